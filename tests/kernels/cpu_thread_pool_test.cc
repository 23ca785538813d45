// CpuThreadPool: every task runs exactly once, whatever the thread count; nested and
// concurrent calls complete.

#include "kernels/cpu_thread_pool.h"

#include <atomic>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace kvcm::kernels {
namespace {

void ExpectEachTaskOnce(CpuThreadPool& pool, int64_t tasks, int32_t threads) {
  std::vector<std::atomic<int>> runs(static_cast<size_t>(tasks));
  pool.ParallelFor(tasks, threads, [&](int64_t i) { runs[static_cast<size_t>(i)]++; });
  for (int64_t i = 0; i < tasks; ++i) {
    ASSERT_EQ(runs[static_cast<size_t>(i)].load(), 1) << "task " << i << " of " << tasks
                                                      << ", threads " << threads;
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
  pool.ParallelFor(4, 0, [&](int64_t) {
    pool.ParallelFor(5, 0, [&](int64_t) { inner++; });
  });
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

TEST(CpuThreadPoolTest, DefaultPoolUsesTheMachine) {
  EXPECT_GE(CpuThreadPool::Default().max_threads(), 1);
  ExpectEachTaskOnce(CpuThreadPool::Default(), 64, 0);
}

}  // namespace
}  // namespace kvcm::kernels
