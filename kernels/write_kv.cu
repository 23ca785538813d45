// cuda::WriteKv: one thread block per token, threads over (kv head, dim).

#include <cuda_runtime.h>

#include <cstdint>

#include "common/base/dtype.h"
#include "common/base/float16.h"
#include "kernels/cuda_check.h"
#include "kernels/write_kv.h"

namespace kvcm::kernels::cuda {
namespace {

constexpr int kThreads = 128;

template <DType kDType>
__device__ __forceinline__ void Store(uint8_t* dst, float x) {
  if constexpr (kDType == DType::kFloat32) {
    *reinterpret_cast<float*>(dst) = x;
  } else if constexpr (kDType == DType::kFloat16) {
    *reinterpret_cast<uint16_t*>(dst) = HalfFromFloat(x);
  } else {
    *reinterpret_cast<uint16_t*>(dst) = BFloat16FromFloat(x);
  }
}

template <DType kDType>
__global__ void __launch_bounds__(kThreads)
    WriteKvKernel(PagedKvView view, const float* key, const float* value, const int64_t* slots) {
  constexpr int64_t kBytes = kDType == DType::kFloat32 ? 4 : 2;
  const int64_t token = blockIdx.x;
  const int64_t slot = slots[token];
  if (slot < 0) return;
  // REQUIRES of the contract; a bad slot would write outside the pool, so stop the context.
  if (slot >= int64_t{view.num_blocks} * view.block_size) __trap();
  const int64_t offset =
      (slot / view.block_size) * view.block_stride + (slot % view.block_size) * view.token_stride;
  const int32_t elems = view.num_kv_heads * view.head_dim;
  for (int32_t e = threadIdx.x; e < elems; e += kThreads) {
    const int32_t h = e / view.head_dim;
    const int32_t d = e % view.head_dim;
    const int64_t dst = offset + h * view.head_stride + d * kBytes;
    const int64_t src = token * elems + e;
    Store<kDType>(view.k + dst, key[src]);
    Store<kDType>(view.v + dst, value[src]);
  }
}

}  // namespace

void WriteKv(const PagedKvView& view, const float* key, const float* value, const int64_t* slots,
             int32_t num_tokens, void* stream) {
  if (num_tokens <= 0) return;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (view.dtype) {
    case DType::kFloat32:
      WriteKvKernel<DType::kFloat32><<<num_tokens, kThreads, 0, s>>>(view, key, value, slots);
      break;
    case DType::kFloat16:
      WriteKvKernel<DType::kFloat16><<<num_tokens, kThreads, 0, s>>>(view, key, value, slots);
      break;
    case DType::kBFloat16:
      WriteKvKernel<DType::kBFloat16><<<num_tokens, kThreads, 0, s>>>(view, key, value, slots);
      break;
    case DType::kFloat8E4M3:
    case DType::kFloat8E5M2:
      NoKernelForDType(view.dtype);
  }
  KVCM_CUDA_CHECK(cudaGetLastError());
}

}  // namespace kvcm::kernels::cuda
