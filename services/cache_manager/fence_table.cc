#include "services/cache_manager/fence_table.h"

#include <utility>

#include "common/base/check.h"

namespace kvcm::cache_manager {

const FenceTable::Fence& FenceTable::Open(uint64_t router_session, ReclaimReason reason,
                                          std::span<const SeqId> seqs,
                                          std::vector<SeqId> router_seqs,
                                          absl::flat_hash_set<uint64_t> waiting) {
  KVCM_CHECK(!seqs.empty() && !waiting.empty())
      << "a fence over " << seqs.size() << " sequences for " << waiting.size() << " executors";
  const uint64_t id = next_fence_id_++;
  Fence& fence = fences_[id];
  fence.id = id;
  fence.router_session = router_session;
  fence.reason = reason;
  fence.count_reclaimed = router_seqs.empty();
  fence.router_seqs = std::move(router_seqs);
  fence.waiting = std::move(waiting);
  fence.seqs.reserve(seqs.size());
  for (size_t i = 0; i < seqs.size(); ++i) fence.seqs.push_back(next_draining_seq_++);
  return fence;
}

std::optional<FenceTable::Fence> FenceTable::Acknowledge(uint64_t id, uint64_t executor) {
  auto it = fences_.find(id);
  if (it == fences_.end() || it->second.waiting.erase(executor) == 0) return std::nullopt;
  if (!it->second.waiting.empty()) return std::nullopt;
  std::optional<Fence> closed(std::move(it->second));
  fences_.erase(it);
  return closed;
}

bool FenceTable::Transfer(uint64_t id, uint64_t from, uint64_t to) {
  auto it = fences_.find(id);
  if (it == fences_.end() || it->second.waiting.erase(from) == 0) return false;
  it->second.waiting.insert(to);
  return true;
}

const FenceTable::Fence* FenceTable::Find(uint64_t id) const {
  auto it = fences_.find(id);
  return it == fences_.end() ? nullptr : &it->second;
}

}  // namespace kvcm::cache_manager
