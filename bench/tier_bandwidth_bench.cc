// Load bandwidth of the tiers below the pool (docs/PERFORMANCE.md, "Tier bandwidth"), each
// beside a baseline measured in the same run:
//
//   T2  DiskTier::Read (header, identity and XXH3 checksum verified) of N blocks written by
//       DiskTier::Write, then dropped from the page cache (fsync + POSIX_FADV_DONTNEED on
//       each tier file, best effort); baseline: a plain sequential pread, one slot's bytes a
//       call, of as many bytes from one file of the same size in the same directory, also
//       dropped from the page cache first, into a 4 KiB-aligned buffer, with O_DIRECT when
//       DiskTier used it.
//   T1  KvTiers with only a host tier: N blocks stored from a shm pool, then loaded back
//       into other pool blocks (KvTiers::Load, then Poll until every load is kLoaded,
//       waiting on wake_fd with poll(2)); baseline: memcpy of the same bytes, one block's
//       bytes a call, between two buffers.
// An informative row times the XXH3-64 that DiskTier::Read computes after its pread.
//
// The ratio is the tier's bytes/s over the baseline's (goal >= 0.8). Each side takes the
// best of --reps repetitions (3), interleaved. The data is drawn from a fixed seed (printed).
//
//   build/bench/tier_bandwidth_bench [--dir DIR] [--blocks N] [--reps R] [--seed S]
//                                    [--movers M] [--buffered]
//
// DIR defaults to $TMPDIR (else /tmp); the benchmark works in a fresh directory under it and
// removes it at the end. Blocks have the bundled SmolLM2-135M's shape: 30 layers x 3 KV
// heads x head dim 64, bf16, block size 16 = 368,640 bytes.

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

#include "absl/strings/str_cat.h"
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
    case 0xEF53: name = "ext2/ext3/ext4"; break;
    case 0x01021994: name = "tmpfs"; break;
    case 0x58465342: name = "xfs"; break;
    case 0x9123683E: name = "btrfs"; break;
    case 0x794C7630: name = "overlayfs"; break;
    case 0x6969: name = "nfs"; break;
    case 0x2FC12FC1: name = "zfs"; break;
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
  int movers = 1;
  bool direct_io = true;
};

// ---- T2 -------------------------------------------------------------------------------

int DiskBench(const Flags& flags, const KvCacheSpec& spec, const std::string& root,
              const std::vector<uint8_t>& data) {
  const uint64_t block_bytes = static_cast<uint64_t>(spec.BytesPerBlock());
  const int n = flags.blocks;
  const std::string tier_dir = root + "/tier";
  std::array<uint8_t, 16> digest{};
  for (int i = 0; i < 16; ++i) digest[i] = static_cast<uint8_t>(flags.seed >> (i % 8 * 8));
  tiers::DiskTier::Options options;
  options.dir = tier_dir;
  options.block_bytes = block_bytes;
  options.identity = tiers::MakeTierIdentity(digest, spec, HashAlgorithm::kXxh3V2);
  options.direct_io = flags.direct_io;
  const uint64_t slot_bytes = 4096 + (block_bytes + 4095) / 4096 * 4096;
  options.capacity_bytes = static_cast<uint64_t>(n) * slot_bytes;
  auto opened = tiers::DiskTier::Open(options);
  if (!opened.ok()) {
    std::fprintf(stderr, "DiskTier::Open: %s\n", opened.status().ToString().c_str());
    return 1;
  }
  std::unique_ptr<tiers::DiskTier> disk = *std::move(opened);
  KVCM_CHECK(disk->slot_bytes() == slot_bytes) << disk->slot_bytes();
  KVCM_CHECK(disk->num_slots() == n) << disk->num_slots();
  const bool direct = disk->direct_io();

  tiers::SlotBuffer buffer(slot_bytes);
  auto start = Clock::now();
  for (int i = 0; i < n; ++i) {
    std::memcpy(buffer.data(), data.data() + static_cast<uint64_t>(i) * block_bytes,
                block_bytes);
    const absl::Status written = disk->Write(i, HashOf(flags.seed, i), i + 1, buffer);
    KVCM_CHECK(written.ok()) << written;
  }
  const double write_s = Seconds(start);

  // The tier's files, to drop from the page cache.
  std::vector<std::string> tier_files;
  for (const auto& entry : std::filesystem::directory_iterator(tier_dir)) {
    if (entry.path().extension() == ".kvcm") tier_files.push_back(entry.path().string());
  }
  std::sort(tier_files.begin(), tier_files.end());

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

  std::printf("\nT2 (disk) load: %d blocks, slot %llu bytes (4096 header + data), %zu files, "
              "O_DIRECT %s\n",
              n, static_cast<unsigned long long>(slot_bytes), tier_files.size(),
              direct ? "yes (tier and baseline)" : "no (buffered: tier and baseline)");
  PrintRow("DiskTier::Write (informative, not synced)", total, write_s);

  Aligned base_buffer(slot_bytes);
  double best_tier = 1e30, best_base = 1e30, best_hash = 1e30;
  bool dropped = true;
  uint64_t tier_bytes = 0;
  for (int rep = 0; rep < flags.reps; ++rep) {
    for (const std::string& f : tier_files) dropped &= DropFromPageCache(f);
    const uint64_t read_before = disk->bytes_read();
    start = Clock::now();
    for (int i = 0; i < n; ++i) {
      tiers::Refusal refusal = tiers::Refusal::kIoError;
      const absl::Status read = disk->Read(i, HashOf(flags.seed, i), buffer, &refusal);
      KVCM_CHECK(read.ok()) << "slot " << i << ": " << read << " ("
                            << tiers::RefusalName(refusal) << ")";
    }
    best_tier = std::min(best_tier, Seconds(start));
    tier_bytes = disk->bytes_read() - read_before;
    // The last block read back is the one written.
    KVCM_CHECK(std::memcmp(buffer.data(),
                           data.data() + static_cast<uint64_t>(n - 1) * block_bytes,
                           block_bytes) == 0);

    dropped &= DropFromPageCache(base_path);
    const int fd = ::open(base_path.c_str(), O_RDONLY | O_CLOEXEC | (direct ? O_DIRECT : 0));
    KVCM_CHECK(fd >= 0) << base_path << ": " << std::strerror(errno);
    start = Clock::now();
    uint64_t done = 0;
    while (done < tier_bytes) {
      const uint64_t chunk = std::min<uint64_t>(slot_bytes, tier_bytes - done);
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
  PrintRow("DiskTier::Read, verified (best of reps)", tier_bytes, best_tier);
  PrintRow("baseline: sequential pread (best of reps)", tier_bytes, best_base);
  PrintRow("informative: XXH3-64 of the data in memory", static_cast<uint64_t>(n) * block_bytes,
           best_hash);
  PrintRatio("T2 load / pread", tier_bytes / best_tier, tier_bytes / best_base, 0.8);
  disk.reset();
  return 0;
}

// ---- T1 -------------------------------------------------------------------------------

// Pool block `block`'s bytes in a tier slot's order (layer, K|V) to or from `bytes`.
void CopyBlock(PoolMemory& memory, const PoolLayout& layout, int32_t layers, BlockId block,
               uint8_t* bytes, bool to_pool) {
  auto* base = static_cast<uint8_t*>(memory.base());
  const uint64_t run = static_cast<uint64_t>(layout.block_stride);
  for (int32_t layer = 0; layer < layers; ++layer) {
    for (int32_t kv = 0; kv < 2; ++kv) {
      uint8_t* at = base + layout.Offset(layer, kv, block, 0, 0);
      if (to_pool) {
        std::memcpy(at, bytes, run);
      } else {
        std::memcpy(bytes, at, run);
      }
      bytes += run;
    }
  }
}

int HostBench(const Flags& flags, const KvCacheSpec& spec, std::vector<uint8_t>& data) {
  const uint64_t block_bytes = static_cast<uint64_t>(spec.BytesPerBlock());
  const int n = flags.blocks;
  // Blocks [0, n) are stored; loads go to [n, 2n).
  auto layout = PoolLayout::For(spec, 2 * n);
  KVCM_CHECK(layout.ok()) << layout.status();
  auto memory = CreateShmPoolMemory(static_cast<uint64_t>(layout->total_bytes),
                                    absl::StrCat("tier-bandwidth-", ::getpid()));
  KVCM_CHECK(memory.ok()) << memory.status();
  std::memset((*memory)->base(), 0, (*memory)->size_bytes());  // fault every page in now
  for (int i = 0; i < n; ++i) {
    CopyBlock(**memory, *layout, spec.num_layers, i,
              data.data() + static_cast<uint64_t>(i) * block_bytes, true);
  }

  tiers::TierOptions options;
  options.host_bytes = static_cast<uint64_t>(n) * block_bytes;
  options.mover_threads = flags.movers;
  auto created = tiers::KvTiers::Create(
      options, spec, HashAlgorithm::kXxh3V2,
      {memory->get(), *layout, spec.num_layers},
      [](std::string line) { std::printf("tiers: %s\n", line.c_str()); });
  if (!created.ok()) {
    std::fprintf(stderr, "KvTiers::Create: %s\n", created.status().ToString().c_str());
    return 1;
  }
  std::unique_ptr<tiers::KvTiers> kv = *std::move(created);
  using Done = tiers::KvTiers::Done;
  std::vector<Done> done;
  auto wait = [&](const std::function<bool()>& finished) {
    while (true) {
      kv->Poll(&done);
      if (finished()) return;
      pollfd fd{kv->wake_fd(), POLLIN, 0};
      (void)::poll(&fd, 1, 1000);
    }
  };

  auto start = Clock::now();
  for (int i = 0; i < n; ++i) {
    KVCM_CHECK(kv->WantStore(HashOf(flags.seed, i)));
    kv->Store(i, HashOf(flags.seed, i));
  }
  kv->Flush();
  int released = 0;
  wait([&] {
    for (const Done& d : done) released += d.kind == Done::Kind::kReleased;
    done.clear();
    const tiers::TierSnapshot s = kv->Snapshot();
    return released == n && s.queued_stores == 0 && s.writing[0] == 0;
  });
  const double store_s = Seconds(start);
  std::vector<BlockHash> hashes;
  for (int i = 0; i < n; ++i) hashes.push_back(HashOf(flags.seed, i));
  KVCM_CHECK(kv->LeadingReady(hashes) == n) << kv->LeadingReady(hashes);

  const uint64_t total = static_cast<uint64_t>(n) * block_bytes;
  std::printf("\nT1 (host) load: %d blocks of %llu bytes (%d runs of %lld bytes in the pool), "
              "%d mover thread(s)\n",
              n, static_cast<unsigned long long>(block_bytes), 2 * spec.num_layers,
              static_cast<long long>(layout->block_stride), flags.movers);
  PrintRow("KvTiers store, pool -> T1 (informative)", total, store_s);

  Aligned dst(total);
  double best_tier = 1e30, best_base = 1e30;
  uint64_t ticket = 0;
  for (int rep = 0; rep < flags.reps; ++rep) {
    start = Clock::now();
    for (int i = 0; i < n; ++i) kv->Load(++ticket, n + i, hashes[static_cast<size_t>(i)]);
    kv->Flush();
    int loaded = 0;
    wait([&] {
      for (const Done& d : done) {
        KVCM_CHECK(d.kind == Done::Kind::kLoaded) << "a load failed: block " << d.block;
        ++loaded;
      }
      done.clear();
      return loaded == n;
    });
    best_tier = std::min(best_tier, Seconds(start));
    if (rep == 0) {  // byte for byte, outside the clock
      std::vector<uint8_t> got(block_bytes);
      for (int i = 0; i < n; ++i) {
        CopyBlock(**memory, *layout, spec.num_layers, n + i, got.data(), false);
        KVCM_CHECK(std::memcmp(got.data(), data.data() + static_cast<uint64_t>(i) * block_bytes,
                               block_bytes) == 0)
            << "block " << i << " loaded wrong bytes";
      }
    }

    start = Clock::now();
    for (int i = 0; i < n; ++i) {
      const uint64_t at = static_cast<uint64_t>(i) * block_bytes;
      std::memcpy(dst.p + at, data.data() + at, block_bytes);
    }
    best_base = std::min(best_base, Seconds(start));
    KVCM_CHECK(std::memcmp(dst.p, data.data(), block_bytes) == 0);
  }
  PrintRow("KvTiers::Load T1 -> pool (best of reps)", total, best_tier);
  PrintRow("baseline: memcpy per block (best of reps)", total, best_base);
  PrintRatio("T1 load / memcpy", total / best_tier, total / best_base, 0.8);
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
      flags.movers = std::atoi(value().c_str());
    } else if (arg == "--buffered") {
      flags.direct_io = false;
    } else {
      std::fprintf(stderr,
                   "usage: %s [--dir DIR] [--blocks N] [--reps R] [--seed S] [--movers M] "
                   "[--buffered]\n",
                   argv[0]);
      return 2;
    }
  }
  KVCM_CHECK(flags.blocks > 0 && flags.reps > 0 && flags.movers > 0);
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

  int rc = DiskBench(flags, spec, root, data);
  if (rc == 0) rc = HostBench(flags, spec, data);
  std::error_code ignored;
  std::filesystem::remove_all(root, ignored);
  return rc;
}

}  // namespace
}  // namespace kvcm

int main(int argc, char** argv) { return kvcm::Main(argc, argv); }
