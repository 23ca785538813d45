// cuda::WriteKv: one thread block per token, threads over (kv head, dim).

#include <cuda_runtime.h>

#include <cstdint>

#include "common/base/float16.h"
#include "kernels/cuda_check.h"
#include "kernels/write_kv.h"

namespace kvcm::kernels::cuda {
namespace {

constexpr int kThreads = 128;

template <KvDType kDType>
__device__ __forceinline__ void Store(uint8_t* dst, float x) {
  if constexpr (kDType == KvDType::kFloat32) {
    *reinterpret_cast<float*>(dst) = x;
  } else if constexpr (kDType == KvDType::kFloat16) {
    *reinterpret_cast<uint16_t*>(dst) = HalfFromFloat(x);
  } else {
    *reinterpret_cast<uint16_t*>(dst) = BFloat16FromFloat(x);
  }
}

template <KvDType kDType>
__global__ void __launch_bounds__(kThreads)
    WriteKvKernel(PagedKvView view, const float* key, const float* value, const int64_t* slots) {
  constexpr int64_t kBytes = kDType == KvDType::kFloat32 ? 4 : 2;
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
    case KvDType::kFloat32:
      WriteKvKernel<KvDType::kFloat32><<<num_tokens, kThreads, 0, s>>>(view, key, value, slots);
      break;
    case KvDType::kFloat16:
      WriteKvKernel<KvDType::kFloat16><<<num_tokens, kThreads, 0, s>>>(view, key, value, slots);
      break;
    case KvDType::kBFloat16:
      WriteKvKernel<KvDType::kBFloat16><<<num_tokens, kThreads, 0, s>>>(view, key, value, slots);
      break;
  }
  KVCM_CUDA_CHECK(cudaGetLastError());
}

}  // namespace kvcm::kernels::cuda
