#pragma once
// The cache-manager protocol's StatsReply (schemas/kvcm_protocol.fbs: StatsReply,
// SessionSummary) as plain values, and the one codec between them and the wire. The cache
// manager fills a StatsSnapshot and encodes it; the client, kvcmctl and the router's
// dashboard read the decoded one.
//
//   const auto payload = EncodeStatsReply(builder, snapshot);               // cache manager
//   KVCM_ASSIGN_OR_RETURN(StatsSnapshot s, DecodeStatsReply(*reply));       // client
//
// Its own library (kvcm_stats_codec): StatsSnapshot names the pool's backend
// (common/memory), which kvcm_wire does not depend on.
//
// Thread safety: stateless functions.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/memory/pool_memory.h"
#include "common/sizing/kv_cache_spec.h"
#include "flatbuffers/flatbuffers.h"
#include "schemas/kvcm_protocol_generated.h"

namespace kvcm {

// One open session (StatsReply.session_list).
struct SessionListing {
  uint64_t session_id = 0;
  wire::Role role = wire::Role::Unknown;
  int32_t pid = 0;
  bool pid_verified = false;  // the kernel vouched for the pid (ipc://)
  std::string name;
  bool quarantined = false;
  int32_t sequences = 0;
  int32_t pending_fences = 0;
  friend bool operator==(const SessionListing&, const SessionListing&) = default;
};

// One tier below the pool that is on (StatsReply.tiers; docs/architecture.md, "Tiers").
struct TierListing {
  std::string name;             // "host" or "disk"
  int32_t capacity_blocks = 0;  // block slots
  int32_t ready_blocks = 0;     // slots holding a loadable block
  int32_t writing_blocks = 0;   // slots a mover is writing
  uint64_t stored_total = 0;    // blocks written into the tier since the start
  uint64_t loaded_total = 0;    // blocks loaded from it into the pool
  uint64_t evicted_total = 0;   // ready slots reused for another block
  friend bool operator==(const TierListing&, const TierListing&) = default;
};

// StatsReply as a plain struct; the comments carry the cache manager's definitions.
// The six block states partition the pool:
//   free + (in_use - quarantined - draining) + quarantined + draining + cached + pinned
//   == num_blocks.
struct StatsSnapshot {
  int32_t num_blocks = 0;
  int32_t block_size = 0;
  int32_t free_blocks = 0;
  int32_t in_use_blocks = 0;       // ref count > 0; includes quarantined_blocks
  int32_t cached_blocks = 0;       // ref count 0, full, hashed, evictable
  int32_t pinned_blocks = 0;       // kept cached on purpose (Pin)
  int32_t quarantined_blocks = 0;  // held by a hung client; never handed out
  int32_t draining_blocks = 0;     // of an ended router, fenced; in in_use_blocks
  uint32_t open_fences = 0;        // fences waiting for an executor's acknowledgement
  int32_t live_sequences = 0;
  double usage_ratio = 0;            // in_use / num_blocks (cached and pinned not counted)
  double occupancy_ratio = 0;        // (in_use + cached + pinned) / num_blocks = 1 - free share
  uint64_t prefix_query_tokens = 0;  // prompt tokens of successful Allocate ops
  uint64_t prefix_hit_tokens = 0;    // of those, found cached
  uint64_t blocks_allocated = 0;
  uint64_t blocks_released = 0;
  uint64_t evictions = 0;
  uint64_t allocation_failures = 0;
  uint64_t cow_copies = 0;
  uint64_t epoch = 0;
  uint32_t sessions = 0;
  uint64_t events_published = 0;
  PoolBackend backend = PoolBackend::kShm;
  uint64_t pool_bytes = 0;
  uint64_t block_bytes = 0;
  KvCacheSpec spec;
  double uptime_seconds = 0;
  uint64_t rejected_messages = 0;
  std::string events_endpoint;  // where the KV events are published ("" if not reported)
  std::string metrics_url;      // the cache manager's /metrics ("" if not reported)
  std::vector<SessionListing> session_list;  // by ascending id
  // The tiers that are on, host before disk; empty without tiers (then the four below are 0).
  std::vector<TierListing> tiers;
  int32_t tier_held_blocks = 0;        // pool blocks held while a mover copies them out
  int32_t tier_loading_blocks = 0;     // pool blocks of prefetches waiting for their loads
  uint64_t tier_refusals_total = 0;    // disk slots not served, every reason
  uint64_t tier_recovered_blocks = 0;  // disk blocks found valid at start

  // prefix_hit_tokens / prefix_query_tokens; 0 before any query.
  double prefix_hit_rate() const {
    return prefix_query_tokens == 0
               ? 0.0
               : static_cast<double>(prefix_hit_tokens) / static_cast<double>(prefix_query_tokens);
  }
  friend bool operator==(const StatsSnapshot&, const StatsSnapshot&) = default;
};

// The pool backend on the wire and back; a value outside the enum reads as shm, as the
// client always read it.
wire::PoolBackend PoolBackendToWire(PoolBackend backend);
PoolBackend PoolBackendFromWire(wire::PoolBackend backend);

// Appends a StatsReply of `stats` to `builder` (before the envelope's root is started).
flatbuffers::Offset<wire::StatsReply> EncodeStatsReply(flatbuffers::FlatBufferBuilder& builder,
                                                       const StatsSnapshot& stats);

// The values of a verified StatsReply. An absent spec, string or list reads as its default;
// INTERNAL "StatsReply: ..." for a spec FromWire refuses (the client adds "cache manager
// protocol error: ").
absl::StatusOr<StatsSnapshot> DecodeStatsReply(const wire::StatsReply& reply);

}  // namespace kvcm
