// LlamaModel::Load on folders made by the tiny-model generator, then corrupted; and the
// reference forward's basic properties (threads, shards, tied embeddings, weight dtypes).

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/safetensors/safetensors.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "services/executor/model/llama_model.h"
#include "tests/support/status_matchers.h"
#include "tests/support/subprocess.h"
#include "tools/make_tiny_model/tiny_model.h"

namespace kvcm::executor {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

class LlamaModelLoadTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<testing::TempDir> dir = testing::TempDir::Create("kvcm-model-load");
    ASSERT_THAT(dir, IsOk());
    dir_.emplace(std::move(*dir));
  }

  // Writes a tiny model into a new subfolder and returns its path.
  std::string MakeModel(const std::string& name, const TinyModelOptions& options = {}) {
    const std::string folder = dir_->path() + "/" + name;
    const absl::Status s = WriteTinyModel(folder, options);
    EXPECT_THAT(s, IsOk());
    std::printf("tiny model %s: seed %llu\n", name.c_str(),
                static_cast<unsigned long long>(options.seed));
    return folder;
  }

  // Rewrites folder/model.safetensors through `edit`, which may change the tensor list.
  void Rewrite(const std::string& folder,
               const std::function<void(std::vector<SafetensorsTensorToWrite>*)>& edit) {
    const std::string path = folder + "/model.safetensors";
    std::vector<SafetensorsTensorToWrite> tensors;
    {
      absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(path);
      ASSERT_THAT(file, IsOk());
      for (const SafetensorsTensorInfo& t : (*file)->tensors()) {
        const std::span<const std::byte> bytes = (*file)->RawBytes(t.name).value();
        tensors.push_back({t.name, t.dtype, t.shape, {bytes.begin(), bytes.end()}});
      }
    }
    edit(&tensors);
    ASSERT_THAT(WriteSafetensors(path, tensors), IsOk());
  }

  std::optional<testing::TempDir> dir_;
};

std::vector<int32_t> Prompt() { return {1, 72 + 3, 101 + 3, 108 + 3, 108 + 3, 111 + 3, 33 + 3}; }

float MaxAbsDiff(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  float m = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) m = std::max(m, std::abs(a[i] - b[i]));
  return m;
}

TEST_F(LlamaModelLoadTest, GeneratedModelLoadsAndRuns) {
  const std::string folder = MakeModel("m");
  absl::StatusOr<std::unique_ptr<LlamaModel>> model = LlamaModel::Load(folder);
  ASSERT_THAT(model, IsOk());
  const LlamaConfig& c = (*model)->config();
  EXPECT_EQ(c.vocab_size, 320);
  EXPECT_EQ(c.hidden_size, 64);
  EXPECT_EQ(c.num_hidden_layers, 4);
  EXPECT_EQ(c.num_attention_heads, 4);
  EXPECT_EQ(c.num_key_value_heads, 2);
  EXPECT_EQ(c.head_dim, 16);
  EXPECT_FALSE(c.tie_word_embeddings);

  const std::vector<int32_t> prompt = Prompt();
  absl::StatusOr<std::vector<float>> logits = (*model)->ForwardContiguous(prompt);
  ASSERT_THAT(logits, IsOk());
  ASSERT_EQ(logits->size(), prompt.size() * 320);
  double sum_sq = 0;
  for (const float v : *logits) {
    ASSERT_TRUE(std::isfinite(v));
    sum_sq += double{v} * v;
  }
  // The generator aims at logits with a standard deviation of about 2.
  const double rms = std::sqrt(sum_sq / static_cast<double>(logits->size()));
  std::printf("logit rms %.3f\n", rms);
  EXPECT_GT(rms, 0.5);
  EXPECT_LT(rms, 8.0);

  // A prefix's logits do not depend on what follows (causality).
  absl::StatusOr<std::vector<float>> prefix =
      (*model)->ForwardContiguous(std::span<const int32_t>(prompt).first(3));
  ASSERT_THAT(prefix, IsOk());
  EXPECT_EQ(*prefix, std::vector<float>(logits->begin(), logits->begin() + 3 * 320));
}

TEST_F(LlamaModelLoadTest, ResultsAreBitwiseIndependentOfThreadCount) {
  const std::string folder = MakeModel("m");
  LlamaModelOptions one;
  one.num_threads = 1;
  LlamaModelOptions many;
  many.num_threads = 5;
  auto a = LlamaModel::Load(folder, one);
  auto b = LlamaModel::Load(folder, many);
  ASSERT_TRUE(a.ok() && b.ok());
  std::vector<int32_t> tokens;
  for (int32_t i = 0; i < 40; ++i) tokens.push_back(3 + (i * 37) % 256);
  EXPECT_EQ((*a)->ForwardContiguous(tokens).value(), (*b)->ForwardContiguous(tokens).value());
}

TEST_F(LlamaModelLoadTest, ShardedFolderEqualsSingleFile) {
  TinyModelOptions sharded;
  sharded.num_shards = 3;
  const std::string one = MakeModel("one");
  const std::string three = MakeModel("three", sharded);
  ASSERT_TRUE(std::filesystem::exists(three + "/model.safetensors.index.json"));
  ASSERT_TRUE(std::filesystem::exists(three + "/model-00003-of-00003.safetensors"));
  auto a = LlamaModel::Load(one);
  auto b = LlamaModel::Load(three);
  ASSERT_THAT(a, IsOk());
  ASSERT_THAT(b, IsOk());
  EXPECT_EQ((*a)->ForwardContiguous(Prompt()).value(), (*b)->ForwardContiguous(Prompt()).value());
}

TEST_F(LlamaModelLoadTest, TiedEmbeddingsNeedNoLmHead) {
  TinyModelOptions tied;
  tied.tie_word_embeddings = true;
  const std::string folder = MakeModel("tied", tied);
  auto file = SafetensorsFile::Open(folder + "/model.safetensors");
  ASSERT_THAT(file, IsOk());
  EXPECT_EQ((*file)->Find("lm_head.weight"), nullptr);
  auto model = LlamaModel::Load(folder);
  ASSERT_THAT(model, IsOk());
  EXPECT_TRUE((*model)->config().tie_word_embeddings);
  auto logits = (*model)->ForwardContiguous(Prompt());
  ASSERT_THAT(logits, IsOk());
  // Different weights from the untied model of the same seed: different logits.
  auto untied = LlamaModel::Load(MakeModel("untied"));
  EXPECT_NE(*logits, (*untied)->ForwardContiguous(Prompt()).value());
}

TEST_F(LlamaModelLoadTest, HalfPrecisionWeightsLoadCloseToFp32) {
  auto fp32 = LlamaModel::Load(MakeModel("fp32"));
  ASSERT_THAT(fp32, IsOk());
  const std::vector<float> ref = (*fp32)->ForwardContiguous(Prompt()).value();
  float ref_max = 0;
  for (const float v : ref) ref_max = std::max(ref_max, std::abs(v));
  for (const DType dtype : {DType::kFloat16, DType::kBFloat16}) {
    TinyModelOptions options;
    options.dtype = dtype;
    const std::string name(DTypeName(dtype));
    auto model = LlamaModel::Load(MakeModel(name, options));
    ASSERT_THAT(model, IsOk());
    const float diff = MaxAbsDiff((*model)->ForwardContiguous(Prompt()).value(), ref);
    std::printf("%s weights: max |logit diff| %.4g (max |logit| %.3g)\n", name.c_str(), diff,
                ref_max);
    // Weights rounded to 11 (fp16) or 8 (bf16) significant bits.
    EXPECT_LT(diff, (dtype == DType::kFloat16 ? 0.01f : 0.1f) * ref_max);
  }
}

TEST_F(LlamaModelLoadTest, MissingTensorIsNamedWithItsShape) {
  const std::string folder = MakeModel("m");
  Rewrite(folder, [](std::vector<SafetensorsTensorToWrite>* tensors) {
    std::erase_if(*tensors, [](const SafetensorsTensorToWrite& t) {
      return t.name == "model.layers.2.mlp.up_proj.weight";
    });
  });
  const absl::Status s = LlamaModel::Load(folder).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(s.message(),
              AllOf(HasSubstr("model.layers.2.mlp.up_proj.weight"), HasSubstr("[128, 64]")));
}

TEST_F(LlamaModelLoadTest, MissingLmHeadWhenUntiedIsNamed) {
  const std::string folder = MakeModel("m");
  Rewrite(folder, [](std::vector<SafetensorsTensorToWrite>* tensors) {
    std::erase_if(*tensors,
                  [](const SafetensorsTensorToWrite& t) { return t.name == "lm_head.weight"; });
  });
  const absl::Status s = LlamaModel::Load(folder).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(s.message(), AllOf(HasSubstr("lm_head.weight"), HasSubstr("tie_word_embeddings")));
}

TEST_F(LlamaModelLoadTest, WrongShapeIsNamedWithExpectedAndActual) {
  const std::string folder = MakeModel("m");
  Rewrite(folder, [](std::vector<SafetensorsTensorToWrite>* tensors) {
    for (SafetensorsTensorToWrite& t : *tensors) {
      if (t.name == "model.layers.1.self_attn.k_proj.weight") {  // [32, 64] -> [16, 64]
        t.shape = {16, 64};
        t.data.resize(t.data.size() / 2);
      }
    }
  });
  const absl::Status s = LlamaModel::Load(folder).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), AllOf(HasSubstr("model.layers.1.self_attn.k_proj.weight"),
                                 HasSubstr("[16, 64]"), HasSubstr("[32, 64]")));
}

TEST_F(LlamaModelLoadTest, ConfigDisagreeingWithWeightsIsNamed) {
  const std::string folder = MakeModel("m");
  TinyModelOptions bigger;
  bigger.intermediate_size = 96;
  std::ofstream(folder + "/config.json", std::ios::trunc) << TinyModelConfigJson(bigger);
  const absl::Status s = LlamaModel::Load(folder).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), AllOf(HasSubstr("model.layers.0.mlp.gate_proj.weight"),
                                 HasSubstr("[128, 64]"), HasSubstr("[96, 64]")));
}

TEST_F(LlamaModelLoadTest, TruncatedWeightsAreDataLossNamingTheTensor) {
  const std::string folder = MakeModel("m");
  const std::string path = folder + "/model.safetensors";
  std::filesystem::resize_file(path, std::filesystem::file_size(path) - 100);
  const absl::Status s = LlamaModel::Load(folder).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), AllOf(HasSubstr("model.safetensors"), HasSubstr("tensor \"")));
}

TEST_F(LlamaModelLoadTest, UnsupportedWeightDtypeIsUnimplemented) {
  const std::string folder = MakeModel("m");
  Rewrite(folder, [](std::vector<SafetensorsTensorToWrite>* tensors) {
    for (SafetensorsTensorToWrite& t : *tensors) {
      if (t.name == "model.norm.weight") t.dtype = "I32";  // same byte size as F32
    }
  });
  const absl::Status s = LlamaModel::Load(folder).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(s.message(), AllOf(HasSubstr("model.norm.weight"), HasSubstr("I32")));
}

TEST_F(LlamaModelLoadTest, MissingFolderPiecesAreNotFound) {
  EXPECT_EQ(LlamaModel::Load(dir_->path() + "/absent").status().code(),
            absl::StatusCode::kNotFound);
  const std::string folder = MakeModel("m");
  std::filesystem::remove(folder + "/model.safetensors");
  const absl::Status s = LlamaModel::Load(folder).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(s.message(), HasSubstr("no .safetensors"));
}

TEST_F(LlamaModelLoadTest, ForwardContiguousRejectsBadTokens) {
  auto model = LlamaModel::Load(MakeModel("m"));
  ASSERT_THAT(model, IsOk());
  EXPECT_EQ((*model)->ForwardContiguous({}).status().code(), absl::StatusCode::kInvalidArgument);
  const std::vector<int32_t> bad = {1, 320};
  const absl::Status s = (*model)->ForwardContiguous(bad).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("tokens[1] = 320"));
}

TEST(TinyModelTest, RejectsInconsistentOptions) {
  TinyModelOptions o;
  o.num_kv_heads = 3;
  EXPECT_EQ(WriteTinyModel("unused", o).code(), absl::StatusCode::kInvalidArgument);
  o = {};
  o.dtype = DType::kFloat8E4M3;
  EXPECT_EQ(WriteTinyModel("unused", o).code(), absl::StatusCode::kInvalidArgument);
  o = {};
  o.head_dim = 7;
  EXPECT_EQ(WriteTinyModel("unused", o).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvcm::executor
