#pragma once

// BlockMap: the pool as a map of cells, each the state of one block or of a fixed run of
// blocks, with the number of blocks in each state. The cache manager computes it
// (BlockLedger::FillBlockMap) for the router's /dashboard and `kvcmctl watch`; it travels
// as BlockMapReply (schemas/kvcm_protocol.fbs, codec in common/wire/block_map_codec.h).
//
// States, as the metric kvcm_cache_manager_blocks{state} counts them, partition the pool:
// the ledger's four (common/block/block_ledger.h) and, of the blocks in use, those held only
// by quarantined sessions or only by draining sequences (docs/architecture.md, "Fencing"),
// which the cache manager knows and the ledger does not.
//
// Thread safety: plain values.

#include <array>
#include <cstdint>
#include <string_view>
#include <vector>

namespace kvcm {

enum class MapState : uint8_t { kFree, kInUse, kCached, kPinned, kQuarantined, kDraining };
inline constexpr int kMapStates = 6;
// "free", "in_use", "cached", "pinned", "quarantined", "draining": the metric's labels.
std::string_view MapStateName(MapState state);

// Cells a BlockMap request may ask for at most (a reply of about 1 MiB), and what it gets
// when it asks for none.
inline constexpr int32_t kMaxBlockMapCells = 1 << 20;
inline constexpr int32_t kDefaultBlockMapCells = 4096;

struct BlockMap {
  int32_t num_blocks = 0;
  // Cell i covers blocks [i * blocks_per_cell, (i + 1) * blocks_per_cell), the last one
  // possibly fewer. Its state is the one most of its blocks are in; on a tie the later
  // state in MapState's order, so that a quarantined or draining block is not hidden by as
  // many ordinary ones.
  int32_t blocks_per_cell = 1;
  std::vector<MapState> cells;  // ceil(num_blocks / blocks_per_cell) of them
  // Blocks in each state, indexed by MapState; they sum to num_blocks.
  std::array<int32_t, kMapStates> counts{};

  int32_t count(MapState state) const { return counts[static_cast<size_t>(state)]; }
  friend bool operator==(const BlockMap&, const BlockMap&) = default;
};

// The run of blocks one cell stands for when a pool of `num_blocks` is shown in at most
// `max_cells` cells: ceil(num_blocks / max_cells), at least 1. REQUIRES: max_cells > 0.
int32_t BlocksPerCell(int32_t num_blocks, int32_t max_cells);

}  // namespace kvcm
