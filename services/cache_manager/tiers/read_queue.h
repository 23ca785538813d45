#pragma once
// ReadQueue: reads kept in flight at once by one thread, through io_uring (liburing), so
// that a mover verifies and copies one disk-tier block while the disk reads the next ones
// (docs/architecture.md, "Tiers"; docs/PERFORMANCE.md, "Tier bandwidth"). With O_DIRECT the
// device moves the bytes while the thread works; with buffered I/O the kernel's own workers
// do. One thread owns a ReadQueue; it is not thread-safe.
//
//   std::unique_ptr<ReadQueue> queue = ReadQueue::Create(4);
//   queue->Add(fd, buffer, bytes, offset, /*tag=*/7);
//   queue->Submit();
//   ReadQueue::Completion done = queue->Wait();   // {7, bytes read or -errno}

#include <cstdint>
#include <deque>
#include <memory>
#include <vector>

#include "absl/status/status.h"

struct io_uring;

namespace kvcm::cache_manager::tiers {

class ReadQueue {
 public:
  // A queue of `depth` reads at most (1 to 4096), through io_uring when `use_io_uring` and
  // the kernel allows it. Where it does not (an old kernel, a seccomp filter that refuses
  // io_uring, the locked-memory limit), or without `use_io_uring`, every read is a pread at
  // Submit: the same results, one at a time; io_uring_error() says why.
  static std::unique_ptr<ReadQueue> Create(uint32_t depth, bool use_io_uring = true);
  ~ReadQueue();  // waits for the reads still in flight: their buffers may be freed after
  ReadQueue(const ReadQueue&) = delete;
  ReadQueue& operator=(const ReadQueue&) = delete;

  uint32_t depth() const { return depth_; }
  // True while reads go through io_uring (false from the start without it, or after the
  // kernel refused a submission).
  bool uses_io_uring() const { return ring_ != nullptr && !broken_; }
  // Why io_uring is not used (OK while it is).
  const absl::Status& io_uring_error() const { return io_uring_error_; }
  // Reads added and not yet returned by Wait.
  uint32_t in_flight() const;

  // Queues a read of `bytes` at `offset` of `fd` into `buffer`; `tag` comes back with its
  // completion. Nothing is read until Submit. REQUIRES: in_flight() < depth(); `buffer`
  // stays valid until the read's completion is returned (aligned as the fd's O_DIRECT asks).
  void Add(int fd, void* buffer, uint32_t bytes, uint64_t offset, uint64_t tag);
  // Hands the reads added since the last call to the kernel (without io_uring: reads them).
  // When the kernel refuses a submission the queue stops using io_uring: the reads it did
  // not take, and every later one, are read with pread; io_uring_error() says why.
  void Submit();

  struct Completion {
    uint64_t tag = 0;
    int64_t result = 0;  // bytes read (fewer than asked only at end of file), or -errno
  };
  // Waits for one submitted read to finish and returns it, in any order.
  // REQUIRES: in_flight() > 0 and Submit called since the last Add.
  Completion Wait();

 private:
  ReadQueue(uint32_t depth, std::unique_ptr<io_uring> ring, absl::Status io_uring_error);
  struct Pending {
    int fd;
    void* buffer;
    uint32_t bytes;
    uint64_t offset;
    uint64_t tag;
  };
  void ReadNow(const Pending& read);

  const uint32_t depth_;
  std::unique_ptr<io_uring> ring_;  // null without io_uring
  absl::Status io_uring_error_;
  bool broken_ = false;               // the kernel refused a submission
  std::vector<Pending> unsubmitted_;  // added since the last Submit, in order
  uint32_t submitted_ = 0;            // in the kernel's hands, not yet waited for
  std::deque<Completion> read_;       // read with pread, returned first by Wait
};

}  // namespace kvcm::cache_manager::tiers
