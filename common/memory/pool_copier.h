#pragma once
// PoolCopier and HostBuffer: bulk copies between a pool (pool_memory.h) and host memory for
// a thread that does many of them, the cache manager's tier movers (docs/architecture.md,
// "Tiers").
//
//   shm   memcpy of each run; HostBuffer is aligned_alloc'd (4096-byte aligned, for O_DIRECT).
//   cuda  each copier owns a CUDA stream: a Gather or Scatter queues one cudaMemcpyAsync per
//         run on it and waits for the stream once, so that the runs of one block go out
//         back to back and nothing waits on other threads' work (the default stream would
//         serialise with it). HostBuffer is page-locked (cudaHostAlloc), so the copies run
//         at the link's speed without a staging copy by the driver; PinForDevice page-locks
//         memory allocated elsewhere (cudaHostRegister), such as a disk tier's slot buffer.
//
// Thread safety: a PoolCopier is used by one thread at a time. HostBuffer is a plain owner.

#include <cstdint>
#include <memory>
#include <span>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/memory/pool_memory.h"

namespace kvcm {

class PoolCopier {
 public:
  // A run of bytes of the pool.
  struct Run {
    uint64_t pool_offset = 0;
    uint64_t bytes = 0;
  };

  // A copier for `pool`, which must outlive it. cuda: creates the stream on the pool's
  // device (INTERNAL with the CUDA error on failure; UNAVAILABLE without CUDA).
  static absl::StatusOr<std::unique_ptr<PoolCopier>> Create(PoolMemory* pool);
  virtual ~PoolCopier() = default;

  // Copies each run of the pool, in order, into consecutive bytes from `dst`, and returns
  // once they are there. OUT_OF_RANGE for a run outside the pool (nothing copied).
  virtual absl::Status Gather(std::span<const Run> runs, uint8_t* dst) = 0;
  // Copies consecutive bytes from `src` into each run of the pool, in order, and returns
  // once they are there (visible to every process that maps the pool).
  virtual absl::Status Scatter(const uint8_t* src, std::span<const Run> runs) = 0;
};

// Host memory for copies to and from a pool of `backend`: page-locked for cuda, 4096-byte
// aligned for both. RESOURCE_EXHAUSTED when it cannot be had.
class HostBuffer {
 public:
  static absl::StatusOr<HostBuffer> Allocate(PoolBackend backend, uint64_t bytes);
  HostBuffer() = default;
  HostBuffer(HostBuffer&& other) noexcept { *this = std::move(other); }
  HostBuffer& operator=(HostBuffer&& other) noexcept;
  ~HostBuffer();

  uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }
  bool page_locked() const { return page_locked_; }

 private:
  uint8_t* data_ = nullptr;
  uint64_t size_ = 0;
  bool page_locked_ = false;
};

// cuda: page-locks `bytes` bytes at `data` (cudaHostRegister) until UnpinForDevice, so that
// copies between it and the device need no staging; shm: nothing. INTERNAL on failure.
absl::Status PinForDevice(PoolBackend backend, void* data, uint64_t bytes);
void UnpinForDevice(PoolBackend backend, void* data);

}  // namespace kvcm
