// A bounded soak of the real stack (docs/RELIABILITY.md, "Soak"): kvcm-launch runs the
// cache manager, the router and two executors of a tiny model; 16 clients send greedy
// requests through the router's four generation routes (/generate, /generate_stream,
// /v1/completions, /v1/chat/completions) for KVCM_SOAK_SECONDS, while a seeded script
// kills (SIGKILL) or stops (SIGTERM) one executor about every 60 s, which kvcm-launch
// restarts. Every 10 s a sample: each process's resident memory (VmRSS) and open fds, the
// window's request latency p50/p99 and outcomes, and the cache manager's block states.
//
// Checked, all from the run itself (no speed threshold): every response carries the tokens
// (or text) of a fault-free reference of the same request or is a clear error; the block
// states sum to the capacity at every scrape; once the load stops no block is in use,
// quarantined or draining; each long-lived process (kvcm-launch, the cache manager, the
// router) ends with no more fds than at the first sample after warm-up plus a small slack,
// and with resident memory within a generous bound of that sample (each executor
// incarnation is a process of its own: compared with its own early sample); the median
// latency of the last clean window (no restart in it) is at most 3 times that of the first;
// every executor that was killed or stopped came back; and at SIGTERM nothing is left.
//
//   KVCM_SOAK_SECONDS   how long the load runs (default 600)
//   KVCM_SOAK_SEED      the script's and the clients' seed (default 20261202), printed
//
// Label soak: not in scripts/test.sh's run unless KVCM_SOAK=1 (it takes ten minutes).

#include <dirent.h>
#include <signal.h>

#include <atomic>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "common/base/mutex.h"
#include "gtest/gtest.h"
#include "tests/faults/launched_stack.h"
#include "tests/support/wait_for.h"

namespace kvcm::faults {
namespace {

using testing::HttpPost;
using testing::HttpResponse;

// One process's footprint: VmRSS (KiB) and the entries of /proc/PID/fd; -1 when unreadable.
struct Footprint {
  pid_t pid = 0;
  int64_t rss_kib = -1;
  int fds = -1;
};
Footprint FootprintOf(pid_t pid) {
  Footprint f;
  f.pid = pid;
  if (pid <= 0) return f;
  std::ifstream status(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(status, line)) {
    absl::string_view rest = line;
    if (absl::ConsumePrefix(&rest, "VmRSS:")) {
      rest = absl::StripAsciiWhitespace(rest);
      absl::ConsumeSuffix(&rest, " kB");
      int64_t kib = 0;
      if (absl::SimpleAtoi(rest, &kib)) f.rss_kib = kib;
    }
  }
  DIR* fd_dir = ::opendir(absl::StrCat("/proc/", pid, "/fd").c_str());
  if (fd_dir != nullptr) {
    int n = 0;
    while (const dirent* entry = ::readdir(fd_dir)) {
      if (entry->d_name[0] != '.') ++n;
    }
    ::closedir(fd_dir);
    f.fds = n;
  }
  return f;
}

// The generation routes the clients use, in turn by the seed.
enum Route { kGenerate, kGenerateStream, kCompletions, kChat, kRoutes };
const char* RouteName(int route) {
  static const char* const kNames[] = {"/generate", "/generate_stream", "/v1/completions",
                                       "/v1/chat/completions"};
  return kNames[route];
}

// One finished request, for the windows' figures.
struct Finished {
  absl::Time at;
  double ms;
  int route;
  std::string kind;
  bool acceptable;
};

struct RequestLog {
  Mutex mutex;
  std::vector<Finished> finished ABSL_GUARDED_BY(mutex);
  std::vector<std::string> bad ABSL_GUARDED_BY(mutex);  // neither the reference nor a clear error
  std::map<std::string, std::string> example ABSL_GUARDED_BY(mutex);  // an error of each kind
};

// One sample: every process's footprint, and the window (since the previous sample).
struct Sample {
  double t = 0;  // seconds since the load started
  std::map<std::string, Footprint> processes;
  int completed = 0;
  std::map<std::string, int> failed;  // by kind
  double p50_ms = 0, p99_ms = 0;
  bool restart = false;  // an executor was killed or stopped in (or just before) the window
  std::string blocks;    // the cache manager's block states at the sample, or "unanswered"
};

class SoakTest : public LaunchedStackTest {
 protected:
  static constexpr int kNumBlocks = 256;
  static constexpr int kExecutors = 2;
  static constexpr int kClients = 16;
  static constexpr absl::Duration kWindow = absl::Seconds(10);
  // Samples before this are warm-up (allocator arenas, first connections, the metric
  // families' label sets filling in); the baselines are the first sample at or after it.
  static constexpr absl::Duration kWarmUp = absl::Seconds(20);

  SoakTest() : LaunchedStackTest("kvcm-soak-test") {}

  static std::string Body(int route, const std::string& text, int32_t n) {
    switch (route) {
      case kGenerate:
      case kGenerateStream:
        return json{{"inputs", text}, {"parameters", {{"max_new_tokens", n}, {"details", true}}}}
            .dump();
      case kCompletions:
        return json{{"model", "tiny"}, {"prompt", text}, {"max_tokens", n}, {"temperature", 0}}
            .dump();
      default:
        return json{{"model", "tiny"},
                    {"messages", json::array({json{{"role", "user"}, {"content", text}}})},
                    {"max_tokens", n},
                    {"temperature", 0}}
            .dump();
    }
  }

  // What a 200 of `route` carries: the token ids as a string for the TGI routes, the text
  // and finish reason for the OpenAI ones; `error` set for a stream that ended in an error
  // event (a clear error: the router's reply to a request its executor lost).
  static std::string Answer(int route, const std::string& body, std::string* error) {
    if (route == kGenerateStream) {
      std::vector<int32_t> ids;
      for (absl::string_view line : absl::StrSplit(body, '\n')) {
        if (!absl::ConsumePrefix(&line, "data:")) continue;
        const json event = json::parse(std::string(line), nullptr, false);
        if (event.is_discarded()) continue;
        if (event.contains("error") && event["error"].is_string()) {
          *error = absl::StrCat("stream error event ", event.value("error_type", ""));
        } else if (event.contains("token")) {
          ids.push_back(event["token"]["id"].get<int32_t>());
        }
      }
      return absl::StrJoin(ids, ",");
    }
    const json reply = json::parse(body, nullptr, false);
    if (!reply.is_object()) return "not JSON";
    if (route == kGenerate) {
      std::vector<int32_t> ids;
      if (reply.contains("details")) {
        for (const json& t : reply["details"]["tokens"]) ids.push_back(t["id"].get<int32_t>());
      }
      return absl::StrJoin(ids, ",");
    }
    if (!reply.contains("choices") || reply["choices"].empty()) return "no choices";
    const json& choice = reply["choices"][0];
    const json text = route == kChat ? choice["message"]["content"] : choice["text"];
    return absl::StrCat(text.dump(), " ", choice["finish_reason"].dump());
  }

  // The fault-free answer of (route, prompt): the model's own tokens for the TGI routes;
  // for the OpenAI routes, what the stack answered before any fault (their replies carry
  // text, not ids; the TGI routes tie that stack to the model).
  std::string Expected(int route, const std::string& text, int32_t n) const {
    if (route == kGenerate || route == kGenerateStream) {
      return absl::StrJoin(KnownReference(text, n), ",");
    }
    auto it = openai_references_.find({route, text, n});
    return it == openai_references_.end() ? "" : it->second;
  }

  Outcome Send(int route, const std::string& text, int32_t n) const {
    absl::StatusOr<HttpResponse> reply =
        HttpPost(url_ + RouteName(route), Body(route, text, n), absl::Seconds(60));
    if (std::optional<Outcome> failure = FailureOf(reply)) return *failure;
    std::string error;
    const std::string answer = Answer(route, reply->body, &error);
    if (!error.empty()) return {error, true, reply->body.substr(0, 300)};
    if (answer != Expected(route, text, n)) {
      return {"WRONG ANSWER", false,
              absl::StrCat(RouteName(route), " '", text, "' n=", n, ": ", reply->body)};
    }
    return {"completed", true, ""};
  }

  std::map<std::tuple<int, std::string, int32_t>, std::string> openai_references_;
};

TEST_F(SoakTest, SteadyLoadWithExecutorRestartsKeepsMemoryFdsAndLatencyFlat) {
  const int64_t seconds = EnvOr("KVCM_SOAK_SECONDS", 600);
  const uint64_t seed = static_cast<uint64_t>(EnvOr("KVCM_SOAK_SEED", 20261202));
  std::cout << "soak: seed " << seed << ", " << seconds
            << " s of load (KVCM_SOAK_SEED, KVCM_SOAK_SECONDS)" << std::endl;
  ASSERT_GE(seconds, 60) << "the soak needs a minute at least: warm-up, windows, a restart";
  const std::set<std::string> shm_before = DevShmEntries();

  // The tiny model has no chat template: the router is given ChatML's.
  const std::string template_path = dir_->path() + "/chatml.jinja";
  {
    std::ofstream out(template_path);
    out << "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + "
           "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}"
           "{{ '<|im_start|>assistant\n' }}{% endif %}";
  }
  ASSERT_NO_FATAL_FAILURE(Launch(kExecutors, kNumBlocks, {"--chat-template", template_path}));

  // The prompts: half share a prefix (prefix-cache hits, so cached blocks churn too).
  std::vector<std::pair<std::string, int32_t>> prompts;
  for (int i = 0; i < 16; ++i) {
    prompts.push_back({absl::StrCat(i % 2 == 0 ? "a shared system prompt, then " : "", "request ",
                                    i, " of the soak"),
                       8 + 4 * (i % 4)});
  }
  for (const auto& prompt : prompts) references_[prompt] = Reference(prompt.first, prompt.second);
  // The fault-free run: each prompt on each route, the TGI ones checked against the model,
  // the OpenAI ones' answers kept as their references (asked twice: the same both times).
  for (const auto& [text, n] : prompts) {
    for (int route = 0; route < kRoutes; ++route) {
      if (route == kCompletions || route == kChat) {
        absl::StatusOr<HttpResponse> reply =
            HttpPost(url_ + RouteName(route), Body(route, text, n), absl::Seconds(60));
        ASSERT_TRUE(reply.ok() && reply->status == 200)
            << RouteName(route) << ": " << (reply.ok() ? reply->body : reply.status().ToString());
        std::string error;
        openai_references_[{route, text, n}] = Answer(route, reply->body, &error);
        ASSERT_EQ(error, "");
      }
      const Outcome outcome = Send(route, text, n);
      ASSERT_EQ(outcome.kind, "completed") << outcome.detail << "\n"
                                           << testing::Tail(launch_->Output());
    }
  }

  const std::vector<std::string> long_lived = {"kvcm-launch", "cache-manager", "router"};
  const std::vector<std::string> executor_names = {"executor-0", "executor-1"};
  std::vector<std::string> names = long_lived;
  names.insert(names.end(), executor_names.begin(), executor_names.end());
  auto footprints = [&] {
    std::map<std::string, Footprint> out;
    for (const std::string& name : names) {
      out[name] = FootprintOf(name == "kvcm-launch" ? launch_->pid() : CurrentPid(name));
    }
    return out;
  };

  const absl::Time start = absl::Now();
  std::atomic<bool> stop_load{false};
  RequestLog log;
  std::vector<std::thread> clients;
  for (int c = 0; c < kClients; ++c) {
    clients.emplace_back([&, c] {
      std::mt19937_64 rng(seed * 31 + static_cast<uint64_t>(c));
      while (!stop_load.load()) {
        const auto& [text, n] = prompts[rng() % prompts.size()];
        const int route = static_cast<int>(rng() % kRoutes);
        const absl::Time sent = absl::Now();
        const Outcome outcome = Send(route, text, n);
        const absl::Time done = absl::Now();
        MutexLock lock(&log.mutex);
        log.finished.push_back({done, absl::ToDoubleMilliseconds(done - sent), route, outcome.kind,
                                outcome.acceptable});
        if (!outcome.acceptable) log.bad.push_back(outcome.kind + ": " + outcome.detail);
        if (!outcome.detail.empty()) log.example.try_emplace(outcome.kind, outcome.detail);
        // A client's back-off after a failure: pacing the load, not a wait for a peer.
        if (outcome.kind != "completed") absl::SleepFor(absl::Milliseconds(50));
      }
    });
  }

  // The scraper: block states sum to capacity at every scrape.
  std::atomic<bool> stop_scrape{false};
  std::atomic<int> scrapes{0}, unanswered{0};
  Mutex scrape_mutex;
  std::vector<std::string> violations;
  std::optional<Scrape> latest;
  std::thread scraper([&] {
    while (!stop_scrape.load()) {
      std::optional<Scrape> scrape = ScrapeCacheManager();
      MutexLock lock(&scrape_mutex);
      if (!scrape) {
        ++unanswered;
      } else {
        ++scrapes;
        double sum = 0;
        for (const auto& [state, count] : scrape->blocks) sum += count;
        if (sum != scrape->capacity || scrape->capacity != kNumBlocks) {
          violations.push_back(
              absl::StrCat("states sum to ", sum, ", capacity ", scrape->capacity));
        }
      }
      latest = scrape;
      // Pacing: a scrape every 200 ms or so, not a wait for a peer (every scrape is checked).
      absl::SleepFor(absl::Milliseconds(200));
    }
  });
  auto blocks_now = [&] {
    MutexLock lock(&scrape_mutex);
    if (!latest) return std::string("unanswered");
    std::string out;
    double sum = 0;
    for (const auto& [state, count] : latest->blocks) {
      absl::StrAppend(&out, out.empty() ? "" : " ", state, "=", count);
      sum += count;
    }
    return absl::StrCat(out, " (sum ", sum, "/", latest->capacity, ")");
  };

  // The main thread: a sample every window, an executor restart about every 60 s (the
  // first at 20..39 s, then 45..75 s apart; none in the last 20 s, so that the last full
  // window is clean), until the end.
  std::mt19937_64 script(seed);
  const absl::Time end = start + absl::Seconds(seconds);
  absl::Time next_restart = start + absl::Seconds(20 + static_cast<int64_t>(script() % 20));
  std::vector<absl::Time> restart_times;
  std::map<std::string, int> restarts;  // by kind
  std::vector<std::string> unrecovered;
  std::vector<Sample> samples;
  size_t counted = 0;  // log.finished entries already in a window
  absl::Time window_start = start;
  auto take_sample = [&](absl::Time now) {
    Sample s;
    s.t = absl::ToDoubleSeconds(now - start);
    s.processes = footprints();
    std::vector<double> ms;
    {
      MutexLock lock(&log.mutex);
      for (; counted < log.finished.size(); ++counted) {
        const Finished& f = log.finished[counted];
        if (f.kind == "completed") {
          ++s.completed;
          ms.push_back(f.ms);
        } else {
          ++s.failed[f.kind];
        }
      }
    }
    s.p50_ms = Quantile(ms, 0.5);
    s.p99_ms = Quantile(ms, 0.99);
    for (absl::Time r : restart_times) {
      // A restart taints its window and the next (requests it failed, a cold executor).
      if (r >= window_start - kWindow && r < now) s.restart = true;
    }
    s.blocks = blocks_now();
    window_start = now;
    samples.push_back(std::move(s));
  };
  absl::Time next_sample = start + kWindow;
  while (absl::Now() < end) {
    // The script's clock: until the next sample, restart or the end. Time passing is what is
    // sampled; a late wake-up only makes a window longer.
    const absl::Time wake = std::min({next_sample, next_restart, end});
    absl::SleepFor(wake - absl::Now());
    const absl::Time now = absl::Now();
    if (now >= next_sample) {
      take_sample(now);
      next_sample += kWindow;
    }
    if (now >= next_restart && now < end - absl::Seconds(20)) {
      const std::string executor = absl::StrCat("executor-", script() % kExecutors);
      const bool kill = script() % 2 == 0;
      const pid_t pid = CurrentPid(executor);
      ASSERT_GT(pid, 0) << executor;
      ASSERT_EQ(::kill(pid, kill ? SIGKILL : SIGTERM), 0) << executor;
      restart_times.push_back(now);
      ++restarts[absl::StrCat(kill ? "SIGKILL " : "SIGTERM ", executor)];
      std::cout << absl::StrFormat("soak: t=%.0f s: %s %s (pid %d)",
                                   absl::ToDoubleSeconds(now - start), kill ? "SIGKILL" : "SIGTERM",
                                   executor, pid)
                << std::endl;
      next_restart = now + absl::Seconds(45 + static_cast<int64_t>(script() % 31));
      // Its successor: kvcm-launch starts it within its backoff; checked before the next
      // (30 s only guards against a hang).
      if (!testing::WaitFor([&] { return CurrentPid(executor) != pid; }, absl::Seconds(30),
                            "the executor's successor")
               .ok()) {
        unrecovered.push_back(executor);
      }
    } else if (now >= next_restart) {
      next_restart = absl::InfiniteFuture();
    }
  }
  stop_load = true;
  for (std::thread& t : clients) t.join();
  take_sample(absl::Now());  // the last, partial window

  // Idle: every block returns to free or cached; then the end footprints.
  std::optional<Scrape> last;
  const bool idle = AwaitIdle(absl::Seconds(30), &last);
  stop_scrape = true;
  scraper.join();

  // The baseline: the first sample at or after the warm-up.
  size_t base = 0;
  while (base + 1 < samples.size() && samples[base].t < absl::ToDoubleSeconds(kWarmUp)) ++base;
  const Sample& first = samples[base];
  // Fds: a slack of 8 for sockets in the middle of a reconnect (a restarted executor's
  // ZeroMQ connections) when the end is sampled.
  constexpr int kFdSlack = 8;
  // The end footprints, once the close of the load's and the scraper's last connections has
  // reached every long-lived process: its fds are back within the bound checked below. The
  // deadline only guards against a hang: leaked fds never come back, and the check fails.
  std::map<std::string, Footprint> final_footprints;
  (void)testing::WaitFor(
      [&] {
        final_footprints = footprints();
        for (const std::string& name : long_lived) {
          if (final_footprints.at(name).fds > first.processes.at(name).fds + kFdSlack) {
            return false;
          }
        }
        return true;
      },
      absl::Seconds(30), "the last connections to close");

  // The table.
  std::string table = "     t  p50 ms  p99 ms    ok  failed";
  for (const std::string& name : names) absl::StrAppend(&table, absl::StrFormat("  %20s", name));
  absl::StrAppend(&table, "  blocks");
  for (const Sample& s : samples) {
    int failed = 0;
    for (const auto& [kind, count] : s.failed) failed += count;
    absl::StrAppend(&table, absl::StrFormat("\n  %4.0f %7.1f %7.1f %5d %7d", s.t, s.p50_ms,
                                            s.p99_ms, s.completed, failed));
    for (const std::string& name : names) {
      const Footprint& f = s.processes.at(name);
      absl::StrAppend(&table, absl::StrFormat("  %7d %6.1fM %3dfd", f.pid,
                                              static_cast<double>(f.rss_kib) / 1024, f.fds));
    }
    absl::StrAppend(&table, s.restart ? "  R " : "    ", s.blocks);
  }
  absl::StrAppend(&table, "\n   end", std::string(35, ' '));
  for (const std::string& name : names) {
    const Footprint& f = final_footprints.at(name);
    absl::StrAppend(&table, absl::StrFormat("  %7d %6.1fM %3dfd", f.pid,
                                            static_cast<double>(f.rss_kib) / 1024, f.fds));
  }
  std::cout << "soak: samples (R: a restart in the window or the one before)\n"
            << table << std::endl;

  // The latency windows compared: the first and last full, clean (no restart) windows after
  // the warm-up; the last sample is a partial window (the load stopping) and is left out.
  std::optional<size_t> first_clean, last_clean;
  for (size_t i = base; i + 1 < samples.size(); ++i) {
    if (samples[i].restart || samples[i].completed == 0) continue;
    if (!first_clean) first_clean = i;
    last_clean = i;
  }

  int requests = 0, completed = 0;
  std::map<std::string, int> by_kind;
  std::map<std::string, int> by_route;
  {
    MutexLock lock(&log.mutex);
    for (const Finished& f : log.finished) {
      ++requests;
      ++by_kind[f.kind];
      if (f.kind == "completed") ++completed, ++by_route[RouteName(f.route)];
    }
  }
  std::string outcomes;
  {
    MutexLock lock(&log.mutex);
    for (const auto& [kind, count] : by_kind) {
      absl::StrAppend(&outcomes, "\n    ", kind, ": ", count);
      if (auto it = log.example.find(kind); it != log.example.end()) {
        absl::StrAppend(&outcomes, " (e.g. ", it->second, ")");
      }
    }
  }
  std::string routes;
  for (const auto& [route, count] : by_route) absl::StrAppend(&routes, " ", route, " ", count);
  std::string injected;
  int restart_count = 0;
  for (const auto& [kind, count] : restarts) {
    absl::StrAppend(&injected, "\n    ", kind, ": ", count);
    restart_count += count;
  }
  std::string footprint_lines;
  for (const std::string& name : long_lived) {
    const Footprint& a = first.processes.at(name);
    const Footprint& b = final_footprints.at(name);
    absl::StrAppend(&footprint_lines,
                    absl::StrFormat("\n    %s (pid %d): RSS %.1f -> %.1f MiB, fds %d -> %d", name,
                                    b.pid, static_cast<double>(a.rss_kib) / 1024,
                                    static_cast<double>(b.rss_kib) / 1024, a.fds, b.fds));
  }
  // Each executor incarnation: its first sample after its own warm-up (its second sample:
  // the first may be of a process still loading the model) and its last.
  struct Incarnation {
    std::string name;
    Footprint early, late;
    int samples = 0;
  };
  std::map<pid_t, Incarnation> incarnations;
  std::vector<Sample> all = samples;
  Sample end_sample;
  end_sample.processes = final_footprints;
  all.push_back(end_sample);
  for (size_t i = base; i < all.size(); ++i) {
    for (const std::string& name : executor_names) {
      const Footprint& f = all[i].processes.at(name);
      if (f.rss_kib < 0) continue;
      Incarnation& inc = incarnations[f.pid];
      inc.name = name;
      ++inc.samples;
      if (inc.samples <= 2) inc.early = f;
      inc.late = f;
    }
  }
  for (const auto& [pid, inc] : incarnations) {
    absl::StrAppend(
        &footprint_lines,
        absl::StrFormat("\n    %s (pid %d, %d samples): RSS %.1f -> %.1f MiB, "
                        "fds %d -> %d",
                        inc.name, pid, inc.samples, static_cast<double>(inc.early.rss_kib) / 1024,
                        static_cast<double>(inc.late.rss_kib) / 1024, inc.early.fds, inc.late.fds));
  }
  std::cout << "soak: seed " << seed << ", " << seconds << " s, " << kClients << " clients, "
            << kExecutors << " executors, " << kNumBlocks << " blocks\n"
            << "  requests: " << requests << outcomes << "\n"
            << "  completed by route:" << routes << "\n"
            << "  executor restarts: " << restart_count << injected << "\n"
            << "  from t=" << first.t << " s (after warm-up) to the end, idle:" << footprint_lines
            << "\n"
            << "  latency of completed requests, first vs last clean window: "
            << (first_clean
                    ? absl::StrFormat("t=%.0f p50 %.1f ms p99 %.1f ms", samples[*first_clean].t,
                                      samples[*first_clean].p50_ms, samples[*first_clean].p99_ms)
                    : "none")
            << " vs "
            << (last_clean
                    ? absl::StrFormat("t=%.0f p50 %.1f ms p99 %.1f ms", samples[*last_clean].t,
                                      samples[*last_clean].p50_ms, samples[*last_clean].p99_ms)
                    : "none")
            << "\n"
            << "  scrapes: " << scrapes.load() << " answered, " << unanswered.load()
            << " unanswered, " << violations.size() << " with states not summing to capacity"
            << std::endl;

  {
    MutexLock lock(&log.mutex);
    EXPECT_TRUE(log.bad.empty()) << log.bad.size() << " requests neither matched the reference "
                                 << "nor got a clear error; the first: " << log.bad.front();
  }
  EXPECT_GT(completed, 0);
  EXPECT_GT(restart_count, 0);
  EXPECT_TRUE(unrecovered.empty()) << unrecovered.front() << " was not restarted within 30 s\n"
                                   << testing::Tail(launch_->Output(), 8000);
  EXPECT_GT(scrapes.load(), 0);
  EXPECT_TRUE(violations.empty()) << violations.front();
  EXPECT_TRUE(idle) << "blocks still held once idle: in_use "
                    << (last ? last->blocks["in_use"] : -1) << ", quarantined "
                    << (last ? last->blocks["quarantined"] : -1) << ", draining "
                    << (last ? last->blocks["draining"] : -1);

  // Memory: 20% of the warm sample or 16 MiB, whichever is more. The processes are small
  // (tens of MiB) and a steady state still moves a few MiB (malloc's per-thread arenas, the
  // kernel's accounting of touched file pages), so a fixed floor keeps noise from failing
  // the run; a leak of a few hundred bytes per request over ten minutes' requests (tens of
  // thousands) still exceeds it. Fds: kFdSlack above.
  auto rss_bound = [](int64_t base_kib) {
    return base_kib + std::max<int64_t>(base_kib / 5, 16 * 1024);
  };
  for (const std::string& name : long_lived) {
    const Footprint& a = first.processes.at(name);
    const Footprint& b = final_footprints.at(name);
    EXPECT_EQ(a.pid, b.pid) << name << " restarted during the soak (only executors are)";
    EXPECT_GT(a.rss_kib, 0) << name;
    EXPECT_LE(b.rss_kib, rss_bound(a.rss_kib))
        << name << ": RSS grew from " << a.rss_kib << " KiB to " << b.rss_kib << " KiB";
    EXPECT_LE(b.fds, a.fds + kFdSlack) << name << ": fds grew from " << a.fds << " to " << b.fds;
  }
  for (const auto& [pid, inc] : incarnations) {
    if (inc.samples < 4) continue;  // too short-lived to say
    EXPECT_LE(inc.late.rss_kib, rss_bound(inc.early.rss_kib))
        << inc.name << " (pid " << pid << "): RSS grew from " << inc.early.rss_kib << " KiB to "
        << inc.late.rss_kib << " KiB";
    EXPECT_LE(inc.late.fds, inc.early.fds + kFdSlack)
        << inc.name << " (pid " << pid << "): fds grew from " << inc.early.fds << " to "
        << inc.late.fds;
  }
  // Latency drift: a ratio within the run, generous for a shared machine.
  ASSERT_TRUE(first_clean && last_clean) << "no clean window to compare";
  EXPECT_LE(samples[*last_clean].p50_ms, 3 * samples[*first_clean].p50_ms)
      << "median latency drifted from " << samples[*first_clean].p50_ms << " ms to "
      << samples[*last_clean].p50_ms << " ms";

  ExpectCleanShutdown(shm_before);
}

}  // namespace
}  // namespace kvcm::faults
