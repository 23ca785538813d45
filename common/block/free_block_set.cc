#include "common/block/free_block_set.h"

namespace kvcm {

FreeBlockSet::FreeBlockSet(int32_t capacity, bool all_free) : capacity_(capacity) {
  KVCM_CHECK(capacity >= 0) << "capacity " << capacity;
  const size_t num_words = (static_cast<size_t>(capacity) + 63) / 64;
  words_.assign(num_words, 0);
  // The summary gets one extra word whose top bit is always set: PopLowest's scan stops
  // there at the latest, and PopLowest is only called when a real bit exists below it.
  summary_.assign((num_words + 63) / 64 + 1, 0);
  summary_.back() = uint64_t{1} << 63;
  if (all_free) {
    for (int32_t id = 0; id < capacity; ++id) Insert(id);
  }
  hint_ = 0;
}

bool FreeBlockSet::ConsistentForTest() const {
  int64_t count = 0;
  for (size_t w = 0; w < words_.size(); ++w) {
    count += std::popcount(words_[w]);
    const bool summary_bit = (summary_[w >> 6] >> (w & 63)) & 1;
    if (summary_bit != (words_[w] != 0)) return false;
    if (words_[w] != 0 && (w >> 6) < hint_) return false;
  }
  // No bits beyond capacity.
  for (size_t id = static_cast<size_t>(capacity_); id < words_.size() * 64; ++id) {
    if ((words_[id >> 6] >> (id & 63)) & 1) return false;
  }
  return count == size_;
}

}  // namespace kvcm
