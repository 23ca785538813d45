// kvcm-router end to end, with real processes and real HTTP: a cache manager, executors of
// the tiny model, the router; requests over TGI's API. Greedy tokens must equal the model
// run alone in this process (the contiguous reference forward); bad requests get their 4xx
// and leave the ledger whole; a client that leaves mid-stream frees its blocks; an executor
// killed with SIGKILL mid-generation changes no token.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
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
#include "tests/services/router/router_stack.h"
#include "tests/support/cache_manager_process.h"
#include "tests/support/http_client.h"
#include "tests/support/metrics_text.h"
#include "tests/support/promtool.h"
#include "tests/support/status_matchers.h"
#include "tests/support/subprocess.h"

namespace kvcm {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using namespace ::kvcm::testing;  // NOLINT: the stack's helpers
using RouterProcessTest = RouterStackTest;

// What an OpenAI /v1/completions stream said: the last finish_reason, the text of its
// choices joined, and the usage chunk's completion_tokens (-1 without one).
struct OpenAiStream {
  std::string finish;
  std::string text;
  int64_t tokens = -1;
};
OpenAiStream ReadOpenAiStream(const std::string& body) {
  OpenAiStream out;
  for (absl::string_view line : absl::StrSplit(body, '\n')) {
    if (!absl::ConsumePrefix(&line, "data: ") || line == "[DONE]") continue;
    const json chunk = json::parse(std::string(line));
    if (chunk.contains("usage") && chunk["usage"].is_object()) {
      out.tokens = chunk["usage"]["completion_tokens"].get<int64_t>();
    }
    for (const json& choice : chunk["choices"]) {
      if (choice["finish_reason"].is_string()) out.finish = choice["finish_reason"];
      if (choice["text"].is_string()) out.text += choice["text"].get<std::string>();
    }
  }
  return out;
}

TEST_F(RouterProcessTest, ConcurrentGreedyRequestsGiveTheTokensOfTheModelRunAlone) {
  ASSERT_NO_FATAL_FAILURE(StartStack(/*num_blocks=*/512, /*executors=*/2));
  // 32 requests over HTTP at once, mixed lengths, every other one streaming, several sharing
  // a system prompt.
  const std::string system = "You are a helpful assistant. Answer briefly. ";
  struct Case {
    std::string text;
    int32_t n;
    bool stream;
  };
  std::vector<Case> cases;
  for (int i = 0; i < 32; ++i) {
    std::string text = (i % 3 == 0 ? system : "") + absl::StrCat("question ", i, "?");
    text.append(static_cast<size_t>(i % 5) * 7, 'a' + static_cast<char>(i % 26));
    cases.push_back({text, 4 + (i * 5) % 17, i % 2 == 1});
  }
  std::vector<std::vector<int32_t>> got(cases.size());
  std::vector<std::string> errors(cases.size());
  std::vector<std::thread> clients;
  for (size_t i = 0; i < cases.size(); ++i) {
    clients.emplace_back([&, i] {
      const Case& c = cases[i];
      absl::StatusOr<HttpResponse> reply =
          HttpPost(url_ + (c.stream ? "/generate_stream" : "/generate"), GenerateBody(c.text, c.n),
                   absl::Seconds(60));
      if (!reply.ok() || reply->status != 200) {
        errors[i] =
            reply.ok() ? absl::StrCat(reply->status, " ", reply->body) : reply.status().ToString();
        return;
      }
      got[i] = c.stream ? StreamIds(reply->body) : TokenIds(reply->body);
    });
  }
  for (std::thread& t : clients) t.join();
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE(cases[i].text);
    EXPECT_EQ(errors[i], "");
    EXPECT_EQ(got[i], Reference(cases[i].text, cases[i].n));
  }
  EXPECT_TRUE(AwaitNoBlockInUse()) << router_->Output();
  ExpectWhole(Stats());
}

// More streams than the HTTP thread delivers in one turn of its loop (64 tokens a slice,
// services/router/http_frontend.cc): a step's tokens are handed over in slices, and those
// of the next step may arrive while a slice is pending. Every stream still gets exactly
// its tokens, in order.
TEST_F(RouterProcessTest, MoreStreamsThanASliceOfDeliveryEachGetTheirTokensInOrder) {
  ASSERT_NO_FATAL_FAILURE(
      StartStack(/*num_blocks=*/1024, /*executors=*/1, {"--max-concurrent-requests", "256"}));
  constexpr int kStreams = 150;
  std::vector<std::string> prompts;
  for (int p = 0; p < 6; ++p) prompts.push_back(absl::StrCat("stream ", p, std::string(p, '+')));
  auto prompt_of = [&](int i) { return prompts[static_cast<size_t>(i) % prompts.size()]; };
  auto tokens_of = [](int i) { return 3 + i % 5; };
  std::vector<std::vector<int32_t>> got(kStreams);
  std::vector<std::string> errors(kStreams);
  std::vector<std::thread> clients;
  for (int i = 0; i < kStreams; ++i) {
    clients.emplace_back([&, i] {
      absl::StatusOr<HttpResponse> reply = HttpPost(
          url_ + "/generate_stream", GenerateBody(prompt_of(i), tokens_of(i)), absl::Seconds(120));
      if (!reply.ok() || reply->status != 200) {
        errors[static_cast<size_t>(i)] =
            reply.ok() ? absl::StrCat(reply->status, " ", reply->body) : reply.status().ToString();
        return;
      }
      got[static_cast<size_t>(i)] = StreamIds(reply->body);
    });
  }
  for (std::thread& t : clients) t.join();
  for (int i = 0; i < kStreams; ++i) {
    SCOPED_TRACE(absl::StrCat("stream ", i));
    EXPECT_EQ(errors[static_cast<size_t>(i)], "");
    EXPECT_EQ(got[static_cast<size_t>(i)], Reference(prompt_of(i), tokens_of(i)));
  }
  EXPECT_TRUE(AwaitNoBlockInUse()) << router_->Output();
  ExpectWhole(Stats());
}

TEST_F(RouterProcessTest, SharedPrefixRequestsComputeFewerPromptTokensAndTheMetricsSayIt) {
  ASSERT_NO_FATAL_FAILURE(StartStack(/*num_blocks=*/256, /*executors=*/1));
  const std::string system(40, 's');  // BOS + 40 bytes: 10 full blocks of 4
  absl::StatusOr<HttpResponse> first = HttpPost(url_ + "/generate", GenerateBody(system + "a", 2));
  ASSERT_TRUE(first.ok() && first->status == 200);
  // The first request's blocks were committed and stay cached; three more share them.
  for (const char* tail : {"b?", "cc", "ddd"}) {
    absl::StatusOr<HttpResponse> reply =
        HttpPost(url_ + "/generate", GenerateBody(system + tail, 3));
    ASSERT_TRUE(reply.ok() && reply->status == 200);
    EXPECT_EQ(TokenIds(reply->body), Reference(system + tail, 3)) << tail;
  }
  // 40 cached tokens for each of the three (the first 10 blocks; never the last token's).
  EXPECT_EQ(RouterMetric("kvcm_router_prompt_tokens_total", {{"source", "cached"}}), 3 * 40);
  const double prompts = (1 + 41) + (1 + 42) + (1 + 42) + (1 + 43);  // BOS + bytes
  EXPECT_EQ(RouterMetric("kvcm_router_prompt_tokens_total", {{"source", "computed"}}),
            prompts - 3 * 40);
  EXPECT_EQ(RouterMetric("kvcm_router_generated_tokens_total"), 2 + 3 * 3);
  EXPECT_EQ(RouterMetric("kvcm_router_requests_total", {{"api", "tgi"}, {"outcome", "ok"}}), 4);
  EXPECT_EQ(RouterMetric("kvcm_router_executors"), 1);
  EXPECT_EQ(RouterMetric("kvcm_router_recomputed_committed_tokens_total"), 0);
  EXPECT_EQ(RouterMetric("kvcm_router_time_to_first_token_seconds_count"), 4);
  // promtool finds nothing to say about the exposition.
  absl::StatusOr<HttpResponse> scraped = kvcm::testing::HttpGet(url_ + "/metrics");
  ASSERT_TRUE(scraped.ok() && scraped->status == 200);
  absl::StatusOr<kvcm::testing::RunResult> lint =
      kvcm::testing::PromtoolCheckMetrics(scraped->body);
  ASSERT_THAT(lint, IsOk());
  EXPECT_EQ(lint->exit_code, 0) << lint->output;
}

TEST_F(RouterProcessTest, TheStepTraceHasALinePerStepWithItsPartsInOrderAndItsTokens) {
  absl::StatusOr<TempDir> dir = TempDir::Create("kvcm-trace");
  ASSERT_THAT(dir, IsOk());
  const std::string trace = dir->path() + "/steps.jsonl";
  ASSERT_NO_FATAL_FAILURE(StartStack(/*num_blocks=*/256, /*executors=*/2, {"--step-trace", trace}));
  std::vector<std::thread> clients;
  std::atomic<int> ok{0};
  std::atomic<int64_t> generated{0};
  for (int i = 0; i < 6; ++i) {
    clients.emplace_back([&, i] {
      absl::StatusOr<HttpResponse> reply = HttpPost(
          url_ + "/generate",
          GenerateBody(absl::StrCat("trace ", std::string(static_cast<size_t>(i) * 7, 'x')),
                       3 + i));
      if (!reply.ok() || reply->status != 200) return;
      ++ok;
      generated += static_cast<int64_t>(TokenIds(reply->body).size());
    });
  }
  for (std::thread& t : clients) t.join();
  ASSERT_EQ(ok.load(), 6);
  // A step's line is written just after its tokens go to the HTTP thread, and the frees
  // come a step after the last token: wait for the pool to drain and the lines to catch up.
  EXPECT_TRUE(AwaitNoBlockInUse());
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  auto count_lines = [&trace] {
    std::ifstream in(trace);
    return static_cast<double>(
        std::count(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>(), '\n'));
  };
  while (count_lines() < RouterMetric("kvcm_router_step_duration_seconds_count") &&
         absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  std::ifstream in(trace);
  ASSERT_TRUE(in.good());
  int lines = 0;
  int64_t tokens = 0;
  int64_t prefill = 0;
  uint64_t last_step = 0;
  int64_t last_delivered = 0;
  for (std::string line; std::getline(in, line);) {
    const nlohmann::json j = nlohmann::json::parse(line);
    ++lines;
    const auto planned = j.at("planned_ns").get<int64_t>();
    const auto dispatched = j.at("dispatched_ns").get<int64_t>();
    const auto answered = j.at("answered_ns").get<int64_t>();
    const auto delivered = j.at("delivered_ns").get<int64_t>();
    EXPECT_GT(j.at("step").get<uint64_t>(), last_step) << line;
    last_step = j.at("step").get<uint64_t>();
    EXPECT_GE(planned, last_delivered) << line;  // one step at a time
    EXPECT_LE(planned, dispatched) << line;
    EXPECT_LE(dispatched, answered) << line;
    EXPECT_LE(answered, delivered) << line;
    last_delivered = delivered;
    EXPECT_GE(j.at("cache_manager_ns").get<int64_t>(), 0) << line;
    EXPECT_LE(j.at("cache_manager_ns").get<int64_t>(), dispatched - planned) << line;
    // A step of block ops alone (the frees after the last tokens) goes to no executor.
    EXPECT_EQ(j.at("executors").get<int>() > 0, j.at("sequences").get<int>() > 0) << line;
    EXPECT_LE(j.at("executors").get<int>(), 2) << line;
    EXPECT_GE(j.at("sequences").get<int>(), j.at("tokens").get<int>()) << line;
    tokens += j.at("tokens").get<int>();
    prefill += j.at("prefill_tokens").get<int>();
  }
  EXPECT_EQ(lines, RouterMetric("kvcm_router_step_duration_seconds_count"));
  EXPECT_EQ(tokens, RouterMetric("kvcm_router_generated_tokens_total"));
  EXPECT_EQ(tokens, generated.load());
  EXPECT_EQ(prefill, RouterMetric("kvcm_router_prompt_tokens_total", {{"source", "computed"}}));
}

TEST_F(RouterProcessTest, AStepTraceThatCannotBeWrittenStopsTheRouterNamingTheFile) {
  ASSERT_NO_FATAL_FAILURE(StartStack(/*num_blocks=*/64, /*executors=*/1));
  const std::string trace = cm_->run_dir() + "/no-such-dir/steps.jsonl";
  absl::StatusOr<kvcm::testing::RunResult> second =
      kvcm::testing::RunProgram({KvcmBinaryPath("kvcm-router"), "--model", *model_dir_, "--run-dir",
                                 cm_->run_dir(), "--port", "0", "--step-trace", trace},
                                "", absl::Seconds(30));
  ASSERT_THAT(second, IsOk());
  EXPECT_NE(second->exit_code, 0);
  EXPECT_THAT(second->output, HasSubstr("cannot open the step trace " + trace));
}

TEST_F(RouterProcessTest, AStopSequenceEndsTheRequestAfterTheTokenThatCompletesIt) {
  ASSERT_NO_FATAL_FAILURE(StartStack(/*num_blocks=*/128, /*executors=*/1));
  const std::string prompt = "stop when you see it";
  const std::vector<int32_t> full = Reference(prompt, 30);
  ASSERT_GE(full.size(), 12u);
  // A stop sequence from the middle of what the model would say: the bytes of two
  // consecutive byte tokens.
  size_t at = 6;
  while (at + 2 < full.size() && BytesOf({full[at], full[at + 1]}).size() < 2) ++at;
  ASSERT_LT(at + 2, full.size()) << "no two byte tokens in a row to stop at";
  const std::string stop = BytesOf({full[at], full[at + 1]});
  std::vector<int32_t> want;
  for (int32_t id : full) {
    want.push_back(id);
    if (BytesOf(want).find(stop) != std::string::npos) break;
  }
  ASSERT_LT(want.size(), full.size());
  for (const bool stream : {false, true}) {
    SCOPED_TRACE(stream);
    const std::string body =
        json{{"inputs", prompt},
             {"parameters", {{"max_new_tokens", 30}, {"details", true}, {"stop", {stop}}}}}
            .dump(-1, ' ', false, json::error_handler_t::replace);
    absl::StatusOr<HttpResponse> reply =
        HttpPost(url_ + (stream ? "/generate_stream" : "/generate"), body);
    ASSERT_TRUE(reply.ok() && reply->status == 200) << (reply.ok() ? reply->body : "");
    std::string last;
    EXPECT_EQ(stream ? StreamIds(reply->body, &last) : TokenIds(reply->body), want);
    const json final_part = json::parse(stream ? last : reply->body, nullptr, false);
    ASSERT_FALSE(final_part.is_discarded());
    EXPECT_EQ(final_part["details"]["finish_reason"], "stop_sequence");
  }
  EXPECT_TRUE(AwaitNoBlockInUse());
}

// vLLM's rule for stop strings and min_tokens: none is looked for while the first
// min_tokens tokens come out, and a match must end in a later token's text. Regression: the
// router ended such a request at a stop string inside its first min_tokens tokens, and
// OpenAI's text was cut at the first occurrence anywhere.
TEST_F(RouterProcessTest, AStopStringInsideTheFirstMinTokensDoesNotEndTheRequest) {
  ASSERT_NO_FATAL_FAILURE(StartStack(/*num_blocks=*/128, /*executors=*/1));
  const std::string prompt = "stop when you see it";
  constexpr int kMaxTokens = 30;
  const std::vector<int32_t> full = Reference(prompt, kMaxTokens);
  ASSERT_GE(full.size(), 12u);
  // A stop string the model says early: the bytes of two consecutive byte tokens, valid
  // UTF-8 (JSON carries nothing else).
  auto usable = [&](size_t i) {
    const std::string pair = BytesOf({full[i], full[i + 1]});
    return pair.size() >= 2 && AsJsonText(pair) == pair;
  };
  size_t at = 2;
  while (at + 2 < full.size() && !usable(at)) ++at;
  ASSERT_LT(at + 2, full.size()) << "no two byte tokens in a row to stop at";
  const std::string stop = BytesOf({full[at], full[at + 1]});
  auto prefix = [&](size_t k) {
    return BytesOf(
        std::vector<int32_t>(full.begin(), full.begin() + static_cast<std::ptrdiff_t>(k)));
  };
  // The first token whose text completes the stop string: min_tokens covers it.
  size_t first_end = 1;
  while (prefix(first_end).find(stop) == std::string::npos) ++first_end;
  const auto min_tokens = static_cast<int32_t>(first_end);
  // What must come instead: the first later token whose own text ends a match.
  size_t end = full.size();
  size_t match = std::string::npos;
  for (size_t k = first_end + 1; k <= full.size(); ++k) {
    const size_t before = prefix(k - 1).size();
    const size_t from = before - std::min(before, stop.size() - 1);
    const size_t found = prefix(k).find(stop, from);
    if (found != std::string::npos) {
      end = k;
      match = found;
      break;
    }
  }
  std::printf("stop string at token %zu; min_tokens %d; ends at token %zu of %zu (%s)\n", first_end,
              min_tokens, end, full.size(),
              match == std::string::npos ? "length" : "stop string again");
  const json body = {{"prompt", prompt}, {"max_tokens", kMaxTokens}, {"temperature", 0},
                     {"stop", {stop}},   {"min_tokens", min_tokens}, {"logprobs", 0}};
  absl::StatusOr<HttpResponse> reply =
      HttpPost(url_ + "/v1/completions", body.dump(-1, ' ', false, json::error_handler_t::replace));
  ASSERT_TRUE(reply.ok() && reply->status == 200) << (reply.ok() ? reply->body : "");
  const json got = json::parse(reply->body);
  EXPECT_EQ(got["usage"]["completion_tokens"], end) << got.dump();
  EXPECT_EQ(got["choices"][0]["finish_reason"], match == std::string::npos ? "length" : "stop");
  const std::string text = prefix(end);
  EXPECT_EQ(got["choices"][0]["text"],
            AsJsonText(match == std::string::npos ? text : text.substr(0, match)));
  // Without min_tokens the same stop string ends it at its first occurrence, as before.
  json early = body;
  early.erase("min_tokens");
  reply = HttpPost(url_ + "/v1/completions",
                   early.dump(-1, ' ', false, json::error_handler_t::replace));
  ASSERT_TRUE(reply.ok() && reply->status == 200) << (reply.ok() ? reply->body : "");
  EXPECT_EQ(json::parse(reply->body)["usage"]["completion_tokens"], first_end) << reply->body;
  EXPECT_TRUE(AwaitNoBlockInUse());
}

// A step longer than the router's 3 s silence deadline (a long prompt on the CPU) is not a
// hang: the executor's heartbeats go out between layers. Before they did, the router dropped
// the busy executor, redid the step on it, and dropped it again, for ever.
TEST_F(RouterProcessTest, AStepLongerThanTheSilenceDeadlineKeepsItsExecutor) {
  // 4 layers of 1 s each: every step takes 4 s.
  ASSERT_NO_FATAL_FAILURE(
      StartStack(/*num_blocks=*/64, /*executors=*/1, {}, {"--fault-layer-delay-ms=1000"}));
  const std::string prompt = "a slow step";
  absl::StatusOr<HttpResponse> reply =
      HttpPost(url_ + "/generate", GenerateBody(prompt, 2), absl::Seconds(60));
  ASSERT_THAT(reply, IsOk());
  ASSERT_EQ(reply->status, 200) << reply->body;
  EXPECT_EQ(TokenIds(reply->body), Reference(prompt, 2));
  EXPECT_THAT(router_->Output(), Not(HasSubstr("silent for more than"))) << router_->Output();
}

TEST_F(RouterProcessTest, APoolOfFewBlocksForcesPreemptionAndEveryRequestStillGetsItsTokens) {
  // 24 blocks of 4 tokens: six requests of ~20 prompt and 30 new tokens cannot all fit.
  ASSERT_NO_FATAL_FAILURE(
      StartStack(/*num_blocks=*/24, /*executors=*/1, {"--max-total-tokens", "96"}));
  std::vector<std::string> texts;
  for (int i = 0; i < 6; ++i) texts.push_back(absl::StrCat("preempt me please ", i));
  std::unique_ptr<Requests> requests = StartRequests(texts, 30);
  requests->Join();
  ExpectReferenceAnswers(*requests, texts, 30);
  EXPECT_TRUE(AwaitNoBlockInUse());
  ASSERT_THAT(router_->Signal(SIGTERM), IsOk());
  ASSERT_THAT(router_->Wait(absl::Seconds(10)), IsOk());
  auto summary = router_->WaitForLine("stopping after [0-9]+ step\\(s\\), ([0-9]+) preemption",
                                      absl::Now() + absl::Seconds(5));
  ASSERT_THAT(summary, IsOk()) << router_->Output();
  int preemptions = 0;
  ASSERT_TRUE(absl::SimpleAtoi((*summary)[1], &preemptions));
  EXPECT_GT(preemptions, 0) << "the pool was meant to be too small";
  router_.reset();
}

TEST_F(RouterProcessTest, BadRequestsGetTheirStatusAndLeaveTheLedgerWhole) {
  ASSERT_NO_FATAL_FAILURE(StartStack(/*num_blocks=*/64, /*executors=*/1,
                                     {"--max-input-tokens", "40", "--max-total-tokens", "60"}));
  struct Bad {
    std::string path;
    std::string body;
    int status;
    std::string says;
  };
  const std::vector<Bad> cases = {
      {"/generate", "{not json", 400, "not a JSON object"},
      {"/generate", R"({"parameters": {}})", 422, "`inputs` must be a string"},
      {"/generate", R"({"inputs": 5})", 422, "`inputs` must be a string"},
      {"/generate", R"({"inputs": "a", "parameters": {"max_new_tokens": 0}})", 422,
       "max_new_tokens"},
      {"/generate", R"({"inputs": "a", "parameters": {"max_new_tokens": "3"}})", 422,
       "max_new_tokens"},
      {"/generate", R"({"inputs": "a", "parameters": {"temperature": -1}})", 422, "temperature"},
      {"/generate", R"({"inputs": "a", "parameters": {"top_p": 1.5}})", 422, "top_p"},
      {"/generate", R"({"inputs": "a", "parameters": {"stop": "x"}})", 422,
       "`stop` must be a list"},
      {"/generate", R"({"inputs": "a", "parameters": {"stop": ["a", "b", "c", "d", "e"]}})", 422,
       "at most 4"},
      {"/generate", R"({"inputs": "a", "parameters": {"repetition_penalty": 0}})", 422,
       "repetition_penalty"},
      {"/generate", R"({"inputs": "a", "parameters": {"frequency_penalty": 3}})", 422,
       "frequency_penalty"},
      {"/generate", R"({"inputs": "a", "parameters": {"top_n_tokens": 6}})", 422, "top_n_tokens"},
      {"/generate", R"({"inputs": "a", "parameters": {"truncate": 41}})", 422, "truncate"},
      {"/generate_stream", R"({"inputs": "a", "parameters": {"decoder_input_details": true}})", 422,
       "not supported when streaming"},
      {"/generate", R"({"inputs": "a", "parameters": {"watermark": true}})", 422, "not supported"},
      {"/generate", R"({"inputs": "a", "parameters": {"best_of": 2}})", 422, "needs sampling"},
      {"/generate", R"({"inputs": "a", "parameters": {"best_of": 5, "do_sample": true}})", 422,
       "best_of"},
      {"/generate_stream", R"({"inputs": "a", "parameters": {"best_of": 2, "do_sample": true}})",
       422, "not supported when streaming"},
      {"/generate", json{{"inputs", std::string(50, 'x')}}.dump(), 422, "less than 40 tokens"},
      {"/generate", R"({"inputs": "a", "parameters": {"max_new_tokens": 59}})", 422,
       "must be <= 60"},
      {"/nowhere", "{}", 404, "no route"},
  };
  for (const Bad& bad : cases) {
    SCOPED_TRACE(bad.body);
    absl::StatusOr<HttpResponse> reply = HttpPost(url_ + bad.path, bad.body);
    ASSERT_THAT(reply, IsOk());
    EXPECT_EQ(reply->status, bad.status) << reply->body;
    const json error = json::parse(reply->body, nullptr, false);
    ASSERT_FALSE(error.is_discarded()) << reply->body;
    EXPECT_THAT(error["error"].get<std::string>(), HasSubstr(bad.says));
    EXPECT_TRUE(error.contains("error_type"));
  }
  // A body over the limit is refused before it is read.
  absl::StatusOr<HttpResponse> huge =
      HttpPost(url_ + "/generate", json{{"inputs", std::string(2 << 20, 'x')}}.dump());
  EXPECT_TRUE(!huge.ok() || huge->status == 413) << (huge.ok() ? huge->body : "");
  // Nothing was allocated for any of them, and the server still answers.
  const StatsSnapshot stats = Stats();
  EXPECT_EQ(stats.in_use_blocks, 0);
  ExpectWhole(stats);
  absl::StatusOr<HttpResponse> fine = HttpPost(url_ + "/generate", GenerateBody("ok", 3));
  ASSERT_THAT(fine, IsOk());
  EXPECT_EQ(fine->status, 200) << fine->body;
  EXPECT_EQ(TokenIds(fine->body), Reference("ok", 3));
}

TEST_F(RouterProcessTest, AClientThatLeavesMidStreamHasItsBlocksFreed) {
  // Slow steps (5 ms a layer), so that the stream is still running when the client goes.
  ASSERT_NO_FATAL_FAILURE(
      StartStack(/*num_blocks=*/128, /*executors=*/1, {}, {"--fault-layer-delay-ms", "5"}));
  const int port = std::stoi(url_.substr(url_.rfind(':') + 1));
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  ::inet_pton(AF_INET, "127.0.0.1", &address.sin_addr);
  ASSERT_EQ(::connect(fd, reinterpret_cast<const sockaddr*>(&address), sizeof(address)), 0);
  const std::string body = GenerateBody("a long story, please", 400);
  const std::string request = absl::StrCat(
      "POST /generate_stream HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
      "application/json\r\nContent-Length: ",
      body.size(), "\r\n\r\n", body);
  ASSERT_EQ(::send(fd, request.data(), request.size(), MSG_NOSIGNAL),
            static_cast<ssize_t>(request.size()));
  // Read until the first token event arrived: the sequence holds blocks now.
  std::string seen;
  char buffer[4096];
  while (seen.find("data:") == std::string::npos) {
    const ssize_t n = ::recv(fd, buffer, sizeof(buffer), 0);
    ASSERT_GT(n, 0);
    seen.append(buffer, static_cast<size_t>(n));
  }
  EXPECT_GT(Stats().in_use_blocks, 0);
  ::close(fd);
  EXPECT_TRUE(AwaitNoBlockInUse()) << router_->Output();
  EXPECT_THAT(router_->Output(), HasSubstr("the client went away; cancelled"));
  ExpectWhole(Stats());
}

TEST_F(RouterProcessTest, AnExecutorKilledMidGenerationChangesNoToken) {
  // Two executors, slow steps; one is killed with SIGKILL while both generate.
  ASSERT_NO_FATAL_FAILURE(
      StartStack(/*num_blocks=*/256, /*executors=*/2, {}, {"--fault-layer-delay-ms", "3"}));
  std::vector<std::string> texts = {"first request", "second request", "third one", "and a fourth"};
  std::unique_ptr<Requests> requests = StartRequests(texts, 40);
  // A few steps in, every request generating.
  ASSERT_TRUE(AwaitGenerating(4, 8)) << router_->Output();
  ASSERT_THAT(executors_[1].process->Signal(SIGKILL), IsOk());
  const int done_at_kill = requests->done.load();
  requests->Join();
  EXPECT_EQ(done_at_kill, 0) << "the kill came too late to be mid-generation";
  ExpectReferenceAnswers(*requests, texts, 40);
  // Its pidfd told the router at once (not the silence limit).
  EXPECT_THAT(router_->Output(), HasSubstr("exited: dropped"));
  EXPECT_TRUE(AwaitNoBlockInUse());
}

// A hung executor (SIGSTOP: alive, mid-step, maybe to write later) is dropped for its
// silence without proof that it stopped. Its sequences must not keep their blocks on
// another executor, nor give them back to the pool, while it may still write them: the
// router frees them with drain and computes them again on the live executor. The blocks
// stay draining until the hung one resumes and acknowledges its fence; every request still
// gets its reference tokens.
TEST_F(RouterProcessTest, AHungExecutorsSequencesAreFreedWithDrainAndFinishElsewhere) {
  ASSERT_NO_FATAL_FAILURE(
      StartStack(/*num_blocks=*/256, /*executors=*/2, {}, {"--fault-layer-delay-ms", "20"}));
  std::vector<std::string> texts = {"first request", "second request", "third one", "and a fourth"};
  std::unique_ptr<Requests> requests = StartRequests(texts, 30);
  // A few steps in, every request generating.
  ASSERT_TRUE(AwaitGenerating(4, 8)) << router_->Output();
  ASSERT_THAT(executors_[1].process->Signal(SIGSTOP), IsOk());
  const int done_at_stop = requests->done.load();
  ASSERT_THAT(router_->WaitForLine("may still be writing", absl::Now() + absl::Seconds(20)), IsOk())
      << router_->Output();
  // While it is stopped its sequences' blocks drain: never handed out again.
  int32_t draining = 0;
  for (int i = 0; i < 100 && draining == 0; ++i) {
    draining = Stats().draining_blocks;
    if (draining == 0) absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_GT(draining, 0);
  requests->Join();
  EXPECT_EQ(done_at_stop, 0) << "the stop came too late to be mid-generation";
  ExpectReferenceAnswers(*requests, texts, 30);
  EXPECT_GT(Stats().draining_blocks, 0) << "the fence did not wait for the stopped executor";
  // Resumed, it ends (or finishes) its step and acknowledges: the blocks come back.
  ASSERT_THAT(executors_[1].process->Signal(SIGCONT), IsOk());
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (Stats().draining_blocks > 0 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_EQ(Stats().draining_blocks, 0);
  EXPECT_TRUE(AwaitNoBlockInUse());
  ExpectWhole(Stats());
}

TEST_F(RouterProcessTest, ASecondRouterOnTheSameRunDirectoryRefusesToStartAndTheFirstServesOn) {
  ASSERT_NO_FATAL_FAILURE(StartStack(/*num_blocks=*/64, /*executors=*/1));
  absl::StatusOr<kvcm::testing::RunResult> second =
      kvcm::testing::RunProgram({KvcmBinaryPath("kvcm-router"), "--model", *model_dir_, "--run-dir",
                                 cm_->run_dir(), "--port", "0"},
                                "", absl::Seconds(30));
  ASSERT_THAT(second, IsOk());
  EXPECT_NE(second->exit_code, 0);
  EXPECT_THAT(second->output, HasSubstr("another router listens on"));
  absl::StatusOr<HttpResponse> reply = HttpPost(url_ + "/generate", GenerateBody("still me", 3));
  ASSERT_THAT(reply, IsOk());
  EXPECT_EQ(reply->status, 200) << reply->body;
  EXPECT_EQ(TokenIds(reply->body), Reference("still me", 3));
  EXPECT_TRUE(AwaitNoBlockInUse());
}

TEST_F(RouterProcessTest, ACacheManagerKilledUnderLoadRestartsAndEveryRequestCompletes) {
  absl::StatusOr<TempDir> run_dir = TempDir::Create("kvcm-rrd");
  ASSERT_THAT(run_dir, IsOk());
  ASSERT_NO_FATAL_FAILURE(StartStack(/*num_blocks=*/256, /*executors=*/1, {},
                                     {"--fault-layer-delay-ms", "3"}, run_dir->path()));
  std::vector<std::string> texts = {"survive a restart", "me too", "and me, please"};
  std::unique_ptr<Requests> requests = StartRequests(texts, 40);
  ASSERT_TRUE(AwaitGenerating(3, 6)) << router_->Output();  // under load
  ASSERT_THAT(cm_->process().Signal(SIGKILL), IsOk());
  const int done_at_kill = requests->done.load();
  (void)cm_->process().Wait(absl::Seconds(10));
  cm_.reset();  // the run directory is the test's: it stays
  absl::StatusOr<std::unique_ptr<CacheManagerProcess>> restarted =
      CacheManagerProcess::Start(ManagerOptions(256, run_dir->path()));
  ASSERT_THAT(restarted, IsOk());
  cm_ = std::move(*restarted);
  requests->Join();
  EXPECT_EQ(done_at_kill, 0) << "the kill came too late to be under load";
  for (size_t i = 0; i < texts.size(); ++i) {
    EXPECT_EQ(requests->errors[i], "") << i;
    EXPECT_EQ(absl::StrJoin(requests->got[i], " "), absl::StrJoin(Reference(texts[i], 40), " "))
        << i;
  }
  EXPECT_THAT(router_->Output(), HasSubstr("registered again with the cache manager"));
  EXPECT_TRUE(AwaitNoBlockInUse()) << router_->Output();
}

TEST_F(RouterProcessTest, SigtermFinishesTheRunningRequestsRefusesNewOnesAndExitsCleanly) {
  ASSERT_NO_FATAL_FAILURE(
      StartStack(/*num_blocks=*/128, /*executors=*/1, {}, {"--fault-layer-delay-ms", "3"}));
  std::unique_ptr<Requests> running = StartRequests({"finish me first"}, 60);
  ASSERT_TRUE(AwaitGenerating(1, 3)) << router_->Output();  // a few of its 60 steps in
  ASSERT_THAT(router_->Signal(SIGTERM), IsOk());
  ASSERT_THAT(router_->WaitForLine("finishing 1 request", absl::Now() + absl::Seconds(10)), IsOk())
      << router_->Output();
  absl::StatusOr<HttpResponse> late = HttpPost(url_ + "/generate", GenerateBody("too late", 3));
  ASSERT_THAT(late, IsOk());
  EXPECT_EQ(late->status, 503) << late->body;
  EXPECT_THAT(late->body, HasSubstr("shutting down"));
  running->Join();
  EXPECT_EQ(running->errors[0], "");
  EXPECT_EQ(running->got[0], Reference("finish me first", 60));
  absl::StatusOr<int> exit_code = router_->Wait(absl::Seconds(15));
  ASSERT_THAT(exit_code, IsOk()) << "\n" << router_->Output();
  EXPECT_EQ(*exit_code, 0) << router_->Output();
  router_.reset();
  EXPECT_TRUE(AwaitNoBlockInUse());
}

TEST_F(RouterProcessTest, ARestartedRouterGetsItsExecutorsBackAndTheDeadOnesPromptsStayCached) {
  ASSERT_NO_FATAL_FAILURE(StartStack(/*num_blocks=*/128, /*executors=*/1));
  const std::string prompt(44, 'p');  // BOS + 44 bytes: 11 full blocks of 4
  absl::StatusOr<HttpResponse> first = HttpPost(url_ + "/generate", GenerateBody(prompt, 4));
  ASSERT_TRUE(first.ok() && first->status == 200);
  ASSERT_THAT(router_->Signal(SIGKILL), IsOk());
  (void)router_->Wait(absl::Seconds(10));
  // A new router on the same run directory: the executor registers with it by itself.
  ASSERT_NO_FATAL_FAILURE(StartRouter({}));
  ASSERT_NO_FATAL_FAILURE(AwaitExecutors(1));
  // The retried request finds its prompt in the prefix cache the dead router filled.
  absl::StatusOr<HttpResponse> retried = HttpPost(url_ + "/generate", GenerateBody(prompt, 4));
  ASSERT_TRUE(retried.ok() && retried->status == 200) << (retried.ok() ? retried->body : "");
  EXPECT_EQ(TokenIds(retried->body), Reference(prompt, 4));
  EXPECT_EQ(RouterMetric("kvcm_router_prompt_tokens_total", {{"source", "cached"}}), 44);
  EXPECT_TRUE(AwaitNoBlockInUse());
}

TEST_F(RouterProcessTest, OpenAiCompletionsGiveTheReferenceTokensUsageAndCachedTokens) {
  ASSERT_NO_FATAL_FAILURE(StartStack(/*num_blocks=*/128, /*executors=*/1));
  const std::string prompt(30, 'o');  // BOS + 30 bytes: 7 full blocks, 28 cacheable tokens
  const std::vector<int32_t> want = Reference(prompt, 6);
  auto post = [&](const json& body) {
    absl::StatusOr<HttpResponse> reply = HttpPost(url_ + "/v1/completions", body.dump());
    EXPECT_THAT(reply, IsOk());
    return reply.ok() ? *reply : HttpResponse{};
  };
  const json greedy = {
      {"model", "tiny"}, {"prompt", prompt}, {"max_tokens", 6}, {"temperature", 0}};
  HttpResponse first = post(greedy);
  ASSERT_EQ(first.status, 200) << first.body;
  json reply = json::parse(first.body);
  EXPECT_EQ(reply["object"], "text_completion");
  EXPECT_EQ(reply["choices"][0]["text"].get<std::string>(), AsJsonText(BytesOf(want)));
  EXPECT_EQ(reply["choices"][0]["finish_reason"], want.size() < 6 ? "stop" : "length");
  EXPECT_EQ(reply["usage"]["prompt_tokens"], 31);
  EXPECT_EQ(reply["usage"]["completion_tokens"], want.size());
  EXPECT_EQ(reply["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
  // The same prompt again: its full blocks come from the prefix cache.
  HttpResponse second = post(greedy);
  ASSERT_EQ(second.status, 200) << second.body;
  EXPECT_EQ(json::parse(second.body)["usage"]["prompt_tokens_details"]["cached_tokens"], 28);

  // Token ids as the prompt, streamed, with a usage chunk and [DONE] at the end.
  const std::vector<int32_t> ids = PromptIds(prompt);
  HttpResponse streamed = post({{"prompt", ids},
                                {"max_tokens", 6},
                                {"temperature", 0},
                                {"stream", true},
                                {"stream_options", {{"include_usage", true}}}});
  ASSERT_EQ(streamed.status, 200) << streamed.body;
  std::string text;
  json usage;
  bool done = false;
  for (absl::string_view line : absl::StrSplit(streamed.body, '\n')) {
    if (!absl::ConsumePrefix(&line, "data: ")) continue;
    if (line == "[DONE]") {
      done = true;
      continue;
    }
    const json chunk = json::parse(std::string(line));
    if (chunk.contains("usage")) usage = chunk["usage"];
    for (const json& choice : chunk["choices"]) text += choice["text"].get<std::string>();
  }
  EXPECT_TRUE(done);
  // Streamed pieces never split a UTF-8 sequence, so they join to the same text.
  EXPECT_EQ(text, AsJsonText(BytesOf(want)));
  EXPECT_EQ(usage["completion_tokens"], want.size());

  // OpenAI's error shape, with 400.
  HttpResponse bad = post({{"prompt", "x"}, {"n", 99}});
  EXPECT_EQ(bad.status, 400);
  const json error = json::parse(bad.body, nullptr, false);
  ASSERT_FALSE(error.is_discarded()) << bad.body;
  EXPECT_EQ(error["error"]["param"], "n");
  EXPECT_EQ(error["error"]["type"], "invalid_request_error");
  EXPECT_EQ(RouterMetric("kvcm_router_requests_total", {{"api", "openai"}, {"outcome", "ok"}}), 3);
  EXPECT_EQ(RouterMetric("kvcm_router_requests_total", {{"api", "openai"}, {"outcome", "invalid"}}),
            1);
  EXPECT_EQ(RouterMetric("kvcm_router_requests_total", {{"api", "tgi"}, {"outcome", "ok"}}), 0);
  absl::StatusOr<HttpResponse> models = kvcm::testing::HttpGet(url_ + "/v1/models");
  ASSERT_TRUE(models.ok() && models->status == 200);
  EXPECT_EQ(json::parse(models->body)["data"][0]["object"], "model");
  EXPECT_TRUE(AwaitNoBlockInUse());
}

TEST_F(RouterProcessTest, DetailsCarryTheModelsLogprobsTopTokensAndPromptScores) {
  ASSERT_NO_FATAL_FAILURE(StartStack(/*num_blocks=*/128, /*executors=*/1,
                                     {"--max-batch-prefill-tokens", "8"}));  // chunked prompts
  const std::string text = "The quick brown fox jumps";
  const ReferenceScores want = Score(*model_, PromptIds(text), 5);
  const json body = {{"inputs", text},
                     {"parameters",
                      {{"max_new_tokens", 5},
                       {"details", true},
                       {"decoder_input_details", true},
                       {"top_n_tokens", 3}}}};
  absl::StatusOr<HttpResponse> reply = HttpPost(url_ + "/generate", body.dump());
  ASSERT_TRUE(reply.ok() && reply->status == 200) << (reply.ok() ? reply->body : "");
  const json details = json::parse(reply->body)["details"];
  ASSERT_EQ(details["tokens"].size(), want.tokens.size()) << reply->body;
  for (size_t i = 0; i < want.tokens.size(); ++i) {
    SCOPED_TRACE(absl::StrCat("token ", i));
    EXPECT_EQ(details["tokens"][i]["id"].get<int32_t>(), want.tokens[i]);
    EXPECT_NEAR(details["tokens"][i]["logprob"].get<double>(), want.logprobs[i], 1e-3);
    ASSERT_EQ(details["top_tokens"][i].size(), 3u);
    for (size_t k = 0; k < 3; ++k) {
      EXPECT_EQ(details["top_tokens"][i][k]["id"].get<int32_t>(), want.top[i][k].first);
      EXPECT_NEAR(details["top_tokens"][i][k]["logprob"].get<double>(), want.top[i][k].second,
                  1e-3);
    }
  }
  // The prompt, every token scored but the first, over three chunks of 8.
  const json& prefill = details["prefill"];
  ASSERT_EQ(prefill.size(), want.prompt.size() + 1);
  EXPECT_TRUE(prefill[0]["logprob"].is_null());
  EXPECT_EQ(prefill[0]["id"], 1);
  for (size_t j = 1; j < prefill.size(); ++j) {
    EXPECT_NEAR(prefill[j]["logprob"].get<double>(), want.prompt[j - 1], 1e-3) << "prompt " << j;
  }
  // Streamed tokens carry their log-probability too.
  absl::StatusOr<HttpResponse> streamed =
      HttpPost(url_ + "/generate_stream", GenerateBody(text, 5));
  ASSERT_TRUE(streamed.ok() && streamed->status == 200);
  size_t seen = 0;
  for (absl::string_view line : absl::StrSplit(streamed->body, '\n')) {
    if (!absl::ConsumePrefix(&line, "data:")) continue;
    const json event = json::parse(std::string(line));
    ASSERT_LT(seen, want.logprobs.size());
    EXPECT_NEAR(event["token"]["logprob"].get<double>(), want.logprobs[seen], 1e-3);
    ++seen;
  }
  EXPECT_EQ(seen, want.tokens.size());

  // OpenAI's echo with logprobs: the prompt's tokens first, the first unscored.
  absl::StatusOr<HttpResponse> echoed = HttpPost(
      url_ + "/v1/completions",
      json{{"prompt", text}, {"max_tokens", 3}, {"temperature", 0}, {"echo", true}, {"logprobs", 1}}
          .dump());
  ASSERT_TRUE(echoed.ok() && echoed->status == 200) << (echoed.ok() ? echoed->body : "");
  const json choice = json::parse(echoed->body)["choices"][0];
  const json& scores = choice["logprobs"]["token_logprobs"];
  ASSERT_EQ(scores.size(), want.prompt.size() + 1 + 3) << echoed->body;
  EXPECT_TRUE(scores[0].is_null());
  EXPECT_TRUE(choice["logprobs"]["top_logprobs"][0].is_null());
  for (size_t j = 1; j <= want.prompt.size(); ++j) {
    EXPECT_NEAR(scores[j].get<double>(), want.prompt[j - 1], 1e-3) << "prompt " << j;
  }
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_NEAR(scores[want.prompt.size() + 1 + i].get<double>(), want.logprobs[i], 1e-3);
  }
  EXPECT_EQ(choice["text"].get<std::string>().substr(0, text.size()), text);
  EXPECT_TRUE(AwaitNoBlockInUse());
}

TEST_F(RouterProcessTest, PenaltiesAndTruncationGiveTheReferenceTokens) {
  ASSERT_NO_FATAL_FAILURE(StartStack(/*num_blocks=*/128, /*executors=*/2));
  const std::string text = "abcabcabcabc";
  SamplingParams penalties;
  penalties.repetition_penalty = 1.8f;
  penalties.frequency_penalty = 1.5f;
  const int32_t n = 12;
  const ReferenceScores plain = Score(*model_, PromptIds(text), n);
  const ReferenceScores want = Score(*model_, PromptIds(text), n, penalties);
  // Otherwise the test could not tell penalties from none.
  ASSERT_NE(plain.tokens, want.tokens) << "pick stronger penalties";
  const json body = {{"inputs", text},
                     {"parameters",
                      {{"max_new_tokens", n},
                       {"details", true},
                       {"repetition_penalty", 1.8},
                       {"frequency_penalty", 1.5}}}};
  absl::StatusOr<HttpResponse> reply = HttpPost(url_ + "/generate", body.dump());
  ASSERT_TRUE(reply.ok() && reply->status == 200) << (reply.ok() ? reply->body : "");
  std::vector<int32_t> got = TokenIds(reply->body);
  EXPECT_EQ(got, testing::CutAfterEos(want.tokens, model_->config().eos_token_ids));

  // OpenAI's frequency and presence penalties, the same definition.
  penalties = {};
  penalties.frequency_penalty = 1.2f;
  penalties.presence_penalty = 0.7f;
  const ReferenceScores openai = Score(*model_, PromptIds(text), 8, penalties);
  absl::StatusOr<HttpResponse> completion =
      HttpPost(url_ + "/v1/completions", json{{"prompt", text},
                                              {"max_tokens", 8},
                                              {"temperature", 0},
                                              {"frequency_penalty", 1.2},
                                              {"presence_penalty", 0.7},
                                              {"logprobs", 2}}
                                             .dump());
  ASSERT_TRUE(completion.ok() && completion->status == 200)
      << (completion.ok() ? completion->body : "");
  const json logprobs = json::parse(completion->body)["choices"][0]["logprobs"];
  ASSERT_FALSE(logprobs.is_null()) << completion->body;
  const size_t got_tokens = logprobs["token_logprobs"].size();
  ASSERT_GE(got_tokens, 1u);
  for (size_t i = 0; i < got_tokens; ++i) {
    EXPECT_NEAR(logprobs["token_logprobs"][i].get<double>(), openai.logprobs[i], 1e-3);
    EXPECT_EQ(logprobs["top_logprobs"][i].size(), 2u) << completion->body;
  }

  // truncate keeps the prompt's last tokens: the reply is that of the shorter prompt.
  const std::string long_text = "this part goes away, and this stays";
  std::vector<int32_t> ids = PromptIds(long_text);
  ids.erase(ids.begin(), ids.end() - 10);
  const std::vector<int32_t> truncated = kvcm::testing::ReferenceGreedy(*model_, ids, 4);
  absl::StatusOr<HttpResponse> cut =
      HttpPost(url_ + "/generate", json{{"inputs", long_text},
                                        {"parameters",
                                         {{"max_new_tokens", 4},
                                          {"details", true},
                                          {"truncate", 10},
                                          {"decoder_input_details", true}}}}
                                       .dump());
  ASSERT_TRUE(cut.ok() && cut->status == 200) << (cut.ok() ? cut->body : "");
  EXPECT_EQ(json::parse(cut->body)["details"]["prefill"].size(), 10u);
  std::vector<int32_t> cut_ids = TokenIds(cut->body);
  cut_ids.resize(std::min(cut_ids.size(), truncated.size()));
  EXPECT_EQ(cut_ids,
            std::vector<int32_t>(truncated.begin(),
                                 truncated.begin() + static_cast<std::ptrdiff_t>(cut_ids.size())));
  EXPECT_TRUE(AwaitNoBlockInUse());
  ExpectWhole(Stats());
}

// For the tests of an EOS the tiny model reaches: `plain`, 8 greedy tokens of a prompt (none
// an EOS of the model's), ends at its 4th token for a router that reads the returned copy of
// the model at `model_dir` (--model; the executors read the original), whose
// generation_config.json names that token an EOS. FAILED_PRECONDITION when `plain` cannot
// tell (fewer tokens, or the 4th one seen before it): pick another prompt then.
absl::StatusOr<TempDir> CopyEndingAtFourth(const std::string& model_dir,
                                           const std::vector<int32_t>& plain,
                                           bool with_weights = false) {
  if (plain.size() != 8) {
    return absl::FailedPreconditionError("the model drew its EOS early; pick another prompt");
  }
  const int32_t stop = plain[3];
  if (std::count(plain.begin(), plain.begin() + 3, stop) != 0) {
    return absl::FailedPreconditionError("the 4th token comes earlier; pick another prompt");
  }
  absl::StatusOr<TempDir> copy = TempDir::Create("kvcm-gencfg");
  if (!copy.ok()) return copy.status();
  std::filesystem::copy_file(model_dir + "/config.json", copy->path() + "/config.json");
  if (with_weights) {  // a folder executors can load too
    for (const auto& entry : std::filesystem::directory_iterator(model_dir)) {
      const std::string name = entry.path().filename().string();
      if (name == "config.json" || name == "generation_config.json") continue;
      std::filesystem::create_symlink(entry.path(), copy->path() + "/" + name);
    }
  }
  std::ofstream out(copy->path() + "/generation_config.json");
  out << json{{"bos_token_id", 1}, {"eos_token_id", {stop, 2}}}.dump();
  if (!out.flush()) return absl::InternalError("writing generation_config.json");
  return copy;
}

// Instruction-tuned models often name their end-of-turn token only in
// generation_config.json: generation must stop there too.
TEST_F(RouterProcessTest, GenerationConfigEosIdsEndGenerationToo) {
  const std::string text = "where does it stop?";
  const std::vector<int32_t> plain = Reference(text, 8);
  absl::StatusOr<TempDir> copy = CopyEndingAtFourth(*model_dir_, plain);
  ASSERT_THAT(copy, IsOk());
  const int32_t stop = plain[3];
  // The router reads the copy (the last --model wins); the executors the original.
  ASSERT_NO_FATAL_FAILURE(
      StartStack(/*num_blocks=*/64, /*executors=*/1, {"--model", copy->path()}));
  EXPECT_THAT(router_->Output(), HasSubstr(absl::StrCat("generation ends at token(s) 2, ", stop)));
  absl::StatusOr<HttpResponse> reply = HttpPost(url_ + "/generate", GenerateBody(text, 8));
  ASSERT_TRUE(reply.ok() && reply->status == 200) << (reply.ok() ? reply->body : "");
  EXPECT_EQ(TokenIds(reply->body), std::vector<int32_t>(plain.begin(), plain.begin() + 4));
  EXPECT_EQ(json::parse(reply->body)["details"]["finish_reason"], "eos_token");
  router_.reset();

  // A malformed one is an error naming the file, before the router serves anything.
  {
    std::ofstream out(copy->path() + "/generation_config.json");
    out << R"({"eos_token_id": "two"})";
  }
  absl::StatusOr<RunResult> refused =
      RunProgram({KvcmBinaryPath("kvcm-router"), "--model", copy->path(), "--run-dir",
                  cm_->run_dir(), "--port", "0"},
                 "", absl::Seconds(30));
  ASSERT_THAT(refused, IsOk());
  EXPECT_NE(refused->exit_code, 0);
  EXPECT_THAT(refused->output, HasSubstr("generation_config.json: eos_token_id"));
}

// vLLM's ignore_eos, as benchmark tools send it: a request that would end at its 4th token
// (an EOS of generation_config.json, as in the test above) runs to max_tokens instead,
// finish_reason "length", the EOS token generated as any other. A stop string still ends it.
TEST_F(RouterProcessTest, IgnoreEosGeneratesExactlyMaxTokensWhereTheModelWouldStopEarlier) {
  const std::string text = "where does it stop?";
  const std::vector<int32_t> plain = Reference(text, 8);
  absl::StatusOr<TempDir> copy = CopyEndingAtFourth(*model_dir_, plain);
  ASSERT_THAT(copy, IsOk());
  ASSERT_NO_FATAL_FAILURE(
      StartStack(/*num_blocks=*/64, /*executors=*/1, {"--model", copy->path()}));
  auto complete = [&](json body) {
    body["prompt"] = text;
    body["max_tokens"] = 8;
    body["temperature"] = 0;
    absl::StatusOr<HttpResponse> reply = HttpPost(url_ + "/v1/completions", body.dump());
    EXPECT_TRUE(reply.ok() && reply->status == 200) << (reply.ok() ? reply->body : "");
    return reply.ok() && reply->status == 200 ? json::parse(reply->body) : json();
  };
  // Without it (or with false, or null), generation ends at the EOS token: 4 tokens.
  for (const json& flag : {json(), json(false)}) {
    json body = json::object();
    if (!flag.is_null()) body["ignore_eos"] = flag;
    const json ended = complete(body);
    ASSERT_TRUE(ended.contains("choices")) << body.dump();
    EXPECT_EQ(ended["choices"][0]["finish_reason"], "stop");
    EXPECT_EQ(ended["usage"]["completion_tokens"], 4);
  }
  // With it: exactly max_tokens, every one the greedy reference's, EOS included.
  const json full = complete({{"ignore_eos", true}, {"min_tokens", 0}, {"logprobs", 0}});
  ASSERT_TRUE(full.contains("choices")) << full.dump();
  EXPECT_EQ(full["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(full["usage"]["completion_tokens"], 8);
  EXPECT_EQ(full["choices"][0]["logprobs"]["tokens"].size(), 8u) << full.dump();
  EXPECT_EQ(full["choices"][0]["text"].get<std::string>(), AsJsonText(BytesOf(plain)));
  // Streamed alike.
  absl::StatusOr<HttpResponse> streamed =
      HttpPost(url_ + "/v1/completions", json{{"prompt", text},
                                              {"max_tokens", 8},
                                              {"temperature", 0},
                                              {"ignore_eos", true},
                                              {"stream", true},
                                              {"stream_options", {{"include_usage", true}}}}
                                             .dump());
  ASSERT_TRUE(streamed.ok() && streamed->status == 200);
  const OpenAiStream stream = ReadOpenAiStream(streamed->body);
  EXPECT_EQ(stream.finish, "length");
  EXPECT_EQ(stream.tokens, 8);
  // TGI's API has no ignore_eos: refused there, named.
  absl::StatusOr<HttpResponse> tgi = HttpPost(
      url_ + "/generate", json{{"inputs", text}, {"parameters", {{"ignore_eos", true}}}}.dump());
  ASSERT_THAT(tgi, IsOk());
  EXPECT_EQ(tgi->status, 422);
  EXPECT_THAT(tgi->body, HasSubstr("ignore_eos"));
  // min_tokens: an EOS that still comes before it (here the executor's model does not name
  // that EOS, only the router's generation_config.json does, so nothing holds it back) is an
  // ordinary token: the request goes on to an EOS from token min_tokens on, or max_tokens.
  const json held = complete({{"min_tokens", 6}, {"logprobs", 0}});
  ASSERT_TRUE(held.contains("choices")) << held.dump();
  size_t until = plain.size();
  for (size_t i = 6; i < plain.size(); ++i) {
    if (plain[i] == plain[3]) {
      until = i + 1;
      break;
    }
  }
  EXPECT_EQ(held["usage"]["completion_tokens"], until) << held.dump();
  EXPECT_EQ(held["choices"][0]["finish_reason"], until < plain.size() ? "stop" : "length");
  EXPECT_EQ(held["choices"][0]["logprobs"]["tokens"].size(), until) << held.dump();
  // min_tokens over max_tokens is a 400 naming it.
  absl::StatusOr<HttpResponse> refused =
      HttpPost(url_ + "/v1/completions",
               json{{"prompt", text}, {"max_tokens", 8}, {"min_tokens", 9}}.dump());
  ASSERT_THAT(refused, IsOk());
  EXPECT_EQ(refused->status, 400) << refused->body;
  EXPECT_EQ(json::parse(refused->body)["error"]["param"], "min_tokens") << refused->body;
  EXPECT_TRUE(AwaitNoBlockInUse());
  ExpectWhole(Stats());
}

// vLLM's min_tokens: the request that would end at its 4th token (an EOS of
// generation_config.json, which the router and the executor both read) cannot end before
// min_tokens tokens are out: the executor holds the EOS ids back (logit -inf) until then,
// so the 4th token is the model's best other one, and generation goes on greedily from
// there, ending at an EOS after that (finish_reason "stop") or at max_tokens ("length").
TEST_F(RouterProcessTest, MinTokensHoldsEosBackUntilThatManyTokensAreOut) {
  const std::string text = "where does it stop?";
  const std::vector<int32_t> plain = Reference(text, 8);
  absl::StatusOr<TempDir> copy = CopyEndingAtFourth(*model_dir_, plain, /*with_weights=*/true);
  ASSERT_THAT(copy, IsOk());
  const int32_t stop = plain[3];
  ASSERT_NO_FATAL_FAILURE(StartStack(/*num_blocks=*/64, /*executors=*/1, {"--model", copy->path()},
                                     {"--model", copy->path()}));
  constexpr int32_t kMaxTokens = 12;
  constexpr int32_t kMinTokens = 6;
  // The reference: the contiguous greedy pass with the EOS ids at -inf for the first
  // kMinTokens tokens, cut after the first EOS id from there on.
  std::vector<int32_t> eos = model_->config().eos_token_ids;
  eos.push_back(stop);
  std::vector<int32_t> want;
  std::vector<int32_t> context = PromptIds(text);
  const size_t vocab = static_cast<size_t>(model_->config().vocab_size);
  bool ended = false;
  while (static_cast<int32_t>(want.size()) < kMaxTokens && !ended) {
    absl::StatusOr<std::vector<float>> logits = model_->ForwardContiguous(context);
    ASSERT_THAT(logits, IsOk());
    std::vector<float> last(logits->end() - static_cast<std::ptrdiff_t>(vocab), logits->end());
    if (static_cast<int32_t>(want.size()) < kMinTokens) {
      for (const int32_t id : eos) {
        last[static_cast<size_t>(id)] = -std::numeric_limits<float>::infinity();
      }
    }
    want.push_back(executor::Greedy(last));
    context.push_back(want.back());
    ended = std::find(eos.begin(), eos.end(), want.back()) != eos.end();
  }
  ASSERT_GE(want.size(), static_cast<size_t>(kMinTokens));
  ASSERT_NE(want[3], stop);
  auto complete = [&](json body) {
    body["prompt"] = text;
    body["temperature"] = 0;
    body["max_tokens"] = kMaxTokens;
    absl::StatusOr<HttpResponse> reply = HttpPost(url_ + "/v1/completions", body.dump());
    EXPECT_TRUE(reply.ok() && reply->status == 200) << (reply.ok() ? reply->body : "");
    return reply.ok() && reply->status == 200 ? json::parse(reply->body) : json();
  };
  // Without min_tokens the EOS ends it at the 4th token, as before.
  const json plain_reply = complete(json::object());
  ASSERT_TRUE(plain_reply.contains("choices")) << plain_reply.dump();
  EXPECT_EQ(plain_reply["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(plain_reply["usage"]["completion_tokens"], 4);
  // With it: the masked reference's tokens, at least min_tokens of them.
  const json held = complete({{"min_tokens", kMinTokens}, {"logprobs", 0}});
  ASSERT_TRUE(held.contains("choices")) << held.dump();
  EXPECT_EQ(held["usage"]["completion_tokens"], want.size()) << held.dump();
  EXPECT_EQ(held["choices"][0]["logprobs"]["tokens"].size(), want.size()) << held.dump();
  EXPECT_EQ(held["choices"][0]["finish_reason"], ended ? "stop" : "length");
  const std::vector<int32_t> first(want.begin(), want.begin() + kMinTokens);
  EXPECT_TRUE(
      absl::StartsWith(held["choices"][0]["text"].get<std::string>(), AsJsonText(BytesOf(first))))
      << held.dump();
  // Streamed alike: min_tokens = max_tokens gives exactly that many.
  absl::StatusOr<HttpResponse> streamed =
      HttpPost(url_ + "/v1/completions", json{{"prompt", text},
                                              {"max_tokens", kMinTokens},
                                              {"min_tokens", kMinTokens},
                                              {"temperature", 0},
                                              {"stream", true},
                                              {"stream_options", {{"include_usage", true}}}}
                                             .dump());
  ASSERT_TRUE(streamed.ok() && streamed->status == 200);
  const OpenAiStream stream = ReadOpenAiStream(streamed->body);
  EXPECT_EQ(stream.finish, "length");
  EXPECT_EQ(stream.tokens, kMinTokens);
  EXPECT_EQ(stream.text, AsJsonText(BytesOf(first)));
  EXPECT_TRUE(AwaitNoBlockInUse());
  ExpectWhole(Stats());
}

TEST_F(RouterProcessTest, SeveralAnswersToOnePromptAreEachTheAnswerOfItsOwnSeed) {
  ASSERT_NO_FATAL_FAILURE(StartStack(/*num_blocks=*/256, /*executors=*/2));
  const std::string prompt = "Tell me three things";  // 21 tokens: a partly filled last block
  auto completion = [&](const json& body) {
    absl::StatusOr<HttpResponse> reply = HttpPost(url_ + "/v1/completions", body.dump());
    EXPECT_TRUE(reply.ok() && reply->status == 200) << (reply.ok() ? reply->body : "");
    return reply.ok() && reply->status == 200 ? json::parse(reply->body) : json();
  };
  // OpenAI's n = 3: choice i is what the same request with seed 7 + i answers alone.
  const json three = completion(
      {{"prompt", prompt}, {"max_tokens", 8}, {"temperature", 0.9}, {"seed", 7}, {"n", 3}});
  ASSERT_EQ(three["choices"].size(), 3u) << three.dump();
  size_t tokens = 0;
  std::set<std::string> distinct;
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(three["choices"][i]["index"], i);
    const json alone =
        completion({{"prompt", prompt}, {"max_tokens", 8}, {"temperature", 0.9}, {"seed", 7 + i}});
    EXPECT_EQ(three["choices"][i]["text"], alone["choices"][0]["text"]) << "choice " << i;
    tokens += alone["usage"]["completion_tokens"].get<size_t>();
    distinct.insert(three["choices"][i]["text"].get<std::string>());
  }
  EXPECT_GT(distinct.size(), 1u) << "three samples at temperature 0.9 all alike";
  EXPECT_EQ(three["usage"]["completion_tokens"], tokens);
  EXPECT_EQ(three["usage"]["prompt_tokens"], 21);

  // Streamed, each chunk names its choice, and each choice's chunks join to its text.
  absl::StatusOr<HttpResponse> streamed =
      HttpPost(url_ + "/v1/completions", json{{"prompt", prompt},
                                              {"max_tokens", 8},
                                              {"temperature", 0.9},
                                              {"seed", 7},
                                              {"n", 3},
                                              {"stream", true}}
                                             .dump());
  ASSERT_TRUE(streamed.ok() && streamed->status == 200);
  std::vector<std::string> texts(3);
  for (absl::string_view line : absl::StrSplit(streamed->body, '\n')) {
    if (!absl::ConsumePrefix(&line, "data: ") || line == "[DONE]") continue;
    const json chunk = json::parse(std::string(line));
    for (const json& choice : chunk["choices"]) {
      texts[choice["index"].get<size_t>()] += choice["text"].get<std::string>();
    }
  }
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(texts[i], three["choices"][i]["text"]) << i;

  // TGI's best_of = 3 (the server picks the seeds): the answer with the highest
  // log-probability, the others in best_of_sequences, each what its seed answers alone.
  auto generate = [&](const json& parameters) {
    absl::StatusOr<HttpResponse> reply =
        HttpPost(url_ + "/generate", json{{"inputs", prompt}, {"parameters", parameters}}.dump());
    EXPECT_TRUE(reply.ok() && reply->status == 200) << (reply.ok() ? reply->body : "");
    return reply.ok() && reply->status == 200 ? json::parse(reply->body) : json();
  };
  const json best_of =
      generate({{"max_new_tokens", 6}, {"do_sample", true}, {"best_of", 3}, {"details", true}});
  ASSERT_EQ(best_of["details"]["best_of_sequences"].size(), 2u) << best_of.dump();
  std::vector<json> answers = {best_of["details"]};
  answers[0]["generated_text"] = best_of["generated_text"];
  for (const json& other : best_of["details"]["best_of_sequences"]) answers.push_back(other);
  std::set<uint64_t> seeds;
  double best_sum = -1e30;
  for (size_t k = 0; k < answers.size(); ++k) {
    const uint64_t seed = answers[k]["seed"].get<uint64_t>();
    seeds.insert(seed);
    const json alone =
        generate({{"max_new_tokens", 6}, {"do_sample", true}, {"seed", seed}, {"details", true}});
    EXPECT_EQ(answers[k]["generated_text"], alone["generated_text"]) << "seed " << seed;
    double sum = 0;
    for (const json& t : alone["details"]["tokens"]) sum += t["logprob"].get<double>();
    if (k == 0) {
      best_sum = sum;
    } else {
      EXPECT_LE(sum, best_sum + 1e-4) << "seed " << seed << " beats the answer given";
    }
  }
  ASSERT_EQ(seeds.size(), 3u);
  EXPECT_EQ(*seeds.rbegin() - *seeds.begin(), 2u);  // seed, seed + 1, seed + 2
  // A seed with best_of is refused, as TGI does.
  absl::StatusOr<HttpResponse> seeded = HttpPost(
      url_ + "/generate",
      json{{"inputs", prompt}, {"parameters", {{"do_sample", true}, {"best_of", 2}, {"seed", 4}}}}
          .dump());
  ASSERT_THAT(seeded, IsOk());
  EXPECT_EQ(seeded->status, 422) << seeded->body;
  EXPECT_TRUE(AwaitNoBlockInUse());
  ExpectWhole(Stats());
}

}  // namespace
}  // namespace kvcm
