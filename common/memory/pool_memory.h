#pragma once

// Pool memory: the one arena of KV-cache blocks that the cache manager owns and other
// processes map (docs/architecture.md). Two backends:
//
//   shm   A sealed memfd (MFD_CLOEXEC | MFD_ALLOW_SEALING; F_SEAL_SHRINK | F_SEAL_GROW |
//         F_SEAL_SEAL), mapped MAP_SHARED. Attachers receive the descriptor over the Unix
//         socket side channel (fd_channel.h) and map it with MapShmPool. Nothing is created
//         in /dev/shm and nothing outlives the last process holding the descriptor or a
//         mapping, so a crash leaves nothing behind.
//   cuda  One cudaMalloc on one device; attachers open its 64-byte legacy IPC handle once
//         with OpenCudaPool. Built only when the CUDA toolkit was found (KVCM_CUDA_ENABLED);
//         otherwise the CUDA functions here return UNAVAILABLE "kvcm was built without
//         CUDA".
//
// The owner side is PoolMemory, the attacher side PoolMapping; both are interfaces so that
// services and tests can swap backends. Neither type knows the layout of the blocks inside
// (pool_layout.h does).
//
// Thread safety: PoolMemory and PoolMapping objects do not change after creation; their
// accessors may be called from any thread. Who writes which bytes of the arena is the
// callers' business (the block ledger decides). The free functions are thread-safe.

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/base/unique_fd.h"

namespace kvcm {

enum class PoolBackend : uint8_t { kShm, kCuda };

// "shm" or "cuda".
std::string_view PoolBackendName(PoolBackend backend);

// Parses "shm" or "cuda" (case-insensitive, surrounding blanks ignored); anything else is
// INVALID_ARGUMENT listing both. ("auto" is a command-line choice, resolved by the caller
// with CudaDeviceCount(), not a backend.)
absl::StatusOr<PoolBackend> ParsePoolBackend(std::string_view name);

// The bytes of a cudaIpcMemHandle_t, as they travel in the pool descriptor.
using CudaIpcHandle = std::array<uint8_t, 64>;

// The owner's side of the arena: the cache manager creates it and keeps it for its
// lifetime. Destroying it releases the memory (munmap and close for shm, cudaFree for
// cuda); for shm the pages live on while attachers still map them.
class PoolMemory {
 public:
  virtual ~PoolMemory() = default;

  virtual PoolBackend backend() const = 0;
  virtual uint64_t size_bytes() const = 0;
  // Start of the arena: a host pointer for shm, a device pointer for cuda. Valid for this
  // object's lifetime.
  virtual void* base() const = 0;
  // shm: the sealed memfd, owned by this object (send it, do not close it); -1 for cuda.
  virtual int shareable_fd() const = 0;
  // cuda: the IPC handle of the allocation; nullopt for shm.
  virtual std::optional<CudaIpcHandle> cuda_ipc_handle() const = 0;
  // cuda: the device index the arena lives on; -1 for shm.
  virtual int cuda_device() const = 0;
};

// An attacher's view of an owner's arena. Destroying it unmaps (shm) or closes the IPC
// mapping (cuda); the owner's memory is untouched.
class PoolMapping {
 public:
  virtual ~PoolMapping() = default;

  virtual PoolBackend backend() const = 0;
  virtual uint64_t size_bytes() const = 0;
  // Start of the arena in this process: host pointer (shm) or device pointer (cuda).
  virtual void* base() const = 0;
};

// ---- shm backend -------------------------------------------------------------------------

// Creates a zeroed arena of `bytes` bytes backed by a sealed memfd named "kvcm:<name>"
// (the name shows in /proc/<pid>/fd and /proc/<pid>/maps as "/memfd:kvcm:<name>"). The
// pages are reserved up front with fallocate, so a pool that does not fit fails here
// rather than with SIGBUS on first touch; this costs time proportional to `bytes` (the
// kernel zeroes the pages).
// INVALID_ARGUMENT when bytes is 0; RESOURCE_EXHAUSTED when memory runs out (ENOMEM,
// ENOSPC); other failures carry the errno text, the step that failed and the byte count.
absl::StatusOr<std::unique_ptr<PoolMemory>> CreateShmPoolMemory(uint64_t bytes,
                                                                const std::string& name);

// Maps an owner's shm arena received from a peer, read/write MAP_SHARED, taking ownership
// of `fd` (closed once mapped: the mapping keeps the memory alive).
// FAILED_PRECONDITION when the file's size is not `expected_bytes` or it is not sealed
// against growing and shrinking (a peer that could shrink the file could make our reads
// fault with SIGBUS); INVALID_ARGUMENT when fd is not valid.
absl::StatusOr<std::unique_ptr<PoolMapping>> MapShmPool(UniqueFd fd, uint64_t expected_bytes);

// MemAvailable from /proc/meminfo, in bytes: the basis for --memory-fraction with the shm
// backend. Does not look at cgroup limits. INTERNAL when the file cannot be read or parsed.
absl::StatusOr<uint64_t> AvailableHostMemoryBytes();

// ---- cuda backend ------------------------------------------------------------------------

// True when this build has the CUDA backend (KVCM_CUDA_ENABLED).
bool CudaBackendCompiled();

// Number of CUDA devices. UNAVAILABLE with a message starting "no CUDA device: " when there
// is none, no driver, or the backend was not compiled.
absl::StatusOr<int> CudaDeviceCount();

// (free, total) bytes of device memory on `device`, as cudaMemGetInfo reports them.
// UNAVAILABLE as CudaDeviceCount; INVALID_ARGUMENT "no CUDA device <n>: ..." for a device
// index out of range.
absl::StatusOr<std::pair<uint64_t, uint64_t>> CudaMemoryInfo(int device);

// Allocates a zeroed arena of `bytes` bytes on `device` with cudaMalloc and exports its
// IPC handle. The calling thread's current device is restored before returning.
// INVALID_ARGUMENT when bytes is 0; UNAVAILABLE and INVALID_ARGUMENT as CudaMemoryInfo
// (either message starts "no CUDA device"); RESOURCE_EXHAUSTED when cudaMalloc runs out
// of memory (the message has the bytes asked for and the device's free bytes); INTERNAL
// for other CUDA errors.
absl::StatusOr<std::unique_ptr<PoolMemory>> CreateCudaPoolMemory(int device, uint64_t bytes);

// Opens an owner's arena from its IPC handle (cudaIpcOpenMemHandle with
// cudaIpcMemLazyEnablePeerAccess) on `device`. Call it once per process and handle: a
// legacy IPC handle cannot be opened in the process that exported it, nor twice in one
// context; both fail here with FAILED_PRECONDITION naming the CUDA error (in the exporting
// process CUDA 13 says cudaErrorDeviceUninitialized, "invalid device context"). `bytes` is the
// arena size from the descriptor (the runtime API cannot check it against the allocation).
// INVALID_ARGUMENT when bytes is 0; UNAVAILABLE and INVALID_ARGUMENT as CudaMemoryInfo.
absl::StatusOr<std::unique_ptr<PoolMapping>> OpenCudaPool(int device, const CudaIpcHandle& handle,
                                                          uint64_t bytes);

// ---- copies, for either backend ----------------------------------------------------------

// Copies `bytes` bytes between host memory and the arena at `offset`: memcpy for shm,
// synchronous cudaMemcpy for cuda. OUT_OF_RANGE when [offset, offset + bytes) is not
// inside the arena; INTERNAL when cudaMemcpy fails. For tests and tools, not the data
// path (executors copy with their own streams).
absl::Status CopyToPool(PoolMapping& pool, uint64_t offset, const void* src, uint64_t bytes);
absl::Status CopyFromPool(const PoolMapping& pool, uint64_t offset, void* dst, uint64_t bytes);
absl::Status CopyToPool(PoolMemory& pool, uint64_t offset, const void* src, uint64_t bytes);
absl::Status CopyFromPool(const PoolMemory& pool, uint64_t offset, void* dst, uint64_t bytes);

}  // namespace kvcm
