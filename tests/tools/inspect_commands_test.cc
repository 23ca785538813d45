// kvcmctl info / stats / watch without a process: flag parsing, the default run directory,
// and the text and JSON formats of a made-up StatsSnapshot.

#include <sstream>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/support/status_matchers.h"
#include "tools/kvcmctl/connection.h"
#include "tools/kvcmctl/info_command.h"
#include "tools/kvcmctl/stats_command.h"
#include "tools/kvcmctl/watch_command.h"

namespace kvcm::kvcmctl {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

StatsSnapshot SampleStats() {
  StatsSnapshot s;
  s.num_blocks = 100;
  s.block_size = 16;
  s.free_blocks = 50;
  s.in_use_blocks = 30;  // 5 of them quarantined
  s.quarantined_blocks = 5;
  s.cached_blocks = 15;
  s.pinned_blocks = 5;
  s.live_sequences = 4;
  s.usage_ratio = 0.30;
  s.occupancy_ratio = 0.50;
  s.prefix_query_tokens = 400;
  s.prefix_hit_tokens = 100;
  s.blocks_allocated = 70;
  s.blocks_released = 40;
  s.evictions = 3;
  s.allocation_failures = 1;
  s.cow_copies = 2;
  s.epoch = 77;
  s.sessions = 3;
  s.events_published = 12;
  s.backend = PoolBackend::kShm;
  s.spec.num_layers = 32;
  s.spec.num_kv_heads = 8;
  s.spec.head_dim = 128;
  s.spec.dtype = DType::kBFloat16;
  s.spec.block_size = 16;
  s.block_bytes = static_cast<uint64_t>(s.spec.BytesPerBlock());
  s.pool_bytes = s.block_bytes * 100;
  s.uptime_seconds = 12.5;
  s.rejected_messages = 6;
  return s;
}

TEST(ConnectionOptionsTest, DefaultRunDirFollowsTheCacheManager) {
  EXPECT_EQ(DefaultRunDir("/run/user/1000", 1000), "/run/user/1000/kvcm");
  EXPECT_EQ(DefaultRunDir(nullptr, 1000), "/tmp/kvcm-1000");
  EXPECT_EQ(DefaultRunDir("relative", 7), "/tmp/kvcm-7");
}

TEST(ConnectionOptionsTest, RunDirEndpointAndTimeout) {
  absl::StatusOr<InfoOptions> options = ParseInfoOptions({}, "/d");
  ASSERT_THAT(options, IsOk());
  EXPECT_EQ(options->connection.endpoint, "ipc:///d/cache-manager.sock");
  EXPECT_EQ(options->connection.events_endpoint, "ipc:///d/events.sock");
  EXPECT_EQ(options->connection.timeout, absl::Seconds(5));

  options = ParseInfoOptions({"--run-dir", "/x", "--timeout", "250ms", "--json"}, "/d");
  ASSERT_THAT(options, IsOk());
  EXPECT_EQ(options->connection.endpoint, "ipc:///x/cache-manager.sock");
  EXPECT_EQ(options->connection.timeout, absl::Milliseconds(250));
  EXPECT_TRUE(options->connection.json);

  options = ParseInfoOptions({"--endpoint", "tcp://127.0.0.1:5555"}, "/d");
  ASSERT_THAT(options, IsOk());
  EXPECT_EQ(options->connection.endpoint, "tcp://127.0.0.1:5555");
  EXPECT_EQ(options->connection.events_endpoint, "");

  options = ParseInfoOptions({"--endpoint", "ipc:///y/cache-manager.sock"}, "/d");
  ASSERT_THAT(options, IsOk());
  EXPECT_EQ(options->connection.events_endpoint, "ipc:///y/events.sock");
}

TEST(ConnectionOptionsTest, BadFlagsAreInvalidArgument) {
  for (const std::vector<std::string>& args : std::vector<std::vector<std::string>>{
           {"--run-dir", "/x", "--endpoint", "ipc:///y"},
           {"--endpoint", "http://x"},
           {"--timeout", "5"},
           {"--timeout", "-1s"},
           {"--bogus"},
           {"positional"},
       }) {
    EXPECT_EQ(ParseStatsOptions(args, "/d").status().code(), absl::StatusCode::kInvalidArgument)
        << args[0];
  }
  EXPECT_EQ(ParseWatchOptions({"--interval", "0s"}, "/d").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseWatchOptions({"--count", "0"}, "/d").status().code(),
            absl::StatusCode::kInvalidArgument);
  // info takes no watch flags.
  EXPECT_EQ(ParseInfoOptions({"--interval", "1s"}, "/d").status().code(),
            absl::StatusCode::kInvalidArgument);
  absl::StatusOr<WatchOptions> watch =
      ParseWatchOptions({"--interval", "2s", "--count", "3"}, "/d");
  ASSERT_THAT(watch, IsOk());
  EXPECT_EQ(watch->interval, absl::Seconds(2));
  EXPECT_EQ(watch->count, 3);
}

TEST(DescribeUnreachableTest, NamesTheEndpointOnce) {
  const absl::Status status = DescribeUnreachable(
      absl::DeadlineExceededError("cache manager at ipc:///d/s did not answer Hello within 5s"),
      "ipc:///d/s");
  EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(status.message(), "no cache manager at ipc:///d/s: did not answer Hello within 5s");
  EXPECT_EQ(DescribeUnreachable(absl::NotFoundError("x"), "e").message(), "x");
}

TEST(StatsFormatTest, StatesSumToCapacityWithQuarantinedApart) {
  const StatsSnapshot stats = SampleStats();
  const BlockStates states = StatesOf(stats);
  EXPECT_EQ(states.in_use, 25);
  EXPECT_EQ(states.total(), 100);

  const std::string text = FormatStatsText(stats);
  EXPECT_THAT(text, HasSubstr("free                 50    50.0%"));
  EXPECT_THAT(text, HasSubstr("in use               25    25.0%"));
  EXPECT_THAT(text, HasSubstr("quarantined           5     5.0%"));
  EXPECT_THAT(text, HasSubstr("total               100   100.0%"));
  EXPECT_THAT(text, HasSubstr("Prefix hit rate 25.0% (100 of 400 prompt tokens"));
  EXPECT_THAT(text, HasSubstr("Evictions 3; copy-on-write copies 2; allocation failures 1"));
  EXPECT_THAT(text, HasSubstr("Events published 12; messages rejected 6"));
  EXPECT_THAT(text, Not(HasSubstr("WARNING")));

  StatsSnapshot broken = stats;
  broken.free_blocks = 49;
  EXPECT_THAT(FormatStatsText(broken), HasSubstr("WARNING: the states sum to 99 blocks, not 100"));

  // Draining blocks (an ended router's, behind a fence) are shown apart from in use, and
  // the states still sum to the capacity.
  StatsSnapshot fenced = stats;
  fenced.draining_blocks = 7;
  const BlockStates fenced_states = StatesOf(fenced);
  EXPECT_EQ(fenced_states.total(), 100);
  const std::string fenced_text = FormatStatsText(fenced);
  EXPECT_THAT(fenced_text, HasSubstr("draining              7     7.0%"));
  EXPECT_THAT(fenced_text, HasSubstr("in use               18    18.0%"));
  EXPECT_THAT(fenced_text, HasSubstr("total               100   100.0%"));
  EXPECT_THAT(fenced_text, Not(HasSubstr("WARNING")));
  const nlohmann::json fenced_json = nlohmann::json::parse(FormatStatsJson(fenced));
  EXPECT_EQ(fenced_json["blocks"]["draining"], 7);

  const nlohmann::json j = nlohmann::json::parse(FormatStatsJson(stats));
  int64_t sum = 0;
  for (const auto& [state, count] : j["blocks"].items()) sum += count.get<int64_t>();
  EXPECT_EQ(sum, 100);
  EXPECT_EQ(j["blocks"]["in_use"], 25);
  EXPECT_DOUBLE_EQ(j["prefix_hit_rate"].get<double>(), 0.25);
  EXPECT_EQ(j["cow_copies"], 2);
}

TEST(StatsFormatTest, TiersAreShownOnlyWhenOn) {
  const StatsSnapshot plain = SampleStats();
  EXPECT_THAT(FormatStatsText(plain), Not(HasSubstr("Tiers")));
  EXPECT_FALSE(nlohmann::json::parse(FormatStatsJson(plain)).contains("tiers"));
  EXPECT_FALSE(nlohmann::json::parse(FormatStatsJson(plain)).contains("tier_held_blocks"));

  StatsSnapshot tiered = plain;
  tiered.tiers = {{"host", 64, 40, 2, 50, 7, 3}, {"disk", 1000, 45, 1, 46, 5, 0}};
  tiered.tier_held_blocks = 2;
  tiered.tier_loading_blocks = 4;
  tiered.tier_refusals_total = 1;
  tiered.tier_recovered_blocks = 9;
  const std::string text = FormatStatsText(tiered);
  EXPECT_THAT(text, HasSubstr("Tiers: 2 pool blocks held for stores, 4 loading; disk refusals 1, "
                              "blocks recovered at start 9\n"));
  EXPECT_THAT(text, HasSubstr("  tier     capacity      ready  writing       stored       loaded"
                              "      evicted\n"));
  EXPECT_THAT(text, HasSubstr("  host           64         40        2           50            7"
                              "            3\n"));
  EXPECT_THAT(text, HasSubstr("  disk         1000         45        1           46            5"
                              "            0\n"));
  const nlohmann::json j = nlohmann::json::parse(FormatStatsJson(tiered));
  ASSERT_EQ(j["tiers"].size(), 2u);
  EXPECT_EQ(j["tiers"][0]["name"], "host");
  EXPECT_EQ(j["tiers"][0]["capacity_blocks"], 64);
  EXPECT_EQ(j["tiers"][0]["ready_blocks"], 40);
  EXPECT_EQ(j["tiers"][0]["writing_blocks"], 2);
  EXPECT_EQ(j["tiers"][0]["stored_total"], 50);
  EXPECT_EQ(j["tiers"][0]["loaded_total"], 7);
  EXPECT_EQ(j["tiers"][0]["evicted_total"], 3);
  EXPECT_EQ(j["tiers"][1]["name"], "disk");
  EXPECT_EQ(j["tier_held_blocks"], 2);
  EXPECT_EQ(j["tier_loading_blocks"], 4);
  EXPECT_EQ(j["tier_refusals_total"], 1);
  EXPECT_EQ(j["tier_recovered_blocks"], 9);
}

TEST(InfoFormatTest, ShowsShapeSizesAndEndpoints) {
  InfoReport report;
  report.endpoint = "ipc:///d/cache-manager.sock";
  report.events_endpoint = "ipc:///d/events.sock";
  report.session.heartbeat_interval = absl::Seconds(1);
  report.session.heartbeat_timeout = absl::Seconds(5);
  report.session.max_ops_per_step = 4096;
  report.stats = SampleStats();
  const std::string text = FormatInfoText(report);
  EXPECT_THAT(text, HasSubstr("32 layers x 8 KV heads x head dim 128, bf16, block size 16"));
  EXPECT_THAT(text, HasSubstr("bytes per block    2097152 B"));
  EXPECT_THAT(text, HasSubstr("num_blocks         100"));
  EXPECT_THAT(text, HasSubstr("max total tokens   1600"));
  EXPECT_THAT(text, HasSubstr("events             ipc:///d/events.sock"));
  const nlohmann::json j = nlohmann::json::parse(FormatInfoJson(report));
  EXPECT_EQ(j["block_bytes"], 2097152);
  EXPECT_EQ(j["pool_bytes"], 209715200);
  EXPECT_EQ(j["bytes_per_token"], 131072);
  EXPECT_EQ(j["dtype"], "bf16");
  EXPECT_EQ(j["backend"], "shm");
  EXPECT_EQ(j["epoch"], 77);
}

TEST(WatchFormatTest, RatesOverTheInterval) {
  const StatsSnapshot before = SampleStats();
  StatsSnapshot after = before;
  after.blocks_allocated += 20;
  after.evictions += 4;
  after.prefix_query_tokens += 100;
  after.prefix_hit_tokens += 75;
  WatchSample sample;
  sample.time = absl::FromUnixSeconds(3600 * 5 + 61);
  sample.stats = after;
  EXPECT_THAT(FormatWatchLine(sample), HasSubstr("05:01:01"));
  EXPECT_THAT(FormatWatchLine(sample), HasSubstr("       -        -"));  // no rates yet
  sample.previous = &before;
  sample.elapsed = absl::Seconds(2);
  const std::string line = FormatWatchLine(sample);
  EXPECT_THAT(line, HasSubstr("75.0%"));  // hit rate over the interval
  EXPECT_THAT(line, HasSubstr("    10.0      2.0"));
  EXPECT_EQ(line.back(), '\n');
  const nlohmann::json j = nlohmann::json::parse(FormatWatchJson(sample));
  EXPECT_DOUBLE_EQ(j["allocations_per_second"].get<double>(), 10.0);
  EXPECT_DOUBLE_EQ(j["interval_prefix_hit_rate"].get<double>(), 0.75);
  EXPECT_EQ(j["blocks"]["quarantined"], 5);
  // Header and line have the same number of columns.
  const auto columns = [](const std::string& s) {
    std::istringstream in(s);
    std::string word;
    int n = 0;
    while (in >> word) ++n;
    return n;
  };
  EXPECT_EQ(columns(FormatWatchHeader()), columns(line));
}

}  // namespace
}  // namespace kvcm::kvcmctl
