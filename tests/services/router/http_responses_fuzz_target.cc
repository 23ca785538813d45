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
//   shape 6  its stream: the role chunks, deltas;
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
//     same event built as a DOM (services/router/stream_events.h promises it);
//   - a TGI stream has one event per token the router kept, and a choice whose last token
//     spells a stop sequence ends there.
//
// All of it is the router's own code: the TGI stream events' bytes are written by
// services/router/stream_events.h (AppendTgiStreamEvent, ShownLogprob), error messages quote
// through Shortened and UnsupportedParameterMessage (services/router/http_requests.h), and
// every other shape by the APIs' formatters, from a real router::Generation and a real
// tokenizer: services/router/tgi_api.h (TgiReply, AppendTgiTokenEvent, TgiErrorBody) and
// services/router/openai_api.h (OpenAiReply, OpenAiRoleChunk, OpenAiTokenChunk,
// OpenAiUsageChunk, OpenAiErrorBody), over generation.h (Shown, BestFirst, StopSequenceSeen,
// TextOf, Dump, Logprob). What the target adds is what the front end does between them
// (Run, AddToken: HttpFrontend::Impl's Start, AddToken, Stream and Finish): recording each
// token the core reports, its piece through an IncrementalDecoder, the stop sequence that
// ends a choice (checked: a choice whose last token spells one ends there). The tokenizer is
// a byte-level BpeTokenizer built from the input's tokens (Vocabulary): a token's text any
// bytes, a special one decoding to nothing.
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
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/tokenizer/bpe_tokenizer.h"
#include "common/tokenizer/byte_level.h"
#include "common/tokenizer/incremental_decoder.h"
#include "common/tokenizer/tokenizer.h"
#include "nlohmann/json.hpp"
#include "services/router/generation.h"
#include "services/router/http_requests.h"
#include "services/router/openai_api.h"
#include "services/router/stream_events.h"
#include "services/router/tgi_api.h"
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

// A token as the core reports it and the tokenizer spells it (shapes 1 to 6: `id` names an
// entry of the input's Vocabulary, below).
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

// ---- The router's state: a Generation and the model's tokenizer --------------------------

// The model's tokenizer, built from the input's tokens: a byte-level BPE (BpeTokenizer, as
// a tokenizer.json gives one) whose vocabulary holds each token the input names: tokens of
// the same input id, text and special flag are one entry, its piece the text (any bytes:
// the byte-level alphabet spells every byte). A special token is an added special token
// (IsSpecial; it decodes to nothing); a token of no text is an id without a piece (which
// also decodes to nothing and is special, as a padded vocab's ids are). The ids the router
// sees are the entries' places, 0 up.
class Vocabulary {
 public:
  // The id of `t`'s entry, added if new.
  int32_t Id(const Token& t) {
    const auto [first, last] = by_input_id_.equal_range(t.id);
    for (auto it = first; it != last; ++it) {
      const Entry& e = entries_[static_cast<size_t>(it->second)];
      if (e.text == t.text && e.special == t.special) return it->second;
    }
    const auto id = static_cast<int32_t>(entries_.size());
    entries_.push_back({t.text, t.special});
    by_input_id_.emplace(t.id, id);
    return id;
  }

  std::unique_ptr<Tokenizer> Build() const {
    BpeVocab vocab;
    vocab.source = "the fuzz input's vocabulary";
    // ByteLevel without its regex: nothing to compile per input (Encode is not called).
    BpePreTokenizerStep byte_level;
    byte_level.kind = BpePreTokenizerStep::Kind::kByteLevel;
    byte_level.use_regex = false;
    vocab.pre_tokenizer.push_back(byte_level);
    vocab.tokens.resize(std::max<size_t>(entries_.size(), 1));
    for (size_t id = 0; id < entries_.size(); ++id) {
      if (entries_[id].special) {
        vocab.added_tokens.push_back(
            {absl::StrCat("<|special_", id, "|>"), static_cast<int32_t>(id), /*special=*/true});
      } else {
        internal::ByteLevelEncode(entries_[id].text, &vocab.tokens[id]);
      }
    }
    absl::StatusOr<std::unique_ptr<BpeTokenizer>> tokenizer =
        BpeTokenizer::FromVocab(std::move(vocab), 0);
    Check(tokenizer.ok(), "the input's vocabulary makes a tokenizer");
    return *std::move(tokenizer);
  }

 private:
  struct Entry {
    std::string text;
    bool special = false;
  };
  std::vector<Entry> entries_;
  std::multimap<int32_t, int32_t> by_input_id_;
};

// What the core reports of one generated token (Progress): its id, log-probability and top
// alternatives (whether it finished its choice, and why: Request::finish).
struct Reported {
  int32_t id = 0;
  float logprob = 0;
  std::vector<std::pair<int32_t, float>> top;
};

// A request as the input describes it: the router's Generation before its first token,
// what the core will report for each choice, and the tokenizer.
struct Request {
  Generation g;
  std::string model_id;
  std::vector<std::vector<Reported>> tokens;  // per choice
  // Per choice: the core's finish reason of its last token; "" when the router ends it at
  // the stop sequence its last token spells (the core reports that token unfinished).
  std::vector<std::string> finish;
  std::unique_ptr<Tokenizer> tokenizer;
  bool fail = false;
  size_t fail_after = 0;
  std::string failure;
};

// Impl::SendEvent: the field, the data, a blank line.
void AppendEvent(std::string_view field, std::string_view data, std::string* out) {
  out->append(field);
  out->append(data);
  out->append("\n\n");
}

HttpError Failure(const Request& r) { return {503, r.failure, "unavailable", "", r.g.api}; }
nlohmann::json ErrorBody(const HttpError& error) {
  return error.api == Api::kOpenAi ? OpenAiErrorBody(error) : TgiErrorBody(error);
}

// HttpFrontend::Impl::AddToken, then Stream: choice `index`'s token `p` recorded, looked at
// for stop sequences and, streamed, its event appended to `out`. Whether the choice is done.
bool AddToken(Request& r, size_t index, const Reported& p, bool reported_finished,
              const std::string& finish_reason, std::string* out) {
  Generation& g = r.g;
  Choice& c = g.choices[index];
  bool finished = reported_finished;
  c.generated.push_back(p.id);
  c.sum_logprob += p.logprob;
  if (g.params.outputs.logprobs) c.logprobs.push_back(p.logprob);
  if (g.params.outputs.top_n > 0) c.top.push_back(p.top);
  c.finish_reason = finish_reason;
  IncrementalDecoder::Piece piece;
  if (g.stream || !g.params.stop.empty()) {
    absl::StatusOr<IncrementalDecoder::Piece> next = c.decoder.Next(*r.tokenizer, c.generated);
    if (next.ok()) piece = *std::move(next);
  }
  const std::optional<size_t> at = finished ? std::nullopt : StopSequenceSeen(g, c, piece);
  if (at.has_value()) {
    finished = true;
    c.stop_at = *at;
    c.finish_reason = "stop_sequence";
  }
  const std::string added = finished ? piece.ready + piece.pending : piece.ready;
  c.text += added;
  if (g.stream) {
    if (g.api == Api::kOpenAi) {
      AppendEvent(kOpenAiEventField,
                  OpenAiTokenChunk(g, index, finished, added, *r.tokenizer, r.model_id), out);
    } else {
      out->append(kTgiEventField);
      AppendTgiTokenEvent(g, index, p.id, p.logprob, finished, added, *r.tokenizer, out);
      out->append("\n\n");
    }
  }
  c.done = finished;
  return finished;
}

// A request from its first token to its end (Impl::Start, DeliverProgress and Finish): a
// chat stream's role chunks, then the choices' tokens one at a time, round robin, each
// choice's last one finishing it (or the stop sequence it spells); then OpenAI's usage
// chunk and [DONE], or the reply. A request that fails after `fail_after` tokens (the
// core's error; an unstreamed one's whenever it comes) answers the error, a stream's as its
// last event; `*failed` says so.
std::string Run(Request& r, bool* failed) {
  Generation& g = r.g;
  *failed = false;
  if (r.fail && !g.stream) {
    *failed = true;
    return Dump(ErrorBody(Failure(r)));
  }
  std::string out;
  if (g.stream && g.chat) {
    for (int32_t k = 0; k < g.shown; ++k) {
      AppendEvent(kOpenAiEventField, OpenAiRoleChunk(g, static_cast<size_t>(k), r.model_id), &out);
    }
  }
  size_t sent = 0;
  for (size_t step = 0;; ++step) {
    bool any = false;
    for (size_t i = 0; i < g.choices.size(); ++i) {
      if (g.choices[i].done || step >= r.tokens[i].size()) continue;
      any = true;
      if (r.fail && sent == r.fail_after) {
        AppendEvent(g.api == Api::kOpenAi ? kOpenAiEventField : kTgiEventField,
                    Dump(ErrorBody(Failure(r))), &out);
        *failed = true;
        return out;
      }
      const bool last = step + 1 == r.tokens[i].size();
      const bool reported_finished = last && !r.finish[i].empty();
      AddToken(r, i, r.tokens[i][step], reported_finished,
               reported_finished ? r.finish[i] : std::string(), &out);
      ++sent;
      Check(!last || g.choices[i].done,
            "a choice whose last token spells a stop sequence ends there (StopSequenceSeen)");
    }
    if (!any) break;
  }
  if (!g.stream) {
    return g.api == Api::kOpenAi ? OpenAiReply(g, *r.tokenizer, r.model_id)
                                 : TgiReply(g, *r.tokenizer);
  }
  if (g.api == Api::kOpenAi) {
    if (g.include_usage) AppendEvent(kOpenAiEventField, OpenAiUsageChunk(g, r.model_id), &out);
    AppendEvent(kOpenAiEventField, kOpenAiDone, &out);
  }
  return out;
}

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
                {"logprob", Logprob(t.logprob)},
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
  Check(bytes == Dump(event),
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
Request ReadRequest(Reader& in, int shape) {
  Request r;
  Generation& g = r.g;
  g.api = shape <= 2 ? Api::kTgi : Api::kOpenAi;
  g.stream = shape == 1 || shape == 4 || shape == 6;
  g.chat = shape == 5 || shape == 6;
  Params& params = g.params;
  const uint8_t flags = in.Byte();
  params.details = (flags & 1) != 0;
  params.do_sample = (flags & 2) != 0;
  params.return_full_text = (flags & 4) != 0 && !g.chat;  // chat has no echo
  params.show_logprobs = (flags & 8) != 0 && g.api == Api::kOpenAi;
  params.outputs.prompt_logprobs = (flags & 16) != 0;
  g.include_usage = (flags & 32) != 0 && g.stream && g.api == Api::kOpenAi;
  g.as_list = (flags & 64) != 0 && shape == 2;
  r.fail = (flags & 128) != 0;
  // What RequestParser sets: TGI always has the generated tokens' logprobs (details and
  // streams show them); OpenAI only when asked.
  params.outputs.logprobs = g.api == Api::kTgi || params.show_logprobs;
  params.outputs.top_n = static_cast<int32_t>(in.Count(5));
  if (g.api == Api::kOpenAi && !params.show_logprobs) params.outputs.top_n = 0;
  params.seed = in.U64();
  g.created = static_cast<int64_t>(in.U64());
  g.prompt_tokens = in.U64();
  g.cached_prompt_tokens = static_cast<int32_t>(in.U32() & 0x7FFFFFFF);
  r.model_id = in.Text();
  g.completion_id = OpenAiCompletionId(g.chat, in.U32());
  g.prompt_text = in.Text();
  std::vector<Token> prompt(1 + in.Count(7));
  for (Token& t : prompt) t = ReadToken(in, 0);
  // The first prompt token has no log-probability (nothing before it).
  prompt.front().logprob = std::numeric_limits<float>::quiet_NaN();
  const size_t stops = in.Count(4);
  for (size_t i = 0; i < stops; ++i) {
    std::string stop = in.Text();
    if (!stop.empty()) params.stop.push_back(std::move(stop));  // RequestParser refuses ""
  }
  const size_t choices = 1 + in.Count(3);
  g.shown = static_cast<int32_t>(1 + in.Count(choices - 1));
  if (g.api == Api::kTgi || g.stream) g.shown = static_cast<int32_t>(choices);
  params.best_of = static_cast<int32_t>(choices);
  params.n = g.shown;
  params.outputs.sequences = static_cast<int32_t>(choices);
  std::vector<std::vector<Token>> generated(choices);
  for (size_t i = 0; i < choices; ++i) {
    std::string finish = kFinishReasons[in.Byte() % 3];
    if (finish == "stop_sequence" && params.stop.empty()) finish = "eos_token";
    generated[i].resize(1 + in.Count(11));
    for (Token& t : generated[i]) t = ReadToken(in, static_cast<size_t>(params.outputs.top_n));
    // A choice that ends at a stop sequence: its last token spells it (a text, so no special
    // token), and the router finds it there.
    if (finish == "stop_sequence") {
      generated[i].back().text += params.stop[in.Byte() % params.stop.size()];
      generated[i].back().special = false;
      finish.clear();
    }
    r.finish.push_back(std::move(finish));
  }
  r.failure = Shortened(in.Text(), kMaxTemplateMessageBytes);
  r.fail_after = in.Count(8);

  Vocabulary vocabulary;
  for (const Token& t : prompt) {
    g.prompt.push_back(vocabulary.Id(t));
    if (params.outputs.prompt_logprobs) g.prompt_logprobs.push_back(t.logprob);
  }
  for (const std::vector<Token>& tokens : generated) {
    std::vector<Reported>& reported = r.tokens.emplace_back();
    for (const Token& t : tokens) {
      Reported p{vocabulary.Id(t), t.logprob, {}};
      for (const Token& alternative : t.top) {
        p.top.emplace_back(vocabulary.Id(alternative), alternative.logprob);
      }
      reported.push_back(std::move(p));
    }
  }
  r.tokenizer = vocabulary.Build();
  g.choices.assign(choices, Choice{});
  return r;
}

void FormatRequest(Reader& in, int shape) {
  Request r = ReadRequest(in, shape);
  const Generation& g = r.g;
  bool failed = false;
  const std::string written = Run(r, &failed);
  if (g.stream) {
    CheckStream(written, g.api,
                g.api == Api::kTgi ? "StreamEvent"
                : g.chat           ? "ChatCompletionChunkEvent"
                                   : "CompletionChunkEvent");
    if (g.api == Api::kTgi && !failed) {
      // One event per token. Events end with a blank line, which no JSON text holds (a
      // token's text may hold "data:" itself).
      size_t events = 0;
      for (size_t at = written.find("\n\n"); at != std::string::npos;
           at = written.find("\n\n", at + 2)) {
        ++events;
      }
      size_t tokens = 0;
      for (const Choice& c : g.choices) tokens += c.generated.size();
      Check(events == tokens, "a TGI stream has one event per token");
    }
    return;
  }
  if (failed) {
    CheckDocument(written, g.api == Api::kOpenAi ? "OpenAiError" : "TgiError");
  } else if (g.api == Api::kOpenAi) {
    CheckDocument(written, g.chat ? "ChatCompletion" : "Completion");
  } else if (g.as_list) {
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
    error.message = in.Bool() ? UnsupportedParameterMessage(key, json(value))
                              : Shortened(value, kMaxTemplateMessageBytes);
    error.type = in.Bool() ? "validation" : "unavailable";
    error.param = Shortened(key);
    const json body = CheckDocument(Dump(ErrorBody(error)),
                                    error.api == Api::kOpenAi ? "OpenAiError" : "TgiError");
    Check(Dump(body).size() <= 8 * (kMaxTemplateMessageBytes + 4 * kMaxEchoedValueBytes),
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
