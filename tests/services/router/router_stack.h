#pragma once
// The whole stack for router tests, as real processes: a cache manager, the router and
// executors of a tiny random model, with helpers to send requests over HTTP and to compute
// what they must answer (the model run alone in the test's process, the contiguous
// reference forward).

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/base/run_dir.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/services/executor/executor_test_util.h"
#include "tests/support/cache_manager_process.h"
#include "tests/support/http_client.h"
#include "tests/support/metrics_text.h"
#include "tests/support/status_matchers.h"
#include "tests/support/subprocess.h"

namespace kvcm::testing {

using json = nlohmann::json;

constexpr uint64_t kModelSeed = 7;

// Block states sum to the pool.
inline void ExpectWhole(const StatsSnapshot& stats) {
  EXPECT_EQ(stats.free_blocks + stats.in_use_blocks + stats.cached_blocks + stats.pinned_blocks,
            stats.num_blocks);
}
constexpr int32_t kBlockSize = 4;

class RouterStackTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    absl::StatusOr<TempDir> dir = TempDir::Create("kvcm-router");
    ASSERT_THAT(dir, IsOk());
    dir_ = new TempDir(std::move(*dir));
    model_dir_ = new std::string(dir_->path() + "/tiny");
    ASSERT_THAT(kvcm::testing::MakeTinyModel(*model_dir_, kModelSeed), IsOk());
    absl::StatusOr<std::unique_ptr<executor::LlamaModel>> model =
        executor::LlamaModel::Load(*model_dir_);
    ASSERT_THAT(model, IsOk());
    model_ = model->release();
  }
  static void TearDownTestSuite() {
    delete model_;
    delete model_dir_;
    delete dir_;
  }

  void TearDown() override {
    if (router_ != nullptr) {
      (void)router_->Signal(SIGTERM);
      (void)router_->Wait(absl::Seconds(10));
    }
  }

  // A cache manager of `num_blocks`, the router, and `executors` executors registered.
  void StartStack(int32_t num_blocks, int executors, std::vector<std::string> router_flags = {},
                  std::vector<std::string> executor_flags = {}, std::string run_dir = "") {
    CacheManagerOptions options = ManagerOptions(num_blocks, run_dir);
    absl::StatusOr<std::unique_ptr<CacheManagerProcess>> cm = CacheManagerProcess::Start(options);
    ASSERT_THAT(cm, IsOk());
    cm_ = std::move(*cm);
    StartRouterAndExecutors(executors, router_flags, executor_flags);
  }

  CacheManagerOptions ManagerOptions(int32_t num_blocks, const std::string& run_dir) const {
    CacheManagerOptions options;
    options.run_dir = run_dir;
    options.num_blocks = num_blocks;
    options.block_size = kBlockSize;
    options.layers = model_->config().num_hidden_layers;
    options.kv_heads = model_->config().num_key_value_heads;
    options.head_dim = model_->config().head_dim;
    options.dtype = "fp32";
    options.heartbeat_interval_ms = 100;
    options.heartbeat_timeout_ms = 2000;
    return options;
  }

  void StartRouterAndExecutors(int executors, const std::vector<std::string>& router_flags,
                               const std::vector<std::string>& executor_flags) {
    ASSERT_NO_FATAL_FAILURE(StartRouter(router_flags));
    for (int i = 0; i < executors; ++i) {
      ExecutorArgs args;
      args.model = *model_dir_;
      args.run_dir = cm_->run_dir();
      args.router = IpcEndpointIn(cm_->run_dir(), kRouterExecutorsSocket);
      args.name = absl::StrCat("exec-", i);
      args.threads = 1;
      args.extra = executor_flags;
      absl::StatusOr<ExecutorProcess> executor = kvcm::testing::StartExecutor(args);
      ASSERT_THAT(executor, IsOk());
      executors_.push_back(std::move(*executor));
    }
    ASSERT_NO_FATAL_FAILURE(AwaitExecutors(executors));
  }

  void StartRouter(const std::vector<std::string>& router_flags) {
    absl::StatusOr<TempDir> log = TempDir::Create("kvcm-rlog");
    ASSERT_THAT(log, IsOk());
    log_ = std::make_unique<TempDir>(std::move(*log));
    Subprocess::Options router;
    const std::vector<std::string> command = {
        KvcmBinaryPath("kvcm-router"),
        "--model",
        router_model_dir_.empty() ? *model_dir_ : router_model_dir_,
        "--run-dir",
        cm_->run_dir(),
        "--port",
        "0"};
    router.argv = router_wrapper_;
    router.argv.insert(router.argv.end(), command.begin(), command.end());
    router.argv.insert(router.argv.end(), router_flags.begin(), router_flags.end());
    router.output_path = log_->path() + "/router";
    absl::StatusOr<std::unique_ptr<Subprocess>> started = Subprocess::Start(router);
    ASSERT_THAT(started, IsOk());
    router_ = std::move(*started);
    auto ready = router_->WaitForLine("ready http=(\\S+)", absl::Now() + absl::Seconds(30));
    ASSERT_THAT(ready, IsOk()) << "\n" << router_->Output();
    url_ = (*ready)[1];
  }

  // Until `executors` are registered with the router (and /health answers 200).
  void AwaitExecutors(int executors) {
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    while (true) {
      absl::StatusOr<HttpResponse> health = kvcm::testing::HttpGet(url_ + "/health");
      if (health.ok() && health->status == 200) {
        absl::StatusOr<HttpResponse> info = kvcm::testing::HttpGet(url_ + "/info");
        if (info.ok() && json::parse(info->body)["executors"].get<int>() == executors) break;
      }
      ASSERT_LT(absl::Now(), deadline) << router_->Output();
      absl::SleepFor(absl::Milliseconds(20));
    }
  }

  // A metric of the router's /metrics (-1 when missing).
  double RouterMetric(const std::string& name, const kvcm::testing::MetricLabels& labels = {}) {
    absl::StatusOr<HttpResponse> scraped = kvcm::testing::HttpGet(url_ + "/metrics");
    if (!scraped.ok() || scraped->status != 200) return -1;
    absl::StatusOr<kvcm::testing::MetricsText> metrics =
        kvcm::testing::ParseMetricsText(scraped->body);
    if (!metrics.ok()) return -1;
    absl::StatusOr<double> value = metrics->Value(name, labels);
    return value.ok() ? *value : -1;
  }

  // The prompt's token ids as the router makes them: BOS, then one per byte.
  static std::vector<int32_t> PromptIds(const std::string& text) {
    std::vector<int32_t> ids = {1};
    for (unsigned char c : text) ids.push_back(3 + c);
    return ids;
  }
  // What the router must answer: the greedy tokens, up to and including the first EOS.
  static std::vector<int32_t> Reference(const std::string& text, int32_t n) {
    return kvcm::testing::ReferenceAnswer(*model_, PromptIds(text), n);
  }

  // Token ids of a /generate reply with details.
  static std::vector<int32_t> TokenIds(const std::string& body) {
    std::vector<int32_t> ids;
    const json reply = json::parse(body, nullptr, false);
    if (reply.is_discarded() || !reply.contains("details")) return ids;
    for (const json& token : reply["details"]["tokens"]) ids.push_back(token["id"].get<int32_t>());
    return ids;
  }
  // Token ids of a /generate_stream reply (server-sent events).
  static std::vector<int32_t> StreamIds(const std::string& body, std::string* last = nullptr) {
    std::vector<int32_t> ids;
    for (absl::string_view line : absl::StrSplit(body, '\n')) {
      if (!absl::ConsumePrefix(&line, "data:")) continue;
      const json event = json::parse(std::string(line), nullptr, false);
      if (event.is_discarded() || !event.contains("token")) continue;
      ids.push_back(event["token"]["id"].get<int32_t>());
      if (last != nullptr) *last = std::string(line);
    }
    return ids;
  }

  static std::string GenerateBody(const std::string& text, int32_t max_new_tokens) {
    return json{{"inputs", text},
                {"parameters", {{"max_new_tokens", max_new_tokens}, {"details", true}}}}
        .dump();
  }

  // /generate requests of `max_new_tokens` for `texts`, each on its own thread, started now.
  struct Requests {
    std::vector<std::vector<int32_t>> got;  // token ids of each 200 reply
    std::vector<std::string> errors;        // else what came back
    std::atomic<int> done{0};
    std::vector<std::thread> threads;
    void Join() {
      for (std::thread& t : threads) {
        if (t.joinable()) t.join();
      }
    }
    ~Requests() { Join(); }  // also when an assertion left the test early
  };
  std::unique_ptr<Requests> StartRequests(const std::vector<std::string>& texts,
                                          int32_t max_new_tokens) {
    auto requests = std::make_unique<Requests>();
    requests->got.resize(texts.size());
    requests->errors.resize(texts.size());
    Requests* r = requests.get();
    for (size_t i = 0; i < texts.size(); ++i) {
      r->threads.emplace_back([this, r, i, text = texts[i], max_new_tokens] {
        absl::StatusOr<HttpResponse> reply =
            HttpPost(url_ + "/generate", GenerateBody(text, max_new_tokens), absl::Seconds(120));
        if (reply.ok() && reply->status == 200) {
          r->got[i] = TokenIds(reply->body);
        } else {
          r->errors[i] = reply.ok() ? absl::StrCat(reply->status, " ", reply->body)
                                    : reply.status().ToString();
        }
        ++r->done;
      });
    }
    return requests;
  }

  // Every request of `texts` was answered, with the model's own `n` tokens.
  static void ExpectReferenceAnswers(const Requests& requests,
                                     const std::vector<std::string>& texts, int32_t n) {
    for (size_t i = 0; i < texts.size(); ++i) {
      EXPECT_EQ(requests.errors[i], "") << i;
      EXPECT_EQ(requests.got[i], Reference(texts[i], n)) << i;
    }
  }

  StatsSnapshot Stats() {
    CacheManagerClient::Options options;
    options.endpoint = cm_->endpoint();
    options.role = wire::Role::Control;
    options.name = "test";
    options.heartbeats = false;
    auto client = CacheManagerClient::Connect(options);
    EXPECT_THAT(client, IsOk());
    if (!client.ok()) return {};
    absl::StatusOr<StatsSnapshot> stats = (*client)->Stats();
    EXPECT_THAT(stats, IsOk());
    // Ends the session: the cache manager keeps 64 per process (--max-sessions-per-process),
    // and a poll of AwaitNoBlockInUse every 20 ms would otherwise run out of them in ~1.3 s
    // and then read the empty snapshot of a refused Hello as "nothing in use".
    absl::StatusOr<int32_t> goodbye = (*client)->Goodbye();
    EXPECT_THAT(goodbye, IsOk());
    return stats.ok() ? *stats : StatsSnapshot{};
  }

  // Waits until `sequences` sequences run and at least `tokens` tokens were generated: the
  // requests are mid-generation (a condition, not a fixed time; docs/RELIABILITY.md, "Timing
  // in tests"). False after 60 s.
  bool AwaitGenerating(int sequences, double tokens) {
    const absl::Time deadline = absl::Now() + absl::Seconds(60);
    while (absl::Now() < deadline) {
      if (RouterMetric("kvcm_router_running_sequences") >= sequences &&
          RouterMetric("kvcm_router_generated_tokens_total") >= tokens) {
        return true;
      }
      absl::SleepFor(absl::Milliseconds(5));
    }
    return false;
  }

  // Waits until no block is in use (the router's frees go out with its next step).
  bool AwaitNoBlockInUse() {
    const absl::Time deadline = absl::Now() + absl::Seconds(20);
    while (absl::Now() < deadline) {
      const StatsSnapshot stats = Stats();
      if (stats.num_blocks > 0 && stats.in_use_blocks == 0) return true;
      absl::SleepFor(absl::Milliseconds(20));
    }
    return false;
  }

  static inline TempDir* dir_ = nullptr;
  static inline std::string* model_dir_ = nullptr;
  static inline executor::LlamaModel* model_ = nullptr;
  std::unique_ptr<CacheManagerProcess> cm_;
  std::unique_ptr<TempDir> log_;
  std::unique_ptr<Subprocess> router_;
  std::vector<ExecutorProcess> executors_;
  std::string url_;
  // Set before StartStack: a command the router runs under (e.g. {"prlimit",
  // "--nofile=256:256", "--"}), and a model folder for the router other than the executors'
  // (the same weights with another tokenizer).
  std::vector<std::string> router_wrapper_;
  std::string router_model_dir_;
};

// The text of byte-level token ids (3 + b is byte b; other ids decode to nothing).
inline std::string BytesOf(const std::vector<int32_t>& ids) {
  std::string text;
  for (int32_t id : ids) {
    if (id >= 3 && id < 259) text.push_back(static_cast<char>(id - 3));
  }
  return text;
}

// `text` as it reads back from the router's JSON: bytes that are not UTF-8 become U+FFFD.
inline std::string AsJsonText(const std::string& text) {
  return json::parse(json(text).dump(-1, ' ', false, json::error_handler_t::replace))
      .get<std::string>();
}

// The model's log-probabilities, from the contiguous reference pass (fp32, no pool).
struct ReferenceScores {
  std::vector<int32_t> tokens;                              // greedy, with the penalties
  std::vector<float> logprobs;                              // of each
  std::vector<std::vector<std::pair<int32_t, float>>> top;  // top 3 of each
  std::vector<float> prompt;                                // of each prompt token after the first
};
inline ReferenceScores Score(const executor::LlamaModel& model, std::vector<int32_t> context,
                             int32_t n, const SamplingParams& penalties = {}) {
  ReferenceScores out;
  const size_t vocab = static_cast<size_t>(model.config().vocab_size);
  const auto prompt_len = static_cast<int32_t>(context.size());
  absl::StatusOr<std::vector<float>> all = model.ForwardContiguous(context);
  if (!all.ok()) return out;
  for (size_t j = 1; j < context.size(); ++j) {
    out.prompt.push_back(executor::LogprobOf({all->data() + (j - 1) * vocab, vocab}, context[j]));
  }
  for (int32_t i = 0; i < n; ++i) {
    absl::StatusOr<std::vector<float>> logits = model.ForwardContiguous(context);
    if (!logits.ok()) return out;
    std::vector<float> last(logits->end() - static_cast<std::ptrdiff_t>(vocab), logits->end());
    executor::ApplyPenalties(last, context, prompt_len, penalties);
    const int32_t token = executor::Greedy(last);
    out.tokens.push_back(token);
    out.logprobs.push_back(executor::LogprobOf(last, token));
    auto& top = out.top.emplace_back();
    for (const executor::TokenLogprob& t : executor::TopLogprobs(last, 3))
      top.emplace_back(t.token, t.logprob);
    context.push_back(token);
  }
  return out;
}

}  // namespace kvcm::testing
