// Prefix-hit capacity of a small pool with and without the tiers, on the shared allocation
// trace (docs/PERFORMANCE.md, "Tier capacity"). Counts, not times: nothing here is timed.
//
//   build/bench/tier_capacity_bench --trace trace.bin
//   build/bench/tier_capacity_bench --trace trace.bin --pools peak/4,header/4,header/16
//
// The trace is the one bench/ledger_trace_bench.cc replays (format KVTRACE1, documented
// there; written by shared/peers/gen_trace.py, seed 20251201). Every replay runs that
// bench's per-block loop through BlockLedger's public API (Allocate with the prompt's full
// block hashes, Commit after the prefill, then an Append and a Commit once a block, Free
// when the request ends; generated tokens from the same fixed function), with one change
// where the pool is smaller than the trace's live set: an Allocate or Append refused
// RESOURCE_EXHAUSTED frees the oldest live request and is tried again (a scheduler admits
// what fits), so fewer requests are live at once. The replays:
//
//   (c) unbounded   a pool of every block-table entry the trace makes: nothing is evicted.
//   (a) pool        a smaller pool, no tiers. --pools lists the sizes: peak/D is the most
//                   blocks (c) had in use at once (the live set: what the trace needs, a
//                   pool any smaller frees requests early) divided by D; header/D the
//                   trace's own pool (its header: 65,536 blocks) divided by D. Default
//                   peak/4,header/4.
//   (b) pool+tier   the same ledger run, with a model of the tiers beside it: an LRU index of
//                   M x the pool's blocks (the host and disk tiers together), fed as
//                   services/cache_manager/tier_coordinator.cc feeds KvTiers:
//                   - a kStored event (a block entering the prefix index) is stored unless
//                     the index holds its hash already (KvTiers::WantStore; nothing is
//                     touched then), the stored hash becoming the most recently used; a
//                     kStored whose hash a later event in the same batch removes is not;
//                   - an Allocate's prompt (its usable blocks: all but the block holding the
//                     last token) past the pool's hits: the leading blocks the index holds,
//                     contiguous from there (KvTiers::LeadingReady), count as hits, as the
//                     prefetch would load them, and are touched (KvTiers::Load). The
//                     prefetch commits them in the pool, as the request's own Commit does
//                     here, so the pool's state is the same as in (a): (b) = (a)'s pool
//                     hits + the tier's.
//                   The model's mover keeps up: copies are instant, no store is dropped
//                   (MakeRoom), no load fails or times out.
// Two admission policies for (b), on the same ledger run:
//   write-through   every kStored block is stored (what the cache manager does);
//   second-use      a block is stored only at its second use (KVBM/vLLM-style): a pool hit
//                   of an Allocate, or a kStored of a hash stored before (a ghost set of
//                   every hash seen once, unbounded: the policy's best case).
// Goal (issue "Tiers"): (b) write-through >= 95% of (c)'s hit blocks with a quarter pool,
// M = 8.

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <list>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "bench/allocation_trace.h"
#include "common/base/check.h"
#include "common/block/block_hash.h"
#include "common/block/block_ledger.h"

namespace kvcm {
namespace {

using Request = bench::TraceRequest;
using Trace = bench::AllocationTrace;
using bench::GeneratedToken;

Trace ReadTrace(const std::string& path) {
  return bench::ReadAllocationTrace(path, /*draw_generated=*/false);
}

// The tiers' index as the cache manager keeps it (services/cache_manager/tiers/kv_tiers.cc),
// one LRU for T1 and T2 together, without the bytes.
class TierModel {
 public:
  enum class Admission { kWriteThrough, kSecondUse };

  TierModel(int64_t capacity, Admission admission) : capacity_(capacity), admission_(admission) {}

  // A block entered the prefix index (a kStored event not removed later in its batch).
  void OnStored(const BlockHash& hash) {
    if (admission_ == Admission::kWriteThrough) {
      Insert(hash);
      return;
    }
    // Second use: stored again after an eviction from the pool.
    if (!seen_.insert(hash.Prefix64()).second) Insert(hash);
  }
  // An Allocate's leading blocks the pool shared: their second (or later) use.
  void OnPoolHits(std::span<const BlockHash> hashes) {
    if (admission_ != Admission::kSecondUse) return;
    for (const BlockHash& hash : hashes) Insert(hash);
  }
  // Of `hashes`, how many leading ones the index holds (KvTiers::LeadingReady); touches
  // them as the loads would (KvTiers::Load).
  int32_t LoadLeading(std::span<const BlockHash> hashes) {
    int32_t n = 0;
    for (const BlockHash& hash : hashes) {
      auto it = index_.find(hash);
      if (it == index_.end()) break;
      lru_.splice(lru_.end(), lru_, it->second);
      ++n;
    }
    loaded_ += static_cast<uint64_t>(n);
    return n;
  }

  uint64_t stored() const { return stored_; }
  uint64_t evicted() const { return evicted_; }
  uint64_t loaded() const { return loaded_; }

 private:
  // KvTiers::WantStore, Store and, at completion, Touch; TakeSlot reuses the LRU slot.
  void Insert(const BlockHash& hash) {
    if (index_.contains(hash)) return;
    if (static_cast<int64_t>(index_.size()) == capacity_) {
      index_.erase(lru_.front());
      lru_.pop_front();
      ++evicted_;
    }
    lru_.push_back(hash);
    index_.emplace(hash, std::prev(lru_.end()));
    ++stored_;
  }

  const int64_t capacity_;
  const Admission admission_;
  std::list<BlockHash> lru_;  // oldest first
  absl::flat_hash_map<BlockHash, std::list<BlockHash>::iterator, BlockHashHasher> index_;
  absl::flat_hash_set<uint64_t> seen_;
  uint64_t stored_ = 0;
  uint64_t evicted_ = 0;
  uint64_t loaded_ = 0;
};

struct ReplayResult {
  uint64_t pool_hits = 0;                // blocks the pool shared at Allocate
  std::vector<uint64_t> with_tier_hits;  // per tier model: pool hits + its loads
  uint64_t evictions = 0;
  uint64_t early_frees = 0;  // requests freed before their turn (pool full)
  int32_t peak_in_use = 0;
  double mean_live = 0;  // live requests, averaged over Allocates
};

ReplayResult Replay(const Trace& t, int32_t num_blocks, std::vector<TierModel>* tiers) {
  BlockLedger::Options options;
  options.num_blocks = num_blocks;
  options.block_size = t.block_size;
  options.record_events = !tiers->empty();
  BlockLedger ledger = *BlockLedger::Create(options);
  const int32_t bs = t.block_size;
  const HashAlgorithm algorithm = kDefaultHashAlgorithm;
  const BlockHash root = RootHash(algorithm, "");
  ReplayResult result;
  result.with_tier_hits.assign(tiers->size(), 0);
  std::deque<SeqId> live;
  std::vector<int32_t> tokens;
  std::vector<BlockHash> hashes;
  AllocateResult allocated;
  AppendResult appended;
  std::vector<bool> stale;
  absl::flat_hash_set<BlockHash, BlockHashHasher> removed_later;
  uint64_t live_sum = 0;

  // TierCoordinator::OnEvents: the batch's kStored events, less those removed later in it.
  auto drain = [&] {
    if (tiers->empty()) return;
    const std::vector<BlockEvent> events = ledger.TakeEvents();
    removed_later.clear();
    bool cleared_later = false;
    stale.assign(events.size(), false);
    for (size_t i = events.size(); i-- > 0;) {
      if (events[i].kind == BlockEvent::Kind::kAllCleared) {
        cleared_later = true;
      } else if (events[i].kind == BlockEvent::Kind::kRemoved) {
        removed_later.insert(events[i].hash);
      } else {
        stale[i] = cleared_later || removed_later.contains(events[i].hash);
      }
    }
    for (size_t i = 0; i < events.size(); ++i) {
      if (events[i].kind != BlockEvent::Kind::kStored || stale[i]) continue;
      for (TierModel& tier : *tiers) tier.OnStored(events[i].hash);
    }
  };
  auto free_oldest = [&] {
    KVCM_CHECK(!live.empty()) << "a request does not fit the pool alone";
    KVCM_CHECK(ledger.Free(live.front()).ok());
    live.pop_front();
    drain();
  };
  auto note_peak = [&] {
    result.peak_in_use = std::max(result.peak_in_use, ledger.Stats().in_use_blocks);
  };

  for (uint32_t i = 0; i < t.requests.size(); ++i) {
    const Request& r = t.requests[i];
    if (static_cast<int32_t>(live.size()) == t.max_live) free_oldest();
    const SeqId seq = i + 1;
    tokens.assign(t.tokens.begin() + r.offset, t.tokens.begin() + r.offset + r.prompt);
    for (int32_t g = 0; g < r.generated; ++g) tokens.push_back(GeneratedToken(i, r.prompt + g));
    hashes.clear();
    HashFullBlocks(algorithm, root, tokens, bs, &hashes);
    const int32_t prompt_blocks = r.prompt / bs;
    const std::span<const BlockHash> prompt_hashes(hashes.data(),
                                                   static_cast<size_t>(prompt_blocks));
    for (;;) {
      const absl::Status status = ledger.Allocate(seq, r.prompt, prompt_hashes, &allocated);
      if (status.ok()) break;
      KVCM_CHECK(absl::IsResourceExhausted(status)) << status;
      free_oldest();
      ++result.early_frees;
    }
    live_sum += live.size();
    const int32_t pool_hits = allocated.num_cached_tokens / bs;
    result.pool_hits += static_cast<uint64_t>(pool_hits);
    // TierCoordinator::BeforeAllocate's `usable`: never the block holding the last token.
    const int32_t usable = std::min(prompt_blocks, r.prompt > 0 ? (r.prompt - 1) / bs : 0);
    for (size_t k = 0; k < tiers->size(); ++k) {
      TierModel& tier = (*tiers)[k];
      tier.OnPoolHits(prompt_hashes.first(static_cast<size_t>(pool_hits)));
      const int32_t loaded =
          pool_hits < usable
              ? tier.LoadLeading(prompt_hashes.subspan(static_cast<size_t>(pool_hits),
                                                       static_cast<size_t>(usable - pool_hits)))
              : 0;
      result.with_tier_hits[k] += static_cast<uint64_t>(pool_hits + loaded);
    }
    KVCM_CHECK(ledger.Commit(seq, r.prompt).ok());
    drain();
    int32_t n = r.prompt;
    const int32_t end = r.prompt + r.generated;
    while (n < end) {
      const int32_t next = std::min(end, (n / bs + 1) * bs);
      for (;;) {
        const absl::Status status = ledger.Append(seq, next - n, &appended);
        if (status.ok()) break;
        KVCM_CHECK(absl::IsResourceExhausted(status)) << status;
        free_oldest();
        ++result.early_frees;
      }
      n = next;
      if (n % bs == 0) {
        KVCM_CHECK(
            ledger.Commit(seq, n, std::span(&hashes[static_cast<size_t>(n / bs - 1)], 1)).ok());
      } else {
        KVCM_CHECK(ledger.Commit(seq, n).ok());
      }
      drain();
    }
    live.push_back(seq);
    note_peak();
  }
  note_peak();
  while (!live.empty()) free_oldest();
  result.evictions = ledger.Stats().evictions;
  result.mean_live = static_cast<double>(live_sum) / static_cast<double>(t.requests.size());
  KVCM_CHECK(ledger.CheckInvariants().ok()) << ledger.CheckInvariants();
  return result;
}

double Percent(uint64_t part, uint64_t whole) {
  return whole == 0 ? 0 : 100.0 * static_cast<double>(part) / static_cast<double>(whole);
}

int Main(int argc, char** argv) {
  std::string trace_path;
  std::string pools = "peak/4,header/4";
  int64_t tier_multiple = 8;
  size_t requests = 0;  // 0: all
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    auto value = [&]() -> std::string {
      KVCM_CHECK(i + 1 < argc) << arg << " needs a value";
      return argv[++i];
    };
    if (arg == "--trace") {
      trace_path = value();
    } else if (arg == "--pools") {
      pools = value();
    } else if (arg == "--tier-multiple") {
      tier_multiple = std::strtoll(value().c_str(), nullptr, 10);
    } else if (arg == "--requests") {
      requests = std::strtoul(value().c_str(), nullptr, 10);
    } else {
      std::fprintf(stderr,
                   "usage: %s --trace FILE [--pools peak/D,header/D,...] [--tier-multiple M] "
                   "[--requests N]\n",
                   argv[0]);
      return 2;
    }
  }
  if (trace_path.empty()) {
    std::fprintf(stderr, "--trace FILE is required (format: see bench/ledger_trace_bench.cc)\n");
    return 2;
  }
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  std::printf("cpu: %s (counts only: nothing here is timed)\n", bench::CpuModel().c_str());
  Trace trace = ReadTrace(trace_path);
  if (requests > 0 && requests < trace.requests.size()) trace.requests.resize(requests);
  int64_t entries = 0;
  for (const Request& r : trace.requests) {
    entries += (r.prompt + r.generated + trace.block_size - 1) / trace.block_size;
  }
  std::printf(
      "trace %s: %zu requests, %zu prompt tokens, its pool %d blocks of %d, %d live, "
      "seed %llu; %lld block-table entries; hash %s\n",
      trace_path.c_str(), trace.requests.size(), trace.tokens.size(), trace.num_blocks,
      trace.block_size, trace.max_live, static_cast<unsigned long long>(trace.seed),
      static_cast<long long>(entries),
      std::string(HashAlgorithmName(kDefaultHashAlgorithm)).c_str());

  std::vector<TierModel> none;
  const ReplayResult unbounded = Replay(trace, static_cast<int32_t>(entries + 1), &none);
  std::printf(
      "(c) unbounded pool (%lld blocks): %llu hit blocks, %llu evictions, peak %d "
      "blocks in use, %.1f live\n",
      static_cast<long long>(entries + 1), static_cast<unsigned long long>(unbounded.pool_hits),
      static_cast<unsigned long long>(unbounded.evictions), unbounded.peak_in_use,
      unbounded.mean_live);

  for (size_t at = 0; at < pools.size();) {
    const size_t comma = std::min(pools.find(',', at), pools.size());
    const std::string spec = pools.substr(at, comma - at);
    at = comma + 1;
    const size_t slash = spec.find('/');
    KVCM_CHECK(slash != std::string::npos) << "--pools: " << spec << " is not peak/D or header/D";
    const std::string basis = spec.substr(0, slash);
    const double divisor = std::strtod(spec.c_str() + slash + 1, nullptr);
    KVCM_CHECK((basis == "peak" || basis == "header") && divisor >= 1)
        << "--pools: " << spec << " is not peak/D or header/D";
    const int32_t whole = basis == "peak" ? unbounded.peak_in_use : trace.num_blocks;
    const auto pool = static_cast<int32_t>(whole / divisor);
    const int64_t tier_blocks = tier_multiple * pool;
    std::vector<TierModel> tiers;
    tiers.emplace_back(tier_blocks, TierModel::Admission::kWriteThrough);
    tiers.emplace_back(tier_blocks, TierModel::Admission::kSecondUse);
    const ReplayResult r = Replay(trace, pool, &tiers);
    std::printf(
        "\npool %d blocks (%s: %s %d / %g), tier index %lld blocks (%lld x the "
        "pool): %.1f live on average, %llu requests freed early, %llu evictions\n",
        pool, spec.c_str(), basis == "peak" ? "(c)'s peak in use" : "the trace's pool", whole,
        divisor, static_cast<long long>(tier_blocks), static_cast<long long>(tier_multiple),
        r.mean_live, static_cast<unsigned long long>(r.early_frees),
        static_cast<unsigned long long>(r.evictions));
    std::printf("  %-34s %12s %10s %12s %12s %12s\n", "replay", "hit blocks", "of (c)",
                "tier loads", "tier stores", "tier evicts");
    std::printf("  %-34s %12llu %9.2f%%\n", "(c) unbounded pool",
                static_cast<unsigned long long>(unbounded.pool_hits), 100.0);
    std::printf("  %-34s %12llu %9.2f%%\n", "(a) pool, no tiers",
                static_cast<unsigned long long>(r.pool_hits),
                Percent(r.pool_hits, unbounded.pool_hits));
    const char* names[] = {"(b) pool + tier, write-through", "(b) pool + tier, second-use"};
    for (size_t k = 0; k < tiers.size(); ++k) {
      std::printf("  %-34s %12llu %9.2f%% %12llu %12llu %12llu\n", names[k],
                  static_cast<unsigned long long>(r.with_tier_hits[k]),
                  Percent(r.with_tier_hits[k], unbounded.pool_hits),
                  static_cast<unsigned long long>(tiers[k].loaded()),
                  static_cast<unsigned long long>(tiers[k].stored()),
                  static_cast<unsigned long long>(tiers[k].evicted()));
    }
    const double b = Percent(r.with_tier_hits[0], unbounded.pool_hits) / 100.0;
    std::printf(
        "  (b) write-through / (c) ratio %.4f (goal >= 0.95: %s); (a) / (c) %.4f; "
        "second-use / write-through %.4f\n",
        b, b >= 0.95 ? "met" : "missed", Percent(r.pool_hits, unbounded.pool_hits) / 100.0,
        static_cast<double>(r.with_tier_hits[1]) /
            static_cast<double>(std::max<uint64_t>(r.with_tier_hits[0], 1)));
  }
  return 0;
}

}  // namespace
}  // namespace kvcm

int main(int argc, char** argv) { return kvcm::Main(argc, argv); }
