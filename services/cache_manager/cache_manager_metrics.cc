#include "services/cache_manager/cache_manager_metrics.h"

#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "common/base/check.h"
#include "common/base/mutex.h"
#include "common/metrics/scrape_registry.h"
#include "prometheus/collectable.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/histogram.h"
#include "prometheus/metric_family.h"
#include "prometheus/registry.h"

namespace kvcm::cache_manager {
namespace {

using prometheus::MetricType;

// --- The cache manager's metrics: the one list ---------------------------------------------
// Snapshot metrics (built at scrape time from one CacheManagerSnapshot) first, then event
// metrics (updated as things happen). Specs() returns them in this order.

constexpr MetricSpec kCapacityBlocks{"kvcm_cache_capacity_blocks", MetricType::Gauge, "",
                                     "Blocks in the KV-cache pool. Fixed at start-up."};
constexpr MetricSpec kBlocks{
    "kvcm_cache_blocks", MetricType::Gauge, "state",
    "Blocks by state, from one snapshot, so the states sum to kvcm_cache_capacity_blocks: "
    "free (holds nothing), in_use (referenced by a live sequence of a healthy session), "
    "cached (reusable prefix, evictable), pinned (reusable prefix, never evicted), "
    "quarantined (held only by hung sessions; unusable until they are proven dead), "
    "draining (released by a router that ended while an executor may still write them; "
    "handed out again once every such executor acknowledged the fence or died)."};
constexpr MetricSpec kUsageRatio{
    "kvcm_cache_usage_ratio", MetricType::Gauge, "",
    "In-use blocks (quarantined and draining included) / capacity: the share of the pool that "
    "cannot be "
    "handed out without ending a sequence. Cached and pinned blocks do not count, as in "
    "vLLM's kv_cache_usage_perc."};
constexpr MetricSpec kOccupancyRatio{
    "kvcm_cache_occupancy_ratio", MetricType::Gauge, "",
    "(In use + cached + pinned blocks) / capacity: the share of the pool holding KV, "
    "reusable prefixes included. 1 - free share."};
constexpr MetricSpec kPoolBytes{"kvcm_cache_pool_bytes", MetricType::Gauge, "",
                                "Bytes of KV-cache pool memory: all blocks, all layers, K and V."};
constexpr MetricSpec kInfo{
    "kvcm_cache_info", MetricType::Gauge, "block_size,block_bytes,dtype,backend,hash_algorithm",
    "Always 1; the labels describe the pool: tokens per block, bytes per block, KV dtype, "
    "memory backend and block hash algorithm."};
constexpr MetricSpec kLiveSequences{"kvcm_cache_live_sequences", MetricType::Gauge, "",
                                    "Sequences holding blocks (allocated and not yet freed)."};
constexpr MetricSpec kBlockAllocations{
    "kvcm_cache_block_allocations_total", MetricType::Counter, "",
    "Blocks taken from the pool for sequences, from the free set or by evicting a cached "
    "block. Prefix hits share blocks and do not count."};
constexpr MetricSpec kBlockReleases{
    "kvcm_cache_block_releases_total", MetricType::Counter, "",
    "Block references dropped that left the block unreferenced (it became cached or free)."};
constexpr MetricSpec kBlockEvictions{
    "kvcm_cache_block_evictions_total", MetricType::Counter, "",
    "Cached blocks evicted (least recently used first) to make room for an allocation."};
constexpr MetricSpec kCowCopies{
    "kvcm_cache_cow_copies_total", MetricType::Counter, "",
    "Copy-on-write block copies ordered: an append into a shared, partly filled block."};
constexpr MetricSpec kPrefixQueryTokens{
    "kvcm_cache_prefix_query_tokens_total", MetricType::Counter, "",
    "Prompt tokens of successful allocations, looked up in the prefix cache."};
constexpr MetricSpec kPrefixHitTokens{
    "kvcm_cache_prefix_hit_tokens_total", MetricType::Counter, "",
    "Of kvcm_cache_prefix_query_tokens_total, tokens whose KV was already cached. "
    "Hit ratio = rate(hit) / rate(query)."};
constexpr MetricSpec kAllocationFailures{
    "kvcm_cache_allocation_failures_total", MetricType::Counter, "",
    "Allocations and appends refused for lack of free or evictable blocks."};
constexpr MetricSpec kWindowReleasedBlocks{
    "kvcm_cache_window_released_blocks_total", MetricType::Counter, "",
    "Blocks released because they slid wholly out of the model's attention window."};
constexpr MetricSpec kGroupWindowReleasedBlocks{
    "kvcm_cache_group_window_released_blocks_total", MetricType::Counter, "group,window",
    "Of kvcm_cache_window_released_blocks_total, those of each KV cache group (window in "
    "tokens, 0 for full attention); without groups one group, the pool's window."};
constexpr MetricSpec kGroupHeldBlocks{
    "kvcm_cache_group_held_blocks", MetricType::Gauge, "group,window",
    "Block table entries of live sequences that hold a block, by KV cache group (window in "
    "tokens, 0 for full attention; a block shared by n sequences counts n times). A window "
    "group holds about window / block_size + 2 per decoding sequence, a full group all of "
    "its blocks; without groups one group, the pool's window."};
constexpr MetricSpec kSessions{"kvcm_cache_manager_sessions", MetricType::Gauge, "role",
                               "Live client sessions, by role."};
constexpr MetricSpec kEpoch{
    "kvcm_cache_manager_epoch", MetricType::Gauge, "",
    "This cache manager's epoch; it changes at each start, and executors reattach when it "
    "does."};
constexpr MetricSpec kOpenFences{
    "kvcm_cache_manager_open_fences", MetricType::Gauge, "",
    "Fences waiting for an executor: each holds the blocks of a router that ended as "
    "draining until every executor that may still write them acknowledged or died."};
constexpr MetricSpec kEventsPublished{
    "kvcm_cache_manager_events_published_total", MetricType::Counter, "",
    "KV events published (BlockStored, BlockRemoved, AllBlocksCleared)."};
constexpr MetricSpec kRequests{"kvcm_cache_manager_requests_total", MetricType::Counter, "type",
                               "Requests handled, by message type."};
constexpr MetricSpec kRequestDuration{
    "kvcm_cache_manager_request_duration_seconds", MetricType::Histogram, "type",
    "Time to handle a request, from receipt to reply, by message type."};
constexpr MetricSpec kRejectedMessages{
    "kvcm_cache_manager_rejected_messages_total", MetricType::Counter, "reason",
    "Inbound messages refused, by reason; a refused message changes nothing."};
constexpr MetricSpec kReclaimedBlocks{
    "kvcm_cache_manager_reclaimed_blocks_total", MetricType::Counter, "reason",
    "Blocks returned to the pool when a session ended, by reason: its client died, said "
    "goodbye, or was replaced by a new session of the same client."};
constexpr MetricSpec kReplayedSteps{
    "kvcm_cache_manager_replayed_steps_total", MetricType::Counter, "",
    "Steps sent again with the request id of one already applied (a client's retry after a "
    "timeout), answered with the first reply without running their ops twice."};
constexpr MetricSpec kUndeliveredReplies{
    "kvcm_cache_manager_undelivered_replies_total", MetricType::Counter, "reason",
    "Replies that could not be handed to their client: it disconnected (peer_gone) or had "
    "stopped reading (queue_full). A client learns a lost Step's outcome by retrying it or "
    "with DescribeSession."};
constexpr MetricSpec kProcessWatches{
    "kvcm_cache_manager_process_watches_total", MetricType::Counter, "source",
    "Client processes watched for death, by where their pidfd came from: taken when the "
    "connection was accepted (connect_pidfd, Linux 6.5+) or opened by pid at Hello "
    "(pid_lookup)."};
constexpr MetricSpec kSilentConnections{
    "kvcm_cache_manager_silent_connections_closed_total", MetricType::Counter, "",
    "Connections closed because they made no valid request within --hello-timeout-ms of being "
    "accepted (each held a descriptor; a client that means it connects again and speaks)."};
constexpr MetricSpec kAccepting{
    "kvcm_cache_manager_accepting_connections", MetricType::Gauge, "",
    "1 while new connections are accepted; 0 while too few file descriptors are left under "
    "RLIMIT_NOFILE (the sessions already connected are still served)."};

constexpr MetricSpec kVllmEvents{
    "kvcm_cache_manager_vllm_events_published_total", MetricType::Counter, "type",
    "Events of the vLLM-format KV event stream (--kv-events-endpoint) published, by type "
    "(block_stored, block_removed, all_blocks_cleared); 0 while the stream is off."};
constexpr MetricSpec kVllmBatches{
    "kvcm_cache_manager_vllm_batches_published_total", MetricType::Counter, "",
    "Batches of the vLLM-format KV event stream published (one sequence number each)."};
constexpr MetricSpec kVllmPublishFailures{
    "kvcm_cache_manager_vllm_publish_failures_total", MetricType::Counter, "",
    "Batches of the vLLM-format stream its PUB socket refused (they stay in the replay "
    "buffer). A subscriber too slow for the PUB's high-water mark loses batches without "
    "this count knowing it; it sees the gap in the sequence numbers and replays."};
constexpr MetricSpec kVllmReplayRequests{
    "kvcm_cache_manager_vllm_replay_requests_total", MetricType::Counter, "result",
    "Requests on the vLLM-format replay socket (--kv-events-replay-endpoint): answered "
    "(served) or refused as malformed (wrong frame count, a sequence number not 8 bytes)."};
constexpr MetricSpec kVllmReplayedBatches{
    "kvcm_cache_manager_vllm_batches_replayed_total", MetricType::Counter, "",
    "Batches sent again from the replay buffer to a subscriber that asked."};
constexpr MetricSpec kVllmBufferBatches{
    "kvcm_cache_manager_vllm_buffer_batches", MetricType::Gauge, "",
    "Batches held for replay (at most --kv-events-buffer-steps)."};
constexpr MetricSpec kVllmSubscriptions{
    "kvcm_cache_manager_vllm_subscriptions_total", MetricType::Counter, "",
    "Subscriptions the vLLM-format PUB received (a consumer connecting or reconnecting); "
    "each is answered with the latest batch, so that the consumer sees where the stream is."};
constexpr MetricSpec kVllmBlocksWithoutTokens{
    "kvcm_cache_manager_vllm_blocks_without_tokens_total", MetricType::Counter, "",
    "Blocks stored without the token ids a vLLM-format event needs (a router that did not "
    "send them at Commit, or a tier block written without them), left out of that stream "
    "with their later removal."};

// The host (T1) and disk (T2) tiers (tiers/kv_tiers.h, docs/architecture.md "Tiers"). Like
// the vLLM stream's, these are exported from start-up, at 0 while the tiers are off.
constexpr MetricSpec kTierCapacityBlocks{
    "kvcm_cache_manager_tier_capacity_blocks", MetricType::Gauge, "tier",
    "Block slots of each tier below the pool (host: --host-tier-bytes, disk: "
    "--disk-tier-bytes); 0 for a tier that is off."};
constexpr MetricSpec kTierBlocks{
    "kvcm_cache_manager_tier_blocks", MetricType::Gauge, "tier,state",
    "Slots of each tier holding a block: ready (written, loadable) or writing (a mover is "
    "writing it)."};
constexpr MetricSpec kTierHeldBlocks{
    "kvcm_cache_manager_tier_held_blocks", MetricType::Gauge, "",
    "Pool blocks held while a mover copies them out to the tiers (write-through); they are "
    "not handed out until the copy has read them."};
constexpr MetricSpec kTierLoadingBlocks{
    "kvcm_cache_manager_tier_loading_blocks", MetricType::Gauge, "",
    "Pool blocks of prefetches waiting for a mover to load them from a tier; they become "
    "matchable only once loaded."};
constexpr MetricSpec kTierStoredBlocks{"kvcm_cache_manager_tier_stored_blocks_total",
                                       MetricType::Counter, "tier",
                                       "Blocks written into each tier."};
constexpr MetricSpec kTierLoadedBlocks{
    "kvcm_cache_manager_tier_loaded_blocks_total", MetricType::Counter, "tier",
    "Blocks loaded from each tier into the pool: prefix hits the pool no longer held."};
constexpr MetricSpec kTierEvictedBlocks{
    "kvcm_cache_manager_tier_evicted_blocks_total", MetricType::Counter, "tier",
    "Ready slots of each tier reused for another block (least recently used first)."};
constexpr MetricSpec kTierStoresDropped{
    "kvcm_cache_manager_tier_stores_dropped_total", MetricType::Counter, "",
    "Stores to the tiers cancelled before they started because the pool needed their "
    "blocks: a copy never makes an allocation wait or fail."};
constexpr MetricSpec kTierDiskFull{"kvcm_cache_manager_tier_disk_full_total", MetricType::Counter,
                                   "",
                                   "Disk tier writes refused for want of space (ENOSPC, EFBIG)."};
constexpr MetricSpec kTierWriteErrors{
    "kvcm_cache_manager_tier_write_errors_total", MetricType::Counter, "",
    "Disk tier writes that failed for another reason than space."};
constexpr MetricSpec kTierLoadFailures{
    "kvcm_cache_manager_tier_load_failures_total", MetricType::Counter, "",
    "Loads from a tier that gave nothing (the slot was refused or could not be read); the "
    "request computes those blocks again."};
constexpr MetricSpec kTierRefusals{
    "kvcm_cache_manager_tier_refusals_total", MetricType::Counter, "reason",
    "Disk tier slots not served, by the check they failed (bad_header, other_identity, "
    "checksum, truncated, wrong_hash, io_error), at start-up or at a load."};
constexpr MetricSpec kTierRecoveredBlocks{"kvcm_cache_manager_tier_recovered_blocks_total",
                                          MetricType::Counter, "",
                                          "Blocks found valid in the disk tier at start-up."};
constexpr MetricSpec kTierBytesWritten{
    "kvcm_cache_manager_tier_bytes_written_total", MetricType::Counter, "",
    "Bytes written to the disk tier (whole slots: header and padded block)."};
constexpr MetricSpec kTierBytesRead{"kvcm_cache_manager_tier_bytes_read_total", MetricType::Counter,
                                    "", "Bytes read from the disk tier (whole slots)."};
constexpr MetricSpec kTierSyncs{
    "kvcm_cache_manager_tier_syncs_total", MetricType::Counter, "",
    "fdatasync rounds of the disk tier's files (at most one per --disk-tier-sync-ms while "
    "blocks are written)."};
constexpr MetricSpec kTierSyncErrors{
    "kvcm_cache_manager_tier_sync_errors_total", MetricType::Counter, "",
    "Disk tier files whose fdatasync failed; the sync is tried again at the next interval."};
constexpr MetricSpec kTierUnsyncedWrites{
    "kvcm_cache_manager_tier_unsynced_writes", MetricType::Gauge, "",
    "Disk tier writes done but not yet covered by a sync: a crash of the machine may lose "
    "them, a crash of the process does not."};
constexpr MetricSpec kTierLoadSeconds{
    "kvcm_cache_manager_tier_load_seconds", MetricType::Histogram, "tier",
    "Time a mover took to copy one block from a tier into the pool, by tier (disk: read "
    "and verification included)."};

// Not in this list: kvcm_cache_manager_config_info, the effective configuration (a gauge at 1,
// one label per option), which main.cc adds to the same registry (common/config/config.h):
// its labels are the binary's flags, so it is declared from the flags themselves.
constexpr std::array kSpecs = {
    kCapacityBlocks,
    kBlocks,
    kUsageRatio,
    kOccupancyRatio,
    kPoolBytes,
    kInfo,
    kLiveSequences,
    kBlockAllocations,
    kBlockReleases,
    kBlockEvictions,
    kCowCopies,
    kPrefixQueryTokens,
    kPrefixHitTokens,
    kAllocationFailures,
    kWindowReleasedBlocks,
    kGroupWindowReleasedBlocks,
    kGroupHeldBlocks,
    kSessions,
    kEpoch,
    kOpenFences,
    kEventsPublished,
    kRequests,
    kRequestDuration,
    kRejectedMessages,
    kReclaimedBlocks,
    kReplayedSteps,
    kUndeliveredReplies,
    kAccepting,
    kProcessWatches,
    kSilentConnections,
    kVllmEvents,
    kVllmBatches,
    kVllmPublishFailures,
    kVllmReplayRequests,
    kVllmReplayedBatches,
    kVllmBufferBatches,
    kVllmSubscriptions,
    kVllmBlocksWithoutTokens,
    kTierCapacityBlocks,
    kTierBlocks,
    kTierHeldBlocks,
    kTierLoadingBlocks,
    kTierStoredBlocks,
    kTierLoadedBlocks,
    kTierEvictedBlocks,
    kTierStoresDropped,
    kTierDiskFull,
    kTierWriteErrors,
    kTierLoadFailures,
    kTierRefusals,
    kTierRecoveredBlocks,
    kTierBytesWritten,
    kTierBytesRead,
    kTierSyncs,
    kTierSyncErrors,
    kTierUnsyncedWrites,
    kTierLoadSeconds,
};

// Bucket upper bounds for kvcm_cache_manager_tier_load_seconds: 10 µs to 10 s in a 1-2.5-5
// series. A host copy of one block takes microseconds, a disk read milliseconds, and a load
// that outlasts --tier-load-timeout-ms (2 s by default) still lands in a bucket.
std::vector<double> TierLoadBucketsSeconds() {
  return {1e-5,  2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01,
          0.025, 0.05,   0.1,  0.25, 0.5,    1,    2.5,  5,      10};
}

// --- Label values --------------------------------------------------------------------------

constexpr std::array<std::string_view, kRequestTypes> kRequestTypeNames = {"hello",
                                                                           "attach",
                                                                           "step",
                                                                           "lookup",
                                                                           "pin",
                                                                           "unpin",
                                                                           "stats",
                                                                           "heartbeat",
                                                                           "goodbye",
                                                                           "event_snapshot",
                                                                           "describe_session",
                                                                           "end_session",
                                                                           "block_map"};
constexpr std::array<std::string_view, kRejectReasons> kRejectReasonNames = {
    "malformed",     "unsupported_version", "oversized",         "not_registered",
    "stale_session", "stale_epoch",         "invalid_argument",  "unknown_sequence",
    "wrong_owner",   "duplicate_sequence",  "permission_denied", "limit_exceeded",
    "shutting_down"};
constexpr std::array<std::string_view, kSessionRoles> kSessionRoleNames = {"router", "executor",
                                                                           "control"};
constexpr std::array<std::string_view, kReclaimReasons> kReclaimReasonNames = {
    "client_died", "goodbye", "session_replaced", "lease_expired", "ended_by_operator"};

template <size_t N>
constexpr bool AllNamed(const std::array<std::string_view, N>& names) {
  for (std::string_view name : names) {
    if (name.empty()) return false;
  }
  return true;
}
static_assert(AllNamed(kRequestTypeNames) && AllNamed(kRejectReasonNames) &&
              AllNamed(kSessionRoleNames) && AllNamed(kReclaimReasonNames));

template <typename Enum, size_t N>
std::string_view NameOf(const std::array<std::string_view, N>& names, Enum value) {
  const size_t index = static_cast<size_t>(value);
  KVCM_CHECK(index < N) << "enum value " << index << " has no label";
  return names[index];
}

// Block states as exported; they partition the pool.
enum ExportedState {
  kFreeState,
  kInUseState,
  kCachedState,
  kPinnedState,
  kQuarantinedState,
  kDrainingState,
  kExportedStates
};
constexpr std::array<std::string_view, kExportedStates> kExportedStateNames = {
    "free", "in_use", "cached", "pinned", "quarantined", "draining"};

prometheus::ClientMetric::Label Label(const char* name, std::string_view value) {
  return {name, std::string(value)};
}

}  // namespace

std::string_view RequestTypeName(RequestType type) { return NameOf(kRequestTypeNames, type); }
std::string_view RejectReasonName(RejectReason reason) {
  return NameOf(kRejectReasonNames, reason);
}
std::string_view SessionRoleName(SessionRole role) { return NameOf(kSessionRoleNames, role); }
std::string_view ReclaimReasonName(ReclaimReason reason) {
  return NameOf(kReclaimReasonNames, reason);
}

// Holds the last snapshot and builds the snapshot metrics from it at scrape time.
class CacheManagerMetrics::SnapshotCollector : public prometheus::Collectable {
 public:
  explicit SnapshotCollector(const CacheInfo& info) : info_(info) {
    snapshot_.ledger.num_blocks = info.num_blocks;
    snapshot_.ledger.block_size = info.block_size;
    snapshot_.ledger.free_blocks = info.num_blocks;
    for (int32_t window : info.group_windows) snapshot_.groups.push_back({window, 0, 0});
  }

  void Publish(const CacheManagerSnapshot& snapshot) {
    const LedgerStats& ledger = snapshot.ledger;
    KVCM_CHECK(ledger.num_blocks == info_.num_blocks)
        << "snapshot of " << ledger.num_blocks << " blocks for a pool of " << info_.num_blocks;
    KVCM_CHECK(ledger.free_blocks + ledger.in_use_blocks + ledger.cached_blocks +
                   ledger.pinned_blocks ==
               ledger.num_blocks)
        << "block states do not partition the pool";
    KVCM_CHECK(snapshot.quarantined_blocks >= 0 && snapshot.draining_blocks >= 0 &&
               snapshot.quarantined_blocks + snapshot.draining_blocks <= ledger.in_use_blocks)
        << "quarantined " << snapshot.quarantined_blocks << " and draining "
        << snapshot.draining_blocks << " of " << ledger.in_use_blocks << " in use";
    MutexLock lock(&mu_);
    snapshot_ = snapshot;
  }

  std::vector<prometheus::MetricFamily> Collect() const override {
    CacheManagerSnapshot s;
    {
      MutexLock lock(&mu_);
      s = snapshot_;
    }
    const LedgerStats& ledger = s.ledger;
    std::vector<prometheus::MetricFamily> families;
    auto add = [&families](const MetricSpec& spec, double value) {
      families.push_back(NewFamily(spec));
      AddSample(families.back(), value);
    };

    add(kCapacityBlocks, ledger.num_blocks);
    families.push_back(NewFamily(kBlocks));
    const std::array<int32_t, kExportedStates> by_state = {
        ledger.free_blocks,   ledger.in_use_blocks - s.quarantined_blocks - s.draining_blocks,
        ledger.cached_blocks, ledger.pinned_blocks,
        s.quarantined_blocks, s.draining_blocks};
    for (int i = 0; i < kExportedStates; ++i) {
      AddSample(families.back(), by_state[i], {Label("state", kExportedStateNames[i])});
    }
    add(kUsageRatio, ledger.usage_ratio);
    add(kOccupancyRatio, ledger.occupancy_ratio);
    add(kPoolBytes, static_cast<double>(info_.pool_bytes));
    families.push_back(NewFamily(kInfo));
    AddSample(families.back(), 1,
              {Label("block_size", std::to_string(info_.block_size)),
               Label("block_bytes", std::to_string(info_.block_bytes)), Label("dtype", info_.dtype),
               Label("backend", info_.backend), Label("hash_algorithm", info_.hash_algorithm)});
    add(kLiveSequences, ledger.live_sequences);
    add(kBlockAllocations, static_cast<double>(ledger.blocks_allocated));
    add(kBlockReleases, static_cast<double>(ledger.blocks_released));
    add(kBlockEvictions, static_cast<double>(ledger.evictions));
    add(kCowCopies, static_cast<double>(ledger.cow_copies));
    add(kPrefixQueryTokens, static_cast<double>(ledger.prefix_query_tokens));
    add(kPrefixHitTokens, static_cast<double>(ledger.prefix_hit_tokens));
    add(kAllocationFailures, static_cast<double>(ledger.allocation_failures));
    add(kWindowReleasedBlocks, static_cast<double>(ledger.window_released));
    auto by_group = [&](const MetricSpec& spec, auto value_of) {
      families.push_back(NewFamily(spec));
      for (size_t g = 0; g < s.groups.size(); ++g) {
        AddSample(families.back(), static_cast<double>(value_of(s.groups[g])),
                  {Label("group", std::to_string(g)),
                   Label("window", std::to_string(s.groups[g].window))});
      }
    };
    by_group(kGroupWindowReleasedBlocks,
             [](const CacheManagerSnapshot::Group& g) { return g.released; });
    by_group(kGroupHeldBlocks, [](const CacheManagerSnapshot::Group& g) { return g.held; });
    families.push_back(NewFamily(kSessions));
    for (int i = 0; i < kSessionRoles; ++i) {
      AddSample(families.back(), s.sessions_by_role[i], {Label("role", kSessionRoleNames[i])});
    }
    add(kEpoch, static_cast<double>(s.epoch));
    add(kOpenFences, s.open_fences);
    add(kEventsPublished, static_cast<double>(s.events_published));
    AddTierFamilies(s, families);
    return families;
  }

 private:
  // The kvcm_cache_manager_tier_* snapshot series: every label set, at 0 without tiers.
  static void AddTierFamilies(const CacheManagerSnapshot& s,
                              std::vector<prometheus::MetricFamily>& families) {
    const tiers::TierSnapshot t = s.tiers.value_or(tiers::TierSnapshot{});
    const tiers::TierCounters& c = t.counters;
    auto tier_label = [](int i) {
      return Label("tier", tiers::TierName(static_cast<tiers::Tier>(i)));
    };
    auto by_tier = [&](const MetricSpec& spec, auto value_of) {
      families.push_back(NewFamily(spec));
      for (int i = 0; i < tiers::kNumTiers; ++i) {
        AddSample(families.back(), static_cast<double>(value_of(i)), {tier_label(i)});
      }
    };
    auto add = [&families](const MetricSpec& spec, double value) {
      families.push_back(NewFamily(spec));
      AddSample(families.back(), value);
    };
    by_tier(kTierCapacityBlocks, [&](int i) { return t.slots[i]; });
    families.push_back(NewFamily(kTierBlocks));
    for (int i = 0; i < tiers::kNumTiers; ++i) {
      AddSample(families.back(), t.ready[i], {tier_label(i), Label("state", "ready")});
      AddSample(families.back(), t.writing[i], {tier_label(i), Label("state", "writing")});
    }
    add(kTierHeldBlocks, s.tier_held_blocks);
    add(kTierLoadingBlocks, s.tier_loading_blocks);
    by_tier(kTierStoredBlocks, [&](int i) { return c.stored[i]; });
    by_tier(kTierLoadedBlocks, [&](int i) { return c.loaded[i]; });
    by_tier(kTierEvictedBlocks, [&](int i) { return c.evicted[i]; });
    add(kTierStoresDropped, static_cast<double>(c.stores_dropped));
    add(kTierDiskFull, static_cast<double>(c.disk_full));
    add(kTierWriteErrors, static_cast<double>(c.write_errors));
    add(kTierLoadFailures, static_cast<double>(c.load_failures));
    families.push_back(NewFamily(kTierRefusals));
    for (int i = 0; i < tiers::kNumRefusals; ++i) {
      AddSample(families.back(), static_cast<double>(c.refused[i]),
                {Label("reason", tiers::RefusalName(static_cast<tiers::Refusal>(i)))});
    }
    add(kTierRecoveredBlocks, static_cast<double>(c.recovered));
    add(kTierBytesWritten, static_cast<double>(c.bytes_written));
    add(kTierBytesRead, static_cast<double>(c.bytes_read));
    add(kTierSyncs, static_cast<double>(c.syncs));
    add(kTierSyncErrors, static_cast<double>(c.sync_errors));
    add(kTierUnsyncedWrites, static_cast<double>(t.unsynced_writes));
  }

  const CacheInfo info_;
  mutable Mutex mu_;
  CacheManagerSnapshot snapshot_ ABSL_GUARDED_BY(mu_);
};

CacheManagerMetrics::CacheManagerMetrics(const CacheInfo& info)
    : registry_(std::make_shared<ScrapeRegistry>()),
      collector_(std::make_shared<SnapshotCollector>(info)) {
  KVCM_CHECK(info.num_blocks > 0) << info.num_blocks;
  KVCM_CHECK(info.block_size > 0) << info.block_size;
  registry_->AddCollector(collector_);

  // Every label set now, at 0.
  requests_ = std::make_shared<LabeledHistograms>(
      kRequestDuration, kRequests, "type",
      std::vector<std::string>(kRequestTypeNames.begin(), kRequestTypeNames.end()),
      RequestLatencyBucketsSeconds());
  registry_->AddCollector(requests_);
  auto& rejected = AddCounterFamily(*registry_, kRejectedMessages);
  for (int i = 0; i < kRejectReasons; ++i) {
    rejected_[i] = &rejected.Add({{"reason", std::string(kRejectReasonNames[i])}});
  }
  auto& reclaimed = AddCounterFamily(*registry_, kReclaimedBlocks);
  for (int i = 0; i < kReclaimReasons; ++i) {
    reclaimed_[i] = &reclaimed.Add({{"reason", std::string(kReclaimReasonNames[i])}});
  }
  replayed_steps_ = &AddCounterFamily(*registry_, kReplayedSteps).Add({});
  accepting_ = &AddGaugeFamily(*registry_, kAccepting).Add({});
  auto& watches = AddCounterFamily(*registry_, kProcessWatches);
  watches_[0] = &watches.Add({{"source", "pid_lookup"}});
  watches_[1] = &watches.Add({{"source", "connect_pidfd"}});
  accepting_->Set(1);
  auto& undelivered = AddCounterFamily(*registry_, kUndeliveredReplies);
  undelivered_[0] = &undelivered.Add({{"reason", "peer_gone"}});
  undelivered_[1] = &undelivered.Add({{"reason", "queue_full"}});
  silent_closed_ = &AddCounterFamily(*registry_, kSilentConnections).Add({});
  auto& vllm_events = AddCounterFamily(*registry_, kVllmEvents);
  vllm_events_[0] = &vllm_events.Add({{"type", "block_stored"}});
  vllm_events_[1] = &vllm_events.Add({{"type", "block_removed"}});
  vllm_events_[2] = &vllm_events.Add({{"type", "all_blocks_cleared"}});
  vllm_batches_ = &AddCounterFamily(*registry_, kVllmBatches).Add({});
  vllm_publish_failures_ = &AddCounterFamily(*registry_, kVllmPublishFailures).Add({});
  auto& replay_requests = AddCounterFamily(*registry_, kVllmReplayRequests);
  vllm_replay_requests_[0] = &replay_requests.Add({{"result", "served"}});
  vllm_replay_requests_[1] = &replay_requests.Add({{"result", "malformed"}});
  vllm_replayed_batches_ = &AddCounterFamily(*registry_, kVllmReplayedBatches).Add({});
  vllm_buffer_batches_ = &AddGaugeFamily(*registry_, kVllmBufferBatches).Add({});
  vllm_subscriptions_ = &AddCounterFamily(*registry_, kVllmSubscriptions).Add({});
  vllm_without_tokens_ = &AddCounterFamily(*registry_, kVllmBlocksWithoutTokens).Add({});
  auto& tier_load = AddHistogramFamily(*registry_, kTierLoadSeconds);
  for (int i = 0; i < tiers::kNumTiers; ++i) {
    tier_load_seconds_[i] =
        &tier_load.Add({{"tier", std::string(tiers::TierName(static_cast<tiers::Tier>(i)))}},
                       TierLoadBucketsSeconds());
  }
}

void CacheManagerMetrics::ObserveTierLoads(std::span<const std::pair<tiers::Tier, double>> loads) {
  for (const auto& [tier, seconds] : loads) {
    const size_t i = static_cast<size_t>(tier);
    KVCM_CHECK(i < tier_load_seconds_.size()) << i;
    tier_load_seconds_[i]->Observe(seconds);
  }
}

void CacheManagerMetrics::CountVllmEvent(int type) {
  KVCM_CHECK(type >= 0 && type < 3) << type;
  vllm_events_[static_cast<size_t>(type)]->Increment();
}

void CacheManagerMetrics::CountVllmBatch(bool published) {
  (published ? vllm_batches_ : vllm_publish_failures_)->Increment();
}

void CacheManagerMetrics::CountVllmReplayRequest(bool malformed, int batches) {
  vllm_replay_requests_[malformed ? 1 : 0]->Increment();
  vllm_replayed_batches_->Increment(static_cast<double>(batches));
}

void CacheManagerMetrics::SetVllmBufferBatches(int64_t batches) {
  vllm_buffer_batches_->Set(static_cast<double>(batches));
}

void CacheManagerMetrics::CountVllmSubscriptions(int n) {
  vllm_subscriptions_->Increment(static_cast<double>(n));
}

void CacheManagerMetrics::CountVllmBlocksWithoutTokens(int64_t blocks) {
  vllm_without_tokens_->Increment(static_cast<double>(blocks));
}

void CacheManagerMetrics::CountSilentConnectionsClosed(int n) {
  silent_closed_->Increment(static_cast<double>(n));
}

void CacheManagerMetrics::CountReplayedStep() { replayed_steps_->Increment(); }

void CacheManagerMetrics::CountProcessWatch(bool from_connect) {
  watches_[from_connect ? 1 : 0]->Increment();
}

void CacheManagerMetrics::SetAccepting(bool accepting) { accepting_->Set(accepting ? 1 : 0); }

void CacheManagerMetrics::CountUndeliveredReply(bool queue_full) {
  undelivered_[queue_full ? 1 : 0]->Increment();
}

CacheManagerMetrics::~CacheManagerMetrics() = default;

void CacheManagerMetrics::ObserveRequest(RequestType type, double seconds) {
  const size_t i = static_cast<size_t>(type);
  KVCM_CHECK(i < static_cast<size_t>(kRequestTypes)) << i;
  requests_->Observe(i, seconds);
}

void CacheManagerMetrics::CountRejected(RejectReason reason) {
  const size_t i = static_cast<size_t>(reason);
  KVCM_CHECK(i < rejected_.size()) << i;
  rejected_[i]->Increment();
}

void CacheManagerMetrics::CountReclaimed(ReclaimReason reason, int64_t blocks) {
  const size_t i = static_cast<size_t>(reason);
  KVCM_CHECK(i < reclaimed_.size()) << i;
  KVCM_CHECK(blocks >= 0) << blocks;
  reclaimed_[i]->Increment(static_cast<double>(blocks));
}

void CacheManagerMetrics::PublishSnapshot(const CacheManagerSnapshot& snapshot) {
  collector_->Publish(snapshot);
}

std::shared_ptr<prometheus::Registry> CacheManagerMetrics::registry() const { return registry_; }

std::span<const MetricSpec> CacheManagerMetrics::Specs() { return kSpecs; }

}  // namespace kvcm::cache_manager
