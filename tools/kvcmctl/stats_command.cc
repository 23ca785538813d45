#include "tools/kvcmctl/stats_command.h"

#include <memory>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/base/status_macros.h"
#include "common/sizing/byte_size.h"
#include "nlohmann/json.hpp"
#include "tools/kvcmctl/command.h"
#include "tools/kvcmctl/flag_parser.h"

namespace kvcm::kvcmctl {

BlockStates StatesOf(const StatsSnapshot& stats) {
  BlockStates states;
  states.free = stats.free_blocks;
  states.in_use = int64_t{stats.in_use_blocks} - stats.quarantined_blocks - stats.draining_blocks;
  states.cached = stats.cached_blocks;
  states.pinned = stats.pinned_blocks;
  states.quarantined = stats.quarantined_blocks;
  states.draining = stats.draining_blocks;
  return states;
}

std::string Percent(double part, double whole) {
  if (whole == 0) return "-";
  return absl::StrFormat("%.1f%%", 100.0 * part / whole);
}

absl::StatusOr<StatsOptions> ParseStatsOptions(absl::Span<const std::string> args,
                                               std::string_view default_run_dir) {
  StatsOptions options;
  KVCM_ASSIGN_OR_RETURN(options.connection, ParseConnectionOnlyCommand(args, default_run_dir));
  return options;
}

std::string StatsUsage() {
  return absl::StrCat(
      "Usage: kvcmctl stats [--run-dir DIR | --endpoint URL] [--timeout DURATION] [--json]\n"
      "\n"
      "Shows a running kvcm-cache-manager's blocks by state (free, in use, cached, pinned,\n"
      "quarantined, draining; they sum to the capacity), usage and occupancy, the prefix hit rate\n"
      "(hit tokens / prompt tokens) and its counters; with tiers below the pool (host, disk),\n"
      "each tier's capacity, blocks ready and being written, and blocks stored, loaded and\n"
      "evicted.\n"
      "\n"
      "Flags:\n",
      FlagHelp(WithConnectionFlags({})));
}

absl::StatusOr<StatsSnapshot> FetchStats(const ConnectionOptions& options) {
  KVCM_ASSIGN_OR_RETURN(std::unique_ptr<CacheManagerClient> client,
                        ConnectToCacheManager(options, "stats", /*heartbeats=*/false));
  absl::StatusOr<StatsSnapshot> stats = client->Stats();
  if (!stats.ok()) return DescribeUnreachable(stats.status(), options.endpoint);
  (void)client->Goodbye();
  return stats;
}

std::string FormatStatsText(const StatsSnapshot& s) {
  const BlockStates states = StatesOf(s);
  const double total = s.num_blocks;
  std::string out = absl::StrFormat("Blocks: %d of %d tokens each (%s per block)\n", s.num_blocks,
                                    s.block_size, FormatBytes(static_cast<int64_t>(s.block_bytes)));
  absl::StrAppend(&out, absl::StrFormat("  %-12s %10s %8s\n", "state", "blocks", "share"));
  const std::pair<const char*, int64_t> rows[] = {
      {"free", states.free},     {"in use", states.in_use},           {"cached", states.cached},
      {"pinned", states.pinned}, {"quarantined", states.quarantined}, {"draining", states.draining},
  };
  for (const auto& [name, count] : rows) {
    absl::StrAppend(&out, absl::StrFormat("  %-12s %10d %8s\n", name, count,
                                          Percent(static_cast<double>(count), total)));
  }
  absl::StrAppend(&out, absl::StrFormat("  %-12s %10d %8s\n", "total", states.total(),
                                        Percent(static_cast<double>(states.total()), total)));
  absl::StrAppend(
      &out, absl::StrFormat(
                "Usage %s (in use, quarantined and draining included, / capacity); occupancy %s "
                "(holding KV / capacity)\n",
                absl::StrFormat("%.1f%%", 100 * s.usage_ratio),
                absl::StrFormat("%.1f%%", 100 * s.occupancy_ratio)));
  absl::StrAppend(&out, absl::StrFormat("Live sequences %d\n", s.live_sequences));
  absl::StrAppend(&out, absl::StrFormat("Prefix hit rate %s (%d of %d prompt tokens were cached)\n",
                                        Percent(static_cast<double>(s.prefix_hit_tokens),
                                                static_cast<double>(s.prefix_query_tokens)),
                                        s.prefix_hit_tokens, s.prefix_query_tokens));
  absl::StrAppend(&out, absl::StrFormat("Blocks allocated %d, released %d\n", s.blocks_allocated,
                                        s.blocks_released));
  absl::StrAppend(&out, absl::StrFormat("Evictions %d; copy-on-write copies %d; allocation "
                                        "failures %d\n",
                                        s.evictions, s.cow_copies, s.allocation_failures));
  absl::StrAppend(&out, absl::StrFormat("Events published %d; messages rejected %d\n",
                                        s.events_published, s.rejected_messages));
  absl::StrAppend(&out, absl::StrFormat("Sessions %d; open fences %d; uptime %.1f s; epoch %d\n",
                                        s.sessions, s.open_fences, s.uptime_seconds, s.epoch));
  if (!s.tiers.empty()) {
    absl::StrAppend(&out, absl::StrFormat("Tiers: %d pool blocks held for stores, %d loading; "
                                          "disk refusals %d, blocks recovered at start %d\n",
                                          s.tier_held_blocks, s.tier_loading_blocks,
                                          s.tier_refusals_total, s.tier_recovered_blocks));
    absl::StrAppend(
        &out, absl::StrFormat("  %-6s %10s %10s %8s %12s %12s %12s\n", "tier", "capacity", "ready",
                              "writing", "stored", "loaded", "evicted"));
    for (const TierListing& tier : s.tiers) {
      absl::StrAppend(&out,
                      absl::StrFormat("  %-6s %10d %10d %8d %12d %12d %12d\n", tier.name,
                                      tier.capacity_blocks, tier.ready_blocks, tier.writing_blocks,
                                      tier.stored_total, tier.loaded_total, tier.evicted_total));
    }
  }
  if (states.total() != s.num_blocks) {
    absl::StrAppend(&out, absl::StrFormat("WARNING: the states sum to %d blocks, not %d\n",
                                          states.total(), s.num_blocks));
  }
  return out;
}

std::string FormatStatsJson(const StatsSnapshot& s) {
  const BlockStates states = StatesOf(s);
  nlohmann::ordered_json j;
  j["epoch"] = s.epoch;
  j["num_blocks"] = s.num_blocks;
  j["block_size"] = s.block_size;
  j["block_bytes"] = s.block_bytes;
  j["blocks"] = {{"free", states.free},
                 {"in_use", states.in_use},
                 {"cached", states.cached},
                 {"pinned", states.pinned},
                 {"quarantined", states.quarantined},
                 {"draining", states.draining}};
  j["open_fences"] = s.open_fences;
  j["usage_ratio"] = s.usage_ratio;
  j["occupancy_ratio"] = s.occupancy_ratio;
  j["live_sequences"] = s.live_sequences;
  j["prefix_query_tokens"] = s.prefix_query_tokens;
  j["prefix_hit_tokens"] = s.prefix_hit_tokens;
  j["prefix_hit_rate"] = s.prefix_hit_rate();
  j["blocks_allocated"] = s.blocks_allocated;
  j["blocks_released"] = s.blocks_released;
  j["evictions"] = s.evictions;
  j["cow_copies"] = s.cow_copies;
  j["allocation_failures"] = s.allocation_failures;
  j["events_published"] = s.events_published;
  j["rejected_messages"] = s.rejected_messages;
  j["sessions"] = s.sessions;
  j["uptime_seconds"] = s.uptime_seconds;
  if (!s.tiers.empty()) {
    nlohmann::ordered_json tiers = nlohmann::ordered_json::array();
    for (const TierListing& tier : s.tiers) {
      nlohmann::ordered_json entry;
      entry["name"] = tier.name;
      entry["capacity_blocks"] = tier.capacity_blocks;
      entry["ready_blocks"] = tier.ready_blocks;
      entry["writing_blocks"] = tier.writing_blocks;
      entry["stored_total"] = tier.stored_total;
      entry["loaded_total"] = tier.loaded_total;
      entry["evicted_total"] = tier.evicted_total;
      tiers.push_back(std::move(entry));
    }
    j["tiers"] = std::move(tiers);
    j["tier_held_blocks"] = s.tier_held_blocks;
    j["tier_loading_blocks"] = s.tier_loading_blocks;
    j["tier_refusals_total"] = s.tier_refusals_total;
    j["tier_recovered_blocks"] = s.tier_recovered_blocks;
  }
  return j.dump(2) + "\n";
}

int RunStatsCommand(absl::Span<const std::string> args, std::ostream& out, std::ostream& err) {
  const absl::StatusOr<StatsOptions> options =
      ParseStatsOptions(args, DefaultRunDirFromEnvironment());
  if (!options.ok()) {
    err << "kvcmctl stats: " << options.status().message() << "\n"
        << "Run 'kvcmctl stats --help' for usage.\n";
    return kExitUsage;
  }
  if (options->connection.help) {
    out << StatsUsage();
    return kExitOk;
  }
  const absl::StatusOr<StatsSnapshot> stats = FetchStats(options->connection);
  if (!stats.ok()) {
    err << "kvcmctl stats: " << stats.status().message() << "\n";
    return kExitFailure;
  }
  out << (options->connection.json ? FormatStatsJson(*stats) : FormatStatsText(*stats));
  return kExitOk;
}

}  // namespace kvcm::kvcmctl
