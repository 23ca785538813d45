#include "services/cache_manager/cache_manager_metrics.h"

#include <atomic>
#include <cstdint>
#include <iostream>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "common/metrics/metrics_server.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/http_client.h"
#include "tests/support/metrics_text.h"
#include "tests/support/status_matchers.h"

namespace kvcm::cache_manager {
namespace {

using ::kvcm::testing::HttpGet;
using ::kvcm::testing::MetricLabels;
using ::kvcm::testing::MetricSample;
using ::kvcm::testing::MetricsText;
using ::kvcm::testing::ParseMetricsText;
using ::testing::ElementsAre;

constexpr int32_t kNumBlocks = 64;
const char* const kStates[] = {"free", "in_use", "cached", "pinned", "quarantined", "draining"};

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

// A consistent snapshot: the ledger's four states partition the pool.
CacheManagerSnapshot Snapshot(int32_t in_use, int32_t cached, int32_t pinned, int32_t quarantined) {
  CacheManagerSnapshot s;
  s.ledger.num_blocks = kNumBlocks;
  s.ledger.block_size = 16;
  s.ledger.in_use_blocks = in_use;
  s.ledger.cached_blocks = cached;
  s.ledger.pinned_blocks = pinned;
  s.ledger.free_blocks = kNumBlocks - in_use - cached - pinned;
  s.ledger.usage_ratio = static_cast<double>(in_use) / kNumBlocks;
  s.ledger.occupancy_ratio = static_cast<double>(in_use + cached + pinned) / kNumBlocks;
  s.quarantined_blocks = quarantined;
  return s;
}

class CacheManagerMetricsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto server = MetricsServer::Start("127.0.0.1:0", metrics_.registry());
    ASSERT_THAT(server, IsOk());
    server_ = std::move(*server);
  }

  MetricsText Scrape() {
    auto response = HttpGet(server_->url());
    EXPECT_THAT(response, IsOk());
    if (!response.ok()) return {};
    EXPECT_EQ(response->status, 200);
    auto text = ParseMetricsText(response->body);
    EXPECT_THAT(text, IsOk());
    return text.ok() ? *text : MetricsText{};
  }

  static double ValueOr(const MetricsText& text, const std::string& name,
                        const MetricLabels& labels = {}) {
    auto value = text.Value(name, labels);
    EXPECT_THAT(value, IsOk());
    return value.value_or(-1);
  }

  CacheManagerMetrics metrics_{Info()};
  std::unique_ptr<MetricsServer> server_;
};

TEST_F(CacheManagerMetricsTest, EveryLabelSetIsExportedAtZeroFromStartUp) {
  const MetricsText text = Scrape();
  EXPECT_EQ(ValueOr(text, "kvcm_cache_capacity_blocks"), kNumBlocks);
  EXPECT_EQ(ValueOr(text, "kvcm_cache_blocks", {{"state", "free"}}), kNumBlocks);
  for (const char* state : {"in_use", "cached", "pinned", "quarantined", "draining"}) {
    EXPECT_EQ(ValueOr(text, "kvcm_cache_blocks", {{"state", state}}), 0) << state;
  }
  for (int i = 0; i < kRequestTypes; ++i) {
    const std::string type(RequestTypeName(static_cast<RequestType>(i)));
    EXPECT_EQ(ValueOr(text, "kvcm_cache_manager_requests_total", {{"type", type}}), 0);
    EXPECT_EQ(ValueOr(text, "kvcm_cache_manager_request_duration_seconds_count", {{"type", type}}),
              0);
  }
  for (int i = 0; i < kRejectReasons; ++i) {
    const std::string reason(RejectReasonName(static_cast<RejectReason>(i)));
    EXPECT_EQ(ValueOr(text, "kvcm_cache_manager_rejected_messages_total", {{"reason", reason}}), 0);
  }
  for (int i = 0; i < kReclaimReasons; ++i) {
    const std::string reason(ReclaimReasonName(static_cast<ReclaimReason>(i)));
    EXPECT_EQ(ValueOr(text, "kvcm_cache_manager_reclaimed_blocks_total", {{"reason", reason}}), 0);
  }
  for (int i = 0; i < kSessionRoles; ++i) {
    const std::string role(SessionRoleName(static_cast<SessionRole>(i)));
    EXPECT_EQ(ValueOr(text, "kvcm_cache_manager_sessions", {{"role", role}}), 0);
  }
  for (const char* counter :
       {"kvcm_cache_block_allocations_total", "kvcm_cache_block_releases_total",
        "kvcm_cache_block_evictions_total", "kvcm_cache_cow_copies_total",
        "kvcm_cache_prefix_query_tokens_total", "kvcm_cache_prefix_hit_tokens_total",
        "kvcm_cache_allocation_failures_total", "kvcm_cache_window_released_blocks_total",
        "kvcm_cache_manager_events_published_total"}) {
    EXPECT_EQ(ValueOr(text, counter), 0) << counter;
  }
  EXPECT_EQ(ValueOr(text, "kvcm_cache_usage_ratio"), 0);
  EXPECT_EQ(ValueOr(text, "kvcm_cache_occupancy_ratio"), 0);
  EXPECT_EQ(ValueOr(text, "kvcm_cache_live_sequences"), 0);
  // Without groups: one group, the pool's window (CacheInfo's default, 0).
  for (const char* by_group :
       {"kvcm_cache_group_window_released_blocks_total", "kvcm_cache_group_held_blocks"}) {
    ASSERT_EQ(text.Samples(by_group).size(), 1u) << by_group;
    EXPECT_EQ(ValueOr(text, by_group, {{"group", "0"}, {"window", "0"}}), 0) << by_group;
  }
  EXPECT_EQ(ValueOr(text, "kvcm_cache_manager_epoch"), 0);
  EXPECT_EQ(ValueOr(text, "kvcm_cache_pool_bytes"), kNumBlocks * 262144.0);
  EXPECT_EQ(ValueOr(text, "kvcm_cache_info",
                    {{"block_size", "16"},
                     {"block_bytes", "262144"},
                     {"dtype", "bf16"},
                     {"backend", "shm"},
                     {"hash_algorithm", "sha256"}}),
            1);
}

TEST_F(CacheManagerMetricsTest, ExportsExactlyTheDeclaredListWithTypesLabelsAndHelp) {
  const MetricsText text = Scrape();
  std::set<std::string> declared;
  for (const MetricSpec& spec : CacheManagerMetrics::Specs()) {
    SCOPED_TRACE(spec.name);
    const std::string name = spec.name;
    declared.insert(name);
    EXPECT_TRUE(absl::StartsWith(name, "kvcm_"));
    ASSERT_TRUE(text.types.contains(name));
    ASSERT_TRUE(text.helps.contains(name));
    EXPECT_FALSE(text.helps.at(name).empty());
    const std::string& type = text.types.at(name);
    // Counters carry _total; nothing else does.
    EXPECT_EQ(type == "counter", absl::EndsWith(name, "_total")) << type;
    EXPECT_EQ(type, spec.type == prometheus::MetricType::Counter     ? "counter"
                    : spec.type == prometheus::MetricType::Gauge     ? "gauge"
                    : spec.type == prometheus::MetricType::Histogram ? "histogram"
                                                                     : "?");
    std::set<std::string> want_labels;
    for (absl::string_view label : absl::StrSplit(spec.labels, ',', absl::SkipEmpty())) {
      want_labels.insert(std::string(label));
    }
    const std::string sample_name = type == "histogram" ? name + "_count" : name;
    const std::vector<MetricSample> samples = text.Samples(sample_name);
    ASSERT_FALSE(samples.empty());
    for (const MetricSample& sample : samples) {
      std::set<std::string> labels;
      for (const auto& [label, value] : sample.labels) labels.insert(label);
      EXPECT_EQ(labels, want_labels);
    }
  }
  for (const auto& [name, type] : text.types) {
    // prometheus-cpp's Exposer always adds its own, about the endpoint itself.
    if (absl::StartsWith(name, "exposer_")) continue;
    EXPECT_TRUE(declared.contains(name)) << name;
  }
}

TEST_F(CacheManagerMetricsTest, ExportsThePublishedSnapshot) {
  CacheManagerSnapshot s = Snapshot(/*in_use=*/20, /*cached=*/8, /*pinned=*/4,
                                    /*quarantined=*/6);
  s.ledger.live_sequences = 5;
  s.ledger.blocks_allocated = 100;
  s.ledger.blocks_released = 80;
  s.ledger.evictions = 7;
  s.ledger.cow_copies = 3;
  s.ledger.prefix_query_tokens = 4096;
  s.ledger.prefix_hit_tokens = 1024;
  s.ledger.allocation_failures = 2;
  s.ledger.window_released = 9;
  s.sessions_by_role = {1, 4, 2};
  s.epoch = 42;
  s.events_published = 1234;
  s.draining_blocks = 3;
  s.open_fences = 2;
  metrics_.PublishSnapshot(s);

  const MetricsText text = Scrape();
  EXPECT_EQ(ValueOr(text, "kvcm_cache_blocks", {{"state", "free"}}), 32);
  EXPECT_EQ(ValueOr(text, "kvcm_cache_blocks", {{"state", "in_use"}}), 11);  // 20 - 6 - 3
  EXPECT_EQ(ValueOr(text, "kvcm_cache_blocks", {{"state", "draining"}}), 3);
  EXPECT_EQ(ValueOr(text, "kvcm_cache_manager_open_fences"), 2);
  EXPECT_EQ(ValueOr(text, "kvcm_cache_blocks", {{"state", "cached"}}), 8);
  EXPECT_EQ(ValueOr(text, "kvcm_cache_blocks", {{"state", "pinned"}}), 4);
  EXPECT_EQ(ValueOr(text, "kvcm_cache_blocks", {{"state", "quarantined"}}), 6);
  EXPECT_DOUBLE_EQ(ValueOr(text, "kvcm_cache_usage_ratio"), 20.0 / 64);
  EXPECT_DOUBLE_EQ(ValueOr(text, "kvcm_cache_occupancy_ratio"), 32.0 / 64);
  EXPECT_EQ(ValueOr(text, "kvcm_cache_live_sequences"), 5);
  EXPECT_EQ(ValueOr(text, "kvcm_cache_block_allocations_total"), 100);
  EXPECT_EQ(ValueOr(text, "kvcm_cache_block_releases_total"), 80);
  EXPECT_EQ(ValueOr(text, "kvcm_cache_block_evictions_total"), 7);
  EXPECT_EQ(ValueOr(text, "kvcm_cache_cow_copies_total"), 3);
  EXPECT_EQ(ValueOr(text, "kvcm_cache_prefix_query_tokens_total"), 4096);
  EXPECT_EQ(ValueOr(text, "kvcm_cache_prefix_hit_tokens_total"), 1024);
  EXPECT_EQ(ValueOr(text, "kvcm_cache_allocation_failures_total"), 2);
  EXPECT_EQ(ValueOr(text, "kvcm_cache_window_released_blocks_total"), 9);
  EXPECT_EQ(ValueOr(text, "kvcm_cache_manager_sessions", {{"role", "router"}}), 1);
  EXPECT_EQ(ValueOr(text, "kvcm_cache_manager_sessions", {{"role", "executor"}}), 4);
  EXPECT_EQ(ValueOr(text, "kvcm_cache_manager_sessions", {{"role", "control"}}), 2);
  EXPECT_EQ(ValueOr(text, "kvcm_cache_manager_epoch"), 42);
  EXPECT_EQ(ValueOr(text, "kvcm_cache_manager_events_published_total"), 1234);
}

// KV cache groups (docs/architecture.md, "The hybrid KV cache"): a series per group, at 0
// from start-up, then each group's releases and held blocks from the snapshot.
TEST(CacheManagerMetricsGroupsTest, ExportsEachGroupsReleasesAndHeldBlocks) {
  CacheManagerMetrics::CacheInfo info = Info();
  info.group_windows = {0, 512, 512};
  CacheManagerMetrics metrics(info);
  auto server = MetricsServer::Start("127.0.0.1:0", metrics.registry());
  ASSERT_THAT(server, IsOk());
  auto scrape = [&]() -> MetricsText {
    auto response = HttpGet((*server)->url());
    EXPECT_THAT(response, IsOk());
    if (!response.ok()) return {};
    auto text = ParseMetricsText(response->body);
    EXPECT_THAT(text, IsOk());
    return text.ok() ? *text : MetricsText{};
  };
  const char* const kHeld = "kvcm_cache_group_held_blocks";
  const char* const kReleased = "kvcm_cache_group_window_released_blocks_total";
  const MetricLabels full = {{"group", "0"}, {"window", "0"}};
  const MetricLabels first = {{"group", "1"}, {"window", "512"}};
  const MetricLabels second = {{"group", "2"}, {"window", "512"}};
  MetricsText text = scrape();
  EXPECT_EQ(text.types.at(kHeld), "gauge");
  EXPECT_EQ(text.Samples(kHeld).size(), 3u);
  for (const MetricLabels& labels : {full, first, second}) {
    EXPECT_EQ(text.Value(kHeld, labels).value_or(-1), 0);
    EXPECT_EQ(text.Value(kReleased, labels).value_or(-1), 0);
  }
  CacheManagerSnapshot s = Snapshot(/*in_use=*/40, /*cached=*/0, /*pinned=*/0, /*quarantined=*/0);
  s.groups = {{0, 0, 40}, {512, 30, 34}, {512, 31, 33}};
  metrics.PublishSnapshot(s);
  text = scrape();
  EXPECT_EQ(text.Value(kHeld, full).value_or(-1), 40);
  EXPECT_EQ(text.Value(kHeld, first).value_or(-1), 34);
  EXPECT_EQ(text.Value(kHeld, second).value_or(-1), 33);
  EXPECT_EQ(text.Value(kReleased, full).value_or(-1), 0);
  EXPECT_EQ(text.Value(kReleased, first).value_or(-1), 30);
  EXPECT_EQ(text.Value(kReleased, second).value_or(-1), 31);
  // A gauge: it goes down again when the sequences end.
  s.groups = {{0, 0, 0}, {512, 30, 0}, {512, 31, 0}};
  metrics.PublishSnapshot(s);
  text = scrape();
  for (const MetricLabels& labels : {full, first, second}) {
    EXPECT_EQ(text.Value(kHeld, labels).value_or(-1), 0);
  }
  EXPECT_EQ(text.Value(kReleased, second).value_or(-1), 31);
}

TEST_F(CacheManagerMetricsTest, CountsRequestsRejectionsAndReclaims) {
  metrics_.ObserveRequest(RequestType::kStep, 2e-3);
  metrics_.ObserveRequest(RequestType::kStep, 4e-6);
  metrics_.ObserveRequest(RequestType::kEventSnapshot, 0.3);
  metrics_.CountRejected(RejectReason::kStaleEpoch);
  metrics_.CountRejected(RejectReason::kStaleEpoch);
  metrics_.CountRejected(RejectReason::kPermissionDenied);
  metrics_.CountReclaimed(ReclaimReason::kClientDied, 12);
  metrics_.CountReclaimed(ReclaimReason::kClientDied, 0);
  metrics_.CountReclaimed(ReclaimReason::kSessionReplaced, 3);

  const MetricsText text = Scrape();
  const std::string requests = "kvcm_cache_manager_requests_total";
  EXPECT_EQ(ValueOr(text, requests, {{"type", "step"}}), 2);
  EXPECT_EQ(ValueOr(text, requests, {{"type", "event_snapshot"}}), 1);
  EXPECT_EQ(ValueOr(text, requests, {{"type", "hello"}}), 0);
  const std::string duration = "kvcm_cache_manager_request_duration_seconds";
  EXPECT_EQ(ValueOr(text, duration + "_count", {{"type", "step"}}), 2);
  EXPECT_DOUBLE_EQ(ValueOr(text, duration + "_sum", {{"type", "step"}}), 2e-3 + 4e-6);
  EXPECT_EQ(ValueOr(text, duration + "_bucket", {{"type", "step"}, {"le", "5e-06"}}), 1);
  EXPECT_EQ(ValueOr(text, duration + "_bucket", {{"type", "step"}, {"le", "+Inf"}}), 2);
  const std::string rejected = "kvcm_cache_manager_rejected_messages_total";
  EXPECT_EQ(ValueOr(text, rejected, {{"reason", "stale_epoch"}}), 2);
  EXPECT_EQ(ValueOr(text, rejected, {{"reason", "permission_denied"}}), 1);
  EXPECT_EQ(ValueOr(text, rejected, {{"reason", "malformed"}}), 0);
  const std::string reclaimed = "kvcm_cache_manager_reclaimed_blocks_total";
  EXPECT_EQ(ValueOr(text, reclaimed, {{"reason", "client_died"}}), 12);
  EXPECT_EQ(ValueOr(text, reclaimed, {{"reason", "session_replaced"}}), 3);
  EXPECT_EQ(ValueOr(text, reclaimed, {{"reason", "goodbye"}}), 0);
}

// Without tiers every tier series is exported at 0; a snapshot with tiers is exported as is,
// and the load durations the server passes on feed the histogram by tier.
TEST_F(CacheManagerMetricsTest, ExportsTheTiers) {
  {
    const MetricsText text = Scrape();
    for (const char* tier : {"host", "disk"}) {
      EXPECT_EQ(ValueOr(text, "kvcm_cache_manager_tier_capacity_blocks", {{"tier", tier}}), 0);
      EXPECT_EQ(
          ValueOr(text, "kvcm_cache_manager_tier_blocks", {{"tier", tier}, {"state", "ready"}}), 0);
      EXPECT_EQ(ValueOr(text, "kvcm_cache_manager_tier_load_seconds_count", {{"tier", tier}}), 0);
    }
    for (int i = 0; i < tiers::kNumRefusals; ++i) {
      const std::string reason(tiers::RefusalName(static_cast<tiers::Refusal>(i)));
      EXPECT_EQ(ValueOr(text, "kvcm_cache_manager_tier_refusals_total", {{"reason", reason}}), 0);
    }
    EXPECT_EQ(ValueOr(text, "kvcm_cache_manager_tier_held_blocks"), 0);
  }

  CacheManagerSnapshot s = Snapshot(/*in_use=*/4, /*cached=*/8, /*pinned=*/0,
                                    /*quarantined=*/0);
  tiers::TierSnapshot t;
  t.slots = {100, 1000};
  t.ready = {40, 300};
  t.writing = {2, 5};
  t.counters.stored = {60, 320};
  t.counters.loaded = {7, 11};
  t.counters.evicted = {3, 0};
  t.counters.stores_dropped = 4;
  t.counters.disk_full = 1;
  t.counters.write_errors = 2;
  t.counters.load_failures = 5;
  t.counters.refused[static_cast<size_t>(tiers::Refusal::kChecksum)] = 6;
  t.counters.refused[static_cast<size_t>(tiers::Refusal::kOtherIdentity)] = 9;
  t.counters.recovered = 250;
  t.counters.bytes_written = 123456789;
  t.counters.bytes_read = 98765;
  t.counters.syncs = 17;
  t.counters.sync_errors = 1;
  t.unsynced_writes = 8;
  s.tiers = t;
  s.tier_held_blocks = 3;
  s.tier_loading_blocks = 12;
  metrics_.PublishSnapshot(s);
  const std::vector<std::pair<tiers::Tier, double>> loads = {
      {tiers::Tier::kHost, 2e-5}, {tiers::Tier::kDisk, 3e-3}, {tiers::Tier::kDisk, 0.2}};
  metrics_.ObserveTierLoads(loads);

  const MetricsText text = Scrape();
  const std::string capacity = "kvcm_cache_manager_tier_capacity_blocks";
  EXPECT_EQ(ValueOr(text, capacity, {{"tier", "host"}}), 100);
  EXPECT_EQ(ValueOr(text, capacity, {{"tier", "disk"}}), 1000);
  const std::string blocks = "kvcm_cache_manager_tier_blocks";
  EXPECT_EQ(ValueOr(text, blocks, {{"tier", "host"}, {"state", "ready"}}), 40);
  EXPECT_EQ(ValueOr(text, blocks, {{"tier", "host"}, {"state", "writing"}}), 2);
  EXPECT_EQ(ValueOr(text, blocks, {{"tier", "disk"}, {"state", "ready"}}), 300);
  EXPECT_EQ(ValueOr(text, blocks, {{"tier", "disk"}, {"state", "writing"}}), 5);
  EXPECT_EQ(ValueOr(text, "kvcm_cache_manager_tier_held_blocks"), 3);
  EXPECT_EQ(ValueOr(text, "kvcm_cache_manager_tier_loading_blocks"), 12);
  EXPECT_EQ(ValueOr(text, "kvcm_cache_manager_tier_stored_blocks_total", {{"tier", "host"}}), 60);
  EXPECT_EQ(ValueOr(text, "kvcm_cache_manager_tier_stored_blocks_total", {{"tier", "disk"}}), 320);
  EXPECT_EQ(ValueOr(text, "kvcm_cache_manager_tier_loaded_blocks_total", {{"tier", "host"}}), 7);
  EXPECT_EQ(ValueOr(text, "kvcm_cache_manager_tier_loaded_blocks_total", {{"tier", "disk"}}), 11);
  EXPECT_EQ(ValueOr(text, "kvcm_cache_manager_tier_evicted_blocks_total", {{"tier", "host"}}), 3);
  EXPECT_EQ(ValueOr(text, "kvcm_cache_manager_tier_evicted_blocks_total", {{"tier", "disk"}}), 0);
  EXPECT_EQ(ValueOr(text, "kvcm_cache_manager_tier_stores_dropped_total"), 4);
  EXPECT_EQ(ValueOr(text, "kvcm_cache_manager_tier_disk_full_total"), 1);
  EXPECT_EQ(ValueOr(text, "kvcm_cache_manager_tier_write_errors_total"), 2);
  EXPECT_EQ(ValueOr(text, "kvcm_cache_manager_tier_load_failures_total"), 5);
  const std::string refusals = "kvcm_cache_manager_tier_refusals_total";
  EXPECT_EQ(ValueOr(text, refusals, {{"reason", "checksum"}}), 6);
  EXPECT_EQ(ValueOr(text, refusals, {{"reason", "other_identity"}}), 9);
  EXPECT_EQ(ValueOr(text, refusals, {{"reason", "bad_header"}}), 0);
  EXPECT_EQ(ValueOr(text, "kvcm_cache_manager_tier_recovered_blocks_total"), 250);
  EXPECT_EQ(ValueOr(text, "kvcm_cache_manager_tier_bytes_written_total"), 123456789);
  EXPECT_EQ(ValueOr(text, "kvcm_cache_manager_tier_bytes_read_total"), 98765);
  EXPECT_EQ(ValueOr(text, "kvcm_cache_manager_tier_syncs_total"), 17);
  EXPECT_EQ(ValueOr(text, "kvcm_cache_manager_tier_sync_errors_total"), 1);
  EXPECT_EQ(ValueOr(text, "kvcm_cache_manager_tier_unsynced_writes"), 8);
  const std::string load = "kvcm_cache_manager_tier_load_seconds";
  EXPECT_EQ(ValueOr(text, load + "_count", {{"tier", "host"}}), 1);
  EXPECT_EQ(ValueOr(text, load + "_count", {{"tier", "disk"}}), 2);
  EXPECT_DOUBLE_EQ(ValueOr(text, load + "_sum", {{"tier", "disk"}}), 3e-3 + 0.2);
  EXPECT_EQ(ValueOr(text, load + "_bucket", {{"tier", "host"}, {"le", "2.5e-05"}}), 1);
  EXPECT_EQ(ValueOr(text, load + "_bucket", {{"tier", "disk"}, {"le", "0.005"}}), 1);
  EXPECT_EQ(ValueOr(text, load + "_bucket", {{"tier", "disk"}, {"le", "+Inf"}}), 2);
}

// One scrape reads one snapshot: while another thread publishes changing snapshots, every
// scrape's states sum to the capacity, and the ratios and live_sequences (derived from the
// same snapshot) agree with its states.
TEST_F(CacheManagerMetricsTest, StatesSumToCapacityInEveryScrapeWhileSnapshotsChange) {
  constexpr uint32_t kSeed = 20240611;
  std::cout << "seed " << kSeed << "\n";
  std::atomic<bool> stop{false};
  std::atomic<int64_t> published{0};
  std::thread publisher([&] {
    std::mt19937 rng(kSeed);
    while (!stop.load()) {
      std::uniform_int_distribution<int32_t> any(0, kNumBlocks);
      const int32_t in_use = any(rng);
      const int32_t cached = std::uniform_int_distribution<int32_t>(0, kNumBlocks - in_use)(rng);
      const int32_t pinned =
          std::uniform_int_distribution<int32_t>(0, kNumBlocks - in_use - cached)(rng);
      const int32_t quarantined = std::uniform_int_distribution<int32_t>(0, in_use)(rng);
      CacheManagerSnapshot s = Snapshot(in_use, cached, pinned, quarantined);
      s.draining_blocks = std::uniform_int_distribution<int32_t>(0, in_use - quarantined)(rng);
      s.ledger.live_sequences = in_use;  // a marker tying the gauges to one snapshot
      metrics_.PublishSnapshot(s);
      published.fetch_add(1);
    }
  });

  constexpr int kScrapes = 60;
  std::set<double> seen_free;
  for (int i = 0; i < kScrapes; ++i) {
    const MetricsText text = Scrape();
    double sum = 0;
    for (const char* state : kStates) sum += ValueOr(text, "kvcm_cache_blocks", {{"state", state}});
    ASSERT_EQ(sum, ValueOr(text, "kvcm_cache_capacity_blocks")) << "scrape " << i;
    const double in_use_total = ValueOr(text, "kvcm_cache_blocks", {{"state", "in_use"}}) +
                                ValueOr(text, "kvcm_cache_blocks", {{"state", "quarantined"}}) +
                                ValueOr(text, "kvcm_cache_blocks", {{"state", "draining"}});
    ASSERT_EQ(ValueOr(text, "kvcm_cache_live_sequences"), in_use_total) << "scrape " << i;
    ASSERT_DOUBLE_EQ(ValueOr(text, "kvcm_cache_usage_ratio") * kNumBlocks, in_use_total);
    ASSERT_DOUBLE_EQ(ValueOr(text, "kvcm_cache_occupancy_ratio") * kNumBlocks,
                     kNumBlocks - ValueOr(text, "kvcm_cache_blocks", {{"state", "free"}}));
    seen_free.insert(ValueOr(text, "kvcm_cache_blocks", {{"state", "free"}}));
  }
  stop.store(true);
  publisher.join();
  std::cout << published.load() << " snapshots published during " << kScrapes << " scrapes, "
            << seen_free.size() << " distinct free counts seen\n";
  EXPECT_GT(seen_free.size(), 1u) << "the scrapes did not see the snapshots change";
}

TEST(CacheManagerMetricsNamesTest, LabelValuesAreTheDocumentedOnes) {
  std::vector<std::string> types, reasons, roles, reclaims;
  for (int i = 0; i < kRequestTypes; ++i) {
    types.emplace_back(RequestTypeName(static_cast<RequestType>(i)));
  }
  for (int i = 0; i < kRejectReasons; ++i) {
    reasons.emplace_back(RejectReasonName(static_cast<RejectReason>(i)));
  }
  for (int i = 0; i < kSessionRoles; ++i) {
    roles.emplace_back(SessionRoleName(static_cast<SessionRole>(i)));
  }
  for (int i = 0; i < kReclaimReasons; ++i) {
    reclaims.emplace_back(ReclaimReasonName(static_cast<ReclaimReason>(i)));
  }
  EXPECT_THAT(types, ElementsAre("hello", "attach", "step", "lookup", "pin", "unpin", "stats",
                                 "heartbeat", "goodbye", "event_snapshot", "describe_session",
                                 "end_session", "block_map"));
  EXPECT_THAT(reasons,
              ElementsAre("malformed", "unsupported_version", "oversized", "not_registered",
                          "stale_session", "stale_epoch", "invalid_argument", "unknown_sequence",
                          "wrong_owner", "duplicate_sequence", "permission_denied",
                          "limit_exceeded", "shutting_down"));
  EXPECT_THAT(roles, ElementsAre("router", "executor", "control"));
  EXPECT_THAT(reclaims, ElementsAre("client_died", "goodbye", "session_replaced", "lease_expired",
                                    "ended_by_operator"));
}

TEST(CacheManagerMetricsDeathTest, SnapshotOfAnotherPoolOrBrokenStatesDies) {
  CacheManagerMetrics metrics(Info());
  CacheManagerSnapshot wrong_pool = Snapshot(1, 1, 1, 0);
  wrong_pool.ledger.num_blocks = kNumBlocks + 1;
  EXPECT_DEATH(metrics.PublishSnapshot(wrong_pool), "snapshot of 65 blocks");
  CacheManagerSnapshot not_a_partition = Snapshot(1, 1, 1, 0);
  not_a_partition.ledger.free_blocks -= 1;
  EXPECT_DEATH(metrics.PublishSnapshot(not_a_partition), "do not partition");
  EXPECT_DEATH(metrics.PublishSnapshot(Snapshot(2, 0, 0, 3)), "quarantined 3 and draining 0 of 2");
  CacheManagerSnapshot over = Snapshot(2, 0, 0, 1);
  over.draining_blocks = 2;
  EXPECT_DEATH(metrics.PublishSnapshot(over), "quarantined 1 and draining 2 of 2");
}

}  // namespace
}  // namespace kvcm::cache_manager
