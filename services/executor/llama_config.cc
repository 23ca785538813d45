#include "services/executor/llama_config.h"

#include <algorithm>
#include <cmath>
#include <iterator>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/base/float16.h"
#include "common/base/status_macros.h"
#include "common/gguf/gguf_file.h"
#include "common/model/model_config.h"

namespace kvcm::executor {
namespace {

constexpr const char* kArchitectures[] = {"LlamaForCausalLM", "MistralForCausalLM",
                                          "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                                          "Gemma3ForCausalLM"};
constexpr const char* kModelTypes[] = {"llama", "mistral", "qwen2", "qwen3", "gemma3_text"};

// The multimodal Gemma 3 (model_type "gemma3"): its language model is Gemma3ForCausalLM's,
// but its checkpoint names the weights model.language_model.* beside a vision tower, which
// the loader does not map; refused by name rather than reported as an unknown architecture.
absl::Status RefuseMultimodalGemma3(const ModelConfig& m, absl::string_view what) {
  return absl::UnimplementedError(
      absl::StrCat(m.Where(), what,
                   " (the multimodal Gemma 3) is not supported: its language model's weights "
                   "(model.language_model.*) and vision tower are not loaded; the text-only "
                   "Gemma3ForCausalLM (model_type gemma3_text) is"));
}

// The supported architecture `m` names (Hugging Face), or the refusal naming the key.
absl::StatusOr<std::string> HfArchitecture(const ModelConfig& m) {
  if (!m.architectures.empty()) {
    for (const std::string& a : m.architectures) {
      if (a == "Gemma3ForConditionalGeneration") {
        return RefuseMultimodalGemma3(m, "\"architectures\" Gemma3ForConditionalGeneration");
      }
      for (const char* known : kArchitectures) {
        if (a == known) return std::string(known);
      }
    }
    return absl::UnimplementedError(absl::StrCat(
        m.Where(), "\"architectures\" [\"", absl::StrJoin(m.architectures, "\", \""),
        "\"] is not supported (supported: ", absl::StrJoin(kArchitectures, ", "), ")"));
  }
  if (m.model_type.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(m.Where(), "neither \"architectures\" nor \"model_type\" is given"));
  }
  for (size_t i = 0; i < std::size(kModelTypes); ++i) {
    if (m.model_type == kModelTypes[i]) return std::string(kArchitectures[i]);
  }
  if (m.model_type == "gemma3") return RefuseMultimodalGemma3(m, "\"model_type\" gemma3");
  return absl::UnimplementedError(
      absl::StrCat(m.Where(), "\"model_type\" \"", m.model_type,
                   "\" is not supported (supported: ", absl::StrJoin(kModelTypes, ", "), ")"));
}

// The RoPE scaling of the set `rope` of `m`: the types and keys the forward pass implements,
// or the refusal naming the key (UNIMPLEMENTED for what it does not implement,
// INVALID_ARGUMENT for a set that lacks what its type needs).
absl::StatusOr<RopeScaling> Scaling(const ModelConfig& m, const RopeConfig& rope) {
  const bool gguf = m.format == ModelConfig::Format::kGguf;
  auto invalid = [&](absl::string_view what) {
    return absl::InvalidArgumentError(absl::StrCat(m.Where(), what));
  };
  auto unimplemented = [&](absl::string_view what) {
    return absl::UnimplementedError(absl::StrCat(m.Where(), what));
  };
  RopeScaling scaling;
  if (gguf) {
    if (rope.type != "default" && rope.type != "linear") {
      return unimplemented(absl::StrCat("GGUF key \"", rope.source, "\" \"", rope.type,
                                        "\" is not supported (none, linear)"));
    }
  } else if (rope.type != "default" && rope.type != "llama3" && rope.type != "linear") {
    return unimplemented(absl::StrCat("\"", rope.source, "\" of rope_type \"", rope.type,
                                      "\" is not supported (supported: default, llama3, linear)"));
  }
  // Every key a supported type reads is a RopeConfig field; anything else would change the
  // frequencies or the attention scale in transformers (attention_factor, beta_fast, ...).
  if (!rope.other_keys.empty()) {
    const auto& [key, value] = rope.other_keys.front();
    return unimplemented(
        absl::StrCat("key \"", key, "\" (", value, ") changes RoPE and is not supported"));
  }
  if (rope.partial_rotary_factor.has_value() && *rope.partial_rotary_factor != 1.0) {
    // 1: the whole head rotates, what kvcm does.
    return unimplemented(absl::StrCat("key \"", rope.source, ".partial_rotary_factor\" (",
                                      *rope.partial_rotary_factor,
                                      ") changes RoPE and is not supported"));
  }
  if (rope.type == "default") return scaling;
  if (!rope.factor.has_value()) {
    if (gguf) {
      return invalid(
          absl::StrCat("GGUF key \"", m.model_type, ".rope.scaling.factor\" is missing"));
    }
    return invalid(
        absl::StrCat("\"", rope.source, "\" of rope_type \"", rope.type, "\" needs a \"factor\""));
  }
  scaling.factor = *rope.factor;
  if (rope.type == "linear") {
    scaling.type = RopeScaling::Type::kLinear;
    return scaling;
  }
  scaling.type = RopeScaling::Type::kLlama3;
  scaling.low_freq_factor = rope.low_freq_factor.value_or(1.0);
  scaling.high_freq_factor = rope.high_freq_factor.value_or(4.0);
  if (!rope.original_max_position_embeddings.has_value()) {
    return invalid(absl::StrCat("\"", rope.source,
                                "\": missing required key \"original_max_position_embeddings\""));
  }
  scaling.original_max_position_embeddings = *rope.original_max_position_embeddings;
  if (scaling.high_freq_factor <= scaling.low_freq_factor) {
    return invalid(
        absl::StrCat("\"", rope.source, "\": high_freq_factor must exceed low_freq_factor"));
  }
  return scaling;
}

// The RoPE of a family with one set for every layer; a per-layer-type set is refused.
absl::Status SetRope(const ModelConfig& m, LlamaConfig* c) {
  if (!m.rope.per_layer_type.empty()) {
    return absl::UnimplementedError(absl::StrCat(m.Where(), "\"rope_parameters\" per layer type (",
                                                 m.rope.per_layer_type,
                                                 ", ...) is not supported for ", c->architecture));
  }
  c->rope_theta = m.rope_theta.value_or(10000.0);
  KVCM_ASSIGN_OR_RETURN(c->rope_scaling, Scaling(m, m.rope));
  return absl::OkStatus();
}

// Gemma 3's two RoPEs, as Gemma3TextConfig resolves them: transformers 5's rope_parameters
// per layer type (each set's rope_theta, else rope_theta for full attention and
// rope_local_base_freq for sliding), or the older rope_theta (default 1e6) with rope_scaling
// for the full-attention layers and rope_local_base_freq (default 10000, unscaled) for the
// sliding ones.
absl::Status SetGemmaRope(const ModelConfig& m, LlamaConfig* c) {
  c->local_rope = true;
  c->rope_theta = m.rope_theta.value_or(1e6);
  c->local_rope_theta = m.rope_local_base_freq.value_or(10000.0);
  if (m.rope_per_layer_type.empty()) {
    KVCM_ASSIGN_OR_RETURN(c->rope_scaling, Scaling(m, m.rope));
    return absl::OkStatus();
  }
  if (m.rope.source == "rope_scaling") {
    return absl::UnimplementedError(
        absl::StrCat(m.Where(),
                     "\"rope_scaling\" beside a per-layer-type \"rope_parameters\" is not "
                     "supported (write the scaling into rope_parameters.full_attention)"));
  }
  for (const auto& [layer_type, rope] : m.rope_per_layer_type) {
    if (layer_type == "full_attention") {
      c->rope_theta = rope.theta.value_or(c->rope_theta);
      KVCM_ASSIGN_OR_RETURN(c->rope_scaling, Scaling(m, rope));
    } else if (layer_type == "sliding_attention") {
      c->local_rope_theta = rope.theta.value_or(c->local_rope_theta);
      KVCM_ASSIGN_OR_RETURN(c->local_rope_scaling, Scaling(m, rope));
    } else {
      return absl::UnimplementedError(
          absl::StrCat(m.Where(), "key \"rope_parameters.", layer_type.substr(0, 64),
                       "\": layer type is not supported (full_attention, sliding_attention)"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

float LlamaConfig::AttentionScale() const {
  // transformers computes query_pre_attn_scalar ** -0.5 in double; head_dim's stays the fp32
  // value the kernels always used.
  if (query_pre_attn_scalar > 0) return static_cast<float>(1.0 / std::sqrt(query_pre_attn_scalar));
  return 1.0f / std::sqrt(static_cast<float>(head_dim));
}

absl::StatusOr<KvCacheSpec> LlamaConfig::KvSpec(DType dtype, int32_t block_size) const {
  KvCacheSpec spec;
  spec.num_layers = num_hidden_layers;
  spec.num_kv_heads = num_key_value_heads;
  spec.head_dim = head_dim;
  spec.dtype = dtype;
  spec.block_size = block_size;
  KVCM_RETURN_IF_ERROR(spec.Validate());
  return spec;
}

std::string RopeScalingName(const RopeScaling& s) {
  switch (s.type) {
    case RopeScaling::Type::kNone:
      return "none";
    case RopeScaling::Type::kLinear:
      return absl::StrCat("linear x", s.factor);
    case RopeScaling::Type::kLlama3:
      return absl::StrCat("llama3 x", s.factor, " (low ", s.low_freq_factor, ", high ",
                          s.high_freq_factor, ", original ", s.original_max_position_embeddings,
                          ")");
  }
  return "";
}

std::string LlamaConfig::ToString() const {
  std::string windows;
  const int64_t windowed =
      std::count_if(layer_windows.begin(), layer_windows.end(), [](int32_t w) { return w > 0; });
  if (windowed > 0) {
    windows = absl::StrCat(", sliding window ",
                           *std::max_element(layer_windows.begin(), layer_windows.end()), " on ",
                           windowed, " of ", layer_windows.size(), " layers");
  }
  return absl::StrCat(
      architecture, ": vocab ", vocab_size, ", hidden ", hidden_size, ", intermediate ",
      intermediate_size, ", ", num_hidden_layers, " layers, ", num_attention_heads, " heads (",
      num_key_value_heads, " KV) x head dim ", head_dim, ", rms_norm_eps ", rms_norm_eps,
      ", rope_theta ", rope_theta, ", rope scaling ", RopeScalingName(rope_scaling),
      local_rope ? absl::StrCat(", sliding layers' rope_theta ", local_rope_theta, " (scaling ",
                                RopeScalingName(local_rope_scaling), ")")
                 : "",
      query_pre_attn_scalar > 0 ? absl::StrCat(", query_pre_attn_scalar ", query_pre_attn_scalar)
                                : "",
      activation == Activation::kGeluTanh ? ", gelu_pytorch_tanh" : "",
      tie_word_embeddings ? ", tied embeddings" : "",
      qkv_bias ? (o_bias ? ", q/k/v/o bias" : ", q/k/v bias") : "", qk_norm ? ", q/k norm" : "",
      windows, torch_dtype.empty() ? "" : ", ", torch_dtype);
}

namespace {

absl::Status Invalid(const ModelConfig& m, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(m.Where(), what));
}
absl::Status Unimplemented(const ModelConfig& m, absl::string_view what) {
  return absl::UnimplementedError(absl::StrCat(m.Where(), what));
}

// The architecture's name: a GGUF file's general.architecture, or config.json's.
absl::StatusOr<std::string> ArchitectureOf(const ModelConfig& m) {
  const bool gguf = m.format == ModelConfig::Format::kGguf;
  if (gguf) {
    if (m.model_type == "llama") {
      return std::string("LlamaForCausalLM (GGUF llama)");
    } else if (m.model_type == "qwen2") {
      return std::string("Qwen2ForCausalLM (GGUF qwen2)");
    } else if (m.model_type == "qwen3") {
      return std::string("Qwen3ForCausalLM (GGUF qwen3)");
    } else if (m.model_type == "gemma3") {
      return std::string("Gemma3ForCausalLM (GGUF gemma3)");
    } else {
      return Unimplemented(m, absl::StrCat("general.architecture \"", m.model_type,
                                           "\" is not supported (supported: llama, qwen2, qwen3, "
                                           "gemma3)"));
    }
  } else {
    return HfArchitecture(m);
  }
}

// A GGUF file's keys that must agree with the head dim, and its epsilon (llama.cpp writes it
// always; there is no default to fall back on).
absl::Status CheckGgufShape(const ModelConfig& m, int32_t head_dim) {
  const std::pair<const char*, std::optional<int32_t>> same[] = {
      {"attention.value_length", m.value_head_dim},
      {"rope.dimension_count", m.rope_dimension_count}};
  for (const auto& [suffix, value] : same) {
    if (!value.has_value() || *value == head_dim) continue;
    return Unimplemented(
        m, absl::StrCat("GGUF key \"", m.model_type, ".", suffix, "\" is ", *value,
                        ", not the head dim ", head_dim,
                        " (partial rotary or unequal key/value heads are not supported)"));
  }
  if (!m.rms_norm_eps.has_value()) {
    return Invalid(m, absl::StrCat(m.KeyName("rms_norm_eps"), " is missing"));
  }
  return absl::OkStatus();
}

// Each layer's sliding window (ModelConfig's LayerWindows). Mistral, Qwen2 and Qwen3 from
// Hugging Face folders use them as transformers does. Llama has none (transformers ignores
// the key), so a Llama config's window shorter than its context is refused rather than
// guessed at, as is a window in a GGUF file of these architectures (llama.cpp applies none).
absl::Status SetLayerWindows(const ModelConfig& m, LlamaConfig* c) {
  KVCM_ASSIGN_OR_RETURN(c->layer_windows, LayerWindows(m));
  const bool any = std::any_of(c->layer_windows.begin(), c->layer_windows.end(),
                               [](int32_t w) { return w > 0; });
  if (!any) return absl::OkStatus();
  const bool gemma3 = c->architecture.starts_with("Gemma3ForCausalLM");
  if (m.format == ModelConfig::Format::kGguf && !gemma3) {
    return Unimplemented(
        m, absl::StrCat("GGUF key \"", m.sliding_window_key,
                        "\" (sliding-window attention) is not supported for ", m.model_type));
  }
  const bool windowed_family = c->architecture.starts_with("MistralForCausalLM") ||
                               c->architecture.starts_with("Qwen2ForCausalLM") ||
                               c->architecture.starts_with("Qwen3ForCausalLM") ||
                               c->architecture.starts_with("Gemma3ForCausalLM");
  if (!windowed_family && m.sliding_window.value_or(0) < c->max_position_embeddings) {
    return Unimplemented(
        m, absl::StrCat("\"", m.sliding_window_key, "\" ", *m.sliding_window,
                        " (shorter than max_position_embeddings=", c->max_position_embeddings,
                        ") is not supported for ", c->architecture));
  }
  if (!windowed_family) std::fill(c->layer_windows.begin(), c->layer_windows.end(), 0);
  return absl::OkStatus();
}

// What a llama.cpp gemma3 file leaves to llama.cpp's code (llama-model.cpp's gemma3 case),
// as llama.cpp runs it: the norms are stored as 1 + w already (convert_hf_to_gguf adds the 1),
// the embedding scale is sqrt(hidden_size) in fp32, the attention scale is head_dim^-0.5
// except for the 27B (62 layers: (hidden_size / heads)^-0.5, its query_pre_attn_scalar), the
// sliding layers' RoPE base is 10000 and unscaled, and every sixth layer is full attention
// (ModelConfig's LayerWindows).
absl::Status SetGgufGemma3Features(const ModelConfig& m, LlamaConfig* c) {
  c->norm_weight_offset = 0.0f;
  c->query_pre_attn_scalar = c->num_hidden_layers == 62
                                 ? static_cast<double>(c->hidden_size / c->num_attention_heads)
                                 : static_cast<double>(c->head_dim);
  c->embedding_scale = static_cast<float>(std::sqrt(static_cast<double>(c->hidden_size)));
  c->local_rope = true;
  c->rope_theta = m.rope_theta.value_or(10000.0);
  c->local_rope_theta = 10000.0;
  KVCM_ASSIGN_OR_RETURN(c->rope_scaling, Scaling(m, m.rope));
  return absl::OkStatus();
}

// Gemma 3's differences from Llama (see llama_config.h), and the Gemma features this
// implementation does not have, refused naming the key rather than computing wrong logits.
absl::Status SetGemma3Features(const ModelConfig& m, LlamaConfig* c) {
  const std::pair<const char*, const std::optional<double>&> softcaps[] = {
      {"attn_logit_softcapping", m.attn_logit_softcapping},
      {"final_logit_softcapping", m.final_logit_softcapping}};
  for (const auto& [key, value] : softcaps) {
    if (!value.has_value()) continue;
    return Unimplemented(m, absl::StrCat(m.KeyName(key), " (", *value,
                                         ": tanh soft-capping) is not supported (only null)"));
  }
  if (m.use_bidirectional_attention.value_or(false)) {
    return Unimplemented(
        m, absl::StrCat(m.KeyName("use_bidirectional_attention"), " true is not supported"));
  }
  // Gemma3TextConfig reads hidden_activation (hidden_act is not its key).
  const std::string activation = m.hidden_activation.value_or("gelu_pytorch_tanh");
  if (activation != "gelu_pytorch_tanh") {
    return Unimplemented(m, absl::StrCat(m.KeyName("hidden_activation"), " \"", activation,
                                         "\" is not supported (only \"gelu_pytorch_tanh\")"));
  }
  c->activation = LlamaConfig::Activation::kGeluTanh;
  c->qk_norm = true;
  c->sandwich_norms = true;
  if (m.format == ModelConfig::Format::kGguf) return SetGgufGemma3Features(m, c);
  c->norm_weight_offset = 1.0f;
  c->query_pre_attn_scalar = m.query_pre_attn_scalar.value_or(256.0);
  // transformers multiplies by sqrt(hidden_size) cast to the weights' dtype.
  float scale = static_cast<float>(std::sqrt(static_cast<double>(c->hidden_size)));
  if (m.torch_dtype == "bfloat16") {
    scale = FloatFromBFloat16(BFloat16FromFloat(scale));
  } else if (m.torch_dtype == "float16") {
    scale = FloatFromHalf(HalfFromFloat(scale));
  }
  c->embedding_scale = scale;
  if (!m.tie_word_embeddings_given) c->tie_word_embeddings = true;  // Gemma3TextConfig's default
  return SetGemmaRope(m, c);
}

// The family's attention details (biases, QK norm), and the features this implementation
// does not have, refused rather than computing wrong logits.
absl::Status SetFamilyFeatures(const ModelConfig& m, LlamaConfig* c) {
  const bool gguf = m.format == ModelConfig::Format::kGguf;
  const bool gemma3 = c->architecture.starts_with("Gemma3ForCausalLM");
  if (!gemma3 && m.hidden_act.has_value() && *m.hidden_act != "silu") {
    return Unimplemented(
        m, absl::StrCat("\"hidden_act\" \"", *m.hidden_act, "\" is not supported (only \"silu\")"));
  }
  if (m.mlp_bias.value_or(false)) return Unimplemented(m, "\"mlp_bias\": true is not supported");
  if (gguf && m.gguf_rope_freqs) {
    return Unimplemented(
        m,
        "tensor \"rope_freqs.weight\" (per-frequency RoPE factors, as Llama 3.1 files carry) is "
        "not supported yet");
  }
  const bool qwen2 = c->architecture.starts_with("Qwen2ForCausalLM");
  const bool qwen3 = c->architecture.starts_with("Qwen3ForCausalLM");
  if (qwen2) {
    // Qwen2's q, k and v projections always have a bias, its o projection none.
    c->qkv_bias = true;
  } else {
    // Llama's, Qwen3's and Gemma 3's attention_bias: q, k, v and o (GGUF files have no such
    // key).
    c->qkv_bias = m.attention_bias.value_or(false);
    c->o_bias = c->qkv_bias;
  }
  // Qwen3 normalizes each head of q and of k (its q_norm and k_norm) before RoPE.
  c->qk_norm = qwen3;
  if (gemma3) {
    KVCM_RETURN_IF_ERROR(SetGemma3Features(m, c));
  } else {
    KVCM_RETURN_IF_ERROR(SetRope(m, c));
  }
  return SetLayerWindows(m, c);
}

}  // namespace

absl::StatusOr<LlamaConfig> LlamaConfigFromModelConfig(const ModelConfig& m) {
  const bool gguf = m.format == ModelConfig::Format::kGguf;
  auto required = [&](const std::optional<int32_t>& value,
                      const char* hf_key) -> absl::StatusOr<int32_t> {
    if (value.has_value()) return *value;
    if (gguf) return Invalid(m, absl::StrCat(m.KeyName(hf_key), " is missing"));
    return Invalid(m, absl::StrCat("missing required key \"", m.text_config ? "text_config." : "",
                                   hf_key, "\""));
  };

  LlamaConfig c;
  KVCM_ASSIGN_OR_RETURN(c.architecture, ArchitectureOf(m));
  KVCM_ASSIGN_OR_RETURN(c.vocab_size, required(m.vocab_size, "vocab_size"));
  KVCM_ASSIGN_OR_RETURN(c.hidden_size, required(m.hidden_size, "hidden_size"));
  KVCM_ASSIGN_OR_RETURN(c.intermediate_size, required(m.intermediate_size, "intermediate_size"));
  c.num_hidden_layers = m.num_hidden_layers;
  c.num_attention_heads = m.num_attention_heads;
  c.num_key_value_heads = m.num_key_value_heads;
  c.head_dim = m.head_dim;
  if (c.head_dim % 2 != 0) {
    return Invalid(m, absl::StrCat(gguf ? m.KeyName("head_dim") : "head_dim",
                                   " must be even for RoPE, got ", c.head_dim));
  }
  if (gguf) {
    KVCM_RETURN_IF_ERROR(CheckGgufShape(m, c.head_dim));
  }
  c.rms_norm_eps = static_cast<float>(m.rms_norm_eps.value_or(1e-6));
  // Gemma3TextConfig's default context is 131072, Llama's 2048.
  c.max_position_embeddings = m.max_position_embeddings.value_or(
      c.architecture.starts_with("Gemma3ForCausalLM") ? 131072 : 2048);
  c.tie_word_embeddings = m.tie_word_embeddings;
  c.bos_token_id = m.bos_token_id.value_or(-1);
  c.eos_token_ids = m.eos_token_ids;
  if (m.eot_token_id.has_value() && std::find(c.eos_token_ids.begin(), c.eos_token_ids.end(),
                                              *m.eot_token_id) == c.eos_token_ids.end()) {
    c.eos_token_ids.push_back(*m.eot_token_id);  // GGUF: generation ends at the end of a turn
  }
  c.torch_dtype = gguf ? absl::StrCat("GGUF ", m.gguf_weight_type) : m.torch_dtype;

  KVCM_RETURN_IF_ERROR(SetFamilyFeatures(m, &c));
  return c;
}

absl::StatusOr<LlamaConfig> ParseLlamaConfig(const std::string& json_text) {
  KVCM_ASSIGN_OR_RETURN(const ModelConfig config, ParseHfModelConfig(json_text));
  return LlamaConfigFromModelConfig(config);
}

absl::StatusOr<LlamaConfig> LoadLlamaConfig(const std::string& path) {
  KVCM_ASSIGN_OR_RETURN(const ModelConfig config, ReadHfModelConfigFile(path));
  return LlamaConfigFromModelConfig(config);
}

absl::StatusOr<LlamaConfig> LlamaConfigFromGguf(const GgufFile& file) {
  KVCM_ASSIGN_OR_RETURN(const ModelConfig config, ModelConfigFromGguf(file));
  return LlamaConfigFromModelConfig(config);
}

}  // namespace kvcm::executor
