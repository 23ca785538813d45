#pragma once

// Helpers shared by the common/memory tests: a temporary directory, waiting for a
// descriptor with a deadline, and seeded byte patterns.

#include <poll.h>
#include <stdlib.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace kvcm::testing_util {

// A fresh directory under the test temp dir (TEST_TMPDIR / TMPDIR), removed with its
// contents on destruction.
class TempDir {
 public:
  TempDir() {
    std::string templ = ::testing::TempDir() + "kvcm_memory_XXXXXX";
    if (::mkdtemp(templ.data()) == nullptr) {
      ADD_FAILURE() << "mkdtemp(" << templ << "): " << std::strerror(errno);
    }
    path_ = templ;
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }

  const std::string& path() const { return path_; }
  std::string File(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// Waits until `fd` is readable; false after `timeout`.
inline bool WaitReadable(int fd, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (true) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return false;
    pollfd pfd{fd, POLLIN, 0};
    const int ready = ::poll(&pfd, 1, static_cast<int>(left.count()));
    if (ready > 0) return true;
    if (ready < 0 && errno != EINTR) return false;
  }
}

// A random seed, printed so that a failure can be replayed.
inline uint64_t NewSeed(const char* what) {
  const uint64_t seed = (uint64_t{std::random_device{}()} << 32) | std::random_device{}();
  std::cout << what << ": pattern seed " << seed << std::endl;
  return seed;
}

// `bytes` pseudo-random bytes determined by `seed`.
inline std::vector<uint8_t> Pattern(uint64_t seed, size_t bytes) {
  std::mt19937_64 rng(seed);
  std::vector<uint8_t> out(bytes);
  for (size_t i = 0; i < bytes; i += 8) {
    uint64_t word = rng();
    for (size_t j = i; j < bytes && j < i + 8; ++j) {
      out[j] = static_cast<uint8_t>(word);
      word >>= 8;
    }
  }
  return out;
}

}  // namespace kvcm::testing_util
