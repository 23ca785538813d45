#pragma once
// Definitions shared by the two files of the CPU matmul, matmul_cpu.cc and
// matmul_int8_cpu.cc, and included only by them: the geometry of a WeightMatrix panel, the
// unrolling pragma of the register tiles and the target pragmas of the per-ISA inner loops.
// Not a public header.

#include <cstdint>

#include "kernels/matmul_cpu.h"

// Full unrolling of the register tiles' loops, so their accumulators live in registers.
#if defined(__clang__)
#define KVCM_UNROLL _Pragma("clang loop unroll(full)")
#else
#define KVCM_UNROLL _Pragma("GCC unroll 16")
#endif

// KVCM_TARGET_BEGIN("avx2,fma,f16c") ... KVCM_TARGET_END compiles the functions between them
// for those extensions: a target attribute on each (clang) or a target pragma (GCC).
// KVCM_AVX512_TARGET_BEGIN(targets) ... KVCM_AVX512_TARGET_END does the same for AVX-512
// code; for GCC it also ignores -Wmaybe-uninitialized, as GCC 12's AVX-512 intrinsics start
// from _mm512_undefined_*(), a self-initialised variable, which it reports once inlined.
#define KVCM_PRAGMA(...) _Pragma(#__VA_ARGS__)
#if defined(__clang__)
#define KVCM_TARGET_BEGIN(targets) \
  KVCM_PRAGMA(clang attribute push(__attribute__((target(targets))), apply_to = function))
#define KVCM_TARGET_END KVCM_PRAGMA(clang attribute pop)
#define KVCM_AVX512_TARGET_BEGIN(targets) KVCM_TARGET_BEGIN(targets)
#define KVCM_AVX512_TARGET_END KVCM_TARGET_END
#else
#define KVCM_TARGET_BEGIN(targets) KVCM_PRAGMA(GCC push_options) KVCM_PRAGMA(GCC target(targets))
#define KVCM_TARGET_END KVCM_PRAGMA(GCC pop_options)
#define KVCM_AVX512_TARGET_BEGIN(targets) \
  KVCM_TARGET_BEGIN(targets)              \
  KVCM_PRAGMA(GCC diagnostic push) KVCM_PRAGMA(GCC diagnostic ignored "-Wmaybe-uninitialized")
#define KVCM_AVX512_TARGET_END KVCM_PRAGMA(GCC diagnostic pop) KVCM_TARGET_END
#endif

namespace kvcm::kernels::matmul_internal {

// Rows of W per panel: the lanes of one group's scales, biases and codes.
inline constexpr int64_t kLanes = WeightMatrix::kPanelRows;
// Bytes of a group's scales and biases (kLanes floats each), which precede its codes.
inline constexpr int64_t kScaleBytes = 2 * kLanes * static_cast<int64_t>(sizeof(float));

}  // namespace kvcm::kernels::matmul_internal
