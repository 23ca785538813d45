// The shm backend of pool_memory.h: a sealed memfd, mapped MAP_SHARED.

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/base/unique_fd.h"
#include "common/memory/pool_memory.h"

namespace kvcm {
namespace {

// memfd names are limited to 249 bytes (NAME_MAX minus the "memfd:" prefix).
constexpr size_t kMaxMemfdNameBytes = 249;
constexpr int kResizeSeals = F_SEAL_SHRINK | F_SEAL_GROW;

// `what` followed by the errno text; the code follows errno (ENOMEM and ENOSPC give
// RESOURCE_EXHAUSTED).
absl::Status ErrnoError(int err, const std::string& what) { return absl::ErrnoToStatus(err, what); }

// A MAP_SHARED read/write mapping of a whole file, unmapped on destruction.
class ShmRegion {
 public:
  static absl::StatusOr<ShmRegion> Map(int fd, uint64_t bytes, const std::string& what) {
    void* base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) {
      return ErrnoError(errno, absl::StrCat(what, ": mmap of ", bytes, " bytes"));
    }
    return ShmRegion(base, bytes);
  }

  ShmRegion(ShmRegion&& other) noexcept
      : base_(std::exchange(other.base_, nullptr)), bytes_(other.bytes_) {}
  ShmRegion& operator=(ShmRegion&&) = delete;
  ShmRegion(const ShmRegion&) = delete;
  ShmRegion& operator=(const ShmRegion&) = delete;
  ~ShmRegion() {
    if (base_ != nullptr) ::munmap(base_, bytes_);
  }

  void* base() const { return base_; }
  uint64_t bytes() const { return bytes_; }

 private:
  ShmRegion(void* base, uint64_t bytes) : base_(base), bytes_(bytes) {}

  void* base_;
  uint64_t bytes_;
};

class ShmPoolMemory final : public PoolMemory {
 public:
  ShmPoolMemory(UniqueFd fd, ShmRegion region) : fd_(std::move(fd)), region_(std::move(region)) {}

  PoolBackend backend() const override { return PoolBackend::kShm; }
  uint64_t size_bytes() const override { return region_.bytes(); }
  void* base() const override { return region_.base(); }
  int shareable_fd() const override { return fd_.get(); }
  std::optional<CudaIpcHandle> cuda_ipc_handle() const override { return std::nullopt; }
  int cuda_device() const override { return -1; }

 private:
  UniqueFd fd_;
  ShmRegion region_;
};

class ShmPoolMapping final : public PoolMapping {
 public:
  explicit ShmPoolMapping(ShmRegion region) : region_(std::move(region)) {}

  PoolBackend backend() const override { return PoolBackend::kShm; }
  uint64_t size_bytes() const override { return region_.bytes(); }
  void* base() const override { return region_.base(); }

 private:
  ShmRegion region_;
};

absl::Status CheckSize(uint64_t bytes, const char* what) {
  if (bytes == 0) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": pool size must be positive"));
  }
  if (bytes > static_cast<uint64_t>(std::numeric_limits<off_t>::max())) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": pool size ", bytes, " bytes does not fit in off_t"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<PoolMemory>> CreateShmPoolMemory(uint64_t bytes,
                                                                const std::string& name) {
  if (absl::Status s = CheckSize(bytes, "shm pool"); !s.ok()) return s;
  const std::string what = absl::StrCat("shm pool \"", name, "\" of ", bytes, " bytes");

  // fallocate on a memfd takes pages until the machine runs out, and the OOM killer does
  // not count unmapped shmem pages against us, so an oversized pool could get some other
  // process killed. Refuse what clearly cannot fit.
  if (absl::StatusOr<uint64_t> available = AvailableHostMemoryBytes();
      available.ok() && bytes > *available) {
    return absl::ResourceExhaustedError(
        absl::StrCat(what, ": only ", *available, " bytes of host memory are available"));
  }

  const std::string memfd_name = absl::StrCat("kvcm:", name).substr(0, kMaxMemfdNameBytes);
  UniqueFd fd(::memfd_create(memfd_name.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!fd.valid()) return ErrnoError(errno, absl::StrCat(what, ": memfd_create"));
  if (::ftruncate(fd.get(), static_cast<off_t>(bytes)) != 0) {
    return ErrnoError(errno, absl::StrCat(what, ": ftruncate"));
  }
  // Reserve the pages now: ENOMEM/ENOSPC here instead of SIGBUS on first touch.
  if (const int err = ::posix_fallocate(fd.get(), 0, static_cast<off_t>(bytes)); err != 0) {
    return ErrnoError(err, absl::StrCat(what, ": fallocate"));
  }
  if (::fcntl(fd.get(), F_ADD_SEALS, kResizeSeals | F_SEAL_SEAL) != 0) {
    return ErrnoError(errno, absl::StrCat(what, ": sealing (F_ADD_SEALS)"));
  }
  absl::StatusOr<ShmRegion> region = ShmRegion::Map(fd.get(), bytes, what);
  if (!region.ok()) return region.status();
  return std::make_unique<ShmPoolMemory>(std::move(fd), *std::move(region));
}

absl::StatusOr<std::unique_ptr<PoolMapping>> MapShmPool(UniqueFd fd, uint64_t expected_bytes) {
  if (!fd.valid()) {
    return absl::InvalidArgumentError("MapShmPool: no file descriptor");
  }
  if (absl::Status s = CheckSize(expected_bytes, "MapShmPool"); !s.ok()) return s;
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return ErrnoError(errno, "MapShmPool: fstat");
  if (!S_ISREG(st.st_mode) || static_cast<uint64_t>(st.st_size) != expected_bytes) {
    return absl::FailedPreconditionError(absl::StrCat("shm pool: the received file is ", st.st_size,
                                                      " bytes but the pool descriptor says ",
                                                      expected_bytes));
  }
  const int seals = ::fcntl(fd.get(), F_GET_SEALS);
  if (seals < 0) {
    return absl::FailedPreconditionError(
        ErrnoError(errno,
                   "shm pool: the received descriptor is not a sealable memfd "
                   "(F_GET_SEALS)")
            .message());
  }
  if ((seals & kResizeSeals) != kResizeSeals) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "shm pool: the received memfd is not sealed against resizing (seals 0x%x, need "
        "F_SEAL_SHRINK | F_SEAL_GROW); refusing to map memory its owner could shrink",
        seals));
  }
  absl::StatusOr<ShmRegion> region = ShmRegion::Map(
      fd.get(), expected_bytes, absl::StrCat("shm pool of ", expected_bytes, " bytes"));
  if (!region.ok()) return region.status();
  return std::make_unique<ShmPoolMapping>(*std::move(region));
}

}  // namespace kvcm
