// The tiny-model generator (library and kvcm-make-tiny-model binary) and end-to-end
// generation from its output: tokenizer -> paged forward -> sampler.

#include "tools/make_tiny_model/tiny_model.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "common/memory/pool_layout.h"
#include "common/safetensors/safetensors.h"
#include "common/tokenizer/tokenizer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "services/executor/model/llama_model.h"
#include "services/executor/model/sampler.h"
#include "tests/support/status_matchers.h"
#include "tests/support/subprocess.h"

#ifndef KVCM_MAKE_TINY_MODEL_PATH
#error "KVCM_MAKE_TINY_MODEL_PATH must name the kvcm-make-tiny-model binary"
#endif

namespace kvcm::executor {
namespace {

using ::testing::HasSubstr;

std::string ReadBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

class TinyModelGenerationTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<testing::TempDir> dir = testing::TempDir::Create("kvcm-tiny");
    ASSERT_THAT(dir, IsOk());
    dir_.emplace(std::move(*dir));
  }
  std::string Path(const std::string& name) const { return dir_->path() + "/" + name; }
  std::optional<testing::TempDir> dir_;
};

TEST_F(TinyModelGenerationTest, SameSeedSameBytesOtherSeedOtherWeights) {
  TinyModelOptions options;
  options.seed = 11;
  ASSERT_THAT(WriteTinyModel(Path("a"), options), IsOk());
  ASSERT_THAT(WriteTinyModel(Path("b"), options), IsOk());
  options.seed = 12;
  ASSERT_THAT(WriteTinyModel(Path("c"), options), IsOk());
  const std::string a = ReadBytes(Path("a/model.safetensors"));
  EXPECT_EQ(a, ReadBytes(Path("b/model.safetensors")));
  EXPECT_NE(a, ReadBytes(Path("c/model.safetensors")));
  EXPECT_EQ(ReadBytes(Path("a/config.json")), ReadBytes(Path("c/config.json")));
}

TEST_F(TinyModelGenerationTest, BinaryWritesALoadableModel) {
  absl::StatusOr<testing::RunResult> run =
      testing::RunProgram({KVCM_MAKE_TINY_MODEL_PATH, "--output=" + Path("m"), "--seed=5",
                           "--dtype=bf16", "--tie_word_embeddings"},
                          "", absl::Seconds(60));
  ASSERT_THAT(run, IsOk());
  EXPECT_EQ(run->exit_code, 0) << run->output;
  EXPECT_THAT(run->output, HasSubstr("seed 5"));

  auto model = LlamaModel::Load(Path("m"));
  ASSERT_THAT(model, IsOk());
  EXPECT_EQ((*model)->config().torch_dtype, "bfloat16");
  EXPECT_TRUE((*model)->config().tie_word_embeddings);
  auto file = SafetensorsFile::Open(Path("m/model.safetensors"));
  ASSERT_THAT(file, IsOk());
  EXPECT_EQ((*file)->Find("model.norm.weight")->dtype, "BF16");
  EXPECT_EQ((*file)->metadata().at("kvcm_tiny_model_seed"), "5");

  // The binary and the library agree.
  TinyModelOptions options;
  options.seed = 5;
  options.dtype = DType::kBFloat16;
  options.tie_word_embeddings = true;
  ASSERT_THAT(WriteTinyModel(Path("lib"), options), IsOk());
  EXPECT_EQ(ReadBytes(Path("m/model.safetensors")), ReadBytes(Path("lib/model.safetensors")));
}

// The same weights with transformers 5's "rope_parameters" or the old keys give the same
// logits; without the key being read (theta 10000, no scaling) they would differ.
TEST_F(TinyModelGenerationTest, BothRopeSpellingsGiveTheSameLogitsAndTheKeyMatters) {
  TinyModelOptions options;
  options.seed = 31;
  options.max_position_embeddings = 4096;
  options.rope_theta = 500000.0;
  options.rms_norm_eps = 1e-6;
  options.rope_scaling = "llama3";
  options.rope_factor = 8.0;
  options.rope_original_max_position_embeddings = 64;
  ASSERT_THAT(WriteTinyModel(Path("old"), options), IsOk());
  options.rope_parameters = true;
  ASSERT_THAT(WriteTinyModel(Path("new"), options), IsOk());
  options.rope_parameters = false;
  options.rope_theta = 10000.0;
  options.rope_scaling = "";
  ASSERT_THAT(WriteTinyModel(Path("plain"), options), IsOk());
  EXPECT_THAT(ReadBytes(Path("new/config.json")), HasSubstr("rope_parameters"));
  EXPECT_THAT(ReadBytes(Path("new/config.json")), ::testing::Not(HasSubstr("rope_scaling")));
  std::vector<int32_t> prompt;
  for (int i = 0; i < 40; ++i) prompt.push_back(3 + (i * 37) % 250);
  std::vector<std::vector<float>> logits;
  for (const char* name : {"old", "new", "plain"}) {
    auto model = LlamaModel::Load(Path(name));
    ASSERT_THAT(model, IsOk());
    auto out = (*model)->ForwardContiguous(prompt);
    ASSERT_THAT(out, IsOk());
    logits.push_back(*std::move(out));
  }
  EXPECT_EQ(logits[0], logits[1]);
  double diff = 0;
  for (size_t i = 0; i < logits[0].size(); ++i)
    diff = std::max(diff, double{std::abs(logits[0][i] - logits[2][i])});
  EXPECT_GT(diff, 1e-3) << "theta and scaling should change the logits";
}

// --architecture=qwen2: a Qwen2ForCausalLM config and a bias on q, k and v, the other
// tensors the llama model's of the same seed (one stream per tensor name).
TEST_F(TinyModelGenerationTest, Qwen2ArchitectureAddsTheQkvBiasesAndKeepsTheOtherTensors) {
  absl::StatusOr<testing::RunResult> run = testing::RunProgram(
      {KVCM_MAKE_TINY_MODEL_PATH, "--output=" + Path("qwen2"), "--architecture=qwen2"}, "",
      absl::Seconds(60));
  ASSERT_THAT(run, IsOk());
  EXPECT_EQ(run->exit_code, 0) << run->output;
  ASSERT_THAT(WriteTinyModel(Path("llama"), TinyModelOptions()), IsOk());

  auto qwen2 = LlamaModel::Load(Path("qwen2"));
  ASSERT_THAT(qwen2, IsOk());
  EXPECT_EQ((*qwen2)->config().architecture, "Qwen2ForCausalLM");
  EXPECT_TRUE((*qwen2)->config().qkv_bias);
  EXPECT_FALSE((*qwen2)->config().o_bias);
  const LlamaWeights::Layer& layer = (*qwen2)->weights().layers[0];
  EXPECT_EQ(layer.q_bias.size(), size_t{4 * 16});
  EXPECT_EQ(layer.k_bias.size(), size_t{2 * 16});
  EXPECT_EQ(layer.v_bias.size(), size_t{2 * 16});
  EXPECT_TRUE(std::any_of(layer.v_bias.begin(), layer.v_bias.end(),
                          [](float b) { return std::abs(b) > 0.1f; }));
  auto llama = LlamaModel::Load(Path("llama"));
  ASSERT_THAT(llama, IsOk());
  EXPECT_FALSE((*llama)->config().qkv_bias);
  EXPECT_EQ((*qwen2)->weights().final_norm, (*llama)->weights().final_norm);
  EXPECT_EQ((*qwen2)->weights().layers[0].input_norm, (*llama)->weights().layers[0].input_norm);

  TinyModelOptions other;
  other.architecture = "gemma";
  const absl::Status refused = WriteTinyModel(Path("x"), other);
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused;
  EXPECT_THAT(refused.message(), HasSubstr("architecture"));
  other.architecture = "qwen2";
  other.attention_bias = true;
  EXPECT_EQ(WriteTinyModel(Path("y"), other).code(), absl::StatusCode::kInvalidArgument);
}

// --architecture=qwen3: a Qwen3ForCausalLM config and per-head q/k norm weights (of
// head_dim, which need not be hidden / heads), the other tensors the llama model's.
TEST_F(TinyModelGenerationTest, Qwen3ArchitectureAddsTheQkNormsAndKeepsTheOtherTensors) {
  absl::StatusOr<testing::RunResult> run =
      testing::RunProgram({KVCM_MAKE_TINY_MODEL_PATH, "--output=" + Path("qwen3"),
                           "--architecture=qwen3", "--head_dim=24"},
                          "", absl::Seconds(60));
  ASSERT_THAT(run, IsOk());
  EXPECT_EQ(run->exit_code, 0) << run->output;
  TinyModelOptions llama_options;
  llama_options.head_dim = 24;
  ASSERT_THAT(WriteTinyModel(Path("llama"), llama_options), IsOk());

  auto qwen3 = LlamaModel::Load(Path("qwen3"));
  ASSERT_THAT(qwen3, IsOk());
  EXPECT_EQ((*qwen3)->config().architecture, "Qwen3ForCausalLM");
  EXPECT_TRUE((*qwen3)->config().qk_norm);
  EXPECT_FALSE((*qwen3)->config().qkv_bias);
  EXPECT_EQ((*qwen3)->config().head_dim, 24);
  const LlamaWeights::Layer& layer = (*qwen3)->weights().layers[0];
  EXPECT_EQ(layer.q_norm.size(), size_t{24});
  EXPECT_EQ(layer.k_norm.size(), size_t{24});
  EXPECT_NE(layer.q_norm, layer.k_norm);
  auto llama = LlamaModel::Load(Path("llama"));
  ASSERT_THAT(llama, IsOk());
  EXPECT_FALSE((*llama)->config().qk_norm);
  EXPECT_TRUE((*llama)->weights().layers[0].q_norm.empty());
  EXPECT_EQ((*qwen3)->weights().layers[0].input_norm, (*llama)->weights().layers[0].input_norm);
  // The norms change the logits.
  const std::vector<int32_t> tokens = {1, 72, 105, 33};
  absl::StatusOr<std::vector<float>> with = (*qwen3)->ForwardContiguous(tokens);
  absl::StatusOr<std::vector<float>> without = (*llama)->ForwardContiguous(tokens);
  ASSERT_THAT(with, IsOk());
  ASSERT_THAT(without, IsOk());
  double diff = 0;
  for (size_t i = 0; i < with->size(); ++i) {
    diff = std::max(diff, double{std::abs((*with)[i] - (*without)[i])});
  }
  EXPECT_GT(diff, 0.1);

  TinyModelOptions biased;
  biased.architecture = "qwen3";
  biased.attention_bias = true;  // Qwen3's attention_bias: q, k, v and o
  ASSERT_THAT(WriteTinyModel(Path("qwen3-bias"), biased), IsOk());
  auto with_bias = LlamaModel::Load(Path("qwen3-bias"));
  ASSERT_THAT(with_bias, IsOk());
  EXPECT_TRUE((*with_bias)->config().qkv_bias);
  EXPECT_TRUE((*with_bias)->config().o_bias);
}

// --attention_bias: Llama's attention_bias, a bias on q, k, v and o.
TEST_F(TinyModelGenerationTest, AttentionBiasAddsTheFourBiases) {
  absl::StatusOr<testing::RunResult> run = testing::RunProgram(
      {KVCM_MAKE_TINY_MODEL_PATH, "--output=" + Path("bias"), "--attention_bias"}, "",
      absl::Seconds(60));
  ASSERT_THAT(run, IsOk());
  EXPECT_EQ(run->exit_code, 0) << run->output;
  auto model = LlamaModel::Load(Path("bias"));
  ASSERT_THAT(model, IsOk());
  EXPECT_EQ((*model)->config().architecture, "LlamaForCausalLM");
  EXPECT_TRUE((*model)->config().qkv_bias);
  EXPECT_TRUE((*model)->config().o_bias);
  EXPECT_EQ((*model)->weights().layers[3].o_bias.size(), size_t{64});
}

TEST_F(TinyModelGenerationTest, BinaryRejectsBadFlags) {
  for (const std::vector<std::string>& args :
       {std::vector<std::string>{"--dtype=int4", "--output=" + Path("x")},
        std::vector<std::string>{"--num_kv_heads=3", "--output=" + Path("x")},
        std::vector<std::string>{}}) {
    std::vector<std::string> argv = {KVCM_MAKE_TINY_MODEL_PATH};
    argv.insert(argv.end(), args.begin(), args.end());
    absl::StatusOr<testing::RunResult> run = testing::RunProgram(argv, "", absl::Seconds(60));
    ASSERT_THAT(run, IsOk());
    EXPECT_EQ(run->exit_code, 1) << run->output;
  }
}

// How one request of Generate samples, and how many tokens it generates at most.
struct Request {
  SamplingParams sampling;
  int32_t max_tokens = 16;
};

// Generates up to `max_tokens` for each prompt, all requests batched together, through the
// paged forward: one prefill step, then one decode step per token. Stops a request on EOS.
std::vector<std::vector<int32_t>> Generate(const LlamaModel& model,
                                           const std::vector<std::vector<int32_t>>& prompts,
                                           const std::vector<Request>& params,
                                           const std::vector<int32_t>& eos_ids) {
  const int32_t block_size = 4;
  const int32_t max_blocks = 32;
  const KvCacheSpec spec = model.config().KvSpec(DType::kFloat16, block_size).value();
  PoolView pool;
  pool.spec = spec;
  pool.layout = PoolLayout::For(spec, max_blocks * static_cast<int32_t>(prompts.size())).value();
  std::vector<uint8_t> memory(static_cast<size_t>(pool.layout.total_bytes));
  pool.base = memory.data();

  const size_t n = prompts.size();
  std::vector<std::vector<int32_t>> tokens = prompts;
  std::vector<std::vector<int32_t>> generated(n);
  std::vector<bool> done(n, false);
  std::vector<int32_t> fed(n, 0);  // tokens whose K/V are in the pool
  std::vector<Sampler> samplers;
  for (const Request& p : params) samplers.push_back(Sampler::Create(p.sampling).value());
  const int32_t vocab = model.config().vocab_size;
  while (true) {
    ForwardBatch batch;
    batch.max_blocks_per_seq = max_blocks;
    std::vector<size_t> in_batch;
    for (size_t i = 0; i < n; ++i) {
      if (done[i]) continue;
      in_batch.push_back(i);
      const int32_t ctx = static_cast<int32_t>(tokens[i].size());
      batch.query_lens.push_back(ctx - fed[i]);
      batch.context_lens.push_back(ctx);
      batch.token_ids.insert(batch.token_ids.end(), tokens[i].begin() + fed[i], tokens[i].end());
      // Request i owns blocks [i * max_blocks, (i + 1) * max_blocks), in reverse order.
      for (int32_t j = 0; j < max_blocks; ++j) {
        batch.block_tables.push_back(static_cast<int32_t>(i + 1) * max_blocks - 1 - j);
      }
      fed[i] = ctx;
    }
    if (in_batch.empty()) break;
    std::vector<float> logits;
    const absl::Status s = model.Forward(batch, pool, &logits);
    EXPECT_THAT(s, IsOk());
    if (!s.ok()) break;
    for (size_t b = 0; b < in_batch.size(); ++b) {
      const size_t i = in_batch[b];
      const int32_t token = samplers[i].Sample(
          std::span<const float>(logits).subspan(b * static_cast<size_t>(vocab), vocab),
          static_cast<int64_t>(generated[i].size()));
      generated[i].push_back(token);
      tokens[i].push_back(token);
      done[i] = CheckStop(token, static_cast<int32_t>(generated[i].size()), params[i].max_tokens,
                          eos_ids) != StopReason::kNone;
    }
  }
  return generated;
}

TEST_F(TinyModelGenerationTest, GreedyGenerationIsDeterministicAndNotDegenerate) {
  TinyModelOptions options;
  std::printf("tiny model seed %llu\n", static_cast<unsigned long long>(options.seed));
  ASSERT_THAT(WriteTinyModel(Path("m"), options), IsOk());
  std::vector<std::vector<int32_t>> runs;
  std::vector<std::vector<int32_t>> by_thread_count;
  for (const int32_t threads : {1, 3}) {
    LlamaModelOptions model_options;
    model_options.num_threads = threads;
    auto model = LlamaModel::Load(Path("m"), model_options);
    ASSERT_THAT(model, IsOk());
    auto tokenizer = LoadTokenizer(Path("m"), (*model)->config().Tokenizer());
    ASSERT_THAT(tokenizer, IsOk());
    std::vector<int32_t> prompt = {(*tokenizer)->bos_id()};
    const std::vector<int32_t> text = (*tokenizer)->Encode("Hello, paged world").value();
    prompt.insert(prompt.end(), text.begin(), text.end());

    Request greedy;
    greedy.max_tokens = 24;
    const std::vector<int32_t> eos = (*model)->config().eos_token_ids;
    const std::vector<std::vector<int32_t>> out = Generate(**model, {prompt}, {greedy}, eos);
    ASSERT_EQ(out.size(), 1u);
    const std::string decoded = (*tokenizer)->Decode(out[0]).value();
    std::printf("%d threads: tokens [%s], text \"%s\"\n", threads,
                absl::StrJoin(out[0], ", ").c_str(), absl::CHexEscape(decoded).c_str());
    by_thread_count.push_back(out[0]);

    // The same prompt again on the same model: the same tokens.
    EXPECT_EQ(Generate(**model, {prompt}, {greedy}, eos)[0], out[0]);

    // Greedy over the contiguous reference picks the same tokens.
    std::vector<int32_t> ref_tokens = prompt;
    std::vector<int32_t> ref_out;
    for (size_t t = 0; t < out[0].size(); ++t) {
      const std::vector<float> logits = (*model)->ForwardContiguous(ref_tokens).value();
      const int32_t vocab = (*model)->config().vocab_size;
      const int32_t next = Greedy(std::span<const float>(logits).last(vocab));
      ref_out.push_back(next);
      ref_tokens.push_back(next);
    }
    EXPECT_EQ(ref_out, out[0]);

    const std::set<int32_t> distinct(out[0].begin(), out[0].end());
    EXPECT_GE(distinct.size(), 4u) << "greedy decoding collapsed onto a few tokens";
  }
  EXPECT_EQ(by_thread_count[0], by_thread_count[1]);
}

// A seeded sampled request gives the same tokens alone or batched with another request.
TEST_F(TinyModelGenerationTest, SampledGenerationDependsOnlyOnTheRequestSeed) {
  ASSERT_THAT(WriteTinyModel(Path("m"), TinyModelOptions()), IsOk());
  auto model = LlamaModel::Load(Path("m"));
  ASSERT_THAT(model, IsOk());
  Request a;
  a.sampling.temperature = 0.8f;
  a.sampling.top_p = 0.9f;
  a.sampling.seed = 31;
  a.max_tokens = 16;
  Request b = a;
  b.sampling.seed = 32;
  b.max_tokens = 9;
  const std::vector<int32_t> prompt_a = {1, 50, 60, 70};
  const std::vector<int32_t> prompt_b = {1, 80, 90, 100, 110, 120, 130};
  const std::vector<int32_t> no_eos;
  const auto alone = Generate(**model, {prompt_a}, {a}, no_eos);
  const auto batched = Generate(**model, {prompt_b, prompt_a}, {b, a}, no_eos);
  EXPECT_EQ(alone[0].size(), 16u);
  EXPECT_EQ(batched[0].size(), 9u);
  EXPECT_EQ(batched[1], alone[0]);
  EXPECT_NE(batched[0], std::vector<int32_t>(alone[0].begin(), alone[0].begin() + 9));
}

}  // namespace
}  // namespace kvcm::executor
