#pragma once
// How many CPUs this process may run on: the CPUs of its affinity mask (taskset, cpusets,
// a container's --cpuset-cpus), not every CPU of the machine.

#include <sched.h>

#include <algorithm>
#include <cstdint>
#include <thread>

namespace kvcm {

// At least 1. Falls back to std::thread::hardware_concurrency() where the mask cannot be
// read.
inline int32_t UsableCpus() {
  cpu_set_t cpus;
  CPU_ZERO(&cpus);
  if (sched_getaffinity(0, sizeof(cpus), &cpus) == 0) {
    return std::max<int32_t>(1, CPU_COUNT(&cpus));
  }
  return std::max<int32_t>(1, static_cast<int32_t>(std::thread::hardware_concurrency()));
}

}  // namespace kvcm
