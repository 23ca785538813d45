// The whole stack on the bundled real model, SmolLM2-135M-Instruct (Q4_1 GGUF): a real
// cache manager, kvcm-router and one kvcm-executor, both given the GGUF file, over real
// HTTP. What they answer is compared with transformers on the same GGUF
// (tests/reference/smollm2_reference.json, from tests/reference/real_model_reference.py):
//   - /v1/chat/completions renders the messages with the model's own chat template (kvcm's
//     Jinja interpreter), tokenizes them with the GGUF's BPE vocabulary, and answers
//     transformers' greedy text, ended at <|im_end|> (EOS) with finish_reason "stop" and
//     usage.prompt_tokens equal to transformers' prompt length, streamed or not;
//   - /v1/completions on a plain prompt gets no BOS (the GGUF says add_bos_token = false)
//     and answers transformers' greedy tokens.
// The pool and the matmuls (--matmul=fp32) are fp32, as the reference computes, so greedy
// choices cannot flip on rounding. Gemma3RouterTest (below) does the same for the second real
// model, Gemma 3 270M, on the hybrid KV cache.

#include <signal.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "common/base/run_dir.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/services/executor/executor_test_util.h"
#include "tests/support/cache_manager_process.h"
#include "tests/support/http_client.h"
#include "tests/support/metrics_text.h"
#include "tests/support/real_model.h"
#include "tests/support/status_matchers.h"
#include "tests/support/subprocess.h"

namespace kvcm {
namespace {

using json = nlohmann::json;
using kvcm::testing::CacheManagerOptions;
using kvcm::testing::CacheManagerProcess;
using kvcm::testing::ExecutorArgs;
using kvcm::testing::ExecutorProcess;
using kvcm::testing::HttpResponse;
using kvcm::testing::Subprocess;
using kvcm::testing::TempDir;

json Reference(const char* path = KVCM_SMOLLM2_REFERENCE) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return json::parse(text.str());
}

const json& Prompt(const json& reference, const std::string& name) {
  for (const json& p : reference["prompts"]) {
    if (p["name"] == name) return p;
  }
  ADD_FAILURE() << "no reference prompt " << name;
  static const json kNone = json::object();
  return kNone;
}

class RealModelRouterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    gguf_ = kvcm::testing::SmolLM2GgufPath();
    ASSERT_TRUE(std::filesystem::exists(gguf_)) << kvcm::testing::SmolLM2Missing(gguf_);
    reference_ = Reference();

    CacheManagerOptions options;
    options.num_blocks = 256;
    options.block_size = 16;
    options.layers = 30;
    options.kv_heads = 3;
    options.head_dim = 64;
    options.dtype = "fp32";
    StartStack(options);
  }

  // A cache manager with `options`, then kvcm-router and one kvcm-executor on gguf_.
  void StartStack(const CacheManagerOptions& options) {
    absl::StatusOr<std::unique_ptr<CacheManagerProcess>> cm = CacheManagerProcess::Start(options);
    ASSERT_THAT(cm, IsOk());
    cm_ = std::move(*cm);

    absl::StatusOr<TempDir> log = TempDir::Create("kvcm-real-router");
    ASSERT_THAT(log, IsOk());
    log_ = std::make_unique<TempDir>(std::move(*log));
    Subprocess::Options router;
    router.argv = {kvcm::testing::KvcmBinaryPath("kvcm-router"),
                   "--model",
                   gguf_,
                   "--run-dir",
                   cm_->run_dir(),
                   "--port",
                   "0",
                   "--max-input-tokens",
                   "1000",
                   "--max-total-tokens",
                   "1100"};
    router.output_path = log_->path() + "/router";
    absl::StatusOr<std::unique_ptr<Subprocess>> started = Subprocess::Start(router);
    ASSERT_THAT(started, IsOk());
    router_ = std::move(*started);
    auto ready = router_->WaitForLine("ready http=(\\S+)", absl::Now() + absl::Seconds(60));
    ASSERT_THAT(ready, IsOk()) << "\n" << router_->Output();
    url_ = (*ready)[1];

    ASSERT_NO_FATAL_FAILURE(executor_ = StartExecutor("exec-test"));
    const absl::Time deadline = absl::Now() + absl::Seconds(120);
    while (true) {
      absl::StatusOr<HttpResponse> health = kvcm::testing::HttpGet(url_ + "/health");
      if (health.ok() && health->status == 200) break;
      ASSERT_LT(absl::Now(), deadline) << router_->Output();
      absl::SleepFor(absl::Milliseconds(50));
    }
  }

  // One more kvcm-executor on gguf_ (extra_executor_args_ after its own).
  std::unique_ptr<ExecutorProcess> StartExecutor(const std::string& name) {
    ExecutorArgs args;
    args.model = gguf_;
    args.run_dir = cm_->run_dir();
    args.router = IpcEndpointIn(cm_->run_dir(), kRouterExecutorsSocket);
    args.name = name;
    args.threads = 2;
    // The fp32 matmuls: transformers' greedy tokens exactly. The int8 default rounds the
    // activations to 8 bits, which flips near ties (tests/services/executor/
    // real_model_test.cc checks it against the same reference).
    args.extra = {"--matmul=fp32"};
    args.extra.insert(args.extra.end(), extra_executor_args_.begin(), extra_executor_args_.end());
    absl::StatusOr<ExecutorProcess> executor = kvcm::testing::StartExecutor(args);
    EXPECT_THAT(executor, IsOk());
    if (!executor.ok()) return nullptr;
    return std::make_unique<ExecutorProcess>(std::move(*executor));
  }

  void TearDown() override {
    if (router_ != nullptr) {
      (void)router_->Signal(SIGTERM);
      (void)router_->Wait(absl::Seconds(10));
    }
  }

  HttpResponse Post(const std::string& path, const json& body) {
    absl::StatusOr<HttpResponse> reply =
        kvcm::testing::HttpPost(url_ + path, body.dump(), absl::Seconds(120));
    EXPECT_THAT(reply, IsOk());
    return reply.ok() ? *reply : HttpResponse{};
  }

  std::string gguf_;
  json reference_;
  std::unique_ptr<CacheManagerProcess> cm_;
  std::unique_ptr<TempDir> log_;
  std::unique_ptr<Subprocess> router_;
  std::unique_ptr<ExecutorProcess> executor_;
  std::vector<std::string> extra_executor_args_;
  std::string url_;
};

TEST_F(RealModelRouterTest, ChatCompletionsAnswerWhatTransformersAnswers) {
  for (const char* name : {"chat", "chat_system"}) {
    SCOPED_TRACE(name);
    const json& p = Prompt(reference_, name);
    ASSERT_TRUE(p["answer_ends_at_eos"].get<bool>());
    const json body = {{"model", "smollm2"},
                       {"messages", p["chat"]},
                       {"temperature", 0},
                       {"max_tokens", reference_["new_tokens"]}};
    const HttpResponse reply = Post("/v1/chat/completions", body);
    ASSERT_EQ(reply.status, 200) << reply.body;
    const json answer = json::parse(reply.body);
    EXPECT_EQ(answer["object"], "chat.completion");
    EXPECT_EQ(answer["model"], "SmolLM2-135M-Instruct.Q4_1");
    const json& choice = answer["choices"][0];
    EXPECT_EQ(choice["message"]["role"], "assistant");
    EXPECT_EQ(choice["message"]["content"], p["answer_text"]);
    EXPECT_EQ(choice["finish_reason"], "stop");
    EXPECT_EQ(answer["usage"]["prompt_tokens"], p["prompt_ids"].size());
    // The answer's tokens and the EOS that ended it.
    EXPECT_EQ(answer["usage"]["completion_tokens"], p["answer_ids"].size() + 1);
  }
}

TEST_F(RealModelRouterTest, StreamedChatDeltasAddUpToTheSameAnswer) {
  const json& p = Prompt(reference_, "chat");
  const json body = {{"messages", p["chat"]},
                     {"temperature", 0},
                     {"max_tokens", reference_["new_tokens"]},
                     {"stream", true},
                     {"stream_options", {{"include_usage", true}}}};
  const HttpResponse reply = Post("/v1/chat/completions", body);
  ASSERT_EQ(reply.status, 200) << reply.body;
  std::string content;
  std::string role;
  std::string finish;
  bool done = false;
  int64_t prompt_tokens = -1;
  for (absl::string_view line : absl::StrSplit(reply.body, '\n')) {
    if (!absl::ConsumePrefix(&line, "data: ")) continue;
    if (line == "[DONE]") {
      done = true;
      continue;
    }
    const json chunk = json::parse(std::string(line));
    EXPECT_EQ(chunk["object"], "chat.completion.chunk");
    if (chunk.contains("usage") && !chunk["usage"].is_null()) {
      prompt_tokens = chunk["usage"]["prompt_tokens"].get<int64_t>();
    }
    for (const json& choice : chunk["choices"]) {
      const json& delta = choice["delta"];
      if (delta.contains("role")) role = delta["role"].get<std::string>();
      if (delta.contains("content")) content += delta["content"].get<std::string>();
      if (!choice["finish_reason"].is_null()) finish = choice["finish_reason"].get<std::string>();
    }
  }
  EXPECT_TRUE(done);
  EXPECT_EQ(role, "assistant");
  EXPECT_EQ(content, p["answer_text"].get<std::string>());
  EXPECT_EQ(finish, "stop");
  EXPECT_EQ(prompt_tokens, static_cast<int64_t>(p["prompt_ids"].size()));
}

TEST_F(RealModelRouterTest, CompletionsOfPlainAndLongPromptsAreTransformersGreedyTokens) {
  for (const char* name : {"plain", "long"}) {
    SCOPED_TRACE(name);
    const json& p = Prompt(reference_, name);
    ASSERT_FALSE(p["answer_ends_at_eos"].get<bool>());
    const json body = {{"prompt", p["text"]},
                       {"temperature", 0},
                       {"max_tokens", reference_["new_tokens"]},
                       {"logprobs", 0}};
    const HttpResponse reply = Post("/v1/completions", body);
    ASSERT_EQ(reply.status, 200) << reply.body;
    const json answer = json::parse(reply.body);
    EXPECT_EQ(answer["choices"][0]["text"], p["answer_text"]);
    EXPECT_EQ(answer["choices"][0]["finish_reason"], "length");
    // No BOS: the prompt is exactly transformers' tokens.
    EXPECT_EQ(answer["usage"]["prompt_tokens"], p["prompt_ids"].size());
    EXPECT_EQ(answer["usage"]["completion_tokens"], p["greedy"].size());
  }
}

TEST_F(RealModelRouterTest, MalformedMessagesAndUnsupportedParametersGet400) {
  // Malformed messages are refused before the template runs, with 400 (OpenAI maps
  // invalid requests to 400).
  for (const json& messages :
       {json::array(), json::array({{{"content", "no role"}}}),
        json::array({{{"role", "user"}, {"content", 7}}}),
        json::array({{{"role", "user"}, {"content", json::array({{{"type", "image_url"}}})}}})}) {
    const HttpResponse reply = Post("/v1/chat/completions", {{"messages", messages}});
    EXPECT_EQ(reply.status, 400) << messages.dump() << ": " << reply.body;
    const json error = json::parse(reply.body, nullptr, false);
    ASSERT_FALSE(error.is_discarded()) << reply.body;
    EXPECT_EQ(error["error"]["param"], "messages") << reply.body;
  }
  const HttpResponse tools =
      Post("/v1/chat/completions", {{"messages", {{{"role", "user"}, {"content", "hi"}}}},
                                    {"tools", json::array({{{"type", "function"}}})}});
  EXPECT_EQ(tools.status, 400) << tools.body;
}

// The second real model, Gemma 3 270M (Q4_K_M GGUF, the base model: no chat template),
// served with the hybrid KV cache: the cache manager takes the model's shape from the GGUF
// (--model-config) and keeps six block tables per sequence, one for the full-attention
// layers (5, 11, 17) and one per group of three sliding-window layers (512 tokens). The
// answers must be transformers' greedy tokens (tests/reference/gemma3_270m_reference.json),
// for a prompt longer than the window too, whose window groups must release the blocks their
// window passed; the same prompt again must hit the cache and answer the same.
class Gemma3RouterTest : public RealModelRouterTest {
 protected:
  static constexpr int kGroups = 6;

  void SetUp() override {
    if (kvcm::testing::kUnderAddressSanitizer) {
      GTEST_SKIP() << "Gemma 3 270M's forward takes minutes under ASan (real_model.h)";
    }
    gguf_ = kvcm::testing::Gemma3GgufPath();
    ASSERT_TRUE(std::filesystem::exists(gguf_)) << kvcm::testing::Gemma3Missing(gguf_);
    reference_ = Reference(KVCM_GEMMA3_REFERENCE);
    CacheManagerOptions options;
    options.num_blocks = 768;  // pages of 3 layer slots; the window prompt takes up to 312
    options.block_size = 16;
    options.layers = 0;
    options.kv_heads = 0;
    options.head_dim = 0;
    options.dtype = "fp32";
    options.extra_args = {"--model-config", gguf_};
    StartStack(options);
  }

  double ManagerMetric(const std::string& name, const kvcm::testing::MetricLabels& labels) {
    absl::StatusOr<HttpResponse> scraped = kvcm::testing::HttpGet(cm_->metrics_url());
    if (!scraped.ok() || scraped->status != 200) return -1;
    absl::StatusOr<kvcm::testing::MetricsText> metrics =
        kvcm::testing::ParseMetricsText(scraped->body);
    if (!metrics.ok()) return -1;
    return metrics->Value(name, labels).value_or(-1);
  }

  double RouterMetric(const std::string& name) {
    absl::StatusOr<HttpResponse> scraped = kvcm::testing::HttpGet(url_ + "/metrics");
    if (!scraped.ok() || scraped->status != 200) return -1;
    absl::StatusOr<kvcm::testing::MetricsText> metrics =
        kvcm::testing::ParseMetricsText(scraped->body);
    if (!metrics.ok()) return -1;
    return metrics->Value(name).value_or(-1);
  }

  // kvcm_cache_group_window_released_blocks_total of each group.
  std::vector<double> WindowReleased() {
    std::vector<double> released;
    for (int g = 0; g < kGroups; ++g) {
      released.push_back(
          ManagerMetric("kvcm_cache_group_window_released_blocks_total",
                        {{"group", absl::StrCat(g)}, {"window", g == 0 ? "0" : "512"}}));
    }
    return released;
  }

  json Complete(const json& p) {
    const json body = {
        {"prompt", p["text"]}, {"temperature", 0}, {"max_tokens", reference_["new_tokens"]}};
    const HttpResponse reply = Post("/v1/completions", body);
    EXPECT_EQ(reply.status, 200) << reply.body;
    return json::parse(reply.body, nullptr, false);
  }
};

// Executors whose steps are slowed by 3 ms a layer, so that requests are still generating
// when one is killed.
class Gemma3ExecutorKillTest : public Gemma3RouterTest {
 protected:
  Gemma3ExecutorKillTest() { extra_executor_args_ = {"--fault-layer-delay-ms=3"}; }
};

TEST_F(Gemma3ExecutorKillTest, AnExecutorKilledMidGenerationChangesNoToken) {
  // Two executors; one is killed with SIGKILL while every request generates. Its step fails
  // and its sequences go on on the other executor, which reads the KV the dead one wrote into
  // the shared pool through every group's table (-1 behind the window groups' windows), and
  // every answer is still transformers'.
  std::unique_ptr<ExecutorProcess> second;
  ASSERT_NO_FATAL_FAILURE(second = StartExecutor("exec-second"));
  ASSERT_NE(second, nullptr);
  const absl::Time ready = absl::Now() + absl::Seconds(60);
  while (RouterMetric("kvcm_router_executors") < 2) {
    ASSERT_LT(absl::Now(), ready) << router_->Output();
    absl::SleepFor(absl::Milliseconds(20));
  }
  const std::vector<std::string> names = {"plain", "code", "non_latin", "window"};
  std::vector<json> answers(names.size());
  std::atomic<int> done{0};
  std::vector<std::thread> threads;
  for (size_t i = 0; i < names.size(); ++i) {
    threads.emplace_back([&, i] {
      answers[i] = Complete(Prompt(reference_, names[i]));
      ++done;
    });
  }
  // Every request generating, a few tokens in.
  const absl::Time deadline = absl::Now() + absl::Seconds(120);
  while (RouterMetric("kvcm_router_running_sequences") < 4 ||
         RouterMetric("kvcm_router_generated_tokens_total") < 8) {
    if (absl::Now() > deadline) break;
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_LT(absl::Now(), deadline) << router_->Output();
  ASSERT_THAT(second->process->Signal(SIGKILL), IsOk());
  const int done_at_kill = done.load();
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(done_at_kill, 0) << "the kill came too late to be mid-generation";
  for (size_t i = 0; i < names.size(); ++i) {
    SCOPED_TRACE(names[i]);
    ASSERT_TRUE(answers[i].is_object());
    EXPECT_EQ(answers[i]["choices"][0]["text"], Prompt(reference_, names[i])["answer_text"]);
  }
  EXPECT_THAT(router_->Output(), ::testing::HasSubstr("exited: dropped"));
  // Every block back: none in use once the answers are in.
  const absl::Time freed = absl::Now() + absl::Seconds(20);
  while (ManagerMetric("kvcm_cache_blocks", {{"state", "in_use"}}) != 0 && absl::Now() < freed) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_EQ(ManagerMetric("kvcm_cache_blocks", {{"state", "in_use"}}), 0);
}

TEST_F(Gemma3RouterTest, CompletionsAreTransformersGreedyTokens) {
  for (const char* name : {"plain", "code", "non_latin"}) {
    SCOPED_TRACE(name);
    const json& p = Prompt(reference_, name);
    ASSERT_FALSE(p["answer_ends_at_eos"].get<bool>());
    const json answer = Complete(p);
    ASSERT_TRUE(answer.is_object());
    EXPECT_EQ(answer["choices"][0]["text"], p["answer_text"]);
    EXPECT_EQ(answer["choices"][0]["finish_reason"], "length");
    // <bos> and then transformers' tokens: the reference's prompt ids include it.
    EXPECT_EQ(p["prompt_ids"][0], 2);
    EXPECT_EQ(answer["usage"]["prompt_tokens"], p["prompt_ids"].size());
    EXPECT_EQ(answer["usage"]["completion_tokens"], p["greedy"].size());
  }
}

TEST_F(Gemma3RouterTest, APromptLongerThanTheWindowReleasesBlocksAndHitsTheCacheAgain) {
  const json& p = Prompt(reference_, "window");
  const size_t prompt_tokens = p["prompt_ids"].size();
  ASSERT_GT(prompt_tokens, 512u + 16u);
  const json first = Complete(p);
  ASSERT_TRUE(first.is_object());
  EXPECT_EQ(first["choices"][0]["text"], p["answer_text"]);
  EXPECT_EQ(first["usage"]["prompt_tokens"], prompt_tokens);

  // Once the prompt is computed, every position before prompt_tokens - 511 is behind every
  // window: at least that many whole blocks go back in each window group, none in the full
  // group, and the five window groups release alike.
  const std::vector<double> released = WindowReleased();
  std::printf("window releases by group:");
  for (double r : released) std::printf(" %.0f", r);
  std::printf("\n");
  EXPECT_EQ(released[0], 0);
  const double at_least = static_cast<double>((prompt_tokens - 511) / 16);
  for (int g = 1; g < kGroups; ++g) {
    EXPECT_GE(released[static_cast<size_t>(g)], at_least) << "group " << g;
    EXPECT_EQ(released[static_cast<size_t>(g)], released[1]) << "group " << g;
  }

  // The same prompt again: its whole blocks but the last token's are cached in every group
  // (the window groups' released blocks stay cached), and the answer is the same.
  const double hits_before = ManagerMetric("kvcm_cache_prefix_hit_tokens_total", {});
  const json second = Complete(p);
  ASSERT_TRUE(second.is_object());
  EXPECT_EQ(second["choices"][0]["text"], p["answer_text"]);
  const double hits = ManagerMetric("kvcm_cache_prefix_hit_tokens_total", {}) - hits_before;
  std::printf("second request: %.0f of %zu prompt tokens from the cache\n", hits, prompt_tokens);
  EXPECT_EQ(hits, static_cast<double>((prompt_tokens - 1) / 16 * 16));
}

}  // namespace
}  // namespace kvcm
