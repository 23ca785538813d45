// kvcm-launch's Prometheus target file: the file_sd JSON it renders, the metrics address it
// reads from each process's "ready" line (the file's atomic replacement:
// tests/common/base/atomic_file_test.cc).

#include "tools/launch/prometheus_targets.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace kvcm::launch {
namespace {

using json = nlohmann::json;
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

}  // namespace
}  // namespace kvcm::launch
