#include "common/model/model_config.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/base/status_macros.h"
#include "common/gguf/ggml_types.h"
#include "common/gguf/gguf_file.h"
#include "nlohmann/json.hpp"

namespace kvcm {
namespace {

using Json = nlohmann::json;

// ---- Hugging Face config.json ---------------------------------------------------------------

absl::Status ConfigError(absl::string_view message) {
  return absl::InvalidArgumentError(absl::StrCat("model config: ", message));
}

const Json* Get(const Json& object, const char* key) {
  const auto it = object.find(key);
  return it == object.end() || it->is_null() ? nullptr : &*it;
}

// The value of an optional positive 32-bit integer key; nullopt when absent or null.
absl::StatusOr<std::optional<int32_t>> OptionalPositiveInt(const Json& object, const char* key) {
  const Json* value = Get(object, key);
  if (value == nullptr) return std::optional<int32_t>();
  if (!value->is_number_integer()) {
    return ConfigError(absl::StrCat("key \"", key, "\" must be an integer, got ",
                                    value->type_name(), " ", value->dump()));
  }
  int64_t v = 0;
  if (value->is_number_unsigned()) {
    const uint64_t u = value->get<uint64_t>();
    v = u > static_cast<uint64_t>(std::numeric_limits<int32_t>::max())
            ? std::numeric_limits<int64_t>::max()
            : static_cast<int64_t>(u);
  } else {
    v = value->get<int64_t>();
  }
  if (v <= 0 || v > std::numeric_limits<int32_t>::max()) {
    return ConfigError(
        absl::StrCat("key \"", key, "\" must be a positive 32-bit integer, got ", value->dump()));
  }
  return std::optional<int32_t>(static_cast<int32_t>(v));
}

absl::StatusOr<int32_t> RequiredPositiveInt(const Json& object, const char* key) {
  KVCM_ASSIGN_OR_RETURN(const std::optional<int32_t> value, OptionalPositiveInt(object, key));
  if (!value.has_value()) return ConfigError(absl::StrCat("missing required key \"", key, "\""));
  return *value;
}

// A positive finite number; nullopt when absent or null.
absl::StatusOr<std::optional<double>> OptionalPositiveNumber(const Json& object, const char* key,
                                                             absl::string_view where = "") {
  const Json* value = Get(object, key);
  if (value == nullptr) return std::optional<double>();
  const std::string name = absl::StrCat(where, where.empty() ? "" : ".", key);
  if (!value->is_number()) {
    return ConfigError(absl::StrCat("key \"", name, "\" must be a number, got ", value->type_name(),
                                    " ", value->dump()));
  }
  const double v = value->get<double>();
  if (!std::isfinite(v) || v <= 0) {
    return ConfigError(
        absl::StrCat("key \"", name, "\" must be a positive number, got ", value->dump()));
  }
  return std::optional<double>(v);
}

absl::StatusOr<std::optional<bool>> OptionalBool(const Json& object, const char* key) {
  const Json* value = Get(object, key);
  if (value == nullptr) return std::optional<bool>();
  if (!value->is_boolean()) {
    return ConfigError(
        absl::StrCat("key \"", key, "\" must be true or false, got ", value->dump()));
  }
  return std::optional<bool>(value->get<bool>());
}

absl::StatusOr<std::optional<std::string>> OptionalString(const Json& object, const char* key) {
  const Json* value = Get(object, key);
  if (value == nullptr) return std::optional<std::string>();
  if (!value->is_string()) {
    return ConfigError(absl::StrCat("key \"", key, "\" must be a string, got ", value->type_name(),
                                    " ", value->dump()));
  }
  return std::optional<std::string>(value->get<std::string>());
}

// bos_token_id / eos_token_id: an int, a list of ints, or null; ids in [0, vocab_size) when
// the vocabulary size is known.
absl::StatusOr<std::vector<int32_t>> TokenIds(const Json& object, const char* key,
                                              std::optional<int32_t> vocab_size) {
  const Json* value = Get(object, key);
  std::vector<int32_t> ids;
  if (value == nullptr) return ids;
  const Json list = value->is_array() ? *value : Json::array({*value});
  const int64_t limit = vocab_size.value_or(std::numeric_limits<int32_t>::max());
  for (const Json& id : list) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() >= limit) {
      return ConfigError(absl::StrCat(
          "key \"", key, "\" must be a token id in [0, ",
          vocab_size.has_value() ? absl::StrCat("vocab_size=", *vocab_size) : std::string("2^31"),
          ") or a list of them, got ", value->dump()));
    }
    const int32_t v = static_cast<int32_t>(id.get<int64_t>());
    if (std::find(ids.begin(), ids.end(), v) == ids.end()) ids.push_back(v);
  }
  return ids;
}

// One RoPE set (rope_scaling or rope_parameters, named `where`). Theta is read by the caller.
absl::StatusOr<RopeConfig> ParseRopeSection(const Json& section, const std::string& where) {
  RopeConfig rope;
  rope.source = where;
  // transformers writes "rope_type"; older configs "type".
  const Json* type = Get(section, "rope_type");
  if (type == nullptr) type = Get(section, "type");
  if (type != nullptr && !type->is_string()) {
    return ConfigError(
        absl::StrCat("\"", where, "\" has a non-string \"rope_type\": ", section.dump()));
  }
  if (type == nullptr && where == "rope_scaling") {
    return ConfigError(
        absl::StrCat("\"rope_scaling\" has no string \"rope_type\": ", section.dump()));
  }
  if (type != nullptr) rope.type = type->get<std::string>();
  KVCM_ASSIGN_OR_RETURN(rope.factor, OptionalPositiveNumber(section, "factor", where));
  KVCM_ASSIGN_OR_RETURN(rope.low_freq_factor,
                        OptionalPositiveNumber(section, "low_freq_factor", where));
  KVCM_ASSIGN_OR_RETURN(rope.high_freq_factor,
                        OptionalPositiveNumber(section, "high_freq_factor", where));
  KVCM_ASSIGN_OR_RETURN(rope.partial_rotary_factor,
                        OptionalPositiveNumber(section, "partial_rotary_factor", where));
  {
    absl::StatusOr<std::optional<int32_t>> original =
        OptionalPositiveInt(section, "original_max_position_embeddings");
    if (!original.ok()) {
      return ConfigError(absl::StrCat("\"", where, "\": ", original.status().message()));
    }
    rope.original_max_position_embeddings = *original;
  }
  for (const auto& [key, value] : section.items()) {
    if (key == "rope_type" || key == "type" || key == "rope_theta" || key == "factor" ||
        key == "low_freq_factor" || key == "high_freq_factor" ||
        key == "original_max_position_embeddings" || key == "partial_rotary_factor") {
      continue;
    }
    rope.other_keys.emplace_back(absl::StrCat(where, ".", key), value.dump());
  }
  return rope;
}

// Whether two spellings of the scaling say the same (defaults applied as transformers does).
bool SameScaling(const RopeConfig& a, const RopeConfig& b) {
  if (a.type != b.type) return false;
  if (a.type == "default") return true;
  return a.factor == b.factor &&
         a.low_freq_factor.value_or(1.0) == b.low_freq_factor.value_or(1.0) &&
         a.high_freq_factor.value_or(4.0) == b.high_freq_factor.value_or(4.0) &&
         a.original_max_position_embeddings == b.original_max_position_embeddings;
}

// Each layer type's set of a per-layer-type rope_parameters, with its own rope_theta.
absl::Status ParseRopePerLayerType(const Json& params, ModelConfig* c) {
  for (const auto& [layer_type, set] : params.items()) {
    const std::string where = absl::StrCat("rope_parameters.", layer_type);
    if (!set.is_object()) {
      return ConfigError(
          absl::StrCat("key \"", where, "\" must be an object, got ", set.dump().substr(0, 100)));
    }
    KVCM_ASSIGN_OR_RETURN(RopeConfig rope, ParseRopeSection(set, where));
    KVCM_ASSIGN_OR_RETURN(rope.theta, OptionalPositiveNumber(set, "rope_theta", where));
    c->rope_per_layer_type.emplace_back(layer_type, std::move(rope));
  }
  return absl::OkStatus();
}

// rope_theta and the RoPE set, from either spelling; both present must agree.
absl::Status ParseRope(const Json& section, ModelConfig* c) {
  KVCM_ASSIGN_OR_RETURN(c->rope_theta, OptionalPositiveNumber(section, "rope_theta"));
  std::optional<RopeConfig> scaling;
  if (const Json* old = Get(section, "rope_scaling"); old != nullptr) {
    if (!old->is_object()) {
      return ConfigError(
          absl::StrCat("key \"rope_scaling\" must be an object or null, got ", old->dump()));
    }
    KVCM_ASSIGN_OR_RETURN(scaling, ParseRopeSection(*old, "rope_scaling"));
  }
  if (const Json* params = Get(section, "rope_parameters"); params != nullptr) {
    if (!params->is_object()) {
      return ConfigError(
          absl::StrCat("key \"rope_parameters\" must be an object or null, got ", params->dump()));
    }
    if (!params->empty() && params->begin()->is_object()) {
      // Per layer type ({"full_attention": {...}, "sliding_attention": {...}}).
      RopeConfig per_layer;
      per_layer.source = "rope_parameters";
      per_layer.per_layer_type = params->begin().key();
      c->rope = scaling.value_or(per_layer);
      c->rope.per_layer_type = per_layer.per_layer_type;
      return ParseRopePerLayerType(*params, c);
    }
    KVCM_ASSIGN_OR_RETURN(const RopeConfig parsed, ParseRopeSection(*params, "rope_parameters"));
    if (scaling.has_value() && !SameScaling(*scaling, parsed)) {
      return ConfigError(absl::StrCat("\"rope_scaling\" and \"rope_parameters\" disagree: ",
                                      section["rope_scaling"].dump(), " vs ", params->dump()));
    }
    if (!scaling.has_value()) scaling = parsed;
    KVCM_ASSIGN_OR_RETURN(const std::optional<double> inner,
                          OptionalPositiveNumber(*params, "rope_theta", "rope_parameters"));
    if (inner.has_value()) {
      if (c->rope_theta.has_value() && *c->rope_theta != *inner) {
        return ConfigError(absl::StrCat("\"rope_theta\" ", *c->rope_theta,
                                        " and \"rope_parameters.rope_theta\" ", *inner,
                                        " disagree"));
      }
      c->rope_theta = inner;
    }
  }
  if (scaling.has_value()) c->rope = *scaling;
  return absl::OkStatus();
}

// "architectures": a non-empty list of strings, when present.
absl::Status ParseArchitectures(const Json& root, ModelConfig* c) {
  if (const Json* archs = Get(root, "architectures"); archs != nullptr) {
    if (!archs->is_array() || archs->empty()) {
      return ConfigError(
          absl::StrCat("key \"architectures\" must be a non-empty list, got ", archs->dump()));
    }
    for (const Json& a : *archs) {
      if (!a.is_string()) {
        return ConfigError(
            absl::StrCat("key \"architectures\" must be a list of strings, got ", archs->dump()));
      }
      c->architectures.push_back(a.get<std::string>());
    }
  }
  return absl::OkStatus();
}

// Layers, query and KV heads, and the head size (given, or hidden_size / heads).
absl::Status ParseAttentionShape(const Json& s, ModelConfig* c) {
  KVCM_ASSIGN_OR_RETURN(c->num_hidden_layers, RequiredPositiveInt(s, "num_hidden_layers"));
  KVCM_ASSIGN_OR_RETURN(c->num_attention_heads, RequiredPositiveInt(s, "num_attention_heads"));
  KVCM_ASSIGN_OR_RETURN(const std::optional<int32_t> kv_heads,
                        OptionalPositiveInt(s, "num_key_value_heads"));
  c->num_key_value_heads = kv_heads.value_or(c->num_attention_heads);  // absent: MHA
  if (c->num_attention_heads % c->num_key_value_heads != 0) {
    return ConfigError(absl::StrCat("\"num_key_value_heads\" (", c->num_key_value_heads,
                                    ") does not divide \"num_attention_heads\" (",
                                    c->num_attention_heads,
                                    "): each KV head must serve a whole group of query heads"));
  }
  KVCM_ASSIGN_OR_RETURN(c->hidden_size, OptionalPositiveInt(s, "hidden_size"));
  KVCM_ASSIGN_OR_RETURN(const std::optional<int32_t> head_dim, OptionalPositiveInt(s, "head_dim"));
  if (head_dim.has_value()) {
    c->head_dim = *head_dim;
  } else {
    if (!c->hidden_size.has_value()) {
      return ConfigError("missing required key \"hidden_size\" (there is no \"head_dim\")");
    }
    if (*c->hidden_size % c->num_attention_heads != 0) {
      return ConfigError(absl::StrCat("no \"head_dim\", and \"hidden_size\" (", *c->hidden_size,
                                      ") is not divisible by \"num_attention_heads\" (",
                                      c->num_attention_heads, ")"));
    }
    c->head_dim = *c->hidden_size / c->num_attention_heads;
  }
  return absl::OkStatus();
}

// "sliding_window" or "sliding_window_size": a length, or null/false for none.
absl::Status ParseSlidingWindow(const Json& s, ModelConfig* c) {
  for (const char* key : {"sliding_window", "sliding_window_size"}) {
    const Json* window = Get(s, key);
    if (window == nullptr || (window->is_boolean() && !window->get<bool>())) continue;
    if (!window->is_number_integer() || window->get<int64_t>() < 0) {
      return ConfigError(absl::StrCat(
          "key \"", key, "\" must be a window length, null or false, got ", window->dump()));
    }
    c->sliding_window = window->is_number_unsigned()
                            ? static_cast<int64_t>(std::min<uint64_t>(
                                  window->get<uint64_t>(), std::numeric_limits<int64_t>::max()))
                            : window->get<int64_t>();
    c->sliding_window_key = key;
    break;
  }

  return absl::OkStatus();
}

// Gemma's keys: the sliding layers' RoPE base, the attention scale, soft-capping (null: none),
// bidirectional attention and the MLP's activation.
absl::Status ParseGemmaKeys(const Json& s, ModelConfig* c) {
  KVCM_ASSIGN_OR_RETURN(c->rope_local_base_freq, OptionalPositiveNumber(s, "rope_local_base_freq"));
  KVCM_ASSIGN_OR_RETURN(c->query_pre_attn_scalar,
                        OptionalPositiveNumber(s, "query_pre_attn_scalar"));
  KVCM_ASSIGN_OR_RETURN(c->attn_logit_softcapping,
                        OptionalPositiveNumber(s, "attn_logit_softcapping"));
  KVCM_ASSIGN_OR_RETURN(c->final_logit_softcapping,
                        OptionalPositiveNumber(s, "final_logit_softcapping"));
  KVCM_ASSIGN_OR_RETURN(c->use_bidirectional_attention,
                        OptionalBool(s, "use_bidirectional_attention"));
  KVCM_ASSIGN_OR_RETURN(c->hidden_activation, OptionalString(s, "hidden_activation"));
  return absl::OkStatus();
}

// "layer_types" (a string per layer), "max_window_layers" and "sliding_window_pattern".
absl::Status ParseLayerTypes(const Json& s, ModelConfig* c) {
  if (const Json* types = Get(s, "layer_types"); types != nullptr) {
    if (!types->is_array() || types->size() != static_cast<size_t>(c->num_hidden_layers)) {
      return ConfigError(absl::StrCat("key \"layer_types\" must be a list of ",
                                      c->num_hidden_layers, " strings (one per layer), got ",
                                      types->dump().substr(0, 200)));
    }
    for (const Json& type : *types) {
      if (!type.is_string()) {
        return ConfigError(absl::StrCat("key \"layer_types\" must hold strings, got ",
                                        type.dump().substr(0, 100)));
      }
      c->layer_types.push_back(type.get<std::string>());
    }
  }
  if (const Json* layers = Get(s, "max_window_layers"); layers != nullptr) {
    if (!layers->is_number_integer() || layers->get<int64_t>() < 0 ||
        layers->get<int64_t>() > std::numeric_limits<int32_t>::max()) {
      return ConfigError(absl::StrCat("key \"max_window_layers\" must be a layer count, got ",
                                      layers->dump().substr(0, 100)));
    }
    c->max_window_layers = static_cast<int32_t>(layers->get<int64_t>());
  }
  KVCM_ASSIGN_OR_RETURN(c->sliding_window_pattern,
                        OptionalPositiveInt(s, "sliding_window_pattern"));
  return absl::OkStatus();
}

// bos_token_id (one id) and eos_token_id (one or a list), within vocab_size.
absl::Status ParseSpecialTokenIds(const Json& s, ModelConfig* c) {
  KVCM_ASSIGN_OR_RETURN(const std::vector<int32_t> bos, TokenIds(s, "bos_token_id", c->vocab_size));
  if (const Json* bos_value = Get(s, "bos_token_id");
      bos_value != nullptr && bos_value->is_array() && bos_value->size() > 1) {
    return ConfigError(
        absl::StrCat("key \"bos_token_id\" must be a single id, got ", s["bos_token_id"].dump()));
  }
  if (!bos.empty()) c->bos_token_id = bos[0];
  KVCM_ASSIGN_OR_RETURN(c->eos_token_ids, TokenIds(s, "eos_token_id", c->vocab_size));

  return absl::OkStatus();
}

// The weights' dtype: in the text section or the root; transformers writes "torch_dtype",
// releases since 4.56 "dtype".
absl::Status ParseTorchDtype(const Json& root, const Json* section, ModelConfig* c) {
  for (const Json* object : {section, &root}) {
    for (const char* key : {"torch_dtype", "dtype"}) {
      KVCM_ASSIGN_OR_RETURN(const std::optional<std::string> dtype, OptionalString(*object, key));
      if (!dtype.has_value()) continue;
      c->torch_dtype = *dtype;
      c->torch_dtype_key = key;
      break;
    }
    if (!c->torch_dtype_key.empty()) break;
  }
  return absl::OkStatus();
}

absl::StatusOr<ModelConfig> ParseHfRoot(const Json& root) {
  if (!root.is_object()) {
    return ConfigError(absl::StrCat("expected a JSON object, got ", root.type_name()));
  }
  ModelConfig c;
  c.format = ModelConfig::Format::kHuggingFace;
  KVCM_RETURN_IF_ERROR(ParseArchitectures(root, &c));
  KVCM_ASSIGN_OR_RETURN(const std::optional<std::string> model_type,
                        OptionalString(root, "model_type"));
  c.model_type = model_type.value_or("");

  // Multimodal configs (Llama 4, Gemma 3, ...) nest the language model under text_config.
  const Json* section = &root;
  if (Get(root, "num_hidden_layers") == nullptr) {
    if (const Json* text = Get(root, "text_config"); text != nullptr && text->is_object()) {
      section = text;
      c.text_config = true;
    }
  }
  const Json& s = *section;

  KVCM_RETURN_IF_ERROR(ParseAttentionShape(s, &c));
  KVCM_ASSIGN_OR_RETURN(c.kv_lora_rank, OptionalPositiveInt(s, "kv_lora_rank"));
  KVCM_ASSIGN_OR_RETURN(c.intermediate_size, OptionalPositiveInt(s, "intermediate_size"));
  KVCM_ASSIGN_OR_RETURN(c.vocab_size, OptionalPositiveInt(s, "vocab_size"));
  KVCM_ASSIGN_OR_RETURN(c.max_position_embeddings,
                        OptionalPositiveInt(s, "max_position_embeddings"));
  KVCM_ASSIGN_OR_RETURN(c.rms_norm_eps, OptionalPositiveNumber(s, "rms_norm_eps"));
  KVCM_RETURN_IF_ERROR(ParseRope(s, &c));
  KVCM_ASSIGN_OR_RETURN(const std::optional<bool> tie, OptionalBool(s, "tie_word_embeddings"));
  c.tie_word_embeddings = tie.value_or(false);
  c.tie_word_embeddings_given = tie.has_value();
  KVCM_RETURN_IF_ERROR(ParseGemmaKeys(s, &c));
  KVCM_ASSIGN_OR_RETURN(c.attention_bias, OptionalBool(s, "attention_bias"));
  KVCM_ASSIGN_OR_RETURN(c.mlp_bias, OptionalBool(s, "mlp_bias"));
  KVCM_ASSIGN_OR_RETURN(c.use_sliding_window, OptionalBool(s, "use_sliding_window"));
  KVCM_ASSIGN_OR_RETURN(c.hidden_act, OptionalString(s, "hidden_act"));
  KVCM_RETURN_IF_ERROR(ParseSlidingWindow(s, &c));
  KVCM_RETURN_IF_ERROR(ParseLayerTypes(s, &c));

  KVCM_RETURN_IF_ERROR(ParseSpecialTokenIds(s, &c));
  KVCM_RETURN_IF_ERROR(ParseTorchDtype(root, section, &c));
  return c;
}

absl::StatusOr<std::string> ReadWholeFile(const std::string& path) {
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
  return text;
}

// ---- GGUF -------------------------------------------------------------------------------------

// GGUF metadata as ModelConfigFromGguf reads it: every error names the file and the key.
class GgufKeys {
 public:
  GgufKeys(const GgufFile& file, std::string arch) : file_(file), arch_(std::move(arch)) {}

  std::string Key(absl::string_view suffix) const { return absl::StrCat(arch_, ".", suffix); }

  absl::Status Invalid(const std::string& key, absl::string_view what) const {
    return absl::InvalidArgumentError(
        absl::StrCat(file_.name(), ": GGUF key \"", key, "\" ", what));
  }

  // An integer in [min_value, INT32_MAX]; nullopt when absent.
  absl::StatusOr<std::optional<int32_t>> OptionalInt(const std::string& key,
                                                     int64_t min_value) const {
    if (!file_.Has(key)) return std::optional<int32_t>();
    KVCM_ASSIGN_OR_RETURN(const int64_t v, file_.GetInt(key));
    if (v < min_value || v > std::numeric_limits<int32_t>::max()) {
      return Invalid(key, absl::StrCat("must be in [", min_value, ", ",
                                       std::numeric_limits<int32_t>::max(), "], got ", v));
    }
    return std::optional<int32_t>(static_cast<int32_t>(v));
  }

  absl::StatusOr<int32_t> RequiredInt(const std::string& key, int64_t min_value) const {
    KVCM_ASSIGN_OR_RETURN(const std::optional<int32_t> v, OptionalInt(key, min_value));
    if (!v.has_value()) return Invalid(key, "is missing");
    return *v;
  }

  absl::StatusOr<std::optional<double>> OptionalPositiveFloat(const std::string& key) const {
    if (!file_.Has(key)) return std::optional<double>();
    KVCM_ASSIGN_OR_RETURN(const double v, file_.GetFloat(key));
    if (!(v > 0) || !std::isfinite(v)) {
      return Invalid(key, absl::StrCat("must be a positive number, got ", v));
    }
    return std::optional<double>(v);
  }

  absl::StatusOr<std::optional<std::string>> OptionalString(const std::string& key) const {
    if (!file_.Has(key)) return std::optional<std::string>();
    KVCM_ASSIGN_OR_RETURN(std::string v, file_.GetString(key));
    return std::optional<std::string>(std::move(v));
  }

 private:
  const GgufFile& file_;
  const std::string arch_;
};

// The type most 2-D weights are stored in ("Q4_1" for a Q4_1 file whose embeddings are Q8_0).
std::string MainWeightType(const GgufFile& file) {
  absl::flat_hash_map<std::string, int64_t> elements;
  std::string best;
  for (const GgufTensorInfo& t : file.tensors()) {
    if (t.dims.size() != 2) continue;
    const std::string name = GgmlTypeName(t.type);
    elements[name] += t.element_count;
    if (best.empty() || elements[name] > elements[best]) best = name;
  }
  return best.empty() ? "F32" : best;
}

// GGUF's names of the Hugging Face keys ModelConfig::KeyName translates ("" for a key
// without an ARCH prefix, in `global`).
struct GgufKeyName {
  absl::string_view hf;
  absl::string_view gguf;
  bool global = false;
};
constexpr GgufKeyName kGgufKeyNames[] = {
    {"num_hidden_layers", "block_count"},
    {"num_attention_heads", "attention.head_count"},
    {"num_key_value_heads", "attention.head_count_kv"},
    {"head_dim", "attention.key_length"},
    {"hidden_size", "embedding_length"},
    {"intermediate_size", "feed_forward_length"},
    {"vocab_size", "vocab_size"},
    {"max_position_embeddings", "context_length"},
    {"rms_norm_eps", "attention.layer_norm_rms_epsilon"},
    {"rope_theta", "rope.freq_base"},
    {"rope_scaling", "rope.scaling.type"},
    {"sliding_window", "attention.sliding_window"},
    {"bos_token_id", "tokenizer.ggml.bos_token_id", true},
    {"eos_token_id", "tokenizer.ggml.eos_token_id", true},
};

}  // namespace

std::string ModelConfig::KeyName(absl::string_view hf_key) const {
  if (format == Format::kGguf) {
    for (const GgufKeyName& k : kGgufKeyNames) {
      if (k.hf != hf_key) continue;
      return k.global ? absl::StrCat("GGUF key \"", k.gguf, "\"")
                      : absl::StrCat("GGUF key \"", model_type, ".", k.gguf, "\"");
    }
    return absl::StrCat("GGUF key for \"", hf_key, "\"");
  }
  return absl::StrCat("key \"", text_config ? "text_config." : "", hf_key, "\"");
}

std::string ModelConfig::Where() const {
  if (format == Format::kGguf) return absl::StrCat(path, ": ");
  return absl::StrCat(path, path.empty() ? "" : ": ", "model config: ");
}

absl::StatusOr<ModelConfig> ParseHfModelConfig(const std::string& json_text) {
  Json root;
  try {
    root = Json::parse(json_text);
  } catch (const Json::exception& e) {
    return ConfigError(absl::StrCat("malformed JSON: ", e.what()));
  }
  return ParseHfRoot(root);
}

absl::StatusOr<ModelConfig> ReadHfModelConfigFile(const std::string& path) {
  KVCM_ASSIGN_OR_RETURN(const std::string text, ReadWholeFile(path));
  absl::StatusOr<ModelConfig> config = ParseHfModelConfig(text);
  if (!config.ok()) {
    return absl::Status(config.status().code(),
                        absl::StrCat(path, ": ", config.status().message()));
  }
  config->path = path;
  return config;
}

absl::StatusOr<ModelConfig> ModelConfigFromGguf(const GgufFile& file) {
  ModelConfig c;
  c.format = ModelConfig::Format::kGguf;
  c.path = file.name();
  // GgufFile's errors name the file and the key.
  KVCM_ASSIGN_OR_RETURN(c.model_type, file.GetString("general.architecture"));
  const GgufKeys keys(file, c.model_type);
  KVCM_ASSIGN_OR_RETURN(c.num_hidden_layers, keys.RequiredInt(keys.Key("block_count"), 1));
  KVCM_ASSIGN_OR_RETURN(c.num_attention_heads,
                        keys.RequiredInt(keys.Key("attention.head_count"), 1));
  KVCM_ASSIGN_OR_RETURN(const std::optional<int32_t> kv_heads,
                        keys.OptionalInt(keys.Key("attention.head_count_kv"), 1));
  c.num_key_value_heads = kv_heads.value_or(c.num_attention_heads);
  if (c.num_attention_heads % c.num_key_value_heads != 0) {
    return keys.Invalid(
        keys.Key("attention.head_count_kv"),
        absl::StrCat("(", c.num_key_value_heads, ") does not divide ",
                     keys.Key("attention.head_count"), " (", c.num_attention_heads, ")"));
  }
  KVCM_ASSIGN_OR_RETURN(c.hidden_size, keys.OptionalInt(keys.Key("embedding_length"), 1));
  KVCM_ASSIGN_OR_RETURN(const std::optional<int32_t> key_length,
                        keys.OptionalInt(keys.Key("attention.key_length"), 1));
  if (key_length.has_value()) {
    c.head_dim = *key_length;
  } else {
    if (!c.hidden_size.has_value()) {
      return keys.Invalid(
          keys.Key("embedding_length"),
          absl::StrCat("is missing, and there is no ", keys.Key("attention.key_length")));
    }
    if (*c.hidden_size % c.num_attention_heads != 0) {
      return keys.Invalid(
          keys.Key("embedding_length"),
          absl::StrCat("(", *c.hidden_size, ") is not divisible by the ", c.num_attention_heads,
                       " heads, and there is no ", keys.Key("attention.key_length")));
    }
    c.head_dim = *c.hidden_size / c.num_attention_heads;
  }
  KVCM_ASSIGN_OR_RETURN(c.value_head_dim, keys.OptionalInt(keys.Key("attention.value_length"), 1));
  KVCM_ASSIGN_OR_RETURN(c.rope_dimension_count,
                        keys.OptionalInt(keys.Key("rope.dimension_count"), 1));
  KVCM_ASSIGN_OR_RETURN(c.intermediate_size, keys.OptionalInt(keys.Key("feed_forward_length"), 1));
  KVCM_ASSIGN_OR_RETURN(c.max_position_embeddings, keys.OptionalInt(keys.Key("context_length"), 1));
  KVCM_ASSIGN_OR_RETURN(c.rms_norm_eps,
                        keys.OptionalPositiveFloat(keys.Key("attention.layer_norm_rms_epsilon")));
  KVCM_ASSIGN_OR_RETURN(c.rope_theta, keys.OptionalPositiveFloat(keys.Key("rope.freq_base")));
  KVCM_ASSIGN_OR_RETURN(const std::optional<std::string> scaling,
                        keys.OptionalString(keys.Key("rope.scaling.type")));
  if (scaling.has_value()) {
    c.rope.source = keys.Key("rope.scaling.type");
    c.rope.type = *scaling == "none" ? "default" : *scaling;
    KVCM_ASSIGN_OR_RETURN(c.rope.factor,
                          keys.OptionalPositiveFloat(keys.Key("rope.scaling.factor")));
  }
  c.gguf_rope_freqs = file.FindTensor("rope_freqs.weight").ok();
  KVCM_ASSIGN_OR_RETURN(const std::optional<int32_t> window,
                        keys.OptionalInt(keys.Key("attention.sliding_window"), 0));
  if (window.has_value()) {
    c.sliding_window = *window;
    c.sliding_window_key = keys.Key("attention.sliding_window");
  }

  int32_t tokens = 0;
  if (file.Has("tokenizer.ggml.tokens")) {
    KVCM_ASSIGN_OR_RETURN(const GgufValue* list, file.GetValue("tokenizer.ggml.tokens"));
    tokens = static_cast<int32_t>(
        std::min<size_t>(list->elements.size(), std::numeric_limits<int32_t>::max()));
  }
  KVCM_ASSIGN_OR_RETURN(c.vocab_size, keys.OptionalInt(keys.Key("vocab_size"), 1));
  if (!c.vocab_size.has_value() && tokens > 0) c.vocab_size = tokens;
  const int64_t vocab = c.vocab_size.value_or(std::numeric_limits<int32_t>::max());
  KVCM_ASSIGN_OR_RETURN(c.bos_token_id, keys.OptionalInt("tokenizer.ggml.bos_token_id", 0));
  if (c.bos_token_id.has_value() && *c.bos_token_id >= vocab) {
    return keys.Invalid(
        "tokenizer.ggml.bos_token_id",
        absl::StrCat("(", *c.bos_token_id, ") is outside the vocabulary of ", vocab));
  }
  for (const char* key : {"tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"}) {
    KVCM_ASSIGN_OR_RETURN(const std::optional<int32_t> id, keys.OptionalInt(key, 0));
    if (!id.has_value()) continue;
    if (*id >= vocab) {
      return keys.Invalid(key, absl::StrCat("(", *id, ") is outside the vocabulary of ", vocab));
    }
    if (std::strcmp(key, "tokenizer.ggml.eos_token_id") == 0) {
      c.eos_token_ids.push_back(*id);
    } else {
      c.eot_token_id = id;
    }
  }
  c.tie_word_embeddings = !file.FindTensor("output.weight").ok();
  if (absl::StatusOr<const GgufTensorInfo*> embeddings = file.FindTensor("token_embd.weight");
      embeddings.ok()) {
    c.gguf_embedding_type = GgmlTypeName((*embeddings)->type);
  }
  c.gguf_weight_type = MainWeightType(file);
  return c;
}

absl::StatusOr<ModelConfig> ReadModelConfig(const std::string& path) {
  std::error_code error;
  if (std::filesystem::is_directory(path, error)) {
    return ReadHfModelConfigFile(absl::StrCat(path, "/config.json"));
  }
  char magic[4] = {};
  if (std::FILE* f = std::fopen(path.c_str(), "rb"); f != nullptr) {
    const size_t n = std::fread(magic, 1, sizeof(magic), f);
    std::fclose(f);
    if (n == sizeof(magic) && std::memcmp(magic, "GGUF", 4) == 0) {
      KVCM_ASSIGN_OR_RETURN(const std::unique_ptr<GgufFile> file, GgufFile::Open(path));
      return ModelConfigFromGguf(*file);
    }
  }
  return ReadHfModelConfigFile(path);
}

absl::StatusOr<std::vector<int32_t>> LayerWindows(const ModelConfig& config) {
  const int32_t window = static_cast<int32_t>(
      std::min<int64_t>(config.sliding_window.value_or(0), std::numeric_limits<int32_t>::max()));
  const bool no_window = window <= 0 || window == std::numeric_limits<int32_t>::max();
  const size_t layers = static_cast<size_t>(config.num_hidden_layers);
  std::vector<int32_t> windows(layers, 0);
  // The family: model_type, else the first architecture's name before "For", lowercased.
  std::string type = config.model_type;
  if (type.empty() && !config.architectures.empty()) {
    type = absl::AsciiStrToLower(
        config.architectures[0].substr(0, config.architectures[0].find("For")));
  }
  const bool qwen = type == "qwen2" || type == "qwen3";
  // Qwen2's and Qwen3's window exists only with use_sliding_window; Mistral's is on every
  // layer whatever layer_types says (transformers' MistralConfig ignores it).
  if (qwen && !config.use_sliding_window.value_or(false)) return windows;
  if (type == "mistral") {
    if (!no_window) std::fill(windows.begin(), windows.end(), window);
    return windows;
  }
  if (!config.layer_types.empty()) {
    for (size_t i = 0; i < layers; ++i) {
      const std::string& layer_type = config.layer_types[i];
      if (layer_type == "full_attention") continue;
      if (layer_type != "sliding_attention") {
        return absl::UnimplementedError(absl::StrCat(
            config.Where(), config.KeyName("layer_types"), "[", i, "] \"", layer_type.substr(0, 64),
            "\" is not supported (full_attention, sliding_attention)"));
      }
      if (window <= 0) {
        return absl::InvalidArgumentError(
            absl::StrCat(config.Where(), config.KeyName("layer_types"), "[", i,
                         "] is \"sliding_attention\", but there is no sliding_window"));
      }
      windows[i] = no_window ? 0 : window;
    }
    return windows;
  }
  if (no_window) return windows;
  if (qwen) {
    for (size_t i = static_cast<size_t>(config.max_window_layers.value_or(28)); i < layers; ++i) {
      windows[i] = window;
    }
    return windows;
  }
  if (type == "gemma2" || type == "gemma3" || type == "gemma3_text") {
    const size_t pattern =
        static_cast<size_t>(config.sliding_window_pattern.value_or(type == "gemma2" ? 2 : 6));
    for (size_t i = 0; i < layers; ++i) {
      if ((i + 1) % pattern != 0) windows[i] = window;
    }
    return windows;
  }
  std::fill(windows.begin(), windows.end(), window);
  return windows;
}

absl::StatusOr<std::vector<int32_t>> ReadEndTokenIds(const std::string& path) {
  KVCM_ASSIGN_OR_RETURN(const ModelConfig config, ReadModelConfig(path));
  std::vector<int32_t> ids = config.eos_token_ids;
  auto add = [&](int32_t id) {
    if (std::find(ids.begin(), ids.end(), id) == ids.end()) ids.push_back(id);
  };
  if (config.eot_token_id.has_value()) add(*config.eot_token_id);
  std::error_code error;
  if (!std::filesystem::is_directory(path, error)) return ids;
  const std::string generation_path = absl::StrCat(path, "/generation_config.json");
  if (!std::filesystem::exists(generation_path, error)) return ids;
  KVCM_ASSIGN_OR_RETURN(const std::string text, ReadWholeFile(generation_path));
  const Json root = Json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!root.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(generation_path, ": not a JSON object"));
  }
  const auto eos = root.find("eos_token_id");
  if (eos == root.end() || eos->is_null()) return ids;
  const Json list = eos->is_array() ? *eos : Json::array({*eos});
  const int64_t vocab = config.vocab_size.value_or(std::numeric_limits<int32_t>::max());
  for (const Json& id : list) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() >= vocab) {
      return absl::InvalidArgumentError(absl::StrCat(generation_path,
                                                     ": eos_token_id must be token ids in [0, ",
                                                     vocab, "), got ", eos->dump()));
    }
    add(static_cast<int32_t>(id.get<int64_t>()));
  }
  return ids;
}

}  // namespace kvcm
