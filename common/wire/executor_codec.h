#pragma once
// The executor protocol's codec (schemas/kvcm_executor.fbs): verifying inbound envelopes,
// finishing outbound ones, and converting StepBatch, StepResult and ExecutorHello to and
// from plain values. Shared by kvcm-executor, the router and the tests' step driver. No
// sockets here, and no model: only bytes and values.
//
// Every inbound buffer goes through VerifyExecutorEnvelope before a field is read: size
// limit, file identifier "KVCX", the FlatBuffers Verifier, protocol version, payload
// present. The Decode* functions then check what the schema cannot say (counts, signs);
// whether block ids fit a pool is the service's business.
//
// Thread safety: stateless functions.

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/block/block_ledger.h"
#include "common/memory/pool_memory.h"
#include "common/sizing/kv_cache_spec.h"
#include "common/wire/envelope.h"
#include "flatbuffers/flatbuffers.h"
#include "schemas/kvcm_executor_generated.h"

namespace kvcm {

// File identifier of ExecutorEnvelope, as in schemas/kvcm_executor.fbs.
inline constexpr char kExecutorEnvelopeIdentifier[] = "KVCX";

// An inbound executor-protocol message, checked (common/wire/envelope.h).
using VerifiedExecutorEnvelope = VerifiedRoot<wire::ExecutorEnvelope>;

// Checks `bytes` (which must outlive the returned pointer). On success the payload union has
// been verified and may be read.
inline VerifiedExecutorEnvelope VerifyExecutorEnvelope(std::span<const uint8_t> bytes,
                                                       size_t max_bytes = kDefaultMaxMessageBytes) {
  return VerifyEnvelopeOf<wire::ExecutorEnvelope>(bytes, max_bytes, kExecutorEnvelopeIdentifier);
}

// Wraps `payload` (of union type `type`) in an envelope and finishes the buffer with the file
// identifier; the caller then sends BufferSpan(builder).
void FinishExecutorEnvelope(flatbuffers::FlatBufferBuilder& builder, uint64_t request_id,
                            uint64_t executor_id, uint64_t epoch, wire::ExecutorMessage type,
                            flatbuffers::Offset<void> payload);

// A finished envelope holding an ErrorReply { code, reason }.
void FinishExecutorError(flatbuffers::FlatBufferBuilder& builder, uint64_t request_id,
                         uint64_t executor_id, uint64_t epoch, wire::ErrorCode code,
                         std::string_view reason);

// "StepBatch", "ErrorReply", ... (the schema's names); "NONE" for none.
std::string_view ExecutorMessageName(wire::ExecutorMessage type);

// ---- Steps ----------------------------------------------------------------------------------

// SamplingParams as a plain value; the defaults are the schema's (greedy).
struct SeqSampling {
  float temperature = 0.0f;
  float top_p = 1.0f;
  int32_t top_k = 0;
  uint64_t seed = 0;
  float repetition_penalty = 1.0f;  // over prompt and output tokens; 1 = none
  float frequency_penalty = 0.0f;   // over output tokens, per occurrence; 0 = none
  float presence_penalty = 0.0f;    // over output tokens, once per token; 0 = none
  // vLLM's min_tokens: while sample_index < min_tokens the model's EOS ids cannot be chosen
  // (docs/executor.md, "Sampling"); 0 = none. Absent on the wire (an older router): 0.
  int32_t min_tokens = 0;

  bool penalized() const {
    return repetition_penalty != 1.0f || frequency_penalty != 0.0f || presence_penalty != 0.0f;
  }
};

// The most alternatives a sequence may ask for (SeqWork.top_n).
inline constexpr int32_t kMaxTopN = 20;

// One sequence of a step (SeqWork): its last `tokens` are new; it holds `context_len`
// tokens after the step; `block_table` maps positions to blocks.
struct SeqStep {
  SeqId seq = 0;
  std::vector<int32_t> tokens;
  int32_t context_len = 0;
  std::vector<BlockId> block_table;
  SeqSampling sampling;
  bool sample = false;
  // Which generated token of the request is chosen (0 = the first); seeds the sampler
  // together with sampling.seed. -1: context_len is used.
  int64_t sample_index = -1;
  // With a penalty: the tokens before the sampled position, the first penalty_prompt_len of
  // them the prompt's.
  std::vector<int32_t> penalty_tokens;
  int32_t penalty_prompt_len = 0;
  bool logprobs = false;        // report the sampled token's log-probability
  int32_t top_n = 0;            // and the top_n most likely tokens (at most kMaxTopN)
  bool input_logprobs = false;  // score each new token after the first
  int32_t score_next = -1;      // and this one at the last position
  // With `sample`: one more draw per seed (sample index 0), for forked sequences.
  std::vector<uint64_t> fork_seeds;
};

// Most fork seeds one sequence may carry.
inline constexpr int32_t kMaxForkSeeds = 64;

// A StepBatch as a plain value.
struct StepRequest {
  uint64_t step_id = 0;
  uint64_t epoch = 0;
  uint64_t router_session = 0;  // the router's cache-manager session; required (not 0)
  std::vector<SeqStep> seqs;
  std::vector<CopyOrder> copies;  // in order
};

// One sequence's outcome (SeqResult).
struct SeqOutcome {
  SeqId seq = 0;
  int32_t token = -1;            // the sampled token; -1 when not asked for or on failure
  absl::Status status;           // per-sequence failure (e.g. non-finite logits)
  float logprob = 0.0f;          // with SeqStep::logprobs
  std::vector<int32_t> top_ids;  // with SeqStep::top_n, most likely first
  std::vector<float> top_logprobs;
  std::vector<float> input_logprobs;  // with SeqStep::input_logprobs
  std::vector<int32_t> fork_tokens;   // with SeqStep::fork_seeds, in their order
  std::vector<float> fork_logprobs;   // and, with SeqStep::logprobs, theirs
};

// A StepResult as a plain value.
struct StepReport {
  uint64_t step_id = 0;
  std::vector<SeqOutcome> results;
  int32_t prefill_tokens = 0;
  int32_t decode_tokens = 0;
  uint64_t duration_us = 0;
};

// Builds a finished StepBatch envelope (router side).
void EncodeStepBatch(flatbuffers::FlatBufferBuilder& builder, uint64_t request_id,
                     uint64_t executor_id, const StepRequest& step);

// Reads a verified StepBatch. INVALID_ARGUMENT naming the sequence (by index and id) for a
// sequence without new tokens, a context_len smaller than its new tokens, a negative block
// id, a duplicate sequence id, a negative copy id, or non-finite / out-of-range sampling
// parameters (temperature < 0, top_p outside (0, 1], top_k < 0, repetition_penalty <= 0,
// frequency or presence penalty outside [-2, 2]), top_n outside [0, kMaxTopN],
// penalty_prompt_len outside [0, len(penalty_tokens)], a negative penalty token, or more
// than kMaxForkSeeds fork seeds (or any without `sample`).
absl::StatusOr<StepRequest> DecodeStepBatch(const wire::StepBatch& step);

// Builds a finished StepResult envelope (executor side).
void EncodeStepResult(flatbuffers::FlatBufferBuilder& builder, uint64_t request_id,
                      uint64_t executor_id, uint64_t epoch, const StepReport& report);

// Reads a verified StepResult (router side). Codes map back with FromWire.
StepReport DecodeStepResult(const wire::StepResult& result);

// ---- Registration ---------------------------------------------------------------------------

// ModelSummary as a plain value.
struct ModelInfo {
  std::string name;
  int32_t num_layers = 0;
  int32_t hidden_size = 0;
  int32_t num_attention_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  int32_t vocab_size = 0;
  int32_t max_position_embeddings = 0;
  std::vector<int32_t> eos_token_ids;
  DType weight_dtype = DType::kFloat32;
};

// ExecutorHello as a plain value.
struct ExecutorHelloInfo {
  std::string name;
  int32_t pid = 0;
  ModelInfo model;
  KvCacheSpec kv_spec;
  int32_t num_blocks = 0;
  PoolBackend backend = PoolBackend::kShm;
  std::string metrics_url;
};

void EncodeExecutorHello(flatbuffers::FlatBufferBuilder& builder, uint64_t request_id,
                         uint64_t executor_id, uint64_t epoch, const ExecutorHelloInfo& hello);
// INVALID_ARGUMENT when the model summary or the KV spec is missing or invalid.
absl::StatusOr<ExecutorHelloInfo> DecodeExecutorHello(const wire::ExecutorHello& hello);

}  // namespace kvcm
