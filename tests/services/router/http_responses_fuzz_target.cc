// The fuzz target of the router's responses (tests/support/fuzz_target.h): every shape of
// reply the router writes, from values the input chooses, as the router formats them —
//
//   shape 0  TGI /generate_stream events straight from the input's values (any index, token
//            id, generated_tokens and seed, up to 2^64 - 1);
//   shape 1  a TGI stream as the router sends it, token by token, with top tokens and its
//            last event (or, failed, an error event);
//   shape 2  TGI /generate (and POST /'s list of one) with details: prefill, tokens,
//            top_tokens, best_of_sequences;
//   shape 3  OpenAI /v1/completions: choices, logprobs (tokens, token_logprobs,
//            top_logprobs, text_offset; the echoed prompt's with echo), usage;
//   shape 4  its stream: one chunk per token, the usage chunk, [DONE];
//   shape 5  /v1/chat/completions: message, logprobs.content with top_logprobs, usage;
//   shape 6  its stream: deltas;
//   shape 7  error bodies of both APIs (a quoted value Shortened);
//
// (the input's first byte, modulo 8) — with log-probabilities of any bit pattern (-inf,
// +inf, NaN, denormals, -FLT_MAX) or chosen from those that broke the router, token counts
// and seeds up to 2^64 - 1, texts of any bytes (not UTF-8, control bytes, NUL) and texts and
// stop sequences of up to 16 KiB (kMaxText). Checked:
//   - every reply is JSON that nlohmann::json::parse reads, and every stream is server-sent
//     events, each one line `data:{json}` (TGI) or `data: {json}` (OpenAI, then
//     `data: [DONE]`) with no line break inside;
//   - each document matches its schema in services/router/openapi.json (embedded at build
//     time): types (nothing null where the document types a number), required members,
//     enums, minimums;
//   - every log-probability written is null where the document allows it or a finite number
//     no lower than kMinLogprob (-9999);
//   - a TGI stream event's bytes (AppendTgiStreamEvent) are those nlohmann writes for the
//     same event built as a DOM (services/router/stream_events.h promises it).
//
// What is the router's own code here and what is not: the TGI stream events are written by
// the router's library (services/router/stream_events.h: AppendTgiStreamEvent,
// AppendJsonString, AppendJsonNumber, ShownLogprob) and error messages quote through
// Shortened (services/router/http_requests.h). The other shapes are built by the APIs'
// formatters (services/router/tgi_api.cc: Details, TgiToken, TgiReply, AppendTgiTokenEvent;
// services/router/openai_api.cc: OpenAiLogprobs, ChatLogprobs, OpenAiChoice, OpenAiChunk,
// OpenAiUsage, OpenAiReply, OpenAiTokenChunk; the error bodies of both), which were
// reachable from nowhere but the front end when this target was written: namespace `mirror`
// below copies them as they are there, over the same building blocks (ShownLogprob,
// nlohmann's dump with error_handler_t::replace). A change to those functions must be copied
// here until this target calls them (tgi_api.h, openai_api.h) instead of its copies
// (docs/RELIABILITY.md, "Fuzzing").
//
// An input is accepted (fuzz::NoteAccepted) when it described a whole response: one cut
// short is formatted all the same, with zeros for what is missing, and counted refused.
// Seeds: tests/services/router/fuzz/http_responses/ (make_http_responses_seeds.py).

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/base/utf8.h"
#include "nlohmann/json.hpp"
#include "services/router/http_requests.h"
#include "services/router/stream_events.h"
#include "tests/support/fuzz_target.h"

// services/router/openapi.json, embedded at build time (cmake/KvcmEmbed.cmake).
extern "C" {
extern const unsigned char kvcm_http_responses_openapi_json[];
extern const size_t kvcm_http_responses_openapi_json_size;
}

namespace kvcm::router {
namespace {

using json = nlohmann::json;
using fuzz::Check;
using fuzz::Fail;

// ---- The input ---------------------------------------------------------------------------

// The bytes of long texts (those repeated) one input may make, in all.
constexpr size_t kTextBudget = 32 << 10;

// Values from the input's bytes (little-endian), zeros once they run out.
class Reader {
 public:
  Reader(const uint8_t* data, size_t size) : data_(data), size_(size) {}

  // Whether a read asked for bytes past the end.
  bool ran_out() const { return ran_out_; }

  uint8_t Byte() {
    if (at_ >= size_) {
      ran_out_ = true;
      return 0;
    }
    return data_[at_++];
  }
  uint64_t Unsigned(int bytes) {
    uint64_t value = 0;
    for (int i = 0; i < bytes; ++i) value |= uint64_t{Byte()} << (8 * i);
    return value;
  }
  uint16_t U16() { return static_cast<uint16_t>(Unsigned(2)); }
  uint32_t U32() { return static_cast<uint32_t>(Unsigned(4)); }
  uint64_t U64() { return Unsigned(8); }
  bool Bool() { return (Byte() & 1) != 0; }
  size_t Count(size_t max) { return Byte() % (max + 1); }

  // A log-probability: selector < 16, one of kSpecial (those that broke the router, and the
  // edges); < 0x80, an ordinary one, -(selector - 16) / 8; else the next four bytes' bits.
  float Logprob() {
    static const float kSpecial[16] = {
        -std::numeric_limits<float>::infinity(),
        std::numeric_limits<float>::infinity(),
        std::numeric_limits<float>::quiet_NaN(),
        -std::numeric_limits<float>::quiet_NaN(),
        std::numeric_limits<float>::denorm_min(),
        -std::numeric_limits<float>::denorm_min(),
        -std::numeric_limits<float>::min(),
        -std::numeric_limits<float>::max(),
        std::numeric_limits<float>::max(),
        kMinLogprob,
        std::nextafter(kMinLogprob, -std::numeric_limits<float>::infinity()),
        -10000.0f,
        0.0f,
        -0.0f,
        -1e-40f,  // a denormal
        -1e30f,
    };
    const uint8_t selector = Byte();
    if (selector < 16) return kSpecial[selector];
    if (selector < 0x80) return -static_cast<float>(selector - 16) / 8.0f;
    const uint32_t bits = U32();
    float value;
    std::memcpy(&value, &bits, sizeof(value));
    return value;
  }

  // A text: a length byte n; n < 0x80: the next n bytes; else the next (n & 0x7F) bytes
  // repeated U16() times (a long text from a short input), at most kMaxText bytes, and
  // kTextBudget in all the input's texts (so that one input stays fast to run).
  std::string Text() {
    static constexpr size_t kMaxText = 16 << 10;
    const uint8_t n = Byte();
    std::string chunk;
    for (size_t i = 0; i < (n & 0x7Fu); ++i) chunk.push_back(static_cast<char>(Byte()));
    if (n < 0x80) return chunk;
    const uint16_t repeat = U16();
    const size_t most = std::min(kMaxText, text_budget_);
    std::string text;
    for (uint16_t i = 0; i < repeat && !chunk.empty() && text.size() < most; ++i) text += chunk;
    if (text.size() > most) text.resize(most);
    text_budget_ -= text.size();
    return text;
  }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t at_ = 0;
  bool ran_out_ = false;
  size_t text_budget_ = kTextBudget;
};

// A token as the core reports it and the tokenizer spells it.
struct Token {
  int32_t id = 0;
  std::string text;  // TokenText(id): any bytes a tokenizer may give
  bool special = false;
  float logprob = 0;
  std::vector<Token> top;  // the alternatives (top_n of them), each without its own
};

Token ReadToken(Reader& in, size_t top_n) {
  Token t;
  t.id = static_cast<int32_t>(in.U32());
  t.text = in.Text();
  t.special = in.Bool();
  t.logprob = in.Logprob();
  for (size_t i = 0; i < top_n; ++i) {
    Token alternative;
    alternative.id = static_cast<int32_t>(in.U32());
    alternative.text = in.Text();
    alternative.special = in.Bool();
    alternative.logprob = in.Logprob();
    t.top.push_back(std::move(alternative));
  }
  return t;
}

// ---- The router's formatting, as HttpFrontend::Impl has it -------------------------------

namespace mirror {

// Params and Active, the members the formatting reads (Impl::Active, Impl::Choice).
struct Choice {
  std::vector<Token> generated;  // with logprobs and top alternatives
  std::string text;              // what a stream has sent so far
  std::string finish_reason;     // "length", "eos_token", "stop_sequence"
};
struct Active {
  bool stream = false;
  bool as_list = false;
  bool chat = false;
  Api api = Api::kTgi;
  int32_t top_n = 0;
  bool logprobs = true;  // params.outputs.logprobs
  bool details = false;
  bool do_sample = false;
  uint64_t seed = 0;
  bool return_full_text = false;
  bool show_logprobs = false;
  bool prompt_logprobs = false;
  bool include_usage = false;
  std::vector<std::string> stop;
  std::string prompt_text;
  std::vector<Token> prompt;  // with prompt_logprobs: logprob of each (the first NaN)
  std::vector<Choice> choices;
  int32_t shown = 1;
  std::string completion_id;
  int64_t created = 0;
  size_t prompt_tokens = 0;
  int32_t cached_prompt_tokens = 0;
  std::string model_id;
};

// The anonymous namespace's Dump and OpenAiTokenText, OpenAiErrorType.
std::string Dump(const json& value) {
  return value.dump(-1, ' ', false, json::error_handler_t::replace);
}
std::string OpenAiTokenText(int32_t id, const std::string& piece) {
  if (piece.empty()) return absl::StrCat("token_id:", id);
  if (IsValidUtf8(piece)) return piece;
  std::string out = "bytes:";
  for (unsigned char c : piece) absl::StrAppend(&out, "\\x", absl::Hex(c, absl::kZeroPad2));
  return out;
}
const char* OpenAiErrorType(int status) {
  switch (status) {
    case 429:
      return "rate_limit_error";
    case 503:
      return "service_unavailable";
    case 500:
      return "server_error";
    default:
      return "invalid_request_error";
  }
}

json Logprob(float value) { return std::isnan(value) ? json(nullptr) : json(ShownLogprob(value)); }
json NumberLogprob(float value) {
  return ShownLogprob(std::isnan(value) ? -std::numeric_limits<float>::infinity() : value);
}

json TgiToken(const Token& t, float logprob) {
  return {{"id", t.id}, {"text", t.text}, {"logprob", Logprob(logprob)}, {"special", t.special}};
}
json TgiTopTokens(const std::vector<Token>& top) {
  json out = json::array();
  for (const Token& t : top) out.push_back(TgiToken(t, t.logprob));
  return out;
}

std::string TextOf(const Choice& c) {
  std::string text;
  for (const Token& t : c.generated) text += t.text;
  return text;
}

json Details(const Active& a, const Choice& c, bool with_prefill = true) {
  constexpr float kNone = std::numeric_limits<float>::quiet_NaN();
  json tokens = json::array();
  for (const Token& t : c.generated) tokens.push_back(TgiToken(t, a.logprobs ? t.logprob : kNone));
  json prefill = json::array();
  if (with_prefill && a.prompt_logprobs) {
    for (const Token& t : a.prompt) {
      prefill.push_back({{"id", t.id}, {"text", t.text}, {"logprob", Logprob(t.logprob)}});
    }
  }
  const size_t index = static_cast<size_t>(&c - a.choices.data());
  json details = {{"finish_reason", c.finish_reason},
                  {"generated_tokens", c.generated.size()},
                  {"seed", a.do_sample ? json(a.seed + index) : json(nullptr)},
                  {"prefill", prefill},
                  {"tokens", tokens}};
  if (a.top_n > 0) {
    json top = json::array();
    for (const Token& t : c.generated) top.push_back(TgiTopTokens(t.top));
    details["top_tokens"] = top;
  }
  return details;
}

json OpenAiLogprobs(const Active& a, const Choice& c, bool with_prompt, size_t from, size_t to,
                    size_t offset) {
  json tokens = json::array(), token_logprobs = json::array(), top = json::array(),
       offsets = json::array();
  auto add = [&](const Token& t, float logprob, const json& alternatives) {
    tokens.push_back(OpenAiTokenText(t.id, t.text));
    token_logprobs.push_back(Logprob(logprob));
    top.push_back(alternatives);
    offsets.push_back(offset);
    offset += t.text.size();
  };
  if (with_prompt) {
    for (const Token& t : a.prompt) {
      const float logprob = a.prompt_logprobs ? t.logprob : std::numeric_limits<float>::quiet_NaN();
      add(t, logprob,
          std::isnan(logprob) ? json(nullptr)
                              : json({{OpenAiTokenText(t.id, t.text), NumberLogprob(logprob)}}));
    }
  }
  for (size_t i = from; i < to && i < c.generated.size(); ++i) {
    json alternatives = json::object();
    for (const Token& alternative : c.generated[i].top) {
      alternatives[OpenAiTokenText(alternative.id, alternative.text)] =
          NumberLogprob(alternative.logprob);
    }
    add(c.generated[i], a.logprobs ? c.generated[i].logprob : 0.0f, alternatives);
  }
  return {{"tokens", tokens},
          {"token_logprobs", token_logprobs},
          {"top_logprobs", top},
          {"text_offset", offsets}};
}

json OpenAiUsage(const Active& a) {
  size_t completion = 0;
  for (const Choice& c : a.choices) completion += c.generated.size();
  return {{"prompt_tokens", a.prompt_tokens},
          {"completion_tokens", completion},
          {"total_tokens", a.prompt_tokens + completion},
          {"prompt_tokens_details", {{"cached_tokens", a.cached_prompt_tokens}}}};
}

json OpenAiChunk(const Active& a, json choices) {
  return {{"id", a.completion_id},
          {"object", !a.chat    ? "text_completion"
                     : a.stream ? "chat.completion.chunk"
                                : "chat.completion"},
          {"created", a.created},
          {"model", a.model_id},
          {"system_fingerprint", "kvcm-router-0.1.0"},
          {"choices", std::move(choices)}};
}

json OpenAiChoice(const Active& a, size_t index, const std::string& text,
                  const json& finish_reason) {
  json choice = {{"index", index}, {"logprobs", nullptr}, {"finish_reason", finish_reason}};
  if (!a.chat) {
    choice["text"] = text;
  } else if (a.stream) {
    choice["delta"] = {{"role", "assistant"}, {"content", text}};
  } else {
    choice["message"] = {{"role", "assistant"}, {"content", text}};
  }
  return choice;
}

std::string OpenAiFinishReason(const std::string& tgi) {
  return tgi == "length" ? "length" : "stop";
}

json ChatLogprobs(const Active& a, const Choice& c, size_t from, size_t to) {
  auto entry = [&](const Token& t, float logprob) {
    json bytes = json::array();
    for (unsigned char b : t.text) bytes.push_back(b);
    return json({{"token", OpenAiTokenText(t.id, t.text)},
                 {"logprob", NumberLogprob(logprob)},
                 {"bytes", bytes}});
  };
  json content = json::array();
  for (size_t i = from; i < to && i < c.generated.size(); ++i) {
    json e = entry(c.generated[i], a.logprobs ? c.generated[i].logprob : 0.0f);
    json top = json::array();
    for (const Token& alternative : c.generated[i].top) {
      top.push_back(entry(alternative, alternative.logprob));
    }
    e["top_logprobs"] = std::move(top);
    content.push_back(std::move(e));
  }
  return {{"content", content}};
}

json ErrorBody(const HttpError& error) {
  if (error.api == Api::kOpenAi) {
    return {{"error",
             {{"message", error.message},
              {"type", OpenAiErrorType(error.status)},
              {"param", error.param.empty() ? json(nullptr) : json(error.param)},
              {"code", nullptr}}}};
  }
  return {{"error", error.message}, {"error_type", error.type}};
}

// Impl::SendEvent: "data:" (TGI) or "data: " (OpenAI), the data, a blank line.
void AppendEvent(Api api, std::string_view data, std::string* out) {
  out->append(api == Api::kOpenAi ? "data: " : "data:");
  out->append(data);
  out->append("\n\n");
}

// Impl::Stream for the newest token of choice `index` (already in c.generated, its piece
// already added to c.text): the event's bytes appended to `out`.
void Stream(const Active& a, size_t index, bool finished, const std::string& piece,
            std::string* out) {
  const Choice& c = a.choices[index];
  const Token& newest = c.generated.back();
  if (a.api == Api::kOpenAi) {
    const bool first_chunk = c.generated.size() == 1;
    const std::string first = first_chunk && a.return_full_text ? a.prompt_text : "";
    json choice =
        OpenAiChoice(a, index, first + piece,
                     finished ? json(OpenAiFinishReason(c.finish_reason)) : json(nullptr));
    if (a.show_logprobs && a.chat) {
      choice["logprobs"] = ChatLogprobs(a, c, c.generated.size() - 1, c.generated.size());
    } else if (a.show_logprobs) {
      const size_t last = c.generated.size() - 1;
      const size_t offset = first_chunk ? 0
                                        : (a.return_full_text ? a.prompt_text.size() : 0) +
                                              c.text.size() - piece.size();
      choice["logprobs"] =
          OpenAiLogprobs(a, c, first_chunk && a.return_full_text, last, last + 1, offset);
    }
    AppendEvent(Api::kOpenAi, Dump(OpenAiChunk(a, json::array({std::move(choice)}))), out);
    return;
  }
  TgiStreamEvent event;
  event.index = c.generated.size() - 1;
  event.token = {newest.id, a.logprobs ? newest.logprob : 0.0f, piece, newest.special};
  std::vector<TgiStreamToken> top;
  if (a.top_n > 0) {
    event.with_top_tokens = true;
    for (const Token& t : newest.top) top.push_back({t.id, t.logprob, t.text, t.special});
    event.top_tokens = top;
  }
  TgiStreamEnd end;
  std::string all;
  if (finished) {
    all = TextOf(c);
    if (a.return_full_text) all = a.prompt_text + all;
    end.generated_text = all;
    end.finish_reason = c.finish_reason;
    end.generated_tokens = c.generated.size();
    end.input_length = a.prompt_tokens;
    if (a.do_sample) end.seed = a.seed;
    event.end = &end;
  }
  out->append("data:");
  AppendTgiStreamEvent(event, out);
  out->append("\n\n");
}

// The choices shown (Impl::Shown): all in order, or the `shown` with the highest total
// log-probability.
std::vector<size_t> Shown(const Active& a, bool best_first) {
  std::vector<size_t> order(a.choices.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  if (best_first || static_cast<int32_t>(order.size()) > a.shown) {
    std::vector<double> sum(a.choices.size(), 0);
    for (size_t i = 0; i < a.choices.size(); ++i) {
      for (const Token& t : a.choices[i].generated) sum[i] += t.logprob;
    }
    std::stable_sort(order.begin(), order.end(),
                     [&](size_t x, size_t y) { return sum[x] > sum[y]; });
    if (!best_first) order.resize(static_cast<size_t>(a.shown));
  }
  return order;
}

// Impl::Finish's reply of an unstreamed request that succeeded: its body.
std::string UnstreamedReply(const Active& a) {
  if (a.api == Api::kOpenAi) {
    json choices = json::array();
    const std::vector<size_t> shown = Shown(a, /*best_first=*/false);
    for (size_t k = 0; k < shown.size(); ++k) {
      const Choice& c = a.choices[shown[k]];
      std::string text = TextOf(c);
      // OpenAI's text stops before the stop sequence (TGI's keeps it).
      if (c.finish_reason == "stop_sequence") {
        size_t cut = text.size();
        for (const std::string& sequence : a.stop) cut = std::min(cut, text.find(sequence));
        text.resize(cut);
      }
      json choice = OpenAiChoice(a, k, a.return_full_text ? a.prompt_text + text : text,
                                 OpenAiFinishReason(c.finish_reason));
      if (a.show_logprobs) {
        choice["logprobs"] =
            a.chat ? ChatLogprobs(a, c, 0, c.generated.size())
                   : OpenAiLogprobs(a, c, a.return_full_text, 0, c.generated.size(), 0);
      }
      choices.push_back(std::move(choice));
    }
    json body = OpenAiChunk(a, std::move(choices));
    body["usage"] = OpenAiUsage(a);
    return Dump(body);
  }
  const std::vector<size_t> order = Shown(a, /*best_first=*/true);
  const Choice& best = a.choices[order.front()];
  const std::string text = TextOf(best);
  json body = {{"generated_text", a.return_full_text ? a.prompt_text + text : text}};
  if (a.details) {
    body["details"] = Details(a, best);
    if (a.choices.size() > 1) {
      json others = json::array();
      for (size_t k = 1; k < order.size(); ++k) {
        const Choice& c = a.choices[order[k]];
        json other = Details(a, c, /*with_prefill=*/false);
        const std::string other_text = TextOf(c);
        other["generated_text"] = a.return_full_text ? a.prompt_text + other_text : other_text;
        others.push_back(std::move(other));
      }
      body["details"]["best_of_sequences"] = std::move(others);
    }
  }
  return Dump(a.as_list ? json::array({body}) : body);
}

// A streamed request from its first token to its end (Impl::DeliverProgress, Stream and
// Finish): the choices' tokens one at a time, round robin, each choice's last one finishing
// it; then OpenAI's usage chunk and [DONE]; or, when it fails after `fail_after` tokens,
// the error event.
std::string StreamedReply(Active a, std::optional<size_t> fail_after, const std::string& failure) {
  std::vector<Choice> whole = std::move(a.choices);
  a.choices.assign(whole.size(), Choice{});
  for (size_t i = 0; i < whole.size(); ++i) a.choices[i].finish_reason = whole[i].finish_reason;
  std::string out;
  size_t sent = 0;
  for (size_t step = 0;; ++step) {
    bool any = false;
    for (size_t i = 0; i < whole.size(); ++i) {
      if (step >= whole[i].generated.size()) continue;
      any = true;
      if (fail_after.has_value() && sent == *fail_after) {
        const HttpError error{503, failure, "unavailable", "", a.api};
        AppendEvent(a.api, Dump(ErrorBody(error)), &out);
        return out;
      }
      Choice& c = a.choices[i];
      c.generated.push_back(whole[i].generated[step]);
      const std::string& piece = c.generated.back().text;
      c.text += piece;
      Stream(a, i, step + 1 == whole[i].generated.size(), piece, &out);
      ++sent;
    }
    if (!any) break;
  }
  if (a.api == Api::kOpenAi) {
    if (a.include_usage) {
      json usage = OpenAiChunk(a, json::array());
      usage["usage"] = OpenAiUsage(a);
      AppendEvent(Api::kOpenAi, Dump(usage), &out);
    }
    AppendEvent(Api::kOpenAi, "[DONE]", &out);
  }
  return out;
}

}  // namespace mirror

// ---- The checks --------------------------------------------------------------------------

// A subset of JSON Schema, enough for services/router/openapi.json's response schemas:
// $ref, type, const, enum, minimum, maximum, required, properties, additionalProperties,
// items, minItems, maxItems, allOf, anyOf, oneOf; other keywords are not checked.
class Schemas {
 public:
  explicit Schemas(json document) : document_(std::move(document)) {}

  // "" when `value` matches components/schemas/`name`, else where and why it does not.
  std::string Mismatch(const json& value, const std::string& name) const {
    return Match(value, Resolve(json("#/components/schemas/" + name)), "$");
  }

 private:
  const json& Resolve(const json& ref) const {
    Check(ref.is_string() && ref.get_ref<const std::string&>().rfind("#/", 0) == 0,
          "a $ref of the document is local");
    const std::string& name = ref.get_ref<const std::string&>();
    auto it = resolved_.find(name);
    if (it == resolved_.end()) {
      it = resolved_.emplace(name, &document_.at(json::json_pointer(name.substr(1)))).first;
    }
    return *it->second;
  }
  static bool IsType(const json& value, const std::string& type) {
    if (type == "object") return value.is_object();
    if (type == "array") return value.is_array();
    if (type == "string") return value.is_string();
    if (type == "boolean") return value.is_boolean();
    if (type == "null") return value.is_null();
    if (type == "number") return value.is_number();
    if (type == "integer") {
      return value.is_number_integer() ||
             (value.is_number_float() && std::trunc(value.get<double>()) == value.get<double>());
    }
    return false;
  }
  // The keywords of one schema object, found in one pass over its members.
  struct Keywords {
    const json* ref = nullptr;
    const json* type = nullptr;
    const json* constant = nullptr;
    const json* enumeration = nullptr;
    const json* minimum = nullptr;
    const json* maximum = nullptr;
    const json* required = nullptr;
    const json* properties = nullptr;
    const json* additional = nullptr;
    const json* items = nullptr;
    const json* min_items = nullptr;
    const json* max_items = nullptr;
    const json* all_of = nullptr;
    const json* any_of = nullptr;
    const json* one_of = nullptr;
  };
  static Keywords KeywordsOf(const json& schema) {
    static constexpr std::pair<std::string_view, const json * Keywords::*> kNames[] = {
        {"$ref", &Keywords::ref},
        {"type", &Keywords::type},
        {"const", &Keywords::constant},
        {"enum", &Keywords::enumeration},
        {"minimum", &Keywords::minimum},
        {"maximum", &Keywords::maximum},
        {"required", &Keywords::required},
        {"properties", &Keywords::properties},
        {"additionalProperties", &Keywords::additional},
        {"items", &Keywords::items},
        {"minItems", &Keywords::min_items},
        {"maxItems", &Keywords::max_items},
        {"allOf", &Keywords::all_of},
        {"anyOf", &Keywords::any_of},
        {"oneOf", &Keywords::one_of},
    };
    Keywords k;
    for (const auto& [key, value] : schema.items()) {
      for (const auto& [name, member] : kNames) {
        if (key == name) {
          k.*member = &value;
          break;
        }
      }
    }
    return k;
  }

  // "" when `value` matches `schema`, else why not; `path` says where `value` is.
  std::string Match(const json& value, const json& schema, const std::string& path) const {
    if (!schema.is_object()) return "";
    const Keywords k = KeywordsOf(schema);
    if (k.ref != nullptr) {
      if (std::string bad = Match(value, Resolve(*k.ref), path); !bad.empty()) return bad;
    }
    if (k.type != nullptr) {
      bool any = false;
      if (k.type->is_string()) any = IsType(value, k.type->get_ref<const std::string&>());
      if (k.type->is_array()) {
        for (const json& t : *k.type) {
          any = any || (t.is_string() && IsType(value, t.get_ref<const std::string&>()));
        }
      }
      if (!any) return absl::StrCat(path, " is ", value.type_name(), ", typed ", k.type->dump());
    }
    if (k.constant != nullptr && value != *k.constant) {
      return absl::StrCat(path, " is not ", k.constant->dump());
    }
    if (k.enumeration != nullptr) {
      bool found = false;
      for (const json& e : *k.enumeration) found = found || e == value;
      if (!found) return absl::StrCat(path, " is not one of ", k.enumeration->dump());
    }
    if (value.is_number() && k.minimum != nullptr && k.minimum->is_number() &&
        value.get<double>() < k.minimum->get<double>()) {
      return absl::StrCat(path, " = ", value.dump(), " < minimum ", k.minimum->dump());
    }
    if (value.is_number() && k.maximum != nullptr && k.maximum->is_number() &&
        value.get<double>() > k.maximum->get<double>()) {
      return absl::StrCat(path, " = ", value.dump(), " > maximum ", k.maximum->dump());
    }
    if (value.is_object()) {
      if (k.required != nullptr) {
        for (const json& key : *k.required) {
          if (!value.contains(key.get_ref<const std::string&>())) {
            return absl::StrCat(path, " lacks ", key.dump());
          }
        }
      }
      for (const auto& [key, member] : value.items()) {
        const json* property = nullptr;
        if (k.properties != nullptr) {
          const auto it = k.properties->find(key);
          if (it != k.properties->end()) property = &*it;
        }
        if (property == nullptr && k.additional == nullptr) continue;
        const std::string at = absl::StrCat(path, ".", key);
        if (property != nullptr) {
          if (std::string bad = Match(member, *property, at); !bad.empty()) return bad;
        } else if (k.additional->is_boolean() && !k.additional->get<bool>()) {
          return absl::StrCat(at, " is not allowed");
        } else if (std::string bad = Match(member, *k.additional, at); !bad.empty()) {
          return bad;
        }
      }
    }
    if (value.is_array()) {
      if (k.min_items != nullptr && value.size() < k.min_items->get<size_t>()) {
        return absl::StrCat(path, " has fewer than ", k.min_items->dump(), " items");
      }
      if (k.max_items != nullptr && value.size() > k.max_items->get<size_t>()) {
        return absl::StrCat(path, " has more than ", k.max_items->dump(), " items");
      }
      if (k.items != nullptr) {
        const std::string items = absl::StrCat(path, "[]");
        for (size_t i = 0; i < value.size(); ++i) {
          if (std::string bad = Match(value[i], *k.items, items); !bad.empty()) {
            return absl::StrCat(bad, " (item ", i, " of ", path, ")");
          }
        }
      }
    }
    if (k.all_of != nullptr) {
      for (const json& part : *k.all_of) {
        if (std::string bad = Match(value, part, path); !bad.empty()) return bad;
      }
    }
    if (k.any_of != nullptr) {
      std::string closest;
      bool any = false;
      for (const json& part : *k.any_of) {
        std::string bad = Match(value, part, path);
        any = any || bad.empty();
        if (bad.size() > closest.size()) closest = bad;  // the deepest, most likely meant
      }
      if (!any) return absl::StrCat(path, " matches none of anyOf; closest: ", closest);
    }
    if (k.one_of != nullptr) {
      int matches = 0;
      std::string closest;
      for (const json& part : *k.one_of) {
        std::string bad = Match(value, part, path);
        matches += bad.empty() ? 1 : 0;
        if (bad.size() > closest.size()) closest = bad;  // the deepest, most likely meant
      }
      if (matches == 0) return absl::StrCat(path, " matches none of oneOf; closest: ", closest);
      if (matches > 1) return absl::StrCat(path, " matches ", matches, " of oneOf");
    }
    return "";
  }

  const json document_;
  mutable std::map<std::string, const json*> resolved_;  // $ref: what it names
};

const Schemas& TheSchemas() {
  static const Schemas* schemas = [] {
    const json document = json::parse(
        std::string_view(reinterpret_cast<const char*>(kvcm_http_responses_openapi_json),
                         kvcm_http_responses_openapi_json_size),
        nullptr, false);
    Check(document.is_object() && document.contains("components"),
          "services/router/openapi.json parses");
    return new Schemas(document);
  }();
  return *schemas;
}

// Every log-probability in `value`: a member "logprob", the items of "token_logprobs", and
// the members of completions' top_logprobs maps: null, or a finite number >= kMinLogprob.
void CheckLogprobs(const json& value, bool in_top_map = false) {
  auto check = [](const json& logprob) {
    if (logprob.is_null()) return;
    Check(logprob.is_number(), "a log-probability is a number or null");
    const double v = logprob.get<double>();
    Check(std::isfinite(v), "a log-probability is finite");
    Check(v >= kMinLogprob, "a log-probability is no lower than -9999");
  };
  if (value.is_object()) {
    for (const auto& [key, member] : value.items()) {
      if (in_top_map) {
        check(member);
      } else if (key == "logprob") {
        check(member);
      } else if (key == "token_logprobs" && member.is_array()) {
        for (const json& item : member) check(item);
      } else if (key == "top_logprobs" && member.is_array()) {
        for (const json& item : member) {
          // Completions': a map of token to log-probability; chat's: objects with a logprob.
          CheckLogprobs(item, /*in_top_map=*/item.is_object() && !item.contains("logprob"));
        }
      } else {
        CheckLogprobs(member);
      }
    }
  } else if (value.is_array()) {
    for (const json& item : value) CheckLogprobs(item);
  }
}

// `text` is one JSON document matching `schema`, its log-probabilities as they must be.
json CheckDocument(std::string_view text, const std::string& schema) {
  const json parsed = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (parsed.is_discarded()) {
    Fail(absl::StrCat("a ", schema, " is not JSON: ", std::string(text.substr(0, 300))));
  }
  if (std::string bad = TheSchemas().Mismatch(parsed, schema); !bad.empty()) {
    Fail(absl::StrCat("a ", schema, " does not match services/router/openapi.json: ", bad, "\n",
                      std::string(text.substr(0, 500))));
  }
  CheckLogprobs(parsed);
  return parsed;
}

// `stream` is server-sent events of `api`, each one line `data:JSON` matching `schema`
// (OpenAI: `data: JSON`, the last one `data: [DONE]` unless it failed).
void CheckStream(std::string_view stream, Api api, const std::string& schema) {
  const std::string_view prefix = api == Api::kOpenAi ? "data: " : "data:";
  bool done = false;
  while (!stream.empty()) {
    const size_t end = stream.find("\n\n");
    Check(end != std::string_view::npos, "every event ends with a blank line");
    std::string_view event = stream.substr(0, end);
    stream.remove_prefix(end + 2);
    Check(!done, "nothing follows data: [DONE]");
    Check(event.substr(0, prefix.size()) == prefix, "every event is a data: line");
    event.remove_prefix(prefix.size());
    Check(event.find_first_of("\r\n") == std::string_view::npos,
          "an event's data holds no line break (it would end the line)");
    if (api == Api::kOpenAi && event == "[DONE]") {
      done = true;
      continue;
    }
    CheckDocument(event, schema);
  }
}

// `bytes` (AppendTgiStreamEvent's) are those nlohmann writes for the same event as a DOM.
void CheckSameAsDom(const TgiStreamEvent& e, std::string_view bytes) {
  auto token = [](const TgiStreamToken& t) {
    return json{{"id", t.id},
                {"text", std::string(t.text)},
                {"logprob", mirror::Logprob(t.logprob)},
                {"special", t.special}};
  };
  json event = {{"index", e.index},
                {"token", token(e.token)},
                {"generated_text", nullptr},
                {"details", nullptr}};
  if (e.with_top_tokens) {
    json top = json::array();
    for (const TgiStreamToken& t : e.top_tokens) top.push_back(token(t));
    event["top_tokens"] = top;
  }
  if (e.end != nullptr) {
    event["generated_text"] = std::string(e.end->generated_text);
    event["details"] = {{"finish_reason", std::string(e.end->finish_reason)},
                        {"generated_tokens", e.end->generated_tokens},
                        {"input_length", e.end->input_length},
                        {"seed", e.end->seed.has_value() ? json(*e.end->seed) : json(nullptr)}};
  }
  Check(bytes == mirror::Dump(event),
        "a stream event's bytes are those nlohmann writes for it (stream_events.h)");
}

constexpr const char* kFinishReasons[] = {"length", "eos_token", "stop_sequence"};

// Shape 0: stream events straight from the input.
void FormatRawEvents(Reader& in) {
  const size_t events = in.Count(8);
  for (size_t e = 0; e < events; ++e) {
    const uint64_t index = in.U64();
    const Token token = ReadToken(in, 0);
    const bool with_top = in.Bool();
    const size_t n_top = in.Count(5);
    std::vector<Token> top_tokens;
    for (size_t i = 0; i < n_top; ++i) top_tokens.push_back(ReadToken(in, 0));
    std::optional<TgiStreamEnd> end;
    std::string generated_text;
    if (in.Bool()) {
      generated_text = in.Text();
      end.emplace();
      end->generated_text = generated_text;
      end->finish_reason = kFinishReasons[in.Byte() % 3];
      end->generated_tokens = in.U64();
      end->input_length = index;  // any value, and the seeds read as before
      const bool seeded = in.Bool();
      const uint64_t seed = in.U64();
      if (seeded) end->seed = seed;
    }
    TgiStreamEvent event;
    event.index = index;
    event.token = {token.id, token.logprob, token.text, token.special};
    std::vector<TgiStreamToken> top;
    for (const Token& t : top_tokens) top.push_back({t.id, t.logprob, t.text, t.special});
    event.with_top_tokens = with_top;
    if (with_top) event.top_tokens = top;
    event.end = end.has_value() ? &*end : nullptr;
    std::string written = "data:";
    AppendTgiStreamEvent(event, &written);
    CheckSameAsDom(event, std::string_view(written).substr(5));
    written.append("\n\n");
    CheckStream(written, Api::kTgi, "StreamEvent");
  }
}

// Shapes 1 to 6: a request and what it generated, from the input.
mirror::Active ReadRequest(Reader& in, int shape, bool* fail, std::string* failure) {
  mirror::Active a;
  a.api = shape <= 2 ? Api::kTgi : Api::kOpenAi;
  a.stream = shape == 1 || shape == 4 || shape == 6;
  a.chat = shape == 5 || shape == 6;
  const uint8_t flags = in.Byte();
  a.details = (flags & 1) != 0;
  a.do_sample = (flags & 2) != 0;
  a.return_full_text = (flags & 4) != 0 && !a.chat;  // chat has no echo
  a.show_logprobs = (flags & 8) != 0 && a.api == Api::kOpenAi;
  a.prompt_logprobs = (flags & 16) != 0;
  a.include_usage = (flags & 32) != 0 && a.stream && a.api == Api::kOpenAi;
  a.as_list = (flags & 64) != 0 && shape == 2;
  *fail = (flags & 128) != 0;
  // What RequestParser sets: TGI always has the generated tokens' logprobs (details and
  // streams show them); OpenAI only when asked.
  a.logprobs = a.api == Api::kTgi || a.show_logprobs;
  a.top_n = static_cast<int32_t>(in.Count(5));
  if (a.api == Api::kOpenAi && !a.show_logprobs) a.top_n = 0;
  a.seed = in.U64();
  a.created = static_cast<int64_t>(in.U64());
  a.prompt_tokens = in.U64();
  a.cached_prompt_tokens = static_cast<int32_t>(in.U32() & 0x7FFFFFFF);
  a.model_id = in.Text();
  a.completion_id = absl::StrCat(a.chat ? "chatcmpl-" : "cmpl-", in.U32());
  a.prompt_text = in.Text();
  const size_t prompt = 1 + in.Count(7);
  for (size_t i = 0; i < prompt; ++i) a.prompt.push_back(ReadToken(in, 0));
  // The first prompt token has no log-probability (nothing before it).
  a.prompt.front().logprob = std::numeric_limits<float>::quiet_NaN();
  const size_t stops = in.Count(4);
  for (size_t i = 0; i < stops; ++i) {
    std::string stop = in.Text();
    if (!stop.empty()) a.stop.push_back(std::move(stop));  // RequestParser refuses ""
  }
  const size_t choices = 1 + in.Count(3);
  a.shown = static_cast<int32_t>(1 + in.Count(choices - 1));
  if (a.api == Api::kTgi || a.stream) a.shown = static_cast<int32_t>(choices);
  for (size_t i = 0; i < choices; ++i) {
    mirror::Choice c;
    c.finish_reason = kFinishReasons[in.Byte() % 3];
    if (c.finish_reason == std::string("stop_sequence") && a.stop.empty()) {
      c.finish_reason = "eos_token";
    }
    const size_t tokens = 1 + in.Count(11);
    for (size_t t = 0; t < tokens; ++t) {
      Token token = ReadToken(in, static_cast<size_t>(a.top_n));
      c.generated.push_back(std::move(token));
    }
    // A choice that ended at a stop sequence has it in its text (the router stops there).
    if (c.finish_reason == std::string("stop_sequence")) {
      c.generated.back().text += a.stop[in.Byte() % a.stop.size()];
    }
    a.choices.push_back(std::move(c));
  }
  *failure = Shortened(in.Text(), kMaxTemplateMessageBytes);
  return a;
}

void FormatRequest(Reader& in, int shape) {
  bool fail = false;
  std::string failure;
  const mirror::Active a = ReadRequest(in, shape, &fail, &failure);
  const size_t fail_after = in.Count(8);
  if (a.stream) {
    const std::string written =
        mirror::StreamedReply(a, fail ? std::optional<size_t>(fail_after) : std::nullopt, failure);
    CheckStream(written, a.api,
                a.api == Api::kTgi ? "StreamEvent"
                : a.chat           ? "ChatCompletionChunkEvent"
                                   : "CompletionChunkEvent");
    if (a.api == Api::kTgi && !fail) {
      // One event per token. Events end with a blank line, which no JSON text holds (a
      // token's text may hold "data:" itself).
      size_t events = 0;
      for (size_t at = written.find("\n\n"); at != std::string::npos;
           at = written.find("\n\n", at + 2)) {
        ++events;
      }
      size_t tokens = 0;
      for (const mirror::Choice& c : a.choices) tokens += c.generated.size();
      Check(events == tokens, "a TGI stream has one event per token");
    }
    return;
  }
  if (fail) {
    // Impl::Finish with an error, then ReplyError (OpenAI's 400 for TGI's 422).
    const HttpError error{503, failure, "unavailable", "", a.api};
    CheckDocument(mirror::Dump(mirror::ErrorBody(error)),
                  a.api == Api::kOpenAi ? "OpenAiError" : "TgiError");
    return;
  }
  const std::string written = mirror::UnstreamedReply(a);
  if (a.api == Api::kOpenAi) {
    CheckDocument(written, a.chat ? "ChatCompletion" : "Completion");
  } else if (a.as_list) {
    const json list = json::parse(written, nullptr, false);
    Check(list.is_array() && list.size() == 1, "POST / answers a list of one reply");
    CheckDocument(list[0].dump(), "GenerateResponse");
  } else {
    CheckDocument(written, "GenerateResponse");
  }
}

// Shape 7: error bodies, the client's bytes quoted through Shortened.
void FormatErrors(Reader& in) {
  static constexpr int kStatuses[] = {400, 404, 405, 413, 422, 429, 500, 501, 503};
  const size_t errors = 1 + in.Count(3);
  for (size_t i = 0; i < errors; ++i) {
    HttpError error;
    error.api = in.Bool() ? Api::kOpenAi : Api::kTgi;
    error.status = kStatuses[in.Byte() % std::size(kStatuses)];
    const std::string key = in.Text();
    const std::string value = in.Text();
    error.message = in.Bool() ? absl::StrCat("parameter `", Shortened(key),
                                             "` is not supported by this server (",
                                             Shortened(mirror::Dump(json(value))), ")")
                              : Shortened(value, kMaxTemplateMessageBytes);
    error.type = in.Bool() ? "validation" : "unavailable";
    error.param = Shortened(key);
    const json body = CheckDocument(mirror::Dump(mirror::ErrorBody(error)),
                                    error.api == Api::kOpenAi ? "OpenAiError" : "TgiError");
    Check(mirror::Dump(body).size() <= 8 * (kMaxTemplateMessageBytes + 4 * kMaxEchoedValueBytes),
          "an error body is short, however long what it quotes");
  }
}

}  // namespace
}  // namespace kvcm::router

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvcm::router;  // NOLINT: one function
  if (size == 0) return 0;
  TheSchemas();
  const int shape = data[0] % 8;
  Reader in(data + 1, size - 1);
  switch (shape) {
    case 0:
      FormatRawEvents(in);
      break;
    case 7:
      FormatErrors(in);
      break;
    default:
      FormatRequest(in, shape);
      break;
  }
  if (!in.ran_out()) kvcm::fuzz::NoteAccepted();
  return 0;
}
