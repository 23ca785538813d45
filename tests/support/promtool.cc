#include "tests/support/promtool.h"

#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace kvcm::testing {

absl::StatusOr<RunResult> PromtoolCheckMetrics(std::string_view exposition) {
  absl::StatusOr<std::string> promtool = FindProgram("promtool");
  if (!promtool.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat(promtool.status().message(),
                     ": install the Debian package `prometheus` (run scripts/bootstrap.sh)"));
  }
  return RunProgram({*promtool, "check", "metrics"}, exposition, absl::Seconds(60));
}

}  // namespace kvcm::testing
