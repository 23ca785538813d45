#pragma once
// What the tier tests share: a small KV spec, a real shm pool laid out by PoolLayout, a
// fresh directory under the test's TMPDIR (a model file and the disk tier's directory),
// blocks filled with seeded bytes, and a wait on KvTiers::wake_fd() with poll(2). Test
// support only.

#include <poll.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/block/block_hash.h"
#include "common/memory/pool_layout.h"
#include "common/memory/pool_memory.h"
#include "common/sizing/kv_cache_spec.h"
#include "gtest/gtest.h"
#include "services/cache_manager/tiers/kv_tiers.h"

namespace kvcm::cache_manager::tiers::testenv {

// 2 layers x 2 KV heads x head dim 8, fp16, 4 tokens a block: 512 bytes a block, in
// 4 runs (layer, K|V) of 128 bytes.
inline KvCacheSpec Spec() {
  KvCacheSpec spec;
  spec.num_layers = 2;
  spec.num_kv_heads = 2;
  spec.head_dim = 8;
  spec.dtype = DType::kFloat16;
  spec.block_size = 4;
  return spec;
}
inline constexpr uint64_t kBlockBytes = 512;
inline constexpr uint64_t kDiskSlotBytes = 4096 + 4096;

inline BlockHash HashOf(int i) {
  const std::string message = absl::StrCat("tier test block ", i);
  return Xxh3Digest({reinterpret_cast<const uint8_t*>(message.data()), message.size()});
}

// Generous: only a guard against a hang, never a timing assumption.
inline constexpr absl::Duration kHangGuard = absl::Seconds(60);

// Calls step() (which polls the tiers), then done(); while done() is false, waits for
// wake_fd to be readable (poll(2)) and goes again. False when the hang guard ran out.
inline bool PollUntil(int wake_fd, const std::function<void()>& step,
                      const std::function<bool()>& done) {
  const absl::Time deadline = absl::Now() + kHangGuard;
  while (true) {
    step();
    if (done()) return true;
    if (absl::Now() >= deadline) return false;
    pollfd fd{wake_fd, POLLIN, 0};
    (void)::poll(&fd, 1, 1000);  // readiness, or a re-check every second
  }
}

class Env {
 public:
  // A pool of `num_blocks` blocks and a directory named after the running test.
  // A cuda pool on device 0 with PoolBackend::kCuda (the caller skips without a GPU).
  explicit Env(int32_t num_blocks, PoolBackend backend = PoolBackend::kShm) {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    root_ = absl::StrCat(::testing::TempDir(), "/", info->test_suite_name(), "-", ::getpid(), "-",
                         info->name());
    std::filesystem::remove_all(root_);
    std::filesystem::create_directories(root_);
    model_ = root_ + "/model.gguf";
    WriteModel(model_, 1);
    EXPECT_EQ(static_cast<uint64_t>(Spec().BytesPerBlock()), kBlockBytes);
    layout_ = *PoolLayout::For(Spec(), num_blocks);
    auto memory = backend == PoolBackend::kCuda
                      ? CreateCudaPoolMemory(0, static_cast<uint64_t>(layout_.total_bytes))
                      : CreateShmPoolMemory(static_cast<uint64_t>(layout_.total_bytes),
                                            absl::StrCat("tier-test-", ::getpid()));
    EXPECT_TRUE(memory.ok()) << memory.status();
    if (memory.ok()) memory_ = *std::move(memory);
  }
  ~Env() { std::filesystem::remove_all(root_); }

  // A model file of 4096 bytes that depend on `variant`.
  static void WriteModel(const std::string& path, int variant) {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    for (int i = 0; i < 4096; ++i) out.put(static_cast<char>((i * 7 + variant * 31) & 0xFF));
  }

  const std::string& root() const { return root_; }
  const std::string& model() const { return model_; }
  std::string disk_dir() const { return root_ + "/tier"; }
  PoolMemory& memory() { return *memory_; }
  const PoolLayout& layout() const { return layout_; }

  KvTiers::PoolAccess Access() { return {memory_.get(), layout_, Spec().num_layers}; }

  TierOptions Options(int32_t host_blocks, int32_t disk_slots) const {
    TierOptions options;
    options.host_bytes = static_cast<uint64_t>(host_blocks) * kBlockBytes;
    if (disk_slots > 0) {
      options.disk_dir = disk_dir();
      options.disk_bytes = static_cast<uint64_t>(disk_slots) * kDiskSlotBytes;
      options.model_path = model_;
    }
    options.mover_threads = 1;
    return options;
  }

  std::unique_ptr<KvTiers> MakeTiers(const TierOptions& options) {
    auto tiers = KvTiers::Create(options, Spec(), HashAlgorithm::kXxh3V2, Access(),
                                 [](std::string line) { std::cout << "tiers: " << line << "\n"; });
    EXPECT_TRUE(tiers.ok()) << tiers.status();
    return tiers.ok() ? *std::move(tiers) : nullptr;
  }

  // Fills pool block `block` with bytes from `seed`; returns them in a tier slot's order
  // (layer, K|V).
  std::vector<uint8_t> FillBlock(BlockId block, uint64_t seed) {
    std::mt19937_64 random(seed);
    std::vector<uint8_t> bytes(kBlockBytes);
    for (uint8_t& b : bytes) b = static_cast<uint8_t>(random());
    const uint64_t run = static_cast<uint64_t>(layout_.block_stride);
    size_t at = 0;
    for (int32_t layer = 0; layer < Spec().num_layers; ++layer) {
      for (int32_t kv = 0; kv < 2; ++kv) {
        const uint64_t offset = static_cast<uint64_t>(layout_.Offset(layer, kv, block, 0, 0));
        EXPECT_TRUE(CopyToPool(*memory_, offset, bytes.data() + at, run).ok());
        at += run;
      }
    }
    return bytes;
  }

  std::vector<uint8_t> ReadBlock(BlockId block) const {
    std::vector<uint8_t> bytes(kBlockBytes);
    const uint64_t run = static_cast<uint64_t>(layout_.block_stride);
    size_t at = 0;
    for (int32_t layer = 0; layer < Spec().num_layers; ++layer) {
      for (int32_t kv = 0; kv < 2; ++kv) {
        const uint64_t offset = static_cast<uint64_t>(layout_.Offset(layer, kv, block, 0, 0));
        EXPECT_TRUE(CopyFromPool(*memory_, offset, bytes.data() + at, run).ok());
        at += run;
      }
    }
    return bytes;
  }

  // Zeroes pool block `block`.
  void ClearBlock(BlockId block) {
    const std::vector<uint8_t> zeros(static_cast<size_t>(layout_.block_stride), 0);
    for (int32_t layer = 0; layer < Spec().num_layers; ++layer) {
      for (int32_t kv = 0; kv < 2; ++kv) {
        const uint64_t offset = static_cast<uint64_t>(layout_.Offset(layer, kv, block, 0, 0));
        EXPECT_TRUE(CopyToPool(*memory_, offset, zeros.data(), zeros.size()).ok());
      }
    }
  }

 private:
  std::string root_;
  std::string model_;
  PoolLayout layout_;
  std::unique_ptr<PoolMemory> memory_;
};

}  // namespace kvcm::cache_manager::tiers::testenv
