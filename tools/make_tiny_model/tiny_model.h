#pragma once
// Tiny random Llama models in the Hugging Face format (config.json + *.safetensors), for
// tests and the demo: the library behind kvcm-make-tiny-model.
//
// The weights are drawn from a seeded generator, one stream per tensor (seeded by the model
// seed and the tensor's name), so a folder is a pure function of its options. Scales are
// chosen so that activations stay near unit size and logits have a standard deviation of
// about 2: greedy decoding has clear winners and sampling is not uniform.
//
//   model.embed_tokens.weight, lm_head.weight   N(0, 1), N(0, 2 / sqrt(hidden))
//   *_layernorm.weight, model.norm.weight       1 + N(0, 0.1)
//   q/k/v/o/gate/up/down_proj.weight            N(0, 1 / sqrt(fan_in))
//   q/k/v_proj.bias (qwen2; llama and qwen3 with attention_bias), o_proj.bias (llama and
//   qwen3 with attention_bias)                  N(0, 0.5)
//   self_attn.q_norm/k_norm.weight (qwen3)      1 + N(0, 0.1)
//
// No tokenizer file is written: the model uses the byte-level tokenizer (tokenizer.h),
// hence vocab 320 >= 259, BOS 1, EOS 2.
//
// Thread safety: plain functions.

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/sizing/kv_cache_spec.h"

namespace kvcm {

struct TinyModelOptions {
  // "llama" (LlamaForCausalLM), "mistral" (MistralForCausalLM: Llama's layers), "qwen2"
  // (Qwen2ForCausalLM: the same layers with a bias on q, k and v, large enough to change
  // every logit) or "qwen3" (Qwen3ForCausalLM: Llama's layers with an RMSNorm over each head
  // of q and of k).
  std::string architecture = "llama";
  // llama and qwen3: "attention_bias", a bias on q, k, v and o.
  bool attention_bias = false;
  // > 0: sliding-window attention of this many tokens. mistral: "sliding_window" (every
  // layer); qwen2 and qwen3: "use_sliding_window": true, "sliding_window" and
  // "max_window_layers" (the layers from that index on slide). Not for llama.
  int32_t sliding_window = 0;
  int32_t max_window_layers = 0;
  int32_t vocab_size = 320;  // >= 259 for the byte-level tokenizer
  int32_t hidden_size = 64;
  int32_t intermediate_size = 128;
  int32_t num_layers = 4;
  int32_t num_heads = 4;
  int32_t num_kv_heads = 2;  // GQA: two query heads per KV head
  int32_t head_dim = 16;     // written as "head_dim"; need not be hidden / heads
  double rope_theta = 10000.0;
  double rms_norm_eps = 1e-5;
  int32_t max_position_embeddings = 2048;
  bool tie_word_embeddings = false;  // true: no lm_head.weight, logits use the embeddings
  DType dtype = DType::kFloat32;     // weight dtype in the file: fp32, fp16 or bf16
  uint64_t seed = 0x6b76636d;        // "kvcm"
  int32_t num_shards = 1;            // > 1: model-0000i-of-0000n.safetensors + index.json
  // RoPE scaling in config.json: "" (none), "linear" or "llama3" (with the factors below).
  std::string rope_scaling;
  double rope_factor = 1.0;
  double rope_low_freq_factor = 1.0;
  double rope_high_freq_factor = 4.0;
  int32_t rope_original_max_position_embeddings = 0;
  // Write transformers >= 5's "rope_parameters" (rope_theta and the scaling in one object)
  // instead of top-level "rope_theta" and "rope_scaling".
  bool rope_parameters = false;
};

// The config.json text for `options`.
std::string TinyModelConfigJson(const TinyModelOptions& options);

// Creates `folder` (and parents) and writes config.json and the safetensors shard(s).
// INVALID_ARGUMENT for inconsistent options (another architecture, attention_bias with
// qwen2, a sliding window with llama or out of range, heads not a multiple of KV heads, odd
// head_dim, fp8 dtype, a non-positive size, more shards than layers); INTERNAL when writing fails.
absl::Status WriteTinyModel(const std::string& folder, const TinyModelOptions& options);

}  // namespace kvcm
