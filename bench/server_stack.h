#pragma once
// The whole server for the full-stack benchmarks: the real kvcm-cache-manager (shm pool),
// kvcm-router and one kvcm-executor, each its own process, started in that order and
// waited for (the router's ready line, the executor's registration).

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/time/clock.h"
#include "common/base/check.h"
#include "tests/support/cache_manager_process.h"
#include "tests/support/subprocess.h"

namespace kvcm::bench {

struct ServerStack {
  std::unique_ptr<testing::CacheManagerProcess> cache_manager;
  std::unique_ptr<testing::Subprocess> router;
  std::unique_ptr<testing::Subprocess> executor;
  std::string url;  // http://127.0.0.1:PORT
  int port = 0;

  ~ServerStack() {
    if (router != nullptr) (void)router->Stop(absl::Seconds(10));
    if (executor != nullptr) (void)executor->Stop(absl::Seconds(10));
  }
};

// Starts the three; `router_args` are appended to the router's own; logs go to `log_dir`.
inline std::unique_ptr<ServerStack> StartServerStack(const std::string& model_dir,
                                                     const testing::CacheManagerOptions& cm_options,
                                                     const std::vector<std::string>& router_args,
                                                     int executor_threads,
                                                     const std::string& log_dir) {
  auto stack = std::make_unique<ServerStack>();
  auto cm = testing::CacheManagerProcess::Start(cm_options);
  KVCM_CHECK(cm.ok()) << cm.status();
  stack->cache_manager = *std::move(cm);
  testing::Subprocess::Options router;
  router.argv = {testing::KvcmBinaryPath("kvcm-router"), "--model", model_dir, "--run-dir",
                 stack->cache_manager->run_dir(),        "--port",  "0"};
  router.argv.insert(router.argv.end(), router_args.begin(), router_args.end());
  router.output_path = log_dir + "/router.log";
  auto started = testing::Subprocess::Start(router);
  KVCM_CHECK(started.ok()) << started.status();
  stack->router = *std::move(started);
  auto ready = stack->router->WaitForLine("ready http=(http://127.0.0.1:([0-9]+))",
                                          absl::Now() + absl::Seconds(30));
  KVCM_CHECK(ready.ok()) << ready.status();
  stack->url = (*ready)[1];
  KVCM_CHECK(absl::SimpleAtoi((*ready)[2], &stack->port));
  testing::Subprocess::Options executor;
  executor.argv = {testing::KvcmBinaryPath("kvcm-executor"),
                   "--model",
                   model_dir,
                   "--run-dir",
                   stack->cache_manager->run_dir(),
                   "--threads",
                   std::to_string(executor_threads),
                   "--metrics-address",
                   "127.0.0.1:0"};
  executor.output_path = log_dir + "/executor.log";
  started = testing::Subprocess::Start(executor);
  KVCM_CHECK(started.ok()) << started.status();
  stack->executor = *std::move(started);
  KVCM_CHECK(
      stack->executor->WaitForLine("registered with the router", absl::Now() + absl::Seconds(60))
          .ok());
  return stack;
}

// `name VALUE` from the command line, or `fallback`.
inline int FlagValue(int argc, char** argv, const char* name, int fallback) {
  for (int i = 1; i + 1 < argc; ++i) {
    int value = 0;
    if (std::string(argv[i]) == name && absl::SimpleAtoi(argv[i + 1], &value)) return value;
  }
  return fallback;
}

// `name VALUE` from the command line as text, or `fallback`.
inline std::string FlagString(int argc, char** argv, const char* name, std::string fallback) {
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::string(argv[i]) == name) return argv[i + 1];
  }
  return fallback;
}

}  // namespace kvcm::bench
