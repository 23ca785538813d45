#pragma once
// HttpFrontend: the router's HTTP front end, the glue between the HTTP server
// (http_server.h: libevent's evhttp on one thread of its own, an open stream costing a
// connection, not a thread), the two APIs (tgi_api.h, openai_api.h; bodies parsed by
// http_requests.h) and RouterCore. It serves the TGI-compatible API:
//
//   POST /generate         {"inputs": "...", "parameters": {...}} -> {"generated_text", "details"}
//   POST /generate_stream  the same, as server-sent events: one per token, the last one with
//                          generated_text and details
//   POST /                 either, by "stream"
//   POST /tokenize         {"inputs"} -> [{"id", "text", "start", "stop"}], at most
//                          max_input_tokens of them (start and stop: the bytes of inputs)
//   GET  /health           200 with an executor registered, else 503
//   GET  /info             the model, the pool and the limits
//   GET  /metrics          Prometheus text (RouterMetrics)
//   GET  /dashboard        the live pool view, one self-contained page (Dashboard), and
//   GET  /dashboard/state  the JSON it polls; 404 without a Dashboard
//   GET  /openapi.json     the OpenAPI document of all of these (OpenApiDocument())
//
// and the OpenAI-compatible one: POST /v1/completions, POST /v1/chat/completions (messages
// rendered with the model's chat template; 501 when it has none), GET /v1/models and
// GET /v1/models/{model}, with OpenAI's error shape {"error": {"message", "type", "param",
// "code"}} (every error of a path under /v1/ has it).
//
// Requests are checked and tokenized here, then handed to RouterCore; the tokens it reports
// come back through Deliver() (any thread) and are written out on the server's thread.
// Errors have TGI's shape {"error": "...", "error_type": "..."}: 400 for a body that is not
// JSON or a request whose framing is ambiguous, 422 for invalid or unsupported parameters
// (never ignored silently), 429 when max_concurrent_requests are in flight, 503 without an
// executor, 404 for an unknown path, 405 for a known path asked with another method than
// its route's, 415 for a POST whose Content-Type is not application/json, 403 for a Host
// that is not this server's (DNS rebinding; docs/router.md, "Browsers"); 413 for a body
// over the limit is libevent's own HTML page (docs/router.md, "Errors"). A client that
// closes its connection has its request cancelled, streamed or not (its sequences freed at
// the next step). When few file descriptors are left, new
// connections are closed as they arrive (docs/router.md, "Connections at the descriptor
// limit").
//
// Thread safety: Deliver() from any thread; the rest from the thread that owns the object.

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/chat/chat_template.h"
#include "common/tokenizer/tokenizer.h"
#include "services/router/dashboard.h"
#include "services/router/router_core.h"
#include "services/router/router_metrics.h"
#include "services/router/tgi_api.h"

namespace kvcm::router {

// A route the router serves (HttpFrontend::Routes()): its path and the one method it
// answers; another method gets 405 with an Allow header naming it.
struct HttpRoute {
  std::string_view path;
  std::string_view method;  // "GET" or "POST"
};

class HttpFrontend {
 public:
  struct Options {
    std::string host = "127.0.0.1";
    int port = 3000;  // 0: any free port (see port())
    int32_t max_concurrent_requests = 128;
    int32_t max_input_tokens = 1024;
    int32_t max_total_tokens = 2048;  // prompt + max_new_tokens
    int32_t default_max_new_tokens = 100;
    // Most alternatives per token (TGI's top_n_tokens, OpenAI's logprobs).
    int32_t max_top_n_tokens = 5;
    // Most sequences one request may generate (TGI's best_of, OpenAI's n and best_of).
    int32_t max_best_of = 4;
    // Larger bodies get 413, larger header blocks 400, from libevent before any handler
    // runs.
    size_t max_body_bytes = 1 << 20;
    size_t max_header_bytes = 16 << 10;
    int timeout_seconds = 60;  // a client that sends nothing for this long is dropped
    // A request must arrive whole (line, headers and body) within this of its connection's
    // accept, or of the previous reply on the connection; a client trickling bytes more
    // slowly (slowloris) is dropped at its next byte after the deadline. 0: no deadline.
    absl::Duration request_timeout = absl::Seconds(10);
    std::string model_id;
    // /v1/chat/completions renders messages with it (null: that endpoint answers 501); it
    // outlives the front end. bos_token and eos_token are the template's variables.
    const ChatTemplate* chat_template = nullptr;
    std::string bos_token;
    std::string eos_token;
    // For /info.
    int32_t block_size = 0;
    int32_t num_blocks = 0;
    int64_t max_batch_total_tokens = 0;
    int32_t max_batch_prefill_tokens = 0;
    // The pool's KV cache groups (TgiKvCacheGroups of the pool's descriptor).
    std::vector<TgiKvCacheGroup> kv_cache_groups;
    // Serves /dashboard and /dashboard/state; null: they answer 404. Outlives the front end.
    Dashboard* dashboard = nullptr;
    // Host names (or IP literals) a request's Host may name besides `host`, localhost,
    // 127.0.0.1 and [::1] (with `host` a wildcard address, any IP literal); "*": any
    // (ParseAllowedHosts; docs/router.md, "Browsers").
    std::vector<std::string> allowed_hosts;
  };

  // --allowed-hosts: comma-separated names or IP literals (an IPv6 one with or without
  // brackets), no ports; "*" allows any Host. Lower-cased; INVALID_ARGUMENT naming the bad
  // entry. (HttpServer::ParseAllowedHosts, which checks the Host of each request.)
  static absl::StatusOr<std::vector<std::string>> ParseAllowedHosts(std::string_view text);

  // Binds and starts serving on its own thread.
  // `metrics` may be null; it and the others outlive the front end.
  static absl::StatusOr<std::unique_ptr<HttpFrontend>> Start(const Options& options,
                                                             const Tokenizer* tokenizer,
                                                             RouterCore* core,
                                                             RouterMetrics* metrics);
  ~HttpFrontend();  // stops: pending requests get their connection closed

  // Every route the server answers, from the table it dispatches on.
  static std::vector<HttpRoute> Routes();
  // The OpenAPI 3.1 document GET /openapi.json serves: services/router/openapi.json, with
  // the bounds that are flags of the router's (max_total_tokens, max_top_n_tokens,
  // max_best_of, ...) taken from `options` (docs/router.md, "OpenAPI document").
  static std::string OpenApiDocument(const Options& options);

  int port() const { return port_; }
  // What the core reports (its sink calls this).
  void Deliver(std::vector<TokenEvent> events);
  // Stops accepting and joins the server's thread.
  void Stop();

  struct Impl;

 private:
  HttpFrontend() = default;
  std::unique_ptr<Impl> impl_;
  int port_ = 0;
};

}  // namespace kvcm::router
