// kvcm-launch as a process: it starts the cache manager, the router and two executors of a
// tiny model, serves requests with the tokens of the model run alone, restarts an executor
// and the cache manager killed with SIGKILL, and at SIGTERM stops everything and removes
// its run directory. A process that cannot start fails the launch with its reason. Its ready
// line means the stack answers a generation request, however slowly the executors start.

#include <signal.h>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <random>
#include <regex>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/services/executor/executor_test_util.h"
#include "tests/support/http_client.h"
#include "tests/support/status_matchers.h"
#include "tests/support/subprocess.h"
#include "tests/support/wait_for.h"

namespace kvcm {
namespace {

using json = nlohmann::json;
using ::testing::HasSubstr;
using testing::HttpGet;
using testing::HttpPost;
using testing::Subprocess;
using testing::TempDir;

class LaunchProcessTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<TempDir> dir = TempDir::Create("kvcm-launch-test");
    ASSERT_THAT(dir, IsOk());
    dir_ = std::make_unique<TempDir>(std::move(*dir));
    model_dir_ = dir_->path() + "/tiny";
    ASSERT_THAT(testing::MakeTinyModel(model_dir_, /*seed=*/3), IsOk());
    absl::StatusOr<std::unique_ptr<executor::LlamaModel>> model =
        executor::LlamaModel::Load(model_dir_);
    ASSERT_THAT(model, IsOk());
    model_ = *std::move(model);
  }

  std::unique_ptr<Subprocess> Launch(std::vector<std::string> extra,
                                     const std::string& log = "launch.log") {
    Subprocess::Options options;
    options.argv = {testing::KvcmBinaryPath("kvcm-launch"),
                    "--model",
                    model_dir_,
                    "--port",
                    "0",
                    "--threads",
                    "1",
                    "--block-size",
                    "4",
                    "--heartbeat-timeout-ms",
                    "2000",
                    "--restart-backoff-ms",
                    "100"};
    options.argv.insert(options.argv.end(), extra.begin(), extra.end());
    options.output_path = dir_->path() + "/" + log;
    options.env = {"TMPDIR=" + dir_->path()};
    absl::StatusOr<std::unique_ptr<Subprocess>> started = Subprocess::Start(options);
    EXPECT_THAT(started, IsOk());
    return started.ok() ? *std::move(started) : nullptr;
  }

  // The pids the launcher reported for `name`, in order.
  static std::vector<pid_t> Pids(const std::string& output, const std::string& name) {
    std::vector<pid_t> pids;
    const std::regex started("kvcm-launch: started " + name + " \\(pid ([0-9]+)\\)");
    for (auto it = std::sregex_iterator(output.begin(), output.end(), started);
         it != std::sregex_iterator(); ++it) {
      pids.push_back(std::stoi((*it)[1]));
    }
    return pids;
  }

  std::vector<int32_t> Generate(const std::string& url, const std::string& text, int32_t n) {
    absl::StatusOr<testing::HttpResponse> reply = HttpPost(
        url + "/generate",
        json{{"inputs", text}, {"parameters", {{"max_new_tokens", n}, {"details", true}}}}.dump(),
        absl::Seconds(60));
    std::vector<int32_t> ids;
    EXPECT_TRUE(reply.ok() && reply->status == 200) << (reply.ok() ? reply->body : "");
    if (!reply.ok() || reply->status != 200) return ids;
    const json body = json::parse(reply->body);
    for (const json& t : body["details"]["tokens"]) ids.push_back(t["id"].get<int32_t>());
    return ids;
  }
  std::vector<int32_t> Reference(const std::string& text, int32_t n) const {
    std::vector<int32_t> prompt = {1};
    for (unsigned char c : text) prompt.push_back(3 + c);
    return testing::ReferenceAnswer(*model_, prompt, n);
  }
  // Until /info counts `executors`.
  static bool AwaitExecutors(const std::string& url, int executors) {
    return testing::WaitFor(
               [&] {
                 absl::StatusOr<testing::HttpResponse> info = HttpGet(url + "/info");
                 return info.ok() && info->status == 200 &&
                        json::parse(info->body)["executors"].get<int>() == executors;
               },
               absl::Seconds(30), "/info to count the executors")
        .ok();
  }

  std::unique_ptr<TempDir> dir_;
  std::string model_dir_;
  std::unique_ptr<executor::LlamaModel> model_;
};

TEST_F(LaunchProcessTest, ServesRestartsWhatDiesAndStopsEverythingAtSigterm) {
  std::unique_ptr<Subprocess> launch = Launch({"--executors", "2", "--num-blocks", "256"});
  ASSERT_NE(launch, nullptr);
  auto ready = launch->WaitForLine("kvcm-launch: ready http=(\\S+) executors=2 run_dir=(\\S+)",
                                   absl::Now() + absl::Seconds(60));
  ASSERT_THAT(ready, IsOk());
  const std::string url = (*ready)[1];
  const std::string run_dir = (*ready)[2];
  EXPECT_TRUE(std::filesystem::exists(run_dir + "/cache-manager.sock"));
  // Every process's lines come prefixed with its name.
  const std::string output = launch->Output();
  for (const char* name : {"[cache-manager] ", "[router] ", "[executor-0] ", "[executor-1] "}) {
    EXPECT_THAT(output, HasSubstr(name));
  }
  EXPECT_EQ(Generate(url, "launched", 6), Reference("launched", 6));

  // An executor killed with SIGKILL is started again and registers.
  const std::vector<pid_t> first = Pids(output, "executor-1");
  ASSERT_EQ(first.size(), 1u);
  ASSERT_EQ(::kill(first[0], SIGKILL), 0);
  ASSERT_THAT(launch->WaitForLine("kvcm-launch: executor-1 exited \\(killed by signal 9",
                                  absl::Now() + absl::Seconds(10)),
              IsOk());
  (void)testing::WaitFor([&] { return Pids(launch->Output(), "executor-1").size() >= 2; },
                         absl::Seconds(20), "executor-1 to be started again");
  ASSERT_EQ(Pids(launch->Output(), "executor-1").size(), 2u) << launch->Output();
  ASSERT_TRUE(AwaitExecutors(url, 2)) << launch->Output();
  EXPECT_EQ(Generate(url, "after an executor", 5), Reference("after an executor", 5));

  // So is the cache manager: the router and the executors move to its new pool.
  const std::vector<pid_t> cm = Pids(launch->Output(), "cache-manager");
  ASSERT_EQ(cm.size(), 1u);
  ASSERT_EQ(::kill(cm[0], SIGKILL), 0);
  (void)testing::WaitFor([&] { return Pids(launch->Output(), "cache-manager").size() >= 2; },
                         absl::Seconds(20), "the cache manager to be started again");
  ASSERT_EQ(Pids(launch->Output(), "cache-manager").size(), 2u) << launch->Output();
  EXPECT_EQ(Generate(url, "after the cache manager", 5), Reference("after the cache manager", 5))
      << launch->Output();

  // SIGTERM: everything stops, in order, and the run directory is gone.
  std::vector<pid_t> all;
  for (const char* name : {"cache-manager", "router", "executor-0", "executor-1"}) {
    const std::vector<pid_t> pids = Pids(launch->Output(), name);
    all.push_back(pids.back());
  }
  ASSERT_THAT(launch->Signal(SIGTERM), IsOk());
  absl::StatusOr<int> code = launch->Wait(absl::Seconds(60));
  ASSERT_THAT(code, IsOk()) << launch->Output();
  EXPECT_EQ(*code, 0) << launch->Output();
  const std::string log = launch->Output();
  const size_t router_exit = log.find("kvcm-launch: router exited");
  const size_t executor_exit = log.find("kvcm-launch: executor-0 exited");
  const size_t cm_exit = log.rfind("kvcm-launch: cache-manager exited");
  EXPECT_LT(router_exit, log.rfind("kvcm-launch: executor-0 exited")) << log;
  EXPECT_NE(executor_exit, std::string::npos);
  EXPECT_LT(log.rfind("kvcm-launch: executor-1 exited"), cm_exit) << log;
  for (pid_t pid : all) EXPECT_NE(::kill(pid, 0), 0) << "pid " << pid << " still runs";
  EXPECT_FALSE(std::filesystem::exists(run_dir));
  EXPECT_THAT(log, HasSubstr("kvcm-launch: stopped"));
}

// kvcm-launch's ready line means "answers a generation request now" (docs/operations.md,
// "kvcm-launch"). The executors run through a wrapper in a --bin-dir of the test's own that
// holds them at a gate the test opens, then sleeps a seeded delay: a request sent at the
// router's own ready line, with the gate shut, is forced to find no executor (503, what a
// client waiting for that line used to get), and one sent at once at the launcher's ready
// line is served with the model's tokens, whatever the delay and however many executors.
TEST_F(LaunchProcessTest, ARequestSentAtTheReadyLineIsServedHoweverSlowlyExecutorsStart) {
  const std::string bin = dir_->path() + "/bin";
  std::filesystem::create_directories(bin);
  for (const char* name : {"kvcm-cache-manager", "kvcm-router"}) {
    std::filesystem::create_symlink(testing::KvcmBinaryPath(name), bin + "/" + name);
  }
  const std::string gate = dir_->path() + "/gate";
  for (uint32_t seed = 1; seed <= 6; ++seed) {
    std::mt19937 rng(seed);
    const int delay_ms = std::uniform_int_distribution<int>(0, 1000)(rng);
    const int executors = 1 + static_cast<int>(seed % 2);
    std::cout << "seed " << seed << ": " << executors << " executor(s), each " << delay_ms
              << " ms after the gate opens" << std::endl;
    std::filesystem::remove(gate);
    {
      std::ofstream wrapper(bin + "/kvcm-executor", std::ios::trunc);
      wrapper << "#!/bin/sh\n"
              << "while [ ! -e '" << gate << "' ]; do sleep 0.02; done\n"
              << "sleep " << delay_ms / 1000 << "." << absl::StrFormat("%03d", delay_ms % 1000)
              << "\n"
              << "exec '" << testing::KvcmBinaryPath("kvcm-executor") << "' \"$@\"\n";
    }
    std::filesystem::permissions(bin + "/kvcm-executor", std::filesystem::perms::owner_all);

    std::unique_ptr<Subprocess> launch =
        Launch({"--executors", absl::StrCat(executors), "--num-blocks", "64", "--bin-dir", bin},
               absl::StrCat("launch-", seed, ".log"));
    ASSERT_NE(launch, nullptr);
    auto router =
        launch->WaitForLine("kvcm-router: ready http=(\\S+)", absl::Now() + absl::Seconds(60));
    ASSERT_THAT(router, IsOk());
    absl::StatusOr<testing::HttpResponse> early =
        HttpPost((*router)[1] + "/generate",
                 json{{"inputs", "too early"}, {"parameters", {{"max_new_tokens", 2}}}}.dump());
    ASSERT_THAT(early, IsOk()) << "\n" << launch->Output();
    EXPECT_EQ(early->status, 503) << early->body;
    EXPECT_THAT(early->body, HasSubstr("no executor is registered"));

    std::ofstream(gate).put('\n');
    auto ready =
        launch->WaitForLine(absl::StrCat("kvcm-launch: ready http=(\\S+) executors=", executors),
                            absl::Now() + absl::Seconds(60));
    ASSERT_THAT(ready, IsOk());
    EXPECT_EQ(Generate((*ready)[1], "at the ready line", 4), Reference("at the ready line", 4))
        << "seed " << seed << "\n"
        << launch->Output();

    ASSERT_THAT(launch->Signal(SIGTERM), IsOk());
    absl::StatusOr<int> code = launch->Wait(absl::Seconds(60));
    ASSERT_THAT(code, IsOk()) << launch->Output();
    EXPECT_EQ(*code, 0) << launch->Output();
  }
}

TEST_F(LaunchProcessTest, AProcessThatCannotStartFailsTheLaunchWithItsReason) {
  // --num-blocks 0 makes the cache manager refuse to start.
  std::unique_ptr<Subprocess> launch = Launch({"--cache-manager-arg=--num-blocks=0"});
  ASSERT_NE(launch, nullptr);
  absl::StatusOr<int> code = launch->Wait(absl::Seconds(30));
  ASSERT_THAT(code, IsOk()) << launch->Output();
  EXPECT_EQ(*code, 1);
  EXPECT_THAT(launch->Output(), HasSubstr("cache-manager failed before it was ready"));
  EXPECT_THAT(launch->Output(), HasSubstr("[cache-manager] "));
  // An unknown flag is refused before anything starts.
  std::unique_ptr<Subprocess> bad = Launch({"--typical-p", "0.5"});
  ASSERT_NE(bad, nullptr);
  code = bad->Wait(absl::Seconds(10));
  ASSERT_THAT(code, IsOk());
  EXPECT_EQ(*code, 2);
  EXPECT_THAT(bad->Output(), HasSubstr("unknown flag --typical-p"));
  EXPECT_THAT(bad->Output(), ::testing::Not(HasSubstr("started")));
}

}  // namespace
}  // namespace kvcm
