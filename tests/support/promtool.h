#pragma once

// `promtool check metrics` (Debian package `prometheus`, installed by scripts/bootstrap.sh)
// on an exposition: the lint that Prometheus's naming conventions are followed (counters
// end in _total, base units, no colons, help present). Test support only.

#include <string_view>

#include "absl/status/statusor.h"
#include "tests/support/subprocess.h"

namespace kvcm::testing {

// Runs `promtool check metrics` with `exposition` on stdin. A clean exposition gives exit
// code 0 and no output; findings give exit code 3 and one line each.
// Errors: FAILED_PRECONDITION (promtool not installed: the message says to run
// scripts/bootstrap.sh), DEADLINE_EXCEEDED.
absl::StatusOr<RunResult> PromtoolCheckMetrics(std::string_view exposition);

}  // namespace kvcm::testing
