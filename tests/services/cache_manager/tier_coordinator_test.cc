// TierCoordinator against a real BlockLedger and real KvTiers on a shm pool: the holds of
// the write-through, the prefetch of a prefix the tiers hold (bytes back in the pool, the
// blocks cached and matchable), the load timeout (explicit clock values, no waiting), and
// MakeRoom's cancelled stores. Results come from the mover threads: the tests wait on
// wake_fd() with poll(2), never for a fixed time.

#include "services/cache_manager/tier_coordinator.h"

#include <iostream>
#include <memory>
#include <optional>
#include <vector>

#include "absl/time/time.h"
#include "common/wire/step_codec.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/services/cache_manager/tier_test_env.h"
#include "tests/support/status_matchers.h"

namespace kvcm::cache_manager {
namespace {

using tiers::testenv::Env;
using tiers::testenv::HashOf;
using tiers::testenv::PollUntil;

constexpr uint64_t kSeed = 777123;
constexpr int32_t kBlocks = 8;
constexpr int32_t kBlockSize = 4;
const absl::Time kT0 = absl::UnixEpoch() + absl::Hours(1000);
constexpr absl::Duration kLoadTimeout = absl::Seconds(2);

class TierCoordinatorTest : public ::testing::Test {
 protected:
  TierCoordinatorTest() : env_(kBlocks) {
    RecordProperty("seed", std::to_string(kSeed));
    std::cout << "random data seed " << kSeed << "\n";
    GroupedLedger::Options options;
    options.pool = {.num_blocks = kBlocks, .block_size = kBlockSize, .record_events = true};
    ledger_ = std::make_unique<GroupedLedger>(*GroupedLedger::Create(std::move(options)));
  }
  ~TierCoordinatorTest() override {
    coordinator_.reset();
    tiers_.reset();  // the movers stop before the pool goes
  }

  void Start(int32_t host_blocks, int32_t disk_slots) {
    tiers_ = env_.MakeTiers(env_.Options(host_blocks, disk_slots));
    ASSERT_NE(tiers_, nullptr);
    coordinator_ = std::make_unique<TierCoordinator>(
        tiers_.get(), ledger_.get(),
        TierCoordinator::Options{.load_timeout = kLoadTimeout, .commit_tokens = {}});
  }

  void TakeEvents() { coordinator_->OnEvents(ledger_->TakeEvents()); }
  void ExpectInvariants() { EXPECT_THAT(ledger_->CheckInvariants(), IsOk()); }

  // Polls the coordinator (handing staged copies to the movers, as the server does after
  // each reply, and taking the ledger's events after each change, as the service does)
  // until `done` holds.
  void PollTill(const std::function<bool()>& done) {
    ASSERT_TRUE(PollUntil(
        tiers_->wake_fd(),
        [&] {
          coordinator_->Flush();
          if (coordinator_->Poll(kT0)) TakeEvents();
          ExpectInvariants();
        },
        done))
        << "hang guard: the movers never reported";
  }
  bool TiersIdle() const {
    const tiers::TierSnapshot s = tiers_->Snapshot();
    return s.queued_stores == 0 && s.queued_loads == 0 && s.writing[0] == 0 && s.writing[1] == 0;
  }
  void DrainStores() {
    PollTill([&] { return coordinator_->held_blocks() == 0 && TiersIdle(); });
    EXPECT_EQ(ledger_->held_blocks(), 0);
  }

  std::vector<BlockHash> Hashes(int first, int n) const {
    std::vector<BlockHash> hashes;
    for (int i = first; i < first + n; ++i) hashes.push_back(HashOf(i));
    return hashes;
  }

  // The ledger's Allocate, as a Step's (one group: no group_blocks).
  absl::StatusOr<AllocateResult> Allocate(SeqId seq, int32_t num_tokens,
                                          std::span<const BlockHash> hashes = {}) {
    AllocateResult result;
    std::vector<BlockId> group_blocks;
    absl::Status status = ledger_->Allocate(seq, num_tokens, hashes, &result, &group_blocks);
    if (!status.ok()) return status;
    return result;
  }

  // Sequence `seq` of `n` full blocks with the hashes Hashes(first, n), its bytes written
  // and committed; returns each block's bytes.
  std::vector<std::vector<uint8_t>> CommitPrefix(SeqId seq, int first, int n) {
    absl::StatusOr<AllocateResult> taken = Allocate(seq, n * kBlockSize);
    EXPECT_THAT(taken.status(), IsOk());
    std::vector<std::vector<uint8_t>> bytes;
    if (!taken.ok()) return bytes;
    for (int i = 0; i < n; ++i) {
      bytes.push_back(env_.FillBlock(taken->blocks[static_cast<size_t>(i)],
                                     kSeed + static_cast<uint64_t>(first + i)));
    }
    EXPECT_THAT(ledger_->Commit(seq, n * kBlockSize, Hashes(first, n)), IsOk());
    return bytes;
  }

  Env env_;
  std::unique_ptr<GroupedLedger> ledger_;  // of one group: the tiers know no other
  std::unique_ptr<tiers::KvTiers> tiers_;
  std::unique_ptr<TierCoordinator> coordinator_;
};

TEST_F(TierCoordinatorTest, CommittedBlocksAreHeldUntilTheMoverReleasesThem) {
  Start(4, 0);
  CommitPrefix(1, 0, 2);
  const std::vector<BlockId> table = *ledger_->BlockTable(1);
  TakeEvents();
  EXPECT_EQ(coordinator_->held_blocks(), 2);
  EXPECT_EQ(ledger_->held_blocks(), 2);
  for (BlockId b : table) EXPECT_EQ(ledger_->RefCount(b), 2) << b;  // the sequence + hold
  ExpectInvariants();
  // Freed while held: in use, not evictable, until the mover's release is polled.
  ASSERT_THAT(ledger_->Free(1), IsOk());
  ExpectInvariants();
  for (BlockId b : table) {
    EXPECT_EQ(ledger_->StateOf(b), BlockState::kInUse) << b;
    EXPECT_EQ(ledger_->RefCount(b), 1) << b;
  }
  EXPECT_EQ(ledger_->EvictAllCached(), 0);
  EXPECT_EQ(ledger_->AvailableBlocks(), kBlocks - 2);
  const std::vector<BlockHash> hashes = Hashes(0, 2);
  EXPECT_EQ(ledger_->Lookup(hashes), 2);
  DrainStores();
  for (BlockId b : table) {
    EXPECT_EQ(ledger_->StateOf(b), BlockState::kCached) << b;
    EXPECT_EQ(ledger_->RefCount(b), 0) << b;
  }
  EXPECT_EQ(ledger_->AvailableBlocks(), kBlocks);
  EXPECT_EQ(tiers_->LeadingReady(hashes), 2);
  ExpectInvariants();
  // Committed again elsewhere: the tiers have it, nothing is held.
  CommitPrefix(2, 0, 2);
  TakeEvents();
  EXPECT_EQ(coordinator_->held_blocks(), 0);
  ExpectInvariants();
}

// A block stored, evicted and reused for other content between two OnEvents calls (one
// Step) must not be written through under its old hash: its bytes are the new content's.
TEST_F(TierCoordinatorTest, BlockReusedBeforeItsEventsAreTakenIsNotStoredUnderItsOldHash) {
  Start(4, 0);
  CommitPrefix(1, 0, 1);
  const BlockId block = (*ledger_->BlockTable(1))[0];
  ASSERT_THAT(ledger_->Free(1), IsOk());
  ASSERT_EQ(ledger_->EvictAllCached(), 1);
  const std::vector<std::vector<uint8_t>> bytes = CommitPrefix(2, 9, 1);
  ASSERT_EQ((*ledger_->BlockTable(2))[0], block);  // lowest free id first
  TakeEvents();                                    // Stored(0, block), Removed(0), Stored(9, block)
  EXPECT_EQ(coordinator_->held_blocks(), 1);
  ExpectInvariants();
  DrainStores();
  const BlockHash h0[] = {HashOf(0)}, h9[] = {HashOf(9)};
  EXPECT_EQ(tiers_->LeadingReady(h0), 0);
  EXPECT_EQ(tiers_->LeadingReady(h9), 1);
}

class PrefetchTest : public TierCoordinatorTest, public ::testing::WithParamInterface<tiers::Tier> {
 protected:
  // A 3-block prefix committed, written to the tiers, evicted from the pool and the pool
  // cleared; returns the bytes it had.
  std::vector<std::vector<uint8_t>> PrefixOnlyInTheTiers() {
    if (GetParam() == tiers::Tier::kHost) {
      Start(4, 0);
    } else {
      Start(0, 8);
    }
    std::vector<std::vector<uint8_t>> bytes = CommitPrefix(1, 0, 3);
    TakeEvents();
    EXPECT_EQ(coordinator_->held_blocks(), 3);
    EXPECT_THAT(ledger_->Free(1), IsOk());
    DrainStores();
    EXPECT_EQ(ledger_->EvictAllCached(), 3);
    TakeEvents();
    EXPECT_EQ(ledger_->Lookup(Hashes(0, 3)), 0);
    EXPECT_EQ(tiers_->LeadingReady(Hashes(0, 3)), 3);
    for (BlockId b = 0; b < kBlocks; ++b) env_.ClearBlock(b);
    ExpectInvariants();
    return bytes;
  }
  // Prompt of 13 tokens: its 3 full blocks are all reusable.
  BlockOp Op(SeqId seq) const { return BlockOp::Allocate(seq, 3 * kBlockSize + 1, Hashes(0, 3)); }
  int32_t ExpectedHost() const { return GetParam() == tiers::Tier::kHost ? 12 : 0; }
  int32_t ExpectedDisk() const { return GetParam() == tiers::Tier::kDisk ? 12 : 0; }
};

TEST_P(PrefetchTest, LoadsThePrefixBackIntoThePool) {
  const std::vector<std::vector<uint8_t>> bytes = PrefixOnlyInTheTiers();
  OpOutcome outcome;
  std::optional<absl::Status> refused = coordinator_->BeforeAllocate(Op(2), kT0, &outcome);
  ASSERT_TRUE(refused.has_value());
  EXPECT_THAT(*refused, StatusIs(absl::StatusCode::kUnavailable, ::testing::HasSubstr("loading")));
  EXPECT_EQ(outcome.host_tokens, ExpectedHost());
  EXPECT_EQ(outcome.disk_tokens, ExpectedDisk());
  EXPECT_EQ(coordinator_->loading_prefetches(), 1);
  EXPECT_EQ(coordinator_->loading_blocks(), 3);
  EXPECT_TRUE(ledger_->IsLive(kFirstPrefetchSeq));
  EXPECT_EQ(ledger_->Lookup(Hashes(0, 3)), 0);  // never matchable before the loads are done
  ExpectInvariants();
  // Sent again while loading: refused again, no second prefetch.
  OpOutcome again;
  ASSERT_TRUE(coordinator_->BeforeAllocate(Op(2), kT0 + absl::Milliseconds(1), &again).has_value());
  EXPECT_EQ(coordinator_->loading_prefetches(), 1);
  PollTill([&] { return coordinator_->loading_prefetches() == 0; });
  EXPECT_EQ(coordinator_->loading_blocks(), 0);
  EXPECT_FALSE(ledger_->IsLive(kFirstPrefetchSeq));
  EXPECT_EQ(ledger_->Lookup(Hashes(0, 3)), 3);
  EXPECT_EQ(ledger_->Stats().cached_blocks, 3);
  EXPECT_EQ(coordinator_->held_blocks(), 0);  // loaded blocks are not written back
  EXPECT_EQ(ledger_->held_blocks(), 0);
  ExpectInvariants();
  OpOutcome served;
  EXPECT_EQ(coordinator_->BeforeAllocate(Op(2), kT0 + absl::Milliseconds(2), &served),
            std::nullopt);
  EXPECT_EQ(served.host_tokens, ExpectedHost());
  EXPECT_EQ(served.disk_tokens, ExpectedDisk());
  absl::StatusOr<AllocateResult> taken = Allocate(2, 13, Hashes(0, 3));
  ASSERT_THAT(taken.status(), IsOk());
  EXPECT_EQ(taken->num_cached_tokens, 12);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(env_.ReadBlock(taken->blocks[i]), bytes[i]) << "block " << i;
  }
  ExpectInvariants();
  // The prefetch's counts went with that Allocate: the next one is an ordinary hit.
  OpOutcome next;
  EXPECT_EQ(coordinator_->BeforeAllocate(Op(3), kT0 + absl::Milliseconds(3), &next), std::nullopt);
  EXPECT_EQ(next.host_tokens, 0);
  EXPECT_EQ(next.disk_tokens, 0);
}

TEST_P(PrefetchTest, PastTheLoadTimeoutTheAllocateRunsWithoutTheLoads) {
  PrefixOnlyInTheTiers();
  OpOutcome outcome;
  ASSERT_TRUE(coordinator_->BeforeAllocate(Op(2), kT0, &outcome).has_value());
  // No Poll yet: every load is still pending for the coordinator, whatever the movers did.
  OpOutcome early;
  ASSERT_TRUE(
      coordinator_->BeforeAllocate(Op(2), kT0 + kLoadTimeout - absl::Milliseconds(1), &early)
          .has_value());
  OpOutcome late;
  EXPECT_EQ(coordinator_->BeforeAllocate(Op(2), kT0 + kLoadTimeout + absl::Seconds(1), &late),
            std::nullopt);
  // Nothing arrived in the pool: the Allocate is told it got nothing from the tiers.
  EXPECT_EQ(late.host_tokens, 0);
  EXPECT_EQ(late.disk_tokens, 0);
  EXPECT_EQ(ledger_->Lookup(Hashes(0, 3)), 0);
  absl::StatusOr<AllocateResult> taken = Allocate(2, 13, Hashes(0, 3));
  ASSERT_THAT(taken.status(), IsOk());
  EXPECT_EQ(taken->num_cached_tokens, 0);
  ExpectInvariants();
  // The loads still finish and their blocks become cached.
  PollTill([&] { return coordinator_->loading_prefetches() == 0; });
  EXPECT_FALSE(ledger_->IsLive(kFirstPrefetchSeq));
  EXPECT_EQ(ledger_->Lookup(Hashes(0, 3)), 3);
  ASSERT_THAT(ledger_->Free(2), IsOk());
  ExpectInvariants();
}

INSTANTIATE_TEST_SUITE_P(Tiers, PrefetchTest,
                         ::testing::Values(tiers::Tier::kHost, tiers::Tier::kDisk),
                         [](const auto& param_info) {
                           return std::string(tiers::TierName(param_info.param));
                         });

TEST_F(TierCoordinatorTest, MakeRoomCancelsQueuedStoresWhenThePoolIsShort) {
  Start(8, 8);
  CommitPrefix(1, 0, 6);
  TakeEvents();
  EXPECT_EQ(coordinator_->held_blocks(), 6);
  ASSERT_THAT(ledger_->Free(1), IsOk());
  EXPECT_EQ(ledger_->AvailableBlocks(), 2);
  // Enough room: nothing is cancelled (only Poll changes the holds otherwise).
  const BlockOp small[] = {BlockOp::Allocate(2, 8)};
  coordinator_->MakeRoom(small);
  EXPECT_EQ(coordinator_->held_blocks(), 6);
  EXPECT_EQ(tiers_->Snapshot().counters.stores_dropped, 0u);
  // Short: the stores not started are dropped and their blocks unheld at once.
  const BlockOp big[] = {BlockOp::Allocate(2, 8 * kBlockSize)};
  coordinator_->MakeRoom(big);
  const uint64_t dropped = tiers_->Snapshot().counters.stores_dropped;
  std::cout << dropped << " of 6 stores dropped\n";
  EXPECT_EQ(coordinator_->held_blocks(), 6 - static_cast<int32_t>(dropped));
  EXPECT_EQ(ledger_->held_blocks(), coordinator_->held_blocks());
  EXPECT_EQ(tiers_->queued_stores(), 0);
  ExpectInvariants();
  DrainStores();
  EXPECT_EQ(ledger_->AvailableBlocks(), kBlocks);
  EXPECT_EQ(tiers_->Snapshot().ready[0], 6 - static_cast<int32_t>(dropped));
  ExpectInvariants();
  absl::StatusOr<AllocateResult> taken = Allocate(2, 8 * kBlockSize);
  EXPECT_THAT(taken.status(), IsOk());
  ExpectInvariants();
}

}  // namespace
}  // namespace kvcm::cache_manager
