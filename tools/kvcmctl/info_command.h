#pragma once

// `kvcmctl info`: what a running cache manager serves. The pool's shape and size (KV spec,
// block size, bytes per block, num_blocks, pool bytes, max total tokens), its backend and
// epoch, its endpoints, its limits and the sessions open (id, role, pid, name, quarantined,
// sequences, pending fences: what `kvcmctl end-session` needs).
//
//   kvcmctl info [--run-dir DIR | --endpoint URL] [--timeout 5s] [--json]
//
// Registers as a Control client, asks for Stats, says Goodbye. Split into parse / build /
// format so each step is testable without a process.

#include <ostream>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/client/cache_manager_client.h"
#include "tools/kvcmctl/connection.h"

namespace kvcm::kvcmctl {

struct InfoOptions {
  ConnectionOptions connection;
};

// Parses the words after "info". INVALID_ARGUMENT naming the flag.
absl::StatusOr<InfoOptions> ParseInfoOptions(absl::Span<const std::string> args,
                                             std::string_view default_run_dir);
std::string InfoUsage();

struct InfoReport {
  std::string endpoint;
  std::string events_endpoint;  // empty when not known (a tcp:// --endpoint)
  SessionInfo session;          // kvcmctl's own HelloReply: limits, heartbeat settings
  StatsSnapshot stats;
};

// Connects, asks, says Goodbye. Errors: those of ConnectToCacheManager ("no cache manager
// at ...") and of CacheManagerClient::Stats.
absl::StatusOr<InfoReport> BuildInfoReport(const InfoOptions& options);

// Aligned "name  value" lines.
std::string FormatInfoText(const InfoReport& report);
// One JSON object, keys in this order: endpoint, events_endpoint (when known), epoch,
// uptime_seconds, backend, num_layers, num_kv_heads, head_dim, dtype, dtype_bytes,
// block_size, bytes_per_token, block_bytes, num_blocks, pool_bytes, max_total_tokens,
// hash_algorithm, heartbeat_interval_ms, heartbeat_timeout_ms, max_ops_per_step,
// max_message_bytes, sessions (as the cache manager counted them, kvcmctl's included).
std::string FormatInfoJson(const InfoReport& report);

// Exit codes: kExitOk; kExitUsage for a bad command line; kExitFailure when the cache
// manager cannot be reached or answers with an error.
int RunInfoCommand(absl::Span<const std::string> args, std::ostream& out, std::ostream& err);

}  // namespace kvcm::kvcmctl
