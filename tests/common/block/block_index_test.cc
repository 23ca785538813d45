// BlockIndex against a std::map model under random inserts, duplicate inserts, lookups and
// erases, including hashes crafted to share their home slot and their tag bits (so that
// probe runs wrap around the table and only the full-hash check tells entries apart).
//
// Each seed is printed. To replay one: KVCM_INDEX_SEED=<seed> ./block_index_test

#include "common/block/block_index.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace kvcm {
namespace {

// A hash whose first word is `prefix` and whose other bytes come from `rest`.
BlockHash MakeHash(uint64_t prefix, uint64_t rest) {
  BlockHash h;
  std::memcpy(h.bytes.data(), &prefix, 8);
  std::memcpy(h.bytes.data() + 8, &rest, 8);
  return h;
}

TEST(BlockIndexTest, FindsInsertsAndErasesExactlyAsAMapDoes) {
  std::vector<uint64_t> seeds = {1, 2, 3, 4, 5, 6, 7, 8};
  if (const char* env = std::getenv("KVCM_INDEX_SEED")) seeds = {std::strtoull(env, nullptr, 10)};
  for (uint64_t seed : seeds) {
    std::printf("seed %llu\n", static_cast<unsigned long long>(seed));
    std::mt19937_64 rng(seed);
    constexpr int32_t kBlocks = 64;
    BlockIndex index(kBlocks);
    const uint64_t slots = index.capacity();
    std::printf("capacity %llu slots\n", static_cast<unsigned long long>(slots));
    std::vector<BlockHash> hashes(kBlocks);
    auto hash_of = [&](int32_t b) -> const BlockHash& { return hashes[static_cast<size_t>(b)]; };
    std::map<std::vector<uint8_t>, int32_t> model;  // hash bytes → block
    std::vector<int32_t> block_key(kBlocks, -1);    // which candidate hash a block holds
    // Candidate hashes: few home slots and colliding tags, distinct full hashes.
    std::vector<BlockHash> candidates;
    for (int i = 0; i < 200; ++i) {
      const uint64_t home = slots - 8 + rng() % 6;    // near the end: runs wrap to slot 0
      const uint64_t tag_bits = (rng() % 2) * slots;  // two tags a home, each shared by many
      candidates.push_back(MakeHash(home | tag_bits | (rng() << 32), rng()));
    }
    auto bytes = [](const BlockHash& h) {
      return std::vector<uint8_t>(h.bytes.begin(), h.bytes.end());
    };
    for (int step = 0; step < 20000; ++step) {
      const int op = static_cast<int>(rng() % 3);
      const int32_t block = static_cast<int32_t>(rng() % kBlocks);
      const int c = static_cast<int>(rng() % candidates.size());
      const BlockHash& h = candidates[static_cast<size_t>(c)];
      auto it = model.find(bytes(h));
      if (op == 0 && block_key[static_cast<size_t>(block)] < 0) {
        const int32_t got = index.Insert(h, block, hash_of);
        if (it != model.end()) {
          ASSERT_EQ(got, it->second) << "seed " << seed << " step " << step;
        } else {
          ASSERT_EQ(got, block) << "seed " << seed << " step " << step;
          hashes[static_cast<size_t>(block)] = h;
          model[bytes(h)] = block;
          block_key[static_cast<size_t>(block)] = c;
        }
      } else if (op == 1 && block_key[static_cast<size_t>(block)] >= 0) {
        const BlockHash& held =
            candidates[static_cast<size_t>(block_key[static_cast<size_t>(block)])];
        index.Erase(BlockIndex::TagOf(held), block);
        model.erase(bytes(held));
        block_key[static_cast<size_t>(block)] = -1;
      } else {
        ASSERT_EQ(index.Find(h, hash_of), it == model.end() ? -1 : it->second)
            << "seed " << seed << " step " << step;
      }
      ASSERT_EQ(index.size(), static_cast<int32_t>(model.size()));
    }
    // Everything the model holds is found, and nothing else is listed.
    int32_t listed = 0;
    index.ForEach([&](int32_t b) {
      ++listed;
      ASSERT_GE(block_key[static_cast<size_t>(b)], 0);
    });
    EXPECT_EQ(listed, static_cast<int32_t>(model.size()));
    for (const auto& [key, b] : model) {
      EXPECT_EQ(index.Find(hashes[static_cast<size_t>(b)], hash_of), b);
    }
  }
}

TEST(BlockIndexTest, ATagCollisionIsToldApartByTheFullHash) {
  BlockIndex index(4);
  std::vector<BlockHash> hashes(4);
  auto hash_of = [&](int32_t b) -> const BlockHash& { return hashes[static_cast<size_t>(b)]; };
  const BlockHash a = MakeHash(0x1234, 1);
  const BlockHash b = MakeHash(0x1234, 2);  // same first word: same slot, same tag
  hashes[0] = a;
  ASSERT_EQ(index.Insert(a, 0, hash_of), 0);
  EXPECT_EQ(index.Find(b, hash_of), -1);
  hashes[1] = b;
  ASSERT_EQ(index.Insert(b, 1, hash_of), 1);
  EXPECT_EQ(index.Find(a, hash_of), 0);
  EXPECT_EQ(index.Find(b, hash_of), 1);
  index.Erase(BlockIndex::TagOf(a), 0);
  EXPECT_EQ(index.Find(a, hash_of), -1);
  EXPECT_EQ(index.Find(b, hash_of), 1);
  EXPECT_EQ(index.size(), 1);
}

}  // namespace
}  // namespace kvcm
