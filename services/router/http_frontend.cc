#include "services/router/http_frontend.h"

#include <event2/buffer.h>
#include <event2/event.h>
#include <event2/http.h>
#include <event2/keyvalq_struct.h>
#include <event2/thread.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <cstring>
#include <mutex>
#include <optional>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/base/log.h"
#include "common/tokenizer/incremental_decoder.h"
#include "common/base/mutex.h"
#include "common/base/utf8.h"
#include "common/base/monotonic_clock.h"
#include "nlohmann/json.hpp"
#include "prometheus/registry.h"
#include "prometheus/text_serializer.h"

namespace kvcm::router {
namespace {

using json = nlohmann::json;

constexpr char kComponent[] = "kvcm-router";
void Log(std::string_view text) { LogLine(kComponent, text); }

constexpr char kVersion[] = "0.1.0";

// A token's text as OpenAI's completions logprobs show it: the text; for a piece that is not
// UTF-8 on its own (part of a character), "bytes:\xNN..." as OpenAI writes those; for one
// that decodes to nothing (a special token), "token_id:N" as vLLM writes token ids. So no two
// tokens share a key of top_logprobs.
std::string OpenAiTokenText(int32_t id, const std::string& piece) {
  if (piece.empty()) return absl::StrCat("token_id:", id);
  if (IsValidUtf8(piece)) return piece;
  std::string out = "bytes:";
  for (unsigned char c : piece) absl::StrAppend(&out, "\\x", absl::Hex(c, absl::kZeroPad2));
  return out;
}

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
};

// JSON text; bytes that are not UTF-8 (a model may generate any byte) become U+FFFD, as
// Hugging Face's decode(errors="replace") does.
std::string Dump(const json& value) {
  return value.dump(-1, ' ', false, json::error_handler_t::replace);
}

enum class Api : uint8_t { kTgi, kOpenAi };

// An error, in the shape of the API it answers.
struct HttpError {
  int status = 422;
  std::string message;
  std::string type = "validation";
  std::string param = "";  // OpenAI: the offending parameter, if one
  Api api = Api::kTgi;
};

// OpenAI's error type for a status.
const char* OpenAiErrorType(int status) {
  switch (status) {
    case 429: return "rate_limit_error";
    case 503: return "service_unavailable";
    case 500: return "server_error";
    default: return "invalid_request_error";
  }
}

}  // namespace

struct HttpFrontend::Impl {
  Options options;
  const Tokenizer* tokenizer = nullptr;
  RouterCore* core = nullptr;
  RouterMetrics* metrics = nullptr;
  event_base* base = nullptr;
  evhttp* http = nullptr;
  event* mail = nullptr;
  event* stop = nullptr;

  Mutex mailbox_mutex;
  std::vector<Progress> mailbox ABSL_GUARDED_BY(mailbox_mutex);

  // What one generated sequence produced.
  struct Choice {
    std::vector<int32_t> generated;
    std::vector<float> logprobs;  // with params.outputs.logprobs, per generated token
    std::vector<std::vector<std::pair<int32_t, float>>> top;  // with top_n
    // Its text a token at a time (streams and stop sequences), and that text so far.
    IncrementalDecoder decoder;
    std::string text;
    size_t emitted = 0;  // bytes of its text already streamed
    bool done = false;
    std::string finish_reason;
    double sum_logprob = 0;  // for best_of
  };

  struct Active {
    evhttp_request* request = nullptr;  // null once the client is gone
    evhttp_connection* connection = nullptr;
    bool stream = false;
    bool as_list = false;  // POST / without streaming answers [reply], as TGI does
    Params params;
    std::string prompt_text;
    std::vector<int32_t> prompt;  // its tokens, as submitted
    std::vector<float> prompt_logprobs;  // with params.outputs.prompt_logprobs
    // One per sequence generated (params.outputs.sequences: OpenAI's n or best_of, TGI's
    // best_of); `shown` of them are returned (OpenAI's n; 1 for TGI).
    std::vector<Choice> choices;
    int32_t shown = 1;
    int32_t open = 0;  // choices not finished yet
    absl::Time arrived;
    absl::Time last_token;
    Api api = Api::kTgi;
    // OpenAI:
    bool chat = false;  // /v1/chat/completions (messages, deltas) rather than /v1/completions
    std::string completion_id;
    int64_t created = 0;
    bool include_usage = false;
    size_t prompt_tokens = 0;
    int32_t cached_prompt_tokens = 0;
  };

  void Count(Api api, RequestOutcome outcome) {
    if (metrics == nullptr) return;
    metrics->CountRequest(api == Api::kOpenAi ? RequestApi::kOpenAi : RequestApi::kTgi, outcome);
  }
  absl::flat_hash_map<uint64_t, Active> active;
  absl::flat_hash_map<evhttp_connection*, uint64_t> by_connection;
  uint64_t next_id = 1;
  uint64_t next_seed = 0x5eed;

  ~Impl() {
    if (mail != nullptr) event_free(mail);
    if (stop != nullptr) event_free(stop);
    if (http != nullptr) evhttp_free(http);
    if (base != nullptr) event_base_free(base);
  }

  static void Reply(evhttp_request* request, int status, const std::string& body,
                    const char* content_type = "application/json") {
    evkeyvalq* headers = evhttp_request_get_output_headers(request);
    evhttp_add_header(headers, "Content-Type", content_type);
    evbuffer* out = evbuffer_new();
    evbuffer_add(out, body.data(), body.size());
    const char* reason = status == 200   ? "OK"
                         : status == 400 ? "Bad Request"
                         : status == 404 ? "Not Found"
                         : status == 405 ? "Method Not Allowed"
                         : status == 422 ? "Unprocessable Entity"
                         : status == 429 ? "Too Many Requests"
                         : status == 501 ? "Not Implemented"
                         : status == 500 ? "Internal Server Error"
                         : status == 503 ? "Service Unavailable"
                                         : "Error";
    evhttp_send_reply(request, status, reason, out);
    evbuffer_free(out);
  }
  // A refusal of a generation request, counted.
  void Refuse(evhttp_request* request, const HttpError& error) {
    Count(error.api, error.status == 429   ? RequestOutcome::kOverloaded
                     : error.status == 503 ? RequestOutcome::kUnavailable
                                           : RequestOutcome::kInvalid);
    ReplyError(request, error);
  }
  static json ErrorBody(const HttpError& error) {
    if (error.api == Api::kOpenAi) {
      return {{"error",
               {{"message", error.message},
                {"type", OpenAiErrorType(error.status)},
                {"param", error.param.empty() ? json(nullptr) : json(error.param)},
                {"code", nullptr}}}};
    }
    return {{"error", error.message}, {"error_type", error.type}};
  }
  static void ReplyError(evhttp_request* request, const HttpError& error) {
    // OpenAI answers invalid requests with 400 (TGI with 422).
    const int status = error.api == Api::kOpenAi && error.status == 422 ? 400 : error.status;
    Reply(request, status, Dump(ErrorBody(error)));
  }

  std::string Body(evhttp_request* request) {
    evbuffer* in = evhttp_request_get_input_buffer(request);
    std::string body(evbuffer_get_length(in), '\0');
    evbuffer_copyout(in, body.data(), body.size());
    return body;
  }

  std::optional<HttpError> ParseParams(const json& root, Params* params) {
    params->max_new_tokens = options.default_max_new_tokens;
    if (!root.contains("parameters") || root["parameters"].is_null()) return std::nullopt;
    const json& p = root["parameters"];
    if (!p.is_object()) return HttpError{422, "`parameters` must be an object"};
    for (const auto& [key, value] : p.items()) {
      if (value.is_null()) continue;
      auto want_int = [&](int64_t lo, int64_t hi) -> std::optional<HttpError> {
        if (!value.is_number_integer() || value.get<int64_t>() < lo || value.get<int64_t>() > hi) {
          return HttpError{422, absl::StrCat("`", key, "` must be an integer in [", lo, ", ", hi,
                                             "]")};
        }
        return std::nullopt;
      };
      auto want_float = [&](double lo, double hi, bool open_lo) -> std::optional<HttpError> {
        if (!value.is_number() || value.get<double>() > hi ||
            (open_lo ? value.get<double>() <= lo : value.get<double>() < lo)) {
          return HttpError{422, absl::StrCat("`", key, "` must be a number in ",
                                             open_lo ? "(" : "[", lo, ", ", hi, "]")};
        }
        return std::nullopt;
      };
      std::optional<HttpError> bad;
      if (key == "max_new_tokens") {
        if (!(bad = want_int(1, options.max_total_tokens))) {
          params->max_new_tokens = value.get<int32_t>();
        }
      } else if (key == "do_sample") {
        if (!value.is_boolean()) bad = HttpError{422, "`do_sample` must be a boolean"};
        else params->do_sample = value.get<bool>();
      } else if (key == "temperature") {
        if (!(bad = want_float(0, 100, true))) params->sampling.temperature = value.get<float>();
      } else if (key == "top_p") {
        if (!(bad = want_float(0, 1, true))) params->sampling.top_p = value.get<float>();
      } else if (key == "top_k") {
        if (!(bad = want_int(1, 1 << 20))) params->sampling.top_k = value.get<int32_t>();
      } else if (key == "seed") {
        if (!value.is_number_unsigned()) bad = HttpError{422, "`seed` must be an unsigned integer"};
        else params->seed = value.get<uint64_t>();
      } else if (key == "details") {
        if (!value.is_boolean()) bad = HttpError{422, "`details` must be a boolean"};
        else params->details = value.get<bool>();
      } else if (key == "return_full_text") {
        if (!value.is_boolean()) bad = HttpError{422, "`return_full_text` must be a boolean"};
        else params->return_full_text = value.get<bool>();
      } else if (key == "repetition_penalty") {
        if (!(bad = want_float(0, 100, true))) {
          params->sampling.repetition_penalty = value.get<float>();
        }
      } else if (key == "frequency_penalty") {
        if (!(bad = want_float(-2, 2, false))) {
          params->sampling.frequency_penalty = value.get<float>();
        }
      } else if (key == "top_n_tokens") {
        if (!(bad = want_int(0, options.max_top_n_tokens))) {
          params->outputs.top_n = value.get<int32_t>();
        }
      } else if (key == "decoder_input_details") {
        if (!value.is_boolean()) bad = HttpError{422, "`decoder_input_details` must be a boolean"};
        else params->outputs.prompt_logprobs = value.get<bool>();
      } else if (key == "truncate") {
        if (!(bad = want_int(1, options.max_input_tokens))) params->truncate = value.get<int32_t>();
      } else if (key == "best_of") {
        if (!(bad = want_int(1, options.max_best_of))) params->best_of = value.get<int32_t>();
      } else if (key == "watermark" && value.is_boolean() && !value.get<bool>()) {
      } else if (key == "stop") {
        if (!value.is_array() || value.size() > 4) {
          bad = HttpError{422, "`stop` must be a list of at most 4 strings"};
        } else {
          for (const json& sequence : value) {
            if (!sequence.is_string() || sequence.get<std::string>().empty()) {
              bad = HttpError{422, "`stop` must be a list of non-empty strings"};
              break;
            }
            params->stop.push_back(sequence.get<std::string>());
          }
        }
      } else {
        // Never ignored silently: kvcm does not do this yet (or not with this value).
        bad = HttpError{422, absl::StrCat("parameter `", key, "` is not supported by this "
                                          "server (", Dump(value), ")")};
      }
      if (bad) return bad;
    }
    if (params->best_of > 1 && !params->do_sample) {
      return HttpError{422, "`best_of` > 1 needs sampling: set `do_sample` (greedy answers "
                            "would all be the same)"};
    }
    if (params->best_of > 1 && p.contains("seed") && !p["seed"].is_null()) {
      return HttpError{422, "`seed` must not be set when `best_of` > 1 (each sequence gets its "
                            "own, reported in details)"};
    }
    if (params->do_sample) {
      if (params->sampling.temperature == 0.0f) params->sampling.temperature = 1.0f;
      params->sampling.seed = p.contains("seed") && !p["seed"].is_null() ? params->seed
                                                                         : next_seed;
      // The request's sequences sample with seed, seed + 1, ...
      next_seed += static_cast<uint64_t>(params->best_of);
      params->seed = params->sampling.seed;
    } else {
      params->sampling = Greedy(params->sampling);
    }
    return std::nullopt;
  }

  // Greedy sampling that keeps `sampling`'s penalties (they apply to greedy choices too).
  static SeqSampling Greedy(const SeqSampling& sampling) {
    SeqSampling greedy;
    greedy.repetition_penalty = sampling.repetition_penalty;
    greedy.frequency_penalty = sampling.frequency_penalty;
    greedy.presence_penalty = sampling.presence_penalty;
    return greedy;
  }

  void HandleGenerate(evhttp_request* request, std::optional<bool> stream_path) {
    if (evhttp_request_get_command(request) != EVHTTP_REQ_POST) {
      return Refuse(request, {405, "use POST", "validation"});
    }
    const json root = json::parse(Body(request), nullptr, /*allow_exceptions=*/false);
    if (root.is_discarded() || !root.is_object()) {
      return Refuse(request, {400, "the body is not a JSON object", "validation"});
    }
    if (!root.contains("inputs") || !root["inputs"].is_string()) {
      return Refuse(request, {422, "`inputs` must be a string"});
    }
    bool stream = stream_path.value_or(false);
    if (!stream_path.has_value() && root.contains("stream")) {
      if (!root["stream"].is_boolean()) return Refuse(request, {422, "`stream` must be a boolean"});
      stream = root["stream"].get<bool>();
    }
    Params params;
    if (auto bad = ParseParams(root, &params)) return Refuse(request, *bad);
    if (stream && params.outputs.prompt_logprobs) {
      return Refuse(request, {422, "`decoder_input_details` == true is not supported when "
                                   "streaming tokens"});
    }
    if (stream && params.best_of > 1) {
      return Refuse(request, {422, "`best_of` > 1 is not supported when streaming tokens"});
    }
    // TGI reports every token's log-probability in details and in each streamed token;
    // best_of ranks its sequences by them.
    params.outputs.logprobs = params.details || stream || params.best_of > 1;
    params.outputs.sequences = params.best_of;
    const std::string text = root["inputs"].get<std::string>();
    absl::StatusOr<std::vector<int32_t>> prompt = PromptOf(text);
    if (!prompt.ok()) return Refuse(request, {422, std::string(prompt.status().message())});
    if (params.truncate > 0 && prompt->size() > static_cast<size_t>(params.truncate)) {
      prompt->erase(prompt->begin(), prompt->end() - params.truncate);  // keeps the last ones
    }
    Active a;
    a.stream = stream;
    a.as_list = !stream_path.has_value() && !stream;
    a.params = params;
    a.prompt_text = text;
    Start(request, std::move(a), *std::move(prompt));
  }

  // BOS (when the tokenizer's model wants one), then the tokenizer's ids.
  absl::StatusOr<std::vector<int32_t>> PromptOf(const std::string& text) const {
    absl::StatusOr<std::vector<int32_t>> encoded = tokenizer->Encode(text);
    if (!encoded.ok()) return encoded.status();
    std::vector<int32_t> prompt;
    if (tokenizer->add_bos() && tokenizer->bos_id() >= 0) prompt.push_back(tokenizer->bos_id());
    prompt.insert(prompt.end(), encoded->begin(), encoded->end());
    return prompt;
  }

  // The checks every API shares; then the request is registered and handed to the core.
  void Start(evhttp_request* request, Active a, std::vector<int32_t> prompt) {
    const Api api = a.api;
    auto refuse = [&](HttpError error) {
      error.api = api;
      Refuse(request, error);
    };
    if (static_cast<int32_t>(prompt.size()) > options.max_input_tokens) {
      return refuse({422, absl::StrCat("the prompt must have less than ", options.max_input_tokens,
                                       " tokens. Given: ", prompt.size())});
    }
    if (static_cast<int64_t>(prompt.size()) + a.params.max_new_tokens > options.max_total_tokens) {
      return refuse({422, absl::StrCat("prompt tokens + new tokens must be <= ",
                                       options.max_total_tokens, ". Given: ", prompt.size(),
                                       " prompt tokens and ", a.params.max_new_tokens,
                                       " new tokens")});
    }
    if (static_cast<int32_t>(active.size()) >= options.max_concurrent_requests) {
      return refuse({429, "Model is overloaded", "overloaded"});
    }
    if (core->draining()) return refuse({503, "the router is shutting down", "unavailable"});
    if (core->live_executors() == 0) {
      return refuse({503, "no executor is registered with the router yet", "unavailable"});
    }
    const uint64_t id = next_id++;
    a.request = request;
    a.connection = evhttp_request_get_connection(request);
    a.arrived = MonotonicNow();
    a.prompt_tokens = prompt.size();
    a.prompt = prompt;
    a.choices.assign(static_cast<size_t>(a.params.outputs.sequences), Choice{});
    a.open = a.params.outputs.sequences;
    by_connection[a.connection] = id;
    evhttp_connection_set_closecb(a.connection, &Impl::OnClose, this);
    if (a.stream) {
      evkeyvalq* headers = evhttp_request_get_output_headers(request);
      evhttp_add_header(headers, "Content-Type", "text/event-stream");
      evhttp_add_header(headers, "Cache-Control", "no-cache");
      evhttp_send_reply_start(request, 200, "OK");
      if (a.chat) {  // OpenAI's first chunk of each choice names the role
        for (int32_t k = 0; k < a.shown; ++k) {
          json choice = OpenAiChoice(a, static_cast<size_t>(k), "", nullptr);
          choice["delta"] = {{"role", "assistant"}, {"content", ""}};
          SendEvent(request, Dump(OpenAiChunk(a, json::array({std::move(choice)}))), Api::kOpenAi);
        }
      }
    }
    Submission submission;
    submission.id = id;
    submission.prompt = std::move(prompt);
    submission.max_new_tokens = a.params.max_new_tokens;
    submission.sampling = a.params.sampling;
    submission.outputs = a.params.outputs;
    submission.api = a.api == Api::kOpenAi ? RequestApi::kOpenAi : RequestApi::kTgi;
    active.emplace(id, std::move(a));
    core->Submit(std::move(submission));
  }

  // The sampling and length parameters the OpenAI completions and chat completions APIs
  // share: nullopt when `key` is one and `value` is fine (applied to `a`, or to `seed`), an
  // error to answer when it is one and its value is wrong, and an error of status 0 when
  // `key` is not one of them.
  std::optional<HttpError> OpenAiParam(const std::string& key, const json& value,
                                       Active* active_request,
                                       std::optional<uint64_t>* seed_out) const {
    Active& a = *active_request;
    std::optional<uint64_t>& seed = *seed_out;
    const bool chat = a.chat;
    auto fail = [&](int status, std::string message, std::string param = "") {
      return std::optional<HttpError>(
          HttpError{status, std::move(message), "validation", std::move(param), Api::kOpenAi});
    };
    if (key == "max_tokens" || (chat && key == "max_completion_tokens")) {
      if (!value.is_number_integer() || value.get<int64_t>() < 1 ||
          value.get<int64_t>() > options.max_total_tokens) {
        return fail(422, absl::StrCat("`", key, "` must be an integer in [1, ",
                                      options.max_total_tokens, "]"), key);
      }
      a.params.max_new_tokens = value.get<int32_t>();
    } else if (key == "temperature") {
      if (!value.is_number() || value.get<double>() < 0 || value.get<double>() > 2) {
        return fail(422, "`temperature` must be a number in [0, 2]", key);
      }
      a.params.sampling.temperature = value.get<float>();
    } else if (key == "top_p") {
      if (!value.is_number() || value.get<double>() <= 0 || value.get<double>() > 1) {
        return fail(422, "`top_p` must be a number in (0, 1]", key);
      }
      a.params.sampling.top_p = value.get<float>();
    } else if (key == "seed") {
      if (!value.is_null()) {
        if (!value.is_number_unsigned()) {
          return fail(422, "`seed` must be an unsigned integer", key);
        }
        seed = value.get<uint64_t>();
      }
    } else if (key == "stream") {
      if (!value.is_boolean()) return fail(422, "`stream` must be a boolean", key);
      a.stream = value.get<bool>();
    } else if (key == "stream_options") {
      if (!value.is_null()) {
        if (!value.is_object()) return fail(422, "`stream_options` must be an object", key);
        for (const auto& [option, flag] : value.items()) {
          if (option != "include_usage" || !flag.is_boolean()) {
            return fail(422, absl::StrCat("stream_options.", option, " is not supported"), key);
          }
          a.include_usage = flag.get<bool>();
        }
      }
    } else if (key == "stop") {
      if (value.is_string()) {
        a.params.stop = {value.get<std::string>()};
      } else if (value.is_array() && value.size() <= 4 &&
                 std::all_of(value.begin(), value.end(),
                             [](const json& x) { return x.is_string(); })) {
        for (const json& x : value) a.params.stop.push_back(x.get<std::string>());
      } else if (!value.is_null()) {
        return fail(422, "`stop` must be a string or a list of at most 4 strings", key);
      }
      std::erase_if(a.params.stop, [](const std::string& x) { return x.empty(); });
    } else if (key == "n" || key == "best_of") {
      if (!value.is_null()) {
        if (!value.is_number_integer() || value.get<int64_t>() < 1 ||
            value.get<int64_t>() > options.max_best_of) {
          return fail(422, absl::StrCat("`", key, "` must be an integer in [1, ",
                                        options.max_best_of, "] (--max-best-of)"), key);
        }
        (key == "n" ? a.params.n : a.params.best_of) = value.get<int32_t>();
      }
    } else if (key == "frequency_penalty" || key == "presence_penalty") {
      if (!value.is_null()) {
        if (!value.is_number() || value.get<double>() < -2 || value.get<double>() > 2) {
          return fail(422, absl::StrCat("`", key, "` must be a number in [-2, 2]"), key);
        }
        (key == "frequency_penalty" ? a.params.sampling.frequency_penalty
                                    : a.params.sampling.presence_penalty) = value.get<float>();
      }
    } else if (key == "repetition_penalty") {  // vLLM's extension
      if (!value.is_null()) {
        if (!value.is_number() || value.get<double>() <= 0 || value.get<double>() > 100) {
          return fail(422, "`repetition_penalty` must be a number in (0, 100]", key);
        }
        a.params.sampling.repetition_penalty = value.get<float>();
      }
    } else if (key == "top_k") {  // vLLM's extension; -1 or 0: all tokens
      if (!value.is_null()) {
        if (!value.is_number_integer() || value.get<int64_t>() < -1 ||
            value.get<int64_t>() > (1 << 20)) {
          return fail(422, "`top_k` must be an integer >= -1 (-1: all tokens)", key);
        }
        a.params.sampling.top_k = std::max<int32_t>(0, value.get<int32_t>());
      }
    } else if (key == "model" || key == "user") {
      if (!value.is_string() && !value.is_null()) return fail(422, "must be a string", key);
    } else {
      return HttpError{0, "", "", "", Api::kOpenAi};
    }
    return std::nullopt;
  }

  // Sampling as OpenAI's parameters chose it (temperature 0: greedy), n and best_of.
  std::optional<HttpError> FinishOpenAiParams(Active* active_request,
                                              std::optional<uint64_t> seed) {
    Active& a = *active_request;
    if (a.params.sampling.temperature > 0) {
      a.params.do_sample = true;
      a.params.seed = seed.value_or(next_seed++);
      a.params.sampling.seed = a.params.seed;
    } else {
      a.params.sampling = Greedy(a.params.sampling);
    }
    if (a.params.best_of > 1 && a.params.best_of < a.params.n) {
      return HttpError{422, "`best_of` must be at least `n`", "validation", "best_of", Api::kOpenAi};
    }
    const int32_t sequences = std::max(a.params.n, a.params.best_of);
    if (sequences > a.params.n && a.stream) {
      return HttpError{422, "`best_of` > `n` is not supported when streaming", "validation",
                       "best_of", Api::kOpenAi};
    }
    a.params.outputs.sequences = sequences;
    a.shown = a.params.n;
    // best_of ranks its sequences by their log-probabilities.
    a.params.outputs.logprobs = a.params.show_logprobs || sequences > a.params.n;
    a.created = absl::ToUnixSeconds(absl::Now());
    return std::nullopt;
  }

  // POST /v1/completions (OpenAI): one prompt (a string, or token ids), one choice.
  void HandleCompletions(evhttp_request* request) {
    auto refuse = [&](int status, std::string message, std::string param = "") {
      Refuse(request, {status, std::move(message), "validation", std::move(param), Api::kOpenAi});
    };
    if (evhttp_request_get_command(request) != EVHTTP_REQ_POST) return refuse(405, "use POST");
    const json root = json::parse(Body(request), nullptr, /*allow_exceptions=*/false);
    if (root.is_discarded() || !root.is_object()) {
      return refuse(400, "the body is not a JSON object");
    }
    Active a;
    a.api = Api::kOpenAi;
    a.params.max_new_tokens = 16;  // OpenAI's default
    a.params.sampling.temperature = 1.0f;
    std::vector<int32_t> prompt;
    bool have_prompt = false;
    std::optional<uint64_t> seed;
    for (const auto& [key, value] : root.items()) {
      if (key == "prompt") {
        json one = value;
        if (value.is_array() && value.size() == 1 && (value[0].is_string() || value[0].is_array())) {
          one = value[0];
        }
        if (one.is_string()) {
          absl::StatusOr<std::vector<int32_t>> ids = PromptOf(one.get<std::string>());
          if (!ids.ok()) return refuse(422, std::string(ids.status().message()), "prompt");
          prompt = *std::move(ids);
          a.prompt_text = one.get<std::string>();
        } else if (one.is_array() && !one.empty() &&
                   std::all_of(one.begin(), one.end(),
                               [](const json& t) { return t.is_number_integer(); })) {
          for (const json& t : one) {
            const int64_t id = t.get<int64_t>();
            if (id < 0 || id >= tokenizer->vocab_size()) {
              return refuse(422, absl::StrCat("token id ", id, " is outside [0, ",
                                              tokenizer->vocab_size(), ")"), "prompt");
            }
            prompt.push_back(static_cast<int32_t>(id));
          }
          absl::StatusOr<std::string> text = tokenizer->Decode(prompt);
          a.prompt_text = text.ok() ? *text : "";
        } else {
          return refuse(422, "`prompt` must be a string, a list of token ids, or a list of one "
                        "of those (several prompts in one request are not supported)", "prompt");
        }
        have_prompt = true;
      } else if (std::optional<HttpError> bad = OpenAiParam(key, value, &a, &seed);
                 !bad.has_value()) {
      } else if (bad->status != 0) {
        return Refuse(request, *bad);
      } else if (key == "echo") {
        if (!value.is_boolean()) return refuse(422, "`echo` must be a boolean", key);
        a.params.return_full_text = value.get<bool>();
      } else if (key == "logprobs") {
        if (!value.is_null()) {
          if (!value.is_number_integer() || value.get<int64_t>() < 0 ||
              value.get<int64_t>() > options.max_top_n_tokens) {
            return refuse(422, absl::StrCat("`logprobs` must be an integer in [0, ",
                                            options.max_top_n_tokens, "]"), key);
          }
          a.params.show_logprobs = true;
          a.params.outputs.top_n = value.get<int32_t>();
        }
      } else if ((key == "suffix" || key == "logit_bias") && value.is_null()) {
      } else {
        return refuse(422, absl::StrCat("parameter `", key, "` is not supported by this server (",
                                        Dump(value), ")"), key);
      }
    }
    if (!have_prompt) return refuse(422, "`prompt` is required", "prompt");
    if (std::optional<HttpError> bad = FinishOpenAiParams(&a, seed)) return Refuse(request, *bad);
    // With echo, the prompt's tokens come first in logprobs, scored.
    a.params.outputs.prompt_logprobs = a.params.show_logprobs && a.params.return_full_text;
    a.completion_id = absl::StrCat("cmpl-", next_id);
    Start(request, std::move(a), std::move(prompt));
  }

  // POST /v1/chat/completions (OpenAI): `messages` rendered with the model's chat template
  // (add_generation_prompt), tokenized as transformers' apply_chat_template(tokenize=True)
  // does (no BOS added: the template writes what the model wants).
  void HandleChatCompletions(evhttp_request* request) {
    auto refuse = [&](int status, std::string message, std::string param = "") {
      Refuse(request, {status, std::move(message), "validation", std::move(param), Api::kOpenAi});
    };
    if (evhttp_request_get_command(request) != EVHTTP_REQ_POST) return refuse(405, "use POST");
    if (options.chat_template == nullptr) {
      return refuse(501, "this model has no usable chat template: start the router with "
                    "--chat-template FILE, or use /v1/completions");
    }
    const json root = json::parse(Body(request), nullptr, /*allow_exceptions=*/false);
    if (root.is_discarded() || !root.is_object()) {
      return refuse(400, "the body is not a JSON object");
    }
    Active a;
    a.api = Api::kOpenAi;
    a.chat = true;
    a.params.max_new_tokens = options.default_max_new_tokens;
    a.params.sampling.temperature = 1.0f;
    std::vector<ChatMessage> messages;
    bool have_messages = false;
    std::optional<uint64_t> seed;
    for (const auto& [key, value] : root.items()) {
      if (key == "messages") {
        if (!value.is_array() || value.empty()) {
          return refuse(422, "`messages` must be a non-empty list of messages", key);
        }
        for (size_t i = 0; i < value.size(); ++i) {
          const json& m = value[i];
          const std::string where = absl::StrCat("messages[", i, "]");
          if (!m.is_object() || !m.contains("role") || !m["role"].is_string()) {
            return refuse(422, absl::StrCat(where, " must be an object with a string `role`"), key);
          }
          ChatMessage message;
          message.role = m["role"].get<std::string>();
          json extra = json::object();
          for (const auto& [field, content] : m.items()) {
            if (field == "role") continue;
            if (field != "content") {
              if (!content.is_null()) extra[field] = content;
              continue;
            }
            if (content.is_string()) {
              message.content = content.get<std::string>();
            } else if (content.is_array()) {
              // Content parts: only text ones, joined as vLLM joins them.
              for (const json& part : content) {
                if (!part.is_object() || part.value("type", "") != "text" ||
                    !part.contains("text") || !part["text"].is_string()) {
                  return refuse(422, absl::StrCat(where, ".content: only parts of type \"text\" "
                                                  "are supported"), key);
                }
                if (!message.content.empty()) message.content += "\n";
                message.content += part["text"].get<std::string>();
              }
            } else if (!content.is_null()) {
              return refuse(422, absl::StrCat(where, ".content must be a string or a list of "
                                              "text parts"), key);
            }
          }
          if (!extra.empty()) message.extra_json = extra.dump();
          messages.push_back(std::move(message));
        }
        have_messages = true;
      } else if (std::optional<HttpError> bad = OpenAiParam(key, value, &a, &seed);
                 !bad.has_value()) {
      } else if (bad->status != 0) {
        return Refuse(request, *bad);
      } else if (key == "logprobs") {
        if (!value.is_null()) {
          if (!value.is_boolean()) return refuse(422, "`logprobs` must be a boolean", key);
          a.params.show_logprobs = value.get<bool>();
        }
      } else if (key == "top_logprobs") {
        if (!value.is_null()) {
          if (!value.is_number_integer() || value.get<int64_t>() < 0 ||
              value.get<int64_t>() > options.max_top_n_tokens) {
            return refuse(422, absl::StrCat("`top_logprobs` must be an integer in [0, ",
                                            options.max_top_n_tokens, "]"), key);
          }
          a.params.outputs.top_n = value.get<int32_t>();
        }
      } else if ((key == "logit_bias" || key == "tools" || key == "tool_choice" ||
                  key == "response_format" || key == "parallel_tool_calls") &&
                 value.is_null()) {
      } else {
        return refuse(422, absl::StrCat("parameter `", key, "` is not supported by this server (",
                                        Dump(value), ")"), key);
      }
    }
    if (!have_messages) return refuse(422, "`messages` is required", "messages");
    if (a.params.outputs.top_n > 0 && !a.params.show_logprobs) {
      return refuse(422, "`top_logprobs` needs `logprobs`: true", "top_logprobs");
    }
    if (!a.params.show_logprobs) a.params.outputs.top_n = 0;
    if (std::optional<HttpError> bad = FinishOpenAiParams(&a, seed)) return Refuse(request, *bad);
    ChatTemplateOptions render;
    render.add_generation_prompt = true;
    render.bos_token = options.bos_token;
    render.eos_token = options.eos_token;
    absl::StatusOr<std::string> text = options.chat_template->Render(messages, render);
    if (!text.ok()) {
      // The template's own raise_exception (roles out of order, ...) is the client's error.
      return refuse(400, absl::StrCat("the chat template refused the messages: ",
                                      text.status().message()), "messages");
    }
    absl::StatusOr<std::vector<int32_t>> prompt = tokenizer->Encode(*text);
    if (!prompt.ok()) return refuse(422, std::string(prompt.status().message()), "messages");
    if (prompt->empty()) return refuse(422, "the chat template rendered nothing", "messages");
    a.prompt_text = *std::move(text);
    a.completion_id = absl::StrCat("chatcmpl-", next_id);
    Start(request, std::move(a), *std::move(prompt));
  }

  void HandleModels(evhttp_request* request) {
    const json models = {{"object", "list"},
                         {"data", json::array({{{"id", options.model_id},
                                                {"object", "model"},
                                                {"created", 0},
                                                {"owned_by", "kvcm"}}})}};
    Reply(request, 200, Dump(models));
  }

  static std::string OpenAiFinishReason(const std::string& tgi) {
    return tgi == "length" ? "length" : "stop";
  }

  json OpenAiUsage(const Active& a) const {
    size_t completion = 0;
    for (const Choice& c : a.choices) completion += c.generated.size();
    return {{"prompt_tokens", a.prompt_tokens},
            {"completion_tokens", completion},
            {"total_tokens", a.prompt_tokens + completion},
            {"prompt_tokens_details", {{"cached_tokens", a.cached_prompt_tokens}}}};
  }

  json OpenAiChunk(const Active& a, json choices) const {
    return {{"id", a.completion_id},
            {"object", !a.chat ? "text_completion"
                       : a.stream ? "chat.completion.chunk"
                                  : "chat.completion"},
            {"created", a.created},
            {"model", options.model_id},
            {"choices", std::move(choices)}};
  }
  // A choice: completions' {"text"}; chat's {"message"} in a reply and {"delta"} in a stream.
  static json OpenAiChoice(const Active& a, size_t index, const std::string& text,
                           const json& finish_reason) {
    json choice = {{"index", index}, {"logprobs", nullptr}, {"finish_reason", finish_reason}};
    if (!a.chat) {
      choice["text"] = text;
    } else if (a.stream) {
      choice["delta"] = text.empty() ? json::object() : json({{"content", text}});
    } else {
      choice["message"] = {{"role", "assistant"}, {"content", text}};
    }
    return choice;
  }

  // Chat's logprobs of generated tokens [from, to): {"content": [{token, logprob, bytes,
  // top_logprobs: [{token, logprob, bytes}]}]}.
  json ChatLogprobs(const Choice& c, size_t from, size_t to) const {
    auto entry = [&](int32_t id, float logprob) {
      const std::string text = TokenText(id);
      json bytes = json::array();
      for (unsigned char b : text) bytes.push_back(b);
      return json({{"token", OpenAiTokenText(id, text)}, {"logprob", logprob}, {"bytes", bytes}});
    };
    json content = json::array();
    for (size_t i = from; i < to && i < c.generated.size(); ++i) {
      json e = entry(c.generated[i], i < c.logprobs.size() ? c.logprobs[i] : 0.0f);
      json top = json::array();
      if (i < c.top.size()) {
        for (const auto& [id, logprob] : c.top[i]) top.push_back(entry(id, logprob));
      }
      e["top_logprobs"] = std::move(top);
      content.push_back(std::move(e));
    }
    return {{"content", content}};
  }

  static void OnClose(evhttp_connection* connection, void* arg) {
    auto* self = static_cast<Impl*>(arg);
    auto it = self->by_connection.find(connection);
    if (it == self->by_connection.end()) return;
    const uint64_t id = it->second;
    self->by_connection.erase(it);
    if (auto a = self->active.find(id); a != self->active.end()) {
      const Api api = a->second.api;
      self->active.erase(a);  // libevent frees the request with the connection
      self->core->Cancel(id);
      self->Count(api, RequestOutcome::kCancelled);
      Log(absl::StrCat("request ", id, ": the client went away; cancelled"));
    }
  }

  std::string TokenText(int32_t id) const {
    const int32_t one[] = {id};
    absl::StatusOr<std::string> piece = tokenizer->Decode(one);
    return piece.ok() ? *piece : "";
  }
  bool Special(int32_t id) const { return tokenizer->IsSpecial(id); }
  // A log-probability as JSON: null when not computed (NaN).
  static json Logprob(float value) { return std::isnan(value) ? json(nullptr) : json(value); }

  // TGI's token object; `logprob` null when it was not asked for.
  json TgiToken(int32_t id, float logprob, const std::string& text) const {
    return {{"id", id}, {"text", text}, {"logprob", Logprob(logprob)}, {"special", Special(id)}};
  }
  json TgiTopTokens(const std::vector<std::pair<int32_t, float>>& top) const {
    json out = json::array();
    for (const auto& [id, logprob] : top) out.push_back(TgiToken(id, logprob, TokenText(id)));
    return out;
  }

  json Details(const Active& a, const Choice& c, bool with_prefill = true) const {
    constexpr float kNone = std::numeric_limits<float>::quiet_NaN();
    json tokens = json::array();
    for (size_t i = 0; i < c.generated.size(); ++i) {
      const int32_t id = c.generated[i];
      tokens.push_back(TgiToken(id, i < c.logprobs.size() ? c.logprobs[i] : kNone, TokenText(id)));
    }
    json prefill = json::array();
    if (with_prefill && a.params.outputs.prompt_logprobs) {
      for (size_t i = 0; i < a.prompt.size(); ++i) {
        const float logprob = i < a.prompt_logprobs.size() ? a.prompt_logprobs[i] : kNone;
        prefill.push_back({{"id", a.prompt[i]},
                           {"text", TokenText(a.prompt[i])},
                           {"logprob", Logprob(logprob)}});
      }
    }
    const size_t index = static_cast<size_t>(&c - a.choices.data());
    json details = {{"finish_reason", c.finish_reason},
                    {"generated_tokens", c.generated.size()},
                    {"seed", a.params.do_sample ? json(a.params.seed + index) : json(nullptr)},
                    {"prefill", prefill},
                    {"tokens", tokens}};
    if (a.params.outputs.top_n > 0) {
      json top = json::array();
      for (const auto& alternatives : c.top) top.push_back(TgiTopTokens(alternatives));
      details["top_tokens"] = top;
    }
    return details;
  }

  // OpenAI's completion logprobs: tokens, token_logprobs, top_logprobs, text_offset; the
  // echoed prompt's first (its first token unscored), then generated tokens [from, to).
  json OpenAiLogprobs(const Active& a, const Choice& c, bool with_prompt, size_t from,
                      size_t to, size_t offset) const {
    json tokens = json::array(), token_logprobs = json::array(), top = json::array(),
         offsets = json::array();
    auto add = [&](int32_t id, float logprob, const json& alternatives) {
      const std::string text = TokenText(id);
      tokens.push_back(OpenAiTokenText(id, text));
      token_logprobs.push_back(Logprob(logprob));
      top.push_back(alternatives);
      offsets.push_back(offset);
      offset += text.size();
    };
    if (with_prompt) {
      for (size_t i = 0; i < a.prompt.size(); ++i) {
        const float logprob = i < a.prompt_logprobs.size() ? a.prompt_logprobs[i]
                                                           : std::numeric_limits<float>::quiet_NaN();
        add(a.prompt[i], logprob,
            std::isnan(logprob) ? json(nullptr)
                                : json({{OpenAiTokenText(a.prompt[i], TokenText(a.prompt[i])), logprob}}));
      }
    }
    for (size_t i = from; i < to && i < c.generated.size(); ++i) {
      json alternatives = json::object();
      if (i < c.top.size()) {
        for (const auto& [id, logprob] : c.top[i]) {
          alternatives[OpenAiTokenText(id, TokenText(id))] = logprob;
        }
      }
      add(c.generated[i], i < c.logprobs.size() ? c.logprobs[i] : 0.0f, alternatives);
    }
    return {{"tokens", tokens},
            {"token_logprobs", token_logprobs},
            {"top_logprobs", top},
            {"text_offset", offsets}};
  }

  std::string TextOf(const Choice& c) const {
    absl::StatusOr<std::string> decoded = tokenizer->Decode(c.generated);
    return decoded.ok() ? *decoded : "";
  }

  // The choices to return, in order: all of them, or with best_of the `shown` whose
  // generated tokens have the highest log-probability in all (TGI's and OpenAI's rule).
  static std::vector<size_t> Shown(const Active& a) {
    std::vector<size_t> order = InOrder(a);
    if (static_cast<int32_t>(order.size()) > a.shown) {
      order = BestFirst(a);
      order.resize(static_cast<size_t>(a.shown));
    }
    return order;
  }
  static std::vector<size_t> InOrder(const Active& a) {
    std::vector<size_t> order(a.choices.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    return order;
  }
  // Every choice, the highest total log-probability first (ties in choice order).
  static std::vector<size_t> BestFirst(const Active& a) {
    std::vector<size_t> order = InOrder(a);
    std::stable_sort(order.begin(), order.end(), [&](size_t x, size_t y) {
      return a.choices[x].sum_logprob > a.choices[y].sum_logprob;
    });
    return order;
  }

  // The request's reply once every choice is done (or it failed with `error`).
  void Finish(uint64_t id, Active& a, const absl::Status& error) {
    if (a.request != nullptr) {
      by_connection.erase(a.connection);
      evhttp_connection_set_closecb(a.connection, nullptr, nullptr);
      if (!error.ok()) {
        const int status = absl::IsResourceExhausted(error) ? 422 : 503;
        const json body = ErrorBody({status, std::string(error.message()),
                                     status == 422 ? "validation" : "unavailable", "", a.api});
        if (a.stream) {
          SendEvent(a.request, Dump(body), a.api);
          evhttp_send_reply_end(a.request);
        } else {
          Reply(a.request, status, Dump(body));
        }
      } else if (a.stream) {
        if (a.api == Api::kOpenAi) {
          if (a.include_usage) {
            json usage = OpenAiChunk(a, json::array());
            usage["usage"] = OpenAiUsage(a);
            SendEvent(a.request, Dump(usage), Api::kOpenAi);
          }
          SendEvent(a.request, "[DONE]", Api::kOpenAi);
        }
        evhttp_send_reply_end(a.request);
      } else if (a.api == Api::kOpenAi) {
        json choices = json::array();
        const std::vector<size_t> shown = Shown(a);
        for (size_t k = 0; k < shown.size(); ++k) {
          const Choice& c = a.choices[shown[k]];
          std::string text = TextOf(c);
          // OpenAI's text stops before the stop sequence (TGI's keeps it).
          if (c.finish_reason == "stop_sequence") {
            size_t cut = text.size();
            for (const std::string& sequence : a.params.stop) {
              cut = std::min(cut, text.find(sequence));
            }
            text.resize(cut);
          }
          json choice = OpenAiChoice(a, k,
                                     a.params.return_full_text ? a.prompt_text + text : text,
                                     OpenAiFinishReason(c.finish_reason));
          if (a.params.show_logprobs) {
            choice["logprobs"] =
                a.chat ? ChatLogprobs(c, 0, c.generated.size())
                       : OpenAiLogprobs(a, c, a.params.return_full_text, 0, c.generated.size(), 0);
          }
          choices.push_back(std::move(choice));
        }
        json body = OpenAiChunk(a, std::move(choices));
        body["usage"] = OpenAiUsage(a);
        Reply(a.request, 200, Dump(body));
      } else {
        const std::vector<size_t> order = BestFirst(a);
        const Choice& best = a.choices[order.front()];
        const std::string text = TextOf(best);
        json body = {{"generated_text", a.params.return_full_text ? a.prompt_text + text : text}};
        if (a.params.details) {
          body["details"] = Details(a, best);
          if (a.choices.size() > 1) {  // TGI's best_of: the others, best first
            json others = json::array();
            for (size_t k = 1; k < order.size(); ++k) {
              const Choice& c = a.choices[order[k]];
              json other = Details(a, c, /*with_prefill=*/false);
              const std::string other_text = TextOf(c);
              other["generated_text"] =
                  a.params.return_full_text ? a.prompt_text + other_text : other_text;
              others.push_back(std::move(other));
            }
            body["details"]["best_of_sequences"] = std::move(others);
          }
        }
        Reply(a.request, 200, Dump(a.as_list ? json::array({body}) : body));
      }
    }
    active.erase(id);
  }

  // Whether the text `c` generated so far contains a stop sequence; if so, its tokens end
  // with the one that completed it.
  // Whether a stop sequence ends in the text `piece` adds to what `c` said before (every
  // earlier token was looked at already, so a match can only end in the new text).
  static bool StopSequenceSeen(const Active& a, const Choice& c,
                               const IncrementalDecoder::Piece& piece) {
    if (a.params.stop.empty()) return false;
    size_t longest = 0;
    for (const std::string& sequence : a.params.stop) longest = std::max(longest, sequence.size());
    const size_t keep = std::min(c.text.size(), longest > 0 ? longest - 1 : 0);
    const std::string tail = c.text.substr(c.text.size() - keep) + piece.ready + piece.pending;
    for (const std::string& sequence : a.params.stop) {
      if (tail.find(sequence) != std::string::npos) return true;
    }
    return false;
  }

  // One server-sent event: "data:" as TGI writes it, "data: " as OpenAI does.
  static void SendEvent(evhttp_request* request, const std::string& data,
                        Api api = Api::kTgi) {
    evbuffer* out = evbuffer_new();
    evbuffer_add_printf(out, api == Api::kOpenAi ? "data: %s\n\n" : "data:%s\n\n", data.c_str());
    evhttp_send_reply_chunk(request, out);
    evbuffer_free(out);
  }

  // Streams choice `index`'s newest token; `finished` with its finish reason.
  // `piece`: the text the token adds (never a broken UTF-8 sequence until the end: what is
  // incomplete waits for the next token).
  void Stream(Active& a, size_t index, const Progress& p, bool finished,
              const std::string& piece) {
    Choice& c = a.choices[index];
    c.emitted += piece.size();
    if (a.api == Api::kOpenAi) {
      const bool first_chunk = c.generated.size() == 1;
      const std::string first = first_chunk && a.params.return_full_text ? a.prompt_text : "";
      json choice = OpenAiChoice(a, index, first + piece,
                                 finished ? json(OpenAiFinishReason(c.finish_reason))
                                          : json(nullptr));
      if (a.params.show_logprobs && a.chat) {
        choice["logprobs"] = ChatLogprobs(c, c.generated.size() - 1, c.generated.size());
      } else if (a.params.show_logprobs) {
        const size_t last = c.generated.size() - 1;
        const size_t offset = first_chunk ? 0
                                          : (a.params.return_full_text ? a.prompt_text.size() : 0) +
                                                c.emitted - piece.size();
        choice["logprobs"] = OpenAiLogprobs(a, c, first_chunk && a.params.return_full_text,
                                            last, last + 1, offset);
      }
      SendEvent(a.request, Dump(OpenAiChunk(a, json::array({std::move(choice)}))), Api::kOpenAi);
      return;
    }
    json event = {{"index", c.generated.size() - 1},
                  {"token", TgiToken(p.token, p.logprob, piece)},
                  {"generated_text", nullptr},
                  {"details", nullptr}};
    if (a.params.outputs.top_n > 0) event["top_tokens"] = TgiTopTokens(c.top.back());
    if (finished) {
      const std::string all = TextOf(c);
      event["generated_text"] = a.params.return_full_text ? a.prompt_text + all : all;
      event["details"] = {{"finish_reason", c.finish_reason},
                          {"generated_tokens", c.generated.size()},
                          {"seed", a.params.do_sample ? json(a.params.seed) : json(nullptr)}};
    }
    SendEvent(a.request, Dump(event));
  }

  static void OnMail(evutil_socket_t, short, void* arg) {
    try {
      static_cast<Impl*>(arg)->DeliverMail();
    } catch (const std::exception& error) {
      Log(absl::StrCat("delivering tokens: ", error.what()));
    }
  }

  void DeliverMail() {
    std::vector<Progress> batch;
    {
      MutexLock lock(&mailbox_mutex);
      batch.swap(mailbox);
    }
    for (const Progress& p : batch) {
      auto it = active.find(p.id);
      if (it == active.end()) continue;
      Active& a = it->second;
      if (!p.error.ok()) {  // the whole request failed
        Done(p.id, a, p.error);
        continue;
      }
      if (p.choice < 0 || static_cast<size_t>(p.choice) >= a.choices.size()) continue;
      const auto index = static_cast<size_t>(p.choice);
      Choice& c = a.choices[index];
      if (c.done) continue;  // a token still in flight after a stop sequence
      bool finished = p.finished;
      if (p.token >= 0) {
        const absl::Time now = MonotonicNow();
        if (metrics != nullptr && index == 0) {
          if (c.generated.empty()) {
            metrics->ObserveTimeToFirstToken(absl::ToDoubleSeconds(now - a.arrived));
          } else {
            metrics->ObserveTimePerOutputToken(absl::ToDoubleSeconds(now - a.last_token));
          }
        }
        if (index == 0) a.last_token = now;
        a.cached_prompt_tokens = p.cached_prompt_tokens;
        c.generated.push_back(p.token);
        c.sum_logprob += p.logprob;
        if (a.params.outputs.logprobs) c.logprobs.push_back(p.logprob);
        if (a.params.outputs.top_n > 0) {
          std::vector<std::pair<int32_t, float>>& top = c.top.emplace_back();
          for (size_t i = 0; i < p.top_ids.size() && i < p.top_logprobs.size(); ++i) {
            top.emplace_back(p.top_ids[i], p.top_logprobs[i]);
          }
        }
        if (!p.prompt_logprobs.empty()) a.prompt_logprobs = p.prompt_logprobs;
        c.finish_reason = p.finish_reason;
        IncrementalDecoder::Piece piece;
        if (a.stream || !a.params.stop.empty()) {
          absl::StatusOr<IncrementalDecoder::Piece> next = c.decoder.Next(*tokenizer, c.generated);
          if (next.ok()) piece = *std::move(next);
        }
        if (!finished && StopSequenceSeen(a, c, piece)) {
          // Ends here: the text up to and including the stop sequence; the core frees the
          // sequence at its next step and any token it still reports is dropped.
          finished = true;
          c.finish_reason = "stop_sequence";
          core->Cancel(p.id, p.choice);
        }
        // At the end, what is still incomplete goes too.
        std::string added = finished ? piece.ready + piece.pending : piece.ready;
        c.text += added;
        if (a.stream && a.request != nullptr) Stream(a, index, p, finished, added);
      } else if (finished) {
        c.finish_reason = p.finish_reason;
      }
      if (!finished) continue;
      c.done = true;
      if (--a.open == 0) Done(p.id, a, absl::OkStatus());
    }
  }

  // The request is over: counted, timed, answered.
  void Done(uint64_t id, Active& a, const absl::Status& error) {
    if (metrics != nullptr) {
      metrics->ObserveRequestDuration(absl::ToDoubleSeconds(MonotonicNow() - a.arrived));
    }
    Count(a.api, error.ok() ? RequestOutcome::kOk : RequestOutcome::kUnavailable);
    Finish(id, a, error);
  }

  void HandleInfo(evhttp_request* request) {
    const json info = {{"model_id", options.model_id},
                       {"model_dtype", nullptr},
                       {"block_size", options.block_size},
                       {"num_blocks", options.num_blocks},
                       {"max_total_tokens_in_pool",
                        int64_t{options.block_size} * options.num_blocks},
                       {"max_batch_total_tokens", options.max_batch_total_tokens},
                       {"max_batch_prefill_tokens", options.max_batch_prefill_tokens},
                       {"max_input_tokens", options.max_input_tokens},
                       {"max_total_tokens", options.max_total_tokens},
                       {"max_concurrent_requests", options.max_concurrent_requests},
                       {"max_stop_sequences", 4},
                       {"max_top_n_tokens", options.max_top_n_tokens},
                       {"max_best_of", options.max_best_of},
                       {"executors", core->live_executors()},
                       {"router", "kvcm-router"},
                       {"version", kVersion}};
    Reply(request, 200, Dump(info));
  }

  void HandleTokenize(evhttp_request* request) {
    const json root = json::parse(Body(request), nullptr, false);
    if (root.is_discarded() || !root.is_object() || !root.contains("inputs") ||
        !root["inputs"].is_string()) {
      return ReplyError(request, {422, "`inputs` must be a string"});
    }
    absl::StatusOr<std::vector<int32_t>> ids = tokenizer->Encode(root["inputs"].get<std::string>());
    if (!ids.ok()) return ReplyError(request, {422, std::string(ids.status().message())});
    json out = json::array();
    for (int32_t id : *ids) {
      const int32_t one[] = {id};
      absl::StatusOr<std::string> text = tokenizer->Decode(one);
      out.push_back({{"id", id}, {"text", text.ok() ? *text : ""}});
    }
    Reply(request, 200, Dump(out));
  }

  static void OnRequest(evhttp_request* request, void* arg) {
    try {
      Route(request, static_cast<Impl*>(arg));
    } catch (const std::exception& error) {  // a bug here must not take the server down
      Log(absl::StrCat("handling ", evhttp_request_get_uri(request), ": ", error.what()));
      ReplyError(request, {500, "internal error", "internal"});
    }
  }

  static void Route(evhttp_request* request, Impl* self) {
    const char* uri = evhttp_request_get_uri(request);
    std::string path = uri == nullptr ? "/" : uri;
    if (const size_t q = path.find('?'); q != std::string::npos) path.resize(q);
    if (path == "/generate") return self->HandleGenerate(request, false);
    if (path == "/generate_stream") return self->HandleGenerate(request, true);
    if (path == "/") return self->HandleGenerate(request, std::nullopt);
    if (path == "/tokenize") return self->HandleTokenize(request);
    if (path == "/v1/completions") return self->HandleCompletions(request);
    if (path == "/v1/chat/completions") return self->HandleChatCompletions(request);
    if (path == "/v1/models") return self->HandleModels(request);
    if (path == "/info") return self->HandleInfo(request);
    if (path == "/metrics") {
      if (self->metrics == nullptr) return ReplyError(request, {404, "no metrics", "validation"});
      const std::string text =
          prometheus::TextSerializer().Serialize(self->metrics->registry()->Collect());
      return Reply(request, 200, text, "text/plain; version=0.0.4");
    }
    if (path == "/dashboard" || path == "/dashboard/state") {
      Dashboard* dashboard = self->options.dashboard;
      if (dashboard == nullptr) return ReplyError(request, {404, "no dashboard", "validation"});
      evkeyvalq* headers = evhttp_request_get_output_headers(request);
      evhttp_add_header(headers, "Cache-Control", "no-store");
      evhttp_add_header(headers, "X-Content-Type-Options", "nosniff");
      if (path == "/dashboard/state") return Reply(request, 200, dashboard->StateJson());
      // The page fetches nothing but its state, from this server: the browser enforces it.
      evhttp_add_header(headers, "Content-Security-Policy",
                        "default-src 'none'; script-src 'unsafe-inline'; "
                        "style-src 'unsafe-inline'; connect-src 'self'; img-src data:");
      return Reply(request, 200, std::string(Dashboard::Page()), "text/html; charset=utf-8");
    }
    if (path == "/health") {
      if (self->core->live_executors() > 0) return Reply(request, 200, "");
      return ReplyError(request, {503, "no executor is registered", "unavailable"});
    }
    ReplyError(request, {404, absl::StrCat("no route ", path), "validation"});
  }

  static void OnStop(evutil_socket_t, short, void* arg) {
    event_base_loopexit(static_cast<Impl*>(arg)->base, nullptr);
  }
};

absl::StatusOr<std::unique_ptr<HttpFrontend>> HttpFrontend::Start(const Options& options,
                                                                  const Tokenizer* tokenizer,
                                                                  RouterCore* core,
                                                                  RouterMetrics* metrics) {
  static std::once_flag threads;
  std::call_once(threads, [] { evthread_use_pthreads(); });
  std::unique_ptr<HttpFrontend> frontend(new HttpFrontend());
  frontend->impl_ = std::make_unique<Impl>();
  Impl& impl = *frontend->impl_;
  impl.options = options;
  impl.tokenizer = tokenizer;
  impl.core = core;
  impl.metrics = metrics;
  impl.base = event_base_new();
  if (impl.base == nullptr) return absl::InternalError("event_base_new failed");
  impl.http = evhttp_new(impl.base);
  evhttp_set_max_body_size(impl.http, static_cast<ev_ssize_t>(options.max_body_bytes));
  evhttp_set_timeout(impl.http, options.timeout_seconds);
  evhttp_set_allowed_methods(impl.http, EVHTTP_REQ_GET | EVHTTP_REQ_POST);
  evhttp_set_gencb(impl.http, &Impl::OnRequest, &impl);
  evhttp_bound_socket* bound = evhttp_bind_socket_with_handle(
      impl.http, options.host.c_str(), static_cast<ev_uint16_t>(options.port));
  if (bound == nullptr) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", options.host, ":",
                                               options.port, ": ", std::strerror(errno)));
  }
  sockaddr_storage address{};
  socklen_t length = sizeof(address);
  ::getsockname(evhttp_bound_socket_get_fd(bound), reinterpret_cast<sockaddr*>(&address),
                &length);
  frontend->port_ = address.ss_family == AF_INET6
                        ? ntohs(reinterpret_cast<sockaddr_in6*>(&address)->sin6_port)
                        : ntohs(reinterpret_cast<sockaddr_in*>(&address)->sin_port);
  impl.mail = event_new(impl.base, -1, 0, &Impl::OnMail, &impl);
  impl.stop = event_new(impl.base, -1, 0, &Impl::OnStop, &impl);
  frontend->thread_ = std::thread([base = impl.base] { event_base_dispatch(base); });
  return frontend;
}

void HttpFrontend::Deliver(std::vector<Progress> progress) {
  {
    MutexLock lock(&impl_->mailbox_mutex);
    for (Progress& p : progress) impl_->mailbox.push_back(std::move(p));
  }
  event_active(impl_->mail, 0, 0);
}

void HttpFrontend::Stop() {
  if (!thread_.joinable()) return;
  event_active(impl_->stop, 0, 0);
  thread_.join();
}

HttpFrontend::~HttpFrontend() { Stop(); }

}  // namespace kvcm::router
