#pragma once
// KVCM_CUDA_CHECK: CHECK-fail with CUDA's message when a runtime call fails. For the CUDA
// kernels' launchers only: a failed launch or allocation there is a broken invariant (bad
// arguments, a dead context), not something a caller can handle.

#include <cuda_runtime.h>

#include "common/base/check.h"

#define KVCM_CUDA_CHECK(expr)                                        \
  do {                                                               \
    const cudaError_t kvcm_cuda_err_ = (expr);                       \
    KVCM_CHECK(kvcm_cuda_err_ == cudaSuccess)                        \
        << #expr << ": " << cudaGetErrorName(kvcm_cuda_err_) << " (" \
        << cudaGetErrorString(kvcm_cuda_err_) << ")";                \
  } while (false)
