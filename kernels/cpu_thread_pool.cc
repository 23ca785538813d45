#include "kernels/cpu_thread_pool.h"

#include <algorithm>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace kvcm::kernels {
namespace {

thread_local const CpuThreadPool* tls_running_pool = nullptr;

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#else
  std::atomic_signal_fence(std::memory_order_seq_cst);
#endif
}

// Waits until `value` no longer holds `old`; returns the new value.
template <typename T>
T WaitForChange(const std::atomic<T>& value, T old, int32_t spins) {
  for (int i = 0; i < spins; ++i) {
    const T now = value.load(std::memory_order_acquire);
    if (now != old) return now;
    CpuRelax();
  }
  for (;;) {
    value.wait(old, std::memory_order_acquire);
    const T now = value.load(std::memory_order_acquire);
    if (now != old) return now;
  }
}

}  // namespace

CpuThreadPool& CpuThreadPool::Default() {
  static CpuThreadPool* pool = [] {
    const int32_t hw = static_cast<int32_t>(std::thread::hardware_concurrency());
    return new CpuThreadPool(std::max(hw, 1) - 1);
  }();
  return *pool;
}

CpuThreadPool::CpuThreadPool(int32_t num_workers, int32_t spin_iterations)
    : spin_iterations_(std::max(spin_iterations, 0)) {
  num_workers = std::clamp(num_workers, 0, kMaxWorkers);
  workers_.reserve(static_cast<size_t>(num_workers));
  for (int32_t id = 0; id < num_workers; ++id) {
    workers_.emplace_back([this, id] { WorkerLoop(id); });
  }
}

CpuThreadPool::~CpuThreadPool() {
  stop_.store(true, std::memory_order_release);
  // A new generation with no participants wakes every worker, which then sees stop_.
  epoch_.fetch_add(1u << 8, std::memory_order_seq_cst);
  epoch_.notify_all();
  for (std::thread& worker : workers_) worker.join();
}

void CpuThreadPool::RunTasks() {
  const CpuThreadPool* const outer = tls_running_pool;
  tls_running_pool = this;
  for (;;) {
    const int64_t task = next_task_.fetch_add(1, std::memory_order_relaxed);
    if (task >= job_tasks_) break;
    (*job_fn_)(task);
  }
  tls_running_pool = outer;
}

void CpuThreadPool::WorkerLoop(int32_t id) {
  // The epoch at construction, not the current one: a worker that starts late must still
  // see the generations published before it ran (it may be counted in busy_ for one).
  uint32_t seen = 0;
  for (;;) {
    seen = WaitForChange(epoch_, seen, spin_iterations_);
    if (stop_.load(std::memory_order_acquire)) return;
    const int32_t participants = static_cast<int32_t>(seen & 0xffu);
    if (id >= participants) continue;
    RunTasks();
    // seq_cst for the same reason as the epoch's store in ParallelFor: the dispatcher may sleep.
    if (busy_.fetch_sub(1, std::memory_order_seq_cst) == 1) busy_.notify_one();
  }
}

void CpuThreadPool::ParallelFor(int64_t num_tasks, int32_t num_threads,
                                absl::FunctionRef<void(int64_t)> fn) {
  if (num_tasks <= 0) return;
  if (num_threads <= 0) num_threads = max_threads();
  const int32_t participants = static_cast<int32_t>(
      std::min<int64_t>({int64_t{num_threads} - 1, int64_t{max_threads()} - 1, num_tasks - 1}));
  if (participants <= 0 || tls_running_pool == this) {
    for (int64_t task = 0; task < num_tasks; ++task) fn(task);
    return;
  }

  MutexLock lock(&dispatch_mu_);
  job_fn_ = &fn;
  job_tasks_ = num_tasks;
  next_task_.store(0, std::memory_order_relaxed);
  busy_.store(participants, std::memory_order_relaxed);
  const uint32_t generation = (epoch_.load(std::memory_order_relaxed) >> 8) + 1;
  // seq_cst, not release: notify_all skips the wake-up when it reads that nobody sleeps
  // (libstdc++ keeps a count of sleepers), and only a seq_cst store keeps that read from
  // passing the store (on x86 a release store waits in the store buffer while the read
  // goes ahead): a worker that went to sleep just then would never wake, and this call
  // would never return. Sleepers count themselves with a seq_cst increment before they
  // read the epoch, so one of the two always sees the other.
  epoch_.store((generation << 8) | static_cast<uint32_t>(participants),
               std::memory_order_seq_cst);
  epoch_.notify_all();

  RunTasks();

  int32_t busy = busy_.load(std::memory_order_acquire);
  while (busy != 0) busy = WaitForChange(busy_, busy, spin_iterations_);
  job_fn_ = nullptr;
}

}  // namespace kvcm::kernels
