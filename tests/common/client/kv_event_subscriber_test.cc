// KvEventSubscriber against an in-process fake publisher (an XPUB socket, so the test knows
// when the subscription has arrived): batch application, the first batch of an epoch, late
// joining with a snapshot, gap detection and recovery, restarts, and refused messages.

#include "common/client/kv_event_subscriber.h"

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/base/monotonic_clock.h"
#include "common/block/block_hash.h"
#include "common/transport/zmq_util.h"
#include "flatbuffers/flatbuffers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "schemas/kvcm_protocol_generated.h"
#include "tests/support/status_matchers.h"
#include "tests/support/subprocess.h"
#include "zmq.hpp"

namespace kvcm {
namespace {

using ::kvcm::testing::TempDir;
using ::testing::Pair;
using ::testing::UnorderedElementsAre;

BlockHash Hash(uint8_t tag) {
  BlockHash hash;
  hash.bytes.fill(tag);
  return hash;
}

KvEventRecord Stored(uint8_t tag, int32_t block) {
  return {KvEventKind::kBlockStored, Hash(tag), BlockHash{}, block};
}
KvEventRecord Removed(uint8_t tag, int32_t block) {
  return {KvEventKind::kBlockRemoved, Hash(tag), BlockHash{}, block};
}
KvEventRecord Cleared() { return {KvEventKind::kAllBlocksCleared, BlockHash{}, BlockHash{}, -1}; }

// The cache manager's publishing side, as schemas/kvcm_protocol.fbs describes it.
class FakePublisher {
 public:
  explicit FakePublisher(const std::string& endpoint) : socket_(context_, zmq::socket_type::xpub) {
    socket_.set(zmq::sockopt::linger, 0);
    socket_.bind(endpoint);
  }

  // Waits for a subscription to `topic` (XPUB delivers it as "\x01topic").
  void AwaitSubscriber() {
    absl::StatusOr<std::vector<zmq::message_t>> message =
        ReceiveMessageUntil(socket_, MonotonicNow() + absl::Seconds(10));
    ASSERT_THAT(message, IsOk());
    ASSERT_EQ(message->size(), 1u);
    EXPECT_EQ((*message)[0].to_string(), std::string("\x01") + kKvEventTopic);
  }

  void Publish(uint64_t seq, uint64_t epoch, const std::vector<KvEventRecord>& events) {
    flatbuffers::FlatBufferBuilder builder;
    std::vector<flatbuffers::Offset<wire::KvEvent>> encoded;
    for (const KvEventRecord& e : events) {
      wire::BlockHash hash(flatbuffers::span<const uint8_t, 32>(e.hash.bytes.data(), 32));
      wire::BlockHash parent(flatbuffers::span<const uint8_t, 32>(e.parent_hash.bytes.data(), 32));
      const bool has_hash = e.kind != KvEventKind::kAllBlocksCleared;
      encoded.push_back(wire::CreateKvEvent(builder, static_cast<wire::EventKind>(e.kind),
                                            has_hash ? &hash : nullptr,
                                            has_hash ? &parent : nullptr, e.block));
    }
    builder.Finish(wire::CreateEventBatch(builder, seq, epoch, builder.CreateVector(encoded)));
    SendRaw(
        kKvEventTopic, SeqFrame(seq),
        std::string(reinterpret_cast<const char*>(builder.GetBufferPointer()), builder.GetSize()));
  }

  void SendRaw(const std::string& topic, const std::string& seq, const std::string& body) {
    const std::span<const uint8_t> frames[] = {AsBytes(topic), AsBytes(seq), AsBytes(body)};
    ASSERT_THAT(SendMessage(socket_, frames), IsOk());
  }
  void SendFrames(const std::vector<std::string>& parts) {
    std::vector<std::span<const uint8_t>> frames;
    for (const std::string& part : parts) frames.push_back(AsBytes(part));
    ASSERT_THAT(SendMessage(socket_, frames), IsOk());
  }

  static std::string SeqFrame(uint64_t seq) {
    std::string out(8, '\0');
    for (int i = 0; i < 8; ++i) out[i] = static_cast<char>(seq >> (56 - 8 * i));
    return out;
  }

 private:
  static std::span<const uint8_t> AsBytes(const std::string& s) {
    return {reinterpret_cast<const uint8_t*>(s.data()), s.size()};
  }

  zmq::context_t context_;
  zmq::socket_t socket_;
};

class KvEventSubscriberTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<TempDir> dir = TempDir::Create("kvcm-ev");
    ASSERT_THAT(dir, IsOk());
    dir_.emplace(std::move(*dir));
    const std::string endpoint = absl::StrCat("ipc://", dir_->path(), "/events.sock");
    publisher_ = std::make_unique<FakePublisher>(endpoint);
    KvEventSubscriber::Options options;
    options.endpoint = endpoint;
    options.on_batch_applied = [this](uint64_t seq, uint64_t, const auto&) {
      applied_.push_back(seq);
    };
    absl::StatusOr<std::unique_ptr<KvEventSubscriber>> subscriber =
        KvEventSubscriber::Connect(options);
    ASSERT_THAT(subscriber, IsOk());
    subscriber_ = std::move(*subscriber);
    publisher_->AwaitSubscriber();
  }

  // Polls until `n` more messages have been taken in; the fake publishes in order, so that
  // means everything sent so far.
  void Receive(int n) {
    const uint64_t target = subscriber_->messages_received() + n;
    const absl::Time deadline = MonotonicNow() + absl::Seconds(10);
    while (subscriber_->messages_received() < target && MonotonicNow() < deadline) {
      absl::StatusOr<int> polled = subscriber_->Poll(absl::Milliseconds(50));
      ASSERT_THAT(polled, IsOk());
    }
    ASSERT_GE(subscriber_->messages_received(), target) << "messages did not arrive";
  }

  std::optional<TempDir> dir_;
  std::unique_ptr<FakePublisher> publisher_;
  std::unique_ptr<KvEventSubscriber> subscriber_;
  std::vector<uint64_t> applied_;
};

TEST_F(KvEventSubscriberTest, FirstBatchOfAnEpochNeedsNoSnapshot) {
  EXPECT_TRUE(subscriber_->needs_snapshot());
  publisher_->Publish(1, 7, {Stored(1, 3), Stored(2, 4)});
  publisher_->Publish(2, 7, {Removed(1, 3), Stored(5, 3)});
  Receive(2);
  EXPECT_FALSE(subscriber_->needs_snapshot());
  EXPECT_EQ(subscriber_->last_seq(), 2u);
  EXPECT_EQ(subscriber_->epoch(), 7u);
  EXPECT_EQ(subscriber_->gaps(), 0u);
  EXPECT_THAT(subscriber_->blocks(), UnorderedElementsAre(Pair(Hash(2), 4), Pair(Hash(5), 3)));
  EXPECT_EQ(applied_, (std::vector<uint64_t>{1, 2}));

  publisher_->Publish(3, 7, {Cleared(), Stored(9, 0)});
  Receive(1);
  EXPECT_THAT(subscriber_->blocks(), UnorderedElementsAre(Pair(Hash(9), 0)));
}

TEST_F(KvEventSubscriberTest, LateJoinerBuffersUntilTheSnapshotThenReplaysAfterItsSeq) {
  publisher_->Publish(5, 7, {Stored(3, 7)});
  publisher_->Publish(6, 7, {Removed(1, 1)});
  Receive(2);
  EXPECT_TRUE(subscriber_->needs_snapshot());
  EXPECT_EQ(subscriber_->buffered_batches(), 2u);
  EXPECT_TRUE(subscriber_->blocks().empty());
  EXPECT_EQ(subscriber_->gaps(), 0u);  // joining late is not a gap

  EventSnapshot snapshot;
  snapshot.seq = 5;  // batch 5 is already in it
  snapshot.epoch = 7;
  snapshot.events = {Stored(1, 1), Stored(2, 2), Stored(3, 7)};
  ASSERT_THAT(subscriber_->ApplySnapshot(snapshot), IsOk());
  EXPECT_FALSE(subscriber_->needs_snapshot());
  EXPECT_EQ(subscriber_->last_seq(), 6u);
  EXPECT_EQ(applied_, (std::vector<uint64_t>{6}));
  EXPECT_THAT(subscriber_->blocks(), UnorderedElementsAre(Pair(Hash(2), 2), Pair(Hash(3), 7)));

  // A batch the snapshot already covered, arriving late, is ignored.
  publisher_->Publish(4, 7, {Stored(8, 8)});
  publisher_->Publish(7, 7, {Stored(4, 4)});
  Receive(2);
  EXPECT_EQ(subscriber_->last_seq(), 7u);
  EXPECT_FALSE(subscriber_->blocks().contains(Hash(8)));
  EXPECT_TRUE(subscriber_->blocks().contains(Hash(4)));
}

TEST_F(KvEventSubscriberTest, LostBatchIsAGapThatASnapshotRepairs) {
  publisher_->Publish(1, 7, {Stored(1, 1)});
  Receive(1);
  subscriber_->DropNextBatchForTest();
  publisher_->Publish(2, 7, {Stored(2, 2)});  // lost
  publisher_->Publish(3, 7, {Stored(3, 3)});
  publisher_->Publish(4, 7, {Removed(1, 1)});
  Receive(3);
  EXPECT_EQ(subscriber_->gaps(), 1u);
  EXPECT_TRUE(subscriber_->needs_snapshot());
  EXPECT_EQ(subscriber_->last_seq(), 1u);
  EXPECT_EQ(subscriber_->buffered_batches(), 2u);

  EventSnapshot snapshot;  // the state after batch 2
  snapshot.seq = 2;
  snapshot.epoch = 7;
  snapshot.events = {Stored(1, 1), Stored(2, 2)};
  ASSERT_THAT(subscriber_->ApplySnapshot(snapshot), IsOk());
  EXPECT_FALSE(subscriber_->needs_snapshot());
  EXPECT_EQ(subscriber_->last_seq(), 4u);
  EXPECT_THAT(subscriber_->blocks(), UnorderedElementsAre(Pair(Hash(2), 2), Pair(Hash(3), 3)));
}

TEST_F(KvEventSubscriberTest, NewEpochEmptiesTheMirror) {
  publisher_->Publish(1, 7, {Stored(1, 1)});
  publisher_->Publish(2, 7, {Stored(2, 2)});
  Receive(2);
  // The cache manager restarted and this is its first batch: follow it at once.
  publisher_->Publish(1, 8, {Stored(3, 0)});
  Receive(1);
  EXPECT_EQ(subscriber_->epoch(), 8u);
  EXPECT_EQ(subscriber_->gaps(), 0u);
  EXPECT_THAT(subscriber_->blocks(), UnorderedElementsAre(Pair(Hash(3), 0)));
  // Another restart whose first batches were missed: unknown state.
  publisher_->Publish(5, 9, {Stored(4, 0)});
  Receive(1);
  EXPECT_EQ(subscriber_->gaps(), 1u);
  EXPECT_TRUE(subscriber_->needs_snapshot());
  EXPECT_TRUE(subscriber_->blocks().empty());
  // A snapshot of epoch 9 replays only epoch 9's batches.
  EventSnapshot snapshot;
  snapshot.seq = 4;
  snapshot.epoch = 9;
  snapshot.events = {Stored(6, 6)};
  ASSERT_THAT(subscriber_->ApplySnapshot(snapshot), IsOk());
  EXPECT_THAT(subscriber_->blocks(), UnorderedElementsAre(Pair(Hash(6), 6), Pair(Hash(4), 0)));
}

TEST_F(KvEventSubscriberTest, MalformedMessagesAreCountedAndSkipped) {
  publisher_->SendFrames({kKvEventTopic, FakePublisher::SeqFrame(1)});  // 2 frames
  publisher_->SendRaw(kKvEventTopic, "1234", "garbage");                // seq size
  publisher_->SendRaw(kKvEventTopic, FakePublisher::SeqFrame(1), "not a flatbuffer");
  publisher_->SendRaw(std::string(kKvEventTopic) + ".other", FakePublisher::SeqFrame(1), "x");
  Receive(4);
  EXPECT_EQ(subscriber_->rejected_batches(), 4u);
  EXPECT_EQ(subscriber_->batches_applied(), 0u);
  // A batch whose frame seq disagrees with its body.
  flatbuffers::FlatBufferBuilder builder;
  builder.Finish(wire::CreateEventBatch(builder, 2, 7));
  publisher_->SendRaw(
      kKvEventTopic, FakePublisher::SeqFrame(1),
      std::string(reinterpret_cast<const char*>(builder.GetBufferPointer()), builder.GetSize()));
  Receive(1);
  EXPECT_EQ(subscriber_->rejected_batches(), 5u);
  publisher_->Publish(1, 7, {Stored(1, 1)});
  Receive(1);
  EXPECT_EQ(subscriber_->batches_applied(), 1u);
}

TEST_F(KvEventSubscriberTest, SnapshotWithOtherThanStoredEventsIsRefused) {
  EventSnapshot snapshot;
  snapshot.seq = 3;
  snapshot.epoch = 7;
  snapshot.events = {Stored(1, 1), Removed(1, 1)};
  EXPECT_EQ(subscriber_->ApplySnapshot(snapshot).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(subscriber_->needs_snapshot());
  EXPECT_TRUE(subscriber_->blocks().empty());
}

TEST(KvEventSubscriberConnectTest, NothingListeningIsUnavailable) {
  absl::StatusOr<TempDir> dir = TempDir::Create("kvcm-ev");
  ASSERT_THAT(dir, IsOk());
  KvEventSubscriber::Options options;
  options.endpoint = absl::StrCat("ipc://", dir->path(), "/events.sock");
  EXPECT_EQ(KvEventSubscriber::Connect(options).status().code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace kvcm
