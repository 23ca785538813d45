#include "common/sizing/model_config.h"

#include <algorithm>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/base/status_macros.h"
#include "common/gguf/gguf_file.h"
#include "common/model/model_config.h"
#include "common/sizing/kv_cache_spec.h"

namespace kvcm {
namespace {

// The KV dtype of a GGUF model without an override: its embeddings' when they are not
// quantized, else llama.cpp's default cache type.
DType GgufCacheDType(const std::string& embedding_type) {
  if (embedding_type == "F32") return DType::kFloat32;
  if (embedding_type == "BF16") return DType::kBFloat16;
  return DType::kFloat16;
}

}  // namespace

absl::StatusOr<KvCacheSpec> SpecFromModelConfig(const ModelConfig& config, int32_t block_size,
                                                std::optional<DType> dtype_override,
                                                std::vector<std::string>* notes) {
  auto note = [&](std::string line) {
    if (notes != nullptr) notes->push_back(std::move(line));
  };
  const bool gguf = config.format == ModelConfig::Format::kGguf;
  if (config.kv_lora_rank.has_value()) {
    return absl::InvalidArgumentError(absl::StrCat(
        config.Where(),
        "multi-head latent attention (\"kv_lora_rank\") is not supported: its cache holds a "
        "compressed latent, not per-head K and V; give the dimensions explicitly"));
  }

  KvCacheSpec spec;
  spec.block_size = block_size;
  spec.num_layers = config.num_hidden_layers;
  spec.num_kv_heads = config.num_key_value_heads;
  spec.head_dim = config.head_dim;

  if (dtype_override.has_value()) {
    spec.dtype = *dtype_override;
  } else if (gguf) {
    // No token embeddings: as for quantized ones.
    const std::string type =
        config.gguf_embedding_type.empty() ? "Q8_0" : config.gguf_embedding_type;
    spec.dtype = GgufCacheDType(type);
    note(absl::StrCat("KV dtype ", std::string(DTypeName(spec.dtype)),
                      " for a GGUF model whose embeddings are ", type,
                      type == "F32" || type == "BF16" || type == "F16"
                          ? ""
                          : " (quantized weights: fp16 is llama.cpp's default cache type)",
                      "; give --dtype to pick another"));
  } else {
    if (config.torch_dtype_key.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          config.Where(),
          "missing key \"torch_dtype\" (or \"dtype\"); give the KV-cache dtype explicitly"));
    }
    absl::StatusOr<DType> dtype = ParseDType(config.torch_dtype);
    if (!dtype.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(config.Where(), "unsupported ", config.torch_dtype_key, " \"",
                       config.torch_dtype, "\"; give the KV-cache dtype explicitly"));
    }
    spec.dtype = *dtype;
    note(absl::StrCat(
        "KV dtype ", std::string(DTypeName(spec.dtype)), " from the config's ",
        config.torch_dtype_key, " \"", config.torch_dtype, "\"",
        spec.dtype == DType::kFloat32
            ? ": 4 bytes per element, twice a bf16 pool for the same tokens; --dtype bf16 (or "
              "fp16, fp8_e4m3) picks another"
            : "; --dtype picks another"));
  }
  if (absl::StatusOr<std::vector<int32_t>> windows = LayerWindows(config); windows.ok()) {
    const int64_t windowed =
        std::count_if(windows->begin(), windows->end(), [](int32_t w) { return w > 0; });
    const int32_t widest = windowed == 0 ? 0 : *std::max_element(windows->begin(), windows->end());
    if (windowed > 0 && windowed == static_cast<int64_t>(windows->size())) {
      note(absl::StrCat(
          "every layer attends within a sliding window of ", widest,
          " tokens: the cache manager releases a sequence's blocks behind it "
          "(--sliding-window-tokens), so a sequence holds about ",
          BlocksHeldUnderWindow(std::numeric_limits<int32_t>::max(), widest, block_size),
          " blocks at a time (the window and up to two blocks being filled); the "
          "pool's size does not change"));
    } else if (windowed > 0) {
      note(absl::StrCat(windowed, " of ", windows->size(),
                        " layers attend within a sliding window of ", widest,
                        " tokens, the others to the whole context: the cache manager keeps "
                        "a block table per KV cache group of layers, and a window group "
                        "releases the blocks behind its window (the pool is then laid out in "
                        "pages of a group's layers; see the KV cache groups below)"));
    }
  }
  if (absl::Status valid = spec.Validate(); !valid.ok()) {
    if (config.path.empty()) return valid;
    return absl::Status(valid.code(), absl::StrCat(config.path, ": ", valid.message()));
  }
  return spec;
}

absl::StatusOr<int32_t> ReleasableWindow(const ModelConfig& config) {
  KVCM_ASSIGN_OR_RETURN(const std::vector<int32_t> windows, LayerWindows(config));
  if (windows.empty() || *std::min_element(windows.begin(), windows.end()) == 0) return 0;
  return *std::max_element(windows.begin(), windows.end());
}

int64_t BlocksHeldUnderWindow(int64_t seq_len, int32_t window, int32_t block_size) {
  const int64_t all = (seq_len + block_size - 1) / block_size;
  if (window <= 0) return all;
  return std::min<int64_t>(all, (int64_t{window} + block_size - 1) / block_size + 2);
}

absl::StatusOr<KvCacheSpec> SpecFromHfConfig(const std::string& json_text, int32_t block_size,
                                             std::optional<DType> dtype_override,
                                             std::vector<std::string>* notes) {
  KVCM_ASSIGN_OR_RETURN(const ModelConfig config, ParseHfModelConfig(json_text));
  return SpecFromModelConfig(config, block_size, dtype_override, notes);
}

absl::StatusOr<KvCacheSpec> SpecFromHfConfigFile(const std::string& path, int32_t block_size,
                                                 std::optional<DType> dtype_override,
                                                 std::vector<std::string>* notes) {
  KVCM_ASSIGN_OR_RETURN(const ModelConfig config, ReadHfModelConfigFile(path));
  return SpecFromModelConfig(config, block_size, dtype_override, notes);
}

absl::StatusOr<KvCacheSpec> SpecFromGgufFile(const std::string& path, int32_t block_size,
                                             std::optional<DType> dtype_override,
                                             std::vector<std::string>* notes) {
  KVCM_ASSIGN_OR_RETURN(const std::unique_ptr<GgufFile> file, GgufFile::Open(path));
  KVCM_ASSIGN_OR_RETURN(const ModelConfig config, ModelConfigFromGguf(*file));
  return SpecFromModelConfig(config, block_size, dtype_override, notes);
}

absl::StatusOr<KvCacheSpec> SpecFromModelPath(const std::string& path, int32_t block_size,
                                              std::optional<DType> dtype_override,
                                              std::vector<std::string>* notes) {
  KVCM_ASSIGN_OR_RETURN(const ModelConfig config, ReadModelConfig(path));
  return SpecFromModelConfig(config, block_size, dtype_override, notes);
}

}  // namespace kvcm
