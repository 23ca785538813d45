#pragma once

// Internal to kvcm_memory: the CUDA calls that pool_memory.cc and pool_copier.cc need,
// defined in cuda_pool_memory.cc (or the stub when CUDA is not built).

#include <cstdint>
#include <span>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace kvcm::memory_internal {

enum class CopyDirection { kHostToDevice, kDeviceToHost };

// Synchronous cudaMemcpy of `bytes` bytes. INTERNAL with the CUDA error on failure;
// UNAVAILABLE when CUDA is not built.
absl::Status CudaCopy(void* dst, const void* src, uint64_t bytes, CopyDirection direction);

}  // namespace kvcm::memory_internal

namespace kvcm::memory_internal {

// A stream of the calling thread's device (cudaStreamCreateWithFlags, non-blocking), as an
// opaque pointer; DestroyCudaStream releases it. UNAVAILABLE without CUDA.
absl::StatusOr<void*> CreateCudaStream(int device);
void DestroyCudaStream(void* stream);
// Queues one cudaMemcpyAsync of each (dst, src, bytes) on `stream` (of `device`), then
// waits for the stream. INTERNAL with the CUDA error.
struct CudaCopyRun {
  void* dst = nullptr;
  const void* src = nullptr;
  uint64_t bytes = 0;
};
absl::Status CudaCopyRunsAsync(int device, void* stream, std::span<const CudaCopyRun> runs,
                               CopyDirection direction);
// cudaHostAlloc / cudaFreeHost; cudaHostRegister / cudaHostUnregister.
absl::StatusOr<void*> CudaHostAlloc(uint64_t bytes);
void CudaHostFree(void* data);
absl::Status CudaHostRegister(void* data, uint64_t bytes);
void CudaHostUnregister(void* data);

}  // namespace kvcm::memory_internal
