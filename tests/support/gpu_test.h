#pragma once
// For the gpu-labelled tests. KVCM_SKIP_WITHOUT_GPU(), in a test body or a fixture's
// SetUp, skips the test with the reason ("no CUDA device: ...") when no CUDA device can be
// used, or fails it when the environment has KVCM_REQUIRE_GPU=1: scripts/gpu-check.sh sets
// it, so that a machine that should have a GPU cannot pass by skipping.

#include <cstdlib>
#include <string_view>

#include "absl/status/statusor.h"
#include "common/memory/pool_memory.h"
#include "gtest/gtest.h"

namespace kvcm::testing {

// True when the environment has KVCM_REQUIRE_GPU=1.
inline bool GpuRequired() {
  const char* require = std::getenv("KVCM_REQUIRE_GPU");
  return require != nullptr && std::string_view(require) == "1";
}

}  // namespace kvcm::testing

#define KVCM_SKIP_WITHOUT_GPU()                                                    \
  do {                                                                             \
    const ::absl::StatusOr<int> kvcm_gpu_count_ = ::kvcm::CudaDeviceCount();       \
    if (!kvcm_gpu_count_.ok()) {                                                   \
      if (::kvcm::testing::GpuRequired()) {                                        \
        FAIL() << "KVCM_REQUIRE_GPU=1 but " << kvcm_gpu_count_.status().message(); \
      }                                                                            \
      GTEST_SKIP() << kvcm_gpu_count_.status().message();                          \
    }                                                                              \
  } while (false)
