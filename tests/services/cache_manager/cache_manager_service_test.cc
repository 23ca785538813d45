// CacheManagerService without sockets: every request path, every refusal, leases and
// events, with an injected clock and a fake process watcher. After each refusal the ledger
// must be exactly as before (same stats, same invariants).

#include "services/cache_manager/cache_manager_service.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "common/wire/block_map_codec.h"
#include "common/wire/convert.h"
#include "common/wire/envelope.h"
#include "common/wire/step_codec.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "prometheus/metric_family.h"
#include "prometheus/registry.h"
#include "tests/support/status_matchers.h"

namespace kvcm::cache_manager {
namespace {

using ::testing::HasSubstr;

class FakeWatcher : public ProcessWatcher {
 public:
  absl::Status Watch(uint64_t session, pid_t pid) override {
    sessions[session] = pid;
    return absl::OkStatus();
  }
  void Unwatch(uint64_t session) override { sessions.erase(session); }
  bool Watches(pid_t pid) const {
    return std::any_of(sessions.begin(), sessions.end(),
                       [pid](const auto& entry) { return entry.second == pid; });
  }
  absl::flat_hash_map<uint64_t, pid_t> sessions;  // watched sessions and their pids
};

constexpr int32_t kBlocks = 64;
constexpr int32_t kBlockSize = 4;
constexpr pid_t kRouterPid = 1000;

BlockHash HashOf(int i) {
  BlockHash h;
  h.bytes[0] = static_cast<uint8_t>(i);
  h.bytes[1] = static_cast<uint8_t>(i >> 8);
  h.bytes[31] = 0x5a;
  return h;
}

// The ops of the test's Steps (common/wire/step_codec.h).
BlockOp Allocate(SeqId seq, int32_t tokens, std::vector<BlockHash> hashes = {}) {
  return BlockOp::Allocate(seq, tokens, hashes);
}
BlockOp Append(SeqId seq, int32_t tokens) { return BlockOp::Append(seq, tokens); }
BlockOp Commit(SeqId seq, int32_t tokens, std::vector<BlockHash> hashes = {}) {
  return BlockOp::Commit(seq, tokens, hashes);
}
BlockOp Free(SeqId seq, bool drain = false) { return BlockOp::Free(seq, drain); }
BlockOp Fork(SeqId parent, SeqId child) { return BlockOp::Fork(parent, child); }

class CacheManagerServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    CacheManagerService::Options& options = options_;
    options.spec.num_layers = 2;
    options.spec.num_kv_heads = 2;
    options.spec.head_dim = 8;
    options.spec.dtype = DType::kFloat16;
    options.spec.block_size = kBlockSize;
    options.ledger.num_blocks = kBlocks;
    options.epoch = 777;
    options.heartbeat_interval = absl::Seconds(1);
    options.heartbeat_timeout = absl::Seconds(3);
    options.max_ops_per_step = 8;
    options.pool.backend = wire::PoolBackend::Shm;
    options.pool.layout.total_bytes = 4096;
    options.pool.fd_channel_path = "/run/kvcm/pool-fd.sock";
    Restart();
  }

  // A new service with options_.
  // A new service with options_, and new metrics for it.
  void Restart() {
    service_.reset();
    CacheManagerMetrics::CacheInfo info;
    info.num_blocks = options_.ledger.num_blocks;
    info.block_size = options_.spec.block_size;
    info.dtype = "fp16";
    info.backend = "shm";
    info.hash_algorithm = "sha256";
    metrics_ = std::make_unique<CacheManagerMetrics>(info);
    auto service = CacheManagerService::Create(options_, &watcher_, metrics_.get(), now_);
    ASSERT_THAT(service, IsOk());
    service_ = *std::move(service);
  }

  // The value of counter `name` with label `label` = `value` (no label: ""), -1 if absent.
  double CounterValue(const std::string& name, const std::string& label = "",
                      const std::string& value = "") const {
    for (const prometheus::MetricFamily& family : metrics_->registry()->Collect()) {
      if (family.name != name) continue;
      for (const prometheus::ClientMetric& metric : family.metric) {
        const bool match =
            label.empty() ||
            std::any_of(metric.label.begin(), metric.label.end(),
                        [&](const auto& l) { return l.name == label && l.value == value; });
        if (match) return metric.counter.value;
      }
    }
    return -1;
  }
  double ReplayedSteps() const { return CounterValue("kvcm_cache_manager_replayed_steps_total"); }
  double Reclaimed(const std::string& reason) const {
    return CounterValue("kvcm_cache_manager_reclaimed_blocks_total", "reason", reason);
  }
  // The reason of the last reply, an ErrorReply.
  std::string reply_reason() const {
    const wire::Envelope* envelope = wire::GetEnvelope(reply_.GetBufferPointer());
    if (envelope->payload_type() != wire::Message::ErrorReply) return "";
    return envelope->payload_as_ErrorReply()->reason()->str();
  }

  // Sends `bytes` as `pid` (ipc:// credentials) and returns the verified reply.
  const wire::Envelope& Send(std::span<const uint8_t> bytes, pid_t pid = kRouterPid) {
    // Over tcp:// the service gets no credentials.
    const std::optional<PeerCredentials> peer =
        over_tcp_ ? std::nullopt
                  : std::optional<PeerCredentials>(PeerCredentials{::geteuid(), 1, pid});
    service_->Handle(peer, bytes, now_, &reply_);
    const VerifiedEnvelope verified = VerifyEnvelope(BufferSpan(reply_));
    EXPECT_EQ(verified.fault, EnvelopeFault::kNone) << verified.reason;
    return *verified.envelope;
  }

  template <typename Build>
  const wire::Envelope& Request(uint64_t session, wire::Message type, Build build,
                                pid_t pid = kRouterPid, uint64_t epoch = 777) {
    request_.Clear();
    flatbuffers::Offset<void> payload = build(request_);
    FinishEnvelope(request_, ++request_id_, session, epoch, type, payload);
    return Send(BufferSpan(request_), pid);
  }

  uint64_t Hello(wire::Role role = wire::Role::Router, pid_t pid = kRouterPid) {
    const wire::Envelope& reply = Request(
        0, wire::Message::Hello,
        [&](flatbuffers::FlatBufferBuilder& b) {
          return wire::CreateHello(b, role, pid, b.CreateString("test")).Union();
        },
        pid, 0);
    EXPECT_EQ(reply.payload_type(), wire::Message::HelloReply);
    return reply.payload_type() == wire::Message::HelloReply
               ? reply.payload_as_HelloReply()->session_id()
               : 0;
  }

  const wire::Envelope& Step(uint64_t session, const std::vector<BlockOp>& ops,
                             pid_t pid = kRouterPid) {
    request_.Clear();
    EXPECT_THAT(EncodeStep(request_, ++request_id_, session, 777, ops), IsOk());
    return Send(BufferSpan(request_), pid);
  }

  // The request id of an envelope's bytes.
  static uint64_t first_request_id(const std::vector<uint8_t>& bytes) {
    return VerifyEnvelope(bytes).envelope->request_id();
  }

  // The error of a reply (Ok if it is not an ErrorReply).
  static wire::ErrorCode ErrorOf(const wire::Envelope& reply) {
    return reply.payload_type() == wire::Message::ErrorReply ? reply.payload_as_ErrorReply()->code()
                                                             : wire::ErrorCode::Ok;
  }

  // The ledger's observable state, to compare before and after a refused message.
  std::string LedgerState() const {
    const LedgerStats s = service_->ledger().Stats();
    std::string out = absl::StrCat(s.free_blocks, "/", s.in_use_blocks, "/", s.cached_blocks, "/",
                                   s.pinned_blocks, "/", s.live_sequences, "/", s.blocks_allocated,
                                   "/", s.blocks_released, ":");
    for (BlockId b = 0; b < kBlocks; ++b) {
      absl::StrAppend(&out, service_->ledger().RefCount(b), ",");
    }
    return out;
  }

  void ExpectRefusedUnchanged(std::span<const uint8_t> bytes, wire::ErrorCode code,
                              pid_t pid = kRouterPid) {
    const std::string before = LedgerState();
    const uint64_t rejected = service_->rejected_messages();
    const wire::Envelope& reply = Send(bytes, pid);
    ASSERT_EQ(reply.payload_type(), wire::Message::ErrorReply);
    EXPECT_EQ(reply.payload_as_ErrorReply()->code(), code)
        << reply.payload_as_ErrorReply()->reason()->str();
    EXPECT_FALSE(reply.payload_as_ErrorReply()->reason()->str().empty());
    EXPECT_EQ(LedgerState(), before);
    EXPECT_EQ(service_->rejected_messages(), rejected + 1);
    EXPECT_THAT(service_->ledger().CheckInvariants(), IsOk());
  }

  FakeWatcher watcher_;
  CacheManagerService::Options options_;
  bool over_tcp_ = false;  // Send() without peer credentials
  absl::Time now_ = absl::FromUnixSeconds(1'000'000);
  std::unique_ptr<CacheManagerMetrics> metrics_;
  std::unique_ptr<CacheManagerService> service_;
  flatbuffers::FlatBufferBuilder request_;
  flatbuffers::FlatBufferBuilder reply_;
  uint64_t request_id_ = 0;
};

TEST_F(CacheManagerServiceTest, HelloIssuesSessionsAndWatchesThePid) {
  const uint64_t a = Hello();
  const uint64_t b = Hello(wire::Role::Executor, 2000);
  EXPECT_NE(a, 0u);
  EXPECT_NE(a, b);
  EXPECT_TRUE(watcher_.Watches(kRouterPid));
  EXPECT_TRUE(watcher_.Watches(2000));
  EXPECT_EQ(service_->num_sessions(), 2);
}

TEST_F(CacheManagerServiceTest, HelloWithAnotherProcessPidIsRefused) {
  const std::string before = LedgerState();
  const wire::Envelope& reply = Request(
      0, wire::Message::Hello,
      [](flatbuffers::FlatBufferBuilder& b) {
        return wire::CreateHello(b, wire::Role::Router, 4242).Union();
      },
      kRouterPid, 0);
  EXPECT_EQ(ErrorOf(reply), wire::ErrorCode::PermissionDenied);
  EXPECT_EQ(service_->num_sessions(), 0);
  EXPECT_EQ(LedgerState(), before);
}

TEST_F(CacheManagerServiceTest, StepAllocatesAppendsCommitsAndFrees) {
  const uint64_t s = Hello();
  const wire::Envelope& reply = Step(s, {Allocate(1, 10, {HashOf(1), HashOf(2)}), Append(1, 3)});
  ASSERT_EQ(reply.payload_type(), wire::Message::StepReply);
  const auto* results = reply.payload_as_StepReply()->results();
  ASSERT_EQ(results->size(), 2u);
  for (const auto* r : *results) EXPECT_EQ(r->code(), wire::ErrorCode::Ok);
  EXPECT_EQ(results->Get(0)->blocks()->size(), 3u);  // 10 tokens, block size 4
  EXPECT_EQ(results->Get(1)->blocks()->size(), 1u);  // 13 tokens need a fourth block
  EXPECT_EQ(service_->ledger().Stats().in_use_blocks, 4);
  // The executors write the step's KV after its reply: the commit comes in the next step.
  ASSERT_EQ(ErrorOf(Step(s, {Commit(1, 12, {HashOf(3)})})), wire::ErrorCode::Ok);

  // The same prefix again hits the cache once the first sequence is freed.
  ASSERT_EQ(Step(s, {Free(1)}).payload_type(), wire::Message::StepReply);
  const wire::Envelope& again = Step(s, {Allocate(2, 10, {HashOf(1), HashOf(2)})});
  ASSERT_EQ(again.payload_type(), wire::Message::StepReply);
  EXPECT_EQ(again.payload_as_StepReply()->results()->Get(0)->num_cached_tokens(), 8);
  EXPECT_THAT(service_->ledger().CheckInvariants(), IsOk());
}

TEST_F(CacheManagerServiceTest, OpsInOneStepSeeEachOther) {
  const uint64_t s = Hello();
  const wire::Envelope& reply =
      Step(s, {Allocate(1, 4), Fork(1, 2), Free(1), Allocate(1, 4), Free(2)});
  ASSERT_EQ(reply.payload_type(), wire::Message::StepReply);
  for (const auto* r : *reply.payload_as_StepReply()->results()) {
    EXPECT_EQ(r->code(), wire::ErrorCode::Ok) << r->reason()->str();
  }
  EXPECT_EQ(service_->ledger().Stats().live_sequences, 1);
}

TEST_F(CacheManagerServiceTest, OpRefusedByTheLedgerFailsAloneAndChangesNothing) {
  const uint64_t s = Hello();
  const wire::Envelope& reply =
      Step(s, {Allocate(1, 8), Allocate(2, kBlocks * kBlockSize), Append(1, 4)});
  ASSERT_EQ(reply.payload_type(), wire::Message::StepReply);
  const auto* results = reply.payload_as_StepReply()->results();
  EXPECT_EQ(results->Get(0)->code(), wire::ErrorCode::Ok);
  EXPECT_EQ(results->Get(1)->code(), wire::ErrorCode::ResourceExhausted);
  EXPECT_FALSE(results->Get(1)->reason()->str().empty());
  EXPECT_EQ(results->Get(2)->code(), wire::ErrorCode::Ok);
  EXPECT_EQ(service_->ledger().Stats().in_use_blocks, 3);
  // The refused sequence was never created, so it can be allocated later.
  EXPECT_EQ(Step(s, {Allocate(2, 4)}).payload_as_StepReply()->results()->Get(0)->code(),
            wire::ErrorCode::Ok);
}

TEST_F(CacheManagerServiceTest, GarbageAndTruncatedBuffersAreRefused) {
  const uint64_t s = Hello();
  ASSERT_EQ(ErrorOf(Step(s, {Allocate(1, 8)})), wire::ErrorCode::Ok);
  const uint32_t seed = 20261129;
  std::printf("seed %u\n", seed);
  std::mt19937 rng(seed);
  for (int i = 0; i < 200; ++i) {
    std::vector<uint8_t> garbage(rng() % 300);
    for (uint8_t& byte : garbage) byte = static_cast<uint8_t>(rng());
    ExpectRefusedUnchanged(garbage, wire::ErrorCode::Malformed);
  }
  ExpectRefusedUnchanged({}, wire::ErrorCode::Malformed);

  // A valid step (sent once, then undone) replayed cut short at every length.
  Step(s, {Allocate(5, 8, {HashOf(9)}), Append(1, 4)});
  const std::vector<uint8_t> bytes(request_.GetBufferPointer(),
                                   request_.GetBufferPointer() + request_.GetSize());
  ASSERT_EQ(ErrorOf(Step(s, {Free(5)})), wire::ErrorCode::Ok);
  for (size_t n = 0; n < bytes.size(); ++n) {
    ExpectRefusedUnchanged(std::span<const uint8_t>(bytes.data(), n), wire::ErrorCode::Malformed);
  }
}

TEST_F(CacheManagerServiceTest, WrongVersionIsRefused) {
  const uint64_t s = Hello();
  flatbuffers::FlatBufferBuilder b;
  auto payload = wire::CreateStats(b);
  wire::EnvelopeBuilder envelope(b);
  envelope.add_version(kProtocolVersion + 1);
  envelope.add_session_id(s);
  envelope.add_epoch(777);
  envelope.add_payload_type(wire::Message::Stats);
  envelope.add_payload(payload.Union());
  b.Finish(envelope.Finish(), kEnvelopeIdentifier);
  ExpectRefusedUnchanged(BufferSpan(b), wire::ErrorCode::UnsupportedVersion);
}

TEST_F(CacheManagerServiceTest, RefusalsNameTheRequestWhenItsIdCanBeRead) {
  const uint64_t s = Hello();
  // Another protocol version.
  flatbuffers::FlatBufferBuilder b;
  auto payload = wire::CreateStats(b);
  wire::EnvelopeBuilder envelope(b);
  envelope.add_version(kProtocolVersion + 1);
  envelope.add_request_id(41);
  envelope.add_session_id(s);
  envelope.add_epoch(777);
  envelope.add_payload_type(wire::Message::Stats);
  envelope.add_payload(payload.Union());
  b.Finish(envelope.Finish(), kEnvelopeIdentifier);
  EXPECT_EQ(Send(BufferSpan(b)).request_id(), 41u);
  EXPECT_EQ(ErrorOf(Send(BufferSpan(b))), wire::ErrorCode::UnsupportedVersion);

  // A step whose hash vector claims more entries than the buffer holds: the FlatBuffers
  // Verifier refuses it, but its request id is still readable.
  const BlockHash hash = HashOf(9);
  ASSERT_EQ(ErrorOf(Step(s, {Allocate(6, 8, {hash})})), wire::ErrorCode::Ok);
  std::vector<uint8_t> bytes(request_.GetBufferPointer(),
                             request_.GetBufferPointer() + request_.GetSize());
  ASSERT_EQ(ErrorOf(Step(s, {Free(6)})), wire::ErrorCode::Ok);
  const uint64_t id = request_id_ - 1;
  auto at = std::search(bytes.begin(), bytes.end(), std::begin(hash.bytes), std::end(hash.bytes));
  ASSERT_NE(at, bytes.end());
  const uint32_t huge = 1u << 24;
  std::memcpy(&*(at - 4), &huge, sizeof(huge));
  const std::string before = LedgerState();
  const wire::Envelope& corrupt = Send(bytes);
  EXPECT_EQ(ErrorOf(corrupt), wire::ErrorCode::Malformed);
  EXPECT_EQ(corrupt.request_id(), id);
  EXPECT_EQ(LedgerState(), before);

  // Oversized: the id is read from the start of the buffer; nothing else is.
  std::vector<uint8_t> oversized(kDefaultMaxMessageBytes + 1, 0);
  std::copy(b.GetBufferPointer(), b.GetBufferPointer() + b.GetSize(), oversized.begin());
  const wire::Envelope& big = Send(oversized);
  EXPECT_EQ(ErrorOf(big), wire::ErrorCode::Malformed);
  EXPECT_EQ(big.request_id(), 41u);

  // Garbage has no readable id: 0.
  const std::vector<uint8_t> garbage(64, 0xab);
  EXPECT_EQ(Send(garbage).request_id(), 0u);
  EXPECT_THAT(service_->ledger().CheckInvariants(), IsOk());
}

TEST_F(CacheManagerServiceTest, SessionsAndSequencesAreBounded) {
  options_.max_sessions = 3;
  options_.max_sessions_per_process = 2;
  options_.max_sequences_per_session = 3;
  Restart();
  const uint64_t a = Hello();
  ASSERT_NE(Hello(), 0u);
  // A third session of one process is refused, and changes nothing.
  const wire::Envelope& third = Request(
      0, wire::Message::Hello,
      [&](flatbuffers::FlatBufferBuilder& b) {
        return wire::CreateHello(b, wire::Role::Router, kRouterPid, b.CreateString("x")).Union();
      },
      kRouterPid, 0);
  ASSERT_EQ(ErrorOf(third), wire::ErrorCode::ResourceExhausted);
  EXPECT_THAT(third.payload_as_ErrorReply()->reason()->str(), HasSubstr("per process"));
  EXPECT_EQ(service_->num_sessions(), 2);
  // Another process may still register, until the cache manager's own limit.
  ASSERT_NE(Hello(wire::Role::Executor, 2000), 0u);
  const wire::Envelope& fourth = Request(
      0, wire::Message::Hello,
      [&](flatbuffers::FlatBufferBuilder& b) {
        return wire::CreateHello(b, wire::Role::Router, 3000, b.CreateString("x")).Union();
      },
      3000, 0);
  ASSERT_EQ(ErrorOf(fourth), wire::ErrorCode::ResourceExhausted);
  EXPECT_EQ(service_->num_sessions(), 3);

  // Three live sequences at most; a step that frees one first may add one.
  ASSERT_EQ(ErrorOf(Step(a, {Allocate(1, 0), Allocate(2, 0), Allocate(3, 0)})),
            wire::ErrorCode::Ok);
  const std::string before = LedgerState();
  const wire::Envelope& over = Step(a, {Allocate(4, 0)});
  ASSERT_EQ(ErrorOf(over), wire::ErrorCode::ResourceExhausted);
  EXPECT_THAT(over.payload_as_ErrorReply()->reason()->str(), HasSubstr("live sequences"));
  ASSERT_EQ(ErrorOf(Step(a, {Fork(1, 5)})), wire::ErrorCode::ResourceExhausted);
  EXPECT_EQ(LedgerState(), before);
  EXPECT_EQ(ErrorOf(Step(a, {Free(1), Fork(2, 5)})), wire::ErrorCode::Ok);
  EXPECT_THAT(service_->ledger().CheckInvariants(), IsOk());
}

TEST_F(CacheManagerServiceTest, ARepeatedStepIsAnsweredFromTheReplayCacheNotRunTwice) {
  const uint64_t s = Hello();
  const wire::Envelope& first = Step(s, {Allocate(1, 8)});
  ASSERT_EQ(ErrorOf(first), wire::ErrorCode::Ok);
  const std::vector<uint8_t> sent(request_.GetBufferPointer(),
                                  request_.GetBufferPointer() + request_.GetSize());
  const std::vector<uint8_t> answer(reply_.GetBufferPointer(),
                                    reply_.GetBufferPointer() + reply_.GetSize());
  const std::string state = LedgerState();

  // The same bytes again: the same reply, byte for byte; nothing runs twice.
  Send(sent);
  EXPECT_EQ(
      std::vector<uint8_t>(reply_.GetBufferPointer(), reply_.GetBufferPointer() + reply_.GetSize()),
      answer);
  EXPECT_EQ(LedgerState(), state);

  // The same request id with other ops is a client bug: refused, nothing changes.
  request_.Clear();
  {
    std::vector<wire::StepOp> types = {wire::StepOp::AllocateOp};
    std::vector<flatbuffers::Offset<void>> values = {
        wire::CreateAllocateOp(request_, 3, 8).Union()};
    auto type_vector = request_.CreateVector(types);
    auto value_vector = request_.CreateVector(values);
    wire::StepBuilder step(request_);
    step.add_ops_type(type_vector);
    step.add_ops(value_vector);
    FinishEnvelope(request_, first_request_id(sent), s, 777, wire::Message::Step,
                   step.Finish().Union());
  }
  const std::string before = LedgerState();
  const wire::Envelope& reused = Send(BufferSpan(request_));
  EXPECT_EQ(ErrorOf(reused), wire::ErrorCode::InvalidArgument);
  EXPECT_EQ(LedgerState(), before);

  // Only the last four steps are kept: after four more, the first is refused as too old to
  // replay, and never run again (an Append run twice would grow its sequence twice).
  for (uint64_t seq = 10; seq < 14; ++seq) {
    ASSERT_EQ(ErrorOf(Step(s, {Allocate(seq, 4)})), wire::ErrorCode::Ok);
  }
  ExpectRefusedUnchanged(sent, wire::ErrorCode::FailedPrecondition);
  EXPECT_THAT(reply_reason(), HasSubstr("not run again"));
  // So is an Append whose reply was pushed out, where running it again would count its
  // tokens twice.
  ASSERT_EQ(ErrorOf(Step(s, {Append(10, 4)})), wire::ErrorCode::Ok);
  const std::vector<uint8_t> append(request_.GetBufferPointer(),
                                    request_.GetBufferPointer() + request_.GetSize());
  for (uint64_t seq = 20; seq < 24; ++seq) {
    ASSERT_EQ(ErrorOf(Step(s, {Allocate(seq, 4)})), wire::ErrorCode::Ok);
  }
  ExpectRefusedUnchanged(append, wire::ErrorCode::FailedPrecondition);
  EXPECT_EQ(*service_->ledger().NumTokens(10), 8);
  EXPECT_EQ(ReplayedSteps(), 1);
}

// A reply larger than the 4 MiB that used to bound the replay cache: kept and replayed whole
// (before, the retry ran again and was refused ALREADY_EXISTS, its allocation unknown).
TEST_F(CacheManagerServiceTest, AStepReplyOfMebibytesIsKeptAndReplayedWhole) {
  constexpr int32_t kLarge = 1'200'000;  // block ids: 4.8 MB of reply
  options_.ledger.num_blocks = kLarge + kBlocks;
  Restart();
  const uint64_t s = Hello();
  const wire::Envelope& first = Step(s, {Allocate(1, kLarge * kBlockSize)});
  ASSERT_EQ(ErrorOf(first), wire::ErrorCode::Ok);
  ASSERT_EQ(first.payload_as_StepReply()->results()->Get(0)->blocks()->size(),
            static_cast<uint32_t>(kLarge));
  const std::vector<uint8_t> sent(request_.GetBufferPointer(),
                                  request_.GetBufferPointer() + request_.GetSize());
  const std::vector<uint8_t> answer(reply_.GetBufferPointer(),
                                    reply_.GetBufferPointer() + reply_.GetSize());
  ASSERT_GT(answer.size(), size_t{4} << 20);
  const LedgerStats before = service_->ledger().Stats();

  Send(sent);
  EXPECT_EQ(
      std::vector<uint8_t>(reply_.GetBufferPointer(), reply_.GetBufferPointer() + reply_.GetSize()),
      answer);
  const LedgerStats after = service_->ledger().Stats();
  EXPECT_EQ(after.in_use_blocks, before.in_use_blocks);
  EXPECT_EQ(after.blocks_allocated, before.blocks_allocated);
  EXPECT_EQ(after.live_sequences, 1);
  EXPECT_EQ(ReplayedSteps(), 1);

  // Three small steps later it is still among the last four, and still replayed.
  for (uint64_t seq = 2; seq < 5; ++seq) {
    ASSERT_EQ(ErrorOf(Step(s, {Allocate(seq, 4)})), wire::ErrorCode::Ok);
  }
  Send(sent);
  EXPECT_EQ(
      std::vector<uint8_t>(reply_.GetBufferPointer(), reply_.GetBufferPointer() + reply_.GetSize()),
      answer);
  EXPECT_EQ(ReplayedSteps(), 2);
  EXPECT_THAT(service_->ledger().CheckInvariants(), IsOk());
}

// Every applied Step's reply is kept, so none may exceed the message limit: a step whose
// reply could is refused whole before it runs.
TEST_F(CacheManagerServiceTest, AStepWhoseReplyCouldExceedTheMessageLimitIsRefusedBeforeItRuns) {
  options_.ledger.num_blocks = 1 << 15;
  options_.max_message_bytes = 64 << 10;
  Restart();
  const uint64_t s = Hello();
  // 20,000 block ids are 80,000 bytes of reply.
  request_.Clear();
  ASSERT_TRUE(EncodeStep(request_, ++request_id_, s, 777,
                         std::vector<BlockOp>{Allocate(1, 20'000 * kBlockSize)})
                  .ok());
  ExpectRefusedUnchanged(BufferSpan(request_), wire::ErrorCode::InvalidArgument);
  EXPECT_THAT(reply_reason(), HasSubstr("split it into smaller steps"));
  // Half of it fits. A step whose ops add up to too much is refused; without its last op,
  // it runs.
  const wire::Envelope& half = Step(s, {Allocate(1, 10'000 * kBlockSize)});
  ASSERT_EQ(ErrorOf(half), wire::ErrorCode::Ok);
  EXPECT_LE(reply_.GetSize(), options_.max_message_bytes);
  request_.Clear();
  ASSERT_TRUE(EncodeStep(request_, ++request_id_, s, 777,
                         std::vector<BlockOp>{Allocate(2, 6'000 * kBlockSize),
                                              Append(1, 6'000 * kBlockSize),
                                              Allocate(3, 6'000 * kBlockSize)})
                  .ok());
  ExpectRefusedUnchanged(BufferSpan(request_), wire::ErrorCode::InvalidArgument);
  ASSERT_EQ(ErrorOf(Step(s, {Allocate(2, 6'000 * kBlockSize), Append(1, 6'000 * kBlockSize)})),
            wire::ErrorCode::Ok);
  EXPECT_LE(reply_.GetSize(), options_.max_message_bytes);
  EXPECT_EQ(*service_->ledger().NumTokens(1), 16'000 * kBlockSize);
}

TEST_F(CacheManagerServiceTest, OnlyTokensOfEarlierStepsCanBeCommitted) {
  const uint64_t s = Hello();
  const std::string empty = LedgerState();
  // The executors write a step's KV after its reply: committing it in the same step would
  // make blocks matchable before their KV exists.
  const wire::Envelope& early = Step(s, {Allocate(1, 8, {HashOf(1), HashOf(2)}), Commit(1, 8)});
  ASSERT_EQ(ErrorOf(early), wire::ErrorCode::InvalidArgument);
  EXPECT_THAT(early.payload_as_ErrorReply()->reason()->str(), HasSubstr("same step"));
  EXPECT_EQ(LedgerState(), empty);
  ASSERT_EQ(ErrorOf(Step(s, {Allocate(1, 8, {HashOf(1), HashOf(2)})})), wire::ErrorCode::Ok);
  // Appended tokens likewise; a fork's child may commit what its parent had.
  EXPECT_EQ(ErrorOf(Step(s, {Append(1, 2), Commit(1, 10)})), wire::ErrorCode::InvalidArgument);
  EXPECT_EQ(ErrorOf(Step(s, {Append(1, 2), Fork(1, 2), Commit(2, 8), Commit(1, 8)})),
            wire::ErrorCode::Ok);
  EXPECT_EQ(ErrorOf(Step(s, {Commit(1, 10), Commit(2, 10)})), wire::ErrorCode::Ok);
  EXPECT_THAT(service_->ledger().CheckInvariants(), IsOk());
}

TEST_F(CacheManagerServiceTest, OverTcpTheSecretGrantsRolesAndAClaimedPidReplacesNothing) {
  options_.tcp_secret = "s3cret";
  Restart();
  // A verified router of pid kRouterPid, hung: quarantined with its blocks.
  const uint64_t hung = Hello();
  ASSERT_EQ(ErrorOf(Step(hung, {Allocate(1, 8)})), wire::ErrorCode::Ok);
  now_ += absl::Seconds(4);
  service_->ExpireSessions(now_);
  ASSERT_EQ(service_->QuarantinedBlocks(), 2);

  over_tcp_ = true;
  auto hello = [&](wire::Role role, const char* secret) {
    return &Request(
        0, wire::Message::Hello,
        [&](flatbuffers::FlatBufferBuilder& b) {
          return wire::CreateHello(b, role, kRouterPid, b.CreateString("tcp"),
                                   secret == nullptr ? 0 : b.CreateString(secret))
              .Union();
        },
        kRouterPid, 0);
  };
  EXPECT_EQ(ErrorOf(*hello(wire::Role::Router, nullptr)), wire::ErrorCode::PermissionDenied);
  EXPECT_EQ(ErrorOf(*hello(wire::Role::Executor, "wrong!")), wire::ErrorCode::PermissionDenied);
  const wire::Envelope* granted = hello(wire::Role::Router, "s3cret");
  ASSERT_EQ(granted->payload_type(), wire::Message::HelloReply);
  const uint64_t remote = granted->payload_as_HelloReply()->session_id();
  // Claiming the hung router's pid ended nothing: it is still quarantined.
  EXPECT_EQ(service_->QuarantinedBlocks(), 2);

  // A control session over tcp:// without the secret may read Stats, but the session list
  // hides every id: with the tcp router's id it could act as that router.
  const wire::Envelope* control = hello(wire::Role::Control, nullptr);
  ASSERT_EQ(control->payload_type(), wire::Message::HelloReply);
  const uint64_t reader = control->payload_as_HelloReply()->session_id();
  auto stats_ids = [&](uint64_t asker) {
    std::vector<uint64_t> seen;
    const wire::Envelope& reply =
        Request(asker, wire::Message::Stats,
                [](flatbuffers::FlatBufferBuilder& b) { return wire::CreateStats(b).Union(); });
    EXPECT_EQ(reply.payload_type(), wire::Message::StatsReply);
    const wire::StatsReply* stats = reply.payload_as_StatsReply();
    if (stats != nullptr && stats->session_list() != nullptr) {
      for (const wire::SessionSummary* summary : *stats->session_list()) {
        seen.push_back(summary->session_id());
      }
    }
    return seen;
  };
  const std::vector<uint64_t> hidden = stats_ids(reader);
  ASSERT_EQ(hidden.size(), 3u);  // the hung ipc router, the tcp router, the reader
  for (uint64_t id : hidden) EXPECT_EQ(id, 0u);
  const std::vector<uint64_t> shown = stats_ids(remote);  // it holds the secret
  EXPECT_NE(std::find(shown.begin(), shown.end(), remote), shown.end());
  EXPECT_NE(std::find(shown.begin(), shown.end(), hung), shown.end());

  // The tcp router's pid can never be proven dead: when its lease runs out, it ends and its
  // blocks come back (no executor could be writing them).
  ASSERT_EQ(ErrorOf(Step(remote, {Allocate(2, 12)})), wire::ErrorCode::Ok);
  EXPECT_EQ(service_->ledger().Stats().in_use_blocks, 5);
  now_ += absl::Seconds(4);
  service_->ExpireSessions(now_);
  EXPECT_EQ(service_->ledger().Stats().in_use_blocks, 2);  // the hung ipc router's only
  EXPECT_EQ(service_->QuarantinedBlocks(), 2);
  over_tcp_ = false;
  EXPECT_THAT(service_->ledger().CheckInvariants(), IsOk());
}

// Each session is watched through its own pidfd: when the process a watch saw exits, that
// session ends and no other. A pid reused by a new process (which registered before the
// old one's exit was handled) keeps its session and its sequences.
TEST_F(CacheManagerServiceTest, AWatchEndsOnlyItsOwnSessionNotAnotherOfTheSamePid) {
  const uint64_t old_router = Hello(wire::Role::Router, kRouterPid);
  ASSERT_EQ(ErrorOf(Step(old_router, {Allocate(1, 8)})), wire::ErrorCode::Ok);
  // The pid now names another process: an executor that says Hello before the old router's
  // exit is seen.
  const uint64_t reuser = Hello(wire::Role::Executor, kRouterPid);
  ASSERT_NE(reuser, 0u);
  ASSERT_EQ(watcher_.sessions.size(), 2u);
  EXPECT_TRUE(service_->OnSessionProcessExited(old_router));
  EXPECT_FALSE(service_->OnSessionProcessExited(old_router));  // already ended
  // The executor's session lives on (its heartbeat is answered), still watched.
  const wire::Envelope& beat = Request(
      reuser, wire::Message::Heartbeat,
      [](flatbuffers::FlatBufferBuilder& b) { return wire::CreateHeartbeat(b).Union(); },
      kRouterPid);
  EXPECT_EQ(beat.payload_type(), wire::Message::HeartbeatReply);
  EXPECT_EQ(watcher_.sessions.count(reuser), 1u);
  EXPECT_EQ(watcher_.sessions.count(old_router), 0u);
  EXPECT_THAT(service_->ledger().CheckInvariants(), IsOk());
}

TEST_F(CacheManagerServiceTest, SessionIdsAreUnguessableAndBoundToTheirCredentials) {
  options_.tcp_secret = "s3cret";
  Restart();
  // Random 53-bit ids: no two alike, none following another.
  std::vector<uint64_t> ids;
  for (pid_t pid = 2000; pid < 2040; ++pid) ids.push_back(Hello(wire::Role::Control, pid));
  int consecutive = 0;
  for (size_t i = 0; i < ids.size(); ++i) {
    EXPECT_NE(ids[i], 0u);
    EXPECT_LT(ids[i], uint64_t{1} << 53);
    if (i > 0 && ids[i] == ids[i - 1] + 1) ++consecutive;
  }
  EXPECT_EQ(absl::flat_hash_set<uint64_t>(ids.begin(), ids.end()).size(), ids.size());
  EXPECT_EQ(consecutive, 0);

  // An ipc:// session answers only to its own process: not to another pid, and not to a
  // peer without credentials even if it knows the id (and the secret).
  const uint64_t router = Hello();
  ASSERT_EQ(ErrorOf(Step(router, {Allocate(1, 4)})), wire::ErrorCode::Ok);
  EXPECT_EQ(ErrorOf(Step(router, {Free(1)}, kRouterPid + 1)), wire::ErrorCode::PermissionDenied);
  over_tcp_ = true;
  EXPECT_EQ(ErrorOf(Step(router, {Free(1)})), wire::ErrorCode::PermissionDenied);
  over_tcp_ = false;
  EXPECT_EQ(service_->ledger().Stats().live_sequences, 1);
  // An id that was never issued, and one that ended, are told apart.
  EXPECT_EQ(ErrorOf(Step(12345, {Free(1)})), wire::ErrorCode::NotRegistered);
  Request(
      ids[0], wire::Message::Goodbye, [](auto& b) { return wire::CreateGoodbye(b).Union(); }, 2000);
  EXPECT_EQ(ErrorOf(Request(
                ids[0], wire::Message::Stats, [](auto& b) { return wire::CreateStats(b).Union(); },
                2000)),
            wire::ErrorCode::StaleSession);
}

TEST_F(CacheManagerServiceTest, ReplyTypesAreNotRequests) {
  const uint64_t s = Hello();
  flatbuffers::FlatBufferBuilder b;
  FinishEnvelope(b, 1, s, 777, wire::Message::StatsReply, wire::CreateStatsReply(b).Union());
  ExpectRefusedUnchanged(BufferSpan(b), wire::ErrorCode::Malformed);
}

TEST_F(CacheManagerServiceTest, SemanticallyBadStepsAreRefusedWhole) {
  const uint64_t s = Hello();
  const uint64_t other = Hello(wire::Role::Router, 3000);
  ASSERT_EQ(ErrorOf(Step(s, {Allocate(1, 8)})), wire::ErrorCode::Ok);
  ASSERT_EQ(ErrorOf(Step(other, {Allocate(50, 4)}, 3000)), wire::ErrorCode::Ok);

  auto refused = [&](const std::vector<BlockOp>& ops, wire::ErrorCode code) {
    const std::string before = LedgerState();
    const uint64_t rejected = service_->rejected_messages();
    const wire::Envelope& reply = Step(s, ops);
    EXPECT_EQ(ErrorOf(reply), code);
    EXPECT_EQ(LedgerState(), before);
    EXPECT_EQ(service_->rejected_messages(), rejected + 1);
  };
  // Out-of-range values; the valid first op must not be applied either.
  refused({Allocate(2, 4), Allocate(3, -1)}, wire::ErrorCode::InvalidArgument);
  refused({Allocate(2, 4), Allocate(3, kBlocks * kBlockSize + 1)},
          wire::ErrorCode::InvalidArgument);
  refused({Allocate(2, 4, {HashOf(1), HashOf(2)})}, wire::ErrorCode::InvalidArgument);
  refused({Append(1, -5)}, wire::ErrorCode::InvalidArgument);
  refused({Commit(1, -1)}, wire::ErrorCode::InvalidArgument);
  // Unknown sequences, including one freed earlier in the same step.
  refused({Allocate(2, 4), Append(99, 1)}, wire::ErrorCode::NotFound);
  refused({Free(1), Commit(1, 4)}, wire::ErrorCode::NotFound);
  refused({Fork(98, 4)}, wire::ErrorCode::NotFound);
  // Another session's sequence.
  refused({Append(50, 1)}, wire::ErrorCode::PermissionDenied);
  refused({Free(50)}, wire::ErrorCode::PermissionDenied);
  // Duplicates.
  refused({Allocate(1, 4)}, wire::ErrorCode::AlreadyExists);
  refused({Allocate(2, 4), Allocate(2, 4)}, wire::ErrorCode::AlreadyExists);
  refused({Fork(1, 50)}, wire::ErrorCode::AlreadyExists);
  // Oversized: more ops than the limit (8 here).
  refused(std::vector<BlockOp>(9, Append(1, 0)), wire::ErrorCode::InvalidArgument);
}

TEST_F(CacheManagerServiceTest, OnlyRoutersStep) {
  const uint64_t e = Hello(wire::Role::Executor, 2000);
  const std::string before = LedgerState();
  EXPECT_EQ(ErrorOf(Step(e, {Allocate(1, 4)}, 2000)), wire::ErrorCode::PermissionDenied);
  EXPECT_EQ(LedgerState(), before);
}

TEST_F(CacheManagerServiceTest, SessionChecks) {
  const uint64_t s = Hello();
  auto stats = [](flatbuffers::FlatBufferBuilder& b) { return wire::CreateStats(b).Union(); };
  EXPECT_EQ(ErrorOf(Request(0, wire::Message::Stats, stats)), wire::ErrorCode::NotRegistered);
  EXPECT_EQ(ErrorOf(Request(s + 100, wire::Message::Stats, stats)), wire::ErrorCode::NotRegistered);
  EXPECT_EQ(ErrorOf(Request(s, wire::Message::Stats, stats, kRouterPid, 776)),
            wire::ErrorCode::StaleEpoch);
  // Another process presenting this session id.
  EXPECT_EQ(ErrorOf(Request(s, wire::Message::Stats, stats, 5555)),
            wire::ErrorCode::PermissionDenied);
  EXPECT_EQ(ErrorOf(Request(s, wire::Message::Stats, stats)), wire::ErrorCode::Ok);
  // After Goodbye the session is stale.
  Request(s, wire::Message::Goodbye,
          [](flatbuffers::FlatBufferBuilder& b) { return wire::CreateGoodbye(b).Union(); });
  EXPECT_EQ(ErrorOf(Request(s, wire::Message::Stats, stats)), wire::ErrorCode::StaleSession);
}

TEST_F(CacheManagerServiceTest, GoodbyeFreesSequencesAndKeepsCommittedBlocksCached) {
  const uint64_t s = Hello();
  ASSERT_EQ(ErrorOf(Step(s, {Allocate(1, 10, {HashOf(1), HashOf(2)})})), wire::ErrorCode::Ok);
  ASSERT_EQ(ErrorOf(Step(s, {Commit(1, 10)})), wire::ErrorCode::Ok);
  const wire::Envelope& bye =
      Request(s, wire::Message::Goodbye, [](auto& b) { return wire::CreateGoodbye(b).Union(); });
  ASSERT_EQ(bye.payload_type(), wire::Message::GoodbyeReply);
  EXPECT_EQ(bye.payload_as_GoodbyeReply()->blocks_released(), 3);
  const LedgerStats stats = service_->ledger().Stats();
  EXPECT_EQ(stats.in_use_blocks, 0);
  EXPECT_EQ(stats.cached_blocks, 2);
  EXPECT_EQ(stats.live_sequences, 0);
}

TEST_F(CacheManagerServiceTest, DeadProcessSequencesAreFreed) {
  const uint64_t s = Hello();
  const uint64_t survivor = Hello(wire::Role::Router, 3000);
  ASSERT_EQ(ErrorOf(Step(s, {Allocate(1, 40), Allocate(2, 8)})), wire::ErrorCode::Ok);
  ASSERT_EQ(ErrorOf(Step(survivor, {Allocate(3, 8)}, 3000)), wire::ErrorCode::Ok);
  service_->OnProcessExited(kRouterPid);
  EXPECT_EQ(service_->ledger().Stats().in_use_blocks, 2);
  EXPECT_FALSE(watcher_.Watches(kRouterPid));
  EXPECT_THAT(service_->ledger().CheckInvariants(), IsOk());
  // The survivor's sequence is untouched, and the freed blocks can be reused.
  EXPECT_EQ(ErrorOf(Step(survivor, {Append(3, 4), Allocate(4, 40)}, 3000)), wire::ErrorCode::Ok);
}

TEST_F(CacheManagerServiceTest, HungSessionIsQuarantinedThenReplaced) {
  const uint64_t s = Hello();
  const uint64_t survivor = Hello(wire::Role::Router, 3000);
  ASSERT_EQ(ErrorOf(Step(s, {Allocate(1, 40)})), wire::ErrorCode::Ok);  // 10 blocks
  // The survivor keeps heartbeating; the first goes silent.
  for (int i = 0; i < 4; ++i) {
    now_ += absl::Seconds(1);
    Request(
        survivor, wire::Message::Heartbeat,
        [](auto& b) { return wire::CreateHeartbeat(b).Union(); }, 3000);
    service_->ExpireSessions(now_);
  }
  EXPECT_EQ(service_->QuarantinedBlocks(), 10);
  EXPECT_EQ(service_->Snapshot().quarantined_blocks, 10);
  // Quarantined blocks are not reissued: the pool has 54 other blocks, not 64.
  const wire::Envelope& big = Step(survivor, {Allocate(7, 55 * kBlockSize)}, 3000);
  EXPECT_EQ(big.payload_as_StepReply()->results()->Get(0)->code(),
            wire::ErrorCode::ResourceExhausted);
  // The hung client wakes up: its old session is refused, ledger unchanged.
  const std::string before = LedgerState();
  EXPECT_EQ(ErrorOf(Step(s, {Append(1, 1)})), wire::ErrorCode::StaleSession);
  EXPECT_EQ(LedgerState(), before);
  // It registers anew: the old session's blocks come back.
  const uint64_t renewed = Hello();
  EXPECT_NE(renewed, s);
  EXPECT_EQ(service_->QuarantinedBlocks(), 0);
  EXPECT_EQ(service_->ledger().Stats().in_use_blocks, 0);
  EXPECT_EQ(ErrorOf(Step(renewed, {Allocate(1, 4)})), wire::ErrorCode::Ok);
}

TEST_F(CacheManagerServiceTest, QuarantinedSessionIsFreedWhenItsProcessDies) {
  const uint64_t s = Hello();
  ASSERT_EQ(ErrorOf(Step(s, {Allocate(1, 12)})), wire::ErrorCode::Ok);
  now_ += absl::Seconds(10);
  EXPECT_EQ(service_->ExpireSessions(now_), 1);
  EXPECT_EQ(service_->QuarantinedBlocks(), 3);
  service_->OnProcessExited(kRouterPid);
  EXPECT_EQ(service_->QuarantinedBlocks(), 0);
  EXPECT_EQ(service_->ledger().Stats().free_blocks, kBlocks);
}

// --- Fencing: no block is reissued while an executor may still write it -----------------

constexpr pid_t kExecutorPid = 2000;
constexpr pid_t kSecondExecutorPid = 2001;

class CacheManagerFenceTest : public CacheManagerServiceTest {
 protected:
  // A heartbeat of `session` acknowledging `acks`; returns the fences its reply lists.
  std::vector<std::pair<uint64_t, uint64_t>> Heartbeat(uint64_t session, pid_t pid,
                                                       std::vector<uint64_t> acks = {}) {
    const wire::Envelope& reply = Request(
        session, wire::Message::Heartbeat,
        [&](flatbuffers::FlatBufferBuilder& b) {
          return wire::CreateHeartbeat(b, acks.empty() ? 0 : b.CreateVector(acks)).Union();
        },
        pid);
    std::vector<std::pair<uint64_t, uint64_t>> fences;
    EXPECT_EQ(reply.payload_type(), wire::Message::HeartbeatReply);
    if (reply.payload_type() != wire::Message::HeartbeatReply) return fences;
    if (const auto* listed = reply.payload_as_HeartbeatReply()->fences()) {
      for (const wire::Fence* f : *listed) fences.emplace_back(f->id(), f->router_session());
    }
    return fences;
  }

  // A Hello over tcp:// (set over_tcp_) with the secret "s3cret"; its session id, 0 if
  // refused.
  uint64_t TcpHello(wire::Role role, pid_t claimed_pid) {
    const wire::Envelope& reply = Request(
        0, wire::Message::Hello,
        [&](flatbuffers::FlatBufferBuilder& b) {
          return wire::CreateHello(b, role, claimed_pid, b.CreateString("tcp"),
                                   b.CreateString("s3cret"))
              .Union();
        },
        claimed_pid, 0);
    return reply.payload_type() == wire::Message::HelloReply
               ? reply.payload_as_HelloReply()->session_id()
               : 0;
  }

  // Blocks a fresh sequence of a second router can get now: all-or-nothing probes.
  int32_t AllocatableBlocks(uint64_t router, pid_t pid) {
    int32_t lo = 0, hi = kBlocks;
    while (lo < hi) {
      const int32_t mid = (lo + hi + 1) / 2;
      const wire::Envelope& reply = Step(router, {Allocate(999, mid * kBlockSize)}, pid);
      const bool ok =
          reply.payload_as_StepReply()->results()->Get(0)->code() == wire::ErrorCode::Ok;
      if (ok) {
        EXPECT_EQ(ErrorOf(Step(router, {Free(999)}, pid)), wire::ErrorCode::Ok);
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    return lo;
  }

  // The block ids sequence `seq` of `router` holds.
  std::vector<int32_t> BlocksOf(uint64_t router, uint64_t seq, int32_t tokens, pid_t pid) {
    const wire::Envelope& reply = Step(router, {Allocate(seq, tokens)}, pid);
    const auto* blocks = reply.payload_as_StepReply()->results()->Get(0)->blocks();
    return blocks == nullptr ? std::vector<int32_t>{}
                             : std::vector<int32_t>(blocks->begin(), blocks->end());
  }
};

TEST_F(CacheManagerFenceTest, DeadRoutersBlocksDrainUntilEveryExecutorAcknowledges) {
  const uint64_t router = Hello();
  const uint64_t exec_a = Hello(wire::Role::Executor, kExecutorPid);
  const uint64_t exec_b = Hello(wire::Role::Executor, kSecondExecutorPid);
  const std::vector<int32_t> held = BlocksOf(router, 1, 10 * kBlockSize, kRouterPid);
  ASSERT_EQ(held.size(), 10u);
  ASSERT_EQ(ErrorOf(Step(router, {Commit(1, 4 * kBlockSize)})), wire::ErrorCode::Ok);
  service_->OnProcessExited(kRouterPid);

  // Draining: counted apart, never reissued to a second router.
  EXPECT_EQ(service_->DrainingBlocks(), 10);
  EXPECT_EQ(service_->Snapshot().draining_blocks, 10);
  EXPECT_EQ(service_->open_fences(), 1);
  EXPECT_THAT(service_->ledger().CheckInvariants(), IsOk());
  const uint64_t second = Hello(wire::Role::Router, 3000);
  EXPECT_EQ(AllocatableBlocks(second, 3000), kBlocks - 10);
  for (int32_t b : BlocksOf(second, 5, (kBlocks - 10) * kBlockSize, 3000)) {
    EXPECT_EQ(std::count(held.begin(), held.end(), b), 0) << "block " << b << " reissued";
  }
  ASSERT_EQ(ErrorOf(Step(second, {Free(5)}, 3000)), wire::ErrorCode::Ok);
  // The dead router's sequence id is free again at once (the drained copy moved away).
  ASSERT_EQ(ErrorOf(Step(second, {Allocate(1, 1), Free(1)}, 3000)), wire::ErrorCode::Ok);

  // Both executors are told; one acknowledging is not enough.
  const auto fences = Heartbeat(exec_a, kExecutorPid);
  ASSERT_EQ(fences.size(), 1u);
  EXPECT_EQ(fences[0].second, router);
  EXPECT_EQ(Heartbeat(exec_b, kSecondExecutorPid), fences);
  EXPECT_TRUE(Heartbeat(exec_a, kExecutorPid, {fences[0].first}).empty());
  EXPECT_EQ(service_->DrainingBlocks(), 10);
  // Acknowledging twice, or a fence that does not exist, changes nothing.
  EXPECT_TRUE(Heartbeat(exec_a, kExecutorPid, {fences[0].first, 12345}).empty());
  EXPECT_EQ(service_->DrainingBlocks(), 10);
  // The second executor dies: its death acknowledges. The blocks come back; the committed
  // ones stay cached for a retried request.
  service_->OnProcessExited(kSecondExecutorPid);
  EXPECT_EQ(service_->DrainingBlocks(), 0);
  EXPECT_EQ(service_->open_fences(), 0);
  const LedgerStats stats = service_->ledger().Stats();
  EXPECT_EQ(stats.in_use_blocks, 0);
  EXPECT_EQ(stats.live_sequences, 0);
  EXPECT_EQ(AllocatableBlocks(second, 3000), kBlocks);
  EXPECT_THAT(service_->ledger().CheckInvariants(), IsOk());
}

TEST_F(CacheManagerFenceTest, GoodbyeAndReplacedRouterSessionsAreFencedToo) {
  const uint64_t exec = Hello(wire::Role::Executor, kExecutorPid);
  const uint64_t router = Hello();
  ASSERT_EQ(ErrorOf(Step(router, {Allocate(1, 12)})), wire::ErrorCode::Ok);
  const wire::Envelope& bye = Request(router, wire::Message::Goodbye,
                                      [](auto& b) { return wire::CreateGoodbye(b).Union(); });
  ASSERT_EQ(bye.payload_type(), wire::Message::GoodbyeReply);
  EXPECT_EQ(bye.payload_as_GoodbyeReply()->blocks_released(), 0);  // draining, not released
  EXPECT_EQ(service_->DrainingBlocks(), 3);

  // A router that was quarantined and registers again gives up its old session: fenced.
  const uint64_t hung = Hello(wire::Role::Router, 3000);
  ASSERT_EQ(ErrorOf(Step(hung, {Allocate(2, 8)}, 3000)), wire::ErrorCode::Ok);
  for (int i = 0; i < 4; ++i) {
    now_ += absl::Seconds(1);
    Heartbeat(exec, kExecutorPid);
    service_->ExpireSessions(now_);
  }
  EXPECT_EQ(service_->QuarantinedBlocks(), 2);
  const uint64_t renewed = Hello(wire::Role::Router, 3000);
  EXPECT_NE(renewed, hung);
  EXPECT_EQ(service_->QuarantinedBlocks(), 0);
  EXPECT_EQ(service_->DrainingBlocks(), 5);
  const auto fences = Heartbeat(exec, kExecutorPid);
  ASSERT_EQ(fences.size(), 2u);
  EXPECT_EQ(fences[0].second, router);
  EXPECT_EQ(fences[1].second, hung);
  EXPECT_TRUE(Heartbeat(exec, kExecutorPid, {fences[0].first, fences[1].first}).empty());
  EXPECT_EQ(service_->DrainingBlocks(), 0);
  EXPECT_EQ(service_->ledger().Stats().in_use_blocks, 0);
  EXPECT_THAT(service_->ledger().CheckInvariants(), IsOk());
}

TEST_F(CacheManagerFenceTest, WithoutExecutorsNothingCanWriteAndBlocksComeBackAtOnce) {
  const uint64_t router = Hello();
  ASSERT_EQ(ErrorOf(Step(router, {Allocate(1, 12)})), wire::ErrorCode::Ok);
  service_->OnProcessExited(kRouterPid);
  EXPECT_EQ(service_->open_fences(), 0);
  EXPECT_EQ(service_->ledger().Stats().free_blocks, kBlocks);
}

TEST_F(CacheManagerFenceTest, HungExecutorKeepsItsFenceUntilItDiesOrComesBack) {
  const uint64_t exec = Hello(wire::Role::Executor, kExecutorPid);
  const uint64_t router = Hello();
  ASSERT_EQ(ErrorOf(Step(router, {Allocate(1, 12)})), wire::ErrorCode::Ok);
  service_->OnProcessExited(kRouterPid);
  // The executor hangs past its lease: quarantined, but not ended (it holds no blocks, yet
  // it may still be writing the dead router's).
  now_ += absl::Seconds(10);
  service_->ExpireSessions(now_);
  EXPECT_EQ(service_->num_sessions(), 1);
  EXPECT_EQ(service_->DrainingBlocks(), 3);
  // It comes back: refused, registers again, and finds its fence in the new session.
  EXPECT_EQ(ErrorOf(Request(
                exec, wire::Message::Heartbeat,
                [](auto& b) { return wire::CreateHeartbeat(b).Union(); }, kExecutorPid)),
            wire::ErrorCode::StaleSession);
  const uint64_t renewed = Hello(wire::Role::Executor, kExecutorPid);
  EXPECT_EQ(service_->DrainingBlocks(), 3);
  const auto fences = Heartbeat(renewed, kExecutorPid);
  ASSERT_EQ(fences.size(), 1u);
  EXPECT_EQ(fences[0].second, router);
  // A second executor that registers after the fence is not waited for.
  Hello(wire::Role::Executor, kSecondExecutorPid);
  EXPECT_TRUE(Heartbeat(renewed, kExecutorPid, {fences[0].first}).empty());
  EXPECT_EQ(service_->DrainingBlocks(), 0);
  EXPECT_EQ(service_->ledger().Stats().free_blocks, kBlocks);

  // Another fence, and this time the hung executor is killed.
  const uint64_t router2 = Hello(wire::Role::Router, 3000);
  ASSERT_EQ(ErrorOf(Step(router2, {Allocate(1, 12)}, 3000)), wire::ErrorCode::Ok);
  service_->OnProcessExited(3000);
  EXPECT_EQ(service_->DrainingBlocks(), 3);
  service_->OnProcessExited(kSecondExecutorPid);
  EXPECT_EQ(service_->DrainingBlocks(), 3);
  service_->OnProcessExited(kExecutorPid);
  EXPECT_EQ(service_->DrainingBlocks(), 0);
  EXPECT_EQ(service_->ledger().Stats().free_blocks, kBlocks);
  EXPECT_THAT(service_->ledger().CheckInvariants(), IsOk());
}

// Found by the deterministic simulation (tests/sim/): an executor whose Hello was answered
// too late (the reply lost, or the cache manager stalled) sends another and goes on with
// the second session. The first, never used, is quarantined; executors are never ended by
// their lease, so it used to wait in every later fence for ever and the blocks of every
// router that ended afterwards stayed draining while the executor lived.
TEST_F(CacheManagerFenceTest, AnUnusedSessionOfARetriedExecutorHelloDoesNotHoldFencesForEver) {
  const uint64_t unused = Hello(wire::Role::Executor, kExecutorPid);
  const uint64_t exec = Hello(wire::Role::Executor, kExecutorPid);
  ASSERT_NE(unused, exec);
  const uint64_t router = Hello();
  ASSERT_EQ(ErrorOf(Step(router, {Allocate(1, 12)})), wire::ErrorCode::Ok);
  service_->OnProcessExited(kRouterPid);
  EXPECT_EQ(service_->DrainingBlocks(), 3);
  // The executor heartbeats on its session and acknowledges what it is told, as it does.
  for (int i = 0; i < 8; ++i) {
    now_ += absl::Seconds(1);
    std::vector<uint64_t> acks;
    for (const auto& [fence, router_session] : Heartbeat(exec, kExecutorPid)) {
      acks.push_back(fence);
    }
    if (!acks.empty()) Heartbeat(exec, kExecutorPid, acks);
    service_->ExpireSessions(now_);
  }
  // The unused session was given up for the live one of the same process, which took its
  // place in the fence and acknowledged it.
  EXPECT_EQ(service_->num_sessions(), 1);
  EXPECT_EQ(ErrorOf(Request(
                unused, wire::Message::Heartbeat,
                [](auto& b) { return wire::CreateHeartbeat(b).Union(); }, kExecutorPid)),
            wire::ErrorCode::StaleSession);
  EXPECT_EQ(service_->open_fences(), 0);
  EXPECT_EQ(service_->DrainingBlocks(), 0);
  EXPECT_EQ(service_->ledger().Stats().free_blocks, kBlocks);
  EXPECT_THAT(service_->ledger().CheckInvariants(), IsOk());
}

TEST_F(CacheManagerFenceTest, AFreeWithDrainWaitsForTheExecutorsWhileTheRouterLivesOn) {
  const uint64_t router = Hello();
  const uint64_t executor = Hello(wire::Role::Executor, 2000);
  ASSERT_EQ(ErrorOf(Step(router, {Allocate(1, 8)})), wire::ErrorCode::Ok);
  // The router moved sequence 1 off a hung executor and frees it: its 2 blocks drain.
  ASSERT_EQ(ErrorOf(Step(router, {Free(1, /*drain=*/true)})), wire::ErrorCode::Ok);
  EXPECT_EQ(service_->DrainingBlocks(), 2);
  EXPECT_EQ(service_->open_fences(), 1);
  const uint64_t other = Hello(wire::Role::Router, 3000);
  EXPECT_EQ(AllocatableBlocks(other, 3000), kBlocks - 2);
  // The executor learns a sequence fence (not a fence over the whole router).
  const wire::Envelope& beat = Request(
      executor, wire::Message::Heartbeat, [](auto& b) { return wire::CreateHeartbeat(b).Union(); },
      2000);
  ASSERT_EQ(beat.payload_type(), wire::Message::HeartbeatReply);
  const auto* reply = beat.payload_as_HeartbeatReply();
  EXPECT_TRUE(reply->fences() == nullptr || reply->fences()->size() == 0);
  ASSERT_NE(reply->sequence_fences(), nullptr);
  ASSERT_EQ(reply->sequence_fences()->size(), 1u);
  const wire::SequenceFence* fence = reply->sequence_fences()->Get(0);
  EXPECT_EQ(fence->router_session(), router);
  ASSERT_EQ(fence->seqs()->size(), 1u);
  EXPECT_EQ(fence->seqs()->Get(0), 1u);
  const uint64_t fence_id = fence->id();
  // The router goes on; only the drained id cannot come back.
  EXPECT_EQ(ErrorOf(Step(router, {Allocate(1, 4)})), wire::ErrorCode::InvalidArgument);
  EXPECT_EQ(ErrorOf(Step(router, {Allocate(2, 4), Free(2, true), Allocate(2, 4)})),
            wire::ErrorCode::InvalidArgument);
  EXPECT_EQ(ErrorOf(Step(router, {Allocate(3, 4)})), wire::ErrorCode::Ok);
  // Acknowledged: the blocks come back.
  Heartbeat(executor, 2000, {fence_id});
  EXPECT_EQ(service_->DrainingBlocks(), 0);
  EXPECT_EQ(service_->open_fences(), 0);
  // With no executor at all nothing can write: a drained free is immediate.
  service_->OnProcessExited(2000);
  ASSERT_EQ(ErrorOf(Step(router, {Free(3, true)})), wire::ErrorCode::Ok);
  EXPECT_EQ(service_->DrainingBlocks(), 0);
  EXPECT_EQ(service_->ledger().Stats().in_use_blocks, 0);
  EXPECT_THAT(service_->ledger().CheckInvariants(), IsOk());
}

TEST_F(CacheManagerFenceTest, RoutersCannotUseTheDrainingIdSpace) {
  const uint64_t router = Hello();
  const std::string before = LedgerState();
  EXPECT_EQ(ErrorOf(Step(router, {Allocate(kFirstDrainingSeq, 4)})),
            wire::ErrorCode::InvalidArgument);
  ASSERT_EQ(ErrorOf(Step(router, {Allocate(1, 4)})), wire::ErrorCode::Ok);
  EXPECT_EQ(ErrorOf(Step(router, {Fork(1, kFirstDrainingSeq + 7)})),
            wire::ErrorCode::InvalidArgument);
  EXPECT_EQ(ErrorOf(Step(router, {Free(1)})), wire::ErrorCode::Ok);
  EXPECT_EQ(LedgerState().substr(LedgerState().find(':')), before.substr(before.find(':')));
}

// A tcp:// router can never be proven dead: when its lease runs out it ends, its blocks
// drain behind a fence for the executors, and are counted as lease_expired once freed.
TEST_F(CacheManagerFenceTest, AnExpiredTcpRoutersBlocksDrainAndAreCountedAsLeaseExpired) {
  options_.tcp_secret = "s3cret";
  Restart();
  const uint64_t exec = Hello(wire::Role::Executor, kExecutorPid);
  over_tcp_ = true;
  const uint64_t remote = TcpHello(wire::Role::Router, kRouterPid);
  ASSERT_NE(remote, 0u);
  ASSERT_EQ(ErrorOf(Step(remote, {Allocate(1, 3 * kBlockSize)})), wire::ErrorCode::Ok);
  over_tcp_ = false;
  // The executor heartbeats; the router falls silent past its 3 s lease.
  now_ += absl::Seconds(2);
  EXPECT_TRUE(Heartbeat(exec, kExecutorPid).empty());
  now_ += absl::Seconds(2);
  service_->ExpireSessions(now_);
  EXPECT_EQ(service_->DrainingBlocks(), 3);
  EXPECT_EQ(Reclaimed("lease_expired"), 0);
  const auto fences = Heartbeat(exec, kExecutorPid);
  ASSERT_EQ(fences.size(), 1u);
  EXPECT_EQ(fences[0].second, remote);
  EXPECT_TRUE(Heartbeat(exec, kExecutorPid, {fences[0].first}).empty());
  EXPECT_EQ(service_->DrainingBlocks(), 0);
  EXPECT_EQ(service_->ledger().Stats().free_blocks, kBlocks);
  EXPECT_EQ(Reclaimed("lease_expired"), 3);
  EXPECT_EQ(Reclaimed("client_died"), 0);
  EXPECT_THAT(service_->ledger().CheckInvariants(), IsOk());
}

// A tcp:// executor cannot be proven dead either, but may still be writing: however long it
// stays silent, its lease never ends it and the blocks it may write stay draining, until an
// operator ends it (kvcmctl end-session) once it can no longer write.
TEST_F(CacheManagerFenceTest, AHungTcpExecutorKeepsItsFencesUntilAnOperatorEndsIt) {
  options_.tcp_secret = "s3cret";
  Restart();
  const uint64_t router = Hello();
  over_tcp_ = true;
  const uint64_t exec = TcpHello(wire::Role::Executor, kExecutorPid);
  ASSERT_NE(exec, 0u);
  over_tcp_ = false;
  ASSERT_EQ(ErrorOf(Step(router, {Allocate(1, 3 * kBlockSize)})), wire::ErrorCode::Ok);
  service_->OnProcessExited(kRouterPid);
  ASSERT_EQ(service_->DrainingBlocks(), 3);
  const uint64_t operator_session = Hello(wire::Role::Control, 3000);
  const uint64_t router2 = Hello(wire::Role::Router, 3001);
  for (int round = 0; round < 5; ++round) {
    now_ += absl::Seconds(10);
    (void)Request(
        operator_session, wire::Message::Heartbeat,
        [](auto& b) { return wire::CreateHeartbeat(b).Union(); }, 3000);
    (void)Request(
        router2, wire::Message::Heartbeat, [](auto& b) { return wire::CreateHeartbeat(b).Union(); },
        3001);
    service_->ExpireSessions(now_);
    EXPECT_EQ(service_->DrainingBlocks(), 3);
    EXPECT_EQ(service_->open_fences(), 1);
    EXPECT_EQ(AllocatableBlocks(router2, 3001), kBlocks - 3);
  }
  const wire::Envelope& ended = Request(
      operator_session, wire::Message::EndSession,
      [&](flatbuffers::FlatBufferBuilder& b) { return wire::CreateEndSession(b, exec).Union(); },
      3000);
  ASSERT_EQ(ended.payload_type(), wire::Message::EndSessionReply);
  EXPECT_EQ(ended.payload_as_EndSessionReply()->blocks_released(), 3);
  EXPECT_EQ(service_->DrainingBlocks(), 0);
  EXPECT_EQ(service_->open_fences(), 0);
  EXPECT_EQ(AllocatableBlocks(router2, 3001), kBlocks);
  EXPECT_EQ(Reclaimed("client_died"), 3);  // the fence's reason: its router died
  over_tcp_ = true;
  EXPECT_EQ(ErrorOf(Request(exec, wire::Message::Heartbeat,
                            [](auto& b) { return wire::CreateHeartbeat(b).Union(); })),
            wire::ErrorCode::StaleSession);
  over_tcp_ = false;
  EXPECT_THAT(service_->ledger().CheckInvariants(), IsOk());
}

TEST_F(CacheManagerServiceTest, PrefixRequests) {
  const uint64_t s = Hello();
  ASSERT_EQ(ErrorOf(Step(s, {Allocate(1, 12, {HashOf(1), HashOf(2), HashOf(3)})})),
            wire::ErrorCode::Ok);
  ASSERT_EQ(ErrorOf(Step(s, {Commit(1, 12), Free(1)})), wire::ErrorCode::Ok);
  auto lookup_of = [&](const std::vector<BlockHash>& chain, int32_t num_tokens) {
    const wire::Envelope& lookup = Request(s, wire::Message::Lookup, [&](auto& b) {
      return wire::CreateLookup(b, ToWire(b, chain), num_tokens).Union();
    });
    EXPECT_EQ(lookup.payload_type(), wire::Message::LookupReply);
    return lookup.payload_type() == wire::Message::LookupReply
               ? lookup.payload_as_LookupReply()->num_cached_blocks()
               : -1;
  };
  std::vector<BlockHash> hashes = {HashOf(1), HashOf(2), HashOf(7)};
  EXPECT_EQ(lookup_of(hashes, 0), 2);
  // What Allocate would reuse: never the block of the prompt's last token. A prompt of
  // exactly the three cached blocks reuses two; one token longer reuses all three.
  const std::vector<BlockHash> cached = {HashOf(1), HashOf(2), HashOf(3)};
  EXPECT_EQ(lookup_of(cached, 0), 2);
  EXPECT_EQ(lookup_of(cached, 12), 2);
  EXPECT_EQ(lookup_of(cached, 13), 3);
  for (int32_t tokens : {12, 13}) {
    const int32_t expected = lookup_of(cached, tokens) * kBlockSize;
    const wire::Envelope& allocated = Step(s, {Allocate(9, tokens, cached), Free(9)});
    ASSERT_EQ(ErrorOf(allocated), wire::ErrorCode::Ok);
    EXPECT_EQ(allocated.payload_as_StepReply()->results()->Get(0)->num_cached_tokens(), expected);
  }

  hashes.pop_back();
  const wire::Envelope& pin = Request(s, wire::Message::Pin, [&](auto& b) {
    return wire::CreatePin(b, b.CreateString("system"), ToWire(b, hashes)).Union();
  });
  ASSERT_EQ(pin.payload_type(), wire::Message::PinReply);
  EXPECT_EQ(service_->ledger().Stats().pinned_blocks, 2);
  // Pinning hashes that are not cached: NOT_FOUND from the ledger, nothing changes.
  const std::string before = LedgerState();
  std::vector<BlockHash> missing = {HashOf(40)};
  EXPECT_EQ(ErrorOf(Request(
                s, wire::Message::Pin,
                [&](auto& b) {
                  return wire::CreatePin(b, b.CreateString("other"), ToWire(b, missing)).Union();
                })),
            wire::ErrorCode::NotFound);
  EXPECT_EQ(LedgerState(), before);
  // A pin without a name is refused.
  ExpectRefusedUnchanged(
      [&] {
        request_.Clear();
        FinishEnvelope(request_, 1, s, 777, wire::Message::Unpin,
                       wire::CreateUnpin(request_).Union());
        return std::vector<uint8_t>(request_.GetBufferPointer(),
                                    request_.GetBufferPointer() + request_.GetSize());
      }(),
      wire::ErrorCode::InvalidArgument);
  const wire::Envelope& unpin = Request(s, wire::Message::Unpin, [&](auto& b) {
    return wire::CreateUnpin(b, b.CreateString("system")).Union();
  });
  EXPECT_EQ(unpin.payload_type(), wire::Message::UnpinReply);
  EXPECT_EQ(service_->ledger().Stats().pinned_blocks, 0);
}

TEST_F(CacheManagerServiceTest, AttachAndStatsDescribeThePool) {
  const uint64_t s = Hello(wire::Role::Executor, 2000);
  const wire::Envelope& attach = Request(
      s, wire::Message::Attach, [](auto& b) { return wire::CreateAttach(b).Union(); }, 2000);
  ASSERT_EQ(attach.payload_type(), wire::Message::AttachReply);
  const wire::PoolDescriptor* d = attach.payload_as_AttachReply()->descriptor();
  EXPECT_EQ(d->num_blocks(), kBlocks);
  EXPECT_EQ(d->epoch(), 777u);
  EXPECT_EQ(d->fd_channel_path()->str(), "/run/kvcm/pool-fd.sock");
  auto spec = FromWire(d->spec());
  ASSERT_THAT(spec, IsOk());
  EXPECT_EQ(spec->block_size, kBlockSize);

  const wire::Envelope& stats = Request(
      s, wire::Message::Stats, [](auto& b) { return wire::CreateStats(b).Union(); }, 2000);
  ASSERT_EQ(stats.payload_type(), wire::Message::StatsReply);
  const wire::StatsReply* r = stats.payload_as_StatsReply();
  EXPECT_EQ(r->num_blocks(), kBlocks);
  EXPECT_EQ(r->free_blocks() + r->in_use_blocks() + r->cached_blocks() + r->pinned_blocks(),
            kBlocks);
  EXPECT_EQ(r->sessions(), 1u);
  EXPECT_EQ(r->block_bytes(), 2u * 2 * 2 * 8 * 2 * kBlockSize);
}

// Applies event batches to a map, as a subscriber would.
void ApplyBatch(const wire::EventBatch& batch, absl::flat_hash_map<BlockId, BlockHash>* map) {
  for (const auto* event : *batch.events()) {
    const BlockHash hash = event->hash() != nullptr ? FromWire(*event->hash()) : BlockHash{};
    switch (event->kind()) {
      case wire::EventKind::BlockStored:
        (*map)[event->block()] = hash;
        break;
      case wire::EventKind::BlockRemoved:
        map->erase(event->block());
        break;
      case wire::EventKind::AllBlocksCleared:
        map->clear();
        break;
    }
  }
}

TEST_F(CacheManagerServiceTest, EventBatchesAreNumberedAndAddUpToTheSnapshot) {
  flatbuffers::FlatBufferBuilder batch;
  absl::flat_hash_map<BlockId, BlockHash> seen;
  uint64_t expected_seq = 1;
  auto drain = [&] {
    while (const uint64_t seq = service_->TakeEventBatch(&batch)) {
      EXPECT_EQ(seq, expected_seq++);
      flatbuffers::Verifier verifier(batch.GetBufferPointer(), batch.GetSize());
      ASSERT_TRUE(verifier.VerifyBuffer<wire::EventBatch>(nullptr));
      const auto* decoded = flatbuffers::GetRoot<wire::EventBatch>(batch.GetBufferPointer());
      EXPECT_EQ(decoded->seq(), seq);
      EXPECT_EQ(decoded->epoch(), 777u);
      ApplyBatch(*decoded, &seen);
    }
  };
  drain();  // the epoch's AllBlocksCleared
  EXPECT_EQ(expected_seq, 2u);
  const uint64_t s = Hello();
  const uint32_t seed = 7;
  std::printf("seed %u\n", seed);
  std::mt19937 rng(seed);
  for (int round = 0; round < 50; ++round) {
    const uint64_t seq = static_cast<uint64_t>(round) + 1;
    const int blocks = 1 + static_cast<int>(rng() % 6);
    std::vector<BlockHash> hashes;
    for (int i = 0; i < blocks; ++i) hashes.push_back(HashOf(static_cast<int>(rng() % 40)));
    // Chains need distinct hashes within a sequence to be realistic; duplicates are fine
    // for the ledger (the first stays indexed).
    Step(s, {Allocate(seq, blocks * kBlockSize, hashes)});
    drain();
    Step(s, {Commit(seq, blocks * kBlockSize), Free(seq)});
    drain();
  }
  // The snapshot equals what the batches added up to.
  const wire::Envelope& snapshot = Request(s, wire::Message::EventSnapshot, [](auto& b) {
    return wire::CreateEventSnapshot(b).Union();
  });
  ASSERT_EQ(snapshot.payload_type(), wire::Message::EventSnapshotReply);
  const auto* reply = snapshot.payload_as_EventSnapshotReply();
  EXPECT_EQ(reply->seq(), expected_seq - 1);
  // It starts with AllBlocksCleared (a late subscriber never saw the epoch's first batch),
  // then BlockStored events without parents.
  ASSERT_GT(reply->events()->size(), 0u);
  EXPECT_EQ(reply->events()->Get(0)->kind(), wire::EventKind::AllBlocksCleared);
  absl::flat_hash_map<BlockId, BlockHash> from_snapshot;
  for (flatbuffers::uoffset_t i = 1; i < reply->events()->size(); ++i) {
    const auto* event = reply->events()->Get(i);
    EXPECT_EQ(event->kind(), wire::EventKind::BlockStored);
    EXPECT_EQ(event->parent_hash(), nullptr);
    from_snapshot[event->block()] = FromWire(*event->hash());
  }
  EXPECT_EQ(from_snapshot.size(), seen.size());
  EXPECT_TRUE(from_snapshot == seen);
  EXPECT_GT(seen.size(), 0u);
}

// --- BlockMap ------------------------------------------------------------------------------

// The pool in all six states: the map, asked by a control session, shows each block in its
// state and counts them as the metrics' snapshot does, summing to the pool.
TEST_F(CacheManagerFenceTest, BlockMapShowsEveryStateAsTheSnapshotCountsIt) {
  const uint64_t hung = Hello();                          // quarantined
  const uint64_t dead = Hello(wire::Role::Router, 3000);  // draining
  const uint64_t live = Hello(wire::Role::Router, 3001);  // in use, cached
  Hello(wire::Role::Executor, kExecutorPid);              // fences wait for it
  const uint64_t control = Hello(wire::Role::Control, 4000);
  ASSERT_EQ(ErrorOf(Step(hung, {Allocate(1, 3 * kBlockSize)})), wire::ErrorCode::Ok);        // 0-2
  ASSERT_EQ(ErrorOf(Step(dead, {Allocate(2, 2 * kBlockSize)}, 3000)), wire::ErrorCode::Ok);  // 3-4
  const std::vector<BlockHash> hashes = {HashOf(1), HashOf(2), HashOf(3)};
  ASSERT_EQ(ErrorOf(Step(live, {Allocate(3, 3 * kBlockSize, hashes)}, 3001)),
            wire::ErrorCode::Ok);  // 5-7
  ASSERT_EQ(ErrorOf(Step(live, {Commit(3, 3 * kBlockSize)}, 3001)), wire::ErrorCode::Ok);
  ASSERT_EQ(ErrorOf(Step(live, {Free(3), Allocate(4, 4 * kBlockSize)}, 3001)),
            wire::ErrorCode::Ok);  // 5-7 cached; 8-11 in use
  const wire::Envelope& pinned = Request(
      live, wire::Message::Pin,
      [&](auto& b) {
        return wire::CreatePin(b, b.CreateString("system"), ToWire(b, std::span(hashes).first(1)))
            .Union();
      },
      3001);
  ASSERT_EQ(ErrorOf(pinned), wire::ErrorCode::Ok);  // 5 pinned
  service_->OnProcessExited(3000);                  // 3-4 drain behind the executor's fence
  // Everyone but the first router keeps talking; it is quarantined.
  now_ += absl::Seconds(4);
  for (auto [session, pid] : {std::pair{live, pid_t{3001}}, {control, pid_t{4000}}}) {
    Request(
        session, wire::Message::Heartbeat, [](auto& b) { return wire::CreateHeartbeat(b).Union(); },
        pid);
  }
  service_->ExpireSessions(now_);
  ASSERT_EQ(service_->QuarantinedBlocks(), 3);
  ASSERT_EQ(service_->DrainingBlocks(), 2);

  auto block_map = [&](uint32_t max_cells) {
    const wire::Envelope& reply = Request(
        control, wire::Message::BlockMap,
        [&](auto& b) { return wire::CreateBlockMap(b, max_cells).Union(); }, 4000);
    EXPECT_EQ(reply.payload_type(), wire::Message::BlockMapReply) << reply_reason();
    absl::StatusOr<BlockMap> map = DecodeBlockMapReply(*reply.payload_as_BlockMapReply());
    EXPECT_THAT(map, IsOk());
    return map.ok() ? *map : BlockMap{};
  };
  const BlockMap map = block_map(0);
  ASSERT_EQ(map.blocks_per_cell, 1);
  ASSERT_EQ(map.cells.size(), static_cast<size_t>(kBlocks));
  using S = MapState;
  const std::vector<MapState> first(map.cells.begin(), map.cells.begin() + 13);
  EXPECT_EQ(first,
            (std::vector<MapState>{S::kQuarantined, S::kQuarantined, S::kQuarantined, S::kDraining,
                                   S::kDraining, S::kPinned, S::kCached, S::kCached, S::kInUse,
                                   S::kInUse, S::kInUse, S::kInUse, S::kFree}));
  const CacheManagerSnapshot snapshot = service_->Snapshot();
  EXPECT_EQ(map.count(S::kFree), snapshot.ledger.free_blocks);
  EXPECT_EQ(map.count(S::kInUse),
            snapshot.ledger.in_use_blocks - snapshot.quarantined_blocks - snapshot.draining_blocks);
  EXPECT_EQ(map.count(S::kCached), snapshot.ledger.cached_blocks);
  EXPECT_EQ(map.count(S::kPinned), snapshot.ledger.pinned_blocks);
  EXPECT_EQ(map.count(S::kQuarantined), snapshot.quarantined_blocks);
  EXPECT_EQ(map.count(S::kDraining), snapshot.draining_blocks);
  EXPECT_EQ(map.count(S::kFree) + map.count(S::kInUse) + map.count(S::kCached) +
                map.count(S::kPinned) + map.count(S::kQuarantined) + map.count(S::kDraining),
            kBlocks);

  // Fewer cells than blocks: runs of 4, each its dominant state, the same counts.
  const BlockMap runs = block_map(16);
  EXPECT_EQ(runs.blocks_per_cell, 4);
  ASSERT_EQ(runs.cells.size(), 16u);
  EXPECT_EQ(runs.cells[0], S::kQuarantined);  // 0-2 quarantined, 3 draining
  EXPECT_EQ(runs.cells[1], S::kCached);       // 4 draining, 5 pinned, 6-7 cached
  EXPECT_EQ(runs.cells[2], S::kInUse);
  EXPECT_EQ(runs.cells[3], S::kFree);
  EXPECT_EQ(runs.counts, map.counts);
  EXPECT_EQ(CounterValue("kvcm_cache_manager_requests_total", "type", "block_map"), 2);
  // Asking for more cells than the bound gets the bound, here one cell per block.
  EXPECT_EQ(block_map(UINT32_MAX).cells.size(), static_cast<size_t>(kBlocks));
}

// KV cache groups (docs/architecture.md, "The hybrid KV cache"): a model of one full and
// one window-8 layer, on pages of one layer slot.
class CacheManagerGroupsServiceTest : public CacheManagerServiceTest {
 protected:
  void SetUp() override {
    CacheManagerServiceTest::SetUp();
    absl::StatusOr<KvCacheGroups> groups = GroupLayers(std::vector<int32_t>{0, 8});
    ASSERT_THAT(groups, IsOk());
    options_.kv_groups = *groups;
    options_.spec.num_layers = groups->group_size;
    Restart();
  }
  void ExpectWhole() const {
    EXPECT_THAT(service_->grouped_ledger().CheckInvariants(), IsOk());
    EXPECT_THAT(service_->ledger().CheckInvariants(), IsOk());
  }
};

TEST_F(CacheManagerGroupsServiceTest, OptionsThatDoNotKnowGroupsAreRefused) {
  CacheManagerService::Options options = options_;
  options.spec.num_layers = 2;  // the model's, not a page's
  EXPECT_EQ(CacheManagerService::CheckOptions(options).code(), absl::StatusCode::kInvalidArgument);
  options = options_;
  options.ledger.sliding_window_tokens = 8;
  EXPECT_EQ(CacheManagerService::CheckOptions(options).code(), absl::StatusCode::kInvalidArgument);
  // The vLLM-format KV events serve groups (docs/protocol.md, "vLLM-format KV events").
  options = options_;
  options.vllm_events = true;
  EXPECT_THAT(CacheManagerService::CheckOptions(options), IsOk());
  EXPECT_THAT(CacheManagerService::CheckOptions(options_), IsOk());
}

TEST_F(CacheManagerGroupsServiceTest, StepsCarryEveryGroupsBlocks) {
  const wire::Envelope& hello = Request(
      0, wire::Message::Hello,
      [](flatbuffers::FlatBufferBuilder& b) {
        return wire::CreateHello(b, wire::Role::Router, kRouterPid, b.CreateString("test")).Union();
      },
      kRouterPid, 0);
  ASSERT_EQ(hello.payload_type(), wire::Message::HelloReply);
  const auto* windows = hello.payload_as_HelloReply()->group_windows();
  ASSERT_NE(windows, nullptr);
  EXPECT_EQ(std::vector<int32_t>(windows->begin(), windows->end()), (std::vector<int32_t>{0, 8}));
  const uint64_t s = hello.payload_as_HelloReply()->session_id();
  std::vector<BlockHash> hashes;
  for (int i = 0; i < 10; ++i) hashes.push_back(HashOf(i));
  const wire::Envelope& allocated = Step(s, {Allocate(1, 40, hashes)});  // 10 blocks a group
  ASSERT_EQ(allocated.payload_type(), wire::Message::StepReply);
  const wire::OpResult* result = allocated.payload_as_StepReply()->results()->Get(0);
  ASSERT_EQ(result->code(), wire::ErrorCode::Ok);
  EXPECT_EQ(result->blocks()->size(), 10u);
  ASSERT_NE(result->group_blocks(), nullptr);
  EXPECT_EQ(result->group_blocks()->size(), 10u);
  EXPECT_EQ(service_->ledger().Stats().in_use_blocks, 20);
  ExpectWhole();
  // Past the window the window group keeps its last two blocks only.
  ASSERT_EQ(ErrorOf(Step(s, {Commit(1, 40)})), wire::ErrorCode::Ok);
  EXPECT_EQ(service_->ledger().Stats().in_use_blocks, 12);
  ExpectWhole();
  // A fork's append copies the shared last block in every group.
  const wire::Envelope& appended = Step(s, {Append(1, 2)});
  ASSERT_EQ(appended.payload_as_StepReply()->results()->Get(0)->code(), wire::ErrorCode::Ok);
  const wire::Envelope& forked = Step(s, {Commit(1, 42), Fork(1, 2)});
  ASSERT_EQ(forked.payload_as_StepReply()->results()->Get(1)->code(), wire::ErrorCode::Ok);
  const wire::Envelope& copied = Step(s, {Append(2, 1)});
  const wire::OpResult* copy = copied.payload_as_StepReply()->results()->Get(0);
  ASSERT_EQ(copy->code(), wire::ErrorCode::Ok);
  ASSERT_NE(copy->copies(), nullptr);
  EXPECT_EQ(copy->copies()->size(), 2u);
  ExpectWhole();
  // Both sequences' blocks in every group are counted when the session goes quiet.
  for (int i = 0; i < 4; ++i) {
    now_ += absl::Seconds(1);
    service_->ExpireSessions(now_);
  }
  EXPECT_EQ(service_->QuarantinedBlocks(), service_->ledger().Stats().in_use_blocks);
  ExpectWhole();
}

}  // namespace
}  // namespace kvcm::cache_manager
