#pragma once

// `kvcmctl watch`: one line of cache statistics per interval.
//
//   kvcmctl watch [--interval 1s] [--count N] [--run-dir DIR | --endpoint URL]
//                 [--timeout 5s] [--json]
//
// Each line: the time, blocks by state (as `kvcmctl stats`), usage and occupancy, and over
// the interval since the previous line the prefix hit rate (hit tokens / prompt tokens) and
// the rates per second of block allocations, evictions, copy-on-write copies and allocation
// failures ("-" on the first line and after a restart). With --json, one JSON object per
// line. Runs until --count lines were printed or SIGINT/SIGTERM, then says Goodbye.
// A sample that fails (no answer in time) prints its reason to stderr and watching goes on;
// a cache-manager restart is reported and followed.

#include <cstdint>
#include <ostream>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/client/cache_manager_client.h"
#include "tools/kvcmctl/connection.h"

namespace kvcm::kvcmctl {

struct WatchOptions {
  ConnectionOptions connection;
  absl::Duration interval = absl::Seconds(1);  // --interval: time between lines
  int64_t count = 0;                           // --count: lines to print; 0 = until stopped
};

absl::StatusOr<WatchOptions> ParseWatchOptions(absl::Span<const std::string> args,
                                               std::string_view default_run_dir);
std::string WatchUsage();

// One sample and what it is compared with.
struct WatchSample {
  absl::Time time;
  StatsSnapshot stats;
  // The previous sample of the same epoch, if any: rates are over [previous, this].
  const StatsSnapshot* previous = nullptr;
  absl::Duration elapsed;  // since the previous sample
};

// The column names, aligned with FormatWatchLine.
std::string FormatWatchHeader();
// One line, ending in a newline; times in UTC (HH:MM:SS).
std::string FormatWatchLine(const WatchSample& sample);
// One compact JSON object on one line: time (RFC 3339, UTC), epoch, num_blocks, blocks
// {free, in_use, cached, pinned, quarantined}, usage_ratio, occupancy_ratio, live_sequences,
// and when there is a previous sample: interval_seconds, interval_prefix_hit_rate (null
// without queries), allocations_per_second, evictions_per_second, cow_copies_per_second,
// allocation_failures_per_second.
std::string FormatWatchJson(const WatchSample& sample);

// Exit codes: kExitOk; kExitUsage; kExitFailure when the cache manager cannot be reached at
// the start, or the last sample failed.
int RunWatchCommand(absl::Span<const std::string> args, std::ostream& out, std::ostream& err);

}  // namespace kvcm::kvcmctl
