#include <cstring>

#include "common/base/check.h"
#include "kernels/copy_blocks.h"

namespace kvcm::kernels::cpu {

// Single-threaded memcpy per (copy, layer, K|V): copy-on-write happens for the last,
// partly filled block of a forked sequence, a few blocks per step.
void CopyBlocks(uint8_t* base, const PoolLayout& layout, const BlockCopy* copies,
                int32_t num_copies) {
  if (num_copies <= 0) return;
  KVCM_CHECK(layout.layer_stride > 0 && layout.total_bytes % layout.layer_stride == 0);
  const int64_t num_layers = layout.total_bytes / layout.layer_stride;
  for (int32_t i = 0; i < num_copies; ++i) {
    const BlockCopy& c = copies[i];
    KVCM_CHECK(c.src >= 0 && c.src < layout.num_blocks && c.dst >= 0 && c.dst < layout.num_blocks)
        << "copy " << i << ": " << c.src << " -> " << c.dst << " of " << layout.num_blocks;
    for (int64_t layer = 0; layer < num_layers; ++layer) {
      for (int64_t kv = 0; kv < 2; ++kv) {
        uint8_t* arena = base + layer * layout.layer_stride + kv * layout.kv_stride;
        std::memcpy(arena + c.dst * layout.block_stride, arena + c.src * layout.block_stride,
                    static_cast<size_t>(layout.block_stride));
      }
    }
  }
}

}  // namespace kvcm::kernels::cpu
