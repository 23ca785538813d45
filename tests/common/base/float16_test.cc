// common/base/float16.h against an independent all-integer reference (the conversion the
// executor used before the copies were merged), every half and bfloat16 pattern and a
// sweep of fp32 patterns, and the two NaN policies of the fp32 -> fp16 narrowing.
#include "common/base/float16.h"

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>

#include "gtest/gtest.h"

namespace kvcm {
namespace {

// Reference widening: the exponent rebiased, subnormals normalized by a loop.
float ReferenceFloatFromHalf(uint16_t half) {
  const uint32_t sign = static_cast<uint32_t>(half & 0x8000u) << 16;
  const uint32_t exponent = (half >> 10) & 0x1fu;
  uint32_t mantissa = half & 0x3ffu;
  uint32_t bits = 0;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + (127 - 15)) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {
    int32_t e = -1;
    do {
      ++e;
      mantissa <<= 1;
    } while ((mantissa & 0x400u) == 0);
    bits = sign | (static_cast<uint32_t>(127 - 15 - e) << 23) | ((mantissa & 0x3ffu) << 13);
  }
  return std::bit_cast<float>(bits);
}

// Reference narrowing: integer rounding of the dropped bits, ties to even; NaN canonical.
uint16_t ReferenceHalfFromFloat(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t abs = bits & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);
  if (abs < 0x38800000u) {
    if (abs < 0x33000000u) return sign;
    const uint32_t exponent = abs >> 23;
    const uint32_t mantissa = (abs & 0x7fffffu) | 0x800000u;
    const uint32_t total_shift = 126 - exponent;
    const uint32_t halfway = 1u << (total_shift - 1);
    uint32_t result = mantissa >> total_shift;
    const uint32_t remainder = mantissa & ((1u << total_shift) - 1);
    if (remainder > halfway || (remainder == halfway && (result & 1u))) ++result;
    return static_cast<uint16_t>(sign | result);
  }
  uint32_t result = ((abs >> 13) - ((127 - 15) << 10));
  const uint32_t remainder = abs & 0x1fffu;
  if (remainder > 0x1000u || (remainder == 0x1000u && (result & 1u))) ++result;
  return static_cast<uint16_t>(sign | result);
}

uint16_t ReferenceBFloat16FromFloat(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  const uint64_t rounded = uint64_t{bits} + 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(rounded >> 16);
}

TEST(Float16Test, EveryHalfWidensAsTheReference) {
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    const float got = FloatFromHalf(static_cast<uint16_t>(h));
    // Bitwise, NaN payloads included.
    ASSERT_EQ(std::bit_cast<uint32_t>(got),
              std::bit_cast<uint32_t>(ReferenceFloatFromHalf(static_cast<uint16_t>(h))))
        << std::hex << h;
  }
}

TEST(Float16Test, EveryBFloat16WidensToTheHighHalf) {
  for (uint32_t b = 0; b <= 0xffff; ++b) {
    ASSERT_EQ(std::bit_cast<uint32_t>(FloatFromBFloat16(static_cast<uint16_t>(b))), b << 16);
  }
}

TEST(Float16Test, NarrowingMatchesTheReferenceOnASweepOfFloats) {
  // A stride that is odd and not a power of two visits every exponent, sign and many
  // mantissa low bits; the halfway points of both formats are checked below.
  for (uint64_t u = 0; u <= 0xffffffffu; u += 65521) {
    const float f = std::bit_cast<float>(static_cast<uint32_t>(u));
    ASSERT_EQ(HalfFromFloat(f), ReferenceHalfFromFloat(f)) << std::hex << u;
    ASSERT_EQ(BFloat16FromFloat(f), ReferenceBFloat16FromFloat(f)) << std::hex << u;
  }
  for (uint32_t h = 0; h < 0x7c00; ++h) {  // every finite half, its midpoints and neighbours
    const uint32_t bits = std::bit_cast<uint32_t>(ReferenceFloatFromHalf(static_cast<uint16_t>(h)));
    for (uint32_t sign : {0u, 0x80000000u}) {
      for (uint32_t delta : {0u, 1u, 0xfffu, 0x1000u, 0x1001u}) {
        const float f = std::bit_cast<float>((bits + delta) | sign);
        ASSERT_EQ(HalfFromFloat(f), ReferenceHalfFromFloat(f)) << std::hex << h << "+" << delta;
      }
    }
  }
  for (uint32_t b = 0; b < 0x7f80; ++b) {
    for (uint32_t delta : {0u, 1u, 0x7fffu, 0x8000u, 0x8001u}) {
      const float f = std::bit_cast<float>((b << 16) + delta);
      ASSERT_EQ(BFloat16FromFloat(f), ReferenceBFloat16FromFloat(f)) << std::hex << b;
    }
  }
}

TEST(Float16Test, EveryHalfRoundTripsThroughFloat) {
  for (uint32_t bits = 0; bits <= 0xffff; ++bits) {
    const uint16_t half = static_cast<uint16_t>(bits);
    const float f = FloatFromHalf(half);
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(FloatFromHalf(HalfFromFloat(f))));
      continue;
    }
    ASSERT_EQ(HalfFromFloat(f), half) << std::hex << bits;
    ASSERT_EQ(HalfFromFloatKeepingNanPayload(f), half) << std::hex << bits;
    ASSERT_EQ(BFloat16FromFloat(FloatFromBFloat16(half)), half) << std::hex << bits;
  }
}

TEST(Float16Test, HalfKnownValuesAndRounding) {
  EXPECT_EQ(FloatFromHalf(0x3c00), 1.0f);
  EXPECT_EQ(FloatFromHalf(0xc000), -2.0f);
  EXPECT_EQ(FloatFromHalf(0x7bff), 65504.0f);
  EXPECT_EQ(FloatFromHalf(0x0001), std::ldexp(1.0f, -24));  // smallest subnormal
  EXPECT_EQ(HalfFromFloat(65520.0f), 0x7c00);               // ties up to infinity
  EXPECT_EQ(HalfFromFloat(65519.0f), 0x7bff);
  EXPECT_EQ(HalfFromFloat(1.0f + std::ldexp(1.0f, -11)), 0x3c00);      // tie to even (down)
  EXPECT_EQ(HalfFromFloat(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);  // tie to even (up)
  EXPECT_EQ(HalfFromFloat(std::ldexp(1.0f, -25)), 0x0000);             // tie to even zero
  EXPECT_EQ(HalfFromFloat(std::ldexp(1.5f, -25)), 0x0001);
  EXPECT_EQ(HalfFromFloat(-0.0f), 0x8000);
  EXPECT_EQ(HalfFromFloat(-INFINITY), 0xfc00);
}

TEST(Float16Test, BFloat16RoundsToNearestEven) {
  EXPECT_EQ(FloatFromBFloat16(0x3f80), 1.0f);
  EXPECT_EQ(BFloat16FromFloat(1.0f), 0x3f80);
  EXPECT_EQ(BFloat16FromFloat(1.0f + std::ldexp(1.0f, -8)), 0x3f80);      // tie, even down
  EXPECT_EQ(BFloat16FromFloat(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);  // tie, even up
  EXPECT_EQ(BFloat16FromFloat(1.0f + std::ldexp(1.0f, -7)), 0x3f81);      // exact
  EXPECT_EQ(BFloat16FromFloat(INFINITY), 0x7f80);
  EXPECT_EQ(BFloat16FromFloat(std::numeric_limits<float>::max()), 0x7f80);  // rounds to inf
}

// The copies merged here differed only in what fp32 -> fp16 does with a NaN: the executor's
// and the KV cache's gave the canonical quiet NaN (PyTorch's behaviour, kept as
// HalfFromFloat); GGUF quantization kept the payload's top bits (numpy's and F16C's, kept as
// HalfFromFloatKeepingNanPayload so GGUF files stay bitwise what gguf's Python writes).
TEST(Float16Test, NanPolicies) {
  const float quiet_payload = std::bit_cast<float>(0xffc02000u);  // -NaN, payload bit 13
  const float signalling = std::bit_cast<float>(0x7f802000u);     // +sNaN, payload bit 13
  EXPECT_EQ(HalfFromFloat(quiet_payload), 0xfe00);
  EXPECT_EQ(HalfFromFloat(signalling), 0x7e00);
  EXPECT_EQ(HalfFromFloatKeepingNanPayload(quiet_payload), 0xfe01);
  EXPECT_EQ(HalfFromFloatKeepingNanPayload(signalling), 0x7e01);
  EXPECT_EQ(BFloat16FromFloat(std::bit_cast<float>(0x7f810000u)), 0x7fc1);  // made quiet
  EXPECT_EQ(BFloat16FromFloat(std::bit_cast<float>(0xffc00001u)), 0xffc0);
  // Widening keeps sign and payload and does not quiet.
  EXPECT_EQ(std::bit_cast<uint32_t>(FloatFromHalf(0x7c01)), 0x7f802000u);
  EXPECT_EQ(std::bit_cast<uint32_t>(FloatFromHalf(0xfe00)), 0xffc00000u);
  EXPECT_EQ(std::bit_cast<uint32_t>(FloatFromBFloat16(0x7f81)), 0x7f810000u);
}

}  // namespace
}  // namespace kvcm
