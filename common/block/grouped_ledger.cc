#include "common/block/grouped_ledger.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/base/check.h"

namespace kvcm {
namespace {

// An op the plan showed would succeed, on one group's sequence: failing is a bug here.
void MustSucceed(const absl::Status& status) { KVCM_CHECK(status.ok()) << status.ToString(); }

}  // namespace

BlockHash GroupBlockHash(HashAlgorithm algorithm, const BlockHash& hash, int32_t group) {
  if (group == 0) return hash;
  const int32_t token = -1 - group;
  return ChainBlockHash(algorithm, hash, std::span(&token, 1));
}

absl::StatusOr<GroupedLedger> GroupedLedger::Create(Options options) {
  if (absl::Status status = BlockLedger::CheckOptions(options.pool); !status.ok()) return status;
  if (options.group_windows.empty()) {
    options.group_windows = {options.pool.sliding_window_tokens};
  }
  for (size_t g = 0; g < options.group_windows.size(); ++g) {
    if (options.group_windows[g] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("group ", g, ": negative window ", options.group_windows[g], " tokens"));
    }
  }
  if (options.group_windows.size() > 1 && options.pool.sliding_window_tokens != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a grouped ledger's windows are its groups'; the pool's sliding_window_tokens must be "
        "0, got ",
        options.pool.sliding_window_tokens));
  }
  if (options.group_windows.size() == 1) {
    // One group is a BlockLedger: its window is the pool's.
    if (options.pool.sliding_window_tokens != 0 &&
        options.pool.sliding_window_tokens != options.group_windows[0]) {
      return absl::InvalidArgumentError(
          absl::StrCat("one group of window ", options.group_windows[0],
                       " tokens on a pool of window ", options.pool.sliding_window_tokens));
    }
    options.pool.sliding_window_tokens = options.group_windows[0];
  }
  absl::StatusOr<BlockLedger> pool = BlockLedger::Create(options.pool);
  if (!pool.ok()) return pool.status();
  return GroupedLedger(std::move(options), *std::move(pool));
}

GroupedLedger::GroupedLedger(Options options, BlockLedger pool)
    : options_(std::move(options)), pool_(std::move(pool)) {
  window_released_.assign(options_.group_windows.size(), 0);
  table_entries_.assign(options_.group_windows.size(), 0);
  hashes_.resize(options_.group_windows.size());
}

absl::StatusOr<SeqId> GroupedLedger::FirstOf(SeqId seq) const {
  if (num_groups() == 1) {
    if (pool_.IsLive(seq)) return seq;
    return absl::NotFoundError(
        absl::StrCat("unknown sequence ", seq, " (never allocated, or already freed)"));
  }
  auto it = first_of_.find(seq);
  if (it == first_of_.end()) {
    return absl::NotFoundError(
        absl::StrCat("unknown sequence ", seq, " (never allocated, or already freed)"));
  }
  return it->second;
}

void GroupedLedger::DeriveHashes(std::span<const BlockHash> block_hashes) const {
  for (int32_t g = 0; g < num_groups(); ++g) {
    std::vector<BlockHash>& out = hashes_[static_cast<size_t>(g)];
    out.clear();
    for (const BlockHash& h : block_hashes) {
      out.push_back(GroupBlockHash(options_.hash_algorithm, h, g));
    }
  }
}

// --- Prefix hits ---------------------------------------------------------------------------

int32_t GroupedLedger::ReleasedAt(int32_t window, int32_t hit) const {
  if (window == 0) return 0;
  // The first query computed is at token hit x block_size; it reads from there - window + 1.
  const int64_t first_needed = int64_t{hit} * block_size() - window + 1;
  return first_needed <= 0 ? 0 : static_cast<int32_t>(first_needed / block_size());
}

bool GroupedLedger::GroupServes(int32_t group, int32_t hit) const {
  const std::vector<BlockHash>& hashes = hashes_[static_cast<size_t>(group)];
  const int32_t from = ReleasedAt(options_.group_windows[static_cast<size_t>(group)], hit);
  for (int32_t i = from; i < hit; ++i) {
    if (pool_.IndexedBlock(hashes[static_cast<size_t>(i)]) == kNoBlock) return false;
  }
  return true;
}

AllocateOptions GroupedLedger::OneWindowHit(int32_t num_tokens,
                                            std::span<const BlockHash> block_hashes) const {
  DeriveHashes(block_hashes);  // group 0's hashes are the caller's
  // A hit never covers the last prompt token (its logits must be computed).
  const int32_t matchable = std::min(static_cast<int32_t>(block_hashes.size()),
                                     num_tokens > 0 ? (num_tokens - 1) / block_size() : 0);
  const int32_t hit = CommonHit(matchable);
  const int32_t released = ReleasedAt(options_.group_windows[0], hit);
  return AllocateOptions{
      .window_tokens = -1, .released_blocks = released, .max_hit_blocks = hit - released};
}

int32_t GroupedLedger::CommonHit(int32_t matchable) const {
  // Full groups bound the hit from the left.
  int32_t hit = matchable;
  for (int32_t g = 0; g < num_groups(); ++g) {
    if (options_.group_windows[static_cast<size_t>(g)] != 0) continue;
    hit = std::min(
        hit,
        pool_.Lookup(std::span(hashes_[static_cast<size_t>(g)]).first(static_cast<size_t>(hit))));
  }
  // Window groups from the right: the longest hit at most `hit` each serves. A shorter hit
  // for one group may not suit another (it reads other blocks), so repeat until all agree;
  // the hit only shrinks, and 0 suits every group.
  bool changed = true;
  while (changed && hit > 0) {
    changed = false;
    for (int32_t g = 0; g < num_groups() && hit > 0; ++g) {
      if (options_.group_windows[static_cast<size_t>(g)] == 0) continue;
      while (hit > 0 && !GroupServes(g, hit)) {
        --hit;
        changed = true;
      }
    }
  }
  return hit;
}

absl::StatusOr<GroupedLedger::Plan> GroupedLedger::PlanAllocate(
    SeqId seq, int32_t num_tokens, std::span<const BlockHash> block_hashes) const {
  if (first_of_.contains(seq)) {
    return absl::AlreadyExistsError(absl::StrCat("sequence ", seq, " is already live"));
  }
  // The pool's own checks (negative tokens, too many hashes, larger than the pool), on a
  // sequence id it does not know, without matching anything.
  absl::StatusOr<AdmissionPlan> checked = pool_.CanAllocate(
      next_first_, num_tokens, block_hashes.first(0), AllocateOptions{.window_tokens = 0});
  if (!checked.ok() && !absl::IsResourceExhausted(checked.status())) return checked.status();
  if (static_cast<size_t>(num_tokens / block_size()) < block_hashes.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("sequence ", seq, ": ", block_hashes.size(), " block hashes for ", num_tokens,
                     " tokens, which fill only ", num_tokens / block_size(), " blocks"));
  }
  DeriveHashes(block_hashes);
  // A hit never covers the last prompt token (its logits must be computed).
  const int32_t matchable = std::min(static_cast<int32_t>(block_hashes.size()),
                                     num_tokens > 0 ? (num_tokens - 1) / block_size() : 0);
  Plan plan;
  plan.hit = CommonHit(matchable);
  const int32_t total = (num_tokens + block_size() - 1) / block_size();
  for (int32_t g = 0; g < num_groups(); ++g) {
    const int32_t released = ReleasedAt(options_.group_windows[static_cast<size_t>(g)], plan.hit);
    plan.blocks_needed += total - plan.hit;
    for (int32_t i = released; i < plan.hit; ++i) {
      const BlockId b = pool_.IndexedBlock(hashes_[static_cast<size_t>(g)][static_cast<size_t>(i)]);
      if (pool_.StateOf(b) == BlockState::kCached) ++plan.reused_from_lru;
    }
  }
  const int32_t available = pool_.AvailableBlocks() - plan.reused_from_lru;
  if (plan.blocks_needed > available) {
    return absl::ResourceExhaustedError(
        absl::StrCat("sequence ", seq, ": needs ", plan.blocks_needed, " new blocks in ",
                     num_groups(), " KV cache groups (", num_tokens, " tokens, ", plan.hit,
                     " blocks cached in every group), but only ", available, " can be taken now"));
  }
  return plan;
}

absl::StatusOr<AdmissionPlan> GroupedLedger::CanAllocate(
    SeqId seq, int32_t num_tokens, std::span<const BlockHash> block_hashes) const {
  if (OneWindowGroup()) {
    const AllocateOptions hit = OneWindowHit(num_tokens, block_hashes);
    absl::StatusOr<AdmissionPlan> plan = pool_.CanAllocate(seq, num_tokens, block_hashes, hit);
    // The hit counts the leading blocks it lies past too, as Allocate's cached tokens do.
    if (plan.ok()) plan->prefix_hit_blocks += hit.released_blocks;
    return plan;
  }
  if (num_groups() == 1) return pool_.CanAllocate(seq, num_tokens, block_hashes);
  absl::StatusOr<Plan> plan = PlanAllocate(seq, num_tokens, block_hashes);
  if (!plan.ok()) return plan.status();
  AdmissionPlan out;
  out.blocks_needed = plan->blocks_needed;
  out.prefix_hit_blocks = plan->hit;
  out.evictions =
      std::max(0, plan->blocks_needed - (pool_.AvailableBlocks() - pool_.Stats().cached_blocks));
  return out;
}

int32_t GroupedLedger::ReusableBlocks(int32_t num_tokens,
                                      std::span<const BlockHash> block_hashes) const {
  if (OneWindowGroup()) {
    const AllocateOptions hit = OneWindowHit(num_tokens, block_hashes);
    return hit.released_blocks + hit.max_hit_blocks;
  }
  if (num_groups() == 1) return pool_.ReusableBlocks(num_tokens, block_hashes);
  if (num_tokens <= 0) return 0;
  DeriveHashes(block_hashes);
  const int32_t matchable =
      std::min(static_cast<int32_t>(block_hashes.size()), (num_tokens - 1) / block_size());
  return CommonHit(matchable);
}

int32_t GroupedLedger::Lookup(std::span<const BlockHash> block_hashes) const {
  if (num_groups() == 1 && !OneWindowGroup()) return pool_.Lookup(block_hashes);
  DeriveHashes(block_hashes);
  return CommonHit(static_cast<int32_t>(block_hashes.size()));
}

absl::Status GroupedLedger::Pin(const std::string& name, std::span<const BlockHash> block_hashes) {
  if (num_groups() == 1) return pool_.Pin(name, block_hashes);
  // Every group's hashes under the one name, so that Unpin(name) releases them all.
  DeriveHashes(block_hashes);
  std::vector<BlockHash> all;
  all.reserve(block_hashes.size() * static_cast<size_t>(num_groups()));
  for (const std::vector<BlockHash>& group : hashes_)
    all.insert(all.end(), group.begin(), group.end());
  return pool_.Pin(name, all);
}

// --- Sequences -----------------------------------------------------------------------------

template <typename Take>
absl::Status GroupedLedger::AllocateGroups(SeqId seq, int32_t num_tokens,
                                           std::span<const BlockHash> block_hashes, Take&& take) {
  absl::StatusOr<Plan> plan = PlanAllocate(seq, num_tokens, block_hashes);
  if (!plan.ok()) {
    if (absl::IsResourceExhausted(plan.status())) ++allocation_failures_;
    return plan.status();
  }
  // Hold every block the groups will share, so that no group's evictions take another's.
  held_.clear();
  for (int32_t g = 0; g < num_groups(); ++g) {
    const int32_t released = ReleasedAt(options_.group_windows[static_cast<size_t>(g)], plan->hit);
    for (int32_t i = released; i < plan->hit; ++i) {
      const BlockId b = pool_.IndexedBlock(hashes_[static_cast<size_t>(g)][static_cast<size_t>(i)]);
      MustSucceed(pool_.Hold(b));
      held_.push_back(b);
    }
  }
  const SeqId first = next_first_;
  next_first_ += static_cast<SeqId>(num_groups());
  for (int32_t g = 0; g < num_groups(); ++g) {
    const int32_t window = options_.group_windows[static_cast<size_t>(g)];
    const int32_t released = ReleasedAt(window, plan->hit);
    const AllocateOptions allocate{.window_tokens = window,
                                   .released_blocks = released,
                                   .max_hit_blocks = plan->hit - released};
    // Only the hashes up to the hit are matched; the rest are known for later commits.
    MustSucceed(CountEntries(g, [&] {
      return pool_.Allocate(IdOf(first, g), num_tokens, hashes_[static_cast<size_t>(g)], allocate,
                            &scratch_);
    }));
    KVCM_CHECK(scratch_.num_cached_tokens == plan->hit * block_size())
        << "group " << g << " found " << scratch_.num_cached_tokens << " tokens, planned "
        << plan->hit * block_size();
    take(g);
  }
  for (BlockId b : held_) MustSucceed(pool_.Unhold(b));
  first_of_.emplace(seq, first);
  return absl::OkStatus();
}

absl::Status GroupedLedger::Allocate(SeqId seq, int32_t num_tokens,
                                     std::span<const BlockHash> block_hashes,
                                     GroupedTables* result) {
  result->groups.resize(static_cast<size_t>(num_groups()));
  if (num_groups() == 1) {
    absl::Status status = OneWindowGroup()
                              ? pool_.Allocate(seq, num_tokens, block_hashes,
                                               OneWindowHit(num_tokens, block_hashes), &scratch_)
                              : pool_.Allocate(seq, num_tokens, block_hashes, &scratch_);
    if (!status.ok()) return status;
    result->groups[0] = scratch_.blocks;
    result->num_cached_tokens = scratch_.num_cached_tokens;
    return absl::OkStatus();
  }
  absl::Status status = AllocateGroups(seq, num_tokens, block_hashes, [&](int32_t g) {
    result->groups[static_cast<size_t>(g)] = scratch_.blocks;
  });
  if (!status.ok()) return status;
  result->num_cached_tokens = scratch_.num_cached_tokens;
  return absl::OkStatus();
}

absl::Status GroupedLedger::Allocate(SeqId seq, int32_t num_tokens,
                                     std::span<const BlockHash> block_hashes,
                                     AllocateResult* result, std::vector<BlockId>* group_blocks) {
  group_blocks->clear();
  if (OneWindowGroup()) {
    return pool_.Allocate(seq, num_tokens, block_hashes, OneWindowHit(num_tokens, block_hashes),
                          result);
  }
  if (num_groups() == 1) return pool_.Allocate(seq, num_tokens, block_hashes, result);
  absl::Status status = AllocateGroups(seq, num_tokens, block_hashes, [&](int32_t g) {
    if (g == 0) {
      result->blocks.swap(scratch_.blocks);
    } else {
      group_blocks->insert(group_blocks->end(), scratch_.blocks.begin(), scratch_.blocks.end());
    }
  });
  if (!status.ok()) return status;
  result->num_cached_tokens = scratch_.num_cached_tokens;
  return absl::OkStatus();
}

absl::Status GroupedLedger::CanAppendGroups(SeqId first, SeqId seq, int32_t num_new_tokens) const {
  // Every group grows by the same blocks; take none unless all fit.
  int32_t needed = 0;
  for (int32_t g = 0; g < num_groups(); ++g) {
    absl::StatusOr<AdmissionPlan> plan = pool_.CanAppend(IdOf(first, g), num_new_tokens);
    if (!plan.ok()) return plan.status();
    needed += plan->blocks_needed;
  }
  if (needed > pool_.AvailableBlocks()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("sequence ", seq, ": appending ", num_new_tokens, " tokens needs ", needed,
                     " new blocks in ", num_groups(), " KV cache groups, but only ",
                     pool_.AvailableBlocks(), " can be taken now"));
  }
  return absl::OkStatus();
}

absl::Status GroupedLedger::Append(SeqId seq, int32_t num_new_tokens, GroupedAppendResult* result) {
  absl::StatusOr<SeqId> first = FirstOf(seq);
  if (!first.ok()) return first.status();
  if (num_groups() > 1) {
    if (absl::Status status = CanAppendGroups(*first, seq, num_new_tokens); !status.ok()) {
      if (absl::IsResourceExhausted(status)) ++allocation_failures_;
      return status;
    }
  }
  result->groups.resize(static_cast<size_t>(num_groups()));
  for (int32_t g = 0; g < num_groups(); ++g) {
    if (num_groups() == 1) {
      return pool_.Append(IdOf(*first, g), num_new_tokens, &result->groups[0]);
    }
    MustSucceed(CountEntries(g, [&] {
      return pool_.Append(IdOf(*first, g), num_new_tokens, &result->groups[static_cast<size_t>(g)]);
    }));
  }
  return absl::OkStatus();
}

absl::Status GroupedLedger::Append(SeqId seq, int32_t num_new_tokens, AppendResult* result,
                                   std::vector<BlockId>* group_blocks) {
  group_blocks->clear();
  if (num_groups() == 1) return pool_.Append(seq, num_new_tokens, result);
  absl::StatusOr<SeqId> first = FirstOf(seq);
  if (!first.ok()) return first.status();
  if (absl::Status status = CanAppendGroups(*first, seq, num_new_tokens); !status.ok()) {
    if (absl::IsResourceExhausted(status)) ++allocation_failures_;
    return status;
  }
  MustSucceed(CountEntries(0, [&] { return pool_.Append(*first, num_new_tokens, result); }));
  for (int32_t g = 1; g < num_groups(); ++g) {
    MustSucceed(CountEntries(
        g, [&] { return pool_.Append(IdOf(*first, g), num_new_tokens, &append_scratch_); }));
    group_blocks->insert(group_blocks->end(), append_scratch_.new_blocks.begin(),
                         append_scratch_.new_blocks.end());
    result->copies.insert(result->copies.end(), append_scratch_.copies.begin(),
                          append_scratch_.copies.end());
  }
  return absl::OkStatus();
}

absl::Status GroupedLedger::Fork(SeqId parent, SeqId child) {
  if (num_groups() == 1) return pool_.Fork(parent, child);
  absl::StatusOr<SeqId> first = FirstOf(parent);
  if (!first.ok()) return first.status();
  if (first_of_.contains(child)) {
    return absl::AlreadyExistsError(absl::StrCat("cannot fork ", parent, " into ", child,
                                                 ": sequence ", child, " is already live"));
  }
  const SeqId child_first = next_first_;
  next_first_ += static_cast<SeqId>(num_groups());
  for (int32_t g = 0; g < num_groups(); ++g) {
    MustSucceed(CountEntries(g, [&] { return pool_.Fork(IdOf(*first, g), IdOf(child_first, g)); }));
  }
  first_of_.emplace(child, child_first);
  return absl::OkStatus();
}

absl::Status GroupedLedger::Commit(SeqId seq, int32_t num_committed_tokens,
                                   std::span<const BlockHash> new_block_hashes) {
  if (num_groups() == 1) return pool_.Commit(seq, num_committed_tokens, new_block_hashes);
  absl::StatusOr<SeqId> first = FirstOf(seq);
  if (!first.ok()) return first.status();
  DeriveHashes(new_block_hashes);
  // Group 0 checks the commit; the others hold the same tokens, so they accept it too.
  for (int32_t g = 0; g < num_groups(); ++g) {
    const uint64_t released_before = pool_.Stats().window_released;
    absl::Status status = CountEntries(g, [&] {
      return pool_.Commit(IdOf(*first, g), num_committed_tokens, hashes_[static_cast<size_t>(g)]);
    });
    if (g == 0 && !status.ok()) return status;
    MustSucceed(status);
    window_released_[static_cast<size_t>(g)] += pool_.Stats().window_released - released_before;
  }
  return absl::OkStatus();
}

absl::Status GroupedLedger::Free(SeqId seq) {
  if (num_groups() == 1) return pool_.Free(seq);
  absl::StatusOr<SeqId> first = FirstOf(seq);
  if (!first.ok()) return first.status();
  for (int32_t g = 0; g < num_groups(); ++g) {
    MustSucceed(CountEntries(g, [&] { return pool_.Free(IdOf(*first, g)); }));
  }
  first_of_.erase(seq);
  return absl::OkStatus();
}

absl::Status GroupedLedger::Rename(SeqId seq, SeqId new_id) {
  if (num_groups() == 1) return pool_.Rename(seq, new_id);
  absl::StatusOr<SeqId> first = FirstOf(seq);
  if (!first.ok()) return first.status();
  if (first_of_.contains(new_id)) {
    return absl::AlreadyExistsError(absl::StrCat("cannot rename ", seq, " to ", new_id,
                                                 ": sequence ", new_id, " is already live"));
  }
  // The pool's ids stay: only the map names the sequence.
  first_of_.erase(seq);
  first_of_.emplace(new_id, *first);
  return absl::OkStatus();
}

absl::Status GroupedLedger::SetOwner(SeqId seq, uint64_t owner) {
  if (num_groups() == 1) return pool_.SetOwner(seq, owner);
  absl::StatusOr<SeqId> first = FirstOf(seq);
  if (!first.ok()) return first.status();
  for (int32_t g = 0; g < num_groups(); ++g) MustSucceed(pool_.SetOwner(IdOf(*first, g), owner));
  return absl::OkStatus();
}

uint64_t GroupedLedger::OwnerOf(SeqId seq) const {
  if (num_groups() == 1) return pool_.OwnerOf(seq);
  auto it = first_of_.find(seq);
  return it == first_of_.end() ? 0 : pool_.OwnerOf(it->second);
}

// --- Introspection -------------------------------------------------------------------------

absl::StatusOr<GroupedTables> GroupedLedger::BlockTables(SeqId seq) const {
  absl::StatusOr<SeqId> first = FirstOf(seq);
  if (!first.ok()) return first.status();
  GroupedTables tables;
  for (int32_t g = 0; g < num_groups(); ++g) {
    absl::StatusOr<std::vector<BlockId>> table = pool_.BlockTable(IdOf(*first, g));
    if (!table.ok()) return table.status();
    tables.groups.push_back(*std::move(table));
  }
  absl::StatusOr<int32_t> committed = pool_.NumCommittedTokens(*first);
  if (!committed.ok()) return committed.status();
  tables.num_cached_tokens = *committed;
  return tables;
}

absl::StatusOr<std::vector<BlockId>> GroupedLedger::BlockTable(SeqId seq) const {
  if (num_groups() == 1) return pool_.BlockTable(seq);
  absl::StatusOr<SeqId> first = FirstOf(seq);
  if (!first.ok()) return first.status();
  return pool_.BlockTable(*first);
}

absl::StatusOr<int32_t> GroupedLedger::NumTokens(SeqId seq) const {
  if (num_groups() == 1) return pool_.NumTokens(seq);
  absl::StatusOr<SeqId> first = FirstOf(seq);
  if (!first.ok()) return first.status();
  return pool_.NumTokens(*first);
}

absl::StatusOr<int32_t> GroupedLedger::NumCommittedTokens(SeqId seq) const {
  if (num_groups() == 1) return pool_.NumCommittedTokens(seq);
  absl::StatusOr<SeqId> first = FirstOf(seq);
  if (!first.ok()) return first.status();
  return pool_.NumCommittedTokens(*first);
}

LedgerStats GroupedLedger::Stats() const {
  LedgerStats stats = pool_.Stats();
  if (num_groups() == 1) return stats;
  stats.live_sequences = static_cast<int32_t>(first_of_.size());
  // Every group's Allocate counts the same prompt and hit: count them once.
  stats.prefix_query_tokens /= static_cast<uint64_t>(num_groups());
  stats.prefix_hit_tokens /= static_cast<uint64_t>(num_groups());
  // Refused before any group's pool saw the request.
  stats.allocation_failures += allocation_failures_;
  return stats;
}

std::vector<GroupStats> GroupedLedger::PerGroupStats() const {
  std::vector<GroupStats> stats(static_cast<size_t>(num_groups()));
  const std::vector<uint64_t> released = WindowReleasedByGroup();
  const std::vector<int64_t> held = HeldBlocksByGroup();
  for (size_t g = 0; g < stats.size(); ++g) {
    stats[g].window = options_.group_windows[g];
    stats[g].window_released = released[g];
    stats[g].held_blocks = held[g];
  }
  return stats;
}

absl::Status GroupedLedger::CheckInvariants() const {
  if (absl::Status status = pool_.CheckInvariants(); !status.ok()) return status;
  if (num_groups() == 1) return absl::OkStatus();  // the pool's sequences are this ledger's
  int64_t live = 0;
  std::vector<int64_t> entries(static_cast<size_t>(num_groups()), 0);
  for (const auto& [seq, first] : first_of_) {
    absl::StatusOr<int32_t> tokens = pool_.NumTokens(IdOf(first, 0));
    absl::StatusOr<int32_t> committed = pool_.NumCommittedTokens(IdOf(first, 0));
    if (!tokens.ok() || !committed.ok()) {
      return absl::InternalError(absl::StrCat("sequence ", seq, ": group 0 is not live"));
    }
    for (int32_t g = 0; g < num_groups(); ++g) {
      const SeqId id = IdOf(first, g);
      ++live;
      if (pool_.NumTokens(id).value_or(-1) != *tokens ||
          pool_.NumCommittedTokens(id).value_or(-1) != *committed) {
        return absl::InternalError(absl::StrCat("sequence ", seq, ": group ", g,
                                                " holds other tokens than group 0 (", *tokens,
                                                " tokens, ", *committed, " committed)"));
      }
      // Nothing the window has passed is held.
      const int32_t window = options_.group_windows[static_cast<size_t>(g)];
      const int64_t first_needed = int64_t{*committed} - window + 1;
      const std::vector<BlockId> table = *pool_.BlockTable(id);
      entries[static_cast<size_t>(g)] +=
          std::count_if(table.begin(), table.end(), [](BlockId b) { return b != kNoBlock; });
      for (size_t i = 0; window > 0 && i < table.size(); ++i) {
        if (table[i] != kNoBlock && int64_t(i + 1) * block_size() <= first_needed) {
          return absl::InternalError(absl::StrCat("sequence ", seq, ": group ", g, " holds block ",
                                                  i, " behind its window of ", window, " tokens"));
        }
      }
    }
  }
  if (entries != table_entries_) {
    for (size_t g = 0; g < entries.size(); ++g) {
      if (entries[g] != table_entries_[g]) {
        return absl::InternalError(absl::StrCat("group ", g, " counts ", table_entries_[g],
                                                " held blocks, its tables hold ", entries[g]));
      }
    }
  }
  if (live != pool_.Stats().live_sequences) {
    return absl::InternalError(absl::StrCat("the pool has ", pool_.Stats().live_sequences,
                                            " live sequences, the groups account for ", live));
  }
  return absl::OkStatus();
}

}  // namespace kvcm
