#pragma once
// The executor protocol's messages (schemas/kvcm_executor.fbs) as plain values, under the
// schema's names: what the router plans into a StepBatch, what the executor answers in a
// StepResult, and what it says of itself in its ExecutorHello (docs/protocol.md). No
// generated code here; common/wire/executor_codec.h converts these to and from the wire, and
// the executor's sampler takes SamplingParams as they arrive.
//
// Thread safety: plain values.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/block/block_ledger.h"
#include "common/memory/pool_memory.h"
#include "common/sizing/kv_cache_spec.h"

namespace kvcm {

// ---- Steps ----------------------------------------------------------------------------------

// How one sequence samples; the defaults are the schema's (greedy).
struct SamplingParams {
  float temperature = 0.0f;         // 0: greedy. Higher flattens the distribution.
  float top_p = 1.0f;               // nucleus mass in (0, 1]; 1 keeps every token
  int32_t top_k = 0;                // keep the k most likely tokens; 0 keeps all
  uint64_t seed = 0;                // the request's seed; same seed, same samples
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

// INVALID_ARGUMENT naming the field, e.g. "temperature must be finite and >= 0, got -1":
// temperature negative or not finite, top_p outside (0, 1], top_k negative,
// repetition_penalty not finite or <= 0, a frequency or presence penalty outside [-2, 2],
// min_tokens negative.
absl::Status ValidateSamplingParams(const SamplingParams& params);

// The most alternatives a sequence may ask for (SeqWork::top_n).
inline constexpr int32_t kMaxTopN = 20;

// One sequence of a step: its last `tokens` are new; it holds `context_len` tokens after the
// step; `block_table` maps positions to blocks.
struct SeqWork {
  SeqId seq = 0;
  std::vector<int32_t> tokens;
  int32_t context_len = 0;
  std::vector<BlockId> block_table;
  SamplingParams sampling;
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
  // With KV cache groups (PoolDescriptor.kv_groups): the tables of groups 1.., each as long
  // as block_table (group 0's), one after another; empty without groups.
  std::vector<BlockId> group_tables;
};

// Most fork seeds one sequence may carry.
inline constexpr int32_t kMaxForkSeeds = 64;

// One step of one executor's batch.
struct StepBatch {
  uint64_t step_id = 0;
  uint64_t epoch = 0;
  uint64_t router_session = 0;  // the router's cache-manager session; required (not 0)
  std::vector<SeqWork> seqs;
  std::vector<CopyOrder> copies;  // in order
};

// One sequence's result.
struct SeqResult {
  SeqId seq = 0;
  int32_t token = -1;            // the sampled token; -1 when not asked for or on failure
  absl::Status status;           // per-sequence failure (e.g. non-finite logits)
  float logprob = 0.0f;          // with SeqWork::logprobs
  std::vector<int32_t> top_ids;  // with SeqWork::top_n, most likely first
  std::vector<float> top_logprobs;
  std::vector<float> input_logprobs;  // with SeqWork::input_logprobs
  std::vector<int32_t> fork_tokens;   // with SeqWork::fork_seeds, in their order
  std::vector<float> fork_logprobs;   // and, with SeqWork::logprobs, theirs
};

// What an executor answers for a StepBatch.
struct StepResult {
  uint64_t step_id = 0;
  std::vector<SeqResult> results;
  int32_t prefill_tokens = 0;
  int32_t decode_tokens = 0;
  uint64_t duration_us = 0;
};

// ---- Registration ---------------------------------------------------------------------------

// The model an executor runs, as the router checks it against the others.
struct ModelSummary {
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

// What an executor says of itself when it registers.
struct ExecutorHello {
  std::string name;
  int32_t pid = 0;
  ModelSummary model;
  KvCacheSpec kv_spec;
  int32_t num_blocks = 0;
  PoolBackend backend = PoolBackend::kShm;
  std::string metrics_url;
};

}  // namespace kvcm
