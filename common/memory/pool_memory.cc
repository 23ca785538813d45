// The backend-independent parts of pool_memory.h: names, host memory, copies.

#include "common/memory/pool_memory.h"

#include <cstdint>
#include <cstring>
#include <fstream>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "common/base/check.h"
#include "common/memory/cuda_copy_internal.h"

namespace kvcm {
namespace {

using memory_internal::CopyDirection;

absl::Status CheckRange(uint64_t size, uint64_t offset, uint64_t bytes) {
  if (offset <= size && bytes <= size - offset) return absl::OkStatus();
  return absl::OutOfRangeError(absl::StrCat("pool copy of ", bytes, " bytes at offset ", offset,
                                            " is outside the ", size, "-byte pool"));
}

absl::Status CopyIn(PoolBackend backend, void* base, uint64_t size, uint64_t offset,
                    const void* src, uint64_t bytes) {
  if (absl::Status s = CheckRange(size, offset, bytes); !s.ok()) return s;
  if (bytes == 0) return absl::OkStatus();
  char* dst = static_cast<char*>(base) + offset;
  switch (backend) {
    case PoolBackend::kShm:
      std::memcpy(dst, src, bytes);
      return absl::OkStatus();
    case PoolBackend::kCuda:
      return memory_internal::CudaCopy(dst, src, bytes, CopyDirection::kHostToDevice);
  }
  KVCM_CHECK(false) << "unknown PoolBackend " << static_cast<int>(backend);
  return absl::InternalError("unreachable");
}

absl::Status CopyOut(PoolBackend backend, const void* base, uint64_t size, uint64_t offset,
                     void* dst, uint64_t bytes) {
  if (absl::Status s = CheckRange(size, offset, bytes); !s.ok()) return s;
  if (bytes == 0) return absl::OkStatus();
  const char* src = static_cast<const char*>(base) + offset;
  switch (backend) {
    case PoolBackend::kShm:
      std::memcpy(dst, src, bytes);
      return absl::OkStatus();
    case PoolBackend::kCuda:
      return memory_internal::CudaCopy(dst, src, bytes, CopyDirection::kDeviceToHost);
  }
  KVCM_CHECK(false) << "unknown PoolBackend " << static_cast<int>(backend);
  return absl::InternalError("unreachable");
}

}  // namespace

std::string_view PoolBackendName(PoolBackend backend) {
  switch (backend) {
    case PoolBackend::kShm:
      return "shm";
    case PoolBackend::kCuda:
      return "cuda";
  }
  KVCM_CHECK(false) << "unknown PoolBackend " << static_cast<int>(backend);
  return "";
}

absl::StatusOr<PoolBackend> ParsePoolBackend(std::string_view name) {
  // Debian's Abseil has its own absl::string_view, distinct from std::string_view.
  const std::string lower = absl::AsciiStrToLower(
      absl::StripAsciiWhitespace(absl::string_view(name.data(), name.size())));
  if (lower == "shm") return PoolBackend::kShm;
  if (lower == "cuda") return PoolBackend::kCuda;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown pool backend \"", std::string(name), "\"; use shm or cuda"));
}

absl::StatusOr<uint64_t> AvailableHostMemoryBytes() {
  std::ifstream meminfo("/proc/meminfo");
  if (!meminfo) return absl::InternalError("cannot open /proc/meminfo");
  std::string line;
  while (std::getline(meminfo, line)) {
    // "MemAvailable:   24320888 kB"
    absl::string_view rest(line);
    if (!absl::ConsumePrefix(&rest, "MemAvailable:")) continue;
    rest = absl::StripAsciiWhitespace(rest);
    if (!absl::ConsumeSuffix(&rest, "kB")) break;
    uint64_t kib = 0;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(rest), &kib)) break;
    return kib * 1024;
  }
  return absl::InternalError("/proc/meminfo has no readable \"MemAvailable: <n> kB\" line");
}

absl::Status CopyToPool(PoolMapping& pool, uint64_t offset, const void* src, uint64_t bytes) {
  return CopyIn(pool.backend(), pool.base(), pool.size_bytes(), offset, src, bytes);
}

absl::Status CopyFromPool(const PoolMapping& pool, uint64_t offset, void* dst, uint64_t bytes) {
  return CopyOut(pool.backend(), pool.base(), pool.size_bytes(), offset, dst, bytes);
}

absl::Status CopyToPool(PoolMemory& pool, uint64_t offset, const void* src, uint64_t bytes) {
  return CopyIn(pool.backend(), pool.base(), pool.size_bytes(), offset, src, bytes);
}

absl::Status CopyFromPool(const PoolMemory& pool, uint64_t offset, void* dst, uint64_t bytes) {
  return CopyOut(pool.backend(), pool.base(), pool.size_bytes(), offset, dst, bytes);
}

}  // namespace kvcm
