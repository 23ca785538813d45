// LlamaCudaModel (llama_model_cuda.h): host side. Checks and plans on the host with the
// CPU model's own code (CheckPool, CheckBatch, PlanTokens), then runs the layers with the
// kernels of kernels/ (WriteKv, PagedAttention, CopyBlocks) and of
// llama_model_cuda_kernels.h on one stream. Compiled only when KVCM_CUDA_ENABLED
// (llama_model_cuda_stub.cc otherwise).

#include "services/executor/llama_model_cuda.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <mutex>
#include <string>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/base/check.h"
#include "common/base/status_macros.h"
#include "common/memory/pool_memory.h"
#include "kernels/paged_attention.h"
#include "kernels/paged_kv.h"
#include "kernels/write_kv.h"
#include "services/executor/llama_model_cuda_kernels.h"

namespace kvcm {
namespace {

// OK, or the failed call with CUDA's name and text for the error (also cleared, so that a
// later call does not report it again). Allocation failures are RESOURCE_EXHAUSTED.
absl::Status CudaStatus(cudaError_t error, std::string_view what) {
  if (error == cudaSuccess) return absl::OkStatus();
  cudaGetLastError();
  std::string text = absl::StrCat(std::string(what), ": ", cudaGetErrorName(error), " (",
                                  cudaGetErrorString(error), ")");
  if (error == cudaErrorMemoryAllocation) return absl::ResourceExhaustedError(std::move(text));
  return absl::InternalError(std::move(text));
}

#define KVCM_RETURN_IF_CUDA_ERROR(expr) KVCM_RETURN_IF_ERROR(CudaStatus((expr), #expr))

// Offsets of the pieces of one device allocation, each 256-byte aligned (what cudaMalloc
// gives, enough for any vector load).
class Carver {
 public:
  // The offset of `count` elements of T; the total grows past them.
  template <typename T>
  uint64_t Take(int64_t count) {
    const uint64_t offset = total_;
    total_ += (static_cast<uint64_t>(std::max<int64_t>(count, 0)) * sizeof(T) + 255) / 256 * 256;
    return offset;
  }
  uint64_t total() const { return std::max<uint64_t>(total_, 256); }

 private:
  uint64_t total_ = 0;
};

// A stream-ordered device allocation, freed (in stream order) when it goes out of scope.
class StreamBuffer {
 public:
  explicit StreamBuffer(cudaStream_t stream) : stream_(stream) {}
  StreamBuffer(const StreamBuffer&) = delete;
  StreamBuffer& operator=(const StreamBuffer&) = delete;
  ~StreamBuffer() {
    if (base_ != nullptr) cudaFreeAsync(base_, stream_);
  }
  absl::Status Allocate(uint64_t bytes) {
    void* base = nullptr;
    KVCM_RETURN_IF_CUDA_ERROR(cudaMallocAsync(&base, bytes, stream_));
    base_ = static_cast<uint8_t*>(base);
    return absl::OkStatus();
  }
  template <typename T>
  T* At(uint64_t offset) const {
    return reinterpret_cast<T*>(base_ + offset);
  }

 private:
  const cudaStream_t stream_;
  uint8_t* base_ = nullptr;
};

// Weights as device pointers into one allocation.
struct DeviceLayer {
  const float* input_norm = nullptr;
  const float* q_proj = nullptr;
  const float* k_proj = nullptr;
  const float* v_proj = nullptr;
  const float* o_proj = nullptr;
  const float* post_norm = nullptr;
  const float* gate_proj = nullptr;
  const float* up_proj = nullptr;
  const float* down_proj = nullptr;
};

}  // namespace

class LlamaCudaModel::Impl {
 public:
  Impl(const LlamaModel& model, int32_t device) : model_(model), device_(device) {}
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;
  ~Impl() {
    cudaSetDevice(device_);
    if (stream_ != nullptr) {
      cudaStreamSynchronize(stream_);
      cudaStreamDestroy(stream_);
    }
    // Fails harmlessly (cudaErrorCudartUnloading) when destroyed during process exit.
    if (weights_ != nullptr) cudaFree(weights_);
  }

  absl::Status Upload();
  absl::Status Forward(const ForwardBatch& batch, const PagedPool& pool,
                       std::vector<float>* logits, LogitsScope scope);
  absl::Status CopyBlocks(const PagedPool& pool, std::span<const kernels::BlockCopy> copies);

  int32_t device() const { return device_; }
  uint64_t weight_bytes() const { return weight_bytes_; }

 private:
  absl::Status CheckDevicePool(const PagedPool& pool) const;

  const LlamaModel& model_;
  const int32_t device_;
  std::mutex mu_;  // one call at a time on the stream
  cudaStream_t stream_ = nullptr;
  uint8_t* weights_ = nullptr;
  uint64_t weight_bytes_ = 0;
  const float* embed_tokens_ = nullptr;
  const float* final_norm_ = nullptr;
  const float* head_ = nullptr;
  const double* inv_freq_ = nullptr;
  std::vector<DeviceLayer> layers_;
};

absl::Status LlamaCudaModel::Impl::Upload() {
  const LlamaWeights& w = model_.weights();
  const std::vector<double>& inv_freq = model_.inv_freq();
  // Every host tensor and where it goes; matrices are dequantized to fp32 one at a time as
  // they are copied (the device kernels read fp32).
  struct Piece {
    const void* host;
    const kernels::WeightMatrix* matrix;  // instead of host
    uint64_t bytes;
    uint64_t offset;
  };
  std::vector<Piece> pieces;
  Carver carver;
  auto add = [&](const std::vector<float>& tensor) {
    const uint64_t offset = carver.Take<float>(static_cast<int64_t>(tensor.size()));
    pieces.push_back({tensor.data(), nullptr, tensor.size() * sizeof(float), offset});
    return offset;
  };
  auto add_matrix = [&](const kernels::WeightMatrix& m) {
    const int64_t n = m.rows() * m.cols();
    const uint64_t offset = carver.Take<float>(n);
    pieces.push_back({nullptr, &m, static_cast<uint64_t>(n) * sizeof(float), offset});
    return offset;
  };
  const uint64_t embed = add_matrix(w.embed_tokens);
  const uint64_t final_norm = add(w.final_norm);
  const uint64_t head = w.lm_head.empty() ? embed : add_matrix(w.lm_head);
  const uint64_t freq = carver.Take<double>(static_cast<int64_t>(inv_freq.size()));
  pieces.push_back({inv_freq.data(), nullptr, inv_freq.size() * sizeof(double), freq});
  std::vector<std::array<uint64_t, 9>> layer_offsets;
  for (const LlamaWeights::Layer& l : w.layers) {
    layer_offsets.push_back({add(l.input_norm), add_matrix(l.q_proj), add_matrix(l.k_proj),
                             add_matrix(l.v_proj), add_matrix(l.o_proj), add(l.post_norm),
                             add_matrix(l.gate_proj), add_matrix(l.up_proj),
                             add_matrix(l.down_proj)});
  }
  weight_bytes_ = carver.total();

  KVCM_ASSIGN_OR_RETURN(const auto memory, CudaMemoryInfo(device_));  // checks the index too
  if (weight_bytes_ > memory.first) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the model's weights take ", weight_bytes_, " bytes in fp32 but CUDA device ", device_,
        " has ", memory.first, " bytes free"));
  }
  KVCM_RETURN_IF_CUDA_ERROR(cudaSetDevice(device_));
  void* base = nullptr;
  KVCM_RETURN_IF_CUDA_ERROR(cudaMalloc(&base, weight_bytes_));
  weights_ = static_cast<uint8_t*>(base);
  for (const Piece& p : pieces) {
    std::vector<float> dequantized;
    const void* host = p.host;
    if (p.matrix != nullptr) {
      dequantized = p.matrix->Dequantize();
      host = dequantized.data();
    }
    KVCM_RETURN_IF_CUDA_ERROR(
        cudaMemcpy(weights_ + p.offset, host, p.bytes, cudaMemcpyHostToDevice));
  }
  KVCM_RETURN_IF_CUDA_ERROR(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));

  auto at = [&](uint64_t offset) { return reinterpret_cast<const float*>(weights_ + offset); };
  embed_tokens_ = at(embed);
  final_norm_ = at(final_norm);
  head_ = at(head);
  inv_freq_ = reinterpret_cast<const double*>(weights_ + freq);
  for (const auto& o : layer_offsets) {
    layers_.push_back(DeviceLayer{at(o[0]), at(o[1]), at(o[2]), at(o[3]), at(o[4]), at(o[5]),
                                  at(o[6]), at(o[7]), at(o[8])});
  }
  return absl::OkStatus();
}

absl::Status LlamaCudaModel::Impl::CheckDevicePool(const PagedPool& pool) const {
  if (pool.cuda_device != device_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the KV pool is ",
        pool.cuda_device < 0 ? std::string("in host memory")
                             : absl::StrCat("on CUDA device ", pool.cuda_device),
        " but this model runs on CUDA device ", device_));
  }
  return model_.CheckPool(pool);
}

absl::Status LlamaCudaModel::Impl::Forward(const ForwardBatch& batch, const PagedPool& pool,
                                           std::vector<float>* logits, LogitsScope scope) {
  KVCM_CHECK(logits != nullptr);
  KVCM_RETURN_IF_ERROR(CheckDevicePool(pool));
  KVCM_RETURN_IF_ERROR(model_.CheckBatch(batch, pool));
  const LlamaConfig& c = model_.config();
  const TokenPlan plan = PlanTokens(batch, pool.spec.block_size, scope);
  const int64_t rows = static_cast<int64_t>(batch.token_ids.size());
  const int64_t num_seqs = static_cast<int64_t>(batch.query_lens.size());
  const int64_t table_size = static_cast<int64_t>(batch.block_tables.size());
  const int64_t num_logits = static_cast<int64_t>(plan.logit_rows.size());
  const int64_t h = c.hidden_size;
  const int64_t q_width = int64_t{c.num_attention_heads} * c.head_dim;
  const int64_t kv_width = int64_t{c.num_key_value_heads} * c.head_dim;
  const int64_t inter = c.intermediate_size;
  const int64_t vocab = c.vocab_size;

  // One scratch allocation: the batch's integers first (copied up in one go), then the
  // activations.
  Carver carver;
  const uint64_t o_tokens = carver.Take<int32_t>(rows);
  const uint64_t o_positions = carver.Take<int32_t>(rows);
  const uint64_t o_query_lens = carver.Take<int32_t>(num_seqs);
  const uint64_t o_context_lens = carver.Take<int32_t>(num_seqs);
  const uint64_t o_tables = carver.Take<int32_t>(table_size);
  const uint64_t o_slots = carver.Take<int64_t>(rows);
  const uint64_t o_logit_rows = carver.Take<int64_t>(num_logits);
  const uint64_t integer_bytes = carver.total();
  const uint64_t o_x = carver.Take<float>(rows * h);
  const uint64_t o_normed = carver.Take<float>(rows * h);
  const uint64_t o_q = carver.Take<float>(rows * q_width);
  const uint64_t o_k = carver.Take<float>(rows * kv_width);
  const uint64_t o_v = carver.Take<float>(rows * kv_width);
  const uint64_t o_attn = carver.Take<float>(rows * q_width);
  const uint64_t o_proj = carver.Take<float>(rows * h);
  const uint64_t o_gate = carver.Take<float>(rows * inter);
  const uint64_t o_up = carver.Take<float>(rows * inter);
  const uint64_t o_picked = carver.Take<float>(num_logits * h);
  const uint64_t o_picked_normed = carver.Take<float>(num_logits * h);
  const uint64_t o_logits = carver.Take<float>(num_logits * vocab);

  std::vector<uint8_t> staging(integer_bytes, 0);
  auto stage = [&](uint64_t offset, const auto& values) {
    std::memcpy(staging.data() + offset, values.data(),
                values.size() * sizeof(*values.data()));
  };
  stage(o_tokens, batch.token_ids);
  stage(o_positions, plan.positions);
  stage(o_query_lens, batch.query_lens);
  stage(o_context_lens, batch.context_lens);
  stage(o_tables, batch.block_tables);
  stage(o_slots, plan.slots);
  stage(o_logit_rows, plan.logit_rows);

  std::lock_guard<std::mutex> lock(mu_);
  KVCM_RETURN_IF_CUDA_ERROR(cudaSetDevice(device_));
  void* const s = stream_;
  StreamBuffer scratch(stream_);
  KVCM_RETURN_IF_ERROR(scratch.Allocate(carver.total()));
  KVCM_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(scratch.At<uint8_t>(0), staging.data(),
                                            integer_bytes, cudaMemcpyHostToDevice, stream_));
  float* const x = scratch.At<float>(o_x);
  float* const normed = scratch.At<float>(o_normed);
  float* const q = scratch.At<float>(o_q);
  float* const k = scratch.At<float>(o_k);
  float* const v = scratch.At<float>(o_v);
  float* const attn = scratch.At<float>(o_attn);
  float* const proj = scratch.At<float>(o_proj);
  float* const gate = scratch.At<float>(o_gate);
  float* const up = scratch.At<float>(o_up);
  const int32_t* const positions = scratch.At<int32_t>(o_positions);

  kernels::PagedAttentionBatch attention;
  attention.num_seqs = static_cast<int32_t>(num_seqs);
  attention.num_q_heads = c.num_attention_heads;
  attention.query_lens = scratch.At<int32_t>(o_query_lens);
  attention.context_lens = scratch.At<int32_t>(o_context_lens);
  attention.block_tables = scratch.At<int32_t>(o_tables);
  attention.max_blocks_per_seq = batch.max_blocks_per_seq;
  attention.scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  attention.max_query_len = *std::max_element(batch.query_lens.begin(), batch.query_lens.end());

  llama_cuda::Embed(scratch.At<int32_t>(o_tokens), rows, embed_tokens_, h, x, s);
  for (int32_t l = 0; l < c.num_hidden_layers; ++l) {
    const DeviceLayer& layer = layers_[static_cast<size_t>(l)];
    // Attention inputs (LlamaModel::AttentionInputs).
    llama_cuda::RmsNorm(x, rows, h, layer.input_norm, c.rms_norm_eps, normed, s);
    llama_cuda::MatMul(normed, rows, h, layer.q_proj, q_width, q, s);
    llama_cuda::MatMul(normed, rows, h, layer.k_proj, kv_width, k, s);
    llama_cuda::MatMul(normed, rows, h, layer.v_proj, kv_width, v, s);
    llama_cuda::Rope(q, rows, c.num_attention_heads, c.head_dim, positions, inv_freq_, s);
    llama_cuda::Rope(k, rows, c.num_key_value_heads, c.head_dim, positions, inv_freq_, s);
    // The pool.
    KVCM_ASSIGN_OR_RETURN(const kernels::PagedKvView view,
                          kernels::LayerView(pool.base, pool.layout, pool.spec, l));
    kernels::cuda::WriteKv(view, k, v, scratch.At<int64_t>(o_slots), static_cast<int32_t>(rows),
                           s);
    kernels::cuda::PagedAttention(view, attention, q, attn, s);
    // Output projection and MLP (LlamaModel::AttentionOutputAndMlp).
    llama_cuda::MatMul(attn, rows, q_width, layer.o_proj, h, proj, s);
    llama_cuda::Add(x, proj, rows * h, s);
    llama_cuda::RmsNorm(x, rows, h, layer.post_norm, c.rms_norm_eps, normed, s);
    llama_cuda::MatMul(normed, rows, h, layer.gate_proj, inter, gate, s);
    llama_cuda::MatMul(normed, rows, h, layer.up_proj, inter, up, s);
    llama_cuda::SiluMul(gate, up, rows * inter, s);
    llama_cuda::MatMul(gate, rows, inter, layer.down_proj, h, proj, s);
    llama_cuda::Add(x, proj, rows * h, s);
  }
  // Final norm and LM head for the chosen rows (LlamaModel::Logits).
  float* const picked = scratch.At<float>(o_picked);
  float* const picked_normed = scratch.At<float>(o_picked_normed);
  float* const device_logits = scratch.At<float>(o_logits);
  llama_cuda::GatherRows(x, scratch.At<int64_t>(o_logit_rows), num_logits, h, picked, s);
  llama_cuda::RmsNorm(picked, num_logits, h, final_norm_, c.rms_norm_eps, picked_normed, s);
  llama_cuda::MatMul(picked_normed, num_logits, h, head_, vocab, device_logits, s);
  logits->assign(static_cast<size_t>(num_logits * vocab), 0.0f);
  KVCM_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(logits->data(), device_logits,
                                            logits->size() * sizeof(float),
                                            cudaMemcpyDeviceToHost, stream_));
  KVCM_RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(stream_));
  return absl::OkStatus();
}

absl::Status LlamaCudaModel::Impl::CopyBlocks(const PagedPool& pool,
                                              std::span<const kernels::BlockCopy> copies) {
  KVCM_RETURN_IF_ERROR(CheckDevicePool(pool));
  if (copies.empty()) return absl::OkStatus();
  absl::flat_hash_set<int32_t> destinations;
  for (size_t i = 0; i < copies.size(); ++i) {
    for (const int32_t block : {copies[i].src, copies[i].dst}) {
      if (block < 0 || block >= pool.layout.num_blocks) {
        return absl::InvalidArgumentError(absl::StrCat("copies[", i, "]: block ", block,
                                                       " is outside [0, ",
                                                       pool.layout.num_blocks, ")"));
      }
    }
    if (!destinations.insert(copies[i].dst).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("copies[", i, "]: block ", copies[i].dst, " is a destination twice"));
    }
  }
  for (size_t i = 0; i < copies.size(); ++i) {
    if (destinations.contains(copies[i].src)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "copies[", i, "]: block ", copies[i].src, " is both a source and a destination"));
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  KVCM_RETURN_IF_CUDA_ERROR(cudaSetDevice(device_));
  StreamBuffer orders(stream_);
  const uint64_t bytes = copies.size() * sizeof(kernels::BlockCopy);
  KVCM_RETURN_IF_ERROR(orders.Allocate(bytes));
  KVCM_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(orders.At<uint8_t>(0), copies.data(), bytes,
                                            cudaMemcpyHostToDevice, stream_));
  kernels::cuda::CopyBlocks(pool.base, pool.layout, orders.At<kernels::BlockCopy>(0),
                            static_cast<int32_t>(copies.size()), stream_);
  KVCM_RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(stream_));
  return absl::OkStatus();
}

// ---- LlamaCudaModel ---------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<LlamaCudaModel>> LlamaCudaModel::Create(const LlamaModel& model,
                                                                       int32_t device) {
  KVCM_ASSIGN_OR_RETURN(const int count, CudaDeviceCount());
  if (device < 0 || device >= count) {
    return absl::InvalidArgumentError(
        absl::StrCat("no CUDA device ", device, ": cudaGetDeviceCount reports ", count));
  }
  if (model.config().qkv_bias || model.config().o_bias) {
    return absl::UnimplementedError(absl::StrCat(
        "attention biases (", model.config().architecture,
        ") are not implemented on CUDA yet; run this model on a shm pool"));
  }
  auto impl = std::make_unique<Impl>(model, device);
  KVCM_RETURN_IF_ERROR(impl->Upload());
  return std::unique_ptr<LlamaCudaModel>(new LlamaCudaModel(std::move(impl)));
}

LlamaCudaModel::LlamaCudaModel(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
LlamaCudaModel::~LlamaCudaModel() = default;

int32_t LlamaCudaModel::device() const { return impl_->device(); }
uint64_t LlamaCudaModel::weight_bytes() const { return impl_->weight_bytes(); }

absl::Status LlamaCudaModel::Forward(const ForwardBatch& batch, const PagedPool& pool,
                                     std::vector<float>* logits, LogitsScope scope) const {
  return impl_->Forward(batch, pool, logits, scope);
}

absl::Status LlamaCudaModel::CopyBlocks(const PagedPool& pool,
                                        std::span<const kernels::BlockCopy> copies) const {
  return impl_->CopyBlocks(pool, copies);
}

}  // namespace kvcm
