#include "common/block/block_index.h"

#include <bit>

#include "common/base/check.h"

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
  // Backward shift: move each later entry of the probe run into the hole unless its home
  // lies cyclically in (hole, its slot], where it would no longer be found.
  size_t hole = i;
  for (size_t j = (i + 1) & mask_; slots_[j].block >= 0; j = (j + 1) & mask_) {
    const size_t home = slots_[j].tag & mask_;
    const bool stays = hole <= j ? (hole < home && home <= j) : (hole < home || home <= j);
    if (stays) continue;
    slots_[hole] = slots_[j];
    hole = j;
  }
  slots_[hole] = Entry{};
  --size_;
}

}  // namespace kvcm
