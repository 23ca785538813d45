// FenceTable alone (services/cache_manager/fence_table.h): ids, acknowledgement, transfer
// and the reclaim rule, without a ledger or a service.

#include "services/cache_manager/fence_table.h"

#include <optional>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvcm::cache_manager {
namespace {

using ::testing::ElementsAre;
using ::testing::UnorderedElementsAre;

constexpr uint64_t kRouter = 7;
constexpr uint64_t kExecutorA = 100;
constexpr uint64_t kExecutorB = 200;
constexpr uint64_t kExecutorC = 300;

TEST(FenceTableTest, OpenGivesFenceIdsFromOneAndDrainingIdsFromTwoToThe63InOrder) {
  FenceTable table;
  const SeqId seqs[] = {5, 3, 9};
  const FenceTable::Fence& fence =
      table.Open(kRouter, ReclaimReason::kClientDied, seqs, {}, {kExecutorA});
  EXPECT_EQ(fence.id, 1u);
  EXPECT_EQ(fence.router_session, kRouter);
  EXPECT_EQ(fence.reason, ReclaimReason::kClientDied);
  // Index by index: the caller renames seqs[i] to fence.seqs[i].
  EXPECT_THAT(fence.seqs,
              ElementsAre(kFirstDrainingSeq, kFirstDrainingSeq + 1, kFirstDrainingSeq + 2));
  EXPECT_THAT(fence.waiting, UnorderedElementsAre(kExecutorA));
  EXPECT_EQ(table.size(), 1);
  ASSERT_NE(table.Find(1), nullptr);
  EXPECT_EQ(table.Find(1)->seqs, fence.seqs);
}

TEST(FenceTableTest, NeitherAFenceIdNorADrainingIdIsGivenTwiceEvenAfterItsFenceClosed) {
  FenceTable table;
  const SeqId first[] = {1, 2};
  const SeqId second[] = {1};
  const std::vector<SeqId> first_draining =
      table.Open(kRouter, ReclaimReason::kGoodbye, first, {}, {kExecutorA}).seqs;
  ASSERT_TRUE(table.Acknowledge(1, kExecutorA).has_value());
  const FenceTable::Fence& again =
      table.Open(kRouter, ReclaimReason::kGoodbye, second, {}, {kExecutorA});
  EXPECT_EQ(again.id, 2u);
  EXPECT_THAT(again.seqs, ElementsAre(first_draining.back() + 1));
}

TEST(FenceTableTest, AcknowledgementByEveryWaitingExecutorReturnsTheSequencesExactlyOnce) {
  FenceTable table;
  const SeqId seqs[] = {11, 12};
  const std::vector<SeqId> draining =
      table.Open(kRouter, ReclaimReason::kLeaseExpired, seqs, {}, {kExecutorA, kExecutorB}).seqs;

  EXPECT_FALSE(table.Acknowledge(1, kExecutorA).has_value());  // B still waited for
  EXPECT_FALSE(table.Acknowledge(1, kExecutorA).has_value());  // a repeat counts nothing
  EXPECT_EQ(table.size(), 1);
  EXPECT_THAT(table.Find(1)->waiting, UnorderedElementsAre(kExecutorB));

  const std::optional<FenceTable::Fence> closed = table.Acknowledge(1, kExecutorB);
  ASSERT_TRUE(closed.has_value());
  EXPECT_EQ(closed->seqs, draining);
  EXPECT_EQ(closed->reason, ReclaimReason::kLeaseExpired);
  EXPECT_EQ(closed->router_session, kRouter);
  EXPECT_TRUE(closed->waiting.empty());
  EXPECT_EQ(table.size(), 0);
  EXPECT_EQ(table.Find(1), nullptr);
  // The last acknowledgement again, or any other, frees nothing twice.
  EXPECT_FALSE(table.Acknowledge(1, kExecutorB).has_value());
  EXPECT_FALSE(table.Acknowledge(1, kExecutorA).has_value());
}

TEST(FenceTableTest, AnUnknownFenceIdChangesNothing) {
  FenceTable table;
  const SeqId seqs[] = {1};
  table.Open(kRouter, ReclaimReason::kClientDied, seqs, {}, {kExecutorA});
  EXPECT_FALSE(table.Acknowledge(0, kExecutorA).has_value());
  EXPECT_FALSE(table.Acknowledge(2, kExecutorA).has_value());
  EXPECT_FALSE(table.Transfer(2, kExecutorA, kExecutorB));
  EXPECT_EQ(table.Find(2), nullptr);
  EXPECT_EQ(table.size(), 1);
  EXPECT_THAT(table.Find(1)->waiting, UnorderedElementsAre(kExecutorA));
}

TEST(FenceTableTest, AnExecutorTheFenceDoesNotWaitForCannotCloseIt) {
  FenceTable table;
  const SeqId seqs[] = {1};
  table.Open(kRouter, ReclaimReason::kClientDied, seqs, {}, {kExecutorA});
  // An executor that registered after the fence opened was never a writer of its blocks.
  EXPECT_FALSE(table.Acknowledge(1, kExecutorC).has_value());
  EXPECT_EQ(table.size(), 1);
  EXPECT_TRUE(table.Acknowledge(1, kExecutorA).has_value());
}

TEST(FenceTableTest, ATransferredFenceWaitsForTheSuccessorAndNoLongerForThePredecessor) {
  FenceTable table;
  const SeqId seqs[] = {1};
  table.Open(kRouter, ReclaimReason::kClientDied, seqs, {}, {kExecutorA, kExecutorB});
  ASSERT_TRUE(table.Transfer(1, kExecutorA, kExecutorC));
  EXPECT_THAT(table.Find(1)->waiting, UnorderedElementsAre(kExecutorB, kExecutorC));
  EXPECT_FALSE(table.Acknowledge(1, kExecutorA).has_value());
  EXPECT_FALSE(table.Acknowledge(1, kExecutorB).has_value());
  EXPECT_TRUE(table.Acknowledge(1, kExecutorC).has_value());
}

TEST(FenceTableTest, ATransferFromAnExecutorNotWaitingChangesNothing) {
  FenceTable table;
  const SeqId seqs[] = {1};
  table.Open(kRouter, ReclaimReason::kClientDied, seqs, {}, {kExecutorA});
  EXPECT_FALSE(table.Transfer(1, kExecutorB, kExecutorC));
  EXPECT_THAT(table.Find(1)->waiting, UnorderedElementsAre(kExecutorA));
}

TEST(FenceTableTest, ASequenceFenceCountsNothingAsReclaimedAndAWholeSessionFenceDoes) {
  FenceTable table;
  const SeqId seqs[] = {42};
  const FenceTable::Fence& whole =
      table.Open(kRouter, ReclaimReason::kClientDied, seqs, {}, {kExecutorA});
  EXPECT_TRUE(whole.count_reclaimed);
  EXPECT_TRUE(whole.router_seqs.empty());
  const FenceTable::Fence& scoped =
      table.Open(kRouter, ReclaimReason::kGoodbye, seqs, {42}, {kExecutorA});
  EXPECT_FALSE(scoped.count_reclaimed);
  EXPECT_THAT(scoped.router_seqs, ElementsAre(42u));
  const std::optional<FenceTable::Fence> closed = table.Acknowledge(2, kExecutorA);
  ASSERT_TRUE(closed.has_value());
  EXPECT_FALSE(closed->count_reclaimed);
  EXPECT_THAT(closed->router_seqs, ElementsAre(42u));
}

TEST(FenceTableTest, DrainingIdsStartAtTwoToThe63) {
  EXPECT_FALSE(FenceTable::IsDraining(kFirstDrainingSeq - 1));
  EXPECT_TRUE(FenceTable::IsDraining(kFirstDrainingSeq));
  EXPECT_TRUE(FenceTable::IsDraining(~SeqId{0}));
  EXPECT_EQ(kFirstDrainingSeq, SeqId{1} << 63);
}

TEST(FenceTableDeathTest, AFenceWaitingForNobodyIsABug) {
  FenceTable table;
  const SeqId seqs[] = {1};
  EXPECT_DEATH(table.Open(kRouter, ReclaimReason::kClientDied, seqs, {}, {}), "0 executors");
}

}  // namespace
}  // namespace kvcm::cache_manager
