#include "services/cache_manager/tiers/read_queue.h"

#include <liburing.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/base/check.h"

namespace kvcm::cache_manager::tiers {
namespace {

// A submission the kernel could not take for now (EAGAIN: no memory for it yet; EBUSY: the
// completion ring is full, which a queue of `depth` with 2 x depth completions never is)
// is tried again this often before the queue gives io_uring up.
constexpr int kSubmitTries = 100;

}  // namespace

std::unique_ptr<ReadQueue> ReadQueue::Create(uint32_t depth, bool use_io_uring) {
  KVCM_CHECK(depth >= 1 && depth <= 4096) << "read queue depth " << depth;
  if (!use_io_uring) {
    return std::unique_ptr<ReadQueue>(
        new ReadQueue(depth, nullptr, absl::FailedPreconditionError("io_uring not asked for")));
  }
  auto ring = std::make_unique<io_uring>();
  const int error = io_uring_queue_init(depth, ring.get(), 0);
  if (error < 0) {
    return std::unique_ptr<ReadQueue>(new ReadQueue(
        depth, nullptr,
        absl::UnavailableError(absl::StrCat("io_uring_queue_init: ", std::strerror(-error)))));
  }
  return std::unique_ptr<ReadQueue>(new ReadQueue(depth, std::move(ring), absl::OkStatus()));
}

ReadQueue::ReadQueue(uint32_t depth, std::unique_ptr<io_uring> ring, absl::Status io_uring_error)
    : depth_(depth), ring_(std::move(ring)), io_uring_error_(std::move(io_uring_error)) {
  unsubmitted_.reserve(depth);
}

ReadQueue::~ReadQueue() {
  if (ring_ == nullptr) return;
  // The kernel may still write into the buffers of reads it took: wait for each.
  while (submitted_ > 0) {
    io_uring_cqe* cqe = nullptr;
    const int error = io_uring_wait_cqe(ring_.get(), &cqe);
    if (error == -EINTR) continue;
    if (error < 0) break;
    io_uring_cqe_seen(ring_.get(), cqe);
    --submitted_;
  }
  io_uring_queue_exit(ring_.get());
}

uint32_t ReadQueue::in_flight() const {
  return static_cast<uint32_t>(unsubmitted_.size() + read_.size()) + submitted_;
}

void ReadQueue::Add(int fd, void* buffer, uint32_t bytes, uint64_t offset, uint64_t tag) {
  KVCM_CHECK(in_flight() < depth_) << "read queue of depth " << depth_ << " is full";
  unsubmitted_.push_back({fd, buffer, bytes, offset, tag});
  if (!uses_io_uring()) return;
  io_uring_sqe* sqe = io_uring_get_sqe(ring_.get());
  // The submission ring has depth entries and at most depth reads are in flight.
  KVCM_CHECK(sqe != nullptr) << "io_uring submission ring full";
  io_uring_prep_read(sqe, fd, buffer, bytes, offset);
  io_uring_sqe_set_data64(sqe, tag);
}

void ReadQueue::Submit() {
  size_t taken = 0;
  if (uses_io_uring() && !unsubmitted_.empty()) {
    for (int tries = 0; taken < unsubmitted_.size();) {
      const int n = io_uring_submit(ring_.get());
      if (n > 0) {
        taken += static_cast<size_t>(n);
        continue;
      }
      const bool again = n == -EINTR || n == -EAGAIN || n == -EBUSY;
      if (n < 0 && again && ++tries < kSubmitTries) continue;
      // Refused (or nothing taken): what the kernel did not take is never handed to it
      // again (no later io_uring_enter), so reading it here cannot race the kernel.
      broken_ = true;
      io_uring_error_ = absl::InternalError(
          absl::StrCat("io_uring_submit: ", n < 0 ? std::strerror(-n) : "took no read"));
      break;
    }
    submitted_ += static_cast<uint32_t>(taken);
  }
  for (size_t i = taken; i < unsubmitted_.size(); ++i) ReadNow(unsubmitted_[i]);
  unsubmitted_.clear();
}

void ReadQueue::ReadNow(const Pending& read) {
  auto* out = static_cast<uint8_t*>(read.buffer);
  uint32_t done = 0;
  int64_t result = 0;
  while (done < read.bytes) {
    const ssize_t n =
        ::pread(read.fd, out + done, read.bytes - done, static_cast<off_t>(read.offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      result = -errno;
      break;
    }
    if (n == 0) break;  // end of file
    done += static_cast<uint32_t>(n);
  }
  read_.push_back({read.tag, result < 0 ? result : int64_t{done}});
}

ReadQueue::Completion ReadQueue::Wait() {
  KVCM_CHECK(unsubmitted_.empty()) << "ReadQueue::Wait before Submit";
  if (!read_.empty()) {
    const Completion done = read_.front();
    read_.pop_front();
    return done;
  }
  KVCM_CHECK(submitted_ > 0) << "ReadQueue::Wait with nothing in flight";
  io_uring_cqe* cqe = nullptr;
  int error;
  while ((error = io_uring_wait_cqe(ring_.get(), &cqe)) == -EINTR) {
  }
  // Waiting fails only for a ring the kernel no longer knows: nothing read can be trusted.
  KVCM_CHECK(error == 0) << "io_uring_wait_cqe: " << std::strerror(-error);
  const Completion done{io_uring_cqe_get_data64(cqe), cqe->res};
  io_uring_cqe_seen(ring_.get(), cqe);
  --submitted_;
  return done;
}

}  // namespace kvcm::cache_manager::tiers
