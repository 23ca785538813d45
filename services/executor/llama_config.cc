#include "services/executor/llama_config.h"

#include <algorithm>
#include <cmath>
#include <iterator>
#include <string_view>
#include <fstream>
#include <limits>
#include <optional>
#include <sstream>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "absl/container/flat_hash_map.h"
#include "common/base/status_macros.h"
#include "common/gguf/gguf_file.h"
#include "nlohmann/json.hpp"

namespace kvcm {
namespace {

using Json = nlohmann::json;

absl::Status Invalid(absl::string_view message) {
  return absl::InvalidArgumentError(absl::StrCat("config.json: ", message));
}
absl::Status Unimplemented(absl::string_view message) {
  return absl::UnimplementedError(absl::StrCat("config.json: ", message));
}

const Json* Get(const Json& object, const char* key) {
  const auto it = object.find(key);
  return it == object.end() || it->is_null() ? nullptr : &*it;
}

absl::StatusOr<std::optional<int32_t>> OptionalInt(const Json& object, const char* key,
                                                   int64_t min_value) {
  const Json* value = Get(object, key);
  if (value == nullptr) return std::optional<int32_t>();
  if (!value->is_number_integer()) {
    return Invalid(absl::StrCat("key \"", key, "\" must be an integer, got ", value->type_name(),
                                " ", value->dump()));
  }
  const bool too_big =
      value->is_number_unsigned() && value->get<uint64_t>() > std::numeric_limits<int32_t>::max();
  const int64_t v = too_big ? std::numeric_limits<int64_t>::max() : value->get<int64_t>();
  if (v < min_value || v > std::numeric_limits<int32_t>::max()) {
    return Invalid(absl::StrCat("key \"", key, "\" must be an integer in [", min_value, ", ",
                                std::numeric_limits<int32_t>::max(), "], got ", value->dump()));
  }
  return std::optional<int32_t>(static_cast<int32_t>(v));
}

absl::StatusOr<int32_t> RequiredPositiveInt(const Json& object, const char* key) {
  KVCM_ASSIGN_OR_RETURN(const std::optional<int32_t> value, OptionalInt(object, key, 1));
  if (!value.has_value()) return Invalid(absl::StrCat("missing required key \"", key, "\""));
  return *value;
}

// A positive finite number, or `default_value` when absent.
absl::StatusOr<double> OptionalPositiveNumber(const Json& object, const char* key,
                                              double default_value) {
  const Json* value = Get(object, key);
  if (value == nullptr) return default_value;
  if (!value->is_number()) {
    return Invalid(absl::StrCat("key \"", key, "\" must be a number, got ", value->type_name(), " ",
                                value->dump()));
  }
  const double v = value->get<double>();
  if (!std::isfinite(v) || v <= 0) {
    return Invalid(
        absl::StrCat("key \"", key, "\" must be a positive number, got ", value->dump()));
  }
  return v;
}

absl::StatusOr<bool> OptionalBool(const Json& object, const char* key, bool default_value) {
  const Json* value = Get(object, key);
  if (value == nullptr) return default_value;
  if (!value->is_boolean()) {
    return Invalid(absl::StrCat("key \"", key, "\" must be true or false, got ", value->dump()));
  }
  return value->get<bool>();
}

// bos_token_id / eos_token_id: an int, a list of ints, or null.
absl::StatusOr<std::vector<int32_t>> TokenIds(const Json& object, const char* key,
                                              int32_t vocab_size) {
  const Json* value = Get(object, key);
  std::vector<int32_t> ids;
  if (value == nullptr) return ids;
  const Json list = value->is_array() ? *value : Json::array({*value});
  for (const Json& id : list) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() >= vocab_size) {
      return Invalid(absl::StrCat("key \"", key, "\" must be a token id in [0, vocab_size=",
                                  vocab_size, ") or a list of them, got ", value->dump()));
    }
    ids.push_back(static_cast<int32_t>(id.get<int64_t>()));
  }
  return ids;
}

// One RoPE parameter set: transformers < 5's top-level "rope_scaling", or transformers 5's
// "rope_parameters" (which also holds rope_theta). `where` names it in messages. Keys that
// change the math and are not understood are an error, never ignored.
absl::StatusOr<RopeScaling> ParseRopeSection(const Json& section, const std::string& where) {
  RopeScaling scaling;
  // transformers writes "rope_type"; older configs "type".
  const Json* type = Get(section, "rope_type");
  if (type == nullptr) type = Get(section, "type");
  if (type != nullptr && !type->is_string()) {
    return Invalid(absl::StrCat("\"", where, "\" has a non-string \"rope_type\": ", section.dump()));
  }
  if (type == nullptr && where == "rope_scaling") {
    return Invalid(absl::StrCat("\"rope_scaling\" has no string \"rope_type\": ", section.dump()));
  }
  const std::string name = type == nullptr ? "default" : type->get<std::string>();
  if (name != "default" && name != "llama3" && name != "linear") {
    return Unimplemented(absl::StrCat("\"", where, "\" of rope_type \"", name,
                                      "\" is not supported (supported: default, llama3, linear)"));
  }
  // Every key a supported type reads; anything else would change the frequencies or the
  // attention scale in transformers (attention_factor, partial_rotary_factor, beta_fast, ...).
  static constexpr std::string_view kKnown[] = {
      "rope_type", "type", "rope_theta", "factor", "low_freq_factor", "high_freq_factor",
      "original_max_position_embeddings"};
  for (const auto& [key, value] : section.items()) {
    if (std::find(std::begin(kKnown), std::end(kKnown), key) != std::end(kKnown)) continue;
    if (key == "partial_rotary_factor" && value.is_number() && value.get<double>() == 1.0) {
      continue;  // the whole head rotates: what kvcm does
    }
    return Unimplemented(absl::StrCat("key \"", where, ".", key, "\" (", value.dump(),
                                      ") changes RoPE and is not supported"));
  }
  if (name == "default") return scaling;
  KVCM_ASSIGN_OR_RETURN(scaling.factor, OptionalPositiveNumber(section, "factor", -1));
  if (scaling.factor < 0) {
    return Invalid(absl::StrCat("\"", where, "\" of rope_type \"", name, "\" needs a \"factor\""));
  }
  if (name == "linear") {
    scaling.type = RopeScaling::Type::kLinear;
    return scaling;
  }
  scaling.type = RopeScaling::Type::kLlama3;
  KVCM_ASSIGN_OR_RETURN(scaling.low_freq_factor,
                        OptionalPositiveNumber(section, "low_freq_factor", 1.0));
  KVCM_ASSIGN_OR_RETURN(scaling.high_freq_factor,
                        OptionalPositiveNumber(section, "high_freq_factor", 4.0));
  KVCM_ASSIGN_OR_RETURN(scaling.original_max_position_embeddings,
                        RequiredPositiveInt(section, "original_max_position_embeddings"));
  if (scaling.high_freq_factor <= scaling.low_freq_factor) {
    return Invalid(absl::StrCat("\"", where, "\": high_freq_factor must exceed low_freq_factor"));
  }
  return scaling;
}

bool SameScaling(const RopeScaling& a, const RopeScaling& b) {
  return a.type == b.type && a.factor == b.factor && a.low_freq_factor == b.low_freq_factor &&
         a.high_freq_factor == b.high_freq_factor &&
         a.original_max_position_embeddings == b.original_max_position_embeddings;
}

// rope_theta and the scaling, from either spelling; both present must agree.
absl::Status ParseRope(const Json& root, LlamaConfig* c) {
  std::optional<double> theta;
  if (Get(root, "rope_theta") != nullptr) {
    KVCM_ASSIGN_OR_RETURN(const double top, OptionalPositiveNumber(root, "rope_theta", 10000.0));
    theta = top;
  }
  std::optional<RopeScaling> scaling;
  if (const Json* old = Get(root, "rope_scaling"); old != nullptr) {
    if (!old->is_object()) {
      return Invalid(
          absl::StrCat("key \"rope_scaling\" must be an object or null, got ", old->dump()));
    }
    KVCM_ASSIGN_OR_RETURN(RopeScaling parsed, ParseRopeSection(*old, "rope_scaling"));
    scaling = parsed;
  }
  if (const Json* params = Get(root, "rope_parameters"); params != nullptr) {
    if (!params->is_object()) {
      return Invalid(absl::StrCat("key \"rope_parameters\" must be an object or null, got ",
                                  params->dump()));
    }
    // Per layer type ({"full_attention": {...}, "sliding_attention": {...}}): not Llama's.
    if (!params->empty() && params->begin()->is_object()) {
      return Unimplemented(absl::StrCat("\"rope_parameters\" per layer type (",
                                        params->begin().key(), ", ...) is not supported"));
    }
    KVCM_ASSIGN_OR_RETURN(const RopeScaling parsed, ParseRopeSection(*params, "rope_parameters"));
    if (scaling.has_value() && !SameScaling(*scaling, parsed)) {
      return Invalid(absl::StrCat("\"rope_scaling\" and \"rope_parameters\" disagree: ",
                                  root["rope_scaling"].dump(), " vs ", params->dump()));
    }
    scaling = parsed;
    if (Get(*params, "rope_theta") != nullptr) {
      KVCM_ASSIGN_OR_RETURN(const double inner,
                            OptionalPositiveNumber(*params, "rope_theta", 10000.0));
      if (theta.has_value() && *theta != inner) {
        return Invalid(absl::StrCat("\"rope_theta\" ", *theta, " and \"rope_parameters.rope_theta\" ",
                                    inner, " disagree"));
      }
      theta = inner;
    }
  }
  c->rope_theta = theta.value_or(10000.0);
  c->rope_scaling = scaling.value_or(RopeScaling{});
  return absl::OkStatus();
}

constexpr const char* kArchitectures[] = {"LlamaForCausalLM", "MistralForCausalLM",
                                          "Qwen2ForCausalLM"};
constexpr const char* kModelTypes[] = {"llama", "mistral", "qwen2"};

absl::StatusOr<std::string> Architecture(const Json& root) {
  const Json* archs = Get(root, "architectures");
  if (archs != nullptr) {
    if (!archs->is_array() || archs->empty()) {
      return Invalid(
          absl::StrCat("key \"architectures\" must be a non-empty list, got ", archs->dump()));
    }
    for (const Json& a : *archs) {
      if (!a.is_string()) continue;
      for (const char* known : kArchitectures) {
        if (a.get<std::string>() == known) return std::string(known);
      }
    }
    return Unimplemented(
        absl::StrCat("\"architectures\" ", archs->dump(),
                     " is not supported (supported: ", absl::StrJoin(kArchitectures, ", "), ")"));
  }
  const Json* model_type = Get(root, "model_type");
  if (model_type == nullptr) {
    return Invalid("neither \"architectures\" nor \"model_type\" is given");
  }
  for (size_t i = 0; i < std::size(kModelTypes); ++i) {
    if (model_type->is_string() && model_type->get<std::string>() == kModelTypes[i]) {
      return std::string(kArchitectures[i]);
    }
  }
  return Unimplemented(
      absl::StrCat("\"model_type\" ", model_type->dump(),
                   " is not supported (supported: ", absl::StrJoin(kModelTypes, ", "), ")"));
}

}  // namespace

absl::StatusOr<KvCacheSpec> LlamaConfig::KvSpec(DType dtype, int32_t block_size) const {
  KvCacheSpec spec;
  spec.num_layers = num_hidden_layers;
  spec.num_kv_heads = num_key_value_heads;
  spec.head_dim = head_dim;
  spec.dtype = dtype;
  spec.block_size = block_size;
  KVCM_RETURN_IF_ERROR(spec.Validate());
  return spec;
}

std::string RopeScalingName(const RopeScaling& s) {
  switch (s.type) {
    case RopeScaling::Type::kNone: return "none";
    case RopeScaling::Type::kLinear: return absl::StrCat("linear x", s.factor);
    case RopeScaling::Type::kLlama3:
      return absl::StrCat("llama3 x", s.factor, " (low ", s.low_freq_factor, ", high ",
                          s.high_freq_factor, ", original ", s.original_max_position_embeddings,
                          ")");
  }
  return "";
}

std::string LlamaConfig::ToString() const {
  return absl::StrCat(
      architecture, ": vocab ", vocab_size, ", hidden ", hidden_size, ", intermediate ",
      intermediate_size, ", ", num_hidden_layers, " layers, ", num_attention_heads, " heads (",
      num_key_value_heads, " KV) x head dim ", head_dim, ", rms_norm_eps ", rms_norm_eps,
      ", rope_theta ", rope_theta, ", rope scaling ", RopeScalingName(rope_scaling),
      tie_word_embeddings ? ", tied embeddings" : "",
      qkv_bias ? (o_bias ? ", q/k/v/o bias" : ", q/k/v bias") : "", torch_dtype.empty() ? "" : ", ", torch_dtype);
}

absl::StatusOr<LlamaConfig> ParseLlamaConfig(const std::string& json_text) {
  Json root;
  try {
    root = Json::parse(json_text);
  } catch (const Json::exception& e) {
    return Invalid(absl::StrCat("malformed JSON: ", e.what()));
  }
  if (!root.is_object()) {
    return Invalid(absl::StrCat("expected a JSON object, got ", root.type_name()));
  }

  LlamaConfig c;
  KVCM_ASSIGN_OR_RETURN(c.architecture, Architecture(root));
  KVCM_ASSIGN_OR_RETURN(c.vocab_size, RequiredPositiveInt(root, "vocab_size"));
  KVCM_ASSIGN_OR_RETURN(c.hidden_size, RequiredPositiveInt(root, "hidden_size"));
  KVCM_ASSIGN_OR_RETURN(c.intermediate_size, RequiredPositiveInt(root, "intermediate_size"));
  KVCM_ASSIGN_OR_RETURN(c.num_hidden_layers, RequiredPositiveInt(root, "num_hidden_layers"));
  KVCM_ASSIGN_OR_RETURN(c.num_attention_heads, RequiredPositiveInt(root, "num_attention_heads"));

  KVCM_ASSIGN_OR_RETURN(const std::optional<int32_t> kv_heads,
                        OptionalInt(root, "num_key_value_heads", 1));
  c.num_key_value_heads = kv_heads.value_or(c.num_attention_heads);
  if (c.num_attention_heads % c.num_key_value_heads != 0) {
    return Invalid(absl::StrCat("\"num_attention_heads\" (", c.num_attention_heads,
                                ") is not a multiple of \"num_key_value_heads\" (",
                                c.num_key_value_heads, ")"));
  }
  KVCM_ASSIGN_OR_RETURN(const std::optional<int32_t> head_dim, OptionalInt(root, "head_dim", 1));
  if (head_dim.has_value()) {
    c.head_dim = *head_dim;
  } else if (c.hidden_size % c.num_attention_heads != 0) {
    return Invalid(absl::StrCat("no \"head_dim\", and \"hidden_size\" (", c.hidden_size,
                                ") is not divisible by \"num_attention_heads\" (",
                                c.num_attention_heads, ")"));
  } else {
    c.head_dim = c.hidden_size / c.num_attention_heads;
  }
  if (c.head_dim % 2 != 0) {
    return Invalid(absl::StrCat("head_dim must be even for RoPE, got ", c.head_dim));
  }

  KVCM_ASSIGN_OR_RETURN(const double eps, OptionalPositiveNumber(root, "rms_norm_eps", 1e-6));
  c.rms_norm_eps = static_cast<float>(eps);
  KVCM_RETURN_IF_ERROR(ParseRope(root, &c));
  KVCM_ASSIGN_OR_RETURN(const std::optional<int32_t> max_pos,
                        OptionalInt(root, "max_position_embeddings", 1));
  c.max_position_embeddings = max_pos.value_or(2048);
  KVCM_ASSIGN_OR_RETURN(c.tie_word_embeddings, OptionalBool(root, "tie_word_embeddings", false));

  KVCM_ASSIGN_OR_RETURN(const std::vector<int32_t> bos,
                        TokenIds(root, "bos_token_id", c.vocab_size));
  if (bos.size() > 1) {
    return Invalid(absl::StrCat("key \"bos_token_id\" must be a single id, got ",
                                root["bos_token_id"].dump()));
  }
  c.bos_token_id = bos.empty() ? -1 : bos[0];
  KVCM_ASSIGN_OR_RETURN(c.eos_token_ids, TokenIds(root, "eos_token_id", c.vocab_size));

  for (const char* key : {"torch_dtype", "dtype"}) {
    const Json* dtype = Get(root, key);
    if (dtype == nullptr) continue;
    if (!dtype->is_string()) {
      return Invalid(absl::StrCat("key \"", key, "\" must be a string, got ", dtype->dump()));
    }
    c.torch_dtype = dtype->get<std::string>();
    break;
  }

  // Features this implementation does not have: refuse rather than compute wrong logits.
  if (const Json* act = Get(root, "hidden_act"); act != nullptr && *act != "silu") {
    return Unimplemented(
        absl::StrCat("\"hidden_act\" ", act->dump(), " is not supported (only \"silu\")"));
  }
  KVCM_ASSIGN_OR_RETURN(const bool mlp_bias, OptionalBool(root, "mlp_bias", false));
  if (mlp_bias) return Unimplemented("\"mlp_bias\": true is not supported");
  const bool qwen2 = c.architecture == "Qwen2ForCausalLM";
  if (qwen2) {
    // Qwen2's q, k and v projections always have a bias, its o projection none.
    c.qkv_bias = true;
    KVCM_ASSIGN_OR_RETURN(const bool windowed, OptionalBool(root, "use_sliding_window", false));
    if (windowed) {
      return Unimplemented("\"use_sliding_window\": true (sliding-window attention) is not "
                           "supported");
    }
  } else {
    KVCM_ASSIGN_OR_RETURN(const bool attention_bias, OptionalBool(root, "attention_bias", false));
    c.qkv_bias = attention_bias;
    c.o_bias = attention_bias;
  }
  if (const Json* window = Get(root, "sliding_window"); window != nullptr && !qwen2) {
    if (!window->is_number_integer() || window->get<int64_t>() < c.max_position_embeddings) {
      return Unimplemented(absl::StrCat("\"sliding_window\" ", window->dump(),
                                        " (shorter than max_position_embeddings=",
                                        c.max_position_embeddings, ") is not supported"));
    }
  }
  return c;
}

absl::StatusOr<LlamaConfig> LoadLlamaConfig(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open \"", path, "\""));
  std::stringstream text;
  text << in.rdbuf();
  if (in.bad()) return absl::NotFoundError(absl::StrCat("cannot read \"", path, "\""));
  absl::StatusOr<LlamaConfig> config = ParseLlamaConfig(text.str());
  if (!config.ok()) {
    return absl::Status(config.status().code(),
                        absl::StrCat(path, ": ", config.status().message()));
  }
  return config;
}

namespace {

// GGUF metadata as LlamaConfigFromGguf reads it: every error names the file and the key.
class GgufKeys {
 public:
  GgufKeys(const GgufFile& file, std::string arch) : file_(file), arch_(std::move(arch)) {}

  std::string Key(std::string_view suffix) const { return absl::StrCat(arch_, ".", std::string(suffix)); }

  absl::Status Invalid(std::string_view key, std::string_view what) const {
    return absl::InvalidArgumentError(
        absl::StrCat(file_.name(), ": GGUF key \"", std::string(key), "\" ", std::string(what)));
  }

  // A required (or, with `fallback`, optional) integer in [min_value, INT32_MAX].
  absl::StatusOr<int32_t> Int(std::string_view key, int64_t min_value,
                              std::optional<int32_t> fallback = std::nullopt) const {
    if (!file_.Has(key)) {
      if (fallback.has_value()) return *fallback;
      return Invalid(key, "is missing");
    }
    KVCM_ASSIGN_OR_RETURN(const int64_t v, file_.GetInt(key));
    if (v < min_value || v > std::numeric_limits<int32_t>::max()) {
      return Invalid(key, absl::StrCat("must be in [", min_value, ", ",
                                       std::numeric_limits<int32_t>::max(), "], got ", v));
    }
    return static_cast<int32_t>(v);
  }

  absl::StatusOr<double> PositiveFloat(std::string_view key,
                                       std::optional<double> fallback = std::nullopt) const {
    if (!file_.Has(key)) {
      if (fallback.has_value()) return *fallback;
      return Invalid(key, "is missing");
    }
    KVCM_ASSIGN_OR_RETURN(const double v, file_.GetFloat(key));
    if (!(v > 0) || !std::isfinite(v)) {
      return Invalid(key, absl::StrCat("must be a positive number, got ", v));
    }
    return v;
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

}  // namespace

absl::StatusOr<LlamaConfig> LlamaConfigFromGguf(const GgufFile& file) {
  KVCM_ASSIGN_OR_RETURN(const std::string arch, file.GetString("general.architecture"));
  if (arch != "llama" && arch != "qwen2") {
    return absl::UnimplementedError(absl::StrCat(file.name(), ": general.architecture \"", arch,
                                                 "\" is not supported (supported: llama, qwen2)"));
  }
  const GgufKeys keys(file, arch);
  LlamaConfig c;
  c.architecture =
      arch == "qwen2" ? "Qwen2ForCausalLM (GGUF qwen2)" : "LlamaForCausalLM (GGUF llama)";
  c.qkv_bias = arch == "qwen2";
  KVCM_ASSIGN_OR_RETURN(c.num_hidden_layers, keys.Int(keys.Key("block_count"), 1));
  KVCM_ASSIGN_OR_RETURN(c.hidden_size, keys.Int(keys.Key("embedding_length"), 1));
  KVCM_ASSIGN_OR_RETURN(c.intermediate_size, keys.Int(keys.Key("feed_forward_length"), 1));
  KVCM_ASSIGN_OR_RETURN(c.num_attention_heads, keys.Int(keys.Key("attention.head_count"), 1));
  KVCM_ASSIGN_OR_RETURN(c.num_key_value_heads, keys.Int(keys.Key("attention.head_count_kv"), 1,
                                                        c.num_attention_heads));
  if (c.num_attention_heads % c.num_key_value_heads != 0) {
    return keys.Invalid(keys.Key("attention.head_count_kv"),
                        absl::StrCat("(", c.num_key_value_heads, ") does not divide ",
                                     keys.Key("attention.head_count"), " (",
                                     c.num_attention_heads, ")"));
  }
  if (!file.Has(keys.Key("attention.key_length")) &&
      c.hidden_size % c.num_attention_heads != 0) {
    return keys.Invalid(keys.Key("embedding_length"),
                        absl::StrCat("(", c.hidden_size, ") is not divisible by the ",
                                     c.num_attention_heads, " heads, and there is no ",
                                     keys.Key("attention.key_length")));
  }
  KVCM_ASSIGN_OR_RETURN(c.head_dim, keys.Int(keys.Key("attention.key_length"), 2,
                                             c.hidden_size / c.num_attention_heads));
  for (const char* same : {"attention.value_length", "rope.dimension_count"}) {
    KVCM_ASSIGN_OR_RETURN(const int32_t v, keys.Int(keys.Key(same), 1, c.head_dim));
    if (v != c.head_dim) {
      return absl::UnimplementedError(absl::StrCat(
          file.name(), ": GGUF key \"", keys.Key(same), "\" is ", v, ", not the head dim ",
          c.head_dim, " (partial rotary or unequal key/value heads are not supported)"));
    }
  }
  if (c.head_dim % 2 != 0) {
    return keys.Invalid(keys.Key("attention.key_length"),
                        absl::StrCat("must be even for RoPE, got ", c.head_dim));
  }
  KVCM_ASSIGN_OR_RETURN(const double eps,
                        keys.PositiveFloat(keys.Key("attention.layer_norm_rms_epsilon")));
  c.rms_norm_eps = static_cast<float>(eps);
  KVCM_ASSIGN_OR_RETURN(c.rope_theta, keys.PositiveFloat(keys.Key("rope.freq_base"), 10000.0));
  if (file.Has(keys.Key("rope.scaling.type"))) {
    KVCM_ASSIGN_OR_RETURN(const std::string type, file.GetString(keys.Key("rope.scaling.type")));
    if (type == "linear") {
      c.rope_scaling.type = RopeScaling::Type::kLinear;
      KVCM_ASSIGN_OR_RETURN(c.rope_scaling.factor,
                            keys.PositiveFloat(keys.Key("rope.scaling.factor")));
    } else if (type != "none") {
      return absl::UnimplementedError(absl::StrCat(file.name(), ": GGUF key \"",
                                                   keys.Key("rope.scaling.type"), "\" \"", type,
                                                   "\" is not supported (none, linear)"));
    }
  }
  if (file.FindTensor("rope_freqs.weight").ok()) {
    return absl::UnimplementedError(absl::StrCat(
        file.name(), ": tensor \"rope_freqs.weight\" (per-frequency RoPE factors, as Llama 3.1 "
        "files carry) is not supported yet"));
  }
  if (file.Has(keys.Key("attention.sliding_window"))) {
    return absl::UnimplementedError(absl::StrCat(file.name(), ": GGUF key \"",
                                                 keys.Key("attention.sliding_window"),
                                                 "\" (sliding-window attention) is not supported"));
  }
  KVCM_ASSIGN_OR_RETURN(c.max_position_embeddings,
                        keys.Int(keys.Key("context_length"), 1, int32_t{2048}));
  int32_t tokens = 0;
  if (file.Has("tokenizer.ggml.tokens")) {
    KVCM_ASSIGN_OR_RETURN(const GgufValue* list, file.GetValue("tokenizer.ggml.tokens"));
    tokens = static_cast<int32_t>(std::min<size_t>(list->elements.size(), INT32_MAX));
  }
  KVCM_ASSIGN_OR_RETURN(c.vocab_size, keys.Int(keys.Key("vocab_size"), 1,
                                               tokens > 0 ? std::optional<int32_t>(tokens)
                                                          : std::nullopt));
  c.tie_word_embeddings = !file.FindTensor("output.weight").ok();
  KVCM_ASSIGN_OR_RETURN(c.bos_token_id, keys.Int("tokenizer.ggml.bos_token_id", 0, int32_t{-1}));
  if (c.bos_token_id >= c.vocab_size) {
    return keys.Invalid("tokenizer.ggml.bos_token_id",
                        absl::StrCat("(", c.bos_token_id, ") is outside the vocabulary of ",
                                     c.vocab_size));
  }
  for (const char* key : {"tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"}) {
    KVCM_ASSIGN_OR_RETURN(const int32_t id, keys.Int(key, 0, int32_t{-1}));
    if (id < 0) continue;
    if (id >= c.vocab_size) {
      return keys.Invalid(key, absl::StrCat("(", id, ") is outside the vocabulary of ",
                                            c.vocab_size));
    }
    if (std::find(c.eos_token_ids.begin(), c.eos_token_ids.end(), id) == c.eos_token_ids.end()) {
      c.eos_token_ids.push_back(id);
    }
  }
  c.torch_dtype = absl::StrCat("GGUF ", MainWeightType(file));
  return c;
}

}  // namespace kvcm
