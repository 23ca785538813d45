#include "common/transport/accept_guard.h"

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/support/status_matchers.h"
#include "tests/support/subprocess.h"

namespace kvcm {
namespace {

// A listening Unix socket with one connection waiting in its backlog, and every other
// descriptor under a lowered RLIMIT_NOFILE taken: the next accept fails with EMFILE.
class AtTheDescriptorLimit {
 public:
  explicit AtTheDescriptorLimit(const std::string& path) {
    listener_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un address{};
    address.sun_family = AF_UNIX;
    std::snprintf(address.sun_path, sizeof(address.sun_path), "%s", path.c_str());
    bound_ = ::bind(listener_, reinterpret_cast<const sockaddr*>(&address), sizeof(address)) == 0 &&
             ::listen(listener_, 8) == 0;
    client_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    connected_ =
        ::connect(client_, reinterpret_cast<const sockaddr*>(&address), sizeof(address)) == 0;
    ::getrlimit(RLIMIT_NOFILE, &saved_);
    rlimit low = saved_;
    low.rlim_cur = static_cast<rlim_t>(client_ + 16);
    limited_ = ::setrlimit(RLIMIT_NOFILE, &low) == 0;
    while (true) {
      const int fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
      if (fd < 0) break;
      fillers_.push_back(fd);
    }
  }
  ~AtTheDescriptorLimit() {
    for (int fd : fillers_) ::close(fd);
    ::setrlimit(RLIMIT_NOFILE, &saved_);
    ::close(client_);
    ::close(listener_);
  }
  bool ready() const { return bound_ && connected_ && limited_ && !fillers_.empty(); }
  int listener() const { return listener_; }
  int client() const { return client_; }
  // Frees one descriptor for the test's own use.
  void FreeOne() {
    ::close(fillers_.back());
    fillers_.pop_back();
  }

 private:
  int listener_ = -1;
  int client_ = -1;
  bool bound_ = false;
  bool connected_ = false;
  bool limited_ = false;
  rlimit saved_{};
  std::vector<int> fillers_;
};

TEST(AcceptGuardTest, AtTheLimitThePendingConnectionIsClosedAndTheCallerToldToMoveOn) {
  auto dir = testing::TempDir::Create("kvcm-accept");
  ASSERT_THAT(dir, IsOk());
  ASSERT_THAT(InstallAcceptGuard(), IsOk());
  const uint64_t dropped_before = ConnectionsDroppedAtDescriptorLimit();
  {
    AtTheDescriptorLimit limit(dir->path() + "/listener.sock");
    ASSERT_TRUE(limit.ready());
    // What libzmq calls: without the guard this is EMFILE, on which its IPC listener aborts.
    const int accepted = ::accept4(limit.listener(), nullptr, nullptr, SOCK_CLOEXEC);
    const int error = errno;
    EXPECT_EQ(accepted, -1);
    EXPECT_EQ(error, ECONNABORTED) << std::strerror(error);
    EXPECT_EQ(ConnectionsDroppedAtDescriptorLimit(), dropped_before + 1);

    // The waiting peer was closed, not left in the backlog for the listener to spin on.
    char byte = 0;
    const ssize_t n = ::recv(limit.client(), &byte, 1, MSG_DONTWAIT);
    EXPECT_TRUE(n == 0 || (n < 0 && errno == ECONNRESET)) << n << " " << std::strerror(errno);

    // The reserve was taken back: still no descriptor for anyone else.
    EXPECT_LT(::open("/dev/null", O_RDONLY | O_CLOEXEC), 0);
    limit.FreeOne();
  }
  // With descriptors free it is the plain system call again.
  AtTheDescriptorLimit again(dir->path() + "/again.sock");
  ASSERT_TRUE(again.ready());
  again.FreeOne();
  const int accepted = ::accept(again.listener(), nullptr, nullptr);
  EXPECT_GE(accepted, 0) << std::strerror(errno);
  if (accepted >= 0) ::close(accepted);
  EXPECT_EQ(ConnectionsDroppedAtDescriptorLimit(), dropped_before + 1);
}

TEST(AcceptGuardTest, NonBlockingListenersStillSeeEagain) {
  auto dir = testing::TempDir::Create("kvcm-accept");
  ASSERT_THAT(dir, IsOk());
  ASSERT_THAT(InstallAcceptGuard(), IsOk());
  const int listener = ::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  std::snprintf(address.sun_path, sizeof(address.sun_path), "%s/idle.sock", dir->path().c_str());
  ASSERT_EQ(::bind(listener, reinterpret_cast<const sockaddr*>(&address), sizeof(address)), 0);
  ASSERT_EQ(::listen(listener, 8), 0);
  EXPECT_EQ(::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC), -1);
  EXPECT_EQ(errno, EAGAIN);
  ::close(listener);
}

}  // namespace
}  // namespace kvcm
