#pragma once

// CacheManagerProcess: a real kvcm-cache-manager started for an integration test, in a temp
// run directory, with the values of its ready line parsed:
//
//   kvcm-cache-manager: ready epoch=<E> endpoint=ipc://... events=ipc://...
//                       metrics=http://127.0.0.1:<port>/metrics        (one line, stderr)
//
//   CacheManagerOptions options;
//   options.num_blocks = 32;
//   KVCM_ASSIGN_OR_RETURN(auto cache_manager, StartCacheManager(options));
//   client_options.endpoint = cache_manager->endpoint();
//
// The binary is KvcmBinaryPath("kvcm-cache-manager"). Metrics bind 127.0.0.1:0 (no fixed
// ports); the small default shape keeps the shm pool a few KiB.
// Thread safety: none; one owner, on the test's main thread (see Subprocess).

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "tests/support/subprocess.h"

namespace kvcm::testing {

// Where the build put kvcm binary `name`: $KVCM_BIN_DIR/name when that variable is set
// (ctest or a developer may point it elsewhere), else the build tree's bin/ directory
// (compiled in).
std::string KvcmBinaryPath(std::string_view name);

struct CacheManagerOptions {
  // Run directory; "" = a fresh temp directory owned (and removed) by the process object.
  // Pass one to restart a cache manager on the same directory.
  std::string run_dir;
  std::string backend = "shm";
  // Shape and size; 0 or "" leaves the flag out (give --model-config or another sizing
  // flag in extra_args instead).
  int32_t num_blocks = 64;
  int32_t layers = 2;
  int32_t kv_heads = 2;
  int32_t head_dim = 8;
  std::string dtype = "fp16";
  int32_t block_size = 4;
  // --heartbeat-interval-ms / --heartbeat-timeout-ms; unset = the binary's defaults.
  std::optional<int32_t> heartbeat_interval_ms;
  std::optional<int32_t> heartbeat_timeout_ms;
  std::vector<std::string> extra_args;  // appended last
  // "NAME=value" entries for its environment (Subprocess::Options::env), e.g. an
  // LD_PRELOAD of the clock-offset library (tests/support/clock_offset_preload.cc).
  std::vector<std::string> env;
  // Run the binary through this command line, e.g. {"prlimit", "--nofile=256:256"} (it must
  // exec the binary, so that the pid stays the cache manager's).
  std::vector<std::string> wrapper;
  absl::Duration ready_timeout = absl::Seconds(30);
};

class CacheManagerProcess {
 public:
  // Starts the binary and waits for its ready line. Errors: those of Subprocess::Start and
  // WaitForLine (FAILED_PRECONDITION with its output when it exits instead, for example
  // because another cache manager holds the run directory), INTERNAL for a temp dir failure.
  static absl::StatusOr<std::unique_ptr<CacheManagerProcess>> Start(
      const CacheManagerOptions& options);

  // SIGKILL if still running, then remove the owned run directory.
  ~CacheManagerProcess() = default;

  uint64_t epoch() const { return epoch_; }
  const std::string& run_dir() const { return run_dir_; }
  const std::string& endpoint() const { return endpoint_; }        // ipc://.../cache-manager.sock
  const std::string& events_endpoint() const { return events_; }   // ipc://.../events.sock
  const std::string& metrics_url() const { return metrics_url_; }  // http://127.0.0.1:P/metrics
  Subprocess& process() { return *process_; }
  std::string Output() const { return process_->Output(); }

  // SIGTERM and wait up to `timeout` for the exit code (0 for a clean exit).
  // DEADLINE_EXCEEDED if it did not exit (it is killed when this object goes away).
  absl::StatusOr<int> Terminate(absl::Duration timeout = absl::Seconds(10));

 private:
  CacheManagerProcess() = default;

  // Declared before process_: removed after the process is gone.
  std::optional<TempDir> dir_;      // the owned run directory, if any
  std::optional<TempDir> log_dir_;  // holds the process's output file
  std::unique_ptr<Subprocess> process_;
  std::string run_dir_;
  uint64_t epoch_ = 0;
  std::string endpoint_;
  std::string events_;
  std::string metrics_url_;
};

inline absl::StatusOr<std::unique_ptr<CacheManagerProcess>> StartCacheManager(
    const CacheManagerOptions& options = {}) {
  return CacheManagerProcess::Start(options);
}

}  // namespace kvcm::testing
