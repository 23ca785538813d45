// KvEventSubscriber against a real kvcm-cache-manager: a scripted workload's events arrive
// in order (BlockStored when committed full blocks enter the prefix index, BlockRemoved when
// they are evicted), and an injected gap is repaired with a snapshot so that the mirror
// equals the cache manager's prefix index.

#include <cstdint>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/time/clock.h"
#include "common/block/block_hash.h"
#include "common/client/cache_manager_client.h"
#include "common/client/kv_event_subscriber.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/cache_manager_process.h"
#include "tests/support/status_matchers.h"

namespace kvcm {
namespace {

using ::kvcm::testing::CacheManagerOptions;
using ::kvcm::testing::CacheManagerProcess;
using ::kvcm::testing::StartCacheManager;
using ::testing::SizeIs;

constexpr int32_t kNumBlocks = 8;
constexpr int32_t kBlockSize = 4;

std::vector<BlockHash> HashesOf(int32_t first, int32_t n) {
  std::vector<int32_t> tokens(n);
  std::iota(tokens.begin(), tokens.end(), first);
  std::vector<BlockHash> hashes;
  HashFullBlocks(HashAlgorithm::kSha256, RootHash(HashAlgorithm::kSha256, "event-test"), tokens,
                 kBlockSize, &hashes);
  return hashes;
}

struct Seen {
  uint64_t seq;
  KvEventRecord event;
};

class KvEventStreamTest : public ::testing::Test {
 protected:
  void SetUp() override {
    CacheManagerOptions options;
    options.num_blocks = kNumBlocks;
    options.block_size = kBlockSize;
    absl::StatusOr<std::unique_ptr<CacheManagerProcess>> cm = StartCacheManager(options);
    ASSERT_THAT(cm, IsOk());
    cm_ = std::move(*cm);

    CacheManagerClient::Options client_options;
    client_options.endpoint = cm_->endpoint();
    client_options.role = wire::Role::Router;
    client_options.name = "event-test";
    absl::StatusOr<std::unique_ptr<CacheManagerClient>> client =
        CacheManagerClient::Connect(client_options);
    ASSERT_THAT(client, IsOk());
    client_ = std::move(*client);

    // Connect, subscribe (Connect waits for the handshake), snapshot, then batches after it.
    KvEventSubscriber::Options subscriber_options;
    subscriber_options.endpoint = cm_->events_endpoint();
    subscriber_options.on_batch_applied = [this](uint64_t seq, uint64_t,
                                                 const std::vector<KvEventRecord>& events) {
      for (const KvEventRecord& event : events) seen_.push_back({seq, event});
    };
    absl::StatusOr<std::unique_ptr<KvEventSubscriber>> subscriber =
        KvEventSubscriber::Connect(subscriber_options);
    ASSERT_THAT(subscriber, IsOk());
    subscriber_ = std::move(*subscriber);
    ASSERT_THAT(subscriber_->Resync(*client_), IsOk());
    EXPECT_FALSE(subscriber_->needs_snapshot());
  }

  void RunStep(BlockOps& step) {
    absl::StatusOr<std::vector<OpOutcome>> outcomes = client_->Step(step);
    ASSERT_THAT(outcomes, IsOk());
    for (const OpOutcome& outcome : *outcomes) ASSERT_THAT(outcome.status, IsOk());
    last_outcomes_ = *outcomes;
    step.Clear();
  }

  // Polls until the subscriber has applied `n` events in all (or has seen a gap).
  void AwaitEvents(size_t n) {
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (seen_.size() < n && !subscriber_->needs_snapshot() && absl::Now() < deadline) {
      ASSERT_THAT(subscriber_->Poll(absl::Milliseconds(50)), IsOk());
    }
  }

  // The cache manager's prefix index, from a fresh snapshot.
  absl::flat_hash_map<BlockHash, int32_t, BlockHashHasher> ServerIndex() {
    absl::StatusOr<EventSnapshot> snapshot = client_->Snapshot();
    EXPECT_THAT(snapshot, IsOk());
    absl::flat_hash_map<BlockHash, int32_t, BlockHashHasher> index;
    if (snapshot.ok()) {
      for (const KvEventRecord& event : snapshot->events) {
        if (event.kind == KvEventKind::kBlockStored) index[event.hash] = event.block;
      }
    }
    return index;
  }

  std::unique_ptr<CacheManagerProcess> cm_;
  std::unique_ptr<CacheManagerClient> client_;
  std::unique_ptr<KvEventSubscriber> subscriber_;
  std::vector<Seen> seen_;
  std::vector<OpOutcome> last_outcomes_;
};

TEST_F(KvEventStreamTest, WorkloadEventsArriveInOrder) {
  // A fresh cache manager announces AllBlocksCleared in its first batch, before anyone
  // could subscribe; count from here.
  absl::StatusOr<StatsSnapshot> before = client_->Stats();
  ASSERT_THAT(before, IsOk());
  const std::vector<BlockHash> hashes = HashesOf(0, 8);
  BlockOps step;
  step.Allocate(1, 10, hashes);
  RunStep(step);
  const std::vector<int32_t> table = last_outcomes_[0].blocks;
  ASSERT_THAT(table, SizeIs(3));
  // Nothing is matchable before the KV is written. 100 ms for events that must not come: a
  // slow machine can only make this miss one, not report one.
  EXPECT_FALSE(subscriber_->Poll(absl::Milliseconds(100)).value_or(-1) > 0);
  EXPECT_TRUE(seen_.empty());

  step.Commit(1, 10).Free(1);
  RunStep(step);
  AwaitEvents(2);
  ASSERT_THAT(seen_, SizeIs(2));
  EXPECT_EQ(seen_[0].event.kind, KvEventKind::kBlockStored);
  EXPECT_EQ(seen_[0].event.hash, hashes[0]);
  EXPECT_EQ(seen_[0].event.block, table[0]);
  // The first block's parent is the chain's root: absent, as the schema says.
  EXPECT_FALSE(seen_[0].event.has_parent);
  EXPECT_EQ(seen_[1].event.kind, KvEventKind::kBlockStored);
  EXPECT_EQ(seen_[1].event.hash, hashes[1]);
  EXPECT_EQ(seen_[1].event.block, table[1]);
  EXPECT_TRUE(seen_[1].event.has_parent);
  EXPECT_EQ(seen_[1].event.parent_hash, hashes[0]);
  EXPECT_EQ(subscriber_->blocks().size(), 2u);

  // A sequence that needs every block evicts both cached ones, tail first.
  step.Allocate(2, kNumBlocks * kBlockSize);
  RunStep(step);
  AwaitEvents(4);
  ASSERT_THAT(seen_, SizeIs(4));
  EXPECT_EQ(seen_[2].event.kind, KvEventKind::kBlockRemoved);
  EXPECT_EQ(seen_[2].event.hash, hashes[1]);
  EXPECT_EQ(seen_[3].event.kind, KvEventKind::kBlockRemoved);
  EXPECT_EQ(seen_[3].event.hash, hashes[0]);
  EXPECT_TRUE(subscriber_->blocks().empty());
  for (size_t i = 1; i < seen_.size(); ++i) EXPECT_LE(seen_[i - 1].seq, seen_[i].seq);
  EXPECT_EQ(subscriber_->gaps(), 0u);
  EXPECT_EQ(subscriber_->epoch(), cm_->epoch());

  absl::StatusOr<StatsSnapshot> stats = client_->Stats();
  ASSERT_THAT(stats, IsOk());
  EXPECT_EQ(stats->events_published - before->events_published, 4u);
  EXPECT_EQ(stats->evictions, 2u);
}

TEST_F(KvEventStreamTest, InjectedGapIsDetectedAndRepairedBySnapshot) {
  BlockOps step;
  step.Allocate(1, 8, HashesOf(0, 8));
  RunStep(step);
  step.Commit(1, 8).Free(1);
  RunStep(step);
  AwaitEvents(2);
  ASSERT_THAT(seen_, SizeIs(2));

  step.Allocate(2, 8, HashesOf(100, 8)).Allocate(3, 4, HashesOf(200, 4));  // no events
  RunStep(step);
  subscriber_->DropNextBatchForTest();
  step.Commit(2, 8);  // lost
  RunStep(step);
  step.Commit(3, 4);  // reveals the gap
  RunStep(step);
  AwaitEvents(100);
  ASSERT_TRUE(subscriber_->needs_snapshot());
  EXPECT_EQ(subscriber_->gaps(), 1u);
  EXPECT_NE(subscriber_->blocks(), ServerIndex());

  ASSERT_THAT(subscriber_->Resync(*client_), IsOk());
  EXPECT_FALSE(subscriber_->needs_snapshot());
  EXPECT_EQ(subscriber_->blocks(), ServerIndex());
  EXPECT_EQ(subscriber_->blocks().size(), 5u);

  // And it keeps following: evicting everything cached empties both.
  step.Free(2).Free(3).Allocate(4, kNumBlocks * kBlockSize);
  RunStep(step);
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (!subscriber_->blocks().empty() && absl::Now() < deadline) {
    ASSERT_THAT(subscriber_->Poll(absl::Milliseconds(50)), IsOk());
  }
  EXPECT_TRUE(subscriber_->blocks().empty());
  EXPECT_EQ(subscriber_->blocks(), ServerIndex());
  EXPECT_EQ(subscriber_->gaps(), 1u);
}

}  // namespace
}  // namespace kvcm
