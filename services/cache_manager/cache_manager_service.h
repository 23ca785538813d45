#pragma once
// CacheManagerService: the cache manager's logic, without sockets. It owns the block ledger
// and the sessions, turns each verified request into ledger calls and a reply, and turns
// ledger events into KV event batches. CacheManagerServer (cache_manager_server.h) feeds
// it messages from the ZeroMQ sockets; tests feed it bytes directly.
//
// Request handling (docs/architecture.md):
// - Envelope checks (size, Verifier, identifier, version), then the session: a request
//   other than Hello must carry a session id this cache manager issued and still holds, the
//   current epoch, and (over ipc://) come from the process that registered it.
// - A message that fails any check gets an ErrorReply with a code and a reason, changes
//   nothing, and is counted by reason (kvcm_cache_manager_rejected_messages_total).
// - Step: the whole op list is validated first (limits, ranges, sequence ids known and
//   owned by the sender, tracking the step's own allocations and frees in order); any
//   failure rejects the whole message. Then the ops are applied in order, each with its own
//   result; an op the ledger refuses (RESOURCE_EXHAUSTED, ...) changes nothing and later
//   ops still run. StepApplier (step_applier.h) does both on the decoded ops; the service
//   decodes, checks the session, keeps the retry ring and encodes the reply.
// - Only routers change sequences (Step). Pins are global and outlive sessions.
// - Retries: the replies of a session's last four applied Steps are kept by request id; the
//   same request again is answered with its first reply and runs nothing. A Step's request
//   id must be above the session's last applied one (0: never kept); a lower one not kept
//   is refused (FailedPrecondition), never run twice. A Step whose reply could exceed
//   max_message_bytes is refused (InvalidArgument, counted as oversized) before it runs.
//
// Sessions and leases:
// - Every message refreshes its session's lease. A session silent for longer than the
//   heartbeat timeout is quarantined by ExpireSessions(): its sequences stay allocated (so
//   their blocks are never handed to anyone else while the client may still run and
//   write), its requests are refused as StaleSession, and its blocks show as quarantined.
// - A session ends on Goodbye, when its process dies (OnProcessExited), or when the same
//   process registers again after being quarantined (it has then given up the old session).
//   An executor session also ends once quarantined while its process holds a live executor
//   session: a Hello retried after its reply came too late leaves one the client never
//   learnt of (ExpireSessions moves its fences to the live one).
//
// Fencing (docs/architecture.md, "Fencing"): a block is never handed to a new owner while a
// process told to write it may still run. The writers are the executors, and the cache
// manager does not know which executor a router told to write what, so when a router
// session ends holding sequences and any executor session exists, its sequences are not
// freed: they move out of the routers' id space (ids >= kFirstDrainingSeq) under a fence
// that waits for every executor session existing then. An executor learns its open fences
// in each HeartbeatReply and acknowledges them (Heartbeat.fence_acks) once it runs no step
// of that router session and will refuse any later one; an executor session that ends
// (process proven dead by its pidfd, or Goodbye) acknowledges by ending. When the last
// waiting executor acknowledged, the sequences are freed (committed full blocks stay
// cached) and counted as reclaimed for the reason the router ended. Until then their
// blocks show as draining. A hung executor is quarantined but keeps its place in every
// fence until it answers or dies: an executor session holding no blocks is never ended
// by its lease. An executor that registers again takes its old session's fences along, and
// so does a live executor session of the process of a quarantined one.
// With no executor session at all, nothing can be writing, and the sequences are freed
// at once.
//
// Thread safety: none; one thread (the server's socket thread) owns the service.

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/block/block_hash.h"
#include "common/block/block_ledger.h"
#include "common/block/block_map.h"
#include "common/block/grouped_ledger.h"
#include "common/sizing/kv_cache_groups.h"
#include "common/sizing/kv_cache_spec.h"
#include "common/wire/message_limits.h"
#include "common/wire/pool_strides.h"
#include "services/cache_manager/cache_manager_metrics.h"
#include "services/cache_manager/fence_table.h"
#include "services/cache_manager/peer_credentials.h"
#include "services/cache_manager/process_watcher.h"
#include "services/cache_manager/session_table.h"
#include "services/cache_manager/step_applier.h"
#include "services/cache_manager/tier_coordinator.h"
#include "services/cache_manager/vllm_conversion.h"
#include "services/cache_manager/vllm_events.h"

// The FlatBuffers and generated types this header only names: the .cc includes the
// generated code (schemas/kvcm_protocol.fbs), so that the service's users need not.
namespace flatbuffers {
class FlatBufferBuilder;
template <typename T>
struct Offset;
}  // namespace flatbuffers

namespace kvcm::wire {
struct Envelope;
struct OpResult;
enum class PoolBackend : uint8_t;  // the .cc checks that Shm is its zero value
}  // namespace kvcm::wire

namespace kvcm {
struct BlockOp;  // common/wire/step_codec.h
}  // namespace kvcm

namespace kvcm::cache_manager {

// What an attaching client needs to reach the pool; filled in by the server from the pool
// memory and sent in every AttachReply.
struct PoolExport {
  wire::PoolBackend backend{};  // wire::PoolBackend::Shm
  PoolStrides layout;
  std::string fd_channel_path;           // shm: the Unix socket passing the memfd
  int32_t cuda_device = -1;              // cuda
  std::vector<uint8_t> cuda_ipc_handle;  // cuda: 64 bytes
};

class CacheManagerService {
 public:
  struct Options {
    KvCacheSpec spec;  // REQUIRES: spec.Validate().ok()
    // num_blocks, sliding window, pin limit; block_size is taken from spec, and events are
    // always recorded.
    BlockLedger::Options ledger;
    // The model's KV cache groups (docs/architecture.md, "The hybrid KV cache"); none
    // (num_groups() == 0): every layer in one table, under ledger.sliding_window_tokens.
    // With groups `spec` is the page's (PageSpec), ledger.sliding_window_tokens is 0, and
    // `tiers` is null (tiers do not support groups yet); vllm_events name each block's group.
    KvCacheGroups kv_groups;
    HashAlgorithm hash_algorithm = kDefaultHashAlgorithm;  // announced in HelloReply
    // Changes at every start; < 2^53 so that the epoch gauge is exact.
    uint64_t epoch = 1;
    // Clients heartbeat this often; a session silent for heartbeat_timeout is quarantined.
    // A short timeout notices hung clients sooner but quarantines clients stalled by a
    // long GC or swap; keep it several intervals long.
    absl::Duration heartbeat_interval = absl::Seconds(1);
    absl::Duration heartbeat_timeout = absl::Seconds(5);
    // Limits on one message: larger messages are refused as oversized.
    int32_t max_ops_per_step = 4096;
    int32_t max_hashes_per_message = 1 << 16;
    size_t max_message_bytes = kDefaultMaxMessageBytes;
    // Bounds on what one peer can make the cache manager hold: sessions in all and per
    // process, live sequences per session. Past them, Hello or Step is refused
    // (ResourceExhausted, counted as limit_exceeded).
    int32_t max_sessions = 4096;
    int32_t max_sessions_per_process = 64;
    int32_t max_sequences_per_session = 1 << 20;
    // Over ipc:// only peers whose uid the kernel reports as one of these are served; any
    // other's every message is refused (PermissionDenied, counted as permission_denied),
    // its Hello first of all. The run directory's mode 0700 already keeps other users off
    // the socket; this holds when a deployment opens it (docs/RELIABILITY.md, "Security").
    // Empty: this process's effective uid only, as the pool fd channel serves.
    std::vector<uid_t> allowed_uids;
    PoolExport pool;
    // The secret a Router or Executor must give in Hello over tcp:// (the contents of
    // RUN_DIR/tcp-secret); empty: no tcp:// endpoint, so every peer has credentials.
    std::string tcp_secret;
    // Reported in StatsReply so that tools can find them.
    std::string events_endpoint;
    std::string metrics_url;
    // The vLLM-format KV event stream is on (docs/protocol.md, "vLLM-format KV events"):
    // HelloReply asks routers for the token ids of committed blocks, and TakeEventBatch
    // also turns the ledger's events into VllmEvents for TakeVllmEvents.
    bool vllm_events = false;
    // The host and disk tiers (tiers/kv_tiers.h), or null; they outlive the service.
    tiers::KvTiers* tiers = nullptr;
  };

  // INVALID_ARGUMENT for options Create() would refuse, without allocating anything, so
  // that a service's flags are checked before it acquires its pool or ports. A sliding
  // window (ledger.sliding_window_tokens) travels in the AttachReply and HelloReply: an
  // executor whose layers do not all attend within it refuses the pool.
  static absl::Status CheckOptions(const Options& options);

  // `watcher` and `metrics` must outlive the service; `metrics` may be null (tests).
  static absl::StatusOr<std::unique_ptr<CacheManagerService>> Create(const Options& options,
                                                                     ProcessWatcher* watcher,
                                                                     CacheManagerMetrics* metrics,
                                                                     absl::Time now);
  // Out of line: the scratch vectors' element types are complete only in the .cc.
  ~CacheManagerService();

  // Handles one inbound message and writes exactly one reply envelope into `reply` (which
  // is cleared first). `peer` is the sender's credentials when known (ipc://).
  void Handle(const std::optional<PeerCredentials>& peer, std::span<const uint8_t> request,
              absl::Time now, flatbuffers::FlatBufferBuilder* reply);

  // Answers a message refused by the transport (for example one of several frames) with a
  // Malformed ErrorReply naming `request_id` (0 when unknown), counted as malformed.
  void RefuseMalformed(uint64_t request_id, std::string_view reason,
                       flatbuffers::FlatBufferBuilder* reply);

  // From now on Step, Hello and Attach are refused with Unavailable (counted as
  // shutting_down); heartbeats, Goodbye and inspection are answered as before.
  void BeginShutdown() { shutting_down_ = true; }

  // Counts a refusal the transport made (the pool fd denied to another user), in
  // rejected_messages() and the metrics alike.
  void CountRejected(RejectReason reason);

  // The process `pid` has exited: its sessions end and their sequences are freed.
  void OnProcessExited(pid_t pid);
  // The process of `session` (as its watch saw it) exited: that session ends, and no other
  // of the same pid (which may be another process's by now). False if it had ended.
  bool OnSessionProcessExited(uint64_t session_id);

  // Quarantines every active session silent since before now - heartbeat_timeout; returns
  // how many were quarantined now. `now` (like every time the service is given) is on the
  // monotonic clock (common/base/monotonic_clock.h).
  int ExpireSessions(absl::Time now);

  // Counts every active session as seen at `now`: the caller's own loop was late (the
  // process was stopped or starved), so the silence was not the clients'.
  void ExtendLeases(absl::Time now);

  // Encodes the ledger events recorded since the last call as one EventBatch (finished
  // without a file identifier) and returns its sequence number; 0 (and `out` untouched)
  // if there were none. Numbers start at 1 and increase by one per batch. The first batch
  // of an epoch is a lone AllBlocksCleared, so that subscribers of an earlier epoch drop
  // what they knew.
  uint64_t TakeEventBatch(flatbuffers::FlatBufferBuilder* out);

  // With Options::vllm_events: the events of the batches TakeEventBatch encoded since the
  // last call, in vLLM's form, in order (the epoch's first batch gives a lone
  // AllBlocksCleared). A block stored without its token ids (a router that did not send
  // them) is left out, and so is its later removal: a vLLM consumer keys blocks by their
  // tokens. Consecutive stored blocks of one chain share an event, as do consecutive
  // removals. Empty when nothing happened, or without vllm_events.
  std::vector<VllmEvent> TakeVllmEvents() { return vllm_.Take(); }
  // Blocks left out of the vLLM stream for want of their token ids, since the start.
  uint64_t vllm_blocks_without_tokens() const { return vllm_.blocks_without_tokens(); }

  // Gauges for the metrics, computed now.
  CacheManagerSnapshot Snapshot() const;

  // With tiers: applies the mover's results (Options::tiers->wake_fd() is readable). True
  // when the ledger or the tiers changed, so that events wait for TakeEventBatch.
  bool PollTiers(absl::Time now);
  // With tiers: hands the copies the last messages staged to the movers. The server calls
  // it after sending each reply (Handle calls it first too, so that nothing staged waits
  // longer than the next message).
  void FlushTiers() {
    if (tiers_ != nullptr) tiers_->Flush();
  }
  // The tier coordinator, or null without tiers.
  const TierCoordinator* tier_coordinator() const { return tiers_.get(); }
  // With tiers: the loads done since the last call and how long each took, by tier
  // (KvTiers::TakeLoadSeconds), for the metrics' histogram. Empty without tiers.
  std::vector<std::pair<tiers::Tier, double>> TakeTierLoadSeconds();

  uint64_t epoch() const { return options_.epoch; }
  // The pool's ledger (with one group, the ledger itself: the same sequence ids).
  const BlockLedger& ledger() const { return ledger_.pool(); }
  const GroupedLedger& grouped_ledger() const { return ledger_; }
  const Options& options() const { return options_; }
  // The uids served over ipc:// (Options::allowed_uids, or this process's effective uid).
  const std::vector<uid_t>& allowed_uids() const { return allowed_uids_; }
  int32_t num_sessions() const { return sessions_.size(); }
  uint64_t rejected_messages() const { return rejected_messages_; }

  // Blocks held only by quarantined sessions (quarantined) and, of the rest, those held
  // only by draining sequences (draining). O(their blocks).
  struct HeldBlocks {
    int32_t quarantined = 0;
    int32_t draining = 0;
  };
  HeldBlocks BlocksHeldApart() const;
  // The same blocks one by one, by ascending id, each kQuarantined or kDraining.
  std::vector<std::pair<BlockId, MapState>> HeldApartList() const;
  int32_t QuarantinedBlocks() const { return BlocksHeldApart().quarantined; }
  int32_t DrainingBlocks() const { return BlocksHeldApart().draining; }
  int32_t open_fences() const { return fences_.size(); }

 private:
  // The sessions and their checks (session_table.h); open fences (fence_table.h).
  using Session = SessionTable::Session;
  using Fence = FenceTable::Fence;

  // A refusal before anything changed (defined in the .cc: it holds a wire::ErrorCode).
  struct Rejection;

  CacheManagerService(const Options& options, GroupedLedger ledger, ProcessWatcher* watcher,
                      CacheManagerMetrics* metrics, absl::Time now);

  void Reject(uint64_t request_id, const Rejection& rejection,
              flatbuffers::FlatBufferBuilder* reply);
  // Whether `given` equals options_.tcp_secret (never when that is empty).
  bool SecretMatches(std::string_view given) const;
  // Session checks for every request but Hello; null (and `rejection` set) on failure.
  Session* CheckSession(const wire::Envelope& envelope, const std::optional<PeerCredentials>& peer,
                        Rejection* rejection);

  // Handle's steps after the envelope and session checks.
  // Whether the session may send a request of this type (tcp:// without the secret reads
  // only; only routers step); nullopt when it may.
  std::optional<Rejection> CheckPermission(RequestType type, const Session& session) const;
  void Dispatch(const wire::Envelope& envelope, std::span<const uint8_t> request, Session& session,
                absl::Time now, flatbuffers::FlatBufferBuilder* reply);
  void HandleEndSession(const wire::Envelope& envelope, const Session& session,
                        flatbuffers::FlatBufferBuilder* reply);

  void HandleHello(const wire::Envelope& envelope, const std::optional<PeerCredentials>& peer,
                   absl::Time now, flatbuffers::FlatBufferBuilder* reply);
  // `request` is the whole envelope's bytes (for recognising a retry).
  void HandleStep(const wire::Envelope& envelope, std::span<const uint8_t> request,
                  Session& session, absl::Time now, flatbuffers::FlatBufferBuilder* reply);
  // HandleStep's steps: a retry's kept reply (or its refusal when its bytes differ); the
  // checks before anything changes; the application and its reply.
  void ReplayStep(const Session::SentStep& sent, uint64_t request_id, size_t request_hash,
                  size_t request_size, flatbuffers::FlatBufferBuilder* reply);
  std::optional<Rejection> CheckStep(const wire::Envelope& envelope, const Session& session);
  void ApplyStep(uint64_t request_id, Session& session, absl::Time now,
                 flatbuffers::FlatBufferBuilder* reply);
  static StepSession StepSessionOf(const Session& session) {
    return StepSession{session.id, session.num_seqs, &session.drained_ids};
  }
  void HandleDescribeSession(const wire::Envelope& envelope, const Session& session,
                             flatbuffers::FlatBufferBuilder* reply);
  void HandleAttach(const wire::Envelope& envelope, flatbuffers::FlatBufferBuilder* reply);
  void HandleStats(const wire::Envelope& envelope, absl::Time now,
                   flatbuffers::FlatBufferBuilder* reply);
  void HandleEventSnapshot(const wire::Envelope& envelope, flatbuffers::FlatBufferBuilder* reply);
  // The pool as a map (BlockLedger::FillBlockMap with the blocks held apart), for any
  // session, Control ones included: it says nothing a StatsReply does not, block by block.
  void HandleBlockMap(const wire::Envelope& envelope, flatbuffers::FlatBufferBuilder* reply);
  // Pin, Unpin, Lookup: nullopt and a reply written, or a rejection.
  std::optional<Rejection> HandlePrefixRequest(const wire::Envelope& envelope,
                                               const Session& session,
                                               flatbuffers::FlatBufferBuilder* reply);

  // Forgets the session. A router's sequences are freed, or fenced while executor sessions
  // exist (see the header comment); an executor's fences count as acknowledged, or move to
  // `successor` (the live session the same process registered again as) when that is not 0.
  // Counts reclaimed blocks; returns the blocks that became unused now.
  int32_t EndSession(uint64_t session_id, ReclaimReason reason, uint64_t successor = 0);
  // `executor` acknowledged fence `id` (or ended); frees the sequences of the fence that
  // FenceTable::Acknowledge closed, if any. Returns the blocks that became unused.
  int32_t AcknowledgeFence(uint64_t id, uint64_t executor);
  // Frees sequences and counts the blocks that became unused for `reason` (unless !count).
  int32_t FreeSequences(std::span<const SeqId> seqs, ReclaimReason reason, bool count = true);
  // The sequences `session` owns, by ascending id: one pass over the ledger's sequences.
  std::vector<SeqId> SeqsOf(const Session& session) const;
  // Puts `seqs` (just taken from `router_session`) behind a fence for every executor
  // session; frees them at once when there is none. `router_seqs`: the router's ids for a
  // sequence fence, empty for a whole ended session. Returns the blocks released now.
  int32_t FenceSequences(uint64_t router_session, std::span<const SeqId> seqs, ReclaimReason reason,
                         std::vector<SeqId> router_seqs);
  void HandleHeartbeat(const wire::Envelope& envelope, Session& session,
                       flatbuffers::FlatBufferBuilder* reply);

  const Options options_;
  // options_.allowed_uids, or this process's effective uid when it is empty.
  const std::vector<uid_t> allowed_uids_;
  GroupedLedger ledger_;
  ProcessWatcher* const watcher_;
  CacheManagerMetrics* const metrics_;
  const absl::Time start_time_;

  SessionTable sessions_;
  FenceTable fences_;
  StepApplier steps_;       // validates and applies Steps' ops to ledger_ (step_applier.h)
  uint64_t event_seq_ = 0;  // last batch number handed out
  // vLLM-format events (Options::vllm_events): fed each Commit's token ids and each batch.
  VllmConverter vllm_;
  bool announce_cleared_ = true;
  uint64_t events_published_ = 0;
  uint64_t rejected_messages_ = 0;
  bool shutting_down_ = false;

  // With Options::tiers.
  std::unique_ptr<TierCoordinator> tiers_;
  // Ledger events taken after a Step or a tier result (for the write-through), waiting for
  // TakeEventBatch.
  std::vector<BlockEvent> pending_events_;
  // Takes the ledger's events into pending_events_, handing them to the tiers first.
  void TakeLedgerEventsForTiers();

  // Scratch reused across messages.
  std::vector<BlockHash> hashes_;
  std::vector<BlockOp> step_ops_;  // the Step being handled, decoded (storage reused)
  std::vector<flatbuffers::Offset<wire::OpResult>> step_results_;  // the reply's, in op order
  BlockMap block_map_;  // the last BlockMap's, its cells' storage reused
};

}  // namespace kvcm::cache_manager
