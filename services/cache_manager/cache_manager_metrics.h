#pragma once

// CacheManagerMetrics: every Prometheus metric of kvcm-cache-manager, declared once in one
// list (cache_manager_metrics.cc, also returned by Specs()), and the calls the service
// makes to update them. The service serves registry() with a MetricsServer.
//
// Two kinds of metrics:
// - Event metrics, updated as things happen on the socket thread: requests by type and
//   their latency (LabeledHistograms: a few cache lines per request), rejected messages by
//   reason, reclaimed blocks by reason (prometheus-cpp counters).
// - Snapshot metrics, built at scrape time from the last CacheManagerSnapshot published:
//   block states, ratios, ledger counters, sessions, epoch, events. A scrape reads ONE
//   snapshot, so `sum(kvcm_cache_blocks)` always equals `kvcm_cache_capacity_blocks`.
//   Until the first PublishSnapshot every block is free and every count is 0.
//
// Every known label set (each RequestType, RejectReason, SessionRole, ReclaimReason and
// block state) is exported from construction, at 0, so that rate() and absent() work from
// the first scrape. Label values come only from these enums: nothing unbounded.
//
// Thread safety: all methods may be called from any thread, concurrently with scrapes
// (which run on the MetricsServer's threads).

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/block/block_ledger.h"
#include "common/metrics/labeled_histograms.h"
#include "common/metrics/metric_spec.h"
#include "services/cache_manager/tiers/kv_tiers.h"

namespace prometheus {
class Counter;
class Histogram;
class Registry;
}  // namespace prometheus

namespace kvcm {
class ScrapeRegistry;  // common/metrics/scrape_registry.h
}  // namespace kvcm

namespace kvcm::cache_manager {

// Requests the cache manager serves (label `type`).
enum class RequestType : uint8_t {
  kHello,
  kAttach,
  kStep,
  kLookup,
  kPin,
  kUnpin,
  kStats,
  kHeartbeat,
  kGoodbye,
  kEventSnapshot,
  kDescribeSession,
  kEndSession,
  kBlockMap,
  kCount
};
inline constexpr int kRequestTypes = static_cast<int>(RequestType::kCount);
// "hello", "attach", ..., "event_snapshot". REQUIRES: type != kCount.
std::string_view RequestTypeName(RequestType type);

// Why an inbound message was refused (label `reason`).
enum class RejectReason : uint8_t {
  kMalformed,           // failed the FlatBuffers Verifier or the envelope checks
  kUnsupportedVersion,  // protocol version not spoken here
  kOversized,           // larger than the message size limit
  kNotRegistered,       // no session: Hello first
  kStaleSession,        // session id not (or no longer) valid
  kStaleEpoch,          // sent for an earlier cache-manager epoch
  kInvalidArgument,     // semantically invalid fields (ids out of range, ...)
  kUnknownSequence,     // names a sequence that is not live
  kWrongOwner,          // names a sequence owned by another session
  kDuplicateSequence,   // allocates a sequence id that is already live
  kPermissionDenied,    // the peer's credentials do not allow the request
  kLimitExceeded,       // too many sessions (in all, or of one process) or sequences
  kShuttingDown,        // a Step while the cache manager drains before it exits
  kCount
};
inline constexpr int kRejectReasons = static_cast<int>(RejectReason::kCount);
// "malformed", "unsupported_version", ..., "permission_denied". REQUIRES: != kCount.
std::string_view RejectReasonName(RejectReason reason);

// Client session roles (label `role`).
enum class SessionRole : uint8_t { kRouter, kExecutor, kControl, kCount };
inline constexpr int kSessionRoles = static_cast<int>(SessionRole::kCount);
// "router", "executor", "control". REQUIRES: role != kCount.
std::string_view SessionRoleName(SessionRole role);

// Why a session's blocks went back to the pool (label `reason`).
// kLeaseExpired: the session's pid could not be verified (tcp://), so it can never be proven
// dead or replaced; after its lease ran out its blocks drain behind a fence and are freed.
enum class ReclaimReason : uint8_t {
  kClientDied,
  kGoodbye,
  kSessionReplaced,
  kLeaseExpired,
  kEndedByOperator,
  kCount
};
inline constexpr int kReclaimReasons = static_cast<int>(ReclaimReason::kCount);
// "client_died", "goodbye", "session_replaced", "lease_expired", "ended_by_operator".
// REQUIRES: reason != kCount.
std::string_view ReclaimReasonName(ReclaimReason reason);

// The state the snapshot metrics are built from, taken by the cache manager on its ledger
// thread in one go.
struct CacheManagerSnapshot {
  LedgerStats ledger;
  // Of ledger.in_use_blocks, those held only by quarantined (hung) sessions: not usable by
  // anyone until the session is proven dead. Exported as state="quarantined", and
  // state="in_use" excludes them. REQUIRES: 0 <= quarantined_blocks <= in_use_blocks.
  int32_t quarantined_blocks = 0;
  // Of ledger.in_use_blocks, those held only by sequences of routers that ended while an
  // executor may still write them (not quarantined): exported as state="draining".
  // REQUIRES: quarantined_blocks + draining_blocks <= in_use_blocks.
  int32_t draining_blocks = 0;
  // Fences waiting for an executor's acknowledgement.
  int32_t open_fences = 0;
  // Live sessions, indexed by SessionRole.
  std::array<int32_t, kSessionRoles> sessions_by_role{};
  // This cache manager's epoch (changes at each start). Exported as a double: exact up to
  // 2^53.
  uint64_t epoch = 0;
  // KV events published since start (BlockStored, BlockRemoved, AllBlocksCleared).
  uint64_t events_published = 0;
  // The host and disk tiers (tiers/kv_tiers.h), when they are on; the kvcm_cache_manager_tier_*
  // series read 0 without them. held: pool blocks held while a mover copies them out;
  // loading: pool blocks of prefetches waiting for their loads (TierCoordinator).
  std::optional<tiers::TierSnapshot> tiers;
  int32_t tier_held_blocks = 0;
  int32_t tier_loading_blocks = 0;
  // Per KV cache group (docs/architecture.md, "The hybrid KV cache"; without groups one, the
  // pool's window): its window in tokens (0: full attention), the blocks its window released
  // and the entries of live sequences' tables in it that hold a block now
  // (GroupedLedger::HeldBlocksByGroup).
  struct Group {
    int32_t window = 0;
    uint64_t released = 0;
    int64_t held = 0;
  };
  std::vector<Group> groups;
};

class CacheManagerMetrics {
 public:
  // What does not change while the cache manager runs; exported as kvcm_cache_info,
  // kvcm_cache_pool_bytes and the initial (all free) snapshot.
  struct CacheInfo {
    int32_t num_blocks = 0;      // REQUIRES: > 0
    int32_t block_size = 0;      // tokens per block. REQUIRES: > 0
    int64_t block_bytes = 0;     // bytes of one block, all layers, K and V
    uint64_t pool_bytes = 0;     // bytes of the whole pool
    std::string dtype;           // KV element type, e.g. "bf16"
    std::string backend;         // pool memory backend, e.g. "shm" or "cuda"
    std::string hash_algorithm;  // block hash, e.g. "sha256"
    // The KV cache groups' windows (0: full attention); without groups one, the pool's.
    std::vector<int32_t> group_windows = {0};
  };

  explicit CacheManagerMetrics(const CacheInfo& info);
  CacheManagerMetrics(const CacheManagerMetrics&) = delete;
  CacheManagerMetrics& operator=(const CacheManagerMetrics&) = delete;
  ~CacheManagerMetrics();

  // One request of `type` was handled in `seconds` (receipt to reply).
  void ObserveRequest(RequestType type, double seconds);
  // One inbound message was refused for `reason`.
  void CountRejected(RejectReason reason);
  // `blocks` blocks went back to the pool because a session ended for `reason`.
  // REQUIRES: blocks >= 0.
  void CountReclaimed(ReclaimReason reason, int64_t blocks);
  // A Step retry answered from the replay cache.
  void CountReplayedStep();
  // A reply the socket could not take: the peer is gone, or its queue is full.
  void CountUndeliveredReply(bool queue_full);
  // `n` connections closed for saying nothing within the Hello deadline.
  void CountSilentConnectionsClosed(int n);
  // Whether new connections are accepted (CacheManagerServer's descriptor guard).
  void SetAccepting(bool accepting);
  // A client process watched for death, its pidfd taken at connect time or opened by pid.
  void CountProcessWatch(bool from_connect);
  // The vLLM-format KV event stream (vllm_event_publisher.h): an event published, by type
  // (VllmEvent::Kind: 0 stored, 1 removed, 2 all cleared); a batch published or refused by
  // the PUB; a replay request answered with `batches` batches, or refused as malformed;
  // the batches held for replay; blocks left out for want of token ids.
  void CountVllmEvent(int type);
  void CountVllmBatch(bool published);
  void CountVllmReplayRequest(bool malformed, int batches);
  void SetVllmBufferBatches(int64_t batches);
  void CountVllmBlocksWithoutTokens(int64_t blocks);
  // Subscriptions received on the PUB (XPUB): consumers connecting or reconnecting.
  void CountVllmSubscriptions(int n);
  // Loads from the tiers and how long each took (KvTiers::TakeLoadSeconds), for
  // kvcm_cache_manager_tier_load_seconds.
  void ObserveTierLoads(std::span<const std::pair<tiers::Tier, double>> loads);
  // Replaces the snapshot the next scrapes read. REQUIRES: snapshot.ledger describes this
  // pool (num_blocks as constructed, states summing to it) and quarantined_blocks is within
  // [0, in_use_blocks]; these are internal invariants, checked.
  void PublishSnapshot(const CacheManagerSnapshot& snapshot);

  // Everything above, for MetricsServer::Start. Scrapes after this object is destroyed
  // return only the event metrics.
  std::shared_ptr<prometheus::Registry> registry() const;

  // Every metric exported, in the order declared: the one list.
  static std::span<const MetricSpec> Specs();

 private:
  class SnapshotCollector;

  std::shared_ptr<ScrapeRegistry> registry_;
  std::shared_ptr<SnapshotCollector> collector_;  // held weakly by registry_
  // Resolved once, indexed by enum; owned by registry_'s families.
  // Requests and their latency by type (kvcm_cache_manager_requests_total and
  // kvcm_cache_manager_request_duration_seconds); held weakly by registry_.
  std::shared_ptr<LabeledHistograms> requests_;
  std::array<prometheus::Counter*, kRejectReasons> rejected_{};
  std::array<prometheus::Counter*, kReclaimReasons> reclaimed_{};
  prometheus::Counter* replayed_steps_ = nullptr;
  prometheus::Gauge* accepting_ = nullptr;
  std::array<prometheus::Counter*, 2> watches_{};      // pid_lookup, connect_pidfd
  std::array<prometheus::Counter*, 2> undelivered_{};  // peer_gone, queue_full
  prometheus::Counter* silent_closed_ = nullptr;
  std::array<prometheus::Counter*, 3> vllm_events_{};  // stored, removed, all cleared
  prometheus::Counter* vllm_batches_ = nullptr;
  prometheus::Counter* vllm_publish_failures_ = nullptr;
  std::array<prometheus::Counter*, 2> vllm_replay_requests_{};  // served, malformed
  prometheus::Counter* vllm_replayed_batches_ = nullptr;
  prometheus::Gauge* vllm_buffer_batches_ = nullptr;
  prometheus::Counter* vllm_without_tokens_ = nullptr;
  prometheus::Counter* vllm_subscriptions_ = nullptr;
  std::array<prometheus::Histogram*, tiers::kNumTiers> tier_load_seconds_{};  // by Tier
};

}  // namespace kvcm::cache_manager
