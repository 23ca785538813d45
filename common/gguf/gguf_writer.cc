#include "common/gguf/gguf_writer.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/base/status_macros.h"
#include "common/gguf/gguf_internal.h"

namespace kvcm {
namespace {

using gguf_internal::Quoted;

constexpr std::string_view kAlignmentKey = "general.alignment";

absl::Status CheckValue(const std::string& key, const GgufValue& value, int depth) {
  if (!gguf_internal::IsValueType(static_cast<uint32_t>(value.type))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "metadata key ", Quoted(key), ": unknown value type ", static_cast<uint32_t>(value.type)));
  }
  if (value.type == GgufValueType::kString && !IsValidUtf8(value.string_value)) {
    return absl::InvalidArgumentError(
        absl::StrCat("metadata key ", Quoted(key), ": string is not valid UTF-8"));
  }
  if (value.type != GgufValueType::kArray) return absl::OkStatus();
  if (depth >= GgufFile::kMaxArrayDepth) {
    return absl::InvalidArgumentError(absl::StrCat(
        "metadata key ", Quoted(key), ": arrays nested deeper than ", GgufFile::kMaxArrayDepth));
  }
  for (size_t i = 0; i < value.elements.size(); ++i) {
    const GgufValue& e = value.elements[i];
    if (e.type != value.element_type) {
      return absl::InvalidArgumentError(absl::StrCat(
          "metadata key ", Quoted(key), ": element ", i, " is ", GgufValueTypeName(e.type),
          " in an array of ", GgufValueTypeName(value.element_type)));
    }
    KVCM_RETURN_IF_ERROR(CheckValue(key, e, depth + 1));
  }
  return absl::OkStatus();
}

template <typename T>
void Put(std::string* out, T v) {
  char buf[sizeof(T)];
  std::memcpy(buf, &v, sizeof(T));
  out->append(buf, sizeof(T));
}

void PutString(std::string* out, const std::string& s) {
  Put<uint64_t>(out, s.size());
  out->append(s);
}

void PutValue(std::string* out, const GgufValue& v) {
  switch (v.type) {
    case GgufValueType::kUint8:
      Put(out, static_cast<uint8_t>(v.uint_value));
      break;
    case GgufValueType::kInt8:
      Put(out, static_cast<int8_t>(v.int_value));
      break;
    case GgufValueType::kUint16:
      Put(out, static_cast<uint16_t>(v.uint_value));
      break;
    case GgufValueType::kInt16:
      Put(out, static_cast<int16_t>(v.int_value));
      break;
    case GgufValueType::kUint32:
      Put(out, static_cast<uint32_t>(v.uint_value));
      break;
    case GgufValueType::kInt32:
      Put(out, static_cast<int32_t>(v.int_value));
      break;
    case GgufValueType::kUint64:
      Put(out, v.uint_value);
      break;
    case GgufValueType::kInt64:
      Put(out, v.int_value);
      break;
    case GgufValueType::kFloat32:
      Put(out, static_cast<float>(v.float_value));
      break;
    case GgufValueType::kFloat64:
      Put(out, v.float_value);
      break;
    case GgufValueType::kBool:
      Put<uint8_t>(out, v.bool_value ? 1 : 0);
      break;
    case GgufValueType::kString:
      PutString(out, v.string_value);
      break;
    case GgufValueType::kArray:
      Put(out, static_cast<uint32_t>(v.element_type));
      Put<uint64_t>(out, v.elements.size());
      for (const GgufValue& e : v.elements) PutValue(out, e);
      break;
  }
}

void Pad(std::string* out, uint64_t alignment) {
  const uint64_t size = out->size();
  out->append((alignment - size % alignment) % alignment, '\0');
}

}  // namespace

absl::Status GgufWriter::SetAlignment(uint32_t alignment) {
  if (alignment == 0 || (alignment & (alignment - 1)) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("general.alignment ", alignment, " is not a power of two"));
  }
  alignment_ = alignment;
  for (GgufKeyValue& kv : metadata_) {
    if (kv.key == kAlignmentKey) {
      kv.value = GgufValue::Uint32(alignment);
      return absl::OkStatus();
    }
  }
  keys_.insert(std::string(kAlignmentKey));
  metadata_.push_back({std::string(kAlignmentKey), GgufValue::Uint32(alignment)});
  return absl::OkStatus();
}

absl::Status GgufWriter::Add(std::string key, GgufValue value) {
  if (!IsValidUtf8(key)) {
    return absl::InvalidArgumentError(
        absl::StrCat("metadata key ", Quoted(key), " is not valid UTF-8"));
  }
  if (key == kAlignmentKey) {
    return absl::InvalidArgumentError(
        "metadata key 'general.alignment' is set with SetAlignment, not Add");
  }
  if (keys_.contains(key)) {
    return absl::InvalidArgumentError(absl::StrCat("duplicate metadata key ", Quoted(key)));
  }
  KVCM_RETURN_IF_ERROR(CheckValue(key, value, 0));
  keys_.insert(key);
  metadata_.push_back({std::move(key), std::move(value)});
  return absl::OkStatus();
}

absl::Status GgufWriter::CheckTensor(const std::string& name, const std::vector<int64_t>& dims,
                                     GgmlType type, int64_t* element_count,
                                     int64_t* byte_size) const {
  const std::string context = absl::StrCat("tensor ", Quoted(name));
  if (!IsValidUtf8(name)) {
    return absl::InvalidArgumentError(absl::StrCat(context, ": name is not valid UTF-8"));
  }
  if (tensor_names_.contains(name)) {
    return absl::InvalidArgumentError(absl::StrCat("duplicate ", context));
  }
  if (dims.empty() || dims.size() > static_cast<size_t>(GgufFile::kMaxDims)) {
    return absl::InvalidArgumentError(
        absl::StrCat(context, " has ", dims.size(), " dims, not 1 to ", GgufFile::kMaxDims));
  }
  int64_t elements = 1;
  for (size_t d = 0; d < dims.size(); ++d) {
    if (dims[d] <= 0 || dims[d] > std::numeric_limits<int64_t>::max() / elements) {
      return absl::InvalidArgumentError(
          absl::StrCat(context, ": dim ", d, " (", dims[d], ") is not positive or overflows"));
    }
    elements *= dims[d];
  }
  const std::optional<GgmlTypeTraits> traits = GetGgmlTypeTraits(type);
  if (!traits.has_value()) {
    return absl::InvalidArgumentError(
        absl::StrCat(context, ": ", GgmlTypeName(type), " is not a ggml type"));
  }
  if (dims[0] % traits->block_size != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(context, ": a row of ", dims[0], " ", traits->name,
                     " elements is not whole blocks of ", traits->block_size));
  }
  absl::StatusOr<int64_t> bytes = TypeBytes(type, elements);
  if (!bytes.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(context, ": ", bytes.status().message()));
  }
  *element_count = elements;
  *byte_size = *bytes;
  return absl::OkStatus();
}

absl::Status GgufWriter::AddTensor(std::string name, std::vector<int64_t> dims, GgmlType type,
                                   std::span<const float> values) {
  int64_t elements = 0, bytes = 0;
  KVCM_RETURN_IF_ERROR(CheckTensor(name, dims, type, &elements, &bytes));
  if (values.size() != static_cast<size_t>(elements)) {
    return absl::InvalidArgumentError(absl::StrCat("tensor ", Quoted(name), ": ", values.size(),
                                                   " values for ", elements, " elements"));
  }
  std::string data(static_cast<size_t>(bytes), '\0');
  absl::Status status = Quantize(
      type, values, std::span<std::byte>(reinterpret_cast<std::byte*>(data.data()), data.size()));
  if (!status.ok()) {
    return absl::Status(status.code(),
                        absl::StrCat("tensor ", Quoted(name), ": ", status.message()));
  }
  tensor_names_.insert(name);
  tensors_.push_back({std::move(name), std::move(dims), type, std::move(data)});
  return absl::OkStatus();
}

absl::Status GgufWriter::AddTensorBytes(std::string name, std::vector<int64_t> dims, GgmlType type,
                                        std::span<const std::byte> data) {
  int64_t elements = 0, bytes = 0;
  KVCM_RETURN_IF_ERROR(CheckTensor(name, dims, type, &elements, &bytes));
  if (data.size() != static_cast<size_t>(bytes)) {
    return absl::InvalidArgumentError(absl::StrCat("tensor ", Quoted(name), ": ", data.size(),
                                                   " bytes, not the ", bytes, " of ", elements, " ",
                                                   GgmlTypeName(type), " elements"));
  }
  tensor_names_.insert(name);
  tensors_.push_back({std::move(name), std::move(dims), type,
                      std::string(reinterpret_cast<const char*>(data.data()), data.size())});
  return absl::OkStatus();
}

std::string GgufWriter::Serialize() const {
  std::string out;
  out.append("GGUF", 4);
  Put<uint32_t>(&out, 3);
  Put<uint64_t>(&out, tensors_.size());
  Put<uint64_t>(&out, metadata_.size());
  for (const GgufKeyValue& kv : metadata_) {
    PutString(&out, kv.key);
    Put(&out, static_cast<uint32_t>(kv.value.type));
    PutValue(&out, kv.value);
  }
  uint64_t offset = 0;
  for (const Tensor& t : tensors_) {
    PutString(&out, t.name);
    Put<uint32_t>(&out, static_cast<uint32_t>(t.dims.size()));
    for (int64_t d : t.dims) Put<uint64_t>(&out, static_cast<uint64_t>(d));
    Put(&out, static_cast<uint32_t>(t.type));
    Put<uint64_t>(&out, offset);
    offset += (t.data.size() + alignment_ - 1) / alignment_ * alignment_;
  }
  Pad(&out, alignment_);
  for (const Tensor& t : tensors_) {
    out.append(t.data);
    Pad(&out, alignment_);
  }
  return out;
}

absl::Status GgufWriter::WriteFile(const std::string& path) const {
  const std::string bytes = Serialize();
  std::ofstream file(path, std::ios::binary | std::ios::trunc);
  if (!file) {
    return absl::InternalError(absl::StrCat(path, ": cannot create: ", std::strerror(errno)));
  }
  file.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  file.close();
  if (!file) return absl::InternalError(absl::StrCat(path, ": write failed"));
  return absl::OkStatus();
}

}  // namespace kvcm
