#include "common/sizing/model_config.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/sizing/kv_cache_spec.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/support/status_matchers.h"

namespace kvcm {
namespace {

using ::testing::HasSubstr;

// The KV-relevant keys of meta-llama/Llama-3.1-8B's config.json: 32 layers, 32 query heads,
// 8 KV heads (GQA), hidden 4096 -> head dim 4096 / 32 = 128, bf16.
constexpr char kLlama31_8B[] = R"json({
  "architectures": ["LlamaForCausalLM"],
  "hidden_size": 4096,
  "intermediate_size": 14336,
  "max_position_embeddings": 131072,
  "model_type": "llama",
  "num_attention_heads": 32,
  "num_hidden_layers": 32,
  "num_key_value_heads": 8,
  "rope_theta": 500000.0,
  "torch_dtype": "bfloat16",
  "vocab_size": 128256
})json";

// meta-llama/Llama-2-7b-hf style without num_key_value_heads (older configs omit it): MHA,
// 32 heads, head dim 4096 / 32 = 128, fp16.
constexpr char kLlama2_7B_NoKvHeads[] = R"json({
  "hidden_size": 4096,
  "num_attention_heads": 32,
  "num_hidden_layers": 32,
  "torch_dtype": "float16"
})json";

KvCacheSpec Spec(const std::string& json, int32_t block_size = 16,
                 std::optional<DType> dtype = std::nullopt) {
  absl::StatusOr<KvCacheSpec> spec = SpecFromHfConfig(json, block_size, dtype);
  EXPECT_THAT(spec, IsOk());
  return spec.value_or(KvCacheSpec{});
}

absl::Status Error(const std::string& json) {
  return SpecFromHfConfig(json, 16, std::nullopt).status();
}

TEST(SpecFromHfConfigTest, Llama31_8BGqa) {
  const KvCacheSpec spec = Spec(kLlama31_8B);
  EXPECT_EQ(spec, (KvCacheSpec{32, 8, 128, DType::kBFloat16, 16}));
  EXPECT_EQ(spec.BytesPerToken(), 131072);  // 2 x 32 x 8 x 128 x 2
}

TEST(SpecFromHfConfigTest, KvHeadsMustDivideQueryHeads) {
  const absl::Status status = Error(R"json({"hidden_size": 4096, "num_attention_heads": 32,
      "num_hidden_layers": 2, "num_key_value_heads": 12, "torch_dtype": "bfloat16"})json");
  EXPECT_TRUE(absl::IsInvalidArgument(status)) << status;
  EXPECT_THAT(status.message(), HasSubstr("\"num_key_value_heads\" (12) does not divide"));
}

TEST(SpecFromHfConfigTest, NotesSayWhichDTypeWasTakenAndWhatAWindowReleases) {
  // google/gemma-2-2b's KV-relevant keys: float32 weights and a 4096-token window.
  constexpr char kGemma2[] = R"json({"head_dim": 256, "hidden_size": 2304,
      "num_attention_heads": 8, "num_hidden_layers": 26, "num_key_value_heads": 4,
      "sliding_window": 4096, "torch_dtype": "float32"})json";
  std::vector<std::string> notes;
  absl::StatusOr<KvCacheSpec> spec = SpecFromHfConfig(kGemma2, 16, std::nullopt, &notes);
  ASSERT_THAT(spec, IsOk());
  EXPECT_EQ(spec->dtype, DType::kFloat32);
  ASSERT_EQ(notes.size(), 2u);
  EXPECT_THAT(notes[0], HasSubstr("KV dtype fp32 from the config's torch_dtype \"float32\""));
  EXPECT_THAT(notes[0], HasSubstr("--dtype bf16"));
  EXPECT_THAT(notes[1], HasSubstr("every layer attends within a sliding window of 4096 tokens"));
  EXPECT_THAT(notes[1], HasSubstr("holds about 258 blocks"));
  // Gemma 2 named: every other layer slides, the rest attend to the whole context.
  notes.clear();
  nlohmann::json gemma2 = nlohmann::json::parse(kGemma2);
  gemma2["model_type"] = "gemma2";
  ASSERT_THAT(SpecFromHfConfig(gemma2.dump(), 16, std::nullopt, &notes), IsOk());
  ASSERT_EQ(notes.size(), 2u);
  EXPECT_THAT(notes[1], HasSubstr("13 of 26 layers attend within a sliding window of 4096"));
  // With --dtype given nothing is chosen for the user; a null window is no window.
  notes.clear();
  ASSERT_THAT(SpecFromHfConfig(kLlama31_8B, 16, DType::kFloat16, &notes), IsOk());
  EXPECT_TRUE(notes.empty());
  ASSERT_THAT(SpecFromHfConfig(R"json({"hidden_size": 64, "num_attention_heads": 4,
      "num_hidden_layers": 2, "sliding_window": null, "torch_dtype": "bfloat16"})json",
                               16, std::nullopt, &notes),
              IsOk());
  ASSERT_EQ(notes.size(), 1u);
  EXPECT_THAT(notes[0], HasSubstr("KV dtype bf16"));
}

TEST(SpecFromHfConfigTest, MissingKvHeadsMeansMha) {
  const KvCacheSpec spec = Spec(kLlama2_7B_NoKvHeads);
  EXPECT_EQ(spec, (KvCacheSpec{32, 32, 128, DType::kFloat16, 16}));
  EXPECT_EQ(spec.BytesPerToken(), 524288);  // 2 x 32 x 32 x 128 x 2
}

TEST(SpecFromHfConfigTest, NullKvHeadsMeansMha) {
  const KvCacheSpec spec = Spec(R"({"hidden_size": 2048, "num_attention_heads": 16,
      "num_hidden_layers": 24, "num_key_value_heads": null, "torch_dtype": "float32"})");
  EXPECT_EQ(spec, (KvCacheSpec{24, 16, 128, DType::kFloat32, 16}));
}

TEST(SpecFromHfConfigTest, ExplicitHeadDimWins) {
  // Mistral-Nemo style: hidden 5120 / 32 heads would be 160, but head_dim says 128.
  const KvCacheSpec spec = Spec(R"({"hidden_size": 5120, "num_attention_heads": 32,
      "num_hidden_layers": 40, "num_key_value_heads": 8, "head_dim": 128,
      "torch_dtype": "bfloat16"})");
  EXPECT_EQ(spec, (KvCacheSpec{40, 8, 128, DType::kBFloat16, 16}));
}

TEST(SpecFromHfConfigTest, Qwen3HeadDimLargerThanHiddenOverHeads) {
  // Qwen/Qwen3-0.6B: hidden 1024 / 16 heads would be 64, but head_dim is 128; 28 layers,
  // 8 KV heads, bf16.
  const KvCacheSpec spec = Spec(R"({"architectures": ["Qwen3ForCausalLM"],
      "model_type": "qwen3", "hidden_size": 1024, "num_attention_heads": 16,
      "num_hidden_layers": 28, "num_key_value_heads": 8, "head_dim": 128,
      "sliding_window": null, "use_sliding_window": false, "torch_dtype": "bfloat16"})");
  EXPECT_EQ(spec, (KvCacheSpec{28, 8, 128, DType::kBFloat16, 16}));
  EXPECT_EQ(spec.BytesPerToken(), 114688);  // 2 x 28 x 8 x 128 x 2
}

TEST(SpecFromHfConfigTest, HeadDimFallbackNeedsExactDivision) {
  const absl::Status status = Error(R"({"hidden_size": 4000, "num_attention_heads": 24,
      "num_hidden_layers": 2, "torch_dtype": "bfloat16"})");
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("\"hidden_size\" (4000)"));
  EXPECT_THAT(status.message(), HasSubstr("\"num_attention_heads\" (24)"));
}

TEST(SpecFromHfConfigTest, HeadDimFallbackNeedsHiddenSize) {
  const absl::Status status =
      Error(R"({"num_attention_heads": 32, "num_hidden_layers": 32, "torch_dtype": "bfloat16"})");
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("missing required key \"hidden_size\""));
}

TEST(SpecFromHfConfigTest, DTypeOverrideAndBlockSize) {
  const KvCacheSpec spec = Spec(kLlama31_8B, 32, DType::kFloat8E4M3);
  EXPECT_EQ(spec, (KvCacheSpec{32, 8, 128, DType::kFloat8E4M3, 32}));
  // An override also stands in for a missing torch_dtype.
  const KvCacheSpec no_dtype =
      Spec(R"({"hidden_size": 4096, "num_attention_heads": 32, "num_hidden_layers": 32})", 16,
           DType::kFloat16);
  EXPECT_EQ(no_dtype.dtype, DType::kFloat16);
}

TEST(SpecFromHfConfigTest, NewerDTypeKey) {
  const KvCacheSpec spec = Spec(R"({"hidden_size": 4096, "num_attention_heads": 32,
      "num_hidden_layers": 32, "num_key_value_heads": 8, "dtype": "bfloat16"})");
  EXPECT_EQ(spec.dtype, DType::kBFloat16);
}

TEST(SpecFromHfConfigTest, MultimodalTextConfig) {
  const KvCacheSpec spec = Spec(R"({"model_type": "some_vlm", "torch_dtype": "bfloat16",
      "text_config": {"hidden_size": 4096, "num_attention_heads": 32, "num_hidden_layers": 48,
                      "num_key_value_heads": 8}})");
  EXPECT_EQ(spec, (KvCacheSpec{48, 8, 128, DType::kBFloat16, 16}));
}

TEST(SpecFromHfConfigTest, MissingKeyIsNamed) {
  const absl::Status status =
      Error(R"({"hidden_size": 4096, "num_attention_heads": 32, "torch_dtype": "bfloat16"})");
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("missing required key \"num_hidden_layers\""));

  const absl::Status no_heads =
      Error(R"({"hidden_size": 4096, "num_hidden_layers": 32, "torch_dtype": "bfloat16"})");
  EXPECT_THAT(no_heads.message(), HasSubstr("\"num_attention_heads\""));
}

TEST(SpecFromHfConfigTest, WrongTypeIsNamed) {
  for (const char* value : {R"("32")", "32.0", "true", "[32]", "{}"}) {
    const absl::Status status = Error(std::string(R"({"hidden_size": 4096,
        "num_attention_heads": 32, "torch_dtype": "bfloat16", "num_hidden_layers": )") +
                                      value + "}");
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << value;
    EXPECT_THAT(status.message(), HasSubstr("\"num_hidden_layers\" must be an integer")) << value;
  }
  const absl::Status dtype = Error(R"({"hidden_size": 4096, "num_attention_heads": 32,
      "num_hidden_layers": 32, "torch_dtype": 16})");
  EXPECT_THAT(dtype.message(), HasSubstr("\"torch_dtype\" must be a string"));
}

TEST(SpecFromHfConfigTest, NonPositiveOrHugeValuesAreNamed) {
  for (const char* value : {"0", "-8", "4294967296"}) {
    const absl::Status status = Error(std::string(R"({"hidden_size": 4096,
        "num_attention_heads": 32, "num_hidden_layers": 32, "torch_dtype": "bfloat16",
        "num_key_value_heads": )") + value +
                                      "}");
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << value;
    EXPECT_THAT(status.message(), HasSubstr("\"num_key_value_heads\" must be a positive")) << value;
  }
}

TEST(SpecFromHfConfigTest, DTypeProblems) {
  const absl::Status missing =
      Error(R"({"hidden_size": 4096, "num_attention_heads": 32, "num_hidden_layers": 32})");
  EXPECT_EQ(missing.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(missing.message(), HasSubstr("missing key \"torch_dtype\""));

  const absl::Status unknown = Error(R"({"hidden_size": 4096, "num_attention_heads": 32,
      "num_hidden_layers": 32, "torch_dtype": "int8"})");
  EXPECT_EQ(unknown.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(unknown.message(), HasSubstr("unsupported torch_dtype \"int8\""));
}

TEST(SpecFromHfConfigTest, MalformedJsonCarriesParserMessage) {
  const absl::Status status = Error(R"({"num_hidden_layers": 32,)");
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("malformed JSON"));
  EXPECT_THAT(status.message(), HasSubstr("parse error"));  // nlohmann's own words
  EXPECT_EQ(Error("").code(), absl::StatusCode::kInvalidArgument);
}

TEST(SpecFromHfConfigTest, TopLevelMustBeAnObject) {
  const absl::Status status = Error("[1, 2, 3]");
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("expected a JSON object"));
}

TEST(SpecFromHfConfigTest, MultiHeadLatentAttentionIsRejected) {
  const absl::Status status = Error(R"({"hidden_size": 7168, "num_attention_heads": 128,
      "num_hidden_layers": 61, "num_key_value_heads": 128, "kv_lora_rank": 512,
      "torch_dtype": "bfloat16"})");
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("kv_lora_rank"));
}

TEST(SpecFromHfConfigTest, BadBlockSizeFromCallerIsReported) {
  const absl::Status status = SpecFromHfConfig(kLlama31_8B, 0, std::nullopt).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("block_size"));
}

// A private directory under the test's temp dir, removed with its files at the end.
class SpecFromHfConfigFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = ::testing::TempDir() + "/model_config_test.XXXXXX";
    ASSERT_NE(mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
  }
  void TearDown() override {
    for (const std::string& path : files_) std::remove(path.c_str());
    rmdir((dir_ + "/subdir").c_str());
    rmdir(dir_.c_str());
  }
  std::string Write(const std::string& name, const std::string& text) {
    const std::string path = dir_ + "/" + name;
    std::ofstream(path) << text;
    files_.push_back(path);
    return path;
  }

  std::string dir_;
  std::vector<std::string> files_;
};

TEST_F(SpecFromHfConfigFileTest, ReadsFile) {
  const std::string path = Write("config.json", kLlama31_8B);
  const absl::StatusOr<KvCacheSpec> spec = SpecFromHfConfigFile(path, 16, std::nullopt);
  ASSERT_THAT(spec, IsOk());
  EXPECT_EQ(*spec, (KvCacheSpec{32, 8, 128, DType::kBFloat16, 16}));
}

TEST_F(SpecFromHfConfigFileTest, MissingFileIsNotFoundNamingThePath) {
  const std::string path = dir_ + "/no-such-config.json";
  const absl::Status status = SpecFromHfConfigFile(path, 16, std::nullopt).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(status.message(), HasSubstr(path));
}

TEST_F(SpecFromHfConfigFileTest, DirectoryIsNotFound) {
  const std::string path = dir_ + "/subdir";
  ASSERT_EQ(mkdir(path.c_str(), 0700), 0);
  const absl::Status status = SpecFromHfConfigFile(path, 16, std::nullopt).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(status.message(), HasSubstr(path));
}

TEST_F(SpecFromHfConfigFileTest, ParseErrorsArePrefixedWithThePath) {
  const std::string path = Write("broken.json", "{not json");
  const absl::Status status = SpecFromHfConfigFile(path, 16, std::nullopt).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr(path + ": model config: malformed JSON"));
}

}  // namespace
}  // namespace kvcm
