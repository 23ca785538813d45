#include "services/executor/model/sampler.h"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/status_matchers.h"

namespace kvcm::executor {
namespace {

using ::testing::HasSubstr;

Sampler Make(float temperature, float top_p = 1.0f, int32_t top_k = 0, uint64_t seed = 7) {
  SamplingParams p;
  p.temperature = temperature;
  p.top_p = top_p;
  p.top_k = top_k;
  p.seed = seed;
  absl::StatusOr<Sampler> sampler = Sampler::Create(p);
  EXPECT_THAT(sampler, IsOk());
  return *sampler;
}

TEST(SamplerTest, GreedyPicksTheLowestIdOnTies) {
  const std::vector<float> logits = {0.5f, 2.0f, -1.0f, 2.0f, 1.9f};
  EXPECT_EQ(Greedy(logits), 1);
  EXPECT_EQ(Make(0).Sample(logits, 0), 1);
  EXPECT_EQ(Greedy(std::vector<float>{NAN, 3.0f, NAN}), 1);  // NaN counts as -inf
  EXPECT_EQ(Greedy(std::vector<float>{-INFINITY, -INFINITY}), 0);
}

TEST(SamplerTest, TopKOneAndTinyTopPAreGreedy) {
  std::vector<float> logits(64);
  for (size_t i = 0; i < logits.size(); ++i) logits[i] = std::sin(static_cast<float>(i));
  logits[17] = logits[40] = 3.0f;  // a tie at the top
  for (int64_t index = 0; index < 200; ++index) {
    EXPECT_EQ(Make(1.5f, 1.0f, /*top_k=*/1).Sample(logits, index), 17);
    EXPECT_EQ(Make(1.5f, /*top_p=*/1e-6f).Sample(logits, index), 17);
  }
}

TEST(SamplerTest, SamplesDependOnlyOnSeedAndTokenIndex) {
  const std::vector<float> logits = {1.0f, 1.1f, 0.9f, 1.05f, 0.3f, 0.7f};
  const Sampler a = Make(1.0f, 0.95f, 0, /*seed=*/1234);
  const Sampler b = Make(1.0f, 0.95f, 0, /*seed=*/1234);
  const Sampler c = Make(1.0f, 0.95f, 0, /*seed=*/1235);
  std::vector<int32_t> from_a, from_b, from_c;
  for (int64_t i = 0; i < 100; ++i) from_a.push_back(a.Sample(logits, i));
  for (int64_t i = 99; i >= 0; --i)
    from_b.insert(from_b.begin(), b.Sample(logits, i));  // any order
  for (int64_t i = 0; i < 100; ++i) from_c.push_back(c.Sample(logits, i));
  EXPECT_EQ(from_a, from_b);
  EXPECT_NE(from_a, from_c);
  for (int64_t i = 0; i < 100; ++i) {
    EXPECT_GE(a.UniformForTest(i), 0.0);
    EXPECT_LT(a.UniformForTest(i), 1.0);
  }
}

// With a fixed seed, the frequencies over 20000 token indices follow softmax(logits / T),
// and top-k / top-p never pick an excluded token.
TEST(SamplerTest, TemperatureDistributionSanity) {
  const std::vector<float> logits = {2.0f, 1.0f, 0.0f, -1.0f};
  const uint64_t seed = 99;
  std::printf("seed %llu\n", static_cast<unsigned long long>(seed));
  for (const float temperature : {0.5f, 1.0f, 2.0f}) {
    const Sampler sampler = Make(temperature, 1.0f, 0, seed);
    std::vector<int> counts(logits.size());
    const int n = 20000;
    for (int64_t i = 0; i < n; ++i) ++counts[static_cast<size_t>(sampler.Sample(logits, i))];
    double z = 0;
    for (const float l : logits) z += std::exp(l / temperature);
    for (size_t t = 0; t < logits.size(); ++t) {
      const double expected = std::exp(logits[t] / temperature) / z;
      const double observed = static_cast<double>(counts[t]) / n;
      // 5 standard deviations of a binomial proportion.
      const double sigma = std::sqrt(expected * (1 - expected) / n);
      EXPECT_NEAR(observed, expected, 5 * sigma + 1e-4)
          << "temperature " << temperature << " token " << t;
    }
  }
  // Higher temperature flattens: token 0 is picked less often.
  const Sampler cold = Make(0.5f, 1.0f, 0, seed);
  const Sampler hot = Make(2.0f, 1.0f, 0, seed);
  int cold0 = 0, hot0 = 0;
  for (int64_t i = 0; i < 5000; ++i) {
    cold0 += cold.Sample(logits, i) == 0;
    hot0 += hot.Sample(logits, i) == 0;
  }
  EXPECT_GT(cold0, hot0);

  // top_k = 2 only ever picks tokens 0 and 1; top_p = 0.7 at T = 1 keeps {0, 1}
  // (p0 = 0.64, p0 + p1 = 0.88).
  const Sampler top_k = Make(1.0f, 1.0f, 2, seed);
  const Sampler top_p = Make(1.0f, 0.7f, 0, seed);
  for (int64_t i = 0; i < 2000; ++i) {
    EXPECT_LT(top_k.Sample(logits, i), 2);
    EXPECT_LT(top_p.Sample(logits, i), 2);
  }
}

// Sample (candidates by buckets, or a linear-time top-k selection) draws the token
// SampleBySorting (the definition: every candidate sorted) draws, over rows of every shape a
// model gives: spread and flat, ties, -inf and NaN entries, a +inf top, the vocabulary's size,
// and every kind of top_k and top_p. The mass of the rows below spans many buckets, so draws
// cross bucket boundaries and land deep in the tail.
TEST(SamplerTest, SampleDrawsWhatSortingDraws) {
  const uint32_t seed = 20261207;
  std::printf("seed %u\n", seed);
  std::mt19937 rng(seed);
  struct Row {
    const char* what;
    std::vector<float> logits;
  };
  std::vector<Row> rows;
  auto normal_row = [&](const char* what, size_t n, float spread) {
    std::normal_distribution<float> normal(0.0f, spread);
    Row row{what, std::vector<float>(n)};
    for (float& l : row.logits) l = normal(rng);
    return row;
  };
  rows.push_back(normal_row("one token", 1, 1.0f));
  rows.push_back(normal_row("two tokens", 2, 1.0f));
  rows.push_back(normal_row("small", 17, 2.0f));
  rows.push_back(normal_row("vocabulary, model-like", 49152, 3.0f));
  rows.push_back(normal_row("vocabulary, flat", 49152, 0.05f));
  rows.push_back(normal_row("wide", 4096, 12.0f));
  {
    Row ties = normal_row("ties", 3000, 2.0f);
    for (float& l : ties.logits) l = std::round(l * 2.0f) / 2.0f;  // steps of 0.5: many ties
    rows.push_back(std::move(ties));
  }
  {
    Row holes = normal_row("-inf and NaN entries", 2000, 2.0f);
    for (size_t i = 0; i < holes.logits.size(); i += 7) holes.logits[i] = -INFINITY;
    for (size_t i = 3; i < holes.logits.size(); i += 11) holes.logits[i] = NAN;
    rows.push_back(std::move(holes));
  }
  {
    Row inf = normal_row("+inf at the top", 100, 2.0f);
    inf.logits[40] = inf.logits[60] = INFINITY;
    rows.push_back(std::move(inf));
  }
  rows.push_back(Row{"all -inf", std::vector<float>(50, -INFINITY)});
  rows.push_back(Row{"all equal", std::vector<float>(300, 1.5f)});

  int64_t draws = 0;
  for (const Row& row : rows) {
    const auto n = static_cast<int32_t>(row.logits.size());
    for (const float temperature : {0.05f, 0.7f, 1.0f, 3.0f}) {
      for (const float top_p : {1.0f, 0.95f, 0.5f, 1e-6f}) {
        for (const int32_t top_k : {0, 1, 3, 50, n - 1, n, n + 1}) {
          if (top_k < 0) continue;
          // The vocabulary's rows: the kinds of top_k once each (their reference sorts 49,152).
          if (n > 10000 && top_k != 0 && top_k != 3 && top_k != n + 1) continue;
          const Sampler sampler = Make(temperature, top_p, top_k, /*seed=*/draws);
          const int64_t indices = n > 10000 ? 2 : n > 1000 ? 10 : 40;
          for (int64_t index = 0; index < indices; ++index, ++draws) {
            ASSERT_EQ(sampler.Sample(row.logits, index), sampler.SampleBySorting(row.logits, index))
                << row.what << ": temperature " << temperature << ", top_p " << top_p << ", top_k "
                << top_k << ", token " << index;
          }
        }
      }
    }
  }
  std::printf("%lld draws\n", static_cast<long long>(draws));
}

TEST(SamplerTest, InvalidParamsAreNamed) {
  SamplingParams p;
  p.temperature = -1;
  EXPECT_THAT(Sampler::Create(p).status().message(), HasSubstr("temperature"));
  p = {};
  p.temperature = NAN;
  EXPECT_EQ(Sampler::Create(p).status().code(), absl::StatusCode::kInvalidArgument);
  p = {};
  p.top_p = 0;
  EXPECT_THAT(Sampler::Create(p).status().message(), HasSubstr("top_p"));
  p = {};
  p.top_p = 1.5f;
  EXPECT_EQ(Sampler::Create(p).status().code(), absl::StatusCode::kInvalidArgument);
  p = {};
  p.top_k = -1;
  EXPECT_THAT(Sampler::Create(p).status().message(), HasSubstr("top_k"));
  p = {};
  p.repetition_penalty = 0;
  EXPECT_THAT(Sampler::Create(p).status().message(), HasSubstr("repetition_penalty"));
  p = {};
  p.frequency_penalty = 2.5f;
  EXPECT_THAT(Sampler::Create(p).status().message(), HasSubstr("frequency_penalty"));
  p = {};
  p.presence_penalty = NAN;
  EXPECT_THAT(Sampler::Create(p).status().message(), HasSubstr("presence_penalty"));
}

TEST(SamplerTest, PenaltiesFollowVllmsDefinitions) {
  SamplingParams p;
  p.repetition_penalty = 2.0f;
  p.frequency_penalty = 0.5f;
  p.presence_penalty = 0.25f;
  std::vector<float> logits = {4.0f, -1.0f, 3.0f, 1.0f, 0.5f};
  // Prompt {0, 1, 1}; output {2, 2, 3, 9 (outside the row: ignored)}.
  const std::vector<int32_t> history = {0, 1, 1, 2, 2, 3, 9};
  ApplyPenalties(logits, history, /*prompt_len=*/3, p);
  EXPECT_FLOAT_EQ(logits[0], 2.0f);                         // repetition only: 4 / 2
  EXPECT_FLOAT_EQ(logits[1], -2.0f);                        // negative: -1 * 2, once
  EXPECT_FLOAT_EQ(logits[2], 3.0f / 2 - 0.5f * 2 - 0.25f);  // seen twice in the output
  EXPECT_FLOAT_EQ(logits[3], 1.0f / 2 - 0.5f - 0.25f);
  EXPECT_FLOAT_EQ(logits[4], 0.5f);  // never seen
  // The distribution helpers: log-probabilities sum to one, top-n sorted.
  const std::vector<TokenLogprob> top = TopLogprobs(logits, 10, 0.7f);
  ASSERT_EQ(top.size(), logits.size());
  double mass = 0;
  for (size_t i = 0; i < top.size(); ++i) {
    mass += std::exp(static_cast<double>(top[i].logprob));
    if (i > 0) {
      EXPECT_GE(top[i - 1].logprob, top[i].logprob);
    }
    EXPECT_FLOAT_EQ(top[i].logprob, LogprobOf(logits, top[i].token, 0.7f));
  }
  EXPECT_NEAR(mass, 1.0, 1e-6);
}

TEST(SamplerTest, EosIsNeverChosenBeforeMinTokensEvenWhenItIsTheArgmax) {
  // EOS (id 2) towers over every other token; id 6 is a second stop id, next most likely.
  const std::vector<float> raw = {0.1f, 0.4f, 9.0f, 0.3f, -0.5f, 0.2f, 5.0f, 0.35f};
  const std::vector<int32_t> stop_ids = {2, 6, 40 /* outside the row: ignored */};
  for (const float temperature : {0.0f, 0.7f, 2.0f}) {
    SamplingParams p;
    p.temperature = temperature;
    p.min_tokens = 5;
    p.seed = 99;
    absl::StatusOr<Sampler> sampler = Sampler::Create(p);
    ASSERT_THAT(sampler, IsOk());
    for (int64_t index = 0; index < 5; ++index) {
      for (uint64_t seed = 0; seed < 50; ++seed) {  // many draws of each index
        SamplingParams seeded = p;
        seeded.seed = seed;
        std::vector<float> logits = raw;
        ApplyMinTokens(logits, index, seeded, stop_ids);
        EXPECT_EQ(logits[2], -INFINITY);
        EXPECT_EQ(logits[6], -INFINITY);
        const int32_t token = Sampler::Create(seeded)->Sample(logits, index);
        EXPECT_NE(token, 2) << "temperature " << temperature << ", token " << index;
        EXPECT_NE(token, 6) << "temperature " << temperature << ", token " << index;
        // What is reported is the masked distribution: EOS has no probability at all.
        EXPECT_EQ(LogprobOf(logits, 2, temperature), -INFINITY);
      }
    }
    // From token min_tokens on the row is left alone: EOS is the argmax again.
    std::vector<float> logits = raw;
    ApplyMinTokens(logits, 5, p, stop_ids);
    EXPECT_EQ(logits, raw);
    if (temperature == 0.0f) {
      EXPECT_EQ(sampler->Sample(logits, 5), 2);
    }
  }
  // min_tokens 0 (the default) changes nothing, and a negative one is refused.
  std::vector<float> logits = raw;
  ApplyMinTokens(logits, 0, SamplingParams{}, stop_ids);
  EXPECT_EQ(logits, raw);
  SamplingParams negative;
  negative.min_tokens = -1;
  EXPECT_THAT(Sampler::Create(negative).status().message(), HasSubstr("min_tokens"));
}

TEST(SamplerTest, StopOnEosOrMaxTokens) {
  const int32_t max_tokens = 3;
  const std::vector<int32_t> eos = {2, 7};
  EXPECT_EQ(CheckStop(5, 1, max_tokens, eos), StopReason::kNone);
  EXPECT_EQ(CheckStop(7, 1, max_tokens, eos), StopReason::kEos);
  EXPECT_EQ(CheckStop(5, 3, max_tokens, eos), StopReason::kMaxTokens);
  EXPECT_EQ(CheckStop(2, 3, max_tokens, eos), StopReason::kEos);  // EOS wins
  EXPECT_EQ(CheckStop(2, 1, max_tokens, {}), StopReason::kNone);
}

}  // namespace
}  // namespace kvcm::executor
