// Fencing with real processes (docs/architecture.md, "Fencing"): kvcm-cache-manager, a
// kvcm-executor whose steps take seconds (--fault-layer-delay-ms), a scripted router
// (kvcm-test-router) killed with SIGKILL while the executor is writing its step, and a
// second router allocating at once. The second router never receives a block the executor
// can still write; the blocks come back once the executor acknowledged the fence (after
// abandoning the step) or died. An observer session maps the pool to see the writes.

#include <signal.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/base/run_dir.h"
#include "common/client/cache_manager_client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "services/executor/model/llama_model.h"
#include "tests/services/executor/executor_test_util.h"
#include "tests/support/cache_manager_process.h"
#include "tests/support/status_matchers.h"
#include "tests/support/subprocess.h"
#include "tests/support/wait_for.h"

namespace kvcm::executor {
namespace {

using ::kvcm::testing::CacheManagerOptions;
using ::kvcm::testing::CacheManagerProcess;
using ::kvcm::testing::ExecutorArgs;
using ::kvcm::testing::ExecutorProcess;
using ::kvcm::testing::KvcmBinaryPath;
using ::kvcm::testing::Subprocess;
using ::kvcm::testing::TempDir;
using ::kvcm::testing::WaitFor;
using ::testing::HasSubstr;

constexpr int32_t kNumBlocks = 4;
constexpr int32_t kBlockSize = 16;
constexpr int32_t kPromptTokens = 3 * kBlockSize;  // the dead router's 3 blocks

// Every layer of the executor's step takes this long (--fault-layer-delay-ms): the test
// stops the executor (SIGSTOP) as soon as it sees layer 0 written, and the other layers'
// delays are how late that may come before the step would be over. The executor checks for
// a fence every few milliseconds of a delay, so a longer one costs only the wait for the
// writes that must not come (the first test).
constexpr int32_t kLayerDelayMs = 3000;

// Heartbeat timeout of the cache manager: long enough that no session of the test (the
// observer, the second router, the stopped executor) is quarantined because a loaded machine
// left a process unscheduled, except where a test waits for that on purpose.
constexpr int32_t kHeartbeatTimeoutMs = 30000;

class FencingProcessTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    absl::StatusOr<TempDir> dir = TempDir::Create("kvcm-fence");
    ASSERT_THAT(dir, IsOk());
    dir_ = new TempDir(std::move(*dir));
    const absl::Status made = kvcm::testing::MakeTinyModel(dir_->path() + "/tiny", 11);
    ASSERT_THAT(made, IsOk());
  }
  static void TearDownTestSuite() { delete dir_; }

  // The cache manager, a dead-to-be router bound on the executor socket, an executor whose
  // every layer takes kLayerDelayMs, and an observer mapping the pool. Returns once the
  // executor wrote layer 0 of the router's step and was stopped (SIGSTOP) before its last
  // layer: mid-step, and it stays there until the test sends SIGCONT.
  void StartMidStep(std::vector<std::string> router_extra = {},
                    int32_t heartbeat_timeout_ms = kHeartbeatTimeoutMs) {
    absl::StatusOr<std::unique_ptr<LlamaModel>> model = LlamaModel::Load(dir_->path() + "/tiny");
    ASSERT_THAT(model, IsOk());
    const LlamaConfig& c = (*model)->config();
    num_layers_ = c.num_hidden_layers;
    CacheManagerOptions options;
    options.num_blocks = kNumBlocks;
    options.layers = c.num_hidden_layers;
    options.kv_heads = c.num_key_value_heads;
    options.head_dim = c.head_dim;
    options.dtype = "fp32";
    options.block_size = kBlockSize;
    options.heartbeat_interval_ms = 100;
    options.heartbeat_timeout_ms = heartbeat_timeout_ms;
    absl::StatusOr<std::unique_ptr<CacheManagerProcess>> cm = CacheManagerProcess::Start(options);
    ASSERT_THAT(cm, IsOk());
    cm_ = std::move(*cm);

    absl::StatusOr<TempDir> sockets = TempDir::Create("kvcm-fence-rt");
    ASSERT_THAT(sockets, IsOk());
    sockets_ = std::make_unique<TempDir>(std::move(*sockets));
    const std::string router = IpcEndpointIn(sockets_->path(), kRouterExecutorsSocket);
    Subprocess::Options router_options;
    router_options.argv = {KvcmBinaryPath("kvcm-test-router"),
                           "--router",
                           router,
                           "--cache-manager",
                           cm_->endpoint(),
                           "--prompt-tokens",
                           absl::StrCat(kPromptTokens)};
    router_options.argv.insert(router_options.argv.end(), router_extra.begin(), router_extra.end());
    router_options.output_path = sockets_->path() + "/router.out";
    absl::StatusOr<std::unique_ptr<Subprocess>> dead = Subprocess::Start(router_options);
    ASSERT_THAT(dead, IsOk());
    dead_router_ = std::move(*dead);
    const absl::Time deadline = absl::Now() + absl::Seconds(60);
    auto session = dead_router_->WaitForLine("router: session=([0-9]+)", deadline);
    ASSERT_THAT(session, IsOk()) << dead_router_->Output();
    ASSERT_TRUE(absl::SimpleAtoi((*session)[1], &dead_session_));

    ExecutorArgs args;
    args.model = dir_->path() + "/tiny";
    args.run_dir = cm_->run_dir();
    args.router = router;
    args.extra = {"--fault-layer-delay-ms", absl::StrCat(kLayerDelayMs)};
    absl::StatusOr<ExecutorProcess> executor = kvcm::testing::StartExecutor(args);
    ASSERT_THAT(executor, IsOk());
    executor_ = std::move(*executor);

    auto blocks = dead_router_->WaitForLine("router: blocks=([0-9,]+)", deadline);
    ASSERT_THAT(blocks, IsOk()) << dead_router_->Output();
    for (absl::string_view b : absl::StrSplit((*blocks)[1], ',')) {
      int32_t id = 0;
      ASSERT_TRUE(absl::SimpleAtoi(b, &id));
      dead_blocks_.push_back(id);
    }
    ASSERT_EQ(dead_blocks_.size(), 3u);
    ASSERT_THAT(dead_router_->WaitForLine("router: step sent", deadline), IsOk())
        << dead_router_->Output();

    // The observer: an Executor-role session, so it maps the pool and is waited for too.
    CacheManagerClient::Options observer;
    observer.endpoint = cm_->endpoint();
    observer.role = wire::Role::Executor;
    observer.name = "observer";
    auto client = CacheManagerClient::Connect(observer);
    ASSERT_THAT(client, IsOk());
    observer_ = std::move(*client);
    auto pool = observer_->Attach();
    ASSERT_THAT(pool, IsOk());
    pool_ = std::make_unique<AttachedPool>(std::move(*pool));
    // Mid-step: layer 0 of the first block holds K/V, and the executor sleeps after it.
    // Stopped at once, so that what follows is certain: it can neither write nor
    // acknowledge a fence until SIGCONT.
    const absl::Status mid_step =
        WaitFor([&] { return LayerWritten(0); }, deadline, "layer 0 of the step");
    ASSERT_THAT(mid_step, IsOk()) << "\n" << executor_.Output();
    ASSERT_THAT(executor_.process->Signal(SIGSTOP), IsOk());
    // Each later layer waits kLayerDelayMs first, so this holds unless the test itself was
    // left unscheduled for the rest of the step; then say so rather than fail later.
    ASSERT_FALSE(LayerWritten(num_layers_ - 1))
        << "the executor finished its step before the test could stop it: the machine left "
           "this test unscheduled for "
        << (num_layers_ - 1) * kLayerDelayMs << " ms or more";
  }

  // Whether any byte of layer `layer`'s K of the dead router's first block is non-zero.
  bool LayerWritten(int32_t layer) const {
    const PoolLayout& layout = pool_->view.layout;
    const auto* base = static_cast<const uint8_t*>(pool_->mapping->base()) +
                       layer * layout.layer_stride + dead_blocks_[0] * layout.block_stride;
    return std::any_of(base, base + layout.block_stride, [](uint8_t b) { return b != 0; });
  }

  // A second router, connected now.
  std::unique_ptr<CacheManagerClient> SecondRouter() {
    CacheManagerClient::Options options;
    options.endpoint = cm_->endpoint();
    options.role = wire::Role::Router;
    options.name = "second-router";
    auto client = CacheManagerClient::Connect(options);
    EXPECT_THAT(client, IsOk());
    return client.ok() ? std::move(*client) : nullptr;
  }

  StatsSnapshot Stats() {
    absl::StatusOr<StatsSnapshot> stats = observer_->Stats();
    EXPECT_THAT(stats, IsOk());
    return stats.ok() ? *stats : StatsSnapshot{};
  }

  // Kills the router with SIGKILL and waits until the cache manager saw it die: its blocks
  // drain. Then the observer acknowledges its own fence (it writes nothing).
  void KillRouterAndAcknowledgeAsObserver() {
    ASSERT_THAT(dead_router_->Signal(SIGKILL), IsOk());
    ASSERT_THAT(dead_router_->Wait(absl::Seconds(30)), IsOk());
    const absl::Status fenced = WaitFor([&] { return observer_->PendingFences().size() == 1; },
                                        absl::Seconds(30), "the observer's fence");
    ASSERT_THAT(fenced, IsOk());
    const FenceNotice fence = observer_->PendingFences()[0];
    EXPECT_EQ(fence.router_session, dead_session_);
    ASSERT_THAT(observer_->AcknowledgeFences({&fence.id, 1}), IsOk());
  }

  // With the executor stopped mid-step (it cannot acknowledge, so what follows is certain),
  // kills the router and checks what a second router, returned in `second`, can get: only
  // the one block the dead router did not hold, kept as its sequence 2.
  void KillRouter(std::unique_ptr<CacheManagerClient>* second) {
    ASSERT_NO_FATAL_FAILURE(KillRouterAndAcknowledgeAsObserver());
    *second = SecondRouter();
    ASSERT_NE(*second, nullptr);
    EXPECT_EQ(Stats().draining_blocks, 3);
    EXPECT_TRUE(absl::IsResourceExhausted(Allocate(**second, 1, kNumBlocks).status()));
    absl::StatusOr<std::vector<int32_t>> one = Allocate(**second, 2, 1);
    ASSERT_THAT(one, IsOk());
    ExpectNoneOfTheDeadRoutersBlocks(*one);
  }

  // Allocates `blocks` blocks as sequence `seq` of `router`: the block ids, or the status.
  static absl::StatusOr<std::vector<int32_t>> Allocate(CacheManagerClient& router, uint64_t seq,
                                                       int32_t blocks) {
    BlockOps step;
    step.Allocate(seq, blocks * kBlockSize);
    absl::StatusOr<std::vector<OpOutcome>> outcomes = router.Step(step);
    if (!outcomes.ok()) return outcomes.status();
    if (!(*outcomes)[0].status.ok()) return (*outcomes)[0].status;
    return (*outcomes)[0].blocks;
  }

  void ExpectNoneOfTheDeadRoutersBlocks(const std::vector<int32_t>& blocks) {
    for (int32_t b : blocks) {
      EXPECT_EQ(std::count(dead_blocks_.begin(), dead_blocks_.end(), b), 0)
          << "block " << b << " reissued while the executor may write it";
    }
  }

  static TempDir* dir_;
  int32_t num_layers_ = 0;
  std::unique_ptr<CacheManagerProcess> cm_;
  std::unique_ptr<TempDir> sockets_;
  std::unique_ptr<Subprocess> dead_router_;
  uint64_t dead_session_ = 0;
  std::vector<int32_t> dead_blocks_;
  ExecutorProcess executor_;
  std::unique_ptr<CacheManagerClient> observer_;
  std::unique_ptr<AttachedPool> pool_;
};

TempDir* FencingProcessTest::dir_ = nullptr;

TEST_F(FencingProcessTest, KilledRoutersBlocksWaitForTheExecutorToAbandonItsStep) {
  // 4 layers x 3 s: without fencing the executor writes layers 1-3 long after the kill.
  ASSERT_NO_FATAL_FAILURE(StartMidStep());
  std::unique_ptr<CacheManagerClient> second;
  ASSERT_NO_FATAL_FAILURE(KillRouter(&second));
  BlockOps free;
  free.Free(2);
  ASSERT_THAT(second->Step(free), IsOk());
  EXPECT_EQ(Stats().draining_blocks, 3);

  // Resumed, the executor learns of the fence from its next heartbeat reply, stops at the
  // next layer boundary and acknowledges: the blocks come back.
  ASSERT_THAT(executor_.process->Signal(SIGCONT), IsOk());
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  const absl::Status drained =
      WaitFor([&] { return Stats().draining_blocks == 0; }, deadline, "the blocks to drain");
  ASSERT_THAT(drained, IsOk()) << "\n" << executor_.Output();
  EXPECT_THAT(executor_.Output(), HasSubstr("abandoned step 1 (stopped after layer"));
  // Logged once the acknowledgement was answered, so possibly just after the blocks came back.
  EXPECT_TRUE(executor_.process
                  ->WaitForLine(absl::StrCat("fenced router session ", dead_session_), deadline)
                  .ok())
      << executor_.Output();
  EXPECT_EQ(Stats().open_fences, 0u);
  absl::StatusOr<std::vector<int32_t>> all = Allocate(*second, 3, kNumBlocks);
  ASSERT_THAT(all, IsOk());
  for (int32_t b : dead_blocks_) EXPECT_EQ(std::count(all->begin(), all->end(), b), 1);

  // The new owner's data stays: the executor writes nothing after acknowledging. Fill the
  // blocks with a pattern and wait past two of the executor's layer delays. A fixed wait,
  // to show that something does not happen: a slow machine can only make it miss a late
  // write, never report one that did not come.
  const PoolLayout& layout = pool_->view.layout;
  auto* base = static_cast<uint8_t*>(pool_->mapping->base());
  for (int32_t layer = 0; layer < num_layers_; ++layer) {
    for (int32_t b : dead_blocks_) {
      for (int kv = 0; kv < 2; ++kv) {
        std::memset(
            base + layer * layout.layer_stride + kv * layout.kv_stride + b * layout.block_stride,
            0xAB, static_cast<size_t>(layout.block_stride));
      }
    }
  }
  absl::SleepFor(absl::Milliseconds(2 * kLayerDelayMs));
  for (int32_t layer = 0; layer < num_layers_; ++layer) {
    for (int32_t b : dead_blocks_) {
      for (int kv = 0; kv < 2; ++kv) {
        const uint8_t* p =
            base + layer * layout.layer_stride + kv * layout.kv_stride + b * layout.block_stride;
        EXPECT_TRUE(std::all_of(p, p + layout.block_stride, [](uint8_t x) { return x == 0xAB; }))
            << "layer " << layer << " block " << b << (kv ? " V" : " K") << " was overwritten";
      }
    }
  }
  EXPECT_EQ(executor_.process->Wait(absl::ZeroDuration()).status().code(),
            absl::StatusCode::kDeadlineExceeded)
      << "the executor should keep serving";
}

TEST_F(FencingProcessTest, ASequenceFreedWithDrainWaitsForTheExecutorWhileItsRouterLives) {
  // The router gives up on its step (as on an executor that hung) and frees the sequence
  // with drain while the executor is still writing it; the router itself goes on.
  // The router frees once this file exists (kvcm-test-router --drain-when).
  const std::string give_up = dir_->path() + "/router-gives-up";
  std::remove(give_up.c_str());  // left by an earlier run of this test in the process
  ASSERT_NO_FATAL_FAILURE(StartMidStep({"--drain-when", give_up}));
  // The executor is stopped mid-step (it cannot acknowledge, so what follows is certain):
  // now the router may free.
  std::ofstream(give_up) << "now\n";
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  ASSERT_THAT(dead_router_->WaitForLine("router: freed with drain", deadline), IsOk())
      << dead_router_->Output();
  // The observer (an executor-role session too) honours its sequence fence at once.
  const absl::Status fenced = WaitFor([&] { return observer_->PendingFences().size() == 1; },
                                      deadline, "the observer's fence");
  ASSERT_THAT(fenced, IsOk());
  const FenceNotice fence = observer_->PendingFences()[0];
  EXPECT_EQ(fence.router_session, dead_session_);
  EXPECT_EQ(fence.seqs.size(), 1u);
  ASSERT_THAT(observer_->AcknowledgeFences({&fence.id, 1}), IsOk());

  // The step's blocks are not reissued while the executor may write them.
  std::unique_ptr<CacheManagerClient> second = SecondRouter();
  ASSERT_NE(second, nullptr);
  EXPECT_EQ(Stats().draining_blocks, 3);
  EXPECT_TRUE(absl::IsResourceExhausted(Allocate(*second, 1, kNumBlocks).status()));
  absl::StatusOr<std::vector<int32_t>> one = Allocate(*second, 2, 1);
  ASSERT_THAT(one, IsOk());
  ExpectNoneOfTheDeadRoutersBlocks(*one);
  // Resumed, the executor stops at the next layer boundary and acknowledges: the blocks
  // come back, and the router that freed them is still registered.
  ASSERT_THAT(executor_.process->Signal(SIGCONT), IsOk());
  const absl::Status drained =
      WaitFor([&] { return Stats().draining_blocks == 0; }, deadline, "the blocks to drain");
  ASSERT_THAT(drained, IsOk()) << "\n" << executor_.Output();
  EXPECT_THAT(executor_.Output(), HasSubstr("abandoned step 1 (stopped after layer"));
  EXPECT_TRUE(
      executor_.process->WaitForLine("fenced 1 sequence\\(s\\) of router session", deadline).ok())
      << executor_.Output();
  EXPECT_EQ(Stats().open_fences, 0u);
  EXPECT_EQ(dead_router_->Wait(absl::ZeroDuration()).status().code(),
            absl::StatusCode::kDeadlineExceeded)
      << "the router should live on";
}

TEST_F(FencingProcessTest, KilledRoutersBlocksComeBackWhenItsHungExecutorDies) {
  // Here the stopped executor must outlive its lease: the cache manager's default timeout.
  ASSERT_NO_FATAL_FAILURE(StartMidStep({}, /*heartbeat_timeout_ms=*/5000));
  // Hung (SIGSTOP): it never acknowledges, so only its death can release the blocks.
  std::unique_ptr<CacheManagerClient> second;
  ASSERT_NO_FATAL_FAILURE(KillRouter(&second));
  // Past its lease: quarantined, still waited for.
  const pid_t executor_pid = executor_.process->pid();
  const absl::Status quarantined = WaitFor(
      [&] {
        for (const SessionListing& session : Stats().session_list) {
          if (session.pid == executor_pid && session.quarantined) return true;
        }
        return false;
      },
      absl::Seconds(60), "the stopped executor's session to be quarantined");
  ASSERT_THAT(quarantined, IsOk());
  EXPECT_EQ(Stats().draining_blocks, 3);

  ASSERT_THAT(executor_.process->Signal(SIGKILL), IsOk());
  ASSERT_THAT(executor_.process->Wait(absl::Seconds(30)), IsOk());
  const absl::Status drained = WaitFor([&] { return Stats().draining_blocks == 0; },
                                       absl::Seconds(60), "the blocks to come back");
  ASSERT_THAT(drained, IsOk());
  absl::StatusOr<std::vector<int32_t>> rest = Allocate(*second, 3, kNumBlocks - 1);
  ASSERT_THAT(rest, IsOk());
  EXPECT_EQ(Stats().free_blocks, 0);
}

}  // namespace
}  // namespace kvcm::executor
