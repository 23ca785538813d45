// cpu::CopyBlocks: each destination block becomes its source for every layer, K and V;
// every other byte is unchanged.

#include "kernels/copy_blocks.h"

#include <random>
#include <vector>

#include "common/memory/pool_layout.h"
#include "gtest/gtest.h"
#include "tests/support/status_matchers.h"

namespace kvcm::kernels {
namespace {

TEST(CopyBlocksTest, CopiesEveryLayerKAndVAndNothingElse) {
  KvCacheSpec spec;
  spec.num_layers = 3;
  spec.num_kv_heads = 2;
  spec.head_dim = 12;
  spec.block_size = 3;
  spec.dtype = DType::kBFloat16;
  const absl::StatusOr<PoolLayout> layout = PoolLayout::For(spec, 9);
  ASSERT_THAT(layout, IsOk());
  std::vector<uint8_t> pool(static_cast<size_t>(layout->total_bytes));
  std::mt19937_64 rng(3);
  for (uint8_t& b : pool) b = static_cast<uint8_t>(rng());
  const std::vector<uint8_t> before = pool;

  const std::vector<BlockCopy> copies = {{2, 5}, {0, 8}, {7, 1}};
  cpu::CopyBlocks(pool.data(), *layout, copies.data(), static_cast<int32_t>(copies.size()));

  std::vector<uint8_t> want = before;
  for (const BlockCopy& c : copies) {
    for (int32_t layer = 0; layer < spec.num_layers; ++layer) {
      for (int32_t kv = 0; kv < 2; ++kv) {
        const int64_t src = layout->Offset(layer, kv, c.src, 0, 0);
        const int64_t dst = layout->Offset(layer, kv, c.dst, 0, 0);
        for (int64_t i = 0; i < layout->block_stride; ++i) {
          want[static_cast<size_t>(dst + i)] = before[static_cast<size_t>(src + i)];
        }
      }
    }
  }
  EXPECT_TRUE(pool == want);
  cpu::CopyBlocks(pool.data(), *layout, nullptr, 0);  // no copies: nothing happens
  EXPECT_TRUE(pool == want);
}

}  // namespace
}  // namespace kvcm::kernels
