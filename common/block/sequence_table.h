#pragma once

// SequenceTable: the ledger's map from a sequence id (chosen by the router: any 64-bit
// value) to the slot holding the sequence.
//
// Every Append and Commit of every decode step looks a sequence up, so this is a plain
// open-addressing table of 16-byte entries (linear probing, Fibonacci hashing of the id,
// deletion by backward shift: no tombstones), kept at most half full and grown by doubling.
// A lookup is a multiply, a shift and usually one compare.
//
// Fibonacci hashing spreads ids that differ only in their high bits or that count up from
// any base; ids chosen to collide (by a client that knows the table size) only lengthen
// probes, never change results, and every client is a router the operator runs.
//
// Thread safety: none.

#include <bit>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "common/base/check.h"
#include "common/block/linear_probing.h"

namespace kvcm {

class SequenceTable {
 public:
  SequenceTable() { Rehash(16); }

  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }

  // The slot of `id`, or -1.
  int32_t Find(uint64_t id) const {
    for (size_t i = Home(id);; i = (i + 1) & mask_) {
      const Entry& e = entries_[i];
      if (e.slot < 0) return -1;
      if (e.id == id) return e.slot;
    }
  }
  bool contains(uint64_t id) const { return Find(id) >= 0; }

  // Maps `id` to `slot`. REQUIRES: id absent, slot >= 0.
  void Insert(uint64_t id, int32_t slot) {
    KVCM_CHECK(slot >= 0) << "slot " << slot;
    if (2 * (size_ + 1) > entries_.size()) Rehash(2 * entries_.size());
    size_t i = Home(id);
    while (entries_[i].slot >= 0) {
      KVCM_CHECK(entries_[i].id != id) << "sequence " << id << " inserted twice";
      i = (i + 1) & mask_;
    }
    entries_[i] = Entry{id, slot};
    ++size_;
  }

  // Removes `id`; false if it was absent.
  bool Erase(uint64_t id);

  // Calls fn(id, slot) for every entry, in table order.
  template <typename Fn>
  void ForEach(Fn&& fn) const {
    for (const Entry& e : entries_) {
      if (e.slot >= 0) fn(e.id, e.slot);
    }
  }

  size_t MemoryBytes() const { return entries_.capacity() * sizeof(Entry); }

 private:
  struct Entry {
    uint64_t id = 0;
    int32_t slot = -1;  // -1: empty
  };

  size_t Home(uint64_t id) const {
    return static_cast<size_t>((id * 0x9E3779B97F4A7C15ULL) >> shift_);
  }
  void Rehash(size_t capacity);

  std::vector<Entry> entries_;
  size_t mask_ = 0;
  int shift_ = 64;
  size_t size_ = 0;
};

inline bool SequenceTable::Erase(uint64_t id) {
  size_t i = Home(id);
  while (true) {
    if (entries_[i].slot < 0) return false;
    if (entries_[i].id == id) break;
    i = (i + 1) & mask_;
  }
  BackwardShiftErase(
      entries_, mask_, i, [](const Entry& e) { return e.slot < 0; },
      [this](const Entry& e) { return Home(e.id); });
  --size_;
  return true;
}

inline void SequenceTable::Rehash(size_t capacity) {
  std::vector<Entry> old = std::move(entries_);
  entries_.assign(capacity, Entry{});
  mask_ = capacity - 1;
  shift_ = 64 - std::countr_zero(capacity);
  size_ = 0;
  for (const Entry& e : old) {
    if (e.slot >= 0) Insert(e.id, e.slot);
  }
}

}  // namespace kvcm
