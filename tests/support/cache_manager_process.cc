#include "tests/support/cache_manager_process.h"

#include <signal.h>

#include <cstdlib>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

#ifndef KVCM_BIN_DIR
#error "KVCM_BIN_DIR must name the build tree's bin directory"
#endif

namespace kvcm::testing {

std::string KvcmBinaryPath(std::string_view name) {
  const char* dir = std::getenv("KVCM_BIN_DIR");
  return absl::StrCat(dir != nullptr && *dir != '\0' ? dir : KVCM_BIN_DIR, "/", std::string(name));
}

absl::StatusOr<std::unique_ptr<CacheManagerProcess>> CacheManagerProcess::Start(
    const CacheManagerOptions& options) {
  std::unique_ptr<CacheManagerProcess> cm(new CacheManagerProcess());
  if (options.run_dir.empty()) {
    absl::StatusOr<TempDir> dir = TempDir::Create("kvcm-cm");
    if (!dir.ok()) return dir.status();
    cm->dir_.emplace(std::move(*dir));
    cm->run_dir_ = cm->dir_->path();
  } else {
    cm->run_dir_ = options.run_dir;
  }

  Subprocess::Options process_options;
  process_options.argv = {KvcmBinaryPath("kvcm-cache-manager"),
                          "--run-dir",
                          cm->run_dir_,
                          "--backend",
                          options.backend,
                          "--block-size",
                          absl::StrCat(options.block_size),
                          "--metrics-address",
                          "127.0.0.1:0"};
  // A zero or empty field leaves its flag out (extra_args may then give --model-config or
  // another sizing flag).
  auto add = [&](const char* flag, const std::string& value, bool given) {
    if (!given) return;
    process_options.argv.push_back(flag);
    process_options.argv.push_back(value);
  };
  add("--num-blocks", absl::StrCat(options.num_blocks), options.num_blocks != 0);
  add("--layers", absl::StrCat(options.layers), options.layers != 0);
  add("--kv-heads", absl::StrCat(options.kv_heads), options.kv_heads != 0);
  add("--head-dim", absl::StrCat(options.head_dim), options.head_dim != 0);
  add("--dtype", options.dtype, !options.dtype.empty());
  if (options.heartbeat_interval_ms.has_value()) {
    process_options.argv.push_back("--heartbeat-interval-ms");
    process_options.argv.push_back(absl::StrCat(*options.heartbeat_interval_ms));
  }
  if (options.heartbeat_timeout_ms.has_value()) {
    process_options.argv.push_back("--heartbeat-timeout-ms");
    process_options.argv.push_back(absl::StrCat(*options.heartbeat_timeout_ms));
  }
  for (const std::string& arg : options.extra_args) process_options.argv.push_back(arg);
  // The log lives next to (not in) the run directory's sockets, in a directory of its own so
  // that two starts on one run directory keep both logs.
  absl::StatusOr<TempDir> log_dir = TempDir::Create("kvcm-cm-log");
  if (!log_dir.ok()) return log_dir.status();
  process_options.output_path = log_dir->path() + "/output";
  process_options.env = options.env;
  process_options.argv.insert(process_options.argv.begin(), options.wrapper.begin(),
                              options.wrapper.end());

  absl::StatusOr<std::unique_ptr<Subprocess>> process = Subprocess::Start(process_options);
  if (!process.ok()) return process.status();
  cm->process_ = std::move(*process);
  absl::StatusOr<std::vector<std::string>> ready = cm->process_->WaitForLine(
      R"(kvcm-cache-manager: ready epoch=([0-9]+) endpoint=(\S+) events=(\S+) metrics=(\S+))",
      absl::Now() + options.ready_timeout);
  // WaitForLine's errors carry the output's tail: the log directory goes with this frame.
  if (!ready.ok()) return ready.status();
  if (!absl::SimpleAtoi((*ready)[1], &cm->epoch_)) {
    return absl::InternalError(absl::StrCat("bad epoch in ready line: ", (*ready)[0]));
  }
  cm->endpoint_ = (*ready)[2];
  cm->events_ = (*ready)[3];
  cm->metrics_url_ = (*ready)[4];
  // Keep the log readable for the process's lifetime: move its directory into the object.
  cm->log_dir_.emplace(std::move(*log_dir));
  return cm;
}

absl::StatusOr<int> CacheManagerProcess::Terminate(absl::Duration timeout) {
  // FAILED_PRECONDITION here only means it has already exited; Wait returns its code.
  (void)process_->Signal(SIGTERM);
  return process_->Wait(timeout);
}

}  // namespace kvcm::testing
