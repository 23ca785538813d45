// The cuda backend of pool_memory.h: one cudaMalloc per pool, shared by legacy CUDA IPC.
// Compiled only when KVCM_CUDA_ENABLED (cuda_pool_memory_stub.cc otherwise). Runtime API
// only: cudart loads the driver itself, so binaries also start on machines without one.

#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/base/status_macros.h"
#include "common/memory/cuda_copy_internal.h"
#include "common/memory/pool_memory.h"

namespace kvcm {
namespace {

static_assert(sizeof(cudaIpcMemHandle_t) == sizeof(CudaIpcHandle),
              "CudaIpcHandle must hold a cudaIpcMemHandle_t");

// "cudaErrorNoDevice (no CUDA-capable device is detected)". Also clears the error so that
// a later unrelated call does not report it again.
std::string CudaErrorText(cudaError_t error) {
  cudaGetLastError();
  return absl::StrCat(cudaGetErrorName(error), " (", cudaGetErrorString(error), ")");
}

// Makes `device` current on this thread for the object's scope, then restores the device
// that was current before.
class ScopedDevice {
 public:
  explicit ScopedDevice(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    if (const cudaError_t e = cudaSetDevice(device); e != cudaSuccess) {
      status_ =
          absl::InternalError(absl::StrCat("cudaSetDevice(", device, "): ", CudaErrorText(e)));
    }
  }
  ScopedDevice(const ScopedDevice&) = delete;
  ScopedDevice& operator=(const ScopedDevice&) = delete;
  ~ScopedDevice() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }

  const absl::Status& status() const { return status_; }

 private:
  int previous_ = -1;
  absl::Status status_;
};

absl::Status CheckDevice(int device) {
  KVCM_ASSIGN_OR_RETURN(const int count, CudaDeviceCount());
  if (device < 0 || device >= count) {
    return absl::InvalidArgumentError(
        absl::StrCat("no CUDA device ", device, ": cudaGetDeviceCount reports ", count));
  }
  return absl::OkStatus();
}

class CudaPoolMemory final : public PoolMemory {
 public:
  CudaPoolMemory(int device, void* base, uint64_t bytes)
      : device_(device), base_(base), bytes_(bytes) {}
  CudaPoolMemory(const CudaPoolMemory&) = delete;
  CudaPoolMemory& operator=(const CudaPoolMemory&) = delete;
  ~CudaPoolMemory() override {
    ScopedDevice scoped(device_);
    // Fails harmlessly (cudaErrorCudartUnloading) when destroyed during process exit.
    cudaFree(base_);
  }

  void set_ipc_handle(const CudaIpcHandle& handle) { handle_ = handle; }

  PoolBackend backend() const override { return PoolBackend::kCuda; }
  uint64_t size_bytes() const override { return bytes_; }
  void* base() const override { return base_; }
  int shareable_fd() const override { return -1; }
  std::optional<CudaIpcHandle> cuda_ipc_handle() const override { return handle_; }
  int cuda_device() const override { return device_; }

 private:
  const int device_;
  void* const base_;
  const uint64_t bytes_;
  CudaIpcHandle handle_{};
};

class CudaPoolMapping final : public PoolMapping {
 public:
  CudaPoolMapping(int device, void* base, uint64_t bytes)
      : device_(device), base_(base), bytes_(bytes) {}
  CudaPoolMapping(const CudaPoolMapping&) = delete;
  CudaPoolMapping& operator=(const CudaPoolMapping&) = delete;
  ~CudaPoolMapping() override {
    ScopedDevice scoped(device_);
    cudaIpcCloseMemHandle(base_);
  }

  PoolBackend backend() const override { return PoolBackend::kCuda; }
  uint64_t size_bytes() const override { return bytes_; }
  void* base() const override { return base_; }

 private:
  const int device_;
  void* const base_;
  const uint64_t bytes_;
};

}  // namespace

namespace memory_internal {

absl::StatusOr<void*> CreateCudaStream(int device) {
  ScopedDevice scoped(device);
  if (!scoped.status().ok()) return scoped.status();
  cudaStream_t stream = nullptr;
  if (const cudaError_t e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
      e != cudaSuccess) {
    return absl::InternalError(absl::StrCat("cudaStreamCreateWithFlags: ", CudaErrorText(e)));
  }
  return static_cast<void*>(stream);
}

void DestroyCudaStream(void* stream) {
  if (stream != nullptr) cudaStreamDestroy(static_cast<cudaStream_t>(stream));
}

absl::Status CudaCopyRunsAsync(int device, void* stream, std::span<const CudaCopyRun> runs,
                               CopyDirection direction) {
  ScopedDevice scoped(device);
  if (!scoped.status().ok()) return scoped.status();
  const cudaMemcpyKind kind =
      direction == CopyDirection::kHostToDevice ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost;
  auto* s = static_cast<cudaStream_t>(stream);
  for (const CudaCopyRun& run : runs) {
    if (const cudaError_t e = cudaMemcpyAsync(run.dst, run.src, run.bytes, kind, s);
        e != cudaSuccess) {
      cudaStreamSynchronize(s);  // what was queued finishes before the buffers are reused
      return absl::InternalError(
          absl::StrCat("cudaMemcpyAsync of ", run.bytes, " bytes: ", CudaErrorText(e)));
    }
  }
  if (const cudaError_t e = cudaStreamSynchronize(s); e != cudaSuccess) {
    return absl::InternalError(absl::StrCat("cudaStreamSynchronize: ", CudaErrorText(e)));
  }
  return absl::OkStatus();
}

absl::StatusOr<void*> CudaHostAlloc(uint64_t bytes) {
  void* data = nullptr;
  if (const cudaError_t e = cudaHostAlloc(&data, bytes, cudaHostAllocPortable); e != cudaSuccess) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cudaHostAlloc of ", bytes, " page-locked bytes: ", CudaErrorText(e)));
  }
  return data;
}

void CudaHostFree(void* data) {
  if (data != nullptr) cudaFreeHost(data);
}

absl::Status CudaHostRegister(void* data, uint64_t bytes) {
  if (const cudaError_t e = cudaHostRegister(data, bytes, cudaHostRegisterPortable);
      e != cudaSuccess) {
    return absl::InternalError(
        absl::StrCat("cudaHostRegister of ", bytes, " bytes: ", CudaErrorText(e)));
  }
  return absl::OkStatus();
}

void CudaHostUnregister(void* data) {
  if (data != nullptr) cudaHostUnregister(data);
}

absl::Status CudaCopy(void* dst, const void* src, uint64_t bytes, CopyDirection direction) {
  const cudaMemcpyKind kind =
      direction == CopyDirection::kHostToDevice ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost;
  if (const cudaError_t e = cudaMemcpy(dst, src, bytes, kind); e != cudaSuccess) {
    return absl::InternalError(absl::StrCat("cudaMemcpy of ", bytes, " bytes: ", CudaErrorText(e)));
  }
  return absl::OkStatus();
}

}  // namespace memory_internal

bool CudaBackendCompiled() { return true; }

absl::StatusOr<int> CudaDeviceCount() {
  int count = 0;
  if (const cudaError_t e = cudaGetDeviceCount(&count); e != cudaSuccess) {
    return absl::UnavailableError(
        absl::StrCat("no CUDA device: cudaGetDeviceCount: ", CudaErrorText(e)));
  }
  if (count == 0) {
    return absl::UnavailableError("no CUDA device: cudaGetDeviceCount found 0 devices");
  }
  return count;
}

absl::StatusOr<std::pair<uint64_t, uint64_t>> CudaMemoryInfo(int device) {
  KVCM_RETURN_IF_ERROR(CheckDevice(device));
  ScopedDevice scoped(device);
  KVCM_RETURN_IF_ERROR(scoped.status());
  size_t free_bytes = 0;
  size_t total_bytes = 0;
  if (const cudaError_t e = cudaMemGetInfo(&free_bytes, &total_bytes); e != cudaSuccess) {
    return absl::InternalError(
        absl::StrCat("cudaMemGetInfo on device ", device, ": ", CudaErrorText(e)));
  }
  return std::make_pair(uint64_t{free_bytes}, uint64_t{total_bytes});
}

absl::StatusOr<std::unique_ptr<PoolMemory>> CreateCudaPoolMemory(int device, uint64_t bytes) {
  if (bytes == 0) return absl::InvalidArgumentError("cuda pool: size must be positive");
  KVCM_RETURN_IF_ERROR(CheckDevice(device));
  ScopedDevice scoped(device);
  KVCM_RETURN_IF_ERROR(scoped.status());
  const std::string what = absl::StrCat("cuda pool of ", bytes, " bytes on device ", device);

  void* base = nullptr;
  if (const cudaError_t e = cudaMalloc(&base, bytes); e != cudaSuccess) {
    const std::string error = CudaErrorText(e);
    if (e == cudaErrorMemoryAllocation) {
      size_t free_bytes = 0;
      size_t total_bytes = 0;
      cudaMemGetInfo(&free_bytes, &total_bytes);
      return absl::ResourceExhaustedError(absl::StrCat(
          what, ": cudaMalloc: ", error, "; ", free_bytes, " of ", total_bytes, " bytes free"));
    }
    return absl::InternalError(absl::StrCat(what, ": cudaMalloc: ", error));
  }
  // Owns `base` from here on: every early return below frees it.
  auto pool = std::make_unique<CudaPoolMemory>(device, base, bytes);

  // Zeroed like the shm backend, so that both start in the same state.
  if (const cudaError_t e = cudaMemset(base, 0, bytes); e != cudaSuccess) {
    return absl::InternalError(absl::StrCat(what, ": cudaMemset: ", CudaErrorText(e)));
  }
  if (const cudaError_t e = cudaDeviceSynchronize(); e != cudaSuccess) {
    return absl::InternalError(absl::StrCat(what, ": cudaDeviceSynchronize: ", CudaErrorText(e)));
  }
  cudaIpcMemHandle_t ipc_handle;
  if (const cudaError_t e = cudaIpcGetMemHandle(&ipc_handle, base); e != cudaSuccess) {
    return absl::InternalError(absl::StrCat(what, ": cudaIpcGetMemHandle: ", CudaErrorText(e)));
  }
  CudaIpcHandle handle;
  std::memcpy(handle.data(), &ipc_handle, handle.size());
  pool->set_ipc_handle(handle);
  return pool;
}

absl::StatusOr<std::unique_ptr<PoolMapping>> OpenCudaPool(int device, const CudaIpcHandle& handle,
                                                          uint64_t bytes) {
  if (bytes == 0) return absl::InvalidArgumentError("cuda pool: size must be positive");
  KVCM_RETURN_IF_ERROR(CheckDevice(device));
  ScopedDevice scoped(device);
  KVCM_RETURN_IF_ERROR(scoped.status());
  cudaIpcMemHandle_t ipc_handle;
  std::memcpy(&ipc_handle, handle.data(), handle.size());
  void* base = nullptr;
  if (const cudaError_t e = cudaIpcOpenMemHandle(&base, ipc_handle, cudaIpcMemLazyEnablePeerAccess);
      e != cudaSuccess) {
    return absl::FailedPreconditionError(
        absl::StrCat("cudaIpcOpenMemHandle on device ", device, ": ", CudaErrorText(e),
                     "; a handle cannot be opened in the process that exported it nor twice in one "
                     "process, and its exporter must still be alive"));
  }
  return std::make_unique<CudaPoolMapping>(device, base, bytes);
}

}  // namespace kvcm
