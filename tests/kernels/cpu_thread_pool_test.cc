// CpuThreadPool: every task runs exactly once, whatever the thread count; nested and
// concurrent calls complete.

#include "kernels/cpu_thread_pool.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "tests/support/wait_for.h"

namespace kvcm::kernels {
namespace {

void ExpectEachTaskOnce(CpuThreadPool& pool, int64_t tasks, int32_t threads) {
  std::vector<std::atomic<int>> runs(static_cast<size_t>(tasks));
  pool.ParallelFor(tasks, threads, [&](int64_t i) { runs[static_cast<size_t>(i)]++; });
  for (int64_t i = 0; i < tasks; ++i) {
    ASSERT_EQ(runs[static_cast<size_t>(i)].load(), 1)
        << "task " << i << " of " << tasks << ", threads " << threads;
  }
}

TEST(CpuThreadPoolTest, RunsEachTaskOnce) {
  CpuThreadPool pool(3);
  EXPECT_EQ(pool.max_threads(), 4);
  for (int round = 0; round < 200; ++round) {
    for (int32_t threads : {0, 1, 2, 4, 9}) {
      for (int64_t tasks : {0, 1, 2, 7, 100}) ExpectEachTaskOnce(pool, tasks, threads);
    }
  }
}

TEST(CpuThreadPoolTest, NoWorkers) {
  CpuThreadPool pool(0);
  ExpectEachTaskOnce(pool, 10, 0);
}

TEST(CpuThreadPoolTest, NestedCallRunsInline) {
  CpuThreadPool pool(2);
  std::atomic<int> inner{0};
  pool.ParallelFor(4, 0, [&](int64_t) { pool.ParallelFor(5, 0, [&](int64_t) { inner++; }); });
  EXPECT_EQ(inner.load(), 20);
}

TEST(CpuThreadPoolTest, ConcurrentCallers) {
  CpuThreadPool pool(2);
  std::atomic<int64_t> total{0};
  std::vector<std::thread> callers;
  for (int c = 0; c < 3; ++c) {
    callers.emplace_back([&] {
      for (int round = 0; round < 100; ++round) {
        pool.ParallelFor(16, 0, [&](int64_t i) { total += i; });
      }
    });
  }
  for (std::thread& t : callers) t.join();
  EXPECT_EQ(total.load(), 3 * 100 * (15 * 16 / 2));
}

// Regression: a worker could sleep through a new job for ever, so ParallelFor never returned
// (seen as a test process stuck in the model's reference forward on 2 cores). The dispatcher
// published the job with a release store and then read whether anyone sleeps: on x86 that
// read may pass the store, miss a worker just going to sleep, and skip the wake-up. Without
// spinning every job goes through sleep and wake-up. A watchdog fails the test instead of
// hanging; its limit is a minute without one job done, far more than a loaded machine leaves
// a thread unscheduled (docs/RELIABILITY.md, "Timing in tests").
TEST(CpuThreadPoolTest, WorkersThatSleepBetweenJobsAlwaysWakeForTheNext) {
  constexpr int kJobs = 50000;
  std::printf("%d jobs, 1 worker, no spinning\n", kJobs);
  CpuThreadPool pool(1, /*spin_iterations=*/0);
  std::atomic<int> done{0};
  std::atomic<bool> finished{false};
  std::thread watchdog([&] {
    while (!finished.load()) {
      const int before = done.load();
      const absl::Status progressed =
          testing::WaitFor([&] { return finished.load() || done.load() != before; },
                           absl::Seconds(60), "one job done");
      if (!progressed.ok()) {
        std::fprintf(stderr, "ParallelFor stuck after %d jobs: a worker missed its wake-up\n",
                     before);
        std::abort();
      }
    }
  });
  int64_t total = 0;
  for (int job = 0; job < kJobs; ++job) {
    std::atomic<int64_t> sum{0};
    pool.ParallelFor(2, 0, [&](int64_t i) { sum += i + 1; });
    total += sum.load();
    done.store(job + 1, std::memory_order_relaxed);
  }
  finished.store(true);
  watchdog.join();
  EXPECT_EQ(total, int64_t{kJobs} * 3);
}

// Regression: ParallelFor waited for every participating worker to check in, so a worker the
// scheduler kept off the cores (another process busy on them) held up the whole call even
// when the other threads had run every task: the decode step went 5x slower beside one busy
// process. Now the call joins on its tasks. Here the only worker is held before it claims
// anything, as a descheduled one would be: the caller runs every task and returns, and
// after the worker is let go every later call still runs each task once.
TEST(CpuThreadPoolTest, ACallDoesNotWaitForAWorkerThatHasNotStarted) {
  std::atomic<bool> hold{true};
  std::atomic<int> held{0};
  CpuThreadPool pool(1, CpuThreadPool::kDefaultSpinIterations, [&](int32_t) {
    held++;
    hold.wait(true);
  });

  std::atomic<bool> returned{false};
  std::vector<std::atomic<int>> runs(64);
  std::thread caller([&] {
    pool.ParallelFor(64, 0, [&](int64_t i) { runs[static_cast<size_t>(i)]++; });
    returned.store(true);
  });
  // Generous: the caller alone needs microseconds; only a call that waits for the held
  // worker runs into the limit.
  const absl::Status done =
      testing::WaitFor([&] { return returned.load(); }, absl::Seconds(60), "ParallelFor returned");
  EXPECT_TRUE(done.ok()) << done << " (held workers: " << held.load() << ")";
  hold.store(false);
  hold.notify_all();
  caller.join();
  for (size_t i = 0; i < runs.size(); ++i) EXPECT_EQ(runs[i].load(), 1) << "task " << i;
  for (int round = 0; round < 100; ++round) ExpectEachTaskOnce(pool, 33, 0);
}

TEST(CpuThreadPoolTest, MoreTasksThanOneGenerationHolds) {
  CpuThreadPool pool(2);
  ExpectEachTaskOnce(pool, (int64_t{1} << 20) + 5, 0);
}

TEST(CpuThreadPoolTest, DefaultPoolUsesTheMachine) {
  EXPECT_GE(CpuThreadPool::Default().max_threads(), 1);
  ExpectEachTaskOnce(CpuThreadPool::Default(), 64, 0);
}

}  // namespace
}  // namespace kvcm::kernels
