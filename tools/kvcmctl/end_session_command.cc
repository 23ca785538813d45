#include "tools/kvcmctl/end_session_command.h"

#include <memory>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/base/run_dir.h"
#include "common/base/status_macros.h"
#include "common/client/cache_manager_client.h"
#include "tools/kvcmctl/command.h"
#include "tools/kvcmctl/flag_parser.h"

namespace kvcm::kvcmctl {

absl::StatusOr<EndSessionOptions> ParseEndSessionOptions(absl::Span<const std::string> args,
                                                         std::string_view default_run_dir) {
  const std::vector<FlagSpec> specs = WithConnectionFlags({});
  KVCM_ASSIGN_OR_RETURN(const ParsedFlags flags, ParseFlags(specs, args));
  EndSessionOptions options;
  KVCM_RETURN_IF_ERROR(ParseConnectionOptions(flags, default_run_dir, &options.connection));
  if (options.connection.help) return options;
  if (flags.positional().size() != 1) {
    return absl::InvalidArgumentError("give exactly one session id");
  }
  const std::string& id = flags.positional()[0];
  if (!absl::SimpleAtoi(id, &options.session_id) || options.session_id == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("session id \"", id, "\" is not a positive number"));
  }
  return options;
}

std::string EndSessionUsage() {
  return absl::StrCat(
      "Usage: kvcmctl end-session ID [--run-dir DIR | --endpoint URL] [--timeout DURATION]\n"
      "\n"
      "Ends session ID of a running kvcm-cache-manager: for a process known to be gone for\n"
      "good whose death the cache manager cannot see. A router's blocks drain behind a fence\n"
      "as at its death; an executor's fences count as acknowledged, so end one only once it\n"
      "can no longer write.\n"
      "\n"
      "Flags:\n",
      FlagHelp(WithConnectionFlags({})));
}

int RunEndSessionCommand(absl::Span<const std::string> args, std::ostream& out, std::ostream& err) {
  const absl::StatusOr<EndSessionOptions> options =
      ParseEndSessionOptions(args, DefaultRunDirFromEnvironment());
  if (!options.ok()) {
    err << "kvcmctl end-session: " << options.status().message() << "\n"
        << "Run 'kvcmctl end-session --help' for usage.\n";
    return kExitUsage;
  }
  if (options->connection.help) {
    out << EndSessionUsage();
    return kExitOk;
  }
  absl::StatusOr<std::unique_ptr<CacheManagerClient>> client =
      ConnectToCacheManager(options->connection, "end-session", /*heartbeats=*/false);
  if (!client.ok()) {
    err << "kvcmctl end-session: " << client.status().message() << "\n";
    return kExitFailure;
  }
  const absl::StatusOr<int32_t> released = (*client)->EndSession(options->session_id);
  (void)(*client)->Goodbye();
  if (!released.ok()) {
    err << "kvcmctl end-session: "
        << DescribeUnreachable(released.status(), options->connection.endpoint).message() << "\n";
    return kExitFailure;
  }
  out << "ended session " << options->session_id << ": " << *released
      << " blocks released now (a router's others drain until every executor acknowledges)\n";
  return kExitOk;
}

}  // namespace kvcm::kvcmctl
