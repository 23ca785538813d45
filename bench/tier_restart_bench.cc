// Warm restart (docs/PERFORMANCE.md, "Warm restart from the disk tier"): time to first
// token of a long prompt on the bundled model (SmolLM2-135M-Instruct, Q4_1 GGUF) after the
// whole stack was stopped and started again on the same --disk-tier-dir, its prefix on disk,
// against a prompt of the same length that nobody sent before (cold), in the same run.
//
//   build/bench/tier_restart_bench [--tokens 4096] [--threads 2]
//
// Each figure is the duration of a greedy /v1/completions request for one token: the
// prefill of what is not cached, and the first token. The stack is kvcm-launch with one
// executor; the prompts are words from a fixed seed (printed).

#include <signal.h>

#include <cstdio>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/numbers.h"
#include "absl/time/clock.h"
#include "common/base/check.h"
#include "nlohmann/json.hpp"
#include "tests/support/cache_manager_process.h"
#include "tests/support/http_client.h"
#include "tests/support/real_model.h"
#include "tests/support/subprocess.h"

namespace kvcm::bench {
namespace {

using json = nlohmann::json;

struct Args {
  int tokens = 4096;
  int threads = 2;
};

Args ParseArgs(int argc, char** argv) {
  Args args;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string name = argv[i];
    int value = 0;
    KVCM_CHECK(absl::SimpleAtoi(argv[i + 1], &value)) << "bad value for " << name;
    if (name == "--tokens") {
      args.tokens = value;
    } else if (name == "--threads") {
      args.threads = value;
    } else {
      KVCM_CHECK(false) << "unknown flag " << name << " (--tokens N, --threads N)";
    }
  }
  return args;
}

// About `words` words of English-like text, different for each seed.
std::string Text(uint32_t seed, int words) {
  static const char* const kWords[] = {
      "cache", "block",  "river", "stone",  "memory", "token", "garden", "window", "paper",
      "light", "engine", "north", "silver", "market", "cloud", "letter", "forest", "signal",
      "table", "bridge", "winter", "number", "music",  "field", "thread", "harbor", "glass"};
  std::mt19937 rng(seed);
  std::uniform_int_distribution<size_t> pick(0, std::size(kWords) - 1);
  std::string text;
  for (int i = 0; i < words; ++i) {
    text += kWords[pick(rng)];
    text += (i % 17 == 16) ? ". " : " ";
  }
  return text;
}

struct Stack {
  std::unique_ptr<testing::Subprocess> launch;
  std::string url;
};

Stack Start(const std::string& model, const std::string& dir, int tokens, int threads) {
  testing::Subprocess::Options options;
  const int blocks = tokens / 16 * 2 + 64;  // two prompts and room to spare
  options.argv = {testing::KvcmBinaryPath("kvcm-launch"), "--model", model, "--port", "0",
                  "--run-dir", dir + "/run", "--executors", "1",
                  "--num-blocks", std::to_string(blocks), "--threads", std::to_string(threads),
                  "--max-input-tokens", std::to_string(tokens + 256),
                  "--max-total-tokens", std::to_string(tokens + 512),
                  "--disk-tier-dir", dir + "/tier", "--disk-tier-bytes", "1GiB"};
  options.output_path = dir + "/launch.log";
  std::filesystem::remove(options.output_path);
  auto started = testing::Subprocess::Start(options);
  KVCM_CHECK(started.ok()) << started.status();
  Stack stack;
  stack.launch = *std::move(started);
  auto ready = stack.launch->WaitForLine("kvcm-launch: ready http=(\\S+) executors=1",
                                         absl::Now() + absl::Seconds(120));
  KVCM_CHECK(ready.ok()) << ready.status() << "\n" << testing::Tail(stack.launch->Output());
  stack.url = (*ready)[1];
  return stack;
}

void Stop(Stack& stack) {
  KVCM_CHECK(stack.launch->Signal(SIGTERM).ok());
  auto code = stack.launch->Wait(absl::Seconds(60));
  KVCM_CHECK(code.ok() && *code == 0) << testing::Tail(stack.launch->Output());
}

struct Timed {
  double seconds = 0;
  int prompt_tokens = 0;
  int cached_tokens = 0;
  std::string text;
};

Timed Complete(const Stack& stack, const std::string& prompt) {
  const json body = {{"model", "m"}, {"prompt", prompt}, {"max_tokens", 1}, {"temperature", 0}};
  const absl::Time start = absl::Now();
  auto reply = testing::HttpPost(stack.url + "/v1/completions", body.dump(), absl::Minutes(5));
  Timed timed;
  timed.seconds = absl::ToDoubleSeconds(absl::Now() - start);
  KVCM_CHECK(reply.ok() && reply->status == 200)
      << (reply.ok() ? reply->body : reply.status().ToString());
  const json parsed = json::parse(reply->body);
  timed.prompt_tokens = parsed["usage"]["prompt_tokens"].get<int>();
  timed.cached_tokens = parsed["usage"]["prompt_tokens_details"]["cached_tokens"].get<int>();
  timed.text = parsed["choices"][0]["text"].get<std::string>();
  return timed;
}

int Main(int argc, char** argv) {
  const Args args = ParseArgs(argc, argv);
  const std::string model = testing::SmolLM2GgufPath();
  if (!std::filesystem::exists(model)) {
    std::printf("%s\n", testing::SmolLM2Missing(model).c_str());
    return 0;
  }
  const std::string dir = absl::StrCat(
      std::filesystem::temp_directory_path().string(), "/kvcm-tier-restart-bench-", getpid());
  std::filesystem::create_directories(dir);
  constexpr uint32_t kSeed = 20261206;
  // SmolLM2's tokenizer gives about 1.06 tokens per word of this text (the dots).
  const int words = args.tokens * 17 / 18;
  const std::string warm_prompt = Text(kSeed, words);
  const std::string cold_prompt = Text(kSeed + 1, words);
  std::printf("tier_restart_bench: %s, prompts of about %d tokens (seed %u), %d executor "
              "thread(s), disk tier in %s\n",
              model.c_str(), args.tokens, kSeed, args.threads, dir.c_str());

  Stack first = Start(model, dir, args.tokens, args.threads);
  const Timed before = Complete(first, warm_prompt);
  // Stopped whole: the cache manager's pool and host memory are gone; the disk tier stays.
  Stop(first);
  Stack second = Start(model, dir, args.tokens, args.threads);
  const Timed warm = Complete(second, warm_prompt);
  const Timed cold = Complete(second, cold_prompt);
  Stop(second);
  std::filesystem::remove_all(dir);

  std::printf("first start, cold:       %7.3f s  (%d prompt tokens, %d cached)\n",
              before.seconds, before.prompt_tokens, before.cached_tokens);
  std::printf("after restart, warm:     %7.3f s  (%d prompt tokens, %d cached from disk)\n",
              warm.seconds, warm.prompt_tokens, warm.cached_tokens);
  std::printf("after restart, cold:     %7.3f s  (%d prompt tokens, %d cached)\n", cold.seconds,
              cold.prompt_tokens, cold.cached_tokens);
  std::printf("same first token before and after the restart: %s\n",
              before.text == warm.text ? "yes" : "NO");
  std::printf("warm restart speedup (cold / warm time to first token): %.1fx (goal >= 10x)\n",
              cold.seconds / warm.seconds);
  return before.text == warm.text ? 0 : 1;
}

}  // namespace
}  // namespace kvcm::bench

int main(int argc, char** argv) { return kvcm::bench::Main(argc, argv); }
