#pragma once
// KvTiers: the host-memory tier (T1) and the disk tier (T2) below the pool (T0), and the
// mover threads that copy blocks between them (docs/architecture.md, "Tiers").
//
// What it keeps: an index from block hash to the slots that hold the block's bytes, one per
// tier, each either being written or ready. The index, the slots' LRU order and every
// decision are the ledger thread's (the cache manager's socket thread); the bytes are the
// mover threads'. The two meet only in a job queue and a result queue (one mutex), and an
// eventfd that wakes the ledger thread when results wait.
//
// - Store(block, hash): write-through. A block that entered the prefix index is copied out
//   of the pool by a mover into a T1 slot and, from there, into a T2 slot, unless the tiers
//   hold its hash already. The caller holds the pool block (BlockLedger::Hold) until Poll
//   reports kReleased, which comes as soon as the bytes are out of the pool, before the disk
//   write. A full tier reuses its least recently used ready slot; a slot being read is never
//   reused.
// - Load(ticket, block, hash): the bytes of `hash`, from T1 if it holds them, else from T2
//   (verified: DiskTier::Read), into the pool block `block`, which the caller took for it
//   and makes matchable only after Poll reports kLoaded. A T2 slot that fails verification
//   is dropped from the index and counted by reason. A mover keeps up to
//   TierOptions::disk_read_depth T2 reads in flight (ReadQueue: io_uring), verifying and
//   copying one block while the disk reads the next.
// - Jobs run loads first (a request waits for them), then stores, in order.
//
// Why write-through and not demotion at eviction: a block evicted from the pool would have
// to be copied before its block is handed out, which puts a tier on the step path; and a
// block written only at eviction is lost when the cache manager is killed, while the disk
// tier must keep what was computed before a crash. Every stored block is thus on disk a
// bounded time after its commit (the mover's queue), and durable across a crash of the
// machine within options().disk_sync_interval more (SyncIfDue: DiskTier::Sync on a mover).
//
// The copies (docs/architecture.md, "Tiers", the CUDA path): each mover has a PoolCopier
// (common/memory/pool_copier.h): memcpy beside a shm pool; beside a cuda pool,
// cudaMemcpyAsync of a block's runs on the mover's own stream and one wait, into T1's
// page-locked memory, and disk reads and writes staged through a page-locked slot buffer.
// The cache manager allocated the pool, so it may copy into it.
//
// Thread safety: every public method but wake_fd() is for the ledger thread only.

#include <sys/types.h>

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/base/unique_fd.h"
#include "common/block/block_hash.h"
#include "common/block/block_ledger.h"
#include "common/memory/pool_copier.h"
#include "common/memory/pool_layout.h"
#include "common/memory/pool_memory.h"
#include "common/sizing/kv_cache_spec.h"
#include "services/cache_manager/tiers/disk_tier.h"
#include "services/cache_manager/tiers/read_queue.h"

namespace kvcm::cache_manager::tiers {

struct TierOptions {
  uint64_t host_bytes = 0;  // T1; 0: none
  std::string disk_dir;     // T2; empty: none
  uint64_t disk_bytes = 0;  // T2's capacity; > 0 with disk_dir
  // The model whose KV the pool holds (a GGUF file or a folder): T2's slots are served only
  // to the same bytes (DiskTier's identity). Required with disk_dir.
  std::string model_path;
  int32_t mover_threads = 1;
  // T2 reads each mover keeps in flight (1 to 64): the disk reads the next blocks of a
  // request's loads while the mover verifies and copies one. 1: one read at a time. Needs
  // io_uring; where the kernel refuses it, reads go one at a time (logged once).
  int32_t disk_read_depth = 8;
  // How long a request may wait for its blocks to load before it computes them.
  absl::Duration load_timeout = absl::Seconds(2);
  bool direct_io = true;  // T2 with O_DIRECT where the file system takes it
  // How often at most a mover calls DiskTier::Sync (fdatasync) while blocks were written
  // since the last one: a block is durable across a node's crash at most this long (and the
  // sync's own time) after its write. 0: after every write. Never on the ledger thread.
  absl::Duration disk_sync_interval = absl::Seconds(1);
  // Keep a TierEvent for every block a tier gains or loses, for TakeEvents() (the
  // vLLM-format stream announces them); off, nothing is kept.
  bool record_events = false;
  // Checked: the options make sense together (INVALID_ARGUMENT naming the flag otherwise).
  bool enabled() const { return host_bytes > 0 || !disk_dir.empty(); }
};
absl::Status CheckTierOptions(const TierOptions& options);

enum class Tier : uint8_t { kHost = 0, kDisk = 1 };
inline constexpr int kNumTiers = 2;
// "host", "disk".
std::string_view TierName(Tier tier);

// A block a tier now holds ready (kStored: written and loadable; with its lineage, as the
// store or the slot's header gave it) or no longer holds (kRemoved: its slot reused or
// refused). Blocks being written, and stores that failed, are never announced.
struct TierEvent {
  enum class Kind : uint8_t { kStored, kRemoved };
  Kind kind = Kind::kStored;
  Tier tier = Tier::kHost;
  BlockHash hash;
  BlockLineage lineage;  // kStored
};

// Totals since the start, for the metrics and StatsReply.
struct TierCounters {
  std::array<uint64_t, kNumTiers> stored{};      // blocks written into each tier
  std::array<uint64_t, kNumTiers> loaded{};      // blocks loaded from each tier
  std::array<uint64_t, kNumTiers> evicted{};     // ready slots reused for another block
  uint64_t stores_dropped = 0;                   // stores cancelled: the pool needed their blocks
  uint64_t disk_full = 0;                        // disk writes refused for want of space
  uint64_t write_errors = 0;                     // other failed disk writes
  uint64_t load_failures = 0;                    // loads that gave nothing (refused or failed)
  std::array<uint64_t, kNumRefusals> refused{};  // T2 slots not served, by reason
  uint64_t recovered = 0;                        // T2 blocks found at start
  uint64_t bytes_written = 0;                    // to T2
  uint64_t bytes_read = 0;                       // from T2
  uint64_t syncs = 0;                            // successful DiskTier::Sync calls
  uint64_t sync_errors = 0;                      // files whose fdatasync failed
};

struct TierSnapshot {
  std::array<int32_t, kNumTiers> slots{};  // capacity in blocks
  std::array<int32_t, kNumTiers> ready{};  // slots holding a verified-on-write block
  std::array<int32_t, kNumTiers> writing{};
  int32_t queued_stores = 0;
  int32_t queued_loads = 0;
  // T2 writes done but not yet covered by a sync: lost to a node's crash, not a process's.
  uint64_t unsynced_writes = 0;
  TierCounters counters;
};

class KvTiers {
 public:
  // Reads or writes one block's bytes in the pool: 2 x num_layers runs of block_stride
  // bytes (pool_layout.h), gathered into BytesPerBlock() contiguous bytes in layer, K|V
  // order, the order of a tier slot's data.
  struct PoolAccess {
    PoolMemory* memory = nullptr;  // outlives the tiers
    PoolLayout layout;
    int32_t num_layers = 0;
  };

  // Opens T2 (DiskTier::Open: lock, files, recovery) and allocates T1. `log` gets one line
  // per notable event (recovery, each refusal reason's first occurrence).
  static absl::StatusOr<std::unique_ptr<KvTiers>> Create(const TierOptions& options,
                                                         const KvCacheSpec& spec,
                                                         HashAlgorithm algorithm, PoolAccess pool,
                                                         std::function<void(std::string)> log);
  ~KvTiers();  // stops the movers after the job each is running
  KvTiers(const KvTiers&) = delete;
  KvTiers& operator=(const KvTiers&) = delete;

  const TierOptions& options() const { return options_; }
  // Readable (an eventfd) when Poll() has results to take; any thread may poll it.
  int wake_fd() const { return wake_fd_.get(); }
  // What T2 found at start (zeros without T2).
  DiskTier::OpenReport disk_report() const;

  // True when a block of this hash should be stored: no tier has or is writing it, and
  // some tier has room or a slot it may reuse.
  bool WantStore(const BlockHash& hash) const;
  // Stages the write-through of pool block `block` (held by the caller) holding `hash`,
  // whose place in its chain and tokens are `lineage` (kept in T2's slot header and in the
  // kStored TierEvents); Flush() hands the staged jobs to the movers.
  void Store(BlockId block, const BlockHash& hash, BlockLineage lineage = {});
  // Of `hashes`, how many leading ones a tier holds ready (loadable now).
  int32_t LeadingReady(std::span<const BlockHash> hashes) const;
  // The tier a load of `hash` would read (T1 before T2). REQUIRES: LeadingReady covers it.
  Tier SourceOf(const BlockHash& hash) const;
  // Stages a load of `hash` into pool block `block` (Flush() hands it to the movers).
  // REQUIRES: LeadingReady covered it.
  void Load(uint64_t ticket, BlockId block, const BlockHash& hash);
  // Hands the staged stores and loads to the movers under one lock, with one wake-up.
  void Flush();
  // Takes back the stores queued (or staged) but not started; returns their pool blocks,
  // which the caller unholds (their blocks are needed more than their copies).
  std::vector<BlockId> CancelQueuedStores();
  int32_t queued_stores() const;

  struct Done {
    enum class Kind : uint8_t {
      kReleased,    // a store read pool block `block`: unhold it
      kLoaded,      // a load wrote pool block `block`
      kLoadFailed,  // a load gave nothing: `block` holds garbage
    };
    Kind kind = Kind::kReleased;
    BlockId block = kNoBlock;
    uint64_t ticket = 0;  // loads
    Tier tier = Tier::kHost;
    double seconds = 0;  // loads: how long the copy took
  };
  // Takes the movers' results, updates the index, appends what the caller must act on.
  void Poll(std::vector<Done>* out);

  // With TierOptions::record_events: what the tiers gained and lost since the last call, in
  // order. The blocks T2 recovered at start come first, each after its parent when T2 holds
  // that too, so that a consumer that places blocks under their parents finds them.
  std::vector<TierEvent> TakeEvents();
  bool has_events() const { return !events_.empty(); }

  TierSnapshot Snapshot() const;
  // Load durations since the last call, by tier, for the histogram.
  std::vector<std::pair<Tier, double>> TakeLoadSeconds();

 private:
  struct Entry {
    std::array<int32_t, kNumTiers> slot{-1, -1};
    std::array<bool, kNumTiers> ready{false, false};
    std::array<uint64_t, kNumTiers> tick{0, 0};  // of its live entry in the tier's LRU ring
    int32_t readers = 0;                         // loads in flight
  };
  struct TierSlots {
    int32_t count = 0;
    std::vector<int32_t> free;                       // unused slots
    std::deque<std::pair<BlockHash, uint64_t>> lru;  // (hash, tick), oldest first; stale
                                                     // entries are skipped
    uint64_t clock = 0;
    int32_t ready = 0;
    int32_t writing = 0;
  };
  struct Job {
    enum class Kind : uint8_t { kStore, kLoad } kind = Kind::kStore;
    BlockId block = kNoBlock;
    BlockHash hash;
    std::array<int32_t, kNumTiers> slot{-1, -1};  // store: destinations; load: one source
    Tier source = Tier::kHost;
    uint64_t ticket = 0;
    uint64_t serial = 0;
    BlockLineage lineage;  // stores
  };
  struct Result {
    enum class Kind : uint8_t { kReleased, kStored, kLoaded, kLoadFailed } kind;
    Job job;
    std::array<absl::Status, kNumTiers> written;  // kStored: per destination
    Refusal refusal = Refusal::kIoError;          // kLoadFailed
    absl::Status load_error;
    double seconds = 0;
  };

  KvTiers(const TierOptions& options, const KvCacheSpec& spec, PoolAccess pool,
          std::function<void(std::string)> log);
  // Indexes the blocks T2 found at start.
  void Recover();
  // The mover's own copier (a CUDA stream of its own for a cuda pool), and its T2 reads:
  // a queue of disk_read_depth of them, each into its own slot buffer (made by the mover).
  struct Mover {
    std::unique_ptr<PoolCopier> copier;
    std::vector<PoolCopier::Run> runs;  // a block's runs, reused
    std::unique_ptr<ReadQueue> reads;
    std::vector<std::unique_ptr<SlotBuffer>> read_buffers;
    std::vector<bool> read_pinned;  // by read buffer: page-locked beside a cuda pool
    std::vector<Job> reading;       // by read buffer: the load it reads for
    std::vector<absl::Time> read_start;
  };
  void MoverLoop(Mover& mover);
  // Mover threads: DiskTier::Sync when T2 has unsynced writes, no other mover syncs and
  // options_.disk_sync_interval has passed since the last sync began (at once with `force`).
  void SyncIfDue(bool force);
  bool UnsyncedLocked() const;  // under mu_: unsynced writes and no sync running
  void RunStore(const Job& job, Mover& mover, SlotBuffer& buffer);
  // A load from T1: one copy.
  void RunHostLoad(const Job& job, Mover& mover);
  // Loads from T2, `first` and those queued behind it, up to disk_read_depth read at once,
  // each verified and copied as its read ends.
  void RunDiskLoads(const Job& first, Mover& mover);
  void FinishDiskLoad(size_t buffer, int64_t read, Mover& mover);
  // The mover's ReadQueue and read buffers, at its start; pinned beside a cuda pool.
  void MakeReadBuffers(Mover& mover);
  // The 2 x num_layers runs of `block` in the pool, in a slot's data order.
  void RunsOf(BlockId block, std::vector<PoolCopier::Run>* runs) const;
  void Post(Result result);

  // Ledger thread: slot bookkeeping.
  // A slot of `tier` for a new block: a free one, else the least recently used ready one
  // no load reads (its block leaves the index); -1 when there is none.
  int32_t TakeSlot(Tier tier);
  void Touch(Tier tier, const BlockHash& hash, Entry& entry);
  // Frees `entry`'s slot of `tier` (announcing its removal when it was ready).
  void DropSlot(Tier tier, const BlockHash& hash, Entry& entry);
  void RecordEvent(TierEvent::Kind kind, Tier tier, const BlockHash& hash,
                   const BlockLineage* lineage);
  // Recover's events, each recovered block after its recovered parent.
  void RecordRecovered();
  void EraseIfEmpty(const BlockHash& hash);
  void ApplyResult(Result& result, std::vector<Done>* out);
  void CountRefusal(Refusal refusal, int32_t slot);

  const TierOptions options_;
  const KvCacheSpec spec_;
  const PoolAccess pool_;
  const uint64_t block_bytes_;
  const std::function<void(std::string)> log_;
  std::unique_ptr<DiskTier> disk_;
  HostBuffer host_;  // T1: slots x block_bytes_ (page-locked beside a cuda pool)
  UniqueFd wake_fd_;

  // Ledger thread.
  absl::flat_hash_map<BlockHash, Entry, BlockHashHasher> index_;
  std::array<TierSlots, kNumTiers> tiers_;
  uint64_t serial_ = 0;
  TierCounters counters_;
  std::array<bool, kNumRefusals> refusal_logged_{};
  std::vector<Job> staged_stores_;  // Store and Load's, until Flush
  std::vector<Job> staged_loads_;
  std::vector<std::pair<Tier, double>> load_seconds_;
  std::vector<TierEvent> events_;  // with record_events, until TakeEvents

  // Shared with the movers, under mu_.
  mutable std::mutex mu_;
  std::condition_variable jobs_ready_;
  std::deque<Job> loads_;
  std::deque<Job> stores_;
  std::vector<Result> results_;
  bool stopping_ = false;
  std::vector<Mover> mover_state_;  // one per mover thread, made before they start
  std::vector<std::thread> movers_;
  // The disk sync's schedule, under mu_ (SyncIfDue).
  bool syncing_ = false;
  std::chrono::steady_clock::time_point next_sync_{};
  std::atomic<bool> sync_error_logged_{false};
  std::atomic<bool> read_queue_logged_{false};
};

}  // namespace kvcm::cache_manager::tiers
