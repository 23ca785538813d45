// The cuda backend of pool_memory.h in a build without CUDA (KVCM_CUDA_ENABLED off): every
// entry point says so.

#include <cstdint>
#include <memory>
#include <span>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/memory/cuda_copy_internal.h"
#include "common/memory/pool_memory.h"

namespace kvcm {
namespace {

absl::Status NotBuilt() {
  return absl::UnavailableError(
      "no CUDA device: kvcm was built without CUDA (KVCM_CUDA=OFF or nvcc not found)");
}

}  // namespace

namespace memory_internal {

absl::Status CudaCopy(void*, const void*, uint64_t, CopyDirection) { return NotBuilt(); }
absl::StatusOr<void*> CreateCudaStream(int) { return NotBuilt(); }
void DestroyCudaStream(void*) {}
absl::Status CudaCopyRunsAsync(int, void*, std::span<const CudaCopyRun>, CopyDirection) {
  return NotBuilt();
}
absl::StatusOr<void*> CudaHostAlloc(uint64_t) { return NotBuilt(); }
void CudaHostFree(void*) {}
absl::Status CudaHostRegister(void*, uint64_t) { return NotBuilt(); }
void CudaHostUnregister(void*) {}

}  // namespace memory_internal

bool CudaBackendCompiled() { return false; }

absl::StatusOr<int> CudaDeviceCount() { return NotBuilt(); }

absl::StatusOr<std::pair<uint64_t, uint64_t>> CudaMemoryInfo(int) { return NotBuilt(); }

absl::StatusOr<std::unique_ptr<PoolMemory>> CreateCudaPoolMemory(int, uint64_t) {
  return NotBuilt();
}

absl::StatusOr<std::unique_ptr<PoolMapping>> OpenCudaPool(int, const CudaIpcHandle&, uint64_t) {
  return NotBuilt();
}

}  // namespace kvcm
