// The hybrid KV cache's ledger (common/block/grouped_ledger.h) and the per-sequence windows
// of BlockLedger it stands on: tables per group, window releases per group, prefix hits that
// every group serves (a window group's matched from the right), all-or-nothing errors.

#include "common/block/grouped_ledger.h"

#include <map>
#include <random>
#include <set>

#include "gtest/gtest.h"
#include "tests/common/block/ledger_test_util.h"

namespace kvcm {
namespace {

using ::kvcm::testing::HashesOf;
using ::kvcm::testing::Iota;
using ::kvcm::testing::Snapshot;

constexpr int32_t kBlock = 16;

BlockLedger::Options PoolOptions(int32_t num_blocks) {
  BlockLedger::Options options;
  options.num_blocks = num_blocks;
  options.block_size = kBlock;
  return options;
}

GroupedLedger MakeGrouped(int32_t num_blocks, std::vector<int32_t> windows) {
  GroupedLedger::Options options;
  options.pool = PoolOptions(num_blocks);
  options.group_windows = std::move(windows);
  options.hash_algorithm = HashAlgorithm::kSha256;
  absl::StatusOr<GroupedLedger> ledger = GroupedLedger::Create(std::move(options));
  EXPECT_TRUE(ledger.ok()) << ledger.status();
  return *std::move(ledger);
}

std::vector<SeqId> PoolIds(int32_t n) {
  std::vector<SeqId> ids;
  for (int32_t i = 1; i <= n; ++i) ids.push_back(static_cast<SeqId>(i));
  return ids;
}

int32_t Held(const std::vector<BlockId>& table) {
  return static_cast<int32_t>(
      std::count_if(table.begin(), table.end(), [](BlockId b) { return b != kNoBlock; }));
}

// --- BlockLedger: a sequence's own window ------------------------------------------------

TEST(SequenceWindowTest, OnlyTheWindowedSequenceReleases) {
  absl::StatusOr<BlockLedger> ledger = BlockLedger::Create(PoolOptions(32));
  ASSERT_TRUE(ledger.ok());
  AllocateResult result;
  ASSERT_TRUE(ledger->Allocate(1, 96, {}, AllocateOptions{.window_tokens = 32}, &result).ok());
  ASSERT_TRUE(ledger->Allocate(2, 96, {}, &result).ok());
  ASSERT_TRUE(ledger->Commit(1, 96).ok());
  ASSERT_TRUE(ledger->Commit(2, 96).ok());
  // Token 96 reads (96 - 32, 96]: from token 65, so blocks 0..3 (tokens 0..63) are passed.
  EXPECT_EQ(Held(*ledger->BlockTable(1)), 2);
  EXPECT_EQ(Held(*ledger->BlockTable(2)), 6);
  EXPECT_EQ(ledger->Stats().window_released, 4u);
  // A fork keeps its parent's window.
  ASSERT_TRUE(ledger->Append(1, 16).ok());
  ASSERT_TRUE(ledger->Fork(1, 3).ok());
  ASSERT_TRUE(ledger->Commit(3, 112).ok());
  EXPECT_EQ((*ledger->BlockTable(3))[4], kNoBlock);
  EXPECT_TRUE(ledger->CheckInvariants().ok()) << ledger->CheckInvariants();
}

TEST(SequenceWindowTest, ReleasedLeadingBlocksAreNeverHeld) {
  absl::StatusOr<BlockLedger> ledger = BlockLedger::Create(PoolOptions(32));
  ASSERT_TRUE(ledger.ok());
  const std::vector<int32_t> prompt = Iota(100);
  const std::vector<BlockHash> hashes = HashesOf(prompt, kBlock);  // 6 full blocks
  AllocateResult first;
  ASSERT_TRUE(ledger->Allocate(1, 100, hashes, &first).ok());
  ASSERT_TRUE(ledger->Commit(1, 96).ok());
  ASSERT_TRUE(ledger->Free(1).ok());
  // Window 32: at a hit of 6 blocks (token 96) the first query reads from token 65, so
  // blocks 0..3 are behind it. Release 4, share blocks 4 and 5.
  AllocateResult second;
  ASSERT_TRUE(ledger
                  ->Allocate(2, 100, hashes,
                             AllocateOptions{.window_tokens = 32, .released_blocks = 4}, &second)
                  .ok());
  EXPECT_EQ(second.num_cached_tokens, 96);
  ASSERT_EQ(second.blocks.size(), 7u);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(second.blocks[i], kNoBlock) << i;
  EXPECT_EQ(second.blocks[4], first.blocks[4]);
  EXPECT_EQ(second.blocks[5], first.blocks[5]);
  EXPECT_EQ(ledger->RefCount(first.blocks[0]), 0);
  // At most max_hit_blocks are shared.
  AllocateResult third;
  ASSERT_TRUE(ledger->Allocate(3, 100, hashes, AllocateOptions{.max_hit_blocks = 2}, &third).ok());
  EXPECT_EQ(third.num_cached_tokens, 32);
  EXPECT_TRUE(ledger->CheckInvariants().ok()) << ledger->CheckInvariants();
}

TEST(SequenceWindowTest, ReleasedBlocksTheWindowStillNeedsAreRefused) {
  absl::StatusOr<BlockLedger> ledger = BlockLedger::Create(PoolOptions(32));
  ASSERT_TRUE(ledger.ok());
  const std::vector<BlockHash> hashes = HashesOf(Iota(100), kBlock);
  const auto before = Snapshot(*ledger, {1});
  AllocateResult result;
  // Nothing cached: at token 0 the window reads everything before the released blocks.
  const absl::Status needed = ledger->Allocate(
      1, 100, hashes, AllocateOptions{.window_tokens = 32, .released_blocks = 2}, &result);
  EXPECT_EQ(needed.code(), absl::StatusCode::kInvalidArgument) << needed;
  const absl::Status no_window = ledger->Allocate(
      1, 100, hashes, AllocateOptions{.window_tokens = 0, .released_blocks = 1}, &result);
  EXPECT_EQ(no_window.code(), absl::StatusCode::kInvalidArgument) << no_window;
  const absl::Status unhashed =
      ledger->Allocate(1, 100, std::span(hashes).first(1),
                       AllocateOptions{.window_tokens = 32, .released_blocks = 2}, &result);
  EXPECT_EQ(unhashed.code(), absl::StatusCode::kInvalidArgument) << unhashed;
  EXPECT_EQ(Snapshot(*ledger, {1}), before);
}

// --- GroupedLedger ------------------------------------------------------------------------

TEST(GroupBlockHashTest, GroupZeroIsTheHashAndGroupsDiffer) {
  const BlockHash h = HashesOf(Iota(16), kBlock)[0];
  EXPECT_EQ(GroupBlockHash(HashAlgorithm::kSha256, h, 0), h);
  std::set<std::string> seen = {h.ToHex()};
  for (int32_t g = 1; g < 8; ++g) {
    EXPECT_TRUE(seen.insert(GroupBlockHash(HashAlgorithm::kSha256, h, g).ToHex()).second) << g;
  }
}

TEST(GroupedLedgerTest, CreateRefusesNonsense) {
  GroupedLedger::Options options;
  options.pool = PoolOptions(8);
  options.group_windows = {0, -4};
  EXPECT_FALSE(GroupedLedger::Create(options).ok());
  options.group_windows = {0, 32};
  options.pool.sliding_window_tokens = 32;
  EXPECT_FALSE(GroupedLedger::Create(options).ok());
  options.pool.sliding_window_tokens = 0;
  EXPECT_TRUE(GroupedLedger::Create(options).ok());
  // One group: its window is the pool's, so the two must agree.
  options.group_windows = {32};
  options.pool.sliding_window_tokens = 48;
  EXPECT_FALSE(GroupedLedger::Create(options).ok());
  options.pool.sliding_window_tokens = 32;
  EXPECT_TRUE(GroupedLedger::Create(options).ok());
  options.group_windows = {};  // none named: one group of the pool's window
  absl::StatusOr<GroupedLedger> single = GroupedLedger::Create(options);
  ASSERT_TRUE(single.ok()) << single.status();
  EXPECT_EQ(single->group_windows(), std::vector<int32_t>{32});
}

TEST(GroupedLedgerTest, EachGroupHasATableAndOnlyWindowGroupsRelease) {
  GroupedLedger ledger = MakeGrouped(64, {0, 32, 32});
  GroupedTables tables;
  ASSERT_TRUE(ledger.Allocate(7, 100, {}, &tables).ok());
  ASSERT_EQ(tables.groups.size(), 3u);
  for (const auto& table : tables.groups) EXPECT_EQ(table.size(), 7u);
  EXPECT_EQ(ledger.AvailableBlocks(), 64 - 21);
  ASSERT_TRUE(ledger.Commit(7, 96).ok());
  const GroupedTables after = *ledger.BlockTables(7);
  EXPECT_EQ(Held(after.groups[0]), 7);
  EXPECT_EQ(Held(after.groups[1]), 3);  // blocks 4..6
  EXPECT_EQ(Held(after.groups[2]), 3);
  const std::vector<GroupStats> stats = ledger.PerGroupStats();
  EXPECT_EQ(stats[0].window_released, 0u);
  EXPECT_EQ(stats[1].window_released, 4u);
  EXPECT_EQ(stats[2].held_blocks, 3);
  EXPECT_EQ(ledger.AvailableBlocks(), 64 - 13);
  EXPECT_TRUE(ledger.CheckInvariants().ok()) << ledger.CheckInvariants();
}

// HeldBlocksByGroup (the cache manager's kvcm_cache_group_held_blocks) is kept as the tables
// change: each group's count is its live tables' entries that hold a block, shared ones
// once per table, through every op that changes a table.
TEST(GroupedLedgerTest, HeldBlocksByGroupCountsEveryTablesEntriesAsTheyChange) {
  GroupedLedger ledger = MakeGrouped(64, {0, 32, 32});
  using Held = std::vector<int64_t>;
  EXPECT_EQ(ledger.HeldBlocksByGroup(), (Held{0, 0, 0}));
  GroupedTables tables;
  ASSERT_TRUE(ledger.Allocate(7, 100, {}, &tables).ok());
  EXPECT_EQ(ledger.HeldBlocksByGroup(), (Held{7, 7, 7}));
  // 100 - 32 + 1 = 69: blocks 0..3 (tokens 0..63) are behind every future query.
  ASSERT_TRUE(ledger.Commit(7, 100).ok());
  EXPECT_EQ(ledger.HeldBlocksByGroup(), (Held{7, 3, 3}));
  ASSERT_TRUE(ledger.Fork(7, 8).ok());  // shared blocks count once per table
  EXPECT_EQ(ledger.HeldBlocksByGroup(), (Held{14, 6, 6}));
  GroupedAppendResult appended;
  // 120 tokens: the shared last block copied (no new entry) and one block more per group.
  ASSERT_TRUE(ledger.Append(8, 20, &appended).ok());
  EXPECT_EQ(ledger.HeldBlocksByGroup(), (Held{15, 7, 7}));
  ASSERT_TRUE(ledger.Free(7).ok());
  EXPECT_EQ(ledger.HeldBlocksByGroup(), (Held{8, 4, 4}));
  const std::vector<GroupStats> stats = ledger.PerGroupStats();
  EXPECT_EQ(stats[0].held_blocks, 8);
  EXPECT_EQ(stats[1].held_blocks, 4);
  EXPECT_EQ(stats[1].window, 32);
  EXPECT_TRUE(ledger.CheckInvariants().ok()) << ledger.CheckInvariants();
  // A refused op changes no count.
  EXPECT_FALSE(ledger.Allocate(9, 64 * kBlock, {}, &tables).ok());
  EXPECT_EQ(ledger.HeldBlocksByGroup(), (Held{8, 4, 4}));
  ASSERT_TRUE(ledger.Free(8).ok());
  EXPECT_EQ(ledger.HeldBlocksByGroup(), (Held{0, 0, 0}));
  EXPECT_TRUE(ledger.CheckInvariants().ok()) << ledger.CheckInvariants();
}

TEST(GroupedLedgerTest, OneFullGroupBehavesAsTheLedgerItStandsOn) {
  GroupedLedger grouped = MakeGrouped(32, {0});
  absl::StatusOr<BlockLedger> plain = BlockLedger::Create(PoolOptions(32));
  ASSERT_TRUE(plain.ok());
  const std::vector<BlockHash> hashes = HashesOf(Iota(70), kBlock);
  GroupedTables tables;
  AllocateResult result;
  ASSERT_TRUE(grouped.Allocate(1, 70, hashes, &tables).ok());
  ASSERT_TRUE(plain->Allocate(1, 70, hashes, &result).ok());
  EXPECT_EQ(tables.groups[0], result.blocks);
  ASSERT_TRUE(grouped.Commit(1, 64).ok());
  ASSERT_TRUE(plain->Commit(1, 64).ok());
  ASSERT_TRUE(grouped.Free(1).ok());
  ASSERT_TRUE(plain->Free(1).ok());
  ASSERT_TRUE(grouped.Allocate(2, 70, hashes, &tables).ok());
  ASSERT_TRUE(plain->Allocate(2, 70, hashes, &result).ok());
  EXPECT_EQ(tables.groups[0], result.blocks);
  EXPECT_EQ(tables.num_cached_tokens, result.num_cached_tokens);
  EXPECT_EQ(tables.num_cached_tokens, 64);
}

// A prompt of 8 full blocks and a bit, committed and freed by a first sequence.
struct CachedPrompt {
  std::vector<BlockHash> hashes = HashesOf(Iota(140), kBlock);  // 8 full blocks
  GroupedTables first;
};

CachedPrompt CacheOnePrompt(GroupedLedger& ledger) {
  CachedPrompt prompt;
  EXPECT_TRUE(ledger.Allocate(1, 140, prompt.hashes, &prompt.first).ok());
  EXPECT_TRUE(ledger.Commit(1, 139).ok());
  EXPECT_TRUE(ledger.Free(1).ok());
  return prompt;
}

TEST(GroupedLedgerTest, AWindowGroupsHitNeedsOnlyTheBlocksItReads) {
  GroupedLedger ledger = MakeGrouped(64, {0, 32});
  const CachedPrompt prompt = CacheOnePrompt(ledger);
  EXPECT_EQ(ledger.ReusableBlocks(140, prompt.hashes), 8);
  GroupedTables tables;
  ASSERT_TRUE(ledger.Allocate(2, 140, prompt.hashes, &tables).ok());
  EXPECT_EQ(tables.num_cached_tokens, 128);
  // Full group: blocks 0..7 shared. Window group: at token 128 it reads from token 97, so
  // only blocks 6 and 7 are shared, 0..5 never held.
  for (int i = 0; i < 8; ++i) EXPECT_EQ(tables.groups[0][i], prompt.first.groups[0][i]) << i;
  for (int i = 0; i < 6; ++i) EXPECT_EQ(tables.groups[1][i], kNoBlock) << i;
  EXPECT_EQ(tables.groups[1][6], prompt.first.groups[1][6]);
  EXPECT_EQ(tables.groups[1][7], prompt.first.groups[1][7]);
  // The two prompts and one hit, each counted once, not once per group.
  EXPECT_EQ(ledger.Stats().prefix_query_tokens, 280u);
  EXPECT_EQ(ledger.Stats().prefix_hit_tokens, 128u);
  EXPECT_TRUE(ledger.CheckInvariants().ok()) << ledger.CheckInvariants();
}

TEST(GroupedLedgerTest, AWindowGroupsHitSurvivesTheEvictionOfItsOldBlocks) {
  GroupedLedger ledger = MakeGrouped(20, {0, 32});
  const CachedPrompt prompt = CacheOnePrompt(ledger);
  // The commit at 139 released the window group's blocks 0..5 (it reads from token 108), so
  // they lead the eviction order; then the free released the full group's 7..0 and the
  // window group's 7, 6. 16 cached, 4 free: a filler of 10 blocks evicts w0..w5.
  GroupedTables filler;
  ASSERT_TRUE(ledger.Allocate(99, 80, {}, &filler).ok());
  ASSERT_TRUE(ledger.Free(99).ok());
  EXPECT_EQ(ledger.pool().IndexedBlock(GroupBlockHash(HashAlgorithm::kSha256, prompt.hashes[0], 1)),
            kNoBlock);
  // Matched from the left, the window group would serve nothing; from the right it serves
  // 8 blocks (it needs only 6 and 7), and so does the full group.
  EXPECT_EQ(ledger.ReusableBlocks(140, prompt.hashes), 8);
  GroupedTables tables;
  ASSERT_TRUE(ledger.Allocate(2, 140, prompt.hashes, &tables).ok());
  EXPECT_EQ(tables.num_cached_tokens, 128);
  EXPECT_TRUE(ledger.CheckInvariants().ok()) << ledger.CheckInvariants();
}

// One group under a window (every layer windowed, Mistral 7B v0.1's shape): the pool's own
// sequences, but its hits matched from the right as a window group's, so that a prompt whose
// oldest blocks were evicted still finds the blocks of its last window.
TEST(GroupedLedgerTest, OneWindowGroupsHitSurvivesTheEvictionOfItsOldBlocks) {
  GroupedLedger::Options one;
  one.pool = PoolOptions(20);
  one.pool.sliding_window_tokens = 32;  // no group windows: one group of the pool's window
  one.hash_algorithm = HashAlgorithm::kSha256;
  absl::StatusOr<GroupedLedger> created = GroupedLedger::Create(one);
  ASSERT_TRUE(created.ok()) << created.status();
  GroupedLedger& ledger = *created;
  const CachedPrompt prompt = CacheOnePrompt(ledger);
  // The commit at 139 released blocks 0..5 (it reads from token 108): they lead the eviction
  // order, then 6 and 7 from the free. 8 cached, 12 free: a filler of 18 blocks evicts 0..5.
  GroupedTables filler;
  ASSERT_TRUE(ledger.Allocate(99, 288, {}, &filler).ok());
  ASSERT_TRUE(ledger.Free(99).ok());
  EXPECT_EQ(ledger.pool().Lookup(prompt.hashes), 0);  // from the left: nothing
  // From the right: at token 128 the first computed query reads from token 97, blocks 6, 7.
  EXPECT_EQ(ledger.Lookup(prompt.hashes), 8);
  EXPECT_EQ(ledger.ReusableBlocks(140, prompt.hashes), 8);
  const absl::StatusOr<AdmissionPlan> plan = ledger.CanAllocate(2, 140, prompt.hashes);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->prefix_hit_blocks, 8);
  EXPECT_EQ(plan->blocks_needed, 1);  // the block of the prompt's last tokens
  GroupedTables tables;
  ASSERT_TRUE(ledger.Allocate(2, 140, prompt.hashes, &tables).ok());
  EXPECT_EQ(tables.num_cached_tokens, 128);
  ASSERT_EQ(tables.groups.size(), 1u);
  ASSERT_EQ(tables.groups[0].size(), 9u);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(tables.groups[0][i], kNoBlock) << i;
  EXPECT_EQ(tables.groups[0][6], prompt.first.groups[0][6]);
  EXPECT_EQ(tables.groups[0][7], prompt.first.groups[0][7]);
  EXPECT_TRUE(ledger.pool().IsLive(2));  // the caller's id, in the pool itself
  EXPECT_EQ(ledger.Stats().prefix_hit_tokens, 128u);
  // Decoding on releases as before; the second Allocate form finds the same hit.
  ASSERT_TRUE(ledger.Commit(2, 140).ok());
  AppendResult appended;
  std::vector<BlockId> group_blocks;
  ASSERT_TRUE(ledger.Append(2, 20, &appended, &group_blocks).ok());
  ASSERT_TRUE(ledger.Commit(2, 160).ok());
  EXPECT_EQ((*ledger.BlockTable(2))[6], kNoBlock);  // 160 - 32 + 1 = 129: blocks 0..7 passed
  AllocateResult again;
  ASSERT_TRUE(ledger.Allocate(3, 140, prompt.hashes, &again, &group_blocks).ok());
  EXPECT_EQ(again.num_cached_tokens, 128);
  EXPECT_TRUE(group_blocks.empty());
  ASSERT_TRUE(ledger.Free(2).ok());
  ASSERT_TRUE(ledger.Free(3).ok());
  EXPECT_TRUE(ledger.CheckInvariants().ok()) << ledger.CheckInvariants();
}

TEST(GroupedLedgerTest, AWindowGroupWithoutItsLastBlocksBoundsTheHit) {
  // The window group first: its blocks reach the eviction order before the full group's.
  GroupedLedger ledger = MakeGrouped(20, {32, 0});
  const CachedPrompt prompt = CacheOnePrompt(ledger);
  // Eviction order: w0..w5 (the commit), w7, w6 (the free, group 0 first), f7..f0. A filler
  // of 12 blocks takes the 4 free and evicts every window block.
  GroupedTables filler;
  ASSERT_TRUE(ledger.Allocate(99, 96, {}, &filler).ok());
  ASSERT_TRUE(ledger.Free(99).ok());
  std::vector<BlockHash> full_group;
  for (const BlockHash& h : prompt.hashes) {
    full_group.push_back(GroupBlockHash(HashAlgorithm::kSha256, h, 1));
  }
  EXPECT_EQ(ledger.pool().Lookup(full_group), 8);  // the full group keeps all 8
  EXPECT_EQ(ledger.pool().Lookup(prompt.hashes), 0);
  // Every hit of k >= 1 blocks needs some window block: none is left.
  EXPECT_EQ(ledger.ReusableBlocks(140, prompt.hashes), 0);
  GroupedTables tables;
  ASSERT_TRUE(ledger.Allocate(2, 140, prompt.hashes, &tables).ok());
  EXPECT_EQ(tables.num_cached_tokens, 0);
  EXPECT_TRUE(ledger.CheckInvariants().ok()) << ledger.CheckInvariants();
}

TEST(GroupedLedgerTest, TheHitStopsWhereThePromptsDiffer) {
  GroupedLedger ledger = MakeGrouped(64, {0, 32});
  const CachedPrompt prompt = CacheOnePrompt(ledger);
  // A prompt that shares 5 blocks of the first: at a hit of 5 the window group reads blocks
  // 3 and 4 (from token 49), cached since the first's commit.
  std::vector<int32_t> other = Iota(140);
  other[5 * kBlock + 3] = 9999;
  EXPECT_EQ(ledger.ReusableBlocks(140, HashesOf(other, kBlock)), 5);
  EXPECT_EQ(ledger.ReusableBlocks(49, prompt.hashes), 3);
  EXPECT_EQ(ledger.ReusableBlocks(48, prompt.hashes), 2);  // the last token is computed
}

TEST(GroupedLedgerTest, FailedAllocateAndAppendChangeNothing) {
  GroupedLedger ledger = MakeGrouped(32, {0, 32, 64});
  const CachedPrompt prompt = CacheOnePrompt(ledger);
  const auto before = Snapshot(ledger.pool(), PoolIds(40));
  GroupedTables tables;
  // 3 groups x 9 blocks, 8 cached per group reusable at most: more than the pool.
  const absl::Status too_big = ledger.Allocate(2, 300, prompt.hashes, &tables);
  EXPECT_EQ(too_big.code(), absl::StatusCode::kResourceExhausted) << too_big;
  EXPECT_EQ(Snapshot(ledger.pool(), PoolIds(40)), before);
  EXPECT_FALSE(ledger.IsLive(2));

  ASSERT_TRUE(ledger.Allocate(3, 40, {}, &tables).ok());  // 3 blocks x 3 groups
  const auto grown = Snapshot(ledger.pool(), PoolIds(40));
  GroupedAppendResult appended;
  const absl::Status no_room = ledger.Append(3, 200, &appended);
  EXPECT_EQ(no_room.code(), absl::StatusCode::kResourceExhausted) << no_room;
  EXPECT_EQ(Snapshot(ledger.pool(), PoolIds(40)), grown);
  const absl::Status unknown = ledger.Append(42, 1, &appended);
  EXPECT_EQ(unknown.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(ledger.Commit(3, 41).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Snapshot(ledger.pool(), PoolIds(40)), grown);
  EXPECT_EQ(ledger.Stats().allocation_failures, 2u);  // the Allocate and the Append
  EXPECT_EQ(ledger.Free(42).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(ledger.Fork(3, 3).code(), absl::StatusCode::kAlreadyExists);
  EXPECT_TRUE(ledger.CheckInvariants().ok()) << ledger.CheckInvariants();
}

TEST(GroupedLedgerTest, ForkCopiesTheSharedLastBlockInEveryGroup) {
  GroupedLedger ledger = MakeGrouped(64, {0, 32});
  GroupedTables tables;
  ASSERT_TRUE(ledger.Allocate(1, 40, {}, &tables).ok());
  ASSERT_TRUE(ledger.Commit(1, 40).ok());
  ASSERT_TRUE(ledger.Fork(1, 2).ok());
  GroupedAppendResult appended;
  ASSERT_TRUE(ledger.Append(2, 1, &appended).ok());
  ASSERT_EQ(appended.groups.size(), 2u);
  for (const AppendResult& group : appended.groups) EXPECT_EQ(group.copies.size(), 1u);
  EXPECT_TRUE(ledger.CheckInvariants().ok()) << ledger.CheckInvariants();
  ASSERT_TRUE(ledger.Free(1).ok());
  ASSERT_TRUE(ledger.Free(2).ok());
  EXPECT_EQ(ledger.pool().Stats().in_use_blocks, 0);
}

// --- The rest of BlockLedger's API --------------------------------------------------------

TEST(GroupedLedgerTest, StepReplyAllocateAndAppendCarryEveryGroup) {
  GroupedLedger ledger = MakeGrouped(64, {0, 32, 32});
  AllocateResult allocated;
  std::vector<BlockId> group_blocks = {123};  // cleared by the call
  ASSERT_TRUE(ledger.Allocate(7, 40, {}, &allocated, &group_blocks).ok());
  const GroupedTables tables = *ledger.BlockTables(7);
  EXPECT_EQ(allocated.blocks, tables.groups[0]);
  std::vector<BlockId> rest = tables.groups[1];
  rest.insert(rest.end(), tables.groups[2].begin(), tables.groups[2].end());
  EXPECT_EQ(group_blocks, rest);  // groups 1.. one after another, each as long as group 0's
  ASSERT_TRUE(ledger.Commit(7, 40).ok());
  ASSERT_TRUE(ledger.Fork(7, 8).ok());
  AppendResult appended;
  ASSERT_TRUE(ledger.Append(8, 17, &appended, &group_blocks).ok());
  // The shared partial block copied in every group, then one more block each.
  EXPECT_EQ(appended.copies.size(), 3u);
  EXPECT_EQ(appended.new_blocks.size(), 1u);
  EXPECT_EQ(group_blocks.size(), 2u);
  const GroupedTables forked = *ledger.BlockTables(8);
  EXPECT_EQ(group_blocks[0], forked.groups[1].back());
  EXPECT_EQ(group_blocks[1], forked.groups[2].back());
  EXPECT_TRUE(ledger.CheckInvariants().ok()) << ledger.CheckInvariants();
}

TEST(GroupedLedgerTest, RenameMovesEveryGroupsTables) {
  GroupedLedger ledger = MakeGrouped(64, {0, 32});
  GroupedTables tables;
  ASSERT_TRUE(ledger.Allocate(1, 40, {}, &tables).ok());
  ASSERT_TRUE(ledger.Allocate(2, 20, {}, &tables).ok());
  const GroupedTables before = *ledger.BlockTables(1);
  EXPECT_EQ(ledger.Rename(1, 2).code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(ledger.Rename(5, 6).code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(ledger.Rename(1, 9).ok());
  EXPECT_FALSE(ledger.IsLive(1));
  EXPECT_TRUE(ledger.IsLive(9));
  EXPECT_EQ(ledger.BlockTables(9)->groups, before.groups);
  EXPECT_EQ(*ledger.NumTokens(9), 40);
  ASSERT_TRUE(ledger.Free(9).ok());
  EXPECT_EQ(ledger.Stats().live_sequences, 1);
  EXPECT_TRUE(ledger.CheckInvariants().ok()) << ledger.CheckInvariants();
}

TEST(GroupedLedgerTest, OwnersNameTheCallersSequences) {
  GroupedLedger ledger = MakeGrouped(64, {0, 32});
  GroupedTables tables;
  ASSERT_TRUE(ledger.Allocate(10, 40, {}, &tables).ok());
  ASSERT_TRUE(ledger.Allocate(20, 40, {}, &tables).ok());
  ASSERT_TRUE(ledger.SetOwner(10, 5).ok());
  ASSERT_TRUE(ledger.SetOwner(20, 6).ok());
  EXPECT_EQ(ledger.SetOwner(30, 6).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(ledger.OwnerOf(10), 5u);
  EXPECT_EQ(ledger.OwnerOf(30), 0u);
  ASSERT_TRUE(ledger.Fork(10, 11).ok());
  ASSERT_TRUE(ledger.SetOwner(11, 5).ok());
  std::map<SeqId, uint64_t> seen;
  ledger.ForEachSequence([&](SeqId seq, uint64_t owner) { seen[seq] = owner; });
  EXPECT_EQ(seen, (std::map<SeqId, uint64_t>{{10, 5}, {11, 5}, {20, 6}}));
  EXPECT_EQ(ledger.Stats().live_sequences, 3);
  EXPECT_EQ(ledger.pool().Stats().live_sequences, 6);  // one pool sequence per group
}

TEST(GroupedLedgerTest, PinsHoldEveryGroupsBlocks) {
  GroupedLedger ledger = MakeGrouped(64, {0, 32});
  const std::vector<BlockHash> hashes = HashesOf(Iota(64), kBlock);  // 4 full blocks
  GroupedTables tables;
  ASSERT_TRUE(ledger.Allocate(1, 64, hashes, &tables).ok());
  // Committed up to 48 only: the window group still holds every block (it reads from 17).
  ASSERT_TRUE(ledger.Commit(1, 48).ok());
  ASSERT_TRUE(ledger.Free(1).ok());
  const std::span<const BlockHash> three = std::span(hashes).first(3);
  ASSERT_TRUE(ledger.Pin("doc", three).ok());
  EXPECT_EQ(ledger.Stats().pinned_blocks, 6);  // 3 blocks x 2 groups
  EXPECT_EQ(ledger.Pin("doc", three).code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(ledger.Pin("more", hashes).code(), absl::StatusCode::kNotFound);  // block 3
  ASSERT_TRUE(ledger.Unpin("doc").ok());
  EXPECT_EQ(ledger.Stats().pinned_blocks, 0);
  EXPECT_EQ(ledger.Unpin("doc").code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(ledger.CheckInvariants().ok()) << ledger.CheckInvariants();
}

TEST(GroupedLedgerTest, LookupIsTheCommonHitWithoutTheLastTokenRule) {
  GroupedLedger ledger = MakeGrouped(64, {0, 32});
  const CachedPrompt prompt = CacheOnePrompt(ledger);
  // The commit at 139 indexed blocks 0..7 in both groups, then released the window group's
  // 0..5 (still cached). Every prefix is a hit; Allocate's would stop short of the last
  // token, Lookup does not.
  EXPECT_EQ(ledger.Lookup(prompt.hashes), 8);
  EXPECT_EQ(ledger.Lookup(std::span(prompt.hashes).first(4)), 4);
  EXPECT_EQ(ledger.ReusableBlocks(64, prompt.hashes), 3);
  std::vector<int32_t> other = Iota(140);
  other[2 * kBlock] = 9999;
  EXPECT_EQ(ledger.Lookup(HashesOf(other, kBlock)), 2);
  EXPECT_EQ(ledger.Lookup({}), 0);
}

// One group: every call is the pool's own, with the caller's ids, so a GroupedLedger of one
// group and a BlockLedger given the same calls agree on every answer and every block.
TEST(GroupedLedgerTest, OneGroupIsABlockLedgerCallForCall) {
  for (const int32_t window : {0, 32}) {
    SCOPED_TRACE(window);
    BlockLedger::Options options = PoolOptions(32);
    options.sliding_window_tokens = window;
    GroupedLedger::Options one;
    one.pool = options;  // no group windows: one group of the pool's window
    absl::StatusOr<GroupedLedger> grouped = GroupedLedger::Create(one);
    absl::StatusOr<BlockLedger> plain = BlockLedger::Create(options);
    ASSERT_TRUE(grouped.ok() && plain.ok());
    const std::vector<BlockHash> hashes = HashesOf(Iota(100), kBlock);
    AllocateResult a, b;
    std::vector<BlockId> group_blocks;
    ASSERT_TRUE(grouped->Allocate(1, 100, hashes, &a, &group_blocks).ok());
    ASSERT_TRUE(plain->Allocate(1, 100, hashes, &b).ok());
    EXPECT_EQ(a.blocks, b.blocks);
    EXPECT_TRUE(group_blocks.empty());
    ASSERT_TRUE(grouped->Commit(1, 100).ok());
    ASSERT_TRUE(plain->Commit(1, 100).ok());
    EXPECT_EQ(*grouped->BlockTable(1), *plain->BlockTable(1));  // the window's releases too
    ASSERT_TRUE(grouped->Rename(1, 7).ok());
    ASSERT_TRUE(plain->Rename(1, 7).ok());
    ASSERT_TRUE(grouped->SetOwner(7, 3).ok());
    ASSERT_TRUE(plain->SetOwner(7, 3).ok());
    EXPECT_EQ(grouped->OwnerOf(7), plain->OwnerOf(7));
    EXPECT_TRUE(grouped->pool().IsLive(7));  // the caller's id, in the pool itself
    ASSERT_TRUE(grouped->Fork(7, 8).ok());
    ASSERT_TRUE(plain->Fork(7, 8).ok());
    AppendResult x, y;
    ASSERT_TRUE(grouped->Append(8, 20, &x, &group_blocks).ok());
    ASSERT_TRUE(plain->Append(8, 20, &y).ok());
    EXPECT_EQ(x.new_blocks, y.new_blocks);
    EXPECT_EQ(x.copies, y.copies);
    EXPECT_EQ(grouped->Lookup(hashes), plain->Lookup(hashes));
    EXPECT_EQ(grouped->ReusableBlocks(100, hashes), plain->ReusableBlocks(100, hashes));
    EXPECT_EQ(grouped->Pin("p", std::span(hashes).last(2)).code(),
              plain->Pin("p", std::span(hashes).last(2)).code());
    EXPECT_EQ(grouped->Stats().pinned_blocks, plain->Stats().pinned_blocks);
    const absl::StatusOr<AdmissionPlan> p = grouped->CanAllocate(9, 100, hashes);
    const absl::StatusOr<AdmissionPlan> q = plain->CanAllocate(9, 100, hashes);
    ASSERT_TRUE(p.ok() && q.ok());
    EXPECT_EQ(p->blocks_needed, q->blocks_needed);
    EXPECT_EQ(p->prefix_hit_blocks, q->prefix_hit_blocks);
    ASSERT_TRUE(grouped->Free(7).ok());
    ASSERT_TRUE(plain->Free(7).ok());
    EXPECT_EQ(Snapshot(grouped->pool(), {7, 8}), Snapshot(*plain, {7, 8}));
    EXPECT_EQ(grouped->Stats().live_sequences, plain->Stats().live_sequences);
    EXPECT_EQ(grouped->PerGroupStats()[0].window_released, plain->Stats().window_released);
    EXPECT_EQ(grouped->HeldBlocksByGroup(), std::vector<int64_t>{plain->table_entries()});
    EXPECT_EQ(plain->table_entries(), Held(*plain->BlockTable(8)));  // the one left
    EXPECT_TRUE(grouped->CheckInvariants().ok()) << grouped->CheckInvariants();
  }
}

// Random ops on three groups: after each one the invariants hold, and a refused op leaves
// the pool exactly as it was.
TEST(GroupedLedgerPropertyTest, RandomOpsKeepTheLedgerWhole) {
  const uint32_t seed = 20261207;
  std::printf("seed %u\n", seed);
  std::mt19937 rng(seed);
  GroupedLedger ledger = MakeGrouped(96, {0, 32, 48});
  // A few shared prompts, so that prefix hits happen.
  std::vector<std::vector<int32_t>> prompts;
  for (int p = 0; p < 4; ++p) prompts.push_back(Iota(200, p * 1000));
  struct Live {
    int32_t prompt = 0;
    int32_t tokens = 0;
    int32_t committed = 0;
    int32_t hashed = 0;
  };
  std::map<SeqId, Live> live;
  SeqId next = 1;
  int refused = 0, hits = 0;
  for (int step = 0; step < 3000; ++step) {
    const auto before = Snapshot(ledger.pool(), {});
    absl::Status status;
    const int op = static_cast<int>(rng() % 5);
    if (op == 0 || live.empty()) {
      const int32_t p = static_cast<int32_t>(rng() % prompts.size());
      const int32_t n = 1 + static_cast<int32_t>(rng() % 200);
      const std::vector<int32_t> tokens(prompts[p].begin(), prompts[p].begin() + n);
      const std::vector<BlockHash> hashes = HashesOf(tokens, kBlock);
      GroupedTables tables;
      status = ledger.Allocate(next, n, hashes, &tables);
      if (status.ok()) {
        hits += tables.num_cached_tokens > 0;
        live[next] = {p, n, tables.num_cached_tokens, static_cast<int32_t>(hashes.size())};
      }
      ++next;
    } else {
      auto it = live.begin();
      std::advance(it, rng() % live.size());
      Live& s = it->second;
      if (op == 1) {
        GroupedAppendResult appended;
        const int32_t n = 1 + static_cast<int32_t>(rng() % 20);
        if (s.tokens + n > 200) continue;
        status = ledger.Append(it->first, n, &appended);
        if (status.ok()) s.tokens += n;
      } else if (op == 2 || op == 3) {
        const std::vector<int32_t> tokens(prompts[s.prompt].begin(),
                                          prompts[s.prompt].begin() + s.tokens);
        const std::vector<BlockHash> all = HashesOf(tokens, kBlock);
        const std::span<const BlockHash> more = std::span(all).subspan(s.hashed);
        status = ledger.Commit(it->first, s.tokens, more);
        ASSERT_TRUE(status.ok()) << status;
        s.committed = s.tokens;
        s.hashed = static_cast<int32_t>(all.size());
      } else {
        status = ledger.Free(it->first);
        ASSERT_TRUE(status.ok()) << status;
        live.erase(it);
      }
    }
    if (!status.ok()) {
      ++refused;
      ASSERT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << status;
      ASSERT_EQ(Snapshot(ledger.pool(), {}), before) << "step " << step;
    }
    ASSERT_TRUE(ledger.CheckInvariants().ok())
        << "step " << step << ": " << ledger.CheckInvariants();
  }
  std::printf("refused %d, allocations with a hit %d\n", refused, hits);
  EXPECT_GT(refused, 0);
  EXPECT_GT(hits, 0);
}

}  // namespace
}  // namespace kvcm
