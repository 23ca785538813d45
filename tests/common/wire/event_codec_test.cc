// The KV event codec: every event of a batch or a snapshot the cache manager encodes decodes
// to itself, in order, and events the client cannot read are refused with the texts it has
// always given.

#include "common/wire/event_codec.h"

#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/status_matchers.h"

namespace kvcm {
namespace {

BlockHash Hash(uint8_t tag) {
  BlockHash hash;
  for (size_t i = 0; i < hash.bytes.size(); ++i) hash.bytes[i] = static_cast<uint8_t>(tag + i);
  return hash;
}

// One event of each kind, a Stored one with and one without its parent.
std::vector<KvEventRecord> Events() {
  return {
      {.kind = KvEventKind::kAllBlocksCleared},
      {.kind = KvEventKind::kBlockStored, .hash = Hash(1), .block = 0},
      {.kind = KvEventKind::kBlockStored,
       .hash = Hash(2),
       .parent_hash = Hash(1),
       .block = 7,
       .has_parent = true},
      {.kind = KvEventKind::kBlockRemoved, .hash = Hash(1), .block = 0},
  };
}

TEST(EventCodecTest, EveryEventOfABatchSurvivesInOrder) {
  KvEventBatch batch;
  batch.seq = (uint64_t{1} << 40) + 1;
  batch.epoch = 99;
  batch.events = Events();
  flatbuffers::FlatBufferBuilder builder;
  builder.Finish(EncodeEventBatch(builder, batch));
  flatbuffers::Verifier verifier(builder.GetBufferPointer(), builder.GetSize());
  ASSERT_TRUE(verifier.VerifyBuffer<wire::EventBatch>(nullptr));
  absl::StatusOr<KvEventBatch> decoded =
      DecodeEventBatch(*flatbuffers::GetRoot<wire::EventBatch>(builder.GetBufferPointer()));
  ASSERT_THAT(decoded, IsOk());
  EXPECT_EQ(*decoded, batch);
  ASSERT_EQ(decoded->events.size(), 4u);
  EXPECT_EQ(decoded->events[0].block, kNoBlock);
  EXPECT_TRUE(decoded->events[2].has_parent);
  EXPECT_EQ(decoded->events[2].parent_hash, Hash(1));
  EXPECT_FALSE(decoded->events[1].has_parent);
  EXPECT_EQ(decoded->events[3].kind, KvEventKind::kBlockRemoved);
}

TEST(EventCodecTest, ASnapshotSurvives) {
  EventSnapshot snapshot;
  snapshot.seq = 12;
  snapshot.epoch = 3;
  snapshot.events = Events();
  flatbuffers::FlatBufferBuilder builder;
  builder.Finish(EncodeEventSnapshotReply(builder, snapshot));
  absl::StatusOr<EventSnapshot> decoded = DecodeEventSnapshotReply(
      *flatbuffers::GetRoot<wire::EventSnapshotReply>(builder.GetBufferPointer()));
  ASSERT_THAT(decoded, IsOk());
  EXPECT_EQ(*decoded, snapshot);

  flatbuffers::FlatBufferBuilder empty;
  empty.Finish(wire::CreateEventSnapshotReply(empty, 5, 6));
  decoded = DecodeEventSnapshotReply(
      *flatbuffers::GetRoot<wire::EventSnapshotReply>(empty.GetBufferPointer()));
  ASSERT_THAT(decoded, IsOk());
  EXPECT_EQ(*decoded, (EventSnapshot{5, 6, {}}));
}

TEST(EventCodecTest, EventsTheClientCannotReadAreRefused) {
  {
    flatbuffers::FlatBufferBuilder builder;
    const wire::BlockHash hash;
    std::vector<flatbuffers::Offset<wire::KvEvent>> events = {
        wire::CreateKvEvent(builder, wire::EventKind::BlockStored, &hash, nullptr, 1),
        wire::CreateKvEvent(builder, static_cast<wire::EventKind>(7), &hash, nullptr, 2)};
    builder.Finish(wire::CreateEventBatch(builder, 1, 1, builder.CreateVector(events)));
    absl::StatusOr<KvEventBatch> refused =
        DecodeEventBatch(*flatbuffers::GetRoot<wire::EventBatch>(builder.GetBufferPointer()));
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInternal);
    EXPECT_EQ(refused.status().message(),
              "cache manager protocol error: KV event 1 has unknown kind 7");
  }
  {
    flatbuffers::FlatBufferBuilder builder;
    std::vector<flatbuffers::Offset<wire::KvEvent>> events = {
        wire::CreateKvEvent(builder, wire::EventKind::AllBlocksCleared),  // needs no hash
        wire::CreateKvEvent(builder, wire::EventKind::BlockRemoved, nullptr, nullptr, 3)};
    builder.Finish(wire::CreateEventSnapshotReply(builder, 1, 1, builder.CreateVector(events)));
    absl::StatusOr<EventSnapshot> refused = DecodeEventSnapshotReply(
        *flatbuffers::GetRoot<wire::EventSnapshotReply>(builder.GetBufferPointer()));
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInternal);
    EXPECT_EQ(refused.status().message(),
              "cache manager protocol error: KV event 1 has no block hash");
  }
}

}  // namespace
}  // namespace kvcm
