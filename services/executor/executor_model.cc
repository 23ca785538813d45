#include "services/executor/executor_model.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/base/check.h"
#include "common/base/status_macros.h"

namespace kvcm::executor {

absl::Status ExecutorModel::Prepare(const PoolView& pool) {
  if (pool.backend != PoolBackend::kCuda) return absl::OkStatus();
  // Refused before any weight is copied (LlamaCudaModel refuses such a pool too).
  KVCM_RETURN_IF_ERROR(CheckCudaPoolGroups(pool));
  if (cuda_ != nullptr) {
    if (cuda_->device() == pool.cuda_device) return absl::OkStatus();
    return absl::FailedPreconditionError(absl::StrCat(
        "the pool is on CUDA device ", pool.cuda_device, " but this executor's weights are on ",
        "CUDA device ", cuda_->device(), ": restart the executor to move them"));
  }
  KVCM_ASSIGN_OR_RETURN(cuda_, LlamaCudaModel::Create(*host_, pool.cuda_device, cuda_options_));
  return absl::OkStatus();
}

absl::Status ExecutorModel::CopyBlocks(const PoolView& pool,
                                       std::span<const kernels::BlockCopy> copies) const {
  if (copies.empty()) return absl::OkStatus();
  if (pool.backend == PoolBackend::kCuda) {
    KVCM_CHECK(cuda_ != nullptr) << "a cuda pool that was not prepared";
    return cuda_->CopyBlocks(pool, copies);
  }
  kernels::cpu::CopyBlocks(pool.base, pool.layout, copies.data(),
                           static_cast<int32_t>(copies.size()));
  return absl::OkStatus();
}

absl::Status ExecutorModel::Forward(const ForwardBatch& batch, const PoolView& pool,
                                    std::vector<float>* logits,
                                    const std::function<bool(int32_t layer)>* after_layer) const {
  if (pool.backend == PoolBackend::kCuda) {
    KVCM_CHECK(cuda_ != nullptr) << "a cuda pool that was not prepared";
    return cuda_->Forward(batch, pool, logits);
  }
  return host_->Forward(batch, pool, logits, LogitsScope::kLastTokenPerSeq, after_layer);
}

}  // namespace kvcm::executor
