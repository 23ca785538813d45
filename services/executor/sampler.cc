#include "services/executor/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "common/base/check.h"

namespace kvcm {
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

absl::Status ValidateSamplingParams(const SamplingParams& p) {
  if (!std::isfinite(p.temperature) || p.temperature < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("sampling: temperature must be finite and >= 0, got ", p.temperature));
  }
  if (!(p.top_p > 0 && p.top_p <= 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("sampling: top_p must be in (0, 1], got ", p.top_p));
  }
  if (p.top_k < 0) {
    return absl::InvalidArgumentError(absl::StrCat("sampling: top_k must be >= 0, got ", p.top_k));
  }
  if (p.max_tokens < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("sampling: max_tokens must be >= 1, got ", p.max_tokens));
  }
  return absl::OkStatus();
}

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
  if (absl::Status s = ValidateSamplingParams(params); !s.ok()) return s;
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

StopReason CheckStop(int32_t token, int32_t num_generated, const SamplingParams& params,
                     std::span<const int32_t> eos_ids) {
  if (std::find(eos_ids.begin(), eos_ids.end(), token) != eos_ids.end()) return StopReason::kEos;
  if (num_generated >= params.max_tokens) return StopReason::kMaxTokens;
  return StopReason::kNone;
}

}  // namespace kvcm
