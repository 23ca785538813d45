// BlockLedger::CheckInvariants and its passes (block_ledger.h): every count the ledger keeps
// against the blocks, sequences, holds, pins, index and LRU ring it counts.

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/block/block_ledger.h"

namespace kvcm {

namespace {

template <typename... Parts>
absl::Status Broken(const Parts&... parts) {
  return absl::InternalError(absl::StrCat(parts...));
}

}  // namespace

absl::Status BlockLedger::CheckInvariants() const {
  std::vector<int32_t> refs(static_cast<size_t>(options_.num_blocks), 0);
  if (absl::Status s = CheckHolds(&refs); !s.ok()) return s;
  if (absl::Status s = CheckSequences(&refs); !s.ok()) return s;
  StateCounts counts;
  if (absl::Status s = CheckBlocks(refs, &counts); !s.ok()) return s;
  if (absl::Status s = CheckCounts(counts); !s.ok()) return s;
  if (absl::Status s = CheckIndexEntries(counts.indexed); !s.ok()) return s;
  if (absl::Status s = CheckLruRing(counts.cached); !s.ok()) return s;
  return CheckPins();
}

// Reference counts equal the references held by live sequences plus the holds: the holds'.
absl::Status BlockLedger::CheckHolds(std::vector<int32_t>* refs) const {
  const int32_t n = options_.num_blocks;
  int64_t holds = 0;
  for (const auto& [b, count] : holds_) {
    if (b < 0 || b >= n) return Broken("hold on block id ", b, ", out of range");
    if (count == 0) return Broken("block ", b, ": an entry of zero holds");
    // A held block keeps its committed KV findable: it stays indexed or a duplicate
    // (neither is dropped while the block is in use).
    if (!IsIndexed(b) && !IsDuplicate(b)) {
      return Broken("held block ", b, " is neither indexed nor a duplicate");
    }
    (*refs)[static_cast<size_t>(b)] += count;
    holds += count;
  }
  if (holds != holds_total_) return Broken("holds total ", holds_total_, " vs ", holds);
  return absl::OkStatus();
}

// Each live sequence's slot, token counts and block table; its blocks' references.
absl::Status BlockLedger::CheckSequences(std::vector<int32_t>* refs) const {
  const int32_t n = options_.num_blocks;
  std::vector<std::pair<SeqId, int32_t>> live_seqs;
  seq_index_.ForEach([&live_seqs](SeqId id, int32_t slot) { live_seqs.emplace_back(id, slot); });
  int64_t entries = 0;
  for (const auto& [id, slot] : live_seqs) {
    const Sequence& s = slots_[static_cast<size_t>(slot)];
    if (s.id != id) return Broken("slot ", slot, " holds sequence ", s.id, " not ", id);
    if (s.num_tokens < 0 || s.num_committed < 0 || s.num_committed > s.num_tokens) {
      return Broken("sequence ", id, ": tokens ", s.num_tokens, ", committed ", s.num_committed);
    }
    if (static_cast<int32_t>(s.blocks.size()) != BlocksFor(s.num_tokens)) {
      return Broken("sequence ", id, ": ", s.blocks.size(), " blocks for ", s.num_tokens,
                    " tokens");
    }
    if (s.hashes.size() > static_cast<size_t>(s.num_tokens / options_.block_size)) {
      return Broken("sequence ", id, ": hashes for non-full blocks");
    }
    for (size_t i = 0; i < s.blocks.size(); ++i) {
      const BlockId b = s.blocks[i];
      if (b == kNoBlock) {
        if (static_cast<int32_t>(i) >= s.first_live) {
          return Broken("sequence ", id, ": released block ", i, " inside the window");
        }
        continue;
      }
      if (b < 0 || b >= n) return Broken("sequence ", id, ": block id ", b, " out of range");
      ++(*refs)[static_cast<size_t>(b)];
      ++entries;
    }
  }
  if (entries != table_entries_) {
    return Broken("table entries ", table_entries_, " vs ", entries, " in the live tables");
  }
  return absl::OkStatus();
}

// Each block: its reference count, duplicate and index marks, and the one list its state
// puts it on; counts of each state into *counts.
absl::Status BlockLedger::CheckBlocks(const std::vector<int32_t>& refs, StateCounts* counts) const {
  for (BlockId b = 0; b < options_.num_blocks; ++b) {
    if (refs[static_cast<size_t>(b)] != meta_[b].ref) {
      return Broken("block ", b, ": ref count ", meta_[b].ref, " but ",
                    refs[static_cast<size_t>(b)], " references (holds included)");
    }
    if (meta_[b].pins > 0) ++counts->pinned_any;
    if (((meta_[b].flags & kHasDuplicates) != 0) !=
        (IsIndexed(b) && duplicates_.contains(hash_[b]))) {
      return Broken("block ", b, ": its has-duplicates flag disagrees with the duplicates");
    }
    if (IsIndexed(b)) {
      ++counts->indexed;
      if (index_.Find(hash_[b], HashOf()) != b) {
        return Broken("block ", b, ": marked indexed but the index disagrees");
      }
    }
    if (IsDuplicate(b)) {
      if (absl::Status s = CheckDuplicate(b); !s.ok()) return s;
    }
    const bool in_free = free_.Contains(b);
    const bool in_lru = (meta_[b].flags & kInLru) != 0;
    switch (StateOf(b)) {
      case BlockState::kInUse:
        ++counts->in_use;
        if (in_free || in_lru) return Broken("in-use block ", b, " on a free or LRU list");
        break;
      case BlockState::kPinned:
        ++counts->pinned_idle;
        if (!IsIndexed(b)) return Broken("pinned block ", b, " is not in the prefix index");
        if (in_free || in_lru) return Broken("pinned block ", b, " on a free or LRU list");
        break;
      case BlockState::kCached:
        ++counts->cached;
        if (in_free || !in_lru) return Broken("cached block ", b, " not (only) on the LRU");
        break;
      case BlockState::kFree:
        ++counts->free;
        if (!in_free || in_lru) return Broken("free block ", b, " not (only) in the free set");
        break;
    }
  }
  return absl::OkStatus();
}

// A duplicate block is in use, not indexed, its hash indexed in another block, and recorded.
absl::Status BlockLedger::CheckDuplicate(BlockId b) const {
  if (IsIndexed(b) || meta_[b].ref == 0) {
    return Broken("duplicate block ", b, " is indexed or not in use");
  }
  const BlockId holder = index_.Find(hash_[b], HashOf());
  if (holder == kNoBlock || holder == b) {
    return Broken("duplicate block ", b, ": its hash is not indexed in another block");
  }
  auto dup = duplicates_.find(hash_[b]);
  if (dup == duplicates_.end() || std::none_of(dup->second.begin(), dup->second.end(),
                                               [b](const Duplicate& d) { return d.block == b; })) {
    return Broken("duplicate block ", b, " not recorded as one");
  }
  return absl::OkStatus();
}

// The states partition the pool, and the ledger's running counts agree with them.
absl::Status BlockLedger::CheckCounts(const StateCounts& c) const {
  if (c.free + c.in_use + c.cached + c.pinned_idle != options_.num_blocks) {
    return Broken("states do not partition");
  }
  if (c.free != free_.size() || !free_.ConsistentForTest()) {
    return Broken("free set holds ", free_.size(), " but ", c.free, " blocks are free");
  }
  if (c.in_use != in_use_blocks_) return Broken("in-use count ", in_use_blocks_, " vs ", c.in_use);
  if (c.pinned_idle != pinned_idle_blocks_) return Broken("pinned count mismatch");
  if (c.pinned_any != pinned_blocks_total_) return Broken("pinned total mismatch");
  if (c.indexed != index_.size()) return Broken("index size mismatch");
  return absl::OkStatus();
}

// Every entry of the index is a block marked indexed (none stale, none twice).
absl::Status BlockLedger::CheckIndexEntries(int32_t indexed) const {
  const int32_t n = options_.num_blocks;
  int32_t entries = 0;
  bool stale = false;
  index_.ForEach([&](BlockId b) {
    ++entries;
    stale |= b < 0 || b >= n || !IsIndexed(b);
  });
  if (stale || entries != indexed) {
    return Broken("index holds ", entries, " entries, ", indexed, " indexed blocks");
  }
  return absl::OkStatus();
}

// The LRU ring holds exactly one live entry per cached block, and its stamps increase.
absl::Status BlockLedger::CheckLruRing(int32_t cached) const {
  const int32_t n = options_.num_blocks;
  std::vector<uint8_t> seen(static_cast<size_t>(n), 0);
  int32_t live = 0;
  uint32_t last_stamp = 0;
  for (size_t i = lru_front_; i < lru_ring_.size(); ++i) {
    const LruEntry& e = lru_ring_[i];
    if (e.block < 0 || e.block >= n) return Broken("LRU ring holds block id ", e.block);
    if (!LruEntryLive(e)) continue;
    if (seen[static_cast<size_t>(e.block)]++) {
      return Broken("block ", e.block, " twice in the LRU");
    }
    // Stamps wrap at 2^32; live entries span far fewer pushes, so the signed difference
    // orders them.
    if (live > 0 && static_cast<int32_t>(e.stamp - last_stamp) <= 0) {
      return Broken("LRU stamps out of order at ", e.block);
    }
    last_stamp = e.stamp;
    ++live;
  }
  if (live != lru_size_ || live != cached) {
    return Broken("LRU ring has ", live, " live entries, size ", lru_size_, ", cached ", cached);
  }
  return absl::OkStatus();
}

// Pin counts equal the named pins.
absl::Status BlockLedger::CheckPins() const {
  std::vector<int32_t> pins(static_cast<size_t>(options_.num_blocks), 0);
  for (const auto& [name, entry] : pins_) {
    for (BlockId b : entry.blocks) ++pins[static_cast<size_t>(b)];
  }
  for (BlockId b = 0; b < options_.num_blocks; ++b) {
    if (pins[static_cast<size_t>(b)] != meta_[b].pins) {
      return Broken("block ", b, ": pin count mismatch");
    }
  }
  return absl::OkStatus();
}

}  // namespace kvcm
