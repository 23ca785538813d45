#pragma once
// Shared by the CPU matmul tests (matmul_cpu_test.cc, matmul_int8_test.cc): random weight
// matrices in ggml's layout of a GGUF tensor type.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "common/base/float16.h"
#include "common/gguf/ggml_types.h"
#include "gtest/gtest.h"
#include "tests/support/status_matchers.h"

namespace kvcm::kernels::matmul_test {

// `rows` rows of `cols` random elements of `type`, as ggml lays them out: quantized from
// N(0, 1) floats where Quantize implements the type, else random bytes with the fp16 super-
// block scales set to small random values (every other bit pattern is a valid code).
inline std::vector<std::byte> RandomTensor(GgmlType type, int64_t rows, int64_t cols,
                                           uint32_t seed) {
  std::mt19937 rng(seed);
  const int64_t bytes = TypeBytes(type, rows * cols).value();
  std::vector<std::byte> out(static_cast<size_t>(bytes));
  if (CanQuantize(type)) {
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> values(static_cast<size_t>(rows * cols));
    for (float& v : values) v = normal(rng);
    EXPECT_THAT(Quantize(type, values, out), IsOk());
    return out;
  }
  std::uniform_int_distribution<int> byte(0, 255);
  for (std::byte& b : out) b = static_cast<std::byte>(byte(rng));
  std::uniform_real_distribution<float> scale(0.001f, 0.05f);
  const GgmlTypeTraits traits = GetGgmlTypeTraits(type).value();
  auto set_f16 = [&](int64_t offset) {
    const uint16_t h = HalfFromFloat(scale(rng));
    std::memcpy(out.data() + offset, &h, sizeof(h));
  };
  for (int64_t b = 0; b < bytes / traits.type_size; ++b) {
    const int64_t at = b * traits.type_size;
    if (type == GgmlType::kQ6_K) {
      set_f16(at + 208);
    } else {  // Q4_K, Q5_K: d, dmin
      set_f16(at);
      set_f16(at + 2);
    }
  }
  return out;
}

}  // namespace kvcm::kernels::matmul_test
