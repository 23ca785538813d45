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

#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "bench/launch_stack.h"
#include "common/base/check.h"
#include "nlohmann/json.hpp"
#include "tests/support/http_client.h"
#include "tests/support/real_model.h"

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

LaunchStack Start(const std::string& model, const std::string& dir, int tokens, int threads) {
  const int blocks = tokens / 16 * 2 + 64;  // two prompts and room to spare
  return StartLaunch(
      model,
      {"--run-dir", dir + "/run", "--num-blocks", std::to_string(blocks), "--threads",
       std::to_string(threads), "--max-input-tokens", std::to_string(tokens + 256),
       "--max-total-tokens", std::to_string(tokens + 512), "--disk-tier-dir", dir + "/tier",
       "--disk-tier-bytes", "1GiB"},
      dir + "/launch.log");
}

struct Timed {
  double seconds = 0;
  int prompt_tokens = 0;
  int cached_tokens = 0;
  std::string text;
};

Timed Complete(const LaunchStack& stack, const std::string& prompt) {
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
  const std::string dir = absl::StrCat(std::filesystem::temp_directory_path().string(),
                                       "/kvcm-tier-restart-bench-", getpid());
  std::filesystem::create_directories(dir);
  constexpr uint32_t kSeed = 20261206;
  // About 1.06 tokens per word (SeededText).
  const int words = args.tokens * 17 / 18;
  const std::string warm_prompt = SeededText(kSeed, words);
  const std::string cold_prompt = SeededText(kSeed + 1, words);
  std::printf(
      "tier_restart_bench: %s, prompts of about %d tokens (seed %u), %d executor "
      "thread(s), disk tier in %s\n",
      model.c_str(), args.tokens, kSeed, args.threads, dir.c_str());

  LaunchStack first = Start(model, dir, args.tokens, args.threads);
  const Timed before = Complete(first, warm_prompt);
  // Stopped whole: the cache manager's pool and host memory are gone; the disk tier stays.
  StopLaunch(first);
  LaunchStack second = Start(model, dir, args.tokens, args.threads);
  const Timed warm = Complete(second, warm_prompt);
  const Timed cold = Complete(second, cold_prompt);
  StopLaunch(second);
  std::filesystem::remove_all(dir);

  std::printf("first start, cold:       %7.3f s  (%d prompt tokens, %d cached)\n", before.seconds,
              before.prompt_tokens, before.cached_tokens);
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
