// The bundled real model, SmolLM2-135M-Instruct (Q4_1 GGUF), against Hugging Face
// transformers loading the same GGUF in float32: tests/reference/smollm2_reference.json,
// which tests/reference/smollm2_reference.py writes (it needs torch, which the suite does not
// install; the outputs are committed and the script regenerates them).
//
// For every reference prompt (plain, chat-formatted with and without a system message, code,
// non-Latin, ~400 tokens) all run as one batch through the paged forward (prefill in one
// step, then batched decode), kvcm must:
//   - produce exactly the reference's greedy tokens;
//   - give logits of the last prompt position within kLogitTolerance of the reference at
//     its 64 largest and at 64 ids drawn with a fixed seed, and the same log-sum-exp;
//   - give, at every greedy step, the reference's 8 largest logits within the tolerance.
// The tolerance is absolute, in logits (whose range is about ±30 here): both sides compute
// in fp32 from the same dequantized weights and differ only in the order of sums. The worst
// error seen is printed.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/base/check.h"
#include "common/memory/pool_layout.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "services/executor/llama_model.h"
#include "tests/support/real_model.h"

namespace kvcm {
namespace {

using json = nlohmann::json;

// About 4e-5 is seen; an error in the Q/K row order or a dequantization gives errors of
// whole logits.
constexpr double kLogitTolerance = 1e-3;

json LoadReference() {
  std::ifstream in(KVCM_SMOLLM2_REFERENCE);
  KVCM_CHECK(in) << "cannot read " << KVCM_SMOLLM2_REFERENCE;
  std::stringstream text;
  text << in.rdbuf();
  return json::parse(text.str());
}

class RealModelTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    const std::string path = testing::SmolLM2GgufPath();
    if (!std::filesystem::exists(path)) return;
    LlamaModelOptions options;
    options.num_threads = 2;
    absl::StatusOr<std::unique_ptr<LlamaModel>> loaded = LlamaModel::Load(path, options);
    KVCM_CHECK(loaded.ok()) << loaded.status();
    model_ = loaded->release();
  }
  static void TearDownTestSuite() {
    delete model_;
    model_ = nullptr;
  }
  void SetUp() override {
    const std::string path = testing::SmolLM2GgufPath();
    ASSERT_NE(model_, nullptr) << testing::SmolLM2Missing(path);
  }

  static LlamaModel* model_;
};
LlamaModel* RealModelTest::model_ = nullptr;

TEST_F(RealModelTest, ConfigComesFromTheGgufMetadata) {
  const LlamaConfig& c = model_->config();
  std::printf("loaded: %s\n", c.ToString().c_str());
  EXPECT_EQ(c.num_hidden_layers, 30);
  EXPECT_EQ(c.hidden_size, 576);
  EXPECT_EQ(c.intermediate_size, 1536);
  EXPECT_EQ(c.num_attention_heads, 9);
  EXPECT_EQ(c.num_key_value_heads, 3);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.vocab_size, 49152);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_DOUBLE_EQ(c.rope_theta, 100000.0);
  EXPECT_FLOAT_EQ(c.rms_norm_eps, 1e-5f);
  EXPECT_EQ(c.max_position_embeddings, 8192);
  EXPECT_EQ(c.bos_token_id, 1);
  EXPECT_EQ(c.eos_token_ids, std::vector<int32_t>{2});
  EXPECT_EQ(c.torch_dtype, "GGUF Q4_1");
}

struct Sequence {
  std::string name;
  std::vector<int32_t> tokens;
  int32_t cached = 0;
  std::vector<int32_t> blocks;
  std::vector<int32_t> greedy;
};

TEST_F(RealModelTest, GreedyTokensAndLogitsMatchTransformersThroughThePagedForward) {
  const json reference = LoadReference();
  const int32_t vocab = model_->config().vocab_size;
  const int32_t new_tokens = reference["new_tokens"].get<int32_t>();
  std::printf("reference: %s, torch %s, transformers %s\n",
              reference["generator"].get<std::string>().c_str(),
              reference["torch"].get<std::string>().c_str(),
              reference["transformers"].get<std::string>().c_str());
  const json& prompts = reference["prompts"];

  // An fp32 pool in plain memory, blocks handed out in a shuffled order (seed printed).
  constexpr int32_t kBlockSize = 16;
  constexpr uint64_t kSeed = 17;
  std::printf("block order seed %llu\n", static_cast<unsigned long long>(kSeed));
  int32_t needed = 0;
  for (const json& p : prompts) {
    needed += (static_cast<int32_t>(p["prompt_ids"].size()) + new_tokens + kBlockSize - 1) /
              kBlockSize;
  }
  PagedPool pool;
  pool.spec = model_->config().KvSpec(DType::kFloat32, kBlockSize).value();
  pool.layout = PoolLayout::For(pool.spec, needed).value();
  std::vector<uint8_t> memory(static_cast<size_t>(pool.layout.total_bytes), 0x5a);
  pool.base = memory.data();
  std::vector<int32_t> free_blocks;
  for (int32_t b = 0; b < needed; ++b) free_blocks.push_back(b);
  std::mt19937_64 rng(kSeed);
  std::shuffle(free_blocks.begin(), free_blocks.end(), rng);

  std::vector<Sequence> seqs;
  for (const json& p : prompts) {
    Sequence s;
    s.name = p["name"].get<std::string>();
    s.tokens = p["prompt_ids"].get<std::vector<int32_t>>();
    seqs.push_back(std::move(s));
  }

  // One step over every sequence's not yet computed tokens; returns the last-token logits
  // of each sequence, in order.
  auto step = [&]() {
    ForwardBatch batch;
    int32_t max_blocks = 1;
    for (Sequence& s : seqs) {
      while (static_cast<int32_t>(s.blocks.size()) * kBlockSize <
             static_cast<int32_t>(s.tokens.size())) {
        KVCM_CHECK(!free_blocks.empty());
        s.blocks.push_back(free_blocks.back());
        free_blocks.pop_back();
      }
      max_blocks = std::max(max_blocks, static_cast<int32_t>(s.blocks.size()));
    }
    batch.max_blocks_per_seq = max_blocks;
    for (Sequence& s : seqs) {
      const auto len = static_cast<int32_t>(s.tokens.size());
      batch.query_lens.push_back(len - s.cached);
      batch.context_lens.push_back(len);
      batch.token_ids.insert(batch.token_ids.end(), s.tokens.begin() + s.cached, s.tokens.end());
      for (int32_t j = 0; j < max_blocks; ++j) {
        batch.block_tables.push_back(j < static_cast<int32_t>(s.blocks.size()) ? s.blocks[j] : -1);
      }
      s.cached = len;
    }
    std::vector<float> logits;
    const absl::Status status = model_->Forward(batch, pool, &logits);
    KVCM_CHECK(status.ok()) << status;
    return logits;
  };
  auto argmax = [&](const float* row) {
    return static_cast<int32_t>(std::max_element(row, row + vocab) - row);
  };

  double worst = 0;
  std::string worst_where;
  auto compare = [&](const std::string& where, const json& ids, const json& values,
                     const float* row) {
    for (size_t i = 0; i < ids.size(); ++i) {
      const int32_t id = ids[i].get<int32_t>();
      const double error = std::abs(static_cast<double>(row[id]) - values[i].get<double>());
      if (error > worst) {
        worst = error;
        worst_where = absl::StrCat(where, " id ", id);
      }
      EXPECT_LE(error, kLogitTolerance)
          << where << ": logit of id " << id << " is " << row[id] << ", reference "
          << values[i].get<double>();
    }
  };

  // The prompts: the logits of their last position.
  std::vector<float> logits = step();
  for (size_t i = 0; i < seqs.size(); ++i) {
    const json& p = prompts[i];
    const float* row = logits.data() + i * vocab;
    compare(seqs[i].name + " last prompt position (top 64)", p["last_top_ids"],
            p["last_top_logits"], row);
    compare(seqs[i].name + " last prompt position (sampled)", p["last_sampled_ids"],
            p["last_sampled_logits"], row);
    const float max = *std::max_element(row, row + vocab);
    double sum = 0;
    for (int32_t v = 0; v < vocab; ++v) sum += std::exp(static_cast<double>(row[v]) - max);
    EXPECT_NEAR(std::log(sum) + max, p["last_logsumexp"].get<double>(), kLogitTolerance)
        << seqs[i].name;
  }
  // Greedy decoding, all sequences in each step.
  double smallest_margin = INFINITY;
  for (int32_t t = 0; t < new_tokens; ++t) {
    for (size_t i = 0; i < seqs.size(); ++i) {
      const json& ref_step = prompts[i]["steps"][static_cast<size_t>(t)];
      const float* row = logits.data() + i * vocab;
      compare(absl::StrCat(seqs[i].name, " step ", t), ref_step["ids"], ref_step["logits"], row);
      const auto& top = ref_step["logits"];
      smallest_margin = std::min(smallest_margin, top[0].get<double>() - top[1].get<double>());
      const int32_t next = argmax(row);
      seqs[i].greedy.push_back(next);
      seqs[i].tokens.push_back(next);
    }
    if (t + 1 < new_tokens) logits = step();
  }
  for (size_t i = 0; i < seqs.size(); ++i) {
    EXPECT_EQ(seqs[i].greedy, prompts[i]["greedy"].get<std::vector<int32_t>>())
        << seqs[i].name << " (" << prompts[i]["prompt_ids"].size() << " prompt tokens)";
  }
  std::printf("worst logit error %.2e (%s); smallest top-1/top-2 margin in the reference %.3f\n",
              worst, worst_where.c_str(), smallest_margin);
}

}  // namespace
}  // namespace kvcm
