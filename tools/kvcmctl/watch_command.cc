#include "tools/kvcmctl/watch_command.h"

#include <signal.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/base/monotonic_clock.h"
#include "common/base/status_macros.h"
#include "nlohmann/json.hpp"
#include "tools/kvcmctl/command.h"
#include "tools/kvcmctl/flag_parser.h"
#include "tools/kvcmctl/stats_command.h"

namespace kvcm::kvcmctl {
namespace {

constexpr FlagSpec kWatchFlags[] = {
    {"interval", "DURATION", "time between lines, e.g. 500ms or 2s (default 1s)"},
    {"count", "N", "print N lines, then stop (default: until interrupted)"},
};

// Set by SIGINT/SIGTERM while `watch` runs: stop after the current line, say Goodbye.
std::atomic<bool> g_stop_requested{false};
static_assert(std::atomic<bool>::is_always_lock_free);

extern "C" void RequestStop(int) { g_stop_requested.store(true); }

// Installs RequestStop for SIGINT and SIGTERM; restores the old handlers when destroyed.
class StopSignals {
 public:
  StopSignals() {
    g_stop_requested.store(false);
    struct sigaction action {};
    action.sa_handler = &RequestStop;
    sigemptyset(&action.sa_mask);
    sigaction(SIGINT, &action, &old_int_);
    sigaction(SIGTERM, &action, &old_term_);
  }
  ~StopSignals() {
    sigaction(SIGINT, &old_int_, nullptr);
    sigaction(SIGTERM, &old_term_, nullptr);
  }
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

 private:
  struct sigaction old_int_ {};
  struct sigaction old_term_ {};
};

// Sleeps until `when`, waking every 50 ms to notice a stop request. False if stopped.
bool SleepUntil(absl::Time when) {
  while (!g_stop_requested.load()) {
    const absl::Duration left = when - MonotonicNow();
    if (left <= absl::ZeroDuration()) return true;
    absl::SleepFor(std::min(left, absl::Milliseconds(50)));
  }
  return false;
}

double PerSecond(uint64_t now, uint64_t before, absl::Duration elapsed) {
  const double seconds = absl::ToDoubleSeconds(elapsed);
  if (seconds <= 0 || now < before) return 0;
  return static_cast<double>(now - before) / seconds;
}

std::string Rate(const WatchSample& sample, uint64_t StatsSnapshot::*field) {
  if (sample.previous == nullptr) return "-";
  return absl::StrFormat("%.1f",
                         PerSecond(sample.stats.*field, sample.previous->*field, sample.elapsed));
}

std::string IntervalHitRate(const WatchSample& sample) {
  if (sample.previous == nullptr) return "-";
  return Percent(
      static_cast<double>(sample.stats.prefix_hit_tokens - sample.previous->prefix_hit_tokens),
      static_cast<double>(sample.stats.prefix_query_tokens - sample.previous->prefix_query_tokens));
}

}  // namespace

absl::StatusOr<WatchOptions> ParseWatchOptions(absl::Span<const std::string> args,
                                               std::string_view default_run_dir) {
  const std::vector<FlagSpec> specs = WithConnectionFlags(kWatchFlags);
  KVCM_ASSIGN_OR_RETURN(const ParsedFlags flags, ParseFlags(specs, args));
  if (!flags.positional().empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("unexpected argument \"", flags.positional().front(), "\""));
  }
  WatchOptions options;
  KVCM_RETURN_IF_ERROR(ParseConnectionOptions(flags, default_run_dir, &options.connection));
  if (flags.Has("interval")) {
    const std::string text = *flags.Get("interval");
    if (!absl::ParseDuration(text, &options.interval) || options.interval <= absl::ZeroDuration() ||
        options.interval == absl::InfiniteDuration()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--interval: expected a positive duration such as 500ms or 2s, got \"", text, "\""));
    }
  }
  if (flags.Has("count")) {
    const std::string text = *flags.Get("count");
    if (!absl::SimpleAtoi(text, &options.count) || options.count <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("--count: expected a positive integer, got \"", text, "\""));
    }
  }
  return options;
}

std::string WatchUsage() {
  return absl::StrCat(
      "Usage: kvcmctl watch [--interval DURATION] [--count N]\n"
      "                     [--run-dir DIR | --endpoint URL] [--timeout DURATION] [--json]\n"
      "\n"
      "Prints a running kvcm-cache-manager's blocks by state, usage and occupancy once per\n"
      "interval, with the prefix hit rate and allocation, eviction, copy-on-write and failure\n"
      "rates over the interval. Stops after --count lines or on Ctrl-C.\n"
      "\n"
      "Flags:\n",
      FlagHelp(WithConnectionFlags(kWatchFlags)));
}

std::string FormatWatchHeader() {
  return absl::StrFormat("%-8s %7s %7s %7s %7s %7s %7s %7s %7s %7s %8s %8s %7s %7s\n", "time",
                         "free", "in_use", "cached", "pinned", "quar", "drain", "usage", "occup",
                         "hit", "alloc/s", "evict/s", "cow/s", "fail/s");
}

std::string FormatWatchLine(const WatchSample& sample) {
  const StatsSnapshot& s = sample.stats;
  const BlockStates states = StatesOf(s);
  return absl::StrFormat(
      "%-8s %7d %7d %7d %7d %7d %7d %7s %7s %7s %8s %8s %7s %7s\n",
      absl::FormatTime("%H:%M:%S", sample.time, absl::UTCTimeZone()), states.free, states.in_use,
      states.cached, states.pinned, states.quarantined, states.draining,
      absl::StrFormat("%.1f%%", 100 * s.usage_ratio),
      absl::StrFormat("%.1f%%", 100 * s.occupancy_ratio), IntervalHitRate(sample),
      Rate(sample, &StatsSnapshot::blocks_allocated), Rate(sample, &StatsSnapshot::evictions),
      Rate(sample, &StatsSnapshot::cow_copies), Rate(sample, &StatsSnapshot::allocation_failures));
}

std::string FormatWatchJson(const WatchSample& sample) {
  const StatsSnapshot& s = sample.stats;
  const BlockStates states = StatesOf(s);
  nlohmann::ordered_json j;
  j["time"] = absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", sample.time, absl::UTCTimeZone());
  j["epoch"] = s.epoch;
  j["num_blocks"] = s.num_blocks;
  j["blocks"] = {{"free", states.free},
                 {"in_use", states.in_use},
                 {"cached", states.cached},
                 {"pinned", states.pinned},
                 {"quarantined", states.quarantined},
                 {"draining", states.draining}};
  j["usage_ratio"] = s.usage_ratio;
  j["occupancy_ratio"] = s.occupancy_ratio;
  j["live_sequences"] = s.live_sequences;
  if (sample.previous != nullptr) {
    const StatsSnapshot& p = *sample.previous;
    j["interval_seconds"] = absl::ToDoubleSeconds(sample.elapsed);
    const uint64_t queries = s.prefix_query_tokens - p.prefix_query_tokens;
    if (queries == 0) {
      j["interval_prefix_hit_rate"] = nullptr;
    } else {
      j["interval_prefix_hit_rate"] =
          static_cast<double>(s.prefix_hit_tokens - p.prefix_hit_tokens) /
          static_cast<double>(queries);
    }
    j["allocations_per_second"] = PerSecond(s.blocks_allocated, p.blocks_allocated, sample.elapsed);
    j["evictions_per_second"] = PerSecond(s.evictions, p.evictions, sample.elapsed);
    j["cow_copies_per_second"] = PerSecond(s.cow_copies, p.cow_copies, sample.elapsed);
    j["allocation_failures_per_second"] =
        PerSecond(s.allocation_failures, p.allocation_failures, sample.elapsed);
  }
  return j.dump() + "\n";
}

int RunWatchCommand(absl::Span<const std::string> args, std::ostream& out, std::ostream& err) {
  const absl::StatusOr<WatchOptions> options =
      ParseWatchOptions(args, DefaultRunDirFromEnvironment());
  if (!options.ok()) {
    err << "kvcmctl watch: " << options.status().message() << "\n"
        << "Run 'kvcmctl watch --help' for usage.\n";
    return kExitUsage;
  }
  if (options->connection.help) {
    out << WatchUsage();
    return kExitOk;
  }
  const ConnectionOptions& connection = options->connection;
  // Heartbeats keep the session while lines are far apart.
  absl::StatusOr<std::unique_ptr<CacheManagerClient>> client =
      ConnectToCacheManager(connection, "watch", /*heartbeats=*/true);
  if (!client.ok()) {
    err << "kvcmctl watch: " << client.status().message() << "\n";
    return kExitFailure;
  }

  StopSignals stop_signals;
  if (!connection.json) out << FormatWatchHeader() << std::flush;
  std::optional<StatsSnapshot> previous;
  absl::Time previous_time;
  bool last_failed = false;
  const absl::Time start = MonotonicNow();
  for (int64_t line = 0; options->count == 0 || line < options->count; ++line) {
    if (line > 0 && !SleepUntil(start + options->interval * line)) break;
    absl::StatusOr<StatsSnapshot> stats = (*client)->Stats();
    const absl::Time now = MonotonicNow();
    if (!stats.ok()) {
      // ABORTED: the cache manager restarted and the client registered again; the counters
      // start over, so the next line has no rates.
      err << "kvcmctl watch: " << DescribeUnreachable(stats.status(), connection.endpoint).message()
          << "\n";
      previous.reset();
      last_failed = true;
      continue;
    }
    last_failed = false;
    if (previous.has_value() && previous->epoch != stats->epoch) previous.reset();
    WatchSample sample;
    sample.time = now;
    sample.stats = *stats;
    sample.previous = previous.has_value() ? &*previous : nullptr;
    sample.elapsed = now - previous_time;
    out << (connection.json ? FormatWatchJson(sample) : FormatWatchLine(sample)) << std::flush;
    previous = *stats;
    previous_time = now;
  }
  (void)(*client)->Goodbye();
  return last_failed ? kExitFailure : kExitOk;
}

}  // namespace kvcm::kvcmctl
