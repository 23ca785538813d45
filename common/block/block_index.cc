#include "common/block/block_index.h"

#include <bit>

#include "common/base/check.h"

namespace kvcm {

BlockIndex::BlockIndex(int32_t num_blocks) {
  KVCM_CHECK(num_blocks > 0 && num_blocks <= (int32_t{1} << 30)) << "num_blocks " << num_blocks;
  // At least eight times the most entries it can hold: at most an eighth full, the probe and
  // shift loops mostly end at their first slot (the header says what this was measured on).
  const size_t capacity = std::bit_ceil(8 * static_cast<size_t>(num_blocks));
  slots_.assign(capacity, Entry{});
  mask_ = capacity - 1;
}

}  // namespace kvcm
