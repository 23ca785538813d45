#pragma once

// UniqueFd: the sole owner of a POSIX file descriptor, closed when the owner goes away.
//
// Move-only. A default-constructed or released UniqueFd holds -1 and closes nothing.
// close() errors are ignored (on Linux the descriptor is gone even when close fails, so
// there is nothing to retry).
//
// Thread safety: none; like an int, one owner at a time.

#include <unistd.h>

#include <utility>

namespace kvcm {

class UniqueFd {
 public:
  UniqueFd() = default;
  // Takes ownership of `fd` (may be -1).
  explicit UniqueFd(int fd) : fd_(fd) {}

  UniqueFd(UniqueFd&& other) noexcept : fd_(other.release()) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept {
    if (this != &other) reset(other.release());
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;

  ~UniqueFd() { reset(); }

  // The descriptor, still owned by this object; -1 when empty.
  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }

  // Gives up ownership without closing; returns the descriptor (-1 when empty).
  [[nodiscard]] int release() { return std::exchange(fd_, -1); }

  // Closes the held descriptor, if any, and takes ownership of `fd`.
  void reset(int fd = -1) {
    const int old = std::exchange(fd_, fd);
    if (old >= 0 && old != fd) ::close(old);
  }

 private:
  int fd_ = -1;
};

}  // namespace kvcm
