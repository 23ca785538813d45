#include "services/executor/model/llama_config.h"

#include <cmath>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/support/status_matchers.h"

namespace kvcm::executor {
namespace {

using ::testing::AllOf;
using ::testing::Each;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using Json = nlohmann::json;

// meta-llama/Llama-2-7b-hf's config.json.
constexpr char kLlama2_7B[] = R"json({
  "architectures": ["LlamaForCausalLM"],
  "bos_token_id": 1,
  "eos_token_id": 2,
  "hidden_act": "silu",
  "hidden_size": 4096,
  "initializer_range": 0.02,
  "intermediate_size": 11008,
  "max_position_embeddings": 4096,
  "model_type": "llama",
  "num_attention_heads": 32,
  "num_hidden_layers": 32,
  "num_key_value_heads": 32,
  "pretraining_tp": 1,
  "rms_norm_eps": 1e-05,
  "rope_scaling": null,
  "tie_word_embeddings": false,
  "torch_dtype": "float16",
  "transformers_version": "4.31.0.dev0",
  "use_cache": true,
  "vocab_size": 32000
})json";

// meta-llama/Llama-3.1-8B-Instruct's config.json (llama3 rope scaling, eos list).
constexpr char kLlama31_8B[] = R"json({
  "architectures": ["LlamaForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 128000,
  "eos_token_id": [128001, 128008, 128009],
  "hidden_act": "silu",
  "hidden_size": 4096,
  "intermediate_size": 14336,
  "max_position_embeddings": 131072,
  "mlp_bias": false,
  "model_type": "llama",
  "num_attention_heads": 32,
  "num_hidden_layers": 32,
  "num_key_value_heads": 8,
  "rms_norm_eps": 1e-05,
  "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192, "rope_type": "llama3"},
  "rope_theta": 500000.0,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "vocab_size": 128256
})json";

// Qwen/Qwen3-0.6B's config.json: head_dim 128 with hidden 1024 and 16 heads.
constexpr char kQwen3_06B[] = R"json({
  "architectures": ["Qwen3ForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 151643,
  "eos_token_id": 151645,
  "head_dim": 128,
  "hidden_act": "silu",
  "hidden_size": 1024,
  "initializer_range": 0.02,
  "intermediate_size": 3072,
  "max_position_embeddings": 40960,
  "max_window_layers": 28,
  "model_type": "qwen3",
  "num_attention_heads": 16,
  "num_hidden_layers": 28,
  "num_key_value_heads": 8,
  "rms_norm_eps": 1e-06,
  "rope_scaling": null,
  "rope_theta": 1000000,
  "sliding_window": null,
  "tie_word_embeddings": true,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.51.0",
  "use_cache": true,
  "use_sliding_window": false,
  "vocab_size": 151936
})json";

constexpr char kMinimal[] = R"json({
  "architectures": ["LlamaForCausalLM"],
  "vocab_size": 320, "hidden_size": 64, "intermediate_size": 128,
  "num_hidden_layers": 2, "num_attention_heads": 4
})json";

absl::Status ErrorWith(const char* base, const std::string& key, const Json& value) {
  Json config = Json::parse(base);
  if (value.is_discarded()) {
    config.erase(key);
  } else {
    config[key] = value;
  }
  return ParseLlamaConfig(config.dump()).status();
}

Json Remove() { return Json(Json::value_t::discarded); }

TEST(LlamaConfigTest, Llama2) {
  absl::StatusOr<LlamaConfig> c = ParseLlamaConfig(kLlama2_7B);
  ASSERT_THAT(c, IsOk());
  EXPECT_EQ(c->architecture, "LlamaForCausalLM");
  EXPECT_EQ(c->vocab_size, 32000);
  EXPECT_EQ(c->hidden_size, 4096);
  EXPECT_EQ(c->intermediate_size, 11008);
  EXPECT_EQ(c->num_hidden_layers, 32);
  EXPECT_EQ(c->num_attention_heads, 32);
  EXPECT_EQ(c->num_key_value_heads, 32);
  EXPECT_EQ(c->head_dim, 128);
  EXPECT_FLOAT_EQ(c->rms_norm_eps, 1e-5f);
  EXPECT_EQ(c->rope_theta, 10000.0);
  EXPECT_EQ(c->rope_scaling.type, RopeScaling::Type::kNone);
  EXPECT_EQ(c->max_position_embeddings, 4096);
  EXPECT_FALSE(c->tie_word_embeddings);
  EXPECT_EQ(c->bos_token_id, 1);
  EXPECT_THAT(c->eos_token_ids, ElementsAre(2));
  EXPECT_EQ(c->torch_dtype, "float16");

  absl::StatusOr<KvCacheSpec> spec = c->KvSpec(DType::kBFloat16, 16);
  ASSERT_THAT(spec, IsOk());
  EXPECT_EQ(spec->num_layers, 32);
  EXPECT_EQ(spec->num_kv_heads, 32);
  EXPECT_EQ(spec->head_dim, 128);
  EXPECT_EQ(spec->dtype, DType::kBFloat16);
  EXPECT_EQ(spec->block_size, 16);
  EXPECT_EQ(c->KvSpec(DType::kFloat32, 0).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(LlamaConfigTest, Llama31WithLlama3RopeScalingAndEosList) {
  absl::StatusOr<LlamaConfig> c = ParseLlamaConfig(kLlama31_8B);
  ASSERT_THAT(c, IsOk());
  EXPECT_EQ(c->num_key_value_heads, 8);
  EXPECT_EQ(c->rope_theta, 500000.0);
  EXPECT_EQ(c->rope_scaling.type, RopeScaling::Type::kLlama3);
  EXPECT_EQ(c->rope_scaling.factor, 8.0);
  EXPECT_EQ(c->rope_scaling.original_max_position_embeddings, 8192);
  EXPECT_EQ(c->bos_token_id, 128000);
  EXPECT_THAT(c->eos_token_ids, ElementsAre(128001, 128008, 128009));
}

TEST(LlamaConfigTest, Defaults) {
  absl::StatusOr<LlamaConfig> c = ParseLlamaConfig(kMinimal);
  ASSERT_THAT(c, IsOk());
  EXPECT_EQ(c->num_key_value_heads, 4);  // = heads
  EXPECT_EQ(c->head_dim, 16);            // = hidden / heads
  EXPECT_FLOAT_EQ(c->rms_norm_eps, 1e-6f);
  EXPECT_EQ(c->rope_theta, 10000.0);
  EXPECT_EQ(c->max_position_embeddings, 2048);
  EXPECT_FALSE(c->tie_word_embeddings);
  EXPECT_EQ(c->bos_token_id, -1);
  EXPECT_TRUE(c->eos_token_ids.empty());
  EXPECT_EQ(c->torch_dtype, "");
}

TEST(LlamaConfigTest, ExplicitHeadDimAndModelTypeOnly) {
  Json config = Json::parse(kMinimal);
  config.erase("architectures");
  config["model_type"] = "mistral";
  config["head_dim"] = 32;
  config["sliding_window"] = nullptr;
  config["num_key_value_heads"] = 2;
  absl::StatusOr<LlamaConfig> c = ParseLlamaConfig(config.dump());
  ASSERT_THAT(c, IsOk());
  EXPECT_EQ(c->architecture, "MistralForCausalLM");
  EXPECT_EQ(c->head_dim, 32);
  EXPECT_EQ(c->num_key_value_heads, 2);
}

TEST(LlamaConfigTest, MissingRequiredKeysAreNamed) {
  for (const char* key : {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                          "num_attention_heads"}) {
    SCOPED_TRACE(key);
    const absl::Status s = ErrorWith(kMinimal, key, Remove());
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(s.message(), AllOf(HasSubstr("missing required key"), HasSubstr(key)));
  }
}

TEST(LlamaConfigTest, BadValuesAreNamed) {
  struct Case {
    const char* key;
    Json value;
  };
  const Case cases[] = {
      {"vocab_size", "320"},
      {"hidden_size", 0},
      {"num_hidden_layers", -2},
      {"num_key_value_heads", 3},  // 4 % 3 != 0
      {"rms_norm_eps", "small"},
      {"rope_theta", -1.0},
      {"tie_word_embeddings", 1},
      {"eos_token_id", 320},  // >= vocab
      {"bos_token_id", Json::array({1, 2})},
      {"head_dim", 15},  // odd
      {"torch_dtype", 16},
      {"max_position_embeddings", 4294967296},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.key);
    const absl::Status s = ErrorWith(kMinimal, c.key, c.value);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(s.message(), HasSubstr(c.key));
  }
  Json no_divide = Json::parse(kMinimal);
  no_divide["num_attention_heads"] = 5;
  EXPECT_THAT(ParseLlamaConfig(no_divide.dump()).status().message(), HasSubstr("divisible"));
}

TEST(LlamaConfigTest, MalformedJson) {
  EXPECT_EQ(ParseLlamaConfig("{\"vocab_size\": ").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(ParseLlamaConfig("[]").status().message(), HasSubstr("JSON object"));
}

TEST(LlamaConfigTest, UnsupportedFeaturesAreUnimplementedNamingTheKey) {
  struct Case {
    const char* key;
    Json value;
    const char* expect;
  };
  const Case cases[] = {
      {"architectures", Json::array({"GemmaForCausalLM"}), "GemmaForCausalLM"},
      {"rope_scaling", Json{{"rope_type", "yarn"}, {"factor", 4.0}}, "yarn"},
      {"rope_scaling", Json{{"type", "dynamic"}, {"factor", 2.0}}, "dynamic"},
      {"mlp_bias", true, "mlp_bias"},
      {"hidden_act", "gelu", "hidden_act"},
      {"sliding_window", 512, "sliding_window"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.key);
    const absl::Status s = ErrorWith(kMinimal, c.key, c.value);
    EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented) << s;
    EXPECT_THAT(s.message(), HasSubstr(c.expect));
  }
  Json no_arch = Json::parse(kMinimal);
  no_arch.erase("architectures");
  no_arch["model_type"] = "gemma";
  EXPECT_EQ(ParseLlamaConfig(no_arch.dump()).status().code(), absl::StatusCode::kUnimplemented);
  no_arch.erase("model_type");
  EXPECT_EQ(ParseLlamaConfig(no_arch.dump()).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(LlamaConfigTest, AttentionBiasesOfLlamaAndQwen2) {
  Json config = Json::parse(kMinimal);
  absl::StatusOr<LlamaConfig> c = ParseLlamaConfig(config.dump());
  ASSERT_THAT(c, IsOk());
  EXPECT_FALSE(c->qkv_bias);
  EXPECT_FALSE(c->o_bias);
  config["attention_bias"] = true;  // Llama's: q, k, v and o
  c = ParseLlamaConfig(config.dump());
  ASSERT_THAT(c, IsOk());
  EXPECT_TRUE(c->qkv_bias);
  EXPECT_TRUE(c->o_bias);
  EXPECT_THAT(c->ToString(), HasSubstr("q/k/v/o bias"));

  Json qwen2 = Json::parse(kMinimal);
  qwen2["architectures"] = Json::array({"Qwen2ForCausalLM"});
  qwen2["sliding_window"] = 64;  // unused while use_sliding_window is false
  qwen2["use_sliding_window"] = false;
  c = ParseLlamaConfig(qwen2.dump());
  ASSERT_THAT(c, IsOk());
  EXPECT_EQ(c->architecture, "Qwen2ForCausalLM");
  EXPECT_TRUE(c->qkv_bias);  // always, for Qwen2
  EXPECT_FALSE(c->o_bias);
  EXPECT_THAT(c->layer_windows, Each(0));
}

// Each layer's window, as transformers decides it for each family.
TEST(LlamaConfigTest, SlidingWindowsPerLayer) {
  Json config = Json::parse(kMinimal);
  const int32_t layers = config["num_hidden_layers"].get<int32_t>();
  ASSERT_GE(layers, 2);
  // Mistral: every layer.
  config["architectures"] = Json::array({"MistralForCausalLM"});
  config["model_type"] = "mistral";
  config["sliding_window"] = 64;
  absl::StatusOr<LlamaConfig> c = ParseLlamaConfig(config.dump());
  ASSERT_THAT(c, IsOk());
  EXPECT_THAT(c->layer_windows, ::testing::SizeIs(layers));
  EXPECT_THAT(c->layer_windows, Each(64));
  EXPECT_THAT(c->ToString(), HasSubstr(absl::StrCat("sliding window 64 on ", layers, " of ")));

  // Qwen2: only with use_sliding_window, from max_window_layers on (default 28, past these).
  config["architectures"] = Json::array({"Qwen2ForCausalLM"});
  config["model_type"] = "qwen2";
  c = ParseLlamaConfig(config.dump());
  ASSERT_THAT(c, IsOk());
  EXPECT_THAT(c->layer_windows, Each(0));
  config["use_sliding_window"] = true;
  c = ParseLlamaConfig(config.dump());
  ASSERT_THAT(c, IsOk());
  EXPECT_THAT(c->layer_windows, Each(0));
  config["max_window_layers"] = 1;
  c = ParseLlamaConfig(config.dump());
  ASSERT_THAT(c, IsOk());
  EXPECT_EQ(c->layer_windows[0], 0);
  for (int32_t i = 1; i < layers; ++i) EXPECT_EQ(c->layer_windows[static_cast<size_t>(i)], 64);

  // layer_types, as transformers >= 4.53 writes them, win over max_window_layers.
  Json types = Json::array();
  for (int32_t i = 0; i < layers; ++i) {
    types.push_back(i % 2 == 0 ? "sliding_attention" : "full_attention");
  }
  config["layer_types"] = types;
  c = ParseLlamaConfig(config.dump());
  ASSERT_THAT(c, IsOk());
  for (int32_t i = 0; i < layers; ++i) {
    EXPECT_EQ(c->layer_windows[static_cast<size_t>(i)], i % 2 == 0 ? 64 : 0) << i;
  }
  config["layer_types"][1] = "chunked_attention";
  const absl::Status chunked = ParseLlamaConfig(config.dump()).status();
  EXPECT_EQ(chunked.code(), absl::StatusCode::kUnimplemented) << chunked;
  EXPECT_THAT(chunked.message(), HasSubstr("\"layer_types\"[1] \"chunked_attention\""));
  config["layer_types"] = Json::array({"full_attention"});
  const absl::Status short_list = ParseLlamaConfig(config.dump()).status();
  EXPECT_EQ(short_list.code(), absl::StatusCode::kInvalidArgument) << short_list;
  EXPECT_THAT(short_list.message(), HasSubstr("layer_types"));

  // Llama has no window: one shorter than the context is refused, not guessed at.
  config = Json::parse(kMinimal);
  config["sliding_window"] = 64;
  const absl::Status llama = ParseLlamaConfig(config.dump()).status();
  EXPECT_EQ(llama.code(), absl::StatusCode::kUnimplemented) << llama;
  EXPECT_THAT(llama.message(), HasSubstr("\"sliding_window\" 64"));
}

TEST(LlamaConfigTest, Qwen3HasQkNormAndItsOwnHeadDim) {
  absl::StatusOr<LlamaConfig> c = ParseLlamaConfig(kQwen3_06B);
  ASSERT_THAT(c, IsOk());
  EXPECT_EQ(c->architecture, "Qwen3ForCausalLM");
  EXPECT_TRUE(c->qk_norm);
  EXPECT_FALSE(c->qkv_bias);
  EXPECT_FALSE(c->o_bias);
  EXPECT_EQ(c->hidden_size, 1024);
  EXPECT_EQ(c->num_attention_heads, 16);
  EXPECT_EQ(c->num_key_value_heads, 8);
  EXPECT_EQ(c->head_dim, 128);  // not 1024 / 16
  EXPECT_FLOAT_EQ(c->rms_norm_eps, 1e-6f);
  EXPECT_EQ(c->rope_theta, 1e6);
  EXPECT_EQ(c->max_position_embeddings, 40960);
  EXPECT_TRUE(c->tie_word_embeddings);
  EXPECT_THAT(c->eos_token_ids, ElementsAre(151645));
  EXPECT_THAT(c->ToString(), HasSubstr("q/k norm"));
  absl::StatusOr<KvCacheSpec> spec = c->KvSpec(DType::kBFloat16, 16);
  ASSERT_THAT(spec, IsOk());
  EXPECT_EQ(spec->num_layers, 28);
  EXPECT_EQ(spec->num_kv_heads, 8);
  EXPECT_EQ(spec->head_dim, 128);

  // model_type alone names it too; attention_bias is Llama's (q, k, v and o).
  Json config = Json::parse(kQwen3_06B);
  config.erase("architectures");
  config["attention_bias"] = true;
  c = ParseLlamaConfig(config.dump());
  ASSERT_THAT(c, IsOk());
  EXPECT_EQ(c->architecture, "Qwen3ForCausalLM");
  EXPECT_TRUE(c->qk_norm);
  EXPECT_TRUE(c->qkv_bias);
  EXPECT_TRUE(c->o_bias);

  // A window is used only with use_sliding_window, on the layers from max_window_layers.
  config = Json::parse(kQwen3_06B);
  config["sliding_window"] = 4096;
  c = ParseLlamaConfig(config.dump());
  ASSERT_THAT(c, IsOk());
  EXPECT_THAT(c->layer_windows, Each(0));
  config["use_sliding_window"] = true;
  config["max_window_layers"] = 20;
  c = ParseLlamaConfig(config.dump());
  ASSERT_THAT(c, IsOk());
  EXPECT_EQ(c->layer_windows[19], 0);
  EXPECT_EQ(c->layer_windows[20], 4096);
  EXPECT_EQ(c->layer_windows[27], 4096);

  // Only Qwen3 has the q/k norm.
  for (const char* other : {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"}) {
    config = Json::parse(kQwen3_06B);
    config["architectures"] = Json::array({other});
    c = ParseLlamaConfig(config.dump());
    ASSERT_THAT(c, IsOk()) << other;
    EXPECT_FALSE(c->qk_norm) << other;
  }
}

TEST(LlamaConfigTest, RopeScalingVariants) {
  Json config = Json::parse(kMinimal);
  config["rope_scaling"] = {{"rope_type", "linear"}, {"factor", 2.0}};
  absl::StatusOr<LlamaConfig> linear = ParseLlamaConfig(config.dump());
  ASSERT_THAT(linear, IsOk());
  EXPECT_EQ(linear->rope_scaling.type, RopeScaling::Type::kLinear);
  EXPECT_EQ(linear->rope_scaling.factor, 2.0);

  config["rope_scaling"] = {{"rope_type", "default"}};
  EXPECT_EQ(ParseLlamaConfig(config.dump())->rope_scaling.type, RopeScaling::Type::kNone);

  config["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 8.0}};  // no original length
  const absl::Status s = ParseLlamaConfig(config.dump()).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("original_max_position_embeddings"));
}

// transformers >= 5 writes rope_theta and the scaling inside "rope_parameters". Read before
// as nothing: theta 10000 and no scaling, silently wrong from the first token.
TEST(LlamaConfigTest, TransformersFiveRopeParametersAreReadLikeTheOldKeys) {
  Json old_style = Json::parse(kMinimal);
  old_style["rope_theta"] = 500000.0;
  old_style["rope_scaling"] = {{"rope_type", "llama3"},
                               {"factor", 8.0},
                               {"low_freq_factor", 1.0},
                               {"high_freq_factor", 4.0},
                               {"original_max_position_embeddings", 8192}};
  Json new_style = Json::parse(kMinimal);
  new_style.erase("rope_theta");
  new_style.erase("rope_scaling");
  new_style["rope_parameters"] = {
      {"rope_theta", 500000.0},  {"rope_type", "llama3"},
      {"factor", 8.0},           {"low_freq_factor", 1.0},
      {"high_freq_factor", 4.0}, {"original_max_position_embeddings", 8192}};
  absl::StatusOr<LlamaConfig> a = ParseLlamaConfig(old_style.dump());
  absl::StatusOr<LlamaConfig> b = ParseLlamaConfig(new_style.dump());
  ASSERT_THAT(a, IsOk());
  ASSERT_THAT(b, IsOk());
  EXPECT_EQ(b->rope_theta, 500000.0);
  EXPECT_EQ(b->rope_scaling.type, RopeScaling::Type::kLlama3);
  EXPECT_EQ(b->rope_scaling.factor, 8.0);
  EXPECT_EQ(b->rope_scaling.original_max_position_embeddings, 8192);
  EXPECT_EQ(a->ToString(), b->ToString());
  EXPECT_THAT(b->ToString(), HasSubstr("rope_theta 500000"));
  EXPECT_THAT(b->ToString(), HasSubstr("llama3 x8"));
  EXPECT_THAT(b->ToString(), HasSubstr("rms_norm_eps"));

  // The default type with only a theta.
  new_style["rope_parameters"] = {{"rope_theta", 100000.0}, {"rope_type", "default"}};
  absl::StatusOr<LlamaConfig> plain = ParseLlamaConfig(new_style.dump());
  ASSERT_THAT(plain, IsOk());
  EXPECT_EQ(plain->rope_theta, 100000.0);
  EXPECT_EQ(plain->rope_scaling.type, RopeScaling::Type::kNone);

  // Both spellings present: they must agree.
  Json both = old_style;
  both["rope_parameters"] = {{"rope_theta", 10000.0},
                             {"rope_type", "llama3"},
                             {"factor", 8.0},
                             {"original_max_position_embeddings", 8192}};
  absl::Status disagree = ParseLlamaConfig(both.dump()).status();
  EXPECT_EQ(disagree.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(disagree.message(), HasSubstr("disagree"));

  // A key that changes the math and is not understood is refused, naming it.
  new_style["rope_parameters"] = {
      {"rope_theta", 10000.0}, {"rope_type", "default"}, {"attention_factor", 0.5}};
  absl::Status unknown = ParseLlamaConfig(new_style.dump()).status();
  EXPECT_EQ(unknown.code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(unknown.message(), HasSubstr("rope_parameters.attention_factor"));
  new_style["rope_parameters"] = {{"rope_theta", 10000.0}, {"partial_rotary_factor", 1.0}};
  EXPECT_THAT(ParseLlamaConfig(new_style.dump()), IsOk());  // the whole head: fine
  new_style["rope_parameters"] = {{"rope_theta", 10000.0}, {"rope_type", "yarn"}, {"factor", 4.0}};
  EXPECT_EQ(ParseLlamaConfig(new_style.dump()).status().code(), absl::StatusCode::kUnimplemented);
  // Per layer type (Gemma 3's shape) is not a Llama's.
  new_style["rope_parameters"] = {{"full_attention", {{"rope_theta", 1e6}}},
                                  {"sliding_attention", {{"rope_theta", 1e4}}}};
  absl::Status per_layer = ParseLlamaConfig(new_style.dump()).status();
  EXPECT_EQ(per_layer.code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(per_layer.message(), HasSubstr("per layer type"));
  new_style["rope_parameters"] = 5;
  EXPECT_EQ(ParseLlamaConfig(new_style.dump()).status().code(), absl::StatusCode::kInvalidArgument);
}

// A config in the shape of google/gemma-3-1b-it's (transformers 4.50's spelling: rope_theta,
// rope_local_base_freq, sliding_window_pattern; no layer_types).
constexpr char kGemma3_1B[] = R"json({
  "architectures": ["Gemma3ForCausalLM"],
  "attention_bias": false,
  "attn_logit_softcapping": null,
  "bos_token_id": 2,
  "eos_token_id": [1, 106],
  "final_logit_softcapping": null,
  "head_dim": 256,
  "hidden_activation": "gelu_pytorch_tanh",
  "hidden_size": 1152,
  "intermediate_size": 6912,
  "max_position_embeddings": 32768,
  "model_type": "gemma3_text",
  "num_attention_heads": 4,
  "num_hidden_layers": 26,
  "num_key_value_heads": 1,
  "query_pre_attn_scalar": 256,
  "rms_norm_eps": 1e-06,
  "rope_local_base_freq": 10000,
  "rope_scaling": null,
  "rope_theta": 1000000,
  "sliding_window": 512,
  "sliding_window_pattern": 6,
  "torch_dtype": "bfloat16",
  "vocab_size": 262144
})json";

TEST(LlamaConfigTest, Gemma3TextIsRead) {
  absl::StatusOr<LlamaConfig> c = ParseLlamaConfig(kGemma3_1B);
  ASSERT_THAT(c, IsOk());
  EXPECT_EQ(c->architecture, "Gemma3ForCausalLM");
  EXPECT_EQ(c->head_dim, 256);
  EXPECT_TRUE(c->qk_norm);
  EXPECT_TRUE(c->sandwich_norms);
  EXPECT_EQ(c->norm_weight_offset, 1.0f);
  // sqrt(1152) = 33.94..., rounded to bf16 (the checkpoint's dtype) as transformers does.
  EXPECT_EQ(c->embedding_scale, 34.0f);
  EXPECT_EQ(c->query_pre_attn_scalar, 256.0);
  EXPECT_EQ(c->AttentionScale(), 1.0f / 16);
  EXPECT_EQ(c->activation, LlamaConfig::Activation::kGeluTanh);
  EXPECT_TRUE(c->tie_word_embeddings);  // Gemma3TextConfig's default
  EXPECT_TRUE(c->local_rope);
  EXPECT_EQ(c->rope_theta, 1e6);
  EXPECT_EQ(c->local_rope_theta, 1e4);
  EXPECT_EQ(c->rope_scaling.type, RopeScaling::Type::kNone);
  // Every sixth layer attends to the whole context.
  ASSERT_EQ(c->layer_windows.size(), 26u);
  for (size_t l = 0; l < 26; ++l) {
    EXPECT_EQ(c->layer_windows[l], (l + 1) % 6 == 0 ? 0 : 512) << l;
  }
  EXPECT_EQ(c->max_position_embeddings, 32768);
  EXPECT_THAT(c->eos_token_ids, ElementsAre(1, 106));

  // The larger models' linear scaling applies to the full-attention layers only; an fp32
  // checkpoint keeps sqrt(hidden_size) unrounded.
  Json config = Json::parse(kGemma3_1B);
  config["rope_scaling"] = {{"rope_type", "linear"}, {"factor", 8.0}};
  config["torch_dtype"] = "float32";
  c = ParseLlamaConfig(config.dump());
  ASSERT_THAT(c, IsOk());
  EXPECT_EQ(c->rope_scaling.type, RopeScaling::Type::kLinear);
  EXPECT_EQ(c->rope_scaling.factor, 8.0);
  EXPECT_EQ(c->local_rope_scaling.type, RopeScaling::Type::kNone);
  EXPECT_EQ(c->embedding_scale, static_cast<float>(std::sqrt(1152.0)));
}

TEST(LlamaConfigTest, Gemma3TransformersFiveRopeParametersPerLayerType) {
  Json config = Json::parse(kGemma3_1B);
  for (const char* key : {"rope_theta", "rope_local_base_freq", "rope_scaling"}) {
    config.erase(key);
  }
  config["rope_parameters"] = {
      {"full_attention", {{"rope_type", "linear"}, {"factor", 8.0}, {"rope_theta", 1e6}}},
      {"sliding_attention", {{"rope_type", "default"}, {"rope_theta", 1e4}}}};
  absl::StatusOr<LlamaConfig> c = ParseLlamaConfig(config.dump());
  ASSERT_THAT(c, IsOk());
  EXPECT_EQ(c->rope_theta, 1e6);
  EXPECT_EQ(c->rope_scaling.type, RopeScaling::Type::kLinear);
  EXPECT_EQ(c->rope_scaling.factor, 8.0);
  EXPECT_EQ(c->local_rope_theta, 1e4);
  EXPECT_EQ(c->local_rope_scaling.type, RopeScaling::Type::kNone);

  // A scaling the forward pass lacks, in either set, is refused naming the set.
  Json yarn = config;
  yarn["rope_parameters"]["sliding_attention"] = {{"rope_type", "yarn"}, {"factor", 2.0}};
  absl::Status s = ParseLlamaConfig(yarn.dump()).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented) << s;
  EXPECT_THAT(s.message(), HasSubstr("rope_parameters.sliding_attention"));
  Json other_type = config;
  other_type["rope_parameters"]["chunked_attention"] = {{"rope_type", "default"}};
  s = ParseLlamaConfig(other_type.dump()).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented) << s;
  EXPECT_THAT(s.message(), HasSubstr("rope_parameters.chunked_attention"));
  // Not for the other families: one RoPE for every layer.
  Json qwen3 = Json::parse(kQwen3_06B);
  qwen3["rope_parameters"] = config["rope_parameters"];
  s = ParseLlamaConfig(qwen3.dump()).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented) << s;
  EXPECT_THAT(s.message(), HasSubstr("per layer type"));
}

TEST(LlamaConfigTest, Gemma3FeaturesNotImplementedAreRefusedNamingTheKey) {
  struct Case {
    const char* key;
    Json value;
    const char* expect;
  };
  const Case cases[] = {
      {"attn_logit_softcapping", 50.0, "attn_logit_softcapping"},
      {"final_logit_softcapping", 30.0, "final_logit_softcapping"},
      {"use_bidirectional_attention", true, "use_bidirectional_attention"},
      {"hidden_activation", "gelu", "hidden_activation"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.key);
    const absl::Status s = ErrorWith(kGemma3_1B, c.key, c.value);
    EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented) << s;
    EXPECT_THAT(s.message(), HasSubstr(c.expect));
  }
}

TEST(LlamaConfigTest, MultimodalGemma3IsRefusedByName) {
  Json multimodal;
  multimodal["architectures"] = {"Gemma3ForConditionalGeneration"};
  multimodal["model_type"] = "gemma3";
  multimodal["text_config"] = Json::parse(kGemma3_1B);
  multimodal["text_config"].erase("architectures");
  absl::Status s = ParseLlamaConfig(multimodal.dump()).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented) << s;
  EXPECT_THAT(s.message(),
              AllOf(HasSubstr("Gemma3ForConditionalGeneration"), HasSubstr("model.language_model"),
                    HasSubstr("Gemma3ForCausalLM")));
  multimodal.erase("architectures");
  s = ParseLlamaConfig(multimodal.dump()).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented) << s;
  EXPECT_THAT(s.message(), HasSubstr("\"model_type\" gemma3"));
}

TEST(LlamaConfigTest, LoadNamesThePath) {
  const absl::Status s = LoadLlamaConfig("/nonexistent-kvcm/config.json").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(s.message(), HasSubstr("config.json"));
}

}  // namespace
}  // namespace kvcm::executor
