// kvcmctl: inspect and plan a kvcm deployment.
//
//   kvcmctl <command> [flags]
//
// Each command parses its own flags (declared in the .cc that owns them) into its options
// struct before anything runs; nothing below reads argv or the environment. To add a
// command, implement `int Run<Name>Command(args, out, err)` in its own file and add a row to
// kCommands.

#include <iostream>
#include <ostream>
#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/str_format.h"
#include "tools/kvcmctl/command.h"
#include "tools/kvcmctl/end_session_command.h"
#include "tools/kvcmctl/info_command.h"
#include "tools/kvcmctl/plan_command.h"
#include "tools/kvcmctl/stats_command.h"
#include "tools/kvcmctl/watch_command.h"

namespace kvcm::kvcmctl {
namespace {

constexpr Command kCommands[] = {
    {"plan", "size a KV-cache pool: blocks, bytes and tokens for a model and a budget",
     &RunPlanCommand},
    {"info", "a running cache manager's pool: spec, block bytes, blocks, backend, epoch",
     &RunInfoCommand},
    {"stats", "a running cache manager's blocks by state, hit rate and counters", &RunStatsCommand},
    {"watch", "one line of cache statistics per interval", &RunWatchCommand},
    {"end-session",
     "end another session of a process gone for good (a tcp peer, a hung "
     "executor)",
     &RunEndSessionCommand},
};

void PrintUsage(std::ostream& os) {
  os << "Usage: kvcmctl <command> [flags]\n\nCommands:\n";
  for (const Command& command : kCommands) {
    os << absl::StrFormat("  %-8s %s\n", command.name, command.summary);
  }
  os << "\nRun 'kvcmctl <command> --help' for a command's flags.\n";
}

int Main(const std::vector<std::string>& argv) {
  if (argv.size() < 2) {
    PrintUsage(std::cerr);
    return kExitUsage;
  }
  const std::string_view name = argv[1];
  if (name == "--help" || name == "-h" || name == "help") {
    PrintUsage(std::cout);
    return kExitOk;
  }
  for (const Command& command : kCommands) {
    if (command.name == name) {
      const std::vector<std::string> args(argv.begin() + 2, argv.end());
      return command.run(args, std::cout, std::cerr);
    }
  }
  std::cerr << "kvcmctl: unknown command \"" << name << "\"\n\n";
  PrintUsage(std::cerr);
  return kExitUsage;
}

}  // namespace
}  // namespace kvcm::kvcmctl

int main(int argc, char** argv) {
  const std::vector<std::string> args(argv, argv + argc);
  const int code = kvcm::kvcmctl::Main(args);
  std::cout.flush();
  if (!std::cout) {
    std::cerr << "kvcmctl: error writing output\n";
    return kvcm::kvcmctl::kExitFailure;
  }
  return code;
}
