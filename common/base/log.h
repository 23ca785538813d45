#pragma once
// One-line logs to stderr: "2026-11-29T18:51:28.123Z kvcm-cache-manager: <text>".
// Each line is written with one write(2), so lines of concurrent threads do not interleave.
// Services log what an operator needs (start-up breakdown, sessions, failures), not every
// request: per-request detail is in the metrics.

#include <unistd.h>

#include <string>
#include <string_view>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace kvcm {

inline void LogLine(std::string_view component, std::string_view text) {
  std::string line = absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ ", absl::Now(), absl::UTCTimeZone());
  line.append(component.data(), component.size());
  line.append(": ");
  line.append(text.data(), text.size());
  line.push_back('\n');
  [[maybe_unused]] const ssize_t written = ::write(STDERR_FILENO, line.data(), line.size());
}

}  // namespace kvcm
