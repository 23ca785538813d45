#pragma once

// `kvcmctl stats`: where a running cache manager's blocks are and what it has done.
//
//   kvcmctl stats [--run-dir DIR | --endpoint URL] [--timeout 5s] [--json]
//
// Blocks by state, with shares that sum to the capacity: free, in use (held by live
// sequences of healthy sessions), cached (reusable prefixes, evictable), pinned (reusable
// prefixes kept on purpose), quarantined (held by hung sessions). Then the usage ratio (in
// use, quarantined included, / capacity), the occupancy ratio (everything holding KV /
// capacity), the prefix hit rate (hit tokens / prompt tokens of successful allocations),
// and the counters: blocks allocated and released, evictions, copy-on-write copies,
// allocation failures, KV events published, messages rejected.

#include <cstdint>
#include <ostream>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/client/cache_manager_client.h"
#include "tools/kvcmctl/connection.h"

namespace kvcm::kvcmctl {

// The five block states of one StatsSnapshot, partitioning the pool. `in_use` excludes
// quarantined blocks here (the wire's in_use_blocks includes them).
struct BlockStates {
  int64_t free = 0;
  int64_t in_use = 0;
  int64_t cached = 0;
  int64_t pinned = 0;
  int64_t quarantined = 0;
  int64_t draining = 0;

  int64_t total() const { return free + in_use + cached + pinned + quarantined + draining; }
};
BlockStates StatesOf(const StatsSnapshot& stats);

// part / whole as a percentage with one decimal, "12.5%"; "-" when whole is 0.
std::string Percent(double part, double whole);

struct StatsOptions {
  ConnectionOptions connection;
};

absl::StatusOr<StatsOptions> ParseStatsOptions(absl::Span<const std::string> args,
                                               std::string_view default_run_dir);
std::string StatsUsage();

// Connects, asks, says Goodbye. Errors as BuildInfoReport.
absl::StatusOr<StatsSnapshot> FetchStats(const ConnectionOptions& options);

// The table and counters for people. When the states do not add up to num_blocks (a
// cache manager bug) a last line says so.
std::string FormatStatsText(const StatsSnapshot& stats);
// One JSON object: epoch, num_blocks, block_size, block_bytes, blocks {free, in_use, cached,
// pinned, quarantined} (in_use without quarantined; they sum to num_blocks), usage_ratio,
// occupancy_ratio, live_sequences, prefix_query_tokens, prefix_hit_tokens,
// prefix_hit_rate (0 before any query), blocks_allocated, blocks_released, evictions,
// cow_copies, allocation_failures, events_published, rejected_messages, sessions,
// uptime_seconds.
std::string FormatStatsJson(const StatsSnapshot& stats);

int RunStatsCommand(absl::Span<const std::string> args, std::ostream& out, std::ostream& err);

}  // namespace kvcm::kvcmctl
