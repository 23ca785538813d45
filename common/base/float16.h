#pragma once
// Conversions between fp32 and the two 16-bit float formats of model weights and the KV
// cache: IEEE 754 binary16 ("F16", torch.float16, GGML_TYPE_F16) and bfloat16 ("BF16",
// torch.bfloat16, GGML_TYPE_BF16), by bit manipulation (no compiler or hardware half type),
// usable from host code and from CUDA device code. The one copy of these conversions: the
// safetensors and GGUF readers, the executors and the kernels' scalar paths all use it (the
// CPU kernels' vector loops use the same formulas, or F16C, eight lanes at a time).
//
//   FloatFromHalf / FloatFromBFloat16: exact (every fp16/bf16 value is an fp32 value);
//     subnormal halves included; a NaN keeps its sign and payload.
//   HalfFromFloat / BFloat16FromFloat: round to nearest, ties to even, as PyTorch does;
//     overflow gives infinity. Bit-identical to CUDA's __float2half_rn and
//     __float2bfloat16_rn for every non-NaN input.
//     NaN: HalfFromFloat gives the canonical quiet NaN (sign | 0x7e00, PyTorch's c10::Half);
//     BFloat16FromFloat keeps the sign and the top payload bits and sets the quiet bit.
//   HalfFromFloatKeepingNanPayload: HalfFromFloat, except that a NaN keeps its sign and top
//     10 payload bits and is made quiet (numpy's astype(float16) and F16C, which gguf's
//     Python writer and ggml on x86 use): GGUF quantization (common/gguf) uses it.
//
// Thread safety: pure functions.

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define KVCM_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define KVCM_HOST_DEVICE inline
#endif

namespace kvcm {
namespace float16_internal {

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

}  // namespace float16_internal

// fp16 bits to fp32. The exponent and mantissa shifted into place give the value times
// 2^-112 for normal and subnormal inputs alike (the multiply by 2^112 is exact); infinities
// and NaNs get the all-ones exponent back.
KVCM_HOST_DEVICE float FloatFromHalf(uint16_t h) {
  using float16_internal::BitsToFloat;
  using float16_internal::FloatBits;
  const uint32_t sign = (uint32_t{h} & 0x8000u) << 16;
  const uint32_t exp_mant = uint32_t{h} & 0x7fffu;
  uint32_t bits = FloatBits(BitsToFloat(exp_mant << 13) * 0x1p112f);
  if (exp_mant >= 0x7c00u) bits |= 0x7f800000u;
  return BitsToFloat(bits | sign);
}

// fp32 to fp16 bits, round to nearest even (F. Giesen's float_to_half_fast3_rtne).
KVCM_HOST_DEVICE uint16_t HalfFromFloat(float f) {
  using float16_internal::BitsToFloat;
  using float16_internal::FloatBits;
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

KVCM_HOST_DEVICE uint16_t HalfFromFloatKeepingNanPayload(float f) {
  const uint32_t u = float16_internal::FloatBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    return static_cast<uint16_t>(((u >> 16) & 0x8000u) | 0x7e00u | ((u >> 13) & 0x3ffu));
  }
  return HalfFromFloat(f);
}

// bf16 bits to fp32: the high half of the fp32 bits.
KVCM_HOST_DEVICE float FloatFromBFloat16(uint16_t b) {
  return float16_internal::BitsToFloat(uint32_t{b} << 16);
}

// fp32 to bf16 bits, round to nearest even.
KVCM_HOST_DEVICE uint16_t BFloat16FromFloat(float f) {
  const uint32_t u = float16_internal::FloatBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

}  // namespace kvcm
