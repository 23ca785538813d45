// Gemma 3's (text) differences from Llama (llama_config.h lists them): GeGLU
// (gelu_pytorch_tanh), RMSNorm computed with (1 + w), the embedding scale, norms after
// attention and the MLP as well as before (sandwich norms), query_pre_attn_scalar, QK norm,
// a local RoPE base for the window layers, and its defaults (tied embeddings, a context of
// 131072). Every sixth layer attends in full, the others within a window (layer_types or
// sliding_window_pattern: ModelConfig's LayerWindows). What Gemma has and the forward does
// not is refused naming the key rather than computing wrong logits.

#include <cmath>
#include <optional>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/base/float16.h"
#include "common/base/status_macros.h"
#include "services/executor/model/architecture.h"

namespace kvcm::executor {
namespace {

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

}  // namespace

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
  // Gemma 3's attention_bias is Llama's: q, k, v and o.
  c->qkv_bias = m.attention_bias.value_or(false);
  c->o_bias = c->qkv_bias;
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

}  // namespace kvcm::executor
