// kvcm-launch's command line: its own flags, flags routed to the process that takes them,
// pass-through, and a clear error for anything else.

#include "tools/launch/launch_options.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/status_matchers.h"

namespace kvcm::launch {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(LaunchOptionsTest, RoutesEachFlagToTheProcessThatTakesIt) {
  absl::StatusOr<LaunchOptions> options = ParseLaunchOptions(
      {"--model", "/m", "--executors=3", "--num-blocks", "4096", "--port=8080",
       "--max_input_tokens", "512", "--threads", "4", "--router-arg=--max-running=8",
       "--cache-manager-arg=--tcp-allow-remote", "--allowed-hosts", "kvcm.example,[::1]"});
  ASSERT_THAT(options, IsOk());
  EXPECT_EQ(options->model, "/m");
  EXPECT_EQ(options->executors, 3);
  EXPECT_TRUE(options->pool_sized);
  EXPECT_THAT(options->cache_manager_args, ElementsAre("--num-blocks=4096", "--tcp-allow-remote"));
  EXPECT_THAT(options->router_args,
              ElementsAre("--port=8080", "--max-input-tokens=512", "--max-running=8",
                          "--allowed-hosts=kvcm.example,[::1]"));
  EXPECT_THAT(options->executor_args, ElementsAre("--threads=4"));
}

TEST(LaunchOptionsTest, RoutesTheVllmEventFlagsToTheCacheManager) {
  absl::StatusOr<LaunchOptions> options =
      ParseLaunchOptions({"--model=/m", "--kv-events-endpoint", "tcp://127.0.0.1:5557",
                          "--kv-events-replay-endpoint=tcp://127.0.0.1:5558", "--kv-events-topic",
                          "kv@a@m", "--kv-events-buffer-steps=500"});
  ASSERT_THAT(options, IsOk());
  EXPECT_THAT(options->cache_manager_args,
              ElementsAre("--kv-events-endpoint=tcp://127.0.0.1:5557",
                          "--kv-events-replay-endpoint=tcp://127.0.0.1:5558",
                          "--kv-events-topic=kv@a@m", "--kv-events-buffer-steps=500"));
  EXPECT_TRUE(options->router_args.empty());
  EXPECT_THAT(LaunchUsage(), HasSubstr("--kv-events-endpoint"));
}

TEST(LaunchOptionsTest, RoutesTheTierFlagsToTheCacheManager) {
  absl::StatusOr<LaunchOptions> options = ParseLaunchOptions(
      {"--model=/m", "--host-tier-bytes", "64GiB", "--disk-tier-dir=/var/kvcm/tier",
       "--disk-tier-bytes", "1TiB", "--tier-mover-threads=2", "--tier-load-timeout-ms", "500",
       "--disk-tier-direct-io", "--disk-tier-sync-ms", "250", "--disk-tier-read-depth=8",
       "--num-blocks=100"});
  ASSERT_THAT(options, IsOk());
  EXPECT_THAT(
      options->cache_manager_args,
      ElementsAre("--host-tier-bytes=64GiB", "--disk-tier-dir=/var/kvcm/tier",
                  "--disk-tier-bytes=1TiB", "--tier-mover-threads=2", "--tier-load-timeout-ms=500",
                  "--disk-tier-direct-io", "--disk-tier-sync-ms=250", "--disk-tier-read-depth=8",
                  "--num-blocks=100"));
  EXPECT_TRUE(options->router_args.empty());
  EXPECT_TRUE(options->executor_args.empty());
  const std::string usage = LaunchUsage();
  for (const char* flag :
       {"--host-tier-bytes", "--disk-tier-dir", "--disk-tier-bytes", "--tier-mover-threads",
        "--tier-load-timeout-ms", "--disk-tier-direct-io[bool]", "--disk-tier-sync-ms",
        "--disk-tier-read-depth"}) {
    EXPECT_THAT(usage, HasSubstr(flag));
  }

  // The boolean one also with a value, or turned off as Abseil spells it.
  options = ParseLaunchOptions({"--model=/m", "--disk-tier-direct-io=false"});
  ASSERT_THAT(options, IsOk());
  EXPECT_THAT(options->cache_manager_args, ElementsAre("--disk-tier-direct-io=false"));
  options = ParseLaunchOptions({"--model=/m", "--nodisk-tier-direct-io"});
  ASSERT_THAT(options, IsOk());
  EXPECT_THAT(options->cache_manager_args, ElementsAre("--nodisk-tier-direct-io"));
  EXPECT_THAT(ParseLaunchOptions({"--model=/m", "--nodisk-tier-direct-io=true"}),
              StatusIs(absl::StatusCode::kInvalidArgument));
  // Only boolean flags have a --no form.
  EXPECT_THAT(ParseLaunchOptions({"--model=/m", "--nohost-tier-bytes"}),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(LaunchOptionsTest, DefaultsAndErrorsNameTheFlag) {
  absl::StatusOr<LaunchOptions> plain = ParseLaunchOptions({"--model=/m"});
  ASSERT_THAT(plain, IsOk());
  EXPECT_EQ(plain->executors, 1);
  EXPECT_FALSE(plain->pool_sized);   // the launcher then asks for kDefaultPoolBytes
  EXPECT_FALSE(plain->threads_set);  // and gives each executor ExecutorThreads
  EXPECT_TRUE(plain->run_dir.empty());

  struct Bad {
    std::vector<std::string> args;
    const char* says;
  };
  const Bad cases[] = {
      {{}, "--model is required"},
      {{"--model"}, "--model needs a value"},
      {{"--model=/m", "--executors=0"}, "--executors must be an integer >= 1"},
      {{"--model=/m", "--executors=two"}, "got \"two\""},
      {{"--model=/m", "--typical-p=0.5"}, "unknown flag --typical-p"},
      {{"--model=/m", "stray"}, "unexpected argument \"stray\""},
  };
  for (const Bad& bad : cases) {
    absl::StatusOr<LaunchOptions> parsed = ParseLaunchOptions(bad.args);
    ASSERT_FALSE(parsed.ok()) << bad.says;
    EXPECT_TRUE(absl::IsInvalidArgument(parsed.status()));
    EXPECT_THAT(std::string(parsed.status().message()), HasSubstr(bad.says));
  }
  // The unknown-flag error says how to pass it anyway.
  EXPECT_THAT(std::string(ParseLaunchOptions({"--model=/m", "--x=1"}).status().message()),
              HasSubstr("--cache-manager-arg="));
  EXPECT_THAT(LaunchUsage(), HasSubstr("--num-blocks"));
}

TEST(LaunchOptionsTest, ThreadsGivenEitherWayAreTheUsers) {
  absl::StatusOr<LaunchOptions> routed = ParseLaunchOptions({"--model=/m", "--threads", "3"});
  ASSERT_THAT(routed, IsOk());
  EXPECT_TRUE(routed->threads_set);
  absl::StatusOr<LaunchOptions> passed =
      ParseLaunchOptions({"--model=/m", "--executor-arg=--threads=3"});
  ASSERT_THAT(passed, IsOk());
  EXPECT_TRUE(passed->threads_set);
  absl::StatusOr<LaunchOptions> other =
      ParseLaunchOptions({"--model=/m", "--executor-arg=--call-timeout-ms=900"});
  ASSERT_THAT(other, IsOk());
  EXPECT_FALSE(other->threads_set);
}

TEST(LaunchOptionsTest, ExecutorsShareTheCpus) {
  EXPECT_EQ(ExecutorThreads(2, 1), 2);
  EXPECT_EQ(ExecutorThreads(16, 3), 5);
  EXPECT_EQ(ExecutorThreads(8, 2), 4);
  EXPECT_EQ(ExecutorThreads(2, 4), 1);  // never 0, which would mean one per CPU
  EXPECT_EQ(ExecutorThreads(0, 1), 1);
}

TEST(LaunchOptionsTest, PrometheusTargetsIsTheLaunchersOwnAndOffByDefault) {
  absl::StatusOr<LaunchOptions> options =
      ParseLaunchOptions({"--model=/m", "--prometheus-targets", "/t/kvcm.json"});
  ASSERT_THAT(options, IsOk());
  EXPECT_EQ(options->prometheus_targets, "/t/kvcm.json");
  EXPECT_TRUE(options->cache_manager_args.empty());
  EXPECT_TRUE(options->router_args.empty());
  EXPECT_TRUE(ParseLaunchOptions({"--model=/m"})->prometheus_targets.empty());
  EXPECT_THAT(
      std::string(ParseLaunchOptions({"--model=/m", "--prometheus-targets"}).status().message()),
      HasSubstr("--prometheus-targets needs a value"));
  EXPECT_THAT(LaunchUsage(), HasSubstr("--prometheus-targets FILE"));
}

}  // namespace
}  // namespace kvcm::launch
