#pragma once

// BlockLedger: the bookkeeping of a fixed pool of KV-cache blocks. No I/O, no memory: it
// decides which block ids hold which sequence's tokens; the pool memory lives elsewhere
// (common/memory/) and is addressed by these ids.
//
// States (they partition the pool; CheckInvariants() verifies it):
//   free    ref count 0, holds nothing reusable.
//   in use  ref count > 0: referenced by one or more live sequences (shared after a fork
//           or a prefix hit), or held (Hold: the tier mover copying it out).
//   cached  ref count 0, full, committed and hashed: reusable by a later sequence with the
//           same prefix until evicted (least recently used first).
//   pinned  ref count 0 and pinned by a named prefix: cached and never evicted.
//
// Lifecycle of a sequence (ids chosen by the caller, the router):
//   Allocate(seq, num_tokens, hashes)  blocks for a prompt; leading blocks whose hashes are
//                                      cached are shared instead of allocated (prefix hit).
//   Append(seq, n)                     room for n more tokens; may return copy orders
//                                      (copy-on-write of a shared, partly filled block).
//   Fork(parent, child)                child shares all of parent's blocks.
//   Commit(seq, tokens, hashes)        the executor wrote the KV of the first `tokens`
//                                      tokens: full blocks with known hashes become
//                                      matchable (never earlier: no reads of unwritten KV).
//   Free(seq)                          drop the sequence; committed, hashed blocks stay
//                                      cached, the rest become free.
//
// Every mutating call is all-or-nothing: it first builds a plan without changing anything
// (the Plan*() methods) and applies it only if the whole plan fits. On error the ledger is
// exactly as it was. Dry runs (CanAllocate, CanAppend) return the plan's summary for
// admission control.
//
// Choices (where the design left room):
// - A prefix hit never covers the prompt's last token: the caller must compute at least
//   one token to get logits (as vLLM does), so a prompt of exactly k full cached blocks
//   hits k-1 of them.
// - Free blocks are handed out before any cached block is evicted, lowest ids first, so a
//   sequence's blocks form ascending runs whenever the pool allows.
// - Eviction takes the least recently released cached block first. A sequence's blocks are
//   released tail first, so among blocks released together the tail goes before the head
//   (a tail is only useful if its head is still there).
// - When two sequences commit blocks with the same hash, the first stays matchable; the
//   second is a private duplicate, freed (not cached) when released. If the first is
//   evicted while a duplicate is still in use, the duplicate becomes the matchable one (and
//   cached when released): the content stays findable as long as a block holds it.
// - Sliding window (W > 0 tokens: Options::sliding_window_tokens for every sequence, or a
//   sequence's own from AllocateOptions): a query at position p attends to positions
//   (p - W, p]. After Commit(seq, c), no future query (p >= c) needs a token before
//   c - W + 1, so blocks lying wholly before it are released (their table entries become
//   kNoBlock). Released blocks follow the same path as Free. Fork keeps the parent's window.
//
// Thread safety: none. One owner thread (the cache manager's ledger thread) calls it.

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/block/block_hash.h"
#include "common/block/block_index.h"
#include "common/block/block_map.h"
#include "common/block/free_block_set.h"
#include "common/block/sequence_table.h"

namespace kvcm {

using BlockId = int32_t;
using SeqId = uint64_t;
inline constexpr BlockId kNoBlock = -1;

enum class BlockState : uint8_t { kFree, kInUse, kCached, kPinned };
std::string_view BlockStateName(BlockState state);

// Copy the KV of block `src` into block `dst` (all layers, K and V), before the step that
// writes into `dst` runs.
struct CopyOrder {
  BlockId src = kNoBlock;
  BlockId dst = kNoBlock;
  friend bool operator==(const CopyOrder&, const CopyOrder&) = default;
};

// How a sequence attends, given at Allocate (BlockLedger::Allocate's overload with options):
// its own sliding window, and leading blocks it never holds because they lie behind it.
struct AllocateOptions {
  // Tokens its queries attend within (see "Sliding window" above); 0 = full attention;
  // -1 = Options::sliding_window_tokens.
  int32_t window_tokens = -1;
  // Leading blocks of the prompt that the window has passed at the prefix hit: their table
  // entries are kNoBlock from the start, and matching begins after them (a window's prefix
  // hit needs only the blocks its queries read: matching from the right). They must have
  // hashes, and lie wholly behind the window at the hit: released_blocks x block_size <=
  // cached tokens - window + 1.
  int32_t released_blocks = 0;
  // At most this many blocks shared after the released ones (-1: as many as the prefix
  // index holds), so that every group of a hybrid cache shares the same prefix.
  int32_t max_hit_blocks = -1;
};

struct AllocateResult {
  std::vector<BlockId> blocks;    // the sequence's whole block table
  int32_t num_cached_tokens = 0;  // leading tokens whose KV is already in the pool
};

struct AppendResult {
  std::vector<BlockId> new_blocks;  // appended to the block table, in order
  std::vector<CopyOrder> copies;    // copy-on-write orders (at most one per call)
  // The block that replaced a shared partial last block (also named in `copies`), or
  // kNoBlock. The table entry at (old size - 1) now holds it.
  BlockId replaced_last = kNoBlock;
};

// What an operation would do, computed without changing anything.
struct AdmissionPlan {
  int32_t blocks_needed = 0;      // new blocks the operation takes from the pool
  int32_t prefix_hit_blocks = 0;  // leading blocks shared instead of allocated
  int32_t evictions = 0;          // cached blocks that would be evicted to make room
  int32_t copies = 0;             // copy-on-write copies
};

// Something the prefix index gained or lost, for the KV event stream.
struct BlockEvent {
  enum class Kind : uint8_t { kStored, kRemoved, kAllCleared };
  Kind kind = Kind::kStored;
  BlockHash hash;  // unset for kAllCleared
  // kStored only: the hash of the sequence's previous block; absent (has_parent false) for
  // its first block, whose parent is the chain's root, RootHash(salt), which only the
  // caller knows (as vLLM's BlockStored leaves parent_block_hash None).
  BlockHash parent_hash;
  bool has_parent = false;
  BlockId block = kNoBlock;
};

// One snapshot. Counts by state sum to num_blocks. Counters are totals since construction.
struct LedgerStats {
  int32_t num_blocks = 0;
  int32_t block_size = 0;
  int32_t free_blocks = 0;
  int32_t in_use_blocks = 0;
  int32_t cached_blocks = 0;
  int32_t pinned_blocks = 0;
  int32_t live_sequences = 0;
  // in_use_blocks / num_blocks: blocks that cannot be handed out without ending a sequence.
  // Cached and pinned blocks are not counted (they hold reusable KV; cached ones can be
  // evicted at any time). occupancy_ratio counts everything that holds KV.
  double usage_ratio = 0;
  // (in_use + cached + pinned) / num_blocks.
  double occupancy_ratio = 0;
  uint64_t prefix_query_tokens = 0;  // prompt tokens of successful Allocate calls
  uint64_t prefix_hit_tokens = 0;    // of which already cached
  uint64_t blocks_allocated = 0;     // blocks taken from the pool (free or evicted)
  uint64_t blocks_released = 0;      // references dropped that left a block unused
  uint64_t evictions = 0;            // cached blocks evicted to make room
  uint64_t allocation_failures = 0;  // Allocate/Append refused for lack of blocks
  uint64_t cow_copies = 0;           // copy-on-write orders issued
  uint64_t window_released = 0;      // blocks released by the sliding window
};

class BlockLedger {
 public:
  struct Options {
    // Blocks in the pool. REQUIRES: > 0.
    int32_t num_blocks = 0;
    // Tokens per block. REQUIRES: > 0. Small blocks waste less memory (at most one partly
    // filled block per sequence) and share prefixes more finely; large blocks make
    // attention kernels and bookkeeping cheaper.
    int32_t block_size = 16;
    // Sliding attention window in tokens; 0 = full attention.
    int32_t sliding_window_tokens = 0;
    // Most blocks that named pins may hold, so pins cannot starve the pool.
    // 0 = num_blocks / 2.
    int32_t max_pinned_blocks = 0;
    // Record BlockEvents for TakeEvents() (the cache manager's event publisher).
    bool record_events = false;
  };

  // INVALID_ARGUMENT on nonsense, without allocating anything.
  static absl::Status CheckOptions(const Options& options);
  // Validates options (CheckOptions).
  static absl::StatusOr<BlockLedger> Create(const Options& options);

  BlockLedger(BlockLedger&&) = default;
  BlockLedger& operator=(BlockLedger&&) = default;

  const Options& options() const { return options_; }
  int32_t num_blocks() const { return options_.num_blocks; }
  int32_t block_size() const { return options_.block_size; }

  // --- Sequences -------------------------------------------------------------------------

  // Creates sequence `seq` holding `num_tokens` tokens. `block_hashes` are the hashes of its
  // leading full blocks (any number up to num_tokens / block_size; fewer disables matching
  // and caching beyond them). Leading blocks found in the prefix index are shared.
  // Errors: ALREADY_EXISTS (seq live), INVALID_ARGUMENT (negative tokens, too many hashes,
  // more tokens than the pool can ever hold), RESOURCE_EXHAUSTED (not enough free or
  // evictable blocks now).
  absl::StatusOr<AllocateResult> Allocate(SeqId seq, int32_t num_tokens,
                                          std::span<const BlockHash> block_hashes = {});
  // The same, into *result (its block table assigned): a result the caller keeps from call
  // to call allocates nothing once its vector has grown. On an error *result is unspecified.
  absl::Status Allocate(SeqId seq, int32_t num_tokens, std::span<const BlockHash> block_hashes,
                        AllocateResult* result);
  // The same, for a sequence with its own window and leading blocks released behind it
  // (AllocateOptions). Errors also: INVALID_ARGUMENT (released blocks without hashes, or
  // that the window still needs at the prefix hit found).
  absl::Status Allocate(SeqId seq, int32_t num_tokens, std::span<const BlockHash> block_hashes,
                        const AllocateOptions& options, AllocateResult* result);
  // Dry run of Allocate: the same checks and the plan, changing nothing (no stats either).
  absl::StatusOr<AdmissionPlan> CanAllocate(SeqId seq, int32_t num_tokens,
                                            std::span<const BlockHash> block_hashes = {},
                                            const AllocateOptions& options = {}) const;

  // Makes room for `num_new_tokens` more tokens. When the partly filled last block is shared
  // (a fork), this sequence gets a private copy of it (a CopyOrder), which reads its KV: so
  // the sequence's tokens must all be committed first.
  // Errors: NOT_FOUND (unknown seq), INVALID_ARGUMENT (negative, or beyond what the pool
  // can ever hold), FAILED_PRECONDITION (copy-on-write of uncommitted KV),
  // RESOURCE_EXHAUSTED.
  absl::StatusOr<AppendResult> Append(SeqId seq, int32_t num_new_tokens);
  // The same, into *result (its vectors cleared and refilled), allocating nothing once a
  // result the caller keeps has grown. On an error *result is unspecified.
  absl::Status Append(SeqId seq, int32_t num_new_tokens, AppendResult* result);
  absl::StatusOr<AdmissionPlan> CanAppend(SeqId seq, int32_t num_new_tokens) const;

  // Creates `child` sharing every block of `parent` (same tokens, same commit point).
  // Errors: NOT_FOUND (parent), ALREADY_EXISTS (child).
  absl::Status Fork(SeqId parent, SeqId child);

  // Records that the KV of the first `num_committed_tokens` tokens has been written, and
  // adds `new_block_hashes` to the hashes known for the sequence's full blocks (continuing
  // where the known hashes end). Full, committed blocks with a known hash enter the prefix
  // index. Applies the sliding window.
  // Errors: NOT_FOUND, INVALID_ARGUMENT (beyond num_tokens, going backwards, hashes for
  // blocks that are not full).
  absl::Status Commit(SeqId seq, int32_t num_committed_tokens,
                      std::span<const BlockHash> new_block_hashes = {});

  // Ends the sequence. Errors: NOT_FOUND (unknown or already freed).
  absl::Status Free(SeqId seq);

  // Gives the live sequence `seq` the id `new_id`, keeping its blocks, tokens and commit
  // point: nothing else changes (no block is released or reused). The cache manager moves
  // the sequences of a client that ended out of the clients' id space this way while they
  // drain. Errors: NOT_FOUND (seq), ALREADY_EXISTS (new_id is live).
  absl::Status Rename(SeqId seq, SeqId new_id);

  // --- Owners ----------------------------------------------------------------------------

  // A value the caller keeps with each live sequence, in the sequence's own record, so
  // that an op finds who holds its sequence in the lines it touches anyway (the cache
  // manager keeps the id of the session that holds it). Allocate and Fork start it at 0,
  // none; Rename keeps it; Free drops it. Errors: NOT_FOUND.
  absl::Status SetOwner(SeqId seq, uint64_t owner);
  // The owner of `seq`: 0 when it has none or is not live.
  uint64_t OwnerOf(SeqId seq) const {
    const int32_t slot = seq_index_.Find(seq);
    return slot < 0 ? 0 : slots_[static_cast<size_t>(slot)].owner;
  }
  // Calls fn(seq, owner) for every live sequence, in no particular order. O(live
  // sequences).
  template <typename Fn>
  void ForEachSequence(Fn&& fn) const {
    seq_index_.ForEach(
        [&](uint64_t id, int32_t slot) { fn(SeqId{id}, slots_[static_cast<size_t>(slot)].owner); });
  }

  // --- Prefix cache ----------------------------------------------------------------------

  // Number of leading `block_hashes` whose blocks are in the prefix index (cached, pinned or
  // in use). Changes nothing.
  int32_t Lookup(std::span<const BlockHash> block_hashes) const;
  // The block the prefix index holds for `hash` (in use, cached or pinned), or kNoBlock.
  BlockId IndexedBlock(const BlockHash& hash) const;
  // The hash `block` is indexed under (or stands in for, as a duplicate of an indexed
  // block); nullopt for a block that has none (free, or holding no full block with a known
  // hash) or an id out of range. O(1).
  std::optional<BlockHash> HashOfBlock(BlockId block) const {
    if (block < 0 || block >= num_blocks() || !(IsIndexed(block) || IsDuplicate(block))) {
      return std::nullopt;
    }
    return hash_[static_cast<size_t>(block)];
  }
  // How many leading blocks Allocate(seq, num_tokens, block_hashes) would reuse now: those
  // of Lookup, less the block holding the prompt's last token, which Allocate never reuses
  // (its logits must be computed). Changes nothing.
  int32_t ReusableBlocks(int32_t num_tokens, std::span<const BlockHash> block_hashes) const;

  // Pins the blocks of `block_hashes` (all must be in the prefix index) under `name`, so
  // they are never evicted. Errors: ALREADY_EXISTS (name), NOT_FOUND (a hash not cached;
  // the message says which), RESOURCE_EXHAUSTED (over max_pinned_blocks),
  // INVALID_ARGUMENT (empty name or list).
  absl::Status Pin(const std::string& name, std::span<const BlockHash> block_hashes);
  // Drops the pin. Its blocks that no sequence uses become cached again, the prefix's tail
  // first in eviction order. Errors: NOT_FOUND.
  absl::Status Unpin(const std::string& name);

  // Evicts every cached (unpinned, unreferenced) block; returns how many.
  int32_t EvictAllCached();

  // --- Holds (the tier mover's, docs/architecture.md "Tiers") ---------------------------
  // Adds a reference to `block` that no sequence owns, so that it is not handed out (not
  // evicted, not freed) until Unhold: the cache manager holds a committed block while its
  // mover copies the block's bytes to a tier. Allowed for a block in the prefix index
  // (in use, cached or pinned) only: a cached one leaves the LRU list and counts as in use
  // while held. Errors: INVALID_ARGUMENT (out of range), FAILED_PRECONDITION (not in the
  // prefix index, nor an in-use duplicate), RESOURCE_EXHAUSTED (65,535 holds on one block).
  absl::Status Hold(BlockId block);
  // Drops one hold: the block goes where a sequence's release would send it (cached while
  // indexed, free otherwise, pinned while pinned). Errors: INVALID_ARGUMENT (out of range),
  // FAILED_PRECONDITION (not held).
  absl::Status Unhold(BlockId block);
  // Holds now, in all (each Hold counts once).
  int32_t held_blocks() const { return holds_total_; }
  // Entries of the live sequences' block tables that hold a block (those a window released
  // not counted): a block n tables share counts n times. Kept as the tables change: O(1).
  int64_t table_entries() const { return table_entries_; }

  // --- Introspection ---------------------------------------------------------------------

  LedgerStats Stats() const;
  // Blocks that can be taken now without ending a sequence: free, or cached and evictable.
  int32_t AvailableBlocks() const { return free_.size() + lru_size_; }
  BlockState StateOf(BlockId block) const;
  int32_t RefCount(BlockId block) const { return meta_[block].ref; }
  bool IsLive(SeqId seq) const { return seq_index_.contains(seq); }
  // The sequence's block table (kNoBlock where the sliding window released a block).
  absl::StatusOr<std::vector<BlockId>> BlockTable(SeqId seq) const;
  absl::StatusOr<int32_t> NumTokens(SeqId seq) const;
  absl::StatusOr<int32_t> NumCommittedTokens(SeqId seq) const;
  // Cached blocks in eviction order (next victim first).
  std::vector<BlockId> EvictionOrderForTest() const;
  // Sets the counter that stamps LRU entries (it wraps at 2^32), to test the wrap.
  void SetLruClockForTest(uint32_t clock);

  // Verifies that the states partition the pool, ref counts equal the references held by
  // live sequences plus the holds (each held block indexed or a duplicate), the prefix
  // index, LRU list, free set and pin counts agree, and every sequence is well formed.
  // Returns INTERNAL naming the first broken rule.
  absl::Status CheckInvariants() const;

  // Events since the last call, oldest first (empty unless Options::record_events).
  std::vector<BlockEvent> TakeEvents();

  // Every block in the prefix index (in use, cached or pinned) with its hash, by ascending
  // block id: the state that the recorded Stored/Removed events add up to. O(num_blocks).
  std::vector<std::pair<BlockId, BlockHash>> IndexedBlocks() const;

  // The pool as a map of at most `max_cells` cells (common/block/block_map.h), in one pass
  // over the blocks' records: each block in its ledger state, except the blocks `held_apart`
  // names, which the caller knows to be quarantined or draining and which are counted in
  // that state instead. Reuses `out`'s storage and allocates nothing per block, so a pool
  // of 1M blocks costs one pass and one reply-sized buffer. O(num_blocks).
  // REQUIRES: max_cells > 0; `held_apart` by ascending block id, each once, each block in
  // use, each state kQuarantined or kDraining.
  void FillBlockMap(int32_t max_cells, std::span<const std::pair<BlockId, MapState>> held_apart,
                    BlockMap* out) const;

  // Bytes the ledger's own structures hold (per-block arrays, index, sequences), counting
  // reserved capacity; for benchmarks and sizing. O(live sequences).
  size_t MemoryBytes() const;

 private:
  // Breaks one invariant at a time to show CheckInvariants finds it
  // (tests/common/block/block_ledger_invariants_test.cc).
  friend class BlockLedgerTestPeer;

  // CheckInvariants' passes, in order (block_ledger.cc).
  struct StateCounts {
    int32_t free = 0, in_use = 0, cached = 0, pinned_idle = 0, pinned_any = 0, indexed = 0;
  };
  absl::Status CheckHolds(std::vector<int32_t>* refs) const;
  absl::Status CheckSequences(std::vector<int32_t>* refs) const;
  absl::Status CheckBlocks(const std::vector<int32_t>& refs, StateCounts* counts) const;
  absl::Status CheckDuplicate(BlockId b) const;
  absl::Status CheckCounts(const StateCounts& c) const;
  absl::Status CheckIndexEntries(int32_t indexed) const;
  absl::Status CheckLruRing(int32_t cached) const;
  absl::Status CheckPins() const;

  struct Sequence {
    SeqId id = 0;
    int32_t num_tokens = 0;
    int32_t num_committed = 0;
    // Blocks [0, num_registered) have been offered to the prefix index.
    int32_t num_registered = 0;
    // Blocks [0, first_live) were released by the sliding window.
    int32_t first_live = 0;
    int32_t window = 0;  // its sliding window in tokens; 0 = full attention
    uint64_t owner = 0;  // SetOwner's
    std::vector<BlockId> blocks;
    std::vector<BlockHash> hashes;  // known hashes of full blocks [0, hashes.size())
  };

  explicit BlockLedger(const Options& options);

  // Full blocks in `num_tokens` tokens (num_tokens >= 0): a shift when the block size is
  // a power of two (as it nearly always is), which the hot paths call on every token.
  int32_t FullBlocks(int32_t num_tokens) const {
    return block_shift_ >= 0 ? num_tokens >> block_shift_ : num_tokens / options_.block_size;
  }
  // Blocks that hold `num_tokens` tokens (the last one possibly partly filled).
  int32_t BlocksFor(int32_t num_tokens) const {
    return static_cast<int32_t>(
        block_shift_ >= 0 ? (int64_t{num_tokens} + options_.block_size - 1) >> block_shift_
                          : (int64_t{num_tokens} + options_.block_size - 1) / options_.block_size);
  }
  bool IsBlockBoundary(int32_t num_tokens) const {
    return block_shift_ >= 0 ? (num_tokens & (options_.block_size - 1)) == 0
                             : num_tokens % options_.block_size == 0;
  }
  const Sequence* FindSeq(SeqId seq) const;
  Sequence* FindSeq(SeqId seq);
  // Plans (const) and their application.
  // `hits`, when given, receives the prefix-hit block ids so Allocate need not look them up
  // again.
  absl::StatusOr<AdmissionPlan> PlanAllocate(SeqId seq, int32_t num_tokens,
                                             std::span<const BlockHash> block_hashes,
                                             const AllocateOptions& options,
                                             std::vector<BlockId>* hits) const;
  // AllocateOptions::window_tokens with -1 resolved.
  int32_t WindowOf(const AllocateOptions& options) const {
    return options.window_tokens < 0 ? options_.sliding_window_tokens : options.window_tokens;
  }
  absl::StatusOr<AdmissionPlan> PlanAppend(const Sequence& s, int32_t num_new_tokens) const;
  absl::Status NotFound(SeqId seq) const;

  // Takes one block: lowest free id, else evicts the least recently used cached block.
  // REQUIRES: AvailableBlocks() > 0.
  BlockId TakeBlock();
  // Appends `n` taken blocks to `out`: the lowest free ids (ascending), then evictions.
  // REQUIRES: AvailableBlocks() >= n.
  void TakeBlocks(int32_t n, std::vector<BlockId>* out);
  // Release() of every block of `blocks` (kNoBlock skipped), last to first.
  void ReleaseTailFirst(std::span<const BlockId> blocks);
  // Drops one reference; the block becomes cached (if indexed and not pinned), pinned or
  // free when the count reaches 0.
  void Release(BlockId block);
  // Adds a reference to a block found in the prefix index.
  void Reuse(BlockId block);
  // Offers the sequence's committed, hashed blocks not yet offered to the prefix index.
  [[gnu::always_inline]] inline void Register(Sequence& s);
  // Register's work, for blocks [s.num_registered, limit). REQUIRES: limit > num_registered.
  void RegisterUpTo(Sequence& s, int32_t limit);
  void ApplyWindow(Sequence& s);
  [[gnu::always_inline]] inline void Unindex(BlockId block);
  // Unindex's rare part: the kRemoved event, and a duplicate taking the block's place.
  void UnindexedWithEventsOrDuplicates(BlockId block, bool has_duplicates);
  // Takes the least recently used cached block out of the LRU list and the prefix index
  // and counts the eviction; the caller decides where it goes. REQUIRES: lru_size_ > 0.
  BlockId EvictLruHead();
  // EvictLruHead without the counts (lru_size_, evictions) and the ring's trimming, which
  // the caller does, once for a run of evictions.
  [[gnu::always_inline]] inline BlockId PopLruHead();
  void TrimLruRing();

  int32_t AcquireSlot();
  void ReleaseSlot(int32_t slot);

  // The LRU ring of cached blocks (below): push a released block, remove a reused one.
  [[gnu::always_inline]] inline void LruPushBack(BlockId block);
  [[gnu::always_inline]] inline void LruRemove(BlockId block);

  Options options_;
  int32_t block_shift_ = -1;  // log2(block_size) when a power of two, else -1

  // Per-block metadata, indexed by BlockId: what taking, releasing, evicting and indexing a
  // block touch, in one 16-byte record (four to a cache line, a MiB for 65,536 blocks).
  // The full hashes are apart (hash_): only indexing writes them and only lookups read them.
  static constexpr uint8_t kIndexed = 1;  // index_ maps hash_[b] to b
  // b holds the content of hash_[b], for which another block is indexed (in duplicates_).
  static constexpr uint8_t kDuplicate = 2;
  static constexpr uint8_t kInLru = 4;  // cached: its live entry is in lru_ring_
  // Indexed, and in-use duplicates of its content wait in duplicates_ to take over: only
  // then does unindexing it need its hash.
  static constexpr uint8_t kHasDuplicates = 8;
  struct BlockMeta {
    int32_t ref = 0;         // live sequences referencing the block, plus its holds
    uint32_t lru_stamp = 0;  // of its live entry in lru_ring_, where kInLru
    uint32_t tag = 0;        // BlockIndex::TagOf(hash_[b]), where kIndexed or kDuplicate
    uint16_t pins = 0;       // named pins holding it (at most kMaxPinsPerBlock)
    uint8_t flags = 0;       // kIndexed, kDuplicate, kInLru, kHasDuplicates
    uint8_t unused = 0;
  };
  static_assert(sizeof(BlockMeta) == 16);
  static constexpr int32_t kMaxPinsPerBlock = UINT16_MAX;
  bool IsIndexed(BlockId b) const { return (meta_[b].flags & kIndexed) != 0; }
  bool IsDuplicate(BlockId b) const { return (meta_[b].flags & kDuplicate) != 0; }
  // The index's view of the blocks' hashes.
  struct MetaHash {
    const BlockHash* hashes;
    const BlockHash& operator()(int32_t b) const { return hashes[b]; }
  };
  MetaHash HashOf() const { return MetaHash{hash_.data()}; }

  std::vector<BlockMeta> meta_;
  std::vector<BlockHash> hash_;  // valid where kIndexed or kDuplicate

  // The LRU list of cached blocks, as a FIFO of (block, stamp) in release order: the next
  // victim is the first live entry from lru_front_. Removing a block (a prefix hit, a pin)
  // only clears its kInLru flag; its entry goes stale and is skipped (an entry is live iff
  // its block is kInLru with the same stamp). Eviction reads the ring in order, so the
  // next victims are known in advance instead of chased through a linked list.
  struct LruEntry {
    BlockId block = kNoBlock;
    uint32_t stamp = 0;
  };
  bool LruEntryLive(const LruEntry& e) const {
    const BlockMeta& m = meta_[e.block];
    return (m.flags & kInLru) != 0 && m.lru_stamp == e.stamp;
  }
  // Drops the stale entries, keeping the order.
  void CompactLru();
  std::vector<LruEntry> lru_ring_;
  size_t lru_front_ = 0;
  // Stamps of pushed entries. 32 bits suffice: a stale entry is dropped (compaction or the
  // front passing it) long before 2^32 more pushes could reuse its stamp.
  uint32_t lru_clock_ = 0;
  int32_t lru_size_ = 0;  // live entries: the cached blocks
  FreeBlockSet free_;

  BlockIndex index_;
  // In-use duplicates of indexed blocks, by hash, with what a kStored event of theirs needs.
  struct Duplicate {
    BlockId block = kNoBlock;
    BlockHash parent;
    bool has_parent = false;
  };
  absl::flat_hash_map<BlockHash, std::vector<Duplicate>, BlockHashHasher> duplicates_;
  // A duplicate is freed: it no longer stands in for its hash.
  void DropDuplicate(BlockId block);

  // Sequences live in reusable slots so their vectors keep their capacity.
  std::vector<Sequence> slots_;
  std::vector<int32_t> free_slots_;
  SequenceTable seq_index_;  // live sequence id → its slot

  struct PinEntry {
    std::vector<BlockId> blocks;
  };
  absl::flat_hash_map<std::string, PinEntry> pins_;
  int32_t pinned_blocks_total_ = 0;  // distinct blocks with pin_count_ > 0

  // Hold's references, by block (each also counted in meta_[b].ref); few at a time, so
  // apart from the per-block records. kMaxHoldsPerBlock at most per block.
  absl::flat_hash_map<BlockId, uint16_t> holds_;
  int32_t holds_total_ = 0;  // the sum of holds_
  static constexpr int32_t kMaxHoldsPerBlock = UINT16_MAX;

  int32_t in_use_blocks_ = 0;
  int32_t pinned_idle_blocks_ = 0;  // ref 0 and pinned
  int64_t table_entries_ = 0;       // table_entries()

  LedgerStats counters_;
  std::vector<BlockEvent> events_;
  std::vector<BlockId> scratch_hits_;  // PlanAllocate → Allocate, reused across calls
};

}  // namespace kvcm
