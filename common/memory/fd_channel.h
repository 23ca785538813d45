#pragma once

// The Unix-socket side channel that hands the shm pool's memfd to an attaching process
// (docs/architecture.md).
//
// The owner (the cache manager) listens on a socket file in its run directory. A client
// connects; the owner accepts, reads the client's credentials with SO_PEERCRED and, if
// its uid is allowed, sends one message: a small header (the caller's bytes, e.g. a pool
// descriptor) with the descriptor attached as SCM_RIGHTS, then closes the connection. A
// refused client sees the connection closed with nothing sent. The client sends nothing.
//
// Wire format, one direction only (owner -> client), native byte order since both ends
// run on one machine:
//
//   uint32 header_length (<= kMaxFdChannelHeaderBytes) | header bytes
//   with exactly one descriptor in SCM_RIGHTS ancillary data on the first byte.
//
// Thread safety: FdChannelListener is not thread-safe; one thread owns it (in the cache
// manager, the socket thread, which polls listen_fd() with its ZeroMQ sockets).
// ReceiveFdFromChannel is thread-safe.

#include <sys/types.h>

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/base/unique_fd.h"

namespace kvcm {

// Largest header the channel carries.
inline constexpr size_t kMaxFdChannelHeaderBytes = 4096;

// The owner's end: a listening socket that serves one descriptor per connection.
class FdChannelListener {
 public:
  // Listens on `socket_path`: removes a stale socket file left there (a socket nobody
  // listens on; found by trying to connect, which a live owner sees as one refused or
  // served client), binds, makes the file mode 0600 before listening, and listens with a
  // non-blocking socket. Only processes whose uid is in `allowed_uids` are served.
  //
  // The 0600 mode means only the owner's uid (and root) can connect at all; to serve
  // another uid, the deployment must also grant it write access to the socket file (an
  // ACL, for instance). SO_PEERCRED is the check that counts either way.
  //
  // INVALID_ARGUMENT when the path is empty or too long for sockaddr_un, or allowed_uids
  // is empty; ALREADY_EXISTS when a live listener answers on the path; FAILED_PRECONDITION
  // when something other than a socket is there; the errno's code otherwise.
  static absl::StatusOr<FdChannelListener> Create(const std::string& socket_path,
                                                  std::vector<uid_t> allowed_uids);

  FdChannelListener(FdChannelListener&& other) noexcept;
  FdChannelListener& operator=(FdChannelListener&& other) noexcept;
  FdChannelListener(const FdChannelListener&) = delete;
  FdChannelListener& operator=(const FdChannelListener&) = delete;
  // Closes the socket and removes the socket file.
  ~FdChannelListener();

  // The listening descriptor, owned by this object: readable (POLLIN) when a connection
  // is pending. Poll it; never read it.
  int listen_fd() const { return listen_fd_.get(); }
  const std::string& socket_path() const { return socket_path_; }

  // Accepts one pending connection without blocking and serves it: sends `header` with
  // `fd_to_send` attached, then closes the connection. Returns the peer's pid (for logs).
  //
  // UNAVAILABLE when no connection is pending (poll first) or the peer went away before
  // the message was sent; PERMISSION_DENIED "peer uid N is not allowed ..." when the
  // peer's uid is not in the allowed list (the connection is closed, nothing sent);
  // INVALID_ARGUMENT when header exceeds kMaxFdChannelHeaderBytes.
  // REQUIRES: fd_to_send >= 0; it stays owned by the caller.
  absl::StatusOr<pid_t> ServeOne(int fd_to_send, std::span<const uint8_t> header);

 private:
  FdChannelListener(UniqueFd listen_fd, std::string socket_path, std::vector<uid_t> allowed_uids);

  UniqueFd listen_fd_;
  std::string socket_path_;  // empty once moved from: nothing to unlink
  std::vector<uid_t> allowed_uids_;
};

// What a client receives: the descriptor (close-on-exec) and the header sent with it.
struct ReceivedFd {
  UniqueFd fd;
  std::vector<uint8_t> header;
};

// Connects to the listener at `socket_path` and waits up to `timeout` for its message.
// PERMISSION_DENIED when the listening process belongs to another user than this one (and
// is not root): nothing is received from it.
// UNAVAILABLE when nothing listens there, or the connection closed without a descriptor
// (the message says the cache manager may have refused this uid); DEADLINE_EXCEEDED when
// no message came in time; DATA_LOSS for a malformed message (header length over the
// limit, no descriptor, more than one).
absl::StatusOr<ReceivedFd> ReceiveFdFromChannel(const std::string& socket_path,
                                                absl::Duration timeout);

}  // namespace kvcm
