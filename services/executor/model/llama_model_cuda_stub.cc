// LlamaCudaModel in a build without CUDA: Create says so, and no object is ever made.

#include "absl/strings/str_cat.h"
#include "common/base/check.h"
#include "common/base/status_macros.h"
#include "services/executor/model/llama_model_cuda.h"

namespace kvcm::executor {

class LlamaCudaModel::Impl {};

absl::StatusOr<std::unique_ptr<LlamaCudaModel>> LlamaCudaModel::Create(
    const LlamaModel& model, int32_t device, const LlamaCudaModelOptions&) {
  KVCM_RETURN_IF_ERROR(CheckCudaSupport(model.config()));
  return absl::UnimplementedError(
      absl::StrCat("kvcm was built without CUDA: the model cannot run on CUDA device ", device,
                   " (rebuild with nvcc on the PATH or -DKVCM_CUDA=ON)"));
}

LlamaCudaModel::LlamaCudaModel(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
LlamaCudaModel::~LlamaCudaModel() = default;

int32_t LlamaCudaModel::device() const {
  KVCM_CHECK(false) << "built without CUDA";
  return -1;
}
DType LlamaCudaModel::weight_dtype() const {
  KVCM_CHECK(false) << "built without CUDA";
  return DType::kFloat32;
}
uint64_t LlamaCudaModel::weight_bytes() const {
  KVCM_CHECK(false) << "built without CUDA";
  return 0;
}

absl::Status LlamaCudaModel::Forward(const ForwardBatch&, const PoolView&, std::vector<float>*,
                                     LogitsScope) const {
  return absl::UnimplementedError("kvcm was built without CUDA");
}

absl::Status LlamaCudaModel::CopyBlocks(const PoolView&,
                                        std::span<const kernels::BlockCopy>) const {
  return absl::UnimplementedError("kvcm was built without CUDA");
}

}  // namespace kvcm::executor
