#pragma once
// LlamaCudaModel: LlamaModel's forward pass on a CUDA device, over a KV pool in device
// memory (the cache manager's --backend cuda pool, opened through CUDA IPC).
//
// It copies the weights of a loaded LlamaModel to the device once and runs the same step as
// LlamaModel::Forward, op for op: embedding, RMSNorm, Q/K/V projections and their biases
// (Qwen2; Llama's attention_bias also on o), RoPE, kernels::cuda::WriteKv into the pool,
// kernels::cuda::PagedAttention over it, output projection, SwiGLU MLP, final norm and LM
// head. The logits come back to the host for sampling.
//
// Weight matrices (the embeddings and the LM head included) are kept on the device in
// LlamaCudaModelOptions::weight_dtype:
//   bf16 (default), fp16  cuBLAS (cublasGemmEx) on tensor cores: the activations are rounded
//                         to the same type for each product, accumulated in fp32
//                         (CUBLAS_COMPUTE_32F), outputs fp32. Norms, biases, RoPE,
//                         attention and the residual stream stay fp32.
//   fp32                  a plain shared-memory tiled fp32 kernel on CUDA cores: the exact
//                         reference, within fp32 rounding of the CPU (the device sums in
//                         another order and fuses multiply-adds), not bit for bit.
// The CPU forward is the reference both are tested against, with a tolerance per weight
// dtype (tests/services/executor/model/llama_model_cuda_test.cc, label gpu: checked by those tests,
// which need a device; docs/executor.md).
//
// Every call runs on one stream owned by the object; with 16-bit weights cuBLAS runs on a
// handle of its own bound to that stream, with a workspace of its own. Each call waits for
// the stream before returning. Scratch memory is allocated per call from the device's
// stream-ordered pool.
//
// Ownership: the LlamaModel must outlive this object (its config, checks and inverse
// frequencies are used); the device weights, the cuBLAS handle and its workspace belong to
// this object. The pool memory belongs to the caller.
// Thread safety: const methods may be called concurrently; they take turns on the stream.

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "kernels/copy_blocks.h"
#include "services/executor/model/llama_model.h"

namespace kvcm::executor {

struct LlamaCudaModelOptions {
  // The dtype the weight matrices are kept and multiplied in on the device (kvcm-executor's
  // --cuda-weight-dtype). kBFloat16 (default): half fp32's bytes, tensor cores, fp32's
  // range, 8 significant bits. kFloat16: the same bytes and speed, 11 significant bits, but a
  // range of +-65504 (a model with a larger weight is refused). kFloat32: twice the bytes,
  // CUDA cores, the CPU's logits within fp32 rounding (the reference option).
  DType weight_dtype = DType::kBFloat16;
};

// OK when LlamaCudaModel computes `config`'s model as LlamaModel does; otherwise
// UNIMPLEMENTED naming the missing feature (Qwen3's per-head q/k norm). Create checks it
// first, in builds with and without CUDA.
inline absl::Status CheckCudaSupport(const LlamaConfig& config) {
  // Gemma 3 needs more than the q/k norm: (1 + w) norms, norms after attention and the MLP,
  // the embedding scale, GELU, its attention scale and a RoPE per layer type.
  if (config.sandwich_norms || config.local_rope || config.norm_weight_offset != 0.0f ||
      config.embedding_scale != 1.0f || config.query_pre_attn_scalar > 0 ||
      config.activation != LlamaConfig::Activation::kSilu) {
    return absl::UnimplementedError(absl::StrCat(
        config.architecture,
        ": Gemma 3 (its (1 + w) norms, post-attention and post-MLP norms, embedding scale, "
        "GELU MLP, query_pre_attn_scalar and per-layer-type RoPE) is not implemented on CUDA "
        "devices yet; run this model on the CPU executor"));
  }
  if (config.qk_norm) {
    return absl::UnimplementedError(absl::StrCat(
        config.architecture,
        ": qwen3's per-head q/k norm (q_norm, k_norm) is not implemented on CUDA devices yet; "
        "run this model on the CPU executor"));
  }
  return absl::OkStatus();
}

// OK for a pool without KV cache groups; UNIMPLEMENTED otherwise: the device forward reads
// every layer through one block table and pool layer l, so it would misread a grouped pool
// (docs/architecture.md, "The hybrid KV cache"). ExecutorModel::Prepare and every device
// pass check it, in builds with and without CUDA.
inline absl::Status CheckCudaPoolGroups(const PoolView& pool) {
  if (pool.kv_groups.empty()) return absl::OkStatus();
  return absl::UnimplementedError(absl::StrCat(
      "the pool has ", pool.kv_groups.size(),
      " KV cache groups: KV cache groups are served by the CPU model only; run the cache "
      "manager with --backend shm, or with --sliding-window-tokens 0 (one block table for "
      "every layer)"));
}

class LlamaCudaModel {
 public:
  // Copies `model`'s weights to `device` in options.weight_dtype and makes the stream and
  // the cuBLAS handle. Errors: UNIMPLEMENTED when this build has no CUDA kernels, or for a
  // model with qk_norm (Qwen3's per-head q/k norm has no CUDA kernel yet) or Gemma 3's
  // features (CheckCudaSupport: refused before any device is touched, rather than computing
  // other logits than the CPU); UNAVAILABLE ("no CUDA
  // device: ...") without a device; INVALID_ARGUMENT for a device index out of range, a weight
  // dtype other than fp32, fp16 or bf16, or a finite weight beyond fp16's range with fp16 (naming
  // the tensor); RESOURCE_EXHAUSTED when the weights do not fit (with the bytes needed and free);
  // INTERNAL when cuBLAS cannot start.
  static absl::StatusOr<std::unique_ptr<LlamaCudaModel>> Create(
      const LlamaModel& model, int32_t device,
      const LlamaCudaModelOptions& options = LlamaCudaModelOptions());

  LlamaCudaModel(const LlamaCudaModel&) = delete;
  LlamaCudaModel& operator=(const LlamaCudaModel&) = delete;
  ~LlamaCudaModel();

  int32_t device() const;
  // options.weight_dtype of Create.
  DType weight_dtype() const;
  // Bytes of device memory the weights take.
  uint64_t weight_bytes() const;

  // LlamaModel::Forward's contract, for a pool whose base is a device pointer on device():
  // FAILED_PRECONDITION when pool.cuda_device is not device(); UNIMPLEMENTED for a pool with
  // KV cache groups (CheckCudaPoolGroups); then the model's CheckPool
  // and CheckBatch, before anything is written; INTERNAL with CUDA's message when a device
  // or cuBLAS call fails (RESOURCE_EXHAUSTED when scratch memory runs out).
  absl::Status Forward(const ForwardBatch& batch, const PoolView& pool, std::vector<float>* logits,
                       LogitsScope scope = LogitsScope::kLastTokenPerSeq) const;

  // Copy-on-write orders (kernels::cuda::CopyBlocks) on a device pool, waited for.
  // FAILED_PRECONDITION for a pool on another device; INVALID_ARGUMENT for a block outside
  // the pool, a destination twice or one that is also a source.
  absl::Status CopyBlocks(const PoolView& pool, std::span<const kernels::BlockCopy> copies) const;

 private:
  class Impl;
  explicit LlamaCudaModel(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvcm::executor
