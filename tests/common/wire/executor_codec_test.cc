// The executor protocol's codec: round trips, and the verifier and decoder refusing bad input.

#include "common/wire/executor_codec.h"

#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "common/wire/envelope.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/status_matchers.h"

namespace kvcm {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

StepBatch SampleStep() {
  StepBatch step;
  step.step_id = 42;
  step.epoch = 1234567;
  step.router_session = 88;
  SeqWork a;
  a.seq = 7;
  a.tokens = {1, 2, 3, 4, 5};
  a.context_len = 5;
  a.block_table = {3, 9};
  a.group_tables = {-1, 11, 12, 13};  // KV cache groups 1 and 2
  a.sample = true;
  a.sample_index = 0;
  SeqWork b;
  b.seq = 8;
  b.tokens = {11};
  b.context_len = 9;
  b.block_table = {4, 5, 6};
  b.sampling.temperature = 0.7f;
  b.sampling.top_p = 0.9f;
  b.sampling.top_k = 40;
  b.sampling.seed = 99;
  b.sampling.repetition_penalty = 1.3f;
  b.sampling.frequency_penalty = -0.5f;
  b.sampling.presence_penalty = 0.25f;
  b.sampling.min_tokens = 6;
  b.penalty_tokens = {1, 2, 3, 50, 50};
  b.penalty_prompt_len = 3;
  b.logprobs = true;
  b.top_n = 5;
  b.fork_seeds = {7, 8};
  b.sample = true;
  b.sample_index = 3;
  a.input_logprobs = true;
  a.score_next = 77;
  step.seqs = {a, b};
  step.copies = {{4, 10}};
  return step;
}

const wire::ExecutorEnvelope& Verified(const flatbuffers::FlatBufferBuilder& builder) {
  const VerifiedExecutorEnvelope verified = VerifyExecutorEnvelope(BufferSpan(builder));
  EXPECT_EQ(verified.fault, EnvelopeFault::kNone) << verified.reason;
  return *verified.envelope;
}

TEST(ExecutorWireTest, StepBatchRoundTrips) {
  flatbuffers::FlatBufferBuilder builder;
  EncodeStepBatch(builder, /*request_id=*/5, /*executor_id=*/3, SampleStep());
  const wire::ExecutorEnvelope& envelope = Verified(builder);
  EXPECT_EQ(envelope.request_id(), 5u);
  EXPECT_EQ(envelope.executor_id(), 3u);
  EXPECT_EQ(envelope.epoch(), 1234567u);
  ASSERT_EQ(envelope.payload_type(), wire::ExecutorMessage::StepBatch);
  absl::StatusOr<StepBatch> step = DecodeStepBatch(*envelope.payload_as_StepBatch());
  ASSERT_THAT(step, IsOk());
  EXPECT_EQ(step->step_id, 42u);
  EXPECT_EQ(step->epoch, 1234567u);
  EXPECT_EQ(step->router_session, 88u);
  ASSERT_EQ(step->seqs.size(), 2u);
  EXPECT_EQ(step->seqs[0].seq, 7u);
  EXPECT_THAT(step->seqs[0].tokens, ElementsAre(1, 2, 3, 4, 5));
  EXPECT_THAT(step->seqs[0].block_table, ElementsAre(3, 9));
  EXPECT_THAT(step->seqs[0].group_tables, ElementsAre(-1, 11, 12, 13));
  EXPECT_TRUE(step->seqs[1].group_tables.empty());
  EXPECT_EQ(step->seqs[0].sampling.temperature, 0.0f);
  EXPECT_EQ(step->seqs[0].sampling.top_p, 1.0f);
  EXPECT_EQ(step->seqs[1].context_len, 9);
  EXPECT_EQ(step->seqs[1].sampling.temperature, 0.7f);
  EXPECT_EQ(step->seqs[1].sampling.top_p, 0.9f);
  EXPECT_EQ(step->seqs[1].sampling.top_k, 40);
  EXPECT_EQ(step->seqs[1].sampling.seed, 99u);
  EXPECT_EQ(step->seqs[1].sample_index, 3);
  EXPECT_EQ(step->seqs[1].sampling.repetition_penalty, 1.3f);
  EXPECT_EQ(step->seqs[1].sampling.frequency_penalty, -0.5f);
  EXPECT_EQ(step->seqs[1].sampling.presence_penalty, 0.25f);
  EXPECT_EQ(step->seqs[1].sampling.min_tokens, 6);
  EXPECT_THAT(step->seqs[1].penalty_tokens, ElementsAre(1, 2, 3, 50, 50));
  EXPECT_EQ(step->seqs[1].penalty_prompt_len, 3);
  EXPECT_TRUE(step->seqs[1].logprobs);
  EXPECT_EQ(step->seqs[1].top_n, 5);
  EXPECT_THAT(step->seqs[1].fork_seeds, ElementsAre(7u, 8u));
  EXPECT_FALSE(step->seqs[1].input_logprobs);
  EXPECT_EQ(step->seqs[1].score_next, -1);
  // Defaults: no penalty, nothing reported.
  EXPECT_EQ(step->seqs[0].sampling.repetition_penalty, 1.0f);
  EXPECT_FALSE(step->seqs[0].sampling.penalized());
  EXPECT_EQ(step->seqs[0].sampling.min_tokens, 0);
  EXPECT_TRUE(step->seqs[0].penalty_tokens.empty());
  EXPECT_FALSE(step->seqs[0].logprobs);
  EXPECT_EQ(step->seqs[0].top_n, 0);
  EXPECT_TRUE(step->seqs[0].input_logprobs);
  EXPECT_EQ(step->seqs[0].score_next, 77);
  ASSERT_EQ(step->copies.size(), 1u);
  EXPECT_EQ(step->copies[0], (CopyOrder{4, 10}));
}

// min_tokens 0 is not written (flatbuffers leaves defaults out), so a step without the field,
// as a router from before min_tokens sends it, is the same bytes and decodes to 0.
TEST(ExecutorWireTest, MinTokensIsCarriedAndAbsentReadsZero) {
  StepBatch sent = SampleStep();
  sent.seqs[1].sampling.min_tokens = 0;
  flatbuffers::FlatBufferBuilder builder;
  EncodeStepBatch(builder, 1, 1, sent);
  const wire::StepBatch& batch = *Verified(builder).payload_as_StepBatch();
  EXPECT_EQ(batch.seqs()->Get(1)->sampling()->min_tokens(), 0);
  absl::StatusOr<StepBatch> step = DecodeStepBatch(batch);
  ASSERT_THAT(step, IsOk());
  EXPECT_EQ(step->seqs[1].sampling.min_tokens, 0);

  sent.seqs[1].sampling.min_tokens = 1 << 20;
  flatbuffers::FlatBufferBuilder large;
  EncodeStepBatch(large, 1, 1, sent);
  step = DecodeStepBatch(*Verified(large).payload_as_StepBatch());
  ASSERT_THAT(step, IsOk());
  EXPECT_EQ(step->seqs[1].sampling.min_tokens, 1 << 20);
}

TEST(ExecutorWireTest, StepResultRoundTripsWithPerSequenceCodes) {
  StepResult report;
  report.step_id = 9;
  auto outcome = [](SeqId seq, int32_t token, absl::Status status) {
    SeqResult o;
    o.seq = seq;
    o.token = token;
    o.status = std::move(status);
    return o;
  };
  report.results.push_back(outcome(7, 123, absl::OkStatus()));
  report.results.back().logprob = -0.75f;
  report.results.back().top_ids = {123, 4};
  report.results.back().top_logprobs = {-0.75f, -1.5f};
  report.results.back().input_logprobs = {-3.0f, -2.5f};
  report.results.back().fork_tokens = {9, 10};
  report.results.back().fork_logprobs = {-1.0f, -2.0f};
  report.results.push_back(outcome(8, 55, absl::FailedPreconditionError("the logits hold a NaN")));
  report.results.push_back(outcome(9, -1, absl::OkStatus()));
  report.prefill_tokens = 5;
  report.decode_tokens = 2;
  report.duration_us = 777;
  flatbuffers::FlatBufferBuilder builder;
  EncodeStepResult(builder, 5, 3, 11, report);
  const wire::ExecutorEnvelope& envelope = Verified(builder);
  ASSERT_EQ(envelope.payload_type(), wire::ExecutorMessage::StepResult);
  const StepResult decoded = DecodeStepResult(*envelope.payload_as_StepResult());
  EXPECT_EQ(decoded.step_id, 9u);
  EXPECT_EQ(decoded.prefill_tokens, 5);
  EXPECT_EQ(decoded.decode_tokens, 2);
  EXPECT_EQ(decoded.duration_us, 777u);
  ASSERT_EQ(decoded.results.size(), 3u);
  EXPECT_EQ(decoded.results[0].token, 123);
  EXPECT_THAT(decoded.results[0].status, IsOk());
  EXPECT_EQ(decoded.results[0].logprob, -0.75f);
  EXPECT_THAT(decoded.results[0].top_ids, ElementsAre(123, 4));
  EXPECT_THAT(decoded.results[0].top_logprobs, ElementsAre(-0.75f, -1.5f));
  EXPECT_THAT(decoded.results[0].input_logprobs, ElementsAre(-3.0f, -2.5f));
  EXPECT_THAT(decoded.results[0].fork_tokens, ElementsAre(9, 10));
  EXPECT_THAT(decoded.results[0].fork_logprobs, ElementsAre(-1.0f, -2.0f));
  EXPECT_TRUE(decoded.results[2].top_ids.empty());
  EXPECT_EQ(decoded.results[1].token, -1);  // failed: no token
  EXPECT_TRUE(absl::IsFailedPrecondition(decoded.results[1].status));
  EXPECT_THAT(std::string(decoded.results[1].status.message()), HasSubstr("NaN"));
  EXPECT_EQ(decoded.results[2].token, -1);
}

TEST(ExecutorWireTest, HelloRoundTrips) {
  ExecutorHello hello;
  hello.name = "exec-a";
  hello.pid = 4321;
  hello.model.name = "tiny";
  hello.model.num_layers = 4;
  hello.model.hidden_size = 64;
  hello.model.num_attention_heads = 4;
  hello.model.num_kv_heads = 2;
  hello.model.head_dim = 16;
  hello.model.vocab_size = 320;
  hello.model.max_position_embeddings = 2048;
  hello.model.eos_token_ids = {2};
  hello.model.weight_dtype = DType::kBFloat16;
  hello.kv_spec = {4, 2, 16, DType::kFloat16, 16};
  hello.num_blocks = 256;
  hello.metrics_url = "http://127.0.0.1:1/metrics";
  flatbuffers::FlatBufferBuilder builder;
  EncodeExecutorHello(builder, 1, 0, 77, hello);
  const wire::ExecutorEnvelope& envelope = Verified(builder);
  absl::StatusOr<ExecutorHello> decoded = DecodeExecutorHello(*envelope.payload_as_ExecutorHello());
  ASSERT_THAT(decoded, IsOk());
  EXPECT_EQ(decoded->name, "exec-a");
  EXPECT_EQ(decoded->pid, 4321);
  EXPECT_EQ(decoded->model.name, "tiny");
  EXPECT_EQ(decoded->model.head_dim, 16);
  EXPECT_THAT(decoded->model.eos_token_ids, ElementsAre(2));
  EXPECT_EQ(decoded->model.weight_dtype, DType::kBFloat16);
  EXPECT_EQ(decoded->kv_spec, hello.kv_spec);
  EXPECT_EQ(decoded->num_blocks, 256);
  EXPECT_EQ(decoded->metrics_url, hello.metrics_url);
}

TEST(ExecutorWireTest, VerifierRefusesForeignAndBrokenBuffers) {
  const std::vector<uint8_t> garbage = {'n', 'o', 't', ' ', 'k', 'v', 'c', 'm', 0, 1};
  EXPECT_EQ(VerifyExecutorEnvelope(garbage).fault, EnvelopeFault::kMalformed);
  EXPECT_EQ(VerifyExecutorEnvelope({}).fault, EnvelopeFault::kMalformed);

  // A cache-manager envelope (KVCP) is not an executor message.
  flatbuffers::FlatBufferBuilder cm;
  FinishErrorReply(cm, 1, 1, wire::ErrorCode::Malformed, "x");
  const VerifiedExecutorEnvelope foreign = VerifyExecutorEnvelope(BufferSpan(cm));
  EXPECT_EQ(foreign.fault, EnvelopeFault::kMalformed);
  EXPECT_THAT(foreign.reason, HasSubstr("KVCX"));

  flatbuffers::FlatBufferBuilder builder;
  EncodeStepBatch(builder, 5, 3, SampleStep());
  std::vector<uint8_t> bytes(builder.GetBufferPointer(),
                             builder.GetBufferPointer() + builder.GetSize());
  // Truncated.
  EXPECT_EQ(VerifyExecutorEnvelope(std::span(bytes).first(bytes.size() / 2)).fault,
            EnvelopeFault::kMalformed);
  // Oversized.
  EXPECT_EQ(VerifyExecutorEnvelope(bytes, bytes.size() - 1).fault, EnvelopeFault::kOversized);
  // Random corruption never crashes the verifier (seeded, logged by the failure message).
  std::mt19937 rng(12345);
  for (int trial = 0; trial < 2000; ++trial) {
    std::vector<uint8_t> corrupt = bytes;
    for (int flips = 0; flips < 4; ++flips) {
      corrupt[8 + rng() % (corrupt.size() - 8)] = static_cast<uint8_t>(rng());
    }
    const VerifiedExecutorEnvelope verified = VerifyExecutorEnvelope(corrupt);
    if (verified.envelope != nullptr &&
        verified.envelope->payload_type() == wire::ExecutorMessage::StepBatch) {
      (void)DecodeStepBatch(*verified.envelope->payload_as_StepBatch());
    }
  }
}

TEST(ExecutorWireTest, VersionIsChecked) {
  flatbuffers::FlatBufferBuilder other;
  auto payload = wire::CreateHeartbeat(other);
  wire::ExecutorEnvelopeBuilder e(other);
  e.add_version(kProtocolVersion + 1);
  e.add_payload_type(wire::ExecutorMessage::Heartbeat);
  e.add_payload(payload.Union());
  other.Finish(e.Finish(), kExecutorEnvelopeIdentifier);
  EXPECT_EQ(VerifyExecutorEnvelope(BufferSpan(other)).fault, EnvelopeFault::kUnsupportedVersion);
}

// Each malformed step names what is wrong.
TEST(ExecutorWireTest, DecodeRefusesInconsistentSteps) {
  struct Case {
    const char* what;
    void (*mutate)(StepBatch&);
    const char* message;
  };
  const Case cases[] = {
      {"duplicate", [](StepBatch& s) { s.seqs[1].seq = s.seqs[0].seq; }, "twice"},
      {"no tokens", [](StepBatch& s) { s.seqs[0].tokens.clear(); }, "no new tokens"},
      {"short context", [](StepBatch& s) { s.seqs[0].context_len = 2; }, "context_len 2"},
      {"negative block", [](StepBatch& s) { s.seqs[1].block_table[2] = -4; }, "block id -4"},
      {"negative temperature", [](StepBatch& s) { s.seqs[1].sampling.temperature = -1; },
       "temperature"},
      {"nan temperature",
       [](StepBatch& s) {
         s.seqs[1].sampling.temperature = std::numeric_limits<float>::quiet_NaN();
       },
       "temperature"},
      {"top_p zero", [](StepBatch& s) { s.seqs[1].sampling.top_p = 0; }, "top_p"},
      {"top_k negative", [](StepBatch& s) { s.seqs[1].sampling.top_k = -2; }, "top_k"},
      {"zero repetition penalty", [](StepBatch& s) { s.seqs[1].sampling.repetition_penalty = 0; },
       "repetition_penalty"},
      {"frequency penalty too big",
       [](StepBatch& s) { s.seqs[1].sampling.frequency_penalty = 2.5f; }, "frequency_penalty"},
      {"presence penalty too small", [](StepBatch& s) { s.seqs[1].sampling.presence_penalty = -3; },
       "presence_penalty"},
      {"negative min_tokens", [](StepBatch& s) { s.seqs[1].sampling.min_tokens = -1; },
       "min_tokens must be >= 0 (0 = none), got -1"},
      {"top_n too big", [](StepBatch& s) { s.seqs[1].top_n = kMaxTopN + 1; }, "top_n"},
      {"penalty prompt past the tokens", [](StepBatch& s) { s.seqs[1].penalty_prompt_len = 6; },
       "penalty_prompt_len 6"},
      {"negative penalty token", [](StepBatch& s) { s.seqs[1].penalty_tokens[0] = -1; },
       "penalty token -1"},
      {"fork seeds without sampling",
       [](StepBatch& s) {
         s.seqs[0].sample = false;
         s.seqs[0].fork_seeds = {1};
       },
       "fork seeds"},
      {"too many fork seeds",
       [](StepBatch& s) { s.seqs[1].fork_seeds.assign(kMaxForkSeeds + 1, 3); }, "fork seeds"},
      {"negative copy", [](StepBatch& s) { s.copies[0].dst = -1; }, "copies[0]"},
      {"group tables not a multiple of the table",
       [](StepBatch& s) {
         s.seqs[0].group_tables = {1, 2, 3};
       },
       "3 group table entries"},
      {"negative group block",
       [](StepBatch& s) {
         s.seqs[0].group_tables = {4, -2};
       },
       "block id -2 at group_tables[1]"},
      {"no router session", [](StepBatch& s) { s.router_session = 0; }, "router_session"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    StepBatch step = SampleStep();
    c.mutate(step);
    flatbuffers::FlatBufferBuilder builder;
    EncodeStepBatch(builder, 1, 1, step);
    const wire::ExecutorEnvelope& envelope = Verified(builder);
    absl::StatusOr<StepBatch> decoded = DecodeStepBatch(*envelope.payload_as_StepBatch());
    ASSERT_FALSE(decoded.ok());
    EXPECT_TRUE(absl::IsInvalidArgument(decoded.status())) << decoded.status();
    EXPECT_THAT(std::string(decoded.status().message()), HasSubstr(c.message));
  }
}

}  // namespace
}  // namespace kvcm
