// Fault injection on the real stack (docs/RELIABILITY.md, "Fault injection"): kvcm-launch
// runs the cache manager, the router and two executors of a tiny model; clients send
// greedy requests for a bounded time while a seeded script kills (SIGKILL) and stops
// (SIGSTOP, then SIGCONT) the executors, the router and the cache manager, one fault at a
// time, and waits for the stack to serve again after each (kvcm-launch restarts what died).
//
// Checked: every request either completed with the tokens of the model run alone (a
// fault-free run) or got a clear error (an HTTP error with its JSON body, or a connection
// the killed router refused or dropped); no request hangs; the cache manager's block
// states sum to its capacity at every scrape; once the faults stop and the clients are
// idle, no block is in use, quarantined or draining; every fault recovered; and at
// SIGTERM every process ever started is gone, no socket or shared-memory object is left
// behind and the run directory's lock is free.
//
//   KVCM_FAULT_SECONDS   how long faults are injected (default 40)
//   KVCM_FAULT_SEED      the script's seed (default 20261202), printed to replay a run
//
// The figures (requests by outcome, faults by kind, recovery time p50/p99/max) are printed
// in one block at the end: docs/RELIABILITY.md has the command.

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <netinet/in.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <map>
#include <memory>
#include <random>
#include <regex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/base/mutex.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/services/executor/executor_test_util.h"
#include "tests/support/http_client.h"
#include "tests/support/subprocess.h"

namespace kvcm {
namespace {

using json = nlohmann::json;
using testing::HttpGet;
using testing::HttpPost;
using testing::Subprocess;
using testing::TempDir;

int64_t EnvOr(const char* name, int64_t fallback) {
  const char* value = std::getenv(name);
  int64_t parsed = 0;
  return value != nullptr && absl::SimpleAtoi(value, &parsed) ? parsed : fallback;
}

// A TCP port free now on 127.0.0.1, so that a restarted router binds the one its clients use.
int FreePort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof(address);
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) {
    if (fd >= 0) ::close(fd);
    return 0;
  }
  ::close(fd);
  return ntohs(address.sin_port);
}

std::set<std::string> DevShmEntries() {
  std::set<std::string> entries;
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm", error)) {
    entries.insert(entry.path().filename().string());
  }
  return entries;
}

// The value at `q` (0..1) of `values`, nearest rank.
double Quantile(std::vector<double> values, double q) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const size_t rank = static_cast<size_t>(std::ceil(q * static_cast<double>(values.size())));
  return values[std::min(values.size() - 1, rank == 0 ? 0 : rank - 1)];
}

// Requests by outcome, from the client threads.
struct Tally {
  Mutex mutex;
  std::map<std::string, int> outcomes ABSL_GUARDED_BY(mutex);
  std::vector<std::string> bad ABSL_GUARDED_BY(mutex);  // neither completed nor a clear error
  std::map<std::string, std::string> example ABSL_GUARDED_BY(mutex);  // an error of each kind
};

class FaultInjectionTest : public ::testing::Test {
 protected:
  static constexpr int kNumBlocks = 256;
  static constexpr int kExecutors = 2;
  static constexpr int kClients = 4;

  void SetUp() override {
    absl::StatusOr<TempDir> dir = TempDir::Create("kvcm-fault-test");
    ASSERT_TRUE(dir.ok());
    dir_ = std::make_unique<TempDir>(std::move(*dir));
    model_dir_ = dir_->path() + "/tiny";
    ASSERT_TRUE(testing::MakeTinyModel(model_dir_, /*seed=*/11).ok());
    absl::StatusOr<std::unique_ptr<LlamaModel>> model = LlamaModel::Load(model_dir_);
    ASSERT_TRUE(model.ok()) << model.status();
    model_ = *std::move(model);
  }

  // The tokens of the model run alone, cut after an end-of-sequence id as the router does.
  std::vector<int32_t> Reference(const std::string& text, int32_t n) const {
    std::vector<int32_t> prompt = {1};
    for (unsigned char c : text) prompt.push_back(3 + c);
    std::vector<int32_t> tokens = testing::ReferenceGreedy(*model_, prompt, n);
    const auto& eos = model_->config().eos_token_ids;
    for (size_t i = 0; i < tokens.size(); ++i) {
      if (std::find(eos.begin(), eos.end(), tokens[i]) != eos.end()) {
        tokens.resize(i + 1);
        break;
      }
    }
    return tokens;
  }

  // The last pid kvcm-launch reported for `name`; 0 before the first.
  pid_t CurrentPid(const std::string& name) const {
    const std::string output = launch_->Output();
    const std::regex started("kvcm-launch: started " + name + " \\(pid ([0-9]+)\\)");
    pid_t pid = 0;
    for (auto it = std::sregex_iterator(output.begin(), output.end(), started);
         it != std::sregex_iterator(); ++it) {
      pid = std::stoi((*it)[1]);
    }
    return pid;
  }
  std::vector<pid_t> AllPids() const {
    const std::string output = launch_->Output();
    const std::regex started("kvcm-launch: started \\S+ \\(pid ([0-9]+)\\)");
    std::vector<pid_t> pids;
    for (auto it = std::sregex_iterator(output.begin(), output.end(), started);
         it != std::sregex_iterator(); ++it) {
      pids.push_back(std::stoi((*it)[1]));
    }
    return pids;
  }

  // The cache manager's metrics address, from kvcm-launch's Prometheus target file.
  std::string CacheManagerMetricsUrl() const {
    const std::string text = testing::ReadFileOrEmpty(targets_file_);
    const json targets = json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (!targets.is_array()) return "";
    for (const json& group : targets) {
      if (group.value("labels", json::object()).value("__kvcm_component", "") ==
              "cache-manager" &&
          group.contains("targets") && !group["targets"].empty()) {
        return absl::StrCat("http://", group["targets"][0].get<std::string>(), "/metrics");
      }
    }
    return "";
  }

  // One scrape of the cache manager: blocks by state and the capacity; nullopt when it
  // cannot be scraped (it is down, stopped or restarting).
  struct Scrape {
    std::map<std::string, double> blocks;
    double capacity = -1;
  };
  std::optional<Scrape> ScrapeCacheManager() const {
    const std::string url = CacheManagerMetricsUrl();
    if (url.empty()) return std::nullopt;
    absl::StatusOr<testing::HttpResponse> reply = HttpGet(url, absl::Seconds(1));
    if (!reply.ok() || reply->status != 200) return std::nullopt;
    Scrape scrape;
    const std::regex by_state("^kvcm_cache_blocks\\{state=\"([a-z_]+)\"\\} ([0-9.e+]+)$");
    for (absl::string_view line : absl::StrSplit(reply->body, '\n')) {
      const std::string text(line);
      std::smatch m;
      if (std::regex_match(text, m, by_state)) {
        scrape.blocks[m[1]] = std::stod(m[2]);
      } else if (absl::StartsWith(text, "kvcm_cache_capacity_blocks ")) {
        scrape.capacity = std::stod(text.substr(text.find(' ') + 1));
      }
    }
    if (scrape.capacity < 0 || scrape.blocks.empty()) return std::nullopt;
    return scrape;
  }

  // What one request ended with: "completed", or the error class a client sees.
  struct Outcome {
    std::string kind;
    bool acceptable = true;
    std::string detail;
  };
  Outcome Request(const std::string& text, int32_t n, absl::Duration timeout) const {
    absl::StatusOr<testing::HttpResponse> reply = HttpPost(
        url_ + "/generate",
        json{{"inputs", text}, {"parameters", {{"max_new_tokens", n}, {"details", true}}}}.dump(),
        timeout);
    if (!reply.ok()) {
      const std::string message(reply.status().message());
      if (absl::StartsWith(message, "connect to")) return {"refused (router down)", true, message};
      if (absl::StrContains(message, "Resource temporarily unavailable")) {
        return {"timed out", false, message};
      }
      if (absl::IsInternal(reply.status())) {
        return {"closed without a response (router killed)", true, message};
      }
      return {"connection lost (router killed)", true, message};
    }
    const json body = json::parse(reply->body, nullptr, /*allow_exceptions=*/false);
    if (reply->status != 200) {
      const bool clear = body.is_object() && body.contains("error") && body["error"].is_string();
      return {absl::StrCat("HTTP ", reply->status, clear ? " " + body.value("error_type", "") : ""),
              clear, reply->body.substr(0, 300)};
    }
    std::vector<int32_t> ids;
    if (body.is_object() && body.contains("details")) {
      for (const json& t : body["details"]["tokens"]) ids.push_back(t["id"].get<int32_t>());
    }
    auto known = references_.find({text, n});
    if (ids != (known != references_.end() ? known->second : Reference(text, n))) {
      return {"WRONG TOKENS", false, absl::StrCat("'", text, "' n=", n, ": ", reply->body)};
    }
    return {"completed", true, ""};
  }

  std::unique_ptr<TempDir> dir_;
  std::string model_dir_;
  std::unique_ptr<LlamaModel> model_;
  // Reference() of the load's prompts, computed before the load starts and read-only after.
  std::map<std::pair<std::string, int32_t>, std::vector<int32_t>> references_;
  std::unique_ptr<Subprocess> launch_;
  std::string url_;
  std::string targets_file_;
};

TEST_F(FaultInjectionTest, KillsAndStopsOfEveryProcessLoseNoRequestAndNoBlock) {
  const int64_t seconds = EnvOr("KVCM_FAULT_SECONDS", 40);
  const uint64_t seed = static_cast<uint64_t>(EnvOr("KVCM_FAULT_SEED", 20261202));
  std::cout << "fault injection: seed " << seed << ", " << seconds
            << " s of faults (KVCM_FAULT_SEED, KVCM_FAULT_SECONDS)" << std::endl;
  const std::set<std::string> shm_before = DevShmEntries();

  const int port = FreePort();
  ASSERT_GT(port, 0);
  const std::string run_dir = dir_->path() + "/run";
  targets_file_ = dir_->path() + "/targets.json";
  Subprocess::Options options;
  options.argv = {testing::KvcmBinaryPath("kvcm-launch"),
                  "--model", model_dir_,
                  "--port", std::to_string(port),
                  "--run-dir", run_dir,
                  "--executors", std::to_string(kExecutors),
                  "--num-blocks", std::to_string(kNumBlocks),
                  "--threads", "1",
                  "--block-size", "4",
                  "--heartbeat-timeout-ms", "2000",
                  "--restart-backoff-ms", "100",
                  "--prometheus-targets", targets_file_};
  options.output_path = dir_->path() + "/launch.log";
  options.env = {"TMPDIR=" + dir_->path()};
  absl::StatusOr<std::unique_ptr<Subprocess>> started = Subprocess::Start(options);
  ASSERT_TRUE(started.ok()) << started.status();
  launch_ = *std::move(started);
  auto ready = launch_->WaitForLine("kvcm-launch: ready http=(\\S+) executors=2",
                                    absl::Now() + absl::Seconds(60));
  ASSERT_TRUE(ready.ok()) << ready.status() << "\n" << testing::Tail(launch_->Output());
  url_ = (*ready)[1];

  // The prompts: a few sharing a prefix (so prefix-cache hits happen under faults too).
  std::vector<std::pair<std::string, int32_t>> prompts;
  for (int i = 0; i < 12; ++i) {
    prompts.push_back({absl::StrCat(i % 2 == 0 ? "a shared system prompt, then " : "", "request ",
                                    i, " of the fault run"),
                       8 + 4 * (i % 4)});
  }
  for (const auto& prompt : prompts) references_[prompt] = Reference(prompt.first, prompt.second);
  references_[{"probe after a fault", 2}] = Reference("probe after a fault", 2);
  // A fault-free run first: the stack serves every prompt with the model's own tokens.
  for (const auto& [text, n] : prompts) {
    const Outcome outcome = Request(text, n, absl::Seconds(60));
    ASSERT_EQ(outcome.kind, "completed") << outcome.detail << "\n" << testing::Tail(launch_->Output());
  }

  std::atomic<bool> stop_load{false};
  Tally tally;
  std::vector<std::thread> clients;
  for (int c = 0; c < kClients; ++c) {
    clients.emplace_back([&, c] {
      std::mt19937_64 rng(seed * 31 + static_cast<uint64_t>(c));
      while (!stop_load.load()) {
        const auto& [text, n] = prompts[rng() % prompts.size()];
        const Outcome outcome = Request(text, n, absl::Seconds(60));
        MutexLock lock(&tally.mutex);
        ++tally.outcomes[outcome.kind];
        if (!outcome.acceptable) tally.bad.push_back(outcome.kind + ": " + outcome.detail);
        if (!outcome.detail.empty()) tally.example.try_emplace(outcome.kind, outcome.detail);
        if (!outcome.acceptable || outcome.kind != "completed") {
          // A refused or dropped connection: back off a little, as a client would.
          absl::SleepFor(absl::Milliseconds(50));
        }
      }
    });
  }

  // The scraper: block states sum to capacity at every scrape the cache manager answers.
  std::atomic<bool> stop_scrape{false};
  int scrapes = 0, unanswered = 0;
  std::vector<std::string> violations;
  std::thread scraper([&] {
    while (!stop_scrape.load()) {
      std::optional<Scrape> scrape = ScrapeCacheManager();
      if (!scrape) {
        ++unanswered;
      } else {
        ++scrapes;
        double sum = 0;
        for (const auto& [state, count] : scrape->blocks) sum += count;
        if (sum != scrape->capacity || scrape->capacity != kNumBlocks) {
          violations.push_back(absl::StrCat("states sum to ", sum, ", capacity ",
                                            scrape->capacity));
        }
      }
      absl::SleepFor(absl::Milliseconds(200));
    }
  });

  // The script: one fault at a time, then until the stack serves again.
  struct Fault {
    std::string process;
    bool kill;  // SIGKILL; else SIGSTOP for a while, then SIGCONT
  };
  const std::vector<Fault> kinds = {
      {"executor-0", true}, {"executor-1", true},  {"executor-0", false}, {"executor-1", false},
      {"router", true},     {"router", false},     {"cache-manager", true},
      {"cache-manager", false}};
  std::mt19937_64 script(seed);
  std::map<std::string, int> injected;
  std::map<std::string, std::vector<double>> recovery_ms;  // by fault
  std::vector<std::string> unrecovered;
  const absl::Time end = absl::Now() + absl::Seconds(seconds);
  while (absl::Now() < end) {
    const Fault& fault = kinds[script() % kinds.size()];
    const pid_t pid = CurrentPid(fault.process);
    ASSERT_GT(pid, 0) << fault.process;
    const std::string name = absl::StrCat(fault.kill ? "SIGKILL " : "SIGSTOP ", fault.process);
    // Recovery counts from the kill, or from the SIGCONT that ends a stop.
    absl::Time at = absl::Now();
    if (fault.kill) {
      ASSERT_EQ(::kill(pid, SIGKILL), 0) << name;
    } else {
      ASSERT_EQ(::kill(pid, SIGSTOP), 0) << name;
      absl::SleepFor(absl::Milliseconds(500 + static_cast<int64_t>(script() % 2500)));
      ::kill(pid, SIGCONT);
      at = absl::Now();
    }
    ++injected[name];
    // Recovered: a request completes with the right tokens (a short one, probed every 100 ms).
    const absl::Time deadline = at + absl::Seconds(60);
    bool recovered = false;
    while (absl::Now() < deadline) {
      if (Request("probe after a fault", 2, absl::Seconds(10)).kind == "completed") {
        recovered = true;
        break;
      }
      absl::SleepFor(absl::Milliseconds(100));
    }
    if (!recovered) {
      unrecovered.push_back(name);
      break;
    }
    recovery_ms[name].push_back(absl::ToDoubleMilliseconds(absl::Now() - at));
    absl::SleepFor(absl::Milliseconds(300 + static_cast<int64_t>(script() % 1700)));
  }
  stop_load = true;
  for (std::thread& t : clients) t.join();

  // Idle: every block returns to free or cached within the lease bound.
  bool idle = false;
  std::optional<Scrape> last;
  const absl::Time idle_deadline = absl::Now() + absl::Seconds(30);
  while (absl::Now() < idle_deadline) {
    last = ScrapeCacheManager();
    if (last && last->blocks["in_use"] == 0 && last->blocks["quarantined"] == 0 &&
        last->blocks["draining"] == 0) {
      idle = true;
      break;
    }
    absl::SleepFor(absl::Milliseconds(200));
  }
  stop_scrape = true;
  scraper.join();

  int requests = 0;
  std::string by_outcome;
  {
    MutexLock lock(&tally.mutex);
    for (const auto& [kind, count] : tally.outcomes) {
      requests += count;
      absl::StrAppend(&by_outcome, "\n    ", kind, ": ", count);
      if (auto it = tally.example.find(kind); it != tally.example.end()) {
        absl::StrAppend(&by_outcome, " (e.g. ", it->second, ")");
      }
    }
  }
  std::string by_fault;
  int faults = 0;
  std::vector<double> all_recoveries;
  for (const auto& [name, count] : injected) {
    faults += count;
    const std::vector<double>& times = recovery_ms[name];
    absl::StrAppend(&by_fault, "\n    ", name, ": ", count, ", recovered in ",
                    absl::StrFormat("%.0f", Quantile(times, 0.5)), " ms (median), ",
                    absl::StrFormat("%.0f", Quantile(times, 1.0)), " ms (max)");
    all_recoveries.insert(all_recoveries.end(), times.begin(), times.end());
  }
  std::cout << "fault injection: seed " << seed << ", " << seconds << " s, " << kClients
            << " clients, " << kExecutors << " executors, " << kNumBlocks << " blocks\n"
            << "  requests: " << requests << by_outcome << "\n"
            << "  faults: " << faults << by_fault << "\n"
            << "  recovery (the kill or the SIGCONT to the next correct reply), ms: p50 "
            << absl::StrFormat("%.0f", Quantile(all_recoveries, 0.5)) << ", p99 "
            << absl::StrFormat("%.0f", Quantile(all_recoveries, 0.99)) << ", max "
            << absl::StrFormat("%.0f", Quantile(all_recoveries, 1.0)) << "\n"
            << "  scrapes: " << scrapes << " answered, " << unanswered
            << " unanswered (cache manager down or stopped), " << violations.size()
            << " with states not summing to capacity" << std::endl;

  {
    MutexLock lock(&tally.mutex);
    EXPECT_TRUE(tally.bad.empty()) << tally.bad.size() << " requests neither completed nor got "
                                   << "a clear error; the first: " << tally.bad.front();
    EXPECT_GT(tally.outcomes["completed"], 0);
  }
  EXPECT_TRUE(unrecovered.empty()) << "no correct reply within 60 s after " << unrecovered.front()
                                   << "\n" << testing::Tail(launch_->Output(), 8000);
  EXPECT_GT(faults, 0);
  EXPECT_TRUE(violations.empty()) << violations.front();
  EXPECT_TRUE(idle) << "blocks still held once idle: in_use "
                    << (last ? last->blocks["in_use"] : -1) << ", quarantined "
                    << (last ? last->blocks["quarantined"] : -1) << ", draining "
                    << (last ? last->blocks["draining"] : -1);

  // SIGTERM: every process ever started is gone, nothing is left behind.
  const std::vector<pid_t> pids = AllPids();
  ASSERT_TRUE(launch_->Signal(SIGTERM).ok());
  absl::StatusOr<int> code = launch_->Wait(absl::Seconds(60));
  ASSERT_TRUE(code.ok()) << testing::Tail(launch_->Output(), 8000);
  EXPECT_EQ(*code, 0) << testing::Tail(launch_->Output(), 8000);
  for (pid_t pid : pids) EXPECT_NE(::kill(pid, 0), 0) << "pid " << pid << " still runs";
  std::vector<std::string> left;
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator(run_dir, error)) {
    const std::string name = entry.path().filename().string();
    // The lock file stays by design (services/cache_manager/run_directory.cc): it must be
    // free, so that the next cache manager starts.
    if (name == "cache-manager.lock") {
      const int fd = ::open(entry.path().c_str(), O_RDWR | O_CLOEXEC);
      EXPECT_GE(fd, 0);
      EXPECT_EQ(::flock(fd, LOCK_EX | LOCK_NB), 0) << "the lock is still held";
      if (fd >= 0) ::close(fd);
      continue;
    }
    left.push_back(name);
  }
  EXPECT_TRUE(left.empty()) << "left in the run directory: " << absl::StrJoin(left, ", ");
  std::vector<std::string> new_shm;
  for (const std::string& entry : DevShmEntries()) {
    if (!shm_before.contains(entry) && absl::StrContains(entry, "kvcm")) new_shm.push_back(entry);
  }
  EXPECT_TRUE(new_shm.empty()) << "left in /dev/shm: " << absl::StrJoin(new_shm, ", ");
}

}  // namespace
}  // namespace kvcm
