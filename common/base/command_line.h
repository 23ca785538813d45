#pragma once
// ParseDashedCommandLine: Abseil flags spelled with dashes.
//
// The services document their flags with dashes (--run-dir, --num-blocks); Abseil names
// flags with underscores. This rewrites the name part of every --flag or --flag=value
// (values are left alone) and then calls absl::ParseCommandLine, which prints a usage
// error and exits on an unknown flag.

#include <algorithm>
#include <cstddef>
#include <string>
#include <vector>

#include "absl/flags/parse.h"

namespace kvcm {

inline void ParseDashedCommandLine(int argc, char** argv) {
  std::vector<std::string> args(argv, argv + argc);
  std::vector<char*> rewritten;
  rewritten.reserve(args.size());
  for (std::string& arg : args) {
    if (arg.rfind("--", 0) == 0) {
      const size_t end = std::min(arg.find('='), arg.size());
      std::replace(arg.begin() + 2, arg.begin() + static_cast<std::ptrdiff_t>(end), '-', '_');
    }
    rewritten.push_back(arg.data());
  }
  absl::ParseCommandLine(static_cast<int>(rewritten.size()), rewritten.data());
}

}  // namespace kvcm
