// The real kvcm-cache-manager with a model whose layers are of two attention types
// (docs/architecture.md, "The hybrid KV cache"): it announces its KV cache groups in
// HelloReply and the pool descriptor, a Step's Allocate returns every group's table, a
// commit past the window gives back the window group's blocks only, a prefix hits in every
// group, and the tiers, which do not know groups, are refused by their flags (the
// vLLM-format KV events serve groups: vllm_events_process_test).
// --sliding-window-tokens 0 keeps the model in one table. Every test checks that the pool
// is whole afterwards.

#include <algorithm>
#include <string>
#include <vector>

#include "common/wire/step_codec.h"
#include "gmock/gmock.h"
#include "tests/services/cache_manager/live_cache_manager.h"
#include "tests/support/mixed_model_config.h"
#include "tests/support/status_matchers.h"

namespace kvcm::live_test {
namespace {

constexpr int32_t kWindow = 8;  // tokens; 2 blocks of kBlockSize
constexpr int32_t kPages = 64;

CacheManagerOptions MixedOptions(const std::string& config) {
  CacheManagerOptions options;
  options.layers = 0;  // the shape comes from the config
  options.kv_heads = 0;
  options.head_dim = 0;
  options.dtype = "";
  options.num_blocks = kPages;
  options.block_size = kBlockSize;
  options.heartbeat_timeout_ms = kGenerousHeartbeatTimeoutMs;
  options.extra_args = {"--model-config", config};
  return options;
}

std::vector<BlockHash> Hashes(int32_t n) {
  std::vector<BlockHash> hashes(static_cast<size_t>(n));
  for (int32_t i = 0; i < n; ++i) {
    hashes[static_cast<size_t>(i)].bytes[0] = static_cast<uint8_t>(i + 1);
    hashes[static_cast<size_t>(i)].bytes[31] = 0x6b;
  }
  return hashes;
}

TEST(CacheManagerGroupsTest, AMixedModelGetsAGroupPerAttentionType) {
  auto dir = kvcm::testing::TempDir::Create("kvcm-groups");
  ASSERT_THAT(dir, IsOk());
  auto manager = CacheManagerProcess::Start(
      MixedOptions(testing::WriteMixedModelConfig(dir->path(), kWindow)));
  ASSERT_THAT(manager, IsOk());
  EXPECT_NE((*manager)->Output().find("KV cache groups"), std::string::npos)
      << (*manager)->Output();

  auto router = Connect(**manager);
  ASSERT_NE(router, nullptr);
  EXPECT_EQ(router->session().group_windows, (std::vector<int32_t>{0, kWindow}));
  EXPECT_EQ(router->session().num_blocks, kPages);
  auto executor = Connect(**manager, wire::Role::Executor);
  ASSERT_NE(executor, nullptr);
  auto attached = executor->Attach();
  ASSERT_THAT(attached, IsOk());
  // Pages of one layer slot: each group has one layer.
  EXPECT_EQ(attached->view.spec.num_layers, 1);
  EXPECT_EQ(attached->view.spec.num_kv_heads, 2);
  EXPECT_EQ(attached->view.spec.head_dim, 16);
  EXPECT_EQ(attached->view.num_blocks, kPages);
  ASSERT_EQ(attached->view.kv_groups.size(), 2u);
  EXPECT_EQ(attached->view.kv_groups[0], (KvCacheGroup{.window = 0, .layers = {0}}));
  EXPECT_EQ(attached->view.kv_groups[1], (KvCacheGroup{.window = kWindow, .layers = {1}}));

  // 40 tokens: 10 blocks in each group.
  const std::vector<BlockHash> hashes = Hashes(10);
  BlockOps step;
  step.Allocate(1, 40, hashes);
  auto allocated = router->Step(step);
  ASSERT_THAT(allocated, IsOk());
  ASSERT_THAT((*allocated)[0].status, IsOk());
  EXPECT_EQ((*allocated)[0].blocks.size(), 10u);
  EXPECT_EQ((*allocated)[0].group_blocks.size(), 10u);
  auto stats = router->Stats();
  ASSERT_THAT(stats, IsOk());
  EXPECT_EQ(stats->in_use_blocks, 20);
  EXPECT_EQ(stats->spec.num_layers, 1);
  ExpectWhole(*stats);

  // Committed to 40, the window group reads from token 33 on: its blocks 0..7 go back to
  // the pool (cached, for prefix hits); the full group keeps all 10.
  step.Clear();
  step.Commit(1, 40);
  ASSERT_THAT(router->Step(step), IsOk());
  stats = router->Stats();
  ASSERT_THAT(stats, IsOk());
  EXPECT_EQ(stats->in_use_blocks, 12);
  EXPECT_EQ(stats->cached_blocks, 8);
  ExpectWhole(*stats);
  // DescribeSession reports both tables, the window group's released entries as -1.
  auto described = router->DescribeSession();
  ASSERT_THAT(described, IsOk());
  ASSERT_EQ(described->sequences.size(), 1u);
  EXPECT_EQ(described->sequences[0].num_committed_tokens, 40);
  EXPECT_EQ(described->sequences[0].blocks, (*allocated)[0].blocks);
  std::vector<BlockId> window_table = (*allocated)[0].group_blocks;
  std::fill(window_table.begin(), window_table.begin() + 8, kNoBlock);
  EXPECT_EQ(described->sequences[0].group_blocks, window_table);

  // The same prompt again hits in both groups: up to the block of its last token.
  step.Clear();
  step.Free(1).Allocate(2, 40, hashes);
  auto again = router->Step(step);
  ASSERT_THAT(again, IsOk());
  ASSERT_THAT((*again)[1].status, IsOk());
  EXPECT_EQ((*again)[1].num_cached_tokens, 36);
  EXPECT_EQ((*again)[1].group_blocks.size(), 10u);
  for (size_t i = 0; i < 9; ++i) EXPECT_EQ((*again)[1].blocks[i], (*allocated)[0].blocks[i]) << i;
  // The window group needs only the blocks its first computed query reads (7 and 8).
  EXPECT_EQ((*again)[1].group_blocks[8], (*allocated)[0].group_blocks[8]);

  // An Append grows every group.
  step.Clear();
  step.Append(2, 4);
  auto appended = router->Step(step);
  ASSERT_THAT(appended, IsOk());
  ASSERT_THAT((*appended)[0].status, IsOk());
  EXPECT_EQ((*appended)[0].blocks.size(), 1u);
  EXPECT_EQ((*appended)[0].group_blocks.size(), 1u);

  step.Clear();
  step.Free(2);
  ASSERT_THAT(router->Step(step), IsOk());
  stats = router->Stats();
  ASSERT_THAT(stats, IsOk());
  EXPECT_EQ(stats->in_use_blocks, 0);
  ExpectWhole(*stats);
}

TEST(CacheManagerGroupsTest, CanAllocateCountsEveryGroupsBlocks) {
  auto dir = kvcm::testing::TempDir::Create("kvcm-groups");
  ASSERT_THAT(dir, IsOk());
  auto manager = CacheManagerProcess::Start(
      MixedOptions(testing::WriteMixedModelConfig(dir->path(), kWindow)));
  ASSERT_THAT(manager, IsOk());
  auto router = Connect(**manager);
  ASSERT_NE(router, nullptr);
  BlockOps step;
  step.CanAllocate(40);
  auto plan = router->Step(step);
  ASSERT_THAT(plan, IsOk());
  ASSERT_THAT((*plan)[0].status, IsOk());
  EXPECT_EQ((*plan)[0].blocks_needed, 20);
  // Both groups together do not fit a prompt of more than half the pages.
  step.Clear();
  step.Allocate(1, (kPages / 2 + 1) * kBlockSize);
  auto refused = router->Step(step);
  ASSERT_THAT(refused, IsOk());
  EXPECT_EQ((*refused)[0].status.code(), absl::StatusCode::kResourceExhausted);
  auto stats = router->Stats();
  ASSERT_THAT(stats, IsOk());
  EXPECT_EQ(stats->in_use_blocks, 0);
  ExpectWhole(*stats);
}

TEST(CacheManagerGroupsTest, SlidingWindowZeroKeepsOneTable) {
  auto dir = kvcm::testing::TempDir::Create("kvcm-groups");
  ASSERT_THAT(dir, IsOk());
  CacheManagerOptions options = MixedOptions(testing::WriteMixedModelConfig(dir->path(), kWindow));
  options.extra_args.insert(options.extra_args.end(), {"--sliding-window-tokens", "0"});
  auto manager = CacheManagerProcess::Start(options);
  ASSERT_THAT(manager, IsOk());
  auto router = Connect(**manager);
  ASSERT_NE(router, nullptr);
  EXPECT_TRUE(router->session().group_windows.empty());
  EXPECT_EQ(router->session().sliding_window_tokens, 0);
  auto executor = Connect(**manager, wire::Role::Executor);
  ASSERT_NE(executor, nullptr);
  auto attached = executor->Attach();
  ASSERT_THAT(attached, IsOk());
  EXPECT_EQ(attached->view.spec.num_layers, 2);
  EXPECT_TRUE(attached->view.kv_groups.empty());
  BlockOps step;
  step.Allocate(1, 40, Hashes(10));
  auto allocated = router->Step(step);
  ASSERT_THAT(allocated, IsOk());
  EXPECT_EQ((*allocated)[0].blocks.size(), 10u);
  EXPECT_TRUE((*allocated)[0].group_blocks.empty());
  step.Clear();
  step.Commit(1, 40);
  ASSERT_THAT(router->Step(step), IsOk());
  auto stats = router->Stats();
  ASSERT_THAT(stats, IsOk());
  EXPECT_EQ(stats->in_use_blocks, 10);  // every block kept
  ExpectWhole(*stats);
}

TEST(CacheManagerGroupsTest, FeaturesWithoutGroupsAreRefusedByTheirFlags) {
  auto dir = kvcm::testing::TempDir::Create("kvcm-groups");
  ASSERT_THAT(dir, IsOk());
  const std::string config = testing::WriteMixedModelConfig(dir->path(), kWindow);
  const std::vector<std::vector<std::string>> cases = {
      {"--host-tier-bytes", "1MiB"},
      {"--disk-tier-dir", dir->path() + "/disk", "--disk-tier-bytes", "1MiB"},
  };
  for (const std::vector<std::string>& flags : cases) {
    SCOPED_TRACE(flags[0]);
    std::vector<std::string> argv = {kvcm::testing::KvcmBinaryPath("kvcm-cache-manager"),
                                     "--run-dir",
                                     dir->path() + "/run",
                                     "--backend",
                                     "shm",
                                     "--model-config",
                                     config,
                                     "--num-blocks",
                                     "16",
                                     "--metrics-address",
                                     "127.0.0.1:0"};
    argv.insert(argv.end(), flags.begin(), flags.end());
    auto run = kvcm::testing::RunProgram(argv, "", absl::Seconds(30));
    ASSERT_THAT(run, IsOk());
    EXPECT_EQ(run->exit_code, 1) << run->output;
    EXPECT_NE(run->output.find(flags[0]), std::string::npos) << run->output;
    EXPECT_NE(run->output.find("do not support KV cache groups yet"), std::string::npos)
        << run->output;
    EXPECT_NE(run->output.find("--sliding-window-tokens 0"), std::string::npos) << run->output;
  }
}

}  // namespace
}  // namespace kvcm::live_test
