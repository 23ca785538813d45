#pragma once
// The router's plain request and generation types, at the bottom of its HTTP layer: what a
// request body parses into (GenerationRequest, or the HttpError to answer: http_requests.h),
// and what a running request has generated (Generation, one Choice per sequence), which the
// APIs' formatters (tgi_api.h, openai_api.h) turn into replies and stream events and the
// front end (http_frontend.h) fills from what the core reports. No sockets, no libevent, no
// core: the per-choice bookkeeping here (which choices are shown, where a stop sequence
// ends one) and the JSON helpers both APIs share are pure functions of these values
// (docs/router.md, "HTTP API (TGI-compatible)").
//
// Thread safety: plain values; the functions keep no state.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/tokenizer/incremental_decoder.h"
#include "common/tokenizer/tokenizer.h"
#include "common/wire/executor_codec.h"
#include "nlohmann/json_fwd.hpp"
#include "services/router/api.h"
#include "services/router/step_planner.h"

namespace kvcm::router {

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
  SamplingParams sampling;
  RequestOutputs outputs;
  int32_t truncate = 0;        // TGI: keep the prompt's last `truncate` tokens (0: all)
  int32_t best_of = 1;         // sequences generated (TGI's best_of; OpenAI's max(n, best_of))
  int32_t n = 1;               // OpenAI: choices returned
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
  bool chat = false;  // /v1/chat/completions (messages, deltas) rather than /v1/completions
  bool stream = false;
  bool as_list = false;        // POST / without streaming answers [reply], as TGI does
  bool include_usage = false;  // OpenAI: stream_options.include_usage
  int32_t shown = 1;           // choices returned (OpenAI's n; 1 for TGI)
  Params params;
  std::string prompt_text;
  std::vector<int32_t> prompt;  // its tokens (BOS first when the tokenizer adds one)
};

// What one generated sequence produced.
struct Choice {
  std::vector<int32_t> generated;
  std::vector<float> logprobs;  // with params.outputs.logprobs, per generated token
  std::vector<std::vector<std::pair<int32_t, float>>> top;  // with top_n
  // Its text a token at a time (streams and stop sequences), and that text so far: what
  // a stream has sent.
  IncrementalDecoder decoder;
  std::string text;
  bool done = false;
  std::string finish_reason;
  double sum_logprob = 0;  // for best_of
  // With finish_reason "stop_sequence": where in `text` the stop sequence that ended it
  // starts (OpenAI's text stops there).
  size_t stop_at = std::string::npos;
};

// A request while it runs: what it asked for and what its sequences produced so far.
struct Generation {
  Api api = Api::kTgi;
  bool stream = false;
  bool as_list = false;  // POST / without streaming answers [reply], as TGI does
  Params params;
  std::string prompt_text;
  std::vector<int32_t> prompt;         // its tokens, as submitted
  std::vector<float> prompt_logprobs;  // with params.outputs.prompt_logprobs
  // One per sequence generated (params.outputs.sequences: OpenAI's n or best_of, TGI's
  // best_of); `shown` of them are returned (OpenAI's n; 1 for TGI).
  std::vector<Choice> choices;
  int32_t shown = 1;
  // OpenAI:
  bool chat = false;  // /v1/chat/completions (messages, deltas) rather than /v1/completions
  std::string completion_id;
  int64_t created = 0;
  bool include_usage = false;
  size_t prompt_tokens = 0;
  int32_t cached_prompt_tokens = 0;
};

// A parsed request as it starts running: its choices not made yet, its prompt left in
// `parsed` (the caller submits it).
Generation GenerationOf(GenerationRequest parsed);

// The choices to return, in order: all of them, or with best_of the `shown` whose
// generated tokens have the highest log-probability in all (TGI's and OpenAI's rule).
std::vector<size_t> Shown(const Generation& g);
// Every choice, the highest total log-probability first (ties in choice order).
std::vector<size_t> BestFirst(const Generation& g);

// Where a stop sequence ending in the text `piece` adds to what `c` said before starts,
// counted in that text (c.text, then the piece); nullopt if none does. Only a match that
// ends in the new text counts: every earlier token was looked at already. As vLLM does,
// nothing is looked for while the request's first min_tokens tokens come out, and a
// sequence those tokens spelled never counts later (docs/router.md, "ignore_eos and
// min_tokens").
std::optional<size_t> StopSequenceSeen(const Generation& g, const Choice& c,
                                       const IncrementalDecoder::Piece& piece);

// One token's text ("" when it does not decode), and a choice's whole generated text.
std::string TokenText(const Tokenizer& tokenizer, int32_t id);
std::string TextOf(const Tokenizer& tokenizer, const Choice& c);

// JSON text; bytes that are not UTF-8 (a model may generate any byte) become U+FFFD, as
// Hugging Face's decode(errors="replace") does.
std::string Dump(const nlohmann::json& value);
// A log-probability as JSON: null when not computed (NaN), else finite (ShownLogprob:
// -inf reads as kMinLogprob, the number the OpenAPI document promises).
nlohmann::json Logprob(float value);
// One where the OpenAPI document types a number, never null: chat's logprob and
// top_logprobs, completions' top_logprobs maps. A NaN (an executor that sent one; kvcm's
// sampler reads a NaN logit as -inf) is written as -inf is, kMinLogprob.
nlohmann::json NumberLogprob(float value);

}  // namespace kvcm::router
