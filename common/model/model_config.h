#pragma once
// ModelConfig: a model's hyperparameters as its files state them, read once for every
// process that needs them (docs/architecture.md): the cache manager, kvcmctl and the launcher
// derive the KV-cache shape from it (common/sizing/model_config.h), the executor builds its
// LlamaConfig from it (services/executor/model/llama_config.h). The reader checks that every key it
// reads is well formed and consistent; which architectures and features a consumer supports
// is the consumer's to check (the executor refuses what it cannot compute).
//
// `--model PATH` (ReadModelConfig) is either
//
//   a Hugging Face folder (its config.json) or a config.json file. Keys, from the top level,
//   or from "text_config" when the top level has no "num_hidden_layers" (multimodal models:
//   Llama 4, Gemma 3, ...; "architectures" and "model_type" are the top level's):
//
//     architectures, model_type     as written (a non-empty list of strings; a string)
//     num_hidden_layers             required
//     num_attention_heads           required
//     num_key_value_heads           absent or null: num_attention_heads (MHA); must divide it
//     head_dim                      absent or null: hidden_size / num_attention_heads (then
//                                   hidden_size is required and must divide exactly)
//     hidden_size, intermediate_size, vocab_size, max_position_embeddings   positive ints
//     rms_norm_eps, rope_theta      positive numbers
//     rope_scaling                  transformers < 5: {"rope_type" (or "type"), "factor",
//                                   "low_freq_factor", "high_freq_factor",
//                                   "original_max_position_embeddings", ...}
//     rope_parameters               transformers >= 5's spelling of rope_theta and
//                                   rope_scaling together; where both spellings are present
//                                   they must agree (INVALID_ARGUMENT otherwise). Keys of
//                                   either that the reader does not interpret are kept in
//                                   RopeConfig::other_keys; a per-layer-type set
//                                   ({"full_attention": {...}, ...}): each type's set in
//                                   rope_per_layer_type (its rope_theta in
//                                   RopeConfig::theta), the first type's name in
//                                   rope.per_layer_type
//     rope_local_base_freq, query_pre_attn_scalar   Gemma: positive numbers
//     attn_logit_softcapping, final_logit_softcapping   Gemma: positive numbers or null
//     tie_word_embeddings, attention_bias, mlp_bias, use_sliding_window,
//     use_bidirectional_attention   booleans
//     hidden_act, hidden_activation (Gemma's spelling)   strings
//     sliding_window (or sliding_window_size)   an integer; null or false: none
//     layer_types                   transformers >= 4.53: each layer's attention type, one
//                                   string per layer ("full_attention", "sliding_attention")
//     max_window_layers             Qwen2/Qwen3: the first layer index a window applies to
//     sliding_window_pattern        Gemma 2/3 before layer_types: every Nth layer is full
//     bos_token_id                  a token id or null; eos_token_id: an id, a list or null
//                                   (ids inside [0, vocab_size) when vocab_size is given)
//     torch_dtype (or "dtype", its name since transformers 4.56)   a string, from the
//                                   section, else the top level
//     kv_lora_rank                  multi-head latent attention (DeepSeek-V2/V3)
//
//   a GGUF file (llama.cpp's keys, ARCH = general.architecture, which is required):
//
//     ARCH.block_count -> num_hidden_layers, ARCH.attention.head_count ->
//     num_attention_heads, ARCH.attention.head_count_kv (default head_count),
//     ARCH.attention.key_length -> head_dim (default embedding_length / head_count),
//     ARCH.attention.value_length, ARCH.rope.dimension_count, ARCH.embedding_length ->
//     hidden_size, ARCH.feed_forward_length -> intermediate_size, ARCH.context_length ->
//     max_position_embeddings, ARCH.vocab_size (default: the number of
//     tokenizer.ggml.tokens), ARCH.attention.layer_norm_rms_epsilon, ARCH.rope.freq_base,
//     ARCH.rope.scaling.type ("none" reads "default") and .factor,
//     ARCH.attention.sliding_window, tokenizer.ggml.bos_token_id, tokenizer.ggml.eos_token_id
//     (eos_token_ids) and .eot_token_id (eot_token_id); tie_word_embeddings is true when
//     there is no output.weight tensor; the types of token_embd.weight and of most 2-D
//     weights, and whether a rope_freqs.weight tensor is present.
//
// Errors name the file and the key:
//   INVALID_ARGUMENT  malformed JSON (with the parser's message) or GGUF metadata; a required
//                     key missing; a value of the wrong type or out of range; heads that do
//                     not divide; disagreeing RoPE spellings
//   NOT_FOUND         the file cannot be opened or read; GgufFile::Open's errors otherwise
//
// Thread safety: a plain value.

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvcm {

class GgufFile;

// One RoPE parameter set as written (HF rope_scaling / rope_parameters, GGUF
// ARCH.rope.scaling.*); which types and keys are supported is the consumer's to say.
struct RopeConfig {
  // Where the set came from, for messages: "rope_scaling" or "rope_parameters" (HF; the
  // former when both are present), "ARCH.rope.scaling.type" (GGUF), "" when there is none.
  std::string source;
  std::string type = "default";  // "rope_type" (older configs: "type"); "default" when absent
  std::optional<double> factor;
  std::optional<double> low_freq_factor;
  std::optional<double> high_freq_factor;
  std::optional<int32_t> original_max_position_embeddings;
  std::optional<double> partial_rotary_factor;
  // Every other key of the set, as ("rope_parameters.attention_factor", its JSON text).
  std::vector<std::pair<std::string, std::string>> other_keys;
  // A per-layer-type set (transformers 5: {"full_attention": {...}, ...}): the first layer
  // type's name; the sets themselves are ModelConfig::rope_per_layer_type.
  std::string per_layer_type;
  // rope_theta inside the set (a per-layer-type set's own base); nullopt when absent.
  std::optional<double> theta;
};

struct ModelConfig {
  enum class Format { kHuggingFace, kGguf };
  Format format = Format::kHuggingFace;
  std::string path;          // the config.json or GGUF file read; "" for ParseHfModelConfig
  bool text_config = false;  // HF: the hyperparameters are text_config's

  // HF: the top level's "architectures" and "model_type". GGUF: no architectures, and
  // model_type is general.architecture ("llama", "qwen2", ...).
  std::vector<std::string> architectures;
  std::string model_type;

  // The attention shape: always set.
  int32_t num_hidden_layers = 0;
  int32_t num_attention_heads = 0;
  int32_t num_key_value_heads = 0;
  int32_t head_dim = 0;
  std::optional<int32_t> value_head_dim;        // GGUF ARCH.attention.value_length
  std::optional<int32_t> rope_dimension_count;  // GGUF ARCH.rope.dimension_count
  std::optional<int32_t> kv_lora_rank;          // multi-head latent attention

  std::optional<int32_t> hidden_size;
  std::optional<int32_t> intermediate_size;
  std::optional<int32_t> vocab_size;
  std::optional<int32_t> max_position_embeddings;
  std::optional<double> rms_norm_eps;
  std::optional<double> rope_theta;
  RopeConfig rope;
  // HF rope_parameters per layer type (Gemma 3): each layer type's name and its set (source
  // "rope_parameters.TYPE", theta its rope_theta), in the file's order; empty otherwise.
  std::vector<std::pair<std::string, RopeConfig>> rope_per_layer_type;
  // Gemma 3 (transformers < 5): the sliding layers' RoPE base, "rope_local_base_freq".
  std::optional<double> rope_local_base_freq;
  // Gemma: the attention scale is query_pre_attn_scalar ** -0.5 (instead of head_dim's).
  std::optional<double> query_pre_attn_scalar;
  // Gemma 2/3: tanh soft-capping of attention scores and of the final logits; nullopt when
  // absent or null.
  std::optional<double> attn_logit_softcapping;
  std::optional<double> final_logit_softcapping;
  std::optional<bool> use_bidirectional_attention;  // Gemma 3 (embedding models)
  bool tie_word_embeddings = false;
  bool tie_word_embeddings_given = false;  // HF: the key is present
  std::optional<bool> attention_bias;
  std::optional<bool> mlp_bias;
  std::optional<std::string> hidden_act;
  std::optional<std::string> hidden_activation;  // Gemma's name for the MLP's activation
  std::optional<int64_t> sliding_window;         // a window length, from sliding_window_key
  std::string sliding_window_key;
  std::optional<bool> use_sliding_window;
  std::vector<std::string> layer_types;           // HF, as written; empty when absent
  std::optional<int32_t> max_window_layers;       // HF (Qwen2, Qwen3)
  std::optional<int32_t> sliding_window_pattern;  // HF (Gemma 2, Gemma 3)
  std::optional<int32_t> bos_token_id;
  std::vector<int32_t> eos_token_ids;   // without repeats
  std::optional<int32_t> eot_token_id;  // GGUF: end of turn (chat models), generation ends too

  // HF: the checkpoint's dtype name as written ("bfloat16"), and the key it came from
  // ("torch_dtype" or "dtype"); "" when absent. GGUF: "".
  std::string torch_dtype;
  std::string torch_dtype_key;
  // GGUF: the ggml type names of token_embd.weight ("" when absent) and of most 2-D weights
  // ("F32" when there are none), and whether a rope_freqs.weight tensor is present.
  std::string gguf_embedding_type;
  std::string gguf_weight_type;
  bool gguf_rope_freqs = false;

  // How messages name the Hugging Face key `hf_key` in this model's file: `key "head_dim"`
  // (`key "text_config.head_dim"` when nested) or, for GGUF, the llama.cpp key
  // (`GGUF key "llama.attention.key_length"`).
  std::string KeyName(absl::string_view hf_key) const;
  // The prefix of messages about this model: "PATH: model config: " (HF; "model config: "
  // without a path) or "PATH: " (GGUF).
  std::string Where() const;
};

// Parses the text of a config.json (errors start "model config: ").
absl::StatusOr<ModelConfig> ParseHfModelConfig(const std::string& json_text);

// Reads a config.json file; errors are prefixed with its path.
absl::StatusOr<ModelConfig> ReadHfModelConfigFile(const std::string& path);

// The hyperparameters in an open GGUF file's metadata; errors name the file and the key.
absl::StatusOr<ModelConfig> ModelConfigFromGguf(const GgufFile& file);

// What --model names: a GGUF file (by its magic), a Hugging Face folder (its config.json) or
// a config.json file.
absl::StatusOr<ModelConfig> ReadModelConfig(const std::string& path);

// Each layer's attention window in tokens, 0 for full attention: a layer with window W
// attends from a query at position p to positions p - W + 1 .. p (as transformers masks
// it). As transformers decides it, by family (model_type, else the first architecture's
// name before "For", lowercased), in this order:
//   - Qwen2 and Qwen3 (model_type qwen2, qwen3) have none without "use_sliding_window";
//   - Mistral: the window on every layer ("layer_types" is ignored, as transformers does);
//   - "layer_types": "full_attention" is 0, "sliding_attention" the sliding window (which
//     must then be given); any other type is UNIMPLEMENTED naming the key and the type;
//   - Qwen2 and Qwen3: the window on the layers from "max_window_layers" (default 28) on;
//   - Gemma 2 and Gemma 3 (model_type gemma2, gemma3, gemma3_text; GGUF gemma2, gemma3):
//     the window on every layer but each "sliding_window_pattern"-th (default 2 for Gemma 2,
//     6 for Gemma 3; GGUF files use these defaults, as llama.cpp does);
//   - any other model: the window on every layer when there is one.
// A window longer than INT32_MAX tokens is full attention. Which of these a consumer can
// compute is the consumer's to check.
absl::StatusOr<std::vector<int32_t>> LayerWindows(const ModelConfig& config);

// The ids generation ends at for the model at `path`, without repeats: a folder's config.json
// eos_token_id, then its generation_config.json's (as transformers' generate() and vLLM read
// them); a GGUF file's eos ids, then its eot id. The errors of ReadModelConfig, and
// INVALID_ARGUMENT "PATH/generation_config.json: eos_token_id must be token ids in [0, V),
// got ..." for a malformed one. (The router's metadata and the executor's min_tokens both
// use it: one rule for where generation ends.)
absl::StatusOr<std::vector<int32_t>> ReadEndTokenIds(const std::string& path);

}  // namespace kvcm
