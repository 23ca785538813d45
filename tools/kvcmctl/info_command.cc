#include "tools/kvcmctl/info_command.h"

#include <cstdint>
#include <memory>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/base/status_macros.h"
#include "common/block/block_hash.h"
#include "common/memory/pool_memory.h"
#include "common/sizing/byte_size.h"
#include "common/sizing/kv_cache_spec.h"
#include "nlohmann/json.hpp"
#include "tools/kvcmctl/command.h"
#include "tools/kvcmctl/flag_parser.h"

namespace kvcm::kvcmctl {
namespace {

void Row(std::string* out, std::string_view name, std::string_view value) {
  absl::StrAppend(out, absl::StrFormat("  %-18s %s\n", name, value));
}

// "router", "executor", "control", "unknown".
std::string RoleText(wire::Role role) { return absl::AsciiStrToLower(wire::EnumNameRole(role)); }

int64_t BytesPerToken(const KvCacheSpec& spec) {
  return spec.Validate().ok() ? spec.BytesPerToken() : 0;
}

}  // namespace

absl::StatusOr<InfoOptions> ParseInfoOptions(absl::Span<const std::string> args,
                                             std::string_view default_run_dir) {
  InfoOptions options;
  KVCM_ASSIGN_OR_RETURN(options.connection, ParseConnectionOnlyCommand(args, default_run_dir));
  return options;
}

std::string InfoUsage() {
  return absl::StrCat(
      "Usage: kvcmctl info [--run-dir DIR | --endpoint URL] [--timeout DURATION] [--json]\n"
      "\n"
      "Shows what a running kvcm-cache-manager serves: the KV spec, block size, bytes per\n"
      "block, num_blocks, pool bytes, backend, epoch, endpoints and sessions.\n"
      "\n"
      "Flags:\n",
      FlagHelp(WithConnectionFlags({})));
}

absl::StatusOr<InfoReport> BuildInfoReport(const InfoOptions& options) {
  KVCM_ASSIGN_OR_RETURN(std::unique_ptr<CacheManagerClient> client,
                        ConnectToCacheManager(options.connection, "info",
                                              /*heartbeats=*/false));
  InfoReport report;
  report.endpoint = options.connection.endpoint;
  report.events_endpoint = options.connection.events_endpoint;
  report.session = client->session();
  absl::StatusOr<StatsSnapshot> stats = client->Stats();
  if (!stats.ok()) return DescribeUnreachable(stats.status(), report.endpoint);
  report.stats = *stats;
  if (!stats->events_endpoint.empty()) report.events_endpoint = stats->events_endpoint;
  // Best effort: the session ends with this process anyway.
  (void)client->Goodbye();
  return report;
}

std::string FormatInfoText(const InfoReport& report) {
  const StatsSnapshot& s = report.stats;
  const SessionInfo& session = report.session;
  std::string out = absl::StrCat("kvcm-cache-manager at ", report.endpoint, "\n");
  Row(&out, "epoch", absl::StrCat(s.epoch));
  Row(&out, "uptime", absl::StrFormat("%.1f s", s.uptime_seconds));
  Row(&out, "backend", PoolBackendName(s.backend));
  Row(&out, "KV spec", s.spec.Validate().ok() ? s.spec.ToString() : "(not reported)");
  Row(&out, "block size", absl::StrCat(s.block_size, " tokens"));
  Row(&out, "bytes per token", ExactBytes(BytesPerToken(s.spec)));
  Row(&out, "bytes per block", ExactBytes(static_cast<int64_t>(s.block_bytes)));
  Row(&out, "num_blocks", absl::StrCat(s.num_blocks));
  Row(&out, "pool bytes", ExactBytes(static_cast<int64_t>(s.pool_bytes)));
  Row(&out, "max total tokens",
      absl::StrCat(int64_t{s.num_blocks} * s.block_size, " (num_blocks x block size)"));
  Row(&out, "hash algorithm", HashAlgorithmName(session.hash_algorithm));
  Row(&out, "heartbeats",
      absl::StrCat("every ", absl::FormatDuration(session.heartbeat_interval), ", timeout ",
                   absl::FormatDuration(session.heartbeat_timeout)));
  Row(&out, "max ops per step", absl::StrCat(session.max_ops_per_step));
  Row(&out, "max message", FormatBytes(session.max_message_bytes));
  Row(&out, "sessions", absl::StrCat(s.sessions, " (this kvcmctl included)"));
  for (const SessionListing& l : s.session_list) {
    absl::StrAppend(
        &out,
        absl::StrFormat(
            "    %-16d %-8s pid %d%s  %s%s  %d sequences%s\n", l.session_id, RoleText(l.role),
            l.pid, l.pid_verified ? "" : " (claimed, tcp)", l.name.empty() ? "-" : l.name,
            l.quarantined ? "  QUARANTINED" : "", l.sequences,
            l.pending_fences > 0 ? absl::StrCat(", ", l.pending_fences, " fences pending") : ""));
  }
  Row(&out, "requests", report.endpoint);
  if (!report.events_endpoint.empty()) Row(&out, "events", report.events_endpoint);
  if (!s.metrics_url.empty()) Row(&out, "metrics", s.metrics_url);
  return out;
}

std::string FormatInfoJson(const InfoReport& report) {
  const StatsSnapshot& s = report.stats;
  const SessionInfo& session = report.session;
  nlohmann::ordered_json j;
  j["endpoint"] = report.endpoint;
  if (!report.events_endpoint.empty()) j["events_endpoint"] = report.events_endpoint;
  if (!s.metrics_url.empty()) j["metrics_url"] = s.metrics_url;
  j["epoch"] = s.epoch;
  j["uptime_seconds"] = s.uptime_seconds;
  j["backend"] = std::string(PoolBackendName(s.backend));
  j["num_layers"] = s.spec.num_layers;
  j["num_kv_heads"] = s.spec.num_kv_heads;
  j["head_dim"] = s.spec.head_dim;
  j["dtype"] = std::string(DTypeName(s.spec.dtype));
  j["dtype_bytes"] = DTypeBytes(s.spec.dtype);
  j["block_size"] = s.block_size;
  j["bytes_per_token"] = BytesPerToken(s.spec);
  j["block_bytes"] = s.block_bytes;
  j["num_blocks"] = s.num_blocks;
  j["pool_bytes"] = s.pool_bytes;
  j["max_total_tokens"] = int64_t{s.num_blocks} * s.block_size;
  j["hash_algorithm"] = std::string(HashAlgorithmName(session.hash_algorithm));
  j["heartbeat_interval_ms"] = absl::ToInt64Milliseconds(session.heartbeat_interval);
  j["heartbeat_timeout_ms"] = absl::ToInt64Milliseconds(session.heartbeat_timeout);
  j["max_ops_per_step"] = session.max_ops_per_step;
  j["max_message_bytes"] = session.max_message_bytes;
  j["sessions"] = s.sessions;
  nlohmann::ordered_json list = nlohmann::ordered_json::array();
  for (const SessionListing& l : s.session_list) {
    nlohmann::ordered_json entry;
    entry["session_id"] = l.session_id;
    entry["role"] = RoleText(l.role);
    entry["pid"] = l.pid;
    entry["pid_verified"] = l.pid_verified;
    entry["name"] = l.name;
    entry["quarantined"] = l.quarantined;
    entry["sequences"] = l.sequences;
    entry["pending_fences"] = l.pending_fences;
    list.push_back(std::move(entry));
  }
  j["session_list"] = std::move(list);
  return j.dump(2) + "\n";
}

int RunInfoCommand(absl::Span<const std::string> args, std::ostream& out, std::ostream& err) {
  const absl::StatusOr<InfoOptions> options =
      ParseInfoOptions(args, DefaultRunDirFromEnvironment());
  if (!options.ok()) {
    err << "kvcmctl info: " << options.status().message() << "\n"
        << "Run 'kvcmctl info --help' for usage.\n";
    return kExitUsage;
  }
  if (options->connection.help) {
    out << InfoUsage();
    return kExitOk;
  }
  const absl::StatusOr<InfoReport> report = BuildInfoReport(*options);
  if (!report.ok()) {
    err << "kvcmctl info: " << report.status().message() << "\n";
    return kExitFailure;
  }
  out << (options->connection.json ? FormatInfoJson(*report) : FormatInfoText(*report));
  return kExitOk;
}

}  // namespace kvcm::kvcmctl
