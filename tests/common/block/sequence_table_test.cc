// SequenceTable against std::map under random inserts, lookups and erases, with ids that
// collide in the low bits, the high bits, or count up (the shapes routers use), through
// several growths. Each seed is printed.

#include "common/block/sequence_table.h"

#include <cstdio>
#include <map>
#include <random>

#include "gtest/gtest.h"

namespace kvcm {
namespace {

TEST(SequenceTableTest, BehavesAsAMapThroughGrowthAndErasure) {
  for (uint64_t seed : {11u, 12u, 13u, 14u}) {
    std::printf("seed %llu\n", static_cast<unsigned long long>(seed));
    std::mt19937_64 rng(seed);
    SequenceTable table;
    std::map<uint64_t, int32_t> model;
    auto random_id = [&]() -> uint64_t {
      switch (rng() % 3) {
        case 0:
          return rng() % 300;  // small, counting ids
        case 1:
          return (rng() % 300) << 40;  // differ in high bits only
        default:
          return 0xffffffff00000000ULL | (rng() % 300);
      }
    };
    for (int step = 0; step < 50000; ++step) {
      const uint64_t id = random_id();
      const auto it = model.find(id);
      switch (rng() % 3) {
        case 0:
          if (it == model.end()) {
            const auto slot = static_cast<int32_t>(rng() % 1000);
            table.Insert(id, slot);
            model[id] = slot;
          }
          break;
        case 1:
          ASSERT_EQ(table.Erase(id), it != model.end()) << "seed " << seed << " step " << step;
          if (it != model.end()) model.erase(it);
          break;
        default:
          ASSERT_EQ(table.Find(id), it == model.end() ? -1 : it->second)
              << "seed " << seed << " step " << step;
      }
      ASSERT_EQ(table.size(), model.size());
    }
    size_t listed = 0;
    table.ForEach([&](uint64_t id, int32_t slot) {
      ++listed;
      EXPECT_EQ(model.at(id), slot);
    });
    EXPECT_EQ(listed, model.size());
  }
}

}  // namespace
}  // namespace kvcm
