#pragma once
// kvcm-launch's command line: its own flags, and every other flag routed to the process
// that takes it (docs/operations.md, "kvcm-launch").
//
//   kvcm-launch --model DIR --executors 2 --num-blocks 4096 --port 8080 --threads 4
//     --num-blocks goes to the cache manager, --port to the router, --threads to each
//     executor.
//   --cache-manager-arg=X / --router-arg=X / --executor-arg=X pass X as it is (repeatable),
//   for flags the table below does not route.
//
// Thread safety: plain values and a pure function.

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/config/config.h"

namespace kvcm::launch {

struct LaunchOptions {
  std::string model;    // --model: the model folder (required)
  int executors = 1;    // --executors
  std::string run_dir;  // --run-dir; "" = a fresh one, removed at exit
  std::string bin_dir;  // --bin-dir; "" = the launcher's own directory
  // Restart backoff: the first wait, doubled after each quick death up to the most.
  int restart_backoff_ms = 500;  // --restart-backoff-ms
  int max_restart_backoff_ms = 10000;
  // --prometheus-targets: a file_sd target file kept current with every process's metrics
  // address (tools/launch/prometheus_targets.h); "" = none. Its folder must exist.
  std::string prometheus_targets;
  // Extra arguments of each process, in command-line order.
  std::vector<std::string> cache_manager_args;
  std::vector<std::string> router_args;
  std::vector<std::string> executor_args;
  // Whether a pool size (--num-blocks, --pool-bytes, --memory-fraction) was given; if not,
  // the launcher asks for kDefaultPoolBytes.
  bool pool_sized = false;
  // Whether the executors' thread count is given (--threads, --executor-arg=--threads=N, the
  // executor section of --config, KVCM_EXECUTOR_THREADS); if not, the launcher gives each
  // executor its share of the CPUs (ExecutorThreads).
  bool threads_set = false;
  // --config: passed on to every process it starts (each reads its own section); "" = none.
  std::string config_file;
};

inline constexpr char kDefaultPoolBytes[] = "1GiB";

// The forward-pass threads of each of `executors` executors on `cpus` usable CPUs when none
// is given: an equal share, at least 1, so that executors started together do not each
// run one thread per CPU and stall on one another (docs/executor.md, "Threads").
int32_t ExecutorThreads(int32_t cpus, int32_t executors);

// Parses argv (without argv[0]). INVALID_ARGUMENT naming the flag for an unknown flag, a
// flag without its value, a bad number, or no --model.
absl::StatusOr<LaunchOptions> ParseLaunchOptions(const std::vector<std::string>& args);

// The launcher's own flags as options of the launch: section of a --config file and of the
// KVCM_LAUNCH_<OPTION> variables (common/config/config.h), with their defaults.
std::vector<config::Option> LaunchConfigOptions();

// The command line once the configuration file and the environment are applied.
struct ConfiguredArgs {
  // `args` without --config and --print-config, after a --name=value for each launcher flag
  // that the file's launch: section or a KVCM_LAUNCH_ variable sets and `args` do not give
  // (so the command line wins).
  std::vector<std::string> args;
  std::vector<config::Setting> settings;  // the launcher's options, for the log and printing
  std::string config_file;                // --config FILE, made absolute; "" = none
  bool print_config = false;              // --print-config
  // Whether the cache manager's section of the file or a KVCM_CACHE_MANAGER_ variable sizes
  // the pool (num_blocks, pool_bytes, memory_fraction), so the launcher must not.
  bool pool_sized = false;
  // Whether the executor section of the file or KVCM_EXECUTOR_THREADS sets a thread count
  // other than 0, so the launcher must not.
  bool threads_set = false;
};

// Applies the file and the environment (`environment`: "NAME=VALUE" entries) to argv
// (without argv[0]). Errors: INVALID_ARGUMENT for --config without a value, and those of
// config::ReadSection and config::Resolve (an unknown key, a value of the wrong type).
absl::StatusOr<ConfiguredArgs> ApplyLaunchConfig(const std::vector<std::string>& args,
                                                 const std::vector<std::string>& environment);

// The help text: the launcher's flags and where every routed flag goes.
std::string LaunchUsage();

}  // namespace kvcm::launch
