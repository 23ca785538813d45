// 1,000 concurrent streams: the router's added latency per streamed token, against a bare
// HTTP server of the same library (libevent's evhttp) streaming the same bytes at the same
// pace, in the same run.
//
//   build/bench/stream_latency_bench [--streams 1000] [--tokens 32]
//                                    [--max-batch-prefill-tokens 4096]
//
// 1. The whole server (the real cache manager, router and one executor of the tests' tiny
//    model, as processes) gets `streams` /generate_stream requests at once from one client
//    thread (libevent, one connection per stream). The client records when each token event
//    arrives; a token's latency is the gap since the stream's previous one. The router's
//    threads are counted before and while the streams are open.
// 2. A bare evhttp server in this process streams the same number of events of the same
//    bytes to the same number of connections, one event to every stream every S, where S
//    is the router's mean step duration in step 1 (its kvcm_router_step_duration_seconds):
//    what the router would cost if delivering tokens took nothing beyond the steps.
// The ratio of the two gap distributions (p50, p99) is the router's added latency per token
// (goal <= 1.2x, docs/PERFORMANCE.md).

#include <event2/buffer.h>
#include <event2/event.h>
#include <event2/http.h>
#include <event2/keyvalq_struct.h>
#include <event2/thread.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/base/check.h"
#include "common/base/monotonic_clock.h"
#include "bench/server_stack.h"
#include "nlohmann/json.hpp"
#include "tests/support/cache_manager_process.h"
#include "tests/support/http_client.h"
#include "tests/support/metrics_text.h"
#include "tests/support/subprocess.h"
#include "tools/make_tiny_model/tiny_model.h"

namespace kvcm {
namespace {

using json = nlohmann::json;
using testing::TempDir;

// One client thread holding every stream.
class StreamClient {
 public:
  struct Stream {
    StreamClient* client = nullptr;
    evhttp_connection* connection = nullptr;
    std::vector<absl::Time> arrivals;  // one per token event
    std::string pending;               // bytes after the last complete event
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
      s.connection = evhttp_connection_base_new(base, nullptr, host.c_str(),
                                                static_cast<ev_uint16_t>(port));
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
      if (s->pending.rfind("data:", 0) == 0) s->arrivals.push_back(now);
      s->pending.erase(0, end + 2);
    }
  }
  static void OnDone(evhttp_request*, void* arg) {
    auto* s = static_cast<Stream*>(arg);
    if (s->done) return;
    s->done = true;
    if (--s->client->left_ == 0) event_base_loopexit(s->client->base_, nullptr);
  }

  std::vector<Stream> streams_;
  int left_ = 0;
  event_base* base_ = nullptr;
};

// Gaps between consecutive token events of every stream, in milliseconds, sorted.
std::vector<double> Gaps(const std::vector<StreamClient::Stream>& streams, int tokens) {
  std::vector<double> gaps;
  for (const auto& s : streams) {
    KVCM_CHECK(static_cast<int>(s.arrivals.size()) == tokens)
        << "a stream got " << s.arrivals.size() << " of " << tokens << " events";
    for (size_t i = 1; i < s.arrivals.size(); ++i) {
      gaps.push_back(absl::ToDoubleMilliseconds(s.arrivals[i] - s.arrivals[i - 1]));
    }
  }
  std::sort(gaps.begin(), gaps.end());
  return gaps;
}
double Quantile(const std::vector<double>& sorted, double q) {
  return sorted[std::min(sorted.size() - 1, static_cast<size_t>(q * static_cast<double>(sorted.size())))];
}

// The bare server: every `pace`, one event of `event` to every open stream, `tokens` in all.
class BareServer {
 public:
  BareServer(std::string event, int tokens, absl::Duration pace)
      : event_(std::move(event)), tokens_(tokens), pace_(pace) {
    base_ = event_base_new();
    http_ = evhttp_new(base_);
    evhttp_set_gencb(http_, &BareServer::OnRequest, this);
    evhttp_bound_socket* bound = evhttp_bind_socket_with_handle(http_, "127.0.0.1", 0);
    KVCM_CHECK(bound != nullptr);
    sockaddr_in address{};
    socklen_t size = sizeof(address);
    ::getsockname(evhttp_bound_socket_get_fd(bound), reinterpret_cast<sockaddr*>(&address), &size);
    port_ = ntohs(address.sin_port);
    timeval tv = absl::ToTimeval(pace_);
    tick_ = event_new(base_, -1, EV_PERSIST, &BareServer::OnTick, this);
    event_add(tick_, &tv);
    thread_ = std::thread([this] { event_base_dispatch(base_); });
  }
  ~BareServer() {
    event_base_loopbreak(base_);
    thread_.join();
    event_free(tick_);
    evhttp_free(http_);
    event_base_free(base_);
  }
  int port() const { return port_; }

 private:
  struct Open {
    evhttp_request* request;
    int sent;
  };
  static void OnRequest(evhttp_request* request, void* arg) {
    auto* self = static_cast<BareServer*>(arg);
    evhttp_add_header(evhttp_request_get_output_headers(request), "Content-Type",
                      "text/event-stream");
    evhttp_send_reply_start(request, 200, "OK");
    self->open_.push_back({request, 0});
  }
  static void OnTick(evutil_socket_t, short, void* arg) {
    auto* self = static_cast<BareServer*>(arg);
    for (Open& o : self->open_) {
      evbuffer* out = evbuffer_new();
      evbuffer_add(out, self->event_.data(), self->event_.size());
      evhttp_send_reply_chunk(o.request, out);
      evbuffer_free(out);
      if (++o.sent == self->tokens_) evhttp_send_reply_end(o.request);
    }
    std::erase_if(self->open_, [self](const Open& o) { return o.sent == self->tokens_; });
  }

  std::string event_;
  int tokens_;
  absl::Duration pace_;
  event_base* base_;
  evhttp* http_;
  event* tick_;
  int port_ = 0;
  std::vector<Open> open_;
  std::thread thread_;
};

int Threads(pid_t pid) {
  std::ifstream status(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(status, line)) {
    int n = 0;
    if (line.rfind("Threads:", 0) == 0 && absl::SimpleAtoi(line.substr(8), &n)) return n;
  }
  return -1;
}

double Metric(const std::string& url, const std::string& name) {
  auto scraped = testing::HttpGet(url + "/metrics");
  KVCM_CHECK(scraped.ok());
  auto metrics = testing::ParseMetricsText(scraped->body);
  KVCM_CHECK(metrics.ok());
  auto value = metrics->Value(name, {});
  return value.ok() ? *value : 0.0;
}

int Main(int argc, char** argv) {
  const int streams = bench::FlagValue(argc, argv, "--streams", 1000);
  const int tokens = bench::FlagValue(argc, argv, "--tokens", 32);
  // The router's --max-batch-prefill-tokens: with the default 4096, the 1,000 prompts are
  // admitted over three steps, which the streams admitted first see as long gaps.
  const int prefill = bench::FlagValue(argc, argv, "--max-batch-prefill-tokens", 4096);
  evthread_use_pthreads();
  absl::StatusOr<TempDir> dir = TempDir::Create("kvcm-slb");
  KVCM_CHECK(dir.ok());
  const std::string model_dir = dir->path() + "/tiny";
  TinyModelOptions tiny;
  tiny.seed = 21;
  KVCM_CHECK(WriteTinyModel(model_dir, tiny).ok());

  testing::CacheManagerOptions cm_options;
  cm_options.block_size = 16;
  cm_options.num_blocks = streams * 3 + 64;
  cm_options.layers = tiny.num_layers;
  cm_options.kv_heads = tiny.num_kv_heads;
  cm_options.head_dim = tiny.head_dim;
  cm_options.dtype = "fp32";
  const std::unique_ptr<bench::ServerStack> stack = bench::StartServerStack(
      model_dir, cm_options,
      {"--max-running", std::to_string(streams + 8), "--max-concurrent-requests",
       std::to_string(streams + 8), "--max-batch-prefill-tokens", std::to_string(prefill)},
      /*executor_threads=*/1, dir->path());
  const int port = stack->port;
  const std::string& url = stack->url;

  const std::string body =
      json{{"inputs", "stream me"}, {"parameters", {{"max_new_tokens", tokens}}}}.dump();
  StreamClient warm;
  (void)warm.Run("127.0.0.1", port, "/generate_stream", body, 50);

  const int threads_idle = Threads(stack->router->pid());
  int threads_busy = 0;
  std::thread sampler([&] {
    absl::SleepFor(absl::Milliseconds(500));
    threads_busy = Threads(stack->router->pid());
  });
  const double steps_before = Metric(url, "kvcm_router_step_duration_seconds_count");
  const double seconds_before = Metric(url, "kvcm_router_step_duration_seconds_sum");
  StreamClient client;
  const absl::Time start = absl::Now();
  const std::vector<StreamClient::Stream> routed =
      client.Run("127.0.0.1", port, "/generate_stream", body, streams);
  const double routed_wall = absl::ToDoubleSeconds(absl::Now() - start);
  sampler.join();
  const double steps = Metric(url, "kvcm_router_step_duration_seconds_count") - steps_before;
  const double step_seconds =
      (Metric(url, "kvcm_router_step_duration_seconds_sum") - seconds_before) / steps;
  const std::vector<double> router_gaps = Gaps(routed, tokens);

  // The bare server streams a token event of the router's size at the router's step pace.
  const std::string event =
      "data:" + json{{"index", 9}, {"token", {{"id", 77}, {"text", "x"},
                                              {"logprob", -1.2345678}, {"special", false}}},
                     {"generated_text", nullptr}, {"details", nullptr}}.dump() + "\n\n";
  const absl::Duration pace = absl::Seconds(step_seconds);
  std::vector<double> bare_gaps;
  {
    BareServer bare(event, tokens, pace);
    StreamClient bare_client;
    bare_gaps = Gaps(bare_client.Run("127.0.0.1", bare.port(), "/generate_stream", body, streams),
                     tokens);
  }

  std::printf("%d streams of %d tokens at once, one client thread, one executor of the tiny "
              "model, --max-batch-prefill-tokens %d\n", streams, tokens, prefill);
  std::printf("router: %.0f steps in %.2f s, mean step %.2f ms; its threads %d idle, %d with "
              "%d streams open\n", steps, routed_wall, step_seconds * 1e3, threads_idle,
              threads_busy, streams);
  std::printf("\n%-30s %10s %10s %10s\n", "per-token gap (ms)", "p50", "p99", "max");
  std::printf("%-30s %10.2f %10.2f %10.2f\n", "router", Quantile(router_gaps, 0.5),
              Quantile(router_gaps, 0.99), router_gaps.back());
  std::printf("%-30s %10.2f %10.2f %10.2f\n", "bare evhttp, same pace", Quantile(bare_gaps, 0.5),
              Quantile(bare_gaps, 0.99), bare_gaps.back());
  std::printf("%-30s %9.2fx %9.2fx   (goal <= 1.20x)\n", "ratio",
              Quantile(router_gaps, 0.5) / Quantile(bare_gaps, 0.5),
              Quantile(router_gaps, 0.99) / Quantile(bare_gaps, 0.99));
  return 0;
}

}  // namespace
}  // namespace kvcm

int main(int argc, char** argv) { return kvcm::Main(argc, argv); }
