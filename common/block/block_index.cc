#include "common/block/block_index.h"

#include <bit>

#include "common/base/check.h"
#include "common/block/linear_probing.h"

namespace kvcm {

BlockIndex::BlockIndex(int32_t num_blocks) {
  KVCM_CHECK(num_blocks > 0 && num_blocks <= (int32_t{1} << 30)) << "num_blocks " << num_blocks;
  // At least twice the most entries it can hold: a load factor of at most one half keeps
  // linear probes short.
  const size_t capacity = std::bit_ceil(4 * static_cast<size_t>(num_blocks));
  slots_.assign(capacity, Entry{});
  mask_ = capacity - 1;
}

void BlockIndex::Erase(uint32_t tag, int32_t block) {
  size_t i = tag & mask_;
  while (slots_[i].block != block) {
    KVCM_CHECK(slots_[i].block >= 0) << "block " << block << " is not in the index";
    i = (i + 1) & mask_;
  }
  BackwardShiftErase(
      slots_, mask_, i, [](const Entry& e) { return e.block < 0; },
      [this](const Entry& e) { return e.tag & mask_; });
  --size_;
}

}  // namespace kvcm
