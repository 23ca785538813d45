// A library to LD_PRELOAD into a process under test that makes its wall clock jump, the
// way an administrator's `date -s` or an NTP step would, without privileges and without
// touching the machine's clock (tests/services/cache_manager/cache_manager_lease_test.cc).
//
// KVCM_TEST_CLOCK_OFFSET_FILE names a file holding a signed number of seconds; every
// CLOCK_REALTIME reading (clock_gettime, gettimeofday, time) is the real one plus that
// offset. The file is read again at most every 10 ms (on CLOCK_MONOTONIC, which stays
// untouched), so a test moves the clock by rewriting the file. A missing or unreadable file
// means no offset.

#include <dlfcn.h>
#include <fcntl.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>

namespace {

using ClockGettime = int (*)(clockid_t, timespec*);

ClockGettime RealClockGettime() {
  static const auto real = reinterpret_cast<ClockGettime>(dlsym(RTLD_NEXT, "clock_gettime"));
  return real;
}

int64_t MonotonicNanos() {
  timespec now{};
  RealClockGettime()(CLOCK_MONOTONIC, &now);
  return int64_t{now.tv_sec} * 1'000'000'000 + now.tv_nsec;
}

std::atomic<int64_t> offset_seconds{0};
std::atomic<int64_t> next_read_nanos{0};

int64_t OffsetSeconds() {
  const int64_t now = MonotonicNanos();
  if (now < next_read_nanos.load(std::memory_order_relaxed)) {
    return offset_seconds.load(std::memory_order_relaxed);
  }
  next_read_nanos.store(now + 10'000'000, std::memory_order_relaxed);
  const char* path = std::getenv("KVCM_TEST_CLOCK_OFFSET_FILE");
  int64_t offset = 0;
  if (path != nullptr) {
    const int fd = ::open(path, O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
      char text[32] = {};
      const ssize_t n = ::read(fd, text, sizeof(text) - 1);
      ::close(fd);
      if (n > 0) offset = std::strtoll(text, nullptr, 10);
    }
  }
  offset_seconds.store(offset, std::memory_order_relaxed);
  return offset;
}

bool IsWallClock(clockid_t clock) {
  return clock == CLOCK_REALTIME || clock == CLOCK_REALTIME_COARSE;
}

}  // namespace

extern "C" {

int clock_gettime(clockid_t clock, timespec* out) {
  const int rc = RealClockGettime()(clock, out);
  if (rc == 0 && IsWallClock(clock)) out->tv_sec += OffsetSeconds();
  return rc;
}

int gettimeofday(timeval* out, void* /*zone*/) {
  timespec now{};
  const int rc = clock_gettime(CLOCK_REALTIME, &now);
  if (rc == 0 && out != nullptr) {
    out->tv_sec = now.tv_sec;
    out->tv_usec = now.tv_nsec / 1000;
  }
  return rc;
}

time_t time(time_t* out) {
  timespec now{};
  clock_gettime(CLOCK_REALTIME, &now);
  if (out != nullptr) *out = now.tv_sec;
  return now.tv_sec;
}

}  // extern "C"
