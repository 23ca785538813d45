#include "common/sizing/kv_cache_groups.h"

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/sizing/kv_cache_spec.h"
#include "common/sizing/model_config.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/status_matchers.h"

namespace kvcm {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// Gemma 3's layer pattern as transformers builds it: every `pattern`-th layer (1-based)
// attends to the whole context, the others within `window` tokens.
std::vector<int32_t> GemmaWindows(int32_t num_layers, int32_t pattern, int32_t window) {
  std::vector<int32_t> windows(num_layers, window);
  for (int32_t layer = pattern - 1; layer < num_layers; layer += pattern) windows[layer] = 0;
  return windows;
}

// Every layer's group and slot point back at it in the group's layer list, and every group
// fits in group_size slots.
void ExpectConsistent(const KvCacheGroups& groups) {
  ASSERT_EQ(groups.group_of.size(), static_cast<size_t>(groups.num_layers));
  ASSERT_EQ(groups.slot_of.size(), static_cast<size_t>(groups.num_layers));
  int32_t placed = 0;
  for (const KvCacheGroup& group : groups.groups) {
    EXPECT_LE(group.layers.size(), static_cast<size_t>(groups.group_size));
    placed += static_cast<int32_t>(group.layers.size());
  }
  EXPECT_EQ(placed, groups.num_layers);
  for (int32_t layer = 0; layer < groups.num_layers; ++layer) {
    const KvCacheGroup& group = groups.groups.at(groups.group_of[layer]);
    EXPECT_EQ(group.layers.at(groups.slot_of[layer]), layer) << "layer " << layer;
  }
}

// Gemma 3 1B: 26 layers, 5, 11, 17 and 23 full, the other 22 within 512 tokens. The fewest
// of a type is 4 (full), so pages hold 4 layers: 1 full group and ceil(22 / 4) = 6 window
// groups, 28 slots for 26 layers.
TEST(GroupLayersTest, Gemma3_1B) {
  const std::vector<int32_t> windows = GemmaWindows(26, 6, 512);
  const absl::StatusOr<KvCacheGroups> groups = GroupLayers(windows);
  ASSERT_THAT(groups, IsOk());
  EXPECT_EQ(groups->num_layers, 26);
  EXPECT_EQ(groups->group_size, 4);
  ASSERT_EQ(groups->num_groups(), 7);
  EXPECT_EQ(groups->padding_slots(), 2);
  EXPECT_EQ(groups->groups[0].window, 0);
  EXPECT_THAT(groups->groups[0].layers, ElementsAre(5, 11, 17, 23));
  // The 22 window layers 0-4, 6-10, 12-16, 18-22, 24-25, strided over 6 groups: group i
  // takes the i-th, (i + 6)-th, (i + 12)-th and (i + 18)-th of them.
  for (int32_t g = 1; g < 7; ++g) EXPECT_EQ(groups->groups[g].window, 512);
  EXPECT_THAT(groups->groups[1].layers, ElementsAre(0, 7, 14, 21));
  EXPECT_THAT(groups->groups[2].layers, ElementsAre(1, 8, 15, 22));
  EXPECT_THAT(groups->groups[3].layers, ElementsAre(2, 9, 16, 24));
  EXPECT_THAT(groups->groups[4].layers, ElementsAre(3, 10, 18, 25));
  EXPECT_THAT(groups->groups[5].layers, ElementsAre(4, 12, 19));
  EXPECT_THAT(groups->groups[6].layers, ElementsAre(6, 13, 20));
  EXPECT_EQ(groups->group_of[5], 0);
  EXPECT_EQ(groups->slot_of[5], 0);
  EXPECT_EQ(groups->group_of[23], 0);
  EXPECT_EQ(groups->slot_of[23], 3);
  EXPECT_EQ(groups->group_of[0], 1);
  EXPECT_EQ(groups->slot_of[0], 0);
  EXPECT_EQ(groups->group_of[25], 4);
  EXPECT_EQ(groups->slot_of[25], 3);
  EXPECT_EQ(groups->group_of[20], 6);
  EXPECT_EQ(groups->slot_of[20], 2);
  ExpectConsistent(*groups);
  EXPECT_EQ(groups->ToString(),
            "7 groups of 4 slots: full attention (layers 5, 11, 17, 23), window 512 (layers 0, 7, "
            "14, 21), window 512 (layers 1, 8, 15, 22), window 512 (layers 2, 9, 16, 24), window "
            "512 (layers 3, 10, 18, 25), window 512 (layers 4, 12, 19), window 512 (layers 6, 13, "
            "20), 2 padding slots");
}

// Gemma 3 27B: 62 layers, 10 full (5, 11, ..., 59) and 52 window. group_size 10: 1 full
// group and ceil(52 / 10) = 6 window groups of 9, 9, 9, 9, 8 and 8 layers.
TEST(GroupLayersTest, Gemma3_27B) {
  const absl::StatusOr<KvCacheGroups> groups = GroupLayers(GemmaWindows(62, 6, 1024));
  ASSERT_THAT(groups, IsOk());
  EXPECT_EQ(groups->group_size, 10);
  ASSERT_EQ(groups->num_groups(), 7);
  EXPECT_EQ(groups->padding_slots(), 8);
  EXPECT_THAT(groups->groups[0].layers, ElementsAre(5, 11, 17, 23, 29, 35, 41, 47, 53, 59));
  std::vector<size_t> sizes;
  for (int32_t g = 1; g < 7; ++g) {
    EXPECT_EQ(groups->groups[g].window, 1024);
    sizes.push_back(groups->groups[g].layers.size());
  }
  EXPECT_THAT(sizes, ElementsAre(9, 9, 9, 9, 8, 8));
  // The window layers are 0-4, 6-10, ..., 54-58, 60-61: the first window group takes the
  // 0th, 6th, ..., 48th of them.
  EXPECT_THAT(groups->groups[1].layers, ElementsAre(0, 7, 14, 21, 28, 36, 43, 50, 57));
  ExpectConsistent(*groups);
}

// One type: one group of every layer, a page per block as without groups.
TEST(GroupLayersTest, OneTypeIsOneGroup) {
  const absl::StatusOr<KvCacheGroups> full = GroupLayers(std::vector<int32_t>(32, 0));
  ASSERT_THAT(full, IsOk());
  EXPECT_EQ(full->group_size, 32);
  ASSERT_EQ(full->num_groups(), 1);
  EXPECT_EQ(full->padding_slots(), 0);
  EXPECT_EQ(full->groups[0].window, 0);
  EXPECT_EQ(full->groups[0].layers.size(), 32u);
  ExpectConsistent(*full);
  const KvCacheSpec llama{32, 8, 128, DType::kBFloat16, 16};
  EXPECT_EQ(PageSpec(llama, *full), llama);

  // Mistral 7B v0.1: a 4,096-token window on each of its 32 layers.
  const absl::StatusOr<KvCacheGroups> mistral = GroupLayers(std::vector<int32_t>(32, 4096));
  ASSERT_THAT(mistral, IsOk());
  EXPECT_EQ(mistral->group_size, 32);
  ASSERT_EQ(mistral->num_groups(), 1);
  EXPECT_EQ(mistral->groups[0].window, 4096);
  EXPECT_EQ(mistral->padding_slots(), 0);

  const absl::StatusOr<KvCacheGroups> single = GroupLayers(std::vector<int32_t>{0});
  ASSERT_THAT(single, IsOk());
  EXPECT_EQ(single->ToString(), "1 group of 1 slot: full attention (layers 0), 0 padding slots");
}

// 12 window + 13 full layers (gpt-oss-20b with an EAGLE head): 13 < 1.25 x 12 = 15, so
// group_size is 13, not 12: 2 groups and 1 unused slot rather than 3 groups and 11.
TEST(GroupLayersTest, NearlyEqualTypesTakeTheLargerSize) {
  std::vector<int32_t> windows;
  for (int32_t layer = 0; layer < 25; ++layer) windows.push_back(layer % 2 == 0 ? 0 : 128);
  const absl::StatusOr<KvCacheGroups> groups = GroupLayers(windows);
  ASSERT_THAT(groups, IsOk());
  EXPECT_EQ(groups->group_size, 13);
  ASSERT_EQ(groups->num_groups(), 2);
  EXPECT_EQ(groups->padding_slots(), 1);
  EXPECT_EQ(groups->groups[0].window, 0);
  EXPECT_EQ(groups->groups[0].layers.size(), 13u);
  EXPECT_EQ(groups->groups[1].window, 128);
  EXPECT_EQ(groups->groups[1].layers.size(), 12u);
  ExpectConsistent(*groups);

  // 10 + 13: 13 is not below 12.5, so group_size is the fewest, 10.
  windows.assign(10, 0);
  windows.insert(windows.end(), 13, 128);
  EXPECT_EQ(GroupLayers(windows)->group_size, 10);
  EXPECT_EQ(GroupLayers(windows)->num_groups(), 3);
}

// Two windows besides full attention: types ordered full, 128, 1024.
TEST(GroupLayersTest, TwoWindowsAndFull) {
  const std::vector<int32_t> windows = {1024, 128, 0, 128, 1024, 128, 0, 128, 1024, 128};
  const absl::StatusOr<KvCacheGroups> groups = GroupLayers(windows);
  ASSERT_THAT(groups, IsOk());
  EXPECT_EQ(groups->group_size, 2);  // full has 2 layers; 5 (window 128) is not below 2.5
  ASSERT_EQ(groups->num_groups(), 6);
  EXPECT_EQ(groups->padding_slots(), 2);
  ExpectConsistent(*groups);
  EXPECT_EQ(groups->ToString(),
            "6 groups of 2 slots: full attention (layers 2, 6), window 128 (layers 1, 7), window "
            "128 (layers 3, 9), window 128 (layers 5), window 1024 (layers 0, 8), window 1024 "
            "(layers 4), 2 padding slots");
}

TEST(GroupLayersTest, Errors) {
  EXPECT_THAT(GroupLayers({}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no layers")));
  EXPECT_THAT(GroupLayers(std::vector<int32_t>{0, 512, -1}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("layer 2 has window -1")));
}

TEST(PageSpecTest, HoldsGroupSizeLayers) {
  const KvCacheGroups groups = *GroupLayers(GemmaWindows(26, 6, 512));
  const KvCacheSpec model{26, 1, 256, DType::kBFloat16, 16};
  const KvCacheSpec page = PageSpec(model, groups);
  EXPECT_EQ(page.num_layers, 4);
  EXPECT_EQ(page.num_kv_heads, 1);
  EXPECT_EQ(page.head_dim, 256);
  EXPECT_EQ(page.block_size, 16);
  // 2 (K and V) x 4 slots x 1 KV head x 256 head dim x 2 bytes x 16 tokens.
  EXPECT_EQ(page.BytesPerBlock(), 65536);
}

// A Gemma-3-1B-shaped model (26 layers, 1 KV head, head dim 256, bf16, 16-token blocks),
// each figure worked by hand:
//   full block (26 layers): 2 x 26 x 1 x 256 x 2 x 16 = 425984 B
//   page (4 slots):         2 x 4 x 1 x 256 x 2 x 16  =  65536 B
//   a window group keeps its 512-token window (512 / 16 = 32 blocks) and up to 2 blocks
//   being filled: 34 blocks once the sequence is longer than that.
TEST(BlocksHeldByGroupsTest, Gemma3_1BAgainstAllLayersInFull) {
  const KvCacheGroups groups = *GroupLayers(GemmaWindows(26, 6, 512));
  const KvCacheSpec model{26, 1, 256, DType::kBFloat16, 16};
  const int64_t page_bytes = PageSpec(model, groups).BytesPerBlock();
  ASSERT_EQ(model.BytesPerBlock(), 425984);
  ASSERT_EQ(page_bytes, 65536);

  // 32768 tokens: the full group 32768 / 16 = 2048 pages, each window group 34.
  EXPECT_EQ(BlocksHeldByGroups(groups, 32768, 16), 2048 + 6 * 34);  // 2252
  const int64_t grouped_32k = int64_t{2252} * 65536;
  const int64_t full_32k = int64_t{2048} * 425984;
  EXPECT_EQ(BlocksHeldByGroups(groups, 32768, 16) * page_bytes, grouped_32k);
  EXPECT_EQ(grouped_32k, 147587072);  // 140.75 MiB
  EXPECT_EQ(full_32k, 872415232);     // 832 MiB
  // 2252 x 4 / (2048 x 26) = 9008 / 53248: about a sixth.
  EXPECT_NEAR(static_cast<double>(grouped_32k) / static_cast<double>(full_32k), 0.1692, 0.0001);

  // 4096 tokens: 256 + 6 x 34 = 460 pages against 256 full blocks.
  EXPECT_EQ(BlocksHeldByGroups(groups, 4096, 16), 460);
  EXPECT_EQ(460 * page_bytes, 30146560);
  EXPECT_EQ(256 * model.BytesPerBlock(), 109051904);

  // 100 tokens, inside the window: every group keeps all ceil(100 / 16) = 7 of its blocks,
  // and the 2 padding slots make the groups cost 28 / 26 of the full layout.
  EXPECT_EQ(BlocksHeldByGroups(groups, 100, 16), 7 * 7);
  EXPECT_EQ(49 * page_bytes, 3211264);
  EXPECT_EQ(7 * model.BytesPerBlock(), 2981888);

  // The all-full layout is one group of 26 slots: a page is a full block.
  const KvCacheGroups all_full = *GroupLayers(std::vector<int32_t>(26, 0));
  EXPECT_EQ(PageSpec(model, all_full).BytesPerBlock(), 425984);
  EXPECT_EQ(BlocksHeldByGroups(all_full, 32768, 16) * 425984, full_32k);
}

}  // namespace
}  // namespace kvcm
