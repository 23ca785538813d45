#pragma once
// Sampling the next token from a row of logits.
//
// A request's samples depend only on its SamplingParams (common/wire/executor_protocol.h,
// seed included) and on the index of
// the token being sampled, never on batching, on other requests or on call order: the
// random number for token `index` is a counter-based hash of (seed, index)
// (SplitMix64-style), not a stream. Re-running a request with the same seed gives the same
// tokens; a preempted and resumed request continues exactly.
//
// Algorithm (temperature > 0): scale logits by 1 / temperature; order candidates by logit,
// descending, lower id first on ties; keep the first top_k (0 = all); softmax over them in
// double; keep the shortest prefix whose probability reaches top_p (at least one token);
// draw from the renormalized prefix. temperature == 0 (or top_k == 1) is greedy: the argmax,
// lowest id on ties. NaN logits count as -infinity.
//
// How, without sorting the vocabulary (SampleBySorting does, as the definition; a full sort
// of SmolLM2's 49,152 logits took 8 - 10 ms a token, more than half a one-thread decode
// step): a top_k below the vocabulary takes its k candidates with a heap (k up to 1,024) or a
// linear-time selection and sorts only those. With every token a candidate, one pass puts
// each token in a bucket by its distance below the top logit (1/8 of a nat each, scaled
// logits; everything 40 nats down in one last bucket) and sums each bucket's probability; the
// nucleus cut and the draw then each find the bucket they fall in from the buckets' sums and
// sort only that bucket's tokens. Bucket by bucket is the sorted order, so the token drawn is
// the definition's; only the order of the sums differs (a draw within their rounding, about
// 1e-12 of the total, of a boundary between two tokens may go the other way).
//
// Thread safety: Sampler is immutable; Sample is const.

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/wire/executor_protocol.h"

namespace kvcm::executor {

// Penalties, as vLLM defines them (and Hugging Face for the repetition penalty), applied to
// one row of logits in place before sampling. `history` is what the sequence holds before
// the position being sampled: its first `prompt_len` tokens are the prompt, the rest its
// output.
// - repetition_penalty r, for every token in the prompt or the output: a logit l > 0 becomes
//   l / r, any other l * r.
// - frequency_penalty f and presence_penalty p, for every token the output holds c > 0
//   times: l - f * c - p.
// Tokens outside the row are ignored (the executor refuses them before this).
void ApplyPenalties(std::span<float> logits, std::span<const int32_t> history, int32_t prompt_len,
                    const SamplingParams& params);

// vLLM's min_tokens, applied to one row of logits in place before sampling (vLLM masks
// before its penalties; either order gives the same row, -infinity stays so under them):
// while the token being chosen is one of the request's first params.min_tokens
// (token_index < min_tokens, 0 for the first generated token), every id of `stop_ids` (the
// model's EOS ids, and any other token that would end the request) gets -infinity, so that
// neither greedy choice nor sampling can pick it, and the log-probabilities reported are of
// that masked distribution. vLLM masks the same set (its EOS ids and stop_token_ids)
// whether or not the request also ignores EOS. From token min_tokens on, nothing changes.
// Ids outside the row are ignored. (A row of nothing but stop ids is all -infinity then:
// Greedy and Sample still return a token.)
void ApplyMinTokens(std::span<float> logits, int64_t token_index, const SamplingParams& params,
                    std::span<const int32_t> stop_ids);

// A token and its log-probability.
struct TokenLogprob {
  int32_t token = 0;
  float logprob = 0.0f;
};

// log softmax(logits / temperature) at `token`, in double; temperature 0 counts as 1 (a
// greedy request reports the model's own distribution). NaN logits count as -infinity.
// REQUIRES: 0 <= token < logits.size().
float LogprobOf(std::span<const float> logits, int32_t token, float temperature = 1.0f);

// The n most likely tokens of that distribution, most likely first, the lower id first on
// ties; min(n, logits.size()) of them.
std::vector<TokenLogprob> TopLogprobs(std::span<const float> logits, int32_t n,
                                      float temperature = 1.0f);

// The argmax of `logits`, lowest id on ties; NaN counts as -infinity.
// REQUIRES: !logits.empty().
int32_t Greedy(std::span<const float> logits);

class Sampler {
 public:
  // INVALID_ARGUMENT from ValidateSamplingParams.
  static absl::StatusOr<Sampler> Create(const SamplingParams& params);

  // The token sampled from `logits` (one row, [vocab]) as the request's token number
  // `token_index` (0 for the first generated token).
  // REQUIRES: !logits.empty().
  int32_t Sample(std::span<const float> logits, int64_t token_index) const;

  // The same draw by the algorithm above taken literally: every candidate sorted, the sums in
  // sorted order. O(vocab log vocab); the reference Sample is tested and measured against.
  int32_t SampleBySorting(std::span<const float> logits, int64_t token_index) const;

  // The uniform number in [0, 1) used for token `token_index` (exposed for tests).
  double UniformForTest(int64_t token_index) const { return Uniform(token_index); }

  const SamplingParams& params() const { return params_; }

 private:
  explicit Sampler(const SamplingParams& params) : params_(params) {}
  double Uniform(int64_t token_index) const;
  // The draw over candidates `order`, sorted (the top first): softmax, nucleus, draw.
  int32_t DrawFromSorted(std::span<const float> logits, std::span<const int32_t> order,
                         int64_t token_index) const;
  // Every token a candidate (top_k 0 or at least the vocabulary), by buckets; `top` is the
  // argmax, whose logit is finite.
  int32_t SampleAll(std::span<const float> logits, int32_t top, int64_t token_index) const;

  SamplingParams params_;
};

// Why generation stops after a token.
enum class StopReason {
  kNone,       // keep going
  kEos,        // the token is an end-of-sequence id (it is still returned to the caller)
  kMaxTokens,  // num_generated reached max_tokens
};

// Whether to stop after generating `token`, the num_generated-th token (1-based) of a
// request of at most `max_tokens` generated tokens. EOS wins over max_tokens when both hold.
StopReason CheckStop(int32_t token, int32_t num_generated, int32_t max_tokens,
                     std::span<const int32_t> eos_ids);

}  // namespace kvcm::executor
