#pragma once
// GgufFile: a GGUF file (llama.cpp's model format, versions 2 and 3) read into its header,
// metadata and tensor infos, with the tensor data used in place.
//
// Layout (little-endian): "GGUF", u32 version, u64 tensor count, u64 key/value count; the
// key/values (string key, u32 value type, value); the tensor infos (string name, u32 dims,
// u64 ne[dims] with ne[0] the contiguous one, u32 ggml type, u64 offset from the data
// section); padding to `general.alignment` (a uint32 power of two, 32 when absent); the
// data section. A string is a u64 byte count and UTF-8 bytes; an array is a u32 element
// type, a u64 count and the elements (arrays of arrays nest).
//
//   auto file = GgufFile::Open(path);          // mmap, read-only, MAP_SHARED
//   auto arch = (*file)->GetString("general.architecture");
//   auto t = (*file)->FindTensor("token_embd.weight");   // (*t)->data: its bytes
//   std::vector<float> w((*t)->element_count);
//   Dequantize((*t)->type, (*t)->data, w);
//
// Open maps the file with MAP_SHARED, so processes that load the same model share its page
// cache; FromBuffer reads bytes the caller keeps alive for the GgufFile's lifetime. Nothing
// is copied except metadata values and names. Every count, length and offset is checked
// against the bytes there are before it is used: a malformed file is an error, never a
// crash, an out-of-bounds read or an allocation sized by an absurd count.
//
// Errors of Open/FromBuffer: NOT_FOUND (no such file; other open/mmap failures are
// INTERNAL), INVALID_ARGUMENT naming the file and the key or tensor: bad magic, version 1
// or an unknown version, truncated header/metadata/tensor infos, a count or length larger
// than the rest of the file could hold, invalid UTF-8 in a key, string or tensor name,
// duplicate keys or tensor names, an unknown value type or tensor type, arrays nested
// deeper than kMaxArrayDepth, more than kMaxMetadataValues array elements in all,
// general.alignment not a uint32 power of two, no dims or more than 4, a zero dim or an
// element count that overflows int64, a row (ne[0]) that is not a whole number of blocks,
// an unaligned tensor offset, tensor data past the end of the file, overlapping tensors.
// Errors of the getters: NOT_FOUND for a missing key or tensor; INVALID_ARGUMENT naming the
// file and key for a value of another type (or an integer that does not fit int64).
//
// Thread safety: immutable after Open/FromBuffer; all methods are const and safe to call
// concurrently.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/gguf/ggml_types.h"

namespace kvcm {

// GGUF's metadata value types (gguf's GGUFValueType), as stored in the file.
enum class GgufValueType : uint32_t {
  kUint8 = 0,
  kInt8 = 1,
  kUint16 = 2,
  kInt16 = 3,
  kUint32 = 4,
  kInt32 = 5,
  kFloat32 = 6,
  kBool = 7,
  kString = 8,
  kArray = 9,
  kUint64 = 10,
  kInt64 = 11,
  kFloat64 = 12,
};

// "uint8", ..., "array"; "type N" for a number that is not a value type.
std::string GgufValueTypeName(GgufValueType type);

// One metadata value. Which member holds it depends on `type`:
//   kUint8/16/32/64          uint_value
//   kInt8/16/32/64           int_value
//   kFloat32, kFloat64       float_value (a float32 converts exactly)
//   kBool                    bool_value
//   kString                  string_value (UTF-8)
//   kArray                   element_type and elements (each of type element_type; an
//                            array of arrays may mix element types inside its elements)
// The factories build values for GgufWriter.
struct GgufValue {
  GgufValueType type = GgufValueType::kUint8;
  uint64_t uint_value = 0;
  int64_t int_value = 0;
  double float_value = 0;
  bool bool_value = false;
  std::string string_value;
  GgufValueType element_type = GgufValueType::kUint8;
  std::vector<GgufValue> elements;

  static GgufValue Uint8(uint8_t v);
  static GgufValue Int8(int8_t v);
  static GgufValue Uint16(uint16_t v);
  static GgufValue Int16(int16_t v);
  static GgufValue Uint32(uint32_t v);
  static GgufValue Int32(int32_t v);
  static GgufValue Uint64(uint64_t v);
  static GgufValue Int64(int64_t v);
  static GgufValue Float32(float v);
  static GgufValue Float64(double v);
  static GgufValue Bool(bool v);
  static GgufValue String(std::string v);
  // An array of `element_type`; the elements must all be of that type (GgufWriter checks).
  static GgufValue Array(GgufValueType element_type, std::vector<GgufValue> elements);
  static GgufValue StringArray(const std::vector<std::string>& values);
  static GgufValue Int32Array(std::span<const int32_t> values);
  static GgufValue Float32Array(std::span<const float> values);

  // Whether `type` is one of the eight integer types.
  bool is_integer() const;
  bool is_float() const {
    return type == GgufValueType::kFloat32 || type == GgufValueType::kFloat64;
  }
};

struct GgufKeyValue {
  std::string key;
  GgufValue value;
};

struct GgufTensorInfo {
  std::string name;
  std::vector<int64_t> dims;  // ne[0] first (the contiguous dimension), as ggml orders them
  GgmlType type = GgmlType::kF32;
  uint64_t offset = 0;              // from the start of the data section
  int64_t element_count = 0;        // product of dims
  int64_t byte_size = 0;            // element_count / block_size * type_size
  std::span<const std::byte> data;  // byte_size bytes inside the file
};

class GgufFile {
 public:
  static constexpr uint32_t kDefaultAlignment = 32;
  static constexpr int kMaxDims = 4;        // GGML_MAX_DIMS
  static constexpr int kMaxArrayDepth = 8;  // arrays of arrays of ... refused beyond
  // Array elements in all of a file's metadata (a large vocabulary has about 10^6 between
  // its tokens, types, scores and merges); a file with more is refused, which bounds the
  // memory a malformed file can make the parser take.
  static constexpr int64_t kMaxMetadataValues = int64_t{1} << 22;

  // Maps and parses the file at `path`.
  static absl::StatusOr<std::unique_ptr<GgufFile>> Open(const std::string& path);
  // Parses `bytes`, which must outlive the returned object; `name` names it in errors.
  static absl::StatusOr<std::unique_ptr<GgufFile>> FromBuffer(std::string name,
                                                              std::span<const std::byte> bytes);

  GgufFile(const GgufFile&) = delete;
  GgufFile& operator=(const GgufFile&) = delete;
  ~GgufFile();

  const std::string& name() const { return name_; }  // the path, or FromBuffer's name
  uint32_t version() const { return version_; }
  uint32_t alignment() const { return alignment_; }
  // Where the data section starts, from the start of the file (a multiple of alignment()).
  uint64_t data_offset() const { return data_offset_; }
  // The whole file.
  std::span<const std::byte> bytes() const { return bytes_; }

  // All key/values in file order (for a metadata dump).
  const std::vector<GgufKeyValue>& metadata() const { return metadata_; }
  bool Has(std::string_view key) const;
  // The value of `key`; NOT_FOUND when absent.
  absl::StatusOr<const GgufValue*> GetValue(std::string_view key) const;

  absl::StatusOr<std::string> GetString(std::string_view key) const;
  // Any integer type whose value fits int64.
  absl::StatusOr<int64_t> GetInt(std::string_view key) const;
  // float32 or float64.
  absl::StatusOr<double> GetFloat(std::string_view key) const;
  absl::StatusOr<bool> GetBool(std::string_view key) const;
  absl::StatusOr<std::vector<std::string>> GetStringArray(std::string_view key) const;
  // An array of any integer type whose values fit int64.
  absl::StatusOr<std::vector<int64_t>> GetIntArray(std::string_view key) const;
  // An array of float32 or float64.
  absl::StatusOr<std::vector<double>> GetFloatArray(std::string_view key) const;

  // The tensor infos in file order.
  const std::vector<GgufTensorInfo>& tensors() const { return tensors_; }
  // NOT_FOUND when there is no tensor `name`.
  absl::StatusOr<const GgufTensorInfo*> FindTensor(std::string_view name) const;

 private:
  class Parser;
  GgufFile() = default;
  absl::Status Parse();
  absl::Status TypeError(std::string_view key, const GgufValue& value,
                         std::string_view wanted) const;

  std::string name_;
  std::span<const std::byte> bytes_;
  void* mapping_ = nullptr;  // Open's mmap, unmapped by the destructor
  size_t mapping_size_ = 0;
  uint32_t version_ = 0;
  uint32_t alignment_ = kDefaultAlignment;
  uint64_t data_offset_ = 0;
  std::vector<GgufKeyValue> metadata_;
  absl::flat_hash_map<std::string, size_t> key_index_;
  std::vector<GgufTensorInfo> tensors_;
  absl::flat_hash_map<std::string, size_t> tensor_index_;
};

}  // namespace kvcm
