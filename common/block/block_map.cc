#include "common/block/block_map.h"

namespace kvcm {

std::string_view MapStateName(MapState state) {
  switch (state) {
    case MapState::kFree:
      return "free";
    case MapState::kInUse:
      return "in_use";
    case MapState::kCached:
      return "cached";
    case MapState::kPinned:
      return "pinned";
    case MapState::kQuarantined:
      return "quarantined";
    case MapState::kDraining:
      return "draining";
  }
  return "unknown";
}

int32_t BlocksPerCell(int32_t num_blocks, int32_t max_cells) {
  if (num_blocks <= max_cells) return 1;
  return static_cast<int32_t>((int64_t{num_blocks} + max_cells - 1) / max_cells);
}

}  // namespace kvcm
