// 1,000 concurrent streams: the router's added latency per streamed token, against a bare
// HTTP server of the same library (libevent's evhttp) streaming the same bytes at the same
// pace, in the same run.
//
//   build/bench/stream_latency_bench [--streams 1000] [--tokens 32]
//                                    [--max-batch-prefill-tokens 4096] [--per-step]
//
// 1. The whole server (the real cache manager, router and one executor of the tests' tiny
//    model, as processes) gets `streams` /generate_stream requests at once from one client
//    thread (libevent, one connection per stream), which records when each token event
//    arrives (CLOCK_MONOTONIC, the clock of the router's --step-trace). The router's threads
//    are counted before and while the streams are open.
// 2. A bare evhttp server in this process replays the router's steps: at the same offsets as
//    the router's steps were answered by the executor, it writes one event of the same bytes
//    to as many of its open streams as the router's step made tokens (the first unfinished
//    ones, in the order they connected: the router admits first come, first served), to the
//    same number of connections from the same client.
// A token's added latency is its arrival minus the moment its step was answered (router:
// `answered_ns` in the step trace; bare: the moment its tick began to write), each token
// attributed to the last step answered before it arrived; the count attributed to each step
// must equal the tokens the step made (printed: a mismatch would mean a step's delivery ran
// past the next step). The ratio of the two distributions (p50, p99) is the router's added
// latency per token (goal <= 1.2x, docs/PERFORMANCE.md). The gaps between a stream's tokens
// are printed too: they hold the steps' own durations, which the replay shares.

#include <event2/buffer.h>
#include <event2/event.h>
#include <event2/http.h>
#include <event2/keyvalq_struct.h>
#include <event2/thread.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "bench/server_stack.h"
#include "bench/stream_client.h"
#include "common/base/check.h"
#include "common/base/monotonic_clock.h"
#include "nlohmann/json.hpp"
#include "tests/support/cache_manager_process.h"
#include "tests/support/subprocess.h"
#include "tools/make_tiny_model/tiny_model.h"

namespace kvcm {
namespace {

using json = nlohmann::json;
using bench::StreamClient;
using testing::TempDir;

// Step times of a step trace line, nanoseconds of CLOCK_MONOTONIC.
struct TracedStep {
  int64_t planned = 0;
  int64_t cache_manager = 0;
  int64_t dispatched = 0;
  int64_t answered = 0;
  int64_t delivered = 0;
  int tokens = 0;
  int prefill_tokens = 0;
};

std::vector<TracedStep> ReadStepTrace(const std::string& path, int64_t from_ns) {
  std::ifstream in(path);
  KVCM_CHECK(in.good()) << "no step trace at " << path;
  std::vector<TracedStep> steps;
  for (std::string line; std::getline(in, line);) {
    const json j = json::parse(line);
    TracedStep s;
    s.planned = j.at("planned_ns").get<int64_t>();
    s.cache_manager = j.at("cache_manager_ns").get<int64_t>();
    s.dispatched = j.at("dispatched_ns").get<int64_t>();
    s.answered = j.at("answered_ns").get<int64_t>();
    s.delivered = j.at("delivered_ns").get<int64_t>();
    s.tokens = j.at("tokens").get<int>();
    s.prefill_tokens = j.at("prefill_tokens").get<int>();
    if (s.planned >= from_ns && s.tokens > 0) steps.push_back(s);
  }
  return steps;
}

int64_t Nanos(absl::Time t) { return absl::ToUnixNanos(t); }

// Each token's latency since the step that made it, in milliseconds, sorted. A stream's
// tokens come from consecutive steps (one token per step from its first; no preemption in
// this run), so its first step is the latest f with births[f + k] <= arrival k for every k
// (a token cannot arrive before its step was answered). `made` receives how many tokens each
// step makes under that attribution, to compare with the tokens the trace says it made.
// `per_step`, if not null, receives each step's latencies (unsorted).
std::vector<double> AddedLatencies(const std::vector<StreamClient::Stream>& streams,
                                   const std::vector<int64_t>& births, std::vector<int>* made,
                                   std::vector<std::vector<double>>* per_step = nullptr) {
  made->assign(births.size(), 0);
  if (per_step != nullptr) per_step->assign(births.size(), {});
  std::vector<double> added;
  for (const auto& s : streams) {
    const size_t n = s.arrivals.size();
    KVCM_CHECK(n <= births.size());
    std::optional<size_t> first;
    for (size_t f = births.size() - n + 1; f-- > 0 && !first;) {
      bool causal = true;
      for (size_t k = 0; k < n && causal; ++k) causal = births[f + k] <= Nanos(s.arrivals[k]);
      if (causal) first = f;
    }
    KVCM_CHECK(first.has_value()) << "a stream's tokens fit no run of steps";
    for (size_t k = 0; k < n; ++k) {
      ++(*made)[*first + k];
      added.push_back(static_cast<double>(Nanos(s.arrivals[k]) - births[*first + k]) / 1e6);
      if (per_step != nullptr) (*per_step)[*first + k].push_back(added.back());
    }
  }
  std::sort(added.begin(), added.end());
  return added;
}

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
  return sorted[std::min(sorted.size() - 1,
                         static_cast<size_t>(q * static_cast<double>(sorted.size())))];
}
double Mean(const std::vector<double>& v) {
  double sum = 0;
  for (double x : v) sum += x;
  return v.empty() ? 0.0 : sum / static_cast<double>(v.size());
}

// The bare server: once `expected` streams are open, replays `ticks` (offsets from the
// first, and how many streams get an event of `event` then), `tokens` events per stream.
class BareServer {
 public:
  struct Tick {
    int64_t offset_ns;
    int events;
  };
  // The executor's compute, offsets from the first tick: on a machine of few cores the
  // router's delivery competes with it for the CPU, so the replay spins through the same
  // intervals on a thread of its own.
  struct Busy {
    int64_t begin_ns;
    int64_t end_ns;
  };
  BareServer(std::string event, int tokens, int expected, std::vector<Tick> ticks,
             std::vector<Busy> busy)
      : event_(std::move(event)),
        tokens_(tokens),
        expected_(expected),
        ticks_(std::move(ticks)),
        busy_(std::move(busy)) {
    base_ = event_base_new();
    http_ = evhttp_new(base_);
    evhttp_set_gencb(http_, &BareServer::OnRequest, this);
    evhttp_bound_socket* bound = evhttp_bind_socket_with_handle(http_, "127.0.0.1", 0);
    KVCM_CHECK(bound != nullptr);
    sockaddr_in address{};
    socklen_t size = sizeof(address);
    ::getsockname(evhttp_bound_socket_get_fd(bound), reinterpret_cast<sockaddr*>(&address), &size);
    port_ = ntohs(address.sin_port);
    tick_ = evtimer_new(base_, &BareServer::OnTick, this);
    thread_ = std::thread([this] { event_base_dispatch(base_); });
    spinner_ = std::thread([this] { Spin(); });
  }
  ~BareServer() {
    stop_ = true;
    spinner_.join();
    event_base_loopbreak(base_);
    thread_.join();
    event_free(tick_);
    evhttp_free(http_);
    event_base_free(base_);
  }
  int port() const { return port_; }
  // When each tick began to write; read once the client is done.
  const std::vector<int64_t>& births() const { return births_; }

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
    if (static_cast<int>(self->open_.size()) == self->expected_) {
      self->start_ = Nanos(MonotonicNow());
      self->started_ = self->start_;
      self->Arm();
    }
  }
  void Spin() {
    while (started_.load() == 0 && !stop_) absl::SleepFor(absl::Milliseconds(1));
    const int64_t start = started_.load();
    for (const Busy& b : busy_) {
      while (!stop_ && Nanos(MonotonicNow()) < start + b.begin_ns) {
        absl::SleepFor(absl::Microseconds(200));
      }
      while (!stop_ && Nanos(MonotonicNow()) < start + b.end_ns) {
      }
    }
  }
  void Arm() {
    if (next_ >= ticks_.size()) return;
    const int64_t wait =
        std::max<int64_t>(0, start_ + ticks_[next_].offset_ns - Nanos(MonotonicNow()));
    timeval tv = absl::ToTimeval(absl::Nanoseconds(wait));
    evtimer_add(tick_, &tv);
  }
  static void OnTick(evutil_socket_t, short, void* arg) {
    auto* self = static_cast<BareServer*>(arg);
    self->births_.push_back(Nanos(MonotonicNow()));
    int left = self->ticks_[self->next_++].events;
    for (Open& o : self->open_) {
      if (left == 0) break;
      if (o.sent == self->tokens_) continue;
      --left;
      evbuffer* out = evbuffer_new();
      evbuffer_add(out, self->event_.data(), self->event_.size());
      evhttp_send_reply_chunk(o.request, out);
      evbuffer_free(out);
      if (++o.sent == self->tokens_) evhttp_send_reply_end(o.request);
    }
    std::erase_if(self->open_, [self](const Open& o) { return o.sent == self->tokens_; });
    self->Arm();
  }

  std::string event_;
  int tokens_;
  int expected_;
  std::vector<Tick> ticks_;
  std::vector<Busy> busy_;
  std::atomic<int64_t> started_{0};
  std::atomic<bool> stop_{false};
  std::thread spinner_;
  size_t next_ = 0;
  int64_t start_ = 0;
  std::vector<int64_t> births_;
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

// How many tokens were attributed to a step other than the tokens it made.
int Misattributed(const std::vector<int>& attributed, const std::vector<int>& made) {
  int off = 0;
  for (size_t i = 0; i < made.size(); ++i) off += std::abs(attributed[i] - made[i]);
  return off;
}

int Main(int argc, char** argv) {
  const int streams = bench::FlagValue(argc, argv, "--streams", 1000);
  const int tokens = bench::FlagValue(argc, argv, "--tokens", 32);
  // The router's --max-batch-prefill-tokens: with the default 4096, the 1,000 prompts are
  // admitted over three steps, which the streams admitted first see as long gaps.
  const int prefill = bench::FlagValue(argc, argv, "--max-batch-prefill-tokens", 4096);
  // --per-step: a line per step, to see which steps the tails come from.
  const bool per_step = std::find_if(argv + 1, argv + argc, [](const char* a) {
                          return std::string(a) == "--per-step";
                        }) != argv + argc;
  evthread_use_pthreads();
  absl::StatusOr<TempDir> dir = TempDir::Create("kvcm-slb");
  KVCM_CHECK(dir.ok());
  const std::string model_dir = dir->path() + "/tiny";
  const std::string trace_path = dir->path() + "/steps.jsonl";
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
       std::to_string(streams + 8), "--max-batch-prefill-tokens", std::to_string(prefill),
       "--step-trace", trace_path},
      /*executor_threads=*/1, dir->path());
  const int port = stack->port;

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
  StreamClient client;
  const absl::Time start = MonotonicNow();
  const std::vector<StreamClient::Stream> routed =
      client.Run("127.0.0.1", port, "/generate_stream", body, streams);
  const double routed_wall = absl::ToDoubleSeconds(MonotonicNow() - start);
  sampler.join();
  const std::vector<TracedStep> steps = ReadStepTrace(trace_path, Nanos(start));
  KVCM_CHECK(!steps.empty());
  std::vector<int64_t> answered;
  std::vector<int> made;
  std::vector<BareServer::Tick> ticks;
  std::vector<BareServer::Busy> busy;
  std::vector<double> router_ms, plan_ms, cm_ms, complete_ms, executor_ms, idle_ms, prefill_step_ms,
      decode_step_ms;
  int made_total = 0;
  for (size_t i = 0; i < steps.size(); ++i) {
    const TracedStep& s = steps[i];
    answered.push_back(s.answered);
    made.push_back(s.tokens);
    made_total += s.tokens;
    ticks.push_back({s.answered - steps[0].answered, s.tokens});
    busy.push_back({s.dispatched - steps[0].answered, s.answered - steps[0].answered});
    // The router's own share of a step: planning, the cache manager's Step, sending the
    // batches, then completing the step and handing tokens to the HTTP thread.
    router_ms.push_back(
        static_cast<double>((s.dispatched - s.planned) + (s.delivered - s.answered)) / 1e6);
    cm_ms.push_back(static_cast<double>(s.cache_manager) / 1e6);
    plan_ms.push_back(static_cast<double>(s.dispatched - s.planned - s.cache_manager) / 1e6);
    complete_ms.push_back(static_cast<double>(s.delivered - s.answered) / 1e6);
    executor_ms.push_back(static_cast<double>(s.answered - s.dispatched) / 1e6);
    if (i + 1 < steps.size())
      idle_ms.push_back(static_cast<double>(steps[i + 1].planned - s.delivered) / 1e6);
    (s.prefill_tokens > 0 ? prefill_step_ms : decode_step_ms)
        .push_back(static_cast<double>(s.delivered - s.planned) / 1e6);
  }
  KVCM_CHECK(made_total == streams * tokens)
      << "the trace's steps made " << made_total << " tokens, the client got " << streams * tokens;
  std::vector<int> router_attributed;
  std::vector<std::vector<double>> router_per_step, bare_per_step;
  const std::vector<double> router_added =
      AddedLatencies(routed, answered, &router_attributed, &router_per_step);
  const std::vector<double> router_gaps = Gaps(routed, tokens);

  // The bare server replays the steps with a token event of the router's size.
  const std::string event =
      "data:" +
      json{{"index", 9},
           {"token", {{"id", 77}, {"text", "x"}, {"logprob", -1.2345678}, {"special", false}}},
           {"generated_text", nullptr},
           {"details", nullptr}}
          .dump() +
      "\n\n";
  std::vector<double> bare_added, bare_gaps;
  std::vector<int> bare_attributed;
  {
    BareServer bare(event, tokens, streams, ticks, busy);
    StreamClient bare_client;
    const std::vector<StreamClient::Stream> served =
        bare_client.Run("127.0.0.1", bare.port(), "/generate_stream", body, streams);
    bare_gaps = Gaps(served, tokens);
    bare_added = AddedLatencies(served, bare.births(), &bare_attributed, &bare_per_step);
  }

  std::printf(
      "%d streams of %d tokens at once, one client thread, one executor of the tiny "
      "model, --max-batch-prefill-tokens %d\n",
      streams, tokens, prefill);
  std::printf(
      "router: %zu steps in %.2f s (%zu with prefill, %.2f ms mean; %zu decode only, "
      "%.2f ms mean); its threads %d idle, %d with %d streams open\n",
      steps.size(), routed_wall, prefill_step_ms.size(), Mean(prefill_step_ms),
      decode_step_ms.size(), Mean(decode_step_ms), threads_idle, threads_busy, streams);
  std::printf(
      "per step, mean: router's own %.3f ms (planning and sending %.3f, cache manager "
      "%.3f, completing %.3f), executor %.2f ms, between steps %.3f ms: router share "
      "%.2f%%\n",
      Mean(router_ms), Mean(plan_ms), Mean(cm_ms), Mean(complete_ms), Mean(executor_ms),
      Mean(idle_ms),
      100.0 * (Mean(router_ms) + Mean(idle_ms)) /
          (Mean(router_ms) + Mean(idle_ms) + Mean(executor_ms)));
  std::printf(
      "tokens the attribution gives a step beyond what it made: router %d, bare %d "
      "(of %d)\n",
      Misattributed(router_attributed, made), Misattributed(bare_attributed, made), made_total);
  std::printf("\n%-34s %10s %10s %10s\n", "ms", "p50", "p99", "max");
  std::printf("%-34s %10.3f %10.3f %10.3f\n", "added latency: router", Quantile(router_added, 0.5),
              Quantile(router_added, 0.99), router_added.back());
  std::printf("%-34s %10.3f %10.3f %10.3f\n", "added latency: bare evhttp replay",
              Quantile(bare_added, 0.5), Quantile(bare_added, 0.99), bare_added.back());
  std::printf("%-34s %9.2fx %9.2fx   (goal <= 1.20x)\n", "ratio",
              Quantile(router_added, 0.5) / Quantile(bare_added, 0.5),
              Quantile(router_added, 0.99) / Quantile(bare_added, 0.99));
  std::printf("%-34s %10.2f %10.2f %10.2f\n", "gap between tokens: router",
              Quantile(router_gaps, 0.5), Quantile(router_gaps, 0.99), router_gaps.back());
  std::printf("%-34s %10.2f %10.2f %10.2f\n", "gap between tokens: bare replay",
              Quantile(bare_gaps, 0.5), Quantile(bare_gaps, 0.99), bare_gaps.back());
  std::printf("%-34s %9.2fx %9.2fx\n", "ratio",
              Quantile(router_gaps, 0.5) / Quantile(bare_gaps, 0.5),
              Quantile(router_gaps, 0.99) / Quantile(bare_gaps, 0.99));
  if (per_step) {
    // Where the tails come from: each step's tokens, its added latency in both runs, when
    // it was answered, and the router's own parts of the next step (planning and sending,
    // the cache manager's Step within it), which run while this step's tokens are written.
    std::printf("\n%5s %7s %8s %10s %10s %10s %10s %10s %10s %10s\n", "step", "tokens", "prefill",
                "router p50", "max", "bare p50", "max", "answered", "next plan", "next cm");
    for (size_t i = 0; i < steps.size(); ++i) {
      std::vector<double>& r = router_per_step[i];
      std::vector<double>& b = bare_per_step[i];
      std::sort(r.begin(), r.end());
      std::sort(b.begin(), b.end());
      if (r.empty() || b.empty()) continue;
      const TracedStep* next = i + 1 < steps.size() ? &steps[i + 1] : nullptr;
      std::printf("%5zu %7d %8d %10.3f %10.3f %10.3f %10.3f %10.2f %10.3f %10.3f\n", i,
                  steps[i].tokens, steps[i].prefill_tokens, Quantile(r, 0.5), r.back(),
                  Quantile(b, 0.5), b.back(),
                  static_cast<double>(steps[i].answered - steps[0].answered) / 1e6,
                  next ? static_cast<double>(next->dispatched - next->planned) / 1e6 : 0.0,
                  next ? static_cast<double>(next->cache_manager) / 1e6 : 0.0);
    }
  }
  return 0;
}

}  // namespace
}  // namespace kvcm

int main(int argc, char** argv) { return kvcm::Main(argc, argv); }
