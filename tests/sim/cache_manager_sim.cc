#include "tests/sim/cache_manager_sim.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <queue>
#include <random>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "common/block/block_hash.h"
#include "common/block/block_ledger.h"
#include "common/wire/convert.h"
#include "common/wire/envelope.h"
#include "common/wire/step_codec.h"
#include "flatbuffers/flatbuffers.h"
#include "schemas/kvcm_protocol_generated.h"
#include "services/cache_manager/cache_manager_service.h"
#include "services/cache_manager/process_watcher.h"

namespace kvcm::sim {

void SimStats::Add(const SimStats& o) {
  events += o.events;
  messages += o.messages;
  dropped += o.dropped;
  duplicated += o.duplicated;
  delayed += o.delayed;
  client_crashes += o.client_crashes;
  client_hangs += o.client_hangs;
  cm_crashes += o.cm_crashes;
  cm_hangs += o.cm_hangs;
  goodbyes += o.goodbyes;
  steps_written += o.steps_written;
  steps_refused += o.steps_refused;
  drained_frees += o.drained_frees;
  fence_acks += o.fence_acks;
  quarantines += o.quarantines;
  blocks_handed += o.blocks_handed;
  writer_checks += o.writer_checks;
}

namespace {

constexpr int32_t kBlocks = 32;
constexpr int32_t kBlockSize = 4;
constexpr int32_t kMaxTokens = 8 * kBlockSize;  // per sequence
constexpr int kMaxSeqsPerRouter = 4;
constexpr int kPrompts = 3;  // prompt families: sequences of one share their prefix
const absl::Duration kHeartbeatInterval = absl::Seconds(1);
const absl::Duration kHeartbeatTimeout = absl::Seconds(5);
const absl::Duration kCallTimeout = absl::Milliseconds(800);
// A router gives up on a step its executor did not answer in this long (and drains it).
const absl::Duration kStepTimeout = absl::Milliseconds(2500);
const absl::Duration kExpiryPeriod = absl::Milliseconds(100);

bool IsSessionGone(wire::ErrorCode code) {
  return code == wire::ErrorCode::NotRegistered || code == wire::ErrorCode::StaleSession ||
         code == wire::ErrorCode::StaleEpoch;
}

// The hash of block `index` of prompt family `prompt`: sequences of one family share it.
BlockHash PromptHash(int prompt, int32_t index) {
  BlockHash hash;
  const uint64_t words[2] = {
      0x9e3779b97f4a7c15ULL * static_cast<uint64_t>(prompt + 1) + static_cast<uint64_t>(index),
      static_cast<uint64_t>(index) * 0xbf58476d1ce4e5b9ULL + 7};
  std::memcpy(hash.bytes.data(), words, sizeof(words));
  std::memcpy(hash.bytes.data() + 16, words, sizeof(words));
  return hash;
}

// pidfds: the service asks to watch a session's pid; the world fires the exits.
class SimWatcher : public cache_manager::ProcessWatcher {
 public:
  absl::Status Watch(uint64_t session, pid_t pid) override {
    auto it = Find(session);
    if (it == watched_.end()) {
      watched_.emplace_back(session, pid);
    } else {
      it->second = pid;
    }
    // The pidfd of a process that exited already is readable at once: a message can
    // outlive its sender in the socket's buffer.
    if (dead_ != nullptr && dead_->contains(pid) && on_dead_) on_dead_(session);
    return absl::OkStatus();
  }
  void SetDead(const std::set<pid_t>* dead, std::function<void(uint64_t)> on_dead) {
    dead_ = dead;
    on_dead_ = std::move(on_dead);
  }
  void Unwatch(uint64_t session) override {
    if (auto it = Find(session); it != watched_.end()) watched_.erase(it);
  }
  // Sessions watched for `pid`, in the order they were watched (session ids are random:
  // nothing is ordered by them).
  std::vector<uint64_t> SessionsOf(pid_t pid) const {
    std::vector<uint64_t> out;
    for (const auto& [session, p] : watched_) {
      if (p == pid) out.push_back(session);
    }
    return out;
  }
  void Clear() { watched_.clear(); }

 private:
  std::vector<std::pair<uint64_t, pid_t>>::iterator Find(uint64_t session) {
    return std::find_if(watched_.begin(), watched_.end(),
                        [&](const auto& w) { return w.first == session; });
  }

  std::vector<std::pair<uint64_t, pid_t>> watched_;  // in the order watched
  const std::set<pid_t>* dead_ = nullptr;
  std::function<void(uint64_t)> on_dead_;
};

// A fence as an executor learns it from a HeartbeatReply (CacheManagerClient's FenceNotice).
struct FenceNotice {
  uint64_t id = 0;
  uint64_t router_session = 0;
  std::vector<SeqId> seqs;  // empty: the whole router session
  bool operator==(const FenceNotice&) const = default;
};

// A step a router asked an executor to run: the blocks it writes.
struct StepBatch {
  int router = 0;
  int router_incarnation = 0;
  uint64_t step_id = 0;
  uint64_t router_session = 0;
  uint64_t epoch = 0;
  SeqId seq = 0;
  std::vector<BlockId> blocks;
};

// A step being written: the oracle's writer.
struct Writer {
  int executor = 0;
  int incarnation = 0;
  uint64_t epoch = 0;
  uint64_t router_session = 0;
  SeqId seq = 0;
  uint64_t step_id = 0;
  int router = 0;
  int router_incarnation = 0;
  std::vector<BlockId> blocks;
  absl::Time ends_at;
  bool stopping = false;  // a fence named it: it stops at the next layer
};

enum class Channel { kMain, kBeat };

// A client's link to the cache manager, as CacheManagerClient keeps it.
struct Link {
  struct Call {
    bool active = false;
    uint64_t request_id = 0;
    wire::Message type = wire::Message::NONE;
    std::vector<uint8_t> bytes;  // for a Step's retry: the same bytes
    absl::Time deadline;
    uint64_t generation = 0;  // the session it was sent for
  };
  uint64_t session = 0;
  uint64_t epoch = 0;
  uint64_t generation = 0;  // +1 at every accepted HelloReply
  bool registered = false;
  bool lost = false;  // the cache manager said the session is gone: re-register
  uint64_t next_request_id = 1;
  Call main, beat;
  absl::Time next_beat;
  Call& Of(Channel c) { return c == Channel::kMain ? main : beat; }
};

struct Process {
  pid_t pid = 0;
  int incarnation = 0;
  bool alive = true;
  bool hung = false;
  absl::Time hung_until;
  Link link;
  // Replies and steps that arrived while hung, handled when it resumes.
  std::deque<std::function<void()>> held;
};

struct RouterSeq {
  SeqId id = 0;
  int prompt = 0;
  int32_t tokens = 0;
  int32_t committed = 0;
  int32_t written = 0;
  int32_t hashes = 0;  // full blocks whose hashes the cache manager has
  std::vector<BlockId> blocks;
  enum State { kIdle, kInStep, kWriting, kGiveUp } state = kIdle;
  uint64_t step_id = 0;
  int32_t write_to = 0;  // tokens once the step is written
  absl::Time deadline;
};

struct Router : Process {
  std::vector<RouterSeq> seqs;
  SeqId next_seq = 1;
  uint64_t next_step_id = 1;
  std::vector<BlockOp> step_ops;  // of the Step in flight
};

struct Executor : Process {
  bool attached = false;
  uint64_t attached_epoch = 0;
  std::vector<FenceNotice> fences;  // from the latest HeartbeatReply
  uint64_t fence_generation = 0;
  uint64_t applied_generation = 0;
  bool ack_failed = false;
  absl::Time ack_retry_at;
  std::set<uint64_t> fenced;                         // router sessions
  std::set<std::pair<uint64_t, SeqId>> fenced_seqs;  // (router session, seq)
  std::deque<StepBatch> queue;
  std::set<std::tuple<int, int, uint64_t>> seen;  // (router, incarnation, step id)
  std::optional<Writer> running;
  uint64_t run_token = 0;  // tells a step's end event apart from a later step's
};

class World {
 public:
  explicit World(const SimOptions& options) : options_(options), rng_(options.seed) {
    num_routers_ = 1 + static_cast<int>(Below(2));
    num_executors_ = 2 + static_cast<int>(Below(2));
    // Fault rates differ from seed to seed, some seeds hardly faulty, some very.
    drop_permille_ = static_cast<int>(Below(60));
    dup_permille_ = static_cast<int>(Below(60));
    delay_permille_ = static_cast<int>(Below(80));
    fault_permille_ = 5 + static_cast<int>(Below(30));
  }

  SimResult Run() {
    watcher_.SetDead(&dead_pids_, [this](uint64_t session) {
      const int cm = cm_incarnation_;
      At(now_ + Millis(0, 5), [this, cm, session] {
        if (cm != cm_incarnation_) return;
        ToCacheManager([this, session] {
          if (service_->OnSessionProcessExited(session)) {
            Trace("cache manager sees the exit of session ", session, "'s process at once");
          }
        });
      });
    });
    result_.routers = num_routers_;
    result_.executors = num_executors_;
    StartCacheManager();
    for (int r = 0; r < num_routers_; ++r) {
      routers_.emplace_back();
      StartRouter(r);
    }
    for (int e = 0; e < num_executors_; ++e) {
      executors_.emplace_back();
      StartExecutor(e);
    }
    fault_end_ = start_ + options_.fault_time;
    const absl::Time end = fault_end_ + options_.quiet_time;
    At(start_ + kExpiryPeriod, [this] { ExpiryTimer(start_); });
    At(start_ + absl::Milliseconds(50), [this] { FaultTick(); });
    At(fault_end_, [this] { StopFaults(); });
    while (!queue_.empty() && result_.ok) {
      Event event = queue_.top();
      queue_.pop();
      if (event.at > end) break;
      now_ = event.at;
      ++result_.stats.events;
      Mix(static_cast<uint64_t>(absl::ToInt64Microseconds(now_ - start_)));
      event.fn();
      if (result_.ok) CheckAlways();
    }
    if (result_.ok) CheckQuiet();
    return std::move(result_);
  }

 private:
  struct Event {
    absl::Time at;
    uint64_t order;
    std::function<void()> fn;
    bool operator>(const Event& o) const { return at != o.at ? at > o.at : order > o.order; }
  };

  // ---- Scheduling and randomness ----------------------------------------------------------

  uint64_t Below(uint64_t n) { return rng_() % n; }
  bool Chance(int permille) { return static_cast<int>(Below(1000)) < permille; }
  absl::Duration Millis(int64_t lo, int64_t hi) {
    return absl::Milliseconds(lo + static_cast<int64_t>(Below(static_cast<uint64_t>(hi - lo + 1))));
  }
  bool Faulty() const { return faults_on_; }

  void At(absl::Time at, std::function<void()> fn) {
    queue_.push(Event{at, next_order_++, std::move(fn)});
  }

  void Mix(uint64_t value) {
    // FNV-1a over the event stream: equal digests, equal runs.
    for (int i = 0; i < 8; ++i) {
      result_.digest ^= (value >> (8 * i)) & 0xff;
      result_.digest *= 0x100000001b3ULL;
    }
  }

  // Session ids are random (the service draws them): traces name them s1, s2, ... in the
  // order they were issued, so that a replay prints the same text.
  std::string Labelled(std::string text) const {
    for (const auto& [id, label] : session_labels_) {
      text = absl::StrReplaceAll(text, {{absl::StrCat(id), label}});
    }
    return text;
  }

  template <typename... Parts>
  void Trace(const Parts&... parts) {
    if (!options_.trace) return;
    result_.trace.push_back(Labelled(absl::StrCat(absl::FormatDuration(now_ - start_), " #",
                                                  result_.stats.events, " ", parts...)));
  }

  template <typename... Parts>
  void Fail(const Parts&... parts) {
    if (!result_.ok) return;
    result_.ok = false;
    result_.failure = Labelled(absl::StrCat("at ", absl::FormatDuration(now_ - start_), " (event ",
                                            result_.stats.events, "): ", parts...));
    Trace("VIOLATION ", result_.failure);
  }

  // A message over the network: maybe dropped, duplicated, held back (and so reordered).
  void Deliver(std::function<void()> fn) {
    ++result_.stats.messages;
    if (Faulty() && Chance(drop_permille_)) {
      ++result_.stats.dropped;
      Mix(1);
      return;
    }
    const bool dup = Faulty() && Chance(dup_permille_);
    auto delay = [&] {
      if (Faulty() && Chance(delay_permille_)) {
        ++result_.stats.delayed;
        return Millis(100, 2500);
      }
      return Millis(1, 20);
    };
    if (dup) {
      ++result_.stats.duplicated;
      At(now_ + delay(), fn);
    }
    At(now_ + delay(), std::move(fn));
  }

  // ---- The cache manager ------------------------------------------------------------------

  void StartCacheManager() {
    cache_manager::CacheManagerService::Options options;
    options.spec = KvCacheSpec{2, 2, 8, DType::kFloat16, kBlockSize};
    options.ledger.num_blocks = kBlocks;
    options.epoch = ++epoch_counter_;
    options.heartbeat_interval = kHeartbeatInterval;
    options.heartbeat_timeout = kHeartbeatTimeout;
    options.pool.layout.total_bytes = 1;
    watcher_.Clear();
    auto service = cache_manager::CacheManagerService::Create(options, &watcher_, nullptr, now_);
    if (!service.ok()) {
      Fail("cannot create the service: ", service.status().ToString());
      return;
    }
    service_ = *std::move(service);
    cm_up_ = true;
    cm_hung_ = false;
    cm_backlog_.clear();
    owners_.assign(kBlocks, {0, 0});
    applied_.clear();
    Trace("cache manager starts, epoch ", options.epoch);
  }

  uint64_t epoch() const { return service_ ? service_->epoch() : 0; }

  // A message reaches the cache manager's socket: handled now, or when it resumes.
  void ToCacheManager(std::function<void()> handle) {
    if (!cm_up_) return;  // nothing listens: lost
    if (cm_hung_) {
      cm_backlog_.push_back(std::move(handle));
      return;
    }
    handle();
  }

  void CmCrash() {
    ++result_.stats.cm_crashes;
    Trace("cache manager crashes (epoch ", epoch(), ")");
    cm_up_ = false;
    cm_hung_ = false;
    cm_backlog_.clear();
    service_.reset();
    ++cm_incarnation_;
    const int incarnation = cm_incarnation_;
    At(now_ + Millis(50, 1500), [this, incarnation] {
      if (cm_incarnation_ == incarnation && !cm_up_) StartCacheManager();
    });
  }

  void CmHang() {
    ++result_.stats.cm_hangs;
    cm_hung_ = true;
    const absl::Duration how_long = Millis(300, 8000);
    Trace("cache manager hangs for ", absl::FormatDuration(how_long));
    const int incarnation = cm_incarnation_;
    At(now_ + how_long, [this, incarnation] {
      if (cm_incarnation_ == incarnation) CmResume();
    });
  }

  void CmResume() {
    if (!cm_hung_) return;
    cm_hung_ = false;
    Trace("cache manager resumes, ", cm_backlog_.size(), " queued");
    // The expiry timer runs late next: it extends the leases first, then reads the queue
    // (CacheManagerServer::OnExpiryTimer).
  }

  void ExpiryTimer(absl::Time scheduled) {
    At(now_ + kExpiryPeriod, [this, next = now_ + kExpiryPeriod] { ExpiryTimer(next); });
    if (!cm_up_ || cm_hung_) return;
    const absl::Duration late = now_ - scheduled;
    if (late > kHeartbeatTimeout / 2) {
      service_->ExtendLeases(now_);
      Trace("leases extended (the loop ran ", absl::FormatDuration(late), " late)");
    }
    std::deque<std::function<void()>> backlog;
    backlog.swap(cm_backlog_);
    for (auto& handle : backlog) {
      if (!cm_up_ || cm_hung_) break;
      handle();
      if (result_.ok) CheckAlways();
    }
    if (!cm_up_ || cm_hung_) return;
    const int quarantined = service_->ExpireSessions(now_);
    if (quarantined > 0) {
      result_.stats.quarantines += quarantined;
      Trace("cache manager quarantines ", quarantined, " session(s)");
      Mix(static_cast<uint64_t>(quarantined));
    }
  }

  // The cache manager handles one request from a client and sends the reply back.
  void CmHandle(bool is_router, int index, int incarnation, pid_t pid, Channel channel,
                std::vector<uint8_t> bytes) {
    service_->Handle(cache_manager::PeerCredentials{::geteuid(), ::getegid(), pid}, bytes, now_,
                     &reply_);
    const VerifiedEnvelope request = VerifyEnvelope(bytes);
    const VerifiedEnvelope reply = VerifyEnvelope(BufferSpan(reply_));
    if (reply.envelope == nullptr) {
      Fail("the cache manager's reply does not verify: ", reply.reason);
      return;
    }
    Mix(static_cast<uint64_t>(reply.envelope->payload_type()));
    if (const wire::HelloReply* hello = reply.envelope->payload_as_HelloReply()) {
      session_labels_.emplace_back(hello->session_id(),
                                   absl::StrCat("s", session_labels_.size() + 1));
    }
    Trace(is_router ? "router " : "executor ", index, " -> cm ",
          wire::EnumNameMessage(request.envelope->payload_type()), " #",
          request.envelope->request_id(), ": ",
          wire::EnumNameMessage(reply.envelope->payload_type()),
          reply.envelope->payload_type() == wire::Message::ErrorReply
              ? absl::StrCat(
                    " ", wire::EnumNameErrorCode(reply.envelope->payload_as_ErrorReply()->code()),
                    " (",
                    reply.envelope->payload_as_ErrorReply()->reason()
                        ? reply.envelope->payload_as_ErrorReply()->reason()->str()
                        : std::string(),
                    ")")
              : std::string());
    if (reply.envelope->payload_type() == wire::Message::StepReply) {
      ObserveHandout(*request.envelope, *reply.envelope);
    }
    std::vector<uint8_t> copy(reply_.GetBufferPointer(),
                              reply_.GetBufferPointer() + reply_.GetSize());
    Deliver([this, is_router, index, incarnation, channel, copy = std::move(copy)]() mutable {
      Process& p = is_router ? static_cast<Process&>(routers_[index])
                             : static_cast<Process&>(executors_[index]);
      if (!p.alive || p.incarnation != incarnation) return;  // its socket is gone
      auto receive = [this, is_router, index, incarnation, channel, copy = std::move(copy)] {
        Process& q = is_router ? static_cast<Process&>(routers_[index])
                               : static_cast<Process&>(executors_[index]);
        if (!q.alive || q.incarnation != incarnation) return;
        if (is_router) {
          RouterReply(index, channel, copy);
        } else {
          ExecutorReply(index, channel, copy);
        }
      };
      if (p.hung) {
        p.held.push_back(std::move(receive));
      } else {
        receive();
      }
    });
  }

  // The oracle's record of handouts: which (router session, sequence) each block was last
  // given to for writing, checked against every writer.
  void ObserveHandout(const wire::Envelope& request, const wire::Envelope& reply) {
    const uint64_t session = request.session_id();
    if (!applied_.insert({session, request.request_id()}).second) return;  // a replay
    std::vector<BlockOp> ops;
    if (!DecodeStep(*request.payload_as_Step(), StepLimits{}, &ops).ok()) {
      Fail("cannot decode a Step the service applied");
      return;
    }
    auto outcomes = DecodeStepReply(*reply.payload_as_StepReply(), ops.size());
    if (!outcomes.ok()) {
      Fail("StepReply: ", outcomes.status().ToString());
      return;
    }
    for (size_t i = 0; i < ops.size(); ++i) {
      const OpOutcome& outcome = (*outcomes)[i];
      if (!outcome.status.ok()) continue;
      size_t first = 0;
      if (ops[i].kind == wire::StepOp::AllocateOp) {
        first = static_cast<size_t>(outcome.num_cached_tokens / kBlockSize);
      } else if (ops[i].kind != wire::StepOp::AppendOp) {
        continue;
      }
      for (size_t b = 0; b < outcome.blocks.size(); ++b) {
        const BlockId block = outcome.blocks[b];
        ++result_.stats.blocks_handed;
        Mix(static_cast<uint64_t>(block));  // the ledger's choices are part of the run
        // A block matched as a cached prefix is read, not written: nobody may be writing
        // it. A block handed out for writing: nobody else may be.
        for (const Executor& e : executors_) {
          if (!e.running || e.running->epoch != epoch()) continue;
          const Writer& w = *e.running;
          ++result_.stats.writer_checks;
          if (std::find(w.blocks.begin(), w.blocks.end(), block) == w.blocks.end()) continue;
          Fail("block ", block, " handed to sequence ", ops[i].seq, " of router session ", session,
               b < first ? " as a cached prefix" : "", " while executor ", w.executor,
               " may still write it for sequence ", w.seq, " of router session ", w.router_session);
          return;
        }
        if (b >= first) owners_[static_cast<size_t>(block)] = {session, ops[i].seq};
      }
    }
  }

  // ---- Clients: the link ------------------------------------------------------------------

  void SendCall(bool is_router, int index, Channel channel, wire::Message type,
                std::vector<uint8_t> bytes, uint64_t request_id) {
    Process& p = is_router ? static_cast<Process&>(routers_[index])
                           : static_cast<Process&>(executors_[index]);
    Link::Call& call = p.link.Of(channel);
    call.active = true;
    call.request_id = request_id;
    call.type = type;
    call.bytes = bytes;
    call.deadline = now_ + kCallTimeout;
    call.generation = p.link.generation;
    const int incarnation = p.incarnation;
    const pid_t pid = p.pid;
    const int cm = cm_incarnation_;
    Deliver([this, is_router, index, incarnation, pid, channel, cm,
             bytes = std::move(bytes)]() mutable {
      if (cm != cm_incarnation_) return;  // sent to a cache manager that died
      ToCacheManager(
          [this, is_router, index, incarnation, pid, channel, bytes = std::move(bytes)]() mutable {
            CmHandle(is_router, index, incarnation, pid, channel, std::move(bytes));
          });
    });
    // A dead cache manager's socket: the client's connection is to whichever runs next,
    // as ZeroMQ reconnects, so later sends reach the new one (cm is read at delivery).
  }

  std::vector<uint8_t> Finish(Link& link, wire::Message type, flatbuffers::Offset<void> payload,
                              uint64_t* request_id) {
    *request_id = link.next_request_id++;
    FinishEnvelope(builder_, *request_id, link.session, link.epoch, type, payload);
    return std::vector<uint8_t>(builder_.GetBufferPointer(),
                                builder_.GetBufferPointer() + builder_.GetSize());
  }

  void SendHello(bool is_router, int index) {
    Process& p = is_router ? static_cast<Process&>(routers_[index])
                           : static_cast<Process&>(executors_[index]);
    builder_.Clear();
    const auto name =
        builder_.CreateString(absl::StrCat(is_router ? "router-" : "executor-", index));
    const auto hello = wire::CreateHello(
        builder_, is_router ? wire::Role::Router : wire::Role::Executor, p.pid, name);
    const uint64_t request_id = p.link.next_request_id++;
    FinishEnvelope(builder_, request_id, 0, 0, wire::Message::Hello, hello.Union());
    SendCall(is_router, index, Channel::kMain, wire::Message::Hello,
             std::vector<uint8_t>(builder_.GetBufferPointer(),
                                  builder_.GetBufferPointer() + builder_.GetSize()),
             request_id);
  }

  void SendHeartbeat(bool is_router, int index, Channel channel,
                     const std::vector<uint64_t>& acks) {
    Process& p = is_router ? static_cast<Process&>(routers_[index])
                           : static_cast<Process&>(executors_[index]);
    builder_.Clear();
    const auto heartbeat =
        wire::CreateHeartbeat(builder_, acks.empty() ? 0 : builder_.CreateVector(acks));
    uint64_t id = 0;
    std::vector<uint8_t> bytes = Finish(p.link, wire::Message::Heartbeat, heartbeat.Union(), &id);
    SendCall(is_router, index, channel, wire::Message::Heartbeat, std::move(bytes), id);
  }

  // Verifies a reply and matches it to the call on `channel`; null if it answers nothing
  // pending (a late reply to a call given up on: dropped, as the real client does).
  const wire::Envelope* Match(Process& p, Channel channel, const std::vector<uint8_t>& bytes,
                              VerifiedEnvelope* verified) {
    *verified = VerifyEnvelope(bytes);
    if (verified->envelope == nullptr) {
      Fail("a reply does not verify: ", verified->reason);
      return nullptr;
    }
    Link::Call& call = p.link.Of(channel);
    if (!call.active || verified->envelope->request_id() != call.request_id) return nullptr;
    call.active = false;
    return verified->envelope;
  }

  // A session-gone refusal for the current session: the caller re-registers when it is
  // ready (CacheManagerClient::SessionGone).
  bool SessionGoneReply(Process& p, const Link::Call& call, const wire::Envelope& reply) {
    const wire::ErrorReply* error = reply.payload_as_ErrorReply();
    if (error == nullptr || !IsSessionGone(error->code())) return false;
    if (call.generation == p.link.generation && p.link.registered) p.link.lost = true;
    return true;
  }

  bool AcceptHello(Process& p, const wire::Envelope& reply) {
    const wire::HelloReply* hello = reply.payload_as_HelloReply();
    if (hello == nullptr) return false;
    p.link.session = hello->session_id();
    p.link.epoch = hello->epoch();
    ++p.link.generation;
    p.link.registered = true;
    p.link.lost = false;
    p.link.beat.active = false;
    p.link.next_beat = now_ + kHeartbeatInterval;
    return true;
  }

  // ---- Processes: crash, hang, restart -----------------------------------------------------

  void Crash(bool is_router, int index) {
    Process& p = is_router ? static_cast<Process&>(routers_[index])
                           : static_cast<Process&>(executors_[index]);
    if (!p.alive) return;
    ++result_.stats.client_crashes;
    Trace(is_router ? "router " : "executor ", index, " (pid ", p.pid, ") crashes");
    p.alive = false;
    p.hung = false;
    p.held.clear();
    dead_pids_.insert(p.pid);
    if (!is_router) executors_[static_cast<size_t>(index)].running.reset();  // writes nothing more
    // The pidfd fires: the cache manager's poller sees the exit once it runs.
    const pid_t pid = p.pid;
    const int cm = cm_incarnation_;
    At(now_ + Millis(0, 5), [this, pid, cm] {
      if (cm != cm_incarnation_) return;
      ToCacheManager([this, pid] {
        for (uint64_t session : watcher_.SessionsOf(pid)) service_->OnSessionProcessExited(session);
        Trace("cache manager sees pid ", pid, " exit");
      });
    });
    const int incarnation = p.incarnation;
    At(now_ + Millis(100, 3000), [this, is_router, index, incarnation] {
      Process& q = is_router ? static_cast<Process&>(routers_[index])
                             : static_cast<Process&>(executors_[index]);
      if (q.incarnation != incarnation || q.alive) return;
      if (is_router) {
        StartRouter(index);
      } else {
        StartExecutor(index);
      }
    });
  }

  void Hang(bool is_router, int index) {
    Process& p = is_router ? static_cast<Process&>(routers_[index])
                           : static_cast<Process&>(executors_[index]);
    if (!p.alive || p.hung) return;
    ++result_.stats.client_hangs;
    p.hung = true;
    const absl::Duration how_long = Millis(200, 12000);
    p.hung_until = now_ + how_long;
    Trace(is_router ? "router " : "executor ", index, " hangs for ",
          absl::FormatDuration(how_long));
    if (!is_router) {
      // A stopped process's step is stopped with it: it goes on writing after it resumes.
      Executor& e = executors_[static_cast<size_t>(index)];
      if (e.running && e.running->ends_at > now_) {
        e.running->ends_at = std::max(e.running->ends_at, p.hung_until) + Millis(1, 50);
        ScheduleStepEnd(index);
      }
    }
    const int incarnation = p.incarnation;
    At(p.hung_until, [this, is_router, index, incarnation] {
      Process& q = is_router ? static_cast<Process&>(routers_[index])
                             : static_cast<Process&>(executors_[index]);
      if (q.incarnation == incarnation) Resume(q);
    });
  }

  void Resume(Process& p) {
    if (!p.alive || !p.hung) return;
    p.hung = false;
    std::deque<std::function<void()>> held;
    held.swap(p.held);
    for (auto& fn : held) fn();
  }

  void FaultTick() {
    if (!Faulty()) return;
    At(now_ + Millis(20, 120), [this] { FaultTick(); });
    if (!Chance(fault_permille_)) return;
    const int what = static_cast<int>(Below(100));
    const bool is_router = Below(2) == 0;
    const int index = static_cast<int>(is_router ? Below(static_cast<uint64_t>(num_routers_))
                                                 : Below(static_cast<uint64_t>(num_executors_)));
    if (what < 30) {
      Crash(is_router, index);
    } else if (what < 75) {
      Hang(is_router, index);
    } else if (what < 87) {
      if (cm_up_ && !cm_hung_) CmHang();
    } else {
      if (cm_up_) CmCrash();
    }
  }

  void StopFaults() {
    faults_on_ = false;
    Trace("faults stop");
    if (!cm_up_) StartCacheManager();
    cm_hung_ = false;
    for (int r = 0; r < num_routers_; ++r) {
      Router& router = routers_[static_cast<size_t>(r)];
      if (router.hung) Resume(router);
    }
    for (int e = 0; e < num_executors_; ++e) {
      Executor& executor = executors_[static_cast<size_t>(e)];
      if (executor.hung) {
        Resume(executor);
      }
    }
  }

  // ---- Routers ------------------------------------------------------------------------------

  void StartRouter(int r) {
    Router& router = routers_[static_cast<size_t>(r)];
    const int incarnation = router.incarnation + 1;
    router = Router();
    router.incarnation = incarnation;
    router.pid = next_pid_++;
    Trace("router ", r, " starts, pid ", router.pid);
    RouterTick(r, incarnation);
    BeatTick(true, r, incarnation);
  }

  void RouterTick(int r, int incarnation) {
    Router& router = routers_[static_cast<size_t>(r)];
    if (router.incarnation != incarnation || !router.alive) return;
    At(now_ + Millis(30, 200), [this, r, incarnation] { RouterTick(r, incarnation); });
    if (router.hung) return;
    Link& link = router.link;
    // A session found gone abandons its call (a Step of the old session is not retried).
    if (link.lost && link.main.active && link.main.type != wire::Message::Hello) {
      link.main.active = false;
    }
    if (link.main.active) {
      if (now_ < link.main.deadline) return;
      // No answer within the call timeout.
      if (link.main.type == wire::Message::Step) {
        // RetryLastStep: the same bytes, so that the cache manager answers from its kept
        // replies and never runs it twice.
        std::vector<uint8_t> bytes = link.main.bytes;
        SendCall(true, r, Channel::kMain, wire::Message::Step, std::move(bytes),
                 link.main.request_id);
        Trace("router ", r, " retries step #", link.main.request_id);
        return;
      }
      // Hello: given up, sent again below. Goodbye: the session may live on (no answer),
      // and so do its sequences, as CacheManagerClient::Goodbye() keeps them.
      link.main.active = false;
    }
    if (!link.registered || link.lost) {
      // Reregister(): the old session's sequences are gone (or will drain behind a fence).
      router.seqs.clear();
      SendHello(true, r);
      return;
    }
    // Steps its executors did not answer in time, or refused: freed with drain, as
    // kvcm-router does for an executor it dropped without proof that it stopped.
    std::vector<BlockOp> ops;
    for (RouterSeq& s : router.seqs) {
      if (s.state == RouterSeq::kGiveUp || (s.state == RouterSeq::kWriting && now_ >= s.deadline)) {
        ops.push_back(BlockOp::Free(s.id, /*drain=*/true));
      }
    }
    if (ops.empty()) {
      std::vector<RouterSeq*> idle;
      for (RouterSeq& s : router.seqs) {
        if (s.state == RouterSeq::kIdle) idle.push_back(&s);
      }
      const int what = static_cast<int>(Below(100));
      if (Faulty() && what < 1) {
        RouterGoodbye(r);
        return;
      }
      const bool quiet = !Faulty();
      if (what < 40 && !quiet && router.seqs.size() < kMaxSeqsPerRouter) {
        RouterSeq s;
        // Sequence ids are one space for all routers: each router process its own range.
        s.id = (static_cast<SeqId>(r + 1) << 48) | (static_cast<SeqId>(router.incarnation) << 32) |
               router.next_seq++;
        s.prompt = static_cast<int>(Below(kPrompts));
        const int32_t tokens = 1 + static_cast<int32_t>(Below(3 * kBlockSize + 2));
        std::vector<BlockHash> hashes;
        for (int32_t b = 0; b < tokens / kBlockSize; ++b) hashes.push_back(PromptHash(s.prompt, b));
        s.hashes = static_cast<int32_t>(hashes.size());
        s.write_to = tokens;
        s.state = RouterSeq::kInStep;
        ops.push_back(BlockOp::Allocate(s.id, tokens, hashes));
        router.seqs.push_back(std::move(s));
      } else if (what < 75 && !quiet && !idle.empty()) {
        RouterSeq& s = *idle[Below(idle.size())];
        if (s.written > s.committed) ops.push_back(CommitOf(s));
        const int32_t more = 1 + static_cast<int32_t>(Below(kBlockSize + 1));
        if (s.tokens + more <= kMaxTokens) {
          ops.push_back(BlockOp::Append(s.id, more));
          s.write_to = s.tokens + more;
          s.state = RouterSeq::kInStep;
        }
      } else if (!idle.empty() && (what < 95 || quiet)) {
        RouterSeq& s = *idle[Below(idle.size())];
        if (s.written > s.committed) ops.push_back(CommitOf(s));
        ops.push_back(BlockOp::Free(s.id));
        s.state = RouterSeq::kInStep;
      }
    }
    if (ops.empty()) return;
    builder_.Clear();
    const uint64_t request_id = link.next_request_id++;
    if (absl::Status encoded = EncodeStep(builder_, request_id, link.session, link.epoch, ops);
        !encoded.ok()) {
      Fail("EncodeStep: ", encoded.ToString());
      return;
    }
    router.step_ops = std::move(ops);
    SendCall(true, r, Channel::kMain, wire::Message::Step,
             std::vector<uint8_t>(builder_.GetBufferPointer(),
                                  builder_.GetBufferPointer() + builder_.GetSize()),
             request_id);
  }

  BlockOp CommitOf(RouterSeq& s) {
    std::vector<BlockHash> hashes;
    for (int32_t b = s.hashes; b < s.written / kBlockSize; ++b) {
      hashes.push_back(PromptHash(s.prompt, b));
    }
    return BlockOp::Commit(s.id, s.written, hashes);
  }

  void RouterGoodbye(int r) {
    Router& router = routers_[static_cast<size_t>(r)];
    ++result_.stats.goodbyes;
    builder_.Clear();
    const auto goodbye = wire::CreateGoodbye(builder_);
    uint64_t id = 0;
    std::vector<uint8_t> bytes = Finish(router.link, wire::Message::Goodbye, goodbye.Union(), &id);
    SendCall(true, r, Channel::kMain, wire::Message::Goodbye, std::move(bytes), id);
  }

  void RouterReply(int r, Channel channel, const std::vector<uint8_t>& bytes) {
    Router& router = routers_[static_cast<size_t>(r)];
    VerifiedEnvelope verified;
    const Link::Call call = router.link.Of(channel);
    const wire::Envelope* reply = Match(router, channel, bytes, &verified);
    if (reply == nullptr) return;
    if (call.type == wire::Message::Hello) {
      if (!AcceptHello(router, *reply)) {
        Fail("router ", r, ": Hello refused: ", wire::EnumNameMessage(reply->payload_type()));
        return;
      }
      router.seqs.clear();
      router.step_ops.clear();
      return;
    }
    if (SessionGoneReply(router, call, *reply)) return;
    if (call.type == wire::Message::Goodbye) {
      if (call.generation == router.link.generation) {
        router.link.registered = false;  // registers again at its next turn
        router.seqs.clear();
      }
      return;
    }
    if (call.type == wire::Message::Heartbeat) {
      if (reply->payload_type() != wire::Message::HeartbeatReply) {
        Fail("router ", r, ": heartbeat answered by ",
             wire::EnumNameMessage(reply->payload_type()));
      }
      return;
    }
    if (call.type != wire::Message::Step) return;
    if (call.generation != router.link.generation) return;
    if (reply->payload_type() != wire::Message::StepReply) {
      const wire::ErrorReply* error = reply->payload_as_ErrorReply();
      Fail("router ", r, ": step refused: ", error ? wire::EnumNameErrorCode(error->code()) : "?",
           " ", error && error->reason() ? error->reason()->str() : "");
      return;
    }
    auto outcomes = DecodeStepReply(*reply->payload_as_StepReply(), router.step_ops.size());
    if (!outcomes.ok()) {
      Fail("router ", r, ": ", outcomes.status().ToString());
      return;
    }
    const std::vector<BlockOp> ops = std::move(router.step_ops);
    router.step_ops.clear();
    for (size_t i = 0; i < ops.size(); ++i) {
      const BlockOp& op = ops[i];
      const OpOutcome& outcome = (*outcomes)[i];
      auto it = std::find_if(router.seqs.begin(), router.seqs.end(),
                             [&](const RouterSeq& s) { return s.id == op.seq; });
      if (it == router.seqs.end()) continue;
      RouterSeq& s = *it;
      switch (op.kind) {
        case wire::StepOp::AllocateOp:
          if (!outcome.status.ok()) {
            router.seqs.erase(it);
            break;
          }
          s.blocks = outcome.blocks;
          s.tokens = op.num_tokens;
          s.written = std::min(outcome.num_cached_tokens, s.tokens);
          s.committed = s.written;
          Dispatch(r, s, outcome.num_cached_tokens);
          break;
        case wire::StepOp::AppendOp:
          if (!outcome.status.ok()) {
            s.state = RouterSeq::kIdle;
            break;
          }
          s.blocks.insert(s.blocks.end(), outcome.blocks.begin(), outcome.blocks.end());
          {
            const int32_t from = s.tokens;
            s.tokens += op.num_tokens;
            Dispatch(r, s, from);
          }
          break;
        case wire::StepOp::CommitOp:
          if (outcome.status.ok()) {
            s.committed = op.num_tokens;
            s.hashes = std::max(s.hashes, op.num_tokens / kBlockSize);
          } else {
            Fail("router ", r, ": commit refused: ", outcome.status.ToString());
          }
          if (s.state == RouterSeq::kInStep &&
              std::none_of(ops.begin(), ops.end(), [&](const BlockOp& o) {
                return o.seq == s.id && o.kind != wire::StepOp::CommitOp;
              })) {
            s.state = RouterSeq::kIdle;
          }
          break;
        case wire::StepOp::FreeOp:
          if (op.drain) ++result_.stats.drained_frees;
          router.seqs.erase(it);
          break;
        default:
          break;
      }
    }
  }

  // The router sends the step writing tokens [from, s.tokens) of `s` to an executor.
  void Dispatch(int r, RouterSeq& s, int32_t from) {
    Router& router = routers_[static_cast<size_t>(r)];
    if (from >= s.tokens) {
      s.written = s.tokens;
      s.state = RouterSeq::kIdle;
      return;
    }
    StepBatch batch;
    batch.router = r;
    batch.router_incarnation = router.incarnation;
    batch.step_id = router.next_step_id++;
    batch.router_session = router.link.session;
    batch.epoch = router.link.epoch;
    batch.seq = s.id;
    for (int32_t b = from / kBlockSize; b <= (s.tokens - 1) / kBlockSize; ++b) {
      batch.blocks.push_back(s.blocks[static_cast<size_t>(b)]);
    }
    s.state = RouterSeq::kWriting;
    s.step_id = batch.step_id;
    s.write_to = s.tokens;
    s.deadline = now_ + kStepTimeout;
    // To an executor that told the router it is ready (attached to the pool); with none,
    // the step waits for the router's patience and is given up.
    std::vector<int> ready;
    for (int x = 0; x < num_executors_; ++x) {
      const Executor& executor = executors_[static_cast<size_t>(x)];
      if (!executor.alive || !executor.attached) continue;
      // An executor that announced the router's epoch (attached to that pool, so it had
      // registered in that epoch before this step was sent, and every fence of a router
      // session of that epoch ending later waits for it). Without this, a step can reach
      // an executor that registers in the step's epoch only after the step's router
      // session ended: it is in no fence of it (SimOptions::router_waits_for_epoch).
      if (options_.router_waits_for_epoch && executor.attached_epoch != router.link.epoch) continue;
      ready.push_back(x);
    }
    if (ready.empty()) {
      Trace("router ", r, " has no executor for step ", batch.step_id);
      return;
    }
    const int e = ready[Below(ready.size())];
    const int incarnation = executors_[static_cast<size_t>(e)].incarnation;
    Trace("router ", r, " sends step ", batch.step_id, " (sequence ", s.id, ", ",
          batch.blocks.size(), " blocks) to executor ", e);
    Deliver([this, e, incarnation, batch = std::move(batch)]() mutable {
      Executor& executor = executors_[static_cast<size_t>(e)];
      if (!executor.alive || executor.incarnation != incarnation) return;
      auto receive = [this, e, incarnation, batch = std::move(batch)]() mutable {
        Executor& x = executors_[static_cast<size_t>(e)];
        if (!x.alive || x.incarnation != incarnation) return;
        const auto key = std::make_tuple(batch.router, batch.router_incarnation, batch.step_id);
        if (!x.seen.insert(key).second) return;  // a duplicate
        x.queue.push_back(std::move(batch));
        ExecutorMaybeRun(e);
      };
      if (executor.hung) {
        executor.held.push_back(std::move(receive));
      } else {
        receive();
      }
    });
  }

  // An executor's answer to a step reaches the router.
  void StepDone(int r, int incarnation, uint64_t step_id, bool written) {
    Router& router = routers_[static_cast<size_t>(r)];
    if (!router.alive || router.incarnation != incarnation) return;
    auto receive = [this, r, incarnation, step_id, written] {
      Router& q = routers_[static_cast<size_t>(r)];
      if (!q.alive || q.incarnation != incarnation) return;
      for (RouterSeq& s : q.seqs) {
        if (s.state != RouterSeq::kWriting || s.step_id != step_id) continue;
        if (written) {
          s.written = s.write_to;
          s.state = RouterSeq::kIdle;
        } else {
          s.state = RouterSeq::kGiveUp;
        }
        return;
      }
    };
    if (router.hung) {
      router.held.push_back(std::move(receive));
    } else {
      receive();
    }
  }

  // ---- Heartbeat threads (routers and executors) --------------------------------------------

  void BeatTick(bool is_router, int index, int incarnation) {
    Process& p = is_router ? static_cast<Process&>(routers_[index])
                           : static_cast<Process&>(executors_[index]);
    if (p.incarnation != incarnation || !p.alive) return;
    At(now_ + kHeartbeatInterval,
       [this, is_router, index, incarnation] { BeatTick(is_router, index, incarnation); });
    // require_progress: a hung process renews nothing.
    if (p.hung || !p.link.registered || p.link.lost) return;
    if (p.link.beat.active && now_ < p.link.beat.deadline) return;
    SendHeartbeat(is_router, index, Channel::kBeat, {});
  }

  // ---- Executors ----------------------------------------------------------------------------

  void StartExecutor(int e) {
    Executor& executor = executors_[static_cast<size_t>(e)];
    const int incarnation = executor.incarnation + 1;
    executor = Executor();
    executor.incarnation = incarnation;
    executor.pid = next_pid_++;
    Trace("executor ", e, " starts, pid ", executor.pid);
    ExecutorTick(e, incarnation);
    BeatTick(false, e, incarnation);
  }

  void ExecutorTick(int e, int incarnation) {
    Executor& executor = executors_[static_cast<size_t>(e)];
    if (executor.incarnation != incarnation || !executor.alive) return;
    At(now_ + Millis(20, 80), [this, e, incarnation] { ExecutorTick(e, incarnation); });
    if (executor.hung) return;
    Link& link = executor.link;
    if (link.main.active && now_ >= link.main.deadline) {
      if (link.main.type == wire::Message::Heartbeat) {
        executor.ack_failed = true;
        executor.ack_retry_at = now_ + absl::Milliseconds(200);
      }
      link.main.active = false;
    }
    if (executor.running) return;  // between steps only, below
    if (link.main.active) return;
    if (!link.registered || link.lost) {
      // CacheManagerPool::Reattach: between steps, the mapping dropped first, then
      // Reregister (the old session's fences move to the new one).
      executor.attached = false;
      for (const StepBatch& batch : executor.queue) Refuse(e, batch);
      executor.queue.clear();
      SendHello(false, e);
      return;
    }
    if (!executor.attached) {
      builder_.Clear();
      const auto attach = wire::CreateAttach(builder_);
      uint64_t id = 0;
      std::vector<uint8_t> bytes = Finish(link, wire::Message::Attach, attach.Union(), &id);
      SendCall(false, e, Channel::kMain, wire::Message::Attach, std::move(bytes), id);
      return;
    }
    if (ApplyFences(e)) return;
    ExecutorMaybeRun(e);
  }

  // ExecutorService::ApplyFences: between steps, every fence recorded (later steps of it
  // are refused), then acknowledged. True when it sent the acknowledgement.
  bool ApplyFences(int e) {
    Executor& executor = executors_[static_cast<size_t>(e)];
    if (executor.fence_generation == executor.applied_generation &&
        (!executor.ack_failed || now_ < executor.ack_retry_at)) {
      return false;
    }
    executor.applied_generation = executor.fence_generation;
    if (executor.fences.empty()) {
      executor.ack_failed = false;
      return false;
    }
    std::vector<uint64_t> ids;
    for (const FenceNotice& fence : executor.fences) {
      RecordFence(executor, fence);
      ids.push_back(fence.id);
    }
    executor.ack_failed = false;
    result_.stats.fence_acks += static_cast<int64_t>(ids.size());
    Trace("executor ", e, " acknowledges ", ids.size(), " fence(s)");
    SendHeartbeat(false, e, Channel::kMain, ids);
    return true;
  }

  static void RecordFence(Executor& executor, const FenceNotice& fence) {
    if (fence.seqs.empty()) {
      executor.fenced.insert(fence.router_session);
      return;
    }
    for (SeqId seq : fence.seqs) executor.fenced_seqs.insert({fence.router_session, seq});
  }

  bool Fenced(const Executor& executor, const StepBatch& batch) const {
    return executor.fenced.contains(batch.router_session) ||
           executor.fenced_seqs.contains({batch.router_session, batch.seq});
  }

  // FenceNames: a pending fence the heartbeat thread learnt of names this step.
  static bool FenceNames(Executor& executor, uint64_t router_session, SeqId seq) {
    bool named = false;
    for (const FenceNotice& fence : executor.fences) {
      if (fence.router_session != router_session) continue;
      if (fence.seqs.empty() ||
          std::find(fence.seqs.begin(), fence.seqs.end(), seq) != fence.seqs.end()) {
        RecordFence(executor, fence);
        named = true;
      }
    }
    return named;
  }

  void Refuse(int e, const StepBatch& batch) {
    ++result_.stats.steps_refused;
    Trace("executor ", e, " refuses step ", batch.step_id, " of router ", batch.router);
    const int r = batch.router, incarnation = batch.router_incarnation;
    const uint64_t step_id = batch.step_id;
    Deliver([this, r, incarnation, step_id] { StepDone(r, incarnation, step_id, false); });
  }

  // ExecutorService::RunStep, for the next queued step when none runs.
  void ExecutorMaybeRun(int e) {
    Executor& executor = executors_[static_cast<size_t>(e)];
    if (executor.hung || !executor.alive || executor.running || executor.queue.empty()) return;
    if (!executor.attached || executor.link.lost) return;  // the tick re-registers first
    StepBatch batch = std::move(executor.queue.front());
    executor.queue.pop_front();
    if (Fenced(executor, batch) || batch.epoch != executor.attached_epoch ||
        FenceNames(executor, batch.router_session, batch.seq)) {
      Refuse(e, batch);
      return;
    }
    Writer w;
    w.executor = e;
    w.incarnation = executor.incarnation;
    w.epoch = executor.attached_epoch;
    w.router_session = batch.router_session;
    w.seq = batch.seq;
    w.step_id = batch.step_id;
    w.router = batch.router;
    w.router_incarnation = batch.router_incarnation;
    w.blocks = batch.blocks;
    // Most steps are short; some outlast the router's patience.
    w.ends_at = now_ + (Chance(100) ? Millis(1000, 4000) : Millis(5, 300));
    executor.running = std::move(w);
    ++executor.run_token;
    Trace("executor ", e, " writes step ", batch.step_id, " (sequence ", batch.seq,
          " of router session ", batch.router_session, ")");
    CheckWriter(*executor.running, /*starting=*/true);
    ScheduleStepEnd(e);
  }

  void ScheduleStepEnd(int e) {
    Executor& executor = executors_[static_cast<size_t>(e)];
    const uint64_t token = ++executor.run_token;
    const int incarnation = executor.incarnation;
    At(executor.running->ends_at, [this, e, token, incarnation] {
      Executor& x = executors_[static_cast<size_t>(e)];
      if (x.incarnation != incarnation || !x.alive || x.run_token != token || !x.running) return;
      if (x.hung) {
        // Stopped at the instant it would have ended: it ends once resumed.
        x.running->ends_at = x.hung_until + absl::Milliseconds(1);
        ScheduleStepEnd(e);
        return;
      }
      const Writer w = std::move(*x.running);
      x.running.reset();
      if (!w.stopping) ++result_.stats.steps_written;
      Trace("executor ", e, w.stopping ? " stopped step " : " finished step ", w.step_id);
      const int r = w.router, ri = w.router_incarnation;
      const uint64_t step_id = w.step_id;
      const bool written = !w.stopping;
      Deliver([this, r, ri, step_id, written] { StepDone(r, ri, step_id, written); });
      ExecutorMaybeRun(e);
    });
  }

  void ExecutorReply(int e, Channel channel, const std::vector<uint8_t>& bytes) {
    Executor& executor = executors_[static_cast<size_t>(e)];
    VerifiedEnvelope verified;
    const Link::Call call = executor.link.Of(channel);
    const wire::Envelope* reply = Match(executor, channel, bytes, &verified);
    if (reply == nullptr) return;
    if (call.type == wire::Message::Hello) {
      const uint64_t old_epoch = executor.link.epoch;
      if (!AcceptHello(executor, *reply)) {
        Fail("executor ", e, ": Hello refused: ", wire::EnumNameMessage(reply->payload_type()));
        return;
      }
      // Reregister() into a new epoch forgets the old one's fences; in the same epoch the
      // cache manager moved them to the new session.
      if (executor.link.epoch != old_epoch) executor.fences.clear();
      return;
    }
    if (channel == Channel::kMain && call.type == wire::Message::Heartbeat &&
        reply->payload_type() == wire::Message::ErrorReply) {
      // The acknowledgement failed (the session was gone): retried, after registering again.
      executor.ack_failed = true;
      executor.ack_retry_at = now_ + absl::Milliseconds(200);
    }
    if (SessionGoneReply(executor, call, *reply)) return;
    if (call.generation != executor.link.generation) return;
    if (call.type == wire::Message::Attach) {
      const wire::AttachReply* attach = reply->payload_as_AttachReply();
      if (attach == nullptr) {
        Fail("executor ", e, ": Attach refused");
        return;
      }
      executor.attached = true;
      executor.attached_epoch = attach->descriptor()->epoch();
      return;
    }
    if (call.type != wire::Message::Heartbeat) return;
    const wire::HeartbeatReply* beat = reply->payload_as_HeartbeatReply();
    if (beat == nullptr) {
      Fail("executor ", e, ": heartbeat answered by ",
           wire::EnumNameMessage(reply->payload_type()));
      return;
    }
    std::vector<FenceNotice> fences;
    if (beat->fences() != nullptr) {
      for (const wire::Fence* f : *beat->fences())
        fences.push_back({f->id(), f->router_session(), {}});
    }
    if (beat->sequence_fences() != nullptr) {
      for (const wire::SequenceFence* f : *beat->sequence_fences()) {
        fences.push_back({f->id(), f->router_session(),
                          std::vector<SeqId>(f->seqs()->begin(), f->seqs()->end())});
      }
    }
    if (fences != executor.fences) {
      executor.fences = std::move(fences);
      ++executor.fence_generation;
      // FencedSinceStepBegan: a running step a fence names stops at its next layer.
      if (executor.running && !executor.running->stopping &&
          FenceNames(executor, executor.running->router_session, executor.running->seq)) {
        executor.running->stopping = true;
        executor.running->ends_at = std::min(executor.running->ends_at, now_ + Millis(1, 10));
        Trace("executor ", e, " stops step ", executor.running->step_id, " (fenced)");
        ScheduleStepEnd(e);
      }
    }
  }

  // ---- The oracle -------------------------------------------------------------------------

  // A step may write its blocks only while they are in use by its own sequence (or its
  // draining rename) and were last handed to that sequence.
  void CheckWriter(const Writer& w, bool starting) {
    if (!cm_up_ || w.epoch != epoch()) return;  // another pool: that memory is gone
    const BlockLedger& ledger = service_->ledger();
    for (BlockId block : w.blocks) {
      ++result_.stats.writer_checks;
      const auto& [session, seq] = owners_[static_cast<size_t>(block)];
      if (session != w.router_session || seq != w.seq) {
        Fail("executor ", w.executor, starting ? " starts writing" : " may still write", " block ",
             block, " for sequence ", w.seq, " of router session ", w.router_session,
             ", but it was handed to sequence ", seq, " of router session ", session, " since");
        return;
      }
      if (ledger.StateOf(block) != BlockState::kInUse) {
        Fail("executor ", w.executor, starting ? " starts writing" : " may still write", " block ",
             block, " for sequence ", w.seq, " of router session ", w.router_session,
             ", but the block is ", std::string(BlockStateName(ledger.StateOf(block))));
        return;
      }
    }
  }

  void CheckAlways() {
    if (!cm_up_) return;
    if (absl::Status ok = service_->ledger().CheckInvariants(); !ok.ok()) {
      Fail("ledger invariants: ", ok.ToString());
      return;
    }
    // No block written by two steps at once (in the live pool).
    std::vector<int> writers(kBlocks, -1);
    for (const Executor& e : executors_) {
      if (!e.alive || !e.running) continue;
      const Writer& w = *e.running;
      if (w.epoch != epoch()) continue;
      for (BlockId block : w.blocks) {
        int& other = writers[static_cast<size_t>(block)];
        if (other >= 0) {
          Fail("block ", block, " written by executors ", other, " and ", w.executor, " at once");
          return;
        }
        other = w.executor;
      }
      CheckWriter(w, /*starting=*/false);
      if (!result_.ok) return;
    }
  }

  // The sessions the cache manager holds, as `kvcmctl stats` lists them (for a failure).
  std::string Sessions() {
    builder_.Clear();
    const auto hello =
        wire::CreateHello(builder_, wire::Role::Control, 1, builder_.CreateString("sim"));
    FinishEnvelope(builder_, 1, 0, 0, wire::Message::Hello, hello.Union());
    service_->Handle(cache_manager::PeerCredentials{::geteuid(), ::getegid(), 1},
                     BufferSpan(builder_), now_, &reply_);
    const wire::Envelope* hello_reply = VerifyEnvelope(BufferSpan(reply_)).envelope;
    if (hello_reply == nullptr || hello_reply->payload_as_HelloReply() == nullptr) return "?";
    const uint64_t session = hello_reply->payload_as_HelloReply()->session_id();
    builder_.Clear();
    const auto stats = wire::CreateStats(builder_);
    FinishEnvelope(builder_, 2, session, epoch(), wire::Message::Stats, stats.Union());
    service_->Handle(cache_manager::PeerCredentials{::geteuid(), ::getegid(), 1},
                     BufferSpan(builder_), now_, &reply_);
    const wire::Envelope* reply = VerifyEnvelope(BufferSpan(reply_)).envelope;
    if (reply == nullptr || reply->payload_as_StatsReply() == nullptr) return "?";
    std::string out = "; sessions:";
    for (const wire::SessionSummary* s : *reply->payload_as_StatsReply()->session_list()) {
      if (s->session_id() == session) continue;
      absl::StrAppend(&out, " [", wire::EnumNameRole(s->role()), " pid ", s->pid(),
                      s->quarantined() ? " quarantined" : "", " seqs ", s->sequences(), " fences ",
                      s->pending_fences(), "]");
    }
    return out;
  }

  // After the faults stopped and the lease bound passed: everything came back.
  void CheckQuiet() {
    if (!cm_up_) {
      Fail("no cache manager after the faults stopped");
      return;
    }
    if (service_->open_fences() != 0) {
      Fail(service_->open_fences(), " fence(s) still open ",
           absl::FormatDuration(options_.quiet_time), " after the faults stopped", Sessions());
      return;
    }
    const auto apart = service_->HeldApartList();
    if (!apart.empty()) {
      Fail(apart.size(), " block(s) still quarantined or draining ",
           absl::FormatDuration(options_.quiet_time), " after the faults stopped (block ",
           apart.front().first, ")", Sessions());
      return;
    }
    std::vector<bool> held(kBlocks, false);
    int64_t seqs = 0;
    for (const Router& router : routers_) {
      if (!router.alive || !router.link.registered || router.link.lost) continue;
      for (const RouterSeq& s : router.seqs) {
        ++seqs;
        for (BlockId b : s.blocks) held[static_cast<size_t>(b)] = true;
      }
    }
    const BlockLedger& ledger = service_->ledger();
    for (BlockId b = 0; b < kBlocks; ++b) {
      if (ledger.StateOf(b) == BlockState::kInUse && !held[static_cast<size_t>(b)]) {
        Fail("block ", b, " is in use ", absl::FormatDuration(options_.quiet_time),
             " after the faults stopped, but no live router holds it");
        return;
      }
    }
    if (ledger.Stats().live_sequences != seqs) {
      Fail(ledger.Stats().live_sequences, " live sequences in the ledger, ", seqs,
           " held by live routers, after the faults stopped");
    }
  }

  const SimOptions options_;
  std::mt19937_64 rng_;
  SimResult result_;
  int num_routers_ = 0, num_executors_ = 0;
  int drop_permille_ = 0, dup_permille_ = 0, delay_permille_ = 0, fault_permille_ = 0;
  bool faults_on_ = true;

  const absl::Time start_ = absl::FromUnixSeconds(1'000'000);
  absl::Time now_ = start_;
  absl::Time fault_end_;
  std::priority_queue<Event, std::vector<Event>, std::greater<Event>> queue_;
  uint64_t next_order_ = 0;

  SimWatcher watcher_;
  std::unique_ptr<cache_manager::CacheManagerService> service_;
  bool cm_up_ = false, cm_hung_ = false;
  int cm_incarnation_ = 0;
  uint64_t epoch_counter_ = 0;
  std::deque<std::function<void()>> cm_backlog_;
  flatbuffers::FlatBufferBuilder reply_;
  flatbuffers::FlatBufferBuilder builder_;

  std::vector<Router> routers_;
  std::vector<Executor> executors_;
  pid_t next_pid_ = 100;
  std::set<pid_t> dead_pids_;

  // The oracle: per block of the live pool, the (router session, sequence) last handed it
  // for writing; the (session, request id) of every Step applied, to tell replays apart.
  std::vector<std::pair<uint64_t, SeqId>> owners_;
  std::set<std::pair<uint64_t, uint64_t>> applied_;
  std::vector<std::pair<uint64_t, std::string>> session_labels_;
};

}  // namespace

SimResult RunSimulation(const SimOptions& options) { return World(options).Run(); }

}  // namespace kvcm::sim
