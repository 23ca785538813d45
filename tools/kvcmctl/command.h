#pragma once

// The shape of a kvcmctl subcommand. main.cc lists the commands in one table; adding one
// (info, stats, watch, ...) means writing its `Run...Command` in its own file and adding a
// row there.

#include <ostream>
#include <string>
#include <string_view>

#include "absl/types/span.h"

namespace kvcm::kvcmctl {

// Exit codes shared by every subcommand.
inline constexpr int kExitOk = 0;
inline constexpr int kExitFailure = 1;  // the command ran and failed (bad config file, ...)
inline constexpr int kExitUsage = 2;    // the command line was wrong; nothing ran

struct Command {
  std::string_view name;     // the word after "kvcmctl"
  std::string_view summary;  // one line for `kvcmctl --help`
  // Parses `args` (the words after the command name) into the command's options, runs it,
  // writes results to `out` and diagnostics to `err`, and returns the exit code.
  int (*run)(absl::Span<const std::string> args, std::ostream& out, std::ostream& err);
};

}  // namespace kvcm::kvcmctl
