// Attach over the cuda backend (label gpu): the pool lives in the cache manager's
// cudaMalloc; this process and two pool_peer processes open its IPC handle. One peer writes
// a seeded pattern into a sequence's blocks, the other reads it back, and this process sees
// the bytes with cudaMemcpy (CopyFromPool). Skipped when the build has no CUDA or the
// machine no device.

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/client/cache_manager_client.h"
#include "common/memory/pool_layout.h"
#include "common/memory/pool_memory.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/cache_manager_process.h"
#include "tests/support/gpu_test.h"
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

TEST(PoolAttachCudaTest, ExecutorProcessesShareTheDevicePool) {
  if (!CudaBackendCompiled()) GTEST_SKIP() << "built without CUDA";
  KVCM_SKIP_WITHOUT_GPU();
  CacheManagerOptions options;
  options.backend = "cuda";
  options.num_blocks = 8;
  options.layers = 3;
  options.kv_heads = 2;
  options.head_dim = 16;
  options.block_size = 4;
  options.extra_args = {"--cuda-device", "0"};
  absl::StatusOr<std::unique_ptr<CacheManagerProcess>> cm = StartCacheManager(options);
  ASSERT_THAT(cm, IsOk());

  CacheManagerClient::Options client_options;
  client_options.endpoint = (*cm)->endpoint();
  client_options.role = wire::Role::Router;
  client_options.name = "cuda-attach-test";
  absl::StatusOr<std::unique_ptr<CacheManagerClient>> router =
      CacheManagerClient::Connect(client_options);
  ASSERT_THAT(router, IsOk());
  BlockOps step;
  step.Allocate(1, 8);
  absl::StatusOr<std::vector<OpOutcome>> outcomes = (*router)->Step(step);
  ASSERT_THAT(outcomes, IsOk());
  const std::vector<int32_t> blocks = (*outcomes)[0].blocks;
  ASSERT_THAT(blocks, SizeIs(2));

  const uint64_t seed = std::random_device{}();
  std::printf("seed=%llu blocks=%s\n", static_cast<unsigned long long>(seed),
              absl::StrJoin(blocks, ",").c_str());
  auto run_peer = [&](const std::string& mode, uint64_t peer_seed) {
    absl::StatusOr<RunResult> result =
        RunProgram({PoolPeerPath(), "--endpoint", (*cm)->endpoint(), "--mode", mode, "--blocks",
                    absl::StrJoin(blocks, ","), "--seed", absl::StrCat(peer_seed)},
                   "", absl::Seconds(60));
    EXPECT_THAT(result, IsOk());
    return result.ok() ? *result : RunResult{-1, result.status().ToString()};
  };
  const RunResult written = run_peer("write", seed);
  ASSERT_EQ(written.exit_code, 0) << written.output;
  const RunResult verified = run_peer("verify", seed);
  EXPECT_EQ(verified.exit_code, 0) << verified.output;
  const RunResult wrong = run_peer("verify", seed + 1);
  EXPECT_EQ(wrong.exit_code, 1) << wrong.output;

  client_options.role = wire::Role::Executor;
  absl::StatusOr<std::unique_ptr<CacheManagerClient>> executor =
      CacheManagerClient::Connect(client_options);
  ASSERT_THAT(executor, IsOk());
  absl::StatusOr<AttachedPool> pool = (*executor)->Attach();
  ASSERT_THAT(pool, IsOk());
  EXPECT_EQ(pool->view.backend, PoolBackend::kCuda);
  EXPECT_EQ(pool->mapping->backend(), PoolBackend::kCuda);
  EXPECT_EQ(pool->view.layout, *PoolLayout::For(pool->view.spec, 8));
  std::vector<uint8_t> bytes(static_cast<size_t>(pool->view.layout.block_stride));
  ASSERT_THAT(CopyFromPool(*pool->mapping,
                           static_cast<uint64_t>(pool->view.layout.Offset(2, 1, blocks[1], 0, 0)),
                           bytes.data(), bytes.size()),
              IsOk());
  bool any_nonzero = false;
  for (uint8_t b : bytes) any_nonzero |= b != 0;
  EXPECT_TRUE(any_nonzero);
}

}  // namespace
}  // namespace kvcm
