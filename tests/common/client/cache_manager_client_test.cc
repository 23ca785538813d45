// CacheManagerClient against a real kvcm-cache-manager process (tests/support): sessions,
// steps, prefix hits, pins, stats, deadlines, restarts and session expiry.

#include "common/client/cache_manager_client.h"

#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/block/block_hash.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/cache_manager_process.h"
#include "tests/support/http_client.h"
#include "tests/support/metrics_text.h"
#include "tests/support/status_matchers.h"
#include "tests/support/subprocess.h"
#include "tests/support/wait_for.h"

namespace kvcm {
namespace {

using ::kvcm::testing::CacheManagerOptions;
using ::kvcm::testing::CacheManagerProcess;
using ::kvcm::testing::StartCacheManager;
using ::kvcm::testing::TempDir;
using ::kvcm::testing::ThreadSleeps;
using ::kvcm::testing::WaitFor;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::SizeIs;

constexpr int32_t kNumBlocks = 16;
constexpr int32_t kBlockSize = 4;
// Heartbeats every 100 ms; a session silent for 3 s is quarantined. The tests of expiry wait
// that long for the silent session, and every other session of this process must outlive
// however long a loaded machine leaves its heartbeat thread unscheduled
// (docs/RELIABILITY.md, "Timing in tests").
constexpr int32_t kHeartbeatIntervalMs = 100;
constexpr int32_t kHeartbeatTimeoutMs = 3000;

// Hashes of the full blocks of tokens [first, first + n).
std::vector<BlockHash> HashesOf(int32_t first, int32_t n) {
  std::vector<int32_t> tokens(n);
  std::iota(tokens.begin(), tokens.end(), first);
  std::vector<BlockHash> hashes;
  HashFullBlocks(HashAlgorithm::kSha256, RootHash(HashAlgorithm::kSha256, "client-test"), tokens,
                 kBlockSize, &hashes);
  return hashes;
}

CacheManagerOptions SmallPool() {
  CacheManagerOptions options;
  options.num_blocks = kNumBlocks;
  options.block_size = kBlockSize;
  options.heartbeat_interval_ms = kHeartbeatIntervalMs;
  options.heartbeat_timeout_ms = kHeartbeatTimeoutMs;
  return options;
}

std::unique_ptr<CacheManagerClient> ConnectOrDie(const std::string& endpoint,
                                                 wire::Role role = wire::Role::Router,
                                                 absl::Duration timeout = absl::Seconds(5),
                                                 bool heartbeats = true) {
  CacheManagerClient::Options options;
  options.endpoint = endpoint;
  options.role = role;
  options.name = "client-test";
  options.call_timeout = timeout;
  options.heartbeats = heartbeats;
  // Again while the Hello times out: a short call timeout is there to time out against a
  // cache manager the test stops, but a loaded machine can exceed it before that.
  absl::StatusOr<std::unique_ptr<CacheManagerClient>> client;
  (void)WaitFor(
      [&] {
        client = CacheManagerClient::Connect(options);
        return !absl::IsDeadlineExceeded(client.status());
      },
      absl::Seconds(60));
  EXPECT_THAT(client, IsOk());
  return client.ok() ? std::move(*client) : nullptr;
}

// `call()`, again while it times out (for 60 s at most), for a client whose short call
// timeout is there to time out against a cache manager the test stopped: once it runs again
// a loaded machine can still keep a reply past that timeout. Each call's late reply is
// dropped by the next (another request id); a retried Step keeps its id.
template <typename Call>
auto UntilAnswered(Call call) -> decltype(call()) {
  decltype(call()) result;
  (void)WaitFor(
      [&] {
        result = call();
        return !absl::IsDeadlineExceeded(result.status());
      },
      absl::Seconds(60));
  return result;
}

// The five states partition the pool.
void ExpectPartition(const StatsSnapshot& s) {
  EXPECT_EQ(s.free_blocks + s.in_use_blocks + s.cached_blocks + s.pinned_blocks, s.num_blocks)
      << "free " << s.free_blocks << " in use " << s.in_use_blocks << " (quarantined "
      << s.quarantined_blocks << ") cached " << s.cached_blocks << " pinned " << s.pinned_blocks;
  EXPECT_LE(s.quarantined_blocks, s.in_use_blocks);
}

class CacheManagerClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<CacheManagerProcess>> cm = StartCacheManager(SmallPool());
    ASSERT_THAT(cm, IsOk());
    cm_ = std::move(*cm);
    client_ = ConnectOrDie(cm_->endpoint());
    ASSERT_NE(client_, nullptr);
  }

  // Allocates seq with `tokens` tokens and the hashes of its full blocks, commits them all,
  // and frees it: its full blocks end up cached.
  std::vector<int32_t> CacheSequence(uint64_t seq, int32_t first_token, int32_t tokens) {
    const std::vector<BlockHash> hashes = HashesOf(first_token, tokens);
    BlockOps step;
    step.Allocate(seq, tokens, hashes);
    absl::StatusOr<std::vector<OpOutcome>> outcomes = client_->Step(step);
    EXPECT_THAT(outcomes, IsOk());
    if (!outcomes.ok()) return {};
    EXPECT_THAT((*outcomes)[0].status, IsOk());
    // The executors write the KV after the step: the commit comes in the next one.
    step.Clear();
    step.Commit(seq, tokens).Free(seq);
    absl::StatusOr<std::vector<OpOutcome>> committed = client_->Step(step);
    EXPECT_THAT(committed, IsOk());
    if (committed.ok()) {
      for (const OpOutcome& outcome : *committed) EXPECT_THAT(outcome.status, IsOk());
    }
    return (*outcomes)[0].blocks;
  }

  std::unique_ptr<CacheManagerProcess> cm_;
  std::unique_ptr<CacheManagerClient> client_;
};

TEST_F(CacheManagerClientTest, ConnectRegistersWithTheAnnouncedLimits) {
  const SessionInfo session = client_->session();
  EXPECT_NE(session.session_id, 0u);
  EXPECT_EQ(session.epoch, cm_->epoch());
  EXPECT_EQ(client_->epoch(), cm_->epoch());
  EXPECT_EQ(session.num_blocks, kNumBlocks);
  EXPECT_EQ(session.block_size, kBlockSize);
  EXPECT_EQ(session.heartbeat_interval, absl::Milliseconds(kHeartbeatIntervalMs));
  EXPECT_EQ(session.heartbeat_timeout, absl::Milliseconds(kHeartbeatTimeoutMs));
  EXPECT_GT(session.max_ops_per_step, 0);
  EXPECT_GT(session.max_message_bytes, 0u);
  EXPECT_THAT(client_->Heartbeat(), IsOk());
}

TEST_F(CacheManagerClientTest, StepAllocatesAppendsCommitsFreesAndHitsThePrefix) {
  const std::vector<BlockHash> hashes = HashesOf(0, 12);  // 3 full blocks
  ASSERT_THAT(hashes, SizeIs(3));

  BlockOps step;
  step.Allocate(1, 10, std::span(hashes).first(2));
  absl::StatusOr<std::vector<OpOutcome>> allocated = client_->Step(step);
  ASSERT_THAT(allocated, IsOk());
  ASSERT_THAT(*allocated, SizeIs(1));
  ASSERT_THAT((*allocated)[0].status, IsOk());
  const std::vector<int32_t> table = (*allocated)[0].blocks;
  EXPECT_THAT(table, SizeIs(3));  // ceil(10 / 4)
  EXPECT_EQ((*allocated)[0].num_cached_tokens, 0);
  for (int32_t block : table) {
    EXPECT_GE(block, 0);
    EXPECT_LT(block, kNumBlocks);
  }

  // Two tokens more still fit in block 3; then all 12 are written and block 3 is full.
  step.Clear();
  step.Append(1, 2);
  absl::StatusOr<std::vector<OpOutcome>> appended = client_->Step(step);
  ASSERT_THAT(appended, IsOk());
  ASSERT_THAT(*appended, SizeIs(1));
  EXPECT_THAT((*appended)[0].status, IsOk());
  EXPECT_THAT((*appended)[0].blocks, SizeIs(0));
  EXPECT_THAT((*appended)[0].copies, SizeIs(0));
  // Committing them in the same step is refused whole: their KV cannot be written yet.
  step.Clear();
  step.Append(1, 0).Commit(1, 13);
  absl::StatusOr<std::vector<OpOutcome>> early = client_->Step(step);
  EXPECT_TRUE(absl::IsInvalidArgument(early.status())) << early.status();
  EXPECT_THAT(early.status().message(), HasSubstr("same step"));
  // The next step, once the executors wrote them.
  step.Clear();
  step.Commit(1, 12, std::span(hashes).subspan(2));
  absl::StatusOr<std::vector<OpOutcome>> committed = client_->Step(step);
  ASSERT_THAT(committed, IsOk());
  EXPECT_THAT((*committed)[0].status, IsOk());

  // What an Allocate of these hashes would reuse: a prompt of exactly the 12 tokens never
  // reuses the block of its last token; one token more reuses all three.
  absl::StatusOr<int32_t> found = client_->Lookup(hashes);
  ASSERT_THAT(found, IsOk());
  EXPECT_EQ(*found, 2);
  found = client_->Lookup(hashes, 13);
  ASSERT_THAT(found, IsOk());
  EXPECT_EQ(*found, 3);

  step.Clear();
  step.Free(1);
  ASSERT_THAT(client_->Step(step), IsOk());
  absl::StatusOr<StatsSnapshot> stats = client_->Stats();
  ASSERT_THAT(stats, IsOk());
  EXPECT_EQ(stats->cached_blocks, 3);
  EXPECT_EQ(stats->free_blocks, kNumBlocks - 3);
  ExpectPartition(*stats);

  // Same prompt again: its two leading blocks come from the cache (a hit never covers the
  // prompt's last token, and 10 tokens end inside block 3 anyway).
  step.Clear();
  step.Allocate(2, 10, std::span(hashes).first(2));
  absl::StatusOr<std::vector<OpOutcome>> again = client_->Step(step);
  ASSERT_THAT(again, IsOk());
  ASSERT_THAT((*again)[0].status, IsOk());
  EXPECT_EQ((*again)[0].num_cached_tokens, 8);
  ASSERT_THAT((*again)[0].blocks, SizeIs(3));
  EXPECT_EQ((*again)[0].blocks[0], table[0]);
  EXPECT_EQ((*again)[0].blocks[1], table[1]);

  stats = client_->Stats();
  ASSERT_THAT(stats, IsOk());
  EXPECT_EQ(stats->live_sequences, 1);
  EXPECT_GT(stats->prefix_hit_tokens, 0u);
  EXPECT_GE(stats->prefix_query_tokens, stats->prefix_hit_tokens);
  ExpectPartition(*stats);

  // The same pool as a map: two blocks shared by sequence 2 in use, the third new one in
  // use, the old third block cached; the counts are the Stats reply's.
  absl::StatusOr<BlockMap> map = client_->GetBlockMap();
  ASSERT_THAT(map, IsOk());
  EXPECT_EQ(map->num_blocks, kNumBlocks);
  EXPECT_EQ(map->blocks_per_cell, 1);
  EXPECT_EQ(map->cells[static_cast<size_t>(table[0])], MapState::kInUse);
  EXPECT_EQ(map->cells[static_cast<size_t>(table[2])], MapState::kCached);
  EXPECT_EQ(map->count(MapState::kInUse), stats->in_use_blocks);
  EXPECT_EQ(map->count(MapState::kCached), stats->cached_blocks);
  EXPECT_EQ(map->count(MapState::kFree), stats->free_blocks);
  absl::StatusOr<BlockMap> one_cell = client_->GetBlockMap(1);
  ASSERT_THAT(one_cell, IsOk());
  EXPECT_EQ(one_cell->blocks_per_cell, kNumBlocks);
  EXPECT_EQ(one_cell->cells, std::vector<MapState>{MapState::kFree});
  EXPECT_EQ(one_cell->counts, map->counts);
}

TEST_F(CacheManagerClientTest, InvalidStepIsRefusedWholeAndChangesNothing) {
  // Semantic checks (sequence known, not live twice, owned) run before any op: one bad op
  // refuses the whole step.
  BlockOps step;
  step.Allocate(1, 4).Allocate(1, 4);
  absl::StatusOr<std::vector<OpOutcome>> outcomes = client_->Step(step);
  EXPECT_EQ(outcomes.status().code(), absl::StatusCode::kAlreadyExists) << outcomes.status();
  step.Clear();
  step.Allocate(1, 4).Append(99, 1);
  outcomes = client_->Step(step);
  EXPECT_EQ(outcomes.status().code(), absl::StatusCode::kNotFound) << outcomes.status();

  // Nothing of the refused steps happened: sequence 1 is new now.
  step.Clear();
  step.Allocate(1, 4).Append(1, 1);
  outcomes = client_->Step(step);
  ASSERT_THAT(outcomes, IsOk());
  ASSERT_THAT(*outcomes, SizeIs(2));
  EXPECT_THAT((*outcomes)[0].status, IsOk());
  EXPECT_THAT((*outcomes)[1].status, IsOk());
  EXPECT_THAT((*outcomes)[1].blocks, SizeIs(1));  // token 5 needs a second block

  // Another session's sequence.
  std::unique_ptr<CacheManagerClient> other = ConnectOrDie(cm_->endpoint());
  ASSERT_NE(other, nullptr);
  step.Clear();
  step.Free(1);
  EXPECT_EQ(other->Step(step).status().code(), absl::StatusCode::kPermissionDenied);
}

TEST_F(CacheManagerClientTest, ATimedOutStepRetriedRunsOnceAndGivesItsFirstOutcome) {
  std::unique_ptr<CacheManagerClient> router =
      ConnectOrDie(cm_->endpoint(), wire::Role::Router, absl::Milliseconds(300));
  ASSERT_NE(router, nullptr);
  EXPECT_TRUE(absl::IsFailedPrecondition(router->RetryLastStep().status()));

  // The cache manager stalls past the call timeout: the step stays queued, runs when it
  // resumes, and its reply comes too late for the caller.
  BlockOps step;
  step.Allocate(7, 10);
  ASSERT_THAT(cm_->process().Signal(SIGSTOP), IsOk());
  absl::StatusOr<std::vector<OpOutcome>> timed_out = router->Step(step);
  ASSERT_THAT(cm_->process().Signal(SIGCONT), IsOk());
  ASSERT_TRUE(absl::IsDeadlineExceeded(timed_out.status())) << timed_out.status();

  // Sent again as the same request: run once, answered with the first outcome (from the
  // replay cache each time it is sent).
  int retries = 0;
  absl::StatusOr<std::vector<OpOutcome>> retried = UntilAnswered([&] {
    ++retries;
    return router->RetryLastStep();
  });
  ASSERT_THAT(retried, IsOk());
  ASSERT_THAT(*retried, SizeIs(1));
  ASSERT_THAT((*retried)[0].status, IsOk());
  EXPECT_THAT((*retried)[0].blocks, SizeIs(3));
  EXPECT_TRUE(absl::IsFailedPrecondition(router->RetryLastStep().status()));

  // What the cache manager holds agrees: one sequence, the blocks the retry returned.
  absl::StatusOr<SessionSnapshot> described =
      UntilAnswered([&] { return router->DescribeSession(); });
  ASSERT_THAT(described, IsOk());
  ASSERT_THAT(described->sequences, SizeIs(1));
  EXPECT_EQ(described->sequences[0].seq, 7u);
  EXPECT_EQ(described->sequences[0].num_tokens, 10);
  EXPECT_EQ(described->sequences[0].num_committed_tokens, 0);
  EXPECT_EQ(described->sequences[0].blocks, (*retried)[0].blocks);
  EXPECT_NE(described->last_step_request_id, 0u);
  absl::StatusOr<StatsSnapshot> stats = UntilAnswered([&] { return router->Stats(); });
  ASSERT_THAT(stats, IsOk());
  EXPECT_EQ(stats->in_use_blocks, 3);
  ExpectPartition(*stats);

  // A new step with the same op is what the retry avoided: the sequence is live already.
  EXPECT_TRUE(absl::IsAlreadyExists(UntilAnswered([&] { return router->Step(step); }).status()));
  auto metrics = kvcm::testing::HttpGet(cm_->metrics_url());
  ASSERT_THAT(metrics, IsOk());
  auto parsed = kvcm::testing::ParseMetricsText(metrics->body);
  ASSERT_THAT(parsed, IsOk());
  EXPECT_EQ(*parsed->Value("kvcm_cache_manager_replayed_steps_total", {}), retries);
}

// The same through a real cache manager with a reply above the 4 MiB that once bounded the
// replay cache: before, the retry ran the step again and was refused (ALREADY_EXISTS), and
// the caller never learnt its block table.
TEST(CacheManagerClientLargeReplyTest, ATimedOutStepWithAMultiMebibyteReplyIsAnsweredOnRetry) {
  constexpr int32_t kBlocks = 1'200'000;  // one token a block: 4.8 MB of block ids
  CacheManagerOptions options;
  options.num_blocks = kBlocks + 16;
  options.layers = 1;
  options.kv_heads = 1;
  options.block_size = 1;
  absl::StatusOr<std::unique_ptr<CacheManagerProcess>> cm = StartCacheManager(options);
  ASSERT_THAT(cm, IsOk());
  std::unique_ptr<CacheManagerClient> router =
      ConnectOrDie((*cm)->endpoint(), wire::Role::Router, absl::Seconds(1));
  ASSERT_NE(router, nullptr);

  BlockOps step;
  step.Allocate(7, kBlocks);
  ASSERT_THAT((*cm)->process().Signal(SIGSTOP), IsOk());
  absl::StatusOr<std::vector<OpOutcome>> timed_out = router->Step(step);
  ASSERT_THAT((*cm)->process().Signal(SIGCONT), IsOk());
  ASSERT_TRUE(absl::IsDeadlineExceeded(timed_out.status())) << timed_out.status();

  // The step ran once the cache manager resumed; its late reply is dropped by this call
  // (another request id), so the retry's answer can only come from the replay cache.
  absl::StatusOr<SessionSnapshot> described =
      UntilAnswered([&] { return router->DescribeSession(); });
  ASSERT_THAT(described, IsOk());
  ASSERT_THAT(described->sequences, SizeIs(1));
  int retries = 0;
  absl::StatusOr<std::vector<OpOutcome>> retried = UntilAnswered([&] {
    ++retries;
    return router->RetryLastStep();
  });
  ASSERT_THAT(retried, IsOk());
  ASSERT_THAT(*retried, SizeIs(1));
  ASSERT_THAT((*retried)[0].status, IsOk());
  ASSERT_THAT((*retried)[0].blocks, SizeIs(kBlocks));
  EXPECT_EQ(described->sequences[0].blocks, (*retried)[0].blocks);
  absl::StatusOr<StatsSnapshot> stats = UntilAnswered([&] { return router->Stats(); });
  ASSERT_THAT(stats, IsOk());
  EXPECT_EQ(stats->in_use_blocks, kBlocks);
  EXPECT_EQ(stats->blocks_allocated, static_cast<uint64_t>(kBlocks));  // allocated once
  auto metrics = kvcm::testing::HttpGet((*cm)->metrics_url());
  ASSERT_THAT(metrics, IsOk());
  auto parsed = kvcm::testing::ParseMetricsText(metrics->body);
  ASSERT_THAT(parsed, IsOk());
  EXPECT_EQ(*parsed->Value("kvcm_cache_manager_replayed_steps_total", {}), retries);
}

TEST_F(CacheManagerClientTest, CanAllocateAdmitsWithoutChangingAnything) {
  CacheSequence(1, 0, 12);  // three cached blocks
  const std::vector<BlockHash> hashes = HashesOf(0, 12);
  BlockOps step;
  step.CanAllocate(13, hashes)
      .Allocate(2, 4 * (kNumBlocks - 3))
      .CanAllocate(13, hashes)
      .CanAllocate(5 * kBlockSize);
  absl::StatusOr<std::vector<OpOutcome>> outcomes = client_->Step(step);
  ASSERT_THAT(outcomes, IsOk());
  ASSERT_THAT(*outcomes, SizeIs(4));
  // Before: the three cached blocks are reused, one more is needed.
  ASSERT_THAT((*outcomes)[0].status, IsOk());
  EXPECT_EQ((*outcomes)[0].num_cached_tokens, 12);
  EXPECT_EQ((*outcomes)[0].blocks_needed, 1);
  // After the step's own allocation took every free block, it no longer fits: it needs one
  // new block, and the only evictable blocks are those of its own prefix.
  EXPECT_TRUE(absl::IsResourceExhausted((*outcomes)[2].status)) << (*outcomes)[2].status;
  EXPECT_TRUE(absl::IsResourceExhausted((*outcomes)[3].status)) << (*outcomes)[3].status;
  absl::StatusOr<StatsSnapshot> stats = client_->Stats();
  ASSERT_THAT(stats, IsOk());
  EXPECT_EQ(stats->live_sequences, 1);  // the dry runs created nothing
  EXPECT_EQ(stats->cached_blocks, 3);
  ExpectPartition(*stats);
}

TEST_F(CacheManagerClientTest, FreeingASequenceTwiceFailsAloneWithNotFound) {
  BlockOps step;
  step.Allocate(1, 4);
  ASSERT_THAT(client_->Step(step), IsOk());
  step.Clear();
  step.Free(1).Free(1).Allocate(2, 4);
  absl::StatusOr<std::vector<OpOutcome>> outcomes = client_->Step(step);
  ASSERT_THAT(outcomes, IsOk());
  EXPECT_THAT((*outcomes)[0].status, IsOk());
  EXPECT_TRUE(absl::IsNotFound((*outcomes)[1].status)) << (*outcomes)[1].status;
  EXPECT_THAT((*outcomes)[2].status, IsOk());
  absl::StatusOr<StatsSnapshot> stats = client_->Stats();
  ASSERT_THAT(stats, IsOk());
  EXPECT_EQ(stats->live_sequences, 1);
  ExpectPartition(*stats);
}

TEST_F(CacheManagerClientTest, AStepReplySaysHowManyBlocksCanBeTakenAfterIt) {
  EXPECT_EQ(client_->available_blocks_after_last_step(), -1);  // no step yet
  BlockOps step;
  step.Allocate(1, 4 * 3).Allocate(2, 1);
  ASSERT_THAT(client_->Step(step), IsOk());
  absl::StatusOr<StatsSnapshot> stats = client_->Stats();
  ASSERT_THAT(stats, IsOk());
  EXPECT_EQ(client_->available_blocks_after_last_step(), stats->free_blocks + stats->cached_blocks);
  EXPECT_EQ(client_->available_blocks_after_last_step(), stats->num_blocks - 4);
  step.Clear();
  step.Free(1).Free(2);
  ASSERT_THAT(client_->Step(step), IsOk());
  EXPECT_EQ(client_->available_blocks_after_last_step(), stats->num_blocks);
}

TEST_F(CacheManagerClientTest, NoHeartbeatReachesTheCacheManagerAfterGoodbye) {
  std::unique_ptr<CacheManagerClient> leaving = ConnectOrDie(cm_->endpoint());
  ASSERT_NE(leaving, nullptr);
  // Heartbeats pile up while the cache manager is stopped; the Goodbye comes during them.
  ASSERT_THAT(cm_->process().Signal(SIGSTOP), IsOk());
  const uint64_t sent = leaving->heartbeats_sent();
  const absl::Status piled = WaitFor([&] { return leaving->heartbeats_sent() >= sent + 2; },
                                     absl::Seconds(60), "two heartbeats sent");
  EXPECT_THAT(piled, IsOk());  // not ASSERT: the cache manager is stopped
  absl::StatusOr<int32_t> released;
  std::atomic<pid_t> bye_tid{0};
  std::thread bye([&] {
    bye_tid.store(static_cast<pid_t>(::syscall(SYS_gettid)));
    released = leaving->Goodbye();
  });
  // Until the Goodbye is on its way (or waiting) behind them: its thread blocks. Had it only
  // slept on the way, a Goodbye that starts after SIGCONT must be answered the same way.
  const absl::Status blocked = WaitFor(
      [&] {
        const pid_t tid = bye_tid.load();
        return tid != 0 && ThreadSleeps(tid);
      },
      absl::Seconds(60), "the Goodbye to block");
  EXPECT_THAT(blocked, IsOk());  // not ASSERT: the cache manager is stopped
  ASSERT_THAT(cm_->process().Signal(SIGCONT), IsOk());
  bye.join();
  ASSERT_THAT(released, IsOk());
  // Every heartbeat was handled before the session ended: none was refused as stale.
  ASSERT_THAT(client_->Stats(), IsOk());
  auto metrics = kvcm::testing::HttpGet(cm_->metrics_url());
  ASSERT_THAT(metrics, IsOk());
  auto parsed = kvcm::testing::ParseMetricsText(metrics->body);
  ASSERT_THAT(parsed, IsOk());
  EXPECT_EQ(
      *parsed->Value("kvcm_cache_manager_rejected_messages_total", {{"reason", "stale_session"}}),
      0);
  // Registering again brings the heartbeats back.
  ASSERT_THAT(leaving->EnsureSession(), IsOk());
  const uint64_t again = leaving->heartbeats_sent();
  const absl::Status resumed = WaitFor([&] { return leaving->heartbeats_sent() > again; },
                                       absl::Seconds(60), "a heartbeat after registering again");
  EXPECT_THAT(resumed, IsOk());
}

TEST_F(CacheManagerClientTest, PoolExhaustionIsResourceExhausted) {
  BlockOps step;
  step.Allocate(1, 40).Allocate(2, 40);  // 10 + 10 blocks of 16
  absl::StatusOr<std::vector<OpOutcome>> outcomes = client_->Step(step);
  ASSERT_THAT(outcomes, IsOk());
  EXPECT_THAT((*outcomes)[0].status, IsOk());
  EXPECT_EQ((*outcomes)[1].status.code(), absl::StatusCode::kResourceExhausted)
      << (*outcomes)[1].status;
  absl::StatusOr<StatsSnapshot> stats = client_->Stats();
  ASSERT_THAT(stats, IsOk());
  EXPECT_EQ(stats->in_use_blocks, 10);  // the failed op changed nothing
  EXPECT_GE(stats->allocation_failures, 1u);
  ExpectPartition(*stats);
}

TEST_F(CacheManagerClientTest, PinKeepsBlocksAndUnpinReleasesThem) {
  const std::vector<BlockHash> hashes = HashesOf(100, 8);
  CacheSequence(1, 100, 8);
  EXPECT_THAT(client_->Pin("system-prompt", hashes), IsOk());
  absl::StatusOr<StatsSnapshot> stats = client_->Stats();
  ASSERT_THAT(stats, IsOk());
  EXPECT_EQ(stats->pinned_blocks, 2);
  EXPECT_EQ(stats->cached_blocks, 0);
  ExpectPartition(*stats);

  EXPECT_EQ(client_->Pin("system-prompt", hashes).code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(client_->Pin("unknown", HashesOf(500, 4)).code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(client_->Unpin("system-prompt"), IsOk());
  EXPECT_EQ(client_->Unpin("system-prompt").code(), absl::StatusCode::kNotFound);
  stats = client_->Stats();
  ASSERT_THAT(stats, IsOk());
  EXPECT_EQ(stats->pinned_blocks, 0);
  EXPECT_EQ(stats->cached_blocks, 2);
  ExpectPartition(*stats);
}

TEST_F(CacheManagerClientTest, StatsDescribeThePoolAndSumToCapacity) {
  CacheSequence(1, 0, 8);  // 2 cached
  BlockOps step;
  step.Allocate(2, 9);  // 3 in use
  ASSERT_THAT(client_->Step(step), IsOk());
  ASSERT_THAT(client_->Pin("p", HashesOf(0, 4)), IsOk());  // 1 of the cached pinned

  absl::StatusOr<StatsSnapshot> stats = client_->Stats();
  ASSERT_THAT(stats, IsOk());
  EXPECT_EQ(stats->num_blocks, kNumBlocks);
  EXPECT_EQ(stats->block_size, kBlockSize);
  EXPECT_EQ(stats->in_use_blocks, 3);
  EXPECT_EQ(stats->cached_blocks, 1);
  EXPECT_EQ(stats->pinned_blocks, 1);
  EXPECT_EQ(stats->free_blocks, kNumBlocks - 5);
  ExpectPartition(*stats);
  EXPECT_EQ(stats->epoch, cm_->epoch());
  EXPECT_EQ(stats->backend, PoolBackend::kShm);
  EXPECT_EQ(stats->spec.num_layers, 2);
  EXPECT_EQ(stats->spec.num_kv_heads, 2);
  EXPECT_EQ(stats->spec.head_dim, 8);
  EXPECT_EQ(stats->spec.dtype, DType::kFloat16);
  EXPECT_EQ(stats->spec.block_size, kBlockSize);
  EXPECT_EQ(stats->block_bytes, static_cast<uint64_t>(stats->spec.BytesPerBlock()));
  EXPECT_EQ(stats->pool_bytes, stats->block_bytes * kNumBlocks);
  EXPECT_GE(stats->sessions, 1u);
  EXPECT_GE(stats->blocks_allocated, 5u);
  EXPECT_NEAR(stats->usage_ratio, 3.0 / kNumBlocks, 1e-9);      // in use only
  EXPECT_NEAR(stats->occupancy_ratio, 5.0 / kNumBlocks, 1e-9);  // everything holding KV
}

TEST_F(CacheManagerClientTest, StoppedCacheManagerGivesDeadlineExceededThenRecovers) {
  std::unique_ptr<CacheManagerClient> impatient =
      ConnectOrDie(cm_->endpoint(), wire::Role::Control, absl::Milliseconds(300));
  ASSERT_NE(impatient, nullptr);
  ASSERT_THAT(cm_->process().Signal(SIGSTOP), IsOk());
  const absl::Time start = absl::Now();
  absl::StatusOr<StatsSnapshot> stats = impatient->Stats();
  const absl::Duration took = absl::Now() - start;
  ASSERT_THAT(cm_->process().Signal(SIGCONT), IsOk());
  EXPECT_EQ(stats.status().code(), absl::StatusCode::kDeadlineExceeded) << stats.status();
  EXPECT_THAT(stats.status().message(),
              HasSubstr(absl::StrCat("cache manager at ", cm_->endpoint(),
                                     " did not answer Stats within 300ms")));
  // It gave up at its deadline, not at the cache manager's return (the cache manager stays
  // stopped until it did). No upper bound: a loaded machine adds any amount to the 300 ms
  // (docs/RELIABILITY.md, "Timing in tests"); the message names the timeout it waited.
  EXPECT_GE(took, absl::Milliseconds(300));
  std::printf("a Stats of a 300 ms timeout gave up after %s\n", absl::FormatDuration(took).c_str());
  // The late answer to the first Stats is dropped; the next call gets its own.
  stats = UntilAnswered([&] { return impatient->Stats(); });
  EXPECT_THAT(stats, IsOk());
}

TEST_F(CacheManagerClientTest, GoodbyeEndsTheSessionAndFreesItsSequences) {
  BlockOps step;
  step.Allocate(1, 8);
  ASSERT_THAT(client_->Step(step), IsOk());
  absl::StatusOr<int32_t> released = client_->Goodbye();
  ASSERT_THAT(released, IsOk());
  EXPECT_EQ(*released, 2);
  EXPECT_EQ(client_->Stats().status().code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_THAT(client_->EnsureSession(), IsOk());
  absl::StatusOr<StatsSnapshot> stats = client_->Stats();
  ASSERT_THAT(stats, IsOk());
  EXPECT_EQ(stats->free_blocks, kNumBlocks);
  EXPECT_EQ(stats->live_sequences, 0);
}

TEST_F(CacheManagerClientTest, SilentSessionExpiresWhileHeartbeatsKeepAnotherAlive) {
  std::unique_ptr<CacheManagerClient> silent =
      ConnectOrDie(cm_->endpoint(), wire::Role::Router, absl::Seconds(5), /*heartbeats=*/false);
  ASSERT_NE(silent, nullptr);
  const uint64_t silent_session = silent->session_id();
  absl::StatusOr<StatsSnapshot> stats = client_->Stats();
  ASSERT_THAT(stats, IsOk());
  const uint32_t sessions = stats->sessions;
  // Wait (bounded) until the cache manager drops the silent session; client_ only talks
  // through its heartbeat thread meanwhile... and these Stats calls.
  const absl::Status expired = WaitFor(
      [&] {
        stats = client_->Stats();
        return !stats.ok() || stats->sessions < sessions;
      },
      absl::Seconds(60), "the silent session to expire");
  ASSERT_THAT(stats, IsOk());
  ASSERT_THAT(expired, IsOk()) << "the silent session never expired: " << expired;
  EXPECT_FALSE(client_->session_lost());
  EXPECT_GT(client_->heartbeats_answered(), 0u);

  absl::StatusOr<StatsSnapshot> refused = silent->Stats();
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kAborted) << refused.status();
  EXPECT_THAT(refused.status().message(),
              HasSubstr(absl::StrCat("ended session ", silent_session)));
  EXPECT_EQ(silent->session_id(), silent_session);  // nothing registered behind its back
  ASSERT_THAT(silent->Reregister(), IsOk());
  EXPECT_NE(silent->session_id(), silent_session);
  EXPECT_THAT(silent->Stats(), IsOk());
}

TEST_F(CacheManagerClientTest, HeartbeatsRequiringProgressStopWhenTheCallerIsStuck) {
  auto connect = [&] {
    CacheManagerClient::Options options;
    options.endpoint = cm_->endpoint();
    options.role = wire::Role::Router;
    options.name = "progress";
    options.require_progress = true;
    absl::StatusOr<std::unique_ptr<CacheManagerClient>> client =
        CacheManagerClient::Connect(options);
    EXPECT_THAT(client, IsOk());
    return client.ok() ? std::move(*client) : nullptr;
  };
  // Both hold a sequence; only one's caller keeps noting progress (an idle scheduler loop);
  // the other's is stuck, as in a deadlock, while its heartbeat thread runs on.
  std::unique_ptr<CacheManagerClient> working = connect();
  std::unique_ptr<CacheManagerClient> stuck = connect();
  ASSERT_NE(working, nullptr);
  ASSERT_NE(stuck, nullptr);
  BlockOps step;
  step.Allocate(1, 8);
  ASSERT_THAT(working->Step(step), IsOk());
  step.Clear();
  step.Allocate(2, 8);
  ASSERT_THAT(stuck->Step(step), IsOk());

  // The stuck caller's lease runs out: the timeout after the progress window, which is the
  // timeout too.
  StatsSnapshot stats;
  absl::Status failed;
  (void)WaitFor(
      [&] {
        working->NoteProgress();
        absl::StatusOr<StatsSnapshot> s = client_->Stats();
        if (!s.ok()) {
          failed = s.status();
          return true;
        }
        stats = *s;
        return stats.quarantined_blocks > 0;
      },
      absl::Seconds(60));
  ASSERT_THAT(failed, IsOk());
  EXPECT_EQ(stats.quarantined_blocks, 2) << "the stuck caller's session was never quarantined";
  EXPECT_GT(stuck->heartbeats_withheld(), 0u);
  EXPECT_EQ(working->heartbeats_withheld(), 0u);
  // Once unstuck, it learns that its session is gone (and registers only when it chooses).
  absl::StatusOr<StatsSnapshot> refused = stuck->Stats();
  EXPECT_TRUE(absl::IsAborted(refused.status())) << refused.status();
  // The working one, idle but noting progress, kept its session and its sequence.
  step.Clear();
  step.Append(1, 1);
  absl::StatusOr<std::vector<OpOutcome>> appended = working->Step(step);
  ASSERT_THAT(appended, IsOk());
  EXPECT_THAT((*appended)[0].status, IsOk());
  ExpectPartition(stats);
}

TEST(CacheManagerClientRestartTest, RestartGivesAbortedWithBothEpochsThenWorksOnceRegisteredAgain) {
  absl::StatusOr<TempDir> run_dir = TempDir::Create("kvcm-rs");
  ASSERT_THAT(run_dir, IsOk());
  CacheManagerOptions options = SmallPool();
  options.run_dir = run_dir->path();
  absl::StatusOr<std::unique_ptr<CacheManagerProcess>> first = StartCacheManager(options);
  ASSERT_THAT(first, IsOk());
  std::unique_ptr<CacheManagerClient> client = ConnectOrDie((*first)->endpoint());
  ASSERT_NE(client, nullptr);
  const uint64_t old_epoch = client->epoch();
  BlockOps step;
  step.Allocate(1, 8);
  ASSERT_THAT(client->Step(step), IsOk());

  absl::StatusOr<int> code = (*first)->Terminate();
  ASSERT_THAT(code, IsOk());
  EXPECT_EQ(*code, 0) << (*first)->Output();
  absl::StatusOr<std::unique_ptr<CacheManagerProcess>> second = StartCacheManager(options);
  ASSERT_THAT(second, IsOk());
  const uint64_t new_epoch = (*second)->epoch();
  ASSERT_NE(new_epoch, old_epoch);

  absl::StatusOr<std::vector<OpOutcome>> refused = client->Step(step);
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kAborted) << refused.status();
  EXPECT_THAT(refused.status().message(),
              HasSubstr(absl::StrCat("message for epoch ", old_epoch,
                                     " but this cache manager runs epoch ", new_epoch)));
  EXPECT_THAT(refused.status().message(), HasSubstr("its sequences are gone"));
  EXPECT_EQ(client->epoch(), old_epoch);
  ASSERT_THAT(client->Reregister(), IsOk());
  EXPECT_EQ(client->epoch(), new_epoch);
  absl::StatusOr<std::vector<OpOutcome>> retried = client->Step(step);
  ASSERT_THAT(retried, IsOk());
  EXPECT_THAT((*retried)[0].status, IsOk());  // seq 1 is new here
}

// Regression: when the heartbeat thread is the first to meet the restarted cache manager,
// the caller's next call must still name both epochs (it once said only "its heartbeat was
// refused", and the test above failed whenever the heartbeat won the race).
TEST(CacheManagerClientRestartTest, AHeartbeatThatMeetsTheRestartFirstGivesTheSameReason) {
  absl::StatusOr<TempDir> run_dir = TempDir::Create("kvcm-rs");
  ASSERT_THAT(run_dir, IsOk());
  CacheManagerOptions options = SmallPool();
  options.run_dir = run_dir->path();
  absl::StatusOr<std::unique_ptr<CacheManagerProcess>> first = StartCacheManager(options);
  ASSERT_THAT(first, IsOk());
  std::unique_ptr<CacheManagerClient> client = ConnectOrDie((*first)->endpoint());
  ASSERT_NE(client, nullptr);
  const uint64_t old_epoch = client->epoch();

  absl::StatusOr<int> code = (*first)->Terminate();
  ASSERT_THAT(code, IsOk());
  absl::StatusOr<std::unique_ptr<CacheManagerProcess>> second = StartCacheManager(options);
  ASSERT_THAT(second, IsOk());
  const uint64_t new_epoch = (*second)->epoch();
  // Heartbeats go out every 100 ms: wait until one has been refused, before any call.
  const absl::Status refused_heartbeat =
      WaitFor([&] { return client->session_lost(); }, absl::Seconds(60));
  ASSERT_THAT(refused_heartbeat, IsOk()) << "no heartbeat reached the restarted cache manager";

  absl::StatusOr<StatsSnapshot> refused = client->Stats();
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kAborted) << refused.status();
  EXPECT_THAT(refused.status().message(), HasSubstr("its heartbeat was refused: StaleEpoch"));
  EXPECT_THAT(refused.status().message(),
              HasSubstr(absl::StrCat("message for epoch ", old_epoch,
                                     " but this cache manager runs epoch ", new_epoch)));
  ASSERT_THAT(client->Reregister(), IsOk());
  EXPECT_FALSE(client->session_lost());
  EXPECT_THAT(client->Stats(), IsOk());
}

TEST(CacheManagerClientRestartTest, ExecutorReattachesAfterACrash) {
  absl::StatusOr<TempDir> run_dir = TempDir::Create("kvcm-rs");
  ASSERT_THAT(run_dir, IsOk());
  CacheManagerOptions options = SmallPool();
  options.run_dir = run_dir->path();
  absl::StatusOr<std::unique_ptr<CacheManagerProcess>> first = StartCacheManager(options);
  ASSERT_THAT(first, IsOk());
  std::unique_ptr<CacheManagerClient> executor =
      ConnectOrDie((*first)->endpoint(), wire::Role::Executor);
  ASSERT_NE(executor, nullptr);
  absl::StatusOr<AttachedPool> pool = executor->Attach();
  ASSERT_THAT(pool, IsOk());
  const uint64_t old_epoch = pool->view.epoch;

  // kill -9: the socket files and the lock stay behind; the successor must cope.
  ASSERT_THAT((*first)->process().Signal(SIGKILL), IsOk());
  ASSERT_THAT((*first)->process().Wait(absl::Seconds(30)), IsOk());
  absl::StatusOr<std::unique_ptr<CacheManagerProcess>> second = StartCacheManager(options);
  ASSERT_THAT(second, IsOk());

  absl::StatusOr<AttachedPool> refused = executor->Attach();
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kAborted) << refused.status();
  EXPECT_THAT(refused.status().message(),
              HasSubstr(absl::StrCat("message for epoch ", old_epoch,
                                     " but this cache manager runs epoch ", (*second)->epoch())));
  pool->mapping.reset();  // drop the old epoch's mapping first
  ASSERT_THAT(executor->Reregister(), IsOk());
  absl::StatusOr<AttachedPool> again = executor->Attach();
  ASSERT_THAT(again, IsOk());
  EXPECT_EQ(again->view.epoch, (*second)->epoch());
}

TEST(CacheManagerClientNoServerTest, MissingSocketIsUnavailableAtOnce) {
  absl::StatusOr<TempDir> dir = TempDir::Create("kvcm-ns");
  ASSERT_THAT(dir, IsOk());
  CacheManagerClient::Options options;
  options.endpoint = absl::StrCat("ipc://", dir->path(), "/cache-manager.sock");
  options.role = wire::Role::Control;
  // At once, not after waiting for a Hello's reply: a timeout long enough that the two
  // cannot be mistaken for each other on a loaded machine.
  options.call_timeout = absl::Seconds(120);
  const absl::Time start = absl::Now();
  absl::StatusOr<std::unique_ptr<CacheManagerClient>> client = CacheManagerClient::Connect(options);
  EXPECT_EQ(client.status().code(), absl::StatusCode::kUnavailable) << client.status();
  EXPECT_THAT(client.status().message(), HasSubstr("no socket file"));
  EXPECT_LT(absl::Now() - start, absl::Seconds(60));
}

}  // namespace
}  // namespace kvcm
