#pragma once
// Helpers of the tests in tests/common/gguf: running tests/common/gguf/gguf_reference.py
// (the `gguf` Python package) and its JSON encoding of metadata values.

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "common/gguf/gguf_file.h"
#include "nlohmann/json.hpp"
#include "tests/support/subprocess.h"

namespace kvcm::testing {

// Runs gguf_reference.py with `args`; INTERNAL with its output when it fails.
inline absl::Status RunGgufReference(const std::vector<std::string>& args) {
  std::vector<std::string> argv = {KVCM_REFERENCE_PYTHON, KVCM_GGUF_REFERENCE_SCRIPT};
  argv.insert(argv.end(), args.begin(), args.end());
  absl::StatusOr<RunResult> run = RunProgram(argv, "", absl::Minutes(5));
  if (!run.ok()) return run.status();
  std::printf("%s", run->output.c_str());
  if (run->exit_code != 0) {
    return absl::InternalError(absl::StrCat(absl::StrJoin(argv, " "), " exited with ",
                                            run->exit_code, ": ", Tail(run->output)));
  }
  return absl::OkStatus();
}

inline absl::StatusOr<nlohmann::json> ReadJson(const std::string& path) {
  const std::string text = ReadFileOrEmpty(path);
  if (text.empty()) return absl::NotFoundError(path + " is empty or missing");
  nlohmann::json json = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (json.is_discarded()) return absl::InvalidArgumentError(path + " is not JSON");
  return json;
}

inline std::string HexBits(uint64_t bits, int digits) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%0*llx", digits, static_cast<unsigned long long>(bits));
  return buf;
}

inline std::string Hex(const void* data, size_t size) {
  static constexpr char kDigits[] = "0123456789abcdef";
  const auto* p = static_cast<const unsigned char*>(data);
  std::string out;
  out.reserve(2 * size);
  for (size_t i = 0; i < size; ++i) {
    out.push_back(kDigits[p[i] >> 4]);
    out.push_back(kDigits[p[i] & 0xF]);
  }
  return out;
}

// gguf_reference.py's encoding of a value: {"type": T, "value": V}.
inline nlohmann::json ValueToJson(const GgufValue& v) {
  nlohmann::json out;
  out["type"] = static_cast<uint32_t>(v.type);
  switch (v.type) {
    case GgufValueType::kUint8:
    case GgufValueType::kUint16:
    case GgufValueType::kUint32:
    case GgufValueType::kUint64:
      out["value"] = v.uint_value;
      break;
    case GgufValueType::kInt8:
    case GgufValueType::kInt16:
    case GgufValueType::kInt32:
    case GgufValueType::kInt64:
      out["value"] = v.int_value;
      break;
    case GgufValueType::kFloat32: {
      const float f = static_cast<float>(v.float_value);
      uint32_t bits;
      std::memcpy(&bits, &f, sizeof(bits));
      out["value"] = HexBits(bits, 8);
      break;
    }
    case GgufValueType::kFloat64: {
      uint64_t bits;
      std::memcpy(&bits, &v.float_value, sizeof(bits));
      out["value"] = HexBits(bits, 16);
      break;
    }
    case GgufValueType::kBool:
      out["value"] = v.bool_value;
      break;
    case GgufValueType::kString:
      out["value"] = v.string_value;
      break;
    case GgufValueType::kArray: {
      nlohmann::json elements = nlohmann::json::array();
      for (const GgufValue& e : v.elements) elements.push_back(ValueToJson(e));
      out["value"] = {{"element_type", static_cast<uint32_t>(v.element_type)},
                      {"elements", std::move(elements)}};
      break;
    }
  }
  return out;
}

// The metadata of `file` as gguf_reference.py lists it: [{"key", "type", "value"}, ...].
inline nlohmann::json MetadataToJson(const GgufFile& file) {
  nlohmann::json out = nlohmann::json::array();
  for (const GgufKeyValue& kv : file.metadata()) {
    nlohmann::json entry = ValueToJson(kv.value);
    entry["key"] = kv.key;
    out.push_back(std::move(entry));
  }
  return out;
}

}  // namespace kvcm::testing
