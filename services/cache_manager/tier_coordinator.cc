#include "services/cache_manager/tier_coordinator.h"

#include <algorithm>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/base/check.h"
#include "common/wire/step_codec.h"

namespace kvcm::cache_manager {

using tiers::KvTiers;
using tiers::Tier;

namespace {
// A finished prefetch is kept this long for its Allocate to come back and read its counts.
constexpr absl::Duration kKeepFinished = absl::Seconds(30);
}  // namespace

TierCoordinator::TierCoordinator(tiers::KvTiers* tiers, GroupedLedger* ledger, Options options)
    : tiers_(tiers), ledger_(ledger), options_(options) {}

void TierCoordinator::OnEvents(std::span<const BlockEvent> events) {
  // Most Steps (decodes inside a block) store nothing: no work, no allocation.
  if (std::none_of(events.begin(), events.end(),
                   [](const BlockEvent& e) { return e.kind == BlockEvent::Kind::kStored; })) {
    return;
  }
  // A block stored and then removed again within these events (evicted, perhaps reused for
  // other content already) no longer holds the hash its kStored names: never store it.
  absl::flat_hash_set<BlockHash, BlockHashHasher>& removed_later = removed_later_;
  removed_later.clear();
  bool cleared_later = false;
  std::vector<bool>& stale = stale_;
  stale.assign(events.size(), false);
  for (size_t i = events.size(); i-- > 0;) {
    const BlockEvent& event = events[i];
    if (event.kind == BlockEvent::Kind::kAllCleared) {
      cleared_later = true;
    } else if (event.kind == BlockEvent::Kind::kRemoved) {
      removed_later.insert(event.hash);
    } else {
      stale[i] = cleared_later || removed_later.contains(event.hash);
    }
  }
  for (size_t i = 0; i < events.size(); ++i) {
    const BlockEvent& event = events[i];
    if (event.kind != BlockEvent::Kind::kStored || stale[i] || !tiers_->WantStore(event.hash)) {
      continue;
    }
    // A prefetch's own blocks come from a tier (WantStore is false for them); any other
    // stored block is held until the mover has read it.
    if (!ledger_->Hold(event.block).ok()) continue;
    ++held_;
    tiers::BlockLineage lineage;
    lineage.parent = event.parent_hash;
    lineage.has_parent = event.has_parent;
    if (options_.commit_tokens) {
      if (const std::vector<int32_t>* tokens = options_.commit_tokens(event.block)) {
        lineage.tokens = *tokens;
      }
    }
    tiers_->Store(event.block, event.hash, std::move(lineage));
  }
}

std::optional<absl::Status> TierCoordinator::BeforeAllocate(const BlockOp& op, absl::Time now,
                                                            OpOutcome* outcome) {
  const int32_t block_size = ledger_->block_size();
  // The block holding the prompt's last token is never reused (its logits are computed).
  const int32_t usable =
      std::min<int32_t>(static_cast<int32_t>(op.hashes.size()),
                        op.num_tokens > 0 ? (op.num_tokens - 1) / block_size : 0);
  if (usable == 0) return std::nullopt;
  const std::span<const BlockHash> hashes(op.hashes.data(), static_cast<size_t>(usable));
  const int32_t in_pool = ledger_->Lookup(hashes);
  // A prefetch of this prefix, finished or not, is found by the last hash it loads: the
  // pool's hits end where it ended.
  for (int32_t end = usable; end > 0; --end) {
    auto it = prefetches_.find(hashes[static_cast<size_t>(end - 1)]);
    if (it == prefetches_.end()) continue;
    Prefetch& prefetch = it->second;
    outcome->host_tokens = prefetch.host_blocks * block_size;
    outcome->disk_tokens = prefetch.disk_blocks * block_size;
    if (!prefetch.done() && now < prefetch.deadline) {
      return absl::UnavailableError(
          absl::StrCat("loading ", prefetch.pending,
                       " of this prompt's blocks from the host and disk tiers: "
                       "send the Allocate again"));
    }
    if (!prefetch.done()) {
      // Timed out: nothing it loads is matchable before it is done, so this Allocate gets
      // nothing from the tiers.
      outcome->host_tokens = 0;
      outcome->disk_tokens = 0;
    }
    if (prefetch.done()) prefetches_.erase(it);  // its counts go with this Allocate
    return std::nullopt;
  }
  if (in_pool >= usable) return std::nullopt;
  const int32_t in_tiers = tiers_->LeadingReady(hashes.subspan(static_cast<size_t>(in_pool)));
  if (in_tiers == 0) return std::nullopt;
  const int32_t blocks = in_pool + in_tiers;
  const SeqId seq = next_seq_++;
  // Fresh blocks for the loads, and the pool's hits shared ahead of them. Without room the
  // request computes its prefix, as without tiers.
  // The tiers serve a ledger of one group only (no group_blocks to fill).
  KVCM_CHECK(ledger_->num_groups() == 1) << "the tiers do not support KV cache groups";
  AllocateResult taken;
  std::vector<BlockId> no_groups;
  const absl::Status status = ledger_->Allocate(
      seq, blocks * block_size, hashes.first(static_cast<size_t>(blocks)), &taken, &no_groups);
  if (!status.ok()) return std::nullopt;
  const int32_t hits = taken.num_cached_tokens / block_size;
  Prefetch prefetch;
  prefetch.seq = seq;
  prefetch.pool_blocks = hits;
  prefetch.blocks = blocks;
  prefetch.state.assign(static_cast<size_t>(blocks - hits), 0);
  prefetch.deadline = now + options_.load_timeout;
  for (int32_t i = hits; i < blocks; ++i) {
    const BlockHash& hash = hashes[static_cast<size_t>(i)];
    prefetch.source.push_back(tiers_->SourceOf(hash));
    if (prefetch.source.back() == Tier::kHost) {
      ++prefetch.host_blocks;
    } else {
      ++prefetch.disk_blocks;
    }
    tiers_->Load(seq, taken.blocks[static_cast<size_t>(i)], hash);
    ++prefetch.pending;
    ++loading_blocks_;
  }
  outcome->host_tokens = prefetch.host_blocks * block_size;
  outcome->disk_tokens = prefetch.disk_blocks * block_size;
  const int32_t pending = prefetch.pending;
  by_seq_[seq] = hashes[static_cast<size_t>(blocks - 1)];
  prefetches_[hashes[static_cast<size_t>(blocks - 1)]] = std::move(prefetch);
  return absl::UnavailableError(absl::StrCat("loading ", pending,
                                             " of this prompt's blocks from the host and disk "
                                             "tiers: send the Allocate again"));
}

void TierCoordinator::MakeRoom(std::span<const BlockOp> ops) {
  if (held_ == 0) return;
  int64_t needed = 0;
  const int32_t block_size = ledger_->block_size();
  for (const BlockOp& op : ops) {
    if (op.kind == wire::StepOp::AllocateOp) {
      needed += (int64_t{op.num_tokens} + block_size - 1) / block_size;
    } else if (op.kind == wire::StepOp::AppendOp) {
      needed += (int64_t{op.num_tokens} + block_size - 1) / block_size + 1;
    }
  }
  if (ledger_->AvailableBlocks() >= needed) return;
  for (BlockId block : tiers_->CancelQueuedStores()) {
    KVCM_CHECK(ledger_->Unhold(block).ok()) << "unhold of block " << block;
    --held_;
  }
}

bool TierCoordinator::Poll(absl::Time now) {
  done_.clear();
  tiers_->Poll(&done_);
  bool changed = false;
  for (const KvTiers::Done& done : done_) {
    if (done.kind == KvTiers::Done::Kind::kReleased) {
      KVCM_CHECK(ledger_->Unhold(done.block).ok()) << "unhold of block " << done.block;
      --held_;
      changed = true;
      continue;
    }
    --loading_blocks_;
    auto seq = by_seq_.find(done.ticket);
    if (seq == by_seq_.end()) continue;
    Prefetch& prefetch = prefetches_.at(seq->second);
    absl::StatusOr<std::vector<BlockId>> table = ledger_->BlockTable(prefetch.seq);
    KVCM_CHECK(table.ok()) << "prefetch sequence " << prefetch.seq << " is gone";
    for (int32_t i = prefetch.pool_blocks; i < prefetch.blocks; ++i) {
      if ((*table)[static_cast<size_t>(i)] != done.block) continue;
      prefetch.state[static_cast<size_t>(i - prefetch.pool_blocks)] =
          done.kind == KvTiers::Done::Kind::kLoaded ? 1 : -1;
      --prefetch.pending;
      break;
    }
    if (prefetch.done()) {
      Finish(prefetch, now);
      by_seq_.erase(seq);
      changed = true;
    }
  }
  // Finished prefetches nobody came back for.
  absl::erase_if(prefetches_, [&](const auto& entry) {
    return entry.second.done() && now - entry.second.done_at > kKeepFinished;
  });
  return changed;
}

void TierCoordinator::Finish(Prefetch& prefetch, absl::Time now) {
  int32_t loaded = prefetch.pool_blocks;
  while (loaded < prefetch.blocks &&
         prefetch.state[static_cast<size_t>(loaded - prefetch.pool_blocks)] == 1) {
    ++loaded;
  }
  if (loaded > prefetch.pool_blocks) {
    const absl::Status committed = ledger_->Commit(prefetch.seq, loaded * ledger_->block_size());
    KVCM_CHECK(committed.ok()) << "commit of prefetch " << prefetch.seq << ": " << committed;
  }
  const absl::Status freed = ledger_->Free(prefetch.seq);
  KVCM_CHECK(freed.ok()) << "free of prefetch " << prefetch.seq << ": " << freed;
  // What the Allocate coming back will be told came from the tiers: the loads that made it.
  prefetch.host_blocks = 0;
  prefetch.disk_blocks = 0;
  for (int32_t i = 0; i < loaded - prefetch.pool_blocks; ++i) {
    ++(prefetch.source[static_cast<size_t>(i)] == Tier::kHost ? prefetch.host_blocks
                                                              : prefetch.disk_blocks);
  }
  prefetch.done_at = now;
}

int32_t TierCoordinator::loading_prefetches() const { return static_cast<int32_t>(by_seq_.size()); }

}  // namespace kvcm::cache_manager
