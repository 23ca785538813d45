#include "tests/support/subprocess.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <sstream>
#include <system_error>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "tests/support/wait_for.h"

namespace kvcm::testing {
namespace {

// Lets the child's environment be built before fork: this environment, with `changes`
// applied ("NAME=value" sets, "NAME" removes).
std::vector<std::string> ChildEnvironment(const std::vector<std::string>& changes) {
  std::map<std::string, std::string> vars;
  for (char** entry = environ; *entry != nullptr; ++entry) {
    const std::string text = *entry;
    const size_t eq = text.find('=');
    if (eq != std::string::npos) vars[text.substr(0, eq)] = text.substr(eq + 1);
  }
  for (const std::string& change : changes) {
    const size_t eq = change.find('=');
    if (eq == std::string::npos) {
      vars.erase(change);
    } else {
      vars[change.substr(0, eq)] = change.substr(eq + 1);
    }
  }
  std::vector<std::string> out;
  out.reserve(vars.size());
  for (const auto& [name, value] : vars) out.push_back(absl::StrCat(name, "=", value));
  return out;
}

int ExitCode(int wait_status) {
  if (WIFEXITED(wait_status)) return WEXITSTATUS(wait_status);
  if (WIFSIGNALED(wait_status)) return 128 + WTERMSIG(wait_status);
  return -1;
}

}  // namespace

absl::StatusOr<std::string> FindProgram(const std::string& name) {
  if (name.find('/') != std::string::npos) {
    if (access(name.c_str(), X_OK) == 0) return name;
    return absl::NotFoundError(absl::StrCat(name, " is not an executable file"));
  }
  const char* path = std::getenv("PATH");
  for (absl::string_view dir : absl::StrSplit(path != nullptr ? path : "/usr/bin:/bin", ':')) {
    if (dir.empty()) continue;
    std::string candidate = absl::StrCat(dir, "/", name);
    if (access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return absl::NotFoundError(absl::StrCat(name, " not found on PATH"));
}

absl::StatusOr<std::unique_ptr<Subprocess>> Subprocess::Start(const Options& options) {
  if (options.argv.empty()) return absl::InvalidArgumentError("empty argv");
  absl::StatusOr<std::string> program = FindProgram(options.argv[0]);
  if (!program.ok()) return program.status();

  // Everything the child needs, prepared before fork: after it only async-signal-safe
  // calls (the parent has threads).
  std::vector<char*> argv;
  for (const std::string& arg : options.argv) argv.push_back(const_cast<char*>(arg.c_str()));
  argv.push_back(nullptr);
  const std::vector<std::string> env_storage = ChildEnvironment(options.env);
  std::vector<char*> envp;
  for (const std::string& entry : env_storage) envp.push_back(const_cast<char*>(entry.c_str()));
  envp.push_back(nullptr);
  const std::string stdin_path = options.stdin_path.empty() ? "/dev/null" : options.stdin_path;
  const std::string output_path = options.output_path.empty() ? "/dev/null" : options.output_path;
  const pid_t parent = getpid();

  const pid_t pid = fork();
  if (pid < 0) return absl::InternalError(absl::StrCat("fork: ", std::strerror(errno)));
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(127);  // the parent died before prctl
    const int in = open(stdin_path.c_str(), O_RDONLY);
    const int out = open(output_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (in < 0 || out < 0 || dup2(in, STDIN_FILENO) < 0 || dup2(out, STDOUT_FILENO) < 0 ||
        dup2(out, STDERR_FILENO) < 0) {
      _exit(127);
    }
    execve(program->c_str(), argv.data(), envp.data());
    _exit(127);
  }
  return std::unique_ptr<Subprocess>(new Subprocess(pid, options.output_path));
}

Subprocess::~Subprocess() {
  if (Poll().has_value()) return;
  kill(pid_, SIGKILL);
  int status = 0;
  while (waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
  }
}

std::string Subprocess::Output() const {
  return output_path_.empty() ? std::string() : ReadFileOrEmpty(output_path_);
}

absl::Status Subprocess::Signal(int signal) {
  if (Poll().has_value()) {
    return absl::FailedPreconditionError(
        absl::StrCat("pid ", pid_, " has exited with code ", *exit_code_));
  }
  if (kill(pid_, signal) != 0) {
    return absl::InternalError(
        absl::StrCat("kill(", pid_, ", ", signal, "): ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::string>> Subprocess::WaitForLine(const std::string& regex,
                                                                 absl::Time deadline) {
  if (output_path_.empty()) {
    return absl::InvalidArgumentError("WaitForLine needs Options::output_path");
  }
  std::regex pattern;
  try {
    pattern = std::regex(regex, std::regex::ECMAScript);
  } catch (const std::regex_error& error) {
    return absl::InvalidArgumentError(absl::StrCat("bad regex \"", regex, "\": ", error.what()));
  }
  // Set by the check that ends the wait: the match, or the child's exit before one.
  std::optional<absl::StatusOr<std::vector<std::string>>> result;
  std::string output;
  auto found = [&] {
    // Checked before reading, so a line written just before exiting is still seen.
    const bool exited = Poll().has_value();
    output = Output();
    size_t start = 0;
    for (size_t end = output.find('\n'); end != std::string::npos;
         start = end + 1, end = output.find('\n', start)) {
      const std::string line = output.substr(start, end - start);
      std::smatch match;
      if (std::regex_search(line, match, pattern)) {
        std::vector<std::string> groups;
        for (const auto& group : match) groups.push_back(group.str());
        result = std::move(groups);
        return true;
      }
    }
    if (exited) {
      result = absl::FailedPreconditionError(absl::StrCat(
          "pid ", pid_, " exited with code ", *exit_code_, " before printing a line matching \"",
          regex, "\"; output:\n", Tail(output)));
    }
    return exited;
  };
  if (WaitFor(found, deadline).ok()) return *std::move(result);
  return absl::DeadlineExceededError(absl::StrCat("pid ", pid_, " printed no line matching \"",
                                                  regex, "\" in time; output:\n", Tail(output)));
}

std::optional<int> Subprocess::Poll() {
  if (exit_code_.has_value()) return exit_code_;
  int status = 0;
  const pid_t done = waitpid(pid_, &status, WNOHANG);
  if (done == pid_) exit_code_ = ExitCode(status);
  return exit_code_;
}

absl::StatusOr<int> Subprocess::Wait(absl::Duration timeout) {
  if (!WaitFor([this] { return Poll().has_value(); }, timeout).ok()) {
    return absl::DeadlineExceededError(
        absl::StrCat("pid ", pid_, " still running after ", absl::FormatDuration(timeout)));
  }
  return *exit_code_;
}

int Subprocess::Stop(absl::Duration grace) {
  if (Poll().has_value()) return *exit_code_;
  kill(pid_, SIGTERM);
  if (absl::StatusOr<int> code = Wait(grace); code.ok()) return *code;
  kill(pid_, SIGKILL);
  int status = 0;
  waitpid(pid_, &status, 0);
  exit_code_ = ExitCode(status);
  return *exit_code_;
}

absl::StatusOr<RunResult> RunProgram(const std::vector<std::string>& argv, std::string_view input,
                                     absl::Duration timeout) {
  absl::StatusOr<TempDir> dir = TempDir::Create("kvcm-run");
  if (!dir.ok()) return dir.status();
  const std::string input_path = dir->path() + "/stdin";
  const std::string output_path = dir->path() + "/output";
  {
    std::ofstream file(input_path, std::ios::binary);
    file << input;
    if (!file) return absl::InternalError(absl::StrCat("cannot write ", input_path));
  }
  absl::StatusOr<std::unique_ptr<Subprocess>> child = Subprocess::Start(
      {.argv = argv, .stdin_path = input_path, .output_path = output_path, .env = {}});
  if (!child.ok()) return child.status();
  absl::StatusOr<int> code = (*child)->Wait(timeout);
  if (!code.ok()) {
    (*child)->Stop(absl::ZeroDuration());
    return absl::DeadlineExceededError(absl::StrCat(argv[0], " killed after ",
                                                    absl::FormatDuration(timeout), ": ",
                                                    ReadFileOrEmpty(output_path)));
  }
  return RunResult{*code, ReadFileOrEmpty(output_path)};
}

absl::StatusOr<TempDir> TempDir::Create(std::string_view prefix) {
  std::error_code error;
  std::filesystem::path base = std::filesystem::temp_directory_path(error);
  if (error) base = "/tmp";
  std::string pattern = (base / absl::StrCat(std::string(prefix), ".XXXXXX")).string();
  if (mkdtemp(pattern.data()) == nullptr) {
    return absl::InternalError(absl::StrCat("mkdtemp ", pattern, ": ", std::strerror(errno)));
  }
  return TempDir(std::move(pattern));
}

TempDir::~TempDir() {
  if (path_.empty()) return;
  std::error_code ignored;
  std::filesystem::remove_all(path_, ignored);
}

std::string Tail(std::string_view text, size_t max_bytes) {
  if (text.size() <= max_bytes) return std::string(text);
  return absl::StrCat("...", std::string(text.substr(text.size() - max_bytes)));
}

std::string ReadFileOrEmpty(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  std::ostringstream contents;
  contents << file.rdbuf();
  return contents.str();
}

}  // namespace kvcm::testing
