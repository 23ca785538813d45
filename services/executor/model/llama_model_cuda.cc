// LlamaCudaModel (llama_model_cuda.h): host side. Checks and plans on the host with the
// CPU model's own code (CheckPool, CheckBatch, PlanTokens), then runs the layers with the
// kernels of kernels/ (WriteKv, PagedAttention, CopyBlocks), of llama_model_cuda_kernels.h
// and, for 16-bit weights, cuBLAS's cublasGemmEx, all on one stream. Compiled only when
// KVCM_CUDA_ENABLED (llama_model_cuda_stub.cc otherwise).

#include "services/executor/model/llama_model_cuda.h"

#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/base/check.h"
#include "common/base/float16.h"
#include "common/base/status_macros.h"
#include "common/memory/pool_memory.h"
#include "kernels/paged_attention.h"
#include "kernels/paged_kv.h"
#include "kernels/write_kv.h"
#include "services/executor/model/llama_model_cuda_kernels.h"

namespace kvcm::executor {
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

// cuBLAS, loaded with dlopen the first time a model needs it, never linked: libcublasLt
// carries some 94 KB of static TLS, and a library linked at start puts that on every
// thread's stack, so that civetweb's worker threads (a 100 KB stack, fixed when Debian built
// it) could no longer start and no process with cuBLAS linked served /metrics
// (docs/executor.md, "Where the model runs"). A library opened later gets its TLS allocated on
// demand.
struct CublasApi {
  decltype(&cublasCreate_v2) create = nullptr;
  decltype(&cublasDestroy_v2) destroy = nullptr;
  decltype(&cublasSetStream_v2) set_stream = nullptr;
  decltype(&cublasSetWorkspace_v2) set_workspace = nullptr;
  // The C entry point (the header adds a C++ overload that takes a cudaDataType).
  cublasStatus_t (*gemm_ex)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int,
                            const void*, const void*, cudaDataType, int, const void*, cudaDataType,
                            int, const void*, void*, cudaDataType, int, cublasComputeType_t,
                            cublasGemmAlgo_t) = nullptr;
  decltype(&cublasGetStatusName) status_name = nullptr;
  decltype(&cublasGetStatusString) status_string = nullptr;
};

absl::StatusOr<const CublasApi*> LoadCublas() {
  static const absl::StatusOr<CublasApi>* const loaded = [] {
    const std::string name = absl::StrCat("libcublas.so.", CUBLAS_VER_MAJOR);
    void* library = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (library == nullptr) {
      const char* error = dlerror();
      return new absl::StatusOr<CublasApi>(
          absl::FailedPreconditionError(absl::StrCat("cannot load cuBLAS (", name,
                                                     ", which the bf16 and fp16 weights need; "
                                                     "--cuda-weight-dtype fp32 does without): ",
                                                     error != nullptr ? error : "dlopen failed")));
    }
    CublasApi api;
    std::string missing;
    auto bind = [&](auto& function, const char* symbol) {
      function =
          reinterpret_cast<std::remove_reference_t<decltype(function)>>(dlsym(library, symbol));
      if (function == nullptr) absl::StrAppend(&missing, missing.empty() ? "" : ", ", symbol);
    };
    bind(api.create, "cublasCreate_v2");
    bind(api.destroy, "cublasDestroy_v2");
    bind(api.set_stream, "cublasSetStream_v2");
    bind(api.set_workspace, "cublasSetWorkspace_v2");
    bind(api.gemm_ex, "cublasGemmEx");
    bind(api.status_name, "cublasGetStatusName");
    bind(api.status_string, "cublasGetStatusString");
    if (!missing.empty()) {
      return new absl::StatusOr<CublasApi>(
          absl::FailedPreconditionError(absl::StrCat(name, " lacks ", missing)));
    }
    return new absl::StatusOr<CublasApi>(api);
  }();
  if (!loaded->ok()) return loaded->status();
  return &**loaded;
}

// The same for cuBLAS: its status name and text (cuBLAS is loaded when a status exists).
absl::Status CublasStatus(cublasStatus_t status, std::string_view what) {
  if (status == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  const CublasApi& api = **LoadCublas();
  std::string text = absl::StrCat(std::string(what), ": ", api.status_name(status), " (",
                                  api.status_string(status), ")");
  if (status == CUBLAS_STATUS_ALLOC_FAILED) return absl::ResourceExhaustedError(std::move(text));
  return absl::InternalError(std::move(text));
}

#define KVCM_RETURN_IF_CUBLAS_ERROR(expr) KVCM_RETURN_IF_ERROR(CublasStatus((expr), #expr))

// cuBLAS's workspace per handle: 32 MiB, what the cuBLAS documentation (cublasSetWorkspace)
// recommends for Hopper (4 MiB before it).
constexpr uint64_t kCublasWorkspaceBytes = uint64_t{32} << 20;

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

// Weights as device pointers into one allocation: matrices in the weight dtype
// (Impl::weight_dtype_), norms and biases fp32; a bias the model lacks is null.
struct DeviceLayer {
  const float* input_norm = nullptr;
  const void* q_proj = nullptr;
  const void* k_proj = nullptr;
  const void* v_proj = nullptr;
  const void* o_proj = nullptr;
  const float* post_norm = nullptr;
  const void* gate_proj = nullptr;
  const void* up_proj = nullptr;
  const void* down_proj = nullptr;
  const float* q_bias = nullptr;
  const float* k_bias = nullptr;
  const float* v_bias = nullptr;
  const float* o_bias = nullptr;
};

// An activation matrix x[rows][in] (fp32, row-major) as a matrix product reads it: with
// 16-bit weights, also its copy rounded to the weights' type, made once for every product
// of the same input (q, k, v; gate, up).
struct Activation {
  const float* fp32 = nullptr;
  const uint16_t* narrowed = nullptr;  // [rows][in]; null with fp32 weights
  int64_t rows = 0;
  int64_t in = 0;
};

// A dequantized weight matrix `name` of `cols` columns rounded to `dtype` (kFloat16 or
// kBFloat16), to nearest, ties to even (common/base/float16.h), as the kernels round
// activations. INVALID_ARGUMENT naming the element when a finite fp32 value is beyond fp16's
// range.
absl::StatusOr<std::vector<uint16_t>> Narrow(const std::vector<float>& values, DType dtype,
                                             const std::string& name, int64_t cols) {
  std::vector<uint16_t> narrowed(values.size());
  const bool half = dtype == DType::kFloat16;
  for (size_t i = 0; i < values.size(); ++i) {
    const float v = values[i];
    narrowed[i] = half ? HalfFromFloat(v) : BFloat16FromFloat(v);
    if (half && std::isfinite(v) && std::isinf(FloatFromHalf(narrowed[i]))) {
      return absl::InvalidArgumentError(absl::StrCat(
          "weight ", name, "[", i / static_cast<size_t>(cols), "][", i % static_cast<size_t>(cols),
          "] = ", v, " is beyond fp16's range (65504): use bf16 or fp32 weights on CUDA"));
    }
  }
  return narrowed;
}

// Where each buffer of one forward step lies in its one scratch allocation: the batch's
// integers first (copied up in one go), then the activations.
struct StepScratch {
  uint64_t tokens = 0, positions = 0, query_lens = 0, context_lens = 0, tables = 0, slots = 0,
           logit_rows = 0;
  uint64_t integer_bytes = 0;  // the integers', from offset 0
  uint64_t x = 0, normed = 0, q = 0, k = 0, v = 0, attn = 0, proj = 0, gate = 0, up = 0, picked = 0,
           picked_normed = 0, logits = 0;
  uint64_t narrowed = 0;  // the 16-bit copy of a product's input (Prepare): the widest of them
  uint64_t total = 0;
};

StepScratch PlanStepScratch(const LlamaConfig& c, const ForwardBatch& batch, const TokenPlan& plan,
                            bool narrows) {
  const int64_t rows = static_cast<int64_t>(batch.token_ids.size());
  const int64_t num_seqs = static_cast<int64_t>(batch.query_lens.size());
  const int64_t num_logits = static_cast<int64_t>(plan.logit_rows.size());
  const int64_t h = c.hidden_size;
  const int64_t q_width = int64_t{c.num_attention_heads} * c.head_dim;
  const int64_t kv_width = int64_t{c.num_key_value_heads} * c.head_dim;
  const int64_t inter = c.intermediate_size;
  Carver carver;
  StepScratch at;
  at.tokens = carver.Take<int32_t>(rows);
  at.positions = carver.Take<int32_t>(rows);
  at.query_lens = carver.Take<int32_t>(num_seqs);
  at.context_lens = carver.Take<int32_t>(num_seqs);
  at.tables = carver.Take<int32_t>(static_cast<int64_t>(batch.block_tables.size()));
  at.slots = carver.Take<int64_t>(rows);
  at.logit_rows = carver.Take<int64_t>(num_logits);
  at.integer_bytes = carver.total();
  at.x = carver.Take<float>(rows * h);
  at.normed = carver.Take<float>(rows * h);
  at.q = carver.Take<float>(rows * q_width);
  at.k = carver.Take<float>(rows * kv_width);
  at.v = carver.Take<float>(rows * kv_width);
  at.attn = carver.Take<float>(rows * q_width);
  at.proj = carver.Take<float>(rows * h);
  at.gate = carver.Take<float>(rows * inter);
  at.up = carver.Take<float>(rows * inter);
  at.picked = carver.Take<float>(num_logits * h);
  at.picked_normed = carver.Take<float>(num_logits * h);
  at.logits = carver.Take<float>(num_logits * c.vocab_size);
  const int64_t narrowed_elements =
      std::max({rows * h, rows * q_width, rows * inter, num_logits * h});
  at.narrowed = carver.Take<uint16_t>(narrows ? narrowed_elements : 0);
  at.total = carver.total();
  return at;
}

// The batch's integers where `at` puts them, for one copy to the device.
std::vector<uint8_t> StageIntegers(const StepScratch& at, const ForwardBatch& batch,
                                   const TokenPlan& plan) {
  std::vector<uint8_t> staging(at.integer_bytes, 0);
  auto stage = [&](uint64_t offset, const auto& values) {
    std::memcpy(staging.data() + offset, values.data(), values.size() * sizeof(*values.data()));
  };
  stage(at.tokens, batch.token_ids);
  stage(at.positions, plan.positions);
  stage(at.query_lens, batch.query_lens);
  stage(at.context_lens, batch.context_lens);
  stage(at.tables, batch.block_tables);
  stage(at.slots, plan.slots);
  stage(at.logit_rows, plan.logit_rows);
  return staging;
}

}  // namespace

class LlamaCudaModel::Impl {
 public:
  Impl(const LlamaModel& model, int32_t device, DType weight_dtype)
      : model_(model), device_(device), weight_dtype_(weight_dtype) {}
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;
  ~Impl() {
    cudaSetDevice(device_);
    if (stream_ != nullptr) cudaStreamSynchronize(stream_);
    if (cublas_ != nullptr) cublas_api_->destroy(cublas_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    // Fails harmlessly (cudaErrorCudartUnloading) when destroyed during process exit.
    if (cublas_workspace_ != nullptr) cudaFree(cublas_workspace_);
    if (weights_ != nullptr) cudaFree(weights_);
  }

  absl::Status Upload();
  // The cuBLAS handle, bound to stream_, and its workspace (bf16 and fp16 weights).
  absl::Status CreateCublas();
  absl::Status Forward(const ForwardBatch& batch, const PoolView& pool, std::vector<float>* logits,
                       LogitsScope scope);
  absl::Status CopyBlocks(const PoolView& pool, std::span<const kernels::BlockCopy> copies);

  int32_t device() const { return device_; }
  DType weight_dtype() const { return weight_dtype_; }
  uint64_t weight_bytes() const { return weight_bytes_; }

 private:
  absl::Status CheckDevicePool(const PoolView& pool) const;
  // One step's device buffers, in its scratch allocation (StepScratch).
  struct LayerBuffers {
    float* x;
    float* normed;
    float* q;
    float* k;
    float* v;
    float* attn;
    float* proj;
    float* gate;
    float* up;
    const int32_t* positions;
    const int64_t* slots;
    uint16_t* narrowed;
  };
  // Decoder layer `l` over the step's `rows` tokens: enqueues its kernels and products on
  // stream_, its K/V into the pool. REQUIRES: mu_ held.
  absl::Status RunLayer(int32_t l, const LayerBuffers& b, int64_t rows,
                        const kernels::PagedAttentionBatch& attention, const PoolView& pool);
  // x as the products read it; `scratch` holds rows * in 16-bit elements (unused with fp32
  // weights). Enqueues the rounding on the stream.
  Activation Prepare(const float* x, int64_t rows, int64_t in, uint16_t* scratch) const;
  // y[rows][out] = x[rows][in] . w[out][in]^T (w in the weight type), enqueued on the stream.
  absl::Status MatMul(const Activation& x, const void* w, int64_t out, float* y) const;

  const LlamaModel& model_;
  const int32_t device_;
  const DType weight_dtype_;  // kFloat32, kFloat16 or kBFloat16 (Create refuses the others)
  std::mutex mu_;             // one call at a time on the stream (and on cublas_, bound to it)
  cudaStream_t stream_ = nullptr;
  cublasHandle_t cublas_ = nullptr;
  const CublasApi* cublas_api_ = nullptr;  // loaded with cublas_
  void* cublas_workspace_ = nullptr;
  uint8_t* weights_ = nullptr;
  uint64_t weight_bytes_ = 0;
  const void* embed_tokens_ = nullptr;
  const float* final_norm_ = nullptr;
  const void* head_ = nullptr;
  const double* inv_freq_ = nullptr;
  std::vector<DeviceLayer> layers_;
};

absl::Status LlamaCudaModel::Impl::CreateCublas() {
  // One handle for this object, bound to its stream, with its own workspace: every product
  // is enqueued on stream_ under mu_, and nothing else uses the handle.
  KVCM_ASSIGN_OR_RETURN(cublas_api_, LoadCublas());
  KVCM_RETURN_IF_CUBLAS_ERROR(cublas_api_->create(&cublas_));
  KVCM_RETURN_IF_CUBLAS_ERROR(cublas_api_->set_stream(cublas_, stream_));
  KVCM_RETURN_IF_CUDA_ERROR(cudaMalloc(&cublas_workspace_, kCublasWorkspaceBytes));
  KVCM_RETURN_IF_CUBLAS_ERROR(
      cublas_api_->set_workspace(cublas_, cublas_workspace_, kCublasWorkspaceBytes));
  return absl::OkStatus();
}

absl::Status LlamaCudaModel::Impl::Upload() {
  const LlamaWeights& w = model_.weights();
  const std::vector<double>& inv_freq = model_.inv_freq();
  // Every host tensor and where it goes; matrices are dequantized to fp32 one at a time as
  // they are copied, then rounded to the weight type.
  struct Piece {
    const void* host;
    const kernels::WeightMatrix* matrix;  // instead of host
    std::string name;                     // a matrix's, for errors
    uint64_t bytes;
    uint64_t offset;
  };
  constexpr uint64_t kNone = std::numeric_limits<uint64_t>::max();
  std::vector<Piece> pieces;
  Carver carver;
  auto add = [&](const std::vector<float>& tensor) {
    if (tensor.empty()) return kNone;  // a bias the model lacks
    const uint64_t offset = carver.Take<float>(static_cast<int64_t>(tensor.size()));
    pieces.push_back({tensor.data(), nullptr, "", tensor.size() * sizeof(float), offset});
    return offset;
  };
  const uint64_t element_bytes = static_cast<uint64_t>(DTypeBytes(weight_dtype_));
  auto add_matrix = [&](const kernels::WeightMatrix& m, std::string name) {
    const int64_t n = m.rows() * m.cols();
    const uint64_t offset = element_bytes == 4 ? carver.Take<float>(n) : carver.Take<uint16_t>(n);
    pieces.push_back(
        {nullptr, &m, std::move(name), static_cast<uint64_t>(n) * element_bytes, offset});
    return offset;
  };
  const uint64_t embed = add_matrix(w.embed_tokens, "embed_tokens");
  const uint64_t final_norm = add(w.final_norm);
  const uint64_t head = w.lm_head.empty() ? embed : add_matrix(w.lm_head, "lm_head");
  const uint64_t freq = carver.Take<double>(static_cast<int64_t>(inv_freq.size()));
  pieces.push_back({inv_freq.data(), nullptr, "", inv_freq.size() * sizeof(double), freq});
  std::vector<std::array<uint64_t, 13>> layer_offsets;
  for (size_t i = 0; i < w.layers.size(); ++i) {
    const LlamaWeights::Layer& l = w.layers[i];
    const std::string p = absl::StrCat("layers.", i, ".");
    layer_offsets.push_back(
        {add(l.input_norm), add_matrix(l.q_proj, p + "q_proj"), add_matrix(l.k_proj, p + "k_proj"),
         add_matrix(l.v_proj, p + "v_proj"), add_matrix(l.o_proj, p + "o_proj"), add(l.post_norm),
         add_matrix(l.gate_proj, p + "gate_proj"), add_matrix(l.up_proj, p + "up_proj"),
         add_matrix(l.down_proj, p + "down_proj"), add(l.q_bias), add(l.k_bias), add(l.v_bias),
         add(l.o_bias)});
  }
  weight_bytes_ = carver.total();
  const bool uses_cublas = weight_dtype_ != DType::kFloat32;
  const uint64_t needed = weight_bytes_ + (uses_cublas ? kCublasWorkspaceBytes : 0);

  KVCM_ASSIGN_OR_RETURN(const auto memory, CudaMemoryInfo(device_));  // checks the index too
  if (needed > memory.first) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the model's weights take ", weight_bytes_, " bytes in ",
                     std::string(DTypeName(weight_dtype_)),
                     uses_cublas ? absl::StrCat(" (and cuBLAS ", kCublasWorkspaceBytes, ")") : "",
                     " but CUDA device ", device_, " has ", memory.first, " bytes free"));
  }
  KVCM_RETURN_IF_CUDA_ERROR(cudaSetDevice(device_));
  void* base = nullptr;
  KVCM_RETURN_IF_CUDA_ERROR(cudaMalloc(&base, weight_bytes_));
  weights_ = static_cast<uint8_t*>(base);
  for (const Piece& p : pieces) {
    std::vector<float> dequantized;
    std::vector<uint16_t> narrowed;
    const void* host = p.host;
    if (p.matrix != nullptr) {
      dequantized = p.matrix->Dequantize();
      host = dequantized.data();
      if (uses_cublas) {
        KVCM_ASSIGN_OR_RETURN(narrowed,
                              Narrow(dequantized, weight_dtype_, p.name, p.matrix->cols()));
        host = narrowed.data();
      }
    }
    KVCM_RETURN_IF_CUDA_ERROR(
        cudaMemcpy(weights_ + p.offset, host, p.bytes, cudaMemcpyHostToDevice));
  }
  KVCM_RETURN_IF_CUDA_ERROR(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  if (uses_cublas) KVCM_RETURN_IF_ERROR(CreateCublas());

  auto at = [&](uint64_t offset) -> const float* {
    return offset == kNone ? nullptr : reinterpret_cast<const float*>(weights_ + offset);
  };
  auto matrix_at = [&](uint64_t offset) -> const void* { return weights_ + offset; };
  embed_tokens_ = matrix_at(embed);
  final_norm_ = at(final_norm);
  head_ = matrix_at(head);
  inv_freq_ = reinterpret_cast<const double*>(weights_ + freq);
  for (const auto& o : layer_offsets) {
    layers_.push_back(DeviceLayer{at(o[0]), matrix_at(o[1]), matrix_at(o[2]), matrix_at(o[3]),
                                  matrix_at(o[4]), at(o[5]), matrix_at(o[6]), matrix_at(o[7]),
                                  matrix_at(o[8]), at(o[9]), at(o[10]), at(o[11]), at(o[12])});
  }
  return absl::OkStatus();
}

Activation LlamaCudaModel::Impl::Prepare(const float* x, int64_t rows, int64_t in,
                                         uint16_t* scratch) const {
  Activation a{x, nullptr, rows, in};
  if (weight_dtype_ != DType::kFloat32) {
    llama_cuda::NarrowTo(x, rows * in, weight_dtype_, scratch, stream_);
    a.narrowed = scratch;
  }
  return a;
}

absl::Status LlamaCudaModel::Impl::MatMul(const Activation& x, const void* w, int64_t out,
                                          float* y) const {
  if (x.rows <= 0 || out <= 0) return absl::OkStatus();
  if (weight_dtype_ == DType::kFloat32) {
    llama_cuda::MatMul(x.fp32, x.rows, x.in, static_cast<const float*>(w), out, y, stream_);
    return absl::OkStatus();
  }
  KVCM_CHECK(x.narrowed != nullptr);
  constexpr int64_t kIntMax = std::numeric_limits<int>::max();
  KVCM_CHECK(x.rows <= kIntMax && x.in <= kIntMax && out <= kIntMax)
      << x.rows << " x " << x.in << " x " << out;
  // cuBLAS is column-major: a row-major [r][c] matrix is, to cuBLAS, the column-major c x r
  // matrix (its transpose) with leading dimension c. So y = x . w^T (row-major) is computed
  // as y^T = w . x^T (column-major):
  //   C      = y^T   out x rows, ldc = out  (y, row-major [rows][out], as is)
  //   op(A)  = w     out x in: A is w's memory, row-major [out][in], i.e. the column-major
  //                  in x out matrix w^T with lda = in; transa = CUBLAS_OP_T gives w
  //   op(B)  = x^T   in x rows: B is x's memory, row-major [rows][in], i.e. the column-major
  //                  in x rows matrix x^T with ldb = in; transb = CUBLAS_OP_N
  //   m = out, n = rows, k = in.
  // A and B in the weight type, C fp32, accumulated in fp32 (CUBLAS_COMPUTE_32F, on tensor
  // cores for 16-bit inputs); alpha = 1, beta = 0 (y is overwritten).
  const cudaDataType_t type = weight_dtype_ == DType::kFloat16 ? CUDA_R_16F : CUDA_R_16BF;
  const int m = static_cast<int>(out);
  const int n = static_cast<int>(x.rows);
  const int k = static_cast<int>(x.in);
  const float alpha = 1.0f;
  const float beta = 0.0f;
  return CublasStatus(
      cublas_api_->gemm_ex(cublas_, CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, &alpha, w, type,
                           /*lda=*/k, x.narrowed, type, /*ldb=*/k, &beta, y, CUDA_R_32F,
                           /*ldc=*/m, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
      "cublasGemmEx");
}

absl::Status LlamaCudaModel::Impl::CheckDevicePool(const PoolView& pool) const {
  if (pool.cuda_device != device_) {
    return absl::FailedPreconditionError(
        absl::StrCat("the KV pool is ",
                     pool.cuda_device < 0 ? std::string("in host memory")
                                          : absl::StrCat("on CUDA device ", pool.cuda_device),
                     " but this model runs on CUDA device ", device_));
  }
  KVCM_RETURN_IF_ERROR(CheckCudaPoolGroups(pool));
  return model_.CheckPool(pool);
}

absl::Status LlamaCudaModel::Impl::RunLayer(int32_t l, const LayerBuffers& b, int64_t rows,
                                            const kernels::PagedAttentionBatch& attention,
                                            const PoolView& pool) {
  const LlamaConfig& c = model_.config();
  const int64_t h = c.hidden_size;
  const int64_t q_width = int64_t{c.num_attention_heads} * c.head_dim;
  const int64_t kv_width = int64_t{c.num_key_value_heads} * c.head_dim;
  const int64_t inter = c.intermediate_size;
  void* const s = stream_;
  const DeviceLayer& layer = layers_[static_cast<size_t>(l)];
  // Attention inputs (LlamaModel::AttentionInputs), biases before RoPE as there.
  llama_cuda::RmsNorm(b.x, rows, h, layer.input_norm, c.rms_norm_eps, b.normed, s);
  const Activation attention_in = Prepare(b.normed, rows, h, b.narrowed);
  KVCM_RETURN_IF_ERROR(MatMul(attention_in, layer.q_proj, q_width, b.q));
  KVCM_RETURN_IF_ERROR(MatMul(attention_in, layer.k_proj, kv_width, b.k));
  KVCM_RETURN_IF_ERROR(MatMul(attention_in, layer.v_proj, kv_width, b.v));
  if (layer.q_bias != nullptr) llama_cuda::AddBias(b.q, rows, q_width, layer.q_bias, s);
  if (layer.k_bias != nullptr) llama_cuda::AddBias(b.k, rows, kv_width, layer.k_bias, s);
  if (layer.v_bias != nullptr) llama_cuda::AddBias(b.v, rows, kv_width, layer.v_bias, s);
  llama_cuda::Rope(b.q, rows, c.num_attention_heads, c.head_dim, b.positions, inv_freq_, s);
  llama_cuda::Rope(b.k, rows, c.num_key_value_heads, c.head_dim, b.positions, inv_freq_, s);
  // The pool.
  KVCM_ASSIGN_OR_RETURN(const kernels::PagedKvView view,
                        kernels::LayerView(pool.base, pool.layout, pool.spec, l));
  kernels::cuda::WriteKv(view, b.k, b.v, b.slots, static_cast<int32_t>(rows), s);
  kernels::PagedAttentionBatch layer_attention = attention;
  layer_attention.sliding_window = c.layer_windows[static_cast<size_t>(l)];
  kernels::cuda::PagedAttention(view, layer_attention, b.q, b.attn, s);
  // Output projection and MLP (LlamaModel::AttentionOutputAndMlp).
  KVCM_RETURN_IF_ERROR(MatMul(Prepare(b.attn, rows, q_width, b.narrowed), layer.o_proj, h, b.proj));
  if (layer.o_bias != nullptr) llama_cuda::AddBias(b.proj, rows, h, layer.o_bias, s);
  llama_cuda::Add(b.x, b.proj, rows * h, s);
  llama_cuda::RmsNorm(b.x, rows, h, layer.post_norm, c.rms_norm_eps, b.normed, s);
  const Activation mlp_in = Prepare(b.normed, rows, h, b.narrowed);
  KVCM_RETURN_IF_ERROR(MatMul(mlp_in, layer.gate_proj, inter, b.gate));
  KVCM_RETURN_IF_ERROR(MatMul(mlp_in, layer.up_proj, inter, b.up));
  llama_cuda::SiluMul(b.gate, b.up, rows * inter, s);
  KVCM_RETURN_IF_ERROR(
      MatMul(Prepare(b.gate, rows, inter, b.narrowed), layer.down_proj, h, b.proj));
  llama_cuda::Add(b.x, b.proj, rows * h, s);
  return absl::OkStatus();
}

absl::Status LlamaCudaModel::Impl::Forward(const ForwardBatch& batch, const PoolView& pool,
                                           std::vector<float>* logits, LogitsScope scope) {
  KVCM_CHECK(logits != nullptr);
  KVCM_RETURN_IF_ERROR(CheckDevicePool(pool));
  KVCM_RETURN_IF_ERROR(model_.CheckBatch(batch, pool));
  const LlamaConfig& c = model_.config();
  const TokenPlan plan = PlanTokens(batch, pool.spec.block_size, scope);
  const int64_t rows = static_cast<int64_t>(batch.token_ids.size());
  const int64_t num_logits = static_cast<int64_t>(plan.logit_rows.size());
  const int64_t h = c.hidden_size;
  const int64_t vocab = c.vocab_size;
  const StepScratch at = PlanStepScratch(c, batch, plan, weight_dtype_ != DType::kFloat32);
  const std::vector<uint8_t> staging = StageIntegers(at, batch, plan);

  std::lock_guard<std::mutex> lock(mu_);
  KVCM_RETURN_IF_CUDA_ERROR(cudaSetDevice(device_));
  void* const s = stream_;
  StreamBuffer scratch(stream_);
  KVCM_RETURN_IF_ERROR(scratch.Allocate(at.total));
  KVCM_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(scratch.At<uint8_t>(0), staging.data(),
                                            at.integer_bytes, cudaMemcpyHostToDevice, stream_));
  const LayerBuffers buffers{scratch.At<float>(at.x),       scratch.At<float>(at.normed),
                             scratch.At<float>(at.q),       scratch.At<float>(at.k),
                             scratch.At<float>(at.v),       scratch.At<float>(at.attn),
                             scratch.At<float>(at.proj),    scratch.At<float>(at.gate),
                             scratch.At<float>(at.up),      scratch.At<int32_t>(at.positions),
                             scratch.At<int64_t>(at.slots), scratch.At<uint16_t>(at.narrowed)};

  kernels::PagedAttentionBatch attention;
  attention.num_seqs = static_cast<int32_t>(batch.query_lens.size());
  attention.num_q_heads = c.num_attention_heads;
  attention.query_lens = scratch.At<int32_t>(at.query_lens);
  attention.context_lens = scratch.At<int32_t>(at.context_lens);
  attention.block_tables = scratch.At<int32_t>(at.tables);
  attention.max_blocks_per_seq = batch.max_blocks_per_seq;
  attention.scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  attention.max_query_len = *std::max_element(batch.query_lens.begin(), batch.query_lens.end());

  llama_cuda::Embed(scratch.At<int32_t>(at.tokens), rows, embed_tokens_, weight_dtype_, h,
                    buffers.x, s);
  for (int32_t l = 0; l < c.num_hidden_layers; ++l) {
    KVCM_RETURN_IF_ERROR(RunLayer(l, buffers, rows, attention, pool));
  }
  // Final norm and LM head for the chosen rows (LlamaModel::Logits).
  float* const picked = scratch.At<float>(at.picked);
  float* const picked_normed = scratch.At<float>(at.picked_normed);
  float* const device_logits = scratch.At<float>(at.logits);
  llama_cuda::GatherRows(buffers.x, scratch.At<int64_t>(at.logit_rows), num_logits, h, picked, s);
  llama_cuda::RmsNorm(picked, num_logits, h, final_norm_, c.rms_norm_eps, picked_normed, s);
  KVCM_RETURN_IF_ERROR(
      MatMul(Prepare(picked_normed, num_logits, h, buffers.narrowed), head_, vocab, device_logits));
  logits->assign(static_cast<size_t>(num_logits * vocab), 0.0f);
  KVCM_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(logits->data(), device_logits,
                                            logits->size() * sizeof(float), cudaMemcpyDeviceToHost,
                                            stream_));
  KVCM_RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(stream_));
  return absl::OkStatus();
}

absl::Status LlamaCudaModel::Impl::CopyBlocks(const PoolView& pool,
                                              std::span<const kernels::BlockCopy> copies) {
  KVCM_RETURN_IF_ERROR(CheckDevicePool(pool));
  if (copies.empty()) return absl::OkStatus();
  absl::flat_hash_set<int32_t> destinations;
  for (size_t i = 0; i < copies.size(); ++i) {
    for (const int32_t block : {copies[i].src, copies[i].dst}) {
      if (block < 0 || block >= pool.layout.num_blocks) {
        return absl::InvalidArgumentError(absl::StrCat(
            "copies[", i, "]: block ", block, " is outside [0, ", pool.layout.num_blocks, ")"));
      }
    }
    if (!destinations.insert(copies[i].dst).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("copies[", i, "]: block ", copies[i].dst, " is a destination twice"));
    }
  }
  for (size_t i = 0; i < copies.size(); ++i) {
    if (destinations.contains(copies[i].src)) {
      return absl::InvalidArgumentError(absl::StrCat("copies[", i, "]: block ", copies[i].src,
                                                     " is both a source and a destination"));
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

absl::StatusOr<std::unique_ptr<LlamaCudaModel>> LlamaCudaModel::Create(
    const LlamaModel& model, int32_t device, const LlamaCudaModelOptions& options) {
  KVCM_RETURN_IF_ERROR(CheckCudaSupport(model.config()));
  if (options.weight_dtype != DType::kFloat32 && options.weight_dtype != DType::kFloat16 &&
      options.weight_dtype != DType::kBFloat16) {
    return absl::InvalidArgumentError(absl::StrCat("CUDA weight dtype ",
                                                   std::string(DTypeName(options.weight_dtype)),
                                                   ": must be bf16, fp16 or fp32"));
  }
  KVCM_ASSIGN_OR_RETURN(const int count, CudaDeviceCount());
  if (device < 0 || device >= count) {
    return absl::InvalidArgumentError(
        absl::StrCat("no CUDA device ", device, ": cudaGetDeviceCount reports ", count));
  }
  auto impl = std::make_unique<Impl>(model, device, options.weight_dtype);
  KVCM_RETURN_IF_ERROR(impl->Upload());
  return std::unique_ptr<LlamaCudaModel>(new LlamaCudaModel(std::move(impl)));
}

LlamaCudaModel::LlamaCudaModel(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
LlamaCudaModel::~LlamaCudaModel() = default;

int32_t LlamaCudaModel::device() const { return impl_->device(); }
DType LlamaCudaModel::weight_dtype() const { return impl_->weight_dtype(); }
uint64_t LlamaCudaModel::weight_bytes() const { return impl_->weight_bytes(); }

absl::Status LlamaCudaModel::Forward(const ForwardBatch& batch, const PoolView& pool,
                                     std::vector<float>* logits, LogitsScope scope) const {
  return impl_->Forward(batch, pool, logits, scope);
}

absl::Status LlamaCudaModel::CopyBlocks(const PoolView& pool,
                                        std::span<const kernels::BlockCopy> copies) const {
  return impl_->CopyBlocks(pool, copies);
}

}  // namespace kvcm::executor
