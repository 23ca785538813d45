// CacheManagerClient against an in-process fake cache manager (a ROUTER socket on its own
// thread, answering with scripted envelopes): the reply handling that a healthy real cache
// manager never exercises. Stale replies are dropped, malformed or mistyped replies are
// INTERNAL, a refused session re-registers, the heartbeat thread notices a lost session,
// local limits are enforced. Also the pure helpers: CheckPoolDescriptor, DecodeKvEvents.

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/base/monotonic_clock.h"
#include "common/base/mutex.h"
#include "common/client/cache_manager_client.h"
#include "common/transport/zmq_util.h"
#include "common/wire/convert.h"
#include "common/wire/envelope.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/status_matchers.h"
#include "tests/support/subprocess.h"
#include "tests/support/wait_for.h"
#include "zmq.hpp"

namespace kvcm {
namespace {

using ::kvcm::testing::TempDir;
using ::kvcm::testing::WaitFor;
using ::testing::HasSubstr;

std::string Bytes(const flatbuffers::FlatBufferBuilder& builder) {
  return std::string(reinterpret_cast<const char*>(builder.GetBufferPointer()), builder.GetSize());
}

// Scripted cache manager. The handler runs on the fake's thread and returns the frames to
// send back (each one whole reply); it must not touch test state without the mutex.
class FakeCacheManager {
 public:
  using Handler = std::function<std::vector<std::string>(const wire::Envelope&)>;

  FakeCacheManager() {
    absl::StatusOr<TempDir> dir = TempDir::Create("kvcm-fk");
    EXPECT_THAT(dir, IsOk());
    dir_.emplace(std::move(*dir));
    endpoint_ = absl::StrCat("ipc://", dir_->path(), "/cache-manager.sock");
    router_ = zmq::socket_t(context_, zmq::socket_type::router);
    router_.set(zmq::sockopt::linger, 0);
    router_.bind(endpoint_);
    thread_ = std::thread([this] { Loop(); });
  }
  ~FakeCacheManager() {
    stop_.store(true);
    thread_.join();
  }

  const std::string& endpoint() const { return endpoint_; }
  void SetHandler(Handler handler) {
    MutexLock lock(&mu_);
    handler_ = std::move(handler);
  }
  int Count(wire::Message type) {
    MutexLock lock(&mu_);
    return counts_[static_cast<int>(type)];
  }

  // Replies built the way the real cache manager builds them.
  static std::string HelloReply(uint64_t request_id, uint64_t session, uint64_t epoch,
                                uint32_t heartbeat_ms = 0, int32_t max_ops = 4096) {
    flatbuffers::FlatBufferBuilder b;
    auto reply = wire::CreateHelloReply(b, session, epoch, heartbeat_ms, heartbeat_ms * 5, 7, 4,
                                        wire::HashAlgorithm::Sha256, max_ops, 1 << 20);
    FinishEnvelope(b, request_id, session, epoch, wire::Message::HelloReply, reply.Union());
    return Bytes(b);
  }
  static std::string StatsReply(uint64_t request_id, uint64_t epoch, int32_t num_blocks) {
    flatbuffers::FlatBufferBuilder b;
    wire::StatsReplyBuilder stats(b);
    stats.add_num_blocks(num_blocks);
    stats.add_epoch(epoch);
    auto reply = stats.Finish();
    FinishEnvelope(b, request_id, 1, epoch, wire::Message::StatsReply, reply.Union());
    return Bytes(b);
  }
  static std::string Error(uint64_t request_id, wire::ErrorCode code, const std::string& why) {
    flatbuffers::FlatBufferBuilder b;
    FinishErrorReply(b, request_id, 1, code, why);
    return Bytes(b);
  }
  static std::string Empty(uint64_t request_id, wire::Message type) {
    flatbuffers::FlatBufferBuilder b;
    flatbuffers::Offset<void> payload;
    switch (type) {
      case wire::Message::HeartbeatReply:
        payload = wire::CreateHeartbeatReply(b).Union();
        break;
      case wire::Message::LookupReply:
        payload = wire::CreateLookupReply(b, 0).Union();
        break;
      default:
        ADD_FAILURE() << "unsupported";
        break;
    }
    FinishEnvelope(b, request_id, 1, 1, type, payload);
    return Bytes(b);
  }

 private:
  void Loop() {
    while (!stop_.load()) {
      absl::StatusOr<std::vector<zmq::message_t>> frames =
          ReceiveMessageUntil(router_, MonotonicNow() + absl::Milliseconds(20));
      if (!frames.ok() || frames->size() != 2) continue;
      const VerifiedEnvelope verified = VerifyEnvelope(FrameBytes((*frames)[1]));
      if (verified.envelope == nullptr) continue;
      std::vector<std::string> replies;
      {
        MutexLock lock(&mu_);
        ++counts_[static_cast<int>(verified.envelope->payload_type())];
        if (handler_) replies = handler_(*verified.envelope);
      }
      for (const std::string& reply : replies) {
        const std::span<const uint8_t> parts[] = {
            FrameBytes((*frames)[0]),
            {reinterpret_cast<const uint8_t*>(reply.data()), reply.size()}};
        EXPECT_THAT(SendMessage(router_, parts), IsOk());
      }
    }
  }

  std::optional<TempDir> dir_;
  std::string endpoint_;
  zmq::context_t context_;
  zmq::socket_t router_;
  Mutex mu_;
  Handler handler_ ABSL_GUARDED_BY(mu_);
  int counts_[32] ABSL_GUARDED_BY(mu_) = {};
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

CacheManagerClient::Options OptionsFor(const FakeCacheManager& fake) {
  CacheManagerClient::Options options;
  options.endpoint = fake.endpoint();
  options.role = wire::Role::Control;
  options.name = "unit";
  // A bound, not a measure: the fake answers at once, but a loaded machine may not run its
  // thread for a while.
  options.call_timeout = absl::Seconds(60);
  return options;
}

// Hello -> session 1 of epoch `*epoch`; Stats -> `on_stats`.
FakeCacheManager::Handler Script(std::shared_ptr<std::atomic<uint64_t>> epoch,
                                 FakeCacheManager::Handler on_stats, uint32_t heartbeat_ms = 0,
                                 int32_t max_ops = 4096,
                                 FakeCacheManager::Handler on_heartbeat = nullptr) {
  return [=](const wire::Envelope& e) -> std::vector<std::string> {
    switch (e.payload_type()) {
      case wire::Message::Hello:
        return {
            FakeCacheManager::HelloReply(e.request_id(), 1, epoch->load(), heartbeat_ms, max_ops)};
      case wire::Message::Stats:
        return on_stats(e);
      case wire::Message::Heartbeat:
        if (on_heartbeat) return on_heartbeat(e);
        return {FakeCacheManager::Empty(e.request_id(), wire::Message::HeartbeatReply)};
      default:
        return {};
    }
  };
}

TEST(CacheManagerClientUnitTest, StaleRepliesAreDropped) {
  FakeCacheManager fake;
  auto epoch = std::make_shared<std::atomic<uint64_t>>(5);
  fake.SetHandler(Script(epoch, [](const wire::Envelope& e) -> std::vector<std::string> {
    return {FakeCacheManager::StatsReply(e.request_id() + 1000, 5, 999),
            FakeCacheManager::StatsReply(e.request_id(), 5, 7)};
  }));
  absl::StatusOr<std::unique_ptr<CacheManagerClient>> client =
      CacheManagerClient::Connect(OptionsFor(fake));
  ASSERT_THAT(client, IsOk());
  EXPECT_EQ((*client)->epoch(), 5u);
  absl::StatusOr<StatsSnapshot> stats = (*client)->Stats();
  ASSERT_THAT(stats, IsOk());
  EXPECT_EQ(stats->num_blocks, 7);
}

TEST(CacheManagerClientUnitTest, MistypedAndMalformedRepliesAreInternal) {
  FakeCacheManager fake;
  auto epoch = std::make_shared<std::atomic<uint64_t>>(5);
  auto calls = std::make_shared<std::atomic<int>>(0);
  fake.SetHandler(Script(epoch, [calls](const wire::Envelope& e) -> std::vector<std::string> {
    if (calls->fetch_add(1) == 0) {
      return {FakeCacheManager::Empty(e.request_id(), wire::Message::LookupReply)};
    }
    return {"not a flatbuffer at all"};
  }));
  absl::StatusOr<std::unique_ptr<CacheManagerClient>> client =
      CacheManagerClient::Connect(OptionsFor(fake));
  ASSERT_THAT(client, IsOk());
  absl::StatusOr<StatsSnapshot> stats = (*client)->Stats();
  EXPECT_EQ(stats.status().code(), absl::StatusCode::kInternal);
  EXPECT_THAT(stats.status().message(), HasSubstr("is a LookupReply; expected StatsReply"));
  stats = (*client)->Stats();
  EXPECT_EQ(stats.status().code(), absl::StatusCode::kInternal);
  EXPECT_THAT(stats.status().message(), HasSubstr("KVCP"));
}

TEST(CacheManagerClientUnitTest, ErrorRepliesMapToStatusCodes) {
  FakeCacheManager fake;
  auto epoch = std::make_shared<std::atomic<uint64_t>>(5);
  fake.SetHandler(Script(epoch, [](const wire::Envelope& e) -> std::vector<std::string> {
    return {FakeCacheManager::Error(e.request_id(), wire::ErrorCode::Unavailable, "bye")};
  }));
  absl::StatusOr<std::unique_ptr<CacheManagerClient>> client =
      CacheManagerClient::Connect(OptionsFor(fake));
  ASSERT_THAT(client, IsOk());
  absl::StatusOr<StatsSnapshot> stats = (*client)->Stats();
  EXPECT_EQ(stats.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(stats.status().message(), "bye");
}

TEST(CacheManagerClientUnitTest, StaleEpochAbortsAndRegistersOnlyWhenAsked) {
  FakeCacheManager fake;
  auto epoch = std::make_shared<std::atomic<uint64_t>>(5);
  fake.SetHandler(Script(epoch, [epoch](const wire::Envelope& e) -> std::vector<std::string> {
    if (e.epoch() != epoch->load()) {
      return {FakeCacheManager::Error(e.request_id(), wire::ErrorCode::StaleEpoch, "old")};
    }
    return {FakeCacheManager::StatsReply(e.request_id(), epoch->load(), 7)};
  }));
  absl::StatusOr<std::unique_ptr<CacheManagerClient>> client =
      CacheManagerClient::Connect(OptionsFor(fake));
  ASSERT_THAT(client, IsOk());
  epoch->store(6);  // "restart"
  absl::StatusOr<StatsSnapshot> stats = (*client)->Stats();
  EXPECT_EQ(stats.status().code(), absl::StatusCode::kAborted);
  EXPECT_THAT(stats.status().message(), HasSubstr("ended session 1 of epoch 5 (StaleEpoch"));
  EXPECT_THAT(stats.status().message(), HasSubstr("call Reregister()"));
  // Nothing registers behind the caller's back: calls keep failing, unsent, until it asks.
  EXPECT_TRUE((*client)->session_lost());
  EXPECT_EQ((*client)->Stats().status().code(), absl::StatusCode::kAborted);
  EXPECT_EQ((*client)->EnsureSession().code(), absl::StatusCode::kAborted);
  EXPECT_EQ(fake.Count(wire::Message::Hello), 1);
  EXPECT_EQ(fake.Count(wire::Message::Stats), 1);
  ASSERT_THAT((*client)->Reregister(), IsOk());
  EXPECT_EQ((*client)->epoch(), 6u);
  EXPECT_THAT((*client)->Stats(), IsOk());
  EXPECT_EQ(fake.Count(wire::Message::Hello), 2);
}

TEST(CacheManagerClientUnitTest, HeartbeatThreadNoticesALostSession) {
  FakeCacheManager fake;
  auto epoch = std::make_shared<std::atomic<uint64_t>>(5);
  auto refuse = std::make_shared<std::atomic<bool>>(false);
  fake.SetHandler(Script(
      epoch,
      [](const wire::Envelope& e) -> std::vector<std::string> {
        return {FakeCacheManager::StatsReply(e.request_id(), 5, 7)};
      },
      /*heartbeat_ms=*/20, 4096,
      [refuse](const wire::Envelope& e) -> std::vector<std::string> {
        if (refuse->load()) {
          return {FakeCacheManager::Error(e.request_id(), wire::ErrorCode::StaleSession, "x")};
        }
        return {FakeCacheManager::Empty(e.request_id(), wire::Message::HeartbeatReply)};
      }));
  absl::StatusOr<std::unique_ptr<CacheManagerClient>> client =
      CacheManagerClient::Connect(OptionsFor(fake));
  ASSERT_THAT(client, IsOk());
  const absl::Status answered = WaitFor([&] { return (*client)->heartbeats_answered() >= 2; },
                                        absl::Seconds(60), "two heartbeats answered");
  EXPECT_THAT(answered, IsOk());
  EXPECT_FALSE((*client)->session_lost());
  refuse->store(true);
  const absl::Status lost = WaitFor([&] { return (*client)->session_lost(); }, absl::Seconds(60),
                                    "the refused heartbeat");
  ASSERT_THAT(lost, IsOk());
  refuse->store(false);
  const int stats_before = fake.Count(wire::Message::Stats);
  absl::StatusOr<StatsSnapshot> stats = (*client)->Stats();
  EXPECT_EQ(stats.status().code(), absl::StatusCode::kAborted) << stats.status();
  EXPECT_THAT(stats.status().message(), HasSubstr("ended session 1"));
  EXPECT_EQ(fake.Count(wire::Message::Stats), stats_before);  // not sent
  EXPECT_TRUE((*client)->session_lost());                     // until the caller registers again
  EXPECT_EQ((*client)->EnsureSession().code(), absl::StatusCode::kAborted);
  ASSERT_THAT((*client)->Reregister(), IsOk());
  EXPECT_FALSE((*client)->session_lost());
  EXPECT_THAT((*client)->Stats(), IsOk());
}

TEST(CacheManagerClientUnitTest, OversizedStepIsRefusedLocally) {
  FakeCacheManager fake;
  auto epoch = std::make_shared<std::atomic<uint64_t>>(5);
  fake.SetHandler(Script(
      epoch, [](const wire::Envelope&) { return std::vector<std::string>{}; }, 0, 2));
  absl::StatusOr<std::unique_ptr<CacheManagerClient>> client =
      CacheManagerClient::Connect(OptionsFor(fake));
  ASSERT_THAT(client, IsOk());
  BlockOps step;
  step.Free(1).Free(2).Free(3);
  EXPECT_EQ((*client)->Step(step).status().code(), absl::StatusCode::kInvalidArgument);
  step.Clear();
  absl::StatusOr<std::vector<OpOutcome>> empty = (*client)->Step(step);
  ASSERT_THAT(empty, IsOk());
  EXPECT_TRUE(empty->empty());
  EXPECT_EQ(fake.Count(wire::Message::Step), 0);
}

TEST(CacheManagerClientUnitTest, UnansweredCallIsDeadlineExceededNamingTheType) {
  FakeCacheManager fake;
  auto epoch = std::make_shared<std::atomic<uint64_t>>(5);
  fake.SetHandler(Script(epoch, [](const wire::Envelope&) { return std::vector<std::string>{}; }));
  CacheManagerClient::Options options = OptionsFor(fake);
  options.call_timeout = absl::Milliseconds(150);
  // Hello is answered, but 150 ms is short enough for a loaded machine to miss even that:
  // connect again until it is (the Stats below is never answered, so it times out anyway).
  absl::StatusOr<std::unique_ptr<CacheManagerClient>> client;
  (void)WaitFor(
      [&] {
        client = CacheManagerClient::Connect(options);
        return !absl::IsDeadlineExceeded(client.status());
      },
      absl::Seconds(60));
  ASSERT_THAT(client, IsOk());
  absl::StatusOr<StatsSnapshot> stats = (*client)->Stats();
  EXPECT_EQ(stats.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(stats.status().message(), absl::StrCat("cache manager at ", fake.endpoint(),
                                                   " did not answer Stats within 150ms"));
}

// ---- Pure helpers --------------------------------------------------------------------------

PoolDescriptorInfo Descriptor(const KvCacheSpec& spec, int32_t num_blocks,
                              uint64_t block_stride_delta) {
  const PoolLayout layout = *PoolLayout::For(spec, num_blocks);
  PoolDescriptorInfo descriptor;
  descriptor.spec = spec;
  descriptor.num_blocks = num_blocks;
  descriptor.layout = {static_cast<uint64_t>(layout.layer_stride),
                       static_cast<uint64_t>(layout.kv_stride),
                       static_cast<uint64_t>(layout.block_stride) + block_stride_delta,
                       static_cast<uint64_t>(layout.token_stride),
                       static_cast<uint64_t>(layout.head_stride),
                       static_cast<uint32_t>(layout.elem_bytes),
                       static_cast<uint64_t>(layout.total_bytes)};
  descriptor.backend = wire::PoolBackend::Shm;
  descriptor.epoch = 9;
  return descriptor;
}

TEST(CheckPoolDescriptorTest, AcceptsTheLayoutOfTheSpecAndRefusesOthers) {
  KvCacheSpec spec;
  spec.num_layers = 3;
  spec.num_kv_heads = 2;
  spec.head_dim = 16;
  spec.dtype = DType::kFloat16;
  spec.block_size = 4;
  absl::StatusOr<PoolView> good = CheckPoolDescriptor(Descriptor(spec, 8, 0), 8);
  ASSERT_THAT(good, IsOk());
  EXPECT_EQ(good->layout, *PoolLayout::For(spec, 8));
  EXPECT_EQ(good->epoch, 9u);
  EXPECT_EQ(good->base, nullptr);

  absl::StatusOr<PoolView> bad = CheckPoolDescriptor(Descriptor(spec, 8, 2), 8);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInternal);
  EXPECT_THAT(bad.status().message(), HasSubstr("layout.block_stride"));

  EXPECT_THAT(CheckPoolDescriptor(Descriptor(spec, 8, 0), 16).status().message(),
              HasSubstr("but Hello announced 16"));

  PoolDescriptorInfo unknown_backend = Descriptor(spec, 8, 0);
  unknown_backend.backend = static_cast<wire::PoolBackend>(7);
  EXPECT_THAT(CheckPoolDescriptor(unknown_backend, 8).status().message(),
              HasSubstr("unknown backend 7"));
}

TEST(BlockOpsTest, RecordsOpsInOrder) {
  std::vector<BlockHash> hashes(2);
  hashes[1].bytes[0] = 1;
  BlockOps step;
  step.Allocate(1, 9, hashes).Append(1, 3).Fork(1, 2).Commit(2, 8, {}).Free(1);
  ASSERT_EQ(step.size(), 5u);
  EXPECT_EQ(step.ops()[0].kind, wire::StepOp::AllocateOp);
  EXPECT_EQ(step.ops()[0].hashes, hashes);
  EXPECT_EQ(step.ops()[2].kind, wire::StepOp::ForkOp);
  EXPECT_EQ(step.ops()[2].seq, 1u);
  EXPECT_EQ(step.ops()[2].child, 2u);
  EXPECT_EQ(step.ops()[3].num_tokens, 8);
  EXPECT_EQ(step.ops()[4].kind, wire::StepOp::FreeOp);
  step.Clear();
  EXPECT_TRUE(step.empty());
}

}  // namespace
}  // namespace kvcm
