#pragma once
// Reading (and, for the tiny-model generator and tests, writing) Hugging Face
// `.safetensors` files.
//
// Format (https://github.com/huggingface/safetensors):
//
//   [8 bytes] N, little-endian uint64: length of the header
//   [N bytes] UTF-8 JSON object: "<tensor name>": {"dtype": "F32", "shape": [2, 3],
//             "data_offsets": [begin, end]}, plus an optional "__metadata__" object of
//             string -> string
//   [rest]    the data section; a tensor's bytes are data[begin, end), row-major
//
// SafetensorsFile maps a file read-only and validates the whole header at Open, before any
// tensor is read: every entry has a known dtype, a non-negative shape, offsets with
// begin <= end inside the data section, end - begin == product(shape) x dtype size, and no
// two tensors overlap (gaps are tolerated). Errors name the file and the tensor:
//
//   NOT_FOUND         the file cannot be opened
//   DATA_LOSS         the file is shorter than its header says (truncated): header length
//                     past the end of the file, or a tensor's bytes past the end
//   INVALID_ARGUMENT  anything else malformed: bad JSON, a missing or mistyped field, an
//                     unknown dtype, begin > end, overlapping tensors, a byte length that
//                     does not match the shape, an absurd header length
//   UNIMPLEMENTED     (LoadFloat32) a valid tensor whose dtype has no fp32 conversion here
//                     (only F32, F16 and BF16 do)
//
// SafetensorsFolder opens every shard of a model folder: the files named by
// `model.safetensors.index.json` when it exists, else every `*.safetensors` in the folder.
//
// Thread safety: after Open, both classes are immutable; concurrent reads are safe.

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace kvcm {

// One tensor's header entry.
struct SafetensorsTensorInfo {
  std::string name;
  std::string dtype;           // as written: "F32", "BF16", "I64", ...
  std::vector<int64_t> shape;  // row-major; empty for a scalar
  uint64_t begin = 0;          // byte offsets into the data section
  uint64_t end = 0;

  int64_t NumElements() const;  // product of shape (1 for a scalar)
};

// Bytes per element of a safetensors dtype name, or 0 when the name is unknown.
// Known: BOOL U8 I8 F8_E4M3 F8_E5M2 (1), U16 I16 F16 BF16 (2), U32 I32 F32 (4),
// U64 I64 F64 (8).
int32_t SafetensorsDTypeBytes(const std::string& dtype);

// Largest header accepted (the reference implementation's limit): 100 MB.
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100'000'000;

class SafetensorsFile {
 public:
  // Maps `path` and validates its header (see the error list above).
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);

  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;
  ~SafetensorsFile();

  const std::string& path() const { return path_; }
  // Every tensor entry, sorted by name.
  const std::vector<SafetensorsTensorInfo>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  // The entry named `name`, or nullptr.
  const SafetensorsTensorInfo* Find(const std::string& name) const;

  // The raw bytes of a tensor (little-endian, row-major), pointing into the mapping.
  // NOT_FOUND when there is no such tensor.
  absl::StatusOr<std::span<const std::byte>> RawBytes(const std::string& name) const;

  // The tensor converted to fp32. NOT_FOUND when absent; UNIMPLEMENTED naming the tensor
  // and dtype unless it is F32, F16 or BF16.
  absl::StatusOr<std::vector<float>> LoadFloat32(const std::string& name) const;

 private:
  SafetensorsFile() = default;

  std::string path_;
  const std::byte* map_ = nullptr;  // the whole file, read-only; owned
  size_t map_size_ = 0;
  const std::byte* data_ = nullptr;  // start of the data section, inside map_
  std::vector<SafetensorsTensorInfo> tensors_;
  absl::flat_hash_map<std::string, size_t> index_;  // name -> position in tensors_
  std::map<std::string, std::string> metadata_;
};

// All safetensors shards of one model folder, as one name space.
class SafetensorsFolder {
 public:
  // Opens the shards of `folder`:
  //   - with `model.safetensors.index.json`: the files its "weight_map" names (each opened
  //     once); every tensor the map lists must be in the file it names, else
  //     INVALID_ARGUMENT naming the tensor and both files;
  //   - otherwise every file ending in ".safetensors", in name order.
  // NOT_FOUND when the folder has no shard. INVALID_ARGUMENT when two shards hold a tensor
  // of the same name (naming it and both files). Errors of SafetensorsFile::Open pass
  // through.
  static absl::StatusOr<std::unique_ptr<SafetensorsFolder>> Open(const std::string& folder);

  // The shard holding `name` and its entry, or {nullptr, nullptr}.
  std::pair<const SafetensorsFile*, const SafetensorsTensorInfo*> Find(
      const std::string& name) const;

  // LoadFloat32 from whichever shard holds `name`; NOT_FOUND names the folder.
  absl::StatusOr<std::vector<float>> LoadFloat32(const std::string& name) const;

  const std::vector<std::unique_ptr<SafetensorsFile>>& files() const { return files_; }

 private:
  std::string folder_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  absl::flat_hash_map<std::string, size_t> owner_;  // tensor name -> index in files_
};

// ---- Writing -----------------------------------------------------------------------------

// One tensor to write: `data` holds exactly product(shape) x SafetensorsDTypeBytes(dtype)
// little-endian bytes.
struct SafetensorsTensorToWrite {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  std::vector<std::byte> data;
};

// Writes a safetensors file with the tensors laid out back to back in the given order and
// the header padded with spaces to a multiple of 8 bytes (as the reference writer does).
// INVALID_ARGUMENT when a tensor's byte length does not match its shape and dtype, a name
// repeats or is "__metadata__"; INTERNAL naming the path when the file cannot be written.
absl::Status WriteSafetensors(const std::string& path,
                              const std::vector<SafetensorsTensorToWrite>& tensors,
                              const std::map<std::string, std::string>& metadata = {});

// fp32 values encoded as "F32", "F16" or "BF16" (round to nearest even) for writing.
// INVALID_ARGUMENT for any other dtype.
absl::StatusOr<std::vector<std::byte>> EncodeFloat32As(std::span<const float> values,
                                                       const std::string& dtype);

}  // namespace kvcm
