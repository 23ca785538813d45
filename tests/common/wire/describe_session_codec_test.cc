// The DescribeSessionReply codec: every sequence, block and count the cache manager encodes
// decodes to itself, in order, and absent lists read as empty.

#include "common/wire/describe_session_codec.h"

#include "gtest/gtest.h"

namespace kvcm {
namespace {

SessionSnapshot RoundTrip(const SessionSnapshot& snapshot) {
  flatbuffers::FlatBufferBuilder builder;
  builder.Finish(EncodeDescribeSessionReply(builder, snapshot));
  flatbuffers::Verifier verifier(builder.GetBufferPointer(), builder.GetSize());
  EXPECT_TRUE(verifier.VerifyBuffer<wire::DescribeSessionReply>(nullptr));
  return DecodeDescribeSessionReply(
      *flatbuffers::GetRoot<wire::DescribeSessionReply>(builder.GetBufferPointer()));
}

TEST(DescribeSessionCodecTest, EverySequenceSurvivesInOrder) {
  SessionSnapshot snapshot;
  snapshot.last_step_request_id = (uint64_t{1} << 40) + 3;
  snapshot.sequences = {
      {1, 40, 32, {5, 6, 7}, {}},
      {uint64_t{1} << 62, 17, 0, {}, {}},
      {9, 1, 1, {0}, {}},
      {10, 12, 8, {1, 2, 3}, {kNoBlock, 11, 12, kNoBlock, kNoBlock, 13}},  // 2 more groups
  };
  const SessionSnapshot decoded = RoundTrip(snapshot);
  EXPECT_EQ(decoded, snapshot);
  ASSERT_EQ(decoded.sequences.size(), 4u);
  EXPECT_EQ(decoded.last_step_request_id, (uint64_t{1} << 40) + 3);
  EXPECT_EQ(decoded.sequences[0].blocks, (std::vector<BlockId>{5, 6, 7}));
  EXPECT_EQ(decoded.sequences[0].num_committed_tokens, 32);
  EXPECT_EQ(decoded.sequences[1].seq, uint64_t{1} << 62);
  EXPECT_EQ(decoded.sequences[1].num_tokens, 17);
  EXPECT_TRUE(decoded.sequences[1].blocks.empty());
  EXPECT_TRUE(decoded.sequences[0].group_blocks.empty());  // no groups: none written
  EXPECT_EQ(decoded.sequences[3].group_blocks,
            (std::vector<BlockId>{kNoBlock, 11, 12, kNoBlock, kNoBlock, 13}));
}

TEST(DescribeSessionCodecTest, AnEmptySessionSurvives) {
  EXPECT_EQ(RoundTrip(SessionSnapshot()), SessionSnapshot());
}

TEST(DescribeSessionCodecTest, AbsentListsReadAsEmpty) {
  flatbuffers::FlatBufferBuilder builder;
  std::vector<flatbuffers::Offset<wire::SequenceState>> states = {
      wire::CreateSequenceState(builder, 4, 8, 2)};  // no block table
  builder.Finish(wire::CreateDescribeSessionReply(builder, builder.CreateVector(states), 6));
  const SessionSnapshot decoded = DecodeDescribeSessionReply(
      *flatbuffers::GetRoot<wire::DescribeSessionReply>(builder.GetBufferPointer()));
  ASSERT_EQ(decoded.sequences.size(), 1u);
  EXPECT_EQ(decoded.sequences[0], (SequenceSnapshot{4, 8, 2, {}, {}}));
  EXPECT_EQ(decoded.last_step_request_id, 6u);

  flatbuffers::FlatBufferBuilder empty;
  empty.Finish(wire::CreateDescribeSessionReply(empty));
  EXPECT_EQ(DecodeDescribeSessionReply(
                *flatbuffers::GetRoot<wire::DescribeSessionReply>(empty.GetBufferPointer())),
            SessionSnapshot());
}

}  // namespace
}  // namespace kvcm
