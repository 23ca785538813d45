// The shm backend of pool_memory.h, alone and across processes through the fd channel.

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/base/unique_fd.h"
#include "common/memory/fd_channel.h"
#include "common/memory/pool_memory.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/common/memory/memory_test_util.h"
#include "tests/support/status_matchers.h"

namespace kvcm {
namespace {

using ::kvcm::testing_util::NewSeed;
using ::kvcm::testing_util::Pattern;
using ::kvcm::testing_util::TempDir;
using ::kvcm::testing_util::WaitReadable;
using ::testing::HasSubstr;
using ::testing::StartsWith;

constexpr uint64_t kMiB = uint64_t{1} << 20;

std::string FdTarget(int fd) {
  char target[256] = {};
  const std::string link = "/proc/self/fd/" + std::to_string(fd);
  const ssize_t n = ::readlink(link.c_str(), target, sizeof(target) - 1);
  return n > 0 ? std::string(target, static_cast<size_t>(n)) : std::string();
}

std::vector<uint8_t> ReadAll(const PoolMemory& pool) {
  std::vector<uint8_t> out(pool.size_bytes());
  EXPECT_THAT(CopyFromPool(pool, 0, out.data(), out.size()), IsOk());
  return out;
}

TEST(ShmPoolMemoryTest, CreatesZeroedSealedMemfd) {
  absl::StatusOr<std::unique_ptr<PoolMemory>> pool = CreateShmPoolMemory(kMiB, "test");
  ASSERT_THAT(pool, IsOk());
  PoolMemory& memory = **pool;
  EXPECT_EQ(memory.backend(), PoolBackend::kShm);
  EXPECT_EQ(memory.size_bytes(), kMiB);
  EXPECT_NE(memory.base(), nullptr);
  EXPECT_EQ(memory.cuda_ipc_handle(), std::nullopt);
  EXPECT_EQ(memory.cuda_device(), -1);
  ASSERT_GE(memory.shareable_fd(), 0);
  EXPECT_EQ(::fcntl(memory.shareable_fd(), F_GETFD) & FD_CLOEXEC, FD_CLOEXEC);
  EXPECT_EQ(::fcntl(memory.shareable_fd(), F_GET_SEALS), F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
  // An anonymous memfd, not a file in /dev/shm: nothing is left behind after a crash.
  EXPECT_THAT(FdTarget(memory.shareable_fd()), StartsWith("/memfd:kvcm:test"));
  EXPECT_EQ(ReadAll(memory), std::vector<uint8_t>(kMiB, 0));
}

TEST(ShmPoolMemoryTest, ResizeIsRefused) {
  std::unique_ptr<PoolMemory> pool = *CreateShmPoolMemory(kMiB, "resize");
  const int fd = pool->shareable_fd();
  EXPECT_NE(::ftruncate(fd, 2 * kMiB), 0);
  EXPECT_EQ(errno, EPERM);
  EXPECT_NE(::ftruncate(fd, kMiB / 2), 0);
  EXPECT_EQ(errno, EPERM);
  EXPECT_NE(::fallocate(fd, 0, 0, 2 * kMiB), 0);  // growing through fallocate
  // F_SEAL_SEAL: nobody can add or change seals (a write seal would break the mapping).
  EXPECT_NE(::fcntl(fd, F_ADD_SEALS, F_SEAL_WRITE), 0);
  struct stat st {};
  ASSERT_EQ(::fstat(fd, &st), 0);
  EXPECT_EQ(static_cast<uint64_t>(st.st_size), kMiB);
}

TEST(ShmPoolMemoryTest, RejectsZeroBytes) {
  EXPECT_EQ(CreateShmPoolMemory(0, "zero").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ShmPoolMemoryTest, MoreThanAvailableIsResourceExhausted) {
  const absl::StatusOr<uint64_t> available = AvailableHostMemoryBytes();
  ASSERT_THAT(available, IsOk());
  const uint64_t bytes = *available + 64 * kMiB;
  const absl::StatusOr<std::unique_ptr<PoolMemory>> pool = CreateShmPoolMemory(bytes, "huge");
  EXPECT_EQ(pool.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(pool.status().message(), HasSubstr(std::to_string(bytes) + " bytes"));
}

TEST(ShmPoolMemoryTest, MappingSharesTheOwnersPages) {
  std::unique_ptr<PoolMemory> pool = *CreateShmPoolMemory(kMiB, "share");
  absl::StatusOr<std::unique_ptr<PoolMapping>> mapping =
      MapShmPool(UniqueFd(::fcntl(pool->shareable_fd(), F_DUPFD_CLOEXEC, 0)), kMiB);
  ASSERT_THAT(mapping, IsOk());
  EXPECT_EQ((*mapping)->backend(), PoolBackend::kShm);
  EXPECT_EQ((*mapping)->size_bytes(), kMiB);
  EXPECT_NE((*mapping)->base(), pool->base());

  const std::vector<uint8_t> pattern = Pattern(NewSeed("MappingSharesTheOwnersPages"), 4096);
  ASSERT_THAT(CopyToPool(*pool, kMiB - 4096, pattern.data(), pattern.size()), IsOk());
  std::vector<uint8_t> seen(4096);
  ASSERT_THAT(CopyFromPool(**mapping, kMiB - 4096, seen.data(), seen.size()), IsOk());
  EXPECT_EQ(seen, pattern);

  // The pages outlive the owner while a mapping holds them.
  pool.reset();
  ASSERT_THAT(CopyFromPool(**mapping, kMiB - 4096, seen.data(), seen.size()), IsOk());
  EXPECT_EQ(seen, pattern);
}

TEST(ShmPoolMemoryTest, MapRefusesSizeMismatch) {
  std::unique_ptr<PoolMemory> pool = *CreateShmPoolMemory(kMiB, "mismatch");
  for (const uint64_t expected : {kMiB / 2, 2 * kMiB}) {
    const absl::StatusOr<std::unique_ptr<PoolMapping>> mapping =
        MapShmPool(UniqueFd(::fcntl(pool->shareable_fd(), F_DUPFD_CLOEXEC, 0)), expected);
    EXPECT_EQ(mapping.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(mapping.status().message(), HasSubstr("pool descriptor says"));
  }
}

TEST(ShmPoolMemoryTest, MapRefusesUnsealedMemfd) {
  UniqueFd fd(::memfd_create("unsealed", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  ASSERT_TRUE(fd.valid());
  ASSERT_EQ(::ftruncate(fd.get(), kMiB), 0);
  const absl::StatusOr<std::unique_ptr<PoolMapping>> mapping = MapShmPool(std::move(fd), kMiB);
  EXPECT_EQ(mapping.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(mapping.status().message(), HasSubstr("not sealed against resizing"));
}

TEST(ShmPoolMemoryTest, MapRefusesGrowSealOnly) {
  UniqueFd fd(::memfd_create("half-sealed", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  ASSERT_TRUE(fd.valid());
  ASSERT_EQ(::ftruncate(fd.get(), kMiB), 0);
  ASSERT_EQ(::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_GROW), 0);
  EXPECT_EQ(MapShmPool(std::move(fd), kMiB).status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(ShmPoolMemoryTest, MapRefusesOrdinaryFile) {
  TempDir dir;
  const std::string path = dir.File("plain");
  std::ofstream(path) << std::string(4096, 'x');
  UniqueFd fd(::open(path.c_str(), O_RDWR | O_CLOEXEC));
  ASSERT_TRUE(fd.valid());
  const absl::StatusOr<std::unique_ptr<PoolMapping>> mapping = MapShmPool(std::move(fd), 4096);
  EXPECT_EQ(mapping.status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(ShmPoolMemoryTest, MapRejectsMissingDescriptor) {
  EXPECT_EQ(MapShmPool(UniqueFd(), kMiB).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ShmPoolMemoryTest, CopiesAreBoundsChecked) {
  std::unique_ptr<PoolMemory> pool = *CreateShmPoolMemory(kMiB, "bounds");
  uint8_t byte = 1;
  EXPECT_THAT(CopyToPool(*pool, kMiB - 1, &byte, 1), IsOk());
  EXPECT_THAT(CopyToPool(*pool, kMiB, &byte, 0), IsOk());
  EXPECT_EQ(CopyToPool(*pool, kMiB, &byte, 1).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(CopyFromPool(*pool, kMiB + 1, &byte, 0).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(CopyFromPool(*pool, 1, &byte, UINT64_MAX).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(CopyFromPool(*pool, UINT64_MAX, &byte, 2).code(), absl::StatusCode::kOutOfRange);
}

// ---- across processes ----------------------------------------------------------------------

// The child's side: receive the memfd, map it, check the parent's pattern, write its own.
// Returns the exit status: 0 when all went well, else the step that failed: 10 receive,
// 11 header, 12 map, 13 read, 14 parent's pattern, 15 write.
int RunAttachingChild(const std::string& socket_path, uint64_t parent_seed, uint64_t child_seed) {
  absl::StatusOr<ReceivedFd> received = ReceiveFdFromChannel(socket_path, absl::Seconds(10));
  if (!received.ok()) {
    std::fprintf(stderr, "child: %s\n", received.status().ToString().c_str());
    return 10;
  }
  uint64_t bytes = 0;
  if (received->header.size() != sizeof(bytes)) return 11;
  std::memcpy(&bytes, received->header.data(), sizeof(bytes));
  absl::StatusOr<std::unique_ptr<PoolMapping>> mapping = MapShmPool(std::move(received->fd), bytes);
  if (!mapping.ok()) {
    std::fprintf(stderr, "child: %s\n", mapping.status().ToString().c_str());
    return 12;
  }
  std::vector<uint8_t> seen(bytes);
  if (!CopyFromPool(**mapping, 0, seen.data(), bytes).ok()) return 13;
  if (seen != Pattern(parent_seed, bytes)) {
    std::fprintf(stderr, "child: the parent's pattern (seed %llu) is not in the pool\n",
                 static_cast<unsigned long long>(parent_seed));
    return 14;
  }
  const std::vector<uint8_t> mine = Pattern(child_seed, bytes);
  if (!CopyToPool(**mapping, 0, mine.data(), bytes).ok()) return 15;
  return 0;
}

// Kills and reaps a child that the test did not wait for (a failed ASSERT).
class ChildGuard {
 public:
  explicit ChildGuard(pid_t pid) : pid_(pid) {}
  ChildGuard(const ChildGuard&) = delete;
  ChildGuard& operator=(const ChildGuard&) = delete;
  ~ChildGuard() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }
  // The child's wait status.
  int Wait() {
    int status = 0;
    ::waitpid(std::exchange(pid_, -1), &status, 0);
    return status;
  }

 private:
  pid_t pid_;
};

TEST(ShmPoolMemoryCrossProcessTest, ParentAndForkedChildSeeEachOthersWrites) {
  TempDir dir;
  const std::string socket_path = dir.File("pool.sock");
  constexpr uint64_t kBytes = 3 * kMiB + 5;
  std::unique_ptr<PoolMemory> pool = *CreateShmPoolMemory(kBytes, "cross-process");
  const uint64_t parent_seed = NewSeed("parent");
  const uint64_t child_seed = NewSeed("child");
  const std::vector<uint8_t> parent_pattern = Pattern(parent_seed, kBytes);
  ASSERT_THAT(CopyToPool(*pool, 0, parent_pattern.data(), kBytes), IsOk());

  absl::StatusOr<FdChannelListener> listener = FdChannelListener::Create(socket_path, {::getuid()});
  ASSERT_THAT(listener, IsOk());

  std::fflush(nullptr);
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0) << std::strerror(errno);
  if (pid == 0) {
    // The child only receives: it must not run the listener's destructor (which would
    // remove the parent's socket file) nor gtest's exit handlers.
    ::_exit(RunAttachingChild(socket_path, parent_seed, child_seed));
  }
  ChildGuard child(pid);

  ASSERT_TRUE(WaitReadable(listener->listen_fd(), std::chrono::seconds(10)))
      << "the child never connected";
  const uint64_t bytes = kBytes;
  std::vector<uint8_t> header(sizeof(bytes));
  std::memcpy(header.data(), &bytes, sizeof(bytes));
  const absl::StatusOr<pid_t> peer = listener->ServeOne(pool->shareable_fd(), header);
  ASSERT_THAT(peer, IsOk());
  EXPECT_EQ(*peer, pid);

  const int status = child.Wait();
  ASSERT_TRUE(WIFEXITED(status)) << "child wait status " << status;
  ASSERT_EQ(WEXITSTATUS(status), 0) << "the child failed at step " << WEXITSTATUS(status);
  EXPECT_TRUE(ReadAll(*pool) == Pattern(child_seed, kBytes))
      << "the child's pattern (seed " << child_seed << ") is not in the parent's mapping";
}

}  // namespace
}  // namespace kvcm
