#include "services/cache_manager/tiers/kv_tiers.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/base/check.h"
#include "common/base/monotonic_clock.h"

namespace kvcm::cache_manager::tiers {
namespace {

constexpr int kHost = static_cast<int>(Tier::kHost);
constexpr int kDisk = static_cast<int>(Tier::kDisk);

uint64_t RoundUp4K(uint64_t bytes) { return (bytes + 4095) / 4096 * 4096; }

}  // namespace

std::string_view TierName(Tier tier) { return tier == Tier::kHost ? "host" : "disk"; }

absl::Status CheckTierOptions(const TierOptions& options) {
  if (!options.disk_dir.empty() && options.disk_bytes == 0) {
    return absl::InvalidArgumentError(
        "--disk-tier-dir needs --disk-tier-bytes: the disk tier's capacity");
  }
  if (options.disk_dir.empty() && options.disk_bytes > 0) {
    return absl::InvalidArgumentError("--disk-tier-bytes needs --disk-tier-dir");
  }
  if (!options.disk_dir.empty() && options.model_path.empty()) {
    return absl::InvalidArgumentError(
        "--disk-tier-dir needs the model (--model-config naming a GGUF file or a model "
        "folder): a disk tier's blocks are served only to the model whose bytes wrote them");
  }
  if (options.enabled() && (options.mover_threads < 1 || options.mover_threads > 64)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tier-mover-threads must be in [1, 64], not ", options.mover_threads));
  }
  if (!options.disk_dir.empty() && (options.disk_read_depth < 1 || options.disk_read_depth > 64)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--disk-tier-read-depth must be in [1, 64], not ", options.disk_read_depth));
  }
  if (options.enabled() && options.load_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--tier-load-timeout-ms must be positive");
  }
  if (options.disk_sync_interval < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--disk-tier-sync-ms must be 0 or more");
  }
  return absl::OkStatus();
}

KvTiers::KvTiers(const TierOptions& options, const KvCacheSpec& spec, PoolAccess pool,
                 std::function<void(std::string)> log)
    : options_(options),
      spec_(spec),
      pool_(std::move(pool)),
      block_bytes_(static_cast<uint64_t>(spec.BytesPerBlock())),
      log_(std::move(log)) {}

absl::StatusOr<std::unique_ptr<KvTiers>> KvTiers::Create(const TierOptions& options,
                                                         const KvCacheSpec& spec,
                                                         HashAlgorithm algorithm, PoolAccess pool,
                                                         std::function<void(std::string)> log) {
  if (absl::Status checked = CheckTierOptions(options); !checked.ok()) return checked;
  if (absl::Status valid = spec.Validate(); !valid.ok()) return valid;
  if (pool.memory == nullptr) return absl::InvalidArgumentError("tiers need the pool memory");
  std::unique_ptr<KvTiers> tiers(new KvTiers(options, spec, std::move(pool), std::move(log)));
  tiers->wake_fd_ = UniqueFd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!tiers->wake_fd_.valid()) {
    return absl::InternalError(absl::StrCat("eventfd: ", std::strerror(errno)));
  }
  const uint64_t bb = tiers->block_bytes_;
  if (options.host_bytes > 0) {
    const uint64_t slots = options.host_bytes / bb;
    if (slots == 0 || slots > INT32_MAX) {
      return absl::InvalidArgumentError(absl::StrCat("--host-tier-bytes ", options.host_bytes,
                                                     " holds ", slots, " blocks of ", bb,
                                                     " bytes: give at least one block's bytes"));
    }
    absl::StatusOr<HostBuffer> host =
        HostBuffer::Allocate(tiers->pool_.memory->backend(), slots * bb);
    if (!host.ok()) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "the host tier's ", slots * bb, " bytes (--host-tier-bytes): ", host.status().message()));
    }
    tiers->host_ = *std::move(host);
    tiers->tiers_[kHost].count = static_cast<int32_t>(slots);
  }
  if (!options.disk_dir.empty()) {
    absl::StatusOr<std::array<uint8_t, 16>> digest =
        ModelDigest(options.model_path, options.disk_dir + "/model-digests");
    if (!digest.ok()) return digest.status();
    DiskTier::Options disk;
    disk.dir = options.disk_dir;
    disk.capacity_bytes = options.disk_bytes;
    disk.block_bytes = bb;
    disk.identity = MakeTierIdentity(*digest, spec, algorithm);
    disk.direct_io = options.direct_io;
    absl::StatusOr<std::unique_ptr<DiskTier>> opened = DiskTier::Open(disk);
    if (!opened.ok()) return opened.status();
    tiers->disk_ = *std::move(opened);
    tiers->tiers_[kDisk].count = tiers->disk_->num_slots();
  }
  for (TierSlots& t : tiers->tiers_) {
    t.free.reserve(static_cast<size_t>(t.count));
    for (int32_t s = t.count - 1; s >= 0; --s) t.free.push_back(s);  // lowest first
  }
  tiers->Recover();
  tiers->mover_state_.resize(static_cast<size_t>(options.mover_threads));
  for (Mover& mover : tiers->mover_state_) {
    absl::StatusOr<std::unique_ptr<PoolCopier>> copier = PoolCopier::Create(tiers->pool_.memory);
    if (!copier.ok()) return copier.status();
    mover.copier = *std::move(copier);
  }
  for (Mover& mover : tiers->mover_state_) {
    tiers->movers_.emplace_back([t = tiers.get(), m = &mover] { t->MoverLoop(*m); });
  }
  return tiers;
}

void KvTiers::Recover() {
  if (disk_ == nullptr) return;
  const DiskTier::OpenReport& report = disk_->open_report();
  TierSlots& t = tiers_[kDisk];
  std::vector<bool> taken(static_cast<size_t>(t.count), false);
  for (const DiskTier::Recovered& r : disk_->recovered()) {
    Entry& entry = index_[r.hash];
    entry.slot[kDisk] = r.slot;
    entry.ready[kDisk] = true;
    taken[static_cast<size_t>(r.slot)] = true;
    ++t.ready;
    Touch(Tier::kDisk, r.hash, entry);
  }
  t.free.clear();
  for (int32_t s = t.count - 1; s >= 0; --s) {
    if (!taken[static_cast<size_t>(s)]) t.free.push_back(s);
  }
  serial_ = report.max_serial;
  RecordRecovered();
  counters_.recovered = static_cast<uint64_t>(report.recovered);
  for (int i = 0; i < kNumRefusals; ++i) {
    counters_.refused[static_cast<size_t>(i)] += static_cast<uint64_t>(report.refused[i]);
  }
  std::string refused;
  for (int i = 0; i < kNumRefusals; ++i) {
    if (report.refused[i] == 0) continue;
    absl::StrAppend(&refused, refused.empty() ? "" : ", ", report.refused[i], " ",
                    std::string(RefusalName(static_cast<Refusal>(i))));
  }
  log_(absl::StrCat("disk tier ", options_.disk_dir, ": ", report.slots, " slots of ",
                    disk_->slot_bytes(), " bytes, ", report.recovered, " blocks recovered, ",
                    report.empty, " empty", refused.empty() ? "" : ", refused: ", refused,
                    " (scanned in ", absl::StrFormat("%.3f", report.seconds), " s; ",
                    disk_->direct_io() ? "O_DIRECT" : "buffered I/O", ")"));
}

KvTiers::~KvTiers() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  jobs_ready_.notify_all();
  for (std::thread& mover : movers_) mover.join();
}

void KvTiers::RecordRecovered() {
  if (!options_.record_events) return;
  const std::vector<DiskTier::Recovered>& recovered = disk_->recovered();
  absl::flat_hash_map<BlockHash, size_t, BlockHashHasher> by_hash;
  for (size_t i = 0; i < recovered.size(); ++i) by_hash.emplace(recovered[i].hash, i);
  // Each block after its ancestors that T2 holds: walk up to the first one announced (or
  // absent), then announce down again.
  std::vector<bool> announced(recovered.size(), false);
  std::vector<size_t> chain;
  for (size_t i = 0; i < recovered.size(); ++i) {
    for (size_t at = i; !announced[at];) {
      announced[at] = true;  // also guards against a cycle of corrupt-but-valid headers
      chain.push_back(at);
      const BlockLineage& lineage = recovered[at].lineage;
      if (!lineage.has_parent) break;
      auto parent = by_hash.find(lineage.parent);
      if (parent == by_hash.end()) break;
      at = parent->second;
    }
    for (auto it = chain.rbegin(); it != chain.rend(); ++it) {
      RecordEvent(TierEvent::Kind::kStored, Tier::kDisk, recovered[*it].hash,
                  &recovered[*it].lineage);
    }
    chain.clear();
  }
}

void KvTiers::RecordEvent(TierEvent::Kind kind, Tier tier, const BlockHash& hash,
                          const BlockLineage* lineage) {
  if (!options_.record_events) return;
  TierEvent event;
  event.kind = kind;
  event.tier = tier;
  event.hash = hash;
  if (lineage != nullptr) event.lineage = *lineage;
  events_.push_back(std::move(event));
}

std::vector<TierEvent> KvTiers::TakeEvents() {
  std::vector<TierEvent> taken;
  taken.swap(events_);
  return taken;
}

DiskTier::OpenReport KvTiers::disk_report() const {
  return disk_ == nullptr ? DiskTier::OpenReport{} : disk_->open_report();
}

// --- The ledger thread's index -------------------------------------------------------------

void KvTiers::Touch(Tier tier, const BlockHash& hash, Entry& entry) {
  TierSlots& t = tiers_[static_cast<int>(tier)];
  entry.tick[static_cast<int>(tier)] = ++t.clock;
  t.lru.emplace_back(hash, t.clock);
  // Stale entries are skipped when met; past twice the slots they are dropped at once.
  if (t.lru.size() > 2 * static_cast<size_t>(t.count) + 64) {
    std::deque<std::pair<BlockHash, uint64_t>> live;
    for (const auto& [h, tick] : t.lru) {
      auto it = index_.find(h);
      if (it != index_.end() && it->second.tick[static_cast<int>(tier)] == tick &&
          it->second.slot[static_cast<int>(tier)] >= 0) {
        live.emplace_back(h, tick);
      }
    }
    t.lru.swap(live);
  }
}

int32_t KvTiers::TakeSlot(Tier tier) {
  TierSlots& t = tiers_[static_cast<int>(tier)];
  if (t.count == 0) return -1;
  if (!t.free.empty()) {
    const int32_t slot = t.free.back();
    t.free.pop_back();
    return slot;
  }
  // The least recently used ready slot that no load reads. Entries passed over (being read)
  // go to the back, as if used now.
  for (size_t tries = t.lru.size(); tries > 0 && !t.lru.empty(); --tries) {
    auto [hash, tick] = t.lru.front();
    t.lru.pop_front();
    auto it = index_.find(hash);
    if (it == index_.end()) continue;
    Entry& entry = it->second;
    const int i = static_cast<int>(tier);
    if (entry.tick[i] != tick || entry.slot[i] < 0 || !entry.ready[i]) continue;
    if (entry.readers > 0) {
      t.lru.emplace_back(hash, tick);
      continue;
    }
    const int32_t slot = entry.slot[i];
    DropSlot(tier, hash, entry);
    ++counters_.evicted[static_cast<size_t>(i)];
    EraseIfEmpty(hash);
    t.free.pop_back();  // DropSlot freed it
    return slot;
  }
  return -1;
}

void KvTiers::DropSlot(Tier tier, const BlockHash& hash, Entry& entry) {
  const int i = static_cast<int>(tier);
  TierSlots& t = tiers_[i];
  const int32_t slot = entry.slot[i];
  if (slot < 0) return;
  if (entry.ready[i]) {
    --t.ready;
    RecordEvent(TierEvent::Kind::kRemoved, tier, hash, nullptr);
  } else {
    --t.writing;
  }
  t.free.push_back(slot);
  entry.slot[i] = -1;
  entry.ready[i] = false;
}

void KvTiers::EraseIfEmpty(const BlockHash& hash) {
  auto it = index_.find(hash);
  if (it != index_.end() && it->second.slot[kHost] < 0 && it->second.slot[kDisk] < 0 &&
      it->second.readers == 0) {
    index_.erase(it);
  }
}

bool KvTiers::WantStore(const BlockHash& hash) const {
  if (index_.contains(hash)) return false;
  for (const TierSlots& t : tiers_) {
    if (t.count > 0 && (!t.free.empty() || t.ready > 0)) return true;
  }
  return false;
}

void KvTiers::Store(BlockId block, const BlockHash& hash, BlockLineage lineage) {
  Job job;
  job.kind = Job::Kind::kStore;
  job.block = block;
  job.hash = hash;
  job.serial = ++serial_;
  job.lineage = std::move(lineage);
  Entry entry;
  for (int i = 0; i < kNumTiers; ++i) {
    const int32_t slot = TakeSlot(static_cast<Tier>(i));
    if (slot < 0) continue;
    TierSlots& t = tiers_[i];
    ++t.writing;
    entry.slot[i] = slot;
    job.slot[i] = slot;
  }
  index_[hash] = entry;
  staged_stores_.push_back(std::move(job));
}

int32_t KvTiers::LeadingReady(std::span<const BlockHash> hashes) const {
  int32_t n = 0;
  for (const BlockHash& hash : hashes) {
    auto it = index_.find(hash);
    if (it == index_.end() || !(it->second.ready[kHost] || it->second.ready[kDisk])) break;
    ++n;
  }
  return n;
}

Tier KvTiers::SourceOf(const BlockHash& hash) const {
  const Entry& entry = index_.at(hash);
  return entry.ready[kHost] ? Tier::kHost : Tier::kDisk;
}

void KvTiers::Load(uint64_t ticket, BlockId block, const BlockHash& hash) {
  Entry& entry = index_.at(hash);
  Job job;
  job.kind = Job::Kind::kLoad;
  job.block = block;
  job.hash = hash;
  job.ticket = ticket;
  job.source = entry.ready[kHost] ? Tier::kHost : Tier::kDisk;
  const int i = static_cast<int>(job.source);
  KVCM_CHECK(entry.ready[i]) << "load of a block no tier holds ready";
  job.slot[i] = entry.slot[i];
  ++entry.readers;
  Touch(job.source, hash, entry);
  staged_loads_.push_back(job);
}

std::vector<BlockId> KvTiers::CancelQueuedStores() {
  std::deque<Job> cancelled;
  {
    std::lock_guard<std::mutex> lock(mu_);
    cancelled.swap(stores_);
  }
  cancelled.insert(cancelled.end(), staged_stores_.begin(), staged_stores_.end());
  staged_stores_.clear();
  std::vector<BlockId> blocks;
  blocks.reserve(cancelled.size());
  for (const Job& job : cancelled) {
    blocks.push_back(job.block);
    auto it = index_.find(job.hash);
    if (it != index_.end()) {
      for (int i = 0; i < kNumTiers; ++i) {
        if (job.slot[i] >= 0) DropSlot(static_cast<Tier>(i), job.hash, it->second);
      }
      EraseIfEmpty(job.hash);
    }
    ++counters_.stores_dropped;
  }
  return blocks;
}

int32_t KvTiers::queued_stores() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int32_t>(stores_.size() + staged_stores_.size());
}

void KvTiers::CountRefusal(Refusal refusal, int32_t slot) {
  ++counters_.refused[static_cast<size_t>(refusal)];
  bool& logged = refusal_logged_[static_cast<size_t>(refusal)];
  if (logged) return;
  logged = true;
  log_(absl::StrCat("disk tier: slot ", slot, " not served (", std::string(RefusalName(refusal)),
                    "); its block is computed again and the slot reused (logged once per "
                    "reason; kvcm_cache_manager_tier_refusals_total counts them)"));
}

void KvTiers::Poll(std::vector<Done>* out) {
  uint64_t ignored;
  (void)!::read(wake_fd_.get(), &ignored, sizeof(ignored));
  std::vector<Result> results;
  {
    std::lock_guard<std::mutex> lock(mu_);
    results.swap(results_);
  }
  for (Result& result : results) ApplyResult(result, out);
}

void KvTiers::ApplyResult(Result& result, std::vector<Done>* out) {
  const Job& job = result.job;
  switch (result.kind) {
    case Result::Kind::kReleased:
      out->push_back({Done::Kind::kReleased, job.block, 0, Tier::kHost, 0});
      return;
    case Result::Kind::kStored: {
      auto it = index_.find(job.hash);
      for (int i = 0; i < kNumTiers; ++i) {
        // The entry or its slot may be gone: cancelled, or reused after a failure.
        if (job.slot[i] < 0 || it == index_.end() || it->second.slot[i] != job.slot[i] ||
            it->second.ready[i]) {
          continue;
        }
        Entry& entry = it->second;
        const absl::Status& written = result.written[static_cast<size_t>(i)];
        if (written.ok()) {
          entry.ready[i] = true;
          --tiers_[i].writing;
          ++tiers_[i].ready;
          ++counters_.stored[static_cast<size_t>(i)];
          Touch(static_cast<Tier>(i), job.hash, entry);
          RecordEvent(TierEvent::Kind::kStored, static_cast<Tier>(i), job.hash, &job.lineage);
          continue;
        }
        if (absl::IsResourceExhausted(written)) {
          if (counters_.disk_full++ == 0) log_(absl::StrCat("disk tier full: ", written.message()));
        } else if (counters_.write_errors++ == 0) {
          log_(absl::StrCat("disk tier write failed: ", written.message()));
        }
        DropSlot(static_cast<Tier>(i), job.hash, entry);
      }
      EraseIfEmpty(job.hash);
      return;
    }
    case Result::Kind::kLoaded:
    case Result::Kind::kLoadFailed: {
      const int i = static_cast<int>(job.source);
      auto it = index_.find(job.hash);
      if (it != index_.end()) {
        --it->second.readers;
        if (result.kind == Result::Kind::kLoadFailed && job.source == Tier::kDisk &&
            it->second.slot[i] == job.slot[i]) {
          DropSlot(Tier::kDisk, job.hash, it->second);
        }
        EraseIfEmpty(job.hash);
      }
      const bool loaded = result.kind == Result::Kind::kLoaded;
      if (loaded) {
        ++counters_.loaded[static_cast<size_t>(i)];
        load_seconds_.emplace_back(job.source, result.seconds);
      } else {
        ++counters_.load_failures;
        if (!result.load_error.ok() && absl::IsDataLoss(result.load_error)) {
          CountRefusal(result.refusal, job.slot[i]);
        } else if (!result.load_error.ok()) {
          log_(absl::StrCat("tier load failed: ", result.load_error.message()));
        }
      }
      out->push_back({loaded ? Done::Kind::kLoaded : Done::Kind::kLoadFailed, job.block, job.ticket,
                      job.source, result.seconds});
      return;
    }
  }
}

TierSnapshot KvTiers::Snapshot() const {
  TierSnapshot s;
  for (int i = 0; i < kNumTiers; ++i) {
    s.slots[i] = tiers_[i].count;
    s.ready[i] = tiers_[i].ready;
    s.writing[i] = tiers_[i].writing;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    s.queued_stores = static_cast<int32_t>(stores_.size() + staged_stores_.size());
    s.queued_loads = static_cast<int32_t>(loads_.size());
  }
  s.counters = counters_;
  if (disk_ != nullptr) {
    s.counters.bytes_written = disk_->bytes_written();
    s.counters.bytes_read = disk_->bytes_read();
    s.counters.syncs = disk_->syncs();
    s.counters.sync_errors = disk_->sync_errors();
    s.unsynced_writes = disk_->writes() - disk_->synced_writes();
  }
  return s;
}

std::vector<std::pair<Tier, double>> KvTiers::TakeLoadSeconds() {
  std::vector<std::pair<Tier, double>> out;
  out.swap(load_seconds_);
  return out;
}

// --- The movers ----------------------------------------------------------------------------

void KvTiers::MoverLoop(Mover& mover) {
  SlotBuffer buffer(disk_ != nullptr ? disk_->slot_bytes() : RoundUp4K(block_bytes_ + 4096));
  const PoolBackend backend = pool_.memory->backend();
  // Beside a cuda pool the slot buffer is page-locked; a failure only makes copies slower.
  const bool pinned = PinForDevice(backend, buffer.slot(), buffer.slot_bytes()).ok();
  MakeReadBuffers(mover);
  while (true) {
    SyncIfDue(/*force=*/false);
    Job job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      const auto ready = [this] { return stopping_ || !loads_.empty() || !stores_.empty(); };
      // Writes not yet synced: wake at the sync's time even without jobs. A mover that
      // writes or syncs comes back here, so some mover always watches for the next sync.
      if (UnsyncedLocked()) {
        if (!jobs_ready_.wait_until(lock, next_sync_, ready)) continue;
      } else {
        jobs_ready_.wait(lock, ready);
      }
      if (stopping_) break;
      std::deque<Job>& queue = loads_.empty() ? stores_ : loads_;
      job = queue.front();
      queue.pop_front();
    }
    if (job.kind == Job::Kind::kStore) {
      RunStore(job, mover, buffer);
    } else if (job.source == Tier::kHost) {
      RunHostLoad(job, mover);
    } else {
      RunDiskLoads(job, mover);
    }
  }
  SyncIfDue(/*force=*/true);  // a clean stop leaves nothing unsynced
  if (pinned) UnpinForDevice(backend, buffer.slot());
  for (size_t i = 0; i < mover.read_buffers.size(); ++i) {
    if (mover.read_pinned[i]) UnpinForDevice(backend, mover.read_buffers[i]->slot());
  }
}

void KvTiers::MakeReadBuffers(Mover& mover) {
  if (disk_ == nullptr) return;
  const auto depth = static_cast<uint32_t>(options_.disk_read_depth);
  mover.reads = ReadQueue::Create(depth, /*use_io_uring=*/depth > 1);
  if (depth > 1 && !mover.reads->uses_io_uring() && !read_queue_logged_.exchange(true)) {
    log_(absl::StrCat("disk tier: each mover reads one block at a time, not ", depth,
                      " (--disk-tier-read-depth): ", mover.reads->io_uring_error().message()));
  }
  const PoolBackend backend = pool_.memory->backend();
  for (uint32_t i = 0; i < depth; ++i) {
    mover.read_buffers.push_back(std::make_unique<SlotBuffer>(disk_->slot_bytes()));
    // As the store buffer: a buffer left unpinned only makes its copies slower.
    mover.read_pinned.push_back(
        PinForDevice(backend, mover.read_buffers.back()->slot(), disk_->slot_bytes()).ok());
  }
  mover.reading.resize(depth);
  mover.read_start.resize(depth);
}

bool KvTiers::UnsyncedLocked() const {
  return disk_ != nullptr && !syncing_ && disk_->writes() != disk_->synced_writes();
}

void KvTiers::SyncIfDue(bool force) {
  const auto now = std::chrono::steady_clock::now();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!UnsyncedLocked() || (!force && now < next_sync_)) return;
    syncing_ = true;
    // From the start: under a steady stream of writes the syncs begin once per interval.
    next_sync_ = now + absl::ToChronoNanoseconds(options_.disk_sync_interval);
  }
  const absl::Status synced = disk_->Sync();
  {
    std::lock_guard<std::mutex> lock(mu_);
    syncing_ = false;
  }
  // Tried again at the next interval; counted (kvcm_cache_manager_tier_sync_errors_total).
  if (!synced.ok() && !sync_error_logged_.exchange(true)) {
    log_(
        absl::StrCat("disk tier sync failed (logged once; blocks written since the last "
                     "sync may not survive a crash of the machine): ",
                     synced.message()));
  }
}

void KvTiers::RunsOf(BlockId block, std::vector<PoolCopier::Run>* runs) const {
  const PoolLayout& l = pool_.layout;
  runs->clear();
  for (int32_t layer = 0; layer < pool_.num_layers; ++layer) {
    for (int32_t kv = 0; kv < 2; ++kv) {
      runs->push_back({static_cast<uint64_t>(l.Offset(layer, kv, block, 0, 0)),
                       static_cast<uint64_t>(l.block_stride)});
    }
  }
}

void KvTiers::Post(Result result) {
  bool first;
  {
    std::lock_guard<std::mutex> lock(mu_);
    first = results_.empty();
    results_.push_back(std::move(result));
  }
  // One wake-up per batch of results: the ledger thread takes them all in one Poll, so a
  // result that finds others waiting needs none (each wake-up is a turn of its loop).
  if (first) {
    const uint64_t one = 1;
    (void)!::write(wake_fd_.get(), &one, sizeof(one));
  }
}

void KvTiers::Flush() {
  if (staged_stores_.empty() && staged_loads_.empty()) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    loads_.insert(loads_.end(), staged_loads_.begin(), staged_loads_.end());
    stores_.insert(stores_.end(), staged_stores_.begin(), staged_stores_.end());
  }
  const size_t jobs = staged_stores_.size() + staged_loads_.size();
  staged_stores_.clear();
  staged_loads_.clear();
  if (jobs == 1) {
    jobs_ready_.notify_one();
  } else {
    jobs_ready_.notify_all();
  }
}

void KvTiers::RunStore(const Job& job, Mover& mover, SlotBuffer& buffer) {
  RunsOf(job.block, &mover.runs);
  const absl::Status copied = mover.copier->Gather(mover.runs, buffer.data());
  Post({Result::Kind::kReleased, job, {}, Refusal::kIoError, absl::OkStatus(), 0});
  Result stored{Result::Kind::kStored, job, {}, Refusal::kIoError, absl::OkStatus(), 0};
  if (!copied.ok()) {
    stored.written = {copied, copied};
    Post(std::move(stored));
    return;
  }
  if (job.slot[kHost] >= 0) {
    std::memcpy(host_.data() + static_cast<uint64_t>(job.slot[kHost]) * block_bytes_, buffer.data(),
                block_bytes_);
  }
  if (job.slot[kDisk] >= 0) {
    stored.written[kDisk] =
        disk_->Write(job.slot[kDisk], job.hash, job.serial, buffer, job.lineage);
  }
  Post(std::move(stored));
}

void KvTiers::RunHostLoad(const Job& job, Mover& mover) {
  const absl::Time start = MonotonicNow();
  Result result{Result::Kind::kLoaded, job, {}, Refusal::kIoError, absl::OkStatus(), 0};
  RunsOf(job.block, &mover.runs);
  result.load_error = mover.copier->Scatter(
      host_.data() + static_cast<uint64_t>(job.slot[kHost]) * block_bytes_, mover.runs);
  if (!result.load_error.ok()) result.kind = Result::Kind::kLoadFailed;
  result.seconds = absl::ToDoubleSeconds(MonotonicNow() - start);
  Post(std::move(result));
}

void KvTiers::RunDiskLoads(const Job& first, Mover& mover) {
  ReadQueue& queue = *mover.reads;
  std::vector<size_t> free;  // read buffers not reading
  for (size_t i = mover.read_buffers.size(); i-- > 0;) free.push_back(i);
  std::vector<Job> next{first};
  while (true) {
    {
      // The disk loads queued behind, while buffers are free: a request's blocks come in a
      // row, and the disk reads them while this thread verifies and copies.
      std::lock_guard<std::mutex> lock(mu_);
      while (!stopping_ && next.size() < free.size() && !loads_.empty() &&
             loads_.front().source == Tier::kDisk) {
        next.push_back(loads_.front());
        loads_.pop_front();
      }
    }
    for (const Job& job : next) {
      const size_t i = free.back();
      free.pop_back();
      mover.reading[i] = job;
      mover.read_start[i] = MonotonicNow();
      SlotBuffer& buffer = *mover.read_buffers[i];
      absl::StatusOr<DiskTier::Extent> extent = disk_->ExtentOf(job.slot[kDisk], buffer);
      if (!extent.ok()) {
        Post({Result::Kind::kLoadFailed, job, {}, Refusal::kIoError, extent.status(), 0});
        free.push_back(i);
        continue;
      }
      queue.Add(extent->fd, buffer.slot(), static_cast<uint32_t>(buffer.slot_bytes()),
                extent->offset, i);
    }
    next.clear();
    queue.Submit();
    if (!queue.uses_io_uring() && queue.io_uring_error().code() == absl::StatusCode::kInternal &&
        !read_queue_logged_.exchange(true)) {
      log_(
          absl::StrCat("disk tier: the kernel refused a read submission; this mover now reads "
                       "one block at a time: ",
                       queue.io_uring_error().message()));
    }
    if (queue.in_flight() == 0) return;
    const ReadQueue::Completion done = queue.Wait();
    FinishDiskLoad(done.tag, done.result, mover);
    free.push_back(done.tag);
  }
}

void KvTiers::FinishDiskLoad(size_t buffer, int64_t read, Mover& mover) {
  const Job& job = mover.reading[buffer];
  Result result{Result::Kind::kLoaded, job, {}, Refusal::kIoError, absl::OkStatus(), 0};
  SlotBuffer& slot = *mover.read_buffers[buffer];
  result.load_error = disk_->Verify(job.slot[kDisk], job.hash, slot, read, &result.refusal);
  if (result.load_error.ok()) {
    RunsOf(job.block, &mover.runs);
    result.load_error = mover.copier->Scatter(slot.data(), mover.runs);
  }
  if (!result.load_error.ok()) result.kind = Result::Kind::kLoadFailed;
  result.seconds = absl::ToDoubleSeconds(MonotonicNow() - mover.read_start[buffer]);
  Post(std::move(result));
}

}  // namespace kvcm::cache_manager::tiers
