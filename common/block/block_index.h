#pragma once

// BlockIndex: the ledger's prefix index, block hash → the block that holds its content.
//
// An open-addressing table (linear probing, deletion by backward shift: no tombstones),
// sized once for the whole pool: a block is indexed for at most one hash, so the table never
// holds more than num_blocks entries and never grows. Each entry is 8 bytes, the low 32 bits
// of the hash's first word (which also place it: its home slot is those bits masked) and the
// block id. The full 32-byte hashes stay with the blocks, with the caller; a lookup
// that finds matching tag bits verifies the full hash there, so a tag collision can never
// return the wrong block.
//
// Why this shape: evictions erase an entry for every block reissued from the cache (millions
// on a busy server); with small entries and no tombstones an erase is a probe of a cache line
// or two, and lookups never degrade as entries come and go. The table has at least eight
// slots per block (at most an eighth full: 4 MiB for 65,536 blocks, 64 bytes per block, next
// to the megabytes of KV a block holds). Its cost is in the ends of the probe and shift
// loops, which a fuller table makes longer and less predictable, more than in its size: on
// the allocation trace of docs/PERFORMANCE.md the ledger alone took 16% less time with eight
// slots per block than with four, and 23% more with two; sixteen were no better than eight.
//
// The hashes are assumed uniformly distributed (SHA-256 or MurmurHash3 digests). A client
// able to choose digests with equal low bits could lengthen probe sequences (never change
// results); with the fast hash every client is trusted anyway (common/block/block_hash.h).
//
// Thread safety: none.

#include <cstddef>
#include <cstdint>
#include <vector>

#include "common/base/check.h"
#include "common/block/block_hash.h"
#include "common/block/linear_probing.h"

namespace kvcm {

class BlockIndex {
 public:
  BlockIndex() = default;
  // An empty index for blocks [0, num_blocks). REQUIRES: 0 < num_blocks <= 2^30.
  explicit BlockIndex(int32_t num_blocks);

  int32_t size() const { return size_; }
  // Slots in the table (a power of two): a slot's index is its entries' tag bits masked.
  size_t capacity() const { return slots_.size(); }
  bool empty() const { return size_ == 0; }

  // The block indexed for `hash`, or -1. `hash_of(b)` returns (a const reference to) the
  // hash block b is indexed for.
  template <typename HashOf>
  int32_t Find(const BlockHash& hash, const HashOf& hash_of) const {
    const uint32_t tag = Tag(hash);
    for (size_t i = tag & mask_;; i = (i + 1) & mask_) {
      const Entry e = slots_[i];
      if (e.block < 0) return -1;
      if (e.tag == tag && hash_of(e.block) == hash) return e.block;
    }
  }

  // Indexes `block` for `hash` unless `hash` is indexed already; returns the block indexed
  // for it afterwards (`block` if it was inserted). REQUIRES: block is not indexed, and
  // hash_of(block) == hash once this returns `block` (the caller stores it before or after).
  template <typename HashOf>
  int32_t Insert(const BlockHash& hash, int32_t block, const HashOf& hash_of) {
    const uint32_t tag = Tag(hash);
    size_t i = tag & mask_;
    for (;; i = (i + 1) & mask_) {
      const Entry e = slots_[i];
      if (e.block < 0) break;
      if (e.tag == tag && hash_of(e.block) == hash) return e.block;
    }
    slots_[i] = Entry{tag, block};
    ++size_;
    return block;
  }

  // Removes the entry of `block`, whose hash has tag `tag` (TagOf). REQUIRES: it is present.
  // Forced inline: the ledger erases once per eviction, in its eviction loop, and a call
  // (which the compiler otherwise makes) was a fifth of the erase's instructions.
  [[gnu::always_inline]] void Erase(uint32_t tag, int32_t block) {
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

  // The bits of a hash an entry keeps: the low 32 bits of its first word.
  static uint32_t TagOf(const BlockHash& hash) { return static_cast<uint32_t>(hash.Prefix64()); }

  // Starts fetching the home slot of a hash with tag `tag`, for an Insert, Find or Erase a
  // little later (the table does not fit the first-level caches).
  void Prefetch(uint32_t tag) const { __builtin_prefetch(&slots_[tag & mask_]); }

  // Calls fn(block) for every indexed block, in table order.
  template <typename Fn>
  void ForEach(Fn&& fn) const {
    for (const Entry& e : slots_) {
      if (e.block >= 0) fn(e.block);
    }
  }

  size_t MemoryBytes() const { return slots_.capacity() * sizeof(Entry); }

 private:
  struct Entry {
    uint32_t tag = 0;
    int32_t block = -1;  // -1: empty slot
  };

  static uint32_t Tag(const BlockHash& hash) { return TagOf(hash); }

  std::vector<Entry> slots_;
  size_t mask_ = 0;
  int32_t size_ = 0;
};

}  // namespace kvcm
