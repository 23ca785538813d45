#include "common/memory/pool_copier.h"

#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/memory/cuda_copy_internal.h"

namespace kvcm {
namespace {

using memory_internal::CopyDirection;
using memory_internal::CudaCopyRun;

absl::Status CheckRuns(const PoolMemory& pool, std::span<const PoolCopier::Run> runs) {
  for (const PoolCopier::Run& run : runs) {
    if (run.pool_offset > pool.size_bytes() || run.bytes > pool.size_bytes() - run.pool_offset) {
      return absl::OutOfRangeError(absl::StrCat("pool copy of ", run.bytes, " bytes at offset ",
                                                run.pool_offset, " is outside the ",
                                                pool.size_bytes(), "-byte pool"));
    }
  }
  return absl::OkStatus();
}

class HostPoolCopier final : public PoolCopier {
 public:
  explicit HostPoolCopier(PoolMemory* pool) : pool_(pool) {}

  absl::Status Gather(std::span<const Run> runs, uint8_t* dst) override {
    if (absl::Status checked = CheckRuns(*pool_, runs); !checked.ok()) return checked;
    const auto* base = static_cast<const uint8_t*>(pool_->base());
    for (const Run& run : runs) {
      std::memcpy(dst, base + run.pool_offset, run.bytes);
      dst += run.bytes;
    }
    return absl::OkStatus();
  }

  absl::Status Scatter(const uint8_t* src, std::span<const Run> runs) override {
    if (absl::Status checked = CheckRuns(*pool_, runs); !checked.ok()) return checked;
    auto* base = static_cast<uint8_t*>(pool_->base());
    for (const Run& run : runs) {
      std::memcpy(base + run.pool_offset, src, run.bytes);
      src += run.bytes;
    }
    return absl::OkStatus();
  }

 private:
  PoolMemory* const pool_;
};

class CudaPoolCopier final : public PoolCopier {
 public:
  CudaPoolCopier(PoolMemory* pool, void* stream) : pool_(pool), stream_(stream) {}
  ~CudaPoolCopier() override { memory_internal::DestroyCudaStream(stream_); }

  absl::Status Gather(std::span<const Run> runs, uint8_t* dst) override {
    if (absl::Status checked = CheckRuns(*pool_, runs); !checked.ok()) return checked;
    const auto* base = static_cast<const uint8_t*>(pool_->base());
    runs_.clear();
    for (const Run& run : runs) {
      runs_.push_back({dst, base + run.pool_offset, run.bytes});
      dst += run.bytes;
    }
    return memory_internal::CudaCopyRunsAsync(pool_->cuda_device(), stream_, runs_,
                                              CopyDirection::kDeviceToHost);
  }

  absl::Status Scatter(const uint8_t* src, std::span<const Run> runs) override {
    if (absl::Status checked = CheckRuns(*pool_, runs); !checked.ok()) return checked;
    auto* base = static_cast<uint8_t*>(pool_->base());
    runs_.clear();
    for (const Run& run : runs) {
      runs_.push_back({base + run.pool_offset, src, run.bytes});
      src += run.bytes;
    }
    return memory_internal::CudaCopyRunsAsync(pool_->cuda_device(), stream_, runs_,
                                              CopyDirection::kHostToDevice);
  }

 private:
  PoolMemory* const pool_;
  void* const stream_;
  std::vector<CudaCopyRun> runs_;  // reused from copy to copy
};

}  // namespace

absl::StatusOr<std::unique_ptr<PoolCopier>> PoolCopier::Create(PoolMemory* pool) {
  if (pool->backend() == PoolBackend::kShm) return std::make_unique<HostPoolCopier>(pool);
  absl::StatusOr<void*> stream = memory_internal::CreateCudaStream(pool->cuda_device());
  if (!stream.ok()) return stream.status();
  return std::make_unique<CudaPoolCopier>(pool, *stream);
}

absl::StatusOr<HostBuffer> HostBuffer::Allocate(PoolBackend backend, uint64_t bytes) {
  HostBuffer buffer;
  buffer.size_ = bytes;
  if (backend == PoolBackend::kCuda) {
    // cudaHostAlloc's memory is page-aligned.
    absl::StatusOr<void*> data = memory_internal::CudaHostAlloc(bytes);
    if (!data.ok()) return data.status();
    buffer.data_ = static_cast<uint8_t*>(*data);
    buffer.page_locked_ = true;
    return buffer;
  }
  const uint64_t rounded = (bytes + 4095) / 4096 * 4096;
  buffer.data_ = static_cast<uint8_t*>(std::aligned_alloc(4096, rounded == 0 ? 4096 : rounded));
  if (buffer.data_ == nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", bytes, " host bytes"));
  }
  return buffer;
}

HostBuffer& HostBuffer::operator=(HostBuffer&& other) noexcept {
  if (this != &other) {
    this->~HostBuffer();
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    page_locked_ = std::exchange(other.page_locked_, false);
  }
  return *this;
}

HostBuffer::~HostBuffer() {
  if (data_ == nullptr) return;
  if (page_locked_) {
    memory_internal::CudaHostFree(data_);
  } else {
    std::free(data_);
  }
  data_ = nullptr;
}

absl::Status PinForDevice(PoolBackend backend, void* data, uint64_t bytes) {
  if (backend != PoolBackend::kCuda) return absl::OkStatus();
  return memory_internal::CudaHostRegister(data, bytes);
}

void UnpinForDevice(PoolBackend backend, void* data) {
  if (backend == PoolBackend::kCuda) memory_internal::CudaHostUnregister(data);
}

}  // namespace kvcm
