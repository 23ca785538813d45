// The whole stack on the bundled real model, SmolLM2-135M-Instruct (Q4_1 GGUF): a real
// cache manager, kvcm-router and one kvcm-executor, both given the GGUF file, over real
// HTTP. What they answer is compared with transformers on the same GGUF
// (tests/reference/smollm2_reference.json, from tests/reference/smollm2_reference.py):
//   - /v1/chat/completions renders the messages with the model's own chat template (kvcm's
//     Jinja interpreter), tokenizes them with the GGUF's BPE vocabulary, and answers
//     transformers' greedy text, ended at <|im_end|> (EOS) with finish_reason "stop" and
//     usage.prompt_tokens equal to transformers' prompt length, streamed or not;
//   - /v1/completions on a plain prompt gets no BOS (the GGUF says add_bos_token = false)
//     and answers transformers' greedy tokens.
// The pool and the matmuls (--matmul=fp32) are fp32, as the reference computes, so greedy
// choices cannot flip on rounding.

#include <signal.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
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

json Reference() {
  std::ifstream in(KVCM_SMOLLM2_REFERENCE);
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

    ExecutorArgs args;
    args.model = gguf_;
    args.run_dir = cm_->run_dir();
    args.router = IpcEndpointIn(cm_->run_dir(), kRouterExecutorsSocket);
    args.threads = 2;
    // The fp32 matmuls: transformers' greedy tokens exactly. The int8 default rounds the
    // activations to 8 bits, which flips near ties (tests/services/executor/
    // real_model_test.cc checks it against the same reference).
    args.extra = {"--matmul=fp32"};
    absl::StatusOr<ExecutorProcess> executor = kvcm::testing::StartExecutor(args);
    ASSERT_THAT(executor, IsOk());
    executor_ = std::make_unique<ExecutorProcess>(std::move(*executor));
    const absl::Time deadline = absl::Now() + absl::Seconds(120);
    while (true) {
      absl::StatusOr<HttpResponse> health = kvcm::testing::HttpGet(url_ + "/health");
      if (health.ok() && health->status == 200) break;
      ASSERT_LT(absl::Now(), deadline) << router_->Output();
      absl::SleepFor(absl::Milliseconds(50));
    }
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

}  // namespace
}  // namespace kvcm
