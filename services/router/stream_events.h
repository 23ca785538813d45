#pragma once
// The JSON of /generate_stream's token events (docs/router.md, "HTTP API"), written straight
// into a caller's buffer: no JSON DOM, no allocation beyond the buffer's growth. The router
// streams one event per generated token, so this is the HTTP thread's per-token work
// (docs/PERFORMANCE.md, "1,000 concurrent streams").
//
// The bytes are exactly those nlohmann::json writes for the same values with
// dump(-1, ' ', /*ensure_ascii=*/false, error_handler_t::replace), the router's Dump(): keys
// in nlohmann's (sorted) order, numbers by its shortest round-trip formatting, strings
// escaped as it escapes them and bytes that are not UTF-8 replaced by U+FFFD as it replaces
// them. tests/services/router/stream_events_test.cc compares the two on seeded random
// values.
//
// Thread safety: none needed; the functions keep no state.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

namespace kvcm::router {

// Appends `text` as a JSON string (quotes included).
void AppendJsonString(std::string_view text, std::string* out);

// Appends `value` as a JSON number, or `null` when it is NaN or infinite (as nlohmann
// writes a double: a float is widened first, as json(float) does).
void AppendJsonNumber(double value, std::string* out);

// The lowest log-probability the APIs write. A token of probability 0 has a log-probability
// of -inf, which JSON cannot hold (nlohmann writes null), while the OpenAPI document types
// a log-probability as a number: every log-probability the router writes goes through
// ShownLogprob, and -inf reads as this (docs/router.md, "Log-probabilities").
inline constexpr float kMinLogprob = -9999.0f;

// `logprob` as it is written: NaN stays NaN (not computed: written null where the APIs say
// so), anything below kMinLogprob (-inf included) is kMinLogprob, +inf (no log-probability
// at all) is 0; a finite value in between is itself.
float ShownLogprob(float logprob);

// TGI's token object: {"id", "logprob", "special", "text"}; `logprob` NaN writes null, and
// any other value its ShownLogprob.
struct TgiStreamToken {
  int32_t id = 0;
  float logprob = 0.0f;
  std::string_view text;
  bool special = false;
};

// What the last event of a stream adds: generated_text and details (TGI's StreamDetails:
// finish_reason, generated_tokens, input_length, seed; docs/router.md, "HTTP API
// (TGI-compatible)").
struct TgiStreamEnd {
  std::string_view generated_text;
  std::string_view finish_reason;
  size_t generated_tokens = 0;
  size_t input_length = 0;       // the prompt's tokens, BOS included
  std::optional<uint64_t> seed;  // null without sampling
};

// One event: {"details", "generated_text", "index", "token"[, "top_tokens"]}; details and
// generated_text are null but in the last event (`end`).
struct TgiStreamEvent {
  size_t index = 0;
  TgiStreamToken token;
  bool with_top_tokens = false;  // top_n_tokens was asked: "top_tokens" is written
  std::span<const TgiStreamToken> top_tokens;
  const TgiStreamEnd* end = nullptr;  // null but for the last event
};

// Appends the event's JSON (without the server-sent event's "data:" and blank line).
void AppendTgiStreamEvent(const TgiStreamEvent& event, std::string* out);

}  // namespace kvcm::router
