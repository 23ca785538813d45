#pragma once
// CpuThreadPool: persistent worker threads for the CPU kernels, cheap enough to use once per
// layer per decode step.
//
// ParallelFor hands out task indices from one atomic counter to the calling thread and up to
// num_threads - 1 workers, and returns when every task has run. Workers that just finished
// spin briefly (about 100 us) before sleeping on a futex (std::atomic::wait), so back-to-back
// calls, such as one per layer, do not pay a wake-up each (a futex wake-up costs tens of
// microseconds on a shared VM); after that they cost nothing.
//
// Thread safety: ParallelFor may be called from any thread; concurrent calls run one after
// the other. A call from inside a task of the same pool runs its tasks serially on the
// calling thread instead of deadlocking.

#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

#include "absl/functional/function_ref.h"
#include "common/base/mutex.h"

namespace kvcm::kernels {

class CpuThreadPool {
 public:
  // The process-wide pool the kernels use: hardware_concurrency() - 1 workers (the caller
  // is the last thread), at most kMaxWorkers, started on first use and never destroyed.
  static CpuThreadPool& Default();

  // Starts `num_workers` worker threads (clamped to [0, kMaxWorkers]). A waiting thread
  // spins `spin_iterations` times (about 100 us by default) before it sleeps.
  explicit CpuThreadPool(int32_t num_workers, int32_t spin_iterations = kDefaultSpinIterations);
  // Stops and joins the workers. REQUIRES: no ParallelFor in progress.
  ~CpuThreadPool();
  CpuThreadPool(const CpuThreadPool&) = delete;
  CpuThreadPool& operator=(const CpuThreadPool&) = delete;

  // Workers plus the calling thread.
  int32_t max_threads() const { return static_cast<int32_t>(workers_.size()) + 1; }

  // Runs fn(task) for every task in [0, num_tasks), each exactly once, on the calling thread
  // and up to num_threads - 1 workers (num_threads <= 0: all of them). Returns after the
  // last task has returned. fn must not throw.
  void ParallelFor(int64_t num_tasks, int32_t num_threads, absl::FunctionRef<void(int64_t)> fn);

  static constexpr int32_t kMaxWorkers = 255;
  // About 100 us of spinning on current x86 cores (PAUSE is 40-140 cycles).
  static constexpr int32_t kDefaultSpinIterations = 4096;

 private:
  void WorkerLoop(int32_t id);
  void RunTasks();

  const int32_t spin_iterations_;

  Mutex dispatch_mu_;  // one ParallelFor at a time

  // The job of the current epoch. Written by the dispatcher, holding dispatch_mu_, before it
  // publishes the epoch (release) and read by participating workers after they see it
  // (acquire); not rewritten until every participant has checked out through busy_. Not
  // ABSL_GUARDED_BY(dispatch_mu_): the workers read them without it, ordered by the epoch.
  const absl::FunctionRef<void(int64_t)>* job_fn_ = nullptr;
  int64_t job_tasks_ = 0;

  // (generation << 8) | participating workers. Workers with id < participants run the job.
  std::atomic<uint32_t> epoch_{0};
  std::atomic<bool> stop_{false};
  std::atomic<int64_t> next_task_{0};
  std::atomic<int32_t> busy_{0};  // participants that have not yet checked out

  std::vector<std::thread> workers_;
};

}  // namespace kvcm::kernels
