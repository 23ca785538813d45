#pragma once
// StreamClient: one client thread (libevent) holding any number of server-sent-event
// streams, recording when each event arrives (CLOCK_MONOTONIC, the clock of the router's
// --step-trace) and what it says. For the benchmarks that time streamed tokens.

#include <event2/buffer.h>
#include <event2/event.h>
#include <event2/http.h>
#include <event2/keyvalq_struct.h>

#include <string>
#include <utility>
#include <vector>

#include "absl/time/time.h"
#include "common/base/check.h"
#include "common/base/monotonic_clock.h"

namespace kvcm::bench {

class StreamClient {
 public:
  struct Stream {
    StreamClient* client = nullptr;
    evhttp_connection* connection = nullptr;
    std::vector<absl::Time> arrivals;  // one per `data:` event
    std::vector<std::string> events;   // each event's data, after "data:", one per arrival
    std::string pending;               // bytes after the last complete event
    int status = 0;                    // the reply's HTTP status; 0: no reply
    bool done = false;
  };

  // Opens `n` streams to host:port, POSTing `body` to `path`, and runs until all end.
  std::vector<Stream> Run(const std::string& host, int port, const std::string& path,
                          const std::string& body, int n) {
    event_base* base = event_base_new();
    streams_.assign(static_cast<size_t>(n), Stream{});
    left_ = n;
    base_ = base;
    for (Stream& s : streams_) {
      s.client = this;
      s.connection =
          evhttp_connection_base_new(base, nullptr, host.c_str(), static_cast<ev_uint16_t>(port));
      evhttp_connection_set_timeout(s.connection, 600);
      evhttp_request* request = evhttp_request_new(&StreamClient::OnDone, &s);
      evhttp_request_set_chunked_cb(request, &StreamClient::OnChunk);
      evkeyvalq* headers = evhttp_request_get_output_headers(request);
      evhttp_add_header(headers, "Host", host.c_str());
      evhttp_add_header(headers, "Content-Type", "application/json");
      evbuffer_add(evhttp_request_get_output_buffer(request), body.data(), body.size());
      KVCM_CHECK(evhttp_make_request(s.connection, request, EVHTTP_REQ_POST, path.c_str()) == 0);
    }
    event_base_dispatch(base);
    for (Stream& s : streams_) evhttp_connection_free(s.connection);
    event_base_free(base);
    return std::move(streams_);
  }

 private:
  static void OnChunk(evhttp_request* request, void* arg) {
    auto* s = static_cast<Stream*>(arg);
    evbuffer* in = evhttp_request_get_input_buffer(request);
    const size_t length = evbuffer_get_length(in);
    std::string bytes(length, '\0');
    evbuffer_remove(in, bytes.data(), length);
    s->pending += bytes;
    const absl::Time now = MonotonicNow();
    for (size_t end; (end = s->pending.find("\n\n")) != std::string::npos;) {
      if (s->pending.rfind("data:", 0) == 0) {
        s->arrivals.push_back(now);
        const size_t from = s->pending.compare(0, 6, "data: ") == 0 ? 6 : 5;
        s->events.push_back(s->pending.substr(from, end - from));
      }
      s->pending.erase(0, end + 2);
    }
  }
  static void OnDone(evhttp_request* request, void* arg) {
    auto* s = static_cast<Stream*>(arg);
    if (s->done) return;
    s->done = true;
    if (request != nullptr) s->status = evhttp_request_get_response_code(request);
    if (--s->client->left_ == 0) event_base_loopexit(s->client->base_, nullptr);
  }

  std::vector<Stream> streams_;
  int left_ = 0;
  event_base* base_ = nullptr;
};

}  // namespace kvcm::bench
