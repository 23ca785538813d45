#pragma once
// Feeds bytes to a RequestFraming (services/router/http_framing.h) in pieces, moving them
// as the router's connection input does (FramedInput::Frame), for the framing's unit test
// and fuzz target. Test support only.

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "services/router/http_framing.h"

namespace kvcm::router::testing {

struct Framed {
  std::string out;  // what libevent reads
  std::optional<FramingRefusal> refusal;
  uint64_t refused_request = 0;
  uint64_t heads = 0;
  bool steps_in_bounds = true;  // no step took more bytes than there were
};

// `input` in pieces of the sizes in `pieces`, then the rest in one piece.
inline Framed FrameInPieces(std::string_view input, FramingLimits limits,
                            const std::vector<size_t>& pieces) {
  RequestFraming framing(limits);
  Framed result;
  std::string raw;
  size_t at = 0;
  for (size_t piece = 0; at < input.size(); ++piece) {
    const size_t n =
        piece < pieces.size() ? std::min(pieces[piece], input.size() - at) : input.size() - at;
    raw.append(input.substr(at, n));
    at += n;
    while (!framing.refused()) {
      const size_t wanted = std::min(raw.size(), framing.WindowWanted());
      const FramingStep step = framing.Next(std::string_view(raw).substr(0, wanted), raw.size());
      if (step.kind == FramingStep::Kind::kNeedMore) break;
      if (step.length > raw.size()) {
        result.steps_in_bounds = false;
        return result;
      }
      result.out +=
          step.kind == FramingStep::Kind::kPass ? raw.substr(0, step.length) : step.replacement;
      raw.erase(0, step.length);
      if (step.kind == FramingStep::Kind::kRefuse) {
        result.refusal = step.refusal;
        result.refused_request = framing.heads();
      }
    }
    if (framing.refused()) raw.clear();
  }
  result.heads = framing.heads();
  return result;
}

}  // namespace kvcm::router::testing
