#pragma once

// GroupedLedger: the block ledger of a hybrid KV cache (docs/architecture.md, "The hybrid
// KV cache"). A model's layers fall into KV cache groups (common/sizing/kv_cache_groups.h):
// full attention, or one window size. Each sequence keeps one block table per group, all
// drawn from one pool of equal pages (one BlockLedger), so a block freed by one group serves
// any other. A window group gives back the blocks every future query has passed, while the
// full-attention groups keep theirs: for a Gemma-3-shaped model at 32K tokens about a fifth
// of the bytes of keeping every layer's KV.
//
// A sequence `seq` of this ledger is one sequence per group in the pool's ledger, which
// live and die together: the same tokens, the same commit point, tables of the same length
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
    // The pool of pages. Its sliding_window_tokens must be 0: windows are per group.
    BlockLedger::Options pool;
    // Tokens each group attends within; 0 = full attention. At least one group.
    std::vector<int32_t> group_windows;
    HashAlgorithm hash_algorithm = kDefaultHashAlgorithm;  // of GroupBlockHash
  };

  // INVALID_ARGUMENT on nonsense (BlockLedger::CheckOptions', no groups, a negative window,
  // a pool window).
  static absl::StatusOr<GroupedLedger> Create(Options options);

  GroupedLedger(GroupedLedger&&) = default;
  GroupedLedger& operator=(GroupedLedger&&) = default;

  int32_t num_groups() const { return static_cast<int32_t>(options_.group_windows.size()); }
  int32_t block_size() const { return pool_.block_size(); }
  const BlockLedger& pool() const { return pool_; }

  // BlockLedger's calls, for every group at once; errors as BlockLedger's, for `seq`.
  absl::Status Allocate(SeqId seq, int32_t num_tokens, std::span<const BlockHash> block_hashes,
                        GroupedTables* result);
  // Dry run: the blocks every group together would take, the common hit in blocks
  // (prefix_hit_blocks) and the evictions.
  absl::StatusOr<AdmissionPlan> CanAllocate(SeqId seq, int32_t num_tokens,
                                            std::span<const BlockHash> block_hashes) const;
  absl::Status Append(SeqId seq, int32_t num_new_tokens, GroupedAppendResult* result);
  absl::Status Fork(SeqId parent, SeqId child);
  absl::Status Commit(SeqId seq, int32_t num_committed_tokens,
                      std::span<const BlockHash> new_block_hashes = {});
  absl::Status Free(SeqId seq);

  // Leading blocks Allocate(seq, num_tokens, block_hashes) would find in every group now.
  int32_t ReusableBlocks(int32_t num_tokens, std::span<const BlockHash> block_hashes) const;

  bool IsLive(SeqId seq) const { return first_of_.contains(seq); }
  absl::StatusOr<GroupedTables> BlockTables(SeqId seq) const;
  std::vector<GroupStats> Stats() const;
  int32_t AvailableBlocks() const { return pool_.AvailableBlocks(); }

  // The pool's invariants, and that every sequence's groups are all live with the same
  // tokens, commit point and table length, and its window groups hold nothing their window
  // has passed. INTERNAL naming the first broken rule.
  absl::Status CheckInvariants() const;

 private:
  GroupedLedger(Options options, BlockLedger pool);

  // The pool ledger's id of group g of a sequence whose first id is `first`.
  static SeqId IdOf(SeqId first, int32_t group) { return first + static_cast<SeqId>(group); }
  absl::StatusOr<SeqId> FirstOf(SeqId seq) const;
  // Group g's hashes of `block_hashes`, into hashes_[g].
  void DeriveHashes(std::span<const BlockHash> block_hashes) const;
  // The common hit of a prompt (in blocks) over hashes_, at most `matchable`.
  int32_t CommonHit(int32_t matchable) const;
  // Leading blocks a group of `window` tokens no longer reads once `hit` blocks are cached.
  int32_t ReleasedAt(int32_t window, int32_t hit) const;
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

  Options options_;
  BlockLedger pool_;
  absl::flat_hash_map<SeqId, SeqId> first_of_;  // sequence -> its group 0's pool id
  SeqId next_first_ = 1;
  std::vector<uint64_t> window_released_;  // per group
  // Scratch of the calls, kept for its capacity.
  mutable std::vector<std::vector<BlockHash>> hashes_;
  std::vector<BlockId> held_;
  AllocateResult scratch_;
};

}  // namespace kvcm
