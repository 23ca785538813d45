#pragma once
// DiskTier: the disk tier (T2) of the KV cache (docs/architecture.md, "Tiers"): a few large
// preallocated files of fixed block slots in one directory, kept across restarts of every
// process, every slot verified when it is read back.
//
// Files: DIR/tier-0.kvcm, DIR/tier-1.kvcm, ... (Options::files of them), each
// slots_per_file x slot_bytes long, preallocated with fallocate (posix_fallocate where the
// file system has no fallocate). A slot is one 4096-byte header and the block's bytes,
// rounded up to a multiple of 4096, so that every slot starts and ends on a 4 KiB boundary
// and can be read and written with O_DIRECT. O_DIRECT is used where the file system takes
// it (open() refuses it on tmpfs: then buffered I/O, direct_io() false).
//
// Slot header (little-endian, version 2), at the slot's offset 0:
//   [0, 8)     magic "KVCMSLOT"
//   [8, 12)    u32 format version (2)
//   [12, 16)   u32 C: header bytes covered by the header checksum (= 128 + 4 x tokens)
//   [16, 32)   identity (TierIdentity: the model's bytes, the KV layout, the hash algorithm)
//   [32, 64)   the block's hash (BlockHash bytes)
//   [64, 72)   u64 serial: a counter the writer increases at every write (newest wins)
//   [72, 80)   u64 data bytes (= block_bytes)
//   [80, 88)   u64 XXH3-64 (seed 0) of the data bytes
//   [88, 120)  the parent block's hash (zero for a chain's first block)
//   [120, 124) u32 flags: bit 0 set when the block has a parent
//   [124, 128) u32 token count (0, or the block size)
//   [128, C)   the block's token ids, i32 each (BlockLineage: what the vLLM-format events
//              announce of a block after a restart)
//   [C, C + 8) u64 XXH3-64 (seed 0) of bytes [0, C)
//   rest of the 4096 bytes zero. A version 1 header (kvcm's first format, whose checksum
// sits at [120, 128)) is refused as another identity.
// A slot is written with one pwrite of header and data together. A write torn by a crash
// (SIGKILL mid-write, a power cut), a flipped byte, a truncated file or a file of another
// model fails the header's or the data's checksum or the identity, and is never served.
//
// The directory has one owner: Open() takes an exclusive flock on DIR/tier.lock and writes
// its pid there; a second owner gets ALREADY_EXISTS naming the holder's pid. The kernel
// drops the lock when the holder dies.
//
// Thread safety: after Open(), Write, Read and Invalidate may be called from several
// threads at once for different slots; the caller (the tier table) never hands one slot to
// two calls at a time. Sync may run beside them. The counters are atomics.

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/base/unique_fd.h"
#include "common/block/block_hash.h"
#include "common/sizing/kv_cache_spec.h"

namespace kvcm::cache_manager::tiers {

// What a block's slot says of its place in the prefix chain and its tokens, so that the
// vLLM-format events can announce it (services/cache_manager/vllm_conversion.h) after a
// restart. Tokens are empty when the commit carried none (the router sends them only while
// the vLLM-format stream is on).
struct BlockLineage {
  BlockHash parent;
  bool has_parent = false;
  std::vector<int32_t> tokens;
};
// The most token ids a slot header holds; a longer block's are not kept.
inline constexpr size_t kMaxSlotTokens = (4096 - 128 - 8) / 4;

// What a slot must carry to be served: XXH3-128 (canonical, big-endian) of
//   "kvcm.tier.v1" || model digest (16 bytes) || i32 num_layers || i32 num_kv_heads ||
//   i32 head_dim || i32 dtype (DType's value) || i32 block_size || u8 hash algorithm
// A block's hash already depends on the salt (the chain's root is RootHash(salt)), so a
// block written under another salt has another hash and is never looked up.
using TierIdentity = std::array<uint8_t, 16>;
TierIdentity MakeTierIdentity(const std::array<uint8_t, 16>& model_digest, const KvCacheSpec& spec,
                              HashAlgorithm algorithm);

// XXH3-128 of a model's bytes: for a regular file (a GGUF), "file" || u64 size || the
// bytes; for a directory, every regular file directly in it whose name ends in
// ".safetensors", ".gguf", ".bin", ".json", ".model" or ".txt" (weights, config, tokenizer),
// by name in byte order, each as u32 len(name) || name || u64 size || the bytes.
// Hashing a 16 GB model takes a while, so the digest is kept in `cache_file` (one line per
// file: "digest-v1 <path> <size> <mtime ns> <inode> <32 hex digits>", where the key of a
// directory is the newest mtime, the sum of sizes and the directory's inode) and reused
// while the key matches. `cache_file` may be empty (no cache); an unwritable cache is not an
// error. NOT_FOUND for a path that does not exist; INTERNAL with errno text on read errors.
absl::StatusOr<std::array<uint8_t, 16>> ModelDigest(const std::string& model_path,
                                                    const std::string& cache_file);

// Why a slot was not served, for the metrics (kvcm_cache_manager_tier_refusals_total) and
// the log (each reason logged once).
enum class Refusal : uint8_t {
  kBadHeader,      // magic, version or header checksum wrong: torn or overwritten header
  kOtherIdentity,  // written for another model, KV layout or hash algorithm
  kChecksum,       // the data does not match its checksum (a flipped byte, a torn write)
  kTruncated,      // the slot lies (partly) past the end of its file
  kWrongHash,      // the header names another block than the index expected
  kIoError,        // pread/pwrite failed
};
inline constexpr int kNumRefusals = 6;
// "bad_header", "other_identity", "checksum", "truncated", "wrong_hash", "io_error".
std::string_view RefusalName(Refusal refusal);

// A buffer for one slot, aligned for O_DIRECT: the header's 4096 bytes, then the data.
class SlotBuffer {
 public:
  explicit SlotBuffer(uint64_t slot_bytes);  // REQUIRES: a multiple of 4096
  ~SlotBuffer();
  SlotBuffer(const SlotBuffer&) = delete;
  SlotBuffer& operator=(const SlotBuffer&) = delete;

  uint8_t* slot() { return slot_; }         // slot_bytes, 4096-aligned
  uint8_t* data() { return slot_ + 4096; }  // the block's bytes
  const uint8_t* data() const { return slot_ + 4096; }
  uint64_t slot_bytes() const { return slot_bytes_; }

 private:
  uint8_t* slot_ = nullptr;
  uint64_t slot_bytes_ = 0;
};

class DiskTier {
 public:
  struct Options {
    std::string dir;              // created (mode 0700) when missing
    uint64_t capacity_bytes = 0;  // slots = capacity_bytes / slot_bytes, at least 1
    uint64_t block_bytes = 0;     // KvCacheSpec::BytesPerBlock(); > 0
    TierIdentity identity{};
    int32_t files = 4;      // at most; fewer when there are fewer slots
    bool direct_io = true;  // try O_DIRECT
  };

  // A slot found valid at Open(): header magic, version, checksum and identity right. Its
  // data is checked at every Read.
  struct Recovered {
    int32_t slot = 0;
    BlockHash hash;
    uint64_t serial = 0;
    BlockLineage lineage;
  };

  // What Open() found, counted by reason (empty slots, all zeros, are not refusals).
  struct OpenReport {
    int32_t slots = 0;
    int32_t recovered = 0;
    int32_t empty = 0;
    std::array<int32_t, kNumRefusals> refused{};  // by Refusal
    uint64_t max_serial = 0;  // the highest serial found; writes continue above it
    bool direct_io = false;
    double seconds = 0;  // how long the scan took
  };

  // Locks the directory, creates or resizes the files (a truncated file is extended again;
  // the slots it lost read as empty, counted kTruncated if their header was cut), reads
  // every slot's header and keeps the valid ones (the newest serial when two name the same
  // hash; the other is counted as kWrongHash and reusable).
  // Errors: ALREADY_EXISTS "disk tier directory DIR is in use by pid N"; PERMISSION_DENIED
  // or INTERNAL naming the directory when it cannot be created, locked or written;
  // RESOURCE_EXHAUSTED when the files cannot be preallocated (ENOSPC), naming the bytes;
  // INVALID_ARGUMENT for options that make no sense.
  static absl::StatusOr<std::unique_ptr<DiskTier>> Open(const Options& options);
  ~DiskTier();

  int32_t num_slots() const { return num_slots_; }
  uint64_t slot_bytes() const { return slot_bytes_; }
  uint64_t block_bytes() const { return options_.block_bytes; }
  bool direct_io() const { return direct_io_; }
  const OpenReport& open_report() const { return report_; }
  // The valid slots found at Open(), by ascending slot.
  const std::vector<Recovered>& recovered() const { return recovered_; }

  // Writes `buffer.data()` (block_bytes) as block `hash` into `slot`, with a header carrying
  // `serial` and `lineage` (its tokens only when they fit, kMaxSlotTokens): fills the header
  // in `buffer` and writes the whole slot with one pwrite.
  // RESOURCE_EXHAUSTED on ENOSPC or EFBIG (the disk is full), INTERNAL on other errors.
  absl::Status Write(int32_t slot, const BlockHash& hash, uint64_t serial, SlotBuffer& buffer,
                     const BlockLineage& lineage = {});

  // Reads `slot` into `buffer` and verifies it: header checksum and magic, identity, that it
  // names `hash`, the data's length and checksum. DATA_LOSS with *refusal set when any check
  // fails (the caller must not use the data), INTERNAL (*refusal kIoError) on read errors.
  absl::Status Read(int32_t slot, const BlockHash& hash, SlotBuffer& buffer, Refusal* refusal);
  // Read in two halves, for a caller that keeps several reads in flight itself (KvTiers'
  // movers, through ReadQueue): where `slot` lies (read slot_bytes() at `offset` of `fd`
  // into buffer.slot()), then the checks Read makes of what that read gave. `read` is its
  // result, bytes or -errno; a short read is continued here with pread. Statuses as Read's.
  struct Extent {
    int fd = -1;
    uint64_t offset = 0;
  };
  absl::StatusOr<Extent> ExtentOf(int32_t slot, const SlotBuffer& buffer) const;
  absl::Status Verify(int32_t slot, const BlockHash& hash, SlotBuffer& buffer, int64_t read,
                      Refusal* refusal);

  // Zeroes the slot's header, so that a slot being reused is not found again after a crash
  // before its new contents are written. INTERNAL on errors.
  absl::Status Invalidate(int32_t slot);

  // Bytes written and read by Write and Read (slot bytes), for the metrics.
  uint64_t bytes_written() const { return bytes_written_.load(std::memory_order_relaxed); }
  uint64_t bytes_read() const { return bytes_read_.load(std::memory_order_relaxed); }

  // fdatasync of every file: makes every Write and Invalidate that returned before the call
  // durable across a node's crash, not only a process's. A write into a fallocate'd file's
  // unwritten extent changes the file's extent map, which O_DIRECT does not make durable (nor
  // does buffered I/O, whose data waits in the page cache): without it a power cut may lose,
  // or read as zeros, a slot that a SIGKILL would have left whole. May be called from any
  // thread, also during writes (those it does not cover stay unsynced). INTERNAL naming the
  // first file that failed (the others are synced all the same); every failed file counted
  // in sync_errors(), and synced_writes() not advanced, so the next Sync() tries again.
  absl::Status Sync();
  // Writes (Write and Invalidate) that succeeded since Open(), and how many of them the last
  // successful Sync() covered: writes() - synced_writes() slots may not survive a node's
  // crash. syncs(): successful Sync() calls; sync_errors(): files whose fdatasync failed.
  uint64_t writes() const { return writes_.load(std::memory_order_acquire); }
  uint64_t synced_writes() const { return synced_writes_.load(std::memory_order_acquire); }
  uint64_t syncs() const { return syncs_.load(std::memory_order_relaxed); }
  uint64_t sync_errors() const { return sync_errors_.load(std::memory_order_relaxed); }

 private:
  explicit DiskTier(const Options& options) : options_(options) {}
  // Open()'s steps: opens and sizes the files, then reads every slot's header.
  // `old_sizes` are the files' sizes before they were extended.
  absl::Status OpenFiles(int32_t files);
  void ScanHeaders(const std::vector<uint64_t>& old_sizes);

  Options options_;
  UniqueFd lock_;
  std::vector<UniqueFd> files_;
  int32_t slots_per_file_ = 0;
  int32_t num_slots_ = 0;
  uint64_t slot_bytes_ = 0;
  bool direct_io_ = false;
  OpenReport report_;
  std::vector<Recovered> recovered_;
  std::atomic<uint64_t> bytes_written_{0};
  std::atomic<uint64_t> bytes_read_{0};
  std::atomic<uint64_t> writes_{0};
  std::atomic<uint64_t> synced_writes_{0};
  std::atomic<uint64_t> syncs_{0};
  std::atomic<uint64_t> sync_errors_{0};
};

}  // namespace kvcm::cache_manager::tiers
