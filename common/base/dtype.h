#pragma once
// DType: the element type of a tensor, the one enum for KV-cache blocks
// (common/sizing/kv_cache_spec.h), the kernels' paged K/V (kernels/paged_kv.h) and the CUDA
// model's weight matrices (services/executor/model/llama_model_cuda_kernels.h).
//
// This header is C++17 and includes no Abseil and no generated code: nvcc compiles the .cu
// files that include it as C++17. DTypeName and ParseDType, which need Abseil or a library,
// are in common/sizing/kv_cache_spec.h.
//
// Thread safety: plain values.

#include <cstdint>

#include "common/base/check.h"

namespace kvcm {

// Element type of a tensor. For the KV cache it may differ from the model's weight dtype (an
// fp8 cache for a bf16 model, for instance). The kernels and the CUDA weights support only
// kFloat32, kFloat16 and kBFloat16; they refuse the fp8 values.
enum class DType {
  kFloat32,
  kFloat16,
  kBFloat16,
  kFloat8E4M3,
  kFloat8E5M2,
};

// Bytes per element: 4, 2, 2, 1, 1. CHECK-fails on a value outside the enum.
constexpr int32_t DTypeBytes(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return 4;
    case DType::kFloat16:
    case DType::kBFloat16:
      return 2;
    case DType::kFloat8E4M3:
    case DType::kFloat8E5M2:
      return 1;
  }
  KVCM_CHECK(false) << "unknown DType " << static_cast<int>(dtype);
  return 0;
}

}  // namespace kvcm
