// StepApplier alone (services/cache_manager/step_applier.h): each op kind's refusals with
// the texts a router sees, that a refused Step leaves the ledger as it was, and that an
// accepted one's outcomes and effects come in op order, against a real BlockLedger.

#include "services/cache_manager/step_applier.h"

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/base/check.h"
#include "common/wire/step_codec.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "services/cache_manager/fence_table.h"
#include "tests/support/status_matchers.h"

namespace kvcm::cache_manager {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;
using ::testing::SizeIs;

constexpr int32_t kBlocks = 16;
constexpr int32_t kBlockSize = 4;  // the pool holds 64 tokens
constexpr uint64_t kMine = 7;
constexpr uint64_t kTheirs = 8;
constexpr int32_t kMaxSeqs = 4;

BlockHash HashOf(int i) {
  BlockHash h;
  h.bytes[0] = static_cast<uint8_t>(i);
  h.bytes[31] = 0x5a;
  return h;
}

// Every observable part of the ledger: counts, counters and each sequence's record.
std::string Fingerprint(const GroupedLedger& grouped) {
  const BlockLedger& ledger = grouped.pool();  // one group: the pool's ids are the ledger's
  const LedgerStats s = ledger.Stats();
  std::string out =
      absl::StrCat("free ", s.free_blocks, " in_use ", s.in_use_blocks, " cached ", s.cached_blocks,
                   " live ", s.live_sequences, " allocated ", s.blocks_allocated, " released ",
                   s.blocks_released, " available ", ledger.AvailableBlocks(), "\n");
  std::vector<std::pair<SeqId, uint64_t>> seqs;
  ledger.ForEachSequence([&](SeqId seq, uint64_t owner) { seqs.emplace_back(seq, owner); });
  std::sort(seqs.begin(), seqs.end());
  for (const auto& [seq, owner] : seqs) {
    absl::StrAppend(&out, "seq ", seq, " owner ", owner, " tokens ", *ledger.NumTokens(seq),
                    " committed ", *ledger.NumCommittedTokens(seq), " blocks ",
                    absl::StrJoin(*ledger.BlockTable(seq), ","), "\n");
  }
  return out;
}

// A ledger of kBlocks pages for KV cache groups of `windows` (none: one group, no window).
GroupedLedger MakeLedger(std::vector<int32_t> windows) {
  GroupedLedger::Options options;
  options.pool = {.num_blocks = kBlocks, .block_size = kBlockSize};
  options.group_windows = std::move(windows);
  return *GroupedLedger::Create(std::move(options));
}

// What a service with no executor session does: a drained sequence is freed at once.
class RecordedEffects final : public StepApplier::Effects {
 public:
  explicit RecordedEffects(GroupedLedger* ledger) : ledger_(ledger) {}
  void Drain(SeqId seq) override {
    calls.push_back(absl::StrCat("drain ", seq));
    KVCM_CHECK(ledger_->Free(seq).ok());
  }
  void CommittedTokens(SeqId seq, int32_t num_committed_tokens,
                       std::span<const int32_t> tokens) override {
    calls.push_back(absl::StrCat("tokens ", seq, " ", num_committed_tokens, " ", tokens.size()));
  }
  std::vector<std::string> calls;

 private:
  GroupedLedger* ledger_;
};

class StepApplierTest : public ::testing::Test {
 protected:
  StepApplierTest()
      : ledger_(MakeLedger({})),
        applier_(&ledger_, {.max_sequences_per_session = kMaxSeqs}),
        effects_(&ledger_) {}

  // A live sequence of `tokens` tokens held by `owner`, all committed.
  void Hold(SeqId seq, int32_t tokens, uint64_t owner) {
    AllocateResult allocated;
    std::vector<BlockId> group_blocks;
    ASSERT_THAT(ledger_.Allocate(seq, tokens, {}, &allocated, &group_blocks), IsOk());
    ASSERT_THAT(ledger_.Commit(seq, tokens), IsOk());
    ASSERT_THAT(ledger_.SetOwner(seq, owner), IsOk());
    if (owner == kMine) ++mine_.num_seqs;
  }

  // The refusal of `ops`, checking that validating them changed nothing in the ledger.
  StepRefusal Refusal(const std::vector<BlockOp>& ops) {
    const std::string before = Fingerprint(ledger_);
    std::optional<StepRefusal> refused = applier_.Validate(ops, mine_);
    EXPECT_EQ(Fingerprint(ledger_), before);
    EXPECT_THAT(ledger_.CheckInvariants(), IsOk());
    EXPECT_TRUE(refused.has_value()) << "the step was accepted";
    return refused.value_or(StepRefusal{RejectReason::kCount, absl::OkStatus()});
  }

  // Whether `ops` pass validation.
  bool Passes(const std::vector<BlockOp>& ops) {
    return !applier_.Validate(ops, mine_).has_value();
  }

  StepApplier::Applied ValidateAndApply(const std::vector<BlockOp>& ops) {
    std::optional<StepRefusal> refused = applier_.Validate(ops, mine_);
    EXPECT_FALSE(refused.has_value()) << refused->status;
    StepApplier::Applied applied = applier_.Apply(ops, mine_, effects_);
    EXPECT_THAT(ledger_.CheckInvariants(), IsOk());
    return applied;
  }

  GroupedLedger ledger_;
  StepApplier applier_;
  RecordedEffects effects_;
  absl::flat_hash_set<SeqId> drained_;
  StepSession mine_{.id = kMine, .num_seqs = 0, .drained_ids = &drained_};
};

// Reason, code and message of a refusal, to compare in one expectation.
std::tuple<RejectReason, absl::StatusCode, std::string> Parts(const StepRefusal& refusal) {
  return {refusal.reason, refusal.status.code(), std::string(refusal.status.message())};
}

std::tuple<RejectReason, absl::StatusCode, std::string> Invalid(std::string message) {
  return {RejectReason::kInvalidArgument, absl::StatusCode::kInvalidArgument, std::move(message)};
}

std::tuple<RejectReason, absl::StatusCode, std::string> NotLive(std::string message) {
  return {RejectReason::kUnknownSequence, absl::StatusCode::kNotFound, std::move(message)};
}

std::tuple<RejectReason, absl::StatusCode, std::string> NotMine(std::string message) {
  return {RejectReason::kWrongOwner, absl::StatusCode::kPermissionDenied, std::move(message)};
}

// --- Allocate ------------------------------------------------------------------------------

TEST_F(StepApplierTest, AnAllocateOfALiveSequenceIsRefusedAsADuplicateWhoeverHoldsIt) {
  Hold(1, 4, kMine);
  Hold(2, 4, kTheirs);
  EXPECT_EQ(Parts(Refusal({BlockOp::Allocate(1, 4)})),
            std::make_tuple(RejectReason::kDuplicateSequence, absl::StatusCode::kAlreadyExists,
                            std::string("op 0 (allocate): sequence 1 is already live")));
  EXPECT_EQ(Parts(Refusal({BlockOp::Allocate(3, 4), BlockOp::Allocate(2, 4)})),
            std::make_tuple(RejectReason::kDuplicateSequence, absl::StatusCode::kAlreadyExists,
                            std::string("op 1 (allocate): sequence 2 is already live")));
}

TEST_F(StepApplierTest, AnAllocateOfAReservedIdIsRefused) {
  EXPECT_EQ(Parts(Refusal({BlockOp::Allocate(kFirstDrainingSeq, 4)})),
            Invalid("op 0 (allocate): sequence id 9223372036854775808 is reserved (ids from "
                    "2^63 up are the cache manager's)"));
}

TEST_F(StepApplierTest, AnIdFreedWithDrainCannotBeAllocatedAgainBeforeOrWithinTheStep) {
  drained_.insert(5);
  const std::string suffix =
      " was freed with drain and cannot be live again (the executors refuse it for good): "
      "choose a new id";
  EXPECT_EQ(Parts(Refusal({BlockOp::Allocate(5, 4)})),
            Invalid("op 0 (allocate): sequence id 5" + suffix));
  Hold(1, 4, kMine);
  EXPECT_EQ(Parts(Refusal({BlockOp::Free(1, /*drain=*/true), BlockOp::Allocate(1, 4)})),
            Invalid("op 1 (allocate): sequence id 1" + suffix));
}

TEST_F(StepApplierTest, AnAllocateWithTokensOutsideThePoolOrAHashPerPartBlockIsRefused) {
  const std::string range = " is outside [0, 64] (the pool's capacity in tokens)";
  EXPECT_EQ(Parts(Refusal({BlockOp::Allocate(1, -1)})),
            Invalid("op 0 (allocate): num_tokens = -1" + range));
  EXPECT_EQ(Parts(Refusal({BlockOp::Allocate(1, 65)})),
            Invalid("op 0 (allocate): num_tokens = 65" + range));
  const BlockHash hashes[] = {HashOf(1), HashOf(2)};
  EXPECT_EQ(Parts(Refusal({BlockOp::Allocate(1, 7, hashes)})),
            Invalid("op 0 (allocate): 2 block hashes for 7 tokens (at most one per full block)"));
}

TEST_F(StepApplierTest, TheSequenceLimitCountsTheStepsOwnAllocationsForksAndFrees) {
  Hold(1, 4, kMine);
  Hold(2, 4, kMine);
  Hold(3, 4, kMine);
  EXPECT_EQ(Parts(Refusal({BlockOp::Allocate(10, 4), BlockOp::Fork(1, 11)})),
            std::make_tuple(RejectReason::kLimitExceeded, absl::StatusCode::kResourceExhausted,
                            std::string("op 1 (fork): the session would hold more than 4 live "
                                        "sequences, its limit")));
  // A free earlier in the step makes room; one of a sequence nobody holds does not.
  EXPECT_TRUE(Passes({BlockOp::Free(1), BlockOp::Allocate(10, 4), BlockOp::Fork(2, 11)}));
  EXPECT_EQ(Refusal({BlockOp::Free(99), BlockOp::Allocate(10, 4), BlockOp::Fork(2, 11)}).reason,
            RejectReason::kLimitExceeded);
}

// --- Append --------------------------------------------------------------------------------

TEST_F(StepApplierTest, AnAppendToASequenceNobodyHoldsIsRefusedAsNotLive) {
  Hold(1, 4, kMine);
  EXPECT_EQ(Parts(Refusal({BlockOp::Append(1, 1), BlockOp::Append(9, 1)})),
            NotLive("op 1 (append): sequence 9 is not live"));
}

TEST_F(StepApplierTest, AnAppendToAnotherSessionsSequenceIsRefusedAsNotItsOwn) {
  Hold(2, 4, kTheirs);
  EXPECT_EQ(Parts(Refusal({BlockOp::Append(2, 1)})),
            NotMine("op 0 (append): sequence 2 belongs to another session"));
}

TEST_F(StepApplierTest, AnAppendOfTokensOutsideThePoolIsRefused) {
  Hold(1, 4, kMine);
  EXPECT_EQ(Parts(Refusal({BlockOp::Append(1, -3)})),
            Invalid("op 0 (append): num_tokens = -3 is outside [0, 64] (the pool's capacity "
                    "in tokens)"));
}

// --- Fork ----------------------------------------------------------------------------------

TEST_F(StepApplierTest, AForkOfAParentNotHeldOrIntoALiveOrReservedChildIsRefused) {
  Hold(1, 4, kMine);
  Hold(2, 4, kTheirs);
  EXPECT_EQ(Parts(Refusal({BlockOp::Fork(9, 10)})), NotLive("op 0 (fork): sequence 9 is not live"));
  EXPECT_EQ(Parts(Refusal({BlockOp::Fork(2, 10)})),
            NotMine("op 0 (fork): sequence 2 belongs to another session"));
  EXPECT_EQ(Parts(Refusal({BlockOp::Fork(1, 2)})),
            std::make_tuple(RejectReason::kDuplicateSequence, absl::StatusCode::kAlreadyExists,
                            std::string("op 0 (fork): sequence 2 is already live")));
  EXPECT_EQ(Parts(Refusal({BlockOp::Fork(1, kFirstDrainingSeq + 1)})),
            Invalid("op 0 (fork): sequence id 9223372036854775809 is reserved (ids from 2^63 "
                    "up are the cache manager's)"));
}

// --- Commit --------------------------------------------------------------------------------

TEST_F(StepApplierTest, ACommitOfAnUnknownOrAnotherSessionsSequenceIsRefused) {
  Hold(2, 4, kTheirs);
  EXPECT_EQ(Parts(Refusal({BlockOp::Commit(9, 0)})),
            NotLive("op 0 (commit): sequence 9 is not live"));
  EXPECT_EQ(Parts(Refusal({BlockOp::Commit(2, 4)})),
            NotMine("op 0 (commit): sequence 2 belongs to another session"));
}

TEST_F(StepApplierTest, ACommitWithCountsOutOfRangeIsRefusedNamingItsField) {
  Hold(1, 8, kMine);
  EXPECT_EQ(Parts(Refusal({BlockOp::Commit(1, 100)})),
            Invalid("op 0 (commit): num_committed_tokens = 100 is outside [0, 64] (the pool's "
                    "capacity in tokens)"));
  const BlockHash hashes[] = {HashOf(1), HashOf(2), HashOf(3)};
  EXPECT_EQ(Parts(Refusal({BlockOp::Commit(1, 8, hashes)})),
            Invalid("op 0 (commit): 3 new block hashes for committing 8 tokens (at most one per "
                    "full block)"));
}

TEST_F(StepApplierTest, ACommitCoversOnlyTokensItsSequenceHadBeforeTheStep) {
  Hold(1, 8, kMine);
  EXPECT_EQ(Parts(Refusal({BlockOp::Append(1, 4), BlockOp::Commit(1, 12)})),
            Invalid("op 1 (commit): commits 12 tokens of sequence 1, which had 8 before this "
                    "step: the KV of tokens added in the same step cannot have been written "
                    "yet (commit them in the next step)"));
  EXPECT_EQ(Parts(Refusal({BlockOp::Allocate(2, 8), BlockOp::Commit(2, 4)})),
            Invalid("op 1 (commit): commits 4 tokens of sequence 2, which had 0 before this "
                    "step: the KV of tokens added in the same step cannot have been written "
                    "yet (commit them in the next step)"));
  // A fork's child may commit what its parent had.
  EXPECT_TRUE(Passes({BlockOp::Fork(1, 3), BlockOp::Append(3, 4), BlockOp::Commit(3, 8)}));
  EXPECT_EQ(Refusal({BlockOp::Fork(1, 3), BlockOp::Append(3, 4), BlockOp::Commit(3, 9)}).reason,
            RejectReason::kInvalidArgument);
}

TEST_F(StepApplierTest, ACommitsTokenIdsMustBeWholeBlocksAndNoMoreThanItCommits) {
  Hold(1, 8, kMine);
  const std::vector<int32_t> three(3, 0), twelve(12, 0), eight(8, 0);
  EXPECT_EQ(Parts(Refusal({BlockOp::Commit(1, 8, {}, three)})),
            Invalid("op 0 (commit): carries 3 token ids for a commit of 8 tokens: give whole "
                    "blocks of 4 tokens, the last full blocks committed, or none"));
  EXPECT_EQ(Parts(Refusal({BlockOp::Commit(1, 8, {}, twelve)})),
            Invalid("op 0 (commit): carries 12 token ids for a commit of 8 tokens: give whole "
                    "blocks of 4 tokens, the last full blocks committed, or none"));
  EXPECT_TRUE(Passes({BlockOp::Commit(1, 8, {}, eight)}));
}

// --- CanAllocate ---------------------------------------------------------------------------

TEST_F(StepApplierTest, ACanAllocateWithCountsOutOfRangeIsRefused) {
  EXPECT_EQ(Parts(Refusal({BlockOp::CanAllocate(65)})),
            Invalid("op 0 (can_allocate): num_tokens = 65 is outside [0, 64] (the pool's "
                    "capacity in tokens)"));
  const BlockHash hashes[] = {HashOf(1)};
  EXPECT_EQ(Parts(Refusal({BlockOp::CanAllocate(3, hashes)})),
            Invalid("op 0 (can_allocate): 1 block hashes for 3 tokens (at most one per full "
                    "block)"));
}

// --- Free ----------------------------------------------------------------------------------

TEST_F(StepApplierTest, AFreeOfAnotherSessionsSequenceOrAReservedIdIsRefused) {
  Hold(2, 4, kTheirs);
  EXPECT_EQ(Parts(Refusal({BlockOp::Free(2)})),
            NotMine("op 0 (free): sequence 2 belongs to another session"));
  EXPECT_EQ(Parts(Refusal({BlockOp::Free(kFirstDrainingSeq)})),
            Invalid("op 0 (free): sequence id 9223372036854775808 is reserved (ids from 2^63 "
                    "up are the cache manager's)"));
}

TEST_F(StepApplierTest, AFreeOfASequenceNobodyHoldsPassesAndFailsAloneInItsResult) {
  Hold(1, 4, kMine);
  const StepApplier::Applied applied =
      ValidateAndApply({BlockOp::Free(1), BlockOp::Free(1), BlockOp::CanAllocate(4)});
  ASSERT_THAT(applied.outcomes, SizeIs(3));
  EXPECT_THAT(applied.outcomes[0].status, IsOk());
  EXPECT_THAT(applied.outcomes[1].status,
              StatusIs(absl::StatusCode::kNotFound, "sequence 1 is not live"));
  EXPECT_THAT(applied.outcomes[2].status, IsOk());
  EXPECT_EQ(applied.num_seqs, 0);
}

// --- Across ops ----------------------------------------------------------------------------

TEST_F(StepApplierTest, AnOpOnASequenceFreedEarlierInTheStepIsRefusedAndOneAllocatedEarlierPasses) {
  Hold(1, 4, kMine);
  EXPECT_EQ(Parts(Refusal({BlockOp::Free(1), BlockOp::Append(1, 1)})),
            NotLive("op 1 (append): sequence 1 is not live"));
  EXPECT_TRUE(Passes(
      {BlockOp::Allocate(2, 4), BlockOp::Append(2, 1), BlockOp::Fork(2, 3), BlockOp::Free(3)}));
  // ... and validation alone allocated nothing.
  EXPECT_FALSE(ledger_.IsLive(2));
}

TEST_F(StepApplierTest, ARefusedStepChangesNothingInTheLedgerWhateverItsEarlierOpsWouldDo) {
  Hold(1, 8, kMine);
  Hold(2, 4, kMine);
  const std::string before = Fingerprint(ledger_);
  const LedgerStats stats = ledger_.Stats();
  const std::vector<BlockOp> ops = {BlockOp::Allocate(3, 16), BlockOp::Append(1, 8),
                                    BlockOp::Fork(1, 4),      BlockOp::Free(2),
                                    BlockOp::Commit(1, 8),    BlockOp::Append(77, 1)};
  const std::optional<StepRefusal> refused = applier_.Validate(ops, mine_);
  ASSERT_TRUE(refused.has_value());
  EXPECT_EQ(Parts(*refused), NotLive("op 5 (append): sequence 77 is not live"));
  EXPECT_EQ(Fingerprint(ledger_), before);
  EXPECT_EQ(ledger_.Stats().live_sequences, stats.live_sequences);
  EXPECT_EQ(ledger_.Stats().free_blocks, stats.free_blocks);
  EXPECT_THAT(ledger_.CheckInvariants(), IsOk());
  EXPECT_THAT(effects_.calls, IsEmpty());
}

TEST_F(StepApplierTest, AnAcceptedStepsOutcomesComeInOpOrderWithTheSessionsNewCount) {
  Hold(1, 4, kMine);
  Hold(2, 4, kMine);
  const StepApplier::Applied applied =
      ValidateAndApply({BlockOp::Allocate(3, 6), BlockOp::Append(1, 5), BlockOp::CanAllocate(8),
                        BlockOp::Fork(3, 4), BlockOp::Free(2), BlockOp::Commit(1, 4)});
  ASSERT_THAT(applied.outcomes, SizeIs(6));
  for (const OpOutcome& outcome : applied.outcomes) EXPECT_THAT(outcome.status, IsOk());
  EXPECT_EQ(applied.outcomes[0].blocks, *ledger_.BlockTable(3));  // the whole table
  EXPECT_THAT(applied.outcomes[0].blocks, SizeIs(2));
  EXPECT_THAT(applied.outcomes[1].blocks, SizeIs(2));  // 9 tokens: two new blocks
  const std::vector<BlockId> table1 = *ledger_.BlockTable(1);
  EXPECT_THAT(applied.outcomes[1].blocks, ElementsAre(table1[1], table1[2]));
  EXPECT_EQ(applied.outcomes[2].blocks_needed, 2);
  EXPECT_THAT(applied.outcomes[3].blocks, IsEmpty());
  EXPECT_THAT(applied.outcomes[4].blocks, IsEmpty());
  EXPECT_EQ(applied.num_seqs, 3);  // 2 + allocate + fork - free
  EXPECT_EQ(ledger_.OwnerOf(3), kMine);
  EXPECT_EQ(ledger_.OwnerOf(4), kMine);
  EXPECT_FALSE(ledger_.IsLive(2));
}

TEST_F(StepApplierTest, AnOpTheLedgerRefusesFailsAloneAndTheOpsAfterItStillRun) {
  Hold(1, 4, kMine);  // 15 blocks left
  const StepApplier::Applied applied =
      ValidateAndApply({BlockOp::Allocate(2, 64), BlockOp::Append(1, 4), BlockOp::Allocate(3, 4)});
  ASSERT_THAT(applied.outcomes, SizeIs(3));
  EXPECT_THAT(applied.outcomes[0].status, StatusIs(absl::StatusCode::kResourceExhausted));
  EXPECT_THAT(applied.outcomes[0].blocks, IsEmpty());
  EXPECT_FALSE(ledger_.IsLive(2));
  EXPECT_THAT(applied.outcomes[1].status, IsOk());
  EXPECT_THAT(applied.outcomes[2].status, IsOk());
  EXPECT_EQ(applied.num_seqs, 2);
}

TEST_F(StepApplierTest, DrainsAndCommittedTokenIdsReachTheCallerInOpOrder) {
  Hold(1, 8, kMine);
  Hold(2, 8, kMine);
  const std::vector<int32_t> tokens(4, 3);
  const StepApplier::Applied applied =
      ValidateAndApply({BlockOp::Commit(2, 8, {}, tokens), BlockOp::Free(1, /*drain=*/true),
                        BlockOp::Commit(2, 8), BlockOp::Free(2)});
  EXPECT_THAT(effects_.calls, ElementsAre("tokens 2 8 4", "drain 1"));
  ASSERT_THAT(applied.outcomes, SizeIs(4));
  EXPECT_THAT(applied.outcomes[1].status, IsOk());
  EXPECT_EQ(applied.num_seqs, 0);
}

TEST_F(StepApplierTest, AShorterStepAfterALongerOneGetsExactlyItsOwnOutcomes) {
  Hold(1, 4, kMine);
  ASSERT_THAT(
      ValidateAndApply({BlockOp::Append(1, 4), BlockOp::Allocate(2, 8), BlockOp::CanAllocate(4)})
          .outcomes,
      SizeIs(3));
  mine_.num_seqs = 2;
  const StepApplier::Applied applied = ValidateAndApply({BlockOp::Append(1, 0)});
  ASSERT_THAT(applied.outcomes, SizeIs(1));
  EXPECT_THAT(applied.outcomes[0].status, IsOk());
  EXPECT_THAT(applied.outcomes[0].blocks, IsEmpty());
  EXPECT_EQ(applied.num_seqs, 2);
}

}  // namespace
}  // namespace kvcm::cache_manager
