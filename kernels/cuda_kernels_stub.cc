// The cuda:: entry points of a build without CUDA: they link, and abort if called.

#include "common/base/check.h"
#include "kernels/copy_blocks.h"
#include "kernels/paged_attention.h"
#include "kernels/paged_kv.h"
#include "kernels/write_kv.h"

namespace kvcm::kernels {

bool CudaKernelsCompiled() { return false; }

namespace cuda {

#define KVCM_NO_CUDA(op) KVCM_CHECK(false) << "kvcm was built without CUDA (" op ")"

void WriteKv(const PagedKvView&, const float*, const float*, const int64_t*, int32_t, void*) {
  KVCM_NO_CUDA("cuda::WriteKv");
}

void PagedAttention(const PagedKvView&, const PagedAttentionBatch&, const float*, float*, void*) {
  KVCM_NO_CUDA("cuda::PagedAttention");
}

void CopyBlocks(uint8_t*, const PoolLayout&, const BlockCopy*, int32_t, void*) {
  KVCM_NO_CUDA("cuda::CopyBlocks");
}

#undef KVCM_NO_CUDA

}  // namespace cuda
}  // namespace kvcm::kernels
