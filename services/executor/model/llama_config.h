#pragma once
// LlamaConfig: the hyperparameters of a Llama-family model, built from the model's
// ModelConfig (common/model/model_config.h reads config.json or a GGUF file's metadata, and
// refuses malformed keys: INVALID_ARGUMENT naming the key). What is checked here is what the
// forward pass supports, with these defaults:
//
//   architecture             "architectures" naming LlamaForCausalLM, MistralForCausalLM,
//                            Qwen2ForCausalLM, Qwen3ForCausalLM or Gemma3ForCausalLM; when
//                            absent, "model_type" llama, mistral, qwen2, qwen3 or gemma3_text;
//                            GGUF general.architecture llama (Llama 2/3, SmolLM, Mistral),
//                            qwen2 (bias on q/k/v), qwen3 (dense Qwen3: per-head q/k norm,
//                            no bias) or gemma3; the families are architecture.h's table,
//                            each one's differences in its own file (llama.cc, qwen.cc,
//                            gemma3.cc)
//   Gemma 3 (text)           q/k norm, norms computed as x_normed * (1 + w), embeddings
//                            scaled by sqrt(hidden_size), norms after attention and the MLP,
//                            attention scale query_pre_attn_scalar ** -0.5 (default 256),
//                            hidden_activation gelu_pytorch_tanh (the default; no other),
//                            one RoPE for the full-attention layers (rope_theta, default 1e6,
//                            with its scaling; rope_parameters.full_attention) and one for
//                            the sliding ones (rope_local_base_freq, default 10000;
//                            rope_parameters.sliding_attention), tied embeddings by default
//   vocab_size, hidden_size, intermediate_size   required (GGUF: ARCH.vocab_size, else the
//                            number of tokens; ARCH.embedding_length; ARCH.feed_forward_length)
//   head_dim                 even (RoPE); GGUF attention.value_length and
//                            rope.dimension_count must equal it
//   rms_norm_eps             default 1e-6 (HF LlamaConfig's default); GGUF: required
//   rope_theta               default 10000
//   max_position_embeddings  default 2048 (HF LlamaConfig's default)
//   rope scaling             none, "linear" (factor) or "llama3" (Llama 3.1+: factor,
//                            low_freq_factor default 1, high_freq_factor default 4,
//                            original_max_position_embeddings required); GGUF none or linear.
//                            A RoPE key that is not understood (attention_factor, beta_fast,
//                            a partial_rotary_factor other than 1, ...) is UNIMPLEMENTED, never
//                            ignored; so is a per-layer-type rope_parameters except
//                            Gemma 3's full_attention and sliding_attention sets
//   attention_bias           (Llama, Qwen3) bias on q, k, v and o: default false; Qwen2:
//                            q, k, v always
//   layer_windows            each layer's sliding window (ModelConfig's LayerWindows):
//                            Mistral's sliding_window on every layer; Qwen2's and Qwen3's
//                            from max_window_layers on with use_sliding_window; layer_types
//   qk_norm                  Qwen3: an RMSNorm (weights q_norm, k_norm of head_dim, epsilon
//                            rms_norm_eps) over each head of q and of k, before RoPE
//   bos_token_id, eos_token_id   as read (GGUF: eos and eot ids)
//   torch_dtype              informational; GGUF: "GGUF <type>", the type most of the 2-D
//                            weights are in
//
// Rejected, naming the key:
//   UNIMPLEMENTED     another architecture (Gemma3ForConditionalGeneration, the multimodal
//                     Gemma 3, named as such); Gemma 3's attn_logit_softcapping or
//                     final_logit_softcapping non-null, use_bidirectional_attention true, a
//                     hidden_activation other than gelu_pytorch_tanh, a rope_parameters
//                     layer type other than full_attention and sliding_attention, or
//                     rope_scaling beside a per-layer-type rope_parameters; rope scaling
//                     of another type (dynamic, yarn, longrope, ...); mlp_bias true;
//                     hidden_act other than "silu"; a Llama sliding_window shorter than
//                     max_position_embeddings; a layer type other than full or sliding
//                     attention; GGUF: ARCH.attention.sliding_window (but gemma3's), a
//                     rope_freqs.weight tensor (Llama 3.1's per-frequency RoPE factors)
//   INVALID_ARGUMENT  a required key missing, an odd head_dim, a scaling without what its
//                     type needs; and ModelConfig's refusals (malformed JSON or metadata, a
//                     value of the wrong type or out of range)
//   NOT_FOUND         (LoadLlamaConfig) the file cannot be read
//
// Thread safety: a plain value.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/model/model_config.h"
#include "common/sizing/kv_cache_spec.h"
#include "common/tokenizer/tokenizer.h"

namespace kvcm {
class GgufFile;  // common/gguf/gguf_file.h
}  // namespace kvcm

namespace kvcm::executor {

// rope_scaling, resolved. kNone leaves the inverse frequencies as 1 / theta^(2i / head_dim).
struct RopeScaling {
  enum class Type { kNone, kLinear, kLlama3 };
  Type type = Type::kNone;
  double factor = 1.0;                           // linear and llama3
  double low_freq_factor = 1.0;                  // llama3
  double high_freq_factor = 4.0;                 // llama3
  int32_t original_max_position_embeddings = 0;  // llama3
};

// "none", "linear x4", "llama3 x8 (low 1, high 4, original 8192)": for logs.
std::string RopeScalingName(const RopeScaling& scaling);

struct LlamaConfig {
  std::string architecture;  // e.g. "LlamaForCausalLM", "Qwen3ForCausalLM (GGUF qwen3)"
  int32_t vocab_size = 0;
  int32_t hidden_size = 0;
  int32_t intermediate_size = 0;
  int32_t num_hidden_layers = 0;
  int32_t num_attention_heads = 0;
  int32_t num_key_value_heads = 0;
  int32_t head_dim = 0;
  float rms_norm_eps = 1e-6f;
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;
  int32_t max_position_embeddings = 2048;
  bool tie_word_embeddings = false;
  bool qkv_bias = false;  // q_proj, k_proj, v_proj have a bias (Qwen2; Llama's attention_bias)
  bool o_bias = false;    // o_proj has one (Llama's and Qwen3's attention_bias)
  // Qwen3, Gemma 3: q_norm and k_norm ([head_dim] RMSNorm weights) normalize each head of q
  // and of k after the projections (and biases), before RoPE.
  bool qk_norm = false;
  // Gemma 3: the sliding-window layers (layer_windows[l] > 0) rotate by their own RoPE
  // (rope_local_base_freq, or rope_parameters.sliding_attention); the full-attention layers
  // keep rope_theta and rope_scaling (rope_parameters.full_attention).
  bool local_rope = false;
  double local_rope_theta = 10000.0;
  RopeScaling local_rope_scaling;
  // Gemma stores its RMSNorm weights as w and computes x_normed * (1 + w); the loader adds this
  // to every norm weight (layer norms, q/k norms, the final norm) so that one RMSNorm serves
  // every family. 0 elsewhere.
  float norm_weight_offset = 0.0f;
  // Gemma: the token embeddings are multiplied by sqrt(hidden_size), rounded to the weights'
  // dtype as transformers does (the LM head, tied or not, is not scaled). 1 elsewhere.
  float embedding_scale = 1.0f;
  // Gemma 2/3: post_attention_layernorm normalizes the attention output before the residual,
  // pre_feedforward_layernorm is the MLP's input norm and post_feedforward_layernorm
  // normalizes the MLP output before the residual.
  bool sandwich_norms = false;
  // Gemma: attention scores are scaled by query_pre_attn_scalar ** -0.5; 0 means head_dim's.
  double query_pre_attn_scalar = 0.0;
  // The MLP's activation on gate: SiLU (Llama, Qwen), or GELU with the tanh approximation
  // (Gemma's gelu_pytorch_tanh).
  enum class Activation { kSilu, kGeluTanh };
  Activation activation = Activation::kSilu;
  // Each layer's sliding window in tokens, 0 for full attention (ModelConfig's LayerWindows):
  // a query at position p attends to positions p - W + 1 .. p. One entry per layer.
  std::vector<int32_t> layer_windows;
  int32_t bos_token_id = -1;           // -1: none
  std::vector<int32_t> eos_token_ids;  // empty: none; generation stops on any of them
  std::string torch_dtype;             // as written, "" when absent

  // The KV-cache block shape of this model: num_hidden_layers x num_key_value_heads x
  // head_dim in `dtype`, `block_size` tokens per block. INVALID_ARGUMENT from
  // KvCacheSpec::Validate when block_size is out of range.
  absl::StatusOr<KvCacheSpec> KvSpec(DType dtype, int32_t block_size) const;

  // The factor attention scores are multiplied by: 1 / sqrt(query_pre_attn_scalar, else
  // head_dim).
  float AttentionScale() const;

  // One line for logs.
  std::string ToString() const;

  // What LoadTokenizer needs of it.
  TokenizerConfig Tokenizer() const { return {vocab_size, bos_token_id, eos_token_ids}; }
};

// The LlamaConfig of `model` (see the table above); refusals start with model.Where().
absl::StatusOr<LlamaConfig> LlamaConfigFromModelConfig(const ModelConfig& model);

// LlamaConfigFromModelConfig of the text of a config.json.
absl::StatusOr<LlamaConfig> ParseLlamaConfig(const std::string& json_text);

// LlamaConfigFromModelConfig of a config.json file; errors are prefixed with its path.
absl::StatusOr<LlamaConfig> LoadLlamaConfig(const std::string& path);

// LlamaConfigFromModelConfig of a GGUF file's metadata (ModelConfigFromGguf); errors name
// the file and the key.
absl::StatusOr<LlamaConfig> LlamaConfigFromGguf(const GgufFile& file);

}  // namespace kvcm::executor
