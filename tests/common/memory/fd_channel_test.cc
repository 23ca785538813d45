#include "common/memory/fd_channel.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/base/unique_fd.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/common/memory/memory_test_util.h"
#include "tests/support/status_matchers.h"
#include "tests/support/wait_for.h"

namespace kvcm {
namespace {

using ::kvcm::testing_util::TempDir;
using ::kvcm::testing_util::WaitReadable;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr auto kPeerWait = std::chrono::seconds(10);

// Same file? (A descriptor passed over SCM_RIGHTS is a new number for the same file.)
bool SameFile(int a, int b) {
  struct stat sa {};
  struct stat sb {};
  return ::fstat(a, &sa) == 0 && ::fstat(b, &sb) == 0 && sa.st_dev == sb.st_dev &&
         sa.st_ino == sb.st_ino;
}

// Receives on a thread of its own while the test serves on the main thread.
class Receiver {
 public:
  Receiver(std::string path, absl::Duration timeout)
      : thread_([this, path = std::move(path), timeout] {
          result_ = ReceiveFdFromChannel(path, timeout);
        }) {}
  absl::StatusOr<ReceivedFd> Join() {
    thread_.join();
    return std::move(result_);
  }

 private:
  absl::StatusOr<ReceivedFd> result_ = absl::UnknownError("not run");
  std::thread thread_;
};

TEST(FdChannelTest, PassesDescriptorAndHeaderToAllowedUid) {
  TempDir dir;
  absl::StatusOr<FdChannelListener> listener =
      FdChannelListener::Create(dir.File("pool.sock"), {::getuid()});
  ASSERT_THAT(listener, IsOk());
  UniqueFd file(::open(dir.path().c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  ASSERT_TRUE(file.valid());

  Receiver receiver(dir.File("pool.sock"), absl::Seconds(10));
  ASSERT_TRUE(WaitReadable(listener->listen_fd(), kPeerWait));
  const std::vector<uint8_t> header = {1, 2, 3, 250};
  const absl::StatusOr<pid_t> peer = listener->ServeOne(file.get(), header);
  ASSERT_THAT(peer, IsOk());
  EXPECT_EQ(*peer, ::getpid());  // the receiver is a thread of this process

  absl::StatusOr<ReceivedFd> received = receiver.Join();
  ASSERT_THAT(received, IsOk());
  EXPECT_THAT(received->header, ElementsAre(1, 2, 3, 250));
  ASSERT_TRUE(received->fd.valid());
  EXPECT_NE(received->fd.get(), file.get());
  EXPECT_TRUE(SameFile(received->fd.get(), file.get()));
  EXPECT_EQ(::fcntl(received->fd.get(), F_GETFD) & FD_CLOEXEC, FD_CLOEXEC);
}

TEST(FdChannelTest, EmptyAndLargestHeaders) {
  TempDir dir;
  FdChannelListener listener = *FdChannelListener::Create(dir.File("s"), {::getuid()});
  for (const size_t size : {size_t{0}, kMaxFdChannelHeaderBytes}) {
    const std::vector<uint8_t> header(size, 7);
    Receiver receiver(dir.File("s"), absl::Seconds(10));
    ASSERT_TRUE(WaitReadable(listener.listen_fd(), kPeerWait));
    ASSERT_THAT(listener.ServeOne(STDIN_FILENO, header), IsOk());
    absl::StatusOr<ReceivedFd> received = receiver.Join();
    ASSERT_THAT(received, IsOk());
    EXPECT_EQ(received->header, header);
  }
}

TEST(FdChannelTest, RefusesHeaderOverLimit) {
  TempDir dir;
  FdChannelListener listener = *FdChannelListener::Create(dir.File("s"), {::getuid()});
  const std::vector<uint8_t> header(kMaxFdChannelHeaderBytes + 1);
  EXPECT_EQ(listener.ServeOne(STDIN_FILENO, header).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(FdChannelTest, RefusesUidNotInAllowedList) {
  TempDir dir;
  FdChannelListener listener =
      *FdChannelListener::Create(dir.File("s"), {::getuid() + 1, ::getuid() + 2});
  Receiver receiver(dir.File("s"), absl::Seconds(10));
  ASSERT_TRUE(WaitReadable(listener.listen_fd(), kPeerWait));
  const absl::StatusOr<pid_t> served = listener.ServeOne(STDIN_FILENO, {});
  EXPECT_EQ(served.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(served.status().message(),
              HasSubstr("peer uid " + std::to_string(::getuid()) + " is not allowed"));

  const absl::StatusOr<ReceivedFd> received = receiver.Join();
  EXPECT_EQ(received.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(received.status().message(),
              HasSubstr("connection closed without a descriptor: the cache manager refused "
                        "this uid?"));
}

TEST(FdChannelTest, AChannelServedByAnotherUserIsRefusedByTheClient) {
  // Root is trusted by every client, so both ends run as other users: the server as
  // nobody (65534), the client as uid 1000.
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to run both ends as other users";
  TempDir dir;
  ASSERT_EQ(::chmod(dir.path().c_str(), 0777), 0);
  const std::string path = dir.File("s");
  // The server: uid 65534 (nobody), serving one descriptor to anyone.
  const pid_t server = ::fork();
  ASSERT_GE(server, 0);
  if (server == 0) {
    if (::setgid(65534) != 0 || ::setuid(65534) != 0) ::_exit(3);
    auto listener = FdChannelListener::Create(path, {0, 65534, 1000});
    if (!listener.ok()) ::_exit(4);
    // Connectable by anyone: what is tested is the client's check of who serves.
    if (::chmod(path.c_str(), 0777) != 0) ::_exit(5);
    // Until the client connects (the test kills this process at its end).
    (void)kvcm::testing::WaitFor(
        [&] { return WaitReadable(listener->listen_fd(), std::chrono::milliseconds(20)); },
        absl::Seconds(120));
    (void)listener->ServeOne(STDIN_FILENO, {});
    ::_exit(0);
  }
  // The client: uid 1000, neither root nor the server's user.
  const pid_t client = ::fork();
  ASSERT_GE(client, 0);
  if (client == 0) {
    if (::setgid(1000) != 0 || ::setuid(1000) != 0) ::_exit(3);
    // Until the server has opened its socket to everyone.
    (void)kvcm::testing::WaitFor(
        [&] {
          struct stat st {};
          return ::stat(path.c_str(), &st) == 0 && (st.st_mode & 0777) == 0777;
        },
        absl::Seconds(60));
    const absl::StatusOr<ReceivedFd> received = ReceiveFdFromChannel(path, absl::Seconds(60));
    ::_exit(absl::IsPermissionDenied(received.status()) ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(client, &status, 0), client);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "the client took a descriptor from another user";
  ::kill(server, SIGKILL);
  ::waitpid(server, &status, 0);
}

TEST(FdChannelTest, ServeOneWithoutPendingConnectionIsUnavailable) {
  TempDir dir;
  FdChannelListener listener = *FdChannelListener::Create(dir.File("s"), {::getuid()});
  const absl::StatusOr<pid_t> served = listener.ServeOne(STDIN_FILENO, {});
  EXPECT_EQ(served.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(served.status().message(), HasSubstr("no pending connection"));
}

TEST(FdChannelTest, ReceiveTimesOutWhenNobodyServes) {
  TempDir dir;
  FdChannelListener listener = *FdChannelListener::Create(dir.File("s"), {::getuid()});
  const auto start = std::chrono::steady_clock::now();
  const absl::StatusOr<ReceivedFd> received =
      ReceiveFdFromChannel(dir.File("s"), absl::Milliseconds(200));
  EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(200));
  EXPECT_EQ(received.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(received.status().message(), HasSubstr("no descriptor from"));
}

TEST(FdChannelTest, ReceiveWithoutListenerIsUnavailable) {
  TempDir dir;
  const absl::StatusOr<ReceivedFd> received =
      ReceiveFdFromChannel(dir.File("nobody.sock"), absl::Seconds(1));
  EXPECT_EQ(received.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(received.status().message(), HasSubstr("is the cache manager running?"));
}

TEST(FdChannelTest, SocketFileIsPrivateAndRemovedWithTheListener) {
  TempDir dir;
  const std::string path = dir.File("s");
  {
    FdChannelListener listener = *FdChannelListener::Create(path, {::getuid()});
    struct stat st {};
    ASSERT_EQ(::lstat(path.c_str(), &st), 0);
    EXPECT_TRUE(S_ISSOCK(st.st_mode));
    EXPECT_EQ(st.st_mode & 0777, 0600u);
    EXPECT_EQ(::fcntl(listener.listen_fd(), F_GETFL) & O_NONBLOCK, O_NONBLOCK);

    // A moved-from listener leaves the file to the new owner.
    FdChannelListener moved = std::move(listener);
    ASSERT_EQ(::access(path.c_str(), F_OK), 0);
    EXPECT_EQ(moved.socket_path(), path);
  }
  EXPECT_NE(::access(path.c_str(), F_OK), 0);
}

TEST(FdChannelTest, ReplacesStaleSocketFile) {
  TempDir dir;
  const std::string path = dir.File("s");
  {
    // A socket file left by a listener that died without cleaning up.
    UniqueFd dead(::socket(AF_UNIX, SOCK_STREAM, 0));
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
    ASSERT_EQ(::bind(dead.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)), 0);
  }
  ASSERT_EQ(::access(path.c_str(), F_OK), 0);
  absl::StatusOr<FdChannelListener> listener = FdChannelListener::Create(path, {::getuid()});
  ASSERT_THAT(listener, IsOk());

  Receiver receiver(path, absl::Seconds(10));
  ASSERT_TRUE(WaitReadable(listener->listen_fd(), kPeerWait));
  EXPECT_THAT(listener->ServeOne(STDIN_FILENO, {}), IsOk());
  EXPECT_THAT(receiver.Join(), IsOk());
}

TEST(FdChannelTest, RefusesPathOfLiveListener) {
  TempDir dir;
  FdChannelListener first = *FdChannelListener::Create(dir.File("s"), {::getuid()});
  const absl::StatusOr<FdChannelListener> second =
      FdChannelListener::Create(dir.File("s"), {::getuid()});
  EXPECT_EQ(second.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(::access(dir.File("s").c_str(), F_OK), 0);  // still the first one's
}

TEST(FdChannelTest, DoesNotRemoveOtherFiles) {
  TempDir dir;
  const std::string path = dir.File("not-a-socket");
  std::ofstream(path) << "keep me";
  const absl::StatusOr<FdChannelListener> listener = FdChannelListener::Create(path, {::getuid()});
  EXPECT_EQ(listener.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(::access(path.c_str(), F_OK), 0);
}

TEST(FdChannelTest, RejectsBadArguments) {
  TempDir dir;
  EXPECT_EQ(FdChannelListener::Create(dir.File("s"), {}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(FdChannelListener::Create("", {::getuid()}).status().code(),
            absl::StatusCode::kInvalidArgument);
  const std::string long_path = dir.File(std::string(200, 'x'));
  EXPECT_EQ(FdChannelListener::Create(long_path, {::getuid()}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ReceiveFdFromChannel(long_path, absl::Seconds(1)).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvcm
