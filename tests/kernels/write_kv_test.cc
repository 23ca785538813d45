// cpu::WriteKv: values land at the slots' addresses computed from the layout, converted
// with round-to-nearest-even; negative slots and everything else are left alone.
// Also common/base/float16.h against independent conversions.

#include "kernels/write_kv.h"

#include <cmath>
#include <cstring>
#include <iostream>
#include <limits>
#include <random>
#include <vector>

#include "common/base/float16.h"
#include "common/memory/pool_layout.h"
#include "gtest/gtest.h"
#include "kernels/paged_kv.h"
#include "tests/kernels/attention_case.h"
#include "tests/support/status_matchers.h"

namespace kvcm::kernels {
namespace {

using testing_util::DecodeBFloat16Independent;
using testing_util::DecodeHalfIndependent;

// Nearest bf16 to x, ties to even, found by comparing the two neighbours in float64.
uint16_t BFloat16Rne(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  const uint16_t lo = static_cast<uint16_t>(u >> 16);
  const uint16_t hi = static_cast<uint16_t>(lo + 1);
  // Past the largest finite value the next step up is infinity, which rounding treats as
  // the value 2^128 (the exponent's next step).
  auto value = [](uint16_t b) {
    const double v = DecodeBFloat16Independent(b);
    return std::isinf(v) ? std::copysign(std::ldexp(1.0, 128), v) : v;
  };
  const double dlo = std::abs(double{x} - value(lo));
  const double dhi = std::abs(double{x} - value(hi));
  if (dlo < dhi) return lo;
  if (dhi < dlo) return hi;
  return (lo & 1) == 0 ? lo : hi;
}

// Nearest half to x, ties to even, found the same way: the positive halves 0x0000..0x7c00
// increase with their bits, so a binary search finds the two neighbours of |x|, compared
// in float64 (infinity as 2^16, the exponent's next step past 65504). Written without the
// compiler's _Float16, which clang 14 lacks on x86-64.
uint16_t HalfRne(float x) {
  const uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  const double magnitude = std::abs(double{x});
  auto value = [](uint16_t b) {
    const double v = DecodeHalfIndependent(b);
    return std::isinf(v) ? std::ldexp(1.0, 16) : v;
  };
  uint32_t low = 0, high = 0x7c00;  // value(low) <= magnitude, found below
  if (magnitude >= value(0x7c00)) return static_cast<uint16_t>(sign | 0x7c00);
  while (high - low > 1) {
    const uint32_t mid = (low + high) / 2;
    if (value(static_cast<uint16_t>(mid)) <= magnitude) {
      low = mid;
    } else {
      high = mid;
    }
  }
  const uint16_t lo = static_cast<uint16_t>(low);
  const uint16_t hi = static_cast<uint16_t>(low + 1);
  const double dlo = magnitude - value(lo);
  const double dhi = value(hi) - magnitude;
  const uint16_t nearest = dlo < dhi ? lo : dhi < dlo ? hi : (lo & 1) == 0 ? lo : hi;
  return static_cast<uint16_t>(sign | nearest);
}

std::vector<float> InterestingFloats() {
  std::vector<float> v = {0.0f,
                          -0.0f,
                          1.0f,
                          -1.0f,
                          65504.0f,
                          65519.0f,
                          65520.0f,
                          1e6f,
                          -1e6f,
                          6.1035156e-05f,
                          5.9604645e-08f,
                          2.9802322e-08f,
                          2.98e-08f,
                          1e-10f,
                          3.0f / 1024.0f,
                          1.0009765625f,
                          1.00048828125f,
                          1.00146484375f,
                          std::numeric_limits<float>::infinity(),
                          -std::numeric_limits<float>::infinity(),
                          std::numeric_limits<float>::denorm_min(),
                          3.3895314e38f};
  std::mt19937_64 rng(11);
  std::uniform_real_distribution<float> wide(-70000.0f, 70000.0f);
  std::uniform_real_distribution<float> small(-1e-4f, 1e-4f);
  std::uniform_int_distribution<uint32_t> bits;
  for (int i = 0; i < 20000; ++i) {
    v.push_back(wide(rng));
    v.push_back(small(rng));
    uint32_t u = bits(rng);
    if ((u & 0x7f800000u) == 0x7f800000u) u &= 0xbfffffffu;  // no NaN
    float f;
    std::memcpy(&f, &u, sizeof(f));
    v.push_back(f);
  }
  return v;
}

TEST(DTypeConversionTest, HalfDecodesEveryValue) {
  for (uint32_t h = 0; h < 0x10000u; ++h) {
    const double want = DecodeHalfIndependent(static_cast<uint16_t>(h));
    const float got = FloatFromHalf(static_cast<uint16_t>(h));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << h;
    } else {
      ASSERT_EQ(double{got}, want) << "bits " << h;
    }
  }
}

TEST(DTypeConversionTest, BFloat16DecodesEveryValue) {
  for (uint32_t b = 0; b < 0x10000u; ++b) {
    const double want = DecodeBFloat16Independent(static_cast<uint16_t>(b));
    const float got = FloatFromBFloat16(static_cast<uint16_t>(b));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << b;
    } else {
      ASSERT_EQ(double{got}, want) << "bits " << b;
    }
  }
}

TEST(DTypeConversionTest, EncodesRoundToNearestEven) {
  for (float x : InterestingFloats()) {
    ASSERT_EQ(HalfFromFloat(x), HalfRne(x)) << x;
    ASSERT_EQ(BFloat16FromFloat(x), BFloat16Rne(x)) << x;
  }
  const float nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(std::isnan(FloatFromHalf(HalfFromFloat(nan))));
  EXPECT_TRUE(std::isnan(FloatFromBFloat16(BFloat16FromFloat(nan))));
}

class WriteKvTest : public ::testing::TestWithParam<DType> {};

TEST_P(WriteKvTest, RoundTripThroughStrides) {
  const DType dtype = GetParam();
  KvCacheSpec spec;
  spec.num_layers = 3;
  spec.num_kv_heads = 3;
  spec.head_dim = 20;
  spec.block_size = 5;
  spec.dtype = dtype;
  const int32_t num_blocks = 7;
  const absl::StatusOr<PoolLayout> layout = PoolLayout::For(spec, num_blocks);
  ASSERT_THAT(layout, IsOk());
  std::vector<uint8_t> pool(static_cast<size_t>(layout->total_bytes));
  std::mt19937_64 rng(5);
  for (uint8_t& b : pool) b = static_cast<uint8_t>(rng());
  const std::vector<uint8_t> before = pool;

  const int32_t layer = 2;
  const absl::StatusOr<PagedKvView> view = LayerView(pool.data(), *layout, spec, layer);
  ASSERT_THAT(view, IsOk());
  const std::vector<int64_t> slots = {0, 34, -1, 12, 13, -7, 6, 20};
  const int32_t n = static_cast<int32_t>(slots.size());
  const int64_t elems = int64_t{spec.num_kv_heads} * spec.head_dim;
  std::vector<float> key(static_cast<size_t>(n * elems));
  std::vector<float> value(key.size());
  std::uniform_real_distribution<float> uniform(-3.0f, 3.0f);
  for (float& x : key) x = uniform(rng);
  for (float& x : value) x = uniform(rng);
  cpu::WriteKv(*view, key.data(), value.data(), slots.data(), n);

  // Build the expected pool independently: the layout's offsets, the reference rounding.
  std::vector<uint8_t> want = before;
  for (int32_t i = 0; i < n; ++i) {
    if (slots[static_cast<size_t>(i)] < 0) continue;
    const int32_t block = static_cast<int32_t>(slots[static_cast<size_t>(i)] / spec.block_size);
    const int32_t token = static_cast<int32_t>(slots[static_cast<size_t>(i)] % spec.block_size);
    for (int32_t kv = 0; kv < 2; ++kv) {
      const std::vector<float>& src = kv == 0 ? key : value;
      for (int32_t h = 0; h < spec.num_kv_heads; ++h) {
        for (int32_t d = 0; d < spec.head_dim; ++d) {
          const float x = src[static_cast<size_t>(i * elems + h * spec.head_dim + d)];
          uint8_t* dst = want.data() + layout->Offset(layer, kv, block, token, h) +
                         int64_t{d} * layout->elem_bytes;
          if (dtype == DType::kFloat32) {
            std::memcpy(dst, &x, sizeof(x));
          } else {
            const uint16_t bits = dtype == DType::kFloat16 ? HalfRne(x) : BFloat16Rne(x);
            std::memcpy(dst, &bits, sizeof(bits));
          }
        }
      }
    }
  }
  ASSERT_EQ(pool.size(), want.size());
  size_t mismatches = 0;
  for (size_t i = 0; i < pool.size(); ++i) mismatches += pool[i] != want[i];
  EXPECT_EQ(mismatches, 0u) << "bytes differing from the expected pool";
}

// The kernel has no fp8 path: it aborts rather than store another type's bytes.
TEST(WriteKvDeathTest, RefusesFp8) {
  std::vector<uint8_t> pool(64);
  PagedKvView view;
  view.k = pool.data();
  view.v = pool.data() + 32;
  view.dtype = DType::kFloat8E5M2;
  view.num_blocks = 1;
  view.block_size = 1;
  view.num_kv_heads = 1;
  view.head_dim = 4;
  view.block_stride = 4;
  view.token_stride = 4;
  view.head_stride = 4;
  const std::vector<float> key(4, 1.0f);
  const std::vector<float> value(4, 1.0f);
  const int64_t slot = 0;
  EXPECT_DEATH(cpu::WriteKv(view, key.data(), value.data(), &slot, 1),
               "no kernel for KV-cache dtype fp8_e5m2");
}

std::string DtypeName(const ::testing::TestParamInfo<DType>& param) {
  return std::string(DTypeName(param.param));
}

INSTANTIATE_TEST_SUITE_P(Dtypes, WriteKvTest,
                         ::testing::Values(DType::kFloat32, DType::kFloat16, DType::kBFloat16),
                         DtypeName);

}  // namespace
}  // namespace kvcm::kernels
