#include "common/wire/executor_protocol.h"

#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"

namespace kvcm {

absl::Status ValidateSamplingParams(const SamplingParams& p) {
  if (!std::isfinite(p.temperature) || p.temperature < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("temperature must be finite and >= 0, got ", p.temperature));
  }
  if (!(p.top_p > 0 && p.top_p <= 1)) {
    return absl::InvalidArgumentError(absl::StrCat("top_p must be in (0, 1], got ", p.top_p));
  }
  if (p.top_k < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("top_k must be >= 0 (0 = all tokens), got ", p.top_k));
  }
  if (!std::isfinite(p.repetition_penalty) || p.repetition_penalty <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "repetition_penalty must be finite and > 0 (1 = none), got ", p.repetition_penalty));
  }
  for (const auto& [name, value] : {std::pair{"frequency_penalty", p.frequency_penalty},
                                    std::pair{"presence_penalty", p.presence_penalty}}) {
    if (!std::isfinite(value) || value < -2 || value > 2) {
      return absl::InvalidArgumentError(absl::StrCat(name, " must be in [-2, 2], got ", value));
    }
  }
  if (p.min_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("min_tokens must be >= 0 (0 = none), got ", p.min_tokens));
  }
  return absl::OkStatus();
}

}  // namespace kvcm
