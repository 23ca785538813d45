// ReadQueue on a real file: reads kept in flight together come back each with its tag and
// its bytes, in any order; a read at or past the end of the file comes back short; a read
// of a closed descriptor comes back with its errno. Through io_uring and through the pread
// it falls back to, alike.

#include "services/cache_manager/tiers/read_queue.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <iostream>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/status_matchers.h"
#include "tests/support/subprocess.h"

namespace kvcm::cache_manager::tiers {
namespace {

using ::kvcm::testing::TempDir;

constexpr uint64_t kSeed = 20261207;
constexpr uint32_t kChunk = 4096;
constexpr uint32_t kChunks = 32;

class ReadQueueTest : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    std::cout << "random data seed " << kSeed << "\n";
    absl::StatusOr<TempDir> dir = TempDir::Create("kvcm-read-queue");
    ASSERT_THAT(dir, IsOk());
    dir_.emplace(*std::move(dir));
    path_ = dir_->path() + "/data";
    data_.resize(size_t{kChunk} * kChunks);
    std::mt19937_64 rng(kSeed);
    for (uint8_t& byte : data_) byte = static_cast<uint8_t>(rng());
    const int fd = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    ASSERT_GE(fd, 0) << std::strerror(errno);
    ASSERT_EQ(::write(fd, data_.data(), data_.size()), static_cast<ssize_t>(data_.size()));
    ::close(fd);
    fd_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
    ASSERT_GE(fd_, 0) << std::strerror(errno);
  }
  void TearDown() override {
    if (fd_ >= 0) ::close(fd_);
  }
  std::unique_ptr<ReadQueue> Make(uint32_t depth) {
    std::unique_ptr<ReadQueue> queue = ReadQueue::Create(depth, /*use_io_uring=*/GetParam());
    std::cout << "io_uring " << (queue->uses_io_uring() ? "used" : "not used") << ": "
              << queue->io_uring_error() << "\n";
    return queue;
  }

  std::optional<TempDir> dir_;
  std::string path_;
  std::vector<uint8_t> data_;
  int fd_ = -1;
};

TEST_P(ReadQueueTest, ReadsInFlightTogetherComeBackEachWithItsBytes) {
  constexpr uint32_t kDepth = 4;
  std::unique_ptr<ReadQueue> queue = Make(kDepth);
  EXPECT_EQ(queue->uses_io_uring(), GetParam() && queue->io_uring_error().ok());
  // Every chunk once, in a shuffled order, at most kDepth at a time.
  std::vector<uint32_t> order(kChunks);
  for (uint32_t i = 0; i < kChunks; ++i) order[i] = i;
  std::shuffle(order.begin(), order.end(), std::mt19937_64(kSeed));
  std::vector<std::vector<uint8_t>> buffers(kDepth, std::vector<uint8_t>(kChunk));
  std::vector<uint32_t> chunk_of(kDepth);
  std::vector<uint32_t> free = {0, 1, 2, 3};
  std::vector<int> seen(kChunks, 0);
  size_t next = 0;
  while (next < order.size() || queue->in_flight() > 0) {
    while (next < order.size() && !free.empty()) {
      const uint32_t b = free.back();
      free.pop_back();
      chunk_of[b] = order[next++];
      std::fill(buffers[b].begin(), buffers[b].end(), 0);
      queue->Add(fd_, buffers[b].data(), kChunk, uint64_t{chunk_of[b]} * kChunk, b);
    }
    EXPECT_LE(queue->in_flight(), kDepth);
    queue->Submit();
    const ReadQueue::Completion done = queue->Wait();
    ASSERT_LT(done.tag, kDepth);
    ASSERT_EQ(done.result, int64_t{kChunk}) << "chunk " << chunk_of[done.tag];
    const uint32_t chunk = chunk_of[done.tag];
    EXPECT_TRUE(std::equal(buffers[done.tag].begin(), buffers[done.tag].end(),
                           data_.begin() + int64_t{chunk} * kChunk))
        << "chunk " << chunk;
    ++seen[chunk];
    free.push_back(static_cast<uint32_t>(done.tag));
  }
  EXPECT_THAT(seen, ::testing::Each(1));
  EXPECT_EQ(queue->in_flight(), 0u);
}

TEST_P(ReadQueueTest, ReadsAtTheEndOfTheFileComeBackShortAndABadDescriptorWithItsErrno) {
  std::unique_ptr<ReadQueue> queue = Make(3);
  std::vector<uint8_t> a(2 * kChunk), b(kChunk), c(kChunk);
  const uint64_t size = data_.size();
  queue->Add(fd_, a.data(), 2 * kChunk, size - kChunk, 1);  // half past the end
  queue->Add(fd_, b.data(), kChunk, size + kChunk, 2);      // wholly past it
  const int closed = ::dup(fd_);
  ASSERT_GE(closed, 0);
  ::close(closed);
  queue->Add(closed, c.data(), kChunk, 0, 3);
  queue->Submit();
  std::vector<int64_t> result(4, 99);
  for (int i = 0; i < 3; ++i) {
    const ReadQueue::Completion done = queue->Wait();
    ASSERT_GE(done.tag, 1u);
    ASSERT_LE(done.tag, 3u);
    result[done.tag] = done.result;
  }
  EXPECT_EQ(result[1], int64_t{kChunk});
  EXPECT_TRUE(std::equal(a.begin(), a.begin() + kChunk, data_.end() - kChunk));
  EXPECT_EQ(result[2], 0);
  EXPECT_EQ(result[3], -EBADF);
}

INSTANTIATE_TEST_SUITE_P(IoUringAndPread, ReadQueueTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& param) {
                           return param.param ? "IoUring" : "Pread";
                         });

// Where the kernel allows io_uring (every machine of the project's CI does), the queue uses
// it; elsewhere this says why and skips.
TEST(ReadQueueIoUringTest, IsUsedWhereTheKernelAllowsIt) {
  std::unique_ptr<ReadQueue> queue = ReadQueue::Create(8);
  if (!queue->uses_io_uring()) {
    GTEST_SKIP() << "io_uring unavailable here: " << queue->io_uring_error();
  }
  EXPECT_THAT(queue->io_uring_error(), IsOk());
  EXPECT_EQ(queue->depth(), 8u);
}

}  // namespace
}  // namespace kvcm::cache_manager::tiers
