// The tiers beside a cuda pool (docs/architecture.md, "Tiers", the CUDA path): the movers
// copy with cudaMemcpyAsync on streams of their own into page-locked host memory, and the
// bytes a tier keeps and gives back are those the shm path keeps and gives back for the
// same block. Label gpu: skipped without a device (scripts/gpu-check.sh runs it on one).

#include <fcntl.h>
#include <unistd.h>

#include <cstdint>
#include <iostream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/services/cache_manager/tier_test_env.h"
#include "tests/support/gpu_test.h"

namespace kvcm::cache_manager::tiers {
namespace {

using testenv::Env;
using testenv::HashOf;
using testenv::PollUntil;
using Done = KvTiers::Done;

constexpr uint64_t kSeed = 20261206;

// Stores block 0 (filled from kSeed) into both tiers, loads it from the host tier into block
// 1 and from the disk tier (a second KvTiers on the same directory) into block 2. Returns
// the three blocks' bytes and the disk slot's data as the file holds it.
struct RoundTrip {
  std::vector<uint8_t> written, from_host, from_disk, slot_data;
};

RoundTrip StoreAndLoad(PoolBackend backend) {
  RoundTrip out;
  Env env(8, backend);
  std::vector<Done> done;
  auto wait = [&](KvTiers& tiers, Done::Kind kind, BlockId block) {
    EXPECT_TRUE(PollUntil(
        tiers.wake_fd(), [&] { tiers.Poll(&done); },
        [&] {
          for (const Done& d : done) {
            if (d.kind == kind && d.block == block) return tiers.Snapshot().writing[1] == 0;
          }
          return false;
        }));
  };
  {
    auto tiers = env.MakeTiers(env.Options(4, 4));
    if (tiers == nullptr) return out;
    out.written = env.FillBlock(0, kSeed);
    tiers->Store(0, HashOf(0));
    tiers->Flush();
    wait(*tiers, Done::Kind::kReleased, 0);
    tiers->Load(1, 1, HashOf(0));
    tiers->Flush();
    wait(*tiers, Done::Kind::kLoaded, 1);
    out.from_host = env.ReadBlock(1);
  }
  {
    auto tiers = env.MakeTiers(env.Options(0, 4));  // the disk tier alone, recovered
    if (tiers == nullptr) return out;
    tiers->Load(2, 2, HashOf(0));
    tiers->Flush();
    wait(*tiers, Done::Kind::kLoaded, 2);
    out.from_disk = env.ReadBlock(2);
  }
  const int fd = ::open((env.disk_dir() + "/tier-0.kvcm").c_str(), O_RDONLY | O_CLOEXEC);
  EXPECT_GE(fd, 0);
  out.slot_data.resize(testenv::kBlockBytes);
  EXPECT_EQ(::pread(fd, out.slot_data.data(), out.slot_data.size(), 4096),
            static_cast<ssize_t>(out.slot_data.size()));
  ::close(fd);
  return out;
}

TEST(KvTiersCudaTest, TheTiersKeepAndGiveBackTheBytesTheShmPathDoes) {
  KVCM_SKIP_WITHOUT_GPU();
  std::cout << "random data seed " << kSeed << "\n";
  const RoundTrip cuda = StoreAndLoad(PoolBackend::kCuda);
  const RoundTrip shm = StoreAndLoad(PoolBackend::kShm);
  ASSERT_EQ(cuda.written.size(), testenv::kBlockBytes);
  EXPECT_EQ(cuda.written, shm.written);
  EXPECT_EQ(cuda.from_host, cuda.written);
  EXPECT_EQ(cuda.from_disk, cuda.written);
  EXPECT_EQ(cuda.slot_data, shm.slot_data);
  EXPECT_EQ(shm.from_host, shm.written);
  EXPECT_EQ(shm.from_disk, shm.written);
}

}  // namespace
}  // namespace kvcm::cache_manager::tiers
