#include "services/executor/model/sampler.h"

#include <algorithm>
#include <array>
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

namespace {

// The candidates' order: the higher logit first, the lower id first on ties.
struct TopFirst {
  std::span<const float> logits;
  bool operator()(int32_t a, int32_t b) const {
    const float la = Sanitize(logits[static_cast<size_t>(a)]);
    const float lb = Sanitize(logits[static_cast<size_t>(b)]);
    return la > lb || (la == lb && a < b);
  }
};

// SampleAll's buckets: a token whose scaled logit is d nats below the top one (d >= 0, or
// +infinity) is in bucket floor(d x kBucketsPerNat), or the last one from kBucketNats on.
// Monotone in the logit, so bucket after bucket, each sorted, is the sorted order.
constexpr int kBucketsPerNat = 8;
constexpr int kBucketNats = 40;
constexpr int kBuckets = kBucketsPerNat * kBucketNats + 1;

// A top_k up to this is selected by a heap (partial_sort), a larger one by nth_element:
// bench/sampler_bench measures 0.19 ms against 0.84 ms for k = 40 of 49,152.
constexpr std::ptrdiff_t kHeapTopK = 1024;

int BucketOf(double d) {
  return d < kBucketNats ? static_cast<int>(d * kBucketsPerNat) : kBuckets - 1;
}

}  // namespace

int32_t Sampler::Sample(std::span<const float> logits, int64_t token_index) const {
  KVCM_CHECK(!logits.empty());
  if (params_.temperature == 0.0f || params_.top_k == 1) return Greedy(logits);
  const int32_t n = static_cast<int32_t>(logits.size());
  if (params_.top_k == 0 || params_.top_k >= n) {
    const int32_t top = Greedy(logits);
    // All -inf, or +inf at the top: the first in order, as the definition's draw gives.
    if (!std::isfinite(Sanitize(logits[static_cast<size_t>(top)]))) return top;
    return SampleAll(logits, top, token_index);
  }
  // The k first in order (the order is total, so they are the definition's k): a heap of k
  // for a small k (most tokens fall below its top at one comparison), else selected in
  // linear time and then sorted.
  std::vector<int32_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  const auto k = static_cast<std::ptrdiff_t>(params_.top_k);
  if (k <= kHeapTopK) {
    std::partial_sort(order.begin(), order.begin() + k, order.end(), TopFirst{logits});
  } else {
    std::nth_element(order.begin(), order.begin() + (k - 1), order.end(), TopFirst{logits});
    std::sort(order.begin(), order.begin() + k, TopFirst{logits});
  }
  order.resize(static_cast<size_t>(k));
  return DrawFromSorted(logits, order, token_index);
}

int32_t Sampler::SampleBySorting(std::span<const float> logits, int64_t token_index) const {
  KVCM_CHECK(!logits.empty());
  if (params_.temperature == 0.0f || params_.top_k == 1) return Greedy(logits);
  const int32_t n = static_cast<int32_t>(logits.size());
  std::vector<int32_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  const int32_t k = params_.top_k > 0 ? std::min(params_.top_k, n) : n;
  if (k == n) {
    std::sort(order.begin(), order.end(), TopFirst{logits});
  } else {
    std::partial_sort(order.begin(), order.begin() + k, order.end(), TopFirst{logits});
    order.resize(static_cast<size_t>(k));
  }
  return DrawFromSorted(logits, order, token_index);
}

int32_t Sampler::DrawFromSorted(std::span<const float> logits, std::span<const int32_t> order,
                                int64_t token_index) const {
  const auto k = static_cast<int32_t>(order.size());
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

int32_t Sampler::SampleAll(std::span<const float> logits, int32_t top, int64_t token_index) const {
  const double inv_temperature = 1.0 / params_.temperature;
  const double max_logit = Sanitize(logits[static_cast<size_t>(top)]);
  // d: the scaled distance below the top; the probability is exp(-d), as DrawFromSorted's
  // exp((l - max) / T) to the bit.
  auto distance = [&](size_t i) { return (max_logit - Sanitize(logits[i])) * inv_temperature; };
  std::array<double, kBuckets> mass{};
  std::array<int32_t, kBuckets> count{};
  std::vector<uint16_t> bucket_of(logits.size());
  static_assert(kBuckets <= 65536);
  for (size_t i = 0; i < logits.size(); ++i) {
    const double d = distance(i);
    const int b = BucketOf(d);
    bucket_of[i] = static_cast<uint16_t>(b);
    mass[static_cast<size_t>(b)] += d < 746 ? std::exp(-d) : 0.0;  // exp(-746) is 0 already
    ++count[static_cast<size_t>(b)];
  }
  double total = 0;
  int last_bucket = 0;
  for (int b = 0; b < kBuckets; ++b) {
    total += mass[static_cast<size_t>(b)];
    if (count[static_cast<size_t>(b)] > 0) last_bucket = b;
  }
  // A bucket's tokens in order, with their probabilities.
  std::vector<int32_t> members;
  std::vector<double> probs;
  int sorted_bucket = -1;
  auto sort_bucket = [&](int b) {
    if (sorted_bucket == b) return;
    members.clear();
    for (size_t i = 0; i < logits.size(); ++i) {
      if (bucket_of[i] == b) members.push_back(static_cast<int32_t>(i));
    }
    std::sort(members.begin(), members.end(), TopFirst{logits});
    probs.clear();
    for (const int32_t id : members) probs.push_back(std::exp(-distance(static_cast<size_t>(id))));
    sorted_bucket = b;
  };

  // The nucleus: whole buckets before keep_bucket, the first keep_count of keep_bucket.
  int keep_bucket = last_bucket;
  size_t keep_count = static_cast<size_t>(count[static_cast<size_t>(last_bucket)]);
  double kept_total = total;
  if (params_.top_p < 1.0f) {
    const double target = static_cast<double>(params_.top_p) * total;
    double before = 0;
    for (int b = 0; b <= last_bucket; ++b) {
      if (count[static_cast<size_t>(b)] == 0) continue;
      if (before + mass[static_cast<size_t>(b)] < target && b < last_bucket) {
        before += mass[static_cast<size_t>(b)];
        continue;
      }
      sort_bucket(b);
      keep_bucket = b;
      keep_count = members.size();  // the whole bucket, should rounding not reach target
      double cumulative = before;
      for (size_t j = 0; j < members.size(); ++j) {
        cumulative += probs[j];
        if (cumulative >= target) {
          keep_count = j + 1;
          break;
        }
      }
      kept_total = before;
      for (size_t j = 0; j < keep_count; ++j) kept_total += probs[j];
      break;
    }
  }

  // The draw, walked as the sorted order: bucket sums until the one it falls in, then tokens.
  const double u = Uniform(token_index) * kept_total;
  double before = 0;
  for (int b = 0; b <= keep_bucket; ++b) {
    if (count[static_cast<size_t>(b)] == 0) continue;
    if (b < keep_bucket && u >= before + mass[static_cast<size_t>(b)]) {
      before += mass[static_cast<size_t>(b)];
      continue;
    }
    sort_bucket(b);
    const size_t walk = b == keep_bucket ? keep_count : members.size();
    double cumulative = before;
    size_t last_positive = 0;
    for (size_t j = 0; j < walk; ++j) {
      cumulative += probs[j];
      if (u < cumulative) return members[j];
      if (probs[j] > 0) last_positive = j;
    }
    // Rounding: the sums said this bucket, its tokens fall just short; its last token with
    // any mass.
    return members[last_positive];
  }
  return top;  // unreachable: keep_bucket holds the top token at least
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
