// How long after its commit a block survives a SIGKILL of the cache manager (docs/
// PERFORMANCE.md, "Warm restart from the disk tier", "Blocks found again after a SIGKILL of
// the cache manager"): under a steady stream of requests, each of its own prompt, the cache
// manager is SIGKILLed at a random moment; kvcm-launch starts it again on the same
// --disk-tier-dir, and each prompt that completed before the kill is sent again to see
// whether all its full blocks came back from disk. The age of a prompt is the kill's time
// minus its request's completion (its blocks were committed before the reply). Per round
// and over all rounds: the youngest prompt found again and the oldest one lost.
//
//   build/bench/tier_crash_bench [--rounds 8] [--rate 200] [--sync-ms 1000] [--clients 2]
//                                [--seed N]
//
// The stack is kvcm-launch with the tiny test model (weights from a fixed seed), one
// executor of one thread, blocks of 4 tokens and a disk tier of 1 GiB in $TMPDIR, both new
// each round (the tier never fills: no slot is reused before the check). The stream sends
// --rate prompts a second (of 31 full blocks each), paced from the round's start; --rate 0
// sends each client's next prompt as soon as its last one is answered, which on the tiny
// model commits blocks faster than the movers write them (the queue then grows: the figures
// show it). Each round kills at a moment drawn uniformly from [2 s, 6 s] after its stream
// starts (the seed is printed). A process's crash keeps the page cache: what this measures
// is the movers' queue, not --disk-tier-sync-ms, which bounds a crash of the machine (the
// last scrape before each kill says how many written blocks no sync covered yet).

#include <signal.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <mutex>
#include <optional>
#include <random>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "bench/server_stack.h"
#include "common/base/check.h"
#include "nlohmann/json.hpp"
#include "tests/support/cache_manager_process.h"
#include "tests/support/http_client.h"
#include "tests/support/subprocess.h"
#include "tools/make_tiny_model/tiny_model.h"

namespace kvcm::bench {
namespace {

using json = nlohmann::json;

struct Args {
  int rounds = 8;
  int rate = 200;  // prompts a second; 0: as fast as the clients go
  int sync_ms = 1000;
  int clients = 2;
  uint64_t seed = 20261206;
};

Args ParseArgs(int argc, char** argv) {
  Args args;
  args.rounds = FlagValue(argc, argv, "--rounds", args.rounds);
  args.rate = FlagValue(argc, argv, "--rate", args.rate);
  args.sync_ms = FlagValue(argc, argv, "--sync-ms", args.sync_ms);
  args.clients = FlagValue(argc, argv, "--clients", args.clients);
  const std::string seed = FlagString(argc, argv, "--seed", std::to_string(args.seed));
  KVCM_CHECK(absl::SimpleAtoi(seed, &args.seed)) << "bad value for --seed: " << seed;
  return args;
}

// Prompt `n`: its first three bytes spell n in base 26, so that no two prompts share their
// first block (BOS and three byte tokens) and a prompt's cached tokens can only be its own.
std::string Prompt(int n) {
  std::string text;
  text += static_cast<char>('a' + n / (26 * 26) % 26);
  text += static_cast<char>('a' + n / 26 % 26);
  text += static_cast<char>('a' + n % 26);
  for (int line = 0; text.size() < 120; ++line) {
    absl::StrAppend(&text, " crash bench prompt ", n, " line ", line, ";");
  }
  return text;
}

class Stack {
 public:
  Stack(const std::string& model, const std::string& dir, int sync_ms) : dir_(dir) {
    testing::Subprocess::Options options;
    options.argv = {testing::KvcmBinaryPath("kvcm-launch"), "--model", model, "--port", "0",
                    "--run-dir", dir + "/run", "--executors", "1", "--threads", "1", "--block-size",
                    "4", "--num-blocks", "4096", "--restart-backoff-ms", "100",
                    "--prometheus-targets", dir + "/targets.json", "--disk-tier-dir", dir + "/tier",
                    "--disk-tier-bytes", "1GiB", "--disk-tier-sync-ms", std::to_string(sync_ms),
                    // A prompt's check waits for its blocks however long they take to load.
                    "--tier-load-timeout-ms", "600000"};
    options.output_path = dir + "/launch.log";
    std::filesystem::remove(options.output_path);
    auto started = testing::Subprocess::Start(options);
    KVCM_CHECK(started.ok()) << started.status();
    launch_ = *std::move(started);
    auto ready = launch_->WaitForLine("kvcm-launch: ready http=(\\S+) executors=1",
                                      absl::Now() + absl::Seconds(120));
    KVCM_CHECK(ready.ok()) << ready.status() << "\n" << testing::Tail(launch_->Output());
    url_ = (*ready)[1];
  }

  void Stop() {
    KVCM_CHECK(launch_->Signal(SIGTERM).ok());
    auto code = launch_->Wait(absl::Seconds(60));
    KVCM_CHECK(code.ok() && *code == 0) << testing::Tail(launch_->Output());
  }

  // The last pid kvcm-launch reported for the cache manager.
  pid_t CacheManagerPid() const {
    const std::string output = launch_->Output();
    const std::regex started("kvcm-launch: started cache-manager \\(pid ([0-9]+)\\)");
    pid_t pid = 0;
    for (auto it = std::sregex_iterator(output.begin(), output.end(), started);
         it != std::sregex_iterator(); ++it) {
      pid = std::stoi((*it)[1]);
    }
    return pid;
  }

  // Series of the cache manager's metrics, in one scrape; -1 for each absent one, all -1
  // when it cannot be scraped.
  std::vector<double> Metrics(const std::vector<std::string>& series) const {
    std::vector<double> values(series.size(), -1);
    const json targets = json::parse(testing::ReadFileOrEmpty(dir_ + "/targets.json"), nullptr,
                                     /*allow_exceptions=*/false);
    if (!targets.is_array()) return values;
    for (const json& group : targets) {
      if (group.value("labels", json::object()).value("__kvcm_component", "") != "cache-manager" ||
          !group.contains("targets") || group["targets"].empty()) {
        continue;
      }
      auto reply = testing::HttpGet(
          absl::StrCat("http://", group["targets"][0].get<std::string>(), "/metrics"),
          absl::Seconds(2));
      if (!reply.ok() || reply->status != 200) return values;
      for (absl::string_view line : absl::StrSplit(reply->body, '\n')) {
        for (size_t i = 0; i < series.size(); ++i) {
          if (absl::StartsWith(line, series[i] + " ")) {
            values[i] = std::stod(std::string(line.substr(series[i].size() + 1)));
          }
        }
      }
    }
    return values;
  }

  // A greedy /v1/completions of one token: the prompt's tokens and the cached ones; nullopt
  // when it failed (the cache manager is down and the router gave up, say).
  std::optional<std::pair<int, int>> Complete(const std::string& prompt,
                                              absl::Duration timeout) const {
    const json body = {{"model", "m"}, {"prompt", prompt}, {"max_tokens", 1}, {"temperature", 0}};
    auto reply = testing::HttpPost(url_ + "/v1/completions", body.dump(), timeout);
    if (!reply.ok() || reply->status != 200) return std::nullopt;
    const json parsed = json::parse(reply->body, nullptr, /*allow_exceptions=*/false);
    if (!parsed.is_object() || !parsed.contains("usage")) return std::nullopt;
    return std::pair<int, int>{
        parsed["usage"]["prompt_tokens"].get<int>(),
        parsed["usage"]["prompt_tokens_details"]["cached_tokens"].get<int>()};
  }

 private:
  std::string dir_;
  std::unique_ptr<testing::Subprocess> launch_;
  std::string url_;
};

struct Round {
  double kill_after = 0;  // seconds after the stream started
  int completed = 0;      // prompts completed before the kill
  int recovered = 0;      // of those, with every full block found again
  int partial = 0;        // some but not all of its full blocks found again
  double youngest_recovered = std::numeric_limits<double>::infinity();  // age, s
  double oldest_lost = -1;                                              // age, s; -1: none
  // The last scrape before the kill: disk writes no sync covered yet, and pool blocks held
  // for stores (queued or being copied out: the movers' queue).
  double unsynced_at_kill = -1;
  double held_at_kill = -1;
  double syncs = -1;  // fdatasync rounds from the stream's start to that scrape
  // Stores cancelled because the pool needed their blocks: never written (a lost prompt
  // older than the queue delay is one of those).
  double stores_dropped = -1;
};

int Main(int argc, char** argv) {
  const Args args = ParseArgs(argc, argv);
  const std::string dir = absl::StrCat(std::filesystem::temp_directory_path().string(),
                                       "/kvcm-tier-crash-bench-", getpid());
  std::filesystem::create_directories(dir);
  TinyModelOptions tiny;
  tiny.seed = 11;
  const std::string model = dir + "/tiny";
  KVCM_CHECK(WriteTinyModel(model, tiny).ok());
  std::printf(
      "tier_crash_bench: %d round(s), seed %llu, %d prompts/s%s, --disk-tier-sync-ms "
      "%d, %d client(s), the tiny model, disk tier in %s\n",
      args.rounds, static_cast<unsigned long long>(args.seed), args.rate,
      args.rate == 0 ? " (unpaced)" : "", args.sync_ms, args.clients, dir.c_str());
  std::mt19937_64 rng(args.seed);
  std::atomic<int> next_prompt{0};
  std::vector<Round> rounds;
  for (int r = 0; r < args.rounds; ++r) {
    // A stack and a disk tier of its own each round: the tier never fills, so that no slot
    // of a block written before the kill is reused before it is checked (the checks of lost
    // prompts store their blocks again).
    const std::string round_dir = absl::StrCat(dir, "/round-", r);
    std::filesystem::create_directories(round_dir);
    Stack stack(model, round_dir, args.sync_ms);
    Round round;
    round.kill_after = std::uniform_real_distribution<double>(2.0, 6.0)(rng);
    // The stream: each client sends the next prompt as soon as its last one is answered.
    std::atomic<bool> stop{false};
    std::mutex mu;
    std::vector<std::pair<int, absl::Time>> done;  // (prompt, completion time)
    std::vector<std::thread> clients;
    const double syncs_at_start = stack.Metrics({"kvcm_cache_manager_tier_syncs_total"})[0];
    const absl::Time start = absl::Now();
    std::atomic<int> sent{0};
    for (int c = 0; c < args.clients; ++c) {
      clients.emplace_back([&] {
        while (!stop.load()) {
          if (args.rate > 0) {
            const int k = sent.fetch_add(1);
            absl::SleepFor(start + absl::Seconds(k) / args.rate - absl::Now());
            if (stop.load()) break;
          }
          const int n = next_prompt.fetch_add(1);
          if (stack.Complete(Prompt(n), absl::Seconds(60)).has_value()) {
            const absl::Time now = absl::Now();
            std::lock_guard<std::mutex> lock(mu);
            done.emplace_back(n, now);
          }
        }
      });
    }
    absl::SleepFor(start + absl::Seconds(round.kill_after) - absl::Milliseconds(50) - absl::Now());
    const std::vector<double> at_kill = stack.Metrics(
        {"kvcm_cache_manager_tier_unsynced_writes", "kvcm_cache_manager_tier_held_blocks",
         "kvcm_cache_manager_tier_syncs_total", "kvcm_cache_manager_tier_stores_dropped_total"});
    round.unsynced_at_kill = at_kill[0];
    round.held_at_kill = at_kill[1];
    round.syncs = at_kill[2] - syncs_at_start;
    round.stores_dropped = at_kill[3];
    absl::SleepFor(start + absl::Seconds(round.kill_after) - absl::Now());
    const pid_t cache_manager = stack.CacheManagerPid();
    const absl::Time kill_time = absl::Now();
    KVCM_CHECK(::kill(cache_manager, SIGKILL) == 0);
    stop = true;
    std::vector<std::pair<int, absl::Time>> before;
    {
      std::lock_guard<std::mutex> lock(mu);
      for (const auto& [n, at] : done) {
        if (at < kill_time) before.emplace_back(n, at);
      }
    }
    // Requests in flight at the kill are sent again by the router to the new cache manager:
    // they complete after it, and are not counted.
    for (std::thread& t : clients) t.join();
    const absl::Time restart_deadline = absl::Now() + absl::Seconds(120);
    while (stack.CacheManagerPid() == cache_manager ||
           !stack.Complete("probe after a restart", absl::Seconds(10)).has_value()) {
      KVCM_CHECK(absl::Now() < restart_deadline) << "the cache manager did not come back";
      absl::SleepFor(absl::Milliseconds(20));
    }
    for (const auto& [n, at] : before) {
      const auto reply = stack.Complete(Prompt(n), absl::Seconds(60));
      KVCM_CHECK(reply.has_value()) << "prompt " << n << " failed after the restart";
      const auto [tokens, cached] = *reply;
      // Every full block but the one holding the last token (computed anyway).
      const int full = (tokens - 1) / 4 * 4;
      const double age = absl::ToDoubleSeconds(kill_time - at);
      ++round.completed;
      if (cached >= full) {
        ++round.recovered;
        round.youngest_recovered = std::min(round.youngest_recovered, age);
      } else {
        if (cached > 0) ++round.partial;
        round.oldest_lost = std::max(round.oldest_lost, age);
      }
    }
    std::printf(
        "round %d: SIGKILL at %.3f s (50 ms before: %.0f blocks held for stores, %.0f "
        "disk writes not synced, %.0f syncs since the start, %.0f stores dropped): %d "
        "prompts completed "
        "before it, %d found again whole, %d lost (%d in part); youngest found again "
        "%.3f s old, oldest lost %s\n",
        r, round.kill_after, round.held_at_kill, round.unsynced_at_kill, round.syncs,
        round.stores_dropped, round.completed, round.recovered, round.completed - round.recovered,
        round.partial, round.youngest_recovered,
        round.oldest_lost < 0 ? "none" : absl::StrFormat("%.3f s old", round.oldest_lost).c_str());
    std::fflush(stdout);
    rounds.push_back(round);
    stack.Stop();
    std::filesystem::remove_all(round_dir);
  }
  std::filesystem::remove_all(dir);

  int completed = 0, recovered = 0;
  double stores_dropped = 0;
  double youngest = std::numeric_limits<double>::infinity(), oldest_lost = -1;
  for (const Round& round : rounds) {
    completed += round.completed;
    stores_dropped += std::max(round.stores_dropped, 0.0);
    recovered += round.recovered;
    youngest = std::min(youngest, round.youngest_recovered);
    oldest_lost = std::max(oldest_lost, round.oldest_lost);
  }
  std::printf(
      "over %d rounds: %d prompts completed before a kill, %d found again whole, %d "
      "lost (stores dropped before the kills: %.0f)\n",
      args.rounds, completed, recovered, completed - recovered, stores_dropped);
  std::printf("youngest prompt found again: %.3f s before the kill\n", youngest);
  if (oldest_lost < 0) {
    std::printf("oldest prompt lost: none\n");
  } else {
    std::printf("oldest prompt lost: %.3f s before the kill\n", oldest_lost);
  }
  return 0;
}

}  // namespace
}  // namespace kvcm::bench

int main(int argc, char** argv) { return kvcm::bench::Main(argc, argv); }
