#pragma once
// TierCoordinator: what the tiers (tiers/kv_tiers.h) ask of the block ledger, on the ledger
// thread (docs/architecture.md, "Tiers"). CacheManagerService owns one when tiers are on and
// calls it at four points:
//
// - OnEvents(): after every change of the ledger, with the events it recorded. A block that
//   entered the prefix index is written through to the tiers: the coordinator holds it in
//   the ledger (BlockLedger::Hold) until the mover has read it, so that it is never handed
//   to a new owner during the copy.
// - BeforeAllocate(): an Allocate whose prefix the tiers hold beyond the pool starts a
//   prefetch and is refused UNAVAILABLE (the router sends it again in a later step; the
//   request waits in its queue, never the step loop). A prefetch is a sequence of the cache
//   manager's own (ids from kFirstPrefetchSeq, owned by no session) allocated with the
//   prefix's hashes: its leading blocks are the pool's hits, the rest fresh blocks the mover
//   loads. When every load is done (or failed) the sequence commits the blocks loaded
//   without a gap from the start and is freed, so they become cached and matchable; never
//   before, so a sequence never reads a block a tier did not finish writing. The Allocate
//   that comes again then finds them as ordinary prefix hits. One that comes again past
//   Options::load_timeout is served with what arrived and computes the rest.
// - MakeRoom(): before a Step runs, if the pool may not have the blocks it asks for, the
//   stores not yet started are dropped and their blocks unheld: a copy never makes an
//   allocation wait or fail.
// - Poll(): the movers' results (the eventfd KvTiers::wake_fd() is readable).
//
// Thread safety: none; the service's thread.

#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/block/block_hash.h"
#include "common/block/block_ledger.h"
#include "common/block/grouped_ledger.h"
#include "services/cache_manager/fence_table.h"
#include "services/cache_manager/tiers/kv_tiers.h"

namespace kvcm {
struct BlockOp;    // common/wire/step_codec.h
struct OpOutcome;  // common/wire/step_codec.h
}  // namespace kvcm

namespace kvcm::cache_manager {

// The prefetch sequences' ids: reserved for the cache manager (above the draining ids'
// start, which routers cannot use), far above any draining id it will ever give.
inline constexpr SeqId kFirstPrefetchSeq = kFirstDrainingSeq + (SeqId{1} << 62);

class TierCoordinator {
 public:
  struct Options {
    absl::Duration load_timeout = absl::Seconds(2);
    // The token ids the commits brought for a pool block (VllmConverter::CommitTokens), or
    // null: a stored block's lineage, kept in T2's slot header and announced by the
    // vLLM-format events. Unset: no tokens.
    std::function<const std::vector<int32_t>*(BlockId)> commit_tokens;
  };

  // `tiers` and `ledger` outlive the coordinator.
  TierCoordinator(tiers::KvTiers* tiers, GroupedLedger* ledger, Options options);

  // Write-through of the blocks `events` stored (see the header comment).
  void OnEvents(std::span<const BlockEvent> events);

  // For an Allocate about to run: nullopt to run it; otherwise the UNAVAILABLE status to
  // answer it with (`outcome`'s tier counts set), while its prefix loads. An Allocate that
  // runs after a prefetch of its prefix gets the tier counts of what was loaded.
  std::optional<absl::Status> BeforeAllocate(const BlockOp& op, absl::Time now, OpOutcome* outcome);

  // Drops queued stores when the pool may lack the blocks `ops` could take.
  void MakeRoom(std::span<const BlockOp> ops);

  // Applies the movers' results. True when the ledger changed (events to take).
  bool Poll(absl::Time now);

  // Hands the stores and loads staged since the last call to the movers (KvTiers::Flush).
  // The service's owner calls it once the reply that staged them is sent, so that the
  // movers' wake-up and copies do not delay that reply; the holds were taken already.
  void Flush() { tiers_->Flush(); }

  // Pool blocks held for stores now; prefetches loading and their blocks.
  int32_t held_blocks() const { return held_; }
  int32_t loading_prefetches() const;
  int32_t loading_blocks() const { return loading_blocks_; }
  tiers::KvTiers& tiers() { return *tiers_; }
  const tiers::KvTiers& tiers() const { return *tiers_; }

 private:
  struct Prefetch {
    SeqId seq = 0;
    int32_t pool_blocks = 0;          // leading blocks that were in the pool already
    int32_t blocks = 0;               // pool_blocks + the blocks to load
    std::vector<int8_t> state;        // per loaded block: 0 loading, 1 loaded, -1 failed
    std::vector<tiers::Tier> source;  // per loaded block: the tier it comes from
    int32_t pending = 0;
    int32_t host_blocks = 0;  // of the loads, from each tier
    int32_t disk_blocks = 0;
    absl::Time deadline;
    absl::Time done_at = absl::InfiniteFuture();
    bool done() const { return pending == 0; }
  };
  // Commits what loaded without a gap, frees the sequence.
  void Finish(Prefetch& prefetch, absl::Time now);

  tiers::KvTiers* const tiers_;
  GroupedLedger* const ledger_;
  const Options options_;
  int32_t held_ = 0;
  int32_t loading_blocks_ = 0;
  SeqId next_seq_ = kFirstPrefetchSeq;
  // By the hash of the prefix's last block to load (it names the whole prefix).
  absl::flat_hash_map<BlockHash, Prefetch, BlockHashHasher> prefetches_;
  absl::flat_hash_map<SeqId, BlockHash> by_seq_;
  std::vector<tiers::KvTiers::Done> done_;  // Poll's scratch
  // OnEvents' scratch: hashes removed later in the events, and which kStored are stale.
  absl::flat_hash_set<BlockHash, BlockHashHasher> removed_later_;
  std::vector<bool> stale_;
};

}  // namespace kvcm::cache_manager
