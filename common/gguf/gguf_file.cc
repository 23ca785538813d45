#include "common/gguf/gguf_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <numeric>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/base/status_macros.h"
#include "common/base/unique_fd.h"
#include "common/gguf/gguf_internal.h"

namespace kvcm {

std::string GgufValueTypeName(GgufValueType type) {
  switch (type) {
    case GgufValueType::kUint8:
      return "uint8";
    case GgufValueType::kInt8:
      return "int8";
    case GgufValueType::kUint16:
      return "uint16";
    case GgufValueType::kInt16:
      return "int16";
    case GgufValueType::kUint32:
      return "uint32";
    case GgufValueType::kInt32:
      return "int32";
    case GgufValueType::kFloat32:
      return "float32";
    case GgufValueType::kBool:
      return "bool";
    case GgufValueType::kString:
      return "string";
    case GgufValueType::kArray:
      return "array";
    case GgufValueType::kUint64:
      return "uint64";
    case GgufValueType::kInt64:
      return "int64";
    case GgufValueType::kFloat64:
      return "float64";
  }
  return absl::StrCat("type ", static_cast<uint32_t>(type));
}

namespace {

GgufValue Make(GgufValueType type) {
  GgufValue v;
  v.type = type;
  return v;
}

}  // namespace

GgufValue GgufValue::Uint8(uint8_t v) {
  GgufValue r = Make(GgufValueType::kUint8);
  r.uint_value = v;
  return r;
}
GgufValue GgufValue::Int8(int8_t v) {
  GgufValue r = Make(GgufValueType::kInt8);
  r.int_value = v;
  return r;
}
GgufValue GgufValue::Uint16(uint16_t v) {
  GgufValue r = Make(GgufValueType::kUint16);
  r.uint_value = v;
  return r;
}
GgufValue GgufValue::Int16(int16_t v) {
  GgufValue r = Make(GgufValueType::kInt16);
  r.int_value = v;
  return r;
}
GgufValue GgufValue::Uint32(uint32_t v) {
  GgufValue r = Make(GgufValueType::kUint32);
  r.uint_value = v;
  return r;
}
GgufValue GgufValue::Int32(int32_t v) {
  GgufValue r = Make(GgufValueType::kInt32);
  r.int_value = v;
  return r;
}
GgufValue GgufValue::Uint64(uint64_t v) {
  GgufValue r = Make(GgufValueType::kUint64);
  r.uint_value = v;
  return r;
}
GgufValue GgufValue::Int64(int64_t v) {
  GgufValue r = Make(GgufValueType::kInt64);
  r.int_value = v;
  return r;
}
GgufValue GgufValue::Float32(float v) {
  GgufValue r = Make(GgufValueType::kFloat32);
  r.float_value = v;
  return r;
}
GgufValue GgufValue::Float64(double v) {
  GgufValue r = Make(GgufValueType::kFloat64);
  r.float_value = v;
  return r;
}
GgufValue GgufValue::Bool(bool v) {
  GgufValue r = Make(GgufValueType::kBool);
  r.bool_value = v;
  return r;
}
GgufValue GgufValue::String(std::string v) {
  GgufValue r = Make(GgufValueType::kString);
  r.string_value = std::move(v);
  return r;
}
GgufValue GgufValue::Array(GgufValueType element_type, std::vector<GgufValue> elements) {
  GgufValue r = Make(GgufValueType::kArray);
  r.element_type = element_type;
  r.elements = std::move(elements);
  return r;
}
GgufValue GgufValue::StringArray(const std::vector<std::string>& values) {
  std::vector<GgufValue> elements;
  elements.reserve(values.size());
  for (const std::string& s : values) elements.push_back(String(s));
  return Array(GgufValueType::kString, std::move(elements));
}
GgufValue GgufValue::Int32Array(std::span<const int32_t> values) {
  std::vector<GgufValue> elements;
  elements.reserve(values.size());
  for (int32_t v : values) elements.push_back(Int32(v));
  return Array(GgufValueType::kInt32, std::move(elements));
}
GgufValue GgufValue::Float32Array(std::span<const float> values) {
  std::vector<GgufValue> elements;
  elements.reserve(values.size());
  for (float v : values) elements.push_back(Float32(v));
  return Array(GgufValueType::kFloat32, std::move(elements));
}

bool GgufValue::is_integer() const {
  switch (type) {
    case GgufValueType::kUint8:
    case GgufValueType::kInt8:
    case GgufValueType::kUint16:
    case GgufValueType::kInt16:
    case GgufValueType::kUint32:
    case GgufValueType::kInt32:
    case GgufValueType::kUint64:
    case GgufValueType::kInt64:
      return true;
    default:
      return false;
  }
}

namespace gguf_internal {

bool IsValueType(uint32_t type) { return type <= static_cast<uint32_t>(GgufValueType::kFloat64); }

size_t MinEncodedSize(GgufValueType type) {
  switch (type) {
    case GgufValueType::kUint8:
    case GgufValueType::kInt8:
    case GgufValueType::kBool:
      return 1;
    case GgufValueType::kUint16:
    case GgufValueType::kInt16:
      return 2;
    case GgufValueType::kUint32:
    case GgufValueType::kInt32:
    case GgufValueType::kFloat32:
      return 4;
    case GgufValueType::kString:
    case GgufValueType::kUint64:
    case GgufValueType::kInt64:
    case GgufValueType::kFloat64:
      return 8;
    case GgufValueType::kArray:
      return 4 + 8;
  }
  return 1;
}

std::string Quoted(std::string_view s) {
  // Names in messages: printable ASCII kept, anything else escaped, long names cut.
  std::string out = "'";
  const size_t limit = 200;
  for (size_t i = 0; i < s.size() && i < limit; ++i) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    if (c >= 0x20 && c < 0x7F && c != '\\' && c != '\'') {
      out.push_back(static_cast<char>(c));
    } else {
      static constexpr char kHex[] = "0123456789abcdef";
      out += "\\x";
      out.push_back(kHex[c >> 4]);
      out.push_back(kHex[c & 0xF]);
    }
  }
  if (s.size() > limit) out += "...";
  out += "'";
  return out;
}

}  // namespace gguf_internal

using gguf_internal::Quoted;

// Reads the file front to back; every read is bounds-checked.
class GgufFile::Parser {
 public:
  explicit Parser(GgufFile& file) : file_(file), bytes_(file.bytes_) {}

  absl::Status Run();

 private:
  size_t remaining() const { return bytes_.size() - pos_; }
  absl::Status Error(std::string what) const {
    return absl::InvalidArgumentError(absl::StrCat(file_.name_, ": ", what));
  }
  bool Take(void* out, size_t n) {
    if (remaining() < n) return false;
    if (n > 0) std::memcpy(out, bytes_.data() + pos_, n);
    pos_ += n;
    return true;
  }
  template <typename T>
  absl::Status Read(T* out, const std::string& context) {
    if (!Take(out, sizeof(T))) {
      return Error(absl::StrCat("truncated ", context, " at byte ", pos_, " (", sizeof(T),
                                " bytes wanted, ", remaining(), " left)"));
    }
    return absl::OkStatus();
  }
  absl::Status ReadString(std::string* out, const std::string& context);
  absl::Status ReadValue(GgufValueType type, int depth, const std::string& context, GgufValue* out);
  absl::Status ReadArray(int depth, const std::string& context, GgufValue* out);
  // A value of type Stored, widened into *field.
  template <typename Stored, typename Field>
  absl::Status ReadAs(Field* field, const std::string& context) {
    Stored v{};
    KVCM_RETURN_IF_ERROR(Read(&v, context));
    *field = v;
    return absl::OkStatus();
  }
  // Run's passes, in order.
  absl::Status ReadHeader(uint64_t* tensor_count, uint64_t* kv_count);
  absl::Status ReadAlignment();
  absl::Status ReadTensorInfo(uint64_t i, uint64_t count, GgufTensorInfo* out);
  absl::Status PlaceTensorData();
  absl::Status CheckNoTensorOverlap() const;

  GgufFile& file_;
  std::span<const std::byte> bytes_;
  size_t pos_ = 0;
  uint64_t values_ = 0;  // array elements read so far
};

absl::Status GgufFile::Parser::ReadString(std::string* out, const std::string& context) {
  uint64_t length = 0;
  KVCM_RETURN_IF_ERROR(Read(&length, context));
  if (length > remaining()) {
    return Error(absl::StrCat(context, ": string of ", length, " bytes at byte ", pos_,
                              " runs past the end of the file (", remaining(), " bytes left)"));
  }
  out->assign(reinterpret_cast<const char*>(bytes_.data()) + pos_, length);
  pos_ += length;
  if (!IsValidUtf8(*out)) {
    return Error(absl::StrCat(context, ": string ", Quoted(*out), " is not valid UTF-8"));
  }
  return absl::OkStatus();
}

absl::Status GgufFile::Parser::ReadValue(GgufValueType type, int depth, const std::string& context,
                                         GgufValue* out) {
  out->type = type;
  switch (type) {
    case GgufValueType::kUint8:
      return ReadAs<uint8_t>(&out->uint_value, context);
    case GgufValueType::kInt8:
      return ReadAs<int8_t>(&out->int_value, context);
    case GgufValueType::kUint16:
      return ReadAs<uint16_t>(&out->uint_value, context);
    case GgufValueType::kInt16:
      return ReadAs<int16_t>(&out->int_value, context);
    case GgufValueType::kUint32:
      return ReadAs<uint32_t>(&out->uint_value, context);
    case GgufValueType::kInt32:
      return ReadAs<int32_t>(&out->int_value, context);
    case GgufValueType::kUint64:
      return ReadAs<uint64_t>(&out->uint_value, context);
    case GgufValueType::kInt64:
      return ReadAs<int64_t>(&out->int_value, context);
    case GgufValueType::kFloat32:
      return ReadAs<float>(&out->float_value, context);
    case GgufValueType::kFloat64:
      return ReadAs<double>(&out->float_value, context);
    case GgufValueType::kBool: {
      uint8_t v = 0;
      KVCM_RETURN_IF_ERROR(Read(&v, context));
      if (v > 1) return Error(absl::StrCat(context, ": bool value ", v, " is neither 0 nor 1"));
      out->bool_value = v != 0;
      return absl::OkStatus();
    }
    case GgufValueType::kString:
      return ReadString(&out->string_value, context);
    case GgufValueType::kArray:
      return ReadArray(depth, context, out);
  }
  return Error(absl::StrCat(context, ": unknown value type ", static_cast<uint32_t>(type)));
}

absl::Status GgufFile::Parser::ReadArray(int depth, const std::string& context, GgufValue* out) {
  if (depth >= kMaxArrayDepth) {
    return Error(absl::StrCat(context, ": arrays nested deeper than ", kMaxArrayDepth));
  }
  uint32_t element_type = 0;
  KVCM_RETURN_IF_ERROR(Read(&element_type, context));
  if (!gguf_internal::IsValueType(element_type)) {
    return Error(absl::StrCat(context, ": unknown array element type ", element_type));
  }
  out->element_type = static_cast<GgufValueType>(element_type);
  uint64_t count = 0;
  KVCM_RETURN_IF_ERROR(Read(&count, context));
  const size_t min_size = gguf_internal::MinEncodedSize(out->element_type);
  if (count > remaining() / min_size) {
    return Error(absl::StrCat(context, ": array of ", count, " ",
                              GgufValueTypeName(out->element_type), " elements cannot fit in the ",
                              remaining(), " bytes left"));
  }
  // Each value costs sizeof(GgufValue) in memory however few bytes it takes in the
  // file, so the file's total is bounded too.
  if (count > static_cast<uint64_t>(kMaxMetadataValues) - values_) {
    return Error(absl::StrCat(context, ": array of ", count, " elements takes the file past ",
                              kMaxMetadataValues, " metadata values"));
  }
  values_ += count;
  out->elements.resize(count);
  for (uint64_t i = 0; i < count; ++i) {
    KVCM_RETURN_IF_ERROR(ReadValue(out->element_type, depth + 1, context, &out->elements[i]));
  }
  return absl::OkStatus();
}

absl::Status GgufFile::Parser::Run() {
  uint64_t tensor_count = 0, kv_count = 0;
  KVCM_RETURN_IF_ERROR(ReadHeader(&tensor_count, &kv_count));
  file_.metadata_.reserve(kv_count);
  for (uint64_t i = 0; i < kv_count; ++i) {
    GgufKeyValue kv;
    const std::string where = absl::StrCat("metadata key/value ", i, " of ", kv_count);
    KVCM_RETURN_IF_ERROR(ReadString(&kv.key, absl::StrCat(where, " (its key)")));
    const std::string context = absl::StrCat("metadata key ", Quoted(kv.key));
    if (file_.key_index_.contains(kv.key)) return Error(absl::StrCat("duplicate ", context));
    uint32_t type = 0;
    KVCM_RETURN_IF_ERROR(Read(&type, context));
    if (!gguf_internal::IsValueType(type)) {
      return Error(absl::StrCat(context, ": unknown value type ", type));
    }
    KVCM_RETURN_IF_ERROR(ReadValue(static_cast<GgufValueType>(type), 0, context, &kv.value));
    file_.key_index_.emplace(kv.key, file_.metadata_.size());
    file_.metadata_.push_back(std::move(kv));
  }

  KVCM_RETURN_IF_ERROR(ReadAlignment());
  file_.tensors_.reserve(tensor_count);
  for (uint64_t i = 0; i < tensor_count; ++i) {
    GgufTensorInfo t;
    KVCM_RETURN_IF_ERROR(ReadTensorInfo(i, tensor_count, &t));
    file_.tensor_index_.emplace(t.name, file_.tensors_.size());
    file_.tensors_.push_back(std::move(t));
  }
  KVCM_RETURN_IF_ERROR(PlaceTensorData());
  return CheckNoTensorOverlap();
}

// The magic, the version (2 or 3) and the counts, which must fit in the bytes left.
absl::Status GgufFile::Parser::ReadHeader(uint64_t* tensor_count, uint64_t* kv_count) {
  char magic[4];
  if (!Take(magic, sizeof(magic))) {
    return Error(absl::StrCat("truncated header: ", bytes_.size(), " bytes"));
  }
  if (std::memcmp(magic, "GGUF", 4) != 0) {
    return Error(absl::StrCat("bad magic ", Quoted(std::string_view(magic, 4)),
                              ", not 'GGUF': not a GGUF file"));
  }
  uint32_t version = 0;
  KVCM_RETURN_IF_ERROR(Read(&version, "header"));
  if (version == 1) return Error("GGUF version 1 is not supported (versions 2 and 3 are)");
  if (version != 2 && version != 3) {
    return Error(absl::StrCat("unsupported GGUF version ", version, " (versions 2 and 3 are)"));
  }
  file_.version_ = version;
  KVCM_RETURN_IF_ERROR(Read(tensor_count, "header"));
  KVCM_RETURN_IF_ERROR(Read(kv_count, "header"));
  // The smallest key/value is 13 bytes (empty key, type, one byte), the smallest tensor
  // info 32 (empty name, one dim, type, offset).
  constexpr size_t kMinKv = 8 + 4 + 1;
  constexpr size_t kMinTensorInfo = 8 + 4 + 8 + 4 + 8;
  if (*kv_count > remaining() / kMinKv ||
      *tensor_count > (remaining() - *kv_count * kMinKv) / kMinTensorInfo) {
    return Error(absl::StrCat("header counts ", *kv_count, " key/values and ", *tensor_count,
                              " tensors cannot fit in the ", remaining(), " bytes left"));
  }

  return absl::OkStatus();
}

// general.alignment, when given: a uint32 power of two.
absl::Status GgufFile::Parser::ReadAlignment() {
  if (auto it = file_.key_index_.find("general.alignment"); it != file_.key_index_.end()) {
    const GgufValue& value = file_.metadata_[it->second].value;
    if (value.type != GgufValueType::kUint32) {
      return Error(absl::StrCat("metadata key 'general.alignment' is ",
                                GgufValueTypeName(value.type), ", not uint32"));
    }
    if (value.uint_value == 0 || (value.uint_value & (value.uint_value - 1)) != 0) {
      return Error(absl::StrCat("metadata key 'general.alignment' is ", value.uint_value,
                                ", not a power of two"));
    }
    file_.alignment_ = static_cast<uint32_t>(value.uint_value);
  }

  return absl::OkStatus();
}

// Tensor info i of `count`: its name (new), dims, type and offset.
absl::Status GgufFile::Parser::ReadTensorInfo(uint64_t i, uint64_t count, GgufTensorInfo* out) {
  KVCM_RETURN_IF_ERROR(
      ReadString(&out->name, absl::StrCat("tensor info ", i, " of ", count, " (its name)")));
  const std::string context = absl::StrCat("tensor ", Quoted(out->name));
  if (file_.tensor_index_.contains(out->name)) return Error(absl::StrCat("duplicate ", context));
  uint32_t n_dims = 0;
  KVCM_RETURN_IF_ERROR(Read(&n_dims, context));
  if (n_dims == 0 || n_dims > static_cast<uint32_t>(kMaxDims)) {
    return Error(absl::StrCat(context, " has ", n_dims, " dims, not 1 to ", kMaxDims));
  }
  int64_t elements = 1;
  for (uint32_t d = 0; d < n_dims; ++d) {
    uint64_t ne = 0;
    KVCM_RETURN_IF_ERROR(Read(&ne, context));
    if (ne == 0) return Error(absl::StrCat(context, ": dim ", d, " is zero"));
    if (ne > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) ||
        static_cast<int64_t>(ne) > std::numeric_limits<int64_t>::max() / elements) {
      return Error(absl::StrCat(context, ": dims overflow int64 at dim ", d, " (", ne, ")"));
    }
    out->dims.push_back(static_cast<int64_t>(ne));
    elements *= static_cast<int64_t>(ne);
  }
  out->element_count = elements;
  uint32_t type = 0;
  KVCM_RETURN_IF_ERROR(Read(&type, context));
  out->type = static_cast<GgmlType>(type);
  const std::optional<GgmlTypeTraits> traits = GetGgmlTypeTraits(out->type);
  if (!traits.has_value()) return Error(absl::StrCat(context, ": unknown tensor type ", type));
  if (out->dims[0] % traits->block_size != 0) {
    return Error(absl::StrCat(context, ": a row of ", out->dims[0], " ", traits->name,
                              " elements is not whole blocks of ", traits->block_size));
  }
  absl::StatusOr<int64_t> bytes = TypeBytes(out->type, elements);
  if (!bytes.ok()) return Error(absl::StrCat(context, ": ", bytes.status().message()));
  out->byte_size = *bytes;
  KVCM_RETURN_IF_ERROR(Read(&out->offset, context));
  return absl::OkStatus();
}

// Each tensor's data, in the data section that starts at the next multiple of the
// alignment: aligned, and inside the file.
absl::Status GgufFile::Parser::PlaceTensorData() {
  const uint64_t align = file_.alignment_;
  file_.data_offset_ = (static_cast<uint64_t>(pos_) + align - 1) / align * align;
  const uint64_t size = bytes_.size();
  const uint64_t data_size = file_.data_offset_ <= size ? size - file_.data_offset_ : 0;
  for (GgufTensorInfo& t : file_.tensors_) {
    const std::string context = absl::StrCat("tensor ", Quoted(t.name));
    if (t.offset % align != 0) {
      return Error(absl::StrCat(context, ": offset ", t.offset, " is not a multiple of the ",
                                "alignment ", align));
    }
    const uint64_t byte_size = static_cast<uint64_t>(t.byte_size);
    if (file_.data_offset_ > size || t.offset > data_size || byte_size > data_size - t.offset) {
      return Error(absl::StrCat(context, ": data at ", t.offset, " + ", byte_size,
                                " bytes runs past the end of the file (the data section has ",
                                data_size, " bytes)"));
    }
    t.data = bytes_.subspan(file_.data_offset_ + t.offset, byte_size);
  }
  return absl::OkStatus();
}

// No two tensors' data overlap.
absl::Status GgufFile::Parser::CheckNoTensorOverlap() const {
  std::vector<size_t> order(file_.tensors_.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return file_.tensors_[a].offset < file_.tensors_[b].offset;
  });
  for (size_t k = 1; k < order.size(); ++k) {
    const GgufTensorInfo& a = file_.tensors_[order[k - 1]];
    const GgufTensorInfo& b = file_.tensors_[order[k]];
    if (a.offset + static_cast<uint64_t>(a.byte_size) > b.offset) {
      return Error(absl::StrCat("tensor ", Quoted(a.name), " (offset ", a.offset, ", ", a.byte_size,
                                " bytes) overlaps tensor ", Quoted(b.name), " (offset ", b.offset,
                                ")"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<GgufFile>> GgufFile::Open(const std::string& path) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd.valid()) {
    const int err = errno;
    const std::string message = absl::StrCat(path, ": cannot open: ", std::strerror(err));
    if (err == ENOENT) return absl::NotFoundError(message);
    return absl::InternalError(message);
  }
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) {
    return absl::InternalError(absl::StrCat(path, ": fstat: ", std::strerror(errno)));
  }
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a regular file"));
  }
  std::unique_ptr<GgufFile> file(new GgufFile());
  file->name_ = path;
  const size_t size = static_cast<size_t>(st.st_size);
  if (size > 0) {
    void* mapping = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd.get(), 0);
    if (mapping == MAP_FAILED) {
      return absl::InternalError(absl::StrCat(path, ": mmap: ", std::strerror(errno)));
    }
    file->mapping_ = mapping;
    file->mapping_size_ = size;
    file->bytes_ = std::span<const std::byte>(static_cast<const std::byte*>(mapping), size);
  }
  KVCM_RETURN_IF_ERROR(file->Parse());
  return file;
}

absl::StatusOr<std::unique_ptr<GgufFile>> GgufFile::FromBuffer(std::string name,
                                                               std::span<const std::byte> bytes) {
  std::unique_ptr<GgufFile> file(new GgufFile());
  file->name_ = std::move(name);
  file->bytes_ = bytes;
  KVCM_RETURN_IF_ERROR(file->Parse());
  return file;
}

GgufFile::~GgufFile() {
  if (mapping_ != nullptr) ::munmap(mapping_, mapping_size_);
}

absl::Status GgufFile::Parse() {
  Parser parser(*this);
  return parser.Run();
}

bool GgufFile::Has(std::string_view key) const {
  return key_index_.contains(absl::string_view(key.data(), key.size()));
}

absl::StatusOr<const GgufValue*> GgufFile::GetValue(std::string_view key) const {
  auto it = key_index_.find(absl::string_view(key.data(), key.size()));
  if (it == key_index_.end()) {
    return absl::NotFoundError(absl::StrCat(name_, ": no metadata key ", Quoted(key)));
  }
  return &metadata_[it->second].value;
}

absl::Status GgufFile::TypeError(std::string_view key, const GgufValue& value,
                                 std::string_view wanted) const {
  std::string is = GgufValueTypeName(value.type);
  if (value.type == GgufValueType::kArray) {
    is = absl::StrCat("an array of ", GgufValueTypeName(value.element_type));
  }
  return absl::InvalidArgumentError(absl::StrCat(name_, ": metadata key ", Quoted(key), " is ", is,
                                                 ", not ", std::string(wanted)));
}

namespace {

// The value of an integer GgufValue when it fits int64.
bool IntOf(const GgufValue& v, int64_t* out) {
  if (!v.is_integer()) return false;
  switch (v.type) {
    case GgufValueType::kInt8:
    case GgufValueType::kInt16:
    case GgufValueType::kInt32:
    case GgufValueType::kInt64:
      *out = v.int_value;
      return true;
    default:
      if (v.uint_value > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return false;
      *out = static_cast<int64_t>(v.uint_value);
      return true;
  }
}

}  // namespace

absl::StatusOr<std::string> GgufFile::GetString(std::string_view key) const {
  KVCM_ASSIGN_OR_RETURN(const GgufValue* v, GetValue(key));
  if (v->type != GgufValueType::kString) return TypeError(key, *v, "a string");
  return v->string_value;
}

absl::StatusOr<int64_t> GgufFile::GetInt(std::string_view key) const {
  KVCM_ASSIGN_OR_RETURN(const GgufValue* v, GetValue(key));
  if (!v->is_integer()) return TypeError(key, *v, "an integer");
  int64_t out;
  if (!IntOf(*v, &out)) {
    return absl::InvalidArgumentError(absl::StrCat(name_, ": metadata key ", Quoted(key), " (",
                                                   v->uint_value, ") does not fit int64"));
  }
  return out;
}

absl::StatusOr<double> GgufFile::GetFloat(std::string_view key) const {
  KVCM_ASSIGN_OR_RETURN(const GgufValue* v, GetValue(key));
  if (!v->is_float()) return TypeError(key, *v, "a float32 or float64");
  return v->float_value;
}

absl::StatusOr<bool> GgufFile::GetBool(std::string_view key) const {
  KVCM_ASSIGN_OR_RETURN(const GgufValue* v, GetValue(key));
  if (v->type != GgufValueType::kBool) return TypeError(key, *v, "a bool");
  return v->bool_value;
}

absl::StatusOr<std::vector<std::string>> GgufFile::GetStringArray(std::string_view key) const {
  KVCM_ASSIGN_OR_RETURN(const GgufValue* v, GetValue(key));
  if (v->type != GgufValueType::kArray || v->element_type != GgufValueType::kString) {
    return TypeError(key, *v, "an array of string");
  }
  std::vector<std::string> out;
  out.reserve(v->elements.size());
  for (const GgufValue& e : v->elements) out.push_back(e.string_value);
  return out;
}

absl::StatusOr<std::vector<int64_t>> GgufFile::GetIntArray(std::string_view key) const {
  KVCM_ASSIGN_OR_RETURN(const GgufValue* v, GetValue(key));
  if (v->type != GgufValueType::kArray || !Make(v->element_type).is_integer()) {
    return TypeError(key, *v, "an array of integers");
  }
  std::vector<int64_t> out(v->elements.size());
  for (size_t i = 0; i < out.size(); ++i) {
    if (!IntOf(v->elements[i], &out[i])) {
      return absl::InvalidArgumentError(absl::StrCat(name_, ": metadata key ", Quoted(key), "[", i,
                                                     "] (", v->elements[i].uint_value,
                                                     ") does not fit int64"));
    }
  }
  return out;
}

absl::StatusOr<std::vector<double>> GgufFile::GetFloatArray(std::string_view key) const {
  KVCM_ASSIGN_OR_RETURN(const GgufValue* v, GetValue(key));
  if (v->type != GgufValueType::kArray || !Make(v->element_type).is_float()) {
    return TypeError(key, *v, "an array of float32 or float64");
  }
  std::vector<double> out;
  out.reserve(v->elements.size());
  for (const GgufValue& e : v->elements) out.push_back(e.float_value);
  return out;
}

absl::StatusOr<const GgufTensorInfo*> GgufFile::FindTensor(std::string_view name) const {
  auto it = tensor_index_.find(absl::string_view(name.data(), name.size()));
  if (it == tensor_index_.end()) {
    return absl::NotFoundError(absl::StrCat(name_, ": no tensor ", Quoted(name)));
  }
  return &tensors_[it->second];
}

}  // namespace kvcm
