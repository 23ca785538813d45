#pragma once
// The bodies of the router's generation requests, parsed: what turns the body of a TGI
// `POST /generate`, `/generate_stream` or `/`, an OpenAI `POST /v1/completions` or
// `POST /v1/chat/completions` into the request the router submits (its prompt tokenized, its
// sampling and outputs resolved), or into the error to answer. What both APIs share is
// here (http_requests.cc); each API's members of RequestParser are defined with that API's
// replies (tgi_api.cc: ParseGenerate, ParseTokenize; openai_api.cc: ParseCompletions,
// ParseChatCompletions), one library of the three. No sockets and no libevent:
// HttpFrontend (http_frontend.h) checks the method, hands the body here, then answers the
// error or starts the request (its limits on prompt length, concurrency and executors are
// its own); the fuzz target tests/services/router/http_requests_fuzz_target.cc feeds any
// bytes here.
//
// Errors carry the status the front end answers with: 400 for a body that is not a JSON
// object (and a chat template's own refusal), 422 for invalid or unsupported parameters
// (never ignored silently: an empty stop string, OpenAI's best_of under n, ...), a body
// nested deeper than kMaxJsonDepth and a prompt of no tokens, 501 for chat completions
// without a chat template. What a refusal quotes of the body is Shortened. The body may be
// any bytes: nothing here throws, and nothing here recurses on the body's nesting.
//
// Thread safety: a RequestParser draws the seeds of sampled requests that gave none from its
// own counter: one thread (the front end's) uses it.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/chat/chat_template.h"
#include "common/tokenizer/tokenizer.h"
#include "common/wire/executor_codec.h"
#include "nlohmann/json_fwd.hpp"
#include "services/router/generation.h"
#include "services/router/step_planner.h"

namespace kvcm::router {

// The deepest a request body's JSON may nest arrays and objects (the body's own object is
// level 1). The parser builds any depth without recursion, but dumping, copying and a chat
// message's conversion for the template (jinja::FromJson) recurse once per level: 20,000
// levels, 40 KB of body, overflowed the stack. So every body is walked once, without
// recursion, and a deeper one is refused before anything else reads it (docs/router.md,
// "Errors").
inline constexpr int kMaxJsonDepth = 64;

// Whether `value` nests arrays and objects deeper than `max_depth` levels (`value` itself,
// when it is one, is level 1). Iterative: any depth is safe to ask about.
bool NestedDeeperThan(const nlohmann::json& value, int max_depth);

// At most this many bytes of a refused value are echoed in an error message ("parameter
// `x` is not supported (VALUE)"), then "...": a 500 KB value must not make a 500 KB reply.
inline constexpr size_t kMaxEchoedValueBytes = 64;
// A chat template's own refusal (raise_exception) is its author's sentence, often longer
// than 64 bytes, but it may quote a message: it is cut at this many bytes.
inline constexpr size_t kMaxTemplateMessageBytes = 256;

// `text` as an error message echoes it: its first `max_bytes` (cut where a UTF-8 character
// starts), then "..." when there was more. Every reply that quotes what a client sent (a
// parameter's name or value, a path, a template's refusal) quotes it through this.
std::string Shortened(absl::string_view text, size_t max_bytes = kMaxEchoedValueBytes);

// Refusals both APIs' parsers word alike: "parameter `key` is not supported by this server
// (value)", both Shortened; a body nested deeper than kMaxJsonDepth; a prompt `field` that
// gives no tokens (an empty text, or one the tokenizer drops whole, for a model that adds no
// BOS: a sequence computes at least its last prompt token, the planner checks it).
std::string UnsupportedParameterMessage(absl::string_view key, const nlohmann::json& value);
std::string TooDeepMessage();
std::string NoPromptTokensMessage(absl::string_view field);

// A temperature below this samples as greedy (OpenAI's and TGI's alike): the logits divided
// by 1e-40 overflow, and the distribution the token is drawn from (and its
// log-probabilities) is no longer a number (docs/router.md, "Log-probabilities").
inline constexpr float kGreedyBelowTemperature = 1e-5f;

// What requests are checked against: HttpFrontend::Options's fields of the same names.
struct RequestLimits {
  int32_t max_input_tokens = 1024;  // TGI's `truncate` and /tokenize's ids at most this
  int32_t max_total_tokens = 2048;  // max_new_tokens at most this
  int32_t default_max_new_tokens = 100;
  int32_t max_top_n_tokens = 5;  // TGI's top_n_tokens, OpenAI's logprobs and top_logprobs
  int32_t max_best_of = 4;       // TGI's best_of, OpenAI's n and best_of
  // Chat completions render messages with it (null: they are answered 501).
  const ChatTemplate* chat_template = nullptr;
  std::string bos_token;  // the template's variables
  std::string eos_token;
};

class RequestParser {
 public:
  // `tokenizer` and limits.chat_template outlive the parser.
  RequestParser(RequestLimits limits, const Tokenizer* tokenizer)
      : options_(std::move(limits)), tokenizer_(tokenizer) {}

  // TGI: `stream_path` is what the path says (/generate_stream: true, /generate: false), or
  // nullopt for POST /, where the body's "stream" decides. nullopt and `out` filled, or the
  // error to answer.
  std::optional<HttpError> ParseGenerate(std::string_view body, std::optional<bool> stream_path,
                                         GenerationRequest* out);
  // OpenAI /v1/completions: one prompt (a string, or token ids).
  std::optional<HttpError> ParseCompletions(std::string_view body, GenerationRequest* out);
  // OpenAI /v1/chat/completions: `messages` rendered with limits.chat_template
  // (add_generation_prompt) and tokenized as transformers' apply_chat_template does.
  std::optional<HttpError> ParseChatCompletions(std::string_view body, GenerationRequest* out);
  // TGI /tokenize: `{"inputs": "..."}` into the ids PromptOf gives, or the error to answer
  // (422 for every refusal, as TGI's): at most limits.max_input_tokens of them, the bound
  // of a prompt (1 MB of digits was a 22 MB reply).
  std::optional<HttpError> ParseTokenize(std::string_view body, std::vector<int32_t>* ids) const;
  // A text prompt's ids as the model sees them: BOS when the tokenizer's model asks for one,
  // then the tokenizer's ids. What /tokenize answers (as TGI's does, special tokens added).
  // May be empty (an empty text, for a model that adds no BOS: SmolLM2): the parsers refuse
  // such a prompt, since a sequence needs at least one token to be computed.
  absl::StatusOr<std::vector<int32_t>> PromptOf(const std::string& text) const;

 private:
  // What an OpenAI body gave that FinishOpenAiParams resolves once every member is read
  // (the members come in no order that may decide anything).
  struct OpenAiGiven {
    std::optional<uint64_t> seed;
    bool best_of = false;  // `best_of` was given (not null): it must be at least `n`
    std::optional<int32_t> max_tokens;
    std::optional<int32_t> max_completion_tokens;  // chat: wins over max_tokens
  };
  // TGI's (tgi_api.cc).
  std::optional<HttpError> ParseParams(const nlohmann::json& root, Params* params);
  std::optional<HttpError> TgiParam(const std::string& key, const nlohmann::json& value,
                                    Params* params) const;
  // OpenAI's (openai_api.cc).
  std::optional<HttpError> OpenAiParam(const std::string& key, const nlohmann::json& value,
                                       GenerationRequest* active_request, OpenAiGiven* given) const;
  std::optional<HttpError> OpenAiExtensionParam(const std::string& key, const nlohmann::json& value,
                                                GenerationRequest* active_request) const;
  std::optional<HttpError> FinishOpenAiParams(GenerationRequest* active_request,
                                              const OpenAiGiven& given);
  static SamplingParams Greedy(const SamplingParams& sampling);

  const RequestLimits options_;
  const Tokenizer* const tokenizer_;
  uint64_t next_seed_ = 0x5eed;  // for sampled requests without a seed
};

}  // namespace kvcm::router
