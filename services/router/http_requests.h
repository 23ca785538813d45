#pragma once
// The bodies of the router's generation requests, parsed: what turns the body of a TGI
// `POST /generate`, `/generate_stream` or `/`, an OpenAI `POST /v1/completions` or
// `POST /v1/chat/completions` into the request the router submits (its prompt tokenized, its
// sampling and outputs resolved), or into the error to answer. No sockets and no libevent:
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
#include "services/router/step_planner.h"

namespace kvcm::router {

enum class Api : uint8_t { kTgi, kOpenAi };

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

// A temperature below this samples as greedy (OpenAI's and TGI's alike): the logits divided
// by 1e-40 overflow, and the distribution the token is drawn from (and its
// log-probabilities) is no longer a number (docs/router.md, "Log-probabilities").
inline constexpr float kGreedyBelowTemperature = 1e-5f;

// An error, in the shape of the API it answers.
struct HttpError {
  int status = 422;
  std::string message;
  std::string type = "validation";
  std::string param = "";  // OpenAI: the offending parameter, if one
  Api api = Api::kTgi;
};

// A request's generation parameters, resolved.
struct Params {
  int32_t max_new_tokens = 0;
  SeqSampling sampling;
  RequestOutputs outputs;
  int32_t truncate = 0;  // TGI: keep the prompt's last `truncate` tokens (0: all)
  int32_t best_of = 1;   // sequences generated (TGI's best_of; OpenAI's max(n, best_of))
  int32_t n = 1;         // OpenAI: choices returned
  bool show_logprobs = false;  // OpenAI: the client asked for logprobs
  bool details = false;
  bool return_full_text = false;
  std::vector<std::string> stop;  // generation ends once the text contains one
  bool do_sample = false;
  uint64_t seed = 0;
  // OpenAI (vLLM's extensions; docs/router.md, "ignore_eos and min_tokens"): generation
  // does not end at the model's EOS token(s), only at max_tokens or a stop string. (vLLM's
  // min_tokens is sampling.min_tokens: the executors hold EOS back until then.)
  bool ignore_eos = false;
};

// A generation request, parsed and checked.
struct GenerationRequest {
  Api api = Api::kTgi;
  bool chat = false;    // /v1/chat/completions (messages, deltas) rather than /v1/completions
  bool stream = false;
  bool as_list = false;  // POST / without streaming answers [reply], as TGI does
  bool include_usage = false;  // OpenAI: stream_options.include_usage
  int32_t shown = 1;           // choices returned (OpenAI's n; 1 for TGI)
  Params params;
  std::string prompt_text;
  std::vector<int32_t> prompt;  // its tokens (BOS first when the tokenizer adds one)
};

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
  std::optional<HttpError> ParseParams(const nlohmann::json& root, Params* params);
  std::optional<HttpError> OpenAiParam(const std::string& key, const nlohmann::json& value,
                                       GenerationRequest* active_request,
                                       OpenAiGiven* given) const;
  std::optional<HttpError> FinishOpenAiParams(GenerationRequest* active_request,
                                              const OpenAiGiven& given);
  static SeqSampling Greedy(const SeqSampling& sampling);

  const RequestLimits options_;
  const Tokenizer* const tokenizer_;
  uint64_t next_seed_ = 0x5eed;  // for sampled requests without a seed
};

}  // namespace kvcm::router
