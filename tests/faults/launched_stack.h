#pragma once

// The real stack of one node as kvcm-launch starts it (the cache manager, the router and
// the executors of a tiny model), for the tests that run it under load while processes die:
// tests/faults/fault_injection_test.cc and tests/faults/soak_test.cc (docs/RELIABILITY.md,
// "Fault injection" and "Soak"). Test support only.

#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <regex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/services/executor/executor_test_util.h"
#include "tests/support/http_client.h"
#include "tests/support/status_matchers.h"
#include "tests/support/subprocess.h"
#include "tests/support/wait_for.h"

namespace kvcm::faults {

inline int64_t EnvOr(const char* name, int64_t fallback) {
  const char* value = std::getenv(name);
  int64_t parsed = 0;
  return value != nullptr && absl::SimpleAtoi(value, &parsed) ? parsed : fallback;
}

// A TCP port free now on 127.0.0.1, so that a restarted router binds the one its clients use.
inline int FreePort() {
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

inline std::set<std::string> DevShmEntries() {
  std::set<std::string> entries;
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm", error)) {
    entries.insert(entry.path().filename().string());
  }
  return entries;
}

// The value at `q` (0..1) of `values`, nearest rank.
inline double Quantile(std::vector<double> values, double q) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const size_t rank = static_cast<size_t>(std::ceil(q * static_cast<double>(values.size())));
  return values[std::min(values.size() - 1, rank == 0 ? 0 : rank - 1)];
}

// What one request ended with: "completed", or the error class a client sees.
struct Outcome {
  std::string kind;
  bool acceptable = true;
  std::string detail;
};

// The outcome of a request that got no HTTP response, or one with a status other than 200:
// a clear error (a refused or dropped connection, an HTTP error with its JSON body, TGI's
// {"error": "..."} or OpenAI's {"error": {"message": "..."}}) or not (a timeout: the request
// hung); nullopt for a 200, which the caller checks.
inline std::optional<Outcome> FailureOf(const absl::StatusOr<testing::HttpResponse>& reply) {
  using json = nlohmann::json;
  if (!reply.ok()) {
    const std::string message(reply.status().message());
    if (absl::StartsWith(message, "connect to")) {
      return Outcome{"refused (router down)", true, message};
    }
    if (absl::StrContains(message, "Resource temporarily unavailable")) {
      return Outcome{"timed out", false, message};
    }
    if (absl::IsInternal(reply.status())) {
      return Outcome{"closed without a response (router killed)", true, message};
    }
    return Outcome{"connection lost (router killed)", true, message};
  }
  if (reply->status == 200) return std::nullopt;
  const json body = json::parse(reply->body, nullptr, /*allow_exceptions=*/false);
  const bool tgi = body.is_object() && body.contains("error") && body["error"].is_string();
  const bool openai = body.is_object() && body.contains("error") && body["error"].is_object() &&
                      body["error"].contains("message") && body["error"]["message"].is_string();
  const std::string type = tgi      ? " " + body.value("error_type", "")
                           : openai ? " " + body["error"].value("type", "")
                                    : "";
  return Outcome{absl::StrCat("HTTP ", reply->status, type), tgi || openai,
                 reply->body.substr(0, 300)};
}

class LaunchedStackTest : public ::testing::Test {
 protected:
  using json = nlohmann::json;

  // `temp_prefix`: the name of the test's temporary directory.
  explicit LaunchedStackTest(std::string temp_prefix) : temp_prefix_(std::move(temp_prefix)) {}

  void SetUp() override {
    absl::StatusOr<testing::TempDir> dir = testing::TempDir::Create(temp_prefix_);
    ASSERT_THAT(dir, IsOk());
    dir_ = std::make_unique<testing::TempDir>(std::move(*dir));
    model_dir_ = dir_->path() + "/tiny";
    ASSERT_THAT(testing::MakeTinyModel(model_dir_, /*seed=*/11), IsOk());
    absl::StatusOr<std::unique_ptr<executor::LlamaModel>> model =
        executor::LlamaModel::Load(model_dir_);
    ASSERT_THAT(model, IsOk());
    model_ = *std::move(model);
  }

  // Starts kvcm-launch with `executors` executors of the tiny model and a pool of
  // `num_blocks` blocks of 4 tokens, `extra` flags after the common ones, and waits until it
  // is ready: url_ is then the router's.
  void Launch(int executors, int num_blocks, const std::vector<std::string>& extra = {}) {
    const int port = FreePort();
    ASSERT_GT(port, 0);
    run_dir_ = dir_->path() + "/run";
    targets_file_ = dir_->path() + "/targets.json";
    testing::Subprocess::Options options;
    options.argv = {testing::KvcmBinaryPath("kvcm-launch"),
                    "--model",
                    model_dir_,
                    "--port",
                    std::to_string(port),
                    "--run-dir",
                    run_dir_,
                    "--executors",
                    std::to_string(executors),
                    "--num-blocks",
                    std::to_string(num_blocks),
                    "--threads",
                    "1",
                    "--block-size",
                    "4",
                    "--heartbeat-timeout-ms",
                    "2000",
                    "--restart-backoff-ms",
                    "100",
                    "--prometheus-targets",
                    targets_file_};
    options.argv.insert(options.argv.end(), extra.begin(), extra.end());
    options.argv.insert(options.argv.begin(), launch_wrapper_.begin(), launch_wrapper_.end());
    options.output_path = dir_->path() + "/launch.log";
    // A second Launch (a restart) must not find the first one's ready line.
    std::filesystem::remove(options.output_path);
    options.env = {"TMPDIR=" + dir_->path()};
    absl::StatusOr<std::unique_ptr<testing::Subprocess>> started =
        testing::Subprocess::Start(options);
    ASSERT_THAT(started, IsOk());
    launch_ = *std::move(started);
    auto ready =
        launch_->WaitForLine(absl::StrCat("kvcm-launch: ready http=(\\S+) executors=", executors),
                             absl::Now() + absl::Seconds(60));
    ASSERT_THAT(ready, IsOk()) << "\n" << testing::Tail(launch_->Output());
    url_ = (*ready)[1];
  }

  // The tokens of the model run alone, cut after an end-of-sequence id as the router does.
  std::vector<int32_t> Reference(const std::string& text, int32_t n) const {
    std::vector<int32_t> prompt = {1};
    for (unsigned char c : text) prompt.push_back(3 + c);
    return testing::ReferenceAnswer(*model_, prompt, n);
  }
  // references_'s entry for the prompt, else Reference() of it.
  std::vector<int32_t> KnownReference(const std::string& text, int32_t n) const {
    auto known = references_.find({text, n});
    return known != references_.end() ? known->second : Reference(text, n);
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
      if (group.value("labels", json::object()).value("__kvcm_component", "") == "cache-manager" &&
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
    absl::StatusOr<testing::HttpResponse> reply = testing::HttpGet(url, absl::Seconds(1));
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

  // Until no block is in use, quarantined or draining (within `timeout`); the last scrape.
  bool AwaitIdle(absl::Duration timeout, std::optional<Scrape>* last) const {
    return testing::WaitFor(
               [&] {
                 *last = ScrapeCacheManager();
                 return *last && (*last)->blocks["in_use"] == 0 &&
                        (*last)->blocks["quarantined"] == 0 && (*last)->blocks["draining"] == 0;
               },
               timeout, "the blocks to be idle")
        .ok();
  }

  // POST /generate (TGI): completed with the reference's tokens, or a clear error.
  Outcome Request(const std::string& text, int32_t n, absl::Duration timeout) const {
    absl::StatusOr<testing::HttpResponse> reply = testing::HttpPost(
        url_ + "/generate",
        json{{"inputs", text}, {"parameters", {{"max_new_tokens", n}, {"details", true}}}}.dump(),
        timeout);
    if (std::optional<Outcome> failure = FailureOf(reply)) return *failure;
    const json body = json::parse(reply->body, nullptr, /*allow_exceptions=*/false);
    std::vector<int32_t> ids;
    if (body.is_object() && body.contains("details")) {
      for (const json& t : body["details"]["tokens"]) ids.push_back(t["id"].get<int32_t>());
    }
    if (ids != KnownReference(text, n)) {
      return {"WRONG TOKENS", false, absl::StrCat("'", text, "' n=", n, ": ", reply->body)};
    }
    return {"completed", true, ""};
  }

  // SIGTERM to kvcm-launch: it exits 0, every process ever started is gone, no socket or
  // shared-memory object is left behind (of those not in `shm_before`) and the run
  // directory's lock is free.
  void ExpectCleanShutdown(const std::set<std::string>& shm_before) {
    const std::vector<pid_t> pids = AllPids();
    ASSERT_THAT(launch_->Signal(SIGTERM), IsOk());
    absl::StatusOr<int> code = launch_->Wait(absl::Seconds(60));
    ASSERT_THAT(code, IsOk()) << testing::Tail(launch_->Output(), 8000);
    EXPECT_EQ(*code, 0) << testing::Tail(launch_->Output(), 8000);
    for (pid_t pid : pids) EXPECT_NE(::kill(pid, 0), 0) << "pid " << pid << " still runs";
    std::vector<std::string> left;
    std::error_code error;
    for (const auto& entry : std::filesystem::directory_iterator(run_dir_, error)) {
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

  const std::string temp_prefix_;
  std::unique_ptr<testing::TempDir> dir_;
  std::string model_dir_;
  std::unique_ptr<executor::LlamaModel> model_;
  // Reference() of the load's prompts, computed before the load starts and read-only after.
  std::map<std::pair<std::string, int32_t>, std::vector<int32_t>> references_;
  std::unique_ptr<testing::Subprocess> launch_;
  // Set before Launch: a command kvcm-launch runs under, which execs it in its own process
  // (e.g. {"prlimit", "--nofile=512:512", "--"}: every process of the stack inherits it).
  std::vector<std::string> launch_wrapper_;
  std::string url_;
  std::string run_dir_;
  std::string targets_file_;
};

}  // namespace kvcm::faults
