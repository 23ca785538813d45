// The table of model families (services/executor/model/architecture.h): each family is found
// by each of its names, the names are unique, an unknown name finds none, and a config naming
// a family gets that family's features and default context, so that a family is one entry
// and one file.

#include "services/executor/model/architecture.h"

#include <set>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "services/executor/model/llama_config.h"

namespace kvcm::executor {
namespace {

TEST(ArchitectureTest, EachFamilyIsFoundByEachOfItsNames) {
  std::set<std::string> hf_names, model_types, gguf_names;
  for (const Architecture& a : Architectures()) {
    EXPECT_EQ(FindArchitecture(a.hf_name), &a) << a.hf_name;
    EXPECT_EQ(FindModelType(a.model_type), &a) << a.hf_name;
    EXPECT_TRUE(hf_names.insert(std::string(a.hf_name)).second) << a.hf_name;
    EXPECT_TRUE(model_types.insert(std::string(a.model_type)).second) << a.model_type;
    if (!a.gguf_name.empty()) {
      EXPECT_EQ(FindGgufArchitecture(a.gguf_name), &a) << a.gguf_name;
      EXPECT_TRUE(gguf_names.insert(std::string(a.gguf_name)).second) << a.gguf_name;
    }
    EXPECT_NE(a.set_features, nullptr) << a.hf_name;
  }
  EXPECT_EQ(hf_names.size(), 5u);
  EXPECT_EQ(FindArchitecture("GPT2LMHeadModel"), nullptr);
  EXPECT_EQ(FindModelType("gpt2"), nullptr);
  EXPECT_EQ(FindGgufArchitecture(""), nullptr);  // Mistral's files are llama's
  EXPECT_EQ(FindGgufArchitecture("llama")->hf_name, "LlamaForCausalLM");
}

// A minimal config.json of `model_type`.
std::string Config(absl::string_view model_type) {
  return absl::StrCat(R"({"model_type": ")", model_type,
                      R"(", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
                         "num_hidden_layers": 2, "num_attention_heads": 4,
                         "num_key_value_heads": 2})");
}

TEST(ArchitectureTest, AConfigGetsItsFamilysFeaturesAndContext) {
  for (const Architecture& a : Architectures()) {
    absl::StatusOr<LlamaConfig> c = ParseLlamaConfig(Config(a.model_type));
    ASSERT_TRUE(c.ok()) << a.model_type << ": " << c.status();
    EXPECT_EQ(c->architecture, a.hf_name);
    EXPECT_EQ(c->max_position_embeddings, a.default_context) << a.model_type;
    const bool qwen2 = a.model_type == "qwen2", qwen3 = a.model_type == "qwen3",
               gemma3 = a.model_type == "gemma3_text";
    EXPECT_EQ(c->qkv_bias, qwen2) << a.model_type;
    EXPECT_EQ(c->qk_norm, qwen3 || gemma3) << a.model_type;
    EXPECT_EQ(c->sandwich_norms, gemma3) << a.model_type;
    EXPECT_EQ(c->activation == LlamaConfig::Activation::kGeluTanh, gemma3) << a.model_type;
    EXPECT_EQ(c->local_rope, gemma3) << a.model_type;
  }
}

}  // namespace
}  // namespace kvcm::executor
