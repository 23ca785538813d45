#include "tools/kvcmctl/connection.h"

#include <unistd.h>

#include <cstdlib>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/base/status_macros.h"
#include "common/transport/zmq_util.h"

namespace kvcm::kvcmctl {
namespace {

absl::Status FlagError(std::string_view flag, std::string_view message) {
  return absl::InvalidArgumentError(
      absl::StrCat("--", std::string(flag), ": ", std::string(message)));
}

}  // namespace

std::string RequestEndpointIn(std::string_view run_dir) {
  return IpcEndpointIn(run_dir, kCacheManagerSocket);
}

std::string EventsEndpointIn(std::string_view run_dir) {
  return IpcEndpointIn(run_dir, kEventSocket);
}

absl::Status ParseConnectionOptions(const ParsedFlags& flags, std::string_view default_run_dir,
                                    ConnectionOptions* options) {
  options->help = flags.Has("help");
  options->json = flags.Has("json");
  if (flags.Has("run-dir") && flags.Has("endpoint")) {
    return absl::InvalidArgumentError("--run-dir and --endpoint cannot be combined");
  }
  if (flags.Has("endpoint")) {
    options->endpoint = *flags.Get("endpoint");
    if (options->endpoint.empty()) return FlagError("endpoint", "empty");
    if (!absl::StartsWith(options->endpoint, "ipc://") &&
        !absl::StartsWith(options->endpoint, "tcp://")) {
      return FlagError("endpoint", absl::StrCat("expected ipc://PATH or tcp://HOST:PORT, got \"",
                                                options->endpoint, "\""));
    }
    const std::optional<std::string> path = IpcPath(options->endpoint);
    const std::string socket = absl::StrCat("/", kCacheManagerSocket);
    if (path.has_value() && absl::EndsWith(*path, socket)) {
      options->events_endpoint = EventsEndpointIn(path->substr(0, path->size() - socket.size()));
    }
  } else {
    const std::string run_dir =
        flags.Has("run-dir") ? *flags.Get("run-dir") : std::string(default_run_dir);
    if (run_dir.empty()) return FlagError("run-dir", "empty");
    options->endpoint = RequestEndpointIn(run_dir);
    options->events_endpoint = EventsEndpointIn(run_dir);
  }
  if (flags.Has("timeout")) {
    const std::string text = *flags.Get("timeout");
    absl::Duration timeout;
    if (!absl::ParseDuration(text, &timeout) || timeout <= absl::ZeroDuration() ||
        timeout == absl::InfiniteDuration()) {
      return FlagError(
          "timeout",
          absl::StrCat("expected a positive duration such as 500ms or 5s, got \"", text, "\""));
    }
    options->timeout = timeout;
  }
  return absl::OkStatus();
}

std::vector<FlagSpec> WithConnectionFlags(absl::Span<const FlagSpec> own) {
  std::vector<FlagSpec> all(std::begin(kConnectionFlags), std::end(kConnectionFlags));
  all.insert(all.end(), own.begin(), own.end());
  return all;
}

absl::Status DescribeUnreachable(const absl::Status& status, std::string_view endpoint) {
  if (status.code() != absl::StatusCode::kUnavailable &&
      status.code() != absl::StatusCode::kDeadlineExceeded) {
    return status;
  }
  // The client's own deadline message starts with "cache manager at <endpoint> "; drop the
  // repetition.
  std::string reason(status.message());
  const std::string prefix = absl::StrCat("cache manager at ", std::string(endpoint), " ");
  if (absl::StartsWith(reason, prefix)) reason = reason.substr(prefix.size());
  return absl::Status(status.code(),
                      absl::StrCat("no cache manager at ", std::string(endpoint), ": ", reason));
}

absl::StatusOr<std::unique_ptr<CacheManagerClient>> ConnectToCacheManager(
    const ConnectionOptions& options, std::string_view command, bool heartbeats) {
  CacheManagerClient::Options client_options;
  client_options.endpoint = options.endpoint;
  client_options.role = wire::Role::Control;
  client_options.name = absl::StrCat("kvcmctl ", std::string(command));
  client_options.call_timeout = options.timeout;
  client_options.heartbeats = heartbeats;
  absl::StatusOr<std::unique_ptr<CacheManagerClient>> client =
      CacheManagerClient::Connect(client_options);
  if (!client.ok()) return DescribeUnreachable(client.status(), options.endpoint);
  return client;
}

absl::StatusOr<ConnectionOptions> ParseConnectionOnlyCommand(absl::Span<const std::string> args,
                                                             std::string_view default_run_dir) {
  const std::vector<FlagSpec> specs = WithConnectionFlags({});
  KVCM_ASSIGN_OR_RETURN(const ParsedFlags flags, ParseFlags(specs, args));
  if (!flags.positional().empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("unexpected argument \"", flags.positional().front(), "\""));
  }
  ConnectionOptions options;
  KVCM_RETURN_IF_ERROR(ParseConnectionOptions(flags, default_run_dir, &options));
  return options;
}

}  // namespace kvcm::kvcmctl
