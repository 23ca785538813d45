#pragma once

// Overflow-checked int64 arithmetic for the sizing code. Internal to kvcm_sizing.

#include <cstdint>
#include <optional>

namespace kvcm::sizing_internal {

// a x b, or nullopt when the product does not fit in an int64.
inline std::optional<int64_t> CheckedMul(int64_t a, int64_t b) {
  int64_t product = 0;
  if (__builtin_mul_overflow(a, b, &product)) return std::nullopt;
  return product;
}

// a + b, or nullopt when the sum does not fit in an int64.
inline std::optional<int64_t> CheckedAdd(int64_t a, int64_t b) {
  int64_t sum = 0;
  if (__builtin_add_overflow(a, b, &sum)) return std::nullopt;
  return sum;
}

}  // namespace kvcm::sizing_internal
