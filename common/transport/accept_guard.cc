#include "common/transport/accept_guard.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "common/base/mutex.h"

namespace kvcm {
namespace {

Mutex reserve_mutex;
int reserve_fd ABSL_GUARDED_BY(reserve_mutex) = -1;
std::atomic<bool> installed{false};
std::atomic<uint64_t> dropped{0};

int RawAccept4(int listener, sockaddr* address, socklen_t* length, int flags) {
  return static_cast<int>(::syscall(SYS_accept4, listener, address, length, flags));
}

int OpenReserve() { return ::open("/dev/null", O_RDONLY | O_CLOEXEC); }

// The accept that both interposed functions run.
int GuardedAccept(int listener, sockaddr* address, socklen_t* length, int flags) {
  const int accepted = RawAccept4(listener, address, length, flags);
  if (accepted >= 0 || (errno != EMFILE && errno != ENFILE) || !installed.load()) {
    return accepted;
  }
  {
    MutexLock lock(&reserve_mutex);
    if (reserve_fd >= 0) {
      ::close(reserve_fd);
      reserve_fd = -1;
      const int shed = RawAccept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
      if (shed >= 0) {
        ::close(shed);
        dropped.fetch_add(1);
      }
      reserve_fd = OpenReserve();  // -1 until a descriptor is free: the next call tries again
    } else {
      reserve_fd = OpenReserve();
    }
  }
  errno = ECONNABORTED;
  return -1;
}

}  // namespace

absl::Status InstallAcceptGuard() {
  MutexLock lock(&reserve_mutex);
  if (reserve_fd < 0) reserve_fd = OpenReserve();
  if (reserve_fd < 0) {
    return absl::InternalError(
        absl::StrCat("opening /dev/null for the accept reserve: errno ", errno));
  }
  installed.store(true);
  return absl::OkStatus();
}

uint64_t ConnectionsDroppedAtDescriptorLimit() { return dropped.load(); }

}  // namespace kvcm

// The interposed definitions (see the header). Without InstallAcceptGuard() they are the
// plain system calls.
extern "C" int accept4(int listener, sockaddr* address, socklen_t* length, int flags) {
  return kvcm::GuardedAccept(listener, address, length, flags);
}

extern "C" int accept(int listener, sockaddr* address, socklen_t* length) {
  return kvcm::GuardedAccept(listener, address, length, 0);
}
