#pragma once
// ThreadPool: a fixed set of worker threads for data-parallel loops (the model's matmuls).
//
// ParallelFor splits [0, n) into contiguous chunks whose bounds depend only on n, the
// minimum chunk and the pool size, and runs them on the workers and the calling thread.
// Callers that compute each output element from its own inputs in a fixed order (as
// LlamaModel does) get bitwise identical results for any number of threads.
//
// Thread safety: ParallelFor may be called from several threads; calls are serialized.
// The destructor joins the workers; no ParallelFor may be running then.

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace kvcm {

class ThreadPool {
 public:
  // `num_threads` threads take part in each loop, the caller included, so num_threads - 1
  // workers are started. 0 means std::thread::hardware_concurrency().
  explicit ThreadPool(int32_t num_threads);
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;
  ~ThreadPool();

  int32_t num_threads() const { return num_threads_; }

  // Calls fn(begin, end) for disjoint chunks covering [0, n), each at least `min_chunk`
  // long (except a shorter n), and returns when all are done. n <= 0 does nothing.
  void ParallelFor(int64_t n, int64_t min_chunk, const std::function<void(int64_t, int64_t)>& fn);

 private:
  void WorkerLoop();
  // Runs chunks of the current job until none is left; returns how many it ran.
  int64_t RunChunks();

  int32_t num_threads_ = 1;
  std::vector<std::thread> workers_;
  std::mutex call_mu_;  // serializes ParallelFor calls

  std::mutex mu_;
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  // The current job; guarded by mu_.
  uint64_t generation_ = 0;
  bool stop_ = false;
  const std::function<void(int64_t, int64_t)>* fn_ = nullptr;
  int64_t n_ = 0;
  int64_t num_chunks_ = 0;
  int64_t next_chunk_ = 0;
  int64_t chunks_done_ = 0;
};

}  // namespace kvcm
