#pragma once
// The executor's side of KV cache groups (docs/architecture.md, "The hybrid KV cache"): a
// pool whose PoolView::kv_groups is not empty holds pages of spec.num_layers slots, each
// sequence has one block table per group, and layer l of the model reads and writes slot
// slot_of[l] of the blocks in its group's table (common/sizing/kv_cache_groups.h).
//
// The executor serves such a pool only when the model's own grouping (GroupLayers of its
// layer windows) is the pool's, group for group: the cache manager releases a window
// group's blocks by that group's window, and a layer reading another group's table, or
// another slot, would read another layer's keys.
//
// Thread safety: plain values and pure functions.

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "common/memory/pool_view.h"

namespace kvcm::executor {

// OK when a model whose layer l attends within layer_windows[l] tokens (0: the whole
// context) can read `pool` through its KV cache groups, or when the pool has none. With
// groups: GroupLayers(layer_windows) must equal pool.kv_groups exactly (the same number of
// groups, each with the same window and the same layers in the same order), the pool's
// spec.num_layers must be that grouping's group_size and the pool must release nothing by
// a pool-wide window (sliding_window_tokens 0: each group's window decides). Otherwise
// FAILED_PRECONDITION naming the first difference. The other dimensions (KV heads, head
// dim, dtype) are the caller's to check, as without groups.
absl::Status CheckPoolGroups(const PoolView& pool, std::span<const int32_t> layer_windows);

// Where each layer of a model lives in `pool`: its group (the index of its block table) and
// its pool layer (its slot). Without groups layer l is group 0 and pool layer l.
// REQUIRES: CheckPoolGroups(pool, windows) passed for the model's `num_layers` windows.
struct LayerPlace {
  int32_t group = 0;
  int32_t pool_layer = 0;
};
std::vector<LayerPlace> PlaceLayers(const PoolView& pool, int32_t num_layers);

// The number of block tables a sequence has on `pool`: one per group, one without groups.
inline int32_t NumBlockTables(const PoolView& pool) {
  return pool.kv_groups.empty() ? 1 : static_cast<int32_t>(pool.kv_groups.size());
}

// The first block-table index that a table whose layers attend within `window` tokens (0:
// the whole context) may hold as -1 (released) for a sequence whose first new token is at
// `first_query`: every block before it lies wholly before the window of each new token, so
// the cache manager may have given it back. 0 for full attention.
inline int64_t ReleasedBlocks(int32_t window, int64_t first_query, int32_t block_size) {
  return window > 0 ? std::max<int64_t>(0, first_query - window + 1) / block_size : 0;
}

// The slot (block x block_size + offset) each new token of a batch is written to through
// the dense tables `tables` ([num_seqs][max_blocks]), in token order: sequence i adds
// query_lens[i] tokens ending at context_lens[i]. REQUIRES: the tables were checked.
std::vector<int64_t> WriteSlots(std::span<const int32_t> query_lens,
                                std::span<const int32_t> context_lens, const int32_t* tables,
                                int32_t max_blocks, int32_t block_size);

}  // namespace kvcm::executor
