// The Heartbeat codec: the fences an executor acknowledges and the fences the cache manager
// lists in its reply survive the wire, whole-session fences and sequence fences alike.

#include "common/wire/heartbeat_codec.h"

#include <vector>

#include "gtest/gtest.h"

namespace kvcm {
namespace {

TEST(HeartbeatCodecTest, AcknowledgementsSurviveInOrder) {
  const std::vector<uint64_t> acks = {9, 3, uint64_t{1} << 63};
  flatbuffers::FlatBufferBuilder builder;
  builder.Finish(EncodeHeartbeat(builder, acks));
  flatbuffers::Verifier verifier(builder.GetBufferPointer(), builder.GetSize());
  ASSERT_TRUE(verifier.VerifyBuffer<wire::Heartbeat>(nullptr));
  const auto* heartbeat = flatbuffers::GetRoot<wire::Heartbeat>(builder.GetBufferPointer());
  EXPECT_EQ(DecodeHeartbeat(*heartbeat), acks);

  flatbuffers::FlatBufferBuilder none;
  none.Finish(EncodeHeartbeat(none));
  const auto* plain = flatbuffers::GetRoot<wire::Heartbeat>(none.GetBufferPointer());
  EXPECT_EQ(plain->fence_acks(), nullptr);  // no acknowledgements: the vector is left out
  EXPECT_TRUE(DecodeHeartbeat(*plain).empty());
}

TEST(HeartbeatCodecTest, EveryFenceSurvives) {
  // Whole-session fences first, then sequence fences: the order a reply decodes to.
  const std::vector<FenceNotice> fences = {
      {1, 7, {}},
      {4, uint64_t{1} << 40, {}},
      {2, 8, {5, 6, uint64_t{1} << 62}},
      {3, 8, {11}},
  };
  flatbuffers::FlatBufferBuilder builder;
  builder.Finish(EncodeHeartbeatReply(builder, fences));
  flatbuffers::Verifier verifier(builder.GetBufferPointer(), builder.GetSize());
  ASSERT_TRUE(verifier.VerifyBuffer<wire::HeartbeatReply>(nullptr));
  const auto* reply = flatbuffers::GetRoot<wire::HeartbeatReply>(builder.GetBufferPointer());
  ASSERT_NE(reply->fences(), nullptr);
  EXPECT_EQ(reply->fences()->size(), 2u);
  ASSERT_NE(reply->sequence_fences(), nullptr);
  EXPECT_EQ(reply->sequence_fences()->size(), 2u);
  EXPECT_EQ(DecodeHeartbeatReply(*reply), fences);
}

TEST(HeartbeatCodecTest, NoFencesReadAsNone) {
  flatbuffers::FlatBufferBuilder builder;
  builder.Finish(EncodeHeartbeatReply(builder, {}));
  const auto* reply = flatbuffers::GetRoot<wire::HeartbeatReply>(builder.GetBufferPointer());
  EXPECT_EQ(reply->sequence_fences(), nullptr);
  EXPECT_TRUE(DecodeHeartbeatReply(*reply).empty());

  flatbuffers::FlatBufferBuilder empty;
  empty.Finish(wire::CreateHeartbeatReply(empty));
  EXPECT_TRUE(
      DecodeHeartbeatReply(*flatbuffers::GetRoot<wire::HeartbeatReply>(empty.GetBufferPointer()))
          .empty());
}

}  // namespace
}  // namespace kvcm
