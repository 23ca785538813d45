#pragma once
// WriteKv: store the K and V of new tokens into their pool slots (vLLM's
// reshape_and_cache). Slot s is token s % block_size of block s / block_size.
//
//   key, value: [num_tokens][num_kv_heads][head_dim] fp32, contiguous
//   slots:      [num_tokens]; a negative slot skips the token (padding)
//
// Converts to the view's dtype (round to nearest even for fp16/bf16).
// REQUIRES: every non-negative slot < num_blocks * block_size; IsKernelDType(view.dtype) (an
// fp8 view CHECK-fails).

#include <cstdint>

#include "kernels/paged_kv.h"

namespace kvcm::kernels {

namespace cpu {
void WriteKv(const PagedKvView& view, const float* key, const float* value, const int64_t* slots,
             int32_t num_tokens);
}  // namespace cpu

namespace cuda {
// Device pointers; `stream` is a cudaStream_t (nullptr: the default stream). Asynchronous.
void WriteKv(const PagedKvView& view, const float* key, const float* value, const int64_t* slots,
             int32_t num_tokens, void* stream);
}  // namespace cuda

}  // namespace kvcm::kernels
