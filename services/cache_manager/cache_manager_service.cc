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
#include "common/wire/convert.h"

namespace kvcm {
namespace {

constexpr size_t kMaxNameBytes = 128;
// What one op's result may add to a StepReply besides its block ids and copy orders: the
// OpResult table, its vtable, offsets, vector headers with their padding, and a reason
// (the ledger's are under 200 bytes).
constexpr size_t kOpResultBytes = 512;
// The envelope and the StepReply table around the results.
constexpr size_t kStepReplyBytes = 256;
// A sequence id no router can allocate: the ledger's dry runs name it.
constexpr SeqId kDryRunSeq = ~SeqId{0};

// An upper bound of the StepReply to `ops` in bytes, whatever the ledger answers: an
// Allocate returns one block id per block of its tokens, an Append at most one per block
// of its new tokens and a copy-on-write order; other ops return no blocks.
size_t StepReplyBound(std::span<const BlockOp> ops, int32_t block_size) {
  size_t bytes = kStepReplyBytes;
  for (const BlockOp& op : ops) {
    bytes += kOpResultBytes;
    const auto blocks_of = [&](int32_t tokens) {
      return static_cast<size_t>((int64_t{tokens} + block_size - 1) / block_size);
    };
    if (op.kind == wire::StepOp::AllocateOp) {
      bytes += sizeof(BlockId) * blocks_of(op.num_tokens);
    } else if (op.kind == wire::StepOp::AppendOp) {
      bytes += sizeof(BlockId) * (blocks_of(op.num_tokens) + 1) + sizeof(wire::CopyOrder);
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
    case M::Hello: return RequestType::kHello;
    case M::Attach: return RequestType::kAttach;
    case M::Step: return RequestType::kStep;
    case M::Lookup: return RequestType::kLookup;
    case M::Pin: return RequestType::kPin;
    case M::Unpin: return RequestType::kUnpin;
    case M::Stats: return RequestType::kStats;
    case M::Heartbeat: return RequestType::kHeartbeat;
    case M::Goodbye: return RequestType::kGoodbye;
    case M::EventSnapshot: return RequestType::kEventSnapshot;
    case M::DescribeSession: return RequestType::kDescribeSession;
    case M::EndSession: return RequestType::kEndSession;
    case M::BlockMap: return RequestType::kBlockMap;
    default: return std::nullopt;
  }
}

std::optional<SessionRole> SessionRoleOf(wire::Role role) {
  switch (role) {
    case wire::Role::Router: return SessionRole::kRouter;
    case wire::Role::Executor: return SessionRole::kExecutor;
    case wire::Role::Control: return SessionRole::kControl;
    default: return std::nullopt;
  }
}

wire::Role WireRoleOf(SessionRole role) {
  switch (role) {
    case SessionRole::kRouter: return wire::Role::Router;
    case SessionRole::kExecutor: return wire::Role::Executor;
    case SessionRole::kControl: return wire::Role::Control;
    default: return wire::Role::Unknown;
  }
}

flatbuffers::Offset<wire::KvEvent> EncodeEvent(flatbuffers::FlatBufferBuilder& builder,
                                               wire::EventKind kind, const BlockHash* hash,
                                               const BlockHash* parent, BlockId block) {
  wire::BlockHash wire_hash, wire_parent;
  if (hash != nullptr) std::memcpy(static_cast<void*>(&wire_hash), hash, sizeof(*hash));
  if (parent != nullptr) {
    std::memcpy(static_cast<void*>(&wire_parent), parent, sizeof(*parent));
  }
  wire::KvEventBuilder event(builder);
  event.add_kind(kind);
  if (hash != nullptr) event.add_hash(&wire_hash);
  if (parent != nullptr) event.add_parent_hash(&wire_parent);
  event.add_block(block);
  return event.Finish();
}

}  // namespace

const char* RoleName(wire::Role role) {
  switch (role) {
    case wire::Role::Router: return "router";
    case wire::Role::Executor: return "executor";
    case wire::Role::Control: return "control";
    default: return "unknown";
  }
}

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
  if (options.ledger.sliding_window_tokens != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a sliding window (", options.ledger.sliding_window_tokens,
        " tokens) is not supported yet: no message tells the executors the window and they "
        "attend to the whole context, so blocks released behind it would corrupt their "
        "output. Run without it (the model's full context is cached)."));
  }
  BlockLedger::Options ledger_options = options.ledger;
  ledger_options.block_size = options.spec.block_size;
  return BlockLedger::CheckOptions(ledger_options);
}

absl::StatusOr<std::unique_ptr<CacheManagerService>> CacheManagerService::Create(
    const Options& options, ProcessWatcher* watcher, CacheManagerMetrics* metrics,
    absl::Time now) {
  KVCM_CHECK(watcher != nullptr);
  if (absl::Status checked = CheckOptions(options); !checked.ok()) return checked;
  BlockLedger::Options ledger_options = options.ledger;
  ledger_options.block_size = options.spec.block_size;
  ledger_options.record_events = true;
  auto ledger = BlockLedger::Create(ledger_options);
  if (!ledger.ok()) return ledger.status();
  return std::unique_ptr<CacheManagerService>(
      new CacheManagerService(options, *std::move(ledger), watcher, metrics, now));
}

CacheManagerService::CacheManagerService(const Options& options, BlockLedger ledger,
                                         ProcessWatcher* watcher,
                                         CacheManagerMetrics* metrics, absl::Time now)
    : options_(options),
      allowed_uids_(options.allowed_uids.empty() ? std::vector<uid_t>{::geteuid()}
                                                 : options.allowed_uids),
      ledger_(std::move(ledger)),
      watcher_(watcher),
      metrics_(metrics),
      start_time_(now),
      sessions_({.epoch = options.epoch, .heartbeat_timeout = options.heartbeat_timeout}),
      vllm_(ledger_.block_size(), options.hash_algorithm) {}

// --- Dispatch ----------------------------------------------------------------------------

void CacheManagerService::Handle(const std::optional<PeerCredentials>& peer,
                                 std::span<const uint8_t> request, absl::Time now,
                                 flatbuffers::FlatBufferBuilder* reply) {
  reply->Clear();
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
    const uint64_t id = verified.request_id;
    switch (verified.fault) {
      case EnvelopeFault::kOversized:
        return Reject(id, {RejectReason::kOversized, wire::ErrorCode::Malformed,
                           verified.reason}, reply);
      case EnvelopeFault::kUnsupportedVersion:
        return Reject(id, {RejectReason::kUnsupportedVersion,
                           wire::ErrorCode::UnsupportedVersion, verified.reason}, reply);
      default:
        return Reject(id, {RejectReason::kMalformed, wire::ErrorCode::Malformed,
                           verified.reason}, reply);
    }
  }
  const wire::Envelope& envelope = *verified.envelope;
  const uint64_t request_id = envelope.request_id();
  const std::optional<RequestType> type = RequestTypeOf(envelope.payload_type());
  if (!type) {
    return Reject(request_id,
                  {RejectReason::kMalformed, wire::ErrorCode::Malformed,
                   absl::StrCat("message type ",
                                wire::EnumNameMessage(envelope.payload_type()),
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

  using M = wire::Message;
  if (!session->authenticated &&
      (*type == RequestType::kAttach || *type == RequestType::kStep ||
       *type == RequestType::kPin || *type == RequestType::kUnpin)) {
    return Reject(request_id,
                  {RejectReason::kPermissionDenied, wire::ErrorCode::PermissionDenied,
                   absl::StrCat("session ", session->id, " came over tcp:// without the "
                                "run directory's secret: it may read, but not attach, pin or "
                                "step")},
                  reply);
  }
  switch (envelope.payload_type()) {
    case M::Heartbeat: return HandleHeartbeat(envelope, *session, reply);
    case M::Goodbye: {
      const uint64_t id = session->id;
      const int32_t released = EndSession(id, ReclaimReason::kGoodbye);
      auto payload = wire::CreateGoodbyeReply(*reply, released);
      return FinishEnvelope(*reply, request_id, id, options_.epoch, M::GoodbyeReply,
                            payload.Union());
    }
    case M::Attach: return HandleAttach(envelope, reply);
    case M::Stats: return HandleStats(envelope, now, reply);
    case M::EventSnapshot: return HandleEventSnapshot(envelope, reply);
    case M::BlockMap: return HandleBlockMap(envelope, reply);
    case M::Step:
      if (session->role != SessionRole::kRouter) {
        return Reject(request_id,
                      {RejectReason::kPermissionDenied, wire::ErrorCode::PermissionDenied,
                       absl::StrCat("only routers change sequences; this session is a ",
                                    RoleName(WireRoleOf(session->role)))},
                      reply);
      }
      return HandleStep(envelope, request, *session, reply);
    case M::DescribeSession: return HandleDescribeSession(envelope, *session, reply);
    case M::EndSession: {
      const uint64_t target = envelope.payload_as_EndSession()->session_id();
      if (session->role != SessionRole::kControl || !session->pid_verified) {
        return Reject(request_id,
                      {RejectReason::kPermissionDenied, wire::ErrorCode::PermissionDenied,
                       "only a control session over ipc:// (kvcmctl) ends other sessions"},
                      reply);
      }
      if (target == session->id) {
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
      return FinishEnvelope(*reply, request_id, session->id, options_.epoch,
                            M::EndSessionReply, payload.Union());
    }
    default: {
      if (auto refused = HandlePrefixRequest(envelope, *session, reply)) {
        return Reject(request_id, *refused, reply);
      }
      return;
    }
  }
}

bool CacheManagerService::SecretMatches(const flatbuffers::String* given) const {
  if (options_.tcp_secret.empty() || given == nullptr) return false;
  const std::string& secret = options_.tcp_secret;
  if (given->size() != secret.size()) return false;
  // Constant time in the contents: a peer learns nothing from how long a refusal took.
  uint8_t difference = 0;
  for (size_t i = 0; i < secret.size(); ++i) {
    difference |= static_cast<uint8_t>(given->c_str()[i] ^ secret[i]);
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
                    absl::StrCat("session ", id, " is not registered here (never, or it ended "
                                 "long ago): send Hello first")};
      break;
    case Refusal::kEnded:
      *rejection = {RejectReason::kStaleSession, wire::ErrorCode::StaleSession,
                    absl::StrCat("session ", id, " has ended: register again")};
      break;
    case Refusal::kOtherProcess:
      *rejection = {RejectReason::kPermissionDenied, wire::ErrorCode::PermissionDenied,
                    absl::StrCat("session ", id, " belongs to pid ", checked.session->pid,
                                 ", not to ",
                                 peer ? absl::StrCat("pid ", peer->pid)
                                      : std::string("a peer without credentials (tcp://)"))};
      break;
    case Refusal::kQuarantined:
      *rejection = {RejectReason::kStaleSession, wire::ErrorCode::StaleSession,
                    absl::StrCat("session ", id, " missed its heartbeats and was quarantined; "
                                 "its sequences are gone: register again")};
      break;
  }
  return nullptr;
}

// --- Sessions ----------------------------------------------------------------------------

void CacheManagerService::HandleHello(const wire::Envelope& envelope,
                                      const std::optional<PeerCredentials>& peer,
                                      absl::Time now, flatbuffers::FlatBufferBuilder* reply) {
  const uint64_t request_id = envelope.request_id();
  const wire::Hello* hello = envelope.payload_as_Hello();
  if (hello == nullptr || !SessionRoleOf(hello->role())) {
    return Reject(request_id,
                  {RejectReason::kInvalidArgument, wire::ErrorCode::InvalidArgument,
                   "Hello needs a role: router, executor or control"},
                  reply);
  }
  if (hello->name() != nullptr && hello->name()->size() > kMaxNameBytes) {
    return Reject(request_id,
                  {RejectReason::kInvalidArgument, wire::ErrorCode::InvalidArgument,
                   absl::StrCat("client name of ", hello->name()->size(),
                                " bytes is longer than ", kMaxNameBytes)},
                  reply);
  }
  if (hello->pid() <= 0 && !peer) {
    return Reject(request_id,
                  {RejectReason::kInvalidArgument, wire::ErrorCode::InvalidArgument,
                   "Hello needs the client's pid"},
                  reply);
  }
  const bool granted = peer.has_value() || SecretMatches(hello->secret());
  if (!granted && hello->role() != wire::Role::Control) {
    return Reject(request_id,
                  {RejectReason::kPermissionDenied, wire::ErrorCode::PermissionDenied,
                   absl::StrCat("over tcp:// a ", RoleName(hello->role()),
                                " must give the secret of the cache manager's run directory "
                                "(RUN_DIR/tcp-secret); without it only a control session "
                                "(read-only) is granted")},
                  reply);
  }
  if (peer && hello->pid() != peer->pid) {
    return Reject(request_id,
                  {RejectReason::kPermissionDenied, wire::ErrorCode::PermissionDenied,
                   absl::StrCat("Hello claims pid ", hello->pid(),
                                " but the connection belongs to pid ", peer->pid)},
                  reply);
  }
  const pid_t pid = hello->pid();
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
  session.role = *SessionRoleOf(hello->role());
  session.pid = pid;
  session.name = hello->name() != nullptr ? hello->name()->str() : std::string();
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

  auto payload = wire::CreateHelloReply(
      *reply, id, options_.epoch,
      static_cast<uint32_t>(absl::ToInt64Milliseconds(options_.heartbeat_interval)),
      static_cast<uint32_t>(absl::ToInt64Milliseconds(options_.heartbeat_timeout)),
      ledger_.num_blocks(), ledger_.block_size(), ToWire(options_.hash_algorithm),
      options_.max_ops_per_step, static_cast<uint32_t>(options_.max_message_bytes),
      options_.vllm_events);
  FinishEnvelope(*reply, request_id, id, options_.epoch, wire::Message::HelloReply,
                 payload.Union());
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
    KVCM_CHECK(freed.ok()) << "sequence " << seq << " to free is unknown to the ledger: "
                           << freed.ToString();
  }
  const auto released = static_cast<int32_t>(ledger_.Stats().blocks_released - released_before);
  if (count && metrics_ != nullptr && released > 0) metrics_->CountReclaimed(reason, released);
  return released;
}

void CacheManagerService::HandleHeartbeat(const wire::Envelope& envelope, Session& session,
                                          flatbuffers::FlatBufferBuilder* reply) {
  const wire::Heartbeat* heartbeat = envelope.payload_as_Heartbeat();
  if (session.role == SessionRole::kExecutor && heartbeat->fence_acks() != nullptr) {
    for (uint64_t fence_id : CopyScalars(heartbeat->fence_acks())) {
      if (session.pending_fences.erase(fence_id) > 0) AcknowledgeFence(fence_id, session.id);
    }
  }
  std::vector<uint64_t> ids(session.pending_fences.begin(), session.pending_fences.end());
  std::sort(ids.begin(), ids.end());
  std::vector<wire::Fence> fences;
  std::vector<flatbuffers::Offset<wire::SequenceFence>> sequence_fences;
  for (uint64_t fence_id : ids) {
    const Fence* open = fences_.Find(fence_id);
    KVCM_CHECK(open != nullptr) << "session " << session.id << " waits in closed fence "
                                << fence_id;
    const Fence& fence = *open;
    if (fence.router_seqs.empty()) {
      fences.emplace_back(fence_id, fence.router_session);
    } else {
      sequence_fences.push_back(wire::CreateSequenceFence(
          *reply, fence_id, fence.router_session, reply->CreateVector(fence.router_seqs)));
    }
  }
  auto whole = reply->CreateVectorOfStructs(fences);
  auto scoped = sequence_fences.empty() ? 0 : reply->CreateVector(sequence_fences);
  auto payload = wire::CreateHeartbeatReply(*reply, whole, scoped);
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

CacheManagerService::HeldBlocks CacheManagerService::BlocksHeldApart() const {
  HeldBlocks held;
  for (const auto& [block, state] : HeldApartList()) {
    ++(state == MapState::kQuarantined ? held.quarantined : held.draining);
  }
  return held;
}

std::vector<std::pair<BlockId, MapState>> CacheManagerService::HeldApartList() const {
  struct Refs {
    int32_t quarantined = 0;
    int32_t draining = 0;
  };
  absl::flat_hash_map<BlockId, Refs> refs;
  auto count = [&](SeqId seq, int32_t Refs::*field) {
    auto table = ledger_.BlockTable(seq);
    KVCM_CHECK(table.ok()) << table.status().ToString();
    for (BlockId block : *table) {
      if (block != kNoBlock) ++(refs[block].*field);
    }
  };
  absl::flat_hash_set<uint64_t> quarantined;
  for (const auto& [id, session] : sessions_.sessions()) {
    if (session.quarantined && session.num_seqs > 0) quarantined.insert(id);
  }
  if (!quarantined.empty()) {
    ledger_.ForEachSequence([&](SeqId seq, uint64_t owner) {
      if (owner != 0 && quarantined.contains(owner)) count(seq, &Refs::quarantined);
    });
  }
  for (const auto& [id, fence] : fences_.fences()) {
    for (SeqId seq : fence.seqs) count(seq, &Refs::draining);
  }
  std::vector<std::pair<BlockId, MapState>> held;
  for (const auto& [block, r] : refs) {
    if (r.quarantined + r.draining != ledger_.RefCount(block)) continue;
    held.emplace_back(block, r.quarantined > 0 ? MapState::kQuarantined : MapState::kDraining);
  }
  std::sort(held.begin(), held.end());
  return held;
}

void CacheManagerService::HandleBlockMap(const wire::Envelope& envelope,
                                         flatbuffers::FlatBufferBuilder* reply) {
  const wire::BlockMap* request = envelope.payload_as_BlockMap();
  const int32_t max_cells = BlockMapCellsFor(request == nullptr ? 0 : request->max_cells());
  ledger_.FillBlockMap(max_cells, HeldApartList(), &block_map_);
  const auto payload = EncodeBlockMapReply(*reply, block_map_);
  FinishEnvelope(*reply, envelope.request_id(), envelope.session_id(), options_.epoch,
                 wire::Message::BlockMapReply, payload.Union());
}

// --- Step ----------------------------------------------------------------------------------

std::optional<CacheManagerService::Rejection> CacheManagerService::ValidateStep(
    std::span<const BlockOp> ops, const Session& session) {
  // Each check is a test that passes inline; only a failing one builds its Rejection (out
  // of line, in the lambdas below). A decode step is a Commit and an Append per running
  // sequence, and an optional<Rejection> returned per check was most of this function.
  const int64_t max_tokens = int64_t{ledger_.num_blocks()} * ledger_.block_size();
  // Live sequences of the session after the ops so far.
  auto live_seqs = static_cast<int64_t>(session.num_seqs);
  auto no_room = [&](size_t i, wire::StepOp type) {
    return Rejection{RejectReason::kLimitExceeded, wire::ErrorCode::ResourceExhausted,
                     absl::StrCat("op ", i, " (", BlockOpName(type), "): the session would ",
                                  "hold more than ", options_.max_sequences_per_session,
                                  " live sequences, its limit")};
  };
  // Only the steps that allocate, fork or free put anything in these: a decode step leaves
  // them empty, and its lookups below skip them.
  if (!step_seqs_.empty()) step_seqs_.clear();
  if (!step_drained_.empty()) step_drained_.clear();
  // Tokens of `seq` whose KV can be written by now: those it had before this step (the
  // executors write only after the step's reply), which is all a Commit may cover.
  auto writable = [&](SeqId seq) -> int32_t {
    if (!step_seqs_.empty()) {
      if (auto it = step_seqs_.find(seq);
          it != step_seqs_.end() && it->second.written != StepSeq::kNotWritten) {
        return it->second.written;
      }
    }
    absl::StatusOr<int32_t> tokens = ledger_.NumTokens(seq);
    return tokens.ok() ? *tokens : 0;
  };
  // Who holds `seq` after the ops validated so far.
  enum class Holder { kThisSession, kOtherSession, kNobody };
  auto holder = [&](SeqId seq) {
    if (!step_seqs_.empty()) {
      if (auto it = step_seqs_.find(seq); it != step_seqs_.end()) {
        return it->second.live ? Holder::kThisSession : Holder::kNobody;
      }
    }
    const uint64_t owner = ledger_.OwnerOf(seq);
    if (owner == 0) return Holder::kNobody;
    return owner == session.id ? Holder::kThisSession : Holder::kOtherSession;
  };
  // The rejection of an op on `seq`, which is `held` by another session or by nobody.
  auto not_owned = [&](size_t i, wire::StepOp type, SeqId seq, Holder held) {
    if (held == Holder::kOtherSession) {
      return Rejection{RejectReason::kWrongOwner, wire::ErrorCode::PermissionDenied,
                       absl::StrCat("op ", i, " (", BlockOpName(type), "): sequence ", seq,
                                    " belongs to another session")};
    }
    return Rejection{RejectReason::kUnknownSequence, wire::ErrorCode::NotFound,
                     absl::StrCat("op ", i, " (", BlockOpName(type), "): sequence ", seq,
                                  " is not live")};
  };
  auto check_new = [&](size_t i, wire::StepOp type, SeqId seq) -> std::optional<Rejection> {
    if (seq >= kFirstDrainingSeq) {
      return Rejection{RejectReason::kInvalidArgument, wire::ErrorCode::InvalidArgument,
                       absl::StrCat("op ", i, " (", BlockOpName(type), "): sequence id ", seq,
                                    " is reserved (ids from 2^63 up are the cache manager's)")};
    }
    if (session.drained_ids.contains(seq) || step_drained_.contains(seq)) {
      return Rejection{RejectReason::kInvalidArgument, wire::ErrorCode::InvalidArgument,
                       absl::StrCat("op ", i, " (", BlockOpName(type), "): sequence id ", seq,
                                    " was freed with drain and cannot be live again (the "
                                    "executors refuse it for good): choose a new id")};
    }
    auto it = step_seqs_.find(seq);
    const bool live = it != step_seqs_.end() ? it->second.live : ledger_.IsLive(seq);
    if (!live) return std::nullopt;
    return Rejection{RejectReason::kDuplicateSequence, wire::ErrorCode::AlreadyExists,
                     absl::StrCat("op ", i, " (", BlockOpName(type), "): sequence ", seq,
                                  " is already live")};
  };
  auto invalid = [](size_t i, wire::StepOp type, const std::string& what) {
    return Rejection{RejectReason::kInvalidArgument, wire::ErrorCode::InvalidArgument,
                     absl::StrCat("op ", i, " (", BlockOpName(type), "): ", what)};
  };
  auto tokens_ok = [max_tokens](int32_t tokens) { return tokens >= 0 && tokens <= max_tokens; };
  auto bad_tokens = [&](size_t i, wire::StepOp type, int32_t tokens, const char* field) {
    return invalid(i, type, absl::StrCat(field, " = ", tokens, " is outside [0, ", max_tokens,
                                         "] (the pool's capacity in tokens)"));
  };
  // At most one hash per full block of `tokens`.
  auto hashes_ok = [&](const BlockOp& op) {
    return static_cast<int64_t>(op.hashes.size()) <= op.num_tokens / ledger_.block_size();
  };
  auto bad_hashes = [&](size_t i, const BlockOp& op, const char* what) {
    return invalid(i, op.kind, absl::StrCat(op.hashes.size(), what, op.num_tokens,
                                            " tokens (at most one per full block)"));
  };

  for (size_t i = 0; i < ops.size(); ++i) {
    const BlockOp& op = ops[i];
    const wire::StepOp type = op.kind;
    switch (type) {
      case wire::StepOp::AllocateOp:
        if (!tokens_ok(op.num_tokens)) return bad_tokens(i, type, op.num_tokens, "num_tokens");
        if (!hashes_ok(op)) return bad_hashes(i, op, " block hashes for ");
        if (auto bad = check_new(i, type, op.seq)) return bad;
        if (++live_seqs > options_.max_sequences_per_session) return no_room(i, type);
        step_seqs_[op.seq] = StepSeq{true, 0};
        break;
      case wire::StepOp::AppendOp:
        if (!tokens_ok(op.num_tokens)) return bad_tokens(i, type, op.num_tokens, "num_tokens");
        if (const Holder held = holder(op.seq); held != Holder::kThisSession) {
          return not_owned(i, type, op.seq, held);
        }
        break;
      case wire::StepOp::ForkOp: {
        if (const Holder held = holder(op.seq); held != Holder::kThisSession) {
          return not_owned(i, type, op.seq, held);
        }
        if (auto bad = check_new(i, type, op.child)) return bad;
        if (++live_seqs > options_.max_sequences_per_session) return no_room(i, type);
        const int32_t written = writable(op.seq);
        step_seqs_[op.child] = StepSeq{true, written};
        break;
      }
      case wire::StepOp::CommitOp: {
        if (!tokens_ok(op.num_tokens)) {
          return bad_tokens(i, type, op.num_tokens, "num_committed_tokens");
        }
        if (!hashes_ok(op)) return bad_hashes(i, op, " new block hashes for committing ");
        if (const Holder held = holder(op.seq); held != Holder::kThisSession) {
          return not_owned(i, type, op.seq, held);
        }
        if (const auto block_size = static_cast<size_t>(ledger_.block_size());
            op.tokens.size() % block_size != 0 ||
            op.tokens.size() / block_size >
                static_cast<size_t>(std::max(op.num_tokens, 0)) / block_size) {
          return invalid(i, type, absl::StrCat(
              "carries ", op.tokens.size(), " token ids for a commit of ", op.num_tokens,
              " tokens: give whole blocks of ", block_size, " tokens, the last full blocks ",
              "committed, or none"));
        }
        if (const int32_t before = writable(op.seq); op.num_tokens > before) {
          return invalid(i, type, absl::StrCat(
              "commits ", op.num_tokens, " tokens of sequence ", op.seq, ", which had ", before,
              " before this step: the KV of tokens added in the same step cannot have been "
              "written yet (commit them in the next step)"));
        }
        break;
      }
      case wire::StepOp::CanAllocateOp:
        if (!tokens_ok(op.num_tokens)) return bad_tokens(i, type, op.num_tokens, "num_tokens");
        if (!hashes_ok(op)) return bad_hashes(i, op, " block hashes for ");
        break;
      case wire::StepOp::FreeOp: {
        if (op.seq >= kFirstDrainingSeq) {
          return invalid(i, type, absl::StrCat("sequence id ", op.seq,
                                               " is reserved (ids from 2^63 up are the "
                                               "cache manager's)"));
        }
        // A sequence nobody holds (freed already: a retried free) fails alone, as NOT_FOUND
        // in its result; another session's is refused with the whole step.
        const Holder held = holder(op.seq);
        if (held == Holder::kOtherSession) return not_owned(i, type, op.seq, held);
        if (held == Holder::kThisSession) --live_seqs;
        step_seqs_[op.seq].live = false;
        if (op.drain) step_drained_.insert(op.seq);
        break;
      }
      default:  // DecodeStep let only the union's types through
        KVCM_CHECK(false) << "decoded step op of unknown type";
    }
  }
  return std::nullopt;
}

void CacheManagerService::HandleStep(const wire::Envelope& envelope,
                                     std::span<const uint8_t> request, Session& session,
                                     flatbuffers::FlatBufferBuilder* reply) {
  const uint64_t request_id = envelope.request_id();
  const size_t request_hash = HashBytes(request);
  if (const Session::SentStep* sent = session.FindSentStep(request_id)) {
    if (sent->request_hash != request_hash || sent->request_size != request.size()) {
      return Reject(request_id,
                    {RejectReason::kInvalidArgument, wire::ErrorCode::InvalidArgument,
                     absl::StrCat("request id ", request_id, " was a different Step of this "
                                  "session: a retry must resend the same bytes")},
                    reply);
    }
    // A retry of a Step already applied: its reply again, its ops not again.
    reply->Clear();
    reply->PushBytes(sent->reply.data(), sent->reply.size());
    if (metrics_ != nullptr) metrics_->CountReplayedStep();
    return;
  }
  // Request ids of a session's Steps increase, so an id not above the last applied one is
  // a retry of a Step that is no longer kept (or a client bug): running it again could
  // apply its ops twice.
  if (request_id != 0 && request_id <= session.last_step_request_id) {
    return Reject(request_id,
                  {RejectReason::kInvalidArgument, wire::ErrorCode::FailedPrecondition,
                   absl::StrCat("request id ", request_id, " is not above the last Step ",
                                "applied in this session (", session.last_step_request_id,
                                ") and is not among the ", session.sent_steps.size(),
                                " kept for retries: it is not run again; DescribeSession ",
                                "tells what the session holds")},
                  reply);
  }
  const StepLimits limits{options_.max_ops_per_step, options_.max_hashes_per_message,
                          ledger_.block_size()};
  if (absl::Status decoded = DecodeStep(*envelope.payload_as_Step(), limits, &step_ops_);
      !decoded.ok()) {
    const bool oversized = absl::IsResourceExhausted(decoded);
    return Reject(request_id,
                  {oversized ? RejectReason::kOversized : RejectReason::kMalformed,
                   oversized ? wire::ErrorCode::InvalidArgument : wire::ErrorCode::Malformed,
                   std::string(decoded.message())},
                  reply);
  }
  if (auto rejection = ValidateStep(step_ops_, session)) {
    return Reject(request_id, *rejection, reply);
  }
  // Every applied Step's reply is kept for a retry, so it must fit the message limit that
  // bounds what the session can make the cache manager hold (and what it announced).
  if (const size_t bound = StepReplyBound(step_ops_, ledger_.block_size());
      bound > options_.max_message_bytes) {
    return Reject(request_id,
                  {RejectReason::kOversized, wire::ErrorCode::InvalidArgument,
                   absl::StrCat("the reply to this step could take ", bound, " bytes, over the ",
                                options_.max_message_bytes, "-byte message limit: split it ",
                                "into smaller steps")},
                  reply);
  }
  std::vector<flatbuffers::Offset<wire::OpResult>>& results = step_results_;
  results.clear();
  OpResultWriter result_writer(*reply);
  for (const BlockOp& op : step_ops_) {
    OpOutcome& outcome = outcome_;
    outcome.status = absl::OkStatus();
    outcome.blocks.clear();
    outcome.copies.clear();
    outcome.num_cached_tokens = 0;
    outcome.blocks_needed = 0;
    switch (op.kind) {
      case wire::StepOp::AllocateOp: {
        outcome.status = ledger_.Allocate(op.seq, op.num_tokens, op.hashes, &allocated_);
        if (!outcome.status.ok()) break;
        KVCM_CHECK(ledger_.SetOwner(op.seq, session.id).ok());
        ++session.num_seqs;
        outcome.blocks.swap(allocated_.blocks);
        outcome.num_cached_tokens = allocated_.num_cached_tokens;
        break;
      }
      case wire::StepOp::AppendOp: {
        outcome.status = ledger_.Append(op.seq, op.num_tokens, &appended_);
        if (!outcome.status.ok()) break;
        outcome.blocks.swap(appended_.new_blocks);
        outcome.copies.swap(appended_.copies);
        break;
      }
      case wire::StepOp::ForkOp:
        outcome.status = ledger_.Fork(op.seq, op.child);
        if (!outcome.status.ok()) break;
        KVCM_CHECK(ledger_.SetOwner(op.child, session.id).ok());
        ++session.num_seqs;
        break;
      case wire::StepOp::CommitOp:
        outcome.status = ledger_.Commit(op.seq, op.num_tokens, op.hashes);
        if (options_.vllm_events && !op.tokens.empty() && outcome.status.ok()) {
          if (auto table = ledger_.BlockTable(op.seq); table.ok()) {
            vllm_.AddCommitTokens(*table, op.num_tokens, op.tokens);
          }
        }
        break;
      case wire::StepOp::FreeOp: {
        const SeqId seq = op.seq;
        if (ledger_.OwnerOf(seq) != session.id) {
          outcome.status = absl::NotFoundError(absl::StrCat("sequence ", seq, " is not live"));
        } else if (op.drain) {
          // Its blocks wait until every executor stopped writing it (a SequenceFence).
          session.drained_ids.insert(seq);
          const SeqId one[] = {seq};
          FenceSequences(session.id, one, ReclaimReason::kGoodbye, {seq});
        } else {
          outcome.status = ledger_.Free(seq);
        }
        if (outcome.status.ok()) --session.num_seqs;
        break;
      }
      case wire::StepOp::CanAllocateOp: {
        auto plan = ledger_.CanAllocate(kDryRunSeq, op.num_tokens, op.hashes);
        if (!plan.ok()) {
          outcome.status = plan.status();
          break;
        }
        outcome.num_cached_tokens = plan->prefix_hit_blocks * ledger_.block_size();
        outcome.blocks_needed = plan->blocks_needed;
        break;
      }
      default:
        KVCM_CHECK(false) << "op type passed validation but is unknown";
    }
    results.push_back(result_writer.Add(outcome));
  }
  auto vector = reply->CreateVector(results);
  auto payload = wire::CreateStepReply(*reply, vector, ledger_.AvailableBlocks());
  FinishEnvelope(*reply, request_id, session.id, options_.epoch, wire::Message::StepReply,
                 payload.Union());
  // Kept for a retry, whatever its size (at most max_message_bytes, checked above), over
  // the oldest of the ring.
  session.KeepSentStep(request_id, request_hash, request.size(),
                       {reply->GetBufferPointer(), reply->GetSize()});
}

void CacheManagerService::HandleDescribeSession(const wire::Envelope& envelope,
                                                const Session& session,
                                                flatbuffers::FlatBufferBuilder* reply) {
  const std::vector<SeqId> seqs = SeqsOf(session);
  std::vector<flatbuffers::Offset<wire::SequenceState>> states;
  states.reserve(seqs.size());
  for (SeqId seq : seqs) {
    absl::StatusOr<std::vector<BlockId>> table = ledger_.BlockTable(seq);
    absl::StatusOr<int32_t> tokens = ledger_.NumTokens(seq);
    absl::StatusOr<int32_t> committed = ledger_.NumCommittedTokens(seq);
    KVCM_CHECK(table.ok() && tokens.ok() && committed.ok())
        << "session " << session.id << " owns sequence " << seq << " unknown to the ledger";
    auto blocks = reply->CreateVector(*table);
    states.push_back(wire::CreateSequenceState(*reply, seq, *tokens, *committed, blocks));
  }
  auto vector = reply->CreateVector(states);
  auto payload = wire::CreateDescribeSessionReply(*reply, vector, session.last_step_request_id);
  FinishEnvelope(*reply, envelope.request_id(), session.id, options_.epoch,
                 wire::Message::DescribeSessionReply, payload.Union());
}

// --- Prefix cache --------------------------------------------------------------------------

std::optional<CacheManagerService::Rejection> CacheManagerService::HandlePrefixRequest(
    const wire::Envelope& envelope, const Session& session,
    flatbuffers::FlatBufferBuilder* reply) {
  const uint64_t request_id = envelope.request_id();
  auto too_many = [&](size_t count) -> std::optional<Rejection> {
    if (count <= static_cast<size_t>(options_.max_hashes_per_message)) return std::nullopt;
    return Rejection{RejectReason::kOversized, wire::ErrorCode::InvalidArgument,
                     absl::StrCat(count, " block hashes exceed the limit of ",
                                  options_.max_hashes_per_message)};
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
      const int32_t num_tokens =
          lookup->num_tokens() > 0
              ? lookup->num_tokens()
              : static_cast<int32_t>(std::min<int64_t>(covered, INT32_MAX));
      auto payload =
          wire::CreateLookupReply(*reply, ledger_.ReusableBlocks(num_tokens, hashes_));
      FinishEnvelope(*reply, request_id, session.id, options_.epoch,
                     wire::Message::LookupReply, payload.Union());
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
      FinishEnvelope(*reply, request_id, session.id, options_.epoch,
                     wire::Message::UnpinReply, payload.Union());
      return std::nullopt;
    }
    default:
      return Rejection{RejectReason::kMalformed, wire::ErrorCode::Malformed,
                       "unexpected request type"};
  }
}

// --- Pool and inspection -------------------------------------------------------------------

void CacheManagerService::HandleAttach(const wire::Envelope& envelope,
                                       flatbuffers::FlatBufferBuilder* reply) {
  const PoolExport& pool = options_.pool;
  auto spec = ToWire(*reply, options_.spec);
  auto layout = wire::CreatePoolLayout(*reply, pool.layer_stride, pool.kv_stride,
                                       pool.block_stride, pool.token_stride, pool.head_stride,
                                       pool.elem_bytes, pool.total_bytes);
  auto path = reply->CreateString(pool.fd_channel_path);
  auto handle = reply->CreateVector(pool.cuda_ipc_handle);
  auto descriptor =
      wire::CreatePoolDescriptor(*reply, spec, ledger_.num_blocks(), layout, pool.backend,
                                 options_.epoch, path, pool.cuda_device, handle);
  auto payload = wire::CreateAttachReply(*reply, descriptor);
  FinishEnvelope(*reply, envelope.request_id(), envelope.session_id(), options_.epoch,
                 wire::Message::AttachReply, payload.Union());
}

void CacheManagerService::HandleStats(const wire::Envelope& envelope, absl::Time now,
                                      flatbuffers::FlatBufferBuilder* reply) {
  const LedgerStats stats = ledger_.Stats();
  auto spec = ToWire(*reply, options_.spec);
  auto events_endpoint = reply->CreateString(options_.events_endpoint);
  auto metrics_url = reply->CreateString(options_.metrics_url);
  std::vector<uint64_t> ids;
  ids.reserve(static_cast<size_t>(sessions_.size()));
  for (const auto& [id, session] : sessions_.sessions()) ids.push_back(id);
  std::sort(ids.begin(), ids.end());
  // A session id is all that binds a tcp:// session: a peer that has not proven who it is
  // (no kernel credentials, no secret) gets the list with every id 0, so that it cannot
  // act as another session.
  const Session* asker = sessions_.Find(envelope.session_id());
  const bool show_ids = asker != nullptr && asker->authenticated;
  std::vector<flatbuffers::Offset<wire::SessionSummary>> summaries;
  summaries.reserve(ids.size());
  for (uint64_t id : ids) {
    const Session& session = *sessions_.Find(id);
    summaries.push_back(wire::CreateSessionSummary(
        *reply, show_ids ? id : 0, WireRoleOf(session.role), session.pid, session.pid_verified,
        reply->CreateString(session.name), session.quarantined,
        session.num_seqs,
        static_cast<int32_t>(session.pending_fences.size())));
  }
  auto session_list = reply->CreateVector(summaries);
  wire::StatsReplyBuilder out(*reply);
  out.add_session_list(session_list);
  out.add_num_blocks(stats.num_blocks);
  out.add_block_size(stats.block_size);
  out.add_free_blocks(stats.free_blocks);
  out.add_in_use_blocks(stats.in_use_blocks);
  out.add_cached_blocks(stats.cached_blocks);
  out.add_pinned_blocks(stats.pinned_blocks);
  const HeldBlocks held = BlocksHeldApart();
  out.add_quarantined_blocks(held.quarantined);
  out.add_draining_blocks(held.draining);
  out.add_open_fences(static_cast<uint32_t>(fences_.size()));
  out.add_live_sequences(stats.live_sequences);
  out.add_usage_ratio(stats.usage_ratio);
  out.add_occupancy_ratio(stats.occupancy_ratio);
  out.add_prefix_query_tokens(stats.prefix_query_tokens);
  out.add_prefix_hit_tokens(stats.prefix_hit_tokens);
  out.add_blocks_allocated(stats.blocks_allocated);
  out.add_blocks_released(stats.blocks_released);
  out.add_evictions(stats.evictions);
  out.add_allocation_failures(stats.allocation_failures);
  out.add_cow_copies(stats.cow_copies);
  out.add_epoch(options_.epoch);
  out.add_sessions(static_cast<uint32_t>(sessions_.size()));
  out.add_events_published(events_published_);
  out.add_backend(options_.pool.backend);
  out.add_pool_bytes(options_.pool.total_bytes);
  out.add_block_bytes(static_cast<uint64_t>(options_.spec.BytesPerBlock()));
  out.add_spec(spec);
  out.add_uptime_seconds(absl::ToDoubleSeconds(now - start_time_));
  out.add_rejected_messages(rejected_messages_);
  out.add_events_endpoint(events_endpoint);
  out.add_metrics_url(metrics_url);
  auto payload = out.Finish();
  FinishEnvelope(*reply, envelope.request_id(), envelope.session_id(), options_.epoch,
                 wire::Message::StatsReply, payload.Union());
}

CacheManagerSnapshot CacheManagerService::Snapshot() const {
  CacheManagerSnapshot snapshot;
  snapshot.ledger = ledger_.Stats();
  const HeldBlocks held = BlocksHeldApart();
  snapshot.quarantined_blocks = held.quarantined;
  snapshot.draining_blocks = held.draining;
  snapshot.open_fences = fences_.size();
  for (const auto& [id, session] : sessions_.sessions()) {
    ++snapshot.sessions_by_role[static_cast<size_t>(session.role)];
  }
  snapshot.epoch = options_.epoch;
  snapshot.events_published = events_published_;
  return snapshot;
}

// --- KV events -----------------------------------------------------------------------------

uint64_t CacheManagerService::TakeEventBatch(flatbuffers::FlatBufferBuilder* out) {
  std::vector<BlockEvent> events = ledger_.TakeEvents();
  // Even an empty batch: the commits' token ids are not kept past it.
  if (options_.vllm_events) vllm_.AddBatch(events, announce_cleared_);
  if (events.empty() && !announce_cleared_) return 0;
  out->Clear();
  std::vector<flatbuffers::Offset<wire::KvEvent>> encoded;
  encoded.reserve(events.size() + 1);
  if (announce_cleared_) {
    encoded.push_back(EncodeEvent(*out, wire::EventKind::AllBlocksCleared, nullptr, nullptr,
                                  kNoBlock));
    announce_cleared_ = false;
  }
  for (const BlockEvent& event : events) {
    switch (event.kind) {
      case BlockEvent::Kind::kStored:
        encoded.push_back(EncodeEvent(*out, wire::EventKind::BlockStored, &event.hash,
                                      event.has_parent ? &event.parent_hash : nullptr,
                                      event.block));
        break;
      case BlockEvent::Kind::kRemoved:
        encoded.push_back(EncodeEvent(*out, wire::EventKind::BlockRemoved, &event.hash,
                                      nullptr, event.block));
        break;
      case BlockEvent::Kind::kAllCleared:
        encoded.push_back(EncodeEvent(*out, wire::EventKind::AllBlocksCleared, nullptr,
                                      nullptr, kNoBlock));
        break;
    }
  }
  auto vector = out->CreateVector(encoded);
  const uint64_t seq = ++event_seq_;
  out->Finish(wire::CreateEventBatch(*out, seq, options_.epoch, vector));
  events_published_ += encoded.size();
  return seq;
}

void CacheManagerService::HandleEventSnapshot(const wire::Envelope& envelope,
                                              flatbuffers::FlatBufferBuilder* reply) {
  std::vector<flatbuffers::Offset<wire::KvEvent>> encoded;
  // The epoch's first batch cleared the subscribers' mirrors before any could connect: a
  // late subscriber learns it here.
  encoded.push_back(
      EncodeEvent(*reply, wire::EventKind::AllBlocksCleared, nullptr, nullptr, kNoBlock));
  for (const auto& [block, hash] : ledger_.IndexedBlocks()) {
    encoded.push_back(
        EncodeEvent(*reply, wire::EventKind::BlockStored, &hash, nullptr, block));
  }
  auto vector = reply->CreateVector(encoded);
  auto payload = wire::CreateEventSnapshotReply(*reply, event_seq_, options_.epoch, vector);
  FinishEnvelope(*reply, envelope.request_id(), envelope.session_id(), options_.epoch,
                 wire::Message::EventSnapshotReply, payload.Union());
}

}  // namespace kvcm
