#include "common/transport/zmq_util.h"

#include <errno.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/base/monotonic_clock.h"

namespace kvcm {
namespace {

absl::Status ZmqError(const char* what, const zmq::error_t& error) {
  return absl::InternalError(absl::StrCat(what, " failed: ", error.what()));
}

// Milliseconds until `deadline` for zmq_poll: 0 when past, rounded up so that a wait never
// returns before the deadline, capped to an int.
long PollTimeoutMs(absl::Time deadline) {
  if (deadline == absl::InfiniteFuture()) return -1;
  const absl::Duration left = deadline - MonotonicNow();
  if (left <= absl::ZeroDuration()) return 0;
  const int64_t ms = absl::ToInt64Milliseconds(absl::Ceil(left, absl::Milliseconds(1)));
  return static_cast<long>(std::min<int64_t>(ms, 1 << 30));
}

}  // namespace

absl::Status SendMessage(zmq::socket_t& socket, std::span<const std::span<const uint8_t>> frames) {
  try {
    for (size_t i = 0; i < frames.size(); ++i) {
      const zmq::send_flags flags =
          i + 1 < frames.size() ? zmq::send_flags::sndmore : zmq::send_flags::none;
      while (true) {
        try {
          if (!socket.send(zmq::const_buffer(frames[i].data(), frames[i].size()), flags)) {
            // EAGAIN: the send queue stayed full for the socket's ZMQ_SNDTIMEO. (A refused
            // first frame sends nothing; ZeroMQ never refuses a later frame of a message.)
            return absl::ResourceExhaustedError("zmq send queue full");
          }
          break;
        } catch (const zmq::error_t& error) {
          if (error.num() != EINTR) throw;
        }
      }
    }
  } catch (const zmq::error_t& error) {
    return ZmqError("zmq send", error);
  }
  return absl::OkStatus();
}

absl::Status SendFrame(zmq::socket_t& socket, std::span<const uint8_t> frame) {
  const std::span<const uint8_t> frames[] = {frame};
  return SendMessage(socket, frames);
}

absl::StatusOr<bool> WaitReadable(zmq::socket_t& socket, absl::Time deadline) {
  while (true) {
    zmq_pollitem_t item{};
    item.socket = socket.handle();
    item.events = ZMQ_POLLIN;
    const int rc = zmq_poll(&item, 1, PollTimeoutMs(deadline));
    if (rc < 0) {
      if (zmq_errno() == EINTR) continue;
      return absl::InternalError(absl::StrCat("zmq_poll failed: ", zmq_strerror(zmq_errno())));
    }
    if (rc > 0 && (item.revents & ZMQ_POLLIN) != 0) return true;
    if (MonotonicNow() >= deadline) return false;
  }
}

absl::StatusOr<std::vector<zmq::message_t>> ReceiveMessage(zmq::socket_t& socket) {
  std::vector<zmq::message_t> frames;
  try {
    while (true) {
      zmq::message_t frame;
      zmq::recv_result_t got;
      while (true) {
        try {
          got = socket.recv(frame, zmq::recv_flags::dontwait);
          break;
        } catch (const zmq::error_t& error) {
          if (error.num() != EINTR) throw;
        }
      }
      if (!got.has_value()) {
        // Nothing pending. Within a multipart message the remaining frames are always
        // already there (ZeroMQ delivers messages atomically), so this only happens first.
        return frames;
      }
      const bool more = frame.more();
      AlignFrame(frame);
      frames.push_back(std::move(frame));
      if (!more) return frames;
    }
  } catch (const zmq::error_t& error) {
    return ZmqError("zmq recv", error);
  }
}

absl::StatusOr<std::vector<zmq::message_t>> ReceiveMessageUntil(zmq::socket_t& socket,
                                                                absl::Time deadline) {
  while (true) {
    absl::StatusOr<bool> ready = WaitReadable(socket, deadline);
    if (!ready.ok()) return ready.status();
    if (!*ready) return std::vector<zmq::message_t>{};
    absl::StatusOr<std::vector<zmq::message_t>> message = ReceiveMessage(socket);
    // A readable socket can still yield nothing (the event was consumed elsewhere, e.g.
    // by a SUB filter); wait again.
    if (!message.ok() || !message->empty()) return message;
  }
}

absl::Status ConnectAndAwaitHandshake(zmq::context_t& context, zmq::socket_t& socket,
                                      const std::string& endpoint, absl::Time deadline) {
  // One monitor endpoint per socket: the handle's address is unique while it lives.
  const std::string monitor_endpoint = absl::StrCat("inproc://kvcm-handshake-monitor-",
                                                    reinterpret_cast<uintptr_t>(socket.handle()));
  if (zmq_socket_monitor(socket.handle(), monitor_endpoint.c_str(),
                         ZMQ_EVENT_HANDSHAKE_SUCCEEDED) != 0) {
    return absl::InternalError(
        absl::StrCat("zmq_socket_monitor failed: ", zmq_strerror(zmq_errno())));
  }
  absl::Status result = absl::OkStatus();
  // Declared first so that it is closed after the monitor is stopped below.
  zmq::socket_t monitor;
  try {
    monitor = zmq::socket_t(context, zmq::socket_type::pair);
    monitor.set(zmq::sockopt::linger, 0);
    monitor.connect(monitor_endpoint);
    try {
      socket.connect(endpoint);
    } catch (const zmq::error_t& error) {
      result = absl::InvalidArgumentError(
          absl::StrCat("cannot connect to ", endpoint, ": ", error.what()));
    }
    while (result.ok()) {
      absl::StatusOr<std::vector<zmq::message_t>> event = ReceiveMessageUntil(monitor, deadline);
      if (!event.ok()) {
        result = event.status();
      } else if (event->empty()) {
        result = absl::DeadlineExceededError(
            absl::StrCat("no ZeroMQ handshake with ", endpoint, " in time"));
      } else if ((*event)[0].size() >= sizeof(uint16_t)) {
        uint16_t id = 0;
        std::memcpy(&id, (*event)[0].data(), sizeof(id));
        if (id == ZMQ_EVENT_HANDSHAKE_SUCCEEDED) break;
      }
    }
  } catch (const zmq::error_t& error) {
    result = ZmqError("socket monitor", error);
  }
  zmq_socket_monitor(socket.handle(), nullptr, 0);
  return result;
}

absl::Status CheckIpcDirectory(std::string_view endpoint) {
  const std::optional<std::string> path = IpcPath(endpoint);
  if (!path.has_value()) return absl::OkStatus();
  const size_t slash = path->rfind('/');
  const std::string dir = slash == std::string::npos ? "."
                          : slash == 0               ? "/"
                                                     : path->substr(0, slash);
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0) {
    return absl::NotFoundError(absl::StrCat("run directory ", dir, " of ", std::string(endpoint),
                                            ": ", std::strerror(errno)));
  }
  if (st.st_uid != ::geteuid() && st.st_uid != 0) {
    return absl::PermissionDeniedError(absl::StrCat(
        "run directory ", dir, " belongs to uid ", st.st_uid, ", not to this user (uid ",
        ::geteuid(), "): refusing to talk to a cache manager there"));
  }
  if ((st.st_mode & 022) != 0) {
    return absl::PermissionDeniedError(
        absl::StrCat("run directory ", dir, " (mode ", absl::StrFormat("%04o", st.st_mode & 07777),
                     ") can be written by other users, who could replace its sockets: refusing it "
                     "(the cache manager creates it with mode 0700)"));
  }
  return absl::OkStatus();
}

void LimitInboundMessages(zmq::socket_t& socket, size_t max_message_bytes) {
  const uint64_t limit = std::min<uint64_t>(uint64_t{max_message_bytes} * 2, INT64_MAX);
  socket.set(zmq::sockopt::maxmsgsize, static_cast<int64_t>(limit));
}

std::optional<std::string> IpcPath(std::string_view endpoint) {
  constexpr std::string_view kIpc = "ipc://";
  if (endpoint.substr(0, kIpc.size()) != kIpc) return std::nullopt;
  return std::string(endpoint.substr(kIpc.size()));
}

absl::Status ProbeIpcListener(std::string_view endpoint) {
  const std::optional<std::string> path = IpcPath(endpoint);
  if (!path.has_value()) return absl::OkStatus();
  struct stat st {};
  if (::stat(path->c_str(), &st) != 0) {
    const int err = errno;
    if (err == ENOENT) {
      return absl::UnavailableError(absl::StrCat("no socket file at ", *path));
    }
    return absl::UnavailableError(absl::StrCat("cannot stat ", *path, ": ", strerror(err)));
  }
  if (!S_ISSOCK(st.st_mode)) {
    return absl::UnavailableError(absl::StrCat(*path, " is not a socket"));
  }
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  if (path->size() >= sizeof(address.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("socket path ", *path, " is longer than ",
                                                   sizeof(address.sun_path) - 1, " bytes"));
  }
  std::memcpy(address.sun_path, path->data(), path->size());
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    return absl::InternalError(absl::StrCat("socket(AF_UNIX) failed: ", strerror(errno)));
  }
  int rc;
  do {
    rc = ::connect(fd, reinterpret_cast<const sockaddr*>(&address), sizeof(address));
  } while (rc != 0 && errno == EINTR);
  const int err = rc == 0 ? 0 : errno;
  ::close(fd);
  if (err == 0) return absl::OkStatus();
  if (err == ECONNREFUSED) {
    return absl::UnavailableError(
        absl::StrCat("nothing listens on ", *path, " (stale socket file)"));
  }
  if (err == EAGAIN) return absl::OkStatus();  // a listener with a full backlog: alive
  return absl::UnavailableError(absl::StrCat("cannot connect to ", *path, ": ", strerror(err)));
}

}  // namespace kvcm
