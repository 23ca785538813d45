// Subprocess and TempDir against /bin/sh children: output capture, WaitForLine, signals,
// exit codes, environment, and the kill on destruction.

#include "tests/support/subprocess.h"

#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <memory>
#include <optional>
#include <string>

#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/status_matchers.h"

namespace kvcm::testing {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::unique_ptr<Subprocess> StartShell(const TempDir& dir, const std::string& script,
                                       std::vector<std::string> env = {}) {
  Subprocess::Options options;
  options.argv = {"/bin/sh", "-c", script};
  options.output_path = dir.path() + "/output";
  options.env = std::move(env);
  absl::StatusOr<std::unique_ptr<Subprocess>> child = Subprocess::Start(options);
  EXPECT_THAT(child, IsOk());
  return child.ok() ? std::move(*child) : nullptr;
}

TEST(SubprocessTest, WaitForLineReturnsGroupsAndExitCode) {
  absl::StatusOr<TempDir> dir = TempDir::Create("kvcm-sp");
  ASSERT_THAT(dir, IsOk());
  auto child = StartShell(*dir, "echo starting; echo 'ready epoch=42 at=x' >&2; exit 3");
  ASSERT_NE(child, nullptr);
  absl::StatusOr<std::vector<std::string>> groups =
      child->WaitForLine("ready epoch=([0-9]+) at=(\\S+)", absl::Now() + absl::Seconds(60));
  ASSERT_THAT(groups, IsOk());
  EXPECT_THAT(*groups, ElementsAre("ready epoch=42 at=x", "42", "x"));
  absl::StatusOr<int> code = child->Wait(absl::Seconds(60));
  ASSERT_THAT(code, IsOk());
  EXPECT_EQ(*code, 3);
  EXPECT_THAT(child->Output(), HasSubstr("starting\n"));
}

TEST(SubprocessTest, WaitForLineFailsWhenTheChildExitsFirst) {
  absl::StatusOr<TempDir> dir = TempDir::Create("kvcm-sp");
  ASSERT_THAT(dir, IsOk());
  auto child = StartShell(*dir, "echo nope; exit 1");
  ASSERT_NE(child, nullptr);
  absl::StatusOr<std::vector<std::string>> groups =
      child->WaitForLine("ready", absl::Now() + absl::Seconds(60));
  EXPECT_EQ(groups.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(groups.status().message(), HasSubstr("nope"));
}

TEST(SubprocessTest, WaitForLineTimesOut) {
  absl::StatusOr<TempDir> dir = TempDir::Create("kvcm-sp");
  ASSERT_THAT(dir, IsOk());
  auto child = StartShell(*dir, "echo partial-line-without-newline | tr -d '\\n'; sleep 30");
  ASSERT_NE(child, nullptr);
  // The line never ends, however long the wait: a short one cannot fail on a slow machine.
  absl::StatusOr<std::vector<std::string>> groups =
      child->WaitForLine("partial", absl::Now() + absl::Milliseconds(200));
  EXPECT_EQ(groups.status().code(), absl::StatusCode::kDeadlineExceeded);
}

TEST(SubprocessTest, SignalsStopContinueAndTerminate) {
  absl::StatusOr<TempDir> dir = TempDir::Create("kvcm-sp");
  ASSERT_THAT(dir, IsOk());
  auto child = StartShell(*dir, "echo up; exec sleep 30");
  ASSERT_NE(child, nullptr);
  ASSERT_THAT(child->WaitForLine("^up$", absl::Now() + absl::Seconds(60)), IsOk());
  ASSERT_THAT(child->Signal(SIGSTOP), IsOk());
  ASSERT_THAT(child->Signal(SIGCONT), IsOk());
  EXPECT_FALSE(child->Poll().has_value());
  ASSERT_THAT(child->Signal(SIGTERM), IsOk());
  absl::StatusOr<int> code = child->Wait(absl::Seconds(60));
  ASSERT_THAT(code, IsOk());
  EXPECT_EQ(*code, 128 + SIGTERM);
  EXPECT_EQ(child->Signal(SIGTERM).code(), absl::StatusCode::kFailedPrecondition);
}

TEST(SubprocessTest, EnvironmentIsPassed) {
  absl::StatusOr<TempDir> dir = TempDir::Create("kvcm-sp");
  ASSERT_THAT(dir, IsOk());
  auto child = StartShell(*dir, "echo \"value=$KVCM_SUBPROCESS_TEST_VAR\"",
                          {"KVCM_SUBPROCESS_TEST_VAR=hello world"});
  ASSERT_NE(child, nullptr);
  absl::StatusOr<std::vector<std::string>> groups =
      child->WaitForLine("value=(.*)$", absl::Now() + absl::Seconds(60));
  ASSERT_THAT(groups, IsOk());
  EXPECT_EQ((*groups)[1], "hello world");
}

TEST(SubprocessTest, DestructionKillsTheChild) {
  absl::StatusOr<TempDir> dir = TempDir::Create("kvcm-sp");
  ASSERT_THAT(dir, IsOk());
  pid_t pid = 0;
  {
    auto child = StartShell(*dir, "echo up; exec sleep 30");
    ASSERT_NE(child, nullptr);
    ASSERT_THAT(child->WaitForLine("^up$", absl::Now() + absl::Seconds(60)), IsOk());
    ASSERT_THAT(child->Signal(SIGSTOP), IsOk());  // even a stopped child goes
    pid = child->pid();
  }
  EXPECT_NE(kill(pid, 0), 0);  // reaped: the pid no longer exists
}

TEST(TempDirTest, CreatesPrivateDirectoryAndRemovesItWithContents) {
  std::string path;
  {
    absl::StatusOr<TempDir> dir = TempDir::Create("kvcm-td");
    ASSERT_THAT(dir, IsOk());
    path = dir->path();
    struct stat st {};
    ASSERT_EQ(stat(path.c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0700u);
    ASSERT_EQ(mkdir((path + "/sub").c_str(), 0700), 0);
    std::ofstream(path + "/sub/file") << "x";
  }
  struct stat st {};
  EXPECT_NE(stat(path.c_str(), &st), 0);
}

}  // namespace
}  // namespace kvcm::testing
