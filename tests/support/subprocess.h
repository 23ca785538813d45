#pragma once

// Subprocess: a child process for tests (a kvcm service binary, a helper binary, a
// Prometheus server, promtool), with its output in a file and bounded waits. Test support
// only.
//
//   KVCM_ASSIGN_OR_RETURN(TempDir dir, TempDir::Create("kvcm-test"));
//   Subprocess::Options options;
//   options.argv = {binary, "--run-dir", dir.path()};
//   options.output_path = dir.path() + "/output";
//   KVCM_ASSIGN_OR_RETURN(auto child, Subprocess::Start(options));
//   KVCM_ASSIGN_OR_RETURN(std::vector<std::string> groups,
//                         child->WaitForLine("ready epoch=([0-9]+)", absl::Now() + timeout));
//
// Waiting never sleeps for a fixed time to let a peer get ready: it polls the output file or
// waitpid every few milliseconds until the condition holds or the deadline passes.
//
// The child gets SIGKILL if the thread that started it exits (PR_SET_PDEATHSIG), so a
// crashed test leaves nothing running; start children from the test's main thread. A child
// still running when its Subprocess is destroyed is killed with SIGKILL and reaped (call
// Stop() first for a graceful SIGTERM).
// Thread safety: none; one owner.

#include <sys/types.h>

#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace kvcm::testing {

// The path of executable `name` (returned as is if it contains a '/'), searched on PATH.
// Errors: NOT_FOUND.
absl::StatusOr<std::string> FindProgram(const std::string& name);

class Subprocess {
 public:
  struct Options {
    std::vector<std::string> argv;  // argv[0]: a path, or a name searched on PATH
    std::string stdin_path;         // "" = /dev/null
    std::string output_path;        // stdout and stderr, truncated first; "" = /dev/null
    // "NAME=value" entries set in the child's environment on top of this process's (an
    // entry replaces a variable of the same name; "NAME" alone removes it).
    std::vector<std::string> env;
  };

  // Errors: NOT_FOUND (no such program), INVALID_ARGUMENT (empty argv), INTERNAL (fork).
  // An exec failure shows as exit code 127.
  static absl::StatusOr<std::unique_ptr<Subprocess>> Start(const Options& options);

  Subprocess(const Subprocess&) = delete;
  Subprocess& operator=(const Subprocess&) = delete;
  // SIGKILL and reap if still running.
  ~Subprocess();

  pid_t pid() const { return pid_; }
  const std::string& output_path() const { return output_path_; }
  // Everything the child has written so far ("" without an output file).
  std::string Output() const;

  // The exit code once it has exited (128 + signal number if a signal ended it), nullopt
  // while it runs.
  std::optional<int> Poll();
  // Waits up to `timeout` for it to exit. Errors: DEADLINE_EXCEEDED (still running).
  absl::StatusOr<int> Wait(absl::Duration timeout);
  // SIGTERM, then SIGKILL if it is still running after `grace`; returns the exit code.
  int Stop(absl::Duration grace);
  // Sends `signal` (SIGSTOP, SIGCONT, SIGTERM, ...). FAILED_PRECONDITION once it has exited.
  absl::Status Signal(int signal);

  // Waits until a complete line of the output matches `regex` (ECMAScript, searched
  // anywhere in the line) and returns the match: [0] the matched text, [1..] the groups.
  // The output is searched from its start on every call. INVALID_ARGUMENT for a bad regex
  // or no output file; FAILED_PRECONDITION when the child exits first; DEADLINE_EXCEEDED
  // when `deadline` passes. Error messages end with the tail of the output.
  absl::StatusOr<std::vector<std::string>> WaitForLine(const std::string& regex,
                                                       absl::Time deadline);

 private:
  Subprocess(pid_t pid, std::string output_path)
      : pid_(pid), output_path_(std::move(output_path)) {}

  pid_t pid_;
  std::string output_path_;  // "" when the output goes to /dev/null
  std::optional<int> exit_code_;
};

struct RunResult {
  int exit_code = 0;
  std::string output;  // stdout and stderr, interleaved
};

// Runs argv with `input` on stdin and waits up to `timeout`. Errors: as Subprocess::Start,
// DEADLINE_EXCEEDED (killed after the timeout).
absl::StatusOr<RunResult> RunProgram(const std::vector<std::string>& argv, std::string_view input,
                                     absl::Duration timeout);

// A fresh directory (mode 0700) under $TMPDIR (or /tmp), removed with its contents on
// destruction. Keep prefixes short: ipc:// socket paths inside must fit sockaddr_un (107
// bytes).
class TempDir {
 public:
  // Errors: INTERNAL.
  static absl::StatusOr<TempDir> Create(std::string_view prefix);
  TempDir(TempDir&& other) noexcept : path_(std::move(other.path_)) { other.path_.clear(); }
  TempDir& operator=(TempDir&&) = delete;
  TempDir(const TempDir&) = delete;
  ~TempDir();
  const std::string& path() const { return path_; }

 private:
  explicit TempDir(std::string path) : path_(std::move(path)) {}
  std::string path_;
};

// The whole file, or "" if it cannot be read.
std::string ReadFileOrEmpty(const std::string& path);

// The last `max_bytes` bytes of `text`, prefixed with "..." when cut.
std::string Tail(std::string_view text, size_t max_bytes = 4000);

}  // namespace kvcm::testing
