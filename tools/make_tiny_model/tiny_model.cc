#include "tools/make_tiny_model/tiny_model.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <numbers>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/base/status_macros.h"
#include "common/safetensors/safetensors.h"
#include "nlohmann/json.hpp"

namespace kvcm {
namespace {

uint64_t SplitMix64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// N(0, 1) numbers from a SplitMix64 stream via Box-Muller: the same on every platform,
// unlike std::normal_distribution.
class NormalStream {
 public:
  NormalStream(uint64_t seed, const std::string& name) : state_(seed) {
    uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a of the name
    for (const char c : name) h = (h ^ static_cast<unsigned char>(c)) * 0x100000001b3ull;
    state_ ^= h;
  }
  double Next() {
    const double u1 = (static_cast<double>(SplitMix64(state_) >> 11) + 1.0) * 0x1.0p-53;  // (0,1]
    const double u2 = static_cast<double>(SplitMix64(state_) >> 11) * 0x1.0p-53;
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
  }

 private:
  uint64_t state_;
};

const char* SafetensorsDType(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "F32";
    case DType::kFloat16:
      return "F16";
    case DType::kBFloat16:
      return "BF16";
    default:
      return nullptr;
  }
}

const char* TorchDType(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "float32";
    case DType::kFloat16:
      return "float16";
    default:
      return "bfloat16";
  }
}

absl::Status Validate(const TinyModelOptions& o) {
  auto invalid = [](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat("tiny model: ", parts...));
  };
  const std::pair<const char*, int64_t> sizes[] = {
      {"vocab_size", o.vocab_size},
      {"hidden_size", o.hidden_size},
      {"intermediate_size", o.intermediate_size},
      {"num_layers", o.num_layers},
      {"num_heads", o.num_heads},
      {"num_kv_heads", o.num_kv_heads},
      {"head_dim", o.head_dim},
      {"max_position_embeddings", o.max_position_embeddings},
      {"num_shards", o.num_shards}};
  for (const auto& [name, value] : sizes) {
    if (value <= 0) return invalid(name, " must be positive, got ", value);
  }
  if (o.architecture != "llama" && o.architecture != "mistral" && o.architecture != "qwen2" &&
      o.architecture != "qwen3") {
    return invalid("architecture must be \"llama\", \"mistral\", \"qwen2\" or \"qwen3\", got \"",
                   o.architecture, "\"");
  }
  if (o.sliding_window < 0 || o.max_window_layers < 0 || o.max_window_layers > o.num_layers) {
    return invalid("sliding_window (", o.sliding_window, ") must be >= 0 and max_window_layers (",
                   o.max_window_layers, ") in [0, num_layers]");
  }
  if (o.sliding_window > 0 && o.architecture == "llama") {
    return invalid("a sliding window is Mistral's, Qwen2's or Qwen3's, not Llama's");
  }
  if (o.attention_bias && o.architecture == "mistral") {
    return invalid("attention_bias is Llama's and Qwen3's (Mistral's projections have none)");
  }
  if (o.attention_bias && o.architecture == "qwen2") {
    return invalid(
        "attention_bias is Llama's and Qwen3's (qwen2 always has its q, k and v "
        "biases)");
  }
  if (o.num_heads % o.num_kv_heads != 0) {
    return invalid("num_heads (", o.num_heads, ") must be a multiple of num_kv_heads (",
                   o.num_kv_heads, ")");
  }
  if (o.head_dim % 2 != 0) return invalid("head_dim must be even, got ", o.head_dim);
  if (SafetensorsDType(o.dtype) == nullptr) {
    return invalid("dtype must be fp32, fp16 or bf16, got ", std::string(DTypeName(o.dtype)));
  }
  if (o.num_shards > o.num_layers) {
    return invalid("num_shards (", o.num_shards, ") exceeds num_layers (", o.num_layers, ")");
  }
  if (!o.rope_scaling.empty() && o.rope_scaling != "linear" && o.rope_scaling != "llama3") {
    return invalid("rope scaling must be \"\", \"linear\" or \"llama3\"");
  }
  if (!o.rope_scaling.empty() && !(o.rope_factor > 0))
    return invalid("rope factor must be positive");
  if (o.rope_scaling == "llama3" && (o.rope_original_max_position_embeddings <= 0 ||
                                     !(o.rope_high_freq_factor > o.rope_low_freq_factor))) {
    return invalid(
        "llama3 rope scaling needs original_max_position_embeddings > 0 and "
        "high_freq_factor > low_freq_factor");
  }
  if (!(o.rope_theta > 0) || !(o.rms_norm_eps > 0)) {
    return invalid("rope_theta and rms_norm_eps must be positive");
  }
  return absl::OkStatus();
}

}  // namespace

std::string TinyModelConfigJson(const TinyModelOptions& o) {
  nlohmann::ordered_json config = {
      {"architectures",
       {o.architecture == "qwen2"     ? "Qwen2ForCausalLM"
        : o.architecture == "qwen3"   ? "Qwen3ForCausalLM"
        : o.architecture == "mistral" ? "MistralForCausalLM"
                                      : "LlamaForCausalLM"}},
      {"model_type", o.architecture},
      {"vocab_size", o.vocab_size},
      {"hidden_size", o.hidden_size},
      {"intermediate_size", o.intermediate_size},
      {"num_hidden_layers", o.num_layers},
      {"num_attention_heads", o.num_heads},
      {"num_key_value_heads", o.num_kv_heads},
      {"head_dim", o.head_dim},
      {"hidden_act", "silu"},
      {"max_position_embeddings", o.max_position_embeddings},
      {"rms_norm_eps", o.rms_norm_eps},
      {"attention_bias", o.attention_bias},
      {"mlp_bias", false},
      {"tie_word_embeddings", o.tie_word_embeddings},
      {"bos_token_id", 1},
      {"eos_token_id", 2},
      {"torch_dtype", TorchDType(o.dtype)},
  };
  nlohmann::ordered_json scaling = nullptr;
  if (!o.rope_scaling.empty()) {
    scaling = {{"rope_type", o.rope_scaling}, {"factor", o.rope_factor}};
    if (o.rope_scaling == "llama3") {
      scaling["low_freq_factor"] = o.rope_low_freq_factor;
      scaling["high_freq_factor"] = o.rope_high_freq_factor;
      scaling["original_max_position_embeddings"] = o.rope_original_max_position_embeddings;
    }
  }
  if (o.rope_parameters) {
    nlohmann::ordered_json params = {{"rope_theta", o.rope_theta}, {"rope_type", "default"}};
    if (!scaling.is_null()) {
      for (const auto& [key, value] : scaling.items()) params[key] = value;
    }
    config["rope_parameters"] = params;
  } else {
    config["rope_theta"] = o.rope_theta;
    config["rope_scaling"] = scaling;
  }
  if (o.sliding_window > 0) {
    if (o.architecture != "mistral") {
      config["use_sliding_window"] = true;
      config["max_window_layers"] = o.max_window_layers;
    }
    config["sliding_window"] = o.sliding_window;
  }
  return config.dump(2) + "\n";
}

absl::Status WriteTinyModel(const std::string& folder, const TinyModelOptions& o) {
  KVCM_RETURN_IF_ERROR(Validate(o));
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(folder, ec);
  if (ec) {
    return absl::InternalError(
        absl::StrCat("tiny model: cannot create \"", folder, "\": ", ec.message()));
  }
  {
    std::ofstream out(fs::path(folder) / "config.json", std::ios::trunc);
    out << TinyModelConfigJson(o);
    out.close();
    if (!out) {
      return absl::InternalError(
          absl::StrCat("tiny model: cannot write config.json in \"", folder, "\""));
    }
  }

  const std::string dtype = SafetensorsDType(o.dtype);
  // Tensors grouped by shard: embeddings with the first, final norm and head with the last,
  // layers spread evenly.
  std::vector<std::vector<SafetensorsTensorToWrite>> shards(static_cast<size_t>(o.num_shards));
  auto add = [&](size_t shard, const std::string& name, std::vector<int64_t> shape, double mean,
                 double stddev) -> absl::Status {
    int64_t n = 1;
    for (const int64_t d : shape) n *= d;
    NormalStream normal(o.seed, name);
    std::vector<float> values(static_cast<size_t>(n));
    for (float& v : values) v = static_cast<float>(mean + stddev * normal.Next());
    KVCM_ASSIGN_OR_RETURN(std::vector<std::byte> bytes, EncodeFloat32As(values, dtype));
    shards[shard].push_back({name, dtype, std::move(shape), std::move(bytes)});
    return absl::OkStatus();
  };
  const int64_t h = o.hidden_size;
  const int64_t q = int64_t{o.num_heads} * o.head_dim;
  const int64_t kv = int64_t{o.num_kv_heads} * o.head_dim;
  const int64_t inter = o.intermediate_size;
  const double norm_noise = 0.1;
  KVCM_RETURN_IF_ERROR(add(0, "model.embed_tokens.weight", {o.vocab_size, h}, 0, 1));
  for (int32_t l = 0; l < o.num_layers; ++l) {
    const size_t shard = static_cast<size_t>(int64_t{l} * o.num_shards / o.num_layers);
    const std::string p = absl::StrCat("model.layers.", l, ".");
    KVCM_RETURN_IF_ERROR(add(shard, p + "input_layernorm.weight", {h}, 1, norm_noise));
    KVCM_RETURN_IF_ERROR(add(shard, p + "self_attn.q_proj.weight", {q, h}, 0, 1 / std::sqrt(h)));
    KVCM_RETURN_IF_ERROR(add(shard, p + "self_attn.k_proj.weight", {kv, h}, 0, 1 / std::sqrt(h)));
    KVCM_RETURN_IF_ERROR(add(shard, p + "self_attn.v_proj.weight", {kv, h}, 0, 1 / std::sqrt(h)));
    KVCM_RETURN_IF_ERROR(add(shard, p + "self_attn.o_proj.weight", {h, q}, 0, 1 / std::sqrt(q)));
    if (o.architecture == "qwen2" || o.attention_bias) {
      KVCM_RETURN_IF_ERROR(add(shard, p + "self_attn.q_proj.bias", {q}, 0, 0.5));
      KVCM_RETURN_IF_ERROR(add(shard, p + "self_attn.k_proj.bias", {kv}, 0, 0.5));
      KVCM_RETURN_IF_ERROR(add(shard, p + "self_attn.v_proj.bias", {kv}, 0, 0.5));
    }
    if (o.attention_bias) {
      KVCM_RETURN_IF_ERROR(add(shard, p + "self_attn.o_proj.bias", {h}, 0, 0.5));
    }
    if (o.architecture == "qwen3") {
      const int64_t d = o.head_dim;
      KVCM_RETURN_IF_ERROR(add(shard, p + "self_attn.q_norm.weight", {d}, 1, norm_noise));
      KVCM_RETURN_IF_ERROR(add(shard, p + "self_attn.k_norm.weight", {d}, 1, norm_noise));
    }
    KVCM_RETURN_IF_ERROR(add(shard, p + "post_attention_layernorm.weight", {h}, 1, norm_noise));
    KVCM_RETURN_IF_ERROR(add(shard, p + "mlp.gate_proj.weight", {inter, h}, 0, 1 / std::sqrt(h)));
    KVCM_RETURN_IF_ERROR(add(shard, p + "mlp.up_proj.weight", {inter, h}, 0, 1 / std::sqrt(h)));
    KVCM_RETURN_IF_ERROR(
        add(shard, p + "mlp.down_proj.weight", {h, inter}, 0, 1 / std::sqrt(inter)));
  }
  const size_t last = shards.size() - 1;
  KVCM_RETURN_IF_ERROR(add(last, "model.norm.weight", {h}, 1, norm_noise));
  if (!o.tie_word_embeddings) {
    KVCM_RETURN_IF_ERROR(add(last, "lm_head.weight", {o.vocab_size, h}, 0, 2 / std::sqrt(h)));
  }

  const std::map<std::string, std::string> metadata = {
      {"format", "pt"}, {"kvcm_tiny_model_seed", absl::StrCat(o.seed)}};
  if (o.num_shards == 1) {
    return WriteSafetensors((fs::path(folder) / "model.safetensors").string(), shards[0], metadata);
  }
  nlohmann::ordered_json weight_map = nlohmann::ordered_json::object();
  uint64_t total_bytes = 0;
  for (size_t s = 0; s < shards.size(); ++s) {
    const std::string name =
        absl::StrFormat("model-%05d-of-%05d.safetensors", s + 1, shards.size());
    KVCM_RETURN_IF_ERROR(WriteSafetensors((fs::path(folder) / name).string(), shards[s], metadata));
    for (const SafetensorsTensorToWrite& t : shards[s]) {
      weight_map[t.name] = name;
      total_bytes += t.data.size();
    }
  }
  const nlohmann::ordered_json index = {{"metadata", {{"total_size", total_bytes}}},
                                        {"weight_map", weight_map}};
  std::ofstream out(fs::path(folder) / "model.safetensors.index.json", std::ios::trunc);
  out << index.dump(2) << "\n";
  out.close();
  if (!out) {
    return absl::InternalError(
        absl::StrCat("tiny model: cannot write the shard index in \"", folder, "\""));
  }
  return absl::OkStatus();
}

}  // namespace kvcm
