#pragma once

// FreeBlockSet: the set of free block ids of a fixed pool, handing out the lowest id first
// so that allocations form ascending runs (contiguous memory reads faster than scattered).
//
// A two-level bitmap: one bit per block, one summary bit per 64-bit word. PopLowest() and
// Insert() are O(1) plus a scan of summary words that is amortised by a low-water hint;
// the summary has one word per 4,096 blocks, so even a million-block pool scans at most
// 256 words.
//
// Thread safety: none.

#include <bit>
#include <cstdint>
#include <vector>

#include "common/base/check.h"

namespace kvcm {

class FreeBlockSet {
 public:
  FreeBlockSet() = default;
  // All ids in [0, capacity) start free when `all_free`, else none.
  FreeBlockSet(int32_t capacity, bool all_free);

  int32_t capacity() const { return capacity_; }
  int32_t size() const { return size_; }
  bool empty() const { return size_ == 0; }

  bool Contains(int32_t id) const {
    return (words_[static_cast<size_t>(id) >> 6] >> (id & 63)) & 1;
  }

  // REQUIRES: 0 <= id < capacity, !Contains(id).
  void Insert(int32_t id) {
    KVCM_CHECK(id >= 0 && id < capacity_ && !Contains(id)) << "id " << id;
    const size_t w = static_cast<size_t>(id) >> 6;
    if (words_[w] == 0) {
      summary_[w >> 6] |= uint64_t{1} << (w & 63);
      if ((w >> 6) < hint_) hint_ = w >> 6;
    }
    words_[w] |= uint64_t{1} << (id & 63);
    ++size_;
  }

  // Removes and returns the lowest id. REQUIRES: !empty().
  int32_t PopLowest() {
    KVCM_CHECK(size_ > 0) << "PopLowest on an empty set";
    while (summary_[hint_] == 0) ++hint_;
    const size_t w = (hint_ << 6) + static_cast<size_t>(std::countr_zero(summary_[hint_]));
    const int bit = std::countr_zero(words_[w]);
    words_[w] &= words_[w] - 1;
    if (words_[w] == 0) summary_[w >> 6] &= ~(uint64_t{1} << (w & 63));
    --size_;
    return static_cast<int32_t>((w << 6) + static_cast<size_t>(bit));
  }

  // Removes the `n` lowest ids and writes them, ascending, to `out`. Takes whole runs of a
  // word at a time. REQUIRES: 0 <= n <= size().
  void PopLowest(int32_t n, int32_t* out) {
    KVCM_CHECK(n >= 0 && n <= size_) << "PopLowest(" << n << ") from " << size_;
    size_ -= n;
    while (n > 0) {
      while (summary_[hint_] == 0) ++hint_;
      const size_t w = (hint_ << 6) + static_cast<size_t>(std::countr_zero(summary_[hint_]));
      uint64_t bits = words_[w];
      const int32_t base = static_cast<int32_t>(w << 6);
      while (bits != 0 && n > 0) {
        *out++ = base + std::countr_zero(bits);
        bits &= bits - 1;
        --n;
      }
      words_[w] = bits;
      if (bits == 0) summary_[w >> 6] &= ~(uint64_t{1} << (w & 63));
    }
  }

  // Removes a specific id. REQUIRES: Contains(id).
  void Erase(int32_t id) {
    KVCM_CHECK(id >= 0 && id < capacity_ && Contains(id)) << "id " << id;
    const size_t w = static_cast<size_t>(id) >> 6;
    words_[w] &= ~(uint64_t{1} << (id & 63));
    if (words_[w] == 0) summary_[w >> 6] &= ~(uint64_t{1} << (w & 63));
    --size_;
  }

  size_t MemoryBytes() const {
    return (words_.capacity() + summary_.capacity()) * sizeof(uint64_t);
  }

  // Recounts from the bitmaps and checks the summary; for CheckInvariants.
  bool ConsistentForTest() const;

 private:
  int32_t capacity_ = 0;
  int32_t size_ = 0;
  size_t hint_ = 0;  // no summary word below this one is nonzero
  std::vector<uint64_t> words_;
  std::vector<uint64_t> summary_;  // one extra zero-free sentinel word, see constructor
};

}  // namespace kvcm
