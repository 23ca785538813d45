#pragma once
// CopyBlocks: carry out copy-on-write orders from the ledger: for each (src, dst) pair,
// copy block src into block dst for every layer, K and V.
//
// REQUIRES: src and dst < layout.num_blocks; no dst appears twice or as a src.

#include <cstdint>

#include "common/memory/pool_layout.h"

namespace kvcm::kernels {

struct BlockCopy {
  int32_t src = 0;
  int32_t dst = 0;
};

namespace cpu {
void CopyBlocks(uint8_t* base, const PoolLayout& layout, const BlockCopy* copies,
                int32_t num_copies);
}  // namespace cpu

namespace cuda {
// `base` and `copies` are device pointers. Asynchronous on `stream`.
void CopyBlocks(uint8_t* base, const PoolLayout& layout, const BlockCopy* copies,
                int32_t num_copies, void* stream);
}  // namespace cuda

}  // namespace kvcm::kernels
