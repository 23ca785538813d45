#pragma once

// KVCM_CHECK: for broken internal invariants only. Peer input and user input never reach
// a CHECK; they get an absl::Status. Abseil 20220623 has no absl/log, hence this shim.
//
//   KVCM_CHECK(ref_count_[b] > 0) << "block " << b;
//
// On failure prints file:line, the condition and the streamed message, then aborts.

#include <cstdio>
#include <cstdlib>
#include <sstream>

namespace kvcm::internal {

class CheckFailure {
 public:
  CheckFailure(const char* file, int line, const char* condition) {
    stream_ << file << ":" << line << ": KVCM_CHECK failed: " << condition << " ";
  }
  CheckFailure(const CheckFailure&) = delete;
  CheckFailure& operator=(const CheckFailure&) = delete;
  [[noreturn]] ~CheckFailure() {
    std::fprintf(stderr, "%s\n", stream_.str().c_str());
    std::fflush(stderr);
    std::abort();
  }
  std::ostream& stream() { return stream_; }

 private:
  std::ostringstream stream_;
};

// Lets `cond ? (void)0 : Voidify() & stream << ...` type-check as void.
struct Voidify {
  void operator&(std::ostream&) {}
};

}  // namespace kvcm::internal

#define KVCM_CHECK(condition)                         \
  (__builtin_expect(static_cast<bool>(condition), 1)) \
      ? (void)0                                       \
      : ::kvcm::internal::Voidify() &                 \
            ::kvcm::internal::CheckFailure(__FILE__, __LINE__, #condition).stream()
