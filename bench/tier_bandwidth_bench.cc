// Load bandwidth of the tiers below the pool (docs/PERFORMANCE.md, "Tier bandwidth"), each
// beside a baseline measured in the same run:
//
//   T2  KvTiers with only a disk tier, one per mover count (--movers): N blocks stored from
//       a shm pool (and synced), the tier's files dropped from the page cache (fsync +
//       POSIX_FADV_DONTNEED, best effort), then loaded back into other pool blocks
//       (KvTiers::Load, then Poll until every load is kLoaded, waiting on wake_fd with
//       poll(2)): the mover's DiskTier::Read (header, identity and XXH3 checksum verified)
//       and its copy into the pool's layout. Baseline: a plain sequential pread, one slot's
//       bytes a call, of as many bytes from one file of the same size in the same directory,
//       also dropped from the page cache first, into a 4 KiB-aligned buffer, with O_DIRECT
//       when the tier used it.
//   T1  KvTiers with only a host tier, one per mover count, loaded the same way; baseline:
//       memcpy of the same bytes, one block's bytes a call, between two buffers.
// Informative rows: DiskTier::Read of the N slots called directly on one thread (the read
// and its verification with nothing beside them), and the XXH3-64 that Read computes after
// its pread. Every loaded block is compared byte for byte once, outside the clock.
//
// The ratio is the tier's bytes/s over the baseline's (goal >= 0.8). Each side takes the
// best of --reps repetitions (3), interleaved. The data is drawn from a fixed seed (printed).
//
//   build/bench/tier_bandwidth_bench [--dir DIR] [--blocks N] [--reps R] [--seed S]
//                                    [--movers M[,M...]] [--buffered]
//
// --movers lists the mover thread counts (TierOptions::mover_threads, the cache manager's
// --tier-mover-threads) to measure, 1,2,4 by default. DIR defaults to $TMPDIR (else /tmp);
// the benchmark works in a fresh directory under it and removes it at the end. Blocks have
// the bundled SmolLM2-135M's shape: 30 layers x 3 KV heads x head dim 64, bf16, block size
// 16 = 368,640 bytes.

#include <fcntl.h>
#include <poll.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "bench/allocation_trace.h"
#include "common/base/check.h"
#include "common/block/block_hash.h"
#include "common/memory/pool_layout.h"
#include "common/memory/pool_memory.h"
#include "common/sizing/kv_cache_spec.h"
#include "services/cache_manager/tiers/disk_tier.h"
#include "services/cache_manager/tiers/kv_tiers.h"

namespace kvcm {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

KvCacheSpec SmolLm2Spec() {
  KvCacheSpec spec;
  spec.num_layers = 30;
  spec.num_kv_heads = 3;
  spec.head_dim = 64;
  spec.dtype = DType::kBFloat16;
  spec.block_size = 16;
  return spec;
}

BlockHash HashOf(uint64_t seed, int i) {
  const std::string message = absl::StrCat("tier bandwidth block ", seed, " ", i);
  return Xxh3Digest({reinterpret_cast<const uint8_t*>(message.data()), message.size()});
}

std::string FileSystem(const std::string& path) {
  struct statfs s {};
  if (::statfs(path.c_str(), &s) != 0) return "unknown";
  const auto type = static_cast<uint64_t>(s.f_type);
  const char* name = "other";
  switch (type) {
    case 0xEF53:
      name = "ext2/ext3/ext4";
      break;
    case 0x01021994:
      name = "tmpfs";
      break;
    case 0x58465342:
      name = "xfs";
      break;
    case 0x9123683E:
      name = "btrfs";
      break;
    case 0x794C7630:
      name = "overlayfs";
      break;
    case 0x6969:
      name = "nfs";
      break;
    case 0x2FC12FC1:
      name = "zfs";
      break;
  }
  char hex[32];
  std::snprintf(hex, sizeof(hex), "0x%llx", static_cast<unsigned long long>(type));
  return absl::StrCat(name, " (f_type ", hex, ")");
}

// fsync (so that no dirty page stays) and POSIX_FADV_DONTNEED: best effort. False when the
// kernel refused either.
bool DropFromPageCache(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  bool ok = ::fsync(fd) == 0;
  ok &= ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED) == 0;
  ::close(fd);
  return ok;
}

// 4 KiB-aligned heap bytes.
struct Aligned {
  explicit Aligned(uint64_t bytes)
      : p(static_cast<uint8_t*>(std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096))) {
    KVCM_CHECK(p != nullptr) << "out of memory: " << bytes << " bytes";
    std::memset(p, 0, (bytes + 4095) / 4096 * 4096);  // fault every page in now
  }
  ~Aligned() { std::free(p); }
  Aligned(const Aligned&) = delete;
  Aligned& operator=(const Aligned&) = delete;
  uint8_t* p;
};

void PrintRow(const char* name, uint64_t bytes, double seconds) {
  std::printf("  %-44s %8.1f MB in %8.2f ms = %7.2f GB/s\n", name, bytes / 1e6, seconds * 1e3,
              bytes / seconds / 1e9);
}

void PrintRatio(const char* what, double tier_bps, double base_bps, double goal) {
  const double ratio = tier_bps / base_bps;
  std::printf("  %-44s ratio %.2f (goal >= %.2f: %s)\n", what, ratio, goal,
              ratio >= goal ? "met" : "MISSED");
}

struct Flags {
  std::string dir;
  int blocks = 512;
  int reps = 3;
  uint64_t seed = 20250611;
  std::vector<int> movers = {1, 2, 4};
  bool direct_io = true;
};

// The files of the disk tier in `dir` (DIR/tier-N.kvcm, disk_tier.h), to drop from the page
// cache.
std::vector<std::string> TierFiles(const std::string& dir) {
  std::vector<std::string> files;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    if (entry.path().extension() == ".kvcm") files.push_back(entry.path().string());
  }
  std::sort(files.begin(), files.end());
  return files;
}

// ---- The pool and KvTiers, shared by T2 and T1 ----------------------------------------

// A shm pool of 2n blocks: [0, n) hold the data's blocks, which every KvTiers stores;
// loads go to [n, 2n). One pool serves every KvTiers of the run, one pass at a time.
struct BenchPool {
  PoolLayout layout;
  std::unique_ptr<PoolMemory> memory;
  int32_t num_layers = 0;
  int n = 0;
  uint64_t block_bytes = 0;

  cache_manager::tiers::KvTiers::PoolAccess Access() const {
    return {memory.get(), layout, num_layers};
  }

  // Pool block `block`'s bytes from `bytes`, in a tier slot's order (layer, K|V).
  void Write(BlockId block, const uint8_t* bytes) {
    ForEachRun(block, [&](uint8_t* at, uint64_t run) {
      std::memcpy(at, bytes, run);
      bytes += run;
    });
  }
  // Pool block `block`'s bytes into `bytes`, in a tier slot's order.
  void Read(BlockId block, uint8_t* bytes) const {
    ForEachRun(block, [&](const uint8_t* at, uint64_t run) {
      std::memcpy(bytes, at, run);
      bytes += run;
    });
  }

  // Every block loaded into [n, 2n) against the data, byte for byte (outside the clock),
  // then zeroed, so that the next check sees only what the next load wrote.
  void CheckLoaded(const std::vector<uint8_t>& data, const char* what) {
    std::vector<uint8_t> got(block_bytes);
    const std::vector<uint8_t> zeros(block_bytes, 0);
    for (int i = 0; i < n; ++i) {
      Read(n + i, got.data());
      KVCM_CHECK(std::memcmp(got.data(), data.data() + static_cast<uint64_t>(i) * block_bytes,
                             block_bytes) == 0)
          << what << ": block " << i << " loaded wrong bytes";
      Write(n + i, zeros.data());
    }
  }

  // fn(address, bytes) for each of the block's 2 x num_layers runs, in a tier slot's order.
  template <typename Fn>
  void ForEachRun(BlockId block, Fn fn) const {
    auto* base = static_cast<uint8_t*>(memory->base());
    const uint64_t run = static_cast<uint64_t>(layout.block_stride);
    for (int32_t layer = 0; layer < num_layers; ++layer) {
      for (int32_t kv = 0; kv < 2; ++kv) fn(base + layout.Offset(layer, kv, block, 0, 0), run);
    }
  }
};

BenchPool MakePool(const KvCacheSpec& spec, int n, const std::vector<uint8_t>& data) {
  BenchPool pool;
  auto layout = PoolLayout::For(spec, 2 * n);
  KVCM_CHECK(layout.ok()) << layout.status();
  pool.layout = *layout;
  auto memory = CreateShmPoolMemory(static_cast<uint64_t>(layout->total_bytes),
                                    absl::StrCat("tier-bandwidth-", ::getpid()));
  KVCM_CHECK(memory.ok()) << memory.status();
  pool.memory = *std::move(memory);
  pool.num_layers = spec.num_layers;
  pool.n = n;
  pool.block_bytes = static_cast<uint64_t>(spec.BytesPerBlock());
  std::memset(pool.memory->base(), 0, pool.memory->size_bytes());  // fault every page in now
  for (int i = 0; i < n; ++i) {
    pool.Write(i, data.data() + static_cast<uint64_t>(i) * pool.block_bytes);
  }
  return pool;
}

using Done = cache_manager::tiers::KvTiers::Done;

// Polls `kv` into `done` until `finished()`, waiting on wake_fd between polls as the cache
// manager's socket thread does. The wait is bounded (10 ms) because the disk sync that
// StoreAll waits for posts no result; a load's result always wakes it.
void PollUntil(cache_manager::tiers::KvTiers& kv, std::vector<Done>& done,
               const std::function<bool()>& finished) {
  while (true) {
    kv.Poll(&done);
    if (finished()) return;
    pollfd fd{kv.wake_fd(), POLLIN, 0};
    (void)::poll(&fd, 1, 10);
  }
}

// One KvTiers measured: its mover count, the time its stores took, its best load pass.
struct Loader {
  int movers = 0;
  std::unique_ptr<cache_manager::tiers::KvTiers> kv;
  double store_s = 0;
  double best_s = 1e30;
  uint64_t ticket = 0;
};

// A KvTiers with `options` over `pool` holding blocks [0, n): stored, copied out of the
// pool, written to the tier and, for a disk tier, synced, so that none of that runs during
// a timed load. Null (after a message) when KvTiers::Create fails.
std::unique_ptr<Loader> StoreAll(const cache_manager::tiers::TierOptions& options,
                                 const KvCacheSpec& spec, const BenchPool& pool,
                                 const std::vector<BlockHash>& hashes) {
  auto created = cache_manager::tiers::KvTiers::Create(
      options, spec, HashAlgorithm::kXxh3V2, pool.Access(),
      [](std::string line) { std::printf("tiers: %s\n", line.c_str()); });
  if (!created.ok()) {
    std::fprintf(stderr, "KvTiers::Create: %s\n", created.status().ToString().c_str());
    return nullptr;
  }
  auto loader = std::make_unique<Loader>();
  loader->movers = options.mover_threads;
  loader->kv = *std::move(created);
  cache_manager::tiers::KvTiers& kv = *loader->kv;
  const int n = static_cast<int>(hashes.size());
  std::vector<Done> done;
  const auto start = Clock::now();
  for (int i = 0; i < n; ++i) {
    KVCM_CHECK(kv.WantStore(hashes[static_cast<size_t>(i)]));
    kv.Store(i, hashes[static_cast<size_t>(i)]);
  }
  kv.Flush();
  int released = 0;
  PollUntil(kv, done, [&] {
    for (const Done& d : done) released += d.kind == Done::Kind::kReleased;
    done.clear();
    const cache_manager::tiers::TierSnapshot s = kv.Snapshot();
    return released == n && s.queued_stores == 0 && s.writing[0] == 0 && s.writing[1] == 0 &&
           s.unsynced_writes == 0;
  });
  loader->store_s = Seconds(start);
  KVCM_CHECK(kv.LeadingReady(hashes) == n) << kv.LeadingReady(hashes);
  return loader;
}

// KvTiers::Load of blocks [0, n) into [n, 2n), then Poll until every load is kLoaded; keeps
// the best time.
void TimedLoad(Loader& loader, const std::vector<BlockHash>& hashes) {
  cache_manager::tiers::KvTiers& kv = *loader.kv;
  const int n = static_cast<int>(hashes.size());
  std::vector<Done> done;
  done.reserve(static_cast<size_t>(n));
  const auto start = Clock::now();
  for (int i = 0; i < n; ++i) kv.Load(++loader.ticket, n + i, hashes[static_cast<size_t>(i)]);
  kv.Flush();
  int loaded = 0;
  PollUntil(kv, done, [&] {
    for (const Done& d : done) {
      KVCM_CHECK(d.kind == Done::Kind::kLoaded) << "a load failed: block " << d.block;
      ++loaded;
    }
    done.clear();
    return loaded == n;
  });
  loader.best_s = std::min(loader.best_s, Seconds(start));
}

// One Loader per mover count of --movers, from `options` with mover_threads set.
std::vector<std::unique_ptr<Loader>> StoreAllPerMovers(
    const Flags& flags, const std::function<cache_manager::tiers::TierOptions(int movers)>& options,
    const KvCacheSpec& spec, const BenchPool& pool, const std::vector<BlockHash>& hashes) {
  std::vector<std::unique_ptr<Loader>> loaders;
  for (const int movers : flags.movers) {
    cache_manager::tiers::TierOptions o = options(movers);
    o.mover_threads = movers;
    std::unique_ptr<Loader> loader = StoreAll(o, spec, pool, hashes);
    if (loader == nullptr) return {};
    loaders.push_back(std::move(loader));
  }
  return loaders;
}

std::string MoversName(const char* what, int movers, const char* suffix) {
  return absl::StrCat(what, ", ", movers, movers == 1 ? " mover" : " movers", suffix);
}

// ---- T2 -------------------------------------------------------------------------------

int DiskBench(const Flags& flags, const KvCacheSpec& spec, const std::string& root,
              const std::vector<uint8_t>& data, BenchPool& pool,
              const std::vector<BlockHash>& hashes) {
  const uint64_t block_bytes = static_cast<uint64_t>(spec.BytesPerBlock());
  const int n = flags.blocks;
  const std::string tier_dir = root + "/tier";
  std::array<uint8_t, 16> digest{};
  for (int i = 0; i < 16; ++i) digest[i] = static_cast<uint8_t>(flags.seed >> (i % 8 * 8));
  cache_manager::tiers::DiskTier::Options options;
  options.dir = tier_dir;
  options.block_bytes = block_bytes;
  options.identity = cache_manager::tiers::MakeTierIdentity(digest, spec, HashAlgorithm::kXxh3V2);
  options.direct_io = flags.direct_io;
  const uint64_t slot_bytes = 4096 + (block_bytes + 4095) / 4096 * 4096;
  options.capacity_bytes = static_cast<uint64_t>(n) * slot_bytes;
  auto opened = cache_manager::tiers::DiskTier::Open(options);
  if (!opened.ok()) {
    std::fprintf(stderr, "DiskTier::Open: %s\n", opened.status().ToString().c_str());
    return 1;
  }
  std::unique_ptr<cache_manager::tiers::DiskTier> disk = *std::move(opened);
  KVCM_CHECK(disk->slot_bytes() == slot_bytes) << disk->slot_bytes();
  KVCM_CHECK(disk->num_slots() == n) << disk->num_slots();
  const bool direct = disk->direct_io();

  cache_manager::tiers::SlotBuffer buffer(slot_bytes);
  auto start = Clock::now();
  for (int i = 0; i < n; ++i) {
    std::memcpy(buffer.data(), data.data() + static_cast<uint64_t>(i) * block_bytes, block_bytes);
    const absl::Status written = disk->Write(i, hashes[static_cast<size_t>(i)], i + 1, buffer);
    KVCM_CHECK(written.ok()) << written;
  }
  const double write_s = Seconds(start);
  const std::vector<std::string> tier_files = TierFiles(tier_dir);

  // The real load path: a KvTiers with only a disk tier of n slots per mover count, each in
  // a directory of its own (a tier directory has one owner). The disk tier serves slots
  // only to the model whose bytes it was given: any file does here.
  const std::string model_path = root + "/model.bin";
  std::ofstream(model_path) << "tier bandwidth bench model " << flags.seed << "\n";
  std::vector<std::unique_ptr<Loader>> loaders = StoreAllPerMovers(
      flags,
      [&](int movers) {
        cache_manager::tiers::TierOptions o;
        o.disk_dir = absl::StrCat(root, "/kv-tier-", movers);
        o.disk_bytes = static_cast<uint64_t>(n) * slot_bytes;
        o.model_path = model_path;
        o.direct_io = flags.direct_io;
        // Short, so that StoreAll's wait for the sync after the last write is short.
        o.disk_sync_interval = absl::Milliseconds(50);
        return o;
      },
      spec, pool, hashes);
  if (loaders.empty()) return 1;
  for (const auto& loader : loaders) {
    KVCM_CHECK(loader->kv->Snapshot().slots[1] == n) << loader->kv->Snapshot().slots[1];
  }

  // The baseline's file: as many bytes as DiskTier's slots, written buffered from the same
  // data (repeated: a slot is a little longer than a block).
  const uint64_t total = static_cast<uint64_t>(n) * slot_bytes;
  const std::string base_path = root + "/baseline.bin";
  {
    const int fd = ::open(base_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    KVCM_CHECK(fd >= 0) << base_path << ": " << std::strerror(errno);
    uint64_t done = 0;
    while (done < total) {
      const uint64_t chunk = std::min<uint64_t>(total - done, data.size());
      const ssize_t w = ::pwrite(fd, data.data(), chunk, static_cast<off_t>(done));
      KVCM_CHECK(w > 0) << std::strerror(errno);
      done += static_cast<uint64_t>(w);
    }
    ::close(fd);
  }

  std::printf(
      "\nT2 (disk) load: %d blocks, slot %llu bytes (4096 header + data), %zu files, "
      "O_DIRECT %s\n",
      n, static_cast<unsigned long long>(slot_bytes), tier_files.size(),
      direct ? "yes (tier and baseline)" : "no (buffered: tier and baseline)");
  PrintRow("DiskTier::Write (informative, not synced)", total, write_s);
  for (const auto& loader : loaders) {
    PrintRow(MoversName("informative: KvTiers store + sync", loader->movers, "").c_str(), total,
             loader->store_s);
  }

  Aligned base_buffer(slot_bytes);
  double best_read = 1e30, best_base = 1e30, best_hash = 1e30;
  bool dropped = true;
  for (int rep = 0; rep < flags.reps; ++rep) {
    for (const auto& loader : loaders) {
      for (const std::string& f : TierFiles(loader->kv->options().disk_dir)) {
        dropped &= DropFromPageCache(f);
      }
      const uint64_t read_before = loader->kv->Snapshot().counters.bytes_read;
      TimedLoad(*loader, hashes);
      KVCM_CHECK(loader->kv->Snapshot().counters.bytes_read - read_before == total);
      if (rep == 0) pool.CheckLoaded(data, "T2 load");
    }

    // DiskTier::Read alone, on this thread: the read and its verification, nothing beside.
    for (const std::string& f : tier_files) dropped &= DropFromPageCache(f);
    const uint64_t read_before = disk->bytes_read();
    start = Clock::now();
    for (int i = 0; i < n; ++i) {
      cache_manager::tiers::Refusal refusal = cache_manager::tiers::Refusal::kIoError;
      const absl::Status read = disk->Read(i, hashes[static_cast<size_t>(i)], buffer, &refusal);
      KVCM_CHECK(read.ok()) << "slot " << i << ": " << read << " ("
                            << cache_manager::tiers::RefusalName(refusal) << ")";
    }
    best_read = std::min(best_read, Seconds(start));
    KVCM_CHECK(disk->bytes_read() - read_before == total);
    // The last block read back is the one written.
    KVCM_CHECK(std::memcmp(buffer.data(), data.data() + static_cast<uint64_t>(n - 1) * block_bytes,
                           block_bytes) == 0);

    dropped &= DropFromPageCache(base_path);
    const int fd = ::open(base_path.c_str(), O_RDONLY | O_CLOEXEC | (direct ? O_DIRECT : 0));
    KVCM_CHECK(fd >= 0) << base_path << ": " << std::strerror(errno);
    start = Clock::now();
    uint64_t done = 0;
    while (done < total) {
      const uint64_t chunk = std::min<uint64_t>(slot_bytes, total - done);
      const ssize_t r = ::pread(fd, base_buffer.p, chunk, static_cast<off_t>(done));
      KVCM_CHECK(r > 0) << "pread: " << std::strerror(errno);
      done += static_cast<uint64_t>(r);
    }
    best_base = std::min(best_base, Seconds(start));
    ::close(fd);

    // What Read adds to its pread: the data's XXH3-64, on the same thread, after the read.
    start = Clock::now();
    uint64_t sum = 0;
    for (int i = 0; i < n; ++i) {
      sum += XXH3_64bits(data.data() + static_cast<uint64_t>(i) * block_bytes, block_bytes);
    }
    best_hash = std::min(best_hash, Seconds(start));
    KVCM_CHECK(sum != 1);  // keeps the loop
  }
  std::printf("  page cache dropped before every pass (fsync + POSIX_FADV_DONTNEED): %s\n",
              dropped ? "yes" : "refused by the kernel for some file (best effort)");
  for (const auto& loader : loaders) {
    PrintRow(MoversName("KvTiers::Load T2 -> pool", loader->movers, " (best)").c_str(), total,
             loader->best_s);
  }
  PrintRow("baseline: sequential pread (best of reps)", total, best_base);
  PrintRow("informative: DiskTier::Read alone, 1 thread", total, best_read);
  PrintRow("informative: XXH3-64 of the data in memory", static_cast<uint64_t>(n) * block_bytes,
           best_hash);
  for (const auto& loader : loaders) {
    PrintRatio(MoversName("T2 load / pread", loader->movers, "").c_str(), total / loader->best_s,
               total / best_base, 0.8);
  }
  std::printf("  %-44s ratio %.2f (informative)\n", "DiskTier::Read alone / pread",
              best_base / best_read);
  loaders.clear();
  disk.reset();
  return 0;
}

// ---- T1 -------------------------------------------------------------------------------

int HostBench(const Flags& flags, const KvCacheSpec& spec, const std::vector<uint8_t>& data,
              BenchPool& pool, const std::vector<BlockHash>& hashes) {
  const uint64_t block_bytes = static_cast<uint64_t>(spec.BytesPerBlock());
  const int n = flags.blocks;
  const uint64_t total = static_cast<uint64_t>(n) * block_bytes;
  std::vector<std::unique_ptr<Loader>> loaders = StoreAllPerMovers(
      flags,
      [&](int) {
        cache_manager::tiers::TierOptions o;
        o.host_bytes = total;
        return o;
      },
      spec, pool, hashes);
  if (loaders.empty()) return 1;

  std::printf("\nT1 (host) load: %d blocks of %llu bytes (%d runs of %lld bytes in the pool)\n", n,
              static_cast<unsigned long long>(block_bytes), 2 * spec.num_layers,
              static_cast<long long>(pool.layout.block_stride));
  for (const auto& loader : loaders) {
    PrintRow(MoversName("informative: KvTiers store -> T1", loader->movers, "").c_str(), total,
             loader->store_s);
  }

  Aligned dst(total);
  double best_base = 1e30;
  for (int rep = 0; rep < flags.reps; ++rep) {
    for (const auto& loader : loaders) {
      TimedLoad(*loader, hashes);
      if (rep == 0) pool.CheckLoaded(data, "T1 load");
    }

    const auto start = Clock::now();
    for (int i = 0; i < n; ++i) {
      const uint64_t at = static_cast<uint64_t>(i) * block_bytes;
      std::memcpy(dst.p + at, data.data() + at, block_bytes);
    }
    best_base = std::min(best_base, Seconds(start));
    KVCM_CHECK(std::memcmp(dst.p, data.data(), block_bytes) == 0);
  }
  for (const auto& loader : loaders) {
    PrintRow(MoversName("KvTiers::Load T1 -> pool", loader->movers, " (best)").c_str(), total,
             loader->best_s);
  }
  PrintRow("baseline: memcpy per block (best of reps)", total, best_base);
  for (const auto& loader : loaders) {
    PrintRatio(MoversName("T1 load / memcpy", loader->movers, "").c_str(), total / loader->best_s,
               total / best_base, 0.8);
  }
  return 0;
}

int Main(int argc, char** argv) {
  Flags flags;
  const char* tmpdir = std::getenv("TMPDIR");
  flags.dir = tmpdir != nullptr && *tmpdir != '\0' ? tmpdir : "/tmp";
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    auto value = [&]() -> std::string {
      KVCM_CHECK(i + 1 < argc) << arg << " needs a value";
      return argv[++i];
    };
    if (arg == "--dir") {
      flags.dir = value();
    } else if (arg == "--blocks") {
      flags.blocks = std::atoi(value().c_str());
    } else if (arg == "--reps") {
      flags.reps = std::atoi(value().c_str());
    } else if (arg == "--seed") {
      flags.seed = std::strtoull(value().c_str(), nullptr, 10);
    } else if (arg == "--movers") {
      flags.movers.clear();
      for (const absl::string_view m : absl::StrSplit(value(), ',')) {
        int movers = 0;
        KVCM_CHECK(absl::SimpleAtoi(m, &movers) && movers > 0) << "--movers: " << m;
        flags.movers.push_back(movers);
      }
    } else if (arg == "--buffered") {
      flags.direct_io = false;
    } else {
      std::fprintf(stderr,
                   "usage: %s [--dir DIR] [--blocks N] [--reps R] [--seed S] "
                   "[--movers M[,M...]] [--buffered]\n",
                   argv[0]);
      return 2;
    }
  }
  KVCM_CHECK(flags.blocks > 0 && flags.reps > 0 && !flags.movers.empty());
  std::setvbuf(stdout, nullptr, _IOLBF, 0);

  const KvCacheSpec spec = SmolLm2Spec();
  KVCM_CHECK(spec.Validate().ok());
  const uint64_t block_bytes = static_cast<uint64_t>(spec.BytesPerBlock());

  std::string pattern = flags.dir + "/kvcm-tier-bench-XXXXXX";
  if (::mkdtemp(pattern.data()) == nullptr) {
    std::fprintf(stderr, "mkdtemp %s: %s\n", pattern.c_str(), std::strerror(errno));
    return 1;
  }
  const std::string root = pattern;

  std::printf("cpu: %s (%ld online)\n", bench::CpuModel().c_str(), ::sysconf(_SC_NPROCESSORS_ONLN));
  std::printf("directory: %s on %s\n", root.c_str(), FileSystem(root).c_str());
  std::printf("blocks: %d x %llu bytes (%s), seed %llu, best of %d reps\n", flags.blocks,
              static_cast<unsigned long long>(block_bytes), spec.ToString().c_str(),
              static_cast<unsigned long long>(flags.seed), flags.reps);

  std::vector<uint8_t> data(static_cast<uint64_t>(flags.blocks) * block_bytes);
  {
    std::mt19937_64 random(flags.seed);
    for (size_t i = 0; i + 8 <= data.size(); i += 8) {
      const uint64_t word = random();
      std::memcpy(data.data() + i, &word, 8);
    }
  }

  BenchPool pool = MakePool(spec, flags.blocks, data);
  std::vector<BlockHash> hashes;
  for (int i = 0; i < flags.blocks; ++i) hashes.push_back(HashOf(flags.seed, i));
  int rc = DiskBench(flags, spec, root, data, pool, hashes);
  if (rc == 0) rc = HostBench(flags, spec, data, pool, hashes);
  std::error_code ignored;
  std::filesystem::remove_all(root, ignored);
  return rc;
}

}  // namespace
}  // namespace kvcm

int main(int argc, char** argv) { return kvcm::Main(argc, argv); }
