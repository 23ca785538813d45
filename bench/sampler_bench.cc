// The executor's sampler on one row of a vocabulary's logits (SmolLM2's 49,152), as every
// sampled token of a request pays it once (services/executor/model/sampler.h):
//
//   build/bench/sampler_bench                       # ratios at the end
//
//   Sample/P            Sampler::Sample: the linear-time top-k selection, or the buckets
//                       when every token is a candidate.
//   SampleBySorting/P   the definition taken literally: every candidate sorted (std::sort;
//                       partial_sort for a top_k), the baseline, in the same run.
//
// P names the parameters: openai_default (temperature 1, top_p 1, no top_k: what an OpenAI
// client that sets nothing asks for), nucleus (temperature 0.7, top_p 0.9), llama_server
// (llama-server's defaults: temperature 0.8, top_k 40, top_p 0.95). The row: normal logits
// of standard deviation 3 (a model's spread) plus 20 tokens 8 - 12 above (its likely
// continuations), seed printed; each iteration samples a new token index.

#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "bench/ratio_reporter.h"
#include "common/base/check.h"
#include "services/executor/model/sampler.h"

namespace kvcm {
namespace {

constexpr uint32_t kSeed = 49152;
constexpr size_t kVocab = 49152;

const std::vector<float>& Row() {
  static const std::vector<float> row = [] {
    std::mt19937 rng(kSeed);
    std::normal_distribution<float> normal(0.0f, 3.0f);
    std::uniform_real_distribution<float> lift(8.0f, 12.0f);
    std::vector<float> logits(kVocab);
    for (float& l : logits) l = normal(rng);
    for (int i = 0; i < 20; ++i) logits[rng() % kVocab] += lift(rng);
    return logits;
  }();
  return row;
}

executor::Sampler MakeSampler(float temperature, float top_p, int32_t top_k) {
  SamplingParams params;
  params.temperature = temperature;
  params.top_p = top_p;
  params.top_k = top_k;
  params.seed = kSeed;
  absl::StatusOr<executor::Sampler> sampler = executor::Sampler::Create(params);
  KVCM_CHECK(sampler.ok()) << sampler.status();
  return *sampler;
}

void BM_Sample(benchmark::State& state, bool by_sorting, float temperature, float top_p,
               int32_t top_k) {
  const std::vector<float>& row = Row();
  const executor::Sampler sampler = MakeSampler(temperature, top_p, top_k);
  int64_t index = 0;
  for (auto _ : state) {
    const int32_t token =
        by_sorting ? sampler.SampleBySorting(row, index) : sampler.Sample(row, index);
    benchmark::DoNotOptimize(token);
    ++index;
  }
  state.counters["units"] = 1;
}

BENCHMARK_CAPTURE(BM_Sample, openai_default, false, 1.0f, 1.0f, 0)->Name("Sample/openai_default");
BENCHMARK_CAPTURE(BM_Sample, openai_default, true, 1.0f, 1.0f, 0)
    ->Name("SampleBySorting/openai_default");
BENCHMARK_CAPTURE(BM_Sample, nucleus, false, 0.7f, 0.9f, 0)->Name("Sample/nucleus");
BENCHMARK_CAPTURE(BM_Sample, nucleus, true, 0.7f, 0.9f, 0)->Name("SampleBySorting/nucleus");
BENCHMARK_CAPTURE(BM_Sample, llama_server, false, 0.8f, 0.95f, 40)->Name("Sample/llama_server");
BENCHMARK_CAPTURE(BM_Sample, llama_server, true, 0.8f, 0.95f, 40)
    ->Name("SampleBySorting/llama_server");

}  // namespace
}  // namespace kvcm

int main(int argc, char** argv) {
  std::printf("seed %u, vocabulary %zu\n", kvcm::kSeed, kvcm::kVocab);
  kvcm::bench::RatioReporter reporter;
  reporter.AddPair("Sample/", "SampleBySorting/", 0, "token");
  return kvcm::bench::RunWithRatios(argc, argv, reporter);
}
