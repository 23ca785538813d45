#pragma once

// Deletion from an open-addressing table with linear probing, by backward shift: no
// tombstones, so lookups never slow down as entries come and go. Shared by the ledger's
// prefix index (common/block/block_index.h) and its sequence table
// (common/block/sequence_table.h).

#include <cstddef>
#include <vector>

namespace kvcm {

// Empties slot `hole` of `slots` (a power-of-two table, `mask` = size - 1) and moves each
// later entry of its probe run into the hole unless the entry's home slot lies cyclically in
// (hole, its position], where it would no longer be found. `empty(entry)` tells an empty
// slot, `home(entry)` an entry's home slot; `Entry{}` is the empty entry.
template <typename Entry, typename IsEmpty, typename HomeOf>
[[gnu::always_inline]] inline void BackwardShiftErase(std::vector<Entry>& slots, size_t mask,
                                                      size_t hole, const IsEmpty& empty,
                                                      const HomeOf& home) {
  for (size_t j = (hole + 1) & mask; !empty(slots[j]); j = (j + 1) & mask) {
    const size_t h = home(slots[j]);
    const bool stays = hole <= j ? (hole < h && h <= j) : (hole < h || h <= j);
    if (stays) continue;
    slots[hole] = slots[j];
    hole = j;
  }
  slots[hole] = Entry{};
}

}  // namespace kvcm
