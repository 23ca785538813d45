// cuda::CopyBlocks: one thread block per (copy, layer x K|V), 16-byte words when the
// strides allow it.

#include <cuda_runtime.h>

#include <cstdint>

#include "common/base/check.h"
#include "kernels/copy_blocks.h"
#include "kernels/cuda_check.h"

namespace kvcm::kernels::cuda {
namespace {

constexpr int kThreads = 256;

template <typename Word>
__global__ void __launch_bounds__(kThreads)
    CopyBlocksKernel(uint8_t* base, int64_t layer_stride, int64_t kv_stride, int64_t block_stride,
                     const BlockCopy* copies) {
  const BlockCopy c = copies[blockIdx.x];
  const int64_t layer = blockIdx.y / 2;
  const int64_t kv = blockIdx.y % 2;
  uint8_t* arena = base + layer * layer_stride + kv * kv_stride;
  const Word* src = reinterpret_cast<const Word*>(arena + c.src * block_stride);
  Word* dst = reinterpret_cast<Word*>(arena + c.dst * block_stride);
  const int64_t words = block_stride / static_cast<int64_t>(sizeof(Word));
  for (int64_t i = threadIdx.x; i < words; i += kThreads) dst[i] = src[i];
}

}  // namespace

void CopyBlocks(uint8_t* base, const PoolLayout& layout, const BlockCopy* copies,
                int32_t num_copies, void* stream) {
  if (num_copies <= 0) return;
  KVCM_CHECK(layout.layer_stride > 0 && layout.total_bytes % layout.layer_stride == 0);
  const int64_t num_layers = layout.total_bytes / layout.layer_stride;
  KVCM_CHECK(num_layers * 2 <= 65535) << num_layers << " layers";
  const dim3 grid(static_cast<unsigned>(num_copies), static_cast<unsigned>(num_layers * 2));
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const uintptr_t misalign =
      reinterpret_cast<uintptr_t>(base) | static_cast<uintptr_t>(layout.block_stride) |
      static_cast<uintptr_t>(layout.kv_stride) | static_cast<uintptr_t>(layout.layer_stride);
  if (misalign % 16 == 0) {
    CopyBlocksKernel<uint4><<<grid, kThreads, 0, s>>>(base, layout.layer_stride, layout.kv_stride,
                                                      layout.block_stride, copies);
  } else {
    CopyBlocksKernel<uint8_t><<<grid, kThreads, 0, s>>>(base, layout.layer_stride, layout.kv_stride,
                                                        layout.block_stride, copies);
  }
  KVCM_CUDA_CHECK(cudaGetLastError());
}

}  // namespace kvcm::kernels::cuda
