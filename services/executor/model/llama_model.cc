#include "services/executor/model/llama_model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <numbers>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/base/check.h"
#include "common/base/status_macros.h"
#include "common/gguf/ggml_types.h"
#include "common/gguf/gguf_file.h"
#include "common/safetensors/safetensors.h"
#include "kernels/cpu_thread_pool.h"
#include "kernels/paged_attention.h"
#include "kernels/paged_kv.h"
#include "kernels/write_kv.h"
#include "services/executor/kv_groups.h"
#include "services/executor/model/architecture.h"

namespace kvcm::executor {
namespace {

// Four-lane float vectors (GCC/Clang vector extension): SSE on any x86-64, NEON on arm64.
typedef float Float4 __attribute__((vector_size(16)));

Float4 Load4(const float* p) {
  Float4 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// a . b in a fixed order: eight lanes (two vectors) accumulated over the length, then summed
// pairwise, then the tail. The same inputs always give the same bits.
float Dot(const float* a, const float* b, int64_t n) {
  Float4 acc0 = {0, 0, 0, 0};
  Float4 acc1 = {0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    acc0 += Load4(a + i) * Load4(b + i);
    acc1 += Load4(a + i + 4) * Load4(b + i + 4);
  }
  const Float4 acc = acc0 + acc1;
  float sum = (acc[0] + acc[1]) + (acc[2] + acc[3]);
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// y[rows][bias.size()] += bias, row by row; nothing for an empty bias.
void AddBias(float* y, int64_t rows, const std::vector<float>& bias) {
  const auto width = static_cast<int64_t>(bias.size());
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < width; ++i) y[r * width + i] += bias[static_cast<size_t>(i)];
  }
}

}  // namespace

namespace internal {

// Where Load finds the tensors, by their Hugging Face names (see llama_model.h).
class WeightSource {
 public:
  virtual ~WeightSource() = default;
  virtual bool Has(const std::string& hf_name) const = 0;
  // Tensor `hf_name` of exactly `shape`, in fp32.
  virtual absl::StatusOr<std::vector<float>> Load(const std::string& hf_name,
                                                  const std::vector<int64_t>& shape) const = 0;
  // Matrix `hf_name` of exactly `shape` ([out, in]), packed for kernels::MatMul.
  virtual absl::StatusOr<kernels::WeightMatrix> LoadMatrix(
      const std::string& hf_name, const std::vector<int64_t>& shape) const = 0;
};

}  // namespace internal

namespace {

using internal::WeightSource;

// A Hugging Face folder's safetensors shards.
class SafetensorsSource final : public WeightSource {
 public:
  SafetensorsSource(const SafetensorsFolder& shards, std::string folder)
      : shards_(shards), folder_(std::move(folder)) {}

  bool Has(const std::string& hf_name) const override {
    return shards_.Find(hf_name).first != nullptr;
  }

  absl::StatusOr<std::vector<float>> Load(const std::string& name,
                                          const std::vector<int64_t>& shape) const override {
    const auto [file, info] = shards_.Find(name);
    if (file == nullptr) {
      return absl::NotFoundError(absl::StrCat("model folder \"", folder_, "\" has no tensor \"",
                                              name, "\" (expected shape ", ShapeString(shape),
                                              ")"));
    }
    if (info->shape != shape) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor \"", name, "\" in \"", file->path(), "\" has shape ", ShapeString(info->shape),
          ", expected ", ShapeString(shape), " from config.json"));
    }
    return file->LoadFloat32(name);
  }

  absl::StatusOr<kernels::WeightMatrix> LoadMatrix(
      const std::string& name, const std::vector<int64_t>& shape) const override {
    KVCM_ASSIGN_OR_RETURN(const std::vector<float> w, Load(name, shape));
    return kernels::WeightMatrix::FromFloat(w, shape[0], shape[1]);
  }

 private:
  const SafetensorsFolder& shards_;
  const std::string folder_;
};

// llama.cpp's name of a Hugging Face tensor name (convert_hf_to_gguf's tensor map):
// model.layers.{l}.self_attn.q_proj.weight -> blk.{l}.attn_q.weight, ... With Gemma's
// sandwich norms, post_attention_layernorm is the attention output's norm
// (post_attention_norm), and pre_/post_feedforward_layernorm are ffn_norm and post_ffw_norm.
std::string GgufTensorName(const std::string& hf_name, bool sandwich_norms) {
  static const std::pair<std::string_view, std::string_view> kWhole[] = {
      {"model.embed_tokens.weight", "token_embd.weight"},
      {"model.norm.weight", "output_norm.weight"},
      {"lm_head.weight", "output.weight"},
  };
  for (const auto& [hf, gguf] : kWhole) {
    if (hf_name == hf) return std::string(gguf);
  }
  static const std::pair<std::string_view, std::string_view> kLayer[] = {
      {"input_layernorm.weight", "attn_norm.weight"},
      {"self_attn.q_proj.weight", "attn_q.weight"},
      {"self_attn.k_proj.weight", "attn_k.weight"},
      {"self_attn.v_proj.weight", "attn_v.weight"},
      {"self_attn.o_proj.weight", "attn_output.weight"},
      {"mlp.gate_proj.weight", "ffn_gate.weight"},
      {"mlp.up_proj.weight", "ffn_up.weight"},
      {"mlp.down_proj.weight", "ffn_down.weight"},
      {"self_attn.q_proj.bias", "attn_q.bias"},
      {"self_attn.k_proj.bias", "attn_k.bias"},
      {"self_attn.v_proj.bias", "attn_v.bias"},
      {"self_attn.o_proj.bias", "attn_output.bias"},
      {"self_attn.q_norm.weight", "attn_q_norm.weight"},
      {"self_attn.k_norm.weight", "attn_k_norm.weight"},
  };
  constexpr std::string_view kLayers = "model.layers.";
  if (hf_name.starts_with(kLayers)) {
    const std::string_view rest = std::string_view(hf_name).substr(kLayers.size());
    const size_t dot = rest.find('.');
    if (dot != std::string_view::npos) {
      const std::string_view layer = rest.substr(0, dot);
      const std::string_view tail = rest.substr(dot + 1);
      auto named = [&](std::string_view gguf) {
        return absl::StrCat("blk.", std::string(layer), ".", std::string(gguf));
      };
      for (const auto& [hf, gguf] : kLayer) {
        if (tail == hf) return named(gguf);
      }
      if (tail == "post_attention_layernorm.weight") {
        return named(sandwich_norms ? "post_attention_norm.weight" : "ffn_norm.weight");
      }
      if (sandwich_norms && tail == "pre_feedforward_layernorm.weight") {
        return named("ffn_norm.weight");
      }
      if (sandwich_norms && tail == "post_feedforward_layernorm.weight") {
        return named("post_ffw_norm.weight");
      }
    }
  }
  return hf_name;
}

// A GGUF file: matrices packed as they are stored (kernels::WeightMatrix::FromGgml), vectors
// dequantized to fp32 (ggml's reference dequantization). GGUF stores
// a [out, in] matrix with dims {in, out} (ne[0] the contiguous one), the same bytes as the
// row-major [out, in]. For the llama architecture, GGUF conversion reorders the rows of
// q_proj and k_proj inside each head from Hugging Face's rotate-half RoPE layout (the first
// half of a head, then the second) to ggml's interleaved pairs (row 2i is HF's row i, row
// 2i + 1 is HF's row i + head_dim / 2); LoadMatrix undoes it (`unpermute`), so the model computes
// RoPE one way for both sources. qwen2 and qwen3 files keep HF's order (ggml runs them with
// NEOX RoPE, which is rotate-half).
class GgufSource final : public WeightSource {
 public:
  GgufSource(const GgufFile& file, const LlamaConfig& config, bool unpermute)
      : file_(file), config_(config), unpermute_(unpermute) {}

  bool Has(const std::string& hf_name) const override {
    return file_.FindTensor(GgufTensorName(hf_name, config_.sandwich_norms)).ok();
  }

  absl::StatusOr<std::vector<float>> Load(const std::string& hf_name,
                                          const std::vector<int64_t>& shape) const override {
    KVCM_ASSIGN_OR_RETURN(const GgufTensorInfo* t, Find(hf_name, shape));
    std::vector<float> out(static_cast<size_t>(t->element_count));
    if (absl::Status s = Dequantize(t->type, t->data, std::span<float>(out)); !s.ok()) {
      return Named(hf_name, s);
    }
    return out;
  }

  absl::StatusOr<kernels::WeightMatrix> LoadMatrix(
      const std::string& hf_name, const std::vector<int64_t>& shape) const override {
    KVCM_ASSIGN_OR_RETURN(const GgufTensorInfo* t, Find(hf_name, shape));
    std::vector<int64_t> order;
    if (unpermute_ && hf_name.ends_with("self_attn.q_proj.weight")) {
      order = UnpermutedRows(config_.num_attention_heads);
    } else if (unpermute_ && hf_name.ends_with("self_attn.k_proj.weight")) {
      order = UnpermutedRows(config_.num_key_value_heads);
    }
    absl::StatusOr<kernels::WeightMatrix> w =
        kernels::WeightMatrix::FromGgml(t->type, t->data, shape[0], shape[1], order);
    if (!w.ok()) return Named(hf_name, w.status());
    return w;
  }

 private:
  // The tensor of `hf_name`, checked to have `shape`.
  absl::StatusOr<const GgufTensorInfo*> Find(const std::string& hf_name,
                                             const std::vector<int64_t>& shape) const {
    const std::string name = GgufTensorName(hf_name, config_.sandwich_norms);
    absl::StatusOr<const GgufTensorInfo*> found = file_.FindTensor(name);
    if (!found.ok()) {
      return absl::NotFoundError(absl::StrCat("\"", file_.name(), "\" has no tensor \"", name,
                                              "\" (expected shape ", ShapeString(shape), ")"));
    }
    const GgufTensorInfo& t = **found;
    const std::vector<int64_t> row_major(t.dims.rbegin(), t.dims.rend());
    if (row_major != shape) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor \"", name, "\" in \"", file_.name(), "\" has shape ",
                       ShapeString(row_major), " (GGUF dims ", ShapeString(t.dims), "), expected ",
                       ShapeString(shape), " from the file's metadata"));
    }
    return &t;
  }

  absl::Status Named(const std::string& hf_name, const absl::Status& s) const {
    return absl::Status(s.code(),
                        absl::StrCat("tensor \"", GgufTensorName(hf_name, config_.sandwich_norms),
                                     "\" in \"", file_.name(), "\": ", s.message()));
  }

  // For each of `heads` heads, Hugging Face's row h * d + part * d / 2 + i is the file's row
  // h * d + 2 i + part (ggml's interleaved pairs).
  std::vector<int64_t> UnpermutedRows(int32_t heads) const {
    const int64_t d = config_.head_dim;
    const int64_t half = d / 2;
    std::vector<int64_t> order(static_cast<size_t>(heads * d));
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t i = 0; i < half; ++i) {
        for (int64_t part = 0; part < 2; ++part) {
          order[static_cast<size_t>(h * d + part * half + i)] = h * d + 2 * i + part;
        }
      }
    }
    return order;
  }

  const GgufFile& file_;
  const LlamaConfig& config_;
  const bool unpermute_;
};

// Adds `offset` to every norm weight: Gemma's x_normed * (1 + w) is then RmsNorm's
// x_normed * w' (1 + w rounds the same in fp32 as transformers' 1.0 + weight.float()).
void AddNormOffset(float offset, LlamaWeights* w) {
  for (LlamaWeights::Layer& l : w->layers) {
    for (std::vector<float>* norm : {&l.input_norm, &l.post_norm, &l.q_norm, &l.k_norm,
                                     &l.attn_output_norm, &l.mlp_output_norm}) {
      for (float& v : *norm) v += offset;
    }
  }
  for (float& v : w->final_norm) v += offset;
}

// GELU with the tanh approximation (PyTorch's gelu(approximate="tanh"), in fp32).
float GeluTanh(float x) {
  constexpr float kBeta = static_cast<float>(0.7978845608028654);  // sqrt(2 / pi)
  constexpr float kKappa = 0.044715f;
  const float inner = kBeta * (x + kKappa * x * x * x);
  return 0.5f * x * (1.0f + std::tanh(inner));
}

absl::StatusOr<DType> KernelDType(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
    case DType::kFloat16:
    case DType::kBFloat16:
      return dtype;
    default:
      return absl::UnimplementedError(absl::StrCat("KV pool dtype ", std::string(DTypeName(dtype)),
                                                   " has no CPU kernel (fp32, fp16, bf16 do)"));
  }
}

// HF's rope inverse frequencies, 1 / theta^(2i / head_dim), with `s` applied
// (transformers' _compute_linear_scaling_rope_parameters and _compute_llama3_parameters).
std::vector<double> InverseFrequencies(int32_t head_dim, double theta, const RopeScaling& s) {
  const int32_t half = head_dim / 2;
  std::vector<double> inv_freq(static_cast<size_t>(half));
  for (int32_t i = 0; i < half; ++i) {
    inv_freq[static_cast<size_t>(i)] = 1.0 / std::pow(theta, static_cast<double>(2 * i) / head_dim);
  }
  if (s.type == RopeScaling::Type::kLinear) {
    for (double& f : inv_freq) f /= s.factor;
  } else if (s.type == RopeScaling::Type::kLlama3) {
    const double old_len = s.original_max_position_embeddings;
    const double low_freq_wavelen = old_len / s.low_freq_factor;
    const double high_freq_wavelen = old_len / s.high_freq_factor;
    for (double& f : inv_freq) {
      const double wavelen = 2 * std::numbers::pi / f;
      if (wavelen > low_freq_wavelen) {
        f /= s.factor;  // low frequencies: interpolated
      } else if (wavelen >= high_freq_wavelen) {
        const double smooth =
            (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
        f = (1 - smooth) * f / s.factor + smooth * f;
      }  // high frequencies: unchanged
    }
  }
  return inv_freq;
}

}  // namespace

LlamaModel::LlamaModel(LlamaConfig config, int32_t num_threads, kernels::MatMulPath matmul)
    : config_(std::move(config)), matmul_(matmul) {
  // A config built by hand may leave the windows out: full attention everywhere.
  config_.layer_windows.resize(static_cast<size_t>(config_.num_hidden_layers), 0);
  const int32_t available = kernels::CpuThreadPool::Default().max_threads();
  num_threads_ = num_threads <= 0 ? available : std::min(num_threads, available);
}

void LlamaModel::ParallelChunks(int64_t n, int64_t min_chunk,
                                absl::FunctionRef<void(int64_t, int64_t)> fn) const {
  if (n <= 0) return;
  min_chunk = std::max<int64_t>(1, min_chunk);
  // Four chunks per thread: a thread slowed by the machine does not hold up the others.
  const int64_t num_chunks =
      std::min<int64_t>((n + min_chunk - 1) / min_chunk, int64_t{num_threads_} * 4);
  if (num_chunks <= 1) {
    fn(0, n);
    return;
  }
  kernels::CpuThreadPool::Default().ParallelFor(num_chunks, num_threads_, [&](int64_t chunk) {
    fn(chunk * n / num_chunks, (chunk + 1) * n / num_chunks);
  });
}

LlamaModel::~LlamaModel() = default;

int64_t LlamaWeights::matrix_bytes() const {
  int64_t bytes = embed_tokens.bytes() + lm_head.bytes();
  for (const Layer& l : layers) {
    for (const kernels::WeightMatrix* m :
         {&l.q_proj, &l.k_proj, &l.v_proj, &l.o_proj, &l.gate_proj, &l.up_proj, &l.down_proj}) {
      bytes += m->bytes();
    }
  }
  return bytes;
}

bool IsGgufFile(const std::string& path) {
  std::error_code error;
  if (!std::filesystem::is_regular_file(path, error)) return false;
  std::ifstream in(path, std::ios::binary);
  char magic[4] = {};
  in.read(magic, sizeof(magic));
  return in.gcount() == 4 && std::memcmp(magic, "GGUF", 4) == 0;
}

absl::StatusOr<std::unique_ptr<LlamaModel>> LlamaModel::Load(const std::string& path,
                                                             const LlamaModelOptions& options) {
  if (IsGgufFile(path)) {
    KVCM_ASSIGN_OR_RETURN(const std::unique_ptr<GgufFile> file, GgufFile::Open(path));
    KVCM_ASSIGN_OR_RETURN(LlamaConfig config, LlamaConfigFromGguf(*file));
    KVCM_ASSIGN_OR_RETURN(const std::string arch, file->GetString("general.architecture"));
    const Architecture* family = FindGgufArchitecture(arch);  // LlamaConfigFromGguf found it
    const LlamaConfig& c = config;
    return LoadWeights(std::move(config),
                       GgufSource(*file, c, /*unpermute=*/family->gguf_interleaved_rope), options);
  }
  KVCM_ASSIGN_OR_RETURN(LlamaConfig config, LoadLlamaConfig(path + "/config.json"));
  KVCM_ASSIGN_OR_RETURN(const std::unique_ptr<SafetensorsFolder> shards,
                        SafetensorsFolder::Open(path));
  if (!config.tie_word_embeddings && !shards->Find("lm_head.weight").first) {
    return absl::NotFoundError(absl::StrCat("model folder \"", path,
                                            "\" has no tensor \"lm_head.weight\" (expected shape [",
                                            config.vocab_size, ", ", config.hidden_size,
                                            "]) and config.json does not set tie_word_embeddings"));
  }
  return LoadWeights(std::move(config), SafetensorsSource(*shards, path), options);
}

absl::StatusOr<std::unique_ptr<LlamaModel>> LlamaModel::LoadWeights(
    LlamaConfig config, const WeightSource& source, const LlamaModelOptions& options) {
  auto model = std::unique_ptr<LlamaModel>(
      new LlamaModel(std::move(config), options.num_threads, options.matmul));
  const LlamaConfig& c = model->config_;
  const int64_t h = c.hidden_size;
  const int64_t q = int64_t{c.num_attention_heads} * c.head_dim;
  const int64_t kv = int64_t{c.num_key_value_heads} * c.head_dim;
  const int64_t inter = c.intermediate_size;
  const int64_t vocab = c.vocab_size;
  auto load = [&](const std::string& name, std::vector<int64_t> shape,
                  std::vector<float>* out) -> absl::Status {
    KVCM_ASSIGN_OR_RETURN(*out, source.Load(name, shape));
    return absl::OkStatus();
  };
  auto load_matrix = [&](const std::string& name, std::vector<int64_t> shape,
                         kernels::WeightMatrix* out) -> absl::Status {
    KVCM_ASSIGN_OR_RETURN(*out, source.LoadMatrix(name, shape));
    return absl::OkStatus();
  };

  KVCM_RETURN_IF_ERROR(
      load_matrix("model.embed_tokens.weight", {vocab, h}, &model->weights_.embed_tokens));
  model->weights_.layers.resize(static_cast<size_t>(c.num_hidden_layers));
  for (int32_t l = 0; l < c.num_hidden_layers; ++l) {
    LlamaWeights::Layer& layer = model->weights_.layers[static_cast<size_t>(l)];
    const std::string p = absl::StrCat("model.layers.", l, ".");
    KVCM_RETURN_IF_ERROR(load(p + "input_layernorm.weight", {h}, &layer.input_norm));
    KVCM_RETURN_IF_ERROR(load_matrix(p + "self_attn.q_proj.weight", {q, h}, &layer.q_proj));
    KVCM_RETURN_IF_ERROR(load_matrix(p + "self_attn.k_proj.weight", {kv, h}, &layer.k_proj));
    KVCM_RETURN_IF_ERROR(load_matrix(p + "self_attn.v_proj.weight", {kv, h}, &layer.v_proj));
    KVCM_RETURN_IF_ERROR(load_matrix(p + "self_attn.o_proj.weight", {h, q}, &layer.o_proj));
    if (c.sandwich_norms) {
      KVCM_RETURN_IF_ERROR(load(p + "pre_feedforward_layernorm.weight", {h}, &layer.post_norm));
      KVCM_RETURN_IF_ERROR(
          load(p + "post_attention_layernorm.weight", {h}, &layer.attn_output_norm));
      KVCM_RETURN_IF_ERROR(
          load(p + "post_feedforward_layernorm.weight", {h}, &layer.mlp_output_norm));
    } else {
      KVCM_RETURN_IF_ERROR(load(p + "post_attention_layernorm.weight", {h}, &layer.post_norm));
    }
    KVCM_RETURN_IF_ERROR(load_matrix(p + "mlp.gate_proj.weight", {inter, h}, &layer.gate_proj));
    KVCM_RETURN_IF_ERROR(load_matrix(p + "mlp.up_proj.weight", {inter, h}, &layer.up_proj));
    KVCM_RETURN_IF_ERROR(load_matrix(p + "mlp.down_proj.weight", {h, inter}, &layer.down_proj));
    if (c.qkv_bias) {
      KVCM_RETURN_IF_ERROR(load(p + "self_attn.q_proj.bias", {q}, &layer.q_bias));
      KVCM_RETURN_IF_ERROR(load(p + "self_attn.k_proj.bias", {kv}, &layer.k_bias));
      KVCM_RETURN_IF_ERROR(load(p + "self_attn.v_proj.bias", {kv}, &layer.v_bias));
    }
    if (c.o_bias) KVCM_RETURN_IF_ERROR(load(p + "self_attn.o_proj.bias", {h}, &layer.o_bias));
    if (c.qk_norm) {
      const int64_t d = c.head_dim;
      KVCM_RETURN_IF_ERROR(load(p + "self_attn.q_norm.weight", {d}, &layer.q_norm));
      KVCM_RETURN_IF_ERROR(load(p + "self_attn.k_norm.weight", {d}, &layer.k_norm));
    }
  }
  KVCM_RETURN_IF_ERROR(load("model.norm.weight", {h}, &model->weights_.final_norm));
  if (c.norm_weight_offset != 0.0f) AddNormOffset(c.norm_weight_offset, &model->weights_);
  if (!c.tie_word_embeddings) {
    KVCM_RETURN_IF_ERROR(load_matrix("lm_head.weight", {vocab, h}, &model->weights_.lm_head));
  }
  model->inv_freq_ = InverseFrequencies(c.head_dim, c.rope_theta, c.rope_scaling);
  if (c.local_rope) {
    model->local_inv_freq_ =
        InverseFrequencies(c.head_dim, c.local_rope_theta, c.local_rope_scaling);
  }
  return model;
}

void LlamaModel::MatMul(const float* x, int64_t rows, int64_t in, const kernels::WeightMatrix& w,
                        int64_t out, float* y) const {
  KVCM_CHECK(w.rows() == out && w.cols() == in)
      << w.rows() << "x" << w.cols() << " != " << out << "x" << in;
  if (matmul_ != kernels::MatMulPath::kFp32) {
    kernels::MatMulInt8(x, rows, w, y, num_threads_, matmul_ == kernels::MatMulPath::kInt8x2);
  } else {
    kernels::MatMul(x, rows, w, y, num_threads_);
  }
}

void LlamaModel::MatMuls(const float* x, int64_t rows, int64_t in,
                         std::initializer_list<kernels::MatMulOutput> outputs) const {
  for (const kernels::MatMulOutput& o : outputs) {
    KVCM_CHECK(o.w->cols() == in) << o.w->cols() << " != " << in;
  }
  if (matmul_ != kernels::MatMulPath::kFp32) {
    kernels::MatMulInt8(x, rows,
                        std::span<const kernels::MatMulOutput>(outputs.begin(), outputs.size()),
                        num_threads_, matmul_ == kernels::MatMulPath::kInt8x2);
    return;
  }
  for (const kernels::MatMulOutput& o : outputs) kernels::MatMul(x, rows, *o.w, o.y, num_threads_);
}

void LlamaModel::RmsNorm(const float* x, int64_t rows, const std::vector<float>& weight,
                         float* out) const {
  const int64_t h = config_.hidden_size;
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * h;
    double sum_sq = 0;
    for (int64_t i = 0; i < h; ++i) sum_sq += static_cast<double>(xr[i]) * xr[i];
    const float inv_rms =
        static_cast<float>(1.0 / std::sqrt(sum_sq / static_cast<double>(h) + config_.rms_norm_eps));
    for (int64_t i = 0; i < h; ++i)
      out[r * h + i] = weight[static_cast<size_t>(i)] * (xr[i] * inv_rms);
  }
}

void LlamaModel::HeadNorm(float* x, int64_t rows, int32_t heads,
                          const std::vector<float>& weight) const {
  if (weight.empty()) return;
  // Each head alone, in a fixed order: the same row gives the same bits in any batch.
  const int64_t d = config_.head_dim;
  for (int64_t r = 0; r < rows * heads; ++r) {
    float* xr = x + r * d;
    double sum_sq = 0;
    for (int64_t i = 0; i < d; ++i) sum_sq += static_cast<double>(xr[i]) * xr[i];
    const float inv_rms =
        static_cast<float>(1.0 / std::sqrt(sum_sq / static_cast<double>(d) + config_.rms_norm_eps));
    for (int64_t i = 0; i < d; ++i) xr[i] = weight[static_cast<size_t>(i)] * (xr[i] * inv_rms);
  }
}

const std::vector<double>& LlamaModel::LayerInvFreq(int32_t l) const {
  if (!local_inv_freq_.empty() && config_.layer_windows[static_cast<size_t>(l)] > 0) {
    return local_inv_freq_;
  }
  return inv_freq_;
}

void LlamaModel::ApplyRope(float* x, int64_t rows, int32_t heads,
                           std::span<const int32_t> positions,
                           const std::vector<double>& inv_freq) const {
  const int32_t d = config_.head_dim;
  const int32_t half = d / 2;
  std::vector<float> cos_table(static_cast<size_t>(half));
  std::vector<float> sin_table(static_cast<size_t>(half));
  for (int64_t r = 0; r < rows; ++r) {
    const double position = positions[static_cast<size_t>(r)];
    for (int32_t i = 0; i < half; ++i) {
      const double angle = position * inv_freq[static_cast<size_t>(i)];
      cos_table[static_cast<size_t>(i)] = static_cast<float>(std::cos(angle));
      sin_table[static_cast<size_t>(i)] = static_cast<float>(std::sin(angle));
    }
    for (int32_t hd = 0; hd < heads; ++hd) {
      float* v = x + (r * heads + hd) * d;
      for (int32_t i = 0; i < half; ++i) {
        // rotate_half: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), x1 = v[i], x2 = v[i + d/2].
        const float x1 = v[i];
        const float x2 = v[i + half];
        const float c = cos_table[static_cast<size_t>(i)];
        const float s = sin_table[static_cast<size_t>(i)];
        v[i] = x1 * c - x2 * s;
        v[i + half] = x2 * c + x1 * s;
      }
    }
  }
}

void LlamaModel::Embed(std::span<const int32_t> tokens, float* x) const {
  const int64_t h = config_.hidden_size;
  for (size_t t = 0; t < tokens.size(); ++t) {
    float* row = x + static_cast<int64_t>(t) * h;
    weights_.embed_tokens.DequantizeRow(tokens[t], row);
    if (config_.embedding_scale != 1.0f) {
      for (int64_t i = 0; i < h; ++i) row[i] *= config_.embedding_scale;
    }
  }
}

void LlamaModel::AttentionInputs(int32_t l, const float* x, int64_t rows,
                                 std::span<const int32_t> positions, float* q, float* k,
                                 float* v) const {
  const LlamaWeights::Layer& layer = weights_.layers[static_cast<size_t>(l)];
  const int64_t h = config_.hidden_size;
  const int64_t q_width = int64_t{config_.num_attention_heads} * config_.head_dim;
  const int64_t kv_width = int64_t{config_.num_key_value_heads} * config_.head_dim;
  std::vector<float> normed(static_cast<size_t>(rows * h));
  RmsNorm(x, rows, layer.input_norm, normed.data());
  KVCM_CHECK(layer.q_proj.rows() == q_width && layer.k_proj.rows() == kv_width &&
             layer.v_proj.rows() == kv_width);
  MatMuls(normed.data(), rows, h, {{&layer.q_proj, q}, {&layer.k_proj, k}, {&layer.v_proj, v}});
  AddBias(q, rows, layer.q_bias);
  AddBias(k, rows, layer.k_bias);
  AddBias(v, rows, layer.v_bias);
  HeadNorm(q, rows, config_.num_attention_heads, layer.q_norm);
  HeadNorm(k, rows, config_.num_key_value_heads, layer.k_norm);
  const std::vector<double>& inv_freq = LayerInvFreq(l);
  ApplyRope(q, rows, config_.num_attention_heads, positions, inv_freq);
  ApplyRope(k, rows, config_.num_key_value_heads, positions, inv_freq);
}

void LlamaModel::Mlp(int32_t l, const float* x, int64_t rows, float* out) const {
  const LlamaWeights::Layer& layer = weights_.layers[static_cast<size_t>(l)];
  const int64_t h = config_.hidden_size;
  const int64_t inter = config_.intermediate_size;
  std::vector<float> gate(static_cast<size_t>(rows * inter));
  std::vector<float> up(static_cast<size_t>(rows * inter));
  KVCM_CHECK(layer.gate_proj.rows() == inter && layer.up_proj.rows() == inter);
  MatMuls(x, rows, h, {{&layer.gate_proj, gate.data()}, {&layer.up_proj, up.data()}});
  if (config_.activation == LlamaConfig::Activation::kGeluTanh) {
    for (size_t i = 0; i < gate.size(); ++i) gate[i] = GeluTanh(gate[i]) * up[i];
  } else {
    for (size_t i = 0; i < gate.size(); ++i) {
      const float g = gate[i];
      gate[i] = g / (1.0f + std::exp(-g)) * up[i];  // SiLU(gate) * up
    }
  }
  MatMul(gate.data(), rows, inter, layer.down_proj, h, out);
}

void LlamaModel::AttentionOutputAndMlp(int32_t l, const float* attn, int64_t rows, float* x) const {
  const LlamaWeights::Layer& layer = weights_.layers[static_cast<size_t>(l)];
  const int64_t h = config_.hidden_size;
  const int64_t q_width = int64_t{config_.num_attention_heads} * config_.head_dim;
  std::vector<float> proj(static_cast<size_t>(rows * h));
  std::vector<float> normed(static_cast<size_t>(rows * h));
  MatMul(attn, rows, q_width, layer.o_proj, h, proj.data());
  AddBias(proj.data(), rows, layer.o_bias);
  // Gemma normalizes each sublayer's output before its residual add (sandwich norms).
  const bool sandwich = config_.sandwich_norms;
  if (sandwich) RmsNorm(proj.data(), rows, layer.attn_output_norm, proj.data());
  for (int64_t i = 0; i < rows * h; ++i) x[i] += proj[static_cast<size_t>(i)];

  RmsNorm(x, rows, layer.post_norm, normed.data());
  Mlp(l, normed.data(), rows, proj.data());
  if (sandwich) RmsNorm(proj.data(), rows, layer.mlp_output_norm, proj.data());
  for (int64_t i = 0; i < rows * h; ++i) x[i] += proj[static_cast<size_t>(i)];
}

void LlamaModel::Logits(const float* x, std::span<const int64_t> rows,
                        std::vector<float>* logits) const {
  const int64_t h = config_.hidden_size;
  std::vector<float> picked(rows.size() * static_cast<size_t>(h));
  for (size_t i = 0; i < rows.size(); ++i) {
    std::memcpy(picked.data() + static_cast<int64_t>(i) * h, x + rows[i] * h,
                static_cast<size_t>(h) * sizeof(float));
  }
  std::vector<float> normed(picked.size());
  RmsNorm(picked.data(), static_cast<int64_t>(rows.size()), weights_.final_norm, normed.data());
  logits->assign(rows.size() * static_cast<size_t>(config_.vocab_size), 0.0f);
  MatMul(normed.data(), static_cast<int64_t>(rows.size()), h, weights_.head(), config_.vocab_size,
         logits->data());
}

absl::Status LlamaModel::CheckPool(const PoolView& pool) const {
  if (pool.base == nullptr) return absl::InvalidArgumentError("KV pool: base is null");
  const KvCacheSpec& spec = pool.spec;
  if (absl::Status s = spec.Validate(); !s.ok()) {
    return absl::FailedPreconditionError(absl::StrCat("KV pool: ", s.message()));
  }
  if (absl::Status s = pool.layout.Validate(spec); !s.ok()) {
    return absl::FailedPreconditionError(absl::StrCat("KV pool: ", s.message()));
  }
  // With KV cache groups the pool's layers are a page's slots, which the groups decide.
  KVCM_RETURN_IF_ERROR(CheckPoolGroups(pool, config_.layer_windows));
  const int32_t model_layers =
      pool.kv_groups.empty() ? config_.num_hidden_layers : pool.spec.num_layers;
  const struct {
    const char* name;
    int32_t pool_value;
    int32_t model_value;
  } fields[] = {{"num_layers", spec.num_layers, model_layers},
                {"num_kv_heads", spec.num_kv_heads, config_.num_key_value_heads},
                {"head_dim", spec.head_dim, config_.head_dim}};
  for (const auto& f : fields) {
    if (f.pool_value != f.model_value) {
      return absl::FailedPreconditionError(
          absl::StrCat("KV pool spec (", spec.ToString(), ") does not fit the model: ", f.name,
                       " is ", f.pool_value, " in the pool but ", f.model_value, " in the model"));
    }
  }
  KVCM_RETURN_IF_ERROR(CheckWindowReads(pool.sliding_window_tokens, config_.layer_windows));
  return KernelDType(spec.dtype).status();
}

int32_t LlamaModel::ReadableFrom(int32_t first_query) const {
  const auto [least, most] =
      std::minmax_element(config_.layer_windows.begin(), config_.layer_windows.end());
  if (least == config_.layer_windows.end() || *least == 0) return 0;
  return std::max(0, first_query - *most + 1);
}

namespace {

// KV cache group g's dense tables in `b` ([num_seqs][max_blocks_per_seq]): block_tables for
// group 0, its part of group_block_tables for the others.
const int32_t* TableOf(const ForwardBatch& b, int32_t g) {
  if (g == 0) return b.block_tables.data();
  const size_t table_entries = b.query_lens.size() * static_cast<size_t>(b.max_blocks_per_seq);
  return b.group_block_tables.data() + static_cast<size_t>(g - 1) * table_entries;
}

std::string TableName(int32_t g) {
  return g == 0 ? std::string("block_tables")
                : absl::StrCat("group_block_tables (KV cache group ", g, ")");
}

// No slot written twice: two sequences (or two KV cache groups: their layers share a page's
// slot numbers) writing one block is a ledger bug that would silently corrupt both.
// REQUIRES: the tables' entries that are written were checked to be blocks of the pool.
absl::Status CheckNoSlotWrittenTwice(const ForwardBatch& b, int32_t num_tables,
                                     int32_t block_size) {
  absl::flat_hash_map<int64_t, size_t> writer;
  for (int32_t g = 0; g < num_tables; ++g) {
    for (size_t i = 0; i < b.query_lens.size(); ++i) {
      const int32_t* table = TableOf(b, g) + i * static_cast<size_t>(b.max_blocks_per_seq);
      for (int32_t p = b.context_lens[i] - b.query_lens[i]; p < b.context_lens[i]; ++p) {
        const int64_t block = table[p / block_size];
        const int64_t slot = block * block_size + p % block_size;
        const auto [it, inserted] = writer.emplace(slot, i);
        if (!inserted) {
          return absl::InvalidArgumentError(absl::StrCat(
              "forward batch: slot ", slot, " (block ", block, ", offset ", p % block_size,
              ") is written by both sequence ", it->second, " and sequence ", i,
              num_tables > 1 ? " (KV cache groups' tables together)" : ""));
        }
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status LlamaModel::CheckBatch(const ForwardBatch& b, const PoolView& pool) const {
  auto invalid = [](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat("forward batch: ", parts...));
  };
  const size_t num_seqs = b.query_lens.size();
  if (num_seqs == 0) return invalid("no sequences (query_lens is empty)");
  if (b.context_lens.size() != num_seqs) {
    return invalid("context_lens has ", b.context_lens.size(), " entries, query_lens ", num_seqs);
  }
  if (b.max_blocks_per_seq <= 0) {
    return invalid("max_blocks_per_seq must be positive, got ", b.max_blocks_per_seq);
  }
  if (b.block_tables.size() != num_seqs * static_cast<size_t>(b.max_blocks_per_seq)) {
    return invalid("block_tables has ", b.block_tables.size(), " entries, expected num_seqs (",
                   num_seqs, ") x max_blocks_per_seq (", b.max_blocks_per_seq, ")");
  }
  // One dense table per KV cache group (one without groups); group 0's is block_tables.
  const int32_t num_tables = NumBlockTables(pool);
  const size_t table_entries = num_seqs * static_cast<size_t>(b.max_blocks_per_seq);
  if (b.group_block_tables.size() != static_cast<size_t>(num_tables - 1) * table_entries) {
    return invalid("group_block_tables has ", b.group_block_tables.size(),
                   " entries, expected (KV cache groups (", num_tables, ") - 1) x num_seqs (",
                   num_seqs, ") x max_blocks_per_seq (", b.max_blocks_per_seq, ")");
  }
  const int32_t block_size = pool.spec.block_size;
  int64_t total_new = 0;
  for (size_t i = 0; i < num_seqs; ++i) {
    const int32_t q = b.query_lens[i];
    const int32_t ctx = b.context_lens[i];
    if (q < 1) return invalid("query_lens[", i, "] must be at least 1, got ", q);
    if (ctx < q) {
      return invalid("context_lens[", i, "] (", ctx, ") is less than query_lens[", i, "] (", q,
                     ")");
    }
    if (ctx > config_.max_position_embeddings) {
      return invalid("context_lens[", i, "] (", ctx, ") exceeds max_position_embeddings (",
                     config_.max_position_embeddings, ")");
    }
    const int64_t blocks_needed = (int64_t{ctx} + block_size - 1) / block_size;
    if (blocks_needed > b.max_blocks_per_seq) {
      return invalid("sequence ", i, " needs ", blocks_needed, " blocks for ", ctx,
                     " tokens of block size ", block_size, " but max_blocks_per_seq is ",
                     b.max_blocks_per_seq);
    }
    for (int32_t g = 0; g < num_tables; ++g) {
      // Blocks wholly behind every window of the table's layers may be released (-1): none
      // is read.
      const int64_t released =
          pool.kv_groups.empty()
              ? ReadableFrom(ctx - q) / block_size
              : ReleasedBlocks(pool.kv_groups[static_cast<size_t>(g)].window, ctx - q, block_size);
      const int32_t* table = TableOf(b, g) + i * static_cast<size_t>(b.max_blocks_per_seq);
      for (int64_t j = 0; j < blocks_needed; ++j) {
        const int32_t block = table[j];
        if (j < released && block == -1) continue;
        if (block < 0 || block >= pool.layout.num_blocks) {
          return invalid(TableName(g), "[", i, "][", j, "] = ", block, " is outside [0, ",
                         pool.layout.num_blocks, ")");
        }
      }
    }
    total_new += q;
  }
  if (static_cast<int64_t>(b.token_ids.size()) != total_new) {
    return invalid("token_ids has ", b.token_ids.size(), " entries but query_lens sum to ",
                   total_new);
  }
  if (!b.all_logits.empty() && b.all_logits.size() != num_seqs) {
    return invalid("all_logits has ", b.all_logits.size(), " entries for ", num_seqs, " sequences");
  }
  for (size_t t = 0; t < b.token_ids.size(); ++t) {
    if (b.token_ids[t] < 0 || b.token_ids[t] >= config_.vocab_size) {
      return invalid("token_ids[", t, "] = ", b.token_ids[t],
                     " is outside [0, vocab_size=", config_.vocab_size, ")");
    }
  }
  return CheckNoSlotWrittenTwice(b, num_tables, block_size);
}

TokenPlan PlanTokens(const ForwardBatch& batch, int32_t block_size, LogitsScope scope) {
  TokenPlan plan;
  plan.positions.reserve(batch.token_ids.size());
  plan.slots.reserve(batch.token_ids.size());
  int64_t row = 0;
  for (size_t i = 0; i < batch.query_lens.size(); ++i) {
    const int32_t* table =
        batch.block_tables.data() + static_cast<int64_t>(i) * batch.max_blocks_per_seq;
    const int32_t ctx = batch.context_lens[i];
    for (int32_t p = ctx - batch.query_lens[i]; p < ctx; ++p, ++row) {
      plan.positions.push_back(p);
      plan.slots.push_back(int64_t{table[p / block_size]} * block_size + p % block_size);
      if (scope == LogitsScope::kAllTokens || p == ctx - 1 ||
          (!batch.all_logits.empty() && batch.all_logits[i] != 0)) {
        plan.logit_rows.push_back(row);
      }
    }
  }
  return plan;
}

namespace {

// Where the layers of KV cache group g read and write: its dense tables and the slots of
// the batch's new tokens through them. Without groups, one group: the batch's tables and
// the plan's slots. REQUIRES: CheckBatch passed.
struct GroupTables {
  std::vector<const int32_t*> tables;
  std::vector<const int64_t*> slots;
  std::vector<std::vector<int64_t>> own_slots;  // groups 1..'s (group 0's are the plan's)
};

GroupTables TablesOfGroups(const ForwardBatch& batch, const PoolView& pool, const TokenPlan& plan) {
  const int32_t num_tables = NumBlockTables(pool);
  GroupTables groups;
  groups.tables.push_back(batch.block_tables.data());
  groups.slots.push_back(plan.slots.data());
  groups.own_slots.reserve(static_cast<size_t>(num_tables - 1));
  for (int32_t g = 1; g < num_tables; ++g) {
    const int32_t* table = TableOf(batch, g);
    groups.tables.push_back(table);
    groups.own_slots.push_back(WriteSlots(batch.query_lens, batch.context_lens, table,
                                          batch.max_blocks_per_seq, pool.spec.block_size));
    groups.slots.push_back(groups.own_slots.back().data());
  }
  return groups;
}

}  // namespace

absl::Status LlamaModel::Forward(const ForwardBatch& batch, const PoolView& pool,
                                 std::vector<float>* logits, LogitsScope scope,
                                 const std::function<bool(int32_t layer)>* after_layer) const {
  KVCM_CHECK(logits != nullptr);
  if (pool.cuda_device >= 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the KV pool is in the memory of CUDA device ", pool.cuda_device,
        ": the host forward pass cannot reach it (LlamaCudaModel runs on device pools)"));
  }
  KVCM_RETURN_IF_ERROR(CheckPool(pool));
  KVCM_RETURN_IF_ERROR(CheckBatch(batch, pool));
  const LlamaConfig& c = config_;
  const int64_t rows = static_cast<int64_t>(batch.token_ids.size());
  const int32_t num_seqs = static_cast<int32_t>(batch.query_lens.size());

  const TokenPlan plan = PlanTokens(batch, pool.spec.block_size, scope);
  // With KV cache groups a layer reads and writes its group's table, in its slot.
  const std::vector<LayerPlace> places = PlaceLayers(pool, c.num_hidden_layers);
  const GroupTables groups = TablesOfGroups(batch, pool, plan);

  const int64_t h = c.hidden_size;
  const int64_t q_width = int64_t{c.num_attention_heads} * c.head_dim;
  const int64_t kv_width = int64_t{c.num_key_value_heads} * c.head_dim;
  std::vector<float> x(static_cast<size_t>(rows * h));
  std::vector<float> q(static_cast<size_t>(rows * q_width));
  std::vector<float> k(static_cast<size_t>(rows * kv_width));
  std::vector<float> v(static_cast<size_t>(rows * kv_width));
  std::vector<float> attn(static_cast<size_t>(rows * q_width));
  Embed(batch.token_ids, x.data());

  kernels::PagedAttentionBatch attention;
  attention.num_seqs = num_seqs;
  attention.num_q_heads = c.num_attention_heads;
  attention.query_lens = batch.query_lens.data();
  attention.context_lens = batch.context_lens.data();
  attention.block_tables = batch.block_tables.data();
  attention.max_blocks_per_seq = batch.max_blocks_per_seq;
  attention.scale = c.AttentionScale();

  for (int32_t l = 0; l < c.num_hidden_layers; ++l) {
    AttentionInputs(l, x.data(), rows, plan.positions, q.data(), k.data(), v.data());
    const LayerPlace place = places[static_cast<size_t>(l)];
    KVCM_ASSIGN_OR_RETURN(const kernels::PagedKvView view,
                          kernels::LayerView(pool.base, pool.layout, pool.spec, place.pool_layer));
    const size_t group = static_cast<size_t>(place.group);
    kernels::cpu::WriteKv(view, k.data(), v.data(), groups.slots[group],
                          static_cast<int32_t>(rows));
    attention.block_tables = groups.tables[group];
    attention.sliding_window = c.layer_windows[static_cast<size_t>(l)];
    kernels::cpu::PagedAttention(view, attention, q.data(), attn.data(), num_threads_);
    AttentionOutputAndMlp(l, attn.data(), rows, x.data());
    if (after_layer != nullptr && !(*after_layer)(l)) {
      return absl::CancelledError(
          absl::StrCat("stopped after layer ", l, " of ", c.num_hidden_layers));
    }
  }
  Logits(x.data(), plan.logit_rows, logits);
  return absl::OkStatus();
}

absl::StatusOr<std::vector<float>> LlamaModel::ForwardContiguous(
    std::span<const int32_t> tokens) const {
  const LlamaConfig& c = config_;
  if (tokens.empty()) return absl::InvalidArgumentError("ForwardContiguous: no tokens");
  if (static_cast<int64_t>(tokens.size()) > c.max_position_embeddings) {
    return absl::InvalidArgumentError(absl::StrCat("ForwardContiguous: ", tokens.size(),
                                                   " tokens exceed max_position_embeddings (",
                                                   c.max_position_embeddings, ")"));
  }
  for (size_t t = 0; t < tokens.size(); ++t) {
    if (tokens[t] < 0 || tokens[t] >= c.vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("ForwardContiguous: tokens[", t, "] = ", tokens[t],
                       " is outside [0, vocab_size=", c.vocab_size, ")"));
    }
  }
  const int64_t rows = static_cast<int64_t>(tokens.size());
  const int32_t d = c.head_dim;
  const int32_t q_heads = c.num_attention_heads;
  const int32_t kv_heads = c.num_key_value_heads;
  const int32_t group = q_heads / kv_heads;
  const int64_t h = c.hidden_size;
  const int64_t q_width = int64_t{q_heads} * d;
  const int64_t kv_width = int64_t{kv_heads} * d;
  std::vector<int32_t> positions(static_cast<size_t>(rows));
  for (int64_t i = 0; i < rows; ++i) positions[static_cast<size_t>(i)] = static_cast<int32_t>(i);

  std::vector<float> x(static_cast<size_t>(rows * h));
  std::vector<float> q(static_cast<size_t>(rows * q_width));
  std::vector<float> k(static_cast<size_t>(rows * kv_width));  // the contiguous KV cache
  std::vector<float> v(static_cast<size_t>(rows * kv_width));
  std::vector<float> attn(static_cast<size_t>(rows * q_width));
  Embed(tokens, x.data());
  const float scale = c.AttentionScale();

  for (int32_t l = 0; l < c.num_hidden_layers; ++l) {
    AttentionInputs(l, x.data(), rows, positions, q.data(), k.data(), v.data());
    const int64_t window = c.layer_windows[static_cast<size_t>(l)];
    // Causal attention, one (position, head) per task: softmax(q . k_j * scale) over j <= t
    // (and j > t - window with a sliding window).
    ParallelChunks(rows * q_heads, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores(static_cast<size_t>(rows));
      for (int64_t task = begin; task < end; ++task) {
        const int64_t t = task / q_heads;
        const int32_t head = static_cast<int32_t>(task % q_heads);
        const int32_t kv_head = head / group;
        const float* qv = q.data() + (t * q_heads + head) * d;
        const int64_t first = window > 0 ? std::max<int64_t>(0, t - window + 1) : 0;
        float max_score = -INFINITY;
        for (int64_t j = first; j <= t; ++j) {
          const float s = Dot(qv, k.data() + (j * kv_heads + kv_head) * d, d) * scale;
          scores[static_cast<size_t>(j)] = s;
          max_score = std::max(max_score, s);
        }
        float denom = 0;
        for (int64_t j = first; j <= t; ++j) {
          scores[static_cast<size_t>(j)] = std::exp(scores[static_cast<size_t>(j)] - max_score);
          denom += scores[static_cast<size_t>(j)];
        }
        float* out = attn.data() + (t * q_heads + head) * d;
        std::fill(out, out + d, 0.0f);
        for (int64_t j = first; j <= t; ++j) {
          const float p = scores[static_cast<size_t>(j)] / denom;
          const float* vv = v.data() + (j * kv_heads + kv_head) * d;
          for (int32_t e = 0; e < d; ++e) out[e] += p * vv[e];
        }
      }
    });
    AttentionOutputAndMlp(l, attn.data(), rows, x.data());
  }
  std::vector<int64_t> all_rows(static_cast<size_t>(rows));
  for (int64_t i = 0; i < rows; ++i) all_rows[static_cast<size_t>(i)] = i;
  std::vector<float> logits;
  Logits(x.data(), all_rows, &logits);
  return logits;
}

}  // namespace kvcm::executor
