#include "services/executor/model/llama_config.h"

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
#include "common/base/status_macros.h"
#include "common/gguf/gguf_file.h"
#include "common/model/model_config.h"
#include "services/executor/model/architecture.h"

namespace kvcm::executor {

absl::Status Invalid(const ModelConfig& m, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(m.Where(), what));
}

absl::Status Unimplemented(const ModelConfig& m, absl::string_view what) {
  return absl::UnimplementedError(absl::StrCat(m.Where(), what));
}

absl::Status RequireSilu(const ModelConfig& m) {
  if (!m.hidden_act.has_value() || *m.hidden_act == "silu") return absl::OkStatus();
  return Unimplemented(
      m, absl::StrCat("\"hidden_act\" \"", *m.hidden_act, "\" is not supported (only \"silu\")"));
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

// The family a config names, and its name as LlamaConfig::architecture shows it.
struct Family {
  const Architecture* architecture = nullptr;
  std::string name;
};

// The family a config.json names ("architectures", else "model_type"), or the refusal
// naming the key.
absl::StatusOr<Family> HfFamily(const ModelConfig& m) {
  std::vector<absl::string_view> names, model_types;
  for (const Architecture& a : Architectures()) {
    names.push_back(a.hf_name);
    model_types.push_back(a.model_type);
  }
  if (!m.architectures.empty()) {
    for (const std::string& name : m.architectures) {
      if (name == "Gemma3ForConditionalGeneration") {
        return RefuseMultimodalGemma3(m, "\"architectures\" Gemma3ForConditionalGeneration");
      }
      if (const Architecture* a = FindArchitecture(name); a != nullptr) {
        return Family{a, std::string(a->hf_name)};
      }
    }
    return absl::UnimplementedError(
        absl::StrCat(m.Where(), "\"architectures\" [\"", absl::StrJoin(m.architectures, "\", \""),
                     "\"] is not supported (supported: ", absl::StrJoin(names, ", "), ")"));
  }
  if (m.model_type.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(m.Where(), "neither \"architectures\" nor \"model_type\" is given"));
  }
  if (const Architecture* a = FindModelType(m.model_type); a != nullptr) {
    return Family{a, std::string(a->hf_name)};
  }
  if (m.model_type == "gemma3") return RefuseMultimodalGemma3(m, "\"model_type\" gemma3");
  return absl::UnimplementedError(
      absl::StrCat(m.Where(), "\"model_type\" \"", m.model_type,
                   "\" is not supported (supported: ", absl::StrJoin(model_types, ", "), ")"));
}

// The family a GGUF file's general.architecture names, or config.json's.
absl::StatusOr<Family> FamilyOf(const ModelConfig& m) {
  if (m.format != ModelConfig::Format::kGguf) return HfFamily(m);
  if (const Architecture* a = FindGgufArchitecture(m.model_type); a != nullptr) {
    return Family{a, absl::StrCat(a->hf_name, " (GGUF ", a->gguf_name, ")")};
  }
  std::vector<absl::string_view> gguf_names;
  for (const Architecture& a : Architectures()) {
    if (!a.gguf_name.empty()) gguf_names.push_back(a.gguf_name);
  }
  return Unimplemented(
      m, absl::StrCat("general.architecture \"", m.model_type,
                      "\" is not supported (supported: ", absl::StrJoin(gguf_names, ", "), ")"));
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

// Each layer's sliding window (ModelConfig's LayerWindows), for the families that attend
// within one as transformers does (Architecture::windowed). Llama has none (transformers
// ignores the key), so a Llama config's window shorter than its context is refused rather
// than guessed at, as is a window in a GGUF file of a family whose llama.cpp code applies
// none (Architecture::gguf_windows).
absl::Status SetLayerWindows(const ModelConfig& m, const Architecture& family, LlamaConfig* c) {
  KVCM_ASSIGN_OR_RETURN(c->layer_windows, LayerWindows(m));
  const bool any = std::any_of(c->layer_windows.begin(), c->layer_windows.end(),
                               [](int32_t w) { return w > 0; });
  if (!any) return absl::OkStatus();
  if (m.format == ModelConfig::Format::kGguf && !family.gguf_windows) {
    return Unimplemented(
        m, absl::StrCat("GGUF key \"", m.sliding_window_key,
                        "\" (sliding-window attention) is not supported for ", m.model_type));
  }
  if (!family.windowed && m.sliding_window.value_or(0) < c->max_position_embeddings) {
    return Unimplemented(
        m, absl::StrCat("\"", m.sliding_window_key, "\" ", *m.sliding_window,
                        " (shorter than max_position_embeddings=", c->max_position_embeddings,
                        ") is not supported for ", c->architecture));
  }
  if (!family.windowed) std::fill(c->layer_windows.begin(), c->layer_windows.end(), 0);
  return absl::OkStatus();
}

// What every family refuses, then the family's own differences (its file), then the windows.
absl::Status SetFamilyFeatures(const ModelConfig& m, const Architecture& family, LlamaConfig* c) {
  if (m.mlp_bias.value_or(false)) return Unimplemented(m, "\"mlp_bias\": true is not supported");
  if (m.format == ModelConfig::Format::kGguf && m.gguf_rope_freqs) {
    return Unimplemented(
        m,
        "tensor \"rope_freqs.weight\" (per-frequency RoPE factors, as Llama 3.1 files carry) is "
        "not supported yet");
  }
  KVCM_RETURN_IF_ERROR(family.set_features(m, c));
  return SetLayerWindows(m, family, c);
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
  KVCM_ASSIGN_OR_RETURN(Family family, FamilyOf(m));
  c.architecture = std::move(family.name);
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
  c.max_position_embeddings =
      m.max_position_embeddings.value_or(family.architecture->default_context);
  c.tie_word_embeddings = m.tie_word_embeddings;
  c.bos_token_id = m.bos_token_id.value_or(-1);
  c.eos_token_ids = m.eos_token_ids;
  if (m.eot_token_id.has_value() && std::find(c.eos_token_ids.begin(), c.eos_token_ids.end(),
                                              *m.eot_token_id) == c.eos_token_ids.end()) {
    c.eos_token_ids.push_back(*m.eot_token_id);  // GGUF: generation ends at the end of a turn
  }
  c.torch_dtype = gguf ? absl::StrCat("GGUF ", m.gguf_weight_type) : m.torch_dtype;

  KVCM_RETURN_IF_ERROR(SetFamilyFeatures(m, *family.architecture, &c));
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
