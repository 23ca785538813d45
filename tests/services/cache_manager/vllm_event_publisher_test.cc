// VllmEventPublisher in process (services/cache_manager/vllm_event_publisher.h): sequence
// numbers reserved in the seq file a chunk ahead of those sent, across the chunk's end and
// across restarts, and a wrapped buffer after a restart keeping that start's first batch.
// The whole cache manager's stream, restarts and bad seq files included, is
// vllm_events_process_test's.

#include "services/cache_manager/vllm_event_publisher.h"

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/base/atomic_file.h"
#include "common/base/monotonic_clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/status_matchers.h"
#include "tests/support/subprocess.h"
#include "tests/support/vllm_event_reader.h"

namespace kvcm::cache_manager {
namespace {

constexpr uint64_t kChunk = VllmEventPublisher::kSeqReservation;

// The number a seq file holds (its one line that is not a comment), or -1.
int64_t Reserved(const std::string& path) {
  absl::StatusOr<std::string> content = ReadSmallFile(path, 4096);
  if (!content.ok()) return -1;
  for (absl::string_view line : absl::StrSplit(*content, '\n')) {
    int64_t value = 0;
    if (!line.empty() && line[0] != '#' && absl::SimpleAtoi(line, &value)) return value;
  }
  return -1;
}

std::unique_ptr<VllmEventPublisher> Start(zmq::context_t& context, const std::string& seq_file,
                                          int32_t buffer_steps, bool replay = false) {
  VllmEventPublisher::Options options;
  options.endpoint = "tcp://127.0.0.1:0";
  if (replay) options.replay_endpoint = "tcp://127.0.0.1:0";
  options.topic = "kv@test@tiny";
  options.buffer_steps = buffer_steps;
  options.seq_file = seq_file;
  auto publisher = VllmEventPublisher::Create(context, options, nullptr);
  EXPECT_THAT(publisher, IsOk());
  return publisher.ok() ? *std::move(publisher) : nullptr;
}

void PublishOne(VllmEventPublisher& publisher) {
  const std::vector<VllmEvent> events(1);  // an AllBlocksCleared
  publisher.Publish(events, 1.5);
}

// A replay from `start`, served by this thread while a reader waits on another.
std::vector<testing::ReadVllmBatch> Replay(VllmEventPublisher& publisher, uint64_t start) {
  std::atomic<bool> done{false};
  absl::StatusOr<std::vector<testing::ReadVllmBatch>> batches;
  std::thread reader([&] {
    batches = testing::ReplayVllmEvents(publisher.replay_endpoint(), start,
                                        MonotonicNow() + absl::Seconds(10));
    done = true;
  });
  const absl::Time deadline = absl::Now() + absl::Seconds(15);
  while (!done && absl::Now() < deadline) {
    zmq::pollitem_t item{publisher.replay_socket()->handle(), 0, ZMQ_POLLIN, 0};
    zmq::poll(&item, 1, std::chrono::milliseconds(10));
    publisher.ServeReplay();
  }
  reader.join();
  EXPECT_THAT(batches, IsOk());
  return batches.ok() ? *std::move(batches) : std::vector<testing::ReadVllmBatch>{};
}

TEST(VllmEventPublisherTest, ReservesTheNextChunkBeforeSendingItsFirstNumber) {
  auto dir = testing::TempDir::Create("kvcm-vllm-publisher");
  ASSERT_THAT(dir, IsOk());
  const std::string seq_file = dir->path() + "/vllm-events.seq";
  zmq::context_t context;
  {
    auto publisher = Start(context, seq_file, 4);
    ASSERT_NE(publisher, nullptr);
    EXPECT_EQ(publisher->first_seq(), 0u);
    EXPECT_EQ(Reserved(seq_file), static_cast<int64_t>(kChunk));
    for (uint64_t i = 0; i < kChunk; ++i) PublishOne(*publisher);
    EXPECT_EQ(publisher->next_seq(), kChunk);
    EXPECT_EQ(Reserved(seq_file), static_cast<int64_t>(kChunk));  // not yet needed
    PublishOne(*publisher);  // seq kChunk: the next chunk is reserved first
    EXPECT_EQ(publisher->next_seq(), kChunk + 1);
    EXPECT_EQ(Reserved(seq_file), static_cast<int64_t>(2 * kChunk));
  }
  // The next start goes on from the mark, above every number sent.
  auto again = Start(context, seq_file, 4);
  ASSERT_NE(again, nullptr);
  EXPECT_EQ(again->first_seq(), 2 * kChunk);
  EXPECT_EQ(again->next_seq(), 2 * kChunk);
  EXPECT_EQ(Reserved(seq_file), static_cast<int64_t>(3 * kChunk));
}

TEST(VllmEventPublisherTest, WithoutASeqFileEveryStartBeginsAtZero) {
  zmq::context_t context;
  for (int start = 0; start < 2; ++start) {
    auto publisher = Start(context, "", 4);
    ASSERT_NE(publisher, nullptr);
    EXPECT_EQ(publisher->first_seq(), 0u);
    PublishOne(*publisher);
    EXPECT_EQ(publisher->next_seq(), 1u);
  }
}

TEST(VllmEventPublisherTest, ASeqFileThatCannotBeWrittenStopsTheStart) {
  auto dir = testing::TempDir::Create("kvcm-vllm-publisher");
  ASSERT_THAT(dir, IsOk());
  zmq::context_t context;
  VllmEventPublisher::Options options;
  options.endpoint = "tcp://127.0.0.1:0";
  options.topic = "kv@test@tiny";
  options.seq_file = dir->path() + "/missing/vllm-events.seq";
  auto publisher = VllmEventPublisher::Create(context, options, nullptr);
  ASSERT_FALSE(publisher.ok());
  EXPECT_TRUE(absl::IsInternal(publisher.status())) << publisher.status();
  EXPECT_THAT(std::string(publisher.status().message()), ::testing::HasSubstr(options.seq_file));
}

TEST(VllmEventPublisherTest, AfterARestartAWrappedBufferKeepsThatStartsFirstBatch) {
  auto dir = testing::TempDir::Create("kvcm-vllm-publisher");
  ASSERT_THAT(dir, IsOk());
  const std::string seq_file = dir->path() + "/vllm-events.seq";
  zmq::context_t context;
  { ASSERT_NE(Start(context, seq_file, 3), nullptr); }
  auto publisher = Start(context, seq_file, 3, /*replay=*/true);
  ASSERT_NE(publisher, nullptr);
  const uint64_t first = publisher->first_seq();
  ASSERT_EQ(first, kChunk);
  for (int i = 0; i < 6; ++i) PublishOne(*publisher);
  // first..first+5 were published; the first and the last two are kept.
  const std::vector<testing::ReadVllmBatch> batches = Replay(*publisher, 0);
  ASSERT_EQ(batches.size(), 3u);
  EXPECT_EQ(batches[0].seq, first);
  EXPECT_EQ(batches[1].seq, first + 4);
  EXPECT_EQ(batches[2].seq, first + 5);
  EXPECT_EQ(publisher->buffered(), 3u);
}

}  // namespace
}  // namespace kvcm::cache_manager
