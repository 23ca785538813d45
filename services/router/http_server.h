#pragma once
// HttpServer: the router's HTTP server, knowing no API (libevent's evhttp on one thread of
// its own: an open stream costs a connection, not a thread). It owns what is HTTP's:
//
//   - the socket and its connections: the framing of each request before libevent reads
//     it (http_framing.h; docs/router.md, "Framing"), the deadline a request must arrive
//     whole within (slowloris), and the descriptor reserve below which new connections are
//     closed as they arrive (docs/router.md, "Connections at the descriptor limit");
//   - the checks every route shares: the Host (DNS rebinding: 400 or 403) and a POST's
//     Content-Type (415) (docs/router.md, "Browsers"), 405 with Allow for a known path
//     asked with another method, 404 for an unknown one;
//   - dispatch to the route table's handlers (functions of the request), replies, server-sent
//     events, and the requests it tracks: a tracked request's client closing its connection
//     (seen at once, streamed or not: docs/router.md, "Errors") is reported by its id;
//   - the mailbox: Deliver() (any thread) hands the core's reports over, and they are
//     handed to Hooks::deliver on the server's thread a slice at a time, the loop writing
//     the sockets between slices; Stop() hands over what is left, then ends the loop.
//
// What an error looks like is the APIs' (HttpError::api, a route's Api, Hooks::api_of_path):
// every error is answered through Hooks::reply_error, and the refusals of a route marked
// `generation` through Hooks::refuse (which counts them).
//
// Thread safety: Deliver() and Stop() from any thread; Create(), Run() and the destructor from
// the owner's; everything else, hooks and handlers included, on the server's thread.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "services/router/api.h"
#include "services/router/generation.h"
#include "services/router/router_core.h"
#include "services/router/router_metrics.h"

struct evhttp_request;

namespace kvcm::router {

class HttpServer {
 public:
  struct Options {
    std::string host = "127.0.0.1";
    int port = 3000;  // 0: any free port (see port())
    // Larger bodies get 413, larger header blocks 400 (the framing first, libevent's own
    // limits as a backstop).
    size_t max_body_bytes = 1 << 20;
    size_t max_header_bytes = 16 << 10;
    int timeout_seconds = 60;  // a client that sends nothing for this long is dropped
    // A request must arrive whole within this of its first byte; 0: no deadline.
    absl::Duration request_timeout = absl::Seconds(10);
    // Host names or IP literals a request's Host may name besides `host`, localhost,
    // 127.0.0.1 and [::1] (ParseAllowedHosts).
    std::vector<std::string> allowed_hosts;
  };

  using Handler = std::function<void(evhttp_request* request)>;
  // A route: its path (ending in "{name}": that prefix, then at least one byte), the one
  // method it answers, the API whose error shape its errors have, whether its refusals are
  // counted (Hooks::refuse: the generation routes'), and its handler.
  struct Route {
    std::string_view path;
    std::string_view method;  // "GET" or "POST"
    Api api = Api::kTgi;
    bool generation = false;
    Handler handle;
  };

  struct Hooks {
    // Answers `error` in its API's shape.
    std::function<void(evhttp_request*, const HttpError&)> reply_error;
    // Answers and counts the refusal of a `generation` route.
    std::function<void(evhttp_request*, const HttpError&)> refuse;
    // The API whose error shape a path no route matched has (404, framing, Host).
    std::function<Api(std::string_view path)> api_of_path;
    // The core's reports Deliver() took, a slice at a time, in order.
    std::function<void(std::span<const TokenEvent>)> deliver;
    // The client of the tracked request `id` closed its connection (Track); the request is
    // no longer tracked, and libevent's (or freed) by now: it must not be answered.
    std::function<void(uint64_t id)> closed;
  };

  // --allowed-hosts: comma-separated names or IP literals (an IPv6 one with or without
  // brackets), no ports; "*" allows any Host. Lower-cased; INVALID_ARGUMENT naming the bad
  // entry.
  static absl::StatusOr<std::vector<std::string>> ParseAllowedHosts(std::string_view text);

  // Binds; serves once Run() is called. `metrics` may be null; it outlives the server.
  static absl::StatusOr<std::unique_ptr<HttpServer>> Create(const Options& options,
                                                            std::vector<Route> routes, Hooks hooks,
                                                            RouterMetrics* metrics);
  ~HttpServer();  // stops: pending requests get their connection closed

  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // Starts serving on its own thread.
  void Run();
  // Stops accepting, hands over what Deliver() took, and joins the thread.
  void Stop();
  int port() const { return port_; }
  // What the core reports (any thread): handed to Hooks::deliver on the server's thread.
  void Deliver(std::vector<TokenEvent> events);

  // ---- On the server's thread -------------------------------------------------------
  // A whole reply; no Content-Type when `content_type` is null.
  static void Reply(evhttp_request* request, int status, const std::string& body,
                    const char* content_type = "application/json");
  static void AddHeader(evhttp_request* request, const char* name, const char* value);
  static std::string Body(evhttp_request* request);
  // The path of a request, without its query.
  static std::string PathOf(evhttp_request* request);
  // `text` percent-decoded ('+' kept), or as it is when it cannot be.
  static std::string PercentDecoded(const std::string& text);

  // A 200 text/event-stream reply begun; its events follow (SendEvent), then EndStream.
  static void StartStream(evhttp_request* request);
  static void EndStream(evhttp_request* request);
  // One server-sent event: `field` ("data:" or "data: "), `data`, a blank line.
  void SendEvent(evhttp_request* request, std::string_view field, std::string_view data);
  // The same, its data written in place (no allocation of its own): the buffer, `field`
  // already in, to append the data to; then SendStartedEvent.
  std::string* StartEvent(std::string_view field);
  void SendStartedEvent(evhttp_request* request);

  // A request that runs past its handler: its client closing the connection (or the
  // socket's end seen while it runs) is reported to Hooks::closed with `id`, until Untrack.
  void Track(uint64_t id, evhttp_request* request);
  // Before its reply (which may close the socket).
  void Untrack(uint64_t id);

  struct Impl;

 private:
  HttpServer() = default;
  std::unique_ptr<Impl> impl_;
  std::thread thread_;
  int port_ = 0;
};

}  // namespace kvcm::router
