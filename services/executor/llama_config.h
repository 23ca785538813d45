#pragma once
// LlamaConfig: the hyperparameters of a Llama-family model, read from a Hugging Face
// `config.json`.
//
// Keys (top level):
//
//   architectures            ["LlamaForCausalLM"], ["MistralForCausalLM"] or
//                            ["Qwen2ForCausalLM"]; when absent, "model_type" must be
//                            "llama", "mistral" or "qwen2"
//   attention_bias           (Llama) bias on q, k, v and o: default false
//   use_sliding_window       (Qwen2) must be false; its sliding_window is then unused
//   vocab_size               required
//   hidden_size              required
//   intermediate_size        required
//   num_hidden_layers        required
//   num_attention_heads      required
//   num_key_value_heads      default num_attention_heads (MHA); must divide it
//   head_dim                 default hidden_size / num_attention_heads (must divide)
//   rms_norm_eps             default 1e-6 (HF LlamaConfig's default)
//   rope_theta               default 10000 (transformers 5: in rope_parameters)
//   max_position_embeddings  default 2048 (HF LlamaConfig's default)
//   tie_word_embeddings      default false
//   bos_token_id             int, list of ints or null (default none)
//   eos_token_id             int, list of ints or null (default none)
//   torch_dtype (or dtype)   the checkpoint's dtype name; informational
//   rope_scaling             null, or {"rope_type": "llama3" | "linear" | "default", ...};
//                            "llama3" (Llama 3.1+) and "linear" are implemented
//   rope_parameters          transformers >= 5's spelling of both: {"rope_theta": ...,
//                            "rope_type": ..., factor, ...}; read like rope_scaling, and
//                            where both spellings are present they must agree
//                            (INVALID_ARGUMENT otherwise). A key of either that changes RoPE
//                            and is not understood (attention_factor, beta_fast, ...) is
//                            UNIMPLEMENTED, never ignored; so is a per-layer-type
//                            rope_parameters.
//
// Rejected, naming the key:
//   UNIMPLEMENTED     another architecture; rope_scaling of another type (dynamic, yarn,
//                     longrope, ...); mlp_bias true; hidden_act other than "silu"; a Mistral
//                     sliding_window shorter than max_position_embeddings; Qwen2's
//                     use_sliding_window true
//   INVALID_ARGUMENT  malformed JSON, a required key missing, a value of the wrong type or
//                     out of range (the message names the key and the value)
//   NOT_FOUND         (LoadLlamaConfig) the file cannot be read
//
// Thread safety: a plain value.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/sizing/kv_cache_spec.h"
#include "common/tokenizer/tokenizer.h"

namespace kvcm {

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
  std::string architecture;  // e.g. "LlamaForCausalLM"
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
  bool o_bias = false;    // o_proj has one (Llama's attention_bias)
  int32_t bos_token_id = -1;           // -1: none
  std::vector<int32_t> eos_token_ids;  // empty: none; generation stops on any of them
  std::string torch_dtype;             // as written, "" when absent

  // The KV-cache block shape of this model: num_hidden_layers x num_key_value_heads x
  // head_dim in `dtype`, `block_size` tokens per block. INVALID_ARGUMENT from
  // KvCacheSpec::Validate when block_size is out of range.
  absl::StatusOr<KvCacheSpec> KvSpec(DType dtype, int32_t block_size) const;

  // One line for logs.
  std::string ToString() const;

  // What LoadTokenizer needs of it.
  TokenizerConfig Tokenizer() const { return {vocab_size, bos_token_id, eos_token_ids}; }
};

// Parses the text of a config.json (see the key table above).
absl::StatusOr<LlamaConfig> ParseLlamaConfig(const std::string& json_text);

// Reads and parses a config.json file; errors are prefixed with its path.
absl::StatusOr<LlamaConfig> LoadLlamaConfig(const std::string& path);

// The same hyperparameters from a GGUF file's metadata (llama.cpp's keys, ARCH being
// general.architecture):
//
//   general.architecture                   "llama" (Llama 2/3, SmolLM, Mistral) or "qwen2"
//                                          (bias on q/k/v)
//   ARCH.block_count                       num_hidden_layers
//   ARCH.embedding_length                  hidden_size
//   ARCH.feed_forward_length               intermediate_size
//   ARCH.attention.head_count              num_attention_heads
//   ARCH.attention.head_count_kv           num_key_value_heads (default: head_count)
//   ARCH.attention.key_length              head_dim (default hidden / heads); value_length
//                                          and rope.dimension_count must equal it
//   ARCH.attention.layer_norm_rms_epsilon  rms_norm_eps (required)
//   ARCH.rope.freq_base                    rope_theta (default 10000)
//   ARCH.rope.scaling.type / .factor       "none" or "linear"; others UNIMPLEMENTED
//   ARCH.context_length                    max_position_embeddings
//   ARCH.vocab_size                        vocab_size (default: the number of tokens)
//   tokenizer.ggml.bos_token_id            bos_token_id
//   tokenizer.ggml.eos_token_id, .eot_token_id   eos_token_ids
// tie_word_embeddings is true when there is no `output.weight` tensor; a `rope_freqs.weight`
// tensor (Llama 3.1's per-frequency RoPE factors) and an ARCH.attention.sliding_window are
// UNIMPLEMENTED. torch_dtype reads "GGUF <type>", the type most of the 2-D weights are in.
// Errors name the file and the key: INVALID_ARGUMENT for a missing or malformed key,
// UNIMPLEMENTED as above.
class GgufFile;
absl::StatusOr<LlamaConfig> LlamaConfigFromGguf(const GgufFile& file);

}  // namespace kvcm
