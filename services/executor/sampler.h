#pragma once
// Sampling the next token from a row of logits.
//
// A request's samples depend only on its SamplingParams (seed included) and on the index of
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
// Thread safety: Sampler is immutable; Sample is const.

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace kvcm {

struct SamplingParams {
  float temperature = 0.0f;  // 0: greedy. Higher flattens the distribution.
  float top_p = 1.0f;        // nucleus mass in (0, 1]; 1 keeps every token
  int32_t top_k = 0;         // keep the k most likely tokens; 0 keeps all
  uint64_t seed = 0;         // the request's seed; same seed, same samples
  int32_t max_tokens = 16;   // stop after this many generated tokens (>= 1)
};

// INVALID_ARGUMENT naming the field: temperature negative or not finite, top_p outside
// (0, 1], top_k negative, max_tokens < 1.
absl::Status ValidateSamplingParams(const SamplingParams& params);

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

  // The uniform number in [0, 1) used for token `token_index` (exposed for tests).
  double UniformForTest(int64_t token_index) const { return Uniform(token_index); }

  const SamplingParams& params() const { return params_; }

 private:
  explicit Sampler(const SamplingParams& params) : params_(params) {}
  double Uniform(int64_t token_index) const;

  SamplingParams params_;
};

// Why generation stops after a token.
enum class StopReason {
  kNone,       // keep going
  kEos,        // the token is an end-of-sequence id (it is still returned to the caller)
  kMaxTokens,  // num_generated reached params.max_tokens
};

// Whether to stop after generating `token`, the num_generated-th token (1-based) of the
// request. EOS wins over max_tokens when both hold.
StopReason CheckStop(int32_t token, int32_t num_generated, const SamplingParams& params,
                     std::span<const int32_t> eos_ids);

}  // namespace kvcm
