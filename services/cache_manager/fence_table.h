#pragma once

// FenceTable: the cache manager's open fences (docs/architecture.md, "Fencing"), as plain
// values: no messages, no ledger, no clock. A fence holds the sequences of a router session
// that ended (or one sequence it freed with FreeOp.drain), renamed out of the routers' id
// space, until every executor session that existed then has acknowledged it. The table
// only decides; CacheManagerService (cache_manager_service.h) applies: it renames the
// sequences in the ledger to the draining ids Open() chose, keeps each executor session's
// list of the fences it waits in (SessionTable::Session::pending_fences), and frees the
// sequences of the fence Acknowledge() hands back.
//
// Contract:
// - Open() gives fence ids from 1 up and draining sequence ids from kFirstDrainingSeq up,
//   one per sequence, in order; neither is ever given twice. A fence waits for a non-empty
//   set of executors (with none, nothing can write, and the caller frees at once).
// - Acknowledge(id, executor) takes `executor` out of the fence's waiting set; the call
//   that empties it closes the fence and returns it, so its sequences are freed exactly
//   once. An unknown (or already closed) fence, or an executor it does not wait for,
//   changes nothing and returns nullopt.
// - Transfer(id, from, to): `from` registered again as `to` (the same writer), which now
//   waits in its place.
// - A fence over a whole ended router session (no router_seqs) counts its blocks as
//   reclaimed for its reason; a sequence fence (router_seqs: the router's ids, the router
//   living on) is the router's own free and counts nothing (count_reclaimed false).
//
// Thread safety: none; one thread (the service's) owns it.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "common/block/block_ledger.h"
#include "services/cache_manager/cache_manager_metrics.h"

namespace kvcm::cache_manager {

// Sequence ids from here up belong to sequences draining behind a fence; routers cannot
// allocate them.
inline constexpr SeqId kFirstDrainingSeq = SeqId{1} << 63;

class FenceTable {
 public:
  // The sequences of a router session that ended, waiting for the executors that may
  // still write them.
  struct Fence {
    uint64_t id = 0;
    uint64_t router_session = 0;
    ReclaimReason reason = ReclaimReason::kClientDied;
    std::vector<SeqId> seqs;                // their draining ids (>= kFirstDrainingSeq)
    absl::flat_hash_set<uint64_t> waiting;  // executor sessions yet to acknowledge
    // A sequence fence (FreeOp.drain): the router's ids of the sequences, the router living
    // on; empty for a fence over a whole ended router session.
    std::vector<SeqId> router_seqs;
    bool count_reclaimed = true;  // a drained free is the router's own, not a reclaim
  };

  // Opens a fence over `seqs` (router ids, renamed by the caller to the returned fence's
  // seqs, index by index) waiting for `waiting`. REQUIRES: !seqs.empty(), !waiting.empty().
  // The reference is valid until the next Open(), Acknowledge() or Transfer().
  const Fence& Open(uint64_t router_session, ReclaimReason reason, std::span<const SeqId> seqs,
                    std::vector<SeqId> router_seqs, absl::flat_hash_set<uint64_t> waiting);

  // See the contract: the closed fence when `executor` was the last it waited for.
  std::optional<Fence> Acknowledge(uint64_t id, uint64_t executor);

  // False (and nothing changed) unless fence `id` is open and waits for `from`.
  bool Transfer(uint64_t id, uint64_t from, uint64_t to);

  const Fence* Find(uint64_t id) const;
  int32_t size() const { return static_cast<int32_t>(fences_.size()); }
  // Every open fence by id (the order is the map's).
  const absl::flat_hash_map<uint64_t, Fence>& fences() const { return fences_; }

  static bool IsDraining(SeqId seq) { return seq >= kFirstDrainingSeq; }

 private:
  absl::flat_hash_map<uint64_t, Fence> fences_;
  uint64_t next_fence_id_ = 1;
  SeqId next_draining_seq_ = kFirstDrainingSeq;
};

}  // namespace kvcm::cache_manager
