// Attach over the shm backend with a real cache manager: the descriptor checks out, and two
// separate executor processes (pool_peer) share the pool: one writes a seeded pattern into
// a sequence's blocks through the layout, another reads it back; this process sees it too.

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/client/cache_manager_client.h"
#include "common/memory/pool_layout.h"
#include "common/memory/pool_memory.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/cache_manager_process.h"
#include "tests/support/status_matchers.h"
#include "tests/support/subprocess.h"

namespace kvcm {
namespace {

using ::kvcm::testing::CacheManagerOptions;
using ::kvcm::testing::CacheManagerProcess;
using ::kvcm::testing::RunProgram;
using ::kvcm::testing::RunResult;
using ::kvcm::testing::StartCacheManager;
using ::testing::HasSubstr;
using ::testing::SizeIs;

// The pool_peer helper is built next to this test binary (the build's tests/ directory);
// found from /proc/self/exe so that the pair can be copied elsewhere and still run.
std::string PoolPeerPath() {
  const std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  return self.substr(0, self.rfind('/') + 1) + "pool_peer";
}

class PoolAttachTest : public ::testing::Test {
 protected:
  void SetUp() override {
    CacheManagerOptions options;
    options.num_blocks = 8;
    options.layers = 3;
    options.kv_heads = 2;
    options.head_dim = 16;
    options.block_size = 4;
    absl::StatusOr<std::unique_ptr<CacheManagerProcess>> cm = StartCacheManager(options);
    ASSERT_THAT(cm, IsOk());
    cm_ = std::move(*cm);
  }

  std::unique_ptr<CacheManagerClient> Connect(wire::Role role) {
    CacheManagerClient::Options options;
    options.endpoint = cm_->endpoint();
    options.role = role;
    options.name = "pool-attach-test";
    absl::StatusOr<std::unique_ptr<CacheManagerClient>> client =
        CacheManagerClient::Connect(options);
    EXPECT_THAT(client, IsOk());
    return client.ok() ? std::move(*client) : nullptr;
  }

  RunResult RunPeer(const std::string& mode, const std::vector<int32_t>& blocks, uint64_t seed) {
    absl::StatusOr<RunResult> result =
        RunProgram({PoolPeerPath(), "--endpoint", cm_->endpoint(), "--mode", mode, "--blocks",
                    absl::StrJoin(blocks, ","), "--seed", absl::StrCat(seed)},
                   "", absl::Seconds(30));
    EXPECT_THAT(result, IsOk());
    return result.ok() ? *result : RunResult{-1, result.status().ToString()};
  }

  std::unique_ptr<CacheManagerProcess> cm_;
};

TEST_F(PoolAttachTest, DescriptorMatchesTheSpecAndTheMappingCoversThePool) {
  std::unique_ptr<CacheManagerClient> executor = Connect(wire::Role::Executor);
  ASSERT_NE(executor, nullptr);
  absl::StatusOr<AttachedPool> pool = executor->Attach();
  ASSERT_THAT(pool, IsOk());
  EXPECT_EQ(pool->view.epoch, cm_->epoch());
  EXPECT_EQ(pool->view.backend, PoolBackend::kShm);
  EXPECT_EQ(pool->view.num_blocks, 8);
  EXPECT_EQ(pool->view.spec.num_layers, 3);
  EXPECT_EQ(pool->view.spec.num_kv_heads, 2);
  EXPECT_EQ(pool->view.spec.head_dim, 16);
  EXPECT_EQ(pool->view.spec.dtype, DType::kFloat16);
  absl::StatusOr<PoolLayout> expected = PoolLayout::For(pool->view.spec, 8);
  ASSERT_THAT(expected, IsOk());
  EXPECT_EQ(pool->view.layout, *expected);
  ASSERT_NE(pool->mapping, nullptr);
  EXPECT_EQ(pool->mapping->backend(), PoolBackend::kShm);
  EXPECT_EQ(pool->mapping->size_bytes(), static_cast<uint64_t>(expected->total_bytes));
  EXPECT_NE(pool->mapping->base(), nullptr);

  // A second attach in the same process maps the same memory again.
  absl::StatusOr<AttachedPool> again = executor->Attach();
  ASSERT_THAT(again, IsOk());
  static_cast<uint8_t*>(pool->mapping->base())[123] = 0x5a;
  EXPECT_EQ(static_cast<const uint8_t*>(again->mapping->base())[123], 0x5a);
}

TEST_F(PoolAttachTest, TwoExecutorProcessesShareBlocksThroughThePool) {
  // The router's view: a sequence and its blocks.
  std::unique_ptr<CacheManagerClient> router = Connect(wire::Role::Router);
  ASSERT_NE(router, nullptr);
  BlockOps step;
  step.Allocate(1, 8);
  absl::StatusOr<std::vector<OpOutcome>> outcomes = router->Step(step);
  ASSERT_THAT(outcomes, IsOk());
  const std::vector<int32_t> blocks = (*outcomes)[0].blocks;
  ASSERT_THAT(blocks, SizeIs(2));

  const uint64_t seed = std::random_device{}();
  std::printf("seed=%llu blocks=%s\n", static_cast<unsigned long long>(seed),
              absl::StrJoin(blocks, ",").c_str());
  RecordProperty("seed", absl::StrCat(seed));

  RunResult written = RunPeer("write", blocks, seed);
  ASSERT_EQ(written.exit_code, 0) << written.output;
  EXPECT_THAT(written.output, HasSubstr(absl::StrCat("attached epoch=", cm_->epoch())));
  RunResult verified = RunPeer("verify", blocks, seed);
  EXPECT_EQ(verified.exit_code, 0) << verified.output;
  RunResult wrong_seed = RunPeer("verify", blocks, seed + 1);
  EXPECT_EQ(wrong_seed.exit_code, 1) << wrong_seed.output;
  EXPECT_THAT(wrong_seed.output, HasSubstr("mismatch"));

  // Blocks nobody wrote are still zero.
  std::vector<int32_t> others;
  for (int32_t b = 0; b < 8; ++b) {
    if (b != blocks[0] && b != blocks[1]) others.push_back(b);
  }
  RunResult zero = RunPeer("zero", others, seed);
  EXPECT_EQ(zero.exit_code, 0) << zero.output;

  // And this process, a third mapping, sees what the writer wrote.
  std::unique_ptr<CacheManagerClient> executor = Connect(wire::Role::Executor);
  ASSERT_NE(executor, nullptr);
  absl::StatusOr<AttachedPool> pool = executor->Attach();
  ASSERT_THAT(pool, IsOk());
  const auto* base = static_cast<const uint8_t*>(pool->mapping->base());
  const int64_t offset = pool->view.layout.Offset(2, 1, blocks[1], 0, 0);  // last layer, V
  bool any_nonzero = false;
  for (int64_t i = 0; i < pool->view.layout.block_stride; ++i) any_nonzero |= base[offset + i] != 0;
  EXPECT_TRUE(any_nonzero);
}

}  // namespace
}  // namespace kvcm
