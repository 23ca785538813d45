// tools/launch/launch_options.h: ApplyLaunchConfig, the launcher's flags from its launch:
// section and KVCM_LAUNCH_* (flag > environment > file), --config taken out and made
// absolute for the processes it starts, and a pool sized by the cache manager's section.

#include <unistd.h>

#include <fstream>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/status_matchers.h"
#include "tools/launch/launch_options.h"

namespace kvcm::launch {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::string WriteFile(const std::string& name, const std::string& text) {
  // The pid keeps parallel test processes (ctest -j) from sharing a file.
  const std::string path = ::testing::TempDir() + "/" + std::to_string(::getpid()) + "_" + name;
  std::ofstream(path) << text;
  return path;
}

TEST(ApplyLaunchConfigTest, FileAndEnvironmentBecomeFlagsInFrontAndTheCommandLineWins) {
  const std::string path =
      WriteFile("launch_a.yaml", "launch:\n  model: /m/file\n  executors: 3\n  run_dir: /r/file\n");
  absl::StatusOr<ConfiguredArgs> configured = ApplyLaunchConfig(
      {"--config", path, "--run-dir=/r/flag", "--port", "8080"}, {"KVCM_LAUNCH_EXECUTORS=2"});
  ASSERT_THAT(configured, IsOk());
  EXPECT_THAT(configured->args, ElementsAre("--model=/m/file", "--executors=2", "--run-dir=/r/flag",
                                            "--port", "8080"));
  EXPECT_EQ(configured->config_file, path);
  EXPECT_FALSE(configured->pool_sized);
  absl::StatusOr<LaunchOptions> options = ParseLaunchOptions(configured->args);
  ASSERT_THAT(options, IsOk());
  EXPECT_EQ(options->model, "/m/file");
  EXPECT_EQ(options->executors, 2);
  EXPECT_EQ(options->run_dir, "/r/flag");
}

TEST(ApplyLaunchConfigTest, ConfigPathIsMadeAbsoluteForTheChildren) {
  absl::StatusOr<ConfiguredArgs> configured =
      ApplyLaunchConfig({"--model", "m", "--config=no-such.yaml"}, {});
  ASSERT_FALSE(configured.ok());
  EXPECT_EQ(configured.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(configured.status().message(), HasSubstr("/no-such.yaml"));
  EXPECT_FALSE(ApplyLaunchConfig({"--model", "m", "--config"}, {}).ok());
}

TEST(ApplyLaunchConfigTest, APoolSizedByTheCacheManagersSectionOrVariablesCountsAsSized) {
  const std::string sized = WriteFile("launch_b.yaml", "cache_manager:\n  num_blocks: 64\n");
  absl::StatusOr<ConfiguredArgs> configured = ApplyLaunchConfig({"--config", sized}, {});
  ASSERT_THAT(configured, IsOk());
  EXPECT_TRUE(configured->pool_sized);
  // The example's defaults (0 and "") size nothing.
  const std::string unsized =
      WriteFile("launch_c.yaml",
                "cache_manager:\n  num_blocks: 0\n  pool_bytes: \"\"\n  memory_fraction: 0\n");
  configured = ApplyLaunchConfig({"--config", unsized}, {});
  ASSERT_THAT(configured, IsOk());
  EXPECT_FALSE(configured->pool_sized);
  configured = ApplyLaunchConfig({}, {"KVCM_CACHE_MANAGER_MEMORY_FRACTION=0.5"});
  ASSERT_THAT(configured, IsOk());
  EXPECT_TRUE(configured->pool_sized);
}

TEST(ApplyLaunchConfigTest, ExecutorThreadsSetByTheExecutorsSectionOrVariableCountAsSet) {
  const std::string set = WriteFile("launch_e.yaml", "executor:\n  threads: 3\n");
  absl::StatusOr<ConfiguredArgs> configured = ApplyLaunchConfig({"--config", set}, {});
  ASSERT_THAT(configured, IsOk());
  EXPECT_TRUE(configured->threads_set);
  // 0 is the executor's "choose": the launcher still gives each executor its share.
  const std::string zero = WriteFile("launch_f.yaml", "executor:\n  threads: 0\n");
  configured = ApplyLaunchConfig({"--config", zero}, {});
  ASSERT_THAT(configured, IsOk());
  EXPECT_FALSE(configured->threads_set);
  configured = ApplyLaunchConfig({}, {"KVCM_EXECUTOR_THREADS=2"});
  ASSERT_THAT(configured, IsOk());
  EXPECT_TRUE(configured->threads_set);
  configured = ApplyLaunchConfig({}, {});
  ASSERT_THAT(configured, IsOk());
  EXPECT_FALSE(configured->threads_set);
}

TEST(ApplyLaunchConfigTest, UnknownLaunchKeyIsAnError) {
  const std::string path = WriteFile("launch_d.yaml", "launch:\n  executor: 2\n");
  absl::StatusOr<ConfiguredArgs> configured = ApplyLaunchConfig({"--config", path}, {});
  ASSERT_FALSE(configured.ok());
  EXPECT_THAT(configured.status().message(), HasSubstr("unknown key \"executor\""));
}

}  // namespace
}  // namespace kvcm::launch
