#include "common/block/free_block_set.h"

#include <cstdio>
#include <random>
#include <set>

#include "gtest/gtest.h"

namespace kvcm {
namespace {

TEST(FreeBlockSetTest, PopsLowestFirst) {
  FreeBlockSet set(200, /*all_free=*/true);
  EXPECT_EQ(set.size(), 200);
  EXPECT_EQ(set.PopLowest(), 0);
  EXPECT_EQ(set.PopLowest(), 1);
  set.Erase(2);
  EXPECT_EQ(set.PopLowest(), 3);
  set.Insert(1);
  EXPECT_EQ(set.PopLowest(), 1);
  EXPECT_TRUE(set.ConsistentForTest());
}

TEST(FreeBlockSetTest, EmptyAtStartWhenAskedAndAcrossSummaryWords) {
  FreeBlockSet set(10000, /*all_free=*/false);
  EXPECT_TRUE(set.empty());
  set.Insert(9999);
  set.Insert(4096);
  EXPECT_EQ(set.PopLowest(), 4096);
  EXPECT_EQ(set.PopLowest(), 9999);
  EXPECT_TRUE(set.empty());
  EXPECT_TRUE(set.ConsistentForTest());
}

// Against std::set as the model, random inserts/pops/erases on odd capacities.
TEST(FreeBlockSetTest, MatchesOrderedSetModel) {
  for (uint32_t seed = 1; seed <= 20; ++seed) {
    std::printf("FreeBlockSetTest seed=%u\n", seed);
    std::mt19937 rng(seed);
    const int32_t capacity = 1 + static_cast<int32_t>(rng() % 9000);
    FreeBlockSet set(capacity, false);
    std::set<int32_t> model;
    for (int op = 0; op < 5000; ++op) {
      const int32_t id = static_cast<int32_t>(rng() % capacity);
      switch (rng() % 3) {
        case 0:
          if (!model.contains(id)) {
            set.Insert(id);
            model.insert(id);
          }
          break;
        case 1:
          if (!model.empty()) {
            ASSERT_EQ(set.PopLowest(), *model.begin()) << "seed " << seed;
            model.erase(model.begin());
          }
          break;
        case 2:
          if (model.contains(id)) {
            set.Erase(id);
            model.erase(id);
          }
          break;
      }
      ASSERT_EQ(set.size(), static_cast<int32_t>(model.size()));
      ASSERT_EQ(set.Contains(id), model.contains(id));
    }
    ASSERT_TRUE(set.ConsistentForTest()) << "seed " << seed;
  }
}

}  // namespace
}  // namespace kvcm
