#include "common/sizing/byte_size.h"

#include <cstdint>
#include <limits>
#include <string>
#include <string_view>

#include "absl/numeric/int128.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"

namespace kvcm {
namespace {

// At most this many fractional digits are kept; more precision than a byte is noise.
constexpr int kMaxFractionDigits = 18;

struct Unit {
  std::string_view name;  // lower case
  int64_t multiplier;
};

constexpr int64_t kKi = int64_t{1} << 10;
constexpr int64_t kMi = int64_t{1} << 20;
constexpr int64_t kGi = int64_t{1} << 30;
constexpr int64_t kTi = int64_t{1} << 40;

// clang-format off
constexpr Unit kUnits[] = {
    {"", 1},          {"b", 1},
    {"k", kKi},       {"kib", kKi},       {"kb", 1'000},
    {"m", kMi},       {"mib", kMi},       {"mb", 1'000'000},
    {"g", kGi},       {"gib", kGi},       {"gb", 1'000'000'000},
    {"t", kTi},       {"tib", kTi},       {"tb", 1'000'000'000'000},
};
// clang-format on

bool IsDigit(char c) { return c >= '0' && c <= '9'; }

absl::Status Invalid(absl::string_view text, absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat("invalid byte size \"", text, "\": ", why,
                                                 " (examples: 123456, 512MiB, 64GiB, 80GB)"));
}

}  // namespace

absl::StatusOr<int64_t> ParseByteSize(std::string_view input) {
  // Debian's Abseil has its own absl::string_view, distinct from std::string_view.
  const absl::string_view text(input.data(), input.size());
  const absl::string_view trimmed = absl::StripAsciiWhitespace(text);
  if (trimmed.empty()) return Invalid(text, "empty");
  if (trimmed.front() == '-') return Invalid(text, "must not be negative");
  if (trimmed.front() == '+') return Invalid(text, "no sign allowed");

  // Integer part.
  size_t pos = 0;
  absl::uint128 integer = 0;
  bool any_digit = false;
  while (pos < trimmed.size() && IsDigit(trimmed[pos])) {
    integer = integer * 10 + static_cast<uint64_t>(trimmed[pos] - '0');
    // Anything above INT64_MAX fails below anyway; stop growing before uint128 wraps.
    if (integer > std::numeric_limits<int64_t>::max()) return Invalid(text, "too large");
    any_digit = true;
    ++pos;
  }
  // Fractional part: numerator / 10^digits.
  absl::uint128 frac_numerator = 0;
  absl::uint128 frac_denominator = 1;
  bool has_fraction = false;
  if (pos < trimmed.size() && trimmed[pos] == '.') {
    has_fraction = true;
    ++pos;
    int digits = 0;
    while (pos < trimmed.size() && IsDigit(trimmed[pos])) {
      if (digits < kMaxFractionDigits) {
        frac_numerator = frac_numerator * 10 + static_cast<uint64_t>(trimmed[pos] - '0');
        frac_denominator *= 10;
        ++digits;
      }
      any_digit = true;
      ++pos;
    }
  }
  if (!any_digit) return Invalid(text, "expected a number");

  // Unit, after optional spaces.
  while (pos < trimmed.size() && trimmed[pos] == ' ') ++pos;
  const std::string unit_name = absl::AsciiStrToLower(trimmed.substr(pos));
  const Unit* unit = nullptr;
  for (const Unit& candidate : kUnits) {
    if (candidate.name == unit_name) {
      unit = &candidate;
      break;
    }
  }
  if (unit == nullptr) {
    return Invalid(text, absl::StrCat("unknown unit \"", trimmed.substr(pos),
                                      "\"; use B, KiB, MiB, GiB, TiB, K, M, G, T, KB, MB, GB "
                                      "or TB"));
  }
  if (has_fraction && unit->multiplier == 1 && frac_numerator != 0) {
    return Invalid(text, "a fraction of a byte; bytes are whole");
  }

  const absl::uint128 multiplier = static_cast<uint64_t>(unit->multiplier);
  // integer < 2^63 and multiplier <= 2^40, so the product fits in 128 bits.
  const absl::uint128 whole = integer * multiplier;
  // frac_numerator < 10^18 < 2^60 and multiplier <= 2^40: fits too. Rounded down.
  const absl::uint128 fraction = frac_numerator * multiplier / frac_denominator;
  const absl::uint128 total = whole + fraction;
  if (total > std::numeric_limits<int64_t>::max()) return Invalid(text, "too large");
  return static_cast<int64_t>(absl::Uint128Low64(total));
}

std::string FormatBytes(int64_t bytes) {
  if (bytes < 0) {
    // -INT64_MIN overflows; go through uint64.
    const uint64_t magnitude = uint64_t{0} - static_cast<uint64_t>(bytes);
    if (magnitude > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return absl::StrCat("-", FormatBytes(std::numeric_limits<int64_t>::max()));
    }
    return absl::StrCat("-", FormatBytes(static_cast<int64_t>(magnitude)));
  }
  if (bytes < kKi) return absl::StrCat(bytes, " B");
  static constexpr std::string_view kNames[] = {"KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  double value = static_cast<double>(bytes) / static_cast<double>(kKi);
  size_t index = 0;
  while (value >= 1024.0 && index + 1 < std::size(kNames)) {
    value /= 1024.0;
    ++index;
  }
  return absl::StrFormat("%.2f %s", value, kNames[index]);
}

std::string ExactBytes(int64_t bytes) {
  if (bytes > -kKi && bytes < kKi) return absl::StrCat(bytes, " B");
  return absl::StrCat(bytes, " B (", FormatBytes(bytes), ")");
}

}  // namespace kvcm
