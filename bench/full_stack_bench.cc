// Full-stack throughput: the whole server (the real kvcm-cache-manager, kvcm-router and one
// kvcm-executor as processes, requests over HTTP) against the same model run in this
// process on the same prompts and batch (LlamaModel::Forward over a pool in plain memory,
// continuous batching by hand: one prefill of every prompt, then one decode step of every
// running sequence), in the same run, interleaved. Greedy, so both generate the same
// tokens; a sequence that draws EOS stops in both.
//
//   build/bench/full_stack_bench [--rounds 3] [--threads 2] [--batch 16] [--new-tokens 32]
//
// Prints tokens/s of each, round by round, and the ratio stack / in-process (goal >= 0.95
// with a real model, docs/PERFORMANCE.md). Three models: the tiny random one of the tests
// (a step costs microseconds, so the ratio is mostly the stack's overhead), a "small"
// random one whose steps cost milliseconds, and the bundled SmolLM2 GGUF
// (scripts/get-model.sh; skipped, saying so, when it is not there; --only NAME runs one).
// Prompts are tokenized as the router tokenizes them (the model's own tokenizer and BOS
// rule), so both sides compute the same tokens.

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "bench/server_stack.h"
#include "common/base/check.h"
#include "common/base/run_dir.h"
#include "common/memory/pool_layout.h"
#include "common/model/model_metadata.h"
#include "common/tokenizer/tokenizer.h"
#include "nlohmann/json.hpp"
#include "services/executor/model/llama_model.h"
#include "services/executor/model/sampler.h"
#include "tests/support/cache_manager_process.h"
#include "tests/support/http_client.h"
#include "tests/support/real_model.h"
#include "tests/support/subprocess.h"
#include "tools/make_tiny_model/tiny_model.h"

namespace kvcm {
namespace {

using json = nlohmann::json;
using testing::TempDir;

constexpr int32_t kBlockSize = 16;
constexpr int32_t kPromptTokens = 48;

struct Shape {
  const char* name;
  TinyModelOptions options;
  std::string gguf;  // a model file instead of a generated random model
};

std::vector<Shape> Shapes() {
  TinyModelOptions tiny;  // the tests' model
  tiny.seed = 11;
  TinyModelOptions small;
  small.vocab_size = 2048;
  small.hidden_size = 512;
  small.intermediate_size = 1536;
  small.num_layers = 8;
  small.num_heads = 8;
  small.num_kv_heads = 4;
  small.head_dim = 64;
  small.seed = 12;
  return {{"tiny", tiny, ""}, {"small", small, ""}, {"smollm2", {}, testing::SmolLM2GgufPath()}};
}

// The i-th prompt of a round: a text of its own, kPromptTokens - 1 bytes (a byte is a
// token of the random models; a real model's tokenizer makes fewer). No two share a block,
// and no round repeats another's: the stack's prefix cache would skip their prefill, which
// the model alone cannot.
std::string PromptText(int round, int i) {
  std::string text = absl::StrCat(round, "/", i, ": ");
  while (static_cast<int32_t>(text.size()) < kPromptTokens - 1) {
    text.push_back(static_cast<char>('a' + (text.size() * 7 + static_cast<size_t>(i)) % 26));
  }
  return text;
}
// As the router makes them: BOS when the tokenizer wants one, then the tokenizer's ids.
std::vector<int32_t> PromptIds(const Tokenizer& tokenizer, const std::string& text) {
  std::vector<int32_t> ids;
  if (tokenizer.add_bos() && tokenizer.bos_id() >= 0) ids.push_back(tokenizer.bos_id());
  absl::StatusOr<std::vector<int32_t>> encoded = tokenizer.Encode(text);
  KVCM_CHECK(encoded.ok()) << encoded.status();
  ids.insert(ids.end(), encoded->begin(), encoded->end());
  return ids;
}

// Generated tokens and the wall time, in this process: one prefill of every prompt, then
// decode steps of every sequence still running.
struct Run {
  int64_t tokens = 0;
  double seconds = 0;
};

Run InProcess(const executor::LlamaModel& model, const Tokenizer& tokenizer,
              const std::vector<int32_t>& eos, int round, int batch, int new_tokens) {
  PoolView pool;
  pool.spec = model.config().KvSpec(DType::kFloat32, kBlockSize).value();
  const int32_t blocks_per_seq = (kPromptTokens + new_tokens + kBlockSize - 1) / kBlockSize;
  pool.layout = PoolLayout::For(pool.spec, batch * blocks_per_seq).value();
  std::vector<uint8_t> memory(static_cast<size_t>(pool.layout.total_bytes));
  pool.base = memory.data();
  const size_t vocab = static_cast<size_t>(model.config().vocab_size);

  struct Seq {
    std::vector<int32_t> tokens;
    int32_t computed = 0;
    int32_t generated = 0;
    bool done = false;
  };
  std::vector<Seq> seqs(static_cast<size_t>(batch));
  for (int i = 0; i < batch; ++i) {
    seqs[static_cast<size_t>(i)].tokens = PromptIds(tokenizer, PromptText(round, i));
  }
  Run run;
  const absl::Time start = absl::Now();
  std::vector<float> logits;
  while (true) {
    executor::ForwardBatch step;
    step.max_blocks_per_seq = blocks_per_seq;
    std::vector<size_t> members;
    for (size_t i = 0; i < seqs.size(); ++i) {
      Seq& s = seqs[i];
      if (s.done) continue;
      const auto size = static_cast<int32_t>(s.tokens.size());
      step.token_ids.insert(step.token_ids.end(), s.tokens.begin() + s.computed, s.tokens.end());
      step.query_lens.push_back(size - s.computed);
      step.context_lens.push_back(size);
      for (int32_t b = 0; b < blocks_per_seq; ++b) {
        step.block_tables.push_back(static_cast<int32_t>(i) * blocks_per_seq + b);
      }
      members.push_back(i);
    }
    if (members.empty()) break;
    const absl::Status ran = model.Forward(step, pool, &logits);
    KVCM_CHECK(ran.ok()) << ran;
    for (size_t k = 0; k < members.size(); ++k) {
      Seq& s = seqs[members[k]];
      s.computed = static_cast<int32_t>(s.tokens.size());
      const int32_t token = executor::Greedy({logits.data() + k * vocab, vocab});
      s.tokens.push_back(token);
      ++run.tokens;
      s.done = ++s.generated >= new_tokens || std::find(eos.begin(), eos.end(), token) != eos.end();
    }
  }
  run.seconds = absl::ToDoubleSeconds(absl::Now() - start);
  return run;
}

// The same through the whole server: `batch` concurrent /generate requests.
Run FullStack(const std::string& url, int round, int batch, int new_tokens) {
  std::vector<int64_t> tokens(static_cast<size_t>(batch), 0);
  std::vector<std::thread> clients;
  const absl::Time start = absl::Now();
  for (int i = 0; i < batch; ++i) {
    clients.emplace_back([&, i] {
      const json body = {{"inputs", PromptText(round, i)},
                         {"parameters", {{"max_new_tokens", new_tokens}, {"details", true}}}};
      absl::StatusOr<testing::HttpResponse> reply =
          testing::HttpPost(url + "/generate", body.dump(), absl::Seconds(600));
      KVCM_CHECK(reply.ok() && reply->status == 200)
          << (reply.ok() ? reply->body : reply.status().ToString());
      tokens[static_cast<size_t>(i)] =
          json::parse(reply->body)["details"]["generated_tokens"].get<int64_t>();
    });
  }
  for (std::thread& t : clients) t.join();
  Run run;
  run.seconds = absl::ToDoubleSeconds(absl::Now() - start);
  for (int64_t n : tokens) run.tokens += n;
  return run;
}

int Main(int argc, char** argv) {
  const int rounds = bench::FlagValue(argc, argv, "--rounds", 3);
  const int threads = bench::FlagValue(argc, argv, "--threads", 2);
  const int batch = bench::FlagValue(argc, argv, "--batch", 16);
  const int new_tokens = bench::FlagValue(argc, argv, "--new-tokens", 32);
  std::printf(
      "full-stack throughput: %d requests of %d prompt tokens, up to %d new tokens each, "
      "greedy; executor and in-process model on %d thread(s); %d round(s)\n",
      batch, kPromptTokens, new_tokens, threads, rounds);
  absl::StatusOr<TempDir> dir = TempDir::Create("kvcm-fsb");
  KVCM_CHECK(dir.ok()) << dir.status();
  const std::string only = bench::FlagString(argc, argv, "--only", "");
  for (const Shape& shape : Shapes()) {
    if (!only.empty() && only != shape.name) continue;
    std::string model_dir = dir->path() + "/" + shape.name;
    if (!shape.gguf.empty()) {
      if (!std::filesystem::exists(shape.gguf)) {
        std::printf("\n%s: skipped, %s\n", shape.name, testing::SmolLM2Missing(shape.gguf).c_str());
        continue;
      }
      model_dir = shape.gguf;
    } else {
      KVCM_CHECK(WriteTinyModel(model_dir, shape.options).ok());
    }
    absl::StatusOr<ModelMetadata> metadata = ReadModelMetadata(model_dir);
    KVCM_CHECK(metadata.ok()) << metadata.status();
    absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer = LoadModelTokenizer(*metadata);
    KVCM_CHECK(tokenizer.ok()) << tokenizer.status();
    executor::LlamaModelOptions model_options;
    model_options.num_threads = threads;
    absl::StatusOr<std::unique_ptr<executor::LlamaModel>> model =
        executor::LlamaModel::Load(model_dir, model_options);
    KVCM_CHECK(model.ok()) << model.status();

    testing::CacheManagerOptions cm_options;
    cm_options.num_blocks = batch * ((kPromptTokens + new_tokens) / kBlockSize + 2) * 2;
    cm_options.block_size = kBlockSize;
    cm_options.layers = (*model)->config().num_hidden_layers;
    cm_options.kv_heads = (*model)->config().num_key_value_heads;
    cm_options.head_dim = (*model)->config().head_dim;
    cm_options.dtype = "fp32";
    const std::string logs = dir->path() + "/" + shape.name + "-logs";
    std::filesystem::create_directories(logs);
    const std::unique_ptr<bench::ServerStack> server = bench::StartServerStack(
        model_dir, cm_options, {"--max-input-tokens", "1024", "--max-total-tokens", "2048"},
        threads, logs);
    const std::string& url = server->url;

    // A warm-up of each (page faults, thread pools), then the interleaved rounds.
    const std::vector<int32_t>& eos = metadata->eos_token_ids;
    (void)InProcess(**model, **tokenizer, eos, 0, batch, 4);
    (void)FullStack(url, 0, batch, 4);
    std::printf("\n%-7s %5s %14s %14s %8s\n", "model", "round", "in-process t/s", "full stack t/s",
                "ratio");
    std::vector<double> ratios;
    for (int round = 1; round <= rounds; ++round) {
      const Run alone = InProcess(**model, **tokenizer, eos, round, batch, new_tokens);
      const Run stack = FullStack(url, round, batch, new_tokens);
      KVCM_CHECK(alone.tokens == stack.tokens)
          << "the stack generated " << stack.tokens << " tokens, the model alone " << alone.tokens;
      const double alone_rate = static_cast<double>(alone.tokens) / alone.seconds;
      const double stack_rate = static_cast<double>(stack.tokens) / stack.seconds;
      ratios.push_back(stack_rate / alone_rate);
      std::printf("%-7s %5d %14.0f %14.0f %7.2fx\n", shape.name, round, alone_rate, stack_rate,
                  ratios.back());
    }
    std::sort(ratios.begin(), ratios.end());
    std::printf("%-7s median ratio %.2fx (goal >= 0.95x with a real model)\n", shape.name,
                ratios[ratios.size() / 2]);
  }
  return 0;
}

}  // namespace
}  // namespace kvcm

int main(int argc, char** argv) { return kvcm::Main(argc, argv); }
