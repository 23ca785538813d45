#pragma once

// GroupedLedger: the block ledger of a hybrid KV cache (docs/architecture.md, "The hybrid
// KV cache"). A model's layers fall into KV cache groups (common/sizing/kv_cache_groups.h):
// full attention, or one window size. Each sequence keeps one block table per group, all
// drawn from one pool of equal pages (one BlockLedger), so a block freed by one group serves
// any other. A window group gives back the blocks every future query has passed, while the
// full-attention groups keep theirs: for a Gemma-3-shaped model at 32K tokens about a fifth
// of the bytes of keeping every layer's KV.
//
// A sequence `seq` of this ledger is one sequence per group in the pool's ledger (with one
// group, `seq` itself: the ledger is then the pool's, call for call), which live and die
// together: the same tokens, the same commit point, tables of the same length
// (a window group's leading entries kNoBlock once released). Its block hashes are the
// caller's chained hashes (common/block/block_hash.h) for group 0 and, for group g > 0,
// GroupBlockHash(h, g): the same content in two groups is two different pages.
//
// Prefix hits (vLLM's hybrid coordinator): the hit is the longest prefix that every group
// can serve. A full-attention group needs every block before the hit point, matched from the
// left; a window group needs only the blocks its first computed query reads (those from the
// hit point - window + 1 on), matched from the right, so a window group's prefix survives
// the eviction of its older blocks. The common hit shrinks until every group serves it.
//
// Every call is all-or-nothing, as BlockLedger's: an op that fails changes nothing in any
// group (Allocate checks the capacity of every group before taking a block, and holds the
// blocks it will share so that another group's evictions cannot take them).
//
// Thread safety: none; one owner thread, as BlockLedger.

#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/block/block_hash.h"
#include "common/block/block_ledger.h"

namespace kvcm {

// Group g's hash of a block whose chained hash is `hash`: `hash` itself for group 0, else
// ChainBlockHash(algorithm, hash, {-1 - g}): a one-token "block" of a negative token, which
// no real block is, so no group's hash equals another's or a real block's.
BlockHash GroupBlockHash(HashAlgorithm algorithm, const BlockHash& hash, int32_t group);

// A sequence's tables, one per group, all of the same length.
struct GroupedTables {
  std::vector<std::vector<BlockId>> groups;
  int32_t num_cached_tokens = 0;  // Allocate: leading tokens whose KV every group has
};

struct GroupedAppendResult {
  std::vector<AppendResult> groups;
};

// Per group, beside the pool's LedgerStats.
struct GroupStats {
  int32_t window = 0;
  int64_t held_blocks = 0;       // table entries of live sequences that hold a block
  uint64_t window_released = 0;  // blocks its window gave back since construction
};

class GroupedLedger {
 public:
  struct Options {
    // The pool of pages. With one group its sliding_window_tokens is that group's window
    // (a BlockLedger's own); with more it must be 0: windows are per group.
    BlockLedger::Options pool;
    // Tokens each group attends within; 0 = full attention. Empty: one group of the pool's
    // window.
    std::vector<int32_t> group_windows;
    HashAlgorithm hash_algorithm = kDefaultHashAlgorithm;  // of GroupBlockHash
  };

  // INVALID_ARGUMENT on nonsense (BlockLedger::CheckOptions', a negative window, a pool
  // window beside more than one group, or one group whose window is not the pool's).
  static absl::StatusOr<GroupedLedger> Create(Options options);

  GroupedLedger(GroupedLedger&&) = default;
  GroupedLedger& operator=(GroupedLedger&&) = default;

  int32_t num_groups() const { return static_cast<int32_t>(options_.group_windows.size()); }
  // Tokens each group attends within; 0 = full attention.
  const std::vector<int32_t>& group_windows() const { return options_.group_windows; }
  int32_t block_size() const { return pool_.block_size(); }
  int32_t num_blocks() const { return pool_.num_blocks(); }
  const BlockLedger& pool() const { return pool_; }

  // BlockLedger's calls, for every group at once; errors as BlockLedger's, for `seq`.
  //
  // With one group every call is the pool's own, on the caller's sequence ids and hashes:
  // a GroupedLedger of one group is a BlockLedger, at the same cost; but one group under a
  // window (every layer windowed, as Mistral 7B v0.1's) has its prefix hits matched from the
  // right as any window group's (Allocate, CanAllocate, Lookup, ReusableBlocks). With more,
  // sequence calls fan out to every group's pool sequence and block calls go to the pool.
  absl::Status Allocate(SeqId seq, int32_t num_tokens, std::span<const BlockHash> block_hashes,
                        GroupedTables* result);
  // The same, as a Step reply carries it: group 0's table in `result`, groups 1..'s tables
  // one after another in `group_blocks` (cleared; left empty with one group).
  absl::Status Allocate(SeqId seq, int32_t num_tokens, std::span<const BlockHash> block_hashes,
                        AllocateResult* result, std::vector<BlockId>* group_blocks);
  // Dry run: the blocks every group together would take, the common hit in blocks
  // (prefix_hit_blocks) and the evictions.
  absl::StatusOr<AdmissionPlan> CanAllocate(SeqId seq, int32_t num_tokens,
                                            std::span<const BlockHash> block_hashes) const;
  absl::Status Append(SeqId seq, int32_t num_new_tokens, GroupedAppendResult* result);
  // The same, as a Step reply carries it: group 0's new blocks in `result`, every group's
  // copy orders in result->copies, groups 1..'s new blocks one after another in
  // `group_blocks` (cleared; left empty with one group).
  absl::Status Append(SeqId seq, int32_t num_new_tokens, AppendResult* result,
                      std::vector<BlockId>* group_blocks);
  absl::Status Fork(SeqId parent, SeqId child);
  absl::Status Commit(SeqId seq, int32_t num_committed_tokens,
                      std::span<const BlockHash> new_block_hashes = {});
  absl::Status Free(SeqId seq);
  // Gives a live sequence another id (every group's tables move with it).
  absl::Status Rename(SeqId seq, SeqId new_id);

  absl::Status SetOwner(SeqId seq, uint64_t owner);
  uint64_t OwnerOf(SeqId seq) const;
  // fn(seq, owner) for every live sequence (its caller's id), in no particular order.
  template <typename Fn>
  void ForEachSequence(Fn&& fn) const {
    if (num_groups() == 1) {
      pool_.ForEachSequence(fn);
      return;
    }
    for (const auto& [seq, first] : first_of_) fn(seq, pool_.OwnerOf(first));
  }

  // Leading blocks of `block_hashes` every group has cached now (the common hit, without
  // Allocate's rule that a hit never covers the last token).
  int32_t Lookup(std::span<const BlockHash> block_hashes) const;
  // Leading blocks Allocate(seq, num_tokens, block_hashes) would find in every group now.
  int32_t ReusableBlocks(int32_t num_tokens, std::span<const BlockHash> block_hashes) const;
  // Pins every group's blocks of `block_hashes` under `name`: each must be cached in every
  // group, window groups included (simple, and stricter than the hit needs).
  absl::Status Pin(const std::string& name, std::span<const BlockHash> block_hashes);
  absl::Status Unpin(const std::string& name) { return pool_.Unpin(name); }
  absl::Status Hold(BlockId block) { return pool_.Hold(block); }
  absl::Status Unhold(BlockId block) { return pool_.Unhold(block); }
  int32_t held_blocks() const { return pool_.held_blocks(); }
  int32_t RefCount(BlockId block) const { return pool_.RefCount(block); }
  BlockState StateOf(BlockId block) const { return pool_.StateOf(block); }
  int32_t EvictAllCached() { return pool_.EvictAllCached(); }

  bool IsLive(SeqId seq) const {
    return num_groups() == 1 ? pool_.IsLive(seq) : first_of_.contains(seq);
  }
  absl::StatusOr<GroupedTables> BlockTables(SeqId seq) const;
  // Group 0's table, tokens and commit point (every group's are the same length and count).
  absl::StatusOr<std::vector<BlockId>> BlockTable(SeqId seq) const;
  absl::StatusOr<int32_t> NumTokens(SeqId seq) const;
  absl::StatusOr<int32_t> NumCommittedTokens(SeqId seq) const;
  // The pool's, counting this ledger's sequences, prompts and refusals (not each group's).
  LedgerStats Stats() const;
  // Window and counters by group. O(groups): no table is read.
  std::vector<GroupStats> PerGroupStats() const;
  // Table entries of live sequences that hold a block, by group (GroupStats::held_blocks;
  // with one group, the pool's BlockLedger::table_entries()). Kept as the tables change:
  // O(groups).
  std::vector<int64_t> HeldBlocksByGroup() const {
    return num_groups() == 1 ? std::vector<int64_t>{pool_.table_entries()} : table_entries_;
  }
  // Blocks each group's window released since construction, by group (with one group, the
  // pool's counter: LedgerStats::window_released). O(groups).
  std::vector<uint64_t> WindowReleasedByGroup() const {
    return num_groups() == 1 ? std::vector<uint64_t>{pool_.Stats().window_released}
                             : window_released_;
  }
  int32_t AvailableBlocks() const { return pool_.AvailableBlocks(); }
  std::vector<BlockEvent> TakeEvents() { return pool_.TakeEvents(); }
  std::vector<std::pair<BlockId, BlockHash>> IndexedBlocks() const { return pool_.IndexedBlocks(); }
  void FillBlockMap(int32_t max_cells, std::span<const std::pair<BlockId, MapState>> held_apart,
                    BlockMap* out) const {
    pool_.FillBlockMap(max_cells, held_apart, out);
  }

  // The pool's invariants, and that every sequence's groups are all live with the same
  // tokens, commit point and table length, and its window groups hold nothing their window
  // has passed. INTERNAL naming the first broken rule.
  absl::Status CheckInvariants() const;

 private:
  GroupedLedger(Options options, BlockLedger pool);

  // The pool ledger's id of group g of a sequence whose first id is `first`.
  static SeqId IdOf(SeqId first, int32_t group) { return first + static_cast<SeqId>(group); }
  // The pool's id of group 0 of `seq`: `seq` itself with one group.
  absl::StatusOr<SeqId> FirstOf(SeqId seq) const;
  // Group g's hashes of `block_hashes`, into hashes_[g].
  void DeriveHashes(std::span<const BlockHash> block_hashes) const;
  // The common hit of a prompt (in blocks) over hashes_, at most `matchable`.
  int32_t CommonHit(int32_t matchable) const;
  // Leading blocks a group of `window` tokens no longer reads once `hit` blocks are cached.
  int32_t ReleasedAt(int32_t window, int32_t hit) const;
  // One group, under a window: its prefix hits are matched from the right.
  bool OneWindowGroup() const { return num_groups() == 1 && options_.group_windows[0] > 0; }
  // With OneWindowGroup(): how Allocate(_, num_tokens, block_hashes) shares the pool's
  // cached blocks: past the leading blocks its hit no longer reads, the hit.
  AllocateOptions OneWindowHit(int32_t num_tokens, std::span<const BlockHash> block_hashes) const;
  // Blocks [released, hit) of group g are in the pool's prefix index.
  bool GroupServes(int32_t group, int32_t hit) const;
  // The plan of an Allocate over every group: new blocks, and the cached ones it reuses.
  struct Plan {
    int32_t hit = 0;
    int32_t blocks_needed = 0;
    int32_t reused_from_lru = 0;
  };
  absl::StatusOr<Plan> PlanAllocate(SeqId seq, int32_t num_tokens,
                                    std::span<const BlockHash> block_hashes) const;
  // Runs `op` (a call on the pool for group g) and adds the change of the pool's table
  // entries to group g's count; returns what `op` returned.
  template <typename Op>
  absl::Status CountEntries(int32_t group, Op&& op) {
    const int64_t before = pool_.table_entries();
    absl::Status status = op();
    table_entries_[static_cast<size_t>(group)] += pool_.table_entries() - before;
    return status;
  }
  // OK when every group of the sequence whose group 0 is `first` can grow by the tokens.
  absl::Status CanAppendGroups(SeqId first, SeqId seq, int32_t num_new_tokens) const;
  // Allocate over more than one group: group g's table into scratch_ and then `take`(g).
  template <typename Take>
  absl::Status AllocateGroups(SeqId seq, int32_t num_tokens,
                              std::span<const BlockHash> block_hashes, Take&& take);

  Options options_;
  BlockLedger pool_;
  absl::flat_hash_map<SeqId, SeqId> first_of_;  // sequence -> its group 0's pool id
  SeqId next_first_ = 1;
  std::vector<uint64_t> window_released_;  // per group
  std::vector<int64_t> table_entries_;     // per group, with more than one: HeldBlocksByGroup
  uint64_t allocation_failures_ = 0;       // refused by the groups' plan, unseen by the pool
  // Scratch of the calls, kept for its capacity.
  mutable std::vector<std::vector<BlockHash>> hashes_;
  std::vector<BlockId> held_;
  AllocateResult scratch_;
  AppendResult append_scratch_;
};

}  // namespace kvcm
