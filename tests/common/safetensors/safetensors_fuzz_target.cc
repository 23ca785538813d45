// The fuzz target of SafetensorsFile::Open (tests/support/fuzz_target.h): the input is a
// whole .safetensors file, written to a memfd and opened by its /proc/self/fd path, so the
// real open, map and header validation run. Any bytes are accepted or refused with
// DATA_LOSS or INVALID_ARGUMENT (the header's error list), never a crash or an exception;
// an accepted file's tensors lie inside its data section with the byte size their shape and
// dtype say, and the F32, F16 and BF16 ones load as fp32 (the rest are UNIMPLEMENTED).
// Seeds: tests/common/safetensors/fuzz/safetensors/ (make_safetensors_seeds.py).

#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/safetensors/safetensors.h"
#include "tests/support/fuzz_target.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using kvcm::fuzz::Check;
  static const int fd = ::memfd_create("fuzz.safetensors", MFD_CLOEXEC);
  Check(fd >= 0, "memfd_create");
  Check(::ftruncate(fd, 0) == 0, "ftruncate");
  size_t written = 0;
  while (written < size) {
    const ssize_t n = ::pwrite(fd, data + written, size - written, static_cast<off_t>(written));
    Check(n > 0, "pwrite");
    written += static_cast<size_t>(n);
  }
  static const std::string path = absl::StrCat("/proc/self/fd/", fd);

  absl::StatusOr<std::unique_ptr<kvcm::SafetensorsFile>> file = kvcm::SafetensorsFile::Open(path);
  if (!file.ok()) {
    Check(file.status().code() == absl::StatusCode::kDataLoss ||
              file.status().code() == absl::StatusCode::kInvalidArgument,
          "a refused file is DATA_LOSS or INVALID_ARGUMENT");
    return 0;
  }
  for (const kvcm::SafetensorsTensorInfo& t : (*file)->tensors()) {
    Check((*file)->Find(t.name) == &t, "Find finds each tensor");
    absl::StatusOr<std::span<const std::byte>> raw = (*file)->RawBytes(t.name);
    Check(raw.ok(), "RawBytes of a listed tensor");
    Check(t.end >= t.begin && raw->size() == t.end - t.begin, "a tensor's bytes are its range");
    Check(static_cast<uint64_t>(t.NumElements()) *
                  static_cast<uint64_t>(kvcm::SafetensorsDTypeBytes(t.dtype)) ==
              raw->size(),
          "a tensor's byte size is its shape times its dtype's");
    absl::StatusOr<std::vector<float>> values = (*file)->LoadFloat32(t.name);
    const bool convertible = t.dtype == "F32" || t.dtype == "F16" || t.dtype == "BF16";
    if (convertible) {
      Check(values.ok() && values->size() == static_cast<size_t>(t.NumElements()),
            "an F32, F16 or BF16 tensor loads");
    } else {
      Check(!values.ok() && values.status().code() == absl::StatusCode::kUnimplemented,
            "other dtypes are UNIMPLEMENTED");
    }
  }
  kvcm::fuzz::NoteAccepted();
  return 0;
}
