#include "services/cache_manager/vllm_conversion.h"

#include <algorithm>
#include <optional>
#include <utility>

#include "common/base/check.h"
#include "common/block/grouped_ledger.h"

namespace kvcm::cache_manager {

VllmConverter::VllmConverter(int32_t block_size, HashAlgorithm algorithm, VllmMedium pool_medium,
                             std::vector<int32_t> group_windows)
    : block_size_(static_cast<size_t>(block_size)),
      algorithm_(algorithm),
      pool_medium_(pool_medium),
      group_windows_(std::move(group_windows)) {
  KVCM_CHECK(block_size > 0);
}

void VllmConverter::AddCommitTokens(std::span<const BlockId> block_table,
                                    int32_t num_committed_tokens, std::span<const int32_t> tokens) {
  const size_t blocks = tokens.size() / block_size_;
  const size_t end = static_cast<size_t>(std::max(num_committed_tokens, 0)) / block_size_;
  if (blocks > end || block_table.size() < end) return;
  // Block by block, onto the block table, ending at the last full block.
  for (size_t b = 0; b < blocks; ++b) {
    const auto first = tokens.begin() + static_cast<ptrdiff_t>(b * block_size_);
    commit_tokens_[block_table[end - blocks + b]].assign(
        first, first + static_cast<ptrdiff_t>(block_size_));
  }
}

void VllmConverter::AddGroupedCommitTokens(
    std::span<const BlockId> table, int32_t num_committed_tokens, std::span<const int32_t> tokens,
    absl::FunctionRef<std::optional<BlockHash>(BlockId)> plain_hash_of) {
  const size_t blocks = tokens.size() / block_size_;
  const size_t end = static_cast<size_t>(std::max(num_committed_tokens, 0)) / block_size_;
  if (blocks > end || table.size() < end) return;
  // The plain hash of a position: that of group 0's block there (the chain's own hash).
  auto plain_at = [&](size_t i) -> std::optional<BlockHash> {
    return table[i] == kNoBlock ? std::nullopt : plain_hash_of(table[i]);
  };
  const size_t first = end - blocks;
  std::optional<BlockHash> parent = first > 0 ? plain_at(first - 1) : std::nullopt;
  for (size_t b = 0; b < blocks; ++b) {
    const size_t i = first + b;
    const std::optional<BlockHash> plain = plain_at(i);
    if (plain.has_value() && (i == 0 || parent.has_value())) {
      GroupedCommit commit;
      commit.origin.id = VllmBlockId(*plain, algorithm_);
      if (i > 0) commit.origin.parent_id = VllmBlockId(*parent, algorithm_);
      const auto from = tokens.begin() + static_cast<ptrdiff_t>(b * block_size_);
      commit.tokens.assign(from, from + static_cast<ptrdiff_t>(block_size_));
      for (size_t g = 0; g < group_windows_.size(); ++g) {
        commit.origin.group = static_cast<int32_t>(g);
        commit_origins_[GroupBlockHash(algorithm_, *plain, commit.origin.group)] = commit;
      }
    }
    parent = plain;
  }
}

const std::vector<int32_t>* VllmConverter::CommitTokens(BlockId block) const {
  auto it = commit_tokens_.find(block);
  return it == commit_tokens_.end() ? nullptr : &it->second;
}

void VllmConverter::Clear() {
  published_.clear();
  keys_.clear();
  VllmEvent event;
  event.kind = VllmEvent::Kind::kAllBlocksCleared;
  pending_.push_back(std::move(event));
}

VllmMedium VllmConverter::MediumOf(Place place) const {
  switch (place) {
    case kPool:
      return pool_medium_;
    case kHostTier:
      return VllmMedium::kCpu;
    case kDiskTier:
      return VllmMedium::kDisk;
  }
  return pool_medium_;
}

uint8_t VllmConverter::PlacesOf(uint8_t places, VllmMedium medium) const {
  uint8_t of = 0;
  for (Place place : {kPool, kHostTier, kDiskTier}) {
    if ((places & place) != 0 && MediumOf(place) == medium) of |= place;
  }
  return of;
}

VllmConverter::Key VllmConverter::KeyOf(const BlockHash& hash) const {
  if (group_windows_.empty()) return {VllmBlockId(hash, algorithm_), -1};
  if (auto it = keys_.find(hash); it != keys_.end()) return it->second;
  return {VllmBlockId(hash, algorithm_), 0};
}

bool VllmConverter::Store(Place place, const BlockHash& hash, const BlockHash* parent,
                          std::span<const int32_t> tokens) {
  Origin origin{-1, VllmBlockId(hash, algorithm_), std::nullopt};
  if (parent != nullptr) origin.parent_id = VllmBlockId(*parent, algorithm_);
  return StoreAs(place, hash, origin, tokens);
}

bool VllmConverter::StoreAs(Place place, const BlockHash& hash, const Origin& origin,
                            std::span<const int32_t> tokens) {
  if (tokens.size() != block_size_) return false;
  const uint64_t id = origin.id;
  const Key key{id, origin.group};
  auto [it, inserted] = published_.try_emplace(key, Published{hash, 0, {}});
  // Another hash with the same 64 bits (in the same group) is published already: a
  // consumer could not tell them apart, so this one is left out.
  if (!inserted && !(it->second.hash == hash)) return false;
  if (inserted && origin.group >= 0) keys_[hash] = key;
  const VllmMedium medium = MediumOf(place);
  const bool announced = PlacesOf(it->second.places, medium) != 0;
  it->second.places |= place;
  if (inserted) it->second.tokens.assign(tokens.begin(), tokens.end());
  if (announced) return true;
  const std::optional<uint64_t> parent_id = origin.parent_id;
  std::optional<VllmGroup> group;
  if (origin.group >= 0) {
    group = VllmGroup{origin.group, group_windows_[static_cast<size_t>(origin.group)]};
  }
  // The block continues the previous event's chain in the same medium (and group): one
  // event for both. Ids stay unique within the event (parent included), which consumers
  // require.
  VllmEvent* last = pending_.empty() ? nullptr : &pending_.back();
  const bool extends = last != nullptr && last->kind == VllmEvent::Kind::kBlockStored &&
                       last->medium == medium && last->group == group && parent_id &&
                       *parent_id == last->block_hashes.back() &&
                       std::find(last->block_hashes.begin(), last->block_hashes.end(), id) ==
                           last->block_hashes.end() &&
                       last->parent_block_hash != id;
  if (!extends) {
    VllmEvent stored;
    stored.kind = VllmEvent::Kind::kBlockStored;
    stored.parent_block_hash = parent_id;
    stored.medium = medium;
    stored.group = group;
    pending_.push_back(std::move(stored));
    last = &pending_.back();
  }
  last->block_hashes.push_back(id);
  for (int32_t token : tokens) last->token_ids.push_back(static_cast<uint32_t>(token));
  return true;
}

void VllmConverter::Remove(Place place, const BlockHash& hash) {
  auto it = published_.find(KeyOf(hash));
  // Never published here (or published for the other hash of a clash).
  if (it == published_.end() || !(it->second.hash == hash) || (it->second.places & place) == 0) {
    return;
  }
  it->second.places &= static_cast<uint8_t>(~place);
  const VllmMedium medium = MediumOf(place);
  const auto [id, group_index] = it->first;
  std::optional<VllmGroup> group;
  if (group_index >= 0) {
    group = VllmGroup{group_index, group_windows_[static_cast<size_t>(group_index)]};
  }
  const bool still_there = PlacesOf(it->second.places, medium) != 0;
  if (it->second.places == 0) {
    published_.erase(it);
    if (group_index >= 0) keys_.erase(hash);
  }
  if (still_there) return;
  VllmEvent* last = pending_.empty() ? nullptr : &pending_.back();
  if (last == nullptr || last->kind != VllmEvent::Kind::kBlockRemoved || last->medium != medium ||
      last->group != group) {
    VllmEvent removed;
    removed.kind = VllmEvent::Kind::kBlockRemoved;
    removed.medium = medium;
    removed.group = group;
    pending_.push_back(std::move(removed));
    last = &pending_.back();
  }
  last->block_hashes.push_back(id);
}

void VllmConverter::StorePoolBlock(const BlockEvent& event) {
  std::span<const int32_t> tokens;
  if (auto committed = commit_tokens_.find(event.block); committed != commit_tokens_.end()) {
    tokens = committed->second;
  } else if (auto known = published_.find(KeyOf(event.hash));
             known != published_.end() && known->second.hash == event.hash) {
    tokens = known->second.tokens;  // loaded from a tier that announced it
  }
  bool stored = false;
  if (group_windows_.empty()) {
    stored = Store(kPool, event.hash, event.has_parent ? &event.parent_hash : nullptr, tokens);
  } else if (auto commit = commit_origins_.find(event.hash); commit != commit_origins_.end()) {
    // With groups, only as its commit taught: the ledger's hash of group g > 0 is not the
    // plain hash it is published with.
    stored = StoreAs(kPool, event.hash, commit->second.origin, commit->second.tokens);
  }
  if (!stored) ++blocks_without_tokens_;
}

void VllmConverter::AddBatch(std::span<const BlockEvent> events, bool cleared) {
  if (cleared) Clear();
  for (const BlockEvent& event : events) {
    switch (event.kind) {
      case BlockEvent::Kind::kStored:
        StorePoolBlock(event);
        break;
      case BlockEvent::Kind::kRemoved:
        Remove(kPool, event.hash);
        break;
      case BlockEvent::Kind::kAllCleared:
        Clear();
        break;
    }
  }
  // Tokens of blocks that stored nothing (indexed already) are not kept past their batch.
  commit_tokens_.clear();
  commit_origins_.clear();
}

void VllmConverter::AddTierEvents(std::span<const tiers::TierEvent> events) {
  for (const tiers::TierEvent& event : events) {
    const Place place = event.tier == tiers::Tier::kHost ? kHostTier : kDiskTier;
    if (event.kind == tiers::TierEvent::Kind::kRemoved) {
      Remove(place, event.hash);
      continue;
    }
    const tiers::BlockLineage& lineage = event.lineage;
    if (!Store(place, event.hash, lineage.has_parent ? &lineage.parent : nullptr, lineage.tokens)) {
      ++blocks_without_tokens_;
    }
  }
}

std::vector<VllmEvent> VllmConverter::Take() {
  std::vector<VllmEvent> taken;
  taken.swap(pending_);
  return taken;
}

}  // namespace kvcm::cache_manager
