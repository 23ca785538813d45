#pragma once
// LlamaCudaModel: LlamaModel's forward pass on a CUDA device, over a KV pool in device
// memory (the cache manager's --backend cuda pool, opened through CUDA IPC).
//
// It copies the weights of a loaded LlamaModel to the device once (fp32, as on the host) and
// runs the same step as LlamaModel::Forward, op for op: embedding, RMSNorm, Q/K/V
// projections, RoPE, kernels::cuda::WriteKv into the pool, kernels::cuda::PagedAttention
// over it, output projection, SwiGLU MLP, final norm and LM head. The logits come back to
// the host for sampling. The CPU forward is the reference it is tested against
// (tests/services/executor/llama_model_cuda_test.cc, label gpu): same logits within fp32
// rounding (the device sums in another order and fuses multiply-adds), not bit for bit.
//
// Matrix products are a plain shared-memory tiled kernel on CUDA cores, not tensor cores:
// correct for any shape, far from cuBLAS's speed on large models (docs/executor.md).
//
// Every call runs on one stream owned by the object and waits for it before returning.
// Scratch memory is allocated per call from the device's stream-ordered pool.
//
// Ownership: the LlamaModel must outlive this object (its config, checks and inverse
// frequencies are used); the device weights belong to this object. The pool memory belongs
// to the caller.
// Thread safety: const methods may be called concurrently; they take turns on the stream.

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/copy_blocks.h"
#include "services/executor/llama_model.h"

namespace kvcm {

class LlamaCudaModel {
 public:
  // Copies `model`'s weights to `device`. Errors: UNIMPLEMENTED when this build has no CUDA
  // kernels; UNAVAILABLE ("no CUDA device: ...") without a device; INVALID_ARGUMENT for a
  // device index out of range; RESOURCE_EXHAUSTED when the weights do not fit (with the
  // bytes needed and free).
  static absl::StatusOr<std::unique_ptr<LlamaCudaModel>> Create(const LlamaModel& model,
                                                                 int32_t device);

  LlamaCudaModel(const LlamaCudaModel&) = delete;
  LlamaCudaModel& operator=(const LlamaCudaModel&) = delete;
  ~LlamaCudaModel();

  int32_t device() const;
  // Bytes of device memory the weights take.
  uint64_t weight_bytes() const;

  // LlamaModel::Forward's contract, for a pool whose base is a device pointer on device():
  // FAILED_PRECONDITION when pool.cuda_device is not device(); then the model's CheckPool
  // and CheckBatch, before anything is written; INTERNAL with CUDA's message when a device
  // call fails (RESOURCE_EXHAUSTED when scratch memory runs out).
  absl::Status Forward(const ForwardBatch& batch, const PagedPool& pool,
                       std::vector<float>* logits,
                       LogitsScope scope = LogitsScope::kLastTokenPerSeq) const;

  // Copy-on-write orders (kernels::cuda::CopyBlocks) on a device pool, waited for.
  // FAILED_PRECONDITION for a pool on another device; INVALID_ARGUMENT for a block outside
  // the pool, a destination twice or one that is also a source.
  absl::Status CopyBlocks(const PagedPool& pool,
                          std::span<const kernels::BlockCopy> copies) const;

 private:
  class Impl;
  explicit LlamaCudaModel(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvcm
