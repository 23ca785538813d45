#include "services/router/generation.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"
#include "services/router/stream_events.h"

namespace kvcm::router {

using json = nlohmann::json;

Generation GenerationOf(GenerationRequest parsed) {
  Generation g;
  g.api = parsed.api;
  g.chat = parsed.chat;
  g.stream = parsed.stream;
  g.as_list = parsed.as_list;
  g.include_usage = parsed.include_usage;
  g.shown = parsed.shown;
  g.params = std::move(parsed.params);
  g.prompt_text = std::move(parsed.prompt_text);
  return g;
}

namespace {

std::vector<size_t> InOrder(const Generation& g) {
  std::vector<size_t> order(g.choices.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  return order;
}

}  // namespace

std::vector<size_t> Shown(const Generation& g) {
  std::vector<size_t> order = InOrder(g);
  if (static_cast<int32_t>(order.size()) > g.shown) {
    order = BestFirst(g);
    order.resize(static_cast<size_t>(g.shown));
  }
  return order;
}

std::vector<size_t> BestFirst(const Generation& g) {
  std::vector<size_t> order = InOrder(g);
  std::stable_sort(order.begin(), order.end(), [&](size_t x, size_t y) {
    return g.choices[x].sum_logprob > g.choices[y].sum_logprob;
  });
  return order;
}

std::optional<size_t> StopSequenceSeen(const Generation& g, const Choice& c,
                                       const IncrementalDecoder::Piece& piece) {
  if (g.params.stop.empty()) return std::nullopt;
  if (static_cast<int64_t>(c.generated.size()) <= g.params.sampling.min_tokens) {
    return std::nullopt;
  }
  size_t longest = 0;
  for (const std::string& sequence : g.params.stop) longest = std::max(longest, sequence.size());
  const size_t keep = std::min(c.text.size(), longest > 0 ? longest - 1 : 0);
  const std::string tail = c.text.substr(c.text.size() - keep) + piece.ready + piece.pending;
  std::optional<size_t> first;
  for (const std::string& sequence : g.params.stop) {
    // A match starting at `from` or later ends past `keep`, in the new text.
    const size_t from = keep - std::min(keep, sequence.size() - 1);
    const size_t at = tail.find(sequence, from);
    if (at != std::string::npos && (!first.has_value() || at < *first)) first = at;
  }
  if (!first.has_value()) return std::nullopt;
  return c.text.size() - keep + *first;
}

std::string TokenText(const Tokenizer& tokenizer, int32_t id) {
  const int32_t one[] = {id};
  absl::StatusOr<std::string> piece = tokenizer.Decode(one);
  return piece.ok() ? *piece : "";
}

std::string TextOf(const Tokenizer& tokenizer, const Choice& c) {
  absl::StatusOr<std::string> decoded = tokenizer.Decode(c.generated);
  return decoded.ok() ? *decoded : "";
}

std::string Dump(const json& value) {
  return value.dump(-1, ' ', false, json::error_handler_t::replace);
}

json Logprob(float value) { return std::isnan(value) ? json(nullptr) : json(ShownLogprob(value)); }

json NumberLogprob(float value) {
  return ShownLogprob(std::isnan(value) ? -std::numeric_limits<float>::infinity() : value);
}

}  // namespace kvcm::router
