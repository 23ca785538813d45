#include "kernels/cpu_thread_pool.h"

#include <algorithm>
#include <utility>

#include "common/base/cpus.h"

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

constexpr int kGenerationShift = 40;

}  // namespace

CpuThreadPool& CpuThreadPool::Default() {
  static CpuThreadPool* pool = new CpuThreadPool(UsableCpus() - 1);
  return *pool;
}

CpuThreadPool::CpuThreadPool(int32_t num_workers, int32_t spin_iterations, WakeHook on_wake)
    : spin_iterations_(std::max(spin_iterations, 0)), on_wake_(std::move(on_wake)) {
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

void CpuThreadPool::RunTasks(uint32_t generation) {
  const CpuThreadPool* const outer = tls_running_pool;
  tls_running_pool = this;
  uint64_t word = claim_.load(std::memory_order_acquire);
  for (;;) {
    // A thread that woke late may find a later generation (or none left): it claims nothing
    // of it, so a generation never counts on a thread that was not there.
    if ((word >> kGenerationShift) != generation) break;
    const uint64_t tasks = (word >> kTaskBits) & kTaskMask;
    const uint64_t task = word & kTaskMask;
    if (task >= tasks) break;
    // acquire: job_fn_ was written before the generation's claim word was published.
    if (!claim_.compare_exchange_weak(word, word + 1, std::memory_order_acquire,
                                      std::memory_order_acquire)) {
      continue;  // `word` now holds the current claim word
    }
    (*job_fn_)(static_cast<int64_t>(task));
    // seq_cst for the same reason as the epoch's store in RunJob: the dispatcher may sleep.
    if (done_.fetch_add(1, std::memory_order_seq_cst) + 1 == static_cast<int32_t>(tasks)) {
      done_.notify_one();
    }
    ++word;  // the likely next claim word; a failed exchange corrects it
  }
  tls_running_pool = outer;
}

void CpuThreadPool::WorkerLoop(int32_t id) {
  // The epoch at construction, not the current one: a worker that starts late must still
  // see the generation published before it ran.
  uint32_t seen = 0;
  for (;;) {
    seen = WaitForChange(epoch_, seen, spin_iterations_);
    if (stop_.load(std::memory_order_acquire)) return;
    const int32_t participants = static_cast<int32_t>(seen & 0xffu);
    if (id >= participants) continue;
    if (on_wake_) on_wake_(id);
    RunTasks(seen >> 8);
  }
}

void CpuThreadPool::RunJob(int64_t num_tasks, int32_t participants,
                           absl::FunctionRef<void(int64_t)> fn) {
  job_fn_ = &fn;
  done_.store(0, std::memory_order_relaxed);
  const uint32_t generation = ((epoch_.load(std::memory_order_relaxed) >> 8) + 1) & kGenerationMask;
  claim_.store(
      (uint64_t{generation} << kGenerationShift) | (static_cast<uint64_t>(num_tasks) << kTaskBits),
      std::memory_order_release);
  // seq_cst, not release: notify_all skips the wake-up when it reads that nobody sleeps
  // (libstdc++ keeps a count of sleepers), and only a seq_cst store keeps that read from
  // passing the store (on x86 a release store waits in the store buffer while the read
  // goes ahead). A worker that went to sleep just then would miss this generation, and
  // the caller would run its share; sleepers count themselves with a seq_cst increment
  // before they read the epoch, so one of the two always sees the other.
  epoch_.store((generation << 8) | static_cast<uint32_t>(participants), std::memory_order_seq_cst);
  epoch_.notify_all();

  RunTasks(generation);

  // The join is on the tasks: every task is claimed by now, and only threads running one
  // are waited for.
  const auto total = static_cast<int32_t>(num_tasks);
  int32_t done = done_.load(std::memory_order_acquire);
  while (done != total) done = WaitForChange(done_, done, spin_iterations_);
  job_fn_ = nullptr;
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
  for (int64_t first = 0; first < num_tasks; first += kMaxTasksPerJob) {
    const int64_t count = std::min(kMaxTasksPerJob, num_tasks - first);
    if (first == 0 && count == num_tasks) {
      RunJob(count, participants, fn);
    } else {
      RunJob(count, participants, [&](int64_t task) { fn(first + task); });
    }
  }
}

}  // namespace kvcm::kernels
