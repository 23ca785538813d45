#pragma once
// CpuThreadPool: persistent worker threads for the CPU kernels, cheap enough to use once per
// layer per decode step.
//
// ParallelFor hands out task indices from one atomic claim word to the calling thread and up
// to num_threads - 1 workers, and returns when every task has *finished*: it joins on the
// tasks, not on the workers. A worker the scheduler has pushed off its core (another process
// shares the cores, as the router, the cache manager and other executors do on one node)
// therefore holds up a call only while it holds a task it claimed; one that had not woken
// yet claims nothing, and the caller and the other workers run its share. Callers cut their
// work into a few chunks per thread so that a claimed chunk is short (docs/executor.md,
// "Threads").
//
// Waiting threads spin briefly (about 20 us) before they sleep on a futex
// (std::atomic::wait), so back-to-back calls, such as one per layer, do not pay a wake-up
// each, while a thread that waits longer gives its core back to whoever needs it.
//
// Thread safety: ParallelFor may be called from any thread; concurrent calls run one after
// the other. A call from inside a task of the same pool runs its tasks serially on the
// calling thread instead of deadlocking.

#include <atomic>
#include <cstdint>
#include <functional>
#include <thread>
#include <vector>

#include "absl/functional/function_ref.h"
#include "common/base/mutex.h"

namespace kvcm::kernels {

class CpuThreadPool {
 public:
  // The process-wide pool the kernels use: one worker fewer than the CPUs this process may
  // run on (UsableCpus(); the caller is the last thread), at most kMaxWorkers, started on
  // first use and never destroyed.
  static CpuThreadPool& Default();

  // Called by a worker each time it wakes for a generation, before it claims a task (tests
  // hold a worker there, as a scheduler that took its core away would).
  using WakeHook = std::function<void(int32_t worker)>;

  // Starts `num_workers` worker threads (clamped to [0, kMaxWorkers]). A waiting thread
  // spins `spin_iterations` times (about 20 us by default) before it sleeps.
  explicit CpuThreadPool(int32_t num_workers, int32_t spin_iterations = kDefaultSpinIterations,
                         WakeHook on_wake = nullptr);
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
  // About 20 us of spinning on current x86 cores (PAUSE is 40-140 cycles).
  static constexpr int32_t kDefaultSpinIterations = 1024;

 private:
  // The claim word: (generation << 40) | (tasks << 20) | next task. One call of at most
  // kMaxTasksPerJob tasks is one generation; longer calls run as several.
  static constexpr int kTaskBits = 20;
  static constexpr uint64_t kTaskMask = (uint64_t{1} << kTaskBits) - 1;
  static constexpr int64_t kMaxTasksPerJob = int64_t{kTaskMask};
  static constexpr uint32_t kGenerationMask = (uint32_t{1} << 24) - 1;

  void WorkerLoop(int32_t id);
  // Claims and runs tasks of generation `generation` until none is left.
  void RunTasks(uint32_t generation);
  // One generation: publishes it, runs tasks, waits until all num_tasks have returned.
  // REQUIRES: dispatch_mu_ held, 0 < num_tasks <= kMaxTasksPerJob.
  void RunJob(int64_t num_tasks, int32_t participants, absl::FunctionRef<void(int64_t)> fn);

  const int32_t spin_iterations_;
  const WakeHook on_wake_;

  Mutex dispatch_mu_;  // one ParallelFor at a time

  // The function of the current generation. Written by the dispatcher, holding dispatch_mu_,
  // before it publishes the generation's claim word (release); read by a thread only after
  // it claimed a task of that generation (acquire), and not rewritten before that task has
  // finished (done_). Not ABSL_GUARDED_BY(dispatch_mu_): the workers read it without it.
  const absl::FunctionRef<void(int64_t)>* job_fn_ = nullptr;

  // (generation << 8) | participating workers, 24 bits of generation: what the workers
  // wait on. Workers with id < participants join that generation.
  std::atomic<uint32_t> epoch_{0};
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> claim_{0};  // see kTaskBits
  std::atomic<int32_t> done_{0};    // tasks of the current generation that have returned

  std::vector<std::thread> workers_;
};

}  // namespace kvcm::kernels
