// A sliding-window model served by the whole stack, as real processes: a tiny Mistral whose
// every layer attends within 6 tokens, a cache manager that releases each sequence's blocks
// behind that window (--sliding-window-tokens, or taken from --model-config), the router
// and an executor, over HTTP. Every answer must be the model's own greedy tokens (the
// contiguous reference forward, which masks the window as transformers does) for prompts
// and generations many windows long, with prefix hits and with preemption; the cache
// manager must have released blocks; and an executor whose layers read further back than
// the pool keeps must refuse the pool, naming the layer.

#include <signal.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
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

class SlidingWindowStackTest : public RouterStackTest {
 protected:
  static void SetUpTestSuite() {
    absl::StatusOr<TempDir> dir = TempDir::Create("kvcm-window");
    ASSERT_THAT(dir, IsOk());
    dir_ = new TempDir(std::move(*dir));
    model_dir_ = new std::string(dir_->path() + "/mistral");
    std::printf("tiny mistral seed %llu, sliding window %d\n",
                static_cast<unsigned long long>(kModelSeed), kWindow);
    ASSERT_THAT(MakeModel(*model_dir_,
                          {"--architecture", "mistral", "--sliding_window", absl::StrCat(kWindow)}),
                IsOk());
    absl::StatusOr<std::unique_ptr<executor::LlamaModel>> model =
        executor::LlamaModel::Load(*model_dir_);
    ASSERT_THAT(model, IsOk());
    ASSERT_THAT((*model)->config().layer_windows, ::testing::Each(kWindow));
    model_ = model->release();
  }

  // The stack with a cache manager of `num_blocks` given `cm_flags` (beside the shape).
  void StartWindowedStack(int32_t num_blocks, const std::vector<std::string>& cm_flags,
                          const std::vector<std::string>& router_flags = {}) {
    CacheManagerOptions options = ManagerOptions(num_blocks, "");
    options.extra_args = cm_flags;
    absl::StatusOr<std::unique_ptr<CacheManagerProcess>> cm = CacheManagerProcess::Start(options);
    ASSERT_THAT(cm, IsOk());
    cm_ = std::move(*cm);
    ASSERT_NO_FATAL_FAILURE(StartRouterAndExecutors(1, router_flags, {}));
  }

  double ManagerMetric(const std::string& name) {
    absl::StatusOr<HttpResponse> scraped = HttpGet(cm_->metrics_url());
    if (!scraped.ok() || scraped->status != 200) return -1;
    absl::StatusOr<MetricsText> metrics = ParseMetricsText(scraped->body);
    if (!metrics.ok()) return -1;
    absl::StatusOr<double> value = metrics->Value(name, {});
    return value.ok() ? *value : -1;
  }

  // Prompts of 40 to 43 bytes (BOS + bytes: 41 to 44 tokens, seven windows).
  static std::vector<std::string> Prompts(int n) {
    std::vector<std::string> texts;
    for (int i = 0; i < n; ++i) {
      texts.push_back(absl::StrCat("the window slides on, one token at a time ", i));
    }
    return texts;
  }
};

TEST_F(SlidingWindowStackTest, EveryAnswerIsTheModelsOwnAndBlocksBehindTheWindowAreReleased) {
  ASSERT_NO_FATAL_FAILURE(StartWindowedStack(/*num_blocks=*/256, {"--sliding-window-tokens", "6"}));
  // Prompts that differ from their first block on: a prefix hit would start a sequence with
  // its leading blocks never held (matched from the right), which no release then counts,
  // and whether one hits depends on when each request arrives.
  std::vector<std::string> texts;
  for (const std::string& text : Prompts(4)) texts.push_back(text.substr(text.size() - 1) + text);
  std::unique_ptr<Requests> requests = StartRequests(texts, 24);
  requests->Join();
  ExpectReferenceAnswers(*requests, texts, 24);
  // Each sequence of ~68 tokens (17 blocks) kept only the blocks of its last window.
  const double released = ManagerMetric("kvcm_cache_window_released_blocks_total");
  std::printf("blocks released behind the window: %.0f\n", released);
  EXPECT_GE(released, 4 * 10);
  EXPECT_TRUE(AwaitNoBlockInUse());
  ExpectWhole(Stats());
}

TEST_F(SlidingWindowStackTest, ARepeatedPromptHitsThePrefixCacheAndGivesTheSameTokens) {
  ASSERT_NO_FATAL_FAILURE(StartWindowedStack(/*num_blocks=*/256, {"--sliding-window-tokens", "6"}));
  const std::string text = Prompts(1)[0];
  for (int round = 0; round < 2; ++round) {
    absl::StatusOr<HttpResponse> reply = HttpPost(url_ + "/generate", GenerateBody(text, 12));
    ASSERT_TRUE(reply.ok() && reply->status == 200) << round;
    EXPECT_EQ(TokenIds(reply->body), Reference(text, 12)) << round;
  }
  // The second found the first's committed blocks (released behind its window into the
  // prefix cache, not dropped): all but the block of the prompt's last token.
  const double cached = RouterMetric("kvcm_router_prompt_tokens_total", {{"source", "cached"}});
  std::printf("cached prompt tokens: %.0f\n", cached);
  EXPECT_GE(cached, 36);
  EXPECT_TRUE(AwaitNoBlockInUse());
  ExpectWhole(Stats());
}

TEST_F(SlidingWindowStackTest, APromptWhoseOldestBlocksWereEvictedStillHitsItsLastWindow) {
  // 24 blocks of 4 tokens. The first request leaves its blocks cached, those behind its
  // window oldest in the eviction order; a second, unrelated one needs more than the free
  // blocks and evicts the oldest of them, so the first prompt's leading blocks are gone.
  // Its repeat still finds the blocks of the window before its last token (a window's
  // prefix hit is matched from the right), and gives the same tokens.
  ASSERT_NO_FATAL_FAILURE(StartWindowedStack(/*num_blocks=*/24, {"--sliding-window-tokens", "6"}));
  const std::string text = Prompts(1)[0];
  const std::string other = "quite another prompt, sharing no prefix at all";
  for (const std::string& prompt : {text, other}) {
    absl::StatusOr<HttpResponse> reply = HttpPost(url_ + "/generate", GenerateBody(prompt, 12));
    ASSERT_TRUE(reply.ok() && reply->status == 200) << prompt;
    EXPECT_EQ(TokenIds(reply->body), Reference(prompt, 12)) << prompt;
  }
  const double evicted = ManagerMetric("kvcm_cache_block_evictions_total");
  std::printf("blocks evicted by the second prompt: %.0f\n", evicted);
  ASSERT_GE(evicted, 1) << "the second prompt must evict the first one's oldest block";
  const double cached_before =
      RouterMetric("kvcm_router_prompt_tokens_total", {{"source", "cached"}});
  absl::StatusOr<HttpResponse> reply = HttpPost(url_ + "/generate", GenerateBody(text, 12));
  ASSERT_TRUE(reply.ok() && reply->status == 200);
  EXPECT_EQ(TokenIds(reply->body), Reference(text, 12));
  const double cached =
      RouterMetric("kvcm_router_prompt_tokens_total", {{"source", "cached"}}) - cached_before;
  std::printf("cached prompt tokens of the repeat: %.0f\n", cached);
  // All but the block of the prompt's last token; matched from the left it would be 0.
  EXPECT_GE(cached, 36);
  EXPECT_TRUE(AwaitNoBlockInUse());
  ExpectWhole(Stats());
}

TEST_F(SlidingWindowStackTest, APoolTooSmallForTheWholeContextsStillGivesEveryAnswer) {
  // 40 blocks of 4 tokens; six requests of ~42 prompt and 30 new tokens would need 108
  // blocks with every block kept, and fit with the window's release.
  ASSERT_NO_FATAL_FAILURE(StartWindowedStack(/*num_blocks=*/40, {"--sliding-window-tokens", "6"}));
  const std::vector<std::string> texts = Prompts(6);
  std::unique_ptr<Requests> requests = StartRequests(texts, 30);
  requests->Join();
  ExpectReferenceAnswers(*requests, texts, 30);
  EXPECT_TRUE(AwaitNoBlockInUse());
  ExpectWhole(Stats());
}

TEST_F(SlidingWindowStackTest, TheCacheManagerTakesTheWindowFromTheModelConfig) {
  CacheManagerOptions options = ManagerOptions(64, "");
  options.layers = 0;
  options.kv_heads = 0;
  options.head_dim = 0;
  options.extra_args = {"--model-config", *model_dir_};
  absl::StatusOr<std::unique_ptr<CacheManagerProcess>> cm = CacheManagerProcess::Start(options);
  ASSERT_THAT(cm, IsOk());
  cm_ = std::move(*cm);
  EXPECT_THAT(cm_->Output(), HasSubstr("every layer attends within 6 tokens"));
  CacheManagerClient::Options client;
  client.endpoint = cm_->endpoint();
  client.role = wire::Role::Control;
  client.name = "test";
  client.heartbeats = false;
  absl::StatusOr<std::unique_ptr<CacheManagerClient>> connected =
      CacheManagerClient::Connect(client);
  ASSERT_THAT(connected, IsOk());
  EXPECT_EQ((*connected)->session().sliding_window_tokens, kWindow);
  ASSERT_NO_FATAL_FAILURE(StartRouterAndExecutors(1, {}, {}));
  const std::string text = Prompts(1)[0];
  absl::StatusOr<HttpResponse> reply = HttpPost(url_ + "/generate", GenerateBody(text, 16));
  ASSERT_TRUE(reply.ok() && reply->status == 200);
  EXPECT_EQ(TokenIds(reply->body), Reference(text, 16));
  EXPECT_GT(ManagerMetric("kvcm_cache_window_released_blocks_total"), 0);
}

TEST_F(SlidingWindowStackTest, AWindowNarrowerThanTheModelsIsRefusedByTheCacheManager) {
  CacheManagerOptions options = ManagerOptions(64, "");
  options.layers = 0;
  options.kv_heads = 0;
  options.head_dim = 0;
  options.extra_args = {"--model-config", *model_dir_, "--sliding-window-tokens", "4"};
  absl::StatusOr<std::unique_ptr<CacheManagerProcess>> cm = CacheManagerProcess::Start(options);
  ASSERT_FALSE(cm.ok());
  EXPECT_THAT(cm.status().message(),
              HasSubstr("--sliding-window-tokens 4 would release blocks that the model"));
}

TEST_F(SlidingWindowStackTest, AnExecutorWhoseLayersReadFurtherBackRefusesThePool) {
  // The cache manager keeps 4 tokens (given without --model-config, so it cannot check);
  // the windowed model reads 6, and a Llama the whole context: both refuse the pool.
  CacheManagerOptions options = ManagerOptions(64, "");
  options.extra_args = {"--sliding-window-tokens", "4"};
  absl::StatusOr<std::unique_ptr<CacheManagerProcess>> cm = CacheManagerProcess::Start(options);
  ASSERT_THAT(cm, IsOk());
  cm_ = std::move(*cm);
  ASSERT_NO_FATAL_FAILURE(StartRouter({}));
  const std::string llama = dir_->path() + "/llama";
  ASSERT_THAT(MakeModel(llama, {}), IsOk());
  for (const auto& [model, expected] :
       {std::pair<std::string, std::string>{*model_dir_,
                                            "layer 0 of the model attends to 6 tokens"},
        {llama, "layer 0 of the model attends to the whole context"}}) {
    ExecutorArgs args;
    args.model = model;
    args.run_dir = cm_->run_dir();
    args.router = IpcEndpointIn(cm_->run_dir(), kRouterExecutorsSocket);
    args.threads = 1;
    absl::StatusOr<RunResult> run = RunProgram(ExecutorArgv(args), "", absl::Seconds(60));
    ASSERT_THAT(run, IsOk());
    EXPECT_NE(run->exit_code, 0) << model;
    EXPECT_THAT(run->output,
                HasSubstr("the cache manager releases blocks behind a sliding window of 4 tokens"))
        << model;
    EXPECT_THAT(run->output, HasSubstr(expected)) << model;
  }
  ExpectWhole(Stats());
}

}  // namespace
}  // namespace kvcm::testing
