// The cuda backend of pool_memory.h on a real device, across processes. Label: gpu.
//
// Without a device every test here skips with "no CUDA device: ..."; with
// KVCM_REQUIRE_GPU=1 in the environment (scripts/gpu-check.sh sets it) they fail instead.
//
// CUDA must not be initialised in a process that then forks, so the cross-process test
// starts its child by re-executing this binary (posix_spawn of /proc/self/exe) with
// kChildFlag as the first argument; main() then runs the child's role instead of gtest.

#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/memory/pool_memory.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/common/memory/memory_test_util.h"
#include "tests/support/gpu_test.h"
#include "tests/support/status_matchers.h"

extern char** environ;

namespace kvcm {

// Names the parameter in test names: ".../shm", not "1-byte object <00>".
void PrintTo(PoolBackend backend, std::ostream* os) { *os << PoolBackendName(backend); }

namespace {

using ::kvcm::testing_util::NewSeed;
using ::kvcm::testing_util::Pattern;
using ::testing::HasSubstr;

constexpr std::string_view kChildFlag = "--kvcm-cuda-pool-child";
constexpr uint64_t kMiB = uint64_t{1} << 20;

// Skips the test when there is no CUDA device, or fails it under KVCM_REQUIRE_GPU=1.
class CudaDeviceTest : public ::testing::Test {
 protected:
  void SetUp() override { KVCM_SKIP_WITHOUT_GPU(); }
};

std::string HandleToHex(const CudaIpcHandle& handle) {
  return absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(handle.data()), handle.size()));
}

// ---- the child's role -----------------------------------------------------------------------

// argv: exe kChildFlag device bytes handle-hex parent-seed child-seed.
// Opens the pool, checks the parent's pattern, writes its own. Exit status 0 when all went
// well, else the step that failed: 2 arguments, 3 open, 4 read, 5 parent's pattern, 6 write.
int RunChild(int argc, char** argv) {
  int device = 0;
  uint64_t bytes = 0;
  uint64_t parent_seed = 0;
  uint64_t child_seed = 0;
  const std::string handle_bytes = argc == 7 ? absl::HexStringToBytes(argv[4]) : "";
  CudaIpcHandle handle{};
  if (argc != 7 || !absl::SimpleAtoi(argv[2], &device) || !absl::SimpleAtoi(argv[3], &bytes) ||
      !absl::SimpleAtoi(argv[5], &parent_seed) || !absl::SimpleAtoi(argv[6], &child_seed) ||
      handle_bytes.size() != handle.size()) {
    std::fprintf(stderr, "cuda child: bad arguments\n");
    return 2;
  }
  std::memcpy(handle.data(), handle_bytes.data(), handle.size());

  absl::StatusOr<std::unique_ptr<PoolMapping>> mapping = OpenCudaPool(device, handle, bytes);
  if (!mapping.ok()) {
    std::fprintf(stderr, "cuda child: %s\n", mapping.status().ToString().c_str());
    return 3;
  }
  std::vector<uint8_t> seen(bytes);
  if (absl::Status s = CopyFromPool(**mapping, 0, seen.data(), bytes); !s.ok()) {
    std::fprintf(stderr, "cuda child: %s\n", s.ToString().c_str());
    return 4;
  }
  if (seen != Pattern(parent_seed, bytes)) {
    std::fprintf(stderr, "cuda child: the parent's pattern (seed %llu) is not in the pool\n",
                 static_cast<unsigned long long>(parent_seed));
    return 5;
  }
  const std::vector<uint8_t> mine = Pattern(child_seed, bytes);
  if (absl::Status s = CopyToPool(**mapping, 0, mine.data(), bytes); !s.ok()) {
    std::fprintf(stderr, "cuda child: %s\n", s.ToString().c_str());
    return 6;
  }
  return 0;
}

// Starts this binary in the child's role; returns its pid or -1.
pid_t SpawnChild(const std::vector<std::string>& args) {
  std::vector<std::string> all = {"/proc/self/exe", std::string(kChildFlag)};
  all.insert(all.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (std::string& arg : all) argv.push_back(arg.data());
  argv.push_back(nullptr);
  pid_t pid = -1;
  const int err = ::posix_spawn(&pid, "/proc/self/exe", nullptr, nullptr, argv.data(), environ);
  if (err != 0) {
    ADD_FAILURE() << "posix_spawn: " << std::strerror(err);
    return -1;
  }
  return pid;
}

// ---- tests ----------------------------------------------------------------------------------

using CudaPoolMemoryTest = CudaDeviceTest;

TEST_F(CudaPoolMemoryTest, CreatesZeroedPoolWithIpcHandle) {
  absl::StatusOr<std::unique_ptr<PoolMemory>> pool = CreateCudaPoolMemory(0, 4 * kMiB);
  ASSERT_THAT(pool, IsOk());
  EXPECT_EQ((*pool)->backend(), PoolBackend::kCuda);
  EXPECT_EQ((*pool)->size_bytes(), 4 * kMiB);
  EXPECT_EQ((*pool)->cuda_device(), 0);
  EXPECT_EQ((*pool)->shareable_fd(), -1);
  ASSERT_TRUE((*pool)->cuda_ipc_handle().has_value());
  EXPECT_NE(*(*pool)->cuda_ipc_handle(), CudaIpcHandle{});
  std::vector<uint8_t> seen(4 * kMiB, 1);
  ASSERT_THAT(CopyFromPool(**pool, 0, seen.data(), seen.size()), IsOk());
  EXPECT_EQ(seen, std::vector<uint8_t>(4 * kMiB, 0));
}

TEST_F(CudaPoolMemoryTest, MemoryInfoAndOversizedPool) {
  const absl::StatusOr<std::pair<uint64_t, uint64_t>> info = CudaMemoryInfo(0);
  ASSERT_THAT(info, IsOk());
  const auto [free_bytes, total_bytes] = *info;
  EXPECT_GT(total_bytes, 0u);
  EXPECT_LE(free_bytes, total_bytes);
  const absl::StatusOr<std::unique_ptr<PoolMemory>> pool =
      CreateCudaPoolMemory(0, total_bytes + kMiB);
  EXPECT_EQ(pool.status().code(), absl::StatusCode::kResourceExhausted) << pool.status();
  EXPECT_THAT(pool.status().message(), HasSubstr("bytes free"));
  // The failure leaves the device usable.
  EXPECT_THAT(CreateCudaPoolMemory(0, kMiB), IsOk());
}

// Observed on an H200 (CUDA 13, driver 580): cudaErrorDeviceUninitialized ("invalid device
// context").
TEST_F(CudaPoolMemoryTest, OpeningOwnHandleInExportingProcessFails) {
  std::unique_ptr<PoolMemory> pool = *CreateCudaPoolMemory(0, kMiB);
  const absl::StatusOr<std::unique_ptr<PoolMapping>> mapping =
      OpenCudaPool(0, *pool->cuda_ipc_handle(), kMiB);
  ASSERT_FALSE(mapping.ok());
  EXPECT_EQ(mapping.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(mapping.status().message(), HasSubstr("cudaIpcOpenMemHandle"));
  std::cout << "opening a handle in its exporting process: " << mapping.status() << std::endl;
}

TEST_F(CudaPoolMemoryTest, ParentAndSpawnedChildSeeEachOthersWrites) {
  constexpr uint64_t kBytes = 8 * kMiB + 3;
  std::unique_ptr<PoolMemory> pool = *CreateCudaPoolMemory(0, kBytes);
  const uint64_t parent_seed = NewSeed("parent");
  const uint64_t child_seed = NewSeed("child");
  const std::vector<uint8_t> parent_pattern = Pattern(parent_seed, kBytes);
  ASSERT_THAT(CopyToPool(*pool, 0, parent_pattern.data(), kBytes), IsOk());

  std::fflush(nullptr);
  const pid_t pid = SpawnChild({"0", std::to_string(kBytes), HandleToHex(*pool->cuda_ipc_handle()),
                                std::to_string(parent_seed), std::to_string(child_seed)});
  ASSERT_GT(pid, 0);
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status)) << "child wait status " << status;
  ASSERT_EQ(WEXITSTATUS(status), 0) << "the child failed at step " << WEXITSTATUS(status);

  std::vector<uint8_t> seen(kBytes);
  ASSERT_THAT(CopyFromPool(*pool, 0, seen.data(), kBytes), IsOk());
  EXPECT_TRUE(seen == Pattern(child_seed, kBytes))
      << "the child's pattern (seed " << child_seed << ") is not in the parent's pool";
}

// One body for both backends: what the copy helpers promise.
class PoolRoundTripTest : public ::testing::TestWithParam<PoolBackend> {
 protected:
  void SetUp() override {
    if (GetParam() == PoolBackend::kCuda) KVCM_SKIP_WITHOUT_GPU();
  }

  absl::StatusOr<std::unique_ptr<PoolMemory>> Create(uint64_t bytes) {
    return GetParam() == PoolBackend::kCuda ? CreateCudaPoolMemory(0, bytes)
                                            : CreateShmPoolMemory(bytes, "round-trip");
  }
};

TEST_P(PoolRoundTripTest, CopiesRoundTripAndAreBoundsChecked) {
  constexpr uint64_t kBytes = 2 * kMiB;
  absl::StatusOr<std::unique_ptr<PoolMemory>> pool = Create(kBytes);
  ASSERT_THAT(pool, IsOk());
  EXPECT_EQ((*pool)->backend(), GetParam());
  const std::vector<uint8_t> pattern = Pattern(NewSeed("round trip"), 12345);
  ASSERT_THAT(CopyToPool(**pool, kBytes - pattern.size(), pattern.data(), pattern.size()), IsOk());
  std::vector<uint8_t> seen(pattern.size());
  ASSERT_THAT(CopyFromPool(**pool, kBytes - seen.size(), seen.data(), seen.size()), IsOk());
  EXPECT_EQ(seen, pattern);
  EXPECT_EQ(CopyToPool(**pool, kBytes - 1, pattern.data(), 2).code(),
            absl::StatusCode::kOutOfRange);
  EXPECT_EQ(CopyFromPool(**pool, kBytes + 1, seen.data(), 0).code(), absl::StatusCode::kOutOfRange);
}

INSTANTIATE_TEST_SUITE_P(Backends, PoolRoundTripTest,
                         ::testing::Values(PoolBackend::kShm, PoolBackend::kCuda),
                         [](const ::testing::TestParamInfo<PoolBackend>& param_info) {
                           return std::string(PoolBackendName(param_info.param));
                         });

}  // namespace
}  // namespace kvcm

int main(int argc, char** argv) {
  if (argc >= 2 && argv[1] == kvcm::kChildFlag) return kvcm::RunChild(argc, argv);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
