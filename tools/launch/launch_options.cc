#include "tools/launch/launch_options.h"

#include <algorithm>
#include <array>
#include <filesystem>
#include <set>
#include <string_view>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace kvcm::launch {
namespace {

enum class Target { kCacheManager, kRouter, kExecutor };

struct Route {
  std::string_view flag;  // dashed, without "--"
  Target target;
  // A boolean flag: given without "=VALUE" it takes no value (passed on as --flag), and
  // --noflag turns it off, as Abseil spells it.
  bool boolean = false;
};

// Flags of the services that the launcher routes (each takes a value, but the boolean ones,
// which may also be given bare or as --noflag). The services' own
// flags the launcher sets itself (--run-dir, --model, --model-config, --name,
// --metrics-address, --router, --cache-manager) are not here: they are the launcher's.
constexpr std::array<Route, 41> kRoutes = {{
    {"backend", Target::kCacheManager},
    {"cuda-device", Target::kCacheManager},
    {"block-size", Target::kCacheManager},
    {"dtype", Target::kCacheManager},
    {"num-blocks", Target::kCacheManager},
    {"pool-bytes", Target::kCacheManager},
    {"memory-fraction", Target::kCacheManager},
    {"hash-algorithm", Target::kCacheManager},
    {"heartbeat-interval-ms", Target::kCacheManager},
    {"heartbeat-timeout-ms", Target::kCacheManager},
    {"max-pinned-blocks", Target::kCacheManager},
    {"max-ops-per-step", Target::kCacheManager},
    {"kv-events-endpoint", Target::kCacheManager},
    {"kv-events-replay-endpoint", Target::kCacheManager},
    {"kv-events-topic", Target::kCacheManager},
    {"kv-events-buffer-steps", Target::kCacheManager},
    {"host-tier-bytes", Target::kCacheManager},
    {"disk-tier-dir", Target::kCacheManager},
    {"disk-tier-bytes", Target::kCacheManager},
    {"tier-mover-threads", Target::kCacheManager},
    {"tier-load-timeout-ms", Target::kCacheManager},
    {"disk-tier-direct-io", Target::kCacheManager, /*boolean=*/true},
    {"disk-tier-sync-ms", Target::kCacheManager},
    {"disk-tier-read-depth", Target::kCacheManager},
    {"hostname", Target::kRouter},
    {"allowed-hosts", Target::kRouter},
    {"port", Target::kRouter},
    {"max-concurrent-requests", Target::kRouter},
    {"max-input-tokens", Target::kRouter},
    {"max-total-tokens", Target::kRouter},
    {"max-batch-prefill-tokens", Target::kRouter},
    {"max-batch-total-tokens", Target::kRouter},
    {"max-running", Target::kRouter},
    {"max-top-n-tokens", Target::kRouter},
    {"drain-timeout-ms", Target::kRouter},
    {"max-best-of", Target::kRouter},
    {"chat-template", Target::kRouter},
    {"threads", Target::kExecutor},
    {"call-timeout-ms", Target::kExecutor},
    {"fault-layer-delay-ms", Target::kExecutor},
    {"cache-manager-secret-file", Target::kExecutor},
}};

std::string Dashed(std::string_view name) {
  std::string out(name);
  std::replace(out.begin(), out.end(), '_', '-');
  return out;
}

const char* TargetName(Target target) {
  switch (target) {
    case Target::kCacheManager:
      return "the cache manager";
    case Target::kRouter:
      return "the router";
    case Target::kExecutor:
      return "each executor";
  }
  return "";
}

}  // namespace

std::vector<config::Option> LaunchConfigOptions() {
  using config::Type;
  const LaunchOptions defaults;
  std::vector<config::Option> options = {
      {"model", Type::kString, defaults.model, ""},
      {"executors", Type::kInt32, absl::StrCat(defaults.executors), ""},
      {"run_dir", Type::kString, defaults.run_dir, ""},
      {"bin_dir", Type::kString, defaults.bin_dir, ""},
      {"restart_backoff_ms", Type::kInt32, absl::StrCat(defaults.restart_backoff_ms), ""},
      {"prometheus_targets", Type::kString, defaults.prometheus_targets, ""},
  };
  for (config::Option& option : options) option.current_value = option.default_value;
  return options;
}

absl::StatusOr<ConfiguredArgs> ApplyLaunchConfig(const std::vector<std::string>& args,
                                                 const std::vector<std::string>& environment) {
  ConfiguredArgs out;
  config::Inputs inputs;
  inputs.section = "launch";
  inputs.options = LaunchConfigOptions();
  inputs.environment = environment;
  std::vector<std::string> rest;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (arg.substr(0, 2) != "--") {
      rest.push_back(arg);
      continue;
    }
    const size_t eq = arg.find('=');
    std::string name = arg.substr(2, eq == std::string::npos ? std::string::npos : eq - 2);
    std::replace(name.begin(), name.end(), '-', '_');
    if (name == "print_config") {
      out.print_config = true;
      continue;
    }
    // The value of a flag that takes one, and whether it was the next argument.
    const bool value_next = eq == std::string::npos && i + 1 < args.size();
    const std::string value = eq != std::string::npos ? arg.substr(eq + 1)
                              : value_next            ? args[i + 1]
                                                      : "";
    if (name == "config") {
      if (eq == std::string::npos && !value_next) {
        return absl::InvalidArgumentError("--config needs a value");
      }
      out.config_file = std::filesystem::absolute(value).string();
      if (value_next) ++i;
      continue;
    }
    for (config::Option& option : inputs.options) {
      if (option.name == name) {
        inputs.given.insert(name);
        option.current_value = value;
      }
    }
    rest.push_back(arg);
  }
  if (!out.config_file.empty()) {
    inputs.file_path = out.config_file;
    absl::StatusOr<config::SectionValues> file = config::ReadSection(out.config_file, "launch");
    if (!file.ok()) return file.status();
    inputs.file = *std::move(file);
  }
  absl::StatusOr<std::vector<config::Setting>> settings = config::Resolve(inputs);
  if (!settings.ok()) return settings.status();
  for (const config::Setting& setting : *settings) {
    if (setting.source == config::Source::kFile || setting.source == config::Source::kEnvironment) {
      out.args.push_back(absl::StrCat("--", Dashed(setting.name), "=", setting.value));
    }
  }
  out.args.insert(out.args.end(), rest.begin(), rest.end());
  out.settings = *std::move(settings);

  // The cache manager reads the same file and inherits the environment: a pool it sizes
  // there must not get the launcher's default size as well.
  const std::set<std::string> sizing = {"num_blocks", "pool_bytes", "memory_fraction"};
  auto sizes = [](const std::string& text) {
    double number = 0;
    return !text.empty() && !(absl::SimpleAtod(text, &number) && number == 0);
  };
  if (!out.config_file.empty()) {
    absl::StatusOr<config::SectionValues> cache_manager =
        config::ReadSection(out.config_file, "cache_manager");
    if (!cache_manager.ok()) return cache_manager.status();
    for (const auto& [key, value] : *cache_manager) {
      if (sizing.contains(key) && sizes(value)) out.pool_sized = true;
    }
    // Likewise the executors' threads (0 means "choose", so it leaves the choice here).
    absl::StatusOr<config::SectionValues> executor =
        config::ReadSection(out.config_file, "executor");
    if (!executor.ok()) return executor.status();
    for (const auto& [key, value] : *executor) {
      if (key == "threads" && sizes(value)) out.threads_set = true;
    }
  }
  for (const std::string& entry : environment) {
    const size_t eq = entry.find('=');
    if (eq == std::string::npos) continue;
    for (const std::string& key : sizing) {
      if (entry.substr(0, eq) == config::EnvironmentVariable("cache_manager", key) &&
          sizes(entry.substr(eq + 1))) {
        out.pool_sized = true;
      }
    }
    if (entry.substr(0, eq) == config::EnvironmentVariable("executor", "threads") &&
        sizes(entry.substr(eq + 1))) {
      out.threads_set = true;
    }
  }
  return out;
}

int32_t ExecutorThreads(int32_t cpus, int32_t executors) {
  return std::max<int32_t>(1, std::max<int32_t>(cpus, 1) / std::max<int32_t>(executors, 1));
}

absl::StatusOr<LaunchOptions> ParseLaunchOptions(const std::vector<std::string>& args) {
  LaunchOptions options;
  for (size_t i = 0; i < args.size(); ++i) {
    std::string_view arg = args[i];
    if (arg.substr(0, 2) != "--") {
      return absl::InvalidArgumentError(absl::StrCat("unexpected argument \"", std::string(arg),
                                                     "\": every argument is a --flag"));
    }
    arg.remove_prefix(2);
    const size_t eq = arg.find('=');
    const std::string name = Dashed(arg.substr(0, eq));
    std::string value;
    auto take_value = [&]() -> absl::Status {
      if (eq != std::string_view::npos) {
        value = std::string(arg.substr(eq + 1));
        return absl::OkStatus();
      }
      if (i + 1 >= args.size()) {
        return absl::InvalidArgumentError(absl::StrCat("--", name, " needs a value"));
      }
      value = args[++i];
      return absl::OkStatus();
    };
    auto take_int = [&](int* out, int lo) -> absl::Status {
      if (absl::Status s = take_value(); !s.ok()) return s;
      if (!absl::SimpleAtoi(value, out) || *out < lo) {
        return absl::InvalidArgumentError(
            absl::StrCat("--", name, " must be an integer >= ", lo, ", got \"", value, "\""));
      }
      return absl::OkStatus();
    };
    absl::Status status;
    if (name == "model") {
      status = take_value();
      options.model = value;
    } else if (name == "executors") {
      status = take_int(&options.executors, 1);
    } else if (name == "run-dir") {
      status = take_value();
      options.run_dir = value;
    } else if (name == "bin-dir") {
      status = take_value();
      options.bin_dir = value;
    } else if (name == "prometheus-targets") {
      status = take_value();
      options.prometheus_targets = value;
    } else if (name == "restart-backoff-ms") {
      status = take_int(&options.restart_backoff_ms, 1);
    } else if (name == "cache-manager-arg" || name == "router-arg" || name == "executor-arg") {
      status = take_value();
      (name == "router-arg"     ? options.router_args
       : name == "executor-arg" ? options.executor_args
                                : options.cache_manager_args)
          .push_back(value);
      if (name == "executor-arg" && absl::StartsWith(value, "--threads")) {
        options.threads_set = true;
      }
    } else {
      auto route = std::find_if(kRoutes.begin(), kRoutes.end(),
                                [&](const Route& r) { return r.flag == name; });
      // --noflag of a boolean flag.
      const bool negated = route == kRoutes.end() && name.rfind("no", 0) == 0 &&
                           std::find_if(kRoutes.begin(), kRoutes.end(), [&](const Route& r) {
                             return r.boolean && r.flag == std::string_view(name).substr(2);
                           }) != kRoutes.end();
      if (negated) {
        route = std::find_if(kRoutes.begin(), kRoutes.end(), [&](const Route& r) {
          return r.flag == std::string_view(name).substr(2);
        });
      }
      if (route == kRoutes.end()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "unknown flag --", name,
            "; pass a flag the launcher does not route with --cache-manager-arg=--", name,
            "=VALUE, --router-arg=... or --executor-arg=... (kvcm-launch --help lists the "
            "routed ones)"));
      }
      std::vector<std::string>& out = route->target == Target::kCacheManager
                                          ? options.cache_manager_args
                                      : route->target == Target::kRouter ? options.router_args
                                                                         : options.executor_args;
      if (route->boolean && (negated || eq == std::string_view::npos)) {
        if (negated && eq != std::string_view::npos) {
          return absl::InvalidArgumentError(absl::StrCat("--", name, " takes no value; use --",
                                                         std::string(route->flag), "=true|false"));
        }
        out.push_back(absl::StrCat("--", name));  // bare --flag or --noflag
        continue;
      }
      status = take_value();
      out.push_back(absl::StrCat("--", name, "=", value));
      if (name == "threads") options.threads_set = true;
      if (name == "num-blocks" || name == "pool-bytes" || name == "memory-fraction") {
        options.pool_sized = true;
      }
    }
    if (!status.ok()) return status;
  }
  if (options.model.empty()) return absl::InvalidArgumentError("--model is required");
  return options;
}

std::string LaunchUsage() {
  std::string usage = R"(kvcm-launch: runs a whole kvcm server on this node.

Starts the cache manager (KV shape from the model), the router and N
executors, waits for each to be ready, restarts any that dies (with backoff), prefixes
their log lines, and stops them all cleanly at SIGINT/SIGTERM (a second signal: at once).

  kvcm-launch --model DIR|FILE.gguf [--executors N] [flags...]

Launcher flags:
  --model PATH              a model folder or a GGUF file (required)
  --executors N             executors to run (default 1); unless --threads is given,
                            each gets an equal share of this process's CPUs
  --run-dir DIR             the run directory (default: a fresh one, removed at exit)
  --bin-dir DIR             where the kvcm binaries are (default: beside kvcm-launch)
  --restart-backoff-ms MS   first wait before a restart (default 500; doubles to 10 s)
  --prometheus-targets FILE keep FILE current for Prometheus's file_sd_configs: every
                            process's metrics address (monitoring/prometheus/prometheus.yml)
  --cache-manager-arg=X, --router-arg=X, --executor-arg=X
                            pass X as it is to that process (repeatable)
  --config FILE             a YAML file: its launch: section sets these flags, and every
                            process started gets --config FILE for its own section
                            (docs/operations.md, "Configuration")
  --print-config            print the launcher's effective configuration and exit
Each launcher flag can also be set by KVCM_LAUNCH_<FLAG> (e.g. KVCM_LAUNCH_EXECUTORS=2);
precedence: flag > environment > file > default.

Routed flags (each passed on as --flag=VALUE; a boolean one, marked [bool], may also be
given bare, --flag, or as --noflag):
)";
  for (Target target : {Target::kCacheManager, Target::kRouter, Target::kExecutor}) {
    std::vector<std::string> names;
    for (const Route& r : kRoutes) {
      if (r.target == target) {
        names.push_back(absl::StrCat("--", std::string(r.flag), r.boolean ? "[bool]" : ""));
      }
    }
    absl::StrAppend(&usage, "  to ", TargetName(target), ": ", absl::StrJoin(names, " "), "\n");
  }
  absl::StrAppend(&usage, "Without a pool size (--num-blocks, --pool-bytes, --memory-fraction) ",
                  "the pool gets --pool-bytes=", kDefaultPoolBytes, ".\n");
  return usage;
}

}  // namespace kvcm::launch
