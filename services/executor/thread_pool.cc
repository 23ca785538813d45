#include "services/executor/thread_pool.h"

#include <algorithm>

namespace kvcm {

ThreadPool::ThreadPool(int32_t num_threads) {
  if (num_threads <= 0) {
    num_threads = static_cast<int32_t>(std::max(1u, std::thread::hardware_concurrency()));
  }
  num_threads_ = num_threads;
  workers_.reserve(static_cast<size_t>(num_threads_ - 1));
  for (int32_t i = 1; i < num_threads_; ++i) workers_.emplace_back([this] { WorkerLoop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  for (std::thread& t : workers_) t.join();
}

int64_t ThreadPool::RunChunks() {
  int64_t ran = 0;
  std::unique_lock<std::mutex> lock(mu_);
  while (fn_ != nullptr && next_chunk_ < num_chunks_) {
    const int64_t chunk = next_chunk_++;
    const auto* fn = fn_;
    const int64_t begin = chunk * n_ / num_chunks_;
    const int64_t end = (chunk + 1) * n_ / num_chunks_;
    lock.unlock();
    (*fn)(begin, end);
    ++ran;
    lock.lock();
    if (++chunks_done_ == num_chunks_) done_cv_.notify_all();
  }
  return ran;
}

void ThreadPool::WorkerLoop() {
  uint64_t seen = 0;
  while (true) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      work_cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
    }
    RunChunks();
  }
}

void ThreadPool::ParallelFor(int64_t n, int64_t min_chunk,
                             const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  min_chunk = std::max<int64_t>(1, min_chunk);
  const int64_t num_chunks =
      std::min<int64_t>((n + min_chunk - 1) / min_chunk, int64_t{num_threads_} * 4);
  if (num_chunks <= 1 || workers_.empty()) {
    fn(0, n);
    return;
  }
  std::lock_guard<std::mutex> call_lock(call_mu_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    fn_ = &fn;
    n_ = n;
    num_chunks_ = num_chunks;
    next_chunk_ = 0;
    chunks_done_ = 0;
    ++generation_;
  }
  work_cv_.notify_all();
  RunChunks();
  std::unique_lock<std::mutex> lock(mu_);
  done_cv_.wait(lock, [&] { return chunks_done_ == num_chunks_; });
  fn_ = nullptr;
}

}  // namespace kvcm
