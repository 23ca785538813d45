#pragma once
// PagedKvView: how a kernel reaches one layer's keys and values in the pool.
//
// The pool is one arena laid out [layer][K|V][block][token in block][kv head][dim]
// (common/memory/pool_layout.h); the strides come from the pool descriptor, never from
// the code. Element (block b, token t, head h, dim d) of this layer's K is at
//   k + b * block_stride + t * token_stride + h * head_stride + d * elem_bytes
// and likewise for V. A token's slot is b * block_size + t.
//
// Pointers are host pointers for the CPU kernels and device pointers for the CUDA ones.
// Thread safety: a plain value.
//
// Every op in kernels/ has a CPU implementation (namespace cpu, the reference) and a CUDA
// one (namespace cuda) with the same semantics. The cuda:: functions always link; in a
// build without CUDA they CHECK-fail with "kvcm was built without CUDA", so callers ask
// CudaKernelsCompiled() first.

#include <cstdint>

#include "absl/status/statusor.h"
#include "common/base/dtype.h"
#include "common/memory/pool_layout.h"
#include "common/sizing/kv_cache_spec.h"

namespace kvcm::kernels {

// True for the element types the kernels store K/V in: kFloat32, kFloat16, kBFloat16. The
// fp8 values have no kernel; every kernel CHECK-fails on them (LayerView refuses them
// first). Compute is always fp32.
constexpr bool IsKernelDType(DType dtype) {
  return dtype == DType::kFloat32 || dtype == DType::kFloat16 || dtype == DType::kBFloat16;
}

// CHECK-fails naming `dtype`: what a kernel does when given a dtype IsKernelDType refuses.
[[noreturn]] void NoKernelForDType(DType dtype);

struct PagedKvView {
  uint8_t* k = nullptr;           // this layer's K arena (block 0, token 0, head 0, dim 0)
  uint8_t* v = nullptr;           // this layer's V arena
  DType dtype = DType::kFloat32;  // one of IsKernelDType's
  int32_t num_blocks = 0;
  int32_t block_size = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  int64_t block_stride = 0;  // bytes
  int64_t token_stride = 0;  // bytes
  int64_t head_stride = 0;   // bytes
};

// The view of `layer` in a pool at `base` with `layout` and `spec`.
// INVALID_ARGUMENT if the dtype has no kernel (fp8) or the layer is out of range.
// REQUIRES: layout.Validate(spec).ok().
absl::StatusOr<PagedKvView> LayerView(uint8_t* base, const PoolLayout& layout,
                                      const KvCacheSpec& spec, int32_t layer);

// True when this build has the CUDA kernels (KVCM_CUDA_ENABLED); false means every cuda::
// function aborts. Says nothing about whether a device is present.
bool CudaKernelsCompiled();

}  // namespace kvcm::kernels
