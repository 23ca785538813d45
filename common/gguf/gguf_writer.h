#pragma once
// GgufWriter: builds a GGUF version 3 file (the layout in common/gguf/gguf_file.h) in
// memory: metadata of every value type, tensors given as floats (quantized with
// Quantize) or as ready bytes, and the data alignment. The layout is the one gguf's
// GGUFWriter produces: the key/values in the order added, the tensor infos in the order
// added, each tensor's data at the next multiple of the alignment.
//
//   GgufWriter writer;
//   KVCM_RETURN_IF_ERROR(writer.Add("general.architecture", GgufValue::String("llama")));
//   KVCM_RETURN_IF_ERROR(writer.AddTensor("token_embd.weight", {64, 259}, GgmlType::kQ8_0,
//                                         values));
//   KVCM_RETURN_IF_ERROR(writer.WriteFile(path));
//
// Errors: INVALID_ARGUMENT naming the key or tensor for a duplicate, invalid UTF-8, an
// array whose elements are not of its element type, arrays nested deeper than
// GgufFile::kMaxArrayDepth, general.alignment added directly (use SetAlignment), an
// alignment that is not a power of two, no dims or more than 4, a zero or negative dim,
// values or bytes that are not the dims' size, a row that is not whole blocks;
// UNIMPLEMENTED for a type Quantize lacks; INTERNAL when the file cannot be written.
//
// Thread safety: none; one owner.

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "common/gguf/ggml_types.h"
#include "common/gguf/gguf_file.h"

namespace kvcm {

class GgufWriter {
 public:
  GgufWriter() = default;

  // Sets the data alignment (a power of two) and writes it as general.alignment (uint32),
  // where the key was added first; the default, 32, is written only when set.
  absl::Status SetAlignment(uint32_t alignment);
  absl::Status Add(std::string key, GgufValue value);

  // Quantizes `values` (dims' product of them, ne[0] first) to `type`.
  absl::Status AddTensor(std::string name, std::vector<int64_t> dims, GgmlType type,
                         std::span<const float> values);
  // Takes `data` as the tensor's bytes (exactly its size for `type`), for any type.
  absl::Status AddTensorBytes(std::string name, std::vector<int64_t> dims, GgmlType type,
                              std::span<const std::byte> data);

  // The file's bytes.
  std::string Serialize() const;
  // Writes Serialize() to `path` (replaced if it exists).
  absl::Status WriteFile(const std::string& path) const;

 private:
  struct Tensor {
    std::string name;
    std::vector<int64_t> dims;
    GgmlType type;
    std::string data;
  };
  absl::Status CheckTensor(const std::string& name, const std::vector<int64_t>& dims, GgmlType type,
                           int64_t* element_count, int64_t* byte_size) const;

  uint32_t alignment_ = GgufFile::kDefaultAlignment;
  std::vector<GgufKeyValue> metadata_;
  absl::flat_hash_set<std::string> keys_;
  std::vector<Tensor> tensors_;
  absl::flat_hash_set<std::string> tensor_names_;
};

}  // namespace kvcm
