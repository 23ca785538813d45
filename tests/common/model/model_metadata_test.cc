// ReadModelMetadata (common/model/model_metadata.h): the ids it takes from ReadModelConfig
// (config.json's or a GGUF file's vocab_size, bos and eos ids), and the end-of-generation
// ids it adds (generation_config.json's; a GGUF file's eot).

#include "common/model/model_metadata.h"

#include <fstream>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "common/gguf/gguf_file.h"
#include "common/gguf/gguf_writer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/status_matchers.h"
#include "tests/support/subprocess.h"

namespace kvcm {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

class ReadModelMetadataTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<testing::TempDir> dir = testing::TempDir::Create("kvcm-model-metadata");
    ASSERT_THAT(dir, IsOk());
    dir_.emplace(*std::move(dir));
  }
  void Write(const std::string& name, const std::string& text) {
    std::ofstream(dir_->path() + "/" + name) << text;
  }
  std::optional<testing::TempDir> dir_;
};

TEST_F(ReadModelMetadataTest, HuggingFaceFolder) {
  Write("config.json", R"({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2,
      "num_attention_heads": 4, "hidden_size": 32, "vocab_size": 100, "bos_token_id": 1,
      "eos_token_id": [2, 3]})");
  Write("generation_config.json", R"({"eos_token_id": [3, 7]})");
  absl::StatusOr<ModelMetadata> m = ReadModelMetadata(dir_->path());
  ASSERT_THAT(m, IsOk());
  EXPECT_FALSE(m->gguf);
  EXPECT_EQ(m->tokenizer.vocab_size, 100);
  EXPECT_EQ(m->tokenizer.bos_token_id, 1);
  EXPECT_THAT(m->tokenizer.eos_token_ids, ElementsAre(2, 3));
  EXPECT_THAT(m->eos_token_ids, ElementsAre(2, 3, 7));

  Write("config.json", R"({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2,
      "num_attention_heads": 4, "hidden_size": 32, "vocab_size": 100, "eos_token_id": 100})");
  const absl::Status s = ReadModelMetadata(dir_->path()).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("config.json: model config: key \"eos_token_id\""));
}

TEST_F(ReadModelMetadataTest, GgufFile) {
  GgufWriter writer;
  const std::vector<std::pair<std::string, GgufValue>> keys = {
      {"general.architecture", GgufValue::String("llama")},
      {"llama.block_count", GgufValue::Uint32(2)},
      {"llama.attention.head_count", GgufValue::Uint32(4)},
      {"llama.embedding_length", GgufValue::Uint32(32)},
      {"tokenizer.ggml.bos_token_id", GgufValue::Uint32(0)},
      {"tokenizer.ggml.eos_token_id", GgufValue::Uint32(1)},
      {"tokenizer.ggml.eot_token_id", GgufValue::Uint32(3)}};
  for (const auto& [key, value] : keys) ASSERT_THAT(writer.Add(key, value), IsOk()) << key;
  std::vector<GgufValue> tokens;
  for (const char* t : {"<s>", "</s>", "a", "<|eot|>"}) tokens.push_back(GgufValue::String(t));
  ASSERT_THAT(writer.Add("tokenizer.ggml.tokens",
                         GgufValue::Array(GgufValueType::kString, std::move(tokens))),
              IsOk());
  const std::string path = dir_->path() + "/tiny.gguf";
  ASSERT_THAT(writer.WriteFile(path), IsOk());
  absl::StatusOr<ModelMetadata> m = ReadModelMetadata(path);
  ASSERT_THAT(m, IsOk());
  EXPECT_TRUE(m->gguf);
  EXPECT_EQ(m->name, "tiny");
  EXPECT_EQ(m->tokenizer.vocab_size, 4);
  EXPECT_EQ(m->tokenizer.bos_token_id, 0);
  EXPECT_THAT(m->tokenizer.eos_token_ids, ElementsAre(1));
  EXPECT_THAT(m->eos_token_ids, ElementsAre(1, 3));  // the eot ends generation too
  EXPECT_EQ(m->bos_token, "<s>");
  EXPECT_EQ(m->eos_token, "</s>");
}

}  // namespace
}  // namespace kvcm
