// ReadModelConfig (common/model/model_config.h): a Hugging Face folder or config.json
// (transformers 4 and 5 spellings, text_config nesting) and a GGUF file's metadata, and the
// refusals of missing or malformed keys, each naming the key.

#include "common/model/model_config.h"

#include <fstream>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/gguf/gguf_file.h"
#include "common/gguf/gguf_writer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/support/status_matchers.h"
#include "tests/support/subprocess.h"

namespace kvcm {
namespace {

using Json = nlohmann::json;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

// Llama 3.1 8B's config.json, as transformers 4 writes it.
Json Llama31() {
  return Json::parse(R"({
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "tie_word_embeddings": false,
    "attention_bias": false,
    "mlp_bias": false,
    "hidden_act": "silu",
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "torch_dtype": "bfloat16"
  })");
}

class ReadModelConfigTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<testing::TempDir> dir = testing::TempDir::Create("kvcm-model-config");
    ASSERT_THAT(dir, IsOk());
    dir_.emplace(*std::move(dir));
  }

  // Writes `text` to `name` in the temp dir; returns its path.
  std::string Write(const std::string& name, const std::string& text) {
    const std::string path = dir_->path() + "/" + name;
    std::ofstream(path) << text;
    return path;
  }

  // A GGUF file of llama metadata `keys`, a 4-token vocabulary and token embeddings of
  // `embedding_type` (and an output.weight when `untied`).
  std::string WriteGguf(const std::vector<std::pair<std::string, GgufValue>>& keys,
                        GgmlType embedding_type = GgmlType::kF16, bool untied = false) {
    GgufWriter writer;
    EXPECT_THAT(writer.Add("general.architecture", GgufValue::String("llama")), IsOk());
    for (const auto& [key, value] : keys) EXPECT_THAT(writer.Add(key, value), IsOk()) << key;
    std::vector<GgufValue> tokens;
    for (const char* t : {"<s>", "</s>", "a", "b"}) tokens.push_back(GgufValue::String(t));
    EXPECT_THAT(writer.Add("tokenizer.ggml.tokens",
                           GgufValue::Array(GgufValueType::kString, std::move(tokens))),
                IsOk());
    const std::vector<float> embeddings(32 * 4, 0.25f);
    EXPECT_THAT(writer.AddTensor("token_embd.weight", {32, 4}, embedding_type, embeddings), IsOk());
    if (untied) {
      EXPECT_THAT(writer.AddTensor("output.weight", {32, 4}, GgmlType::kF32, embeddings), IsOk());
    }
    const std::string path = dir_->path() + "/model.gguf";
    EXPECT_THAT(writer.WriteFile(path), IsOk());
    return path;
  }

  std::optional<testing::TempDir> dir_;
};

// The minimal llama GGUF metadata: 2 layers, 4 heads (2 KV) of 8 over a hidden size of 32.
std::vector<std::pair<std::string, GgufValue>> GgufKeys() {
  return {{"llama.block_count", GgufValue::Uint32(2)},
          {"llama.attention.head_count", GgufValue::Uint32(4)},
          {"llama.attention.head_count_kv", GgufValue::Uint32(2)},
          {"llama.embedding_length", GgufValue::Uint32(32)},
          {"llama.feed_forward_length", GgufValue::Uint32(64)},
          {"llama.context_length", GgufValue::Uint32(256)},
          {"llama.attention.layer_norm_rms_epsilon", GgufValue::Float32(1e-5f)},
          {"llama.rope.freq_base", GgufValue::Float32(10000.0f)},
          {"tokenizer.ggml.bos_token_id", GgufValue::Uint32(0)},
          {"tokenizer.ggml.eos_token_id", GgufValue::Uint32(1)},
          {"tokenizer.ggml.eot_token_id", GgufValue::Uint32(3)}};
}

// ---- Hugging Face ---------------------------------------------------------------------------

TEST_F(ReadModelConfigTest, HuggingFaceFolder) {
  Write("config.json", Llama31().dump());
  absl::StatusOr<ModelConfig> c = ReadModelConfig(dir_->path());
  ASSERT_THAT(c, IsOk());
  EXPECT_EQ(c->format, ModelConfig::Format::kHuggingFace);
  EXPECT_EQ(c->path, dir_->path() + "/config.json");
  EXPECT_FALSE(c->text_config);
  EXPECT_THAT(c->architectures, ElementsAre("LlamaForCausalLM"));
  EXPECT_EQ(c->model_type, "llama");
  EXPECT_EQ(c->num_hidden_layers, 32);
  EXPECT_EQ(c->num_attention_heads, 32);
  EXPECT_EQ(c->num_key_value_heads, 8);
  EXPECT_EQ(c->head_dim, 128);  // hidden_size / num_attention_heads
  EXPECT_EQ(c->hidden_size, 4096);
  EXPECT_EQ(c->intermediate_size, 14336);
  EXPECT_EQ(c->vocab_size, 128256);
  EXPECT_EQ(c->max_position_embeddings, 131072);
  EXPECT_EQ(c->rms_norm_eps, 1e-5);
  EXPECT_EQ(c->rope_theta, 500000.0);
  EXPECT_EQ(c->rope.source, "rope_scaling");
  EXPECT_EQ(c->rope.type, "llama3");
  EXPECT_EQ(c->rope.factor, 8.0);
  EXPECT_EQ(c->rope.low_freq_factor, 1.0);
  EXPECT_EQ(c->rope.high_freq_factor, 4.0);
  EXPECT_EQ(c->rope.original_max_position_embeddings, 8192);
  EXPECT_TRUE(c->rope.other_keys.empty());
  EXPECT_FALSE(c->tie_word_embeddings);
  EXPECT_EQ(c->attention_bias, false);
  EXPECT_EQ(c->mlp_bias, false);
  EXPECT_EQ(c->hidden_act, "silu");
  EXPECT_EQ(c->bos_token_id, 128000);
  EXPECT_THAT(c->eos_token_ids, ElementsAre(128001, 128008, 128009));
  EXPECT_EQ(c->torch_dtype, "bfloat16");
  EXPECT_EQ(c->torch_dtype_key, "torch_dtype");
  EXPECT_FALSE(c->sliding_window.has_value());
  EXPECT_FALSE(c->kv_lora_rank.has_value());
  EXPECT_EQ(c->KeyName("head_dim"), "key \"head_dim\"");
  EXPECT_EQ(c->Where(), c->path + ": model config: ");

  // The config.json file itself reads the same.
  absl::StatusOr<ModelConfig> file = ReadModelConfig(c->path);
  ASSERT_THAT(file, IsOk());
  EXPECT_EQ(file->num_key_value_heads, 8);
}

TEST_F(ReadModelConfigTest, DefaultsWhenOptionalKeysAreAbsentOrNull) {
  const Json minimal = {{"model_type", "mistral"},  {"num_hidden_layers", 2},
                        {"num_attention_heads", 4}, {"num_key_value_heads", nullptr},
                        {"head_dim", 16},           {"sliding_window", nullptr},
                        {"rope_scaling", nullptr}};
  absl::StatusOr<ModelConfig> c = ParseHfModelConfig(minimal.dump());
  ASSERT_THAT(c, IsOk());
  EXPECT_TRUE(c->architectures.empty());
  EXPECT_EQ(c->num_key_value_heads, 4);  // MHA
  EXPECT_EQ(c->head_dim, 16);
  EXPECT_FALSE(c->hidden_size.has_value());
  EXPECT_FALSE(c->vocab_size.has_value());
  EXPECT_FALSE(c->rope_theta.has_value());
  EXPECT_EQ(c->rope.source, "");
  EXPECT_EQ(c->rope.type, "default");
  EXPECT_FALSE(c->bos_token_id.has_value());
  EXPECT_TRUE(c->eos_token_ids.empty());
  EXPECT_EQ(c->torch_dtype_key, "");
  EXPECT_FALSE(c->sliding_window.has_value());
  EXPECT_EQ(c->path, "");
  EXPECT_EQ(c->Where(), "model config: ");
}

TEST_F(ReadModelConfigTest, TransformersFiveSpellings) {
  Json config = Llama31();
  config.erase("rope_theta");
  config.erase("rope_scaling");
  config.erase("torch_dtype");
  config["dtype"] = "float16";
  config["rope_parameters"] = {{"rope_theta", 500000.0},
                               {"rope_type", "llama3"},
                               {"factor", 8.0},
                               {"original_max_position_embeddings", 8192},
                               {"attention_factor", 0.5}};
  Write("config.json", config.dump());
  absl::StatusOr<ModelConfig> c = ReadModelConfig(dir_->path());
  ASSERT_THAT(c, IsOk());
  EXPECT_EQ(c->torch_dtype, "float16");
  EXPECT_EQ(c->torch_dtype_key, "dtype");
  EXPECT_EQ(c->rope_theta, 500000.0);
  EXPECT_EQ(c->rope.source, "rope_parameters");
  EXPECT_EQ(c->rope.type, "llama3");
  EXPECT_EQ(c->rope.factor, 8.0);
  EXPECT_FALSE(c->rope.low_freq_factor.has_value());
  EXPECT_EQ(c->rope.original_max_position_embeddings, 8192);
  // Kept for the consumer to refuse, named as the file spells it.
  ASSERT_EQ(c->rope.other_keys.size(), 1u);
  EXPECT_EQ(c->rope.other_keys[0].first, "rope_parameters.attention_factor");
  EXPECT_EQ(c->rope.other_keys[0].second, "0.5");

  // Both spellings: they must agree (defaults applied).
  config["rope_parameters"].erase("attention_factor");
  config["rope_scaling"] = {{"rope_type", "llama3"},
                            {"factor", 8.0},
                            {"low_freq_factor", 1.0},
                            {"original_max_position_embeddings", 8192}};
  config["rope_theta"] = 500000.0;
  EXPECT_THAT(ParseHfModelConfig(config.dump()), IsOk());
  config["rope_scaling"]["factor"] = 4.0;
  absl::Status disagree = ParseHfModelConfig(config.dump()).status();
  EXPECT_EQ(disagree.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(disagree.message(), HasSubstr("\"rope_scaling\" and \"rope_parameters\" disagree"));
  config["rope_scaling"] = nullptr;
  config["rope_theta"] = 10000.0;
  disagree = ParseHfModelConfig(config.dump()).status();
  EXPECT_EQ(disagree.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(disagree.message(), HasSubstr("\"rope_parameters.rope_theta\""));

  // Per layer type (Gemma 3's shape): each layer type's set, with its own theta.
  config.erase("rope_theta");
  config["rope_parameters"] = {
      {"full_attention", {{"rope_theta", 1e6}, {"rope_type", "linear"}, {"factor", 8.0}}},
      {"sliding_attention", {{"rope_theta", 1e4}, {"beta_fast", 32}}}};
  absl::StatusOr<ModelConfig> per_layer = ParseHfModelConfig(config.dump());
  ASSERT_THAT(per_layer, IsOk());
  EXPECT_EQ(per_layer->rope.per_layer_type, "full_attention");
  ASSERT_EQ(per_layer->rope_per_layer_type.size(), 2u);
  const auto& [full_type, full] = per_layer->rope_per_layer_type[0];
  EXPECT_EQ(full_type, "full_attention");
  EXPECT_EQ(full.source, "rope_parameters.full_attention");
  EXPECT_EQ(full.theta, 1e6);
  EXPECT_EQ(full.type, "linear");
  EXPECT_EQ(full.factor, 8.0);
  const auto& [sliding_type, sliding] = per_layer->rope_per_layer_type[1];
  EXPECT_EQ(sliding_type, "sliding_attention");
  EXPECT_EQ(sliding.theta, 1e4);
  EXPECT_EQ(sliding.type, "default");
  ASSERT_EQ(sliding.other_keys.size(), 1u);
  EXPECT_EQ(sliding.other_keys[0].first, "rope_parameters.sliding_attention.beta_fast");
  // A malformed set is refused naming it.
  config["rope_parameters"]["sliding_attention"] = 3;
  absl::Status bad = ParseHfModelConfig(config.dump()).status();
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.message(), HasSubstr("\"rope_parameters.sliding_attention\" must be an object"));
  config["rope_parameters"]["sliding_attention"] = {{"rope_theta", -1}};
  bad = ParseHfModelConfig(config.dump()).status();
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.message(), HasSubstr("rope_parameters.sliding_attention.rope_theta"));
}

TEST_F(ReadModelConfigTest, GemmaKeys) {
  Json config = Llama31();
  absl::StatusOr<ModelConfig> c = ParseHfModelConfig(config.dump());
  ASSERT_THAT(c, IsOk());
  EXPECT_FALSE(c->rope_local_base_freq.has_value());
  EXPECT_FALSE(c->query_pre_attn_scalar.has_value());
  EXPECT_FALSE(c->attn_logit_softcapping.has_value());
  EXPECT_FALSE(c->final_logit_softcapping.has_value());
  EXPECT_FALSE(c->use_bidirectional_attention.has_value());
  EXPECT_FALSE(c->hidden_activation.has_value());
  EXPECT_TRUE(c->tie_word_embeddings_given);

  config["rope_local_base_freq"] = 10000;
  config["query_pre_attn_scalar"] = 256;
  config["attn_logit_softcapping"] = nullptr;
  config["final_logit_softcapping"] = 30.0;
  config["use_bidirectional_attention"] = false;
  config["hidden_activation"] = "gelu_pytorch_tanh";
  config.erase("tie_word_embeddings");
  c = ParseHfModelConfig(config.dump());
  ASSERT_THAT(c, IsOk());
  EXPECT_EQ(c->rope_local_base_freq, 10000.0);
  EXPECT_EQ(c->query_pre_attn_scalar, 256.0);
  EXPECT_FALSE(c->attn_logit_softcapping.has_value());  // null: none
  EXPECT_EQ(c->final_logit_softcapping, 30.0);
  EXPECT_EQ(c->use_bidirectional_attention, false);
  EXPECT_EQ(c->hidden_activation, "gelu_pytorch_tanh");
  EXPECT_FALSE(c->tie_word_embeddings_given);

  const std::pair<const char*, Json> bad[] = {
      {"rope_local_base_freq", -1.0},     {"query_pre_attn_scalar", "256"},
      {"attn_logit_softcapping", 0.0},    {"final_logit_softcapping", "30"},
      {"use_bidirectional_attention", 1}, {"hidden_activation", 3}};
  for (const auto& [key, value] : bad) {
    SCOPED_TRACE(key);
    Json broken = config;
    broken[key] = value;
    const absl::Status s = ParseHfModelConfig(broken.dump()).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(s.message(), HasSubstr(absl::StrCat("key \"", key, "\"")));
  }
}

TEST_F(ReadModelConfigTest, TextConfigNesting) {
  // A multimodal config: the language model's hyperparameters under text_config, the
  // architecture and (here) the dtype at the top level.
  const Json config = {{"architectures", {"Llama4ForConditionalGeneration"}},
                       {"model_type", "llama4"},
                       {"torch_dtype", "bfloat16"},
                       {"vision_config", {{"num_hidden_layers", 34}, {"hidden_size", 1408}}},
                       {"text_config",
                        {{"model_type", "llama4_text"},
                         {"num_hidden_layers", 48},
                         {"num_attention_heads", 40},
                         {"num_key_value_heads", 8},
                         {"head_dim", 128},
                         {"hidden_size", 5120},
                         {"vocab_size", 202048},
                         {"rope_theta", 500000.0},
                         {"eos_token_id", {200001, 200007, 200008}},
                         {"attention_chunk_size", 8192}}}};
  Write("config.json", config.dump());
  absl::StatusOr<ModelConfig> c = ReadModelConfig(dir_->path());
  ASSERT_THAT(c, IsOk());
  EXPECT_TRUE(c->text_config);
  EXPECT_THAT(c->architectures, ElementsAre("Llama4ForConditionalGeneration"));
  EXPECT_EQ(c->model_type, "llama4");
  EXPECT_EQ(c->num_hidden_layers, 48);
  EXPECT_EQ(c->num_attention_heads, 40);
  EXPECT_EQ(c->num_key_value_heads, 8);
  EXPECT_EQ(c->head_dim, 128);
  EXPECT_EQ(c->vocab_size, 202048);
  EXPECT_EQ(c->rope_theta, 500000.0);
  EXPECT_THAT(c->eos_token_ids, ElementsAre(200001, 200007, 200008));
  EXPECT_EQ(c->torch_dtype, "bfloat16");  // from the top level
  EXPECT_EQ(c->KeyName("head_dim"), "key \"text_config.head_dim\"");

  // A nested key that is malformed is refused naming it.
  Json bad = config;
  bad["text_config"]["num_key_value_heads"] = "eight";
  const absl::Status s = ParseHfModelConfig(bad.dump()).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("\"num_key_value_heads\" must be an integer"));
}

TEST_F(ReadModelConfigTest, MissingOrInvalidKeysAreRefusedNamingTheKey) {
  struct Case {
    const char* key;
    Json value;  // null: the key removed
    const char* expect;
  };
  const Case cases[] = {
      {"num_hidden_layers", nullptr, "missing required key \"num_hidden_layers\""},
      {"num_attention_heads", nullptr, "missing required key \"num_attention_heads\""},
      {"num_hidden_layers", "32", "key \"num_hidden_layers\" must be an integer"},
      {"num_hidden_layers", 0, "key \"num_hidden_layers\" must be a positive 32-bit integer"},
      {"num_key_value_heads", 12, "\"num_key_value_heads\" (12) does not divide"},
      {"hidden_size", 4001, "\"hidden_size\" (4001) is not divisible"},
      {"vocab_size", 4294967296, "key \"vocab_size\" must be a positive 32-bit integer"},
      {"rms_norm_eps", "small", "key \"rms_norm_eps\" must be a number"},
      {"rope_theta", -1.0, "key \"rope_theta\" must be a positive number"},
      {"rope_scaling", 5, "key \"rope_scaling\" must be an object or null"},
      {"rope_scaling", Json{{"factor", 8.0}}, "\"rope_scaling\" has no string \"rope_type\""},
      {"tie_word_embeddings", 1, "key \"tie_word_embeddings\" must be true or false"},
      {"hidden_act", 3, "key \"hidden_act\" must be a string"},
      {"architectures", Json::array(), "key \"architectures\" must be a non-empty list"},
      {"bos_token_id", Json::array({1, 2}), "key \"bos_token_id\" must be a single id"},
      {"eos_token_id", 128256, "key \"eos_token_id\" must be a token id in [0, vocab_size=128256)"},
      {"torch_dtype", 16, "key \"torch_dtype\" must be a string"},
      {"sliding_window", "4k", "key \"sliding_window\" must be a window length"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.key);
    Json config = Llama31();
    if (c.value.is_null()) {
      config.erase(c.key);
    } else {
      config[c.key] = c.value;
    }
    const absl::Status s = ParseHfModelConfig(config.dump()).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(s.message(), HasSubstr(c.expect));
  }
  // Without head_dim, hidden_size is required.
  Json no_hidden = Llama31();
  no_hidden.erase("hidden_size");
  EXPECT_THAT(ParseHfModelConfig(no_hidden.dump()).status().message(),
              HasSubstr("missing required key \"hidden_size\""));
}

TEST_F(ReadModelConfigTest, MalformedOrMissingFiles) {
  const std::string bad = Write("config.json", "{\"num_hidden_layers\": ");
  absl::Status s = ReadModelConfig(bad).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr(bad + ": model config: malformed JSON"));
  s = ReadModelConfig(dir_->path()).status();  // the folder: its config.json
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(ParseHfModelConfig("[1]").status().message(), HasSubstr("expected a JSON object"));

  const std::string missing = dir_->path() + "/sub";
  s = ReadModelConfig(missing).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(s.message(), HasSubstr(missing));
}

TEST_F(ReadModelConfigTest, KeptFeaturesForConsumersToJudge) {
  Json config = Llama31();
  config["sliding_window"] = 4096;
  config["kv_lora_rank"] = 512;
  config["use_sliding_window"] = false;
  config["mlp_bias"] = true;
  config["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}, {"beta_fast", 32}};
  absl::StatusOr<ModelConfig> c = ParseHfModelConfig(config.dump());
  ASSERT_THAT(c, IsOk());
  EXPECT_EQ(c->sliding_window, 4096);
  EXPECT_EQ(c->sliding_window_key, "sliding_window");
  EXPECT_EQ(c->kv_lora_rank, 512);
  EXPECT_EQ(c->use_sliding_window, false);
  EXPECT_EQ(c->mlp_bias, true);
  EXPECT_EQ(c->rope.type, "yarn");
  ASSERT_EQ(c->rope.other_keys.size(), 1u);
  EXPECT_EQ(c->rope.other_keys[0].first, "rope_scaling.beta_fast");
  config["sliding_window"] = false;  // Qwen2-style "no window"
  c = ParseHfModelConfig(config.dump());
  ASSERT_THAT(c, IsOk());
  EXPECT_FALSE(c->sliding_window.has_value());
}

// ---- GGUF -------------------------------------------------------------------------------------

// LayerWindows: each layer's window as transformers decides it per family.
TEST_F(ReadModelConfigTest, LayerWindowsFollowEachFamilysRule) {
  auto windows_of = [](const Json& config) {
    absl::StatusOr<ModelConfig> c = ParseHfModelConfig(config.dump());
    EXPECT_THAT(c, IsOk());
    if (!c.ok()) return absl::StatusOr<std::vector<int32_t>>(c.status());
    return LayerWindows(*c);
  };
  auto windows = [&](const Json& config) {
    absl::StatusOr<std::vector<int32_t>> w = windows_of(config);
    EXPECT_THAT(w, IsOk());
    return w.value_or(std::vector<int32_t>());
  };
  Json base = {{"num_hidden_layers", 6}, {"num_attention_heads", 4}, {"head_dim", 8}};
  // No window anywhere: every layer full.
  EXPECT_THAT(windows(base), ElementsAre(0, 0, 0, 0, 0, 0));

  // Mistral: every layer, whatever layer_types says (transformers' MistralConfig ignores it).
  Json mistral = base;
  mistral["model_type"] = "mistral";
  mistral["sliding_window"] = 4096;
  mistral["layer_types"] = Json::array();
  for (int i = 0; i < 6; ++i) mistral["layer_types"].push_back("full_attention");
  EXPECT_THAT(windows(mistral), ElementsAre(4096, 4096, 4096, 4096, 4096, 4096));
  // The family from the architecture when model_type is absent.
  mistral.erase("model_type");
  mistral["architectures"] = {"MistralForCausalLM"};
  EXPECT_THAT(windows(mistral), ElementsAre(4096, 4096, 4096, 4096, 4096, 4096));

  // Qwen2: only with use_sliding_window, from max_window_layers on (default 28).
  Json qwen2 = base;
  qwen2["model_type"] = "qwen2";
  qwen2["sliding_window"] = 32768;
  EXPECT_THAT(windows(qwen2), ElementsAre(0, 0, 0, 0, 0, 0));
  qwen2["use_sliding_window"] = true;
  EXPECT_THAT(windows(qwen2), ElementsAre(0, 0, 0, 0, 0, 0));
  qwen2["max_window_layers"] = 4;
  EXPECT_THAT(windows(qwen2), ElementsAre(0, 0, 0, 0, 32768, 32768));
  qwen2["max_window_layers"] = -1;
  EXPECT_EQ(ParseHfModelConfig(qwen2.dump()).status().code(), absl::StatusCode::kInvalidArgument);

  // Gemma 3 (text_config nesting): every sixth layer full, or sliding_window_pattern's.
  Json gemma3 = {{"architectures", {"Gemma3ForConditionalGeneration"}},
                 {"model_type", "gemma3"},
                 {"text_config", base}};
  gemma3["text_config"]["sliding_window"] = 1024;
  EXPECT_THAT(windows(gemma3), ElementsAre(1024, 1024, 1024, 1024, 1024, 0));
  gemma3["text_config"]["sliding_window_pattern"] = 3;
  EXPECT_THAT(windows(gemma3), ElementsAre(1024, 1024, 0, 1024, 1024, 0));
  // layer_types, when written, say it directly.
  gemma3["text_config"]["layer_types"] = {"sliding_attention", "full_attention",
                                          "sliding_attention", "sliding_attention",
                                          "full_attention",    "sliding_attention"};
  EXPECT_THAT(windows(gemma3), ElementsAre(1024, 0, 1024, 1024, 0, 1024));

  // Refusals name the key: an unknown layer type, a list of the wrong length, a sliding
  // layer without a window.
  Json chunked = gemma3;
  chunked["text_config"]["layer_types"][2] = "chunked_attention";
  const absl::StatusOr<std::vector<int32_t>> unknown = windows_of(chunked);
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(unknown.status().message(),
              HasSubstr("key \"text_config.layer_types\"[2] \"chunked_attention\""));
  Json short_list = gemma3;
  short_list["text_config"]["layer_types"] = {"full_attention"};
  const absl::Status length = ParseHfModelConfig(short_list.dump()).status();
  EXPECT_EQ(length.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(length.message(), HasSubstr("\"layer_types\" must be a list of 6 strings"));
  Json no_window = gemma3;
  no_window["text_config"].erase("sliding_window");
  const absl::StatusOr<std::vector<int32_t>> missing = windows_of(no_window);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(missing.status().message(), HasSubstr("no sliding_window"));
}

TEST_F(ReadModelConfigTest, GgufMetadata) {
  const std::string path = WriteGguf(GgufKeys());
  absl::StatusOr<ModelConfig> c = ReadModelConfig(path);
  ASSERT_THAT(c, IsOk());
  EXPECT_EQ(c->format, ModelConfig::Format::kGguf);
  EXPECT_EQ(c->path, path);
  EXPECT_EQ(c->model_type, "llama");
  EXPECT_TRUE(c->architectures.empty());
  EXPECT_EQ(c->num_hidden_layers, 2);
  EXPECT_EQ(c->num_attention_heads, 4);
  EXPECT_EQ(c->num_key_value_heads, 2);
  EXPECT_EQ(c->head_dim, 8);  // embedding_length / head_count
  EXPECT_EQ(c->hidden_size, 32);
  EXPECT_EQ(c->intermediate_size, 64);
  EXPECT_EQ(c->max_position_embeddings, 256);
  EXPECT_EQ(c->vocab_size, 4);  // the number of tokens
  EXPECT_FLOAT_EQ(static_cast<float>(*c->rms_norm_eps), 1e-5f);
  EXPECT_EQ(c->rope_theta, 10000.0);
  EXPECT_EQ(c->rope.type, "default");
  EXPECT_EQ(c->bos_token_id, 0);
  EXPECT_THAT(c->eos_token_ids, ElementsAre(1));
  EXPECT_EQ(c->eot_token_id, 3);
  EXPECT_TRUE(c->tie_word_embeddings);  // no output.weight
  EXPECT_EQ(c->gguf_embedding_type, "F16");
  EXPECT_EQ(c->gguf_weight_type, "F16");
  EXPECT_FALSE(c->gguf_rope_freqs);
  EXPECT_EQ(c->torch_dtype, "");
  EXPECT_EQ(c->KeyName("head_dim"), "GGUF key \"llama.attention.key_length\"");
  EXPECT_EQ(c->KeyName("bos_token_id"), "GGUF key \"tokenizer.ggml.bos_token_id\"");
  EXPECT_EQ(c->Where(), path + ": ");

  // The file opened by the caller reads the same.
  absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::Open(path);
  ASSERT_THAT(file, IsOk());
  absl::StatusOr<ModelConfig> again = ModelConfigFromGguf(**file);
  ASSERT_THAT(again, IsOk());
  EXPECT_EQ(again->head_dim, 8);
}

TEST_F(ReadModelConfigTest, GgufOptionalKeys) {
  std::vector<std::pair<std::string, GgufValue>> keys = GgufKeys();
  keys.emplace_back("llama.attention.key_length", GgufValue::Uint32(16));
  keys.emplace_back("llama.attention.value_length", GgufValue::Uint32(16));
  keys.emplace_back("llama.rope.dimension_count", GgufValue::Uint32(16));
  keys.emplace_back("llama.vocab_size", GgufValue::Uint32(4));
  keys.emplace_back("llama.rope.scaling.type", GgufValue::String("linear"));
  keys.emplace_back("llama.rope.scaling.factor", GgufValue::Float32(4.0f));
  keys.emplace_back("llama.attention.sliding_window", GgufValue::Uint32(128));
  absl::StatusOr<ModelConfig> c = ReadModelConfig(WriteGguf(keys, GgmlType::kBF16, true));
  ASSERT_THAT(c, IsOk());
  EXPECT_EQ(c->head_dim, 16);
  EXPECT_EQ(c->value_head_dim, 16);
  EXPECT_EQ(c->rope_dimension_count, 16);
  EXPECT_EQ(c->rope.source, "llama.rope.scaling.type");
  EXPECT_EQ(c->rope.type, "linear");
  EXPECT_EQ(c->rope.factor, 4.0);
  EXPECT_EQ(c->sliding_window, 128);
  EXPECT_EQ(c->sliding_window_key, "llama.attention.sliding_window");
  EXPECT_FALSE(c->tie_word_embeddings);
  EXPECT_EQ(c->gguf_embedding_type, "BF16");
}

TEST_F(ReadModelConfigTest, GgufMissingOrInvalidKeysAreRefusedNamingTheKey) {
  struct Case {
    const char* key;
    std::optional<GgufValue> value;  // nullopt: the key removed
    const char* expect;
  };
  const Case cases[] = {
      {"llama.block_count", std::nullopt, "GGUF key \"llama.block_count\" is missing"},
      {"llama.attention.head_count", std::nullopt,
       "GGUF key \"llama.attention.head_count\" is missing"},
      {"llama.block_count", GgufValue::Int32(0), "GGUF key \"llama.block_count\" must be in [1"},
      {"llama.attention.head_count_kv", GgufValue::Uint32(3),
       "GGUF key \"llama.attention.head_count_kv\" (3) does not divide"},
      {"llama.embedding_length", GgufValue::Uint32(30),
       "GGUF key \"llama.embedding_length\" (30) is not divisible"},
      {"llama.embedding_length", std::nullopt, "GGUF key \"llama.embedding_length\" is missing"},
      {"llama.rope.freq_base", GgufValue::Float32(-1.0f),
       "GGUF key \"llama.rope.freq_base\" must be a positive number"},
      {"tokenizer.ggml.bos_token_id", GgufValue::Uint32(4),
       "GGUF key \"tokenizer.ggml.bos_token_id\" (4) is outside the vocabulary of 4"},
      {"tokenizer.ggml.eot_token_id", GgufValue::Uint32(9),
       "GGUF key \"tokenizer.ggml.eot_token_id\" (9) is outside the vocabulary"},
      {"llama.block_count", GgufValue::String("two"), "llama.block_count"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.key);
    std::vector<std::pair<std::string, GgufValue>> keys;
    for (auto& [key, value] : GgufKeys()) {
      if (key != c.key) keys.emplace_back(key, value);
    }
    if (c.value.has_value()) keys.emplace_back(c.key, *c.value);
    const std::string path = WriteGguf(keys);
    const absl::Status s = ReadModelConfig(path).status();
    EXPECT_FALSE(s.ok());
    EXPECT_THAT(s.message(), HasSubstr(path));
    EXPECT_THAT(s.message(), HasSubstr(c.expect));
  }
}

// ---- Where generation ends ------------------------------------------------------------------

// The ids, or a failure naming the error.
std::vector<int32_t> EndIds(const std::string& path) {
  absl::StatusOr<std::vector<int32_t>> ids = ReadEndTokenIds(path);
  EXPECT_THAT(ids, IsOk());
  return ids.ok() ? *ids : std::vector<int32_t>{};
}

TEST_F(ReadModelConfigTest, EndTokenIdsJoinConfigAndGenerationConfigWithoutRepeats) {
  Write("config.json", Llama31().dump());
  // Only config.json: its ids, in order.
  EXPECT_THAT(EndIds(dir_->path()), ElementsAre(128001, 128008, 128009));
  // generation_config.json adds its own after them, once each.
  Write("generation_config.json", R"({"eos_token_id": [128009, 7], "do_sample": true})");
  EXPECT_THAT(EndIds(dir_->path()), ElementsAre(128001, 128008, 128009, 7));
  Write("generation_config.json", R"({"eos_token_id": null})");
  EXPECT_THAT(EndIds(dir_->path()), ElementsAre(128001, 128008, 128009));
  // An id outside the vocabulary, or not an id, is refused naming the file.
  for (const char* bad : {R"({"eos_token_id": 128256})", R"({"eos_token_id": "eos"})", "[1]"}) {
    Write("generation_config.json", bad);
    absl::StatusOr<std::vector<int32_t>> ids = ReadEndTokenIds(dir_->path());
    ASSERT_FALSE(ids.ok()) << bad;
    EXPECT_EQ(ids.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(ids.status().message(), HasSubstr("generation_config.json")) << bad;
  }
}

TEST_F(ReadModelConfigTest, EndTokenIdsOfAGgufAreItsEosThenItsEot) {
  const std::string path = WriteGguf(GgufKeys());
  EXPECT_THAT(EndIds(path), ElementsAre(1, 3));
}

}  // namespace
}  // namespace kvcm
