#pragma once
// The whole server as one `kvcm-launch` process, for the benchmarks on the bundled model
// (tier_restart_bench, tier_chat_bench), and the seeded English-like text they send it.

#include <signal.h>

#include <filesystem>
#include <iterator>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "common/base/check.h"
#include "tests/support/cache_manager_process.h"
#include "tests/support/subprocess.h"

namespace kvcm::bench {

struct LaunchStack {
  std::unique_ptr<testing::Subprocess> launch;
  std::string url;  // http://127.0.0.1:PORT
};

// Starts `kvcm-launch --model MODEL --port 0 --executors 1 ARGS...`, its output in
// `log_path`, and waits for its ready line.
inline LaunchStack StartLaunch(const std::string& model, const std::vector<std::string>& args,
                               const std::string& log_path) {
  testing::Subprocess::Options options;
  options.argv = {
      testing::KvcmBinaryPath("kvcm-launch"), "--model", model, "--port", "0", "--executors", "1"};
  options.argv.insert(options.argv.end(), args.begin(), args.end());
  options.output_path = log_path;
  std::filesystem::remove(options.output_path);
  auto started = testing::Subprocess::Start(options);
  KVCM_CHECK(started.ok()) << started.status();
  LaunchStack stack;
  stack.launch = *std::move(started);
  auto ready = stack.launch->WaitForLine("kvcm-launch: ready http=(\\S+) executors=1",
                                         absl::Now() + absl::Seconds(120));
  KVCM_CHECK(ready.ok()) << ready.status() << "\n" << testing::Tail(stack.launch->Output());
  stack.url = (*ready)[1];
  return stack;
}

// SIGTERM, which stops every process of the stack cleanly; checks that it exits 0.
inline void StopLaunch(LaunchStack& stack) {
  KVCM_CHECK(stack.launch->Signal(SIGTERM).ok());
  auto code = stack.launch->Wait(absl::Seconds(60));
  KVCM_CHECK(code.ok() && *code == 0) << testing::Tail(stack.launch->Output());
}

// About `words` words of English-like text, different for each seed. SmolLM2's tokenizer
// gives about 1.06 tokens per word of it (the dots).
inline std::string SeededText(uint32_t seed, int words) {
  static const char* const kWords[] = {
      "cache", "block",  "river",  "stone",  "memory", "token", "garden", "window", "paper",
      "light", "engine", "north",  "silver", "market", "cloud", "letter", "forest", "signal",
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

}  // namespace kvcm::bench
