// kvcm-launch: the whole server on one node, as TGI's text-generation-launcher does it for
// TGI (docs/operations.md, "kvcm-launch"). Starts the cache manager, the router and N
// executors in that order, each once the one before is ready; prefixes their log lines;
// restarts any that dies, with backoff; and at SIGINT/SIGTERM stops the router first (it
// drains), then the executors, then the cache manager.
//
// Every child runs in its own process group, so a terminal's Ctrl-C reaches the launcher
// only and the order of the stop is the launcher's. A process that dies before it was ever
// ready fails the launch (a bad flag would otherwise restart for ever).
//
// With --prometheus-targets FILE it keeps FILE, Prometheus's file_sd target list, current
// with every process's metrics address as each reports it (prometheus_targets.h).

#include <fcntl.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/base/atomic_file.h"
#include "common/base/cpus.h"
#include "common/base/log.h"
#include "common/base/monotonic_clock.h"
#include "common/base/run_dir.h"
#include "common/base/termination_signals.h"
#include "common/base/unique_fd.h"
#include "common/transport/event_loop.h"
#include "tools/launch/launch_options.h"
#include "tools/launch/prometheus_targets.h"

namespace kvcm::launch {
namespace {

constexpr char kComponent[] = "kvcm-launch";
void Log(std::string_view text) { LogLine(kComponent, text); }

// A process that ran this long before it died restarts after the first backoff again.
constexpr absl::Duration kHealthyRun = absl::Seconds(30);
// How long each group gets to stop after SIGTERM before SIGKILL.
constexpr absl::Duration kStopGrace = absl::Seconds(20);

std::string Describe(int status) {
  if (WIFEXITED(status)) return absl::StrCat("exit code ", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    return absl::StrCat("killed by signal ", WTERMSIG(status), " (", strsignal(WTERMSIG(status)),
                        ")");
  }
  return absl::StrCat("status ", status);
}

enum class Group { kCacheManager = 0, kRouter = 1, kExecutor = 2 };

struct Child {
  std::string name;  // "cache-manager", "router", "executor-0", ...
  Group group = Group::kExecutor;
  std::vector<std::string> argv;
  std::string ready_marker;  // a log line holding this says the process is ready
  // Where its /metrics is, from its last "ready" line; kept after it dies, so Prometheus
  // sees it down until it reports a new address (prometheus_targets.h).
  std::optional<MetricsEndpoint> metrics;

  pid_t pid = -1;
  UniqueFd pidfd;
  UniqueFd output;
  std::string partial;  // output after the last newline
  EventLoop::Id output_watch = 0;
  EventLoop::Id exit_watch = 0;
  absl::Time started;
  bool ready = false;
  bool ever_ready = false;
  absl::Duration backoff;
  EventLoop::Id restart_timer = 0;
  int restarts = 0;
};

class Launcher {
 public:
  explicit Launcher(LaunchOptions options) : options_(std::move(options)) {}

  absl::Status Run(int signal_fd);
  int exit_code() const { return exit_code_; }

 private:
  absl::Status Prepare();
  void Start(Child& child);
  void OnOutput(Child& child);
  void Line(Child& child, std::string_view line);
  void OnExit(Child& child);
  void ScheduleRestart(Child& child);
  void Advance();  // starts what the start order allows next
  void BeginStop();
  void StopPhase();
  void Fail(const std::string& why);
  // Rewrites --prometheus-targets (nothing without it): every process that reported its
  // metrics address, or none at all when `empty`.
  absl::Status WriteTargets(bool empty);
  bool Alive(const Child& child) const { return child.pid > 0; }

  LaunchOptions options_;
  EventLoop loop_;
  std::vector<std::unique_ptr<Child>> children_;  // cache manager, router, executors
  std::string run_dir_;
  bool own_run_dir_ = false;
  std::string host_;  // this node's name, for the targets' instance labels
  std::string url_;
  bool announced_ = false;
  bool stopping_ = false;
  int stop_phase_ = 0;  // 1: router, 2: executors, 3: cache manager, 4: done
  absl::Time phase_deadline_;
  int exit_code_ = 0;
};

absl::Status Launcher::Prepare() {
  std::string bin = options_.bin_dir;
  if (bin.empty()) {
    std::error_code error;
    bin = std::filesystem::read_symlink("/proc/self/exe", error).parent_path().string();
    if (error) return absl::InternalError("cannot find the launcher's own directory");
  }
  for (const char* binary : {"kvcm-cache-manager", "kvcm-router", "kvcm-executor"}) {
    if (::access((bin + "/" + binary).c_str(), X_OK) != 0) {
      return absl::NotFoundError(
          absl::StrCat(bin, "/", binary, " is missing or not executable (--bin-dir)"));
    }
  }
  // A model folder (its config.json) or a GGUF file: the cache manager reads either.
  const bool folder = std::filesystem::is_directory(options_.model);
  if (folder ? !std::filesystem::exists(options_.model + "/config.json")
             : !std::filesystem::is_regular_file(options_.model)) {
    return absl::NotFoundError(absl::StrCat(
        options_.model, folder ? "/config.json not found (--model)"
                               : " is neither a model folder nor a GGUF file (--model)"));
  }
  // The target file first (empty), so a path that cannot be written fails before anything
  // is made.
  if (!options_.prometheus_targets.empty()) {
    char host[256] = {};
    if (::gethostname(host, sizeof(host) - 1) != 0 || host[0] == '\0') {
      std::snprintf(host, sizeof(host), "localhost");
    }
    host_ = host;
    if (absl::Status s = WriteTargets(/*empty=*/true); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("--prometheus-targets: ", s.message()));
    }
  }
  run_dir_ = options_.run_dir;
  if (run_dir_.empty()) {
    const char* tmp = std::getenv("TMPDIR");
    std::string pattern =
        absl::StrCat(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp", "/kvcm-launch.XXXXXX");
    if (::mkdtemp(pattern.data()) == nullptr) {
      return absl::InternalError(absl::StrCat("mkdtemp ", pattern, ": ", std::strerror(errno)));
    }
    run_dir_ = pattern;
    own_run_dir_ = true;
  }

  auto child = [&](std::string name, Group group, std::string binary, std::string marker) {
    auto c = std::make_unique<Child>();
    c->name = std::move(name);
    c->group = group;
    c->argv = {bin + "/" + binary};
    // Each reads its own section; the launcher's flags below still win over the file.
    if (!options_.config_file.empty()) {
      c->argv.insert(c->argv.end(), {"--config", options_.config_file});
    }
    c->ready_marker = std::move(marker);
    c->backoff = absl::Milliseconds(options_.restart_backoff_ms);
    return c;
  };
  auto cm = child("cache-manager", Group::kCacheManager, "kvcm-cache-manager", "ready epoch=");
  cm->argv.insert(cm->argv.end(), {"--run-dir", run_dir_, "--model-config", options_.model,
                                   "--metrics-address", "127.0.0.1:0"});
  if (!options_.pool_sized) cm->argv.push_back(absl::StrCat("--pool-bytes=", kDefaultPoolBytes));
  cm->argv.insert(cm->argv.end(), options_.cache_manager_args.begin(),
                  options_.cache_manager_args.end());
  children_.push_back(std::move(cm));

  auto router = child("router", Group::kRouter, "kvcm-router", "ready http=");
  router->argv.insert(router->argv.end(), {"--model", options_.model, "--run-dir", run_dir_});
  router->argv.insert(router->argv.end(), options_.router_args.begin(), options_.router_args.end());
  children_.push_back(std::move(router));

  for (int i = 0; i < options_.executors; ++i) {
    auto executor = child(absl::StrCat("executor-", i), Group::kExecutor, "kvcm-executor",
                          "registered with the router as executor");
    executor->argv.insert(executor->argv.end(),
                          {"--model", options_.model, "--run-dir", run_dir_, "--name",
                           absl::StrCat("executor-", i), "--metrics-address", "127.0.0.1:0"});
    if (!options_.threads_set) {
      executor->argv.push_back(absl::StrCat(
          "--threads=", ExecutorThreads(UsableCpus(), static_cast<int32_t>(options_.executors))));
    }
    executor->argv.insert(executor->argv.end(), options_.executor_args.begin(),
                          options_.executor_args.end());
    children_.push_back(std::move(executor));
  }
  return absl::OkStatus();
}

absl::Status Launcher::WriteTargets(bool empty) {
  if (options_.prometheus_targets.empty()) return absl::OkStatus();
  std::vector<ScrapeTarget> targets;
  for (const auto& child : children_) {
    if (empty || !child->metrics.has_value()) continue;
    const char* component = child->group == Group::kCacheManager ? "cache-manager"
                            : child->group == Group::kRouter     ? "router"
                                                                 : "executor";
    targets.push_back({component, child->name, child->metrics->address, child->metrics->path});
  }
  return WriteFileAtomically(options_.prometheus_targets, RenderPrometheusTargets(targets, host_));
}

void Launcher::Start(Child& child) {
  int pipe_fds[2];
  if (::pipe2(pipe_fds, O_CLOEXEC) != 0) {
    return Fail(absl::StrCat("pipe for ", child.name, ": ", std::strerror(errno)));
  }
  std::vector<char*> argv;
  for (std::string& arg : child.argv) argv.push_back(arg.data());
  argv.push_back(nullptr);
  const pid_t pid = ::fork();
  if (pid < 0) {
    ::close(pipe_fds[0]);
    ::close(pipe_fds[1]);
    return Fail(absl::StrCat("fork for ", child.name, ": ", std::strerror(errno)));
  }
  if (pid == 0) {
    ::setpgid(0, 0);  // a terminal's SIGINT is the launcher's to forward
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    ::signal(SIGPIPE, SIG_DFL);
    ::dup2(pipe_fds[1], STDOUT_FILENO);
    ::dup2(pipe_fds[1], STDERR_FILENO);
    ::execv(argv[0], argv.data());
    std::fprintf(stderr, "exec %s: %s\n", argv[0], std::strerror(errno));
    ::_exit(127);
  }
  ::close(pipe_fds[1]);
  child.pid = pid;
  child.output = UniqueFd(pipe_fds[0]);
  ::fcntl(child.output.get(), F_SETFL, ::fcntl(child.output.get(), F_GETFL) | O_NONBLOCK);
  child.pidfd = UniqueFd(static_cast<int>(::syscall(SYS_pidfd_open, pid, 0)));
  child.started = MonotonicNow();
  child.ready = false;
  child.partial.clear();
  child.output_watch = loop_.WatchFd(child.output.get(), [this, &child] { OnOutput(child); });
  if (child.pidfd.valid()) {
    child.exit_watch = loop_.WatchFd(child.pidfd.get(), [this, &child] { OnExit(child); });
  }
  Log(absl::StrCat("started ", child.name, " (pid ", pid, ")"));
}

void Launcher::OnOutput(Child& child) {
  char buffer[8192];
  while (true) {
    const ssize_t n = ::read(child.output.get(), buffer, sizeof(buffer));
    if (n > 0) {
      child.partial.append(buffer, static_cast<size_t>(n));
      size_t start = 0;
      for (size_t nl; (nl = child.partial.find('\n', start)) != std::string::npos; start = nl + 1) {
        Line(child, std::string_view(child.partial).substr(start, nl - start));
      }
      child.partial.erase(0, start);
      continue;
    }
    if (n == 0) {  // the process closed its output (it is exiting)
      if (!child.partial.empty()) Line(child, child.partial);
      child.partial.clear();
      loop_.Cancel(child.output_watch);
      child.output_watch = 0;
      child.output.reset();
      // Without a pidfd (an old kernel) the end of the output is the end of the process.
      if (!child.pidfd.valid()) OnExit(child);
    }
    return;  // EAGAIN: all read for now
  }
}

void Launcher::Line(Child& child, std::string_view line) {
  std::printf("[%s] %.*s\n", child.name.c_str(), static_cast<int>(line.size()), line.data());
  std::fflush(stdout);
  if (std::optional<MetricsEndpoint> metrics = MetricsEndpointFromReadyLine(line);
      metrics.has_value() && !options_.prometheus_targets.empty()) {
    child.metrics = std::move(metrics);
    if (absl::Status s = WriteTargets(/*empty=*/false); !s.ok()) {
      Log(absl::StrCat("error: --prometheus-targets not updated: ", s.ToString()));
    }
  }
  if (child.ready || line.find(child.ready_marker) == std::string_view::npos) return;
  child.ready = true;
  child.ever_ready = true;
  if (child.group == Group::kRouter) {
    const size_t at = line.find("ready http=") + std::strlen("ready http=");
    url_ = std::string(line.substr(at, line.find(' ', at) - at));
  }
  Advance();
}

void Launcher::Advance() {
  if (stopping_) return;
  Child& cm = *children_[0];
  Child& router = *children_[1];
  if (!cm.ever_ready) return;
  if (!Alive(router) && router.restart_timer == 0 && !router.ever_ready) Start(router);
  if (!router.ever_ready) return;
  bool all_ready = true;
  for (size_t i = 2; i < children_.size(); ++i) {
    Child& executor = *children_[i];
    if (!Alive(executor) && executor.restart_timer == 0 && !executor.ever_ready) Start(executor);
    all_ready = all_ready && executor.ever_ready;
  }
  if (all_ready && !announced_) {
    announced_ = true;
    // threads_each: what the launcher gave each executor, when it chose (last: tests and
    // scripts read the fields before it).
    Log(absl::StrCat(
        "ready http=", url_, " executors=", options_.executors, " run_dir=", run_dir_,
        options_.threads_set
            ? ""
            : absl::StrCat(" threads_each=", ExecutorThreads(UsableCpus(), options_.executors))));
  }
}

void Launcher::OnExit(Child& child) {
  if (child.pid <= 0) return;
  if (child.output.valid()) OnOutput(child);  // what it wrote last
  int status = 0;
  const pid_t reaped = ::waitpid(child.pid, &status, 0);
  if (reaped != child.pid) return;
  if (child.exit_watch != 0) loop_.Cancel(child.exit_watch);
  child.exit_watch = 0;
  child.pidfd.reset();
  if (child.output_watch != 0) loop_.Cancel(child.output_watch);
  child.output_watch = 0;
  child.output.reset();
  const absl::Duration ran = MonotonicNow() - child.started;
  child.pid = -1;
  child.ready = false;
  Log(absl::StrCat(child.name, " exited (", Describe(status), ") after ",
                   absl::FormatDuration(absl::Trunc(ran, absl::Milliseconds(100)))));
  if (stopping_) return StopPhase();
  if (!child.ever_ready) {
    return Fail(absl::StrCat(child.name, " failed before it was ready (", Describe(status),
                             "); its last lines are above"));
  }
  if (ran >= kHealthyRun) child.backoff = absl::Milliseconds(options_.restart_backoff_ms);
  ScheduleRestart(child);
}

void Launcher::ScheduleRestart(Child& child) {
  Log(absl::StrCat("restarting ", child.name, " in ", absl::FormatDuration(child.backoff)));
  child.restart_timer = loop_.AddTimer(child.backoff, [this, &child](absl::Duration) {
    loop_.Cancel(child.restart_timer);
    child.restart_timer = 0;
    if (stopping_) return;
    ++child.restarts;
    Start(child);
  });
  child.backoff = std::min(child.backoff * 2, absl::Milliseconds(options_.max_restart_backoff_ms));
}

void Launcher::BeginStop() {
  if (stopping_) return;
  stopping_ = true;
  Log("stopping: the router first (it lets running requests finish), then the executors, "
      "then the cache manager");
  for (auto& child : children_) {
    if (child->restart_timer != 0) loop_.Cancel(child->restart_timer);
    child->restart_timer = 0;
  }
  // A server being stopped is not down: Prometheus drops its targets now.
  if (absl::Status s = WriteTargets(/*empty=*/true); !s.ok()) {
    Log(absl::StrCat("error: --prometheus-targets not emptied: ", s.ToString()));
  }
  stop_phase_ = 0;
  StopPhase();
}

// Moves through the stop phases: each sends SIGTERM to its group and waits for it.
void Launcher::StopPhase() {
  auto group_of_phase = [](int phase) {
    return phase == 1 ? Group::kRouter : phase == 2 ? Group::kExecutor : Group::kCacheManager;
  };
  while (stop_phase_ < 4) {
    if (stop_phase_ > 0) {
      bool alive = false;
      for (auto& child : children_) {
        alive = alive || (child->group == group_of_phase(stop_phase_) && Alive(*child));
      }
      if (alive) return;  // OnExit calls again
    }
    if (++stop_phase_ == 4) break;
    phase_deadline_ = MonotonicNow() + kStopGrace;
    for (auto& child : children_) {
      if (child->group == group_of_phase(stop_phase_) && Alive(*child)) {
        ::kill(child->pid, SIGTERM);
      }
    }
  }
  loop_.Stop();
}

void Launcher::Fail(const std::string& why) {
  Log(absl::StrCat("error: ", why));
  exit_code_ = 1;
  BeginStop();
}

absl::Status Launcher::Run(int signal_fd) {
  if (absl::Status s = loop_.Init(); !s.ok()) return s;
  if (absl::Status s = Prepare(); !s.ok()) return s;
  Log(absl::StrCat("run directory ", run_dir_, own_run_dir_ ? " (removed at exit)" : "", "; ",
                   options_.executors, " executor(s)"));
  loop_.WatchSignals(signal_fd, [this](int signo) {
    if (!stopping_) {
      Log(absl::StrCat("signal ", signo, " (", strsignal(signo), ")"));
      return BeginStop();
    }
    Log("second signal: killing everything now");
    for (auto& child : children_) {
      if (Alive(*child)) ::kill(child->pid, SIGKILL);
    }
  });
  // Stop phases that overrun their grace get SIGKILL.
  loop_.AddTimer(absl::Milliseconds(500), [this](absl::Duration) {
    if (!stopping_ || MonotonicNow() < phase_deadline_) return;
    for (auto& child : children_) {
      if (Alive(*child)) {
        Log(absl::StrCat(child->name, " did not stop in ", absl::FormatDuration(kStopGrace),
                         ": SIGKILL"));
        ::kill(child->pid, SIGKILL);
      }
    }
  });
  Start(*children_[0]);
  if (absl::Status s = loop_.Run(); !s.ok()) return s;
  if (own_run_dir_) {
    std::error_code error;
    std::filesystem::remove_all(run_dir_, error);
  }
  Log(exit_code_ == 0 ? "stopped" : "stopped after an error");
  return absl::OkStatus();
}

}  // namespace
}  // namespace kvcm::launch

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  for (const std::string& arg : args) {
    if (arg == "--help" || arg == "-h") {
      std::fputs(kvcm::launch::LaunchUsage().c_str(), stdout);
      return 0;
    }
  }
  // Environment and --config for the launcher's own flags (common/config/config.h).
  std::vector<std::string> environment;
  for (char** entry = environ; *entry != nullptr; ++entry) environment.emplace_back(*entry);
  absl::StatusOr<kvcm::launch::ConfiguredArgs> configured =
      kvcm::launch::ApplyLaunchConfig(args, environment);
  if (!configured.ok()) {
    std::fprintf(stderr, "kvcm-launch: %s\n", std::string(configured.status().message()).c_str());
    return 2;
  }
  if (configured->print_config) {
    std::fputs(kvcm::config::PrintableConfig("launch", configured->settings).c_str(), stdout);
    return 0;
  }
  absl::StatusOr<kvcm::launch::LaunchOptions> options =
      kvcm::launch::ParseLaunchOptions(configured->args);
  if (!options.ok()) {
    std::fprintf(stderr, "kvcm-launch: %s\n", std::string(options.status().message()).c_str());
    return 2;
  }
  options->config_file = configured->config_file;
  options->pool_sized = options->pool_sized || configured->pool_sized;
  options->threads_set = options->threads_set || configured->threads_set;
  kvcm::LogLine("kvcm-launch",
                kvcm::config::Describe(configured->settings, configured->config_file));
  kvcm::UniqueFd signals = kvcm::BlockTerminationSignals();
  kvcm::launch::Launcher launcher(*std::move(options));
  if (absl::Status run = launcher.Run(signals.get()); !run.ok()) {
    std::fprintf(stderr, "kvcm-launch: %s\n", std::string(run.message()).c_str());
    return 1;
  }
  return launcher.exit_code();
}
