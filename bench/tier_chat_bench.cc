// Multi-turn chat through HTTP (docs/PERFORMANCE.md, "Multi-turn chat through HTTP"): time
// to first token (p50, p99) and throughput of a chat workload on the bundled model
// (SmolLM2-135M-Instruct, Q4_1 GGUF) whose pool is too small to keep every conversation's
// history, with the host and disk tiers on against the same stack with them off, in the
// same run.
//
//   build/bench/tier_chat_bench [--conversations 8] [--turns 4] [--words 150]
//                               [--max-tokens 16] [--threads 2] [--blocks 0]
//
// Each conversation is `turns` user messages of `words` words from a fixed seed (printed);
// each turn sends the whole history to POST /v1/chat/completions (stream, greedy, at most
// `max-tokens` tokens) and appends the answer to it. The conversations take turns
// round-robin, one request at a time, so that by the time one comes back the others have
// gone through a pool sized to about 1.5 conversations (--blocks 0) and pushed its
// history out: without tiers each turn computes the whole history again; with them its
// prefix is loaded from the host tier. Time to first token is from the request's start to
// the first event with content; throughput counts the requests' own durations, one after
// the other. Two kvcm-launch stacks, tiers off and on, are started fresh side by side, get
// one request each not timed, then take every turn in turn (which of them first
// alternating), so that drift and the load of other processes fall on both alike; they
// must answer with the same text.

#include <event2/thread.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "bench/launch_stack.h"
#include "bench/server_stack.h"
#include "bench/stream_client.h"
#include "common/base/check.h"
#include "common/base/monotonic_clock.h"
#include "nlohmann/json.hpp"
#include "tests/support/http_client.h"
#include "tests/support/metrics_text.h"
#include "tests/support/real_model.h"

namespace kvcm::bench {
namespace {

using json = nlohmann::json;

constexpr uint32_t kSeed = 20261206;
constexpr int kBlockSize = 16;

struct Workload {
  int conversations = 8;
  int turns = 4;
  int words = 150;  // per user message
  int max_tokens = 16;
  int threads = 2;
  int blocks = 0;  // the pool; 0: about 1.5 conversations' worth (PoolBlocks)
};

// Tokens of a whole conversation, estimated: its messages (about 1.06 tokens per word,
// SeededText), the answers, about 10 tokens of chat template per turn and the template's
// default system prompt.
int ConversationTokens(const Workload& w) {
  return w.turns * (w.words * 18 / 17 + w.max_tokens + 10) + 40;
}

// About 1.5 conversations: the conversation running always fits, the others' histories
// never all do.
int PoolBlocks(const Workload& w) {
  return w.blocks > 0 ? w.blocks : ConversationTokens(w) * 3 / 2 / kBlockSize;
}

struct Turn {
  double ttft_s = 0;   // request start to the first event with content
  double seconds = 0;  // the whole request
  int prompt_tokens = 0;
  int cached_tokens = 0;
  int completion_tokens = 0;
  std::string answer;
};

struct Result {
  std::vector<Turn> turns;  // in the order sent: turn-major, conversation-minor
  double from_host = 0;     // cached prompt tokens the tiers supplied (router's counter)
  double from_disk = 0;
};

// One streamed chat completion: its time to first token, usage and answer.
Turn Chat(const LaunchStack& stack, int port, const json& messages, int max_tokens) {
  const json body = {
      {"model", "m"},     {"messages", messages}, {"max_tokens", max_tokens},
      {"temperature", 0}, {"stream", true},       {"stream_options", {{"include_usage", true}}}};
  StreamClient client;
  const absl::Time start = MonotonicNow();
  const std::vector<StreamClient::Stream> streams =
      client.Run("127.0.0.1", port, "/v1/chat/completions", body.dump(), 1);
  const StreamClient::Stream& s = streams.front();
  KVCM_CHECK(s.status == 200) << "HTTP " << s.status << " from " << stack.url;
  Turn turn;
  turn.seconds = absl::ToDoubleSeconds(MonotonicNow() - start);
  bool first = true;
  for (size_t i = 0; i < s.events.size(); ++i) {
    if (s.events[i] == "[DONE]") break;
    const json event = json::parse(s.events[i]);
    if (event.contains("usage")) {
      const json& usage = event["usage"];
      turn.prompt_tokens = usage["prompt_tokens"].get<int>();
      turn.completion_tokens = usage["completion_tokens"].get<int>();
      turn.cached_tokens = usage["prompt_tokens_details"]["cached_tokens"].get<int>();
    }
    for (const json& choice : event["choices"]) {
      if (!choice["delta"].contains("content")) continue;
      const std::string text = choice["delta"]["content"].get<std::string>();
      if (first && !text.empty()) {
        turn.ttft_s = absl::ToDoubleSeconds(s.arrivals[i] - start);
        first = false;
      }
      turn.answer += text;
    }
  }
  KVCM_CHECK(!first) << "a reply without content from " << stack.url;
  KVCM_CHECK(turn.prompt_tokens > 0) << "a stream without usage from " << stack.url;
  return turn;
}

// One configuration: its stack, its conversations so far and its figures.
struct Config {
  LaunchStack stack;
  int port = 0;
  std::vector<json> histories;  // one per conversation
  Result result;
};

// A fresh stack in `dir`, one request sent and not timed; `tiers`: a host tier big enough
// for every block and a disk tier.
Config Start(const std::string& model, const std::string& dir, const Workload& w, bool tiers) {
  const int pool_tokens = PoolBlocks(w) * kBlockSize;
  std::vector<std::string> args = {
      "--run-dir",          dir + "/run",
      "--num-blocks",       std::to_string(PoolBlocks(w)),
      "--threads",          std::to_string(w.threads),
      "--max-input-tokens", std::to_string(pool_tokens - w.max_tokens - kBlockSize),
      "--max-total-tokens", std::to_string(pool_tokens - kBlockSize)};
  if (tiers) {
    args.insert(args.end(), {"--host-tier-bytes", "1GiB", "--disk-tier-dir", dir + "/tier",
                             "--disk-tier-bytes", "1GiB"});
  }
  std::filesystem::create_directories(dir);
  Config config;
  config.stack = StartLaunch(model, args, dir + "/launch.log");
  const std::string& url = config.stack.url;
  KVCM_CHECK(absl::SimpleAtoi(url.substr(url.rfind(':') + 1), &config.port)) << url;
  config.histories.assign(static_cast<size_t>(w.conversations), json::array());
  // A fresh executor's first request pays for its first touch of the weights and its
  // buffers. A message of another seed, so that only the system prompt is shared.
  (void)Chat(config.stack, config.port,
             json::array({{{"role", "user"}, {"content", SeededText(1, 50)}}}), w.max_tokens);
  return config;
}

// Turn `t` of conversation `c`: its user message, sent with the history, and the answer.
void Send(Config& config, const Workload& w, int c, int t) {
  json& history = config.histories[static_cast<size_t>(c)];
  const uint32_t seed = kSeed + static_cast<uint32_t>(c * w.turns + t);
  history.push_back({{"role", "user"}, {"content", SeededText(seed, w.words)}});
  config.result.turns.push_back(Chat(config.stack, config.port, history, w.max_tokens));
  history.push_back({{"role", "assistant"}, {"content", config.result.turns.back().answer}});
}

// Reads the router's counters of prompt tokens from the tiers and stops the stack.
Result Finish(Config& config) {
  auto metrics = testing::HttpGet(config.stack.url + "/metrics");
  KVCM_CHECK(metrics.ok() && metrics->status == 200);
  auto parsed = testing::ParseMetricsText(metrics->body);
  KVCM_CHECK(parsed.ok()) << parsed.status();
  const char* const kFromTier = "kvcm_router_prompt_tokens_from_tier_total";
  config.result.from_host = parsed->Value(kFromTier, {{"tier", "host"}}).value_or(0);
  config.result.from_disk = parsed->Value(kFromTier, {{"tier", "disk"}}).value_or(0);
  StopLaunch(config.stack);
  return std::move(config.result);
}

// The nearest-rank percentile `p` (0 to 1) of `values`.
double Percentile(std::vector<double> values, double p) {
  std::sort(values.begin(), values.end());
  const size_t rank = static_cast<size_t>(std::ceil(p * static_cast<double>(values.size())));
  return values[std::max<size_t>(rank, 1) - 1];
}

struct Figures {
  double p50 = 0;
  double p99 = 0;
  double requests_per_s = 0;
  double tokens_per_s = 0;  // output tokens
  double busy_s = 0;        // the requests one after the other: the sum of their durations
  int64_t prompt_tokens = 0;
  int64_t cached_tokens = 0;
};

Figures Summarize(const Result& r) {
  std::vector<double> ttft;
  Figures f;
  int64_t completion = 0;
  for (const Turn& t : r.turns) {
    ttft.push_back(t.ttft_s);
    f.busy_s += t.seconds;
    f.prompt_tokens += t.prompt_tokens;
    f.cached_tokens += t.cached_tokens;
    completion += t.completion_tokens;
  }
  f.p50 = Percentile(ttft, 0.5);
  f.p99 = Percentile(ttft, 0.99);
  f.requests_per_s = static_cast<double>(r.turns.size()) / f.busy_s;
  f.tokens_per_s = static_cast<double>(completion) / f.busy_s;
  return f;
}

int Main(int argc, char** argv) {
  Workload w;
  w.conversations = FlagValue(argc, argv, "--conversations", w.conversations);
  w.turns = FlagValue(argc, argv, "--turns", w.turns);
  w.words = FlagValue(argc, argv, "--words", w.words);
  w.max_tokens = FlagValue(argc, argv, "--max-tokens", w.max_tokens);
  w.threads = FlagValue(argc, argv, "--threads", w.threads);
  w.blocks = FlagValue(argc, argv, "--blocks", w.blocks);
  const std::string model = testing::SmolLM2GgufPath();
  if (!std::filesystem::exists(model)) {
    std::printf("%s\n", testing::SmolLM2Missing(model).c_str());
    return 0;
  }
  evthread_use_pthreads();
  const std::string dir = absl::StrCat(std::filesystem::temp_directory_path().string(),
                                       "/kvcm-tier-chat-bench-", getpid());
  std::filesystem::create_directories(dir);
  std::printf(
      "tier_chat_bench: %s, %d conversations of %d turns round-robin, user messages "
      "of %d words (seed %u), answers of at most %d tokens, greedy; pool of %d blocks "
      "of %d tokens (a conversation is about %d tokens), %d executor thread(s)\n",
      model.c_str(), w.conversations, w.turns, w.words, kSeed, w.max_tokens, PoolBlocks(w),
      kBlockSize, ConversationTokens(w), w.threads);
  std::fflush(stdout);

  // Both stacks run at once and take the requests in turn, which of the two first
  // alternating, so that the load of others on the machine falls on both alike; the one
  // not answering is idle.
  Config plain = Start(model, dir + "/off", w, /*tiers=*/false);
  Config tiered = Start(model, dir + "/on", w, /*tiers=*/true);
  for (int t = 0; t < w.turns; ++t) {
    for (int c = 0; c < w.conversations; ++c) {
      const bool plain_first = (t * w.conversations + c) % 2 == 0;
      Send(plain_first ? plain : tiered, w, c, t);
      Send(plain_first ? tiered : plain, w, c, t);
    }
  }
  const Result off = Finish(plain);
  const Result on = Finish(tiered);
  std::filesystem::remove_all(dir);

  std::printf("\nmean time to first token by turn (s), and cached prompt tokens:\n");
  std::printf("%-5s %14s %14s %18s %18s\n", "turn", "tiers off", "tiers on", "cached off",
              "cached on");
  for (int t = 0; t < w.turns; ++t) {
    double ttft_off = 0, ttft_on = 0;
    int64_t cached_off = 0, cached_on = 0, prompt = 0;
    for (int c = 0; c < w.conversations; ++c) {
      const size_t i = static_cast<size_t>(t * w.conversations + c);
      ttft_off += off.turns[i].ttft_s / w.conversations;
      ttft_on += on.turns[i].ttft_s / w.conversations;
      cached_off += off.turns[i].cached_tokens;
      cached_on += on.turns[i].cached_tokens;
      prompt += off.turns[i].prompt_tokens;
    }
    std::printf("%-5d %14.3f %14.3f %8lld of %6lld %8lld of %6lld\n", t + 1, ttft_off, ttft_on,
                static_cast<long long>(cached_off), static_cast<long long>(prompt),
                static_cast<long long>(cached_on), static_cast<long long>(prompt));
  }

  const Figures f_off = Summarize(off);
  const Figures f_on = Summarize(on);
  std::printf("\n%-10s %9s %9s %10s %12s %16s %8s\n", "", "TTFT p50", "TTFT p99", "requests/s",
              "out tokens/s", "cached/prompt", "busy");
  auto print = [](const char* name, const Figures& f) {
    std::printf("%-10s %8.3fs %8.3fs %10.3f %12.2f %7lld/%-8lld %7.1fs\n", name, f.p50, f.p99,
                f.requests_per_s, f.tokens_per_s, static_cast<long long>(f.cached_tokens),
                static_cast<long long>(f.prompt_tokens), f.busy_s);
  };
  print("tiers off", f_off);
  print("tiers on", f_on);
  std::printf("tiers on: %.0f cached prompt tokens loaded from the host tier, %.0f from disk\n",
              on.from_host, on.from_disk);
  std::printf(
      "ratios (tiers on / off): TTFT p50 %.2fx (goal <= 0.5x: %s), p99 %.2fx, "
      "requests/s %.2fx, output tokens/s %.2fx\n",
      f_on.p50 / f_off.p50, f_on.p50 <= 0.5 * f_off.p50 ? "met" : "MISSED", f_on.p99 / f_off.p99,
      f_on.requests_per_s / f_off.requests_per_s, f_on.tokens_per_s / f_off.tokens_per_s);

  size_t same = 0;
  size_t first_difference = off.turns.size();
  for (size_t i = 0; i < off.turns.size(); ++i) {
    if (off.turns[i].answer == on.turns[i].answer) {
      ++same;
    } else if (first_difference == off.turns.size()) {
      first_difference = i;
    }
  }
  std::printf("same greedy answers with tiers on and off: %zu of %zu\n", same, off.turns.size());
  KVCM_CHECK(same == off.turns.size())
      << "the tiers changed an answer, first request " << first_difference << ": \""
      << off.turns[first_difference].answer << "\" against \"" << on.turns[first_difference].answer
      << "\"";
  return 0;
}

}  // namespace
}  // namespace kvcm::bench

int main(int argc, char** argv) { return kvcm::bench::Main(argc, argv); }
