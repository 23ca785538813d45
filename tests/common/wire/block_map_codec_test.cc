// The BlockMapReply codec: what the cache manager encodes decodes to the same map, and a
// reply whose values contradict each other is refused naming what is wrong.

#include "common/wire/block_map_codec.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/status_matchers.h"

namespace kvcm {
namespace {

using ::testing::HasSubstr;

// A finished BlockMapReply of these raw values, decoded.
absl::StatusOr<BlockMap> DecodeRaw(int32_t num_blocks, int32_t per_cell,
                                   const std::vector<uint8_t>& cells,
                                   const std::vector<int32_t>& counts) {
  flatbuffers::FlatBufferBuilder builder;
  builder.Finish(wire::CreateBlockMapReply(
      builder, num_blocks, per_cell, builder.CreateVector(cells), builder.CreateVector(counts)));
  return DecodeBlockMapReply(
      *flatbuffers::GetRoot<wire::BlockMapReply>(builder.GetBufferPointer()));
}

TEST(BlockMapCodecTest, AnEncodedMapDecodesToItself) {
  BlockMap map;
  map.num_blocks = 9;
  map.blocks_per_cell = 2;
  map.cells = {MapState::kInUse, MapState::kQuarantined, MapState::kDraining, MapState::kPinned,
               MapState::kCached};
  map.counts = {1, 3, 1, 1, 2, 1};
  flatbuffers::FlatBufferBuilder builder;
  builder.Finish(EncodeBlockMapReply(builder, map));
  absl::StatusOr<BlockMap> decoded =
      DecodeBlockMapReply(*flatbuffers::GetRoot<wire::BlockMapReply>(builder.GetBufferPointer()));
  ASSERT_THAT(decoded, IsOk());
  EXPECT_EQ(*decoded, map);
}

TEST(BlockMapCodecTest, RepliesThatContradictThemselvesAreRefused) {
  const std::vector<int32_t> counts = {4, 0, 0, 0, 0, 0};
  EXPECT_THAT(DecodeRaw(4, 2, {0, 0}, counts), IsOk());
  auto refused = [](const absl::StatusOr<BlockMap>& map, const std::string& why) {
    EXPECT_EQ(map.status().code(), absl::StatusCode::kInternal) << why;
    EXPECT_THAT(map.status().message(), HasSubstr(why));
  };
  refused(DecodeRaw(4, 2, {0, 0, 0}, counts), "3 cells for 4 blocks in runs of 2");
  refused(DecodeRaw(4, 0, {0, 0}, counts), "in runs of 0");
  refused(DecodeRaw(4, 2, {0, 6}, counts), "cell 1 has state 6");
  refused(DecodeRaw(4, 2, {0, 0}, {4, 0, 0, 0, 0}), "5 counts");
  refused(DecodeRaw(4, 2, {0, 0}, {3, 0, 0, 0, 0, 0}), "counts sum to 3, not 4");
  refused(DecodeRaw(4, 2, {0, 0}, {5, -1, 0, 0, 0, 0}), "negative count");
}

TEST(BlockMapCodecTest, RequestedCellsAreBounded) {
  EXPECT_EQ(BlockMapCellsFor(0), kDefaultBlockMapCells);
  EXPECT_EQ(BlockMapCellsFor(10), 10);
  EXPECT_EQ(BlockMapCellsFor(UINT32_MAX), kMaxBlockMapCells);
}

}  // namespace
}  // namespace kvcm
