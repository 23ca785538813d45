#include "services/router/http_frontend.h"

#include <algorithm>
#include <cstring>
#include <optional>
#include <span>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/base/log.h"
#include "common/base/monotonic_clock.h"
#include "common/tokenizer/incremental_decoder.h"
#include "nlohmann/json.hpp"
#include "prometheus/registry.h"
#include "prometheus/text_serializer.h"
#include "services/router/http_requests.h"
#include "services/router/http_server.h"
#include "services/router/openai_api.h"
#include "services/router/tgi_api.h"

// services/router/openapi.json, embedded at build time (cmake/KvcmEmbed.cmake).
extern "C" {
extern const unsigned char kvcm_openapi_json[];
extern const size_t kvcm_openapi_json_size;
}

namespace kvcm::router {
namespace {

using json = nlohmann::json;

void Log(std::string_view text) { LogLine(kRouterName, text); }

constexpr char kModelPrefix[] = "/v1/models/";

// The API whose error shape a path's errors have: OpenAI's under /v1/.
Api ApiOfPath(std::string_view path) {
  return path == "/v1" || path.starts_with("/v1/") ? Api::kOpenAi : Api::kTgi;
}

// An error's body in its API's shape.
json ErrorBody(const HttpError& error) {
  return error.api == Api::kOpenAi ? OpenAiErrorBody(error) : TgiErrorBody(error);
}

// The server-sent event field of an API.
std::string_view EventField(Api api) {
  return api == Api::kOpenAi ? kOpenAiEventField : kTgiEventField;
}

}  // namespace

absl::StatusOr<std::vector<std::string>> HttpFrontend::ParseAllowedHosts(std::string_view text) {
  return HttpServer::ParseAllowedHosts(text);
}

struct HttpFrontend::Impl {
  Options options;
  const Tokenizer* tokenizer = nullptr;
  RouterCore* core = nullptr;
  RouterMetrics* metrics = nullptr;
  std::unique_ptr<RequestParser> parser;  // with `options`' limits and `tokenizer`
  std::string openapi;                    // GET /openapi.json: OpenApiDocument(options)

  // A request while it runs: what it generated (Generation), and where it goes.
  struct Active : Generation {
    evhttp_request* request = nullptr;
    int32_t open = 0;  // choices not finished yet
    absl::Time arrived;
    absl::Time last_token;
  };
  absl::flat_hash_map<uint64_t, Active> active;
  uint64_t next_id = 1;

  // Latencies of the tokens of one slice, observed after all its events are queued to
  // their connections rather than between them.
  std::vector<double> first_token_seconds;
  std::vector<double> token_gap_seconds;

  std::unique_ptr<HttpServer> server;  // last: stopped and freed first

  void Count(Api api, RequestOutcome outcome) {
    if (metrics == nullptr) return;
    metrics->CountRequest(api, outcome);
  }

  static void ReplyError(evhttp_request* request, const HttpError& error) {
    // OpenAI answers invalid requests with 400 (TGI with 422).
    const int status = error.api == Api::kOpenAi ? OpenAiErrorStatus(error.status) : error.status;
    HttpServer::Reply(request, status, Dump(ErrorBody(error)));
  }
  // A refusal of a generation request, counted.
  void Refuse(evhttp_request* request, const HttpError& error) {
    Count(error.api, error.status == 429   ? RequestOutcome::kOverloaded
                     : error.status == 503 ? RequestOutcome::kUnavailable
                                           : RequestOutcome::kInvalid);
    ReplyError(request, error);
  }

  // POST /generate, /generate_stream and / (TGI): the body parsed by RequestParser.
  void HandleGenerate(evhttp_request* request, std::optional<bool> stream_path) {
    GenerationRequest parsed;
    if (std::optional<HttpError> bad =
            parser->ParseGenerate(HttpServer::Body(request), stream_path, &parsed)) {
      return Refuse(request, *bad);
    }
    std::vector<int32_t> prompt = std::move(parsed.prompt);
    Active a;
    static_cast<Generation&>(a) = GenerationOf(std::move(parsed));
    Start(request, std::move(a), std::move(prompt));
  }

  // POST /v1/completions and /v1/chat/completions (OpenAI): the body parsed by
  // RequestParser.
  void HandleOpenAi(evhttp_request* request, bool chat) {
    GenerationRequest parsed;
    const std::string body = HttpServer::Body(request);
    if (std::optional<HttpError> bad = chat ? parser->ParseChatCompletions(body, &parsed)
                                            : parser->ParseCompletions(body, &parsed)) {
      return Refuse(request, *bad);
    }
    std::vector<int32_t> prompt = std::move(parsed.prompt);
    Active a;
    static_cast<Generation&>(a) = GenerationOf(std::move(parsed));
    a.completion_id = OpenAiCompletionId(chat, next_id);
    a.created = absl::ToUnixSeconds(absl::Now());
    Start(request, std::move(a), std::move(prompt));
  }

  // 422 when the prompt and every token it may generate need more blocks than the pool has
  // in all, or more tokens than max_batch_total_tokens: the planner's rule for a request it
  // rejects (StepPlanner::Plan), with the core's message (RouterCore's rejected requests).
  std::optional<HttpError> NeverFits(size_t prompt_tokens, int64_t max_new_tokens) const {
    const int64_t whole = static_cast<int64_t>(prompt_tokens) + max_new_tokens;
    const bool over_pool =
        options.num_blocks > 0 && options.block_size > 0 &&
        (whole + options.block_size - 1) / options.block_size > options.num_blocks;
    const bool over_batch =
        options.max_batch_total_tokens > 0 && whole > options.max_batch_total_tokens;
    if (!over_pool && !over_batch) return std::nullopt;
    return HttpError{422, "the prompt and max_new_tokens need more KV cache than the pool holds",
                     "validation"};
  }

  // The checks every API shares, before a request is registered: the error to answer, or
  // nullopt.
  std::optional<HttpError> StartRefusal(const Active& a, const std::vector<int32_t>& prompt) const {
    if (prompt.empty()) {  // the parsers refuse it first: the planner cannot run it
      return HttpError{422, "the prompt has no tokens"};
    }
    if (static_cast<int32_t>(prompt.size()) > options.max_input_tokens) {
      return HttpError{422,
                       absl::StrCat("the prompt must have less than ", options.max_input_tokens,
                                    " tokens. Given: ", prompt.size())};
    }
    if (static_cast<int64_t>(prompt.size()) + a.params.max_new_tokens > options.max_total_tokens) {
      return HttpError{
          422, absl::StrCat("prompt tokens + new tokens must be <= ", options.max_total_tokens,
                            ". Given: ", prompt.size(), " prompt tokens and ",
                            a.params.max_new_tokens, " new tokens")};
    }
    // What the pool can never hold the planner rejects once queued (StepPlanner::Plan): known
    // now, so refused now, with the status and body of any refusal, a stream's included
    // (it was a 200 stream of one error event; docs/router.md, "Errors").
    if (std::optional<HttpError> never = NeverFits(prompt.size(), a.params.max_new_tokens)) {
      return never;
    }
    if (static_cast<int32_t>(active.size()) >= options.max_concurrent_requests) {
      return HttpError{429, "Model is overloaded", "overloaded"};
    }
    if (core->draining()) return HttpError{503, "the router is shutting down", "unavailable"};
    if (core->live_executors() == 0) {
      return HttpError{503, "no executor is registered with the router yet", "unavailable"};
    }
    return std::nullopt;
  }

  // The checks every API shares; then the request is registered and handed to the core.
  void Start(evhttp_request* request, Active a, std::vector<int32_t> prompt) {
    if (std::optional<HttpError> refused = StartRefusal(a, prompt)) {
      refused->api = a.api;
      return Refuse(request, *refused);
    }
    const uint64_t id = next_id++;
    a.request = request;
    a.arrived = MonotonicNow();
    a.prompt_tokens = prompt.size();
    a.prompt = prompt;
    a.choices.assign(static_cast<size_t>(a.params.outputs.sequences), Choice{});
    a.open = a.params.outputs.sequences;
    server->Track(id, request);
    if (a.stream) {
      HttpServer::StartStream(request);
      if (a.chat) {  // OpenAI's first chunk of each choice names the role
        for (int32_t k = 0; k < a.shown; ++k) {
          server->SendEvent(request, kOpenAiEventField,
                            OpenAiRoleChunk(a, static_cast<size_t>(k), options.model_id));
        }
      }
    }
    Submission submission;
    submission.id = id;
    submission.prompt = std::move(prompt);
    submission.max_new_tokens = a.params.max_new_tokens;
    submission.sampling = a.params.sampling;
    submission.outputs = a.params.outputs;
    submission.api = a.api;
    submission.ignore_eos = a.params.ignore_eos;
    active.emplace(id, std::move(a));
    core->Submit(std::move(submission));
  }

  // The client of request `id` went away (HttpServer::Track): cancelled.
  void OnClosed(uint64_t id) {
    auto a = active.find(id);
    if (a == active.end()) return;
    const Api api = a->second.api;
    active.erase(a);
    core->Cancel(id);
    Count(api, RequestOutcome::kCancelled);
    Log(absl::StrCat("request ", id, ": the client went away; cancelled"));
  }

  // The request's reply once every choice is done (or it failed with `error`).
  void Finish(uint64_t id, Active& a, const absl::Status& error) {
    server->Untrack(id);  // before the reply, which may close the socket
    if (!error.ok()) {
      FinishFailed(a, error);
    } else if (a.stream) {
      if (a.api == Api::kOpenAi) {
        if (a.include_usage) {
          server->SendEvent(a.request, kOpenAiEventField, OpenAiUsageChunk(a, options.model_id));
        }
        server->SendEvent(a.request, kOpenAiEventField, kOpenAiDone);
      }
      HttpServer::EndStream(a.request);
    } else if (a.api == Api::kOpenAi) {
      HttpServer::Reply(a.request, 200, OpenAiReply(a, *tokenizer, options.model_id));
    } else {
      HttpServer::Reply(a.request, 200, TgiReply(a, *tokenizer));
    }
    active.erase(id);
  }
  // A request the core failed: 422 for what the pool cannot hold, else 503; a stream's as
  // its last event.
  void FinishFailed(Active& a, const absl::Status& error) {
    const int status = absl::IsResourceExhausted(error) ? 422 : 503;
    const HttpError failure{status, std::string(error.message()),
                            status == 422 ? "validation" : "unavailable", "", a.api};
    if (a.stream) {
      server->SendEvent(a.request, EventField(a.api), Dump(ErrorBody(failure)));
      HttpServer::EndStream(a.request);
    } else {
      ReplyError(a.request, failure);  // OpenAI's 400 for TGI's 422, as every refusal
    }
  }

  // Streams choice `index`'s newest token (`p`'s); `finished` with its finish reason.
  // `piece`: the text the token adds (never a broken UTF-8 sequence until the end: what is
  // incomplete waits for the next token).
  void Stream(Active& a, size_t index, const TokenEvent& p, bool finished,
              const std::string& piece) {
    if (a.api == Api::kOpenAi) {
      server->SendEvent(a.request, kOpenAiEventField,
                        OpenAiTokenChunk(a, index, finished, piece, *tokenizer, options.model_id));
      return;
    }
    std::string* event = server->StartEvent(kTgiEventField);
    AppendTgiTokenEvent(a, index, p.token, p.logprob, finished, piece, *tokenizer, event);
    server->SendStartedEvent(a.request);
  }

  // A slice of what the core reported (HttpServer::Hooks::deliver), then the latencies of
  // its tokens.
  void DeliverSlice(std::span<const TokenEvent> batch) {
    DeliverEvents(batch);
    if (metrics != nullptr) {
      for (double seconds : first_token_seconds) metrics->ObserveTimeToFirstToken(seconds);
      for (double seconds : token_gap_seconds) metrics->ObserveTimePerOutputToken(seconds);
    }
    first_token_seconds.clear();
    token_gap_seconds.clear();
  }

  void DeliverEvents(std::span<const TokenEvent> batch) {
    for (const TokenEvent& p : batch) {
      auto it = active.find(p.request);
      if (it == active.end()) continue;
      Active& a = it->second;
      if (!p.error.ok()) {  // the whole request failed
        Done(p.request, a, p.error);
        continue;
      }
      if (p.choice < 0 || static_cast<size_t>(p.choice) >= a.choices.size()) continue;
      const auto index = static_cast<size_t>(p.choice);
      Choice& c = a.choices[index];
      if (c.done) continue;  // a token still in flight after a stop sequence
      bool finished = p.finished;
      if (p.token >= 0) {
        finished = AddToken(a, index, p);
      } else if (finished) {
        c.finish_reason = p.finish_reason;
      }
      if (!finished) continue;
      c.done = true;
      if (--a.open == 0) Done(p.request, a, absl::OkStatus());
    }
  }

  // Choice `index`'s token `p.token`: recorded, timed, looked at for stop sequences and
  // streamed. Returns whether the choice is finished.
  bool AddToken(Active& a, size_t index, const TokenEvent& p) {
    Choice& c = a.choices[index];
    bool finished = p.finished;
    NoteTokenTime(a, index, c);
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
    const std::optional<size_t> at = finished ? std::nullopt : StopSequenceSeen(a, c, piece);
    if (at.has_value()) {
      // Ends here: the text up to and including the stop sequence; the core frees the
      // sequence at its next step and any token it still reports is dropped.
      finished = true;
      c.stop_at = *at;
      c.finish_reason = "stop_sequence";
      core->Cancel(p.request, p.choice);
    }
    // At the end, what is still incomplete goes too.
    std::string added = finished ? piece.ready + piece.pending : piece.ready;
    c.text += added;
    if (a.stream && a.request != nullptr) Stream(a, index, p, finished, added);
    return finished;
  }

  // The first choice's time to its first token, or since its last one.
  void NoteTokenTime(Active& a, size_t index, const Choice& c) {
    const absl::Time now = MonotonicNow();
    if (metrics != nullptr && index == 0) {
      (c.generated.empty() ? first_token_seconds : token_gap_seconds)
          .push_back(absl::ToDoubleSeconds(now - (c.generated.empty() ? a.arrived : a.last_token)));
    }
    if (index == 0) a.last_token = now;
  }

  // The request is over: counted, timed, answered.
  void Done(uint64_t id, Active& a, const absl::Status& error) {
    if (metrics != nullptr) {
      metrics->ObserveRequestDuration(absl::ToDoubleSeconds(MonotonicNow() - a.arrived));
    }
    Count(a.api, error.ok() ? RequestOutcome::kOk : RequestOutcome::kUnavailable);
    Finish(id, a, error);
  }

  // GET /v1/models/{model} (the official client's models.retrieve): the entry /v1/models
  // lists when {model} (percent-decoded, and it may hold a '/') is the model served, else
  // 404 in OpenAI's shape.
  void HandleModel(evhttp_request* request) {
    const std::string id =
        HttpServer::PercentDecoded(HttpServer::PathOf(request).substr(std::strlen(kModelPrefix)));
    if (id == options.model_id) {
      return HttpServer::Reply(request, 200, OpenAiModel(options.model_id));
    }
    ReplyError(request, {404,
                         absl::StrCat("the model `", Shortened(id),
                                      "` does not exist (this "
                                      "server serves `",
                                      options.model_id, "`)"),
                         "validation", "model", Api::kOpenAi});
  }

  void HandleInfo(evhttp_request* request) {
    TgiInfo info;
    info.model_id = options.model_id;
    info.block_size = options.block_size;
    info.num_blocks = options.num_blocks;
    info.max_batch_total_tokens = options.max_batch_total_tokens;
    info.max_batch_prefill_tokens = options.max_batch_prefill_tokens;
    info.max_input_tokens = options.max_input_tokens;
    info.max_total_tokens = options.max_total_tokens;
    info.max_concurrent_requests = options.max_concurrent_requests;
    info.max_top_n_tokens = options.max_top_n_tokens;
    info.max_best_of = options.max_best_of;
    info.executors = core->live_executors();
    info.kv_cache_groups = options.kv_cache_groups;
    HttpServer::Reply(request, 200, TgiInfoReply(info));
  }

  void HandleTokenize(evhttp_request* request) {
    // The ids a prompt of this text is run with, BOS included: what the cache holds and the
    // KV events carry (a cluster router's query needs exactly those).
    std::vector<int32_t> ids;
    const std::string body = HttpServer::Body(request);
    if (std::optional<HttpError> bad = parser->ParseTokenize(body, &ids)) {
      return ReplyError(request, *bad);
    }
    HttpServer::Reply(request, 200, TgiTokenizeReply(body, ids, *tokenizer));
  }

  void HandleMetrics(evhttp_request* request) {
    if (metrics == nullptr) return ReplyError(request, {404, "no metrics", "validation"});
    const std::string text = prometheus::TextSerializer().Serialize(metrics->registry()->Collect());
    HttpServer::Reply(request, 200, text, "text/plain; version=0.0.4");
  }

  // /dashboard (the page) and /dashboard/state (the JSON it polls).
  void HandleDashboard(evhttp_request* request, bool state) {
    if (options.dashboard == nullptr) {
      return ReplyError(request, {404, "no dashboard", "validation"});
    }
    HttpServer::AddHeader(request, "Cache-Control", "no-store");
    HttpServer::AddHeader(request, "X-Content-Type-Options", "nosniff");
    if (state) return HttpServer::Reply(request, 200, options.dashboard->StateJson());
    // The page fetches nothing but its state, from this server: the browser enforces it.
    HttpServer::AddHeader(request, "Content-Security-Policy",
                          "default-src 'none'; script-src 'unsafe-inline'; "
                          "style-src 'unsafe-inline'; connect-src 'self'; img-src data:");
    HttpServer::Reply(request, 200, std::string(Dashboard::Page()), "text/html; charset=utf-8");
  }

  void HandleHealth(evhttp_request* request) {
    // No body, and so no Content-Type (an empty body is no JSON).
    if (core->live_executors() > 0) return HttpServer::Reply(request, 200, "", nullptr);
    ReplyError(request, {503, "no executor is registered", "unavailable"});
  }

  // A route of the table below: HttpServer::Route with its handler a function of Impl.
  struct RouteEntry {
    const char* path;
    const char* method;  // "GET" or "POST"
    Api api;
    bool generation;
    void (*handle)(Impl* self, evhttp_request* request);
  };
  // Every route the server answers: the table HttpFrontend::Routes() lists and GET
  // /openapi.json documents (docs/router.md, "OpenAPI document").
  static const RouteEntry kRoutes[];

  // kRoutes, each handler bound to this front end.
  std::vector<HttpServer::Route> ServerRoutes();

  HttpServer::Hooks ServerHooks() {
    HttpServer::Hooks hooks;
    hooks.reply_error = &Impl::ReplyError;
    hooks.refuse = [this](evhttp_request* r, const HttpError& error) { Refuse(r, error); };
    hooks.api_of_path = &ApiOfPath;
    hooks.deliver = [this](std::span<const TokenEvent> batch) { DeliverSlice(batch); };
    hooks.closed = [this](uint64_t id) { OnClosed(id); };
    return hooks;
  }
};

const HttpFrontend::Impl::RouteEntry HttpFrontend::Impl::kRoutes[] = {
    {"/generate", "POST", Api::kTgi, true,
     [](Impl* self, evhttp_request* r) { self->HandleGenerate(r, false); }},
    {"/generate_stream", "POST", Api::kTgi, true,
     [](Impl* self, evhttp_request* r) { self->HandleGenerate(r, true); }},
    {"/", "POST", Api::kTgi, true,
     [](Impl* self, evhttp_request* r) { self->HandleGenerate(r, std::nullopt); }},
    {"/tokenize", "POST", Api::kTgi, false,
     [](Impl* self, evhttp_request* r) { self->HandleTokenize(r); }},
    {"/v1/completions", "POST", Api::kOpenAi, true,
     [](Impl* self, evhttp_request* r) { self->HandleOpenAi(r, false); }},
    {"/v1/chat/completions", "POST", Api::kOpenAi, true,
     [](Impl* self, evhttp_request* r) { self->HandleOpenAi(r, true); }},
    {"/v1/models", "GET", Api::kOpenAi, false,
     [](Impl* self, evhttp_request* r) {
       HttpServer::Reply(r, 200, OpenAiModelList(self->options.model_id));
     }},
    {"/v1/models/{model}", "GET", Api::kOpenAi, false,
     [](Impl* self, evhttp_request* r) { self->HandleModel(r); }},
    {"/info", "GET", Api::kTgi, false, [](Impl* self, evhttp_request* r) { self->HandleInfo(r); }},
    {"/metrics", "GET", Api::kTgi, false,
     [](Impl* self, evhttp_request* r) { self->HandleMetrics(r); }},
    {"/dashboard", "GET", Api::kTgi, false,
     [](Impl* self, evhttp_request* r) { self->HandleDashboard(r, false); }},
    {"/dashboard/state", "GET", Api::kTgi, false,
     [](Impl* self, evhttp_request* r) { self->HandleDashboard(r, true); }},
    {"/health", "GET", Api::kTgi, false,
     [](Impl* self, evhttp_request* r) { self->HandleHealth(r); }},
    {"/openapi.json", "GET", Api::kTgi, false,
     [](Impl* self, evhttp_request* r) { HttpServer::Reply(r, 200, self->openapi); }},
};

std::vector<HttpServer::Route> HttpFrontend::Impl::ServerRoutes() {
  std::vector<HttpServer::Route> routes;
  for (const RouteEntry& route : kRoutes) {
    routes.push_back({route.path, route.method, route.api, route.generation,
                      [this, handle = route.handle](evhttp_request* r) { handle(this, r); }});
  }
  return routes;
}

std::vector<HttpRoute> HttpFrontend::Routes() {
  std::vector<HttpRoute> routes;
  for (const Impl::RouteEntry& route : Impl::kRoutes) routes.push_back({route.path, route.method});
  return routes;
}

std::string HttpFrontend::OpenApiDocument(const Options& options) {
  json document = json::parse(
      std::string_view(reinterpret_cast<const char*>(kvcm_openapi_json), kvcm_openapi_json_size));
  document["info"]["version"] = kRouterVersion;
  // A bound that is a flag of the router's is named by "x-kvcm-maximum" where it applies.
  const std::pair<std::string_view, int64_t> limits[] = {
      {"max_total_tokens", options.max_total_tokens},
      {"max_input_tokens", options.max_input_tokens},
      {"max_top_n_tokens", options.max_top_n_tokens},
      {"max_best_of", options.max_best_of},
  };
  std::vector<json*> pending = {&document};
  while (!pending.empty()) {
    json* node = pending.back();
    pending.pop_back();
    if (node->is_object() && node->contains("x-kvcm-maximum")) {
      const json& name = (*node)["x-kvcm-maximum"];
      for (const auto& [flag, value] : limits) {
        if (name.is_string() && name.get<std::string>() == flag) (*node)["maximum"] = value;
      }
    }
    if (node->is_structured()) {
      for (json& child : *node) pending.push_back(&child);
    }
  }
  return document.dump(1);
}

absl::StatusOr<std::unique_ptr<HttpFrontend>> HttpFrontend::Start(const Options& options,
                                                                  const Tokenizer* tokenizer,
                                                                  RouterCore* core,
                                                                  RouterMetrics* metrics) {
  std::unique_ptr<HttpFrontend> frontend(new HttpFrontend());
  frontend->impl_ = std::make_unique<Impl>();
  Impl& impl = *frontend->impl_;
  impl.options = options;
  impl.tokenizer = tokenizer;
  RequestLimits limits;
  limits.max_input_tokens = options.max_input_tokens;
  limits.max_total_tokens = options.max_total_tokens;
  limits.default_max_new_tokens = options.default_max_new_tokens;
  limits.max_top_n_tokens = options.max_top_n_tokens;
  limits.max_best_of = options.max_best_of;
  limits.chat_template = options.chat_template;
  limits.bos_token = options.bos_token;
  limits.eos_token = options.eos_token;
  impl.parser = std::make_unique<RequestParser>(std::move(limits), tokenizer);
  impl.openapi = OpenApiDocument(options);
  impl.core = core;
  impl.metrics = metrics;
  HttpServer::Options server_options;
  server_options.host = options.host;
  server_options.port = options.port;
  server_options.max_body_bytes = options.max_body_bytes;
  server_options.max_header_bytes = options.max_header_bytes;
  server_options.timeout_seconds = options.timeout_seconds;
  server_options.request_timeout = options.request_timeout;
  server_options.allowed_hosts = options.allowed_hosts;
  absl::StatusOr<std::unique_ptr<HttpServer>> server =
      HttpServer::Create(server_options, impl.ServerRoutes(), impl.ServerHooks(), metrics);
  if (!server.ok()) return server.status();
  impl.server = *std::move(server);
  frontend->port_ = impl.server->port();
  impl.server->Run();
  return frontend;
}

void HttpFrontend::Deliver(std::vector<TokenEvent> events) {
  impl_->server->Deliver(std::move(events));
}

void HttpFrontend::Stop() {
  if (impl_ != nullptr && impl_->server != nullptr) impl_->server->Stop();
}

HttpFrontend::~HttpFrontend() { Stop(); }

}  // namespace kvcm::router
