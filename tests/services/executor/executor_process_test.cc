// kvcm-executor as a real process, with a real kvcm-cache-manager and the scripted
// StepDriver in the router's place:
// - batched greedy generation equals the in-process contiguous reference, and the K/V the
//   executor wrote into the shared pool is, bitwise, what an in-process paged Forward writes
//   into a local pool with the same layout and block tables;
// - bad model folders and a pool of another shape stop it at start with a clear message;
// - malformed and inconsistent steps get error replies and it keeps serving;
// - SIGTERM mid-step: the step is answered, Goodbye to both peers, exit 0;
// - a cache-manager restart: it re-attaches to the new epoch without reloading weights.

#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/base/run_dir.h"
#include "common/client/cache_manager_client.h"
#include "common/memory/pool_layout.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "services/executor/model/llama_model.h"
#include "services/executor/model/sampler.h"
#include "tests/services/executor/executor_test_util.h"
#include "tests/services/executor/step_driver.h"
#include "tests/support/cache_manager_process.h"
#include "tests/support/promtool.h"
#include "tests/support/status_matchers.h"
#include "tests/support/subprocess.h"
#include "tests/support/wait_for.h"
#include "tools/make_tiny_model/tiny_model.h"

namespace kvcm::executor {
namespace {

using ::kvcm::testing::CacheManagerOptions;
using ::kvcm::testing::CacheManagerProcess;
using ::kvcm::testing::ExecutorArgs;
using ::kvcm::testing::ExecutorProcess;
using ::kvcm::testing::KvcmBinaryPath;
using ::kvcm::testing::MetricsText;
using ::kvcm::testing::RunProgram;
using ::kvcm::testing::RunResult;
using ::kvcm::testing::StepDriver;
using ::kvcm::testing::TempDir;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;

constexpr uint64_t kModelSeed = 7;
constexpr int32_t kNumBlocks = 256;

const std::vector<std::vector<int32_t>>& kPrompts = kvcm::testing::TestPrompts();

// The tiny model, made once by kvcm-make-tiny-model, and the in-process reference.
class ExecutorProcessTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    absl::StatusOr<TempDir> dir = TempDir::Create("kvcm-ex");
    ASSERT_THAT(dir, IsOk());
    dir_ = new TempDir(std::move(*dir));
    model_dir_ = new std::string(dir_->path() + "/tiny");
    const absl::Status made = kvcm::testing::MakeTinyModel(*model_dir_, kModelSeed);
    ASSERT_THAT(made, IsOk());
    // One thread here, two in the executor: the K/V comparison below also checks that the
    // thread count does not change a bit.
    LlamaModelOptions model_options;
    model_options.num_threads = 1;
    absl::StatusOr<std::unique_ptr<LlamaModel>> model =
        LlamaModel::Load(*model_dir_, model_options);
    ASSERT_THAT(model, IsOk());
    model_ = model->release();
  }
  static void TearDownTestSuite() {
    delete model_;
    delete model_dir_;
    delete dir_;
  }

  const LlamaConfig& config() const { return model_->config(); }

  CacheManagerOptions ManagerOptions(const std::string& dtype, int32_t block_size) const {
    CacheManagerOptions options;
    options.num_blocks = kNumBlocks;
    options.layers = config().num_hidden_layers;
    options.kv_heads = config().num_key_value_heads;
    options.head_dim = config().head_dim;
    options.dtype = dtype;
    options.block_size = block_size;
    options.heartbeat_interval_ms = 100;
    // No test here is about leases: no session (the driver's, the executor's) may be
    // quarantined because a loaded machine left it unscheduled (docs/RELIABILITY.md,
    // "Timing in tests").
    options.heartbeat_timeout_ms = 30000;
    return options;
  }

  // A cache manager, the driver bound on `router` and an executor registered with it.
  void StartAll(const CacheManagerOptions& manager_options) {
    kvcm::testing::ExecutorStack stack;
    const absl::Status started =
        kvcm::testing::StartExecutorStack(*model_dir_, manager_options, &stack);
    cm_ = std::move(stack.cm);
    if (stack.sockets.has_value()) sockets_.emplace(std::move(*stack.sockets));
    router_ = stack.router;
    driver_ = std::move(stack.driver);
    executor_ = std::move(stack.executor);
    ASSERT_THAT(started, IsOk());
    EXPECT_EQ(executor_.epoch, cm_->epoch());
    EXPECT_EQ(stack.hello.name, "exec-test");
    EXPECT_EQ(stack.hello.model.name, "tiny");
    EXPECT_EQ(stack.hello.num_blocks, kNumBlocks);
    EXPECT_EQ(stack.hello.kv_spec.num_layers, config().num_hidden_layers);
    EXPECT_EQ(driver_->hello_epoch(), cm_->epoch());
  }

  static std::vector<int32_t> ReferenceGreedy(std::vector<int32_t> tokens, int32_t n) {
    return kvcm::testing::ReferenceGreedy(*model_, std::move(tokens), n);
  }

  double Metric(const std::string& name, const kvcm::testing::MetricLabels& labels = {}) {
    absl::StatusOr<MetricsText> text = kvcm::testing::ScrapeMetrics(executor_.metrics_url);
    EXPECT_THAT(text, IsOk());
    if (!text.ok()) return -1;
    absl::StatusOr<double> value = text->Value(name, labels);
    EXPECT_THAT(value, IsOk()) << name << ": " << value.status();
    return value.ok() ? *value : -1;
  }

  static TempDir* dir_;
  static std::string* model_dir_;
  static LlamaModel* model_;
  std::unique_ptr<CacheManagerProcess> cm_;
  std::optional<TempDir> sockets_;
  std::string router_;
  std::unique_ptr<StepDriver> driver_;
  ExecutorProcess executor_;
};

TempDir* ExecutorProcessTest::dir_ = nullptr;
std::string* ExecutorProcessTest::model_dir_ = nullptr;
LlamaModel* ExecutorProcessTest::model_ = nullptr;

// ---- THE test -------------------------------------------------------------------------------

class ExecutorGenerationTest
    : public ExecutorProcessTest,
      public ::testing::WithParamInterface<std::pair<std::string, int32_t>> {};

TEST_P(ExecutorGenerationTest, BatchedGreedyTokensEqualTheReferenceAndTheKvIsInThePool) {
  const auto [dtype, block_size] = GetParam();
  ASSERT_NO_FATAL_FAILURE(StartAll(ManagerOptions(dtype, block_size)));
  constexpr int32_t kNewTokens = 12;

  absl::StatusOr<std::vector<StepDriver::Sequence>> seqs =
      driver_->Generate(kPrompts, kNewTokens, /*free_at_end=*/false);
  ASSERT_THAT(seqs, IsOk()) << "\n" << executor_.Output();
  for (size_t i = 0; i < kPrompts.size(); ++i) {
    SCOPED_TRACE(absl::StrCat("prompt ", i, " of ", kPrompts[i].size(), " tokens"));
    EXPECT_THAT((*seqs)[i].generated, ElementsAreArray(ReferenceGreedy(kPrompts[i], kNewTokens)));
  }

  // This process attaches to the pool too (a second mapping of the same memory) ...
  CacheManagerClient::Options client_options;
  client_options.endpoint = cm_->endpoint();
  client_options.role = wire::Role::Executor;
  client_options.name = "kv-checker";
  auto client = CacheManagerClient::Connect(client_options);
  ASSERT_THAT(client, IsOk());
  absl::StatusOr<AttachedPool> shared = (*client)->Attach();
  ASSERT_THAT(shared, IsOk());
  ASSERT_EQ(shared->view.backend, PoolBackend::kShm);
  // ... and replays the driver's steps with an in-process paged Forward into a local pool of
  // the same layout and block tables.
  std::vector<uint8_t> local(static_cast<size_t>(shared->view.layout.total_bytes), 0);
  PoolView local_pool = shared->view;
  local_pool.base = local.data();
  ASSERT_THAT(kvcm::testing::ReplaySteps(*model_, driver_->sent_steps(), local_pool), IsOk());

  // Every written (layer, K|V, position, head) vector of every sequence: bitwise equal. The
  // same model code, tokens, positions and batches give the same bits (the model's matmuls
  // and the attention kernel reduce in a fixed order whatever the thread count).
  const auto* pool_bytes = static_cast<const uint8_t*>(shared->mapping->base());
  const PoolLayout& layout = shared->view.layout;
  const size_t head_bytes = static_cast<size_t>(layout.elem_bytes * shared->view.spec.head_dim);
  int64_t compared = 0;
  int64_t differing = 0;
  bool any_nonzero = false;
  for (const StepDriver::Sequence& seq : *seqs) {
    ASSERT_EQ(seq.committed, seq.prompt_len + kNewTokens - 1);
    kvcm::testing::ForEachWrittenKvVector(
        layout, shared->view.spec, seq.blocks, seq.committed, [&](int64_t offset) {
          const uint8_t* got = pool_bytes + offset;
          differing += std::memcmp(got, local.data() + offset, head_bytes) != 0;
          for (size_t b = 0; b < head_bytes && !any_nonzero; ++b) any_nonzero = got[b] != 0;
          ++compared;
        });
  }
  std::printf("compared %lld K/V head vectors (%s, block size %d): %lld differ\n",
              static_cast<long long>(compared), dtype.c_str(), block_size,
              static_cast<long long>(differing));
  EXPECT_EQ(differing, 0);
  EXPECT_TRUE(any_nonzero);
  ASSERT_THAT(driver_->Free(*seqs), IsOk());

  EXPECT_EQ(Metric("kvcm_executor_steps_total"), kNewTokens);
  EXPECT_EQ(Metric("kvcm_executor_tokens_processed_total", {{"phase", "prefill"}}), 5 + 11 + 17);
  EXPECT_EQ(Metric("kvcm_executor_tokens_processed_total", {{"phase", "decode"}}),
            3 * (kNewTokens - 1));
  EXPECT_EQ(Metric("kvcm_executor_tokens_sampled_total"), 3 * kNewTokens);
  EXPECT_EQ(Metric("kvcm_executor_attaches_total"), 1);
  EXPECT_EQ(Metric("kvcm_executor_model_loads_total"), 1);
  EXPECT_EQ(Metric("kvcm_executor_epoch"), static_cast<double>(cm_->epoch()));
  EXPECT_EQ(Metric("kvcm_executor_mapped_bytes"), static_cast<double>(layout.total_bytes));
  auto body = kvcm::testing::HttpGet(executor_.metrics_url);
  ASSERT_THAT(body, IsOk());
  auto lint = kvcm::testing::PromtoolCheckMetrics(body->body);
  ASSERT_THAT(lint, IsOk());
  EXPECT_EQ(lint->exit_code, 0) << lint->output;
}

INSTANTIATE_TEST_SUITE_P(PoolShapes, ExecutorGenerationTest,
                         ::testing::Values(std::make_pair(std::string("fp32"), 4),
                                           std::make_pair(std::string("fp16"), 16)),
                         [](const auto& test_param) {
                           return absl::StrCat(test_param.param.first, "_block",
                                               test_param.param.second);
                         });

// ---- Start-up failures ------------------------------------------------------------------------

// Runs the executor on `folder` (no cache manager is needed: the model loads first) and
// returns its exit code and output.
RunResult RunOnFolder(const std::string& folder) {
  ExecutorArgs args;
  args.model = folder;
  args.run_dir = "/nonexistent-kvcm-run-dir";
  args.router = "ipc:///nonexistent-kvcm-run-dir/router.sock";
  absl::StatusOr<RunResult> result =
      RunProgram(kvcm::testing::ExecutorArgv(args), "", absl::Seconds(60));
  EXPECT_THAT(result, IsOk());
  return result.ok() ? *result : RunResult{-1, result.status().ToString()};
}

TEST_F(ExecutorProcessTest, BadModelFoldersStopItWithTheProblemNamed) {
  namespace fs = std::filesystem;
  TinyModelOptions options;
  options.seed = kModelSeed;
  struct Case {
    const char* what;
    void (*spoil)(const std::string& folder, const TinyModelOptions& options);
    std::vector<const char*> needles;
  };
  const Case cases[] = {
      {"missing config.json",
       [](const std::string& folder, const TinyModelOptions&) {
         fs::remove(folder + "/config.json");
       },
       {"config.json"}},
      {"truncated safetensors",
       [](const std::string& folder, const TinyModelOptions&) {
         const std::string file = folder + "/model.safetensors";
         fs::resize_file(file, fs::file_size(file) / 2);
       },
       {"model.safetensors"}},
      {"missing tensor (config asks for a fifth layer)",
       [](const std::string& folder, const TinyModelOptions& o) {
         TinyModelOptions more = o;
         more.num_layers = o.num_layers + 1;
         std::FILE* f = std::fopen((folder + "/config.json").c_str(), "w");
         const std::string json = TinyModelConfigJson(more);
         std::fwrite(json.data(), 1, json.size(), f);
         std::fclose(f);
       },
       {"model.layers.4."}},
      {"wrong shape (config says intermediate_size 96)",
       [](const std::string& folder, const TinyModelOptions& o) {
         TinyModelOptions other = o;
         other.intermediate_size = 96;
         std::FILE* f = std::fopen((folder + "/config.json").c_str(), "w");
         const std::string json = TinyModelConfigJson(other);
         std::fwrite(json.data(), 1, json.size(), f);
         std::fclose(f);
       },
       {"mlp", "96"}},
  };
  int index = 0;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    const std::string folder = absl::StrCat(dir_->path(), "/bad", index++);
    ASSERT_THAT(WriteTinyModel(folder, options), IsOk());
    c.spoil(folder, options);
    const RunResult result = RunOnFolder(folder);
    EXPECT_EQ(result.exit_code, 1) << result.output;
    EXPECT_THAT(result.output, HasSubstr("cannot load the model from " + folder));
    for (const char* needle : c.needles) EXPECT_THAT(result.output, HasSubstr(needle));
    EXPECT_THAT(result.output, ::testing::Not(HasSubstr("ready")));
  }
  const RunResult missing = RunOnFolder(dir_->path() + "/no-such-model");
  EXPECT_EQ(missing.exit_code, 1) << missing.output;
  EXPECT_THAT(missing.output, HasSubstr("no-such-model"));
}

TEST_F(ExecutorProcessTest, APoolOfAnotherShapeStopsItWithBothShapes) {
  CacheManagerOptions options = ManagerOptions("fp32", 4);
  options.layers = 2;
  options.head_dim = 8;
  auto cm = CacheManagerProcess::Start(options);
  ASSERT_THAT(cm, IsOk());
  ExecutorArgs args;
  args.model = *model_dir_;
  args.run_dir = (*cm)->run_dir();
  args.router = IpcEndpointIn((*cm)->run_dir(), kRouterExecutorsSocket);
  absl::StatusOr<RunResult> result =
      RunProgram(kvcm::testing::ExecutorArgv(args), "", absl::Seconds(60));
  ASSERT_THAT(result, IsOk());
  EXPECT_EQ(result->exit_code, 1) << result->output;
  EXPECT_THAT(result->output, HasSubstr("(2 layers x 2 KV heads x head dim 8)"));
  EXPECT_THAT(result->output, HasSubstr("(4 layers x 2 KV heads x head dim 16)"));
}

TEST_F(ExecutorProcessTest, NoCacheManagerStopsIt) {
  absl::StatusOr<TempDir> empty = TempDir::Create("kvcm-none");
  ASSERT_THAT(empty, IsOk());
  ExecutorArgs args;
  args.model = *model_dir_;
  args.run_dir = empty->path();
  args.router = IpcEndpointIn(empty->path(), kRouterExecutorsSocket);
  absl::StatusOr<RunResult> result =
      RunProgram(kvcm::testing::ExecutorArgv(args), "", absl::Seconds(60));
  ASSERT_THAT(result, IsOk());
  EXPECT_EQ(result->exit_code, 1) << result->output;
  EXPECT_THAT(result->output, HasSubstr("cache-manager.sock"));
}

// ---- Bad input while serving ------------------------------------------------------------------

TEST_F(ExecutorProcessTest, MalformedAndInconsistentStepsGetErrorsAndServingGoesOn) {
  ASSERT_NO_FATAL_FAILURE(StartAll(ManagerOptions("fp32", 4)));
  const absl::Time deadline = absl::Now() + absl::Seconds(30);

  // Bytes that are no executor message at all: ErrorReply Malformed, request id 0.
  const std::string garbage = "this is not a flatbuffer, not even close";
  ASSERT_THAT(driver_->SendRaw({reinterpret_cast<const uint8_t*>(garbage.data()), garbage.size()}),
              IsOk());
  auto reply = driver_->AwaitReply(0, deadline);
  ASSERT_THAT(reply, IsOk());
  ASSERT_EQ(reply->envelope->payload_type(), wire::ExecutorMessage::ErrorReply);
  EXPECT_EQ(reply->envelope->payload_as_ErrorReply()->code(), wire::ErrorCode::Malformed);

  // A block id outside the pool.
  StepBatch step;
  step.epoch = driver_->epoch();
  SeqWork s;
  s.seq = 900;
  s.tokens = {1, 2, 3};
  s.context_len = 3;
  s.block_table = {kNumBlocks + 5};
  s.sample = true;
  step.seqs.push_back(s);
  absl::StatusOr<StepResult> refused = driver_->RunStep(step);
  EXPECT_TRUE(absl::IsInvalidArgument(refused.status())) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("the pool has 256 blocks"));

  // Block tables of an earlier epoch.
  step.seqs[0].block_table = {0};
  step.epoch = driver_->epoch() - 1;
  refused = driver_->RunStep(step);
  EXPECT_TRUE(absl::IsAborted(refused.status())) << refused.status();  // StaleEpoch

  // And it still serves.
  auto seqs = driver_->Generate({kPrompts[1]}, 4);
  ASSERT_THAT(seqs, IsOk());
  EXPECT_THAT((*seqs)[0].generated, ElementsAreArray(ReferenceGreedy(kPrompts[1], 4)));
  EXPECT_EQ(Metric("kvcm_executor_step_errors_total", {{"reason", "malformed"}}), 1);
  EXPECT_EQ(Metric("kvcm_executor_step_errors_total", {{"reason", "invalid_argument"}}), 1);
  EXPECT_EQ(Metric("kvcm_executor_step_errors_total", {{"reason", "stale_epoch"}}), 1);
  EXPECT_EQ(executor_.process->Poll(), std::nullopt);
}

// ---- SIGTERM ----------------------------------------------------------------------------------

TEST_F(ExecutorProcessTest, SigtermMidStepAnswersTheStepAndExitsCleanly) {
  CacheManagerOptions options = ManagerOptions("fp32", 16);
  ASSERT_NO_FATAL_FAILURE(StartAll(options));
  // A long prompt (the tiny model's max_position_embeddings is 2048): a prefill long enough
  // to be caught running.
  std::vector<int32_t> prompt(2000);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = 3 + static_cast<int32_t>(i * 37 % 300);
  auto seq = driver_->Allocate(prompt);
  ASSERT_THAT(seq, IsOk());
  StepBatch step;
  step.step_id = 1;
  step.epoch = driver_->epoch();
  step.seqs.push_back(driver_->WorkFor(*seq, /*sample=*/true));

  const pid_t pid = executor_.process->pid();
  const int64_t idle = kvcm::testing::CpuTicks(pid);
  auto request_id = driver_->SendStep(step);
  ASSERT_THAT(request_id, IsOk());
  // Wait until it is computing (its CPU time moves), then SIGTERM. Not asserted: a step over
  // before 3 ticks (30 ms of CPU) were seen must be answered all the same.
  (void)kvcm::testing::WaitFor([&] { return kvcm::testing::CpuTicks(pid) >= idle + 3; },
                               absl::Seconds(60));
  ASSERT_THAT(executor_.process->Signal(SIGTERM), IsOk());

  absl::StatusOr<StepResult> report =
      driver_->AwaitStep(*request_id, absl::Now() + absl::Seconds(60));
  ASSERT_THAT(report, IsOk()) << "\n" << executor_.Output();
  ASSERT_EQ(report->results.size(), 1u);
  EXPECT_GE(report->results[0].token, 0);
  EXPECT_EQ(report->prefill_tokens, 2000);
  std::printf("the step took %.1f ms\n", static_cast<double>(report->duration_us) / 1000.0);

  driver_->ServeUntil(absl::Now() + absl::Seconds(60));  // answers its Goodbye
  EXPECT_TRUE(driver_->goodbye_received());
  absl::StatusOr<int> exit_code = executor_.process->Wait(absl::Seconds(60));
  ASSERT_THAT(exit_code, IsOk());
  EXPECT_EQ(*exit_code, 0) << executor_.Output();
  EXPECT_THAT(executor_.Output(), HasSubstr("stopped after 1 step(s)"));
  // It said Goodbye to the cache manager too: only the driver's session is left.
  auto stats = driver_->cache_manager().Stats();
  ASSERT_THAT(stats, IsOk());
  EXPECT_EQ(stats->sessions, 1u);
}

// ---- Cache-manager restart --------------------------------------------------------------------

TEST_F(ExecutorProcessTest, CacheManagerRestartReattachesWithoutReloadingWeights) {
  absl::StatusOr<TempDir> run_dir = TempDir::Create("kvcm-rd");
  ASSERT_THAT(run_dir, IsOk());
  CacheManagerOptions options = ManagerOptions("fp16", 4);
  options.run_dir = run_dir->path();
  ASSERT_NO_FATAL_FAILURE(StartAll(options));
  const std::vector<int32_t> expected = ReferenceGreedy(kPrompts[2], 6);
  auto before = driver_->Generate({kPrompts[2]}, 6);
  ASSERT_THAT(before, IsOk());
  EXPECT_THAT((*before)[0].generated, ElementsAreArray(expected));

  for (int restart = 1; restart <= 2; ++restart) {
    SCOPED_TRACE(absl::StrCat("restart ", restart));
    const uint64_t old_epoch = cm_->epoch();
    ASSERT_THAT(cm_->process().Signal(SIGKILL), IsOk());
    ASSERT_THAT(cm_->process().Wait(absl::Seconds(30)), IsOk());
    auto cm = CacheManagerProcess::Start(options);
    ASSERT_THAT(cm, IsOk());
    cm_ = std::move(*cm);
    ASSERT_NE(cm_->epoch(), old_epoch);
    // The driver (as the router) registers again: its sequences of the old epoch are gone.
    const absl::Time deadline = absl::Now() + absl::Seconds(60);
    absl::Status session;
    (void)kvcm::testing::WaitFor(
        [&] {
          session = driver_->cache_manager().EnsureSession();
          // Its executor runs no step of the old epoch (the driver waits for every reply).
          if (absl::IsAborted(session)) session = driver_->cache_manager().Reregister();
          if (driver_->epoch() == cm_->epoch()) return true;
          (void)driver_->cache_manager().Heartbeat();
          return false;
        },
        deadline);
    ASSERT_EQ(driver_->epoch(), cm_->epoch()) << session;

    if (restart == 1) {
      // Wait for the executor to notice by itself (its cache-manager heartbeat was refused).
      auto line = executor_.process->WaitForLine(
          absl::StrCat("re-attached to the pool of epoch ", cm_->epoch()), deadline);
      ASSERT_THAT(line, IsOk());
    }
    // restart 2: a step of the new epoch right away. An executor that has not noticed yet
    // re-attaches for it but refuses it: it had no session in that epoch when the step was
    // sent, so no fence of the sender waits for it (docs/architecture.md, "Fencing"). Its
    // next Hello announces the epoch, and steps of it run from then on.
    if (restart == 2) {
      auto early = driver_->Generate({kPrompts[2]}, 6);
      if (!early.ok()) {
        EXPECT_TRUE(absl::IsAborted(early.status())) << early.status();
        EXPECT_THAT(std::string(early.status().message()), HasSubstr("stale epoch, re-attached"));
      }
      if (driver_->hello_epoch() != cm_->epoch()) {
        auto hello = driver_->AwaitHello(absl::Now() + absl::Seconds(60));
        ASSERT_THAT(hello, IsOk()) << "\n" << executor_.Output();
      }
    }
    auto after = driver_->Generate({kPrompts[2]}, 6);
    ASSERT_THAT(after, IsOk()) << "\n" << executor_.Output();
    EXPECT_THAT((*after)[0].generated, ElementsAreArray(expected));
    EXPECT_EQ(Metric("kvcm_executor_attaches_total"), 1 + restart);
    EXPECT_EQ(Metric("kvcm_executor_model_loads_total"), 1);
    EXPECT_EQ(Metric("kvcm_executor_epoch"), static_cast<double>(cm_->epoch()));
    // It tells the router the new pool in an ExecutorHello from its loop's upkeep, after
    // the step that made it re-attach: a busy executor may handle every later step of the
    // generation first (they queue while it works), so the Hello can come after the last
    // reply. Read it if it has not come yet.
    if (driver_->hello_epoch() != cm_->epoch()) {
      auto hello = driver_->AwaitHello(absl::Now() + absl::Seconds(60));
      ASSERT_THAT(hello, IsOk()) << "\n" << executor_.Output();
    }
    EXPECT_EQ(driver_->hello_epoch(), cm_->epoch());  // it told the router the new pool
  }
  EXPECT_EQ(executor_.process->Poll(), std::nullopt);
}

}  // namespace
}  // namespace kvcm::executor
