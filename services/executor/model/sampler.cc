#include "services/executor/model/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/base/check.h"

namespace kvcm::executor {
namespace {

uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

float Sanitize(float logit) {
  return std::isnan(logit) ? -std::numeric_limits<float>::infinity() : logit;
}

}  // namespace

int32_t Greedy(std::span<const float> logits) {
  KVCM_CHECK(!logits.empty());
  int32_t best = 0;
  float best_value = Sanitize(logits[0]);
  for (size_t i = 1; i < logits.size(); ++i) {
    const float v = Sanitize(logits[i]);
    if (v > best_value) {  // strict: the lowest id wins ties
      best_value = v;
      best = static_cast<int32_t>(i);
    }
  }
  return best;
}

absl::StatusOr<Sampler> Sampler::Create(const SamplingParams& params) {
  if (absl::Status s = ValidateSamplingParams(params); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("sampling: ", s.message()));
  }
  return Sampler(params);
}

double Sampler::Uniform(int64_t token_index) const {
  // Two rounds so that neighbouring seeds and indices give unrelated numbers.
  const uint64_t bits =
      SplitMix64(SplitMix64(params_.seed) ^
                 SplitMix64(static_cast<uint64_t>(token_index) + 0x632be59bd9b4e019ull));
  return static_cast<double>(bits >> 11) * 0x1.0p-53;  // 53 random bits in [0, 1)
}

int32_t Sampler::Sample(std::span<const float> logits, int64_t token_index) const {
  KVCM_CHECK(!logits.empty());
  if (params_.temperature == 0.0f || params_.top_k == 1) return Greedy(logits);

  const int32_t n = static_cast<int32_t>(logits.size());
  std::vector<int32_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  auto before = [&](int32_t a, int32_t b) {
    const float la = Sanitize(logits[static_cast<size_t>(a)]);
    const float lb = Sanitize(logits[static_cast<size_t>(b)]);
    return la > lb || (la == lb && a < b);
  };
  const int32_t k = params_.top_k > 0 ? std::min(params_.top_k, n) : n;
  std::partial_sort(order.begin(), order.begin() + k, order.end(), before);
  order.resize(static_cast<size_t>(k));

  const double inv_temperature = 1.0 / params_.temperature;
  const double max_logit = Sanitize(logits[static_cast<size_t>(order[0])]);
  if (!std::isfinite(max_logit)) return order[0];  // all -inf (or +inf at the top)
  std::vector<double> probs(static_cast<size_t>(k));
  double total = 0;
  for (int32_t i = 0; i < k; ++i) {
    const double l = Sanitize(logits[static_cast<size_t>(order[static_cast<size_t>(i)])]);
    probs[static_cast<size_t>(i)] = std::exp((l - max_logit) * inv_temperature);
    total += probs[static_cast<size_t>(i)];
  }
  // Nucleus: the shortest prefix reaching top_p of the mass.
  int32_t keep = k;
  if (params_.top_p < 1.0f) {
    const double target = static_cast<double>(params_.top_p) * total;
    double mass = 0;
    for (int32_t i = 0; i < k; ++i) {
      mass += probs[static_cast<size_t>(i)];
      if (mass >= target) {
        keep = i + 1;
        break;
      }
    }
  }
  double kept_total = 0;
  for (int32_t i = 0; i < keep; ++i) kept_total += probs[static_cast<size_t>(i)];
  const double u = Uniform(token_index) * kept_total;
  double cumulative = 0;
  for (int32_t i = 0; i < keep; ++i) {
    cumulative += probs[static_cast<size_t>(i)];
    if (u < cumulative) return order[static_cast<size_t>(i)];
  }
  return order[static_cast<size_t>(keep - 1)];  // rounding at the very top of the range
}

void ApplyPenalties(std::span<float> logits, std::span<const int32_t> history, int32_t prompt_len,
                    const SamplingParams& params) {
  const auto vocab = static_cast<int64_t>(logits.size());
  auto in_row = [vocab](int32_t token) { return token >= 0 && token < vocab; };
  if (params.repetition_penalty != 1.0f) {
    absl::flat_hash_set<int32_t> seen;
    for (int32_t token : history) {
      if (!in_row(token) || !seen.insert(token).second) continue;
      float& l = logits[static_cast<size_t>(token)];
      l = l > 0 ? l / params.repetition_penalty : l * params.repetition_penalty;
    }
  }
  if (params.frequency_penalty != 0.0f || params.presence_penalty != 0.0f) {
    absl::flat_hash_map<int32_t, int32_t> counts;
    const size_t from = std::min(history.size(), static_cast<size_t>(std::max(prompt_len, 0)));
    for (size_t i = from; i < history.size(); ++i) {
      if (in_row(history[i])) ++counts[history[i]];
    }
    for (const auto& [token, count] : counts) {
      logits[static_cast<size_t>(token)] -=
          params.frequency_penalty * static_cast<float>(count) + params.presence_penalty;
    }
  }
}

void ApplyMinTokens(std::span<float> logits, int64_t token_index, const SamplingParams& params,
                    std::span<const int32_t> stop_ids) {
  if (token_index >= params.min_tokens) return;
  const auto vocab = static_cast<int64_t>(logits.size());
  for (const int32_t id : stop_ids) {
    if (id >= 0 && id < vocab) {
      logits[static_cast<size_t>(id)] = -std::numeric_limits<float>::infinity();
    }
  }
}

namespace {

// max and log(sum(exp(l / t - max))) of a row, in double.
struct Normalizer {
  double inv_t = 1;
  double max = 0;
  double log_sum = 0;
};

Normalizer NormalizerOf(std::span<const float> logits, float temperature) {
  Normalizer n;
  n.inv_t = temperature > 0 ? 1.0 / temperature : 1.0;
  n.max = -std::numeric_limits<double>::infinity();
  for (float l : logits) n.max = std::max(n.max, Sanitize(l) * n.inv_t);
  if (!std::isfinite(n.max)) return n;
  double sum = 0;
  for (float l : logits) sum += std::exp(Sanitize(l) * n.inv_t - n.max);
  n.log_sum = std::log(sum);
  return n;
}

float LogprobWith(const Normalizer& n, float logit) {
  if (!std::isfinite(n.max)) return -std::numeric_limits<float>::infinity();
  return static_cast<float>(Sanitize(logit) * n.inv_t - n.max - n.log_sum);
}

}  // namespace

float LogprobOf(std::span<const float> logits, int32_t token, float temperature) {
  KVCM_CHECK(token >= 0 && static_cast<size_t>(token) < logits.size()) << token;
  return LogprobWith(NormalizerOf(logits, temperature), logits[static_cast<size_t>(token)]);
}

std::vector<TokenLogprob> TopLogprobs(std::span<const float> logits, int32_t n, float temperature) {
  const auto k =
      static_cast<size_t>(std::clamp<int64_t>(n, 0, static_cast<int64_t>(logits.size())));
  std::vector<int32_t> order(logits.size());
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(k), order.end(),
                    [&](int32_t a, int32_t b) {
                      const float la = Sanitize(logits[static_cast<size_t>(a)]);
                      const float lb = Sanitize(logits[static_cast<size_t>(b)]);
                      return la > lb || (la == lb && a < b);
                    });
  const Normalizer norm = NormalizerOf(logits, temperature);
  std::vector<TokenLogprob> top;
  top.reserve(k);
  for (size_t i = 0; i < k; ++i) {
    top.push_back({order[i], LogprobWith(norm, logits[static_cast<size_t>(order[i])])});
  }
  return top;
}

StopReason CheckStop(int32_t token, int32_t num_generated, int32_t max_tokens,
                     std::span<const int32_t> eos_ids) {
  if (std::find(eos_ids.begin(), eos_ids.end(), token) != eos_ids.end()) return StopReason::kEos;
  if (num_generated >= max_tokens) return StopReason::kMaxTokens;
  return StopReason::kNone;
}

}  // namespace kvcm::executor
