// The backend-independent parts of pool_memory.h, and the cuda backend's answers on a
// machine (or build) without a CUDA device. Runs everywhere.

#include "common/memory/pool_memory.h"

#include <cstdint>
#include <fstream>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/status_matchers.h"

namespace kvcm {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

TEST(PoolBackendTest, NamesRoundTrip) {
  EXPECT_EQ(PoolBackendName(PoolBackend::kShm), "shm");
  EXPECT_EQ(PoolBackendName(PoolBackend::kCuda), "cuda");
  for (PoolBackend backend : {PoolBackend::kShm, PoolBackend::kCuda}) {
    EXPECT_EQ(*ParsePoolBackend(PoolBackendName(backend)), backend);
  }
  EXPECT_EQ(*ParsePoolBackend(" CUDA "), PoolBackend::kCuda);
}

TEST(PoolBackendTest, RejectsUnknownNames) {
  for (const char* name : {"", "auto", "gpu", "shm0"}) {
    const absl::StatusOr<PoolBackend> backend = ParsePoolBackend(name);
    EXPECT_EQ(backend.status().code(), absl::StatusCode::kInvalidArgument) << name;
  }
  EXPECT_THAT(ParsePoolBackend("gpu").status().message(), HasSubstr("use shm or cuda"));
}

TEST(AvailableHostMemoryTest, IsPositiveAndAtMostMemTotal) {
  const absl::StatusOr<uint64_t> available = AvailableHostMemoryBytes();
  ASSERT_THAT(available, IsOk());
  EXPECT_GT(*available, 0u);
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  uint64_t total_kib = 0;
  ASSERT_TRUE(meminfo >> key >> total_kib);
  ASSERT_EQ(key, "MemTotal:");
  EXPECT_LE(*available, total_kib * 1024);
}

// Runs here (no GPU, or no CUDA build) and on GPU machines alike: with devices present it
// asks for the device one past the last.
TEST(CudaUnavailableTest, FailsWithAClearMessage) {
  const absl::StatusOr<int> count = CudaDeviceCount();
  const int absent_device = count.ok() ? *count : 0;
  const absl::StatusCode expected_code =
      count.ok() ? absl::StatusCode::kInvalidArgument : absl::StatusCode::kUnavailable;
  if (!count.ok()) {
    EXPECT_EQ(count.status().code(), absl::StatusCode::kUnavailable);
    EXPECT_THAT(std::string(count.status().message()), StartsWith("no CUDA device: "));
  }
  if (!CudaBackendCompiled()) {
    EXPECT_THAT(count.status().message(), HasSubstr("kvcm was built without CUDA"));
  }

  const absl::StatusOr<std::unique_ptr<PoolMemory>> pool =
      CreateCudaPoolMemory(absent_device, 1 << 20);
  EXPECT_EQ(pool.status().code(), expected_code) << pool.status();
  EXPECT_THAT(std::string(pool.status().message()), StartsWith("no CUDA device"));

  const absl::StatusOr<std::unique_ptr<PoolMapping>> mapping =
      OpenCudaPool(absent_device, CudaIpcHandle{}, 1 << 20);
  EXPECT_EQ(mapping.status().code(), expected_code) << mapping.status();
  EXPECT_THAT(std::string(mapping.status().message()), StartsWith("no CUDA device"));

  const absl::StatusOr<std::pair<uint64_t, uint64_t>> info = CudaMemoryInfo(absent_device);
  EXPECT_EQ(info.status().code(), expected_code) << info.status();
  EXPECT_THAT(std::string(info.status().message()), StartsWith("no CUDA device"));
}

}  // namespace
}  // namespace kvcm
