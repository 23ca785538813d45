#include "services/router/stream_events.h"

#include <algorithm>
#include <array>
#include <charconv>
#include <cmath>
#include <limits>

#include "common/base/utf8.h"
#include "nlohmann/json.hpp"

namespace kvcm::router {
namespace {

template <typename Integer>
void AppendInteger(Integer value, std::string* out) {
  std::array<char, 24> digits;
  const std::to_chars_result end =
      std::to_chars(digits.data(), digits.data() + digits.size(), value);
  out->append(digits.data(), end.ptr);
}

void AppendToken(const TgiStreamToken& token, std::string* out) {
  out->append(R"({"id":)");
  AppendInteger(token.id, out);
  out->append(R"(,"logprob":)");
  AppendJsonNumber(ShownLogprob(token.logprob), out);
  out->append(token.special ? R"(,"special":true,"text":)" : R"(,"special":false,"text":)");
  AppendJsonString(token.text, out);
  out->push_back('}');
}

}  // namespace

void AppendJsonString(std::string_view text, std::string* out) {
  if (!IsValidUtf8(text)) {
    // What nlohmann replaces, and where it resumes after a bad byte, is its own decoder's
    // business: it writes this string, a model's stray bytes being rare.
    out->append(nlohmann::json(std::string(text))
                    .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
    return;
  }
  static constexpr char kHex[] = "0123456789abcdef";
  out->push_back('"');
  size_t run = 0;  // start of the bytes not yet copied, which need no escape
  for (size_t i = 0; i < text.size(); ++i) {
    const auto c = static_cast<unsigned char>(text[i]);
    if (c >= 0x20 && c != '"' && c != '\\') continue;  // valid UTF-8 passes through
    out->append(text.data() + run, i - run);
    run = i + 1;
    switch (c) {
      case '"':
        out->append("\\\"");
        break;
      case '\\':
        out->append("\\\\");
        break;
      case '\b':
        out->append("\\b");
        break;
      case '\t':
        out->append("\\t");
        break;
      case '\n':
        out->append("\\n");
        break;
      case '\f':
        out->append("\\f");
        break;
      case '\r':
        out->append("\\r");
        break;
      default: {
        const char escape[] = {'\\', 'u', '0', '0', kHex[c >> 4], kHex[c & 0xF]};
        out->append(escape, sizeof(escape));
      }
    }
  }
  out->append(text.data() + run, text.size() - run);
  out->push_back('"');
}

float ShownLogprob(float logprob) {
  if (std::isnan(logprob)) return logprob;
  if (logprob == std::numeric_limits<float>::infinity()) return 0.0f;
  return std::max(logprob, kMinLogprob);
}

void AppendJsonNumber(double value, std::string* out) {
  if (!std::isfinite(value)) {
    out->append("null");
    return;
  }
  // nlohmann's own shortest round-trip formatting (Grisu2), as its serializer calls it.
  std::array<char, 64> digits;
  char* end = nlohmann::detail::to_chars(digits.data(), digits.data() + digits.size(), value);
  out->append(digits.data(), end);
}

void AppendTgiStreamEvent(const TgiStreamEvent& event, std::string* out) {
  if (event.end == nullptr) {
    out->append(R"({"details":null,"generated_text":null,"index":)");
  } else {
    const TgiStreamEnd& end = *event.end;
    out->append(R"({"details":{"finish_reason":)");
    AppendJsonString(end.finish_reason, out);
    out->append(R"(,"generated_tokens":)");
    AppendInteger(end.generated_tokens, out);
    out->append(R"(,"input_length":)");
    AppendInteger(end.input_length, out);
    out->append(R"(,"seed":)");
    if (end.seed.has_value()) {
      AppendInteger(*end.seed, out);
    } else {
      out->append("null");
    }
    out->append(R"(},"generated_text":)");
    AppendJsonString(end.generated_text, out);
    out->append(R"(,"index":)");
  }
  AppendInteger(event.index, out);
  out->append(R"(,"token":)");
  AppendToken(event.token, out);
  if (event.with_top_tokens) {
    out->append(R"(,"top_tokens":[)");
    for (size_t i = 0; i < event.top_tokens.size(); ++i) {
      if (i > 0) out->push_back(',');
      AppendToken(event.top_tokens[i], out);
    }
    out->push_back(']');
  }
  out->push_back('}');
}

}  // namespace kvcm::router
