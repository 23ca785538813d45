#pragma once
// ParseDashedCommandLine: Abseil flags spelled with dashes.
//
// The services document their flags with dashes (--run-dir, --num-blocks); Abseil names
// flags with underscores. This rewrites the name part of every --flag or --flag=value
// (values are left alone) and then calls absl::ParseCommandLine, which prints a usage
// error and exits on an unknown flag. FlagGiven() then tells a flag given on the command line
// (even with its default value, e.g. --num-blocks 0) from one left out.

#include <algorithm>
#include <cstddef>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "absl/flags/parse.h"

namespace kvcm {

// Underscored names of the flags on the command line (filled by ParseDashedCommandLine).
inline std::set<std::string, std::less<>>& GivenFlagNames() {
  static std::set<std::string, std::less<>> names;
  return names;
}

// Whether --`name` (underscored, e.g. "num_blocks") was on the command line.
inline bool FlagGiven(std::string_view name) { return GivenFlagNames().contains(name); }

inline void ParseDashedCommandLine(int argc, char** argv) {
  std::vector<std::string> args(argv, argv + argc);
  std::vector<char*> rewritten;
  rewritten.reserve(args.size());
  for (std::string& arg : args) {
    if (arg.rfind("--", 0) == 0) {
      const size_t end = std::min(arg.find('='), arg.size());
      std::replace(arg.begin() + 2, arg.begin() + static_cast<std::ptrdiff_t>(end), '-', '_');
      std::string name = arg.substr(2, end - 2);
      if (name.rfind("no", 0) == 0) GivenFlagNames().insert(name.substr(2));  // --noflag
      GivenFlagNames().insert(std::move(name));
    }
    rewritten.push_back(arg.data());
  }
  absl::ParseCommandLine(static_cast<int>(rewritten.size()), rewritten.data());
}

}  // namespace kvcm
