// A property test of fencing (docs/architecture.md, "Fencing") with a model of in-flight
// writers: routers allocate and hand their block tables to executors, whose steps finish
// some time later; routers die (their pidfds fire) while those steps still run; executors
// acknowledge a fence only once no step of the fenced router runs on them, as the real
// executor does, or die; routers also give up on a step that runs on a hung executor and
// free its sequence with drain. The property: a block handed to a router is never one that
// a step of another router, or a step its router gave up on, may still be writing, and the
// ledger stays consistent.
//
// Seeds are fixed and printed; KVCM_FENCE_SEED=N replays one.

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/wire/convert.h"
#include "common/wire/envelope.h"
#include "common/wire/step_codec.h"
#include "gtest/gtest.h"
#include "services/cache_manager/cache_manager_service.h"
#include "tests/support/status_matchers.h"

namespace kvcm::cache_manager {
namespace {

class FakeWatcher : public ProcessWatcher {
 public:
  absl::Status Watch(uint64_t, pid_t) override { return absl::OkStatus(); }
  void Unwatch(uint64_t) override {}
};

constexpr int32_t kBlocks = 24;
constexpr int32_t kBlockSize = 4;
constexpr int kRouters = 3;
constexpr int kExecutors = 2;
constexpr int kActions = 3000;

// A step an executor runs for a router session: it may write these blocks until it ends.
struct InFlight {
  int executor = 0;
  uint64_t router_session = 0;
  uint64_t seq = 0;
  bool retired = false;  // its router freed the sequence with drain while it ran
  std::vector<int32_t> blocks;
  int ends_at = 0;  // the action after which it has finished
};

class FenceModel {
 public:
  explicit FenceModel(uint32_t seed) : rng_(seed) {
    CacheManagerService::Options options;
    options.spec = KvCacheSpec{2, 2, 8, DType::kFloat16, kBlockSize};
    options.ledger.num_blocks = kBlocks;
    options.epoch = 5;
    options.pool.layout.total_bytes = 1;
    auto service = CacheManagerService::Create(options, &watcher_, nullptr, now_);
    EXPECT_THAT(service, IsOk());
    service_ = *std::move(service);
    for (int r = 0; r < kRouters; ++r) routers_.push_back({next_pid_++, 0, {}});
    for (int e = 0; e < kExecutors; ++e) executors_.push_back({next_pid_++, 0});
    for (auto& router : routers_) router.session = Hello(wire::Role::Router, router.pid);
    for (auto& executor : executors_) executor.session = Hello(wire::Role::Executor, executor.pid);
  }

  void Run() {
    for (action_ = 0; action_ < kActions && !::testing::Test::HasFatalFailure(); ++action_) {
      std::erase_if(in_flight_, [&](const InFlight& w) { return w.ends_at <= action_; });
      const int what = static_cast<int>(rng_() % 100);
      if (what < 45) {
        RouterAllocates(Pick(kRouters));
      } else if (what < 55) {
        RouterFrees(Pick(kRouters));
      } else if (what < 60) {
        RouterMovesASequenceOff(Pick(kRouters));
      } else if (what < 68) {
        RouterDies(Pick(kRouters));
      } else if (what < 98) {
        ExecutorHeartbeats(Pick(kExecutors));
      } else {
        ExecutorDies(Pick(kExecutors));
      }
      ASSERT_THAT(service_->ledger().CheckInvariants(), IsOk()) << Where();
    }
    std::printf(
        "  %d blocks handed out, %d router deaths, %d drained frees, %d executor "
        "deaths, %d fences acknowledged; %d checks of a block against in-flight "
        "writers\n",
        handed_, router_deaths_, drained_, executor_deaths_, acks_, checks_);
    EXPECT_GT(router_deaths_, 0);
    EXPECT_GT(drained_, 0);
    EXPECT_GT(acks_, 0);
  }

 private:
  struct Router {
    pid_t pid = 0;
    uint64_t session = 0;
    std::vector<uint64_t> seqs;  // live, with no step in flight once Free is chosen
  };
  struct Executor {
    pid_t pid = 0;
    uint64_t session = 0;
  };

  int Pick(int n) { return static_cast<int>(rng_() % static_cast<uint32_t>(n)); }
  std::string Where() const { return absl::StrCat("action ", action_); }

  const wire::Envelope& Send(pid_t pid, uint64_t session, wire::Message type,
                             flatbuffers::Offset<void> payload) {
    FinishEnvelope(request_, ++request_id_, session, 5, type, payload);
    service_->Handle(PeerCredentials{::geteuid(), 1, pid}, BufferSpan(request_), now_, &reply_);
    verified_ = VerifyEnvelope(BufferSpan(reply_));
    EXPECT_NE(verified_.envelope, nullptr) << verified_.reason;
    return *verified_.envelope;
  }

  // A Step of one op from `router`.
  const wire::Envelope& SendStep(const Router& router, const BlockOp& op) {
    request_.Clear();
    const BlockOp ops[] = {op};
    EXPECT_THAT(EncodeStep(request_, ++request_id_, router.session, 5, ops), IsOk());
    service_->Handle(PeerCredentials{::geteuid(), 1, router.pid}, BufferSpan(request_), now_,
                     &reply_);
    verified_ = VerifyEnvelope(BufferSpan(reply_));
    EXPECT_NE(verified_.envelope, nullptr) << verified_.reason;
    return *verified_.envelope;
  }

  uint64_t Hello(wire::Role role, pid_t pid) {
    request_.Clear();
    const auto payload = wire::CreateHello(request_, role, pid, request_.CreateString("m"));
    const wire::Envelope& reply = Send(pid, 0, wire::Message::Hello, payload.Union());
    EXPECT_EQ(reply.payload_type(), wire::Message::HelloReply) << Where();
    return reply.payload_type() == wire::Message::HelloReply
               ? reply.payload_as_HelloReply()->session_id()
               : 0;
  }

  // A block handed to `router_session`: no step of another router may still write it.
  void CheckHandedOut(uint64_t router_session, int32_t block) {
    ++handed_;
    for (const InFlight& write : in_flight_) {
      ++checks_;
      if (write.router_session == router_session && !write.retired) continue;
      for (int32_t b : write.blocks) {
        ASSERT_NE(b, block) << Where() << ": block " << block << " handed to router session "
                            << router_session << " while executor " << write.executor
                            << " may still write it for router session " << write.router_session;
      }
    }
  }

  void RouterAllocates(int r) {
    Router& router = routers_[r];
    const uint64_t seq = next_seq_++;
    const int32_t tokens = 1 + Pick(3 * kBlockSize);
    const wire::Envelope& reply = SendStep(router, BlockOp::Allocate(seq, tokens));
    ASSERT_EQ(reply.payload_type(), wire::Message::StepReply) << Where();
    const wire::OpResult* result = reply.payload_as_StepReply()->results()->Get(0);
    if (result->code() != wire::ErrorCode::Ok) {
      ASSERT_EQ(result->code(), wire::ErrorCode::ResourceExhausted) << Where();
      return;
    }
    InFlight write;
    write.executor = Pick(kExecutors);
    write.router_session = router.session;
    write.seq = seq;
    write.ends_at = action_ + 1 + Pick(40);  // a step taking a while
    for (int32_t block : *result->blocks()) {
      CheckHandedOut(router.session, block);
      write.blocks.push_back(block);
    }
    router.seqs.push_back(seq);
    in_flight_.push_back(std::move(write));
  }

  // A live router frees a sequence once none of its own steps writes it any more.
  void RouterFrees(int r) {
    Router& router = routers_[r];
    if (router.seqs.empty()) return;
    for (const InFlight& write : in_flight_) {
      if (write.router_session == router.session) return;  // it waits for its steps
    }
    const size_t i = static_cast<size_t>(Pick(static_cast<int>(router.seqs.size())));
    const uint64_t seq = router.seqs[i];
    router.seqs.erase(router.seqs.begin() + static_cast<std::ptrdiff_t>(i));
    const wire::Envelope& reply = SendStep(router, BlockOp::Free(seq));
    ASSERT_EQ(reply.payload_type(), wire::Message::StepReply) << Where();
  }

  // The router gives up on a step that runs on a hung executor and frees its sequence with
  // drain, going on with its other work: that step may still write the blocks.
  void RouterMovesASequenceOff(int r) {
    Router& router = routers_[r];
    for (InFlight& write : in_flight_) {
      if (write.router_session != router.session || write.retired) continue;
      auto it = std::find(router.seqs.begin(), router.seqs.end(), write.seq);
      if (it == router.seqs.end()) continue;
      router.seqs.erase(it);
      write.retired = true;
      const wire::Envelope& reply = SendStep(router, BlockOp::Free(write.seq, /*drain=*/true));
      ASSERT_EQ(reply.payload_type(), wire::Message::StepReply) << Where();
      ASSERT_EQ(reply.payload_as_StepReply()->results()->Get(0)->code(), wire::ErrorCode::Ok)
          << Where();
      ++drained_;
      return;
    }
  }

  // SIGKILL while its steps may still run on the executors; a new process registers.
  void RouterDies(int r) {
    Router& router = routers_[r];
    service_->OnProcessExited(router.pid);
    ++router_deaths_;
    router.pid = next_pid_++;
    router.seqs.clear();
    router.session = Hello(wire::Role::Router, router.pid);
  }

  // The executor acknowledges the fences of router sessions it runs no step for.
  void ExecutorHeartbeats(int e) {
    Executor& executor = executors_[e];
    std::vector<uint64_t> acks;
    for (const auto& [fence, router_session] : known_fences_[e]) {
      bool running = false;
      for (const InFlight& write : in_flight_) {
        running |= write.executor == e && write.router_session == router_session;
      }
      if (!running) acks.push_back(fence);
    }
    for (const auto& [fence, scope] : known_sequence_fences_[e]) {
      bool running = false;
      for (const InFlight& write : in_flight_) {
        running |=
            write.executor == e && write.router_session == scope.first &&
            std::find(scope.second.begin(), scope.second.end(), write.seq) != scope.second.end();
      }
      if (!running) acks.push_back(fence);
    }
    request_.Clear();
    const auto payload =
        wire::CreateHeartbeat(request_, acks.empty() ? 0 : request_.CreateVector(acks));
    const wire::Envelope& reply =
        Send(executor.pid, executor.session, wire::Message::Heartbeat, payload.Union());
    ASSERT_EQ(reply.payload_type(), wire::Message::HeartbeatReply) << Where();
    acks_ += static_cast<int>(acks.size());
    known_fences_[e].clear();
    known_sequence_fences_[e].clear();
    if (const auto* fences = reply.payload_as_HeartbeatReply()->fences()) {
      for (const wire::Fence* fence : *fences) {
        known_fences_[e][fence->id()] = fence->router_session();
      }
    }
    if (const auto* fences = reply.payload_as_HeartbeatReply()->sequence_fences()) {
      for (const wire::SequenceFence* fence : *fences) {
        known_sequence_fences_[e][fence->id()] = {
            fence->router_session(),
            std::vector<uint64_t>(fence->seqs()->begin(), fence->seqs()->end())};
      }
    }
  }

  // Killed: it writes nothing more; a new one registers (it has no fences).
  void ExecutorDies(int e) {
    Executor& executor = executors_[e];
    service_->OnProcessExited(executor.pid);
    ++executor_deaths_;
    std::erase_if(in_flight_, [&](const InFlight& w) { return w.executor == e; });
    known_fences_[e].clear();
    known_sequence_fences_[e].clear();
    executor.pid = next_pid_++;
    executor.session = Hello(wire::Role::Executor, executor.pid);
  }

  std::mt19937 rng_;
  FakeWatcher watcher_;
  absl::Time now_ = absl::FromUnixSeconds(1000);
  std::unique_ptr<CacheManagerService> service_;
  flatbuffers::FlatBufferBuilder request_;
  flatbuffers::FlatBufferBuilder reply_;
  VerifiedEnvelope verified_;
  uint64_t request_id_ = 0;
  pid_t next_pid_ = 100;
  uint64_t next_seq_ = 1;
  std::vector<Router> routers_;
  std::vector<Executor> executors_;
  std::vector<InFlight> in_flight_;
  absl::flat_hash_map<uint64_t, uint64_t> known_fences_[kExecutors];  // fence -> router
  // Sequence fences: fence -> (router session, its sequences).
  absl::flat_hash_map<uint64_t, std::pair<uint64_t, std::vector<uint64_t>>>
      known_sequence_fences_[kExecutors];
  int action_ = 0;
  int handed_ = 0, router_deaths_ = 0, executor_deaths_ = 0, acks_ = 0, checks_ = 0;
  int drained_ = 0;
};

class FencePropertyTest : public ::testing::TestWithParam<uint32_t> {};

TEST_P(FencePropertyTest, NoBlockIsHandedOutWhileAnotherRoutersStepMayWriteIt) {
  uint32_t seed = GetParam();
  if (const char* replay = std::getenv("KVCM_FENCE_SEED")) seed = std::strtoul(replay, nullptr, 10);
  std::printf("fence property seed=%u (replay: KVCM_FENCE_SEED=%u)\n", seed, seed);
  FenceModel model(seed);
  model.Run();
}

INSTANTIATE_TEST_SUITE_P(Seeds, FencePropertyTest, ::testing::Range(1u, 17u));

}  // namespace
}  // namespace kvcm::cache_manager
