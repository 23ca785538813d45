// kvcm-executor on a pool in device memory (label gpu): kvcm-cache-manager --backend cuda,
// the scripted StepDriver in the router's place, and an executor that copies its weights to
// the pool's device and runs every step there (LlamaCudaModel, --cuda-weight-dtype fp32: the
// exact reference option; the 16-bit weights are compared with the CPU's logits in
// llama_model_cuda_test.cc):
//   - batched greedy generation gives exactly the tokens of the in-process CPU reference;
//   - the K/V it wrote is in the shared device pool: this process opens the pool through its
//     own CUDA IPC mapping, copies it out and finds every written element within tolerance
//     of a CPU replay of the same steps into a host pool (fp16 cache: 4e-3 relative, as in
//     llama_model_cuda_test.cc).
//
// Without a device the test skips with "no CUDA device: ..."; with KVCM_REQUIRE_GPU=1
// (scripts/gpu-check.sh sets it) it fails instead.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/client/cache_manager_client.h"
#include "common/memory/pool_layout.h"
#include "common/memory/pool_memory.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "services/executor/model/llama_model.h"
#include "tests/services/executor/executor_test_util.h"
#include "tests/services/executor/step_driver.h"
#include "tests/support/cache_manager_process.h"
#include "tests/support/gpu_test.h"
#include "tests/support/status_matchers.h"
#include "tests/support/subprocess.h"
#include "tools/make_tiny_model/tiny_model.h"

namespace kvcm::executor {
namespace {

using ::kvcm::testing::CacheManagerOptions;
using ::kvcm::testing::ExecutorStack;
using ::kvcm::testing::StepDriver;
using ::kvcm::testing::TempDir;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;

constexpr double kTolerance = 4e-3;  // fp16 cache
constexpr int32_t kBlockSize = 16;
constexpr int32_t kNewTokens = 12;

TEST(ExecutorCudaProcessTest, GreedyTokensEqualTheCpuReferenceAndTheKvIsInTheDevicePool) {
  KVCM_SKIP_WITHOUT_GPU();

  absl::StatusOr<TempDir> dir = TempDir::Create("kvcm-ex-cuda");
  ASSERT_THAT(dir, IsOk());
  TinyModelOptions tiny;
  tiny.seed = 7;
  std::printf("tiny model seed %llu\n", static_cast<unsigned long long>(tiny.seed));
  const std::string model_dir = dir->path() + "/tiny";
  ASSERT_THAT(WriteTinyModel(model_dir, tiny), IsOk());
  absl::StatusOr<std::unique_ptr<LlamaModel>> model = LlamaModel::Load(model_dir);
  ASSERT_THAT(model, IsOk());
  const LlamaConfig& config = (*model)->config();

  CacheManagerOptions manager;
  manager.backend = "cuda";
  manager.extra_args = {"--cuda-device", "0"};
  manager.num_blocks = 256;
  manager.layers = config.num_hidden_layers;
  manager.kv_heads = config.num_key_value_heads;
  manager.head_dim = config.head_dim;
  manager.dtype = "fp16";
  manager.block_size = kBlockSize;
  manager.heartbeat_interval_ms = 100;
  // Not a test of leases: no session may be quarantined because a loaded machine (or a
  // CUDA context being made) kept a process from its heartbeats (docs/RELIABILITY.md,
  // "Timing in tests").
  manager.heartbeat_timeout_ms = 30000;
  ExecutorStack stack;
  const absl::Status started = kvcm::testing::StartExecutorStack(model_dir, manager, &stack,
                                                                 {"--cuda-weight-dtype", "fp32"});
  ASSERT_THAT(started, IsOk());
  EXPECT_EQ(stack.hello.backend, PoolBackend::kCuda);
  EXPECT_THAT(stack.executor.Output(), HasSubstr("copied the weights to CUDA device 0 as fp32"));

  const std::vector<std::vector<int32_t>>& prompts = kvcm::testing::TestPrompts();
  absl::StatusOr<std::vector<StepDriver::Sequence>> seqs =
      stack.driver->Generate(prompts, kNewTokens, /*free_at_end=*/false);
  ASSERT_THAT(seqs, IsOk()) << "\n" << stack.executor.Output();
  for (size_t i = 0; i < prompts.size(); ++i) {
    SCOPED_TRACE(absl::StrCat("prompt ", i));
    EXPECT_THAT((*seqs)[i].generated,
                ElementsAreArray(kvcm::testing::ReferenceGreedy(**model, prompts[i], kNewTokens)));
  }

  // This process opens the device pool too, and copies it out.
  CacheManagerClient::Options client_options;
  client_options.endpoint = stack.cm->endpoint();
  client_options.role = wire::Role::Executor;
  client_options.name = "kv-checker";
  auto client = CacheManagerClient::Connect(client_options);
  ASSERT_THAT(client, IsOk());
  absl::StatusOr<AttachedPool> shared = (*client)->Attach();
  ASSERT_THAT(shared, IsOk());
  ASSERT_EQ(shared->view.backend, PoolBackend::kCuda);
  const PoolLayout& layout = shared->view.layout;
  std::vector<uint8_t> device(static_cast<size_t>(layout.total_bytes));
  ASSERT_THAT(CopyFromPool(*shared->mapping, 0, device.data(), device.size()), IsOk());

  // A CPU replay of the driver's steps into a host pool of the same layout.
  std::vector<uint8_t> local(static_cast<size_t>(layout.total_bytes), 0);
  PoolView local_pool = shared->view;
  local_pool.base = local.data();
  local_pool.backend = PoolBackend::kShm;
  local_pool.cuda_device = -1;
  ASSERT_THAT(kvcm::testing::ReplaySteps(**model, stack.driver->sent_steps(), local_pool), IsOk());

  double worst = 0;
  int64_t compared = 0;
  for (const StepDriver::Sequence& seq : *seqs) {
    kvcm::testing::ForEachWrittenKvVector(
        layout, shared->view.spec, seq.blocks, seq.committed, [&](int64_t at) {
          worst = std::max(worst, kvcm::testing::WorstKvVectorError(device.data(), local.data(), at,
                                                                    layout, shared->view.spec));
          compared += shared->view.spec.head_dim;
        });
  }
  std::printf("compared %lld K/V elements: worst relative error %.3g (tolerance %.1g)\n",
              static_cast<long long>(compared), worst, kTolerance);
  EXPECT_GT(compared, 0);
  EXPECT_LE(worst, kTolerance);
  ASSERT_THAT(stack.driver->Free(*seqs), IsOk());
}

}  // namespace
}  // namespace kvcm::executor
