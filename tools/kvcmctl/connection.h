#pragma once

// What every kvcmctl command that talks to a running cache manager shares: the flags that
// say where it is (--run-dir or --endpoint), how long to wait (--timeout), --json, and the
// connection itself (role Control, "no cache manager at <endpoint>: <reason>" on failure).
//
// Thread safety: plain values and stateless functions.

#include <sys/types.h>

#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/base/run_dir.h"
#include "common/client/cache_manager_client.h"
#include "tools/kvcmctl/flag_parser.h"

namespace kvcm::kvcmctl {

// The connection flags, first in each such command's table.
inline constexpr FlagSpec kConnectionFlags[] = {
    {"run-dir", "DIR",
     "the cache manager's run directory (default $XDG_RUNTIME_DIR/kvcm, else /tmp/kvcm-$UID)"},
    {"endpoint", "URL", "its request socket instead of --run-dir: ipc://PATH or tcp://HOST:PORT"},
    {"timeout", "DURATION", "how long to wait for each answer, e.g. 500ms or 5s (default 5s)"},
    {"json", "", "print JSON instead of text"},
    {"help", "", "print this help"},
};

// DefaultRunDir and DefaultRunDirFromEnvironment (the latter for the Run*Command functions
// only) come from common/base/run_dir.h.

// The sockets a cache manager creates in its run directory.
std::string RequestEndpointIn(std::string_view run_dir);  // ipc://DIR/cache-manager.sock
std::string EventsEndpointIn(std::string_view run_dir);   // ipc://DIR/events.sock

struct ConnectionOptions {
  bool help = false;
  // Where the cache manager answers: from --endpoint, else ipc://RUN_DIR/cache-manager.sock.
  std::string endpoint;
  // Its events socket when known: ipc://DIR/events.sock when the endpoint is an ipc:// path
  // ending in /cache-manager.sock (always with --run-dir); empty otherwise.
  std::string events_endpoint;
  absl::Duration timeout = absl::Seconds(5);  // --timeout
  bool json = false;                          // --json
};

// Fills `options` from the connection flags in `flags`; `default_run_dir` applies when
// neither --run-dir nor --endpoint is given. INVALID_ARGUMENT naming the flag for both
// given, an empty value, or a timeout that is not a positive duration.
absl::Status ParseConnectionOptions(const ParsedFlags& flags, std::string_view default_run_dir,
                                    ConnectionOptions* options);

// kConnectionFlags followed by `own`: one command's whole table.
std::vector<FlagSpec> WithConnectionFlags(absl::Span<const FlagSpec> own);

// The whole command line of a command that takes only the connection flags (info, stats):
// no positional arguments.
absl::StatusOr<ConnectionOptions> ParseConnectionOnlyCommand(absl::Span<const std::string> args,
                                                             std::string_view default_run_dir);

// Connects and registers as role Control, named "kvcmctl <command>". When nothing answers
// (UNAVAILABLE, DEADLINE_EXCEEDED) the status reads "no cache manager at <endpoint>:
// <reason>"; other errors (a refused Hello) pass through. Fails within the timeout: at once
// when nothing listens on an ipc:// socket file, else after at most options.timeout.
absl::StatusOr<std::unique_ptr<CacheManagerClient>> ConnectToCacheManager(
    const ConnectionOptions& options, std::string_view command, bool heartbeats);

// "no cache manager at <endpoint>: <reason>" for UNAVAILABLE and DEADLINE_EXCEEDED (the
// code is kept); other statuses pass through.
absl::Status DescribeUnreachable(const absl::Status& status, std::string_view endpoint);

}  // namespace kvcm::kvcmctl
