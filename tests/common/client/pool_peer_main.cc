// pool_peer: a helper process for pool_attach_test. It registers as an executor, attaches
// to the cache manager's pool (receiving the shm memfd over the side channel) and writes or
// checks a seeded byte pattern in the given blocks, through the pool layout:
//
//   pool_peer --endpoint ipc://... --mode write|verify|zero --blocks 3,5 --seed 1234
//
// write   fills every byte of each block (all layers, K and V) with the pattern;
// verify  checks that the pattern is there;
// zero    checks that the blocks are all zero.
// Exit 0 on success, 1 on a mismatch or error (with the reason on stderr), 2 on bad flags.

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "common/client/cache_manager_client.h"
#include "common/memory/pool_memory.h"

namespace kvcm {
namespace {

// splitmix64: a tiny, well-mixed generator, so both processes derive the same bytes.
uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// The pattern byte at `index` of (block, layer, kv).
uint8_t PatternByte(uint64_t seed, int32_t block, int32_t layer, int32_t kv, int64_t index) {
  const uint64_t region = Mix(seed ^ Mix((uint64_t(uint32_t(block)) << 32) |
                                         (uint64_t(uint32_t(layer)) << 1) | uint64_t(kv)));
  return static_cast<uint8_t>(Mix(region + static_cast<uint64_t>(index / 8)) >> (8 * (index % 8)));
}

int Run(int argc, char** argv) {
  std::string endpoint;
  std::string mode;
  std::vector<int32_t> blocks;
  uint64_t seed = 0;
  for (int i = 1; i + 1 < argc; i += 2) {
    const absl::string_view flag = argv[i];
    const std::string value = argv[i + 1];
    if (flag == "--endpoint") {
      endpoint = value;
    } else if (flag == "--mode") {
      mode = value;
    } else if (flag == "--seed") {
      if (!absl::SimpleAtoi(value, &seed)) return 2;
    } else if (flag == "--blocks") {
      for (absl::string_view part : absl::StrSplit(value, ',')) {
        int32_t block = 0;
        if (!absl::SimpleAtoi(part, &block)) return 2;
        blocks.push_back(block);
      }
    } else {
      std::fprintf(stderr, "pool_peer: unknown flag %s\n", argv[i]);
      return 2;
    }
  }
  if (endpoint.empty() || blocks.empty() ||
      (mode != "write" && mode != "verify" && mode != "zero")) {
    std::fprintf(stderr, "pool_peer: need --endpoint, --mode write|verify|zero, --blocks\n");
    return 2;
  }

  CacheManagerClient::Options options;
  options.endpoint = endpoint;
  options.role = wire::Role::Executor;
  options.name = "pool-peer-" + mode;
  absl::StatusOr<std::unique_ptr<CacheManagerClient>> client = CacheManagerClient::Connect(options);
  if (!client.ok()) {
    std::fprintf(stderr, "pool_peer: %s\n", client.status().ToString().c_str());
    return 1;
  }
  absl::StatusOr<AttachedPool> pool = (*client)->Attach();
  if (!pool.ok()) {
    std::fprintf(stderr, "pool_peer: attach: %s\n", pool.status().ToString().c_str());
    return 1;
  }
  std::printf("pool_peer: attached epoch=%llu num_blocks=%d pool_bytes=%llu mode=%s seed=%llu\n",
              static_cast<unsigned long long>(pool->view.epoch), pool->view.num_blocks,
              static_cast<unsigned long long>(pool->mapping->size_bytes()), mode.c_str(),
              static_cast<unsigned long long>(seed));

  const PoolLayout& layout = pool->view.layout;
  std::vector<uint8_t> bytes(static_cast<size_t>(layout.block_stride));
  for (int32_t block : blocks) {
    if (block < 0 || block >= pool->view.num_blocks) {
      std::fprintf(stderr, "pool_peer: block %d out of range\n", block);
      return 1;
    }
    for (int32_t layer = 0; layer < pool->view.spec.num_layers; ++layer) {
      for (int32_t kv = 0; kv < 2; ++kv) {
        const uint64_t offset = static_cast<uint64_t>(layout.Offset(layer, kv, block, 0, 0));
        if (mode == "write") {
          for (size_t i = 0; i < bytes.size(); ++i) {
            bytes[i] = PatternByte(seed, block, layer, kv, static_cast<int64_t>(i));
          }
          if (absl::Status s = CopyToPool(*pool->mapping, offset, bytes.data(), bytes.size());
              !s.ok()) {
            std::fprintf(stderr, "pool_peer: %s\n", s.ToString().c_str());
            return 1;
          }
          continue;
        }
        if (absl::Status s = CopyFromPool(*pool->mapping, offset, bytes.data(), bytes.size());
            !s.ok()) {
          std::fprintf(stderr, "pool_peer: %s\n", s.ToString().c_str());
          return 1;
        }
        for (size_t i = 0; i < bytes.size(); ++i) {
          const uint8_t want =
              mode == "zero" ? 0 : PatternByte(seed, block, layer, kv, static_cast<int64_t>(i));
          if (bytes[i] != want) {
            std::fprintf(stderr,
                         "pool_peer: mismatch in block %d layer %d %s byte %zu: got 0x%02x, "
                         "want 0x%02x (seed %llu)\n",
                         block, layer, kv == 0 ? "K" : "V", i, bytes[i], want,
                         static_cast<unsigned long long>(seed));
            return 1;
          }
        }
      }
    }
  }
  std::printf("pool_peer: %s ok for %zu block(s)\n", mode.c_str(), blocks.size());
  (void)(*client)->Goodbye();
  return 0;
}

}  // namespace
}  // namespace kvcm

int main(int argc, char** argv) { return kvcm::Run(argc, argv); }
