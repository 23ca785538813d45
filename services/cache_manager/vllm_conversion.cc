#include "services/cache_manager/vllm_conversion.h"

#include <algorithm>
#include <optional>
#include <utility>

#include "common/base/check.h"

namespace kvcm {

VllmConverter::VllmConverter(int32_t block_size, HashAlgorithm algorithm)
    : block_size_(static_cast<size_t>(block_size)), algorithm_(algorithm) {
  KVCM_CHECK(block_size > 0);
}

void VllmConverter::AddCommitTokens(std::span<const BlockId> block_table,
                                    int32_t num_committed_tokens,
                                    std::span<const int32_t> tokens) {
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

void VllmConverter::Clear() {
  stored_.clear();
  VllmEvent event;
  event.kind = VllmEvent::Kind::kAllBlocksCleared;
  pending_.push_back(std::move(event));
}

void VllmConverter::AddBatch(std::span<const BlockEvent> events, bool cleared) {
  if (cleared) Clear();
  for (const BlockEvent& event : events) {
    switch (event.kind) {
      case BlockEvent::Kind::kStored: {
        auto tokens = commit_tokens_.find(event.block);
        if (tokens == commit_tokens_.end() || tokens->second.size() != block_size_) {
          ++blocks_without_tokens_;
          break;
        }
        const uint64_t id = VllmBlockId(event.hash, algorithm_);
        if (!stored_.insert(id).second) {
          // Another hash with the same 64 bits is stored already: a consumer could not tell
          // them apart, so this one is left out.
          ++blocks_without_tokens_;
          break;
        }
        const std::optional<uint64_t> parent =
            event.has_parent ? std::optional<uint64_t>(VllmBlockId(event.parent_hash, algorithm_))
                             : std::nullopt;
        // The block continues the previous event's chain: one event for both. Ids stay
        // unique within the event (parent included), which consumers require.
        VllmEvent* last = pending_.empty() ? nullptr : &pending_.back();
        const bool extends =
            last != nullptr && last->kind == VllmEvent::Kind::kBlockStored && parent &&
            *parent == last->block_hashes.back() &&
            std::find(last->block_hashes.begin(), last->block_hashes.end(), id) ==
                last->block_hashes.end() &&
            last->parent_block_hash != id;
        if (!extends) {
          VllmEvent stored;
          stored.kind = VllmEvent::Kind::kBlockStored;
          stored.parent_block_hash = parent;
          pending_.push_back(std::move(stored));
          last = &pending_.back();
        }
        last->block_hashes.push_back(id);
        for (int32_t token : tokens->second) {
          last->token_ids.push_back(static_cast<uint32_t>(token));
        }
        break;
      }
      case BlockEvent::Kind::kRemoved: {
        const uint64_t id = VllmBlockId(event.hash, algorithm_);
        if (stored_.erase(id) == 0) break;  // never published
        VllmEvent* last = pending_.empty() ? nullptr : &pending_.back();
        if (last == nullptr || last->kind != VllmEvent::Kind::kBlockRemoved) {
          VllmEvent removed;
          removed.kind = VllmEvent::Kind::kBlockRemoved;
          pending_.push_back(std::move(removed));
          last = &pending_.back();
        }
        last->block_hashes.push_back(id);
        break;
      }
      case BlockEvent::Kind::kAllCleared:
        Clear();
        break;
    }
  }
  // Tokens of blocks that stored nothing (indexed already) are not kept past their batch.
  commit_tokens_.clear();
}

std::vector<VllmEvent> VllmConverter::Take() {
  std::vector<VllmEvent> taken;
  taken.swap(pending_);
  return taken;
}

}  // namespace kvcm
