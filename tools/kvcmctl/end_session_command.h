#pragma once

// `kvcmctl end-session ID`: ends another session of a running cache manager, for a process
// known to be gone for good whose death the cache manager cannot see (a tcp:// peer, an
// executor that hung and will never answer its fences). A router's sequences drain behind
// a fence, as at a death; an executor's open fences count as acknowledged, so end one only
// once it can no longer write (killed, or its machine gone).
//
//   kvcmctl end-session ID [--run-dir DIR | --endpoint URL] [--timeout 5s]
//
// Registers as a Control client (ipc:// only: the cache manager refuses this over tcp://),
// sends EndSession, says Goodbye.

#include <cstdint>
#include <ostream>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "tools/kvcmctl/connection.h"

namespace kvcm::kvcmctl {

struct EndSessionOptions {
  ConnectionOptions connection;
  uint64_t session_id = 0;
};

// Parses the words after "end-session": the session id (positive) and the connection flags.
// INVALID_ARGUMENT naming what is wrong.
absl::StatusOr<EndSessionOptions> ParseEndSessionOptions(absl::Span<const std::string> args,
                                                         std::string_view default_run_dir);
std::string EndSessionUsage();

int RunEndSessionCommand(absl::Span<const std::string> args, std::ostream& out, std::ostream& err);

}  // namespace kvcm::kvcmctl
