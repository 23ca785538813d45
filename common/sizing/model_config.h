#pragma once

// A KvCacheSpec from a Hugging Face `config.json`, so users need not copy model dimensions
// by hand.
//
// Keys read (from the top level, or from "text_config" when the top level has no
// "num_hidden_layers", as in multimodal configs):
//
//   num_hidden_layers     required                                  -> num_layers
//   num_attention_heads   required                                  (query heads)
//   num_key_value_heads   optional; absent or null means multi-head
//                         attention, num_attention_heads            -> num_kv_heads
//   head_dim              optional; absent or null means
//                         hidden_size / num_attention_heads, which
//                         must divide exactly                       -> head_dim
//   torch_dtype           (or "dtype", its newer name) bfloat16,
//                         float16 or float32; not read when a dtype
//                         override is given                         -> dtype
//
// Configs with multi-head latent attention ("kv_lora_rank", DeepSeek-V2/V3) cache a
// compressed latent rather than per-head K and V; the formula above does not describe
// them, so they are rejected rather than sized wrongly. Sliding-window attention does not
// change the size of a block, only how many a sequence keeps.
//
// Errors:
//   INVALID_ARGUMENT  malformed JSON (with the parser's message); a required key missing or
//                     of the wrong type (the message names the key); a value out of range
//                     (via KvCacheSpec::Validate); an unknown torch_dtype without override.
//   NOT_FOUND         (file overload) the file cannot be opened or read; names the path.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/sizing/kv_cache_spec.h"

namespace kvcm {

// Parses the text of a config.json. `block_size` is not in the model config; the caller
// chooses it. `dtype_override` is the KV-cache dtype when set (e.g. fp8 for a bf16 model);
// otherwise the config's torch_dtype is used. `num_key_value_heads` must divide
// `num_attention_heads` (grouped-query attention), or the config is refused.
//
// `notes`, when given, receives what a user should know about choices made for them, one
// line each: which KV dtype was taken from the config and how to pick another (a float32
// config would size a pool twice as large as bf16), and that a `sliding_window` in the
// config is ignored (the pool is sized for full attention: windows are not supported yet).
absl::StatusOr<KvCacheSpec> SpecFromHfConfig(const std::string& json_text, int32_t block_size,
                                             std::optional<DType> dtype_override,
                                             std::vector<std::string>* notes = nullptr);

// Reads the file at `path` and calls SpecFromHfConfig on its contents. Errors from parsing
// are prefixed with the path.
absl::StatusOr<KvCacheSpec> SpecFromHfConfigFile(const std::string& path, int32_t block_size,
                                                 std::optional<DType> dtype_override,
                                                 std::vector<std::string>* notes = nullptr);

// A KvCacheSpec from a GGUF file's metadata (ARCH = general.architecture):
// ARCH.block_count -> num_layers, ARCH.attention.head_count_kv (default head_count) ->
// num_kv_heads, ARCH.attention.key_length (default embedding_length / head_count) ->
// head_dim. The KV dtype, unless overridden: the type of the file's token embeddings when it
// is F32, F16 or BF16, else fp16 (the weights are quantized; fp16 is llama.cpp's default
// cache type) — said in `notes`, with how to pick another. ARCH.attention.sliding_window is
// noted as ignored, like a config.json's. Errors: GgufFile::Open's; INVALID_ARGUMENT naming
// the file and the key for a missing or malformed key, a head_count_kv that does not divide
// head_count, or what KvCacheSpec::Validate refuses.
absl::StatusOr<KvCacheSpec> SpecFromGgufFile(const std::string& path, int32_t block_size,
                                             std::optional<DType> dtype_override,
                                             std::vector<std::string>* notes = nullptr);

// What a --model or --model-config flag names: a GGUF file (SpecFromGgufFile), a model
// folder (its config.json) or a config.json file (SpecFromHfConfigFile).
absl::StatusOr<KvCacheSpec> SpecFromModelPath(const std::string& path, int32_t block_size,
                                              std::optional<DType> dtype_override,
                                              std::vector<std::string>* notes = nullptr);

}  // namespace kvcm
