// The configuration of the real binaries (common/config/config.h): deploy/config/
// kvcm.example.yaml lists every option of every binary with its default and each binary
// accepts it; a real kvcm-cache-manager resolves a file, an environment variable and a flag
// in that order (checked on its /metrics info gauge, its log line and its pool); a bad key
// or value stops a binary with a message naming it.

#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/config/config.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/cache_manager_process.h"
#include "tests/support/http_client.h"
#include "tests/support/metrics_text.h"
#include "tests/support/status_matchers.h"
#include "tests/support/subprocess.h"

namespace kvcm::config {
namespace {

using kvcm::testing::Subprocess;
using ::testing::HasSubstr;

struct Binary {
  const char* section;
  const char* path;
};
const Binary kBinaries[] = {{"cache_manager", KVCM_CACHE_MANAGER_BIN},
                            {"router", KVCM_ROUTER_BIN},
                            {"executor", KVCM_EXECUTOR_BIN},
                            {"launch", KVCM_LAUNCH_BIN}};

struct Finished {
  int exit_code = -1;
  std::string output;
};

Finished RunToExit(std::vector<std::string> argv, std::vector<std::string> env = {}) {
  static int counter = 0;
  Subprocess::Options options;
  options.argv = std::move(argv);
  options.env = std::move(env);
  // Each test runs in its own process beside others (ctest -j): the pid keeps their output
  // files apart (a shared name let a parallel test truncate this one's output).
  options.output_path =
      absl::StrCat(::testing::TempDir(), "/config_process_", ::getpid(), "_", ++counter);
  auto process = Subprocess::Start(options);
  EXPECT_THAT(process, IsOk());
  if (!process.ok()) return {};
  absl::StatusOr<int> code = (*process)->Wait(absl::Seconds(30));
  EXPECT_THAT(code, IsOk());
  return {code.value_or(-1), (*process)->Output()};
}

std::string WriteFile(const std::string& name, const std::string& text) {
  const std::string path = absl::StrCat(::testing::TempDir(), "/", ::getpid(), "_", name);
  std::ofstream(path) << text;
  return path;
}

TEST(ExampleConfigTest, ListsEveryOptionOfEveryBinaryWithItsDefault) {
  for (const Binary& binary : kBinaries) {
    SCOPED_TRACE(binary.section);
    const Finished defaults = RunToExit({binary.path, "--print-config"});
    ASSERT_EQ(defaults.exit_code, 0) << defaults.output;
    absl::StatusOr<SectionValues> printed =
        ParseSection(defaults.output, "--print-config", binary.section);
    ASSERT_THAT(printed, IsOk());
    ASSERT_FALSE(printed->empty());
    absl::StatusOr<SectionValues> example = ReadSection(KVCM_EXAMPLE_CONFIG, binary.section);
    ASSERT_THAT(example, IsOk());
    // Same keys (every flag has a key, every key is a flag) and the defaults as values.
    EXPECT_EQ(*example, *printed);
  }
}

TEST(ExampleConfigTest, EveryBinaryAcceptsTheExampleAndItChangesNothing) {
  for (const Binary& binary : kBinaries) {
    SCOPED_TRACE(binary.section);
    const Finished defaults = RunToExit({binary.path, "--print-config"});
    const Finished with_file =
        RunToExit({binary.path, "--config", KVCM_EXAMPLE_CONFIG, "--print-config"});
    ASSERT_EQ(with_file.exit_code, 0) << with_file.output;
    EXPECT_EQ(with_file.output, defaults.output);
  }
}

TEST(BinaryConfigTest, AnUnknownKeyStopsTheBinaryNamingTheKeyAndTheFile) {
  const std::string path = WriteFile("unknown_key.yaml", "router:\n  max_runing: 3\n");
  const Finished run = RunToExit({KVCM_ROUTER_BIN, "--config", path, "--print-config"});
  EXPECT_EQ(run.exit_code, 1);
  EXPECT_THAT(run.output, HasSubstr("unknown key \"max_runing\" in section router of " + path));
  const Finished launch = RunToExit({KVCM_LAUNCH_BIN, "--config", path, "--print-config"});
  // The launcher reads only its own section: the router's typo is the router's to report.
  EXPECT_EQ(launch.exit_code, 0) << launch.output;
}

TEST(BinaryConfigTest, AValueOfTheWrongTypeStopsTheBinaryNamingItAndTheType) {
  const Finished env =
      RunToExit({KVCM_EXECUTOR_BIN, "--print-config"}, {"KVCM_EXECUTOR_THREADS=four"});
  EXPECT_EQ(env.exit_code, 1);
  EXPECT_THAT(env.output, HasSubstr("KVCM_EXECUTOR_THREADS: expected int32, got \"four\""));
  const std::string path = WriteFile("wrong_type.yaml", "launch:\n  executors: two\n");
  const Finished file = RunToExit({KVCM_LAUNCH_BIN, "--config", path, "--print-config"});
  EXPECT_NE(file.exit_code, 0);
  EXPECT_THAT(file.output, HasSubstr("executors in section launch of "));
  EXPECT_THAT(file.output, HasSubstr("expected int32, got \"two\""));
}

TEST(BinaryConfigTest, LaunchTakesFlagOverEnvironmentOverFile) {
  const std::string path = WriteFile("launch.yaml",
                                     "launch:\n  executors: 3\n  restart_backoff_ms: 70\n  "
                                     "bin_dir: /from/file\n");
  const Finished run =
      RunToExit({KVCM_LAUNCH_BIN, "--config", path, "--bin-dir", "/from/flag", "--print-config"},
                {"KVCM_LAUNCH_RESTART_BACKOFF_MS=90", "KVCM_LAUNCH_BIN_DIR=/env"});
  ASSERT_EQ(run.exit_code, 0) << run.output;
  absl::StatusOr<SectionValues> printed = ParseSection(run.output, "--print-config", "launch");
  ASSERT_THAT(printed, IsOk()) << run.output;
  EXPECT_EQ(printed->at("executors"), "3");            // file
  EXPECT_EQ(printed->at("restart_backoff_ms"), "90");  // environment over file
  EXPECT_EQ(printed->at("bin_dir"), "/from/flag");     // flag over both
  EXPECT_EQ(printed->at("model"), "");                 // default
}

// kvcm-launch passes --config on: the cache manager it starts reads the same file, and a
// key it does not know stops the launch, with the cache manager's reason, before anything
// is ready.
TEST(BinaryConfigTest, LaunchPassesTheFileOnToTheProcessesItStarts) {
  const std::string model = absl::StrCat(::testing::TempDir(), "/", ::getpid(), "_launch_model");
  ASSERT_EQ(std::system(absl::StrCat("mkdir -p ", model).c_str()), 0);
  std::ofstream(model + "/config.json") << "{}";
  const std::string path = WriteFile("launch_children.yaml", "cache_manager:\n  num_blokcs: 64\n");
  const Finished run = RunToExit({KVCM_LAUNCH_BIN, "--config", path, "--model", model});
  EXPECT_EQ(run.exit_code, 1) << run.output;
  EXPECT_THAT(run.output,
              HasSubstr("unknown key \"num_blokcs\" in section cache_manager of " + path));
}

// A real cache manager: the file sets num_blocks, hash_algorithm and max_ops_per_step; the
// environment overrides hash_algorithm and max_ops_per_step; the command line overrides
// max_ops_per_step again.
TEST(BinaryConfigTest, CacheManagerResolvesFlagOverEnvironmentOverFileOverDefault) {
  const std::string path = WriteFile(
      "cache_manager.yaml",
      "cache_manager:\n  num_blocks: 48\n  hash_algorithm: fast128\n  max_ops_per_step: 100\n");
  kvcm::testing::CacheManagerOptions options;
  options.num_blocks = 0;  // from the file, not the command line
  options.env = {"KVCM_CACHE_MANAGER_HASH_ALGORITHM=sha256",
                 "KVCM_CACHE_MANAGER_MAX_OPS_PER_STEP=200"};
  options.extra_args = {"--config", path, "--max-ops-per-step=300"};
  auto manager = kvcm::testing::CacheManagerProcess::Start(options);
  ASSERT_THAT(manager, IsOk());
  absl::StatusOr<kvcm::testing::HttpResponse> response =
      kvcm::testing::HttpGet((*manager)->metrics_url());
  ASSERT_THAT(response, IsOk());
  absl::StatusOr<kvcm::testing::MetricsText> text = kvcm::testing::ParseMetricsText(response->body);
  ASSERT_THAT(text, IsOk());
  const std::vector<kvcm::testing::MetricSample> info =
      text->Samples("kvcm_cache_manager_config_info");
  ASSERT_EQ(info.size(), 1u);
  EXPECT_EQ(info[0].value, 1);
  std::map<std::string, std::string> labels = info[0].labels;
  EXPECT_EQ(labels["num_blocks"], "48");               // file
  EXPECT_EQ(labels["hash_algorithm"], "sha256");       // environment over file
  EXPECT_EQ(labels["max_ops_per_step"], "300");        // flag over both
  EXPECT_EQ(labels["block_size"], "4");                // flag
  EXPECT_EQ(labels["heartbeat_interval_ms"], "1000");  // default
  EXPECT_EQ(labels["config_file"], path);
  // The flags really took the values: the pool's own gauges say so.
  const std::vector<kvcm::testing::MetricSample> cache_info = text->Samples("kvcm_cache_info");
  ASSERT_EQ(cache_info.size(), 1u);
  EXPECT_EQ(cache_info[0].labels.at("hash_algorithm"), "sha256");
  const std::vector<kvcm::testing::MetricSample> pool_bytes =
      text->Samples("kvcm_cache_pool_bytes");
  ASSERT_EQ(pool_bytes.size(), 1u);
  double block_bytes = 0;
  ASSERT_TRUE(absl::SimpleAtod(cache_info[0].labels.at("block_bytes"), &block_bytes));
  EXPECT_EQ(pool_bytes[0].value, 48 * block_bytes);
  const std::string output = (*manager)->Output();
  EXPECT_THAT(output, HasSubstr("hash_algorithm=sha256 (env KVCM_CACHE_MANAGER_HASH_ALGORITHM)"));
  EXPECT_THAT(output, HasSubstr("num_blocks=48 (file)"));
  EXPECT_THAT(output, HasSubstr("max_ops_per_step=300 (flag)"));
  EXPECT_THAT(output, HasSubstr(" from " + path));
}

}  // namespace
}  // namespace kvcm::config
