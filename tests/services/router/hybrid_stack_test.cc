// A model that mixes full-attention and sliding-window layers served by the whole stack, as
// real processes, with the hybrid KV cache (docs/architecture.md, "The hybrid KV cache"): a
// tiny Qwen2 whose layer 0 attends to the whole context and layers 1-3 within 6 tokens, so
// that the cache manager (given --model-config) lays the pool out in pages of one layer slot
// and keeps four block tables per sequence (one full group, three window groups). Every
// answer must be the model's own greedy tokens (the contiguous reference forward) for prompts
// and generations many windows long, with prefix hits and in a pool too small for every
// request at once; the window groups must have released blocks; and an executor whose model
// groups its layers otherwise must refuse the pool.

#include <signal.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/services/executor/executor_test_util.h"
#include "tests/services/router/router_stack.h"
#include "tests/support/cache_manager_process.h"
#include "tests/support/http_client.h"
#include "tests/support/metrics_text.h"
#include "tests/support/status_matchers.h"
#include "tests/support/subprocess.h"

namespace kvcm::testing {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr int32_t kWindow = 6;  // not a multiple of the block size (4)

// Writes a tiny model with kvcm-make-tiny-model and `flags`.
absl::Status MakeModel(const std::string& folder, const std::vector<std::string>& flags) {
  std::vector<std::string> argv = {KvcmBinaryPath("kvcm-make-tiny-model"), "--output", folder,
                                   "--seed", absl::StrCat(kModelSeed)};
  argv.insert(argv.end(), flags.begin(), flags.end());
  absl::StatusOr<RunResult> made = RunProgram(argv, "", absl::Seconds(60));
  if (!made.ok()) return made.status();
  if (made->exit_code != 0) return absl::InternalError(made->output);
  return absl::OkStatus();
}

class HybridStackTest : public RouterStackTest {
 protected:
  static void SetUpTestSuite() {
    absl::StatusOr<TempDir> dir = TempDir::Create("kvcm-hybrid");
    ASSERT_THAT(dir, IsOk());
    dir_ = new TempDir(std::move(*dir));
    model_dir_ = new std::string(dir_->path() + "/qwen2");
    std::printf("tiny qwen2 seed %llu: layer 0 full, layers 1-3 a window of %d\n",
                static_cast<unsigned long long>(kModelSeed), kWindow);
    ASSERT_THAT(MakeModel(*model_dir_, {"--architecture", "qwen2", "--sliding_window",
                                        absl::StrCat(kWindow), "--max_window_layers", "1"}),
                IsOk());
    absl::StatusOr<std::unique_ptr<executor::LlamaModel>> model =
        executor::LlamaModel::Load(*model_dir_);
    ASSERT_THAT(model, IsOk());
    ASSERT_THAT((*model)->config().layer_windows, ElementsAre(0, kWindow, kWindow, kWindow));
    model_ = model->release();
  }

  // A cache manager that takes the model's shape (and so its groups) from --model-config.
  CacheManagerOptions HybridManager(int32_t num_blocks, std::vector<std::string> more = {}) {
    CacheManagerOptions options = ManagerOptions(num_blocks, "");
    options.layers = 0;
    options.kv_heads = 0;
    options.head_dim = 0;
    options.extra_args = {"--model-config", *model_dir_};
    options.extra_args.insert(options.extra_args.end(), more.begin(), more.end());
    return options;
  }

  void StartHybridStack(int32_t num_blocks, std::vector<std::string> more = {}) {
    absl::StatusOr<std::unique_ptr<CacheManagerProcess>> cm =
        CacheManagerProcess::Start(HybridManager(num_blocks, std::move(more)));
    ASSERT_THAT(cm, IsOk());
    cm_ = std::move(*cm);
    ASSERT_NO_FATAL_FAILURE(StartRouterAndExecutors(1, {}, {}));
  }

  SessionInfo Session() {
    CacheManagerClient::Options client;
    client.endpoint = cm_->endpoint();
    client.role = wire::Role::Control;
    client.name = "test";
    client.heartbeats = false;
    absl::StatusOr<std::unique_ptr<CacheManagerClient>> connected =
        CacheManagerClient::Connect(client);
    EXPECT_THAT(connected, IsOk());
    return connected.ok() ? (*connected)->session() : SessionInfo{};
  }

  double ManagerMetric(const std::string& name, const MetricLabels& labels = {}) {
    absl::StatusOr<HttpResponse> scraped = HttpGet(cm_->metrics_url());
    if (!scraped.ok() || scraped->status != 200) return -1;
    absl::StatusOr<MetricsText> metrics = ParseMetricsText(scraped->body);
    if (!metrics.ok()) return -1;
    absl::StatusOr<double> value = metrics->Value(name, labels);
    return value.ok() ? *value : -1;
  }

  // Prompts of 41 to 44 tokens (BOS + bytes): seven windows. They differ from their first
  // byte, so that none finds another's blocks (a hit never holds the window groups' blocks
  // before it, which would make the releases depend on when each arrived).
  static std::vector<std::string> Prompts(int n) {
    std::vector<std::string> texts;
    for (int i = 0; i < n; ++i) {
      texts.push_back(absl::StrCat(i, " full and sliding layers, one table each"));
    }
    return texts;
  }
};

TEST_F(HybridStackTest, EveryAnswerIsTheModelsOwnWithABlockTablePerGroup) {
  ASSERT_NO_FATAL_FAILURE(StartHybridStack(/*num_blocks=*/512));
  EXPECT_THAT(Session().group_windows, ElementsAre(0, kWindow, kWindow, kWindow));
  const std::vector<std::string> texts = Prompts(4);
  std::unique_ptr<Requests> requests = StartRequests(texts, 24);
  requests->Join();
  ExpectReferenceAnswers(*requests, texts, 24);
  // Each sequence of ~68 tokens (17 blocks) kept only its last window in each window group:
  // 15 blocks released in each of the 3 window groups at its last commit.
  const double released = ManagerMetric("kvcm_cache_window_released_blocks_total");
  std::printf("blocks released behind the windows: %.0f\n", released);
  EXPECT_GE(released, 4 * 3 * 10);
  // By group: the full group released nothing, the window groups all the rest alike.
  const std::string by_group = "kvcm_cache_group_window_released_blocks_total";
  EXPECT_EQ(ManagerMetric(by_group, {{"group", "0"}, {"window", "0"}}), 0);
  for (const char* group : {"1", "2", "3"}) {
    EXPECT_EQ(ManagerMetric(by_group, {{"group", group}, {"window", absl::StrCat(kWindow)}}),
              released / 3)
        << group;
  }
  EXPECT_TRUE(AwaitNoBlockInUse());
  ExpectWhole(Stats());
}

TEST_F(HybridStackTest, ARepeatedPromptHitsInEveryGroupAndGivesTheSameTokens) {
  ASSERT_NO_FATAL_FAILURE(StartHybridStack(/*num_blocks=*/512));
  const std::string text = Prompts(1)[0];
  for (int round = 0; round < 2; ++round) {
    absl::StatusOr<HttpResponse> reply = HttpPost(url_ + "/generate", GenerateBody(text, 12));
    ASSERT_TRUE(reply.ok() && reply->status == 200) << round;
    EXPECT_EQ(TokenIds(reply->body), Reference(text, 12)) << round;
  }
  // The full group kept every committed block; the window groups the last window's, which
  // is all a hit needs of them (matched from the right): all but the last token's block.
  const double cached = RouterMetric("kvcm_router_prompt_tokens_total", {{"source", "cached"}});
  std::printf("cached prompt tokens: %.0f\n", cached);
  EXPECT_GE(cached, 36);
  EXPECT_TRUE(AwaitNoBlockInUse());
  ExpectWhole(Stats());
}

TEST_F(HybridStackTest, APoolTooSmallForEveryoneAtOnceStillGivesEveryAnswer) {
  // 120 pages: six requests of ~42 prompt and 30 new tokens take 4 x 11 pages each at
  // admission and ~18 + 3 x 4 decoding; not all fit at once, so some wait or are preempted.
  ASSERT_NO_FATAL_FAILURE(StartHybridStack(/*num_blocks=*/120));
  const std::vector<std::string> texts = Prompts(6);
  std::unique_ptr<Requests> requests = StartRequests(texts, 30);
  requests->Join();
  ExpectReferenceAnswers(*requests, texts, 30);
  // How many were preempted depends on when the requests arrived: printed, not asserted.
  std::printf("preemptions: %.0f\n", RouterMetric("kvcm_router_preemptions_total"));
  EXPECT_TRUE(AwaitNoBlockInUse());
  ExpectWhole(Stats());
}

TEST_F(HybridStackTest, WithoutGroupsEveryBlockIsKeptAndTheAnswersAreTheSame) {
  ASSERT_NO_FATAL_FAILURE(StartHybridStack(/*num_blocks=*/256, {"--sliding-window-tokens", "0"}));
  EXPECT_TRUE(Session().group_windows.empty());
  const std::vector<std::string> texts = Prompts(2);
  std::unique_ptr<Requests> requests = StartRequests(texts, 16);
  requests->Join();
  ExpectReferenceAnswers(*requests, texts, 16);
  EXPECT_EQ(ManagerMetric("kvcm_cache_window_released_blocks_total"), 0);
}

TEST_F(HybridStackTest, AnExecutorWhoseModelGroupsOtherwiseRefusesThePool) {
  absl::StatusOr<std::unique_ptr<CacheManagerProcess>> cm =
      CacheManagerProcess::Start(HybridManager(64));
  ASSERT_THAT(cm, IsOk());
  cm_ = std::move(*cm);
  ASSERT_NO_FATAL_FAILURE(StartRouter({}));
  // The same shape with every layer in the window (one group), and a Llama (one full
  // group): neither may read pages laid out for four groups.
  const std::string mistral = dir_->path() + "/mistral";
  ASSERT_THAT(
      MakeModel(mistral, {"--architecture", "mistral", "--sliding_window", absl::StrCat(kWindow)}),
      IsOk());
  const std::string llama = dir_->path() + "/llama";
  ASSERT_THAT(MakeModel(llama, {}), IsOk());
  for (const std::string& model : {mistral, llama}) {
    ExecutorArgs args;
    args.model = model;
    args.run_dir = cm_->run_dir();
    args.router = IpcEndpointIn(cm_->run_dir(), kRouterExecutorsSocket);
    args.threads = 1;
    absl::StatusOr<RunResult> run = RunProgram(ExecutorArgv(args), "", absl::Seconds(60));
    ASSERT_THAT(run, IsOk());
    EXPECT_NE(run->exit_code, 0) << model;
    EXPECT_THAT(run->output, HasSubstr("group")) << model << ": " << run->output;
  }
  ExpectWhole(Stats());
}

}  // namespace
}  // namespace kvcm::testing
