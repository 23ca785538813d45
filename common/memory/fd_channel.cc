#include "common/memory/fd_channel.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "common/base/check.h"
#include "common/base/status_macros.h"
#include "common/base/unique_fd.h"

namespace kvcm {
namespace {

using Clock = std::chrono::steady_clock;

// Room for one descriptor of ancillary data, aligned for cmsghdr.
union FdControlBuffer {
  char bytes[CMSG_SPACE(sizeof(int))];
  cmsghdr align;
};

absl::Status ErrnoError(int err, const std::string& what) { return absl::ErrnoToStatus(err, what); }

absl::StatusOr<sockaddr_un> SocketAddress(const std::string& path) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.empty() || path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("fd channel: socket path \"", path,
                                                   "\" must be 1 to ", sizeof(addr.sun_path) - 1,
                                                   " bytes long, got ", path.size()));
  }
  std::memcpy(addr.sun_path, path.data(), path.size());
  return addr;
}

int Connect(int fd, const sockaddr_un& addr) {
  return ::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr));
}

// Removes a socket file nobody listens on. OK when there is nothing at `path`.
absl::Status RemoveStaleSocket(const std::string& path, const sockaddr_un& addr) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return absl::OkStatus();
    return ErrnoError(errno, absl::StrCat("fd channel: lstat ", path));
  }
  if (!S_ISSOCK(st.st_mode)) {
    return absl::FailedPreconditionError(
        absl::StrCat("fd channel: ", path, " exists and is not a socket; not removing it"));
  }
  UniqueFd probe(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!probe.valid()) return ErrnoError(errno, "fd channel: socket");
  // EAGAIN: a live listener with a full backlog.
  if (Connect(probe.get(), addr) == 0 || errno == EAGAIN) {
    return absl::AlreadyExistsError(
        absl::StrCat("fd channel: another process is listening on ", path));
  }
  if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
    return ErrnoError(errno, absl::StrCat("fd channel: removing stale socket ", path));
  }
  return absl::OkStatus();
}

// Sends all of `bytes` on a non-blocking socket, the first chunk with `fd` attached.
absl::Status SendWithFd(int socket_fd, int fd, std::span<const uint8_t> bytes) {
  size_t sent = 0;
  while (sent < bytes.size()) {
    iovec iov{};
    iov.iov_base = const_cast<uint8_t*>(bytes.data() + sent);
    iov.iov_len = bytes.size() - sent;
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    FdControlBuffer control{};
    if (sent == 0) {
      msg.msg_control = control.bytes;
      msg.msg_controllen = sizeof(control.bytes);
      cmsghdr* cmsg = CMSG_FIRSTHDR(&msg);
      cmsg->cmsg_level = SOL_SOCKET;
      cmsg->cmsg_type = SCM_RIGHTS;
      cmsg->cmsg_len = CMSG_LEN(sizeof(int));
      std::memcpy(CMSG_DATA(cmsg), &fd, sizeof(int));
    }
    const ssize_t n = ::sendmsg(socket_fd, &msg, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      // A fresh Unix socket's buffer holds far more than a 4 KiB message, so EAGAIN means
      // a peer that stopped reading; the owner must not block on it.
      return ErrnoError(errno, "fd channel: sendmsg");
    }
    sent += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

}  // namespace

FdChannelListener::FdChannelListener(UniqueFd listen_fd, std::string socket_path,
                                     std::vector<uid_t> allowed_uids)
    : listen_fd_(std::move(listen_fd)),
      socket_path_(std::move(socket_path)),
      allowed_uids_(std::move(allowed_uids)) {}

FdChannelListener::FdChannelListener(FdChannelListener&& other) noexcept
    : listen_fd_(std::move(other.listen_fd_)),
      socket_path_(std::exchange(other.socket_path_, std::string())),
      allowed_uids_(std::move(other.allowed_uids_)) {}

FdChannelListener& FdChannelListener::operator=(FdChannelListener&& other) noexcept {
  if (this != &other) {
    if (!socket_path_.empty()) ::unlink(socket_path_.c_str());
    listen_fd_ = std::move(other.listen_fd_);
    socket_path_ = std::exchange(other.socket_path_, std::string());
    allowed_uids_ = std::move(other.allowed_uids_);
  }
  return *this;
}

FdChannelListener::~FdChannelListener() {
  if (!socket_path_.empty()) ::unlink(socket_path_.c_str());
}

absl::StatusOr<FdChannelListener> FdChannelListener::Create(const std::string& socket_path,
                                                            std::vector<uid_t> allowed_uids) {
  if (allowed_uids.empty()) {
    return absl::InvalidArgumentError(
        "fd channel: allowed_uids is empty, so no process could attach");
  }
  KVCM_ASSIGN_OR_RETURN(const sockaddr_un addr, SocketAddress(socket_path));
  KVCM_RETURN_IF_ERROR(RemoveStaleSocket(socket_path, addr));

  UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!fd.valid()) return ErrnoError(errno, "fd channel: socket");
  if (::bind(fd.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0) {
    return ErrnoError(errno, absl::StrCat("fd channel: bind ", socket_path));
  }
  // From here on the listener owns the socket file and removes it on any failure.
  FdChannelListener listener(std::move(fd), socket_path, std::move(allowed_uids));
  // Before listen(): until then every connect is refused, so there is no window in which
  // the file has the umask's mode and accepts connections.
  if (::chmod(socket_path.c_str(), 0600) != 0) {
    return ErrnoError(errno, absl::StrCat("fd channel: chmod 0600 ", socket_path));
  }
  if (::listen(listener.listen_fd(), SOMAXCONN) != 0) {
    return ErrnoError(errno, absl::StrCat("fd channel: listen on ", socket_path));
  }
  return listener;
}

absl::StatusOr<pid_t> FdChannelListener::ServeOne(int fd_to_send, std::span<const uint8_t> header) {
  KVCM_CHECK(fd_to_send >= 0) << "ServeOne with fd " << fd_to_send;
  if (header.size() > kMaxFdChannelHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrCat("fd channel: header of ", header.size(),
                                                   " bytes exceeds the limit of ",
                                                   kMaxFdChannelHeaderBytes));
  }
  UniqueFd conn(::accept4(listen_fd_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
  if (!conn.valid()) {
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR || errno == ECONNABORTED) {
      return absl::UnavailableError(
          absl::StrCat("fd channel: no pending connection on ", socket_path_));
    }
    return ErrnoError(errno, absl::StrCat("fd channel: accept on ", socket_path_));
  }
  ucred cred{};
  socklen_t cred_len = sizeof(cred);
  if (::getsockopt(conn.get(), SOL_SOCKET, SO_PEERCRED, &cred, &cred_len) != 0) {
    return ErrnoError(errno, "fd channel: SO_PEERCRED");
  }
  if (std::find(allowed_uids_.begin(), allowed_uids_.end(), cred.uid) == allowed_uids_.end()) {
    return absl::PermissionDeniedError(
        absl::StrCat("peer uid ", cred.uid, " is not allowed (pid ", cred.pid, " on ", socket_path_,
                     "; allowed uids: ", absl::StrJoin(allowed_uids_, ", "), ")"));
  }

  std::vector<uint8_t> message(sizeof(uint32_t) + header.size());
  const uint32_t length = static_cast<uint32_t>(header.size());
  std::memcpy(message.data(), &length, sizeof(length));
  if (!header.empty()) {
    std::memcpy(message.data() + sizeof(length), header.data(), header.size());
  }
  if (absl::Status s = SendWithFd(conn.get(), fd_to_send, message); !s.ok()) {
    return absl::UnavailableError(
        absl::StrCat("fd channel: sending to pid ", cred.pid, " failed: ", s.message()));
  }
  return cred.pid;
}

namespace {

// A connection to the channel's server, which must be this user (or root): a socket
// planted by someone else would hand out memory of their choosing.
absl::StatusOr<UniqueFd> ConnectToChannel(const std::string& socket_path) {
  KVCM_ASSIGN_OR_RETURN(const sockaddr_un addr, SocketAddress(socket_path));
  UniqueFd sock(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!sock.valid()) return ErrnoError(errno, "fd channel: socket");
  if (Connect(sock.get(), addr) != 0) {
    return absl::UnavailableError(
        ErrnoError(errno, absl::StrCat("fd channel: nothing accepts connections on ", socket_path,
                                       " (is the cache manager running?)"))
            .message());
  }
  ucred server{};
  socklen_t server_len = sizeof(server);
  if (::getsockopt(sock.get(), SOL_SOCKET, SO_PEERCRED, &server, &server_len) != 0) {
    return ErrnoError(errno, "fd channel: SO_PEERCRED");
  }
  if (server.uid != ::geteuid() && server.uid != 0) {
    return absl::PermissionDeniedError(absl::StrCat(
        "fd channel ", socket_path, " is served by uid ", server.uid, " (pid ", server.pid,
        "), not by this user (uid ", ::geteuid(), "): refusing its descriptor"));
  }

  return sock;
}

// The descriptors `msg` carried into *received: one in all, or DATA_LOSS.
absl::Status TakeDescriptors(msghdr* msg, const std::string& socket_path, UniqueFd* received) {
  for (cmsghdr* cmsg = CMSG_FIRSTHDR(msg); cmsg != nullptr; cmsg = CMSG_NXTHDR(msg, cmsg)) {
    if (cmsg->cmsg_level != SOL_SOCKET || cmsg->cmsg_type != SCM_RIGHTS) continue;
    const size_t count = (cmsg->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < count; ++i) {
      int fd = -1;
      std::memcpy(&fd, CMSG_DATA(cmsg) + i * sizeof(int), sizeof(int));
      UniqueFd owned(fd);
      if (received->valid()) {
        return absl::DataLossError(
            absl::StrCat("fd channel: ", socket_path, " sent more than one descriptor"));
      }
      *received = std::move(owned);
    }
  }
  if ((msg->msg_flags & MSG_CTRUNC) != 0) {
    return absl::DataLossError(
        absl::StrCat("fd channel: ", socket_path, " sent more than one descriptor"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ReceivedFd> ReceiveFdFromChannel(const std::string& socket_path,
                                                absl::Duration timeout) {
  // Clamped so that the steady-clock deadline cannot overflow.
  const Clock::time_point deadline =
      Clock::now() +
      absl::ToChronoNanoseconds(std::clamp(timeout, absl::ZeroDuration(), absl::Hours(24 * 365)));
  KVCM_ASSIGN_OR_RETURN(UniqueFd sock, ConnectToChannel(socket_path));

  uint8_t buffer[sizeof(uint32_t) + kMaxFdChannelHeaderBytes];
  size_t want = sizeof(uint32_t);  // the length first, then the header it announces
  size_t got = 0;
  UniqueFd received;
  while (got < want) {
    const auto remaining = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now());
    if (remaining.count() <= 0) {
      return absl::DeadlineExceededError(
          absl::StrCat("fd channel: no descriptor from ", socket_path, " within ",
                       absl::FormatDuration(timeout), " (", got, " bytes received)"));
    }
    pollfd pfd{sock.get(), POLLIN, 0};
    const int ready =
        ::poll(&pfd, 1, static_cast<int>(std::min<int64_t>(remaining.count(), 1 << 30)));
    if (ready < 0 && errno != EINTR) return ErrnoError(errno, "fd channel: poll");
    if (ready <= 0) continue;

    iovec iov{};
    iov.iov_base = buffer + got;
    iov.iov_len = want - got;
    FdControlBuffer control{};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.bytes;
    msg.msg_controllen = sizeof(control.bytes);
    const ssize_t n = ::recvmsg(sock.get(), &msg, MSG_CMSG_CLOEXEC);
    if (n < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) continue;
      return absl::UnavailableError(
          ErrnoError(errno, absl::StrCat("fd channel: recvmsg from ", socket_path)).message());
    }
    if (absl::Status taken = TakeDescriptors(&msg, socket_path, &received); !taken.ok()) {
      return taken;
    }
    if (n == 0) {
      if (got == 0 && !received.valid()) {
        return absl::UnavailableError(absl::StrCat(
            "fd channel: connection closed without a descriptor: the cache manager refused "
            "this uid? (uid ",
            ::getuid(), ", socket ", socket_path, ")"));
      }
      return absl::UnavailableError(absl::StrCat("fd channel: connection to ", socket_path,
                                                 " closed after ", got, " of ", want, " bytes"));
    }
    got += static_cast<size_t>(n);
    if (got == sizeof(uint32_t) && want == sizeof(uint32_t)) {
      uint32_t length = 0;
      std::memcpy(&length, buffer, sizeof(length));
      if (length > kMaxFdChannelHeaderBytes) {
        return absl::DataLossError(absl::StrCat("fd channel: ", socket_path, " announced a ",
                                                length, "-byte header; the limit is ",
                                                kMaxFdChannelHeaderBytes));
      }
      want += length;
    }
  }
  if (!received.valid()) {
    return absl::DataLossError(
        absl::StrCat("fd channel: the message from ", socket_path, " carried no descriptor"));
  }
  ReceivedFd result;
  result.fd = std::move(received);
  result.header.assign(buffer + sizeof(uint32_t), buffer + want);
  return result;
}

}  // namespace kvcm
