// kvcm-launch's Prometheus target file: the file_sd JSON it renders, the metrics address it
// reads from each process's "ready" line, and the atomic replacement of the file.

#include "tools/launch/prometheus_targets.h"

#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/support/subprocess.h"

namespace kvcm::launch {
namespace {

using json = nlohmann::json;
using ::testing::HasSubstr;

std::string ReadAll(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

TEST(PrometheusTargetsTest, RendersOneGroupPerProcessWithItsComponentAndAStableInstance) {
  const json groups =
      json::parse(RenderPrometheusTargets({{"cache-manager", "cache-manager", "127.0.0.1:41001"},
                                           {"router", "router", "127.0.0.1:3000"},
                                           {"executor", "executor-0", "127.0.0.1:41002"},
                                           {"executor", "executor-1", "127.0.0.1:41003", "/other"}},
                                          "node1"));
  ASSERT_TRUE(groups.is_array());
  ASSERT_EQ(groups.size(), 4u);
  EXPECT_EQ(groups[0], json::parse(R"({"targets": ["127.0.0.1:41001"],
      "labels": {"__kvcm_component": "cache-manager", "instance": "node1:cache-manager"}})"));
  EXPECT_EQ(groups[1]["labels"]["__kvcm_component"], "router");
  EXPECT_EQ(groups[2]["targets"], json::parse(R"(["127.0.0.1:41002"])"));
  EXPECT_EQ(groups[2]["labels"]["instance"], "node1:executor-0");
  EXPECT_FALSE(groups[2]["labels"].contains("__metrics_path__"));
  EXPECT_EQ(groups[3]["labels"]["__metrics_path__"], "/other");
  // No process: an empty list, which Prometheus reads as "no targets".
  EXPECT_EQ(json::parse(RenderPrometheusTargets({}, "node1")), json::array());
}

TEST(PrometheusTargetsTest, ReadsTheMetricsAddressFromEachProcesssReadyLineOnly) {
  // The lines the three services print (services/*/main.cc).
  auto cm = MetricsEndpointFromReadyLine(
      "2026-12-01T10:00:00.000Z kvcm-cache-manager: ready epoch=1764583200000000 "
      "endpoint=ipc:///run/kvcm/cache-manager.sock events=ipc:///run/kvcm/events.sock "
      "metrics=http://127.0.0.1:41001/metrics");
  ASSERT_TRUE(cm.has_value());
  EXPECT_EQ(cm->address, "127.0.0.1:41001");
  EXPECT_EQ(cm->path, "/metrics");
  auto router = MetricsEndpointFromReadyLine(
      "2026-12-01T10:00:00.000Z kvcm-router: ready http=http://0.0.0.0:3000 "
      "metrics=http://0.0.0.0:3000/metrics executors=ipc:///run/kvcm/router-executors.sock");
  ASSERT_TRUE(router.has_value());
  EXPECT_EQ(router->address, "127.0.0.1:3000");  // the wildcard is scraped on this node
  auto executor = MetricsEndpointFromReadyLine(
      "kvcm-executor: ready name=executor-0 model=tiny pool=shm:64x4:f32 epoch=1 "
      "router=ipc:///r.sock metrics=http://127.0.0.1:41002/metrics");
  ASSERT_TRUE(executor.has_value());
  EXPECT_EQ(executor->address, "127.0.0.1:41002");

  // Any other line, or a URL that does not parse, says nothing.
  for (const char* line : {
           "kvcm-router: executor joined metrics=http://127.0.0.1:41002/metrics",
           "kvcm-executor: ready name=e metrics=http://127.0.0.1/metrics",
           "kvcm-executor: ready name=e metrics=http://127.0.0.1:0/metrics",
           "kvcm-executor: ready name=e metrics=http://127.0.0.1:99999/metrics",
           "kvcm-executor: ready name=e metrics=http://:41002/metrics",
           "kvcm-executor: ready name=e",
       }) {
    EXPECT_FALSE(MetricsEndpointFromReadyLine(line).has_value()) << line;
  }
}

TEST(PrometheusTargetsTest, WriteReplacesTheFileWholeAndLeavesNoTempFile) {
  absl::StatusOr<testing::TempDir> dir = testing::TempDir::Create("kvcm-targets-test");
  ASSERT_TRUE(dir.ok()) << dir.status();
  const std::string path = dir->path() + "/kvcm.json";
  ASSERT_TRUE(WriteFileAtomically(path, "[]\n").ok());
  EXPECT_EQ(ReadAll(path), "[]\n");
  struct stat before {};
  ASSERT_EQ(::stat(path.c_str(), &before), 0);
  ASSERT_TRUE(WriteFileAtomically(path, "[{\"targets\": []}]\n").ok());
  EXPECT_EQ(ReadAll(path), "[{\"targets\": []}]\n");
  // A new file renamed over the old one (a reader holding the old one keeps it whole).
  struct stat st {};
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_NE(st.st_ino, before.st_ino);
  EXPECT_EQ(st.st_mode & 0777, 0644u);
  int entries = 0;
  for ([[maybe_unused]] const auto& entry : std::filesystem::directory_iterator(dir->path())) {
    ++entries;
  }
  EXPECT_EQ(entries, 1);

  // A folder that does not exist: NOT_FOUND naming the path, and nothing made.
  const absl::Status missing = WriteFileAtomically(dir->path() + "/no/kvcm.json", "[]\n");
  EXPECT_TRUE(absl::IsNotFound(missing)) << missing;
  EXPECT_THAT(std::string(missing.message()), HasSubstr("/no/kvcm.json"));
}

}  // namespace
}  // namespace kvcm::launch
