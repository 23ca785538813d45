// Exact scenarios on tiny pools: every block id, state and order is spelled out.

#include "common/block/block_ledger.h"

#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/common/block/ledger_test_util.h"
#include "tests/support/status_matchers.h"

namespace kvcm {
namespace {

using ::kvcm::testing::HashesOf;
using ::kvcm::testing::Iota;
using ::kvcm::testing::Snapshot;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::UnorderedElementsAre;

constexpr BlockId X = kNoBlock;

BlockLedger MakeLedger(int32_t num_blocks, int32_t block_size, int32_t window = 0,
                       bool events = false) {
  BlockLedger::Options options;
  options.num_blocks = num_blocks;
  options.block_size = block_size;
  options.sliding_window_tokens = window;
  options.record_events = events;
  auto ledger = BlockLedger::Create(options);
  EXPECT_THAT(ledger, IsOk());
  return std::move(ledger).value();
}

#define EXPECT_INVARIANTS(ledger) \
  EXPECT_THAT((ledger).CheckInvariants(), IsOk()) << (ledger).CheckInvariants()

// Block sizes 4 and 16: scenarios are written in units of `bs`.
class LedgerScenarioTest : public ::testing::TestWithParam<int32_t> {
 protected:
  int32_t bs() const { return GetParam(); }
};

TEST_P(LedgerScenarioTest, AllocatesLowestFreeBlocksInAscendingRuns) {
  BlockLedger ledger = MakeLedger(8, bs());
  auto a = ledger.Allocate(1, 2 * bs() + 1);
  ASSERT_THAT(a, IsOk());
  EXPECT_THAT(a->blocks, ElementsAre(0, 1, 2));
  EXPECT_EQ(a->num_cached_tokens, 0);
  auto b = ledger.Allocate(2, bs());
  EXPECT_THAT(b->blocks, ElementsAre(3));
  ASSERT_THAT(ledger.Free(1), IsOk());
  EXPECT_INVARIANTS(ledger);
  // Freed ids are reused lowest first: 0, 1 then 4 (3 is taken).
  auto c = ledger.Allocate(3, 3 * bs());
  EXPECT_THAT(c->blocks, ElementsAre(0, 1, 2));
  auto d = ledger.Allocate(4, 2 * bs());
  EXPECT_THAT(d->blocks, ElementsAre(4, 5));
  EXPECT_INVARIANTS(ledger);
  const LedgerStats stats = ledger.Stats();
  EXPECT_EQ(stats.in_use_blocks, 6);
  EXPECT_EQ(stats.free_blocks, 2);
  EXPECT_DOUBLE_EQ(stats.usage_ratio, 6.0 / 8);
}

// Allocate and Append into a result the caller keeps (as the cache manager keeps its own)
// answer exactly what the returning forms answer, whatever the result held before: a ledger
// driven each way through a prefix hit, a new block, a copy-on-write, the fast path that
// adds nothing, and errors.
TEST_P(LedgerScenarioTest, AllocateAndAppendIntoAKeptResultAnswerWhatTheReturningFormsDo) {
  BlockLedger by_value = MakeLedger(16, bs());
  BlockLedger into = MakeLedger(16, bs());
  AllocateResult allocated{{91, 92, 93, 94, 95, 96, 97, 98, 99}, 7};  // stale contents
  AppendResult appended{{42}, {{1, 2}}, 5};
  const auto prompt = Iota(2 * bs() + 1);
  const auto hashes = HashesOf(prompt, bs());
  // Each call also checks the code the scenario expects of it.
  auto allocate_both = [&](SeqId seq, int32_t tokens, std::span<const BlockHash> h,
                           absl::StatusCode expected = absl::StatusCode::kOk) {
    auto want = by_value.Allocate(seq, tokens, h);
    const absl::Status got = into.Allocate(seq, tokens, h, &allocated);
    EXPECT_EQ(want.status().code(), expected) << want.status();
    ASSERT_EQ(got.code(), want.status().code()) << got;
    if (!want.ok()) return;
    EXPECT_EQ(allocated.blocks, want->blocks) << "seq " << seq;
    EXPECT_EQ(allocated.num_cached_tokens, want->num_cached_tokens) << "seq " << seq;
  };
  auto append_both = [&](SeqId seq, int32_t tokens,
                         absl::StatusCode expected = absl::StatusCode::kOk) {
    auto want = by_value.Append(seq, tokens);
    const absl::Status got = into.Append(seq, tokens, &appended);
    EXPECT_EQ(want.status().code(), expected) << want.status();
    ASSERT_EQ(got.code(), want.status().code()) << got;
    if (!want.ok()) return;
    EXPECT_EQ(appended.new_blocks, want->new_blocks) << "seq " << seq;
    EXPECT_EQ(appended.copies, want->copies) << "seq " << seq;
    EXPECT_EQ(appended.replaced_last, want->replaced_last) << "seq " << seq;
  };
  auto both = [&](auto&& op) {
    ASSERT_THAT(op(by_value), IsOk());
    ASSERT_THAT(op(into), IsOk());
  };
  allocate_both(1, 2 * bs() + 1, hashes);
  both([&](BlockLedger& l) { return l.Commit(1, 2 * bs() + 1); });
  allocate_both(2, 2 * bs() + 1, hashes);  // two blocks hit
  EXPECT_EQ(allocated.num_cached_tokens, 2 * bs());
  append_both(1, bs());  // a new block
  EXPECT_EQ(appended.new_blocks.size(), 1u);
  both([&](BlockLedger& l) { return l.Commit(2, 2 * bs() + 1); });
  both([&](BlockLedger& l) { return l.Fork(2, 3); });
  append_both(3, 1);  // the shared partial block is copied
  EXPECT_EQ(appended.copies.size(), 1u);
  EXPECT_NE(appended.replaced_last, X);
  append_both(3, 1);  // fits the private last block: nothing to report
  EXPECT_TRUE(appended.new_blocks.empty());
  EXPECT_TRUE(appended.copies.empty());
  EXPECT_EQ(appended.replaced_last, X);
  append_both(99, 1, absl::StatusCode::kNotFound);
  allocate_both(1, 1, {}, absl::StatusCode::kAlreadyExists);
  allocate_both(4, 17 * bs(), {}, absl::StatusCode::kInvalidArgument);  // more than the pool
  allocate_both(5, 15 * bs(), {}, absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(Snapshot(into, {1, 2, 3}), Snapshot(by_value, {1, 2, 3}));
  EXPECT_INVARIANTS(into);
}

TEST_P(LedgerScenarioTest, ZeroTokenSequenceHoldsNoBlocksUntilAppend) {
  BlockLedger ledger = MakeLedger(4, bs());
  auto a = ledger.Allocate(1, 0);
  ASSERT_THAT(a, IsOk());
  EXPECT_TRUE(a->blocks.empty());
  auto app = ledger.Append(1, 1);
  ASSERT_THAT(app, IsOk());
  EXPECT_THAT(app->new_blocks, ElementsAre(0));
  EXPECT_INVARIANTS(ledger);
}

TEST_P(LedgerScenarioTest, PrefixHitNeedsCommitAndSharesBlocks) {
  BlockLedger ledger = MakeLedger(16, bs());
  const auto prompt = Iota(3 * bs() + 1);  // 3 full blocks and one token
  const auto hashes = HashesOf(prompt, bs());
  ASSERT_EQ(hashes.size(), 3u);
  auto a = ledger.Allocate(1, static_cast<int32_t>(prompt.size()), hashes);
  EXPECT_THAT(a->blocks, ElementsAre(0, 1, 2, 3));

  // Not committed yet: nothing is matchable (its KV may not be written).
  auto b = ledger.Allocate(2, static_cast<int32_t>(prompt.size()), hashes);
  EXPECT_EQ(b->num_cached_tokens, 0);
  EXPECT_THAT(b->blocks, ElementsAre(4, 5, 6, 7));
  EXPECT_EQ(ledger.Lookup(hashes), 0);

  ASSERT_THAT(ledger.Commit(1, 2 * bs()), IsOk());  // two blocks written
  EXPECT_EQ(ledger.Lookup(hashes), 2);
  auto c = ledger.Allocate(3, static_cast<int32_t>(prompt.size()), hashes);
  EXPECT_EQ(c->num_cached_tokens, 2 * bs());
  EXPECT_THAT(c->blocks, ElementsAre(0, 1, 8, 9));
  EXPECT_EQ(ledger.RefCount(0), 2);
  EXPECT_EQ(ledger.RefCount(8), 1);
  EXPECT_EQ(*ledger.NumCommittedTokens(3), 2 * bs());
  const LedgerStats stats = ledger.Stats();
  EXPECT_EQ(stats.prefix_query_tokens, 3u * prompt.size());
  EXPECT_EQ(stats.prefix_hit_tokens, 2u * bs());
  EXPECT_INVARIANTS(ledger);
}

TEST_P(LedgerScenarioTest, HitNeverCoversTheLastPromptToken) {
  BlockLedger ledger = MakeLedger(8, bs());
  const auto prompt = Iota(2 * bs());
  const auto hashes = HashesOf(prompt, bs());
  ASSERT_THAT(ledger.Allocate(1, 2 * bs(), hashes), IsOk());
  ASSERT_THAT(ledger.Commit(1, 2 * bs()), IsOk());
  ASSERT_THAT(ledger.Free(1), IsOk());
  EXPECT_EQ(ledger.Stats().cached_blocks, 2);
  // Same prompt again: block 1 holds the last token, which must be computed for logits.
  auto b = ledger.Allocate(2, 2 * bs(), hashes);
  EXPECT_EQ(b->num_cached_tokens, bs());
  EXPECT_THAT(b->blocks, ElementsAre(0, 2));
  EXPECT_INVARIANTS(ledger);
}

TEST_P(LedgerScenarioTest, FreeKeepsCommittedFullBlocksCachedAndFreesTheRest) {
  BlockLedger ledger = MakeLedger(8, bs());
  const auto prompt = Iota(2 * bs() + 2);
  auto a = ledger.Allocate(1, static_cast<int32_t>(prompt.size()), HashesOf(prompt, bs()));
  ASSERT_THAT(ledger.Commit(1, bs() + 1), IsOk());  // only block 0 fully written
  ASSERT_THAT(ledger.Free(1), IsOk());
  EXPECT_EQ(ledger.StateOf(0), BlockState::kCached);
  EXPECT_EQ(ledger.StateOf(1), BlockState::kFree);
  EXPECT_EQ(ledger.StateOf(2), BlockState::kFree);
  EXPECT_INVARIANTS(ledger);
}

// The LRU's entry stamps are 32-bit and wrap; eviction order and the invariants must not
// notice (the invariants compared stamps unsigned, which a wrap would have broken).
TEST_P(LedgerScenarioTest, LruStampsWrappingKeepTheEvictionOrder) {
  BlockLedger ledger = MakeLedger(8, bs());
  ledger.SetLruClockForTest(UINT32_MAX - 2);
  // Three cached blocks released one after another, the clock wrapping between them.
  for (SeqId seq = 1; seq <= 3; ++seq) {
    const auto prompt = Iota(bs() + 1, static_cast<int32_t>(100 * seq));
    ASSERT_THAT(ledger.Allocate(seq, bs() + 1, HashesOf(prompt, bs())), IsOk());
    ASSERT_THAT(ledger.Commit(seq, bs() + 1), IsOk());
  }
  const std::vector<BlockId> order = {0, 2, 4};  // each sequence's full block, oldest first
  for (SeqId seq = 1; seq <= 3; ++seq) ASSERT_THAT(ledger.Free(seq), IsOk());
  EXPECT_EQ(ledger.EvictionOrderForTest(), order);
  EXPECT_INVARIANTS(ledger);
  // The pool's free blocks go first, then the cached ones in that order.
  ASSERT_THAT(ledger.Allocate(9, 8 * bs()), IsOk());
  EXPECT_EQ(ledger.EvictionOrderForTest(), std::vector<BlockId>{});
  EXPECT_INVARIANTS(ledger);
}

TEST_P(LedgerScenarioTest, RenameKeepsBlocksAndFreesTheOldId) {
  BlockLedger ledger = MakeLedger(8, bs());
  const auto prompt = Iota(2 * bs() + 2);
  ASSERT_THAT(ledger.Allocate(1, static_cast<int32_t>(prompt.size()), HashesOf(prompt, bs())),
              IsOk());
  ASSERT_THAT(ledger.Commit(1, bs() + 1), IsOk());
  ASSERT_THAT(ledger.Allocate(2, 1), IsOk());
  EXPECT_EQ(ledger.Rename(1, 2).code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(ledger.Rename(9, 10).code(), absl::StatusCode::kNotFound);
  ASSERT_THAT(ledger.Rename(1, 100), IsOk());
  EXPECT_INVARIANTS(ledger);
  EXPECT_THAT(*ledger.BlockTable(100), ElementsAre(0, 1, 2));
  EXPECT_EQ(ledger.BlockTable(1).status().code(), absl::StatusCode::kNotFound);
  for (BlockId b : {0, 1, 2}) EXPECT_EQ(ledger.StateOf(b), BlockState::kInUse);
  // The old id is free for a new sequence; the renamed one keeps its commit point.
  ASSERT_THAT(ledger.Allocate(1, bs()), IsOk());
  ASSERT_THAT(ledger.Free(100), IsOk());
  EXPECT_EQ(ledger.StateOf(0), BlockState::kCached);
  EXPECT_EQ(ledger.StateOf(1), BlockState::kFree);
  EXPECT_INVARIANTS(ledger);
}

TEST_P(LedgerScenarioTest, AnOwnerStaysWithItsSequenceUntilItIsFreed) {
  BlockLedger ledger = MakeLedger(8, bs());
  ASSERT_THAT(ledger.Allocate(1, bs() + 1), IsOk());
  EXPECT_EQ(ledger.OwnerOf(1), 0u);  // none until set
  EXPECT_EQ(ledger.SetOwner(9, 7).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(ledger.OwnerOf(9), 0u);
  ASSERT_THAT(ledger.SetOwner(1, 7), IsOk());
  ASSERT_THAT(ledger.Commit(1, bs()), IsOk());
  ASSERT_THAT(ledger.Append(1, bs()), IsOk());
  EXPECT_EQ(ledger.OwnerOf(1), 7u);
  // A fork's child starts with none; a rename keeps it.
  ASSERT_THAT(ledger.Fork(1, 2), IsOk());
  EXPECT_EQ(ledger.OwnerOf(2), 0u);
  ASSERT_THAT(ledger.SetOwner(2, 8), IsOk());
  ASSERT_THAT(ledger.Rename(1, 100), IsOk());
  EXPECT_EQ(ledger.OwnerOf(100), 7u);
  EXPECT_EQ(ledger.OwnerOf(1), 0u);
  std::vector<std::pair<SeqId, uint64_t>> seen;
  ledger.ForEachSequence([&](SeqId seq, uint64_t owner) { seen.emplace_back(seq, owner); });
  EXPECT_THAT(seen, UnorderedElementsAre(std::pair<SeqId, uint64_t>{100, 7},
                                         std::pair<SeqId, uint64_t>{2, 8}));
  // Freed, its record is reused by the next sequence, which starts with none again.
  ASSERT_THAT(ledger.Free(100), IsOk());
  EXPECT_EQ(ledger.OwnerOf(100), 0u);
  ASSERT_THAT(ledger.Allocate(3, 1), IsOk());
  EXPECT_EQ(ledger.OwnerOf(3), 0u);
  EXPECT_INVARIANTS(ledger);
}

TEST_P(LedgerScenarioTest, EvictsLeastRecentlyReleasedAndTailBeforeHead) {
  BlockLedger ledger = MakeLedger(6, bs());
  const auto doc_a = Iota(3 * bs(), 0);
  const auto doc_b = Iota(2 * bs(), 1000);
  ASSERT_THAT(ledger.Allocate(1, 3 * bs(), HashesOf(doc_a, bs())), IsOk());  // 0 1 2
  ASSERT_THAT(ledger.Allocate(2, 2 * bs(), HashesOf(doc_b, bs())), IsOk());  // 3 4
  ASSERT_THAT(ledger.Commit(1, 3 * bs()), IsOk());
  ASSERT_THAT(ledger.Commit(2, 2 * bs()), IsOk());
  ASSERT_THAT(ledger.Free(1), IsOk());
  ASSERT_THAT(ledger.Free(2), IsOk());
  EXPECT_THAT(ledger.EvictionOrderForTest(), ElementsAre(2, 1, 0, 4, 3));

  // Three blocks: the one free block first, then two victims from the LRU end.
  auto plan = ledger.CanAllocate(3, 3 * bs());
  ASSERT_THAT(plan, IsOk());
  EXPECT_EQ(plan->blocks_needed, 3);
  EXPECT_EQ(plan->evictions, 2);
  auto c = ledger.Allocate(3, 3 * bs());
  EXPECT_THAT(c->blocks, ElementsAre(5, 2, 1));
  EXPECT_EQ(ledger.Stats().evictions, 2u);
  EXPECT_EQ(ledger.Lookup(HashesOf(doc_a, bs())), 1);  // head of A survived
  EXPECT_EQ(ledger.Lookup(HashesOf(doc_b, bs())), 2);
  EXPECT_INVARIANTS(ledger);
}

TEST_P(LedgerScenarioTest, PrefixHitMovesBlocksToMostRecentlyUsed) {
  BlockLedger ledger = MakeLedger(6, bs());
  const auto doc_a = Iota(2 * bs(), 0);
  const auto doc_b = Iota(2 * bs(), 1000);
  ASSERT_THAT(ledger.Allocate(1, 2 * bs(), HashesOf(doc_a, bs())), IsOk());  // 0 1
  ASSERT_THAT(ledger.Allocate(2, 2 * bs(), HashesOf(doc_b, bs())), IsOk());  // 2 3
  ASSERT_THAT(ledger.Commit(1, 2 * bs()), IsOk());
  ASSERT_THAT(ledger.Commit(2, 2 * bs()), IsOk());
  ASSERT_THAT(ledger.Free(1), IsOk());
  ASSERT_THAT(ledger.Free(2), IsOk());
  EXPECT_THAT(ledger.EvictionOrderForTest(), ElementsAre(1, 0, 3, 2));
  // Reuse A's head (prompt = A's first block + 1 token) and release it again.
  auto prompt = Iota(bs() + 1, 0);
  auto hit = ledger.Allocate(3, bs() + 1, HashesOf(prompt, bs()));
  EXPECT_EQ(hit->num_cached_tokens, bs());
  EXPECT_THAT(hit->blocks, ElementsAre(0, 4));
  ASSERT_THAT(ledger.Free(3), IsOk());
  EXPECT_THAT(ledger.EvictionOrderForTest(), ElementsAre(1, 3, 2, 0));
  EXPECT_INVARIANTS(ledger);
}

TEST_P(LedgerScenarioTest, ForkSharesBlocksAndCopiesPartialBlockOnWrite) {
  BlockLedger ledger = MakeLedger(8, bs());
  ASSERT_THAT(ledger.Allocate(1, bs() + 2), IsOk());  // blocks 0 (full), 1 (2 tokens)
  ASSERT_THAT(ledger.Fork(1, 2), IsOk());
  EXPECT_EQ(ledger.RefCount(0), 2);
  EXPECT_EQ(ledger.RefCount(1), 2);
  EXPECT_INVARIANTS(ledger);

  // The copy would read block 1's KV, which is not written yet: refused, nothing changes.
  auto unwritten = ledger.Append(2, 1);
  EXPECT_TRUE(absl::IsFailedPrecondition(unwritten.status())) << unwritten.status();
  EXPECT_TRUE(absl::IsFailedPrecondition(ledger.CanAppend(2, 1).status()));
  EXPECT_EQ(ledger.RefCount(1), 2);
  EXPECT_EQ(ledger.Stats().cow_copies, 0u);
  EXPECT_INVARIANTS(ledger);
  // Once written (the child shares the parent's commit point only as of the fork, so both
  // commit), the copy goes ahead.
  ASSERT_THAT(ledger.Commit(1, bs() + 2), IsOk());
  ASSERT_THAT(ledger.Commit(2, bs() + 2), IsOk());

  auto plan = ledger.CanAppend(2, 1);
  EXPECT_EQ(plan->copies, 1);
  auto child = ledger.Append(2, 1);
  ASSERT_THAT(child, IsOk());
  EXPECT_THAT(child->copies, ElementsAre(CopyOrder{1, 2}));
  EXPECT_EQ(child->replaced_last, 2);
  EXPECT_TRUE(child->new_blocks.empty());
  EXPECT_THAT(*ledger.BlockTable(2), ElementsAre(0, 2));
  EXPECT_EQ(ledger.RefCount(1), 1);
  EXPECT_EQ(ledger.RefCount(0), 2);

  // The parent now owns block 1 alone: appending writes in place, no copy.
  auto parent = ledger.Append(1, bs());  // crosses into a new block
  EXPECT_TRUE(parent->copies.empty());
  EXPECT_THAT(parent->new_blocks, ElementsAre(3));
  EXPECT_THAT(*ledger.BlockTable(1), ElementsAre(0, 1, 3));
  EXPECT_EQ(ledger.Stats().cow_copies, 1u);
  EXPECT_INVARIANTS(ledger);

  // Freeing the parent leaves the child's shared head intact.
  ASSERT_THAT(ledger.Free(1), IsOk());
  EXPECT_EQ(ledger.RefCount(0), 1);
  EXPECT_EQ(ledger.StateOf(1), BlockState::kFree);
  EXPECT_INVARIANTS(ledger);
}

TEST_P(LedgerScenarioTest, ForkWithFullLastBlockNeedsNoCopy) {
  BlockLedger ledger = MakeLedger(8, bs());
  ASSERT_THAT(ledger.Allocate(1, 2 * bs()), IsOk());
  ASSERT_THAT(ledger.Fork(1, 2), IsOk());
  auto child = ledger.Append(2, 1);
  EXPECT_TRUE(child->copies.empty());
  EXPECT_THAT(child->new_blocks, ElementsAre(2));
  EXPECT_INVARIANTS(ledger);
}

TEST_P(LedgerScenarioTest, AppendCrossesSeveralBoundariesAtOnce) {
  BlockLedger ledger = MakeLedger(8, bs());
  ASSERT_THAT(ledger.Allocate(1, 3), IsOk());
  auto app = ledger.Append(1, 3 * bs());
  ASSERT_THAT(app, IsOk());
  EXPECT_THAT(app->new_blocks, ElementsAre(1, 2, 3));
  EXPECT_EQ(*ledger.NumTokens(1), 3 * bs() + 3);
  auto none = ledger.Append(1, 0);
  EXPECT_TRUE(none->new_blocks.empty());
  EXPECT_INVARIANTS(ledger);
}

TEST_P(LedgerScenarioTest, SlidingWindowReleasesBlocksOutsideTheWindow) {
  const int32_t window = 2 * bs();
  BlockLedger ledger = MakeLedger(16, bs(), window);
  const auto prompt = Iota(5 * bs());
  const auto hashes = HashesOf(prompt, bs());
  ASSERT_THAT(ledger.Allocate(1, 5 * bs(), hashes), IsOk());  // 0..4
  ASSERT_THAT(ledger.Allocate(2, 5 * bs()), IsOk());          // 5..9, no hashes
  // Nothing is released until the commit point leaves the window behind.
  ASSERT_THAT(ledger.Commit(1, 2 * bs()), IsOk());
  EXPECT_THAT(*ledger.BlockTable(1), ElementsAre(0, 1, 2, 3, 4));
  // Committed 5 blocks: the next query (position 5bs) sees (5bs - 2bs, 5bs]; tokens before
  // 3bs + 1 are never read again, so blocks 0..2 (ending at 3bs) go.
  ASSERT_THAT(ledger.Commit(1, 5 * bs()), IsOk());
  ASSERT_THAT(ledger.Commit(2, 5 * bs()), IsOk());
  EXPECT_THAT(*ledger.BlockTable(1), ElementsAre(X, X, X, 3, 4));
  EXPECT_THAT(*ledger.BlockTable(2), ElementsAre(X, X, X, 8, 9));
  // Committed, hashed blocks stay cached; unhashed ones are free.
  for (BlockId b : {0, 1, 2}) EXPECT_EQ(ledger.StateOf(b), BlockState::kCached) << b;
  for (BlockId b : {5, 6, 7}) EXPECT_EQ(ledger.StateOf(b), BlockState::kFree) << b;
  EXPECT_EQ(ledger.Stats().window_released, 6u);
  EXPECT_INVARIANTS(ledger);
  // Decoding on (new blocks come from the lowest free ids, 5 and 6): block 3 goes once the
  // commit point passes 4bs + window - 1.
  ASSERT_THAT(ledger.Append(1, 1), IsOk());
  ASSERT_THAT(ledger.Commit(1, 5 * bs() + 1), IsOk());
  EXPECT_THAT(*ledger.BlockTable(1), ElementsAre(X, X, X, 3, 4, 5));
  ASSERT_THAT(ledger.Append(1, bs()), IsOk());
  ASSERT_THAT(ledger.Commit(1, 6 * bs() + 1), IsOk());
  EXPECT_THAT(*ledger.BlockTable(1), ElementsAre(X, X, X, X, 4, 5, 6));
  // A fork shares only the live blocks; freeing both skips the released entries.
  ASSERT_THAT(ledger.Fork(1, 3), IsOk());
  EXPECT_INVARIANTS(ledger);
  ASSERT_THAT(ledger.Free(1), IsOk());
  ASSERT_THAT(ledger.Free(3), IsOk());
  ASSERT_THAT(ledger.Free(2), IsOk());
  EXPECT_EQ(ledger.Stats().in_use_blocks, 0);
  EXPECT_INVARIANTS(ledger);
}

TEST_P(LedgerScenarioTest, PinnedBlocksAreNeverEvicted) {
  BlockLedger ledger = MakeLedger(4, bs());
  const auto system_prompt = Iota(2 * bs(), 7);
  const auto hashes = HashesOf(system_prompt, bs());
  ASSERT_THAT(ledger.Allocate(1, 2 * bs(), hashes), IsOk());
  ASSERT_THAT(ledger.Commit(1, 2 * bs()), IsOk());
  ASSERT_THAT(ledger.Pin("system", hashes), IsOk());
  // Pinned while in use: still in use until released.
  EXPECT_EQ(ledger.StateOf(0), BlockState::kInUse);
  ASSERT_THAT(ledger.Free(1), IsOk());
  EXPECT_EQ(ledger.StateOf(0), BlockState::kPinned);
  EXPECT_EQ(ledger.StateOf(1), BlockState::kPinned);
  EXPECT_TRUE(ledger.EvictionOrderForTest().empty());
  EXPECT_INVARIANTS(ledger);

  // Only the 2 unpinned blocks can be handed out.
  auto too_big = ledger.Allocate(2, 3 * bs());
  EXPECT_EQ(too_big.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(ledger.EvictAllCached(), 0);
  EXPECT_EQ(ledger.Lookup(hashes), 2);
  // A pinned prefix is still shared by a new sequence.
  auto prompt = system_prompt;
  prompt.push_back(99);
  auto hit = ledger.Allocate(3, static_cast<int32_t>(prompt.size()), HashesOf(prompt, bs()));
  EXPECT_EQ(hit->num_cached_tokens, 2 * bs());
  EXPECT_THAT(hit->blocks, ElementsAre(0, 1, 2));
  ASSERT_THAT(ledger.Free(3), IsOk());
  EXPECT_EQ(ledger.Stats().pinned_blocks, 2);

  ASSERT_THAT(ledger.Unpin("system"), IsOk());
  EXPECT_EQ(ledger.StateOf(0), BlockState::kCached);
  EXPECT_EQ(ledger.Stats().pinned_blocks, 0);
  EXPECT_EQ(ledger.EvictAllCached(), 2);
  EXPECT_EQ(ledger.Lookup(hashes), 0);
  EXPECT_INVARIANTS(ledger);
}

TEST_P(LedgerScenarioTest, PinErrorsChangeNothing) {
  BlockLedger ledger = MakeLedger(4, bs());
  const auto doc = Iota(3 * bs());
  const auto hashes = HashesOf(doc, bs());
  ASSERT_THAT(ledger.Allocate(1, 3 * bs(), hashes), IsOk());
  ASSERT_THAT(ledger.Commit(1, 2 * bs()), IsOk());  // block 2 not committed: not cached
  const auto before = Snapshot(ledger, {1});

  auto missing = ledger.Pin("p", hashes);
  EXPECT_EQ(missing.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.message(), HasSubstr("block 2 of 3"));
  EXPECT_EQ(ledger.Pin("", hashes).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ledger.Pin("p", {}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ledger.Unpin("nope").code(), absl::StatusCode::kNotFound);
  // Limit: num_blocks / 2 = 2 blocks by default.
  ASSERT_THAT(ledger.Pin("p", std::span(hashes).first(2)), IsOk());
  EXPECT_EQ(ledger.Pin("p", std::span(hashes).first(1)).code(), absl::StatusCode::kAlreadyExists);
  ASSERT_THAT(ledger.Pin("q", std::span(hashes).first(1)), IsOk());  // same block: no new one
  ASSERT_THAT(ledger.Unpin("q"), IsOk());
  ASSERT_THAT(ledger.Unpin("p"), IsOk());
  EXPECT_EQ(Snapshot(ledger, {1}), before);
  EXPECT_INVARIANTS(ledger);
}

TEST_P(LedgerScenarioTest, PinLimitIsEnforced) {
  BlockLedger::Options options;
  options.num_blocks = 8;
  options.block_size = bs();
  options.max_pinned_blocks = 1;
  BlockLedger ledger = *BlockLedger::Create(options);
  const auto doc = Iota(2 * bs());
  const auto hashes = HashesOf(doc, bs());
  ASSERT_THAT(ledger.Allocate(1, 2 * bs(), hashes), IsOk());
  ASSERT_THAT(ledger.Commit(1, 2 * bs()), IsOk());
  const auto before = Snapshot(ledger, {1});
  EXPECT_EQ(ledger.Pin("both", hashes).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(Snapshot(ledger, {1}), before);
  EXPECT_THAT(ledger.Pin("head", std::span(hashes).first(1)), IsOk());
}

TEST_P(LedgerScenarioTest, ExhaustionIsAllOrNothing) {
  BlockLedger ledger = MakeLedger(4, bs());
  ASSERT_THAT(ledger.Allocate(1, 2 * bs()), IsOk());
  ASSERT_THAT(ledger.Allocate(3, bs()), IsOk());
  const auto before = Snapshot(ledger, {1, 2, 3});
  auto dry = ledger.CanAllocate(2, 2 * bs());
  EXPECT_EQ(dry.status().code(), absl::StatusCode::kResourceExhausted);
  auto failed = ledger.Allocate(2, 2 * bs());
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(failed.status().message(), HasSubstr("needs 2 new blocks"));
  EXPECT_EQ(ledger.CanAppend(1, 2 * bs()).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(ledger.Append(1, 2 * bs()).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(Snapshot(ledger, {1, 2, 3}), before);
  EXPECT_EQ(ledger.Stats().allocation_failures, 2u);  // dry runs are not counted
  // Exactly the last block still fits.
  EXPECT_THAT(ledger.Allocate(2, bs()), IsOk());
  EXPECT_EQ(ledger.Stats().free_blocks, 0);
  EXPECT_INVARIANTS(ledger);
}

TEST_P(LedgerScenarioTest, CachedBlocksReusedByAnAllocationAreNotEvictedForIt) {
  BlockLedger ledger = MakeLedger(4, bs());
  const auto doc = Iota(2 * bs() + 1);
  const auto hashes = HashesOf(doc, bs());
  ASSERT_THAT(ledger.Allocate(1, 2 * bs() + 1, hashes), IsOk());
  ASSERT_THAT(ledger.Commit(1, 2 * bs() + 1), IsOk());
  ASSERT_THAT(ledger.Free(1), IsOk());            // 0 1 cached, 2 3 free
  ASSERT_THAT(ledger.Allocate(9, bs()), IsOk());  // takes 2
  // The prompt plus one more block hits the 2 cached blocks and needs 2 new ones: 1 is free
  // and the only evictable blocks are the hit itself, so it must fail and change nothing.
  auto longer = doc;
  for (int i = 0; i < bs(); ++i) longer.push_back(500 + i);
  const auto before = Snapshot(ledger, {2, 9});
  auto r = ledger.Allocate(2, static_cast<int32_t>(longer.size()), HashesOf(longer, bs()));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
  EXPECT_EQ(Snapshot(ledger, {2, 9}), before);
  // The original prompt fits: 2 hits + 1 new.
  auto ok = ledger.Allocate(2, static_cast<int32_t>(doc.size()), hashes);
  ASSERT_THAT(ok, IsOk());
  EXPECT_THAT(ok->blocks, ElementsAre(0, 1, 3));
  EXPECT_INVARIANTS(ledger);
}

TEST_P(LedgerScenarioTest, DuplicateContentIsIndexedOnceAndTheCopyFreed) {
  BlockLedger ledger = MakeLedger(8, bs());
  const auto doc = Iota(bs() + 1);
  const auto hashes = HashesOf(doc, bs());
  ASSERT_THAT(ledger.Allocate(1, bs() + 1, hashes), IsOk());  // 0 1
  ASSERT_THAT(ledger.Allocate(2, bs() + 1, hashes), IsOk());  // 2 3 (nothing committed yet)
  ASSERT_THAT(ledger.Commit(1, bs() + 1), IsOk());
  ASSERT_THAT(ledger.Commit(2, bs() + 1), IsOk());
  ASSERT_THAT(ledger.Free(2), IsOk());
  ASSERT_THAT(ledger.Free(1), IsOk());
  EXPECT_EQ(ledger.StateOf(0), BlockState::kCached);
  EXPECT_EQ(ledger.StateOf(2), BlockState::kFree);
  EXPECT_EQ(ledger.Stats().cached_blocks, 1);
  EXPECT_INVARIANTS(ledger);
}

// Regression: the duplicate of an evicted block was never indexed, so content still held in
// the pool could not be found again (a second prefix miss for the same prompt).
TEST_P(LedgerScenarioTest, ADuplicateStillInUseTakesOverWhenTheIndexedBlockIsEvicted) {
  BlockLedger ledger = MakeLedger(4, bs(), /*window=*/0, /*events=*/true);
  const auto doc = Iota(bs() + 1);
  const auto hashes = HashesOf(doc, bs());
  ASSERT_THAT(ledger.Allocate(1, bs() + 1, hashes), IsOk());  // 0 1
  ASSERT_THAT(ledger.Allocate(2, bs() + 1, hashes), IsOk());  // 2 3 (nothing committed yet)
  ASSERT_THAT(ledger.Commit(1, bs() + 1), IsOk());            // 0 indexed
  ASSERT_THAT(ledger.Commit(2, bs() + 1), IsOk());            // 2 a duplicate of 0
  ASSERT_THAT(ledger.Free(1), IsOk());                        // 0 cached, 1 free
  (void)ledger.TakeEvents();
  // Two new blocks: 1 is free, 0 is evicted. Sequence 2's block 2 holds the same content.
  ASSERT_THAT(ledger.Allocate(3, 2 * bs()), IsOk());
  EXPECT_EQ(ledger.StateOf(2), BlockState::kInUse);
  EXPECT_EQ(ledger.Lookup(hashes), 1) << "the duplicate should be matchable now";
  const std::vector<BlockEvent> events = ledger.TakeEvents();
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0].kind, BlockEvent::Kind::kRemoved);
  EXPECT_EQ(events[0].block, 0);
  EXPECT_EQ(events[1].kind, BlockEvent::Kind::kStored);
  EXPECT_EQ(events[1].block, 2);
  EXPECT_EQ(events[1].hash, hashes[0]);
  EXPECT_INVARIANTS(ledger);
  // Released, it is cached like any indexed block, and a new prompt hits it.
  ASSERT_THAT(ledger.Free(2), IsOk());
  EXPECT_EQ(ledger.StateOf(2), BlockState::kCached);
  auto hit = ledger.Allocate(4, bs() + 1, hashes);
  ASSERT_THAT(hit, IsOk());
  EXPECT_EQ(hit->num_cached_tokens, bs());
  EXPECT_EQ(hit->blocks[0], 2);
  EXPECT_INVARIANTS(ledger);
}

TEST_P(LedgerScenarioTest, CommitAddsHashesForGeneratedBlocks) {
  BlockLedger ledger = MakeLedger(8, bs());
  auto tokens = Iota(bs() + 1);
  ASSERT_THAT(ledger.Allocate(1, bs() + 1, HashesOf(tokens, bs())), IsOk());
  // Decode bs - 1 more tokens: block 1 becomes full; its hash arrives with the commit.
  ASSERT_THAT(ledger.Append(1, bs() - 1), IsOk());
  for (int i = 0; i < bs() - 1; ++i) tokens.push_back(900 + i);
  const auto hashes = HashesOf(tokens, bs());
  ASSERT_EQ(hashes.size(), 2u);
  EXPECT_EQ(ledger.Commit(1, 2 * bs(), std::span(hashes).subspan(1, 1)).code(),
            absl::StatusCode::kOk);
  EXPECT_EQ(ledger.Lookup(hashes), 2);
  // A hash for a block that is not full is refused.
  EXPECT_EQ(ledger.Commit(1, 2 * bs(), std::span(hashes).first(1)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_INVARIANTS(ledger);
}

TEST_P(LedgerScenarioTest, ErrorsAreClearAndChangeNothing) {
  BlockLedger ledger = MakeLedger(4, bs());
  ASSERT_THAT(ledger.Allocate(1, bs() + 1), IsOk());
  ASSERT_THAT(ledger.Fork(1, 2), IsOk());
  ASSERT_THAT(ledger.Commit(1, 2), IsOk());
  const std::vector<SeqId> seqs = {1, 2, 3, 4};
  const auto before = Snapshot(ledger, seqs);
  auto expect_unchanged = [&](absl::Status status, absl::StatusCode code, std::string_view text) {
    EXPECT_EQ(status.code(), code) << status;
    EXPECT_THAT(std::string(status.message()), HasSubstr(std::string(text)));
    EXPECT_EQ(Snapshot(ledger, seqs), before);
    EXPECT_INVARIANTS(ledger);
  };
  using C = absl::StatusCode;
  expect_unchanged(ledger.Append(9, 1).status(), C::kNotFound, "unknown sequence 9");
  expect_unchanged(ledger.Commit(9, 1), C::kNotFound, "unknown sequence 9");
  expect_unchanged(ledger.Free(9), C::kNotFound, "unknown sequence 9");
  expect_unchanged(ledger.Fork(9, 3), C::kNotFound, "unknown sequence 9");
  expect_unchanged(ledger.Fork(1, 2), C::kAlreadyExists, "already live");
  expect_unchanged(ledger.Allocate(1, 1).status(), C::kAlreadyExists, "already live");
  expect_unchanged(ledger.Allocate(3, -1).status(), C::kInvalidArgument, "negative");
  expect_unchanged(ledger.Append(1, -1).status(), C::kInvalidArgument, "negative");
  expect_unchanged(ledger.Allocate(3, 4 * bs() + 1).status(), C::kInvalidArgument,
                   "whole pool has 4 blocks");
  expect_unchanged(ledger.Append(1, 3 * bs()).status(), C::kInvalidArgument,
                   "exceed what the whole pool can hold");
  expect_unchanged(ledger.Commit(1, 1), C::kInvalidArgument, "cannot go back");
  expect_unchanged(ledger.Commit(1, bs() + 2), C::kInvalidArgument, "holds only");
  const auto two_blocks = HashesOf(Iota(2 * bs()), bs());
  expect_unchanged(ledger.Allocate(3, bs(), two_blocks).status(), C::kInvalidArgument,
                   "fill only 1 blocks");

  // Free the forked parent, then free it again: the second is NOT_FOUND and the child
  // keeps its blocks.
  ASSERT_THAT(ledger.Free(1), IsOk());
  const auto after_free = Snapshot(ledger, seqs);
  EXPECT_EQ(ledger.Free(1).code(), C::kNotFound);
  EXPECT_EQ(ledger.Append(1, 1).status().code(), C::kNotFound);  // append to freed
  EXPECT_EQ(Snapshot(ledger, seqs), after_free);
  EXPECT_EQ(ledger.RefCount(0), 1);
  EXPECT_THAT(*ledger.BlockTable(2), ElementsAre(0, 1));
  ASSERT_THAT(ledger.Free(2), IsOk());
  EXPECT_EQ(ledger.Stats().free_blocks, 4);
  EXPECT_INVARIANTS(ledger);
}

TEST_P(LedgerScenarioTest, RecordsStoredAndRemovedEvents) {
  BlockLedger ledger = MakeLedger(2, bs(), 0, /*events=*/true);
  const auto doc = Iota(2 * bs());
  const auto hashes = HashesOf(doc, bs());
  ASSERT_THAT(ledger.Allocate(1, 2 * bs(), hashes), IsOk());
  ASSERT_THAT(ledger.Commit(1, 2 * bs()), IsOk());
  auto events = ledger.TakeEvents();
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0].kind, BlockEvent::Kind::kStored);
  EXPECT_EQ(events[0].hash, hashes[0]);
  EXPECT_FALSE(events[0].has_parent);  // the first block's parent is the chain's root
  EXPECT_TRUE(events[1].has_parent);
  EXPECT_EQ(events[1].hash, hashes[1]);
  EXPECT_EQ(events[1].parent_hash, hashes[0]);
  EXPECT_EQ(events[1].block, 1);
  ASSERT_THAT(ledger.Free(1), IsOk());
  EXPECT_TRUE(ledger.TakeEvents().empty());    // cached, not removed
  ASSERT_THAT(ledger.Allocate(2, 1), IsOk());  // evicts the tail block
  events = ledger.TakeEvents();
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].kind, BlockEvent::Kind::kRemoved);
  EXPECT_EQ(events[0].hash, hashes[1]);
}

INSTANTIATE_TEST_SUITE_P(BlockSizes, LedgerScenarioTest, ::testing::Values(4, 16),
                         [](const auto& param_info) {
                           return "bs" + std::to_string(param_info.param);
                         });

TEST(LedgerOptionsTest, RejectsNonsense) {
  BlockLedger::Options options;
  options.num_blocks = 0;
  EXPECT_EQ(BlockLedger::Create(options).status().code(), absl::StatusCode::kInvalidArgument);
  options.num_blocks = 4;
  options.block_size = 0;
  EXPECT_EQ(BlockLedger::Create(options).status().code(), absl::StatusCode::kInvalidArgument);
  options.block_size = 16;
  options.sliding_window_tokens = -1;
  EXPECT_EQ(BlockLedger::Create(options).status().code(), absl::StatusCode::kInvalidArgument);
  options.sliding_window_tokens = 0;
  options.max_pinned_blocks = 5;
  EXPECT_EQ(BlockLedger::Create(options).status().code(), absl::StatusCode::kInvalidArgument);
  options.max_pinned_blocks = 0;
  options.num_blocks = 1 << 28;
  EXPECT_EQ(BlockLedger::Create(options).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(LedgerBlockSizeOneTest, EveryTokenIsABlock) {
  BlockLedger ledger = MakeLedger(8, 1);
  const auto doc = Iota(5);
  const auto hashes = HashesOf(doc, 1);
  ASSERT_THAT(ledger.Allocate(1, 5, hashes), IsOk());
  ASSERT_THAT(ledger.Commit(1, 5), IsOk());
  auto hit = ledger.Allocate(2, 5, hashes);
  EXPECT_EQ(hit->num_cached_tokens, 4);
  EXPECT_THAT(hit->blocks, ElementsAre(0, 1, 2, 3, 5));
  EXPECT_INVARIANTS(ledger);
}

// --- Holds (the tier mover's) --------------------------------------------------------------

// A 4-block pool, block size 4, whose block 0 is cached (indexed for hashes[0]) and the rest
// free, unless `free_seq` is false: then sequence 1 still holds blocks 0 (committed) and 1.
constexpr int32_t kHoldBs = 4;
BlockLedger LedgerWithCommittedBlock0(std::vector<BlockHash>* hashes, bool free_seq = true) {
  BlockLedger ledger = MakeLedger(4, kHoldBs);
  *hashes = HashesOf(Iota(kHoldBs + 1), kHoldBs);
  EXPECT_THAT(ledger.Allocate(1, kHoldBs + 1, *hashes), IsOk());  // 0 1
  EXPECT_THAT(ledger.Commit(1, kHoldBs + 1), IsOk());             // 0 indexed
  if (free_seq) {
    EXPECT_THAT(ledger.Free(1), IsOk());  // 0 cached, 1 free
  }
  EXPECT_INVARIANTS(ledger);
  return ledger;
}

TEST(BlockLedgerHoldTest, AHeldCachedBlockIsNotEvictedUntilUnhold) {
  std::vector<BlockHash> hashes;
  BlockLedger ledger = LedgerWithCommittedBlock0(&hashes);
  ASSERT_EQ(ledger.StateOf(0), BlockState::kCached);

  ASSERT_THAT(ledger.Hold(0), IsOk());
  EXPECT_INVARIANTS(ledger);
  EXPECT_EQ(ledger.StateOf(0), BlockState::kInUse);
  EXPECT_EQ(ledger.RefCount(0), 1);
  EXPECT_EQ(ledger.held_blocks(), 1);
  EXPECT_TRUE(ledger.EvictionOrderForTest().empty());
  EXPECT_EQ(ledger.AvailableBlocks(), 3);
  LedgerStats stats = ledger.Stats();
  EXPECT_EQ(stats.in_use_blocks, 1);
  EXPECT_EQ(stats.cached_blocks, 0);
  EXPECT_EQ(stats.free_blocks, 3);
  EXPECT_EQ(ledger.EvictAllCached(), 0);
  EXPECT_INVARIANTS(ledger);
  EXPECT_EQ(ledger.Lookup(hashes), 1);
  EXPECT_THAT(ledger.IndexedBlocks(), ElementsAre(std::pair<BlockId, BlockHash>(0, hashes[0])));

  // Every other block is not enough for 4 blocks: the held one is not taken.
  const auto before = Snapshot(ledger, {2});
  EXPECT_THAT(ledger.Allocate(2, 4 * kHoldBs), StatusIs(absl::StatusCode::kResourceExhausted));
  EXPECT_EQ(Snapshot(ledger, {2}), before);
  EXPECT_INVARIANTS(ledger);
  auto three = ledger.Allocate(2, 3 * kHoldBs);
  ASSERT_THAT(three, IsOk());
  EXPECT_THAT(three->blocks, ElementsAre(1, 2, 3));
  EXPECT_INVARIANTS(ledger);
  EXPECT_EQ(ledger.Stats().evictions, 0u);
  EXPECT_EQ(ledger.Lookup(hashes), 1);
  ASSERT_THAT(ledger.Free(2), IsOk());
  EXPECT_INVARIANTS(ledger);

  // Unheld, it is cached and evictable again.
  ASSERT_THAT(ledger.Unhold(0), IsOk());
  EXPECT_INVARIANTS(ledger);
  EXPECT_EQ(ledger.held_blocks(), 0);
  EXPECT_EQ(ledger.StateOf(0), BlockState::kCached);
  EXPECT_THAT(ledger.EvictionOrderForTest(), ElementsAre(0));
  stats = ledger.Stats();
  EXPECT_EQ(stats.in_use_blocks, 0);
  EXPECT_EQ(stats.cached_blocks, 1);
  auto four = ledger.Allocate(3, 4 * kHoldBs);
  ASSERT_THAT(four, IsOk());
  EXPECT_THAT(four->blocks, ElementsAre(1, 2, 3, 0));
  EXPECT_EQ(ledger.Stats().evictions, 1u);
  EXPECT_EQ(ledger.Lookup(hashes), 0);
  EXPECT_INVARIANTS(ledger);
}

TEST(BlockLedgerHoldTest, ABlockHeldWhileItsSequenceFreesItIsCachedAtUnhold) {
  std::vector<BlockHash> hashes;
  BlockLedger ledger = LedgerWithCommittedBlock0(&hashes, /*free_seq=*/false);
  ASSERT_EQ(ledger.StateOf(0), BlockState::kInUse);

  ASSERT_THAT(ledger.Hold(0), IsOk());
  EXPECT_INVARIANTS(ledger);
  EXPECT_EQ(ledger.RefCount(0), 2);
  EXPECT_EQ(ledger.Stats().in_use_blocks, 2);

  ASSERT_THAT(ledger.Free(1), IsOk());
  EXPECT_INVARIANTS(ledger);
  EXPECT_EQ(ledger.StateOf(0), BlockState::kInUse);
  EXPECT_EQ(ledger.RefCount(0), 1);
  EXPECT_EQ(ledger.StateOf(1), BlockState::kFree);
  LedgerStats stats = ledger.Stats();
  EXPECT_EQ(stats.in_use_blocks, 1);
  EXPECT_EQ(stats.cached_blocks, 0);
  EXPECT_EQ(stats.free_blocks, 3);
  EXPECT_EQ(stats.live_sequences, 0);
  BlockMap map;
  ledger.FillBlockMap(4, {}, &map);
  EXPECT_EQ(map.count(MapState::kInUse), 1);
  EXPECT_EQ(map.count(MapState::kFree), 3);
  // The cache manager may count it apart (draining) while it is held.
  const std::pair<BlockId, MapState> apart[] = {{0, MapState::kDraining}};
  ledger.FillBlockMap(4, apart, &map);
  EXPECT_EQ(map.count(MapState::kDraining), 1);
  EXPECT_EQ(map.count(MapState::kInUse), 0);

  ASSERT_THAT(ledger.Unhold(0), IsOk());
  EXPECT_INVARIANTS(ledger);
  EXPECT_EQ(ledger.StateOf(0), BlockState::kCached);
  stats = ledger.Stats();
  EXPECT_EQ(stats.in_use_blocks, 0);
  EXPECT_EQ(stats.cached_blocks, 1);
  // A prefix hit on it.
  auto hit = ledger.Allocate(2, kHoldBs + 1, hashes);
  ASSERT_THAT(hit, IsOk());
  EXPECT_EQ(hit->num_cached_tokens, kHoldBs);
  EXPECT_THAT(hit->blocks, ElementsAre(0, 1));
  EXPECT_INVARIANTS(ledger);
}

TEST(BlockLedgerHoldTest, RefusedHoldsAndUnholdsChangeNothing) {
  std::vector<BlockHash> hashes;
  BlockLedger ledger = LedgerWithCommittedBlock0(&hashes, /*free_seq=*/false);
  ASSERT_THAT(ledger.Allocate(2, kHoldBs), IsOk());  // 2, uncommitted
  const auto before = Snapshot(ledger, {1, 2});
  // Free (3), in use but not committed (1, 2): nothing of theirs is in the prefix index.
  EXPECT_THAT(ledger.Hold(3), StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(ledger.Hold(1), StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(ledger.Hold(2), StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(ledger.Hold(-1), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ledger.Hold(4), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ledger.Hold(kNoBlock), StatusIs(absl::StatusCode::kInvalidArgument));
  // Not held (0 is in use by sequence 1, but not held), or out of range.
  EXPECT_THAT(ledger.Unhold(0), StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(ledger.Unhold(3), StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(ledger.Unhold(-1), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ledger.Unhold(4), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_EQ(Snapshot(ledger, {1, 2}), before);
  EXPECT_EQ(ledger.held_blocks(), 0);
  EXPECT_INVARIANTS(ledger);

  // Once evicted, a formerly cached block cannot be held either.
  ASSERT_THAT(ledger.Free(1), IsOk());
  ASSERT_THAT(ledger.Free(2), IsOk());
  EXPECT_EQ(ledger.EvictAllCached(), 1);
  EXPECT_INVARIANTS(ledger);
  const auto evicted = Snapshot(ledger, {});
  EXPECT_THAT(ledger.Hold(0), StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_EQ(Snapshot(ledger, {}), evicted);
  EXPECT_INVARIANTS(ledger);
}

TEST(BlockLedgerHoldTest, TwoHoldsNeedTwoUnholds) {
  std::vector<BlockHash> hashes;
  BlockLedger ledger = LedgerWithCommittedBlock0(&hashes);
  ASSERT_THAT(ledger.Hold(0), IsOk());
  EXPECT_INVARIANTS(ledger);
  ASSERT_THAT(ledger.Hold(0), IsOk());
  EXPECT_INVARIANTS(ledger);
  EXPECT_EQ(ledger.RefCount(0), 2);
  EXPECT_EQ(ledger.held_blocks(), 2);
  EXPECT_EQ(ledger.Stats().in_use_blocks, 1);

  ASSERT_THAT(ledger.Unhold(0), IsOk());
  EXPECT_INVARIANTS(ledger);
  EXPECT_EQ(ledger.StateOf(0), BlockState::kInUse);
  EXPECT_EQ(ledger.held_blocks(), 1);
  EXPECT_EQ(ledger.EvictAllCached(), 0);
  EXPECT_INVARIANTS(ledger);

  ASSERT_THAT(ledger.Unhold(0), IsOk());
  EXPECT_INVARIANTS(ledger);
  EXPECT_EQ(ledger.StateOf(0), BlockState::kCached);
  EXPECT_EQ(ledger.held_blocks(), 0);
  EXPECT_THAT(ledger.Unhold(0), StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_EQ(ledger.StateOf(0), BlockState::kCached);
  EXPECT_INVARIANTS(ledger);
}

TEST(BlockLedgerHoldTest, HoldsPerBlockAreLimited) {
  std::vector<BlockHash> hashes;
  BlockLedger ledger = LedgerWithCommittedBlock0(&hashes);
  for (int i = 0; i < 65535; ++i) ASSERT_THAT(ledger.Hold(0), IsOk()) << i;
  EXPECT_INVARIANTS(ledger);
  const auto before = Snapshot(ledger, {});
  EXPECT_THAT(ledger.Hold(0), StatusIs(absl::StatusCode::kResourceExhausted));
  EXPECT_EQ(Snapshot(ledger, {}), before);
  EXPECT_EQ(ledger.held_blocks(), 65535);
  EXPECT_INVARIANTS(ledger);
  for (int i = 0; i < 65535; ++i) ASSERT_THAT(ledger.Unhold(0), IsOk()) << i;
  EXPECT_EQ(ledger.StateOf(0), BlockState::kCached);
  EXPECT_EQ(ledger.held_blocks(), 0);
  EXPECT_INVARIANTS(ledger);
}

TEST(BlockLedgerHoldTest, AHeldPinnedBlockStaysPinnedAfterUnhold) {
  std::vector<BlockHash> hashes;
  BlockLedger ledger = LedgerWithCommittedBlock0(&hashes);
  const auto head = std::span(hashes).first(1);
  ASSERT_THAT(ledger.Pin("p", head), IsOk());
  EXPECT_INVARIANTS(ledger);
  ASSERT_EQ(ledger.StateOf(0), BlockState::kPinned);

  ASSERT_THAT(ledger.Hold(0), IsOk());
  EXPECT_INVARIANTS(ledger);
  EXPECT_EQ(ledger.StateOf(0), BlockState::kInUse);
  EXPECT_EQ(ledger.Stats().pinned_blocks, 0);
  EXPECT_EQ(ledger.Stats().in_use_blocks, 1);
  ASSERT_THAT(ledger.Unhold(0), IsOk());
  EXPECT_INVARIANTS(ledger);
  EXPECT_EQ(ledger.StateOf(0), BlockState::kPinned);
  EXPECT_EQ(ledger.Stats().pinned_blocks, 1);
  EXPECT_TRUE(ledger.EvictionOrderForTest().empty());

  // Held, then unpinned: still in use; cached at Unhold.
  ASSERT_THAT(ledger.Hold(0), IsOk());
  EXPECT_INVARIANTS(ledger);
  ASSERT_THAT(ledger.Unpin("p"), IsOk());
  EXPECT_INVARIANTS(ledger);
  EXPECT_EQ(ledger.StateOf(0), BlockState::kInUse);
  EXPECT_TRUE(ledger.EvictionOrderForTest().empty());
  ASSERT_THAT(ledger.Unhold(0), IsOk());
  EXPECT_INVARIANTS(ledger);
  EXPECT_EQ(ledger.StateOf(0), BlockState::kCached);
  EXPECT_THAT(ledger.EvictionOrderForTest(), ElementsAre(0));

  // Held, then pinned (Pin while held), then Unhold: pinned; Unpin: cached.
  ASSERT_THAT(ledger.Hold(0), IsOk());
  EXPECT_INVARIANTS(ledger);
  ASSERT_THAT(ledger.Pin("q", head), IsOk());
  EXPECT_INVARIANTS(ledger);
  EXPECT_EQ(ledger.StateOf(0), BlockState::kInUse);
  ASSERT_THAT(ledger.Unhold(0), IsOk());
  EXPECT_INVARIANTS(ledger);
  EXPECT_EQ(ledger.StateOf(0), BlockState::kPinned);
  EXPECT_TRUE(ledger.EvictionOrderForTest().empty());
  ASSERT_THAT(ledger.Unpin("q"), IsOk());
  EXPECT_INVARIANTS(ledger);
  EXPECT_EQ(ledger.StateOf(0), BlockState::kCached);
  EXPECT_THAT(ledger.EvictionOrderForTest(), ElementsAre(0));
}

TEST(BlockLedgerHoldTest, ADuplicateMayBeHeld) {
  // Blocks 0 and 2 hold the same content: 0 is indexed, 2 its duplicate.
  auto make = [](const std::vector<BlockHash>& hashes) {
    BlockLedger ledger = MakeLedger(4, kHoldBs);
    EXPECT_THAT(ledger.Allocate(1, kHoldBs + 1, hashes), IsOk());  // 0 1
    EXPECT_THAT(ledger.Allocate(2, kHoldBs + 1, hashes), IsOk());  // 2 3
    EXPECT_THAT(ledger.Commit(1, kHoldBs + 1), IsOk());
    EXPECT_THAT(ledger.Commit(2, kHoldBs + 1), IsOk());
    EXPECT_INVARIANTS(ledger);
    return ledger;
  };
  const auto hashes = HashesOf(Iota(kHoldBs + 1), kHoldBs);
  {  // Still a duplicate at Unhold: freed.
    BlockLedger ledger = make(hashes);
    ASSERT_THAT(ledger.Hold(2), IsOk());
    EXPECT_INVARIANTS(ledger);
    ASSERT_THAT(ledger.Free(2), IsOk());
    EXPECT_INVARIANTS(ledger);
    EXPECT_EQ(ledger.StateOf(2), BlockState::kInUse);
    ASSERT_THAT(ledger.Unhold(2), IsOk());
    EXPECT_INVARIANTS(ledger);
    EXPECT_EQ(ledger.StateOf(2), BlockState::kFree);
    EXPECT_EQ(ledger.Lookup(hashes), 1);
  }
  {  // The indexed block evicted while the duplicate is held: it takes over, cached at Unhold.
    BlockLedger ledger = make(hashes);
    ASSERT_THAT(ledger.Hold(2), IsOk());
    ASSERT_THAT(ledger.Free(2), IsOk());  // 2 held, 3 free
    ASSERT_THAT(ledger.Free(1), IsOk());  // 0 cached, 1 free
    EXPECT_INVARIANTS(ledger);
    auto taken = ledger.Allocate(3, 3 * kHoldBs);  // 1 3, and 0 evicted
    ASSERT_THAT(taken, IsOk());
    EXPECT_THAT(taken->blocks, ElementsAre(1, 3, 0));
    EXPECT_INVARIANTS(ledger);
    EXPECT_EQ(ledger.Lookup(hashes), 1);
    EXPECT_THAT(ledger.IndexedBlocks(), ElementsAre(std::pair<BlockId, BlockHash>(2, hashes[0])));
    ASSERT_THAT(ledger.Unhold(2), IsOk());
    EXPECT_INVARIANTS(ledger);
    EXPECT_EQ(ledger.StateOf(2), BlockState::kCached);
    ASSERT_THAT(ledger.Free(3), IsOk());
    auto hit = ledger.Allocate(4, kHoldBs + 1, hashes);
    ASSERT_THAT(hit, IsOk());
    EXPECT_EQ(hit->blocks[0], 2);
    EXPECT_EQ(hit->num_cached_tokens, kHoldBs);
    EXPECT_INVARIANTS(ledger);
  }
}

}  // namespace
}  // namespace kvcm
