#include "common/sizing/kv_cache_spec.h"

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/base/check.h"
#include "common/sizing/byte_size.h"
#include "common/sizing/checked_math.h"

namespace kvcm {
namespace {

using sizing_internal::CheckedMul;

// 2 x layers x kv_heads x head_dim x dtype bytes x tokens, or nullopt on int64 overflow.
// Each factor must be positive.
std::optional<int64_t> KvBytes(const KvCacheSpec& spec, int64_t tokens) {
  std::optional<int64_t> bytes = int64_t{2};
  for (int64_t factor : {int64_t{spec.num_layers}, int64_t{spec.num_kv_heads},
                         int64_t{spec.head_dim}, int64_t{DTypeBytes(spec.dtype)}, tokens}) {
    if (!bytes.has_value()) return std::nullopt;
    bytes = CheckedMul(*bytes, factor);
  }
  return bytes;
}

// False for a value outside the enum (a spec built from a bad cast or a peer's bytes).
bool IsKnownDType(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
    case DType::kFloat16:
    case DType::kBFloat16:
    case DType::kFloat8E4M3:
    case DType::kFloat8E5M2:
      return true;
  }
  return false;
}

absl::Status RequirePositive(absl::string_view field, int32_t value) {
  if (value > 0) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("KV-cache spec: ", field, " must be positive, got ", value));
}

}  // namespace

std::string_view DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "fp32";
    case DType::kFloat16:
      return "fp16";
    case DType::kBFloat16:
      return "bf16";
    case DType::kFloat8E4M3:
      return "fp8_e4m3";
    case DType::kFloat8E5M2:
      return "fp8_e5m2";
  }
  KVCM_CHECK(false) << "unknown DType " << static_cast<int>(dtype);
  return "";
}

absl::StatusOr<DType> ParseDType(std::string_view name) {
  // Debian's Abseil has its own absl::string_view, distinct from std::string_view.
  const std::string lower = absl::AsciiStrToLower(
      absl::StripAsciiWhitespace(absl::string_view(name.data(), name.size())));
  if (lower == "fp32" || lower == "float32") return DType::kFloat32;
  if (lower == "fp16" || lower == "float16" || lower == "half") return DType::kFloat16;
  if (lower == "bf16" || lower == "bfloat16") return DType::kBFloat16;
  if (lower == "fp8" || lower == "fp8_e4m3" || lower == "float8_e4m3fn") {
    return DType::kFloat8E4M3;
  }
  if (lower == "fp8_e5m2" || lower == "float8_e5m2") return DType::kFloat8E5M2;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown dtype \"", std::string(name),
                   "\"; use one of fp32 (float32), fp16 (float16, half), bf16 (bfloat16), "
                   "fp8 (fp8_e4m3, float8_e4m3fn), fp8_e5m2"));
}

absl::Status KvCacheSpec::Validate() const {
  if (absl::Status s = RequirePositive("num_layers", num_layers); !s.ok()) return s;
  if (absl::Status s = RequirePositive("num_kv_heads", num_kv_heads); !s.ok()) return s;
  if (absl::Status s = RequirePositive("head_dim", head_dim); !s.ok()) return s;
  if (absl::Status s = RequirePositive("block_size", block_size); !s.ok()) return s;
  if (block_size > kMaxBlockSize) {
    return absl::InvalidArgumentError(absl::StrCat("KV-cache spec: block_size must be at most ",
                                                   kMaxBlockSize, " tokens, got ", block_size,
                                                   " (it counts tokens, not bytes)"));
  }
  if (!IsKnownDType(dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat("KV-cache spec: unknown dtype value ", static_cast<int>(dtype)));
  }
  if (!KvBytes(*this, block_size).has_value()) {
    return absl::InvalidArgumentError(
        absl::StrCat("KV-cache spec: bytes per block overflow int64 (", ToString(), ")"));
  }
  return absl::OkStatus();
}

int64_t KvCacheSpec::BytesPerToken() const {
  const std::optional<int64_t> bytes = KvBytes(*this, 1);
  KVCM_CHECK(Validate().ok() && bytes.has_value()) << "invalid spec " << ToString();
  return *bytes;
}

int64_t KvCacheSpec::BytesPerBlock() const {
  const std::optional<int64_t> bytes = KvBytes(*this, block_size);
  KVCM_CHECK(Validate().ok() && bytes.has_value()) << "invalid spec " << ToString();
  return *bytes;
}

std::string KvCacheSpec::ToString() const {
  // DTypeName() CHECK-fails on a value outside the enum; a spec reported as invalid may
  // carry one.
  const std::string dtype_name = IsKnownDType(dtype)
                                     ? std::string(DTypeName(dtype))
                                     : absl::StrCat("dtype#", static_cast<int>(dtype));
  return absl::StrCat(num_layers, " layers x ", num_kv_heads, " KV heads x head dim ", head_dim,
                      ", ", dtype_name, ", block size ", block_size);
}

bool operator==(const KvCacheSpec& a, const KvCacheSpec& b) {
  return a.num_layers == b.num_layers && a.num_kv_heads == b.num_kv_heads &&
         a.head_dim == b.head_dim && a.dtype == b.dtype && a.block_size == b.block_size;
}

std::string BytesPerTokenFormula(const KvCacheSpec& spec) {
  const int64_t bytes = spec.BytesPerToken();
  return absl::StrCat("2 (K and V) x ", spec.num_layers, " layers x ", spec.num_kv_heads,
                      " KV heads x ", spec.head_dim, " head dim x ", DTypeBytes(spec.dtype),
                      " bytes (", std::string(DTypeName(spec.dtype)), ") = ", ExactBytes(bytes));
}

std::string BytesPerBlockFormula(const KvCacheSpec& spec) {
  const int64_t bytes = spec.BytesPerBlock();
  return absl::StrCat(spec.BytesPerToken(), " B per token x ", spec.block_size,
                      " tokens per block = ", ExactBytes(bytes));
}

}  // namespace kvcm
