// BlockLedger::FillBlockMap (common/block/block_map.h): every block in the state the ledger
// itself reports (StateOf), counts equal to its Stats and summing to the pool, runs of blocks
// shown by their dominant state, and the blocks the cache manager holds apart counted as
// such.

#include "common/block/block_map.h"

#include <algorithm>
#include <array>
#include <cstdio>
#include <random>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/block/block_ledger.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/common/block/ledger_test_util.h"
#include "tests/support/status_matchers.h"

namespace kvcm {
namespace {

using ::kvcm::testing::HashesOf;
using ::kvcm::testing::Iota;
using ::testing::ElementsAre;

BlockLedger MakeLedger(int32_t num_blocks, int32_t block_size) {
  BlockLedger::Options options;
  options.num_blocks = num_blocks;
  options.block_size = block_size;
  auto ledger = BlockLedger::Create(options);
  EXPECT_THAT(ledger, IsOk());
  return std::move(ledger).value();
}

MapState AsMapState(BlockState state) {
  switch (state) {
    case BlockState::kFree:
      return MapState::kFree;
    case BlockState::kInUse:
      return MapState::kInUse;
    case BlockState::kCached:
      return MapState::kCached;
    case BlockState::kPinned:
      return MapState::kPinned;
  }
  return MapState::kFree;
}

// The map worked out block by block from StateOf, the slow way.
BlockMap ExpectedMap(const BlockLedger& ledger, int32_t max_cells,
                     const std::vector<std::pair<BlockId, MapState>>& held = {}) {
  std::vector<MapState> states;
  for (BlockId b = 0; b < ledger.num_blocks(); ++b) states.push_back(AsMapState(ledger.StateOf(b)));
  for (const auto& [block, state] : held) states[static_cast<size_t>(block)] = state;
  BlockMap map;
  map.num_blocks = ledger.num_blocks();
  map.blocks_per_cell = BlocksPerCell(map.num_blocks, max_cells);
  for (size_t first = 0; first < states.size(); first += map.blocks_per_cell) {
    std::array<int32_t, kMapStates> in_cell{};
    for (size_t b = first; b < std::min(states.size(), first + map.blocks_per_cell); ++b) {
      ++in_cell[static_cast<size_t>(states[b])];
      ++map.counts[static_cast<size_t>(states[b])];
    }
    int best = 0;
    for (int s = 0; s < kMapStates; ++s) {
      if (in_cell[s] > 0 && in_cell[s] >= in_cell[best]) best = s;
    }
    map.cells.push_back(static_cast<MapState>(best));
  }
  return map;
}

void ExpectCountsAreTheLedgers(const BlockMap& map, const BlockLedger& ledger) {
  const LedgerStats stats = ledger.Stats();
  EXPECT_EQ(map.count(MapState::kFree), stats.free_blocks);
  EXPECT_EQ(map.count(MapState::kInUse), stats.in_use_blocks);
  EXPECT_EQ(map.count(MapState::kCached), stats.cached_blocks);
  EXPECT_EQ(map.count(MapState::kPinned), stats.pinned_blocks);
  EXPECT_EQ(map.count(MapState::kQuarantined), 0);
  EXPECT_EQ(map.count(MapState::kDraining), 0);
  int32_t sum = 0;
  for (int32_t c : map.counts) sum += c;
  EXPECT_EQ(sum, ledger.num_blocks());
}

TEST(BlockMapTest, EachBlockIsInTheStateTheLedgerReportsAndTheCountsAreItsStats) {
  constexpr int32_t bs = 4;
  BlockLedger ledger = MakeLedger(12, bs);
  // Blocks 0-2 cached after seq 1 ends, 0-1 then pinned; 3-4 in use by seq 2.
  const auto prompt = Iota(3 * bs, 11);
  const auto hashes = HashesOf(prompt, bs);
  ASSERT_THAT(ledger.Allocate(1, 3 * bs, hashes), IsOk());
  ASSERT_THAT(ledger.Commit(1, 3 * bs), IsOk());
  ASSERT_THAT(ledger.Free(1), IsOk());
  ASSERT_THAT(ledger.Pin("system", std::span(hashes).first(2)), IsOk());
  ASSERT_THAT(ledger.Allocate(2, 2 * bs), IsOk());

  BlockMap map;
  ledger.FillBlockMap(kDefaultBlockMapCells, {}, &map);
  EXPECT_EQ(map.num_blocks, 12);
  EXPECT_EQ(map.blocks_per_cell, 1);
  using S = MapState;
  EXPECT_THAT(map.cells,
              ElementsAre(S::kPinned, S::kPinned, S::kCached, S::kInUse, S::kInUse, S::kFree,
                          S::kFree, S::kFree, S::kFree, S::kFree, S::kFree, S::kFree));
  EXPECT_THAT(map.counts, ElementsAre(7, 2, 1, 2, 0, 0));
  ExpectCountsAreTheLedgers(map, ledger);
}

TEST(BlockMapTest, ARunOfBlocksShowsItsDominantStateAndATieTheLaterState) {
  constexpr int32_t bs = 4;
  BlockLedger ledger = MakeLedger(10, bs);
  ASSERT_THAT(ledger.Allocate(1, 3 * bs), IsOk());  // blocks 0-2 in use
  BlockMap map;
  // Runs of 4: [0-3] in use 3 : free 1, [4-7] free, [8-9] free.
  ledger.FillBlockMap(3, {}, &map);
  EXPECT_EQ(map.blocks_per_cell, 4);
  EXPECT_THAT(map.cells, ElementsAre(MapState::kInUse, MapState::kFree, MapState::kFree));
  // Runs of 2: [0-1] in use, [2-3] one in use and one free: in use, the later state.
  ledger.FillBlockMap(5, {}, &map);
  EXPECT_EQ(map.blocks_per_cell, 2);
  EXPECT_THAT(map.cells, ElementsAre(MapState::kInUse, MapState::kInUse, MapState::kFree,
                                     MapState::kFree, MapState::kFree));
  ExpectCountsAreTheLedgers(map, ledger);
  // One cell for the whole pool.
  ledger.FillBlockMap(1, {}, &map);
  EXPECT_EQ(map.blocks_per_cell, 10);
  EXPECT_THAT(map.cells, ElementsAre(MapState::kFree));
  EXPECT_THAT(map.counts, ElementsAre(7, 3, 0, 0, 0, 0));
}

TEST(BlockMapTest, BlocksHeldApartCountAsQuarantinedOrDrainingInsteadOfInUse) {
  constexpr int32_t bs = 4;
  BlockLedger ledger = MakeLedger(8, bs);
  ASSERT_THAT(ledger.Allocate(1, 4 * bs), IsOk());  // blocks 0-3 in use
  const std::vector<std::pair<BlockId, MapState>> held = {{1, MapState::kQuarantined},
                                                          {3, MapState::kDraining}};
  BlockMap map;
  ledger.FillBlockMap(8, held, &map);
  EXPECT_THAT(map.cells, ElementsAre(MapState::kInUse, MapState::kQuarantined, MapState::kInUse,
                                     MapState::kDraining, MapState::kFree, MapState::kFree,
                                     MapState::kFree, MapState::kFree));
  EXPECT_THAT(map.counts, ElementsAre(4, 2, 0, 0, 1, 1));
  // In a run of two, one quarantined block beside one in use shows the run quarantined.
  ledger.FillBlockMap(4, held, &map);
  EXPECT_THAT(map.cells, ElementsAre(MapState::kQuarantined, MapState::kDraining, MapState::kFree,
                                     MapState::kFree));
  EXPECT_EQ(map, ExpectedMap(ledger, 4, held));
}

TEST(BlockMapTest, TheBufferIsReusedAcrossCalls) {
  BlockLedger ledger = MakeLedger(64, 4);
  BlockMap map;
  ledger.FillBlockMap(64, {}, &map);
  const MapState* cells = map.cells.data();
  ASSERT_THAT(ledger.Allocate(1, 40), IsOk());
  ledger.FillBlockMap(64, {}, &map);
  EXPECT_EQ(map.cells.data(), cells);
  EXPECT_EQ(map.count(MapState::kInUse), 10);
}

// Random pools and random operations: after each batch, the map at several cell limits is
// the one worked out block by block, and its counts are the ledger's.
class BlockMapRandomTest : public ::testing::TestWithParam<uint32_t> {};

TEST_P(BlockMapRandomTest, RandomLedgersGiveTheMapWorkedOutBlockByBlock) {
  const uint32_t seed = GetParam();
  std::printf("block map seed=%u\n", seed);
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  constexpr int32_t bs = 4;
  for (int pool = 0; pool < 8; ++pool) {
    const int32_t num_blocks = std::uniform_int_distribution<int32_t>(1, 300)(rng);
    BlockLedger ledger = MakeLedger(num_blocks, bs);
    std::vector<SeqId> live;
    SeqId next = 1;
    int pins = 0;
    for (int op = 0; op < 400; ++op) {
      const int kind = std::uniform_int_distribution<int>(0, 9)(rng);
      if (kind < 5) {
        // A prompt from one of a few prefixes, so that blocks are shared and cached.
        const int32_t tokens = std::uniform_int_distribution<int32_t>(1, 6 * bs)(rng);
        const auto prompt = Iota(tokens, 100 * std::uniform_int_distribution<int>(0, 3)(rng));
        const auto hashes = HashesOf(prompt, bs);
        if (ledger.Allocate(next, tokens, hashes).ok()) {
          if (ledger.Commit(next, tokens).ok()) live.push_back(next);
          if (kind == 0 && !hashes.empty()) {
            (void)ledger.Pin(absl::StrCat("pin", pins++), std::span(hashes).first(1));
          }
        }
        ++next;
      } else if (!live.empty()) {
        const size_t i = std::uniform_int_distribution<size_t>(0, live.size() - 1)(rng);
        ASSERT_THAT(ledger.Free(live[i]), IsOk());
        live.erase(live.begin() + static_cast<ptrdiff_t>(i));
      }
      if (op % 50 != 49) continue;
      for (int32_t max_cells : {1, 7, 64, kDefaultBlockMapCells}) {
        BlockMap map;
        ledger.FillBlockMap(max_cells, {}, &map);
        EXPECT_EQ(map, ExpectedMap(ledger, max_cells)) << "max_cells " << max_cells;
        ExpectCountsAreTheLedgers(map, ledger);
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Seeds, BlockMapRandomTest, ::testing::Values(1u, 2u, 3u, 20261201u));

}  // namespace
}  // namespace kvcm
