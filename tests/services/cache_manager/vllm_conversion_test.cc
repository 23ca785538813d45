// VllmConverter (services/cache_manager/vllm_conversion.h) alone: ledger events and commit
// tokens in, vLLM-format events out (docs/protocol.md, "vLLM-format KV events").

#include "services/cache_manager/vllm_conversion.h"

#include <cstdint>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/base/check.h"
#include "common/block/grouped_ledger.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/status_matchers.h"

namespace kvcm::cache_manager {
namespace {

constexpr int32_t kBlockSize = 4;

// A hash whose first byte is `tag` (so its default-algorithm id is tag << 56) and whose last
// byte is `low` (its kVllmSha256Cbor id).
BlockHash Hash(uint8_t tag, uint8_t low = 0) {
  BlockHash hash;
  hash.bytes[0] = tag;
  hash.bytes[31] = low;
  return hash;
}
uint64_t Id(uint8_t tag) { return uint64_t{tag} << 56; }

BlockEvent Stored(BlockId block, const BlockHash& hash,
                  std::optional<BlockHash> parent = std::nullopt) {
  BlockEvent event;
  event.kind = BlockEvent::Kind::kStored;
  event.block = block;
  event.hash = hash;
  if (parent) {
    event.parent_hash = *parent;
    event.has_parent = true;
  }
  return event;
}
BlockEvent Removed(BlockId block, const BlockHash& hash) {
  BlockEvent event;
  event.kind = BlockEvent::Kind::kRemoved;
  event.block = block;
  event.hash = hash;
  return event;
}
BlockEvent AllCleared() {
  BlockEvent event;
  event.kind = BlockEvent::Kind::kAllCleared;
  return event;
}

// Block `block`'s tokens: 4 ids starting at 100 * (block + 1).
std::vector<int32_t> TokensOf(BlockId block) {
  std::vector<int32_t> tokens;
  for (int32_t i = 0; i < kBlockSize; ++i) tokens.push_back(100 * (block + 1) + i);
  return tokens;
}
std::vector<uint32_t> Unsigned(const std::vector<int32_t>& tokens) {
  return std::vector<uint32_t>(tokens.begin(), tokens.end());
}

// A commit of `blocks` (the sequence's whole table) with the tokens of every block.
void CommitAll(VllmConverter& converter, const std::vector<BlockId>& blocks) {
  std::vector<int32_t> tokens;
  for (BlockId block : blocks) {
    const std::vector<int32_t> mine = TokensOf(block);
    tokens.insert(tokens.end(), mine.begin(), mine.end());
  }
  converter.AddCommitTokens(blocks, static_cast<int32_t>(blocks.size()) * kBlockSize, tokens);
}

TEST(VllmConverterTest, ACommitWithTokensGivesBlockStoredWithTheParentHashAndTheTokens) {
  VllmConverter converter(kBlockSize);
  CommitAll(converter, {7});
  const BlockEvent events[] = {Stored(7, Hash(2), Hash(1))};
  converter.AddBatch(events, /*cleared=*/false);

  const std::vector<VllmEvent> out = converter.Take();
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].kind, VllmEvent::Kind::kBlockStored);
  EXPECT_EQ(out[0].block_hashes, std::vector<uint64_t>{Id(2)});
  EXPECT_EQ(out[0].parent_block_hash, std::optional<uint64_t>(Id(1)));
  EXPECT_EQ(out[0].token_ids, Unsigned(TokensOf(7)));
  EXPECT_EQ(converter.blocks_without_tokens(), 0u);
}

TEST(VllmConverterTest, ASequencesFirstBlockHasNoParent) {
  VllmConverter converter(kBlockSize);
  CommitAll(converter, {0});
  const BlockEvent events[] = {Stored(0, Hash(1))};
  converter.AddBatch(events, false);

  const std::vector<VllmEvent> out = converter.Take();
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].parent_block_hash, std::nullopt);
}

TEST(VllmConverterTest, TokensGoOntoTheLastFullBlocksTheCommitCovers) {
  VllmConverter converter(kBlockSize);
  // Three blocks in the table, 10 tokens committed (two full blocks), the tokens of one
  // block: they are block 11's (the second), not 10's nor 12's (partly written).
  const std::vector<BlockId> table = {10, 11, 12};
  converter.AddCommitTokens(table, 10, TokensOf(11));
  const BlockEvent events[] = {Stored(10, Hash(1)), Stored(11, Hash(2), Hash(1))};
  converter.AddBatch(events, false);

  const std::vector<VllmEvent> out = converter.Take();
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].block_hashes, std::vector<uint64_t>{Id(2)});
  EXPECT_EQ(out[0].token_ids, Unsigned(TokensOf(11)));
  EXPECT_EQ(converter.blocks_without_tokens(), 1u);  // block 10
}

TEST(VllmConverterTest, TokensForMoreBlocksThanTheCommitCoversAreIgnored) {
  VllmConverter converter(kBlockSize);
  std::vector<int32_t> two = TokensOf(0);
  const std::vector<int32_t> second = TokensOf(1);
  two.insert(two.end(), second.begin(), second.end());
  const std::vector<BlockId> table = {0, 1};
  converter.AddCommitTokens(table, kBlockSize, two);  // one block committed
  converter.AddCommitTokens(std::span<const BlockId>(table).first(1), 2 * kBlockSize,
                            two);  // a table too short
  const BlockEvent events[] = {Stored(0, Hash(1))};
  converter.AddBatch(events, false);

  EXPECT_TRUE(converter.Take().empty());
  EXPECT_EQ(converter.blocks_without_tokens(), 1u);
}

TEST(VllmConverterTest, ABlockCommittedWithoutTokensIsCountedAndNotPublished) {
  VllmConverter converter(kBlockSize);
  const BlockEvent events[] = {Stored(3, Hash(1)), Stored(4, Hash(2), Hash(1))};
  converter.AddBatch(events, false);

  EXPECT_TRUE(converter.Take().empty());
  EXPECT_EQ(converter.blocks_without_tokens(), 2u);
}

TEST(VllmConverterTest, TheRemovalOfABlockNeverPublishedGivesNothing) {
  VllmConverter converter(kBlockSize);
  const BlockEvent stored[] = {Stored(3, Hash(1))};  // no tokens
  converter.AddBatch(stored, false);
  const BlockEvent removed[] = {Removed(3, Hash(1)), Removed(4, Hash(9))};
  converter.AddBatch(removed, false);

  EXPECT_TRUE(converter.Take().empty());
}

TEST(VllmConverterTest, ARemovalGivesBlockRemovedOnce) {
  VllmConverter converter(kBlockSize);
  CommitAll(converter, {3});
  const BlockEvent stored[] = {Stored(3, Hash(1))};
  converter.AddBatch(stored, false);
  const BlockEvent removed[] = {Removed(3, Hash(1))};
  converter.AddBatch(removed, false);
  converter.AddBatch(removed, false);  // removed again: nothing stored under that id now

  const std::vector<VllmEvent> out = converter.Take();
  ASSERT_EQ(out.size(), 2u);
  EXPECT_EQ(out[1].kind, VllmEvent::Kind::kBlockRemoved);
  EXPECT_EQ(out[1].block_hashes, std::vector<uint64_t>{Id(1)});
}

TEST(VllmConverterTest, ConsecutiveStoredBlocksOfOneChainShareAnEvent) {
  VllmConverter converter(kBlockSize);
  CommitAll(converter, {0, 1, 2});
  const BlockEvent events[] = {Stored(0, Hash(1)), Stored(1, Hash(2), Hash(1)),
                               Stored(2, Hash(3), Hash(2))};
  converter.AddBatch(events, false);

  const std::vector<VllmEvent> out = converter.Take();
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].block_hashes, (std::vector<uint64_t>{Id(1), Id(2), Id(3)}));
  EXPECT_EQ(out[0].parent_block_hash, std::nullopt);
  std::vector<uint32_t> tokens;
  for (BlockId block : {0, 1, 2}) {
    const std::vector<uint32_t> mine = Unsigned(TokensOf(block));
    tokens.insert(tokens.end(), mine.begin(), mine.end());
  }
  EXPECT_EQ(out[0].token_ids, tokens);
}

TEST(VllmConverterTest, AStoredBlockOfAnotherChainStartsANewEvent) {
  VllmConverter converter(kBlockSize);
  CommitAll(converter, {0, 1});
  const BlockEvent events[] = {Stored(0, Hash(1)), Stored(1, Hash(2), Hash(7))};
  converter.AddBatch(events, false);

  const std::vector<VllmEvent> out = converter.Take();
  ASSERT_EQ(out.size(), 2u);
  EXPECT_EQ(out[1].block_hashes, std::vector<uint64_t>{Id(2)});
  EXPECT_EQ(out[1].parent_block_hash, std::optional<uint64_t>(Id(7)));
}

TEST(VllmConverterTest, ABlockWhoseIdIsTheEventsParentStartsANewEvent) {
  VllmConverter converter(kBlockSize);
  CommitAll(converter, {0, 1});
  // Block 0 (id 2) is the child of id 1, never published; block 1 has id 1 and continues
  // the chain: in one event the ids would not be unique, parent included.
  const BlockEvent events[] = {Stored(0, Hash(2), Hash(1)), Stored(1, Hash(1), Hash(2))};
  converter.AddBatch(events, false);

  const std::vector<VllmEvent> out = converter.Take();
  ASSERT_EQ(out.size(), 2u);
  EXPECT_EQ(out[1].block_hashes, std::vector<uint64_t>{Id(1)});
  EXPECT_EQ(out[1].parent_block_hash, std::optional<uint64_t>(Id(2)));
}

TEST(VllmConverterTest, ABlockWhoseIdIsPublishedAlreadyIsCountedAndLeftOut) {
  VllmConverter converter(kBlockSize);
  CommitAll(converter, {0, 1});
  // Two hashes with the same first 8 bytes: the same id.
  const BlockEvent events[] = {Stored(0, Hash(1, 1)), Stored(1, Hash(1, 2))};
  converter.AddBatch(events, false);

  const std::vector<VllmEvent> out = converter.Take();
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].block_hashes, std::vector<uint64_t>{Id(1)});
  EXPECT_EQ(out[0].token_ids, Unsigned(TokensOf(0)));
  EXPECT_EQ(converter.blocks_without_tokens(), 1u);
}

TEST(VllmConverterTest, ConsecutiveRemovalsShareAnEvent) {
  VllmConverter converter(kBlockSize);
  CommitAll(converter, {0, 1});
  const BlockEvent stored[] = {Stored(0, Hash(1)), Stored(1, Hash(2), Hash(1))};
  converter.AddBatch(stored, false);
  const BlockEvent removed[] = {Removed(1, Hash(2)), Removed(0, Hash(1))};
  converter.AddBatch(removed, false);

  const std::vector<VllmEvent> out = converter.Take();
  ASSERT_EQ(out.size(), 2u);
  EXPECT_EQ(out[1].kind, VllmEvent::Kind::kBlockRemoved);
  EXPECT_EQ(out[1].block_hashes, (std::vector<uint64_t>{Id(2), Id(1)}));
}

TEST(VllmConverterTest, EventsComeInTheLedgersOrder) {
  VllmConverter converter(kBlockSize);
  CommitAll(converter, {0});
  const BlockEvent first[] = {Stored(0, Hash(1))};
  converter.AddBatch(first, false);
  CommitAll(converter, {2});
  const BlockEvent second[] = {Removed(0, Hash(1)), Stored(2, Hash(3)), AllCleared()};
  converter.AddBatch(second, false);

  const std::vector<VllmEvent> out = converter.Take();
  ASSERT_EQ(out.size(), 4u);
  EXPECT_EQ(out[0].kind, VllmEvent::Kind::kBlockStored);
  EXPECT_EQ(out[0].block_hashes, std::vector<uint64_t>{Id(1)});
  EXPECT_EQ(out[1].kind, VllmEvent::Kind::kBlockRemoved);
  EXPECT_EQ(out[1].block_hashes, std::vector<uint64_t>{Id(1)});
  EXPECT_EQ(out[2].kind, VllmEvent::Kind::kBlockStored);
  EXPECT_EQ(out[2].block_hashes, std::vector<uint64_t>{Id(3)});
  EXPECT_EQ(out[3].kind, VllmEvent::Kind::kAllBlocksCleared);
}

TEST(VllmConverterTest, ClearedPutsAllBlocksClearedBeforeTheBatch) {
  VllmConverter converter(kBlockSize);
  CommitAll(converter, {0});
  const BlockEvent events[] = {Stored(0, Hash(1))};
  converter.AddBatch(events, /*cleared=*/true);

  const std::vector<VllmEvent> out = converter.Take();
  ASSERT_EQ(out.size(), 2u);
  EXPECT_EQ(out[0].kind, VllmEvent::Kind::kAllBlocksCleared);
  EXPECT_EQ(out[1].kind, VllmEvent::Kind::kBlockStored);
}

TEST(VllmConverterTest, AnEmptyClearedBatchGivesALoneAllBlocksCleared) {
  VllmConverter converter(kBlockSize);
  converter.AddBatch({}, /*cleared=*/true);

  const std::vector<VllmEvent> out = converter.Take();
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].kind, VllmEvent::Kind::kAllBlocksCleared);
  EXPECT_TRUE(out[0].block_hashes.empty());
}

TEST(VllmConverterTest, AClearForgetsWhatWasPublished) {
  for (const bool ledger_clear : {false, true}) {
    SCOPED_TRACE(ledger_clear ? "the ledger's kAllCleared" : "cleared");
    VllmConverter converter(kBlockSize);
    CommitAll(converter, {0});
    const BlockEvent stored[] = {Stored(0, Hash(1))};
    converter.AddBatch(stored, false);
    if (ledger_clear) {
      const BlockEvent clear[] = {AllCleared()};
      converter.AddBatch(clear, false);
    } else {
      converter.AddBatch({}, true);
    }
    // The block published before the clear is not removed after it, and its id may be
    // published again.
    CommitAll(converter, {5});
    const BlockEvent after[] = {Removed(0, Hash(1)), Stored(5, Hash(1))};
    converter.AddBatch(after, false);

    const std::vector<VllmEvent> out = converter.Take();
    ASSERT_EQ(out.size(), 3u);
    EXPECT_EQ(out[1].kind, VllmEvent::Kind::kAllBlocksCleared);
    EXPECT_EQ(out[2].kind, VllmEvent::Kind::kBlockStored);
    EXPECT_EQ(out[2].token_ids, Unsigned(TokensOf(5)));
    EXPECT_EQ(converter.blocks_without_tokens(), 0u);
  }
}

TEST(VllmConverterTest, TokensAreForgottenAtTheEndOfTheNextBatch) {
  VllmConverter converter(kBlockSize);
  CommitAll(converter, {0});
  converter.AddBatch({}, false);  // the block was indexed already: it stored nothing
  const BlockEvent later[] = {Stored(0, Hash(1))};
  converter.AddBatch(later, false);

  EXPECT_TRUE(converter.Take().empty());
  EXPECT_EQ(converter.blocks_without_tokens(), 1u);
}

TEST(VllmConverterTest, TakeHandsEachEventOutOnce) {
  VllmConverter converter(kBlockSize);
  converter.AddBatch({}, true);
  EXPECT_EQ(converter.Take().size(), 1u);
  EXPECT_TRUE(converter.Take().empty());
}

TEST(VllmConverterTest, IdsFollowTheHashAlgorithm) {
  VllmConverter converter(kBlockSize, HashAlgorithm::kVllmSha256Cbor);
  CommitAll(converter, {0});
  const BlockEvent events[] = {Stored(0, Hash(1, 42), Hash(2, 43))};
  converter.AddBatch(events, false);
  const BlockEvent removed[] = {Removed(0, Hash(1, 42))};
  converter.AddBatch(removed, false);

  const std::vector<VllmEvent> out = converter.Take();
  ASSERT_EQ(out.size(), 2u);
  EXPECT_EQ(out[0].block_hashes, std::vector<uint64_t>{42});
  EXPECT_EQ(out[0].parent_block_hash, std::optional<uint64_t>(43));
  EXPECT_EQ(out[1].block_hashes, std::vector<uint64_t>{42});
}

// A tier's event for block `tag`: stored with parent `parent` (0: none) and the tokens of
// pool block `tag` (none with `tokens` false), or removed.
tiers::TierEvent TierStored(tiers::Tier tier, uint8_t tag, uint8_t parent = 0, bool tokens = true) {
  tiers::TierEvent event;
  event.kind = tiers::TierEvent::Kind::kStored;
  event.tier = tier;
  event.hash = Hash(tag);
  if (parent != 0) {
    event.lineage.parent = Hash(parent);
    event.lineage.has_parent = true;
  }
  if (tokens) event.lineage.tokens = TokensOf(tag);
  return event;
}
tiers::TierEvent TierRemoved(tiers::Tier tier, uint8_t tag) {
  tiers::TierEvent event;
  event.kind = tiers::TierEvent::Kind::kRemoved;
  event.tier = tier;
  event.hash = Hash(tag);
  return event;
}

// "stored GPU [1 2] parent 0", "removed DISK [3]": ids by tag (Id(tag) >> 56).
std::vector<std::string> Describe(const std::vector<VllmEvent>& events) {
  std::vector<std::string> out;
  for (const VllmEvent& event : events) {
    std::string ids;
    for (uint64_t id : event.block_hashes) absl::StrAppend(&ids, ids.empty() ? "" : " ", id >> 56);
    switch (event.kind) {
      case VllmEvent::Kind::kBlockStored:
        out.push_back(absl::StrCat("stored ", std::string(VllmMediumName(event.medium)), " [", ids,
                                   "] parent ",
                                   event.parent_block_hash ? *event.parent_block_hash >> 56 : 0));
        break;
      case VllmEvent::Kind::kBlockRemoved:
        out.push_back(
            absl::StrCat("removed ", std::string(VllmMediumName(event.medium)), " [", ids, "]"));
        break;
      case VllmEvent::Kind::kAllBlocksCleared:
        out.push_back("cleared");
        break;
    }
  }
  return out;
}

TEST(VllmConverterTest, EachPlaceAnnouncesInItsMediumBesideACudaPool) {
  VllmConverter converter(kBlockSize, kDefaultHashAlgorithm, VllmMedium::kGpu);
  CommitAll(converter, {1});
  const BlockEvent stored[] = {Stored(1, Hash(1))};
  converter.AddBatch(stored, false);
  const tiers::TierEvent tier_stored[] = {TierStored(tiers::Tier::kHost, 1),
                                          TierStored(tiers::Tier::kDisk, 1)};
  converter.AddTierEvents(tier_stored);
  // Evicted from the pool, then from the host tier: each medium removes it on its own.
  const BlockEvent removed[] = {Removed(1, Hash(1))};
  converter.AddBatch(removed, false);
  const tiers::TierEvent host_removed[] = {TierRemoved(tiers::Tier::kHost, 1)};
  converter.AddTierEvents(host_removed);

  const std::vector<VllmEvent> out = converter.Take();
  EXPECT_THAT(Describe(out), ::testing::ElementsAre(
                                 "stored GPU [1] parent 0", "stored CPU [1] parent 0",
                                 "stored DISK [1] parent 0", "removed GPU [1]", "removed CPU [1]"));
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(out[i].token_ids, Unsigned(TokensOf(1))) << i;
  EXPECT_EQ(converter.blocks_without_tokens(), 0u);
}

// Beside a shm pool, the pool and the host tier are both host memory ("CPU"): a block is
// announced once while either holds it, and removed when neither does.
TEST(VllmConverterTest, BesideAShmPoolThePoolAndTheHostTierShareTheCpuMedium) {
  VllmConverter converter(kBlockSize, kDefaultHashAlgorithm, VllmMedium::kCpu);
  CommitAll(converter, {1});
  const BlockEvent stored[] = {Stored(1, Hash(1))};
  converter.AddBatch(stored, false);
  const tiers::TierEvent host_stored[] = {TierStored(tiers::Tier::kHost, 1)};
  converter.AddTierEvents(host_stored);
  EXPECT_THAT(Describe(converter.Take()), ::testing::ElementsAre("stored CPU [1] parent 0"));

  const BlockEvent removed[] = {Removed(1, Hash(1))};
  converter.AddBatch(removed, false);
  EXPECT_TRUE(converter.Take().empty());  // the host tier still holds it

  const tiers::TierEvent host_removed[] = {TierRemoved(tiers::Tier::kHost, 1)};
  converter.AddTierEvents(host_removed);
  EXPECT_THAT(Describe(converter.Take()), ::testing::ElementsAre("removed CPU [1]"));
  // Gone everywhere: a second removal gives nothing.
  converter.AddTierEvents(host_removed);
  EXPECT_TRUE(converter.Take().empty());
}

TEST(VllmConverterTest, TierBlocksOfOneChainShareAnEventPerMedium) {
  VllmConverter converter(kBlockSize);
  const tiers::TierEvent events[] = {
      TierStored(tiers::Tier::kDisk, 1),    TierStored(tiers::Tier::kDisk, 2, 1),
      TierStored(tiers::Tier::kHost, 3, 2),  // another medium: a new event
      TierStored(tiers::Tier::kDisk, 3, 2), TierRemoved(tiers::Tier::kDisk, 1),
      TierRemoved(tiers::Tier::kDisk, 2),   TierRemoved(tiers::Tier::kHost, 3)};
  converter.AddTierEvents(events);
  EXPECT_THAT(
      Describe(converter.Take()),
      ::testing::ElementsAre("stored DISK [1 2] parent 0", "stored CPU [3] parent 2",
                             "stored DISK [3] parent 2", "removed DISK [1 2]", "removed CPU [3]"));
}

// A prefetch commits the blocks a tier loaded into the pool itself, with no router's tokens:
// they are announced with the tokens the tier announced them with.
TEST(VllmConverterTest, ABlockLoadedFromATierIsAnnouncedInThePoolWithTheTiersTokens) {
  VllmConverter converter(kBlockSize, kDefaultHashAlgorithm, VllmMedium::kGpu);
  const tiers::TierEvent recovered[] = {TierStored(tiers::Tier::kDisk, 1)};
  converter.AddTierEvents(recovered);
  const BlockEvent loaded[] = {Stored(9, Hash(1))};  // pool block 9, no commit tokens
  converter.AddBatch(loaded, false);

  const std::vector<VllmEvent> out = converter.Take();
  EXPECT_THAT(Describe(out),
              ::testing::ElementsAre("stored DISK [1] parent 0", "stored GPU [1] parent 0"));
  ASSERT_EQ(out.size(), 2u);
  EXPECT_EQ(out[1].token_ids, Unsigned(TokensOf(1)));
  EXPECT_EQ(converter.blocks_without_tokens(), 0u);
}

TEST(VllmConverterTest, ATierBlockWithoutTokensIsCountedAndNeverAnnounced) {
  VllmConverter converter(kBlockSize);
  const tiers::TierEvent stored[] = {TierStored(tiers::Tier::kDisk, 1, 0, /*tokens=*/false)};
  converter.AddTierEvents(stored);
  const tiers::TierEvent removed[] = {TierRemoved(tiers::Tier::kDisk, 1),
                                      TierRemoved(tiers::Tier::kHost, 2)};
  converter.AddTierEvents(removed);
  EXPECT_TRUE(converter.Take().empty());
  EXPECT_EQ(converter.blocks_without_tokens(), 1u);
}

TEST(VllmConverterTest, ATierBlockWhoseIdIsAnotherHashsIsCountedAndLeftOut) {
  VllmConverter converter(kBlockSize);
  CommitAll(converter, {0});
  const BlockEvent stored[] = {Stored(0, Hash(1, 1))};
  converter.AddBatch(stored, false);
  tiers::TierEvent clash = TierStored(tiers::Tier::kDisk, 1);
  clash.hash = Hash(1, 2);  // the same first 8 bytes
  converter.AddTierEvents({&clash, 1});
  tiers::TierEvent clash_removed = TierRemoved(tiers::Tier::kDisk, 1);
  clash_removed.hash = Hash(1, 2);
  converter.AddTierEvents({&clash_removed, 1});
  EXPECT_THAT(Describe(converter.Take()), ::testing::ElementsAre("stored GPU [1] parent 0"));
  EXPECT_EQ(converter.blocks_without_tokens(), 1u);
}

TEST(VllmConverterTest, CommitTokensAreThoseOfTheLastCommitUntilTheNextBatch) {
  VllmConverter converter(kBlockSize);
  EXPECT_EQ(converter.CommitTokens(3), nullptr);
  CommitAll(converter, {3});
  ASSERT_NE(converter.CommitTokens(3), nullptr);
  EXPECT_EQ(*converter.CommitTokens(3), TokensOf(3));
  converter.AddBatch({}, false);
  EXPECT_EQ(converter.CommitTokens(3), nullptr);
}

// KV cache groups (docs/protocol.md, "vLLM-format KV events"), on a real GroupedLedger of a
// full-attention group and a window group of 2 blocks: every group's blocks are published
// under the plain hash of their position with the group's index, kind and window, with the
// same token ids, and each (id, group) stored is removed once, naming the same id and group.
struct GroupedFixture {
  static constexpr int32_t kWindow = 2 * kBlockSize;
  GroupedLedger ledger;
  VllmConverter converter{kBlockSize, kDefaultHashAlgorithm, VllmMedium::kGpu, {0, kWindow}};

  static GroupedLedger MakeLedger() {
    GroupedLedger::Options options;
    options.pool.num_blocks = 16;
    options.pool.block_size = kBlockSize;
    options.pool.record_events = true;
    options.group_windows = {0, kWindow};
    auto ledger = GroupedLedger::Create(options);
    KVCM_CHECK(ledger.ok()) << ledger.status();
    return *std::move(ledger);
  }
  GroupedFixture() : ledger(MakeLedger()) {}

  // Allocates `tokens` (hashes of its full blocks given), commits them all with the full
  // blocks' token ids, and converts the ledger's events.
  void Run(SeqId seq, const std::vector<int32_t>& tokens, bool cleared) {
    const std::vector<BlockHash> hashes = ChainHashes(tokens);
    const int32_t n = static_cast<int32_t>(tokens.size());
    GroupedTables tables;
    ASSERT_THAT(ledger.Allocate(seq, n, hashes, &tables), IsOk());
    ASSERT_THAT(ledger.Commit(seq, n), IsOk());
    auto table = ledger.BlockTable(seq);
    ASSERT_THAT(table, IsOk());
    const std::span<const int32_t> full(tokens.data(), hashes.size() * kBlockSize);
    converter.AddGroupedCommitTokens(
        *table, n, full, [this](BlockId block) { return ledger.pool().HashOfBlock(block); });
    converter.AddBatch(ledger.TakeEvents(), cleared);
  }
  static std::vector<BlockHash> ChainHashes(const std::vector<int32_t>& tokens) {
    std::vector<BlockHash> hashes;
    HashFullBlocks(kDefaultHashAlgorithm, RootHash(kDefaultHashAlgorithm, ""), tokens, kBlockSize,
                   &hashes);
    return hashes;
  }
  static std::vector<uint64_t> Ids(const std::vector<BlockHash>& hashes) {
    std::vector<uint64_t> ids;
    for (const BlockHash& hash : hashes) ids.push_back(VllmBlockId(hash));
    return ids;
  }
};

std::vector<int32_t> Iota(int32_t from, int32_t n) {
  std::vector<int32_t> tokens;
  for (int32_t i = 0; i < n; ++i) tokens.push_back(from + i);
  return tokens;
}

TEST(VllmConverterGroupsTest, EveryGroupsBlocksArePublishedUnderThePlainHashWithTheirGroup) {
  GroupedFixture f;
  // 3 full blocks and a token more: the window group releases its first block in the same
  // commit (it is cached, not removed), and it is published all the same.
  const std::vector<int32_t> first = Iota(1000, 3 * kBlockSize + 1);
  f.Run(1, first, /*cleared=*/true);
  const std::vector<uint64_t> ids = GroupedFixture::Ids(GroupedFixture::ChainHashes(first));
  const std::vector<uint32_t> tokens(first.begin(), first.begin() + 3 * kBlockSize);
  std::vector<VllmEvent> events = f.converter.Take();
  ASSERT_EQ(events.size(), 3u);
  EXPECT_EQ(events[0].kind, VllmEvent::Kind::kAllBlocksCleared);
  for (int32_t g = 0; g < 2; ++g) {
    SCOPED_TRACE(absl::StrCat("group ", g));
    const VllmEvent& stored = events[static_cast<size_t>(1 + g)];
    EXPECT_EQ(stored.kind, VllmEvent::Kind::kBlockStored);
    EXPECT_EQ(stored.block_hashes, ids);  // the plain hashes, equal across groups
    EXPECT_EQ(stored.parent_block_hash, std::nullopt);
    EXPECT_EQ(stored.token_ids, tokens);
    EXPECT_EQ(stored.group, (VllmGroup{g, g == 0 ? 0 : GroupedFixture::kWindow}));
  }

  // A prompt sharing the first 2 blocks: its third block, in both groups, child of the second.
  std::vector<int32_t> second(first.begin(), first.begin() + 2 * kBlockSize);
  for (int32_t t : Iota(5000, kBlockSize + 1)) second.push_back(t);
  f.Run(2, second, /*cleared=*/false);
  const uint64_t third = GroupedFixture::Ids(GroupedFixture::ChainHashes(second))[2];
  events = f.converter.Take();
  ASSERT_EQ(events.size(), 2u);
  for (int32_t g = 0; g < 2; ++g) {
    const VllmEvent& stored = events[static_cast<size_t>(g)];
    EXPECT_EQ(stored.kind, VllmEvent::Kind::kBlockStored);
    EXPECT_EQ(stored.block_hashes, std::vector<uint64_t>{third});
    EXPECT_EQ(stored.parent_block_hash, ids[1]);
    EXPECT_EQ(stored.token_ids, Unsigned(Iota(5000, kBlockSize)));
    EXPECT_EQ(stored.group->index, g);
  }
  EXPECT_EQ(f.converter.blocks_without_tokens(), 0u);

  // Everything evicted: each (id, group) published is removed once, naming its group.
  ASSERT_THAT(f.ledger.Free(1), IsOk());
  ASSERT_THAT(f.ledger.Free(2), IsOk());
  EXPECT_EQ(f.ledger.EvictAllCached(), 8);
  f.converter.AddBatch(f.ledger.TakeEvents(), /*cleared=*/false);
  std::multiset<std::pair<int32_t, uint64_t>> removed;
  for (const VllmEvent& event : f.converter.Take()) {
    ASSERT_EQ(event.kind, VllmEvent::Kind::kBlockRemoved);
    ASSERT_TRUE(event.group.has_value());
    EXPECT_EQ(event.group->window, event.group->index == 0 ? 0 : GroupedFixture::kWindow);
    for (uint64_t id : event.block_hashes) removed.insert({event.group->index, id});
  }
  std::multiset<std::pair<int32_t, uint64_t>> expected;
  for (int32_t g = 0; g < 2; ++g) {
    for (uint64_t id : {ids[0], ids[1], ids[2], third}) expected.insert({g, id});
  }
  EXPECT_EQ(removed, expected);
  // Nothing is removed twice.
  f.ledger.EvictAllCached();
  f.converter.AddBatch(f.ledger.TakeEvents(), /*cleared=*/false);
  EXPECT_TRUE(f.converter.Take().empty());
}

// A grouped block whose commit brought no tokens is left out and counted, in every group.
TEST(VllmConverterGroupsTest, AGroupedBlockWithoutTokensIsCountedAndLeftOut) {
  GroupedFixture f;
  const std::vector<int32_t> tokens = Iota(7, 2 * kBlockSize);
  const std::vector<BlockHash> hashes = GroupedFixture::ChainHashes(tokens);
  GroupedTables tables;
  ASSERT_THAT(f.ledger.Allocate(1, 2 * kBlockSize, hashes, &tables), IsOk());
  ASSERT_THAT(f.ledger.Commit(1, 2 * kBlockSize), IsOk());
  f.converter.AddBatch(f.ledger.TakeEvents(), /*cleared=*/false);
  EXPECT_TRUE(f.converter.Take().empty());
  EXPECT_EQ(f.converter.blocks_without_tokens(), 4u);  // 2 blocks x 2 groups
}

}  // namespace
}  // namespace kvcm::cache_manager
