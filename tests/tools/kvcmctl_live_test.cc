// The kvcmctl binary (KVCMCTL_PATH) against a real kvcm-cache-manager (tests/support):
// info, stats and watch in text and JSON, and "no cache manager" when nothing runs or
// nothing answers.

#include <signal.h>

#include <cstdio>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/block/block_hash.h"
#include "common/client/cache_manager_client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/support/cache_manager_process.h"
#include "tests/support/status_matchers.h"
#include "tests/support/subprocess.h"
#include "tests/support/wait_for.h"

#ifndef KVCMCTL_PATH
#error "KVCMCTL_PATH must name the kvcmctl binary"
#endif

namespace kvcm {
namespace {

using ::kvcm::testing::CacheManagerOptions;
using ::kvcm::testing::CacheManagerProcess;
using ::kvcm::testing::RunProgram;
using ::kvcm::testing::RunResult;
using ::kvcm::testing::StartCacheManager;
using ::kvcm::testing::TempDir;
using ::kvcm::testing::WaitFor;
using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::SizeIs;

RunResult Kvcmctl(const std::vector<std::string>& args,
                  absl::Duration timeout = absl::Seconds(30)) {
  std::vector<std::string> argv = {std::string(KVCMCTL_PATH)};
  for (const std::string& arg : args) argv.push_back(arg);
  absl::StatusOr<RunResult> result = RunProgram(argv, "", timeout);
  EXPECT_THAT(result, IsOk());
  return result.ok() ? *result : RunResult{-1, result.status().ToString()};
}

class KvcmctlLiveTest : public ::testing::Test {
 protected:
  void SetUp() override {
    CacheManagerOptions options;
    options.num_blocks = 16;
    options.block_size = 4;
    absl::StatusOr<std::unique_ptr<CacheManagerProcess>> cm = StartCacheManager(options);
    ASSERT_THAT(cm, IsOk());
    cm_ = std::move(*cm);

    // Some state to report: 2 cached blocks (one pinned) and a live 3-block sequence.
    CacheManagerClient::Options client_options;
    client_options.endpoint = cm_->endpoint();
    client_options.role = wire::Role::Router;
    client_options.name = "kvcmctl-live-test";
    absl::StatusOr<std::unique_ptr<CacheManagerClient>> client =
        CacheManagerClient::Connect(client_options);
    ASSERT_THAT(client, IsOk());
    router_ = std::move(*client);
    std::vector<int32_t> tokens(8);
    std::iota(tokens.begin(), tokens.end(), 0);
    std::vector<BlockHash> hashes;
    HashFullBlocks(HashAlgorithm::kSha256, RootHash(HashAlgorithm::kSha256, ""), tokens, 4,
                   &hashes);
    BlockOps step;
    step.Allocate(1, 8, hashes);
    ASSERT_THAT(router_->Step(step), IsOk());
    step.Clear();
    step.Commit(1, 8).Free(1).Allocate(2, 10, hashes);
    ASSERT_THAT(router_->Step(step), IsOk());
    step.Clear();
    step.Free(2);
    ASSERT_THAT(router_->Step(step), IsOk());
    ASSERT_THAT(router_->Pin("head", std::span(hashes).first(1)), IsOk());
    step.Clear();
    step.Allocate(3, 9);
    ASSERT_THAT(router_->Step(step), IsOk());
  }

  std::unique_ptr<CacheManagerProcess> cm_;
  std::unique_ptr<CacheManagerClient> router_;
};

TEST_F(KvcmctlLiveTest, InfoShowsThePool) {
  RunResult result = Kvcmctl({"info", "--run-dir", cm_->run_dir()});
  ASSERT_EQ(result.exit_code, 0) << result.output;
  EXPECT_THAT(result.output, HasSubstr("2 layers x 2 KV heads x head dim 8, fp16, block size 4"));
  EXPECT_THAT(result.output, HasSubstr(absl::StrCat("epoch              ", cm_->epoch())));
  EXPECT_THAT(result.output, HasSubstr("num_blocks         16"));
  EXPECT_THAT(result.output, HasSubstr("bytes per block    512 B"));
  EXPECT_THAT(result.output, HasSubstr("backend            shm"));
  EXPECT_THAT(result.output, HasSubstr(cm_->events_endpoint()));
  EXPECT_THAT(result.output, HasSubstr(cm_->metrics_url()));

  result = Kvcmctl({"info", "--endpoint", cm_->endpoint(), "--json"});
  ASSERT_EQ(result.exit_code, 0) << result.output;
  const nlohmann::json j = nlohmann::json::parse(result.output);
  EXPECT_EQ(j["epoch"], cm_->epoch());
  EXPECT_EQ(j["num_blocks"], 16);
  EXPECT_EQ(j["block_bytes"], 512);
  EXPECT_EQ(j["pool_bytes"], 16 * 512);
  EXPECT_EQ(j["max_total_tokens"], 64);
  EXPECT_EQ(j["endpoint"], cm_->endpoint());
  EXPECT_EQ(j["events_endpoint"], cm_->events_endpoint());
  EXPECT_EQ(j["metrics_url"], cm_->metrics_url());
  EXPECT_EQ(j["sessions"], 2);  // the router and kvcmctl itself
}

TEST_F(KvcmctlLiveTest, StatsSumToCapacity) {
  RunResult result = Kvcmctl({"stats", "--run-dir", cm_->run_dir(), "--json"});
  ASSERT_EQ(result.exit_code, 0) << result.output;
  const nlohmann::json j = nlohmann::json::parse(result.output);
  EXPECT_EQ(j["blocks"]["in_use"], 3);
  EXPECT_EQ(j["blocks"]["cached"], 1);
  EXPECT_EQ(j["blocks"]["pinned"], 1);
  EXPECT_EQ(j["blocks"]["free"], 11);
  int64_t sum = 0;
  for (const auto& [state, count] : j["blocks"].items()) sum += count.get<int64_t>();
  EXPECT_EQ(sum, 16);
  EXPECT_EQ(j["prefix_hit_tokens"], 8);
  EXPECT_GT(j["prefix_hit_rate"].get<double>(), 0.0);

  result = Kvcmctl({"stats", "--run-dir", cm_->run_dir()});
  ASSERT_EQ(result.exit_code, 0) << result.output;
  EXPECT_THAT(result.output, HasSubstr("total                16   100.0%"));
  EXPECT_THAT(result.output, HasSubstr("in use                3    18.8%"));
  EXPECT_THAT(result.output, HasSubstr("Live sequences 1"));
  // No tiers: nothing about them.
  EXPECT_THAT(result.output, Not(HasSubstr("Tiers")));
  EXPECT_FALSE(j.contains("tiers"));
}

// A cache manager with a host tier: `kvcmctl stats` shows it, and the blocks a Commit wrote
// through to it once a mover has copied them.
TEST(KvcmctlTiersTest, StatsShowTheHostTier) {
  CacheManagerOptions options;
  options.num_blocks = 16;
  options.block_size = 4;
  options.extra_args = {"--host-tier-bytes=8KiB"};  // 16 slots of 512 B
  absl::StatusOr<std::unique_ptr<CacheManagerProcess>> cm = StartCacheManager(options);
  ASSERT_THAT(cm, IsOk());
  CacheManagerClient::Options client_options;
  client_options.endpoint = (*cm)->endpoint();
  client_options.role = wire::Role::Router;
  client_options.name = "kvcmctl-tiers-test";
  absl::StatusOr<std::unique_ptr<CacheManagerClient>> router =
      CacheManagerClient::Connect(client_options);
  ASSERT_THAT(router, IsOk());
  std::vector<int32_t> tokens(8);
  std::iota(tokens.begin(), tokens.end(), 0);
  std::vector<BlockHash> hashes;
  HashFullBlocks(HashAlgorithm::kSha256, RootHash(HashAlgorithm::kSha256, ""), tokens, 4, &hashes);
  BlockOps step;
  step.Allocate(1, 8, hashes);
  ASSERT_THAT((*router)->Step(step), IsOk());
  step.Clear();
  step.Commit(1, 8).Free(1);  // 2 full blocks enter the prefix index: written through
  ASSERT_THAT((*router)->Step(step), IsOk());

  nlohmann::json j;
  const absl::Status stored = WaitFor(
      [&] {
        const RunResult result = Kvcmctl({"stats", "--run-dir", (*cm)->run_dir(), "--json"});
        if (result.exit_code != 0) return false;
        j = nlohmann::json::parse(result.output);
        return j.contains("tiers") && j["tiers"].size() == 1 && j["tiers"][0]["ready_blocks"] == 2;
      },
      absl::Seconds(60));
  ASSERT_THAT(stored, IsOk()) << j.dump();
  EXPECT_EQ(j["tiers"][0]["name"], "host");  // no disk tier: not listed
  EXPECT_EQ(j["tiers"][0]["capacity_blocks"], 16);
  EXPECT_EQ(j["tiers"][0]["writing_blocks"], 0);
  EXPECT_EQ(j["tiers"][0]["stored_total"], 2);
  EXPECT_EQ(j["tiers"][0]["loaded_total"], 0);
  EXPECT_EQ(j["tiers"][0]["evicted_total"], 0);
  EXPECT_EQ(j["tier_held_blocks"], 0);
  EXPECT_EQ(j["tier_loading_blocks"], 0);
  EXPECT_EQ(j["tier_refusals_total"], 0);
  EXPECT_EQ(j["tier_recovered_blocks"], 0);

  const RunResult text = Kvcmctl({"stats", "--run-dir", (*cm)->run_dir()});
  ASSERT_EQ(text.exit_code, 0) << text.output;
  EXPECT_THAT(text.output, HasSubstr("Tiers: 0 pool blocks held for stores, 0 loading; disk "
                                     "refusals 0, blocks recovered at start 0\n"));
  EXPECT_THAT(text.output, HasSubstr("  host           16          2        0            2"));
  EXPECT_THAT(text.output, Not(HasSubstr("  disk ")));
}

TEST_F(KvcmctlLiveTest, WatchPrintsOneLinePerIntervalAndSaysGoodbye) {
  const absl::Time start = absl::Now();
  RunResult result =
      Kvcmctl({"watch", "--run-dir", cm_->run_dir(), "--interval", "100ms", "--count", "3"});
  ASSERT_EQ(result.exit_code, 0) << result.output;
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(200));
  std::vector<std::string> lines = absl::StrSplit(result.output, '\n', absl::SkipEmpty());
  ASSERT_THAT(lines, SizeIs(4)) << result.output;
  EXPECT_THAT(lines[0], HasSubstr("free  in_use  cached  pinned"));
  EXPECT_THAT(lines[1], HasSubstr("     11       3       1       1       0"));

  result = Kvcmctl(
      {"watch", "--endpoint", cm_->endpoint(), "--interval", "50ms", "--count", "2", "--json"});
  ASSERT_EQ(result.exit_code, 0) << result.output;
  lines = absl::StrSplit(result.output, '\n', absl::SkipEmpty());
  ASSERT_THAT(lines, SizeIs(2)) << result.output;
  const nlohmann::json second = nlohmann::json::parse(lines[1]);
  EXPECT_EQ(second["blocks"]["in_use"], 3);
  EXPECT_TRUE(second.contains("allocations_per_second"));

  // Every kvcmctl said Goodbye: only the router's session is left.
  absl::StatusOr<StatsSnapshot> stats = router_->Stats();
  ASSERT_THAT(stats, IsOk());
  EXPECT_EQ(stats->sessions, 1u);
}

TEST_F(KvcmctlLiveTest, StoppedCacheManagerIsReportedWithinTheTimeout) {
  ASSERT_THAT(cm_->process().Signal(SIGSTOP), IsOk());
  const absl::Time start = absl::Now();
  RunResult result = Kvcmctl({"stats", "--run-dir", cm_->run_dir(), "--timeout", "300ms"});
  const absl::Duration took = absl::Now() - start;
  ASSERT_THAT(cm_->process().Signal(SIGCONT), IsOk());
  EXPECT_EQ(result.exit_code, 1) << result.output;
  EXPECT_THAT(result.output,
              HasSubstr(absl::StrCat("kvcmctl stats: no cache manager at ", cm_->endpoint(),
                                     ": did not answer Hello within 300ms")));
  // It gave up at its own timeout, which the message names: the cache manager stays
  // stopped until kvcmctl has exited. How long that took is printed, not bounded: a
  // loaded machine adds any amount to the start of a process (docs/RELIABILITY.md,
  // "Timing in tests").
  std::printf("kvcmctl with --timeout 300ms gave up after %s\n",
              absl::FormatDuration(took).c_str());
}

TEST_F(KvcmctlLiveTest, EndSessionEndsARouterAndFreesItsBlocks) {
  // The router holds sequence 3 (3 blocks); no executor is registered, so nothing can be
  // writing them and they come back at once.
  const uint64_t session = router_->session_id();
  // `kvcmctl info` lists it, so that an operator can find the id.
  const RunResult info = Kvcmctl({"info", "--run-dir", cm_->run_dir()});
  ASSERT_EQ(info.exit_code, 0) << info.output;
  EXPECT_THAT(info.output, HasSubstr(absl::StrCat(session)));
  EXPECT_THAT(info.output, HasSubstr("kvcmctl-live-test"));
  EXPECT_THAT(info.output, HasSubstr("1 sequences"));
  const RunResult json = Kvcmctl({"info", "--run-dir", cm_->run_dir(), "--json"});
  EXPECT_THAT(json.output, HasSubstr(absl::StrCat("\"session_id\": ", session)));
  const RunResult ended =
      Kvcmctl({"end-session", absl::StrCat(session), "--run-dir", cm_->run_dir()});
  EXPECT_EQ(ended.exit_code, 0) << ended.output;
  EXPECT_THAT(ended.output, HasSubstr(absl::StrCat("ended session ", session, ": 3 blocks")));
  absl::StatusOr<StatsSnapshot> refused = router_->Stats();
  EXPECT_TRUE(absl::IsAborted(refused.status())) << refused.status();

  const RunResult stats = Kvcmctl({"stats", "--run-dir", cm_->run_dir(), "--json"});
  ASSERT_EQ(stats.exit_code, 0) << stats.output;
  EXPECT_THAT(stats.output, HasSubstr("\"live_sequences\": 0"));
  // Unknown ids and nonsense are errors that say so.
  const RunResult unknown = Kvcmctl({"end-session", "999", "--run-dir", cm_->run_dir()});
  EXPECT_EQ(unknown.exit_code, 1);
  EXPECT_THAT(unknown.output, HasSubstr("no session 999"));
  const RunResult bad = Kvcmctl({"end-session", "abc", "--run-dir", cm_->run_dir()});
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_THAT(bad.output, HasSubstr("not a positive number"));
}

TEST(KvcmctlNoCacheManagerTest, NothingRunningExitsOneAtOnce) {
  absl::StatusOr<TempDir> dir = TempDir::Create("kvcm-ctl");
  ASSERT_THAT(dir, IsOk());
  for (const char* command : {"info", "stats", "watch"}) {
    // At once, not after waiting for a Hello's reply: a timeout longer than this test may
    // run (Kvcmctl stops it after 30 s) tells the two apart on a loaded machine too.
    RunResult result = Kvcmctl({command, "--run-dir", dir->path(), "--timeout", "600s"});
    EXPECT_EQ(result.exit_code, 1) << result.output;
    EXPECT_THAT(result.output,
                HasSubstr(absl::StrCat("kvcmctl ", command, ": no cache manager at ipc://",
                                       dir->path(), "/cache-manager.sock: no socket file")));
  }
}

TEST(KvcmctlNoCacheManagerTest, ConflictingFlagsAreUsageErrors) {
  RunResult result = Kvcmctl({"info", "--run-dir", "/x", "--endpoint", "ipc:///y"});
  EXPECT_EQ(result.exit_code, 2) << result.output;
  EXPECT_THAT(result.output, HasSubstr("cannot be combined"));
  result = Kvcmctl({"watch", "--help"});
  EXPECT_EQ(result.exit_code, 0) << result.output;
  EXPECT_THAT(result.output, HasSubstr("--interval"));
}

}  // namespace
}  // namespace kvcm
