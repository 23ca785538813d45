// The cache manager's /metrics checked by the Prometheus tools themselves: `promtool check
// metrics` lints the exposition, and a real Prometheus server scrapes it. Both come from
// the Debian package `prometheus` (scripts/bootstrap.sh installs it); without them these
// tests fail rather than skip.

#include <chrono>
#include <iostream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/metrics/metrics_server.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "services/cache_manager/cache_manager_metrics.h"
#include "tests/support/http_client.h"
#include "tests/support/prometheus_server.h"
#include "tests/support/promtool.h"
#include "tests/support/status_matchers.h"

namespace kvcm::cache_manager {
namespace {

using ::kvcm::testing::HttpGet;
using ::kvcm::testing::PrometheusServer;
using ::kvcm::testing::PromtoolCheckMetrics;

constexpr int32_t kNumBlocks = 64;

CacheManagerMetrics::CacheInfo Info() {
  CacheManagerMetrics::CacheInfo info;
  info.num_blocks = kNumBlocks;
  info.block_size = 16;
  info.block_bytes = 262144;
  info.pool_bytes = uint64_t{kNumBlocks} * 262144;
  info.dtype = "bf16";
  info.backend = "shm";
  info.hash_algorithm = "sha256";
  return info;
}

// free 34, in use 16 (of which 2 quarantined), cached 10, pinned 4.
CacheManagerSnapshot BusySnapshot() {
  CacheManagerSnapshot s;
  s.ledger.num_blocks = kNumBlocks;
  s.ledger.block_size = 16;
  s.ledger.free_blocks = 34;
  s.ledger.in_use_blocks = 16;
  s.ledger.cached_blocks = 10;
  s.ledger.pinned_blocks = 4;
  s.ledger.live_sequences = 3;
  s.ledger.usage_ratio = 16.0 / kNumBlocks;
  s.ledger.occupancy_ratio = 30.0 / kNumBlocks;
  s.ledger.blocks_allocated = 50;
  s.ledger.prefix_query_tokens = 800;
  s.ledger.prefix_hit_tokens = 160;
  s.quarantined_blocks = 2;
  s.sessions_by_role = {1, 2, 0};
  s.epoch = 7;
  s.events_published = 25;
  return s;
}

class CacheManagerMetricsIntegrationTest : public ::testing::Test {
 protected:
  void SetUp() override {
    metrics_.PublishSnapshot(BusySnapshot());
    metrics_.ObserveRequest(RequestType::kStep, 1.5e-4);
    metrics_.ObserveRequest(RequestType::kHello, 2e-5);
    metrics_.CountRejected(RejectReason::kMalformed);
    metrics_.CountReclaimed(ReclaimReason::kGoodbye, 5);
    auto server = MetricsServer::Start("127.0.0.1:0", metrics_.registry());
    ASSERT_THAT(server, IsOk());
    server_ = std::move(*server);
  }

  CacheManagerMetrics metrics_{Info()};
  std::unique_ptr<MetricsServer> server_;
};

TEST_F(CacheManagerMetricsIntegrationTest, PromtoolCheckMetricsReportsNothing) {
  auto response = HttpGet(server_->url());
  ASSERT_THAT(response, IsOk());
  ASSERT_EQ(response->status, 200);

  auto result = PromtoolCheckMetrics(response->body);
  ASSERT_THAT(result, IsOk());  // says to run scripts/bootstrap.sh
  EXPECT_EQ(result->output, "");
  EXPECT_EQ(result->exit_code, 0) << result->output;
}

// The check above is not vacuous: promtool does report a counter without _total.
TEST(PromtoolTest, ReportsACounterWithoutTotal) {
  auto result = PromtoolCheckMetrics(
      "# HELP kvcm_test_events Events.\n# TYPE kvcm_test_events counter\nkvcm_test_events 1\n");
  ASSERT_THAT(result, IsOk());  // says to run scripts/bootstrap.sh
  EXPECT_EQ(result->exit_code, 3) << result->output;
  EXPECT_THAT(result->output,
              ::testing::HasSubstr("counter metrics should have \"_total\" suffix"));
}

// A scrape by a real Prometheus server agrees with what was published. Prometheus scrapes
// every second; the test polls its query API until the value arrives (deadline, no sleeps).
TEST_F(CacheManagerMetricsIntegrationTest, RealPrometheusScrapesIt) {
  const auto start = std::chrono::steady_clock::now();
  PrometheusServer::Options options;
  options.targets = {absl::StrCat("127.0.0.1:", server_->port())};
  options.scrape_interval = absl::Seconds(1);
  auto prometheus = PrometheusServer::Start(options);
  ASSERT_THAT(prometheus, IsOk());  // says to run scripts/bootstrap.sh
  const auto ready = std::chrono::steady_clock::now();

  const absl::Duration timeout = absl::Seconds(60);
  absl::Status status =
      (*prometheus)->WaitForValue("kvcm_cache_capacity_blocks", kNumBlocks, timeout);
  ASSERT_THAT(status, IsOk());
  status = (*prometheus)->WaitForValue("sum(kvcm_cache_blocks)", kNumBlocks, timeout);
  EXPECT_THAT(status, IsOk());
  status = (*prometheus)->WaitForValue("kvcm_cache_blocks{state=\"quarantined\"}", 2, timeout);
  EXPECT_THAT(status, IsOk());
  status = (*prometheus)->WaitForValue("up{job=\"kvcm\"}", 1, timeout);
  EXPECT_THAT(status, IsOk());
  // Every label set is there from start-up: 10 request types, all at 0 but two.
  auto requests = (*prometheus)->Query("kvcm_cache_manager_requests_total");
  ASSERT_THAT(requests, IsOk());
  EXPECT_EQ(requests->size(), static_cast<size_t>(kRequestTypes));

  const auto done = std::chrono::steady_clock::now();
  using Ms = std::chrono::milliseconds;
  std::cout << "prometheus ready after " << std::chrono::duration_cast<Ms>(ready - start).count()
            << " ms, first scrape seen after "
            << std::chrono::duration_cast<Ms>(done - start).count() << " ms\n";
}

}  // namespace
}  // namespace kvcm::cache_manager
