// PoolCopier and HostBuffer on a shm pool (the cuda side: kv_tiers_cuda_test, label gpu).

#include "common/memory/pool_copier.h"

#include <cstdint>
#include <numeric>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/status_matchers.h"

namespace kvcm {
namespace {

TEST(PoolCopierTest, GatherAndScatterMoveTheRunsInOrder) {
  auto pool = CreateShmPoolMemory(1 << 16, "pool-copier-test");
  ASSERT_THAT(pool, IsOk());
  auto* base = static_cast<uint8_t*>((*pool)->base());
  std::iota(base, base + (1 << 16), uint8_t{0});
  auto copier = PoolCopier::Create(pool->get());
  ASSERT_THAT(copier, IsOk());
  const PoolCopier::Run runs[] = {{4096, 3}, {100, 2}, {65533, 3}};
  std::vector<uint8_t> out(8, 0xEE);
  ASSERT_THAT((*copier)->Gather(runs, out.data()), IsOk());
  EXPECT_THAT(out, ::testing::ElementsAre(0, 1, 2, 100, 101, 253, 254, 255));
  const std::vector<uint8_t> in = {9, 8, 7, 6, 5, 4, 3, 2};
  ASSERT_THAT((*copier)->Scatter(in.data(), runs), IsOk());
  EXPECT_EQ(base[4096], 9);
  EXPECT_EQ(base[4098], 7);
  EXPECT_EQ(base[100], 6);
  EXPECT_EQ(base[101], 5);
  EXPECT_EQ(base[65535], 2);
}

TEST(PoolCopierTest, ARunOutsideThePoolCopiesNothing) {
  auto pool = CreateShmPoolMemory(4096, "pool-copier-test");
  ASSERT_THAT(pool, IsOk());
  auto copier = PoolCopier::Create(pool->get());
  ASSERT_THAT(copier, IsOk());
  const PoolCopier::Run runs[] = {{0, 4}, {4094, 4}};
  std::vector<uint8_t> out(8, 0xEE);
  EXPECT_THAT((*copier)->Gather(runs, out.data()), StatusIs(absl::StatusCode::kOutOfRange));
  EXPECT_EQ(out, std::vector<uint8_t>(8, 0xEE));
  EXPECT_THAT((*copier)->Scatter(out.data(), runs), StatusIs(absl::StatusCode::kOutOfRange));
  EXPECT_EQ(static_cast<uint8_t*>((*pool)->base())[0], 0);
}

TEST(HostBufferTest, ShmBuffersAreAlignedForDirectIoAndMove) {
  auto buffer = HostBuffer::Allocate(PoolBackend::kShm, 10000);
  ASSERT_THAT(buffer, IsOk());
  EXPECT_EQ(reinterpret_cast<uintptr_t>(buffer->data()) % 4096, 0u);
  EXPECT_FALSE(buffer->page_locked());
  buffer->data()[9999] = 1;
  HostBuffer moved = *std::move(buffer);
  EXPECT_EQ(moved.size(), 10000u);
  EXPECT_EQ(moved.data()[9999], 1);
  EXPECT_THAT(PinForDevice(PoolBackend::kShm, moved.data(), moved.size()), IsOk());
}

}  // namespace
}  // namespace kvcm
