#pragma once

// Internal to kvcm_memory: the one CUDA call that pool_memory.cc needs, defined in
// cuda_pool_memory.cc (or the stub when CUDA is not built).

#include <cstdint>

#include "absl/status/status.h"

namespace kvcm::memory_internal {

enum class CopyDirection { kHostToDevice, kDeviceToHost };

// Synchronous cudaMemcpy of `bytes` bytes. INTERNAL with the CUDA error on failure;
// UNAVAILABLE when CUDA is not built.
absl::Status CudaCopy(void* dst, const void* src, uint64_t bytes, CopyDirection direction);

}  // namespace kvcm::memory_internal
