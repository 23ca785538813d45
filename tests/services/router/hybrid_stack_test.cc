// A model that mixes full-attention and sliding-window layers served by the whole stack, as
// real processes, with the hybrid KV cache (docs/architecture.md, "The hybrid KV cache"): a
// tiny Qwen2 whose layer 0 attends to the whole context and layers 1-3 within 6 tokens, so
// that the cache manager (given --model-config) lays the pool out in pages of one layer slot
// and keeps four block tables per sequence (one full group, three window groups). Every
// answer must be the model's own greedy tokens (the contiguous reference forward) for prompts
// and generations many windows long, with prefix hits and in a pool too small for every
// request at once; the window groups must have released blocks; the blocks each group holds
// (kvcm_cache_group_held_blocks) must be what the ledger's tables hold, a window group's
// bounded by its window while a sequence decodes; /info must show every group; and an
// executor whose model groups its layers otherwise must refuse the pool.

#include <signal.h>

#include <algorithm>
#include <array>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
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
constexpr int kGroups = 4;      // layer 0 full, layers 1, 2 and 3 each a window group
// Blocks a decoding sequence holds at most in a window group: the window's and up to two
// being filled (BlocksHeldUnderWindow), ceil(6 / 4) + 2.
constexpr double kWindowGroupBlocks = 4;
const char kHeld[] = "kvcm_cache_group_held_blocks";

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

  // The cache manager's /metrics, one snapshot (empty when it cannot be read).
  MetricsText ManagerMetrics() {
    absl::StatusOr<HttpResponse> scraped = HttpGet(cm_->metrics_url());
    if (!scraped.ok() || scraped->status != 200) return {};
    absl::StatusOr<MetricsText> metrics = ParseMetricsText(scraped->body);
    return metrics.ok() ? *metrics : MetricsText{};
  }

  double ManagerMetric(const std::string& name, const MetricLabels& labels = {}) {
    absl::StatusOr<double> value = ManagerMetrics().Value(name, labels);
    return value.ok() ? *value : -1;
  }

  // kvcm_cache_group_held_blocks of every group of `metrics` (-1 where missing).
  static std::array<double, kGroups> HeldByGroup(const MetricsText& metrics) {
    std::array<double, kGroups> held;
    for (int g = 0; g < kGroups; ++g) {
      const std::string window = absl::StrCat(g == 0 ? 0 : kWindow);
      held[static_cast<size_t>(g)] =
          metrics.Value(kHeld, {{"group", absl::StrCat(g)}, {"window", window}}).value_or(-1);
    }
    return held;
  }

  // Scrapes until every group's held blocks are `want` (the snapshot follows a Step's reply
  // within the cache manager's turn); the last seen.
  std::array<double, kGroups> AwaitHeld(const std::array<double, kGroups>& want) {
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    std::array<double, kGroups> held = HeldByGroup(ManagerMetrics());
    while (held != want && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(5));
      held = HeldByGroup(ManagerMetrics());
    }
    return held;
  }

  // /info's body (null when it cannot be read).
  nlohmann::json Info() {
    absl::StatusOr<HttpResponse> info = HttpGet(url_ + "/info");
    if (!info.ok() || info->status != 200) return nullptr;
    return nlohmann::json::parse(info->body, nullptr, false);
  }
  // Pool bytes per token of `slots` layer slots: K and V of each KV head, in fp32 (the
  // stack's --dtype).
  static int64_t BytesPerToken(int64_t slots) {
    return 2 * slots * model_->config().num_key_value_heads * model_->config().head_dim * 4;
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

TEST_F(HybridStackTest, InfoShowsEachGroupsWindowLayersBytesAndBlocks) {
  ASSERT_NO_FATAL_FAILURE(StartHybridStack(/*num_blocks=*/512));
  const nlohmann::json info = Info();
  ASSERT_TRUE(info.is_object()) << info;
  const int64_t max_total = info.at("max_total_tokens").get<int64_t>();
  EXPECT_EQ(max_total, 2048);  // the router's default
  // Pages of one layer slot; a sequence of 2048 tokens holds 512 blocks of 4 in the full
  // group and 4 in each window group.
  const int64_t page = BytesPerToken(1);
  nlohmann::json want = nlohmann::json::array();
  want.push_back({{"group", 0},
                  {"window_tokens", 0},
                  {"layers", {0}},
                  {"bytes_per_token", page},
                  {"max_blocks_per_sequence", 512}});
  for (int g = 1; g < kGroups; ++g) {
    want.push_back({{"group", g},
                    {"window_tokens", kWindow},
                    {"layers", {g}},
                    {"bytes_per_token", page},
                    {"max_blocks_per_sequence", 4}});
  }
  EXPECT_EQ(info.at("kv_cache_groups"), want);
  EXPECT_EQ(info.at("num_blocks"), 512);  // TGI's fields as they were
  EXPECT_EQ(info.at("block_size"), 4);
}

// The ledger's tables, step by step, against kvcm_cache_group_held_blocks: the test's own
// router session on the stack's cache manager (no router), each op changing the counts by
// exactly what it adds to or drops from the tables.
TEST_F(HybridStackTest, HeldBlocksByGroupAreWhatTheTablesHold) {
  absl::StatusOr<std::unique_ptr<CacheManagerProcess>> cm =
      CacheManagerProcess::Start(HybridManager(512));
  ASSERT_THAT(cm, IsOk());
  cm_ = std::move(*cm);
  EXPECT_EQ(AwaitHeld({0, 0, 0, 0}), (std::array<double, kGroups>{0, 0, 0, 0}));
  CacheManagerClient::Options options;
  options.endpoint = cm_->endpoint();
  options.role = wire::Role::Router;
  options.name = "test-router";
  absl::StatusOr<std::unique_ptr<CacheManagerClient>> router = CacheManagerClient::Connect(options);
  ASSERT_THAT(router, IsOk());
  auto step = [&](BlockOps ops) {
    absl::StatusOr<std::vector<OpOutcome>> outcomes = (*router)->Step(ops);
    ASSERT_THAT(outcomes, IsOk());
    for (const OpOutcome& outcome : *outcomes) ASSERT_THAT(outcome.status, IsOk());
  };
  using Held = std::array<double, kGroups>;
  // 41 tokens: 11 blocks in every group until the window groups' commit.
  ASSERT_NO_FATAL_FAILURE(step(BlockOps().Allocate(1, 41)));
  EXPECT_EQ(AwaitHeld({11, 11, 11, 11}), (Held{11, 11, 11, 11}));
  // Committed to 41, a window group reads from token 36 on: blocks 0..8 go back.
  ASSERT_NO_FATAL_FAILURE(step(BlockOps().Commit(1, 41)));
  EXPECT_EQ(AwaitHeld({11, 2, 2, 2}), (Held{11, 2, 2, 2}));
  // A fork shares every held block: each table counts them.
  ASSERT_NO_FATAL_FAILURE(step(BlockOps().Fork(1, 2)));
  EXPECT_EQ(AwaitHeld({22, 4, 4, 4}), (Held{22, 4, 4, 4}));
  ASSERT_NO_FATAL_FAILURE(step(BlockOps().Free(2).Append(1, 8)));  // 49 tokens: 13 blocks
  EXPECT_EQ(AwaitHeld({13, 4, 4, 4}), (Held{13, 4, 4, 4}));
  ASSERT_NO_FATAL_FAILURE(step(BlockOps().Commit(1, 49)));  // from token 44: blocks 11, 12
  EXPECT_EQ(AwaitHeld({13, 2, 2, 2}), (Held{13, 2, 2, 2}));
  EXPECT_EQ(ManagerMetric("kvcm_cache_group_window_released_blocks_total",
                          {{"group", "1"}, {"window", absl::StrCat(kWindow)}}),
            9 + 2);  // the commits of 41 and 49 (a fork, a free and an append release none)
  ASSERT_NO_FATAL_FAILURE(step(BlockOps().Free(1)));
  EXPECT_EQ(AwaitHeld({0, 0, 0, 0}), (Held{0, 0, 0, 0}));
  EXPECT_EQ(ManagerMetric("kvcm_cache_blocks", {{"state", "in_use"}}), 0);
}

// Over HTTP: while a sequence decodes, its window groups hold at most the window's blocks
// (and every group exactly what the pool has in use: no block is shared); once it ends, no
// group holds anything.
TEST_F(HybridStackTest, WhileASequenceDecodesItsWindowGroupsHoldOnlyTheWindow) {
  ASSERT_NO_FATAL_FAILURE(StartHybridStack(/*num_blocks=*/512));
  const std::vector<std::string> texts = Prompts(1);  // 41 tokens: 11 blocks
  std::unique_ptr<Requests> requests = StartRequests(texts, 200);
  int decoding = 0;  // samples past the prompt's blocks
  double most_full = 0;
  while (requests->done.load() == 0) {
    const MetricsText metrics = ManagerMetrics();
    if (metrics.samples.empty()) continue;  // not read this time
    const std::array<double, kGroups> held = HeldByGroup(metrics);
    const double in_use = metrics.Value("kvcm_cache_blocks", {{"state", "in_use"}}).value_or(-1);
    ASSERT_EQ(held[0] + held[1] + held[2] + held[3], in_use);
    for (int g = 1; g < kGroups; ++g) {
      ASSERT_EQ(held[static_cast<size_t>(g)], held[1]) << g;  // the same window
      ASSERT_LE(held[static_cast<size_t>(g)], held[0]) << g;
    }
    if (held[0] > 11) {  // past the prompt, whose commit released the window's tail
      ++decoding;
      ASSERT_LE(held[1], kWindowGroupBlocks) << "full group " << held[0];
    }
    most_full = std::max(most_full, held[0]);
  }
  requests->Join();
  ExpectReferenceAnswers(*requests, texts, 200);
  std::printf("samples while decoding: %d, most blocks of the full group: %.0f\n", decoding,
              most_full);
  EXPECT_GT(decoding, 0);
  EXPECT_EQ(AwaitHeld({0, 0, 0, 0}), (std::array<double, kGroups>{0, 0, 0, 0}));
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
  // One group, the pool's window (none), that held every in-use block and holds none now.
  EXPECT_TRUE(AwaitNoBlockInUse());
  EXPECT_EQ(ManagerMetric(kHeld, {{"group", "0"}, {"window", "0"}}), 0);
  EXPECT_EQ(ManagerMetrics().Samples(kHeld).size(), 1u);
  // /info: one group of all 4 layers, blocks of all of them, 512 blocks of 2048 tokens.
  const nlohmann::json info = Info();
  ASSERT_TRUE(info.is_object()) << info;
  EXPECT_EQ(info.at("kv_cache_groups"), nlohmann::json::parse(absl::StrCat(
                                            R"([{"group": 0, "window_tokens": 0,
                                                 "layers": [0, 1, 2, 3], "bytes_per_token": )",
                                            BytesPerToken(4), R"(,
                                                 "max_blocks_per_sequence": 512}])")));
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
