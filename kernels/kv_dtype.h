#pragma once
// Scalar conversions between fp32 and the 16-bit storage types of the KV cache, by bit
// manipulation (no compiler or hardware half type needed), usable from host and CUDA code.
//
//   HalfBitsToFloat / BFloat16BitsToFloat: exact (every fp16/bf16 value is an fp32 value).
//   FloatToHalfBits / FloatToBFloat16Bits: round to nearest, ties to even; overflow gives
//     infinity; NaN stays NaN (quiet). Bit-identical to CUDA's __float2half_rn and
//     __float2bfloat16_rn for every non-NaN input.
//
// The CPU kernels' vector loops use the same formulas (or F16C) eight lanes at a time.
// Thread safety: pure functions.

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define KVCM_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define KVCM_HOST_DEVICE inline
#endif

namespace kvcm::kernels {

KVCM_HOST_DEVICE uint32_t FloatBits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

KVCM_HOST_DEVICE float BitsToFloat(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

// fp16 (IEEE binary16) bits to fp32. The exponent and mantissa shifted into place give the
// value times 2^-112 for normal and subnormal inputs alike (the multiply by 2^112 is exact);
// infinities and NaNs get the all-ones exponent back.
KVCM_HOST_DEVICE float HalfBitsToFloat(uint16_t h) {
  const uint32_t sign = (uint32_t{h} & 0x8000u) << 16;
  const uint32_t exp_mant = uint32_t{h} & 0x7fffu;
  uint32_t bits = FloatBits(BitsToFloat(exp_mant << 13) * 0x1p112f);
  if (exp_mant >= 0x7c00u) bits |= 0x7f800000u;
  return BitsToFloat(bits | sign);
}

// fp32 to fp16 bits, round to nearest even (F. Giesen's float_to_half_fast3_rtne).
KVCM_HOST_DEVICE uint16_t FloatToHalfBits(float f) {
  uint32_t u = FloatBits(f);
  const uint32_t sign = u & 0x80000000u;
  u ^= sign;
  uint32_t out;
  if (u >= (127u + 16u) << 23) {  // |f| >= 65536, infinity or NaN
    out = u > 0x7f800000u ? 0x7e00u : 0x7c00u;
  } else if (u < 113u << 23) {  // |f| < 2^-14: the result is subnormal or zero
    // Adding 0.5 puts the 10 mantissa bits of the subnormal at the bottom of the float,
    // rounded to nearest even by the addition itself.
    constexpr uint32_t kDenormMagic = ((127u - 15u) + (23u - 10u) + 1u) << 23;
    out = FloatBits(BitsToFloat(u) + BitsToFloat(kDenormMagic)) - kDenormMagic;
  } else {
    const uint32_t mant_odd = (u >> 13) & 1u;
    u += ((15u - 127u) << 23) + 0xfffu;  // rebias the exponent, round half down...
    u += mant_odd;                       // ...or up when that makes the result even
    out = u >> 13;                       // may carry into infinity: correct overflow
  }
  return static_cast<uint16_t>(out | (sign >> 16));
}

// bf16 bits to fp32: the high half of the fp32 bits.
KVCM_HOST_DEVICE float BFloat16BitsToFloat(uint16_t b) { return BitsToFloat(uint32_t{b} << 16); }

// fp32 to bf16 bits, round to nearest even.
KVCM_HOST_DEVICE uint16_t FloatToBFloat16Bits(float f) {
  const uint32_t u = FloatBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

}  // namespace kvcm::kernels
