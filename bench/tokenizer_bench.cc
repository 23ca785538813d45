// Encode throughput of kvcm's BpeTokenizer against Hugging Face `tokenizers`, one thread each,
// on the same tokenizer (the bundled SmolLM2's, from its GGUF) and the same seeded corpus
// (tests/common/tokenizer/bpe_reference.py, 5,000 strings of many scripts, code, whitespace,
// digits, emoji and special tokens).
//
// The Python side runs as a subprocess in this run (TOKENIZERS_PARALLELISM=false,
// RAYON_NUM_THREADS=1) and reports its seconds per pass over the corpus, for encode_batch and
// for one encode call per string; those are fed to Google Benchmark as manual times, so the
// ratio table compares time per token. kvcm's pass is Encode per string, with and without the
// word cache. Goal: kvcm takes at most the time of HF's encode_batch (tokens/s ratio >= 1).
//
//   build-*/bench/tokenizer_bench [--count=N] [--seed=S]

#include <benchmark/benchmark.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "bench/ratio_reporter.h"
#include "common/tokenizer/bpe_tokenizer.h"
#include "tests/support/real_model.h"
#include "tests/support/subprocess.h"

namespace kvcm {
namespace {

using Json = nlohmann::json;

struct Setup {
  std::unique_ptr<BpeTokenizer> tokenizer;
  std::vector<std::string> corpus;
  int64_t tokens = 0;  // HF's count over the corpus
  std::vector<double> hf_batch_seconds;
  std::vector<double> hf_single_seconds;
};

Setup* g_setup = nullptr;

bool Run(const std::vector<std::string>& args, const std::string& log, std::string* output) {
  testing::Subprocess::Options options;
  options.argv = {KVCM_REFERENCE_PYTHON, KVCM_BPE_REFERENCE_SCRIPT};
  options.argv.insert(options.argv.end(), args.begin(), args.end());
  options.output_path = log;
  options.env = {"TOKENIZERS_PARALLELISM=false", "RAYON_NUM_THREADS=1"};
  auto child = testing::Subprocess::Start(options);
  if (!child.ok()) {
    std::fprintf(stderr, "%s\n", child.status().ToString().c_str());
    return false;
  }
  absl::StatusOr<int> code = (*child)->Wait(absl::Minutes(10));
  *output = (*child)->Output();
  if (!code.ok() || *code != 0) {
    std::fprintf(stderr, "bpe_reference.py %s failed:\n%s\n", args[0].c_str(), output->c_str());
    return false;
  }
  return true;
}

void KvcmEncode(benchmark::State& state, bool cached) {
  const Setup& s = *g_setup;
  int64_t tokens = 0;
  for (auto _ : state) {
    tokens = 0;
    for (const std::string& text : s.corpus) {
      absl::StatusOr<std::vector<int32_t>> ids =
          cached ? s.tokenizer->Encode(text) : s.tokenizer->EncodeUncached(text);
      if (!ids.ok()) {
        state.SkipWithError(ids.status().ToString().c_str());
        return;
      }
      tokens += static_cast<int64_t>(ids->size());
      benchmark::DoNotOptimize(ids->data());
    }
  }
  if (tokens != s.tokens) state.SkipWithError("kvcm's token count differs from Hugging Face's");
  state.counters["units"] = static_cast<double>(tokens);
  state.counters["tokens/s"] = benchmark::Counter(static_cast<double>(tokens),
                                                  benchmark::Counter::kIsIterationInvariantRate);
}

// One repetition = one of the Python side's passes, as a manual time.
void HfEncode(benchmark::State& state, const std::vector<double>* seconds) {
  static size_t next[2] = {0, 0};
  size_t& i = next[seconds == &g_setup->hf_batch_seconds ? 0 : 1];
  for (auto _ : state) {
    state.SetIterationTime((*seconds)[i % seconds->size()]);
    ++i;
  }
  state.counters["units"] = static_cast<double>(g_setup->tokens);
  state.counters["tokens/s"] = benchmark::Counter(static_cast<double>(g_setup->tokens),
                                                  benchmark::Counter::kIsIterationInvariantRate);
}

}  // namespace
}  // namespace kvcm

int main(int argc, char** argv) {
  using namespace kvcm;
  int count = 5000;
  int seed = 20240917;
  std::vector<char*> rest;
  for (int i = 0; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg.rfind("--count=", 0) == 0) {
      count = std::atoi(arg.c_str() + 8);
    } else if (arg.rfind("--seed=", 0) == 0) {
      seed = std::atoi(arg.c_str() + 7);
    } else {
      rest.push_back(argv[i]);
    }
  }
  const std::string gguf = testing::SmolLM2GgufPath();
  if (!std::filesystem::exists(gguf)) {
    std::fprintf(stderr, "%s\n", testing::SmolLM2Missing(gguf).c_str());
    return 1;
  }
  absl::StatusOr<testing::TempDir> dir = testing::TempDir::Create("kvcm-tokenizer-bench");
  if (!dir.ok()) return 1;
  const std::string model = dir->path() + "/model";
  const std::string corpus_path = dir->path() + "/corpus.json";
  std::string output;
  if (!Run({"smollm2", "--gguf", gguf, "--out-dir", model, "--count", "1"}, dir->path() + "/a.log",
           &output) ||
      !Run({"corpus", "--out", corpus_path, "--count", std::to_string(count), "--seed",
            std::to_string(seed)},
           dir->path() + "/b.log", &output)) {
    return 1;
  }
  std::printf("%s", output.c_str());
  if (!Run({"bench", "--dir", model, "--corpus", corpus_path, "--repetitions", "3"},
           dir->path() + "/c.log", &output)) {
    return 1;
  }
  static Setup setup;
  const Json hf = Json::parse(output.substr(output.rfind('{')));
  setup.tokens = hf["tokens"].get<int64_t>();
  setup.hf_batch_seconds = hf["encode_batch_seconds"].get<std::vector<double>>();
  setup.hf_single_seconds = hf["encode_seconds"].get<std::vector<double>>();
  {
    std::ifstream in(corpus_path);
    std::stringstream text;
    text << in.rdbuf();
    setup.corpus = Json::parse(text.str()).get<std::vector<std::string>>();
  }
  TokenizerConfig config;
  config.vocab_size = 49152;
  auto tokenizer = BpeTokenizer::FromTokenizerJson(model + "/tokenizer.json", config);
  if (!tokenizer.ok()) {
    std::fprintf(stderr, "%s\n", tokenizer.status().ToString().c_str());
    return 1;
  }
  setup.tokenizer = std::move(*tokenizer);
  g_setup = &setup;
  size_t bytes = 0;
  for (const std::string& s : setup.corpus) bytes += s.size();
  std::printf("SmolLM2 tokenizer, corpus of %zu strings (seed %d), %zu bytes, %lld tokens\n",
              setup.corpus.size(), seed, bytes, static_cast<long long>(setup.tokens));

  benchmark::RegisterBenchmark("kvcm_encode/smollm2", KvcmEncode, true);
  benchmark::RegisterBenchmark("kvcm_encode_uncached/smollm2", KvcmEncode, false);
  benchmark::RegisterBenchmark("hf_encode_batch/smollm2", HfEncode, &setup.hf_batch_seconds)
      ->UseManualTime()
      ->Iterations(1);
  benchmark::RegisterBenchmark("hf_encode/smollm2", HfEncode, &setup.hf_single_seconds)
      ->UseManualTime()
      ->Iterations(1);

  bench::RatioReporter reporter;
  // Time per token, kvcm / HF: at most 1.0 (kvcm at least as fast; the tokens/s ratio
  // kvcm/HF is its inverse).
  const std::string hf_batch = "hf_encode_batch/smollm2/iterations:1/manual_time";
  const std::string hf_single = "hf_encode/smollm2/iterations:1/manual_time";
  for (const std::string kvcm_name : {"kvcm_encode/smollm2", "kvcm_encode_uncached/smollm2"}) {
    reporter.AddPair(kvcm_name, hf_batch, 1.0, "token");
    reporter.AddPair(kvcm_name, hf_single, 1.0, "token");
  }
  int n = static_cast<int>(rest.size());
  return bench::RunWithRatios(n, rest.data(), reporter);
}
