// The cache-manager Step codec: every op kind and every outcome field round trips, and
// DecodeStep refuses malformed and oversized steps.

#include "common/wire/step_codec.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "common/wire/convert.h"
#include "common/wire/envelope.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/status_matchers.h"

namespace kvcm {
namespace {

using ::testing::HasSubstr;

BlockHash HashOf(int i) {
  BlockHash h;
  h.bytes[0] = static_cast<uint8_t>(i);
  h.bytes[31] = 0xa5;
  return h;
}

std::vector<BlockOp> EveryKind() {
  const std::vector<BlockHash> two = {HashOf(1), HashOf(2)};
  const std::vector<BlockHash> one = {HashOf(3)};
  return {BlockOp::Allocate(7, 40, two), BlockOp::Append(7, 3),  BlockOp::Fork(7, 9),
          BlockOp::Commit(7, 32, one),   BlockOp::Free(9, true), BlockOp::Free(11),
          BlockOp::CanAllocate(20, two)};
}

const wire::Envelope& Verified(const flatbuffers::FlatBufferBuilder& builder) {
  const VerifiedEnvelope verified = VerifyEnvelope(BufferSpan(builder));
  EXPECT_EQ(verified.fault, EnvelopeFault::kNone) << verified.reason;
  return *verified.envelope;
}

TEST(StepCodecTest, EveryOpKindRoundTrips) {
  const std::vector<BlockOp> ops = EveryKind();
  flatbuffers::FlatBufferBuilder builder;
  ASSERT_THAT(EncodeStep(builder, /*request_id=*/5, /*session_id=*/77, /*epoch=*/3, ops), IsOk());
  const wire::Envelope& envelope = Verified(builder);
  EXPECT_EQ(envelope.request_id(), 5u);
  EXPECT_EQ(envelope.session_id(), 77u);
  EXPECT_EQ(envelope.epoch(), 3u);
  ASSERT_EQ(envelope.payload_type(), wire::Message::Step);
  // Into storage that held other ops: nothing of them may remain.
  std::vector<BlockOp> decoded = {BlockOp::Commit(1, 2, std::vector<BlockHash>(5, HashOf(9)))};
  ASSERT_THAT(DecodeStep(*envelope.payload_as_Step(), {}, &decoded), IsOk());
  EXPECT_EQ(decoded, ops);
}

TEST(StepCodecTest, AnOpWithoutAKindIsRefusedWhenEncoding) {
  std::vector<BlockOp> ops = EveryKind();
  ops.insert(ops.begin() + 2, BlockOp{});
  flatbuffers::FlatBufferBuilder builder;
  absl::Status status = EncodeStep(builder, 1, 1, 1, ops);
  EXPECT_TRUE(absl::IsInvalidArgument(status)) << status;
  EXPECT_THAT(status.message(), HasSubstr("step op 2 has no kind"));
}

TEST(StepCodecTest, MalformedStepsAreDataLoss) {
  flatbuffers::FlatBufferBuilder builder;
  // Two types, one op.
  std::vector<wire::StepOp> types = {wire::StepOp::AppendOp, wire::StepOp::FreeOp};
  std::vector<flatbuffers::Offset<void>> values = {wire::CreateAppendOp(builder, 1, 1).Union()};
  auto step = wire::CreateStep(builder, builder.CreateVector(types), builder.CreateVector(values));
  FinishEnvelope(builder, 1, 1, 1, wire::Message::Step, step.Union());
  // The Verifier already refuses union vectors of different lengths (DecodeStep checks it
  // again, for a buffer that did not pass through it).
  EXPECT_EQ(VerifyEnvelope(BufferSpan(builder)).fault, EnvelopeFault::kMalformed);

  // A type outside the union (the Verifier lets unknown union types through).
  builder.Clear();
  types = {static_cast<wire::StepOp>(42)};
  values = {wire::CreateAppendOp(builder, 1, 1).Union()};
  step = wire::CreateStep(builder, builder.CreateVector(types), builder.CreateVector(values));
  FinishEnvelope(builder, 1, 1, 1, wire::Message::Step, step.Union());
  const VerifiedEnvelope verified = VerifyEnvelope(BufferSpan(builder));
  ASSERT_NE(verified.envelope, nullptr) << verified.reason;
  std::vector<BlockOp> decoded;
  absl::Status status = DecodeStep(*verified.envelope->payload_as_Step(), {}, &decoded);
  EXPECT_TRUE(absl::IsDataLoss(status)) << status;
  EXPECT_THAT(status.message(), HasSubstr("op 0 has unknown type 42"));
}

TEST(StepCodecTest, LimitsOnOpsAndHashesAreResourceExhausted) {
  const std::vector<BlockOp> ops = EveryKind();  // 7 ops, 5 hashes
  flatbuffers::FlatBufferBuilder builder;
  ASSERT_THAT(EncodeStep(builder, 1, 1, 1, ops), IsOk());
  const wire::Step& step = *Verified(builder).payload_as_Step();
  std::vector<BlockOp> decoded;
  EXPECT_THAT(DecodeStep(step, {.max_ops = 7, .max_hashes = 5}, &decoded), IsOk());
  absl::Status status = DecodeStep(step, {.max_ops = 6}, &decoded);
  EXPECT_TRUE(absl::IsResourceExhausted(status)) << status;
  EXPECT_THAT(status.message(), HasSubstr("step of 7 ops exceeds the limit of 6"));
  status = DecodeStep(step, {.max_hashes = 4}, &decoded);
  EXPECT_TRUE(absl::IsResourceExhausted(status)) << status;
  EXPECT_THAT(status.message(), HasSubstr("more than 4 block hashes"));
}

// Every field of each decoded outcome equals the one encoded.
void ExpectSameOutcomes(const std::vector<OpOutcome>& decoded,
                        const std::vector<OpOutcome>& outcomes) {
  ASSERT_EQ(decoded.size(), outcomes.size());
  for (size_t i = 0; i < outcomes.size(); ++i) {
    SCOPED_TRACE(i);
    EXPECT_EQ(decoded[i].status, outcomes[i].status);
    EXPECT_EQ(decoded[i].blocks, outcomes[i].blocks);
    EXPECT_EQ(decoded[i].copies, outcomes[i].copies);
    EXPECT_EQ(decoded[i].num_cached_tokens, outcomes[i].num_cached_tokens);
    EXPECT_EQ(decoded[i].blocks_needed, outcomes[i].blocks_needed);
    EXPECT_EQ(decoded[i].group_blocks, outcomes[i].group_blocks);
  }
}

TEST(StepCodecTest, OutcomesRoundTripAndTheirCountIsChecked) {
  std::vector<OpOutcome> outcomes(4);
  outcomes[0].blocks = {3, 4, 5};
  outcomes[0].num_cached_tokens = 16;
  outcomes[0].group_blocks = {6, 7, 8, -1, 11, 12};  // KV cache groups 1 and 2
  outcomes[1].blocks = {9};
  outcomes[1].copies = {CopyOrder{5, 9}};
  outcomes[2].status = absl::ResourceExhaustedError("2 blocks needed, 1 free");
  outcomes[3].num_cached_tokens = 8;
  outcomes[3].blocks_needed = 2;
  flatbuffers::FlatBufferBuilder builder;
  std::vector<flatbuffers::Offset<wire::OpResult>> results;
  for (const OpOutcome& outcome : outcomes) results.push_back(EncodeOpOutcome(builder, outcome));
  const auto reply = wire::CreateStepReply(builder, builder.CreateVector(results));
  FinishEnvelope(builder, 2, 1, 1, wire::Message::StepReply, reply.Union());
  const wire::StepReply& wire_reply = *Verified(builder).payload_as_StepReply();

  absl::StatusOr<std::vector<OpOutcome>> decoded = DecodeStepReply(wire_reply, 4);
  ASSERT_THAT(decoded, IsOk());
  ExpectSameOutcomes(*decoded, outcomes);
  absl::StatusOr<std::vector<OpOutcome>> short_count = DecodeStepReply(wire_reply, 5);
  EXPECT_TRUE(absl::IsInternal(short_count.status())) << short_count.status();
  EXPECT_THAT(short_count.status().message(), HasSubstr("4 results for 5 ops"));
}

// OpResultWriter: the empty OK results of a reply share one table (the reply is smaller than
// with a table each), every other result is its own, and all decode as they were given.
TEST(StepCodecTest, EmptyOkResultsShareOneTableAndDecodeTheSame) {
  std::vector<OpOutcome> outcomes(64);  // empty OK, but for:
  outcomes[5].blocks = {11};
  outcomes[17].status = absl::NotFoundError("sequence 3 is not live");
  outcomes[40].num_cached_tokens = 32;
  outcomes[63].copies = {CopyOrder{2, 6}};
  auto encode = [&outcomes](flatbuffers::FlatBufferBuilder& builder, bool shared) {
    std::vector<flatbuffers::Offset<wire::OpResult>> results;
    OpResultWriter writer(builder);
    for (const OpOutcome& outcome : outcomes) {
      results.push_back(shared ? writer.Add(outcome) : EncodeOpOutcome(builder, outcome));
    }
    const auto reply = wire::CreateStepReply(builder, builder.CreateVector(results));
    FinishEnvelope(builder, 2, 1, 1, wire::Message::StepReply, reply.Union());
    return results;
  };
  flatbuffers::FlatBufferBuilder each, shared;
  const std::vector<flatbuffers::Offset<wire::OpResult>> each_offsets = encode(each, false);
  const std::vector<flatbuffers::Offset<wire::OpResult>> shared_offsets = encode(shared, true);
  auto distinct = [](const std::vector<flatbuffers::Offset<wire::OpResult>>& offsets) {
    std::vector<uint32_t> o;
    for (const auto& offset : offsets) o.push_back(offset.o);
    std::sort(o.begin(), o.end());
    return std::unique(o.begin(), o.end()) - o.begin();
  };
  EXPECT_EQ(distinct(each_offsets), 64);
  EXPECT_EQ(distinct(shared_offsets), 5);  // the four that carry something, and the shared one
  EXPECT_LT(shared.GetSize(), each.GetSize());

  absl::StatusOr<std::vector<OpOutcome>> decoded =
      DecodeStepReply(*Verified(shared).payload_as_StepReply(), outcomes.size());
  ASSERT_THAT(decoded, IsOk());
  ExpectSameOutcomes(*decoded, outcomes);
}

}  // namespace
}  // namespace kvcm
