#pragma once

// The KV-cache shape (KvCacheSpec) of a model, from its ModelConfig (common/model/
// model_config.h: a Hugging Face config.json or a GGUF file's metadata), so users need not
// copy model dimensions by hand.
//
//   num_layers    num_hidden_layers (GGUF ARCH.block_count)
//   num_kv_heads  num_key_value_heads (absent: num_attention_heads, MHA; GGUF
//                 ARCH.attention.head_count_kv)
//   head_dim      head_dim (absent: hidden_size / num_attention_heads; GGUF
//                 ARCH.attention.key_length)
//   dtype         the override when given; else the config's torch_dtype (or "dtype", its
//                 newer name): bfloat16, float16 or float32; for GGUF the type of the token
//                 embeddings when it is F32, F16 or BF16, else fp16 (the weights are
//                 quantized; fp16 is llama.cpp's default cache type)
//
// Configs with multi-head latent attention ("kv_lora_rank", DeepSeek-V2/V3) cache a
// compressed latent rather than per-head K and V; the formula above does not describe
// them, so they are rejected rather than sized wrongly. Sliding-window attention does not
// change the size of a block, only how many a sequence keeps.
//
// Errors: ReadModelConfig's (INVALID_ARGUMENT naming the key for a missing, mistyped or
// out-of-range key, malformed JSON with the parser's message; NOT_FOUND naming the path for
// a file that cannot be read), and INVALID_ARGUMENT for multi-head latent attention, a
// missing or unknown torch_dtype without override, or what KvCacheSpec::Validate refuses.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/model/model_config.h"
#include "common/sizing/kv_cache_spec.h"

namespace kvcm {

// The spec of `config`. `block_size` is not in the model config; the caller chooses it.
// `dtype_override` is the KV-cache dtype when set (e.g. fp8 for a bf16 model); otherwise the
// config's is used.
//
// `notes`, when given, receives what a user should know about choices made for them, one
// line each: which KV dtype was taken from the config and how to pick another (a float32
// config would size a pool twice as large as bf16), and what the config's sliding windows
// do to the pool (blocks released behind the window when every layer has one; KV cache
// groups when layers of several attention types mix).
absl::StatusOr<KvCacheSpec> SpecFromModelConfig(const ModelConfig& config, int32_t block_size,
                                                std::optional<DType> dtype_override,
                                                std::vector<std::string>* notes = nullptr);

// The sliding window behind which the cache manager may release a sequence's blocks for
// `config` (--sliding-window-tokens): the widest layer window when every layer has one
// (LayerWindows), else 0 (some layer attends to the whole context). LayerWindows' errors.
absl::StatusOr<int32_t> ReleasableWindow(const ModelConfig& config);

// Blocks a sequence of `seq_len` tokens holds while it decodes under a release window of
// `window` tokens (> 0): the window and up to two blocks being filled, at most its own
// blocks. With window 0, all its blocks.
int64_t BlocksHeldUnderWindow(int64_t seq_len, int32_t window, int32_t block_size);

// SpecFromModelConfig of the text of a config.json (ParseHfModelConfig).
absl::StatusOr<KvCacheSpec> SpecFromHfConfig(const std::string& json_text, int32_t block_size,
                                             std::optional<DType> dtype_override,
                                             std::vector<std::string>* notes = nullptr);

// SpecFromModelConfig of a config.json file; errors are prefixed with the path.
absl::StatusOr<KvCacheSpec> SpecFromHfConfigFile(const std::string& path, int32_t block_size,
                                                 std::optional<DType> dtype_override,
                                                 std::vector<std::string>* notes = nullptr);

// SpecFromModelConfig of a GGUF file; errors name the file (and the key).
absl::StatusOr<KvCacheSpec> SpecFromGgufFile(const std::string& path, int32_t block_size,
                                             std::optional<DType> dtype_override,
                                             std::vector<std::string>* notes = nullptr);

// What a --model or --model-config flag names (ReadModelConfig): a GGUF file, a model
// folder (its config.json) or a config.json file.
absl::StatusOr<KvCacheSpec> SpecFromModelPath(const std::string& path, int32_t block_size,
                                              std::optional<DType> dtype_override,
                                              std::vector<std::string>* notes = nullptr);

}  // namespace kvcm
