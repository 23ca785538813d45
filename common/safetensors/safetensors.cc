#include "common/safetensors/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <system_error>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/base/float16.h"
#include "common/base/status_macros.h"
#include "nlohmann/json.hpp"

namespace kvcm {
namespace {

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; a big-endian host needs byte swaps here");

using Json = nlohmann::json;

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

std::string ErrnoMessage(int error) { return std::generic_category().message(error); }

// Reads a non-negative integer from a JSON value; false when it is not one.
bool NonNegativeInteger(const Json& value, uint64_t* out) {
  if (value.is_number_unsigned()) {
    *out = value.get<uint64_t>();
    return true;
  }
  if (value.is_number_integer() && value.get<int64_t>() >= 0) {
    *out = static_cast<uint64_t>(value.get<int64_t>());
    return true;
  }
  return false;
}

// The header's "__metadata__" entry (null, or an object of strings) into *out.
absl::Status ReadSafetensorsMetadata(const Json& entry, const std::string& where,
                                     std::map<std::string, std::string>* out) {
  if (entry.is_null()) return absl::OkStatus();
  if (!entry.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": \"__metadata__\" must be an object, got ", entry.type_name()));
  }
  for (const auto& [key, value] : entry.items()) {
    if (!value.is_string()) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": \"__metadata__\" value of \"", key,
                                                     "\" must be a string, got ",
                                                     value.type_name()));
    }
    (*out)[key] = value.get<std::string>();
  }
  return absl::OkStatus();
}

// One tensor's header entry: its dtype, shape and data_offsets, which must lie within the
// data section's `data_size` bytes and hold exactly the shape's bytes.
absl::StatusOr<SafetensorsTensorInfo> ReadSafetensorsEntry(const std::string& name,
                                                           const Json& entry,
                                                           const std::string& where,
                                                           uint64_t data_size) {
  const std::string what = absl::StrCat(where, ", tensor \"", name, "\"");
  if (!entry.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": entry must be a JSON object, got ", entry.type_name()));
  }
  SafetensorsTensorInfo info;
  info.name = name;

  const auto dtype = entry.find("dtype");
  if (dtype == entry.end() || !dtype->is_string()) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": missing string \"dtype\""));
  }
  info.dtype = dtype->get<std::string>();
  const int32_t elem_bytes = SafetensorsDTypeBytes(info.dtype);
  if (elem_bytes == 0) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": unknown dtype \"", info.dtype, "\""));
  }

  const auto shape = entry.find("shape");
  if (shape == entry.end() || !shape->is_array()) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": missing array \"shape\""));
  }
  // The product in bytes, checked for overflow as it grows.
  uint64_t expected_bytes = static_cast<uint64_t>(elem_bytes);
  bool overflow = false;
  for (const Json& dim : *shape) {
    uint64_t d = 0;
    if (!NonNegativeInteger(dim, &d) ||
        d > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": \"shape\" must hold non-negative integers, got ", shape->dump()));
    }
    info.shape.push_back(static_cast<int64_t>(d));
    if (__builtin_mul_overflow(expected_bytes, d, &expected_bytes)) overflow = true;
  }

  const auto offsets = entry.find("data_offsets");
  uint64_t begin = 0;
  uint64_t end = 0;
  if (offsets == entry.end() || !offsets->is_array() || offsets->size() != 2 ||
      !NonNegativeInteger((*offsets)[0], &begin) || !NonNegativeInteger((*offsets)[1], &end)) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": \"data_offsets\" must be [begin, end] of non-negative integers"));
  }
  if (begin > end) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": data_offsets [", begin, ", ", end, "] have begin after end"));
  }
  if (end > data_size) {
    return absl::DataLossError(absl::StrCat(what, ": data_offsets [", begin, ", ", end,
                                            "] run past the end of the ", data_size,
                                            "-byte data section (truncated file?)"));
  }
  if (overflow || expected_bytes != end - begin) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": shape ", ShapeString(info.shape), " of ", info.dtype, " needs ",
                     overflow ? std::string("more than 2^64") : absl::StrCat(expected_bytes),
                     " bytes but data_offsets [", begin, ", ", end, "] hold ", end - begin));
  }
  info.begin = begin;
  info.end = end;
  return info;
}

// No two non-empty tensors may share a byte.
absl::Status CheckNoSafetensorsOverlap(const std::vector<SafetensorsTensorInfo>& tensors,
                                       const std::string& where) {
  // No two non-empty tensors may share a byte.
  std::vector<const SafetensorsTensorInfo*> by_offset;
  for (const SafetensorsTensorInfo& t : tensors) {
    if (t.end > t.begin) by_offset.push_back(&t);
  }
  std::sort(by_offset.begin(), by_offset.end(),
            [](const SafetensorsTensorInfo* a, const SafetensorsTensorInfo* b) {
              return a->begin < b->begin;
            });
  for (size_t i = 1; i < by_offset.size(); ++i) {
    const SafetensorsTensorInfo& prev = *by_offset[i - 1];
    const SafetensorsTensorInfo& next = *by_offset[i];
    if (next.begin < prev.end) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": tensors \"", prev.name, "\" [", prev.begin, ", ", prev.end,
                       ") and \"", next.name, "\" [", next.begin, ", ", next.end, ") overlap"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

int64_t SafetensorsTensorInfo::NumElements() const {
  int64_t n = 1;
  for (const int64_t d : shape) n *= d;
  return n;
}

int32_t SafetensorsDTypeBytes(const std::string& dtype) {
  static const auto* const kSizes = new absl::flat_hash_map<std::string, int32_t>{
      {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E4M3", 1}, {"F8_E5M2", 1},
      {"U16", 2},  {"I16", 2}, {"F16", 2}, {"BF16", 2},    {"U32", 4},
      {"I32", 4},  {"F32", 4}, {"U64", 8}, {"I64", 8},     {"F64", 8}};
  const auto it = kSizes->find(dtype);
  return it == kSizes->end() ? 0 : it->second;
}

SafetensorsFile::~SafetensorsFile() {
  if (map_ != nullptr) {
    munmap(const_cast<std::byte*>(map_), map_size_);
  }
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  auto file = std::unique_ptr<SafetensorsFile>(new SafetensorsFile());
  file->path_ = path;
  const std::string where = absl::StrCat("safetensors file \"", path, "\"");

  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    return absl::NotFoundError(absl::StrCat("cannot open ", where, ": ", ErrnoMessage(errno)));
  }
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    const int error = errno;
    ::close(fd);
    return absl::NotFoundError(absl::StrCat("cannot stat ", where, ": ", ErrnoMessage(error)));
  }
  const uint64_t file_size = static_cast<uint64_t>(st.st_size);
  if (file_size < 8) {
    ::close(fd);
    return absl::DataLossError(absl::StrCat(where, " is truncated: ", file_size,
                                            " bytes, less than the 8-byte header length"));
  }
  void* map = mmap(nullptr, file_size, PROT_READ, MAP_PRIVATE, fd, 0);
  const int map_error = errno;
  ::close(fd);
  if (map == MAP_FAILED) {
    return absl::InternalError(absl::StrCat("cannot map ", where, ": ", ErrnoMessage(map_error)));
  }
  file->map_ = static_cast<const std::byte*>(map);
  file->map_size_ = file_size;

  uint64_t header_len = 0;
  std::memcpy(&header_len, file->map_, 8);
  if (header_len > kMaxSafetensorsHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": header length ", header_len,
                                                   " exceeds the limit of ",
                                                   kMaxSafetensorsHeaderBytes, " bytes"));
  }
  if (header_len > file_size - 8) {
    return absl::DataLossError(absl::StrCat(where, " is truncated: header length ", header_len,
                                            " runs past the end of the ", file_size, "-byte file"));
  }
  file->data_ = file->map_ + 8 + header_len;
  const uint64_t data_size = file_size - 8 - header_len;

  Json header;
  try {
    header = Json::parse(reinterpret_cast<const char*>(file->map_ + 8),
                         reinterpret_cast<const char*>(file->data_));
  } catch (const Json::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": header is not valid JSON: ", e.what()));
  }
  if (!header.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": header must be a JSON object, got ", header.type_name()));
  }

  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      if (absl::Status s = ReadSafetensorsMetadata(entry, where, &file->metadata_); !s.ok()) {
        return s;
      }
      continue;
    }
    absl::StatusOr<SafetensorsTensorInfo> info =
        ReadSafetensorsEntry(name, entry, where, data_size);
    if (!info.ok()) return info.status();
    file->tensors_.push_back(*std::move(info));
  }

  if (absl::Status s = CheckNoSafetensorsOverlap(file->tensors_, where); !s.ok()) return s;

  for (size_t i = 0; i < file->tensors_.size(); ++i) file->index_[file->tensors_[i].name] = i;
  return file;
}

const SafetensorsTensorInfo* SafetensorsFile::Find(const std::string& name) const {
  const auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

absl::StatusOr<std::span<const std::byte>> SafetensorsFile::RawBytes(
    const std::string& name) const {
  const SafetensorsTensorInfo* info = Find(name);
  if (info == nullptr) {
    return absl::NotFoundError(
        absl::StrCat("safetensors file \"", path_, "\" has no tensor \"", name, "\""));
  }
  return std::span<const std::byte>(data_ + info->begin, info->end - info->begin);
}

absl::StatusOr<std::vector<float>> SafetensorsFile::LoadFloat32(const std::string& name) const {
  KVCM_ASSIGN_OR_RETURN(const std::span<const std::byte> bytes, RawBytes(name));
  const SafetensorsTensorInfo& info = *Find(name);
  const size_t n = static_cast<size_t>(info.NumElements());
  std::vector<float> out(n);
  if (info.dtype == "F32") {
    if (n > 0) std::memcpy(out.data(), bytes.data(), n * sizeof(float));
  } else if (info.dtype == "F16" || info.dtype == "BF16") {
    const bool bf16 = info.dtype == "BF16";
    for (size_t i = 0; i < n; ++i) {
      uint16_t bits = 0;
      std::memcpy(&bits, bytes.data() + 2 * i, 2);
      out[i] = bf16 ? FloatFromBFloat16(bits) : FloatFromHalf(bits);
    }
  } else {
    return absl::UnimplementedError(
        absl::StrCat("safetensors file \"", path_, "\", tensor \"", name, "\": dtype ", info.dtype,
                     " cannot be loaded as fp32 (supported: F32, F16, BF16)"));
  }
  return out;
}

absl::StatusOr<std::unique_ptr<SafetensorsFolder>> SafetensorsFolder::Open(
    const std::string& folder) {
  namespace fs = std::filesystem;
  auto result = std::make_unique<SafetensorsFolder>();
  result->folder_ = folder;

  const fs::path index_path = fs::path(folder) / "model.safetensors.index.json";
  std::error_code ec;
  // weight_map from the index, when there is one: tensor -> file name.
  std::map<std::string, std::string> weight_map;
  std::vector<std::string> file_names;
  if (fs::exists(index_path, ec)) {
    std::ifstream in(index_path);
    Json index;
    try {
      index = Json::parse(in);
    } catch (const Json::exception& e) {
      return absl::InvalidArgumentError(
          absl::StrCat("\"", index_path.string(), "\" is not valid JSON: ", e.what()));
    }
    const auto map = index.is_object() ? index.find("weight_map") : index.end();
    if (map == index.end() || !map->is_object()) {
      return absl::InvalidArgumentError(
          absl::StrCat("\"", index_path.string(), "\" has no \"weight_map\" object"));
    }
    for (const auto& [tensor, file_name] : map->items()) {
      if (!file_name.is_string()) {
        return absl::InvalidArgumentError(absl::StrCat("\"", index_path.string(),
                                                       "\": weight_map entry of \"", tensor,
                                                       "\" must be a file name string"));
      }
      const std::string name = file_name.get<std::string>();
      if (name.empty() || name.find('/') != std::string::npos || name == "." || name == "..") {
        return absl::InvalidArgumentError(
            absl::StrCat("\"", index_path.string(), "\": weight_map entry of \"", tensor,
                         "\" names \"", name, "\", which is not a file in the folder"));
      }
      weight_map[tensor] = name;
      if (std::find(file_names.begin(), file_names.end(), name) == file_names.end()) {
        file_names.push_back(name);
      }
    }
    std::sort(file_names.begin(), file_names.end());
  } else {
    for (fs::directory_iterator it(folder, ec), end; !ec && it != end; it.increment(ec)) {
      const std::string name = it->path().filename().string();
      if (name.size() > 12 && name.ends_with(".safetensors")) file_names.push_back(name);
    }
    if (ec) {
      return absl::NotFoundError(
          absl::StrCat("cannot list model folder \"", folder, "\": ", ec.message()));
    }
    std::sort(file_names.begin(), file_names.end());
  }
  if (file_names.empty()) {
    return absl::NotFoundError(
        absl::StrCat("model folder \"", folder, "\" has no .safetensors file"));
  }

  for (const std::string& name : file_names) {
    KVCM_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsFile> file,
                          SafetensorsFile::Open((fs::path(folder) / name).string()));
    const size_t file_index = result->files_.size();
    for (const SafetensorsTensorInfo& t : file->tensors()) {
      const auto [it, inserted] = result->owner_.emplace(t.name, file_index);
      if (!inserted) {
        return absl::InvalidArgumentError(absl::StrCat("tensor \"", t.name, "\" appears in both \"",
                                                       result->files_[it->second]->path(),
                                                       "\" and \"", file->path(), "\""));
      }
    }
    result->files_.push_back(std::move(file));
  }
  for (const auto& [tensor, name] : weight_map) {
    const auto it = result->owner_.find(tensor);
    const std::string expected = (fs::path(folder) / name).string();
    if (it == result->owner_.end() || result->files_[it->second]->path() != expected) {
      return absl::InvalidArgumentError(absl::StrCat(
          "\"", index_path.string(), "\" puts tensor \"", tensor, "\" in \"", name, "\", but ",
          it == result->owner_.end()
              ? std::string("no shard holds it")
              : absl::StrCat("it is in \"", result->files_[it->second]->path(), "\"")));
    }
  }
  return result;
}

std::pair<const SafetensorsFile*, const SafetensorsTensorInfo*> SafetensorsFolder::Find(
    const std::string& name) const {
  const auto it = owner_.find(name);
  if (it == owner_.end()) return {nullptr, nullptr};
  const SafetensorsFile* file = files_[it->second].get();
  return {file, file->Find(name)};
}

absl::StatusOr<std::vector<float>> SafetensorsFolder::LoadFloat32(const std::string& name) const {
  const auto [file, info] = Find(name);
  if (file == nullptr) {
    return absl::NotFoundError(
        absl::StrCat("model folder \"", folder_, "\" has no tensor \"", name, "\""));
  }
  return file->LoadFloat32(name);
}

absl::Status WriteSafetensors(const std::string& path,
                              const std::vector<SafetensorsTensorToWrite>& tensors,
                              const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    header["__metadata__"] = nlohmann::ordered_json::object();
    for (const auto& [key, value] : metadata) header["__metadata__"][key] = value;
  }
  uint64_t offset = 0;
  for (const SafetensorsTensorToWrite& t : tensors) {
    if (t.name == "__metadata__" || header.contains(t.name)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "writing \"", path, "\": duplicate or reserved tensor name \"", t.name, "\""));
    }
    const int32_t elem_bytes = SafetensorsDTypeBytes(t.dtype);
    uint64_t expected = static_cast<uint64_t>(elem_bytes);
    for (const int64_t d : t.shape) expected *= static_cast<uint64_t>(d);
    if (elem_bytes == 0 || expected != t.data.size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "writing \"", path, "\", tensor \"", t.name, "\": ", t.data.size(),
          " bytes do not match shape ", ShapeString(t.shape), " of dtype \"", t.dtype, "\""));
    }
    header[t.name] = {
        {"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {offset, offset + t.data.size()}}};
    offset += t.data.size();
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  const uint64_t header_len = text.size();

  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  char len_bytes[8];
  std::memcpy(len_bytes, &header_len, 8);
  out.write(len_bytes, 8);
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
  for (const SafetensorsTensorToWrite& t : tensors) {
    out.write(reinterpret_cast<const char*>(t.data.data()),
              static_cast<std::streamsize>(t.data.size()));
  }
  out.close();
  if (!out) {
    return absl::InternalError(absl::StrCat("cannot write safetensors file \"", path, "\""));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::byte>> EncodeFloat32As(std::span<const float> values,
                                                       const std::string& dtype) {
  std::vector<std::byte> out;
  if (dtype == "F32") {
    out.resize(values.size() * 4);
    if (!values.empty()) std::memcpy(out.data(), values.data(), out.size());
  } else if (dtype == "F16" || dtype == "BF16") {
    out.resize(values.size() * 2);
    for (size_t i = 0; i < values.size(); ++i) {
      const uint16_t bits =
          dtype == "F16" ? HalfFromFloat(values[i]) : BFloat16FromFloat(values[i]);
      std::memcpy(out.data() + 2 * i, &bits, 2);
    }
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot encode fp32 values as dtype \"", dtype, "\" (F32, F16, BF16)"));
  }
  return out;
}

}  // namespace kvcm
