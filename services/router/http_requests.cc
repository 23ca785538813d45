#include "services/router/http_requests.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/chat/chat_template.h"
#include "nlohmann/json.hpp"

namespace kvcm::router {

using json = nlohmann::json;

std::string UnsupportedParameterMessage(absl::string_view key, const json& value) {
  return absl::StrCat("parameter `", Shortened(key), "` is not supported by this server (",
                      Shortened(Dump(value)), ")");
}

std::string TooDeepMessage() {
  return absl::StrCat("the body nests arrays and objects deeper than ", kMaxJsonDepth, " levels");
}

std::string NoPromptTokensMessage(absl::string_view field) {
  return absl::StrCat("`", field,
                      "` cannot be empty: it gives no tokens, and this model adds "
                      "no BOS token to a prompt");
}

std::string Shortened(absl::string_view text, size_t max_bytes) {
  if (text.size() <= max_bytes) return std::string(text);
  size_t cut = max_bytes;
  while (cut > 0 && (static_cast<unsigned char>(text[cut]) & 0xC0) == 0x80) --cut;
  return absl::StrCat(text.substr(0, cut), "...");
}

bool NestedDeeperThan(const json& value, int max_depth) {
  if (!value.is_structured()) return false;
  // Depth first with a stack of our own: a body of 500,000 levels must not recurse here
  // either.
  std::vector<std::pair<const json*, int>> pending = {{&value, 1}};
  while (!pending.empty()) {
    const auto [node, depth] = pending.back();
    pending.pop_back();
    if (depth > max_depth) return true;
    for (const json& child : *node) {
      if (child.is_structured()) pending.emplace_back(&child, depth + 1);
    }
  }
  return false;
}

// Greedy sampling that keeps `sampling`'s penalties and min_tokens (they apply to greedy
// choices too).
SamplingParams RequestParser::Greedy(const SamplingParams& sampling) {
  SamplingParams greedy;
  greedy.repetition_penalty = sampling.repetition_penalty;
  greedy.frequency_penalty = sampling.frequency_penalty;
  greedy.presence_penalty = sampling.presence_penalty;
  greedy.min_tokens = sampling.min_tokens;
  return greedy;
}

// BOS (when the tokenizer's model wants one), then the tokenizer's ids.
absl::StatusOr<std::vector<int32_t>> RequestParser::PromptOf(const std::string& text) const {
  absl::StatusOr<std::vector<int32_t>> encoded = tokenizer_->Encode(text);
  if (!encoded.ok()) return encoded.status();
  std::vector<int32_t> prompt;
  if (tokenizer_->add_bos() && tokenizer_->bos_id() >= 0) prompt.push_back(tokenizer_->bos_id());
  prompt.insert(prompt.end(), encoded->begin(), encoded->end());
  return prompt;
}

}  // namespace kvcm::router
