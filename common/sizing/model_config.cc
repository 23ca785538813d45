#include "common/sizing/model_config.h"

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <optional>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/base/status_macros.h"
#include "common/gguf/gguf_file.h"
#include "common/sizing/kv_cache_spec.h"
#include "nlohmann/json.hpp"

namespace kvcm {
namespace {

using Json = nlohmann::json;

absl::Status ConfigError(absl::string_view message) {
  return absl::InvalidArgumentError(absl::StrCat("model config: ", message));
}

bool Present(const Json& object, const char* key) {
  const auto it = object.find(key);
  return it != object.end() && !it->is_null();
}

// The value of an optional positive integer key; nullopt when absent or null.
absl::StatusOr<std::optional<int32_t>> OptionalPositiveInt(const Json& object, const char* key) {
  const auto it = object.find(key);
  if (it == object.end() || it->is_null()) return std::optional<int32_t>();
  if (!it->is_number_integer()) {
    return ConfigError(absl::StrCat("key \"", key, "\" must be an integer, got ", it->type_name(),
                                    " ", it->dump()));
  }
  int64_t value = 0;
  if (it->is_number_unsigned()) {
    const uint64_t u = it->get<uint64_t>();
    value = u > static_cast<uint64_t>(std::numeric_limits<int32_t>::max())
                ? std::numeric_limits<int64_t>::max()
                : static_cast<int64_t>(u);
  } else {
    value = it->get<int64_t>();
  }
  if (value <= 0 || value > std::numeric_limits<int32_t>::max()) {
    return ConfigError(
        absl::StrCat("key \"", key, "\" must be a positive 32-bit integer, got ", it->dump()));
  }
  return std::optional<int32_t>(static_cast<int32_t>(value));
}

absl::StatusOr<int32_t> RequiredPositiveInt(const Json& object, const char* key) {
  KVCM_ASSIGN_OR_RETURN(std::optional<int32_t> value, OptionalPositiveInt(object, key));
  if (!value.has_value()) {
    return ConfigError(absl::StrCat("missing required key \"", key, "\""));
  }
  return *value;
}

// The dtype and the key it came from.
absl::StatusOr<std::pair<DType, std::string>> DTypeFromConfig(const Json& section,
                                                               const Json& root) {
  // transformers writes "torch_dtype"; releases since 4.56 write "dtype" instead.
  for (const Json* object : {&section, &root}) {
    for (const char* key : {"torch_dtype", "dtype"}) {
      const auto it = object->find(key);
      if (it == object->end() || it->is_null()) continue;
      if (!it->is_string()) {
        return ConfigError(absl::StrCat("key \"", key, "\" must be a string, got ", it->type_name(),
                                        " ", it->dump()));
      }
      const std::string name = it->get<std::string>();
      absl::StatusOr<DType> dtype = ParseDType(name);
      if (!dtype.ok()) {
        return ConfigError(absl::StrCat("unsupported ", key, " \"", name,
                                        "\"; give the KV-cache dtype explicitly"));
      }
      return std::make_pair(*dtype, absl::StrCat(key, " \"", name, "\""));
    }
  }
  return ConfigError(
      "missing key \"torch_dtype\" (or \"dtype\"); give the KV-cache dtype explicitly");
}

}  // namespace

absl::StatusOr<KvCacheSpec> SpecFromHfConfig(const std::string& json_text, int32_t block_size,
                                             std::optional<DType> dtype_override,
                                             std::vector<std::string>* notes) {
  auto note = [&](std::string line) {
    if (notes != nullptr) notes->push_back(std::move(line));
  };
  Json root;
  try {
    root = Json::parse(json_text);
  } catch (const Json::exception& e) {
    return ConfigError(absl::StrCat("malformed JSON: ", e.what()));
  }
  if (!root.is_object()) {
    return ConfigError(absl::StrCat("expected a JSON object, got ", root.type_name()));
  }

  // Multimodal configs (Llama 4, Gemma 3, ...) nest the language model under text_config.
  const Json* section = &root;
  if (!Present(root, "num_hidden_layers")) {
    const auto it = root.find("text_config");
    if (it != root.end() && it->is_object()) section = &*it;
  }

  if (Present(*section, "kv_lora_rank")) {
    return ConfigError(
        "multi-head latent attention (\"kv_lora_rank\") is not supported: its cache holds a "
        "compressed latent, not per-head K and V; give the dimensions explicitly");
  }

  KvCacheSpec spec;
  spec.block_size = block_size;
  KVCM_ASSIGN_OR_RETURN(spec.num_layers, RequiredPositiveInt(*section, "num_hidden_layers"));
  KVCM_ASSIGN_OR_RETURN(const int32_t num_attention_heads,
                        RequiredPositiveInt(*section, "num_attention_heads"));

  KVCM_ASSIGN_OR_RETURN(const std::optional<int32_t> num_kv_heads,
                        OptionalPositiveInt(*section, "num_key_value_heads"));
  spec.num_kv_heads = num_kv_heads.value_or(num_attention_heads);  // absent: MHA
  if (num_attention_heads % spec.num_kv_heads != 0) {
    return ConfigError(absl::StrCat(
        "\"num_key_value_heads\" (", spec.num_kv_heads, ") does not divide \"num_attention_heads\" (",
        num_attention_heads, "): each KV head must serve a whole group of query heads"));
  }

  KVCM_ASSIGN_OR_RETURN(const std::optional<int32_t> head_dim,
                        OptionalPositiveInt(*section, "head_dim"));
  if (head_dim.has_value()) {
    spec.head_dim = *head_dim;
  } else {
    KVCM_ASSIGN_OR_RETURN(const int32_t hidden_size, RequiredPositiveInt(*section, "hidden_size"));
    if (hidden_size % num_attention_heads != 0) {
      return ConfigError(absl::StrCat("no \"head_dim\", and \"hidden_size\" (", hidden_size,
                                      ") is not divisible by \"num_attention_heads\" (",
                                      num_attention_heads, ")"));
    }
    spec.head_dim = hidden_size / num_attention_heads;
  }

  if (dtype_override.has_value()) {
    spec.dtype = *dtype_override;
  } else {
    KVCM_ASSIGN_OR_RETURN(const auto chosen, DTypeFromConfig(*section, root));
    spec.dtype = chosen.first;
    note(absl::StrCat(
        "KV dtype ", std::string(DTypeName(spec.dtype)), " from the config's ", chosen.second,
        spec.dtype == DType::kFloat32
            ? ": 4 bytes per element, twice a bf16 pool for the same tokens; --dtype bf16 (or "
              "fp16, fp8_e4m3) picks another"
            : "; --dtype picks another"));
  }
  for (const char* key : {"sliding_window", "sliding_window_size"}) {
    const auto it = section->find(key);
    if (it == section->end() || it->is_null() || (it->is_boolean() && !it->get<bool>())) {
      continue;
    }
    note(absl::StrCat("the config's \"", key, "\" (", it->dump(),
                      ") is ignored: the pool is sized for full attention in every layer "
                      "(kvcm does not release blocks behind a window yet)"));
  }

  KVCM_RETURN_IF_ERROR(spec.Validate());
  return spec;
}

absl::StatusOr<KvCacheSpec> SpecFromHfConfigFile(const std::string& path, int32_t block_size,
                                                 std::optional<DType> dtype_override,
                                                 std::vector<std::string>* notes) {
  std::FILE* file = std::fopen(path.c_str(), "rb");
  if (file == nullptr) {
    return absl::NotFoundError(absl::StrCat("cannot open model config \"", path,
                                            "\": ", std::generic_category().message(errno)));
  }
  std::string text;
  char buffer[1 << 14];
  size_t n = 0;
  while ((n = std::fread(buffer, 1, sizeof(buffer), file)) > 0) text.append(buffer, n);
  const bool read_failed = std::ferror(file) != 0;
  const int read_errno = errno;
  std::fclose(file);
  if (read_failed) {
    return absl::NotFoundError(absl::StrCat("cannot read model config \"", path,
                                            "\": ", std::generic_category().message(read_errno)));
  }
  absl::StatusOr<KvCacheSpec> spec = SpecFromHfConfig(text, block_size, dtype_override, notes);
  if (!spec.ok()) {
    return absl::Status(spec.status().code(), absl::StrCat(path, ": ", spec.status().message()));
  }
  return spec;
}

absl::StatusOr<KvCacheSpec> SpecFromGgufFile(const std::string& path, int32_t block_size,
                                             std::optional<DType> dtype_override,
                                             std::vector<std::string>* notes) {
  KVCM_ASSIGN_OR_RETURN(const std::unique_ptr<GgufFile> file, GgufFile::Open(path));
  KVCM_ASSIGN_OR_RETURN(const std::string arch, file->GetString("general.architecture"));
  auto key = [&](const char* suffix) { return absl::StrCat(arch, ".", suffix); };
  auto invalid = [&](const std::string& k, const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": GGUF key \"", k, "\" ", what));
  };
  auto positive = [&](const std::string& k,
                      std::optional<int64_t> fallback) -> absl::StatusOr<int32_t> {
    if (!file->Has(k)) {
      if (fallback.has_value()) return static_cast<int32_t>(*fallback);
      return invalid(k, "is missing");
    }
    KVCM_ASSIGN_OR_RETURN(const int64_t v, file->GetInt(k));
    if (v <= 0 || v > std::numeric_limits<int32_t>::max()) {
      return invalid(k, absl::StrCat("must be a positive 32-bit integer, got ", v));
    }
    return static_cast<int32_t>(v);
  };
  KvCacheSpec spec;
  KVCM_ASSIGN_OR_RETURN(spec.num_layers, positive(key("block_count"), std::nullopt));
  KVCM_ASSIGN_OR_RETURN(const int32_t heads, positive(key("attention.head_count"), std::nullopt));
  KVCM_ASSIGN_OR_RETURN(spec.num_kv_heads, positive(key("attention.head_count_kv"), heads));
  if (heads % spec.num_kv_heads != 0) {
    return invalid(key("attention.head_count_kv"),
                   absl::StrCat("(", spec.num_kv_heads, ") does not divide ",
                                key("attention.head_count"), " (", heads, ")"));
  }
  if (file->Has(key("attention.key_length"))) {
    KVCM_ASSIGN_OR_RETURN(spec.head_dim, positive(key("attention.key_length"), std::nullopt));
  } else {
    KVCM_ASSIGN_OR_RETURN(const int32_t hidden, positive(key("embedding_length"), std::nullopt));
    if (hidden % heads != 0) {
      return invalid(key("embedding_length"),
                     absl::StrCat("(", hidden, ") is not divisible by the ", heads, " heads"));
    }
    spec.head_dim = hidden / heads;
  }
  spec.block_size = block_size;
  if (dtype_override.has_value()) {
    spec.dtype = *dtype_override;
  } else {
    absl::StatusOr<const GgufTensorInfo*> embeddings = file->FindTensor("token_embd.weight");
    const GgmlType type = embeddings.ok() ? (*embeddings)->type : GgmlType::kQ8_0;
    spec.dtype = type == GgmlType::kF32    ? DType::kFloat32
                 : type == GgmlType::kBF16 ? DType::kBFloat16
                                           : DType::kFloat16;
    if (notes != nullptr) {
      notes->push_back(absl::StrCat(
          "KV dtype ", std::string(DTypeName(spec.dtype)), " for a GGUF model whose embeddings are ",
          GgmlTypeName(type),
          type == GgmlType::kF32 || type == GgmlType::kBF16 || type == GgmlType::kF16
              ? ""
              : " (quantized weights: fp16 is llama.cpp's default cache type)",
          "; give --dtype to pick another"));
    }
  }
  if (notes != nullptr && file->Has(key("attention.sliding_window"))) {
    notes->push_back(absl::StrCat(key("attention.sliding_window"),
                                  " is ignored: the pool is sized for full attention"));
  }
  if (absl::Status valid = spec.Validate(); !valid.ok()) {
    return absl::Status(valid.code(), absl::StrCat(path, ": ", valid.message()));
  }
  return spec;
}

absl::StatusOr<KvCacheSpec> SpecFromModelPath(const std::string& path, int32_t block_size,
                                              std::optional<DType> dtype_override,
                                              std::vector<std::string>* notes) {
  std::error_code error;
  if (std::filesystem::is_directory(path, error)) {
    return SpecFromHfConfigFile(absl::StrCat(path, "/config.json"), block_size, dtype_override,
                                notes);
  }
  char magic[4] = {};
  if (std::FILE* f = std::fopen(path.c_str(), "rb"); f != nullptr) {
    const size_t n = std::fread(magic, 1, sizeof(magic), f);
    std::fclose(f);
    if (n == sizeof(magic) && std::memcmp(magic, "GGUF", 4) == 0) {
      return SpecFromGgufFile(path, block_size, dtype_override, notes);
    }
  }
  return SpecFromHfConfigFile(path, block_size, dtype_override, notes);
}

}  // namespace kvcm
