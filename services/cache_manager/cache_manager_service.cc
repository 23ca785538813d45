#include "services/cache_manager/cache_manager_service.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <utility>

#include "absl/hash/hash.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "common/base/check.h"
#include "common/wire/attach_codec.h"
#include "common/wire/block_map_codec.h"
#include "common/wire/convert.h"
#include "common/wire/describe_session_codec.h"
#include "common/wire/envelope.h"
#include "common/wire/event_codec.h"
#include "common/wire/heartbeat_codec.h"
#include "common/wire/hello_codec.h"
#include "common/wire/stats_codec.h"
#include "common/wire/step_codec.h"
#include "flatbuffers/flatbuffers.h"
#include "schemas/kvcm_protocol_generated.h"
#include "services/cache_manager/session_roles.h"

namespace kvcm::cache_manager {

// The header declares wire::PoolBackend opaquely and defaults PoolExport::backend to zero.
static_assert(static_cast<int>(wire::PoolBackend::Shm) == 0);

struct CacheManagerService::Rejection {
  RejectReason reason;
  wire::ErrorCode code;
  std::string message;
};

namespace {

constexpr size_t kMaxNameBytes = 128;
// What one op's result may add to a StepReply besides its block ids and copy orders: the
// OpResult table, its vtable, offsets, vector headers with their padding, and a reason
// (the ledger's are under 200 bytes).
constexpr size_t kOpResultBytes = 512;
// The envelope and the StepReply table around the results.
constexpr size_t kStepReplyBytes = 256;

// An upper bound of the StepReply to `ops` in bytes, whatever the ledger answers: an
// Allocate returns one block id per block of its tokens, an Append at most one per block
// of its new tokens and a copy-on-write order, each in every KV cache group; other ops
// return no blocks.
size_t StepReplyBound(std::span<const BlockOp> ops, int32_t block_size, int32_t num_groups) {
  size_t bytes = kStepReplyBytes;
  for (const BlockOp& op : ops) {
    bytes += kOpResultBytes;
    const auto blocks_of = [&](int32_t tokens) {
      return static_cast<size_t>((int64_t{tokens} + block_size - 1) / block_size);
    };
    if (op.kind == wire::StepOp::AllocateOp) {
      bytes += sizeof(BlockId) * blocks_of(op.num_tokens) * static_cast<size_t>(num_groups);
    } else if (op.kind == wire::StepOp::AppendOp) {
      // Each group's new blocks and its copy order (group_blocks, copies).
      bytes += (sizeof(BlockId) * (blocks_of(op.num_tokens) + 1) + sizeof(wire::CopyOrder)) *
               static_cast<size_t>(num_groups);
    }
  }
  return bytes;
}

size_t HashBytes(std::span<const uint8_t> bytes) {
  return absl::Hash<absl::string_view>{}(
      absl::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()));
}

std::optional<RequestType> RequestTypeOf(wire::Message type) {
  using M = wire::Message;
  switch (type) {
    case M::Hello:
      return RequestType::kHello;
    case M::Attach:
      return RequestType::kAttach;
    case M::Step:
      return RequestType::kStep;
    case M::Lookup:
      return RequestType::kLookup;
    case M::Pin:
      return RequestType::kPin;
    case M::Unpin:
      return RequestType::kUnpin;
    case M::Stats:
      return RequestType::kStats;
    case M::Heartbeat:
      return RequestType::kHeartbeat;
    case M::Goodbye:
      return RequestType::kGoodbye;
    case M::EventSnapshot:
      return RequestType::kEventSnapshot;
    case M::DescribeSession:
      return RequestType::kDescribeSession;
    case M::EndSession:
      return RequestType::kEndSession;
    case M::BlockMap:
      return RequestType::kBlockMap;
    default:
      return std::nullopt;
  }
}

// The ledger of `options`: one pool of pages, for one group under the ledger's window or
// for the model's KV cache groups.
GroupedLedger::Options LedgerOptionsOf(const CacheManagerService::Options& options) {
  GroupedLedger::Options out;
  out.pool = options.ledger;
  out.pool.block_size = options.spec.block_size;
  out.hash_algorithm = options.hash_algorithm;
  for (const KvCacheGroup& group : options.kv_groups.groups) {
    out.group_windows.push_back(group.window);
  }
  return out;
}

// With KV cache groups: a pool of pages, and no tiers (they do not know groups yet).
absl::Status CheckGroups(const CacheManagerService::Options& options) {
  const KvCacheGroups& groups = options.kv_groups;
  if (groups.num_groups() == 0) return absl::OkStatus();
  if (options.spec.num_layers != groups.group_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "with KV cache groups the pool's spec is a page's: ", groups.group_size,
        " layer slots, got ", options.spec.num_layers, " layers (", groups.ToString(), ")"));
  }
  if (options.ledger.sliding_window_tokens != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "with KV cache groups the windows are the groups'; the ledger's sliding window must be "
        "0, got ",
        options.ledger.sliding_window_tokens, " tokens"));
  }
  for (const KvCacheGroup& group : groups.groups) {
    if (group.window < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("KV cache group of negative window ", group.window, " tokens"));
    }
  }
  if (options.tiers != nullptr) {
    return absl::UnimplementedError(absl::StrCat(
        "the host and disk tiers do not support KV cache groups yet (", groups.ToString(), ")"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CacheManagerService::CheckOptions(const Options& options) {
  if (absl::Status valid = options.spec.Validate(); !valid.ok()) return valid;
  if (options.heartbeat_interval <= absl::ZeroDuration() ||
      options.heartbeat_timeout <= options.heartbeat_interval) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the heartbeat timeout (", absl::FormatDuration(options.heartbeat_timeout),
        ") must be longer than the heartbeat interval (",
        absl::FormatDuration(options.heartbeat_interval), "), which must be positive"));
  }
  if (options.max_ops_per_step <= 0 || options.max_hashes_per_message <= 0 ||
      options.max_sessions <= 0 || options.max_sessions_per_process <= 0 ||
      options.max_sequences_per_session <= 0) {
    return absl::InvalidArgumentError("message, session and sequence limits must be positive");
  }
  if (absl::Status groups = CheckGroups(options); !groups.ok()) return groups;
  return BlockLedger::CheckOptions(LedgerOptionsOf(options).pool);
}

absl::StatusOr<std::unique_ptr<CacheManagerService>> CacheManagerService::Create(
    const Options& options, ProcessWatcher* watcher, CacheManagerMetrics* metrics, absl::Time now) {
  KVCM_CHECK(watcher != nullptr);
  if (absl::Status checked = CheckOptions(options); !checked.ok()) return checked;
  GroupedLedger::Options ledger_options = LedgerOptionsOf(options);
  ledger_options.pool.record_events = true;
  auto ledger = GroupedLedger::Create(std::move(ledger_options));
  if (!ledger.ok()) return ledger.status();
  return std::unique_ptr<CacheManagerService>(
      new CacheManagerService(options, *std::move(ledger), watcher, metrics, now));
}

CacheManagerService::CacheManagerService(const Options& options, GroupedLedger ledger,
                                         ProcessWatcher* watcher, CacheManagerMetrics* metrics,
                                         absl::Time now)
    : options_(options),
      allowed_uids_(options.allowed_uids.empty() ? std::vector<uid_t>{::geteuid()}
                                                 : options.allowed_uids),
      ledger_(std::move(ledger)),
      watcher_(watcher),
      metrics_(metrics),
      start_time_(now),
      sessions_({.epoch = options.epoch, .heartbeat_timeout = options.heartbeat_timeout}),
      steps_(&ledger_, {.max_sequences_per_session = options.max_sequences_per_session}),
      vllm_(ledger_.block_size(), options.hash_algorithm,
            options.pool.backend == wire::PoolBackend::Cuda ? VllmMedium::kGpu : VllmMedium::kCpu,
            ledger_.num_groups() > 1 ? ledger_.group_windows() : std::vector<int32_t>{}) {
  if (options.tiers != nullptr) {
    TierCoordinator::Options tier_options;
    tier_options.load_timeout = options.tiers->options().load_timeout;
    if (options.vllm_events) {
      tier_options.commit_tokens = [this](BlockId block) { return vllm_.CommitTokens(block); };
    }
    tiers_ = std::make_unique<TierCoordinator>(options.tiers, &ledger_, std::move(tier_options));
  }
}

CacheManagerService::~CacheManagerService() = default;

void CacheManagerService::TakeLedgerEventsForTiers() {
  if (tiers_ == nullptr) return;
  std::vector<BlockEvent> events = ledger_.TakeEvents();
  tiers_->OnEvents(events);
  pending_events_.insert(pending_events_.end(), events.begin(), events.end());
}

bool CacheManagerService::PollTiers(absl::Time now) {
  if (tiers_ == nullptr) return false;
  if (!tiers_->Poll(now)) return tiers_->tiers().has_events();  // only the tiers changed
  TakeLedgerEventsForTiers();
  tiers_->Flush();
  return true;
}

// --- Dispatch ----------------------------------------------------------------------------

namespace {

// The reason counted and the code replied for an envelope refused before it was read.
std::pair<RejectReason, wire::ErrorCode> EnvelopeFaultCodes(EnvelopeFault fault) {
  switch (fault) {
    case EnvelopeFault::kOversized:
      return {RejectReason::kOversized, wire::ErrorCode::Malformed};
    case EnvelopeFault::kUnsupportedVersion:
      return {RejectReason::kUnsupportedVersion, wire::ErrorCode::UnsupportedVersion};
    default:
      return {RejectReason::kMalformed, wire::ErrorCode::Malformed};
  }
}

}  // namespace

void CacheManagerService::Handle(const std::optional<PeerCredentials>& peer,
                                 std::span<const uint8_t> request, absl::Time now,
                                 flatbuffers::FlatBufferBuilder* reply) {
  reply->Clear();
  FlushTiers();
  const VerifiedEnvelope verified = VerifyEnvelope(request, options_.max_message_bytes);
  // Another user's process is served nothing, whatever it sent: not a session, not Stats,
  // not even a reason why its bytes are malformed.
  if (peer.has_value() &&
      std::find(allowed_uids_.begin(), allowed_uids_.end(), peer->uid) == allowed_uids_.end()) {
    return Reject(verified.request_id,
                  {RejectReason::kPermissionDenied, wire::ErrorCode::PermissionDenied,
                   absl::StrCat("uid ", peer->uid, " (pid ", peer->pid,
                                ") may not use this cache manager: it serves uid ",
                                absl::StrJoin(allowed_uids_, ", "), " only")},
                  reply);
  }
  if (verified.fault != EnvelopeFault::kNone) {
    // The reply names the request when its id could be read, so that the sender sees the
    // refusal instead of waiting out its timeout.
    const auto [reason, code] = EnvelopeFaultCodes(verified.fault);
    return Reject(verified.request_id, {reason, code, verified.reason}, reply);
  }
  const wire::Envelope& envelope = *verified.envelope;
  const uint64_t request_id = envelope.request_id();
  const std::optional<RequestType> type = RequestTypeOf(envelope.payload_type());
  if (!type) {
    return Reject(request_id,
                  {RejectReason::kMalformed, wire::ErrorCode::Malformed,
                   absl::StrCat("message type ", wire::EnumNameMessage(envelope.payload_type()),
                                " is not a request")},
                  reply);
  }
  // Latency by type, receipt to reply, on the real clock (`now` may be a test's).
  struct Timer {
    CacheManagerMetrics* metrics;
    RequestType type;
    std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
    ~Timer() {
      if (metrics == nullptr) return;
      metrics->ObserveRequest(
          type, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
  } timer{metrics_, *type};
  if (shutting_down_ && (*type == RequestType::kHello || *type == RequestType::kAttach ||
                         *type == RequestType::kStep)) {
    return Reject(request_id,
                  {RejectReason::kShuttingDown, wire::ErrorCode::Unavailable,
                   "the cache manager is shutting down: no new sessions, attachments or block "
                   "operations"},
                  reply);
  }
  if (*type == RequestType::kHello) return HandleHello(envelope, peer, now, reply);

  Rejection rejection;
  Session* session = CheckSession(envelope, peer, &rejection);
  if (session == nullptr) return Reject(request_id, rejection, reply);
  session->last_seen = now;
  if (std::optional<Rejection> refused = CheckPermission(*type, *session)) {
    return Reject(request_id, *refused, reply);
  }
  Dispatch(envelope, request, *session, now, reply);
}

std::optional<CacheManagerService::Rejection> CacheManagerService::CheckPermission(
    RequestType type, const Session& session) const {
  if (!session.authenticated && (type == RequestType::kAttach || type == RequestType::kStep ||
                                 type == RequestType::kPin || type == RequestType::kUnpin)) {
    return Rejection{RejectReason::kPermissionDenied, wire::ErrorCode::PermissionDenied,
                     absl::StrCat("session ", session.id,
                                  " came over tcp:// without the run directory's secret: it may "
                                  "read, but not attach, pin or step")};
  }
  if (type == RequestType::kStep && session.role != SessionRole::kRouter) {
    return Rejection{RejectReason::kPermissionDenied, wire::ErrorCode::PermissionDenied,
                     absl::StrCat("only routers change sequences; this session is a ",
                                  RoleName(WireRoleOf(session.role)))};
  }
  return std::nullopt;
}

void CacheManagerService::Dispatch(const wire::Envelope& envelope, std::span<const uint8_t> request,
                                   Session& session, absl::Time now,
                                   flatbuffers::FlatBufferBuilder* reply) {
  using M = wire::Message;
  switch (envelope.payload_type()) {
    case M::Heartbeat:
      return HandleHeartbeat(envelope, session, reply);
    case M::Goodbye: {
      const uint64_t id = session.id;
      const int32_t released = EndSession(id, ReclaimReason::kGoodbye);
      auto payload = wire::CreateGoodbyeReply(*reply, released);
      return FinishEnvelope(*reply, envelope.request_id(), id, options_.epoch, M::GoodbyeReply,
                            payload.Union());
    }
    case M::Attach:
      return HandleAttach(envelope, reply);
    case M::Stats:
      return HandleStats(envelope, now, reply);
    case M::EventSnapshot:
      return HandleEventSnapshot(envelope, reply);
    case M::BlockMap:
      return HandleBlockMap(envelope, reply);
    case M::Step:
      return HandleStep(envelope, request, session, now, reply);
    case M::DescribeSession:
      return HandleDescribeSession(envelope, session, reply);
    case M::EndSession:
      return HandleEndSession(envelope, session, reply);
    default: {
      if (auto refused = HandlePrefixRequest(envelope, session, reply)) {
        return Reject(envelope.request_id(), *refused, reply);
      }
      return;
    }
  }
}

void CacheManagerService::HandleEndSession(const wire::Envelope& envelope, const Session& session,
                                           flatbuffers::FlatBufferBuilder* reply) {
  const uint64_t request_id = envelope.request_id();
  const uint64_t target = envelope.payload_as_EndSession()->session_id();
  if (session.role != SessionRole::kControl || !session.pid_verified) {
    return Reject(request_id,
                  {RejectReason::kPermissionDenied, wire::ErrorCode::PermissionDenied,
                   "only a control session over ipc:// (kvcmctl) ends other sessions"},
                  reply);
  }
  if (target == session.id) {
    return Reject(request_id,
                  {RejectReason::kInvalidArgument, wire::ErrorCode::InvalidArgument,
                   "a session ends itself with Goodbye"},
                  reply);
  }
  const Session* ended = sessions_.Find(target);
  if (ended == nullptr) {
    return Reject(request_id,
                  {RejectReason::kInvalidArgument, wire::ErrorCode::NotFound,
                   absl::StrCat("no session ", target)},
                  reply);
  }
  const wire::Role role = WireRoleOf(ended->role);
  const int32_t released = EndSession(target, ReclaimReason::kEndedByOperator);
  auto payload = wire::CreateEndSessionReply(*reply, released, role);
  return FinishEnvelope(*reply, request_id, session.id, options_.epoch,
                        wire::Message::EndSessionReply, payload.Union());
}

bool CacheManagerService::SecretMatches(std::string_view given) const {
  if (options_.tcp_secret.empty() || given.empty()) return false;
  const std::string& secret = options_.tcp_secret;
  if (given.size() != secret.size()) return false;
  // Constant time in the contents: a peer learns nothing from how long a refusal took.
  uint8_t difference = 0;
  for (size_t i = 0; i < secret.size(); ++i) {
    difference |= static_cast<uint8_t>(given[i] ^ secret[i]);
  }
  return difference == 0;
}

void CacheManagerService::RefuseMalformed(uint64_t request_id, std::string_view reason,
                                          flatbuffers::FlatBufferBuilder* reply) {
  Reject(request_id, {RejectReason::kMalformed, wire::ErrorCode::Malformed, std::string(reason)},
         reply);
}

void CacheManagerService::Reject(uint64_t request_id, const Rejection& rejection,
                                 flatbuffers::FlatBufferBuilder* reply) {
  CountRejected(rejection.reason);
  reply->Clear();
  FinishErrorReply(*reply, request_id, options_.epoch, rejection.code, rejection.message);
}

void CacheManagerService::CountRejected(RejectReason reason) {
  ++rejected_messages_;
  if (metrics_ != nullptr) metrics_->CountRejected(reason);
}

CacheManagerService::Session* CacheManagerService::CheckSession(
    const wire::Envelope& envelope, const std::optional<PeerCredentials>& peer,
    Rejection* rejection) {
  const uint64_t id = envelope.session_id();
  const SessionTable::Checked checked =
      sessions_.Check(envelope.epoch(), id, peer ? std::optional<pid_t>(peer->pid) : std::nullopt);
  using Refusal = SessionTable::Refusal;
  switch (checked.refusal) {
    case Refusal::kNone:
      return checked.session;
    case Refusal::kStaleEpoch:
      *rejection = {RejectReason::kStaleEpoch, wire::ErrorCode::StaleEpoch,
                    absl::StrCat("message for epoch ", envelope.epoch(),
                                 " but this cache manager runs epoch ", options_.epoch,
                                 ": register again (and re-attach)")};
      break;
    case Refusal::kNotRegistered:
      *rejection = {RejectReason::kNotRegistered, wire::ErrorCode::NotRegistered,
                    absl::StrCat("session ", id,
                                 " is not registered here (never, or it ended "
                                 "long ago): send Hello first")};
      break;
    case Refusal::kEnded:
      *rejection = {RejectReason::kStaleSession, wire::ErrorCode::StaleSession,
                    absl::StrCat("session ", id, " has ended: register again")};
      break;
    case Refusal::kOtherProcess:
      *rejection = {
          RejectReason::kPermissionDenied, wire::ErrorCode::PermissionDenied,
          absl::StrCat("session ", id, " belongs to pid ", checked.session->pid, ", not to ",
                       peer ? absl::StrCat("pid ", peer->pid)
                            : std::string("a peer without credentials (tcp://)"))};
      break;
    case Refusal::kQuarantined:
      *rejection = {RejectReason::kStaleSession, wire::ErrorCode::StaleSession,
                    absl::StrCat("session ", id,
                                 " missed its heartbeats and was quarantined; "
                                 "its sequences are gone: register again")};
      break;
  }
  return nullptr;
}

// --- Sessions ----------------------------------------------------------------------------

void CacheManagerService::HandleHello(const wire::Envelope& envelope,
                                      const std::optional<PeerCredentials>& peer, absl::Time now,
                                      flatbuffers::FlatBufferBuilder* reply) {
  const uint64_t request_id = envelope.request_id();
  const wire::Hello* payload = envelope.payload_as_Hello();
  if (payload == nullptr || !SessionRoleOf(payload->role())) {
    return Reject(request_id,
                  {RejectReason::kInvalidArgument, wire::ErrorCode::InvalidArgument,
                   "Hello needs a role: router, executor or control"},
                  reply);
  }
  const HelloRequest hello = DecodeHello(*payload);
  if (hello.name.size() > kMaxNameBytes) {
    return Reject(request_id,
                  {RejectReason::kInvalidArgument, wire::ErrorCode::InvalidArgument,
                   absl::StrCat("client name of ", hello.name.size(), " bytes is longer than ",
                                kMaxNameBytes)},
                  reply);
  }
  if (hello.pid <= 0 && !peer) {
    return Reject(request_id,
                  {RejectReason::kInvalidArgument, wire::ErrorCode::InvalidArgument,
                   "Hello needs the client's pid"},
                  reply);
  }
  const bool granted = peer.has_value() || SecretMatches(hello.secret);
  if (!granted && hello.role != wire::Role::Control) {
    return Reject(request_id,
                  {RejectReason::kPermissionDenied, wire::ErrorCode::PermissionDenied,
                   absl::StrCat("over tcp:// a ", RoleName(hello.role),
                                " must give the secret of the cache manager's run directory "
                                "(RUN_DIR/tcp-secret); without it only a control session "
                                "(read-only) is granted")},
                  reply);
  }
  if (peer && hello.pid != peer->pid) {
    return Reject(request_id,
                  {RejectReason::kPermissionDenied, wire::ErrorCode::PermissionDenied,
                   absl::StrCat("Hello claims pid ", hello.pid,
                                " but the connection belongs to pid ", peer->pid)},
                  reply);
  }
  const pid_t pid = hello.pid;
  // The same process registering again after quarantine has given up its old session; an
  // executor's fences go with it to the new one (it is still the same writer). Only a pid
  // the kernel vouched for can replace a session: a pid claimed over tcp:// may be anyone's.
  const SessionTable::Registration registration =
      sessions_.PlanRegistration(pid, /*kernel_vouched=*/peer.has_value());
  const std::vector<uint64_t>& replaced = registration.replaced;
  const int32_t of_process = registration.others;
  const int32_t open = sessions_.size() - static_cast<int32_t>(replaced.size());
  if (open >= options_.max_sessions || of_process >= options_.max_sessions_per_process) {
    return Reject(request_id,
                  {RejectReason::kLimitExceeded, wire::ErrorCode::ResourceExhausted,
                   open >= options_.max_sessions
                       ? absl::StrCat("the cache manager holds ", open,
                                      " sessions, its limit: end some (Goodbye) first")
                       : absl::StrCat("pid ", pid, " holds ", of_process,
                                      " sessions, the limit per process: end some first")},
                  reply);
  }

  Session session;
  session.id = sessions_.NewId();
  session.role = *SessionRoleOf(hello.role);
  session.pid = pid;
  session.name = hello.name;
  session.last_seen = now;
  session.authenticated = granted;
  if (peer) {
    // Only credentials the kernel vouched for are watched: a pid claimed over tcp:// may
    // belong to anybody (or to another pid namespace).
    session.pid_verified = watcher_->Watch(session.id, pid).ok();
  }
  const uint64_t id = session.id;
  const bool executor = session.role == SessionRole::kExecutor;
  sessions_.Add(std::move(session));
  // After the new session exists (Watch is idempotent, so the pid stays watched).
  for (uint64_t old_id : replaced) {
    EndSession(old_id, ReclaimReason::kSessionReplaced, executor ? id : 0);
  }

  SessionInfo info;
  info.session_id = id;
  info.epoch = options_.epoch;
  info.heartbeat_interval = options_.heartbeat_interval;
  info.heartbeat_timeout = options_.heartbeat_timeout;
  info.num_blocks = ledger_.num_blocks();
  info.block_size = ledger_.block_size();
  info.hash_algorithm = options_.hash_algorithm;
  info.max_ops_per_step = options_.max_ops_per_step;
  info.max_message_bytes = static_cast<uint32_t>(options_.max_message_bytes);
  info.wants_commit_tokens = options_.vllm_events;
  info.tiers = tiers_ != nullptr;
  info.sliding_window_tokens = options_.ledger.sliding_window_tokens;
  if (options_.kv_groups.num_groups() > 0) info.group_windows = ledger_.group_windows();
  auto hello_reply = EncodeHelloReply(*reply, info);
  FinishEnvelope(*reply, request_id, id, options_.epoch, wire::Message::HelloReply,
                 hello_reply.Union());
}

int32_t CacheManagerService::EndSession(uint64_t session_id, ReclaimReason reason,
                                        uint64_t successor) {
  // Its id is remembered for a while, so that a late request is told its session ended.
  const std::optional<Session> removed = sessions_.Remove(session_id);
  if (!removed) return 0;
  const Session& session = *removed;
  // By ascending id, not in the ledger's table order: the blocks are released, and so later
  // reused and evicted, the same way everywhere, which lets a simulated run replay exactly
  // (tests/sim/).
  const std::vector<SeqId> seqs = SeqsOf(session);
  std::vector<uint64_t> pending(session.pending_fences.begin(), session.pending_fences.end());
  std::sort(pending.begin(), pending.end());
  if (session.pid_verified) watcher_->Unwatch(session_id);

  int32_t released = 0;
  // An executor that ended writes nothing more; one that registered again is still the
  // writer it was.
  for (uint64_t fence_id : pending) {
    if (successor != 0) {
      if (!fences_.Transfer(fence_id, session_id, successor)) continue;
      Session* heir = sessions_.Find(successor);
      KVCM_CHECK(heir != nullptr) << "successor " << successor << " of " << session_id;
      heir->pending_fences.insert(fence_id);
    } else {
      released += AcknowledgeFence(fence_id, session_id);
    }
  }
  if (seqs.empty()) return released;

  return released + FenceSequences(session_id, seqs, reason, {});
}

int32_t CacheManagerService::FenceSequences(uint64_t router_session, std::span<const SeqId> seqs,
                                            ReclaimReason reason, std::vector<SeqId> router_seqs) {
  absl::flat_hash_set<uint64_t> writers = sessions_.Executors();
  if (writers.empty()) return FreeSequences(seqs, reason, /*count=*/router_seqs.empty());

  const Fence& fence =
      fences_.Open(router_session, reason, seqs, std::move(router_seqs), std::move(writers));
  for (size_t i = 0; i < seqs.size(); ++i) {
    const SeqId draining = fence.seqs[i];
    const absl::Status renamed = ledger_.Rename(seqs[i], draining);
    KVCM_CHECK(renamed.ok()) << "session " << router_session << " owned sequence " << seqs[i]
                             << " that the ledger cannot rename: " << renamed.ToString();
    KVCM_CHECK(ledger_.SetOwner(draining, 0).ok());  // the cache manager's now
  }
  for (uint64_t writer : fence.waiting) sessions_.Find(writer)->pending_fences.insert(fence.id);
  return 0;
}

int32_t CacheManagerService::AcknowledgeFence(uint64_t id, uint64_t executor) {
  const std::optional<Fence> closed = fences_.Acknowledge(id, executor);
  if (!closed) return 0;
  return FreeSequences(closed->seqs, closed->reason, closed->count_reclaimed);
}

std::vector<SeqId> CacheManagerService::SeqsOf(const Session& session) const {
  std::vector<SeqId> seqs;
  if (session.num_seqs == 0) return seqs;
  seqs.reserve(static_cast<size_t>(session.num_seqs));
  ledger_.ForEachSequence([&](SeqId seq, uint64_t owner) {
    if (owner == session.id) seqs.push_back(seq);
  });
  KVCM_CHECK(seqs.size() == static_cast<size_t>(session.num_seqs))
      << "session " << session.id << " counts " << session.num_seqs << " sequences; the ledger "
      << "has " << seqs.size() << " of it";
  std::sort(seqs.begin(), seqs.end());
  return seqs;
}

int32_t CacheManagerService::FreeSequences(std::span<const SeqId> seqs, ReclaimReason reason,
                                           bool count) {
  const uint64_t released_before = ledger_.Stats().blocks_released;
  for (SeqId seq : seqs) {
    const absl::Status freed = ledger_.Free(seq);
    KVCM_CHECK(freed.ok()) << "sequence " << seq
                           << " to free is unknown to the ledger: " << freed.ToString();
  }
  const auto released = static_cast<int32_t>(ledger_.Stats().blocks_released - released_before);
  if (count && metrics_ != nullptr && released > 0) metrics_->CountReclaimed(reason, released);
  return released;
}

void CacheManagerService::HandleHeartbeat(const wire::Envelope& envelope, Session& session,
                                          flatbuffers::FlatBufferBuilder* reply) {
  const wire::Heartbeat* heartbeat = envelope.payload_as_Heartbeat();
  if (session.role == SessionRole::kExecutor && heartbeat->fence_acks() != nullptr) {
    for (uint64_t fence_id : DecodeHeartbeat(*heartbeat)) {
      if (session.pending_fences.erase(fence_id) > 0) AcknowledgeFence(fence_id, session.id);
    }
  }
  std::vector<uint64_t> ids(session.pending_fences.begin(), session.pending_fences.end());
  std::sort(ids.begin(), ids.end());
  std::vector<FenceNotice> fences;
  fences.reserve(ids.size());
  for (uint64_t fence_id : ids) {
    const Fence* open = fences_.Find(fence_id);
    KVCM_CHECK(open != nullptr) << "session " << session.id << " waits in closed fence "
                                << fence_id;
    fences.push_back({fence_id, open->router_session, open->router_seqs});
  }
  auto payload = EncodeHeartbeatReply(*reply, fences);
  FinishEnvelope(*reply, envelope.request_id(), session.id, options_.epoch,
                 wire::Message::HeartbeatReply, payload.Union());
}

void CacheManagerService::OnProcessExited(pid_t pid) {
  for (uint64_t id : sessions_.VerifiedSessionsOf(pid)) EndSession(id, ReclaimReason::kClientDied);
}

bool CacheManagerService::OnSessionProcessExited(uint64_t session_id) {
  const Session* session = sessions_.Find(session_id);
  if (session == nullptr || !session->pid_verified) return false;
  EndSession(session_id, ReclaimReason::kClientDied);
  return true;
}

int CacheManagerService::ExpireSessions(absl::Time now) {
  // The table quarantines, and names the sessions to end and why (session_table.h); their
  // sequences are freed or fenced here.
  const SessionTable::Expiry expiry = sessions_.Expire(now);
  for (const SessionTable::End& end : expiry.to_end) EndSession(end.id, end.reason, end.successor);
  return expiry.quarantined;
}

void CacheManagerService::ExtendLeases(absl::Time now) { sessions_.ExtendLeases(now); }

// --- Step ----------------------------------------------------------------------------------

void CacheManagerService::HandleStep(const wire::Envelope& envelope,
                                     std::span<const uint8_t> request, Session& session,
                                     absl::Time now, flatbuffers::FlatBufferBuilder* reply) {
  const uint64_t request_id = envelope.request_id();
  const size_t request_hash = HashBytes(request);
  if (const Session::SentStep* sent = session.FindSentStep(request_id)) {
    return ReplayStep(*sent, request_id, request_hash, request.size(), reply);
  }
  if (std::optional<Rejection> refused = CheckStep(envelope, session)) {
    return Reject(request_id, *refused, reply);
  }
  ApplyStep(request_id, session, now, reply);
  // Kept for a retry, whatever its size (at most max_message_bytes, checked above), over
  // the oldest of the ring.
  session.KeepSentStep(request_id, request_hash, request.size(),
                       {reply->GetBufferPointer(), reply->GetSize()});
}

void CacheManagerService::ReplayStep(const Session::SentStep& sent, uint64_t request_id,
                                     size_t request_hash, size_t request_size,
                                     flatbuffers::FlatBufferBuilder* reply) {
  if (sent.request_hash != request_hash || sent.request_size != request_size) {
    return Reject(request_id,
                  {RejectReason::kInvalidArgument, wire::ErrorCode::InvalidArgument,
                   absl::StrCat("request id ", request_id,
                                " was a different Step of this "
                                "session: a retry must resend the same bytes")},
                  reply);
  }
  // A retry of a Step already applied: its reply again, its ops not again.
  reply->Clear();
  reply->PushBytes(sent.reply.data(), sent.reply.size());
  if (metrics_ != nullptr) metrics_->CountReplayedStep();
}

std::optional<CacheManagerService::Rejection> CacheManagerService::CheckStep(
    const wire::Envelope& envelope, const Session& session) {
  const uint64_t request_id = envelope.request_id();
  // Request ids of a session's Steps increase, so an id not above the last applied one is
  // a retry of a Step that is no longer kept (or a client bug): running it again could
  // apply its ops twice.
  if (request_id != 0 && request_id <= session.last_step_request_id) {
    return Rejection{RejectReason::kInvalidArgument, wire::ErrorCode::FailedPrecondition,
                     absl::StrCat("request id ", request_id, " is not above the last Step ",
                                  "applied in this session (", session.last_step_request_id,
                                  ") and is not among the ", session.sent_steps.size(),
                                  " kept for retries: it is not run again; DescribeSession ",
                                  "tells what the session holds")};
  }
  const StepLimits limits{options_.max_ops_per_step, options_.max_hashes_per_message,
                          ledger_.block_size()};
  if (absl::Status decoded = DecodeStep(*envelope.payload_as_Step(), limits, &step_ops_);
      !decoded.ok()) {
    const bool oversized = absl::IsResourceExhausted(decoded);
    return Rejection{oversized ? RejectReason::kOversized : RejectReason::kMalformed,
                     oversized ? wire::ErrorCode::InvalidArgument : wire::ErrorCode::Malformed,
                     std::string(decoded.message())};
  }
  if (std::optional<StepRefusal> refused = steps_.Validate(step_ops_, StepSessionOf(session))) {
    return Rejection{refused->reason, ToWireCode(refused->status.code()),
                     std::string(refused->status.message())};
  }
  // Every applied Step's reply is kept for a retry, so it must fit the message limit that
  // bounds what the session can make the cache manager hold (and what it announced).
  if (const size_t bound = StepReplyBound(step_ops_, ledger_.block_size(), ledger_.num_groups());
      bound > options_.max_message_bytes) {
    return Rejection{RejectReason::kOversized, wire::ErrorCode::InvalidArgument,
                     absl::StrCat("the reply to this step could take ", bound, " bytes, over the ",
                                  options_.max_message_bytes, "-byte message limit: split it ",
                                  "into smaller steps")};
  }
  return std::nullopt;
}

void CacheManagerService::ApplyStep(uint64_t request_id, Session& session, absl::Time now,
                                    flatbuffers::FlatBufferBuilder* reply) {
  const StepSession step_session = StepSessionOf(session);
  std::vector<flatbuffers::Offset<wire::OpResult>>& results = step_results_;
  results.clear();
  // What a Step does beyond the ledger, at its op's place in the order.
  struct Effects final : StepApplier::Effects {
    CacheManagerService& service_;
    Session& session_;
    Effects(CacheManagerService& service, Session& session)
        : service_(service), session_(session) {}
    void Drain(SeqId seq) override {
      session_.drained_ids.insert(seq);
      const SeqId one[] = {seq};
      service_.FenceSequences(session_.id, one, ReclaimReason::kGoodbye, {seq});
    }
    void CommittedTokens(SeqId seq, int32_t num_tokens, std::span<const int32_t> tokens) override {
      if (!service_.options_.vllm_events) return;
      const GroupedLedger& ledger = service_.ledger_;
      if (ledger.num_groups() > 1) {
        // Every group's blocks, each published with the plain hash of its position: the
        // one group 0's block there is indexed under (docs/protocol.md, "vLLM-format KV
        // events").
        if (auto table = ledger.BlockTable(seq); table.ok()) {
          service_.vllm_.AddGroupedCommitTokens(
              *table, num_tokens, tokens,
              [&ledger](BlockId block) { return ledger.pool().HashOfBlock(block); });
        }
        return;
      }
      if (auto table = ledger.BlockTable(seq); table.ok()) {
        service_.vllm_.AddCommitTokens(*table, num_tokens, tokens);
      }
    }
    std::optional<absl::Status> BeforeAllocate(const BlockOp& op, OpOutcome* outcome) override {
      if (service_.tiers_ == nullptr) return std::nullopt;
      return service_.tiers_->BeforeAllocate(op, now_, outcome);
    }
    absl::Time now_;
  } effects(*this, session);
  effects.now_ = now;
  if (tiers_ != nullptr) tiers_->MakeRoom(step_ops_);
  const StepApplier::Applied applied = steps_.Apply(step_ops_, step_session, effects);
  // Before any other message can end a sequence: the blocks this step stored are held for
  // their write-through now.
  TakeLedgerEventsForTiers();
  session.num_seqs = applied.num_seqs;
  OpResultWriter result_writer(*reply);
  for (const OpOutcome& outcome : applied.outcomes) results.push_back(result_writer.Add(outcome));
  auto vector = reply->CreateVector(results);
  auto payload = wire::CreateStepReply(*reply, vector, ledger_.AvailableBlocks());
  FinishEnvelope(*reply, request_id, session.id, options_.epoch, wire::Message::StepReply,
                 payload.Union());
}

void CacheManagerService::HandleDescribeSession(const wire::Envelope& envelope,
                                                const Session& session,
                                                flatbuffers::FlatBufferBuilder* reply) {
  const std::vector<SeqId> seqs = SeqsOf(session);
  SessionSnapshot snapshot;
  snapshot.last_step_request_id = session.last_step_request_id;
  snapshot.sequences.reserve(seqs.size());
  for (SeqId seq : seqs) {
    absl::StatusOr<GroupedTables> tables = ledger_.BlockTables(seq);
    absl::StatusOr<int32_t> tokens = ledger_.NumTokens(seq);
    absl::StatusOr<int32_t> committed = ledger_.NumCommittedTokens(seq);
    KVCM_CHECK(tables.ok() && tokens.ok() && committed.ok())
        << "session " << session.id << " owns sequence " << seq << " unknown to the ledger";
    SequenceSnapshot& described = snapshot.sequences.emplace_back();
    described.seq = seq;
    described.num_tokens = *tokens;
    described.num_committed_tokens = *committed;
    described.blocks = std::move(tables->groups[0]);
    for (size_t g = 1; g < tables->groups.size(); ++g) {
      described.group_blocks.insert(described.group_blocks.end(), tables->groups[g].begin(),
                                    tables->groups[g].end());
    }
  }
  auto payload = EncodeDescribeSessionReply(*reply, snapshot);
  FinishEnvelope(*reply, envelope.request_id(), session.id, options_.epoch,
                 wire::Message::DescribeSessionReply, payload.Union());
}

// --- Prefix cache --------------------------------------------------------------------------

std::optional<CacheManagerService::Rejection> CacheManagerService::HandlePrefixRequest(
    const wire::Envelope& envelope, const Session& session, flatbuffers::FlatBufferBuilder* reply) {
  const uint64_t request_id = envelope.request_id();
  auto too_many = [&](size_t count) -> std::optional<Rejection> {
    if (count <= static_cast<size_t>(options_.max_hashes_per_message)) return std::nullopt;
    return Rejection{
        RejectReason::kOversized, wire::ErrorCode::InvalidArgument,
        absl::StrCat(count, " block hashes exceed the limit of ", options_.max_hashes_per_message)};
  };
  auto check_name = [&](const flatbuffers::String* name) -> std::optional<Rejection> {
    if (name != nullptr && name->size() > 0 && name->size() <= kMaxNameBytes) {
      return std::nullopt;
    }
    return Rejection{RejectReason::kInvalidArgument, wire::ErrorCode::InvalidArgument,
                     absl::StrCat("a pin needs a name of 1 to ", kMaxNameBytes, " bytes")};
  };
  auto ledger_error = [&](const absl::Status& status) {
    reply->Clear();
    FinishErrorReply(*reply, request_id, options_.epoch, ToWireCode(status.code()),
                     std::string_view(status.message().data(), status.message().size()));
  };
  switch (envelope.payload_type()) {
    case wire::Message::Lookup: {
      const wire::Lookup* lookup = envelope.payload_as_Lookup();
      if (auto bad = too_many(HashCount(lookup->block_hashes()))) return bad;
      FromWire(lookup->block_hashes(), &hashes_);
      const int64_t covered = int64_t{ledger_.block_size()} * static_cast<int64_t>(hashes_.size());
      const int32_t num_tokens = lookup->num_tokens() > 0
                                     ? lookup->num_tokens()
                                     : static_cast<int32_t>(std::min<int64_t>(covered, INT32_MAX));
      auto payload = wire::CreateLookupReply(*reply, ledger_.ReusableBlocks(num_tokens, hashes_));
      FinishEnvelope(*reply, request_id, session.id, options_.epoch, wire::Message::LookupReply,
                     payload.Union());
      return std::nullopt;
    }
    case wire::Message::Pin: {
      if (session.role == SessionRole::kExecutor) {
        return Rejection{RejectReason::kPermissionDenied, wire::ErrorCode::PermissionDenied,
                         "executors do not pin prefixes"};
      }
      const wire::Pin* pin = envelope.payload_as_Pin();
      if (auto bad = check_name(pin->name())) return bad;
      if (auto bad = too_many(HashCount(pin->block_hashes()))) return bad;
      FromWire(pin->block_hashes(), &hashes_);
      if (absl::Status pinned = ledger_.Pin(pin->name()->str(), hashes_); !pinned.ok()) {
        ledger_error(pinned);
        return std::nullopt;
      }
      auto payload = wire::CreatePinReply(*reply);
      FinishEnvelope(*reply, request_id, session.id, options_.epoch, wire::Message::PinReply,
                     payload.Union());
      return std::nullopt;
    }
    case wire::Message::Unpin: {
      if (session.role == SessionRole::kExecutor) {
        return Rejection{RejectReason::kPermissionDenied, wire::ErrorCode::PermissionDenied,
                         "executors do not pin prefixes"};
      }
      const wire::Unpin* unpin = envelope.payload_as_Unpin();
      if (auto bad = check_name(unpin->name())) return bad;
      if (absl::Status unpinned = ledger_.Unpin(unpin->name()->str()); !unpinned.ok()) {
        ledger_error(unpinned);
        return std::nullopt;
      }
      auto payload = wire::CreateUnpinReply(*reply);
      FinishEnvelope(*reply, request_id, session.id, options_.epoch, wire::Message::UnpinReply,
                     payload.Union());
      return std::nullopt;
    }
    default:
      return Rejection{RejectReason::kMalformed, wire::ErrorCode::Malformed,
                       "unexpected request type"};
  }
}

// --- Pool and inspection -------------------------------------------------------------------

// --- KV events -----------------------------------------------------------------------------

}  // namespace kvcm::cache_manager
