#pragma once
// ExecutorModel: the model as kvcm-executor's step logic runs it, on whichever memory the
// attached pool is in.
//
//   shm pool   LlamaModel::Forward on the host, kernels::cpu::CopyBlocks.
//   cuda pool  LlamaCudaModel on the pool's device: the weights are copied there the first
//              time a pool on a device is attached (Prepare), in the options' weight dtype,
//              and stay there across re-attachments to new cache-manager epochs.
//
// The host model stays loaded either way (it is what the device copy is made from, and a
// later shm pool runs on it). A pool on another device than the weights' is refused: the
// executor must be restarted to move them.
//
// Thread safety: none; the executor's socket thread owns it. The LlamaModel must outlive it.

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "kernels/copy_blocks.h"
#include "services/executor/executor_pool.h"
#include "services/executor/model/llama_model.h"
#include "services/executor/model/llama_model_cuda.h"

namespace kvcm::executor {

class ExecutorModel {
 public:
  // `cuda_options`: how the weights go to a device (LlamaCudaModel::Create), if one is used.
  explicit ExecutorModel(const LlamaModel* host,
                         const LlamaCudaModelOptions& cuda_options = LlamaCudaModelOptions())
      : host_(host), cuda_options_(cuda_options) {}
  ExecutorModel(const ExecutorModel&) = delete;
  ExecutorModel& operator=(const ExecutorModel&) = delete;

  const LlamaModel& host() const { return *host_; }
  // The device copy; null until a cuda pool was prepared.
  const LlamaCudaModel* cuda() const { return cuda_.get(); }

  // Makes the model runnable on `pool`. shm: nothing to do. cuda: copies the weights to
  // pool.cuda_device unless they are there; FAILED_PRECONDITION when they are on another
  // device; UNIMPLEMENTED for a pool with KV cache groups (CheckCudaPoolGroups);
  // LlamaCudaModel::Create's errors (UNIMPLEMENTED in a build without CUDA,
  // RESOURCE_EXHAUSTED when they do not fit).
  absl::Status Prepare(const PoolView& pool);

  // Copy-on-write orders, then one step, on the memory `pool` is in. REQUIRES for a cuda
  // pool: Prepare(pool) succeeded. Errors: the forward pass's (LlamaModel::Forward,
  // LlamaCudaModel::Forward) and CopyBlocks's.
  absl::Status CopyBlocks(const PoolView& pool, std::span<const kernels::BlockCopy> copies) const;
  // `after_layer`: LlamaModel::Forward's, on a host pool. The device pass does not stop
  // between layers (that would synchronise the stream every layer); it ignores it.
  absl::Status Forward(const ForwardBatch& batch, const PoolView& pool, std::vector<float>* logits,
                       const std::function<bool(int32_t layer)>* after_layer = nullptr) const;

 private:
  const LlamaModel* const host_;
  const LlamaCudaModelOptions cuda_options_;
  std::unique_ptr<LlamaCudaModel> cuda_;
};

}  // namespace kvcm::executor
