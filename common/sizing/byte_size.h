#pragma once

// Byte sizes as users write them on the command line, and as kvcm prints them.

#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace kvcm {

// Parses a byte size: a non-negative decimal number, optionally with a fractional part,
// optionally followed (after optional spaces) by a unit. Units are case-insensitive:
//
//   (none), B              x 1
//   KiB MiB GiB TiB        x 1024^n  (binary)
//   K   M   G   T          x 1024^n  (bare letters are binary too, as in most memory tools)
//   KB  MB  GB  TB         x 1000^n  (decimal, as disk and GPU vendors write them)
//
// Examples: "123456" -> 123456, "512MiB" -> 536870912, "64G" -> 68719476736,
// "80GB" -> 80000000000, "1.5TiB" -> 1649267441664.
// A fractional result is rounded down to a whole byte ("1.1KiB" -> 1126). A plain number
// with a fraction and no unit ("1.5") is rejected: bytes are whole.
// Returns INVALID_ARGUMENT for an empty string, a sign (negative sizes make no sense), an
// exponent, an unknown unit, trailing garbage, or a value above INT64_MAX.
absl::StatusOr<int64_t> ParseByteSize(std::string_view text);

// Formats a byte count for people with binary units and two decimals: "512 B",
// "1.50 KiB", "64.00 GiB", "1.50 TiB". Below 1 KiB prints the exact count. Negative counts
// are printed with a leading '-'.
std::string FormatBytes(int64_t bytes);

// The exact count, then FormatBytes in parentheses from 1 KiB up: "131072 B (128.00 KiB)",
// "512 B". For formulas, where the exact figure matters and the unit helps reading.
std::string ExactBytes(int64_t bytes);

}  // namespace kvcm
