// A second check of kvcm's loaders, independent of its own writer: tiny random Llama and
// Qwen2 models written by Hugging Face transformers' save_pretrained (transformers 5's config
// spelling: dtype, rope_parameters, layer_types), with transformers' logits
// (tests/reference/transformers_models.py writes both; it needs torch, so they are
// committed). kvcm loads each folder and must give the same logits at every position of a
// fixed token sequence, and the same greedy continuation:
//   llama       grouped-query attention, llama3 RoPE scaling
//   llama-bias  attention_bias (q, k, v and o), tied embeddings
//   qwen2       Qwen2ForCausalLM: bias on q, k and v, tied embeddings

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "services/executor/llama_model.h"
#include "tests/support/status_matchers.h"

namespace kvcm {
namespace {

using json = nlohmann::json;

// Both sides compute in fp32 from the same weights; only the order of sums differs.
constexpr double kTolerance = 1e-4;

class TransformersModelsTest : public ::testing::TestWithParam<const char*> {
 protected:
  static json Reference() {
    std::ifstream in(std::string(KVCM_REFERENCE_DIR) + "/transformers_reference.json");
    std::stringstream text;
    text << in.rdbuf();
    return json::parse(text.str());
  }
};

TEST_P(TransformersModelsTest, LogitsAndGreedyTokensEqualTransformers) {
  const std::string name = GetParam();
  const json reference = Reference();
  const json& want = reference["models"][name];
  LlamaModelOptions options;
  options.num_threads = 1;
  absl::StatusOr<std::unique_ptr<LlamaModel>> model =
      LlamaModel::Load(std::string(KVCM_REFERENCE_DIR) + "/transformers/" + name, options);
  ASSERT_THAT(model, IsOk());
  std::printf("%s: %s\n", name.c_str(), (*model)->config().ToString().c_str());

  std::vector<int32_t> tokens = reference["prompt"].get<std::vector<int32_t>>();
  absl::StatusOr<std::vector<float>> logits = (*model)->ForwardContiguous(tokens);
  ASSERT_THAT(logits, IsOk());
  const size_t vocab = static_cast<size_t>((*model)->config().vocab_size);
  ASSERT_EQ(logits->size(), tokens.size() * vocab);
  double worst = 0;
  for (size_t t = 0; t < tokens.size(); ++t) {
    for (size_t v = 0; v < vocab; ++v) {
      worst = std::max(worst, std::abs((*logits)[t * vocab + v] -
                                       want["logits"][t][v].get<double>()));
    }
  }
  std::printf("%s: worst logit error %.2e over %zu positions (reference margin %.3f)\n",
              name.c_str(), worst, tokens.size(), want["smallest_margin"].get<double>());
  EXPECT_LE(worst, kTolerance);

  std::vector<int32_t> greedy;
  for (size_t i = 0; i < want["greedy"].size(); ++i) {
    absl::StatusOr<std::vector<float>> step = (*model)->ForwardContiguous(tokens);
    ASSERT_THAT(step, IsOk());
    const float* last = step->data() + (tokens.size() - 1) * vocab;
    const auto next = static_cast<int32_t>(std::max_element(last, last + vocab) - last);
    greedy.push_back(next);
    tokens.push_back(next);
  }
  EXPECT_EQ(greedy, want["greedy"].get<std::vector<int32_t>>());
}

INSTANTIATE_TEST_SUITE_P(Models, TransformersModelsTest,
                         ::testing::Values("llama", "llama-bias", "qwen2"),
                         [](const ::testing::TestParamInfo<const char*>& param) {
                           std::string n = param.param;
                           std::replace(n.begin(), n.end(), '-', '_');
                           return n;
                         });

}  // namespace
}  // namespace kvcm
