#include "common/block/block_ledger.h"

#include <algorithm>
#include <array>
#include <bit>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/base/check.h"
#include "common/base/status_macros.h"

namespace kvcm {

std::string_view BlockStateName(BlockState state) {
  switch (state) {
    case BlockState::kFree:
      return "free";
    case BlockState::kInUse:
      return "in_use";
    case BlockState::kCached:
      return "cached";
    case BlockState::kPinned:
      return "pinned";
  }
  return "unknown";
}

absl::StatusOr<BlockLedger> BlockLedger::Create(const Options& options) {
  if (absl::Status checked = CheckOptions(options); !checked.ok()) return checked;
  return BlockLedger(options);
}

absl::Status BlockLedger::CheckOptions(const Options& options) {
  if (options.num_blocks <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_blocks must be positive, got ", options.num_blocks));
  }
  if (options.block_size <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("block_size must be positive, got ", options.block_size));
  }
  if (int64_t{options.num_blocks} * options.block_size > int64_t{INT32_MAX}) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_blocks × block_size = ", int64_t{options.num_blocks} * options.block_size,
                     " tokens does not fit a 32-bit token count"));
  }
  if (options.sliding_window_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("sliding_window_tokens must be >= 0 (0 = full attention), got ",
                     options.sliding_window_tokens));
  }
  if (options.max_pinned_blocks < 0 || options.max_pinned_blocks > options.num_blocks) {
    return absl::InvalidArgumentError(absl::StrCat("max_pinned_blocks must be in [0, ",
                                                   options.num_blocks, "], got ",
                                                   options.max_pinned_blocks));
  }
  return absl::OkStatus();
}

BlockLedger::BlockLedger(const Options& options) : options_(options) {
  if (std::has_single_bit(static_cast<uint32_t>(options_.block_size))) {
    block_shift_ = std::countr_zero(static_cast<uint32_t>(options_.block_size));
  }
  const int32_t n = options_.num_blocks;
  if (options_.max_pinned_blocks == 0) options_.max_pinned_blocks = n / 2;
  meta_.assign(static_cast<size_t>(n), BlockMeta{});
  hash_.resize(static_cast<size_t>(n));
  index_ = BlockIndex(n);
  free_ = FreeBlockSet(n, /*all_free=*/true);
  counters_.num_blocks = n;
  counters_.block_size = options_.block_size;
}

// --- Lookup helpers ------------------------------------------------------------------------

const BlockLedger::Sequence* BlockLedger::FindSeq(SeqId seq) const {
  const int32_t slot = seq_index_.Find(seq);
  return slot < 0 ? nullptr : &slots_[static_cast<size_t>(slot)];
}

BlockLedger::Sequence* BlockLedger::FindSeq(SeqId seq) {
  const int32_t slot = seq_index_.Find(seq);
  return slot < 0 ? nullptr : &slots_[static_cast<size_t>(slot)];
}

absl::Status BlockLedger::NotFound(SeqId seq) const {
  return absl::NotFoundError(
      absl::StrCat("unknown sequence ", seq, " (never allocated, or already freed)"));
}

int32_t BlockLedger::AcquireSlot() {
  if (!free_slots_.empty()) {
    const int32_t slot = free_slots_.back();
    free_slots_.pop_back();
    return slot;
  }
  slots_.emplace_back();
  return static_cast<int32_t>(slots_.size() - 1);
}

void BlockLedger::ReleaseSlot(int32_t slot) {
  Sequence& s = slots_[slot];
  s.blocks.clear();
  s.hashes.clear();
  free_slots_.push_back(slot);
}

// --- Block moves -------------------------------------------------------------------------

inline void BlockLedger::LruPushBack(BlockId block) {
  BlockMeta& m = meta_[block];
  m.flags |= kInLru;
  m.lru_stamp = ++lru_clock_;
  lru_ring_.push_back({block, m.lru_stamp});
  ++lru_size_;
}

inline void BlockLedger::LruRemove(BlockId block) {
  BlockMeta& m = meta_[block];
  KVCM_CHECK(m.flags & kInLru) << "block " << block << " not in the LRU list";
  m.flags &= ~kInLru;  // its ring entry goes stale, skipped when it reaches the front
  --lru_size_;
  // Stale entries are at most as many as live ones (plus slack): dropping them is linear
  // in the ring, and happens only after as many removals, so O(1) amortised.
  if (lru_ring_.size() - lru_front_ > 2 * static_cast<size_t>(lru_size_) + 1024) CompactLru();
}

void BlockLedger::CompactLru() {
  size_t out = 0;
  for (size_t i = lru_front_; i < lru_ring_.size(); ++i) {
    if (LruEntryLive(lru_ring_[i])) lru_ring_[out++] = lru_ring_[i];
  }
  lru_ring_.resize(out);
  lru_front_ = 0;
}

inline void BlockLedger::Unindex(BlockId block) {
  BlockMeta& m = meta_[block];
  KVCM_CHECK(m.flags & kIndexed) << "block " << block;
  index_.Erase(m.tag, block);  // by tag and id: the full hash is not read
  const bool has_duplicates = (m.flags & kHasDuplicates) != 0;
  m.flags &= ~(kIndexed | kHasDuplicates);
  if (options_.record_events || has_duplicates) [[unlikely]] {
    UnindexedWithEventsOrDuplicates(block, has_duplicates);
  }
}

void BlockLedger::UnindexedWithEventsOrDuplicates(BlockId block, bool has_duplicates) {
  const BlockHash hash = hash_[block];
  if (options_.record_events) {
    events_.push_back({BlockEvent::Kind::kRemoved, hash, BlockHash{}, false, block});
  }
  if (!has_duplicates) return;
  // A duplicate still in use takes its place: the content stays matchable.
  auto dup = duplicates_.find(hash);
  KVCM_CHECK(dup != duplicates_.end()) << "block " << block << " has no recorded duplicates";
  const Duplicate next = dup->second.back();
  dup->second.pop_back();
  uint8_t more = kHasDuplicates;
  if (dup->second.empty()) {
    duplicates_.erase(dup);
    more = 0;
  }
  KVCM_CHECK(meta_[next.block].ref > 0) << "duplicate block " << next.block << " is not in use";
  meta_[next.block].flags &= ~kDuplicate;
  meta_[next.block].flags |= kIndexed | more;
  index_.Insert(hash, next.block, HashOf());
  if (options_.record_events) {
    events_.push_back({BlockEvent::Kind::kStored, hash, next.parent, next.has_parent, next.block});
  }
}

void BlockLedger::DropDuplicate(BlockId block) {
  auto dup = duplicates_.find(hash_[block]);
  KVCM_CHECK(dup != duplicates_.end()) << "duplicate block " << block << " not recorded";
  std::erase_if(dup->second, [block](const Duplicate& d) { return d.block == block; });
  if (dup->second.empty()) {
    duplicates_.erase(dup);
    const BlockId holder = index_.Find(hash_[block], HashOf());
    KVCM_CHECK(holder != kNoBlock) << "duplicate block " << block << " of an unindexed hash";
    meta_[holder].flags &= ~kHasDuplicates;
  }
  meta_[block].flags &= ~kDuplicate;
}

inline BlockId BlockLedger::PopLruHead() {
  // The front of the ring, past stale entries. Looking a few entries ahead, the next
  // victims' metadata is fetched while this one is handled (their ids are known: no
  // pointer chasing).
  // Two stages: the metadata of the victim kAhead entries on, and the index slot of the
  // one kAhead / 2 on (its tag is in its metadata, fetched by then).
  constexpr size_t kAhead = 8;
  while (!LruEntryLive(lru_ring_[lru_front_])) ++lru_front_;
  const BlockId block = lru_ring_[lru_front_++].block;
  if (lru_front_ + kAhead < lru_ring_.size()) {
    __builtin_prefetch(&meta_[lru_ring_[lru_front_ + kAhead].block]);
    index_.Prefetch(meta_[lru_ring_[lru_front_ + kAhead / 2].block].tag);
  }
  meta_[block].flags &= ~kInLru;
  Unindex(block);
  return block;
}

void BlockLedger::TrimLruRing() {
  if (lru_front_ > lru_ring_.size() / 2 && lru_front_ >= 4096) {
    // Drop the consumed prefix (amortised O(1): it is at least half the ring).
    lru_ring_.erase(lru_ring_.begin(), lru_ring_.begin() + static_cast<ptrdiff_t>(lru_front_));
    lru_front_ = 0;
  }
}

BlockId BlockLedger::EvictLruHead() {
  const BlockId block = PopLruHead();
  --lru_size_;
  ++counters_.evictions;
  TrimLruRing();
  return block;
}

BlockId BlockLedger::TakeBlock() {
  BlockId block;
  if (!free_.empty()) {
    block = free_.PopLowest();
  } else {
    KVCM_CHECK(lru_size_ > 0) << "TakeBlock with no free or cached block";
    block = EvictLruHead();
  }
  KVCM_CHECK(meta_[block].ref == 0 && meta_[block].pins == 0) << "block " << block;
  meta_[block].ref = 1;
  ++in_use_blocks_;
  ++counters_.blocks_allocated;
  return block;
}

void BlockLedger::TakeBlocks(int32_t n, std::vector<BlockId>* out) {
  if (n == 0) return;
  const int32_t from_free = std::min(n, free_.size());
  const size_t at = out->size();
  out->resize(at + static_cast<size_t>(n));
  BlockId* ids = out->data() + at;
  free_.PopLowest(from_free, ids);
  BlockMeta* meta = meta_.data();
  for (int32_t i = 0; i < from_free; ++i) meta[ids[i]].ref = 1;
  // The rest evicted in one loop, EvictLruHead's steps inlined, counts added once.
  const int32_t evicted = n - from_free;
  KVCM_CHECK(evicted <= lru_size_) << "TakeBlocks(" << n << ") with " << from_free << " free and "
                                   << lru_size_ << " cached blocks";
  for (int32_t i = from_free; i < n; ++i) {
    const BlockId block = PopLruHead();
    KVCM_CHECK(meta[block].ref == 0 && meta[block].pins == 0) << "block " << block;
    meta[block].ref = 1;
    ids[i] = block;
  }
  if (evicted > 0) {
    lru_size_ -= evicted;
    counters_.evictions += static_cast<uint64_t>(evicted);
    TrimLruRing();
  }
  in_use_blocks_ += n;
  counters_.blocks_allocated += static_cast<uint64_t>(n);
}

void BlockLedger::ReleaseTailFirst(std::span<const BlockId> blocks) {
  // Counts accumulate in locals: members could alias the per-block arrays.
  BlockMeta* meta = meta_.data();
  int32_t released = 0;
  for (auto it = blocks.rbegin(); it != blocks.rend(); ++it) {
    const BlockId b = *it;
    if (b == kNoBlock) continue;
    KVCM_CHECK(meta[b].ref > 0) << "release of unreferenced block " << b;
    if (--meta[b].ref > 0) continue;
    ++released;
    if (meta_[b].pins > 0) {
      ++pinned_idle_blocks_;
    } else if (IsIndexed(b)) {
      LruPushBack(b);
    } else {
      if (IsDuplicate(b)) DropDuplicate(b);
      free_.Insert(b);
    }
  }
  in_use_blocks_ -= released;
  counters_.blocks_released += static_cast<uint64_t>(released);
}

void BlockLedger::Reuse(BlockId block) {
  if (meta_[block].ref == 0) {
    if (meta_[block].pins > 0) {
      --pinned_idle_blocks_;
    } else {
      LruRemove(block);
    }
    ++in_use_blocks_;
  }
  ++meta_[block].ref;
}

void BlockLedger::Release(BlockId block) { ReleaseTailFirst(std::span(&block, 1)); }

// --- Allocate ------------------------------------------------------------------------------

absl::StatusOr<AdmissionPlan> BlockLedger::PlanAllocate(SeqId seq, int32_t num_tokens,
                                                        std::span<const BlockHash> block_hashes,
                                                        const AllocateOptions& options,
                                                        std::vector<BlockId>* hits) const {
  if (seq_index_.contains(seq)) {
    return absl::AlreadyExistsError(absl::StrCat("sequence ", seq, " is already live"));
  }
  if (num_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("sequence ", seq, ": negative token count ", num_tokens));
  }
  const int32_t total_blocks = BlocksFor(num_tokens);
  if (total_blocks > options_.num_blocks) {
    return absl::InvalidArgumentError(absl::StrCat(
        "sequence ", seq, ": ", num_tokens, " tokens need ", total_blocks, " blocks of ",
        options_.block_size, " tokens, but the whole pool has ", options_.num_blocks,
        " blocks (max total tokens ", int64_t{options_.num_blocks} * options_.block_size, ")"));
  }
  const size_t full_blocks = static_cast<size_t>(FullBlocks(num_tokens));
  if (block_hashes.size() > full_blocks) {
    return absl::InvalidArgumentError(
        absl::StrCat("sequence ", seq, ": ", block_hashes.size(), " block hashes for ", num_tokens,
                     " tokens, which fill only ", full_blocks, " blocks"));
  }
  // A hit never covers the last prompt token (it must be computed to get logits).
  const size_t matchable = std::min(
      block_hashes.size(), num_tokens > 0 ? static_cast<size_t>(FullBlocks(num_tokens - 1)) : 0);
  const int32_t window = WindowOf(options);
  const int32_t released = options.released_blocks;
  if (window < 0 || released < 0 || static_cast<size_t>(released) > block_hashes.size() ||
      (released > 0 && window == 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("sequence ", seq, ": window ", window, " tokens with ", released,
                     " leading blocks released (", block_hashes.size(),
                     " hashed): released blocks need a window and their hashes"));
  }
  AdmissionPlan plan;
  int32_t hits_from_lru = 0;
  const size_t match_end =
      options.max_hit_blocks < 0
          ? matchable
          : std::min(matchable, static_cast<size_t>(released + options.max_hit_blocks));
  for (size_t i = static_cast<size_t>(released); i < match_end; ++i) {
    const BlockId b = index_.Find(block_hashes[i], HashOf());
    if (b == kNoBlock) break;
    ++plan.prefix_hit_blocks;
    if (hits != nullptr) hits->push_back(b);
    if (meta_[b].ref == 0 && meta_[b].pins == 0) ++hits_from_lru;
  }
  if (released > 0) {
    // The released blocks must be behind the window of the first query computed.
    const int64_t first_needed =
        int64_t{released + plan.prefix_hit_blocks} * options_.block_size - window + 1;
    if (int64_t{released} * options_.block_size > first_needed) {
      return absl::InvalidArgumentError(
          absl::StrCat("sequence ", seq, ": ", released, " leading blocks released, but with ",
                       plan.prefix_hit_blocks, " blocks found after them the window of ", window,
                       " tokens still reads from token ", std::max<int64_t>(first_needed, 0)));
    }
  }
  plan.blocks_needed = total_blocks - released - plan.prefix_hit_blocks;
  // Cached blocks that this allocation reuses cannot also be evicted for it.
  const int32_t available = AvailableBlocks() - hits_from_lru;
  if (plan.blocks_needed > available) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "sequence ", seq, ": needs ", plan.blocks_needed, " new blocks (", num_tokens, " tokens, ",
        plan.prefix_hit_blocks, " blocks cached), but only ", available, " can be taken now (",
        free_.size(), " free, ", lru_size_ - hits_from_lru, " cached evictable)"));
  }
  plan.evictions = std::max(0, plan.blocks_needed - free_.size());
  return plan;
}

absl::StatusOr<AdmissionPlan> BlockLedger::CanAllocate(SeqId seq, int32_t num_tokens,
                                                       std::span<const BlockHash> block_hashes,
                                                       const AllocateOptions& options) const {
  return PlanAllocate(seq, num_tokens, block_hashes, options, nullptr);
}

absl::StatusOr<AllocateResult> BlockLedger::Allocate(SeqId seq, int32_t num_tokens,
                                                     std::span<const BlockHash> block_hashes) {
  AllocateResult result;
  if (absl::Status status = Allocate(seq, num_tokens, block_hashes, &result); !status.ok()) {
    return status;
  }
  return result;
}

absl::Status BlockLedger::Allocate(SeqId seq, int32_t num_tokens,
                                   std::span<const BlockHash> block_hashes,
                                   AllocateResult* result) {
  return Allocate(seq, num_tokens, block_hashes, AllocateOptions{}, result);
}

absl::Status BlockLedger::Allocate(SeqId seq, int32_t num_tokens,
                                   std::span<const BlockHash> block_hashes,
                                   const AllocateOptions& options, AllocateResult* result) {
  scratch_hits_.clear();
  absl::StatusOr<AdmissionPlan> plan =
      PlanAllocate(seq, num_tokens, block_hashes, options, &scratch_hits_);
  if (!plan.ok()) {
    if (absl::IsResourceExhausted(plan.status())) ++counters_.allocation_failures;
    return plan.status();
  }
  const int32_t slot = AcquireSlot();
  Sequence& s = slots_[slot];
  s.id = seq;
  s.num_tokens = num_tokens;
  const int32_t released = options.released_blocks;
  s.num_committed = (released + plan->prefix_hit_blocks) * options_.block_size;
  s.num_registered = released + plan->prefix_hit_blocks;
  s.first_live = released;
  s.window = WindowOf(options);
  s.owner = 0;
  s.blocks.assign(static_cast<size_t>(released), kNoBlock);
  s.blocks.reserve(static_cast<size_t>(released + plan->prefix_hit_blocks + plan->blocks_needed));
  s.hashes.assign(block_hashes.begin(), block_hashes.end());
  for (BlockId b : scratch_hits_) {
    Reuse(b);
    s.blocks.push_back(b);
  }
  TakeBlocks(plan->blocks_needed, &s.blocks);
  table_entries_ += static_cast<int64_t>(s.blocks.size()) - released;
  seq_index_.Insert(seq, slot);

  counters_.prefix_query_tokens += static_cast<uint64_t>(num_tokens);
  counters_.prefix_hit_tokens += static_cast<uint64_t>(s.num_committed);
  result->blocks.assign(s.blocks.begin(), s.blocks.end());
  result->num_cached_tokens = s.num_committed;
  return absl::OkStatus();
}

// --- Append --------------------------------------------------------------------------------

absl::StatusOr<AdmissionPlan> BlockLedger::PlanAppend(const Sequence& s,
                                                      int32_t num_new_tokens) const {
  if (num_new_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("sequence ", s.id, ": negative token count ", num_new_tokens));
  }
  const int64_t new_total = int64_t{s.num_tokens} + num_new_tokens;
  const int64_t capacity = int64_t{options_.num_blocks} * options_.block_size;
  if (new_total > capacity) {
    return absl::InvalidArgumentError(absl::StrCat(
        "sequence ", s.id, ": ", new_total, " tokens exceed what the whole pool can hold (",
        options_.num_blocks, " blocks × ", options_.block_size, " = ", capacity, " tokens)"));
  }
  AdmissionPlan plan;
  const bool partial = !IsBlockBoundary(s.num_tokens);
  if (num_new_tokens > 0 && partial && meta_[s.blocks.back()].ref > 1) {
    // The copy reads the shared block's KV: it must be written, or the copy is garbage.
    if (s.num_committed < s.num_tokens) {
      return absl::FailedPreconditionError(
          absl::StrCat("sequence ", s.id,
                       " shares its partly filled last block, whose KV is not committed "
                       "(",
                       s.num_committed, " of ", s.num_tokens,
                       " tokens): commit it before appending, "
                       "as copy-on-write copies that KV"));
    }
    plan.copies = 1;
  }
  plan.blocks_needed = BlocksFor(static_cast<int32_t>(new_total)) -
                       static_cast<int32_t>(s.blocks.size()) + plan.copies;
  if (plan.blocks_needed > AvailableBlocks()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "sequence ", s.id, ": appending ", num_new_tokens, " tokens needs ", plan.blocks_needed,
        " new blocks, but only ", AvailableBlocks(), " can be taken now (", free_.size(), " free, ",
        lru_size_, " cached evictable)"));
  }
  plan.evictions = std::max(0, plan.blocks_needed - free_.size());
  return plan;
}

absl::StatusOr<AdmissionPlan> BlockLedger::CanAppend(SeqId seq, int32_t num_new_tokens) const {
  const Sequence* s = FindSeq(seq);
  if (s == nullptr) return NotFound(seq);
  return PlanAppend(*s, num_new_tokens);
}

absl::StatusOr<AppendResult> BlockLedger::Append(SeqId seq, int32_t num_new_tokens) {
  AppendResult result;
  if (absl::Status status = Append(seq, num_new_tokens, &result); !status.ok()) return status;
  return result;
}

absl::Status BlockLedger::Append(SeqId seq, int32_t num_new_tokens, AppendResult* result) {
  result->new_blocks.clear();
  result->copies.clear();
  result->replaced_last = kNoBlock;
  Sequence* s = FindSeq(seq);
  if (s == nullptr) return NotFound(seq);
  // Fast path, most decode steps: the tokens fit the partly filled last block, which this
  // sequence alone holds. No block moves; the plan below would find the same.
  if (num_new_tokens > 0 && !IsBlockBoundary(s->num_tokens) &&
      int64_t{s->num_tokens} + num_new_tokens <=
          static_cast<int64_t>(s->blocks.size()) * options_.block_size &&
      meta_[s->blocks.back()].ref == 1) {
    s->num_tokens += num_new_tokens;
    return absl::OkStatus();
  }
  absl::StatusOr<AdmissionPlan> plan = PlanAppend(*s, num_new_tokens);
  if (!plan.ok()) {
    if (absl::IsResourceExhausted(plan.status())) ++counters_.allocation_failures;
    return plan.status();
  }
  if (plan->copies > 0) {
    // The partly filled last block is shared (fork): give this sequence a private copy.
    const BlockId old_block = s->blocks.back();
    const BlockId copy = TakeBlock();
    result->copies.push_back({old_block, copy});
    result->replaced_last = copy;
    s->blocks.back() = copy;
    Release(old_block);
    ++counters_.cow_copies;
  }
  TakeBlocks(plan->blocks_needed - plan->copies, &result->new_blocks);
  s->blocks.insert(s->blocks.end(), result->new_blocks.begin(), result->new_blocks.end());
  table_entries_ += static_cast<int64_t>(result->new_blocks.size());
  s->num_tokens += num_new_tokens;
  return absl::OkStatus();
}

// --- Fork, commit, free ------------------------------------------------------------------

absl::Status BlockLedger::Fork(SeqId parent, SeqId child) {
  const int32_t parent_slot = seq_index_.Find(parent);
  if (parent_slot < 0) return NotFound(parent);
  if (seq_index_.contains(child)) {
    return absl::AlreadyExistsError(absl::StrCat("cannot fork ", parent, " into ", child,
                                                 ": sequence ", child, " is already live"));
  }
  const int32_t child_slot = AcquireSlot();  // may move slots_: index, don't hold pointers
  const Sequence& p = slots_[parent_slot];
  Sequence& c = slots_[child_slot];
  c.id = child;
  c.num_tokens = p.num_tokens;
  c.num_committed = p.num_committed;
  c.num_registered = p.num_registered;
  c.first_live = p.first_live;
  c.window = p.window;
  c.owner = 0;
  c.blocks = p.blocks;
  c.hashes = p.hashes;
  for (BlockId b : c.blocks) {
    if (b != kNoBlock) Reuse(b);
  }
  table_entries_ += static_cast<int64_t>(c.blocks.size()) - c.first_live;
  seq_index_.Insert(child, child_slot);
  return absl::OkStatus();
}

inline void BlockLedger::Register(Sequence& s) {
  const int32_t limit =
      std::min(static_cast<int32_t>(s.hashes.size()), FullBlocks(s.num_committed));
  if (limit <= s.num_registered) return;  // most commits of a decode step: inline, no call
  RegisterUpTo(s, limit);
}

void BlockLedger::RegisterUpTo(Sequence& s, int32_t limit) {
  // The index slots and the blocks' hash entries (written below, 2 MiB of them for 65,536
  // blocks: a store miss per block otherwise) fetched kAhead blocks ahead of their insertion.
  constexpr int32_t kAhead = 8;
  auto fetch = [&](int32_t i) {
    index_.Prefetch(BlockIndex::TagOf(s.hashes[i]));
    if (s.blocks[i] != kNoBlock) __builtin_prefetch(&hash_[s.blocks[i]], 1);
  };
  for (int32_t i = s.num_registered; i < std::min(limit, s.num_registered + kAhead); ++i) fetch(i);
  for (int32_t i = s.num_registered; i < limit; ++i) {
    if (i + kAhead < limit) fetch(i + kAhead);
    const BlockId b = s.blocks[i];
    if (b == kNoBlock || IsIndexed(b) || IsDuplicate(b)) continue;
    if (const BlockId holder = index_.Insert(s.hashes[i], b, HashOf()); holder != b) {
      // Same content already indexed in another block: a duplicate, which takes over if
      // that block is evicted first.
      meta_[holder].flags |= kHasDuplicates;
      meta_[b].flags |= kDuplicate;
      meta_[b].tag = BlockIndex::TagOf(s.hashes[i]);
      hash_[b] = s.hashes[i];
      duplicates_[s.hashes[i]].push_back({b, i > 0 ? s.hashes[i - 1] : BlockHash{}, i > 0});
      continue;
    }
    meta_[b].flags |= kIndexed;
    meta_[b].tag = BlockIndex::TagOf(s.hashes[i]);
    hash_[b] = s.hashes[i];
    if (options_.record_events) {
      const BlockHash parent = i > 0 ? s.hashes[i - 1] : BlockHash{};
      events_.push_back({BlockEvent::Kind::kStored, hash_[b], parent, i > 0, b});
    }
  }
  s.num_registered = std::max(s.num_registered, limit);
}

void BlockLedger::ApplyWindow(Sequence& s) {
  const int64_t window = s.window;
  if (window == 0) return;
  const int64_t first_needed_token = int64_t{s.num_committed} - window + 1;
  if (first_needed_token <= 0) return;
  const int32_t release_upto = static_cast<int32_t>(std::min<int64_t>(
      first_needed_token / options_.block_size, static_cast<int64_t>(s.blocks.size())));
  for (int32_t i = s.first_live; i < release_upto; ++i) {
    if (s.blocks[i] == kNoBlock) continue;
    Release(s.blocks[i]);
    s.blocks[i] = kNoBlock;
    ++counters_.window_released;
    --table_entries_;
  }
  s.first_live = std::max(s.first_live, release_upto);
}

absl::Status BlockLedger::Commit(SeqId seq, int32_t num_committed_tokens,
                                 std::span<const BlockHash> new_block_hashes) {
  Sequence* s = FindSeq(seq);
  if (s == nullptr) return NotFound(seq);
  if (num_committed_tokens < s->num_committed) {
    return absl::InvalidArgumentError(
        absl::StrCat("sequence ", seq, ": commit point cannot go back from ", s->num_committed,
                     " to ", num_committed_tokens, " tokens"));
  }
  if (num_committed_tokens > s->num_tokens) {
    return absl::InvalidArgumentError(absl::StrCat("sequence ", seq, ": cannot commit ",
                                                   num_committed_tokens, " tokens, it holds only ",
                                                   s->num_tokens));
  }
  const size_t full_blocks = static_cast<size_t>(FullBlocks(s->num_tokens));
  if (s->hashes.size() + new_block_hashes.size() > full_blocks) {
    return absl::InvalidArgumentError(
        absl::StrCat("sequence ", seq, ": ", s->hashes.size() + new_block_hashes.size(),
                     " block hashes in all, but only ", full_blocks, " blocks are full"));
  }
  if (new_block_hashes.size() == 1) {
    s->hashes.push_back(new_block_hashes[0]);  // a decode step filling a block
  } else if (!new_block_hashes.empty()) {
    s->hashes.insert(s->hashes.end(), new_block_hashes.begin(), new_block_hashes.end());
  }
  s->num_committed = num_committed_tokens;
  Register(*s);
  ApplyWindow(*s);
  return absl::OkStatus();
}

absl::Status BlockLedger::Free(SeqId seq) {
  const int32_t slot = seq_index_.Find(seq);
  if (slot < 0) return NotFound(seq);
  Sequence& s = slots_[static_cast<size_t>(slot)];
  // Tail first: among blocks released together, the tail is evicted before the head.
  ReleaseTailFirst(s.blocks);
  table_entries_ -= static_cast<int64_t>(s.blocks.size()) - s.first_live;
  seq_index_.Erase(seq);
  ReleaseSlot(slot);
  return absl::OkStatus();
}

absl::Status BlockLedger::Rename(SeqId seq, SeqId new_id) {
  const int32_t slot = seq_index_.Find(seq);
  if (slot < 0) return NotFound(seq);
  if (seq_index_.contains(new_id)) {
    return absl::AlreadyExistsError(absl::StrCat("cannot rename ", seq, " to ", new_id,
                                                 ": sequence ", new_id, " is already live"));
  }
  seq_index_.Erase(seq);
  slots_[static_cast<size_t>(slot)].id = new_id;
  seq_index_.Insert(new_id, slot);
  return absl::OkStatus();
}

absl::Status BlockLedger::SetOwner(SeqId seq, uint64_t owner) {
  const int32_t slot = seq_index_.Find(seq);
  if (slot < 0) return NotFound(seq);
  slots_[static_cast<size_t>(slot)].owner = owner;
  return absl::OkStatus();
}

// --- Prefix cache --------------------------------------------------------------------------

BlockId BlockLedger::IndexedBlock(const BlockHash& hash) const {
  return index_.Find(hash, HashOf());
}

int32_t BlockLedger::Lookup(std::span<const BlockHash> block_hashes) const {
  int32_t n = 0;
  for (const BlockHash& h : block_hashes) {
    if (index_.Find(h, HashOf()) == kNoBlock) break;
    ++n;
  }
  return n;
}

int32_t BlockLedger::ReusableBlocks(int32_t num_tokens,
                                    std::span<const BlockHash> block_hashes) const {
  if (num_tokens <= 0) return 0;
  const size_t matchable =
      std::min(block_hashes.size(), static_cast<size_t>((num_tokens - 1) / options_.block_size));
  return Lookup(block_hashes.first(matchable));
}

absl::Status BlockLedger::Pin(const std::string& name, std::span<const BlockHash> block_hashes) {
  if (name.empty()) return absl::InvalidArgumentError("pin name must not be empty");
  if (block_hashes.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("pin '", name, "' names no blocks"));
  }
  if (pins_.contains(name)) {
    return absl::AlreadyExistsError(absl::StrCat("pin '", name, "' already exists"));
  }
  std::vector<BlockId> blocks;
  blocks.reserve(block_hashes.size());
  for (size_t i = 0; i < block_hashes.size(); ++i) {
    const BlockId found = index_.Find(block_hashes[i], HashOf());
    if (found == kNoBlock) {
      return absl::NotFoundError(
          absl::StrCat("pin '", name, "': block ", i, " of ", block_hashes.size(), " (hash ",
                       block_hashes[i].ToHex().substr(0, 16), "…) is not in the prefix cache"));
    }
    blocks.push_back(found);
  }
  {  // Drop repeats, keeping chain order (head first).
    absl::flat_hash_set<BlockId> seen;
    blocks.erase(std::remove_if(blocks.begin(), blocks.end(),
                                [&](BlockId b) { return !seen.insert(b).second; }),
                 blocks.end());
  }
  int32_t newly_pinned = 0;
  for (BlockId b : blocks) {
    newly_pinned += meta_[b].pins == 0 ? 1 : 0;
    if (meta_[b].pins == kMaxPinsPerBlock) {
      return absl::ResourceExhaustedError(absl::StrCat("pin '", name, "': block ", b,
                                                       " is already held by ", kMaxPinsPerBlock,
                                                       " pins, the most one block can have"));
    }
  }
  if (pinned_blocks_total_ + newly_pinned > options_.max_pinned_blocks) {
    return absl::ResourceExhaustedError(
        absl::StrCat("pin '", name, "' would pin ", pinned_blocks_total_ + newly_pinned,
                     " blocks, over the limit of ", options_.max_pinned_blocks));
  }
  for (BlockId b : blocks) {
    if (meta_[b].pins++ > 0) continue;
    ++pinned_blocks_total_;
    if (meta_[b].ref == 0) {
      LruRemove(b);
      ++pinned_idle_blocks_;
    }
  }
  pins_.emplace(name, PinEntry{std::move(blocks)});
  return absl::OkStatus();
}

absl::Status BlockLedger::Unpin(const std::string& name) {
  auto it = pins_.find(name);
  if (it == pins_.end()) return absl::NotFoundError(absl::StrCat("no pin named '", name, "'"));
  // Tail first, so that the prefix's tail is evicted before its head.
  for (auto rit = it->second.blocks.rbegin(); rit != it->second.blocks.rend(); ++rit) {
    const BlockId b = *rit;
    if (--meta_[b].pins > 0) continue;
    --pinned_blocks_total_;
    if (meta_[b].ref == 0) {
      --pinned_idle_blocks_;
      LruPushBack(b);
    }
  }
  pins_.erase(it);
  return absl::OkStatus();
}

int32_t BlockLedger::EvictAllCached() {
  int32_t n = 0;
  while (lru_size_ > 0) {
    free_.Insert(EvictLruHead());
    ++n;
  }
  return n;
}

// --- Holds -------------------------------------------------------------------------------

absl::Status BlockLedger::Hold(BlockId block) {
  if (block < 0 || block >= options_.num_blocks) {
    return absl::InvalidArgumentError(
        absl::StrCat("hold of block ", block, ": out of range [0, ", options_.num_blocks, ")"));
  }
  // A duplicate is always in use (it is dropped when its last reference goes).
  if (!IsIndexed(block) && !(IsDuplicate(block) && meta_[block].ref > 0)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "hold of block ", block, " (", std::string(BlockStateName(StateOf(block))),
        "): only a block in the prefix index, or an in-use duplicate, holds committed KV"));
  }
  auto it = holds_.find(block);
  if (it != holds_.end() && it->second == kMaxHoldsPerBlock) {
    return absl::ResourceExhaustedError(absl::StrCat("hold of block ", block, ": already held ",
                                                     kMaxHoldsPerBlock,
                                                     " times, the most one block can be"));
  }
  Reuse(block);
  if (it == holds_.end()) {
    holds_.emplace(block, uint16_t{1});
  } else {
    ++it->second;
  }
  ++holds_total_;
  return absl::OkStatus();
}

absl::Status BlockLedger::Unhold(BlockId block) {
  if (block < 0 || block >= options_.num_blocks) {
    return absl::InvalidArgumentError(
        absl::StrCat("unhold of block ", block, ": out of range [0, ", options_.num_blocks, ")"));
  }
  auto it = holds_.find(block);
  if (it == holds_.end()) {
    return absl::FailedPreconditionError(
        absl::StrCat("unhold of block ", block, ": it is not held"));
  }
  if (--it->second == 0) holds_.erase(it);
  --holds_total_;
  Release(block);
  return absl::OkStatus();
}

// --- Introspection -------------------------------------------------------------------------

LedgerStats BlockLedger::Stats() const {
  LedgerStats stats = counters_;
  stats.free_blocks = free_.size();
  stats.in_use_blocks = in_use_blocks_;
  stats.cached_blocks = lru_size_;
  stats.pinned_blocks = pinned_idle_blocks_;
  stats.live_sequences = static_cast<int32_t>(seq_index_.size());
  const double n = options_.num_blocks;
  stats.usage_ratio = in_use_blocks_ / n;
  stats.occupancy_ratio = (in_use_blocks_ + lru_size_ + pinned_idle_blocks_) / n;
  return stats;
}

BlockState BlockLedger::StateOf(BlockId block) const {
  KVCM_CHECK(block >= 0 && block < options_.num_blocks) << "block " << block;
  if (meta_[block].ref > 0) return BlockState::kInUse;
  if (meta_[block].pins > 0) return BlockState::kPinned;
  if (IsIndexed(block)) return BlockState::kCached;
  return BlockState::kFree;
}

absl::StatusOr<std::vector<BlockId>> BlockLedger::BlockTable(SeqId seq) const {
  const Sequence* s = FindSeq(seq);
  if (s == nullptr) return NotFound(seq);
  return s->blocks;
}

absl::StatusOr<int32_t> BlockLedger::NumTokens(SeqId seq) const {
  const Sequence* s = FindSeq(seq);
  if (s == nullptr) return NotFound(seq);
  return s->num_tokens;
}

absl::StatusOr<int32_t> BlockLedger::NumCommittedTokens(SeqId seq) const {
  const Sequence* s = FindSeq(seq);
  if (s == nullptr) return NotFound(seq);
  return s->num_committed;
}

std::vector<BlockId> BlockLedger::EvictionOrderForTest() const {
  std::vector<BlockId> order;
  for (size_t i = lru_front_; i < lru_ring_.size(); ++i) {
    if (LruEntryLive(lru_ring_[i])) order.push_back(lru_ring_[i].block);
  }
  return order;
}

void BlockLedger::SetLruClockForTest(uint32_t clock) { lru_clock_ = clock; }

std::vector<BlockEvent> BlockLedger::TakeEvents() { return std::exchange(events_, {}); }

std::vector<std::pair<BlockId, BlockHash>> BlockLedger::IndexedBlocks() const {
  std::vector<std::pair<BlockId, BlockHash>> out;
  out.reserve(static_cast<size_t>(index_.size()));
  for (BlockId b = 0; b < options_.num_blocks; ++b) {
    if (IsIndexed(b)) out.emplace_back(b, hash_[b]);
  }
  return out;
}

void BlockLedger::FillBlockMap(int32_t max_cells,
                               std::span<const std::pair<BlockId, MapState>> held_apart,
                               BlockMap* out) const {
  KVCM_CHECK(max_cells > 0) << "max_cells " << max_cells;
  const int32_t n = options_.num_blocks;
  const int32_t per_cell = BlocksPerCell(n, max_cells);
  out->num_blocks = n;
  out->blocks_per_cell = per_cell;
  out->cells.resize(static_cast<size_t>((int64_t{n} + per_cell - 1) / per_cell));
  out->counts.fill(0);
  size_t next_held = 0;
  std::array<int32_t, kMapStates> in_cell{};
  size_t cell = 0;
  for (BlockId first = 0; first < n; first += per_cell) {
    const BlockId end = static_cast<BlockId>(std::min<int64_t>(n, int64_t{first} + per_cell));
    in_cell.fill(0);
    for (BlockId b = first; b < end; ++b) {
      const BlockMeta& m = meta_[b];
      MapState state = m.ref > 0                   ? MapState::kInUse
                       : m.pins > 0                ? MapState::kPinned
                       : (m.flags & kIndexed) != 0 ? MapState::kCached
                                                   : MapState::kFree;
      if (next_held < held_apart.size() && held_apart[next_held].first == b) {
        KVCM_CHECK(state == MapState::kInUse) << "block " << b << " held apart but not in use";
        state = held_apart[next_held++].second;
      }
      ++in_cell[static_cast<size_t>(state)];
    }
    // The state most blocks of the cell are in; a tie goes to the later state.
    size_t dominant = 0;
    for (size_t s = 0; s < in_cell.size(); ++s) {
      out->counts[s] += in_cell[s];
      if (in_cell[s] > 0 && in_cell[s] >= in_cell[dominant]) dominant = s;
    }
    out->cells[cell++] = static_cast<MapState>(dominant);
  }
  KVCM_CHECK(next_held == held_apart.size())
      << "held_apart not sorted, repeated or out of range at entry " << next_held;
}

size_t BlockLedger::MemoryBytes() const {
  auto vec = [](const auto& v) { return v.capacity() * sizeof(v[0]); };
  auto map = [](const auto& m) {
    using Slot = typename std::decay_t<decltype(m)>::value_type;
    return m.capacity() * (sizeof(Slot) + 1);
  };
  size_t bytes = vec(meta_) + vec(hash_) + vec(lru_ring_) + free_.MemoryBytes() +
                 index_.MemoryBytes() + map(duplicates_) + seq_index_.MemoryBytes() + map(pins_) +
                 map(holds_) + vec(free_slots_) + vec(events_) + vec(scratch_hits_);
  for (const Sequence& s : slots_) bytes += sizeof(Sequence) + vec(s.blocks) + vec(s.hashes);
  return bytes;
}

}  // namespace kvcm
