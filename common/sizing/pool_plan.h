#pragma once

// How many KV-cache blocks a memory budget buys, and what that means in tokens and sequences.
//
// The plan is pure arithmetic on a KvCacheSpec and a PoolBudget; it allocates nothing. The
// cache manager plans, logs the plan, then allocates exactly plan.pool_bytes; `kvcmctl plan`
// prints the same plan before anything starts.
//
// Thread safety: plain values; the functions here have no shared state.

#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <variant>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/sizing/kv_cache_spec.h"

namespace kvcm {

// Default safety margin for a fraction-of-free-memory budget: keep 10% of the chosen
// fraction back for allocator fragmentation and transient buffers. TGI multiplies its free
// memory by TGI_WIGGLE_ROOM = 0.90 for the same reason.
inline constexpr double kDefaultMemoryMargin = 0.10;

// Block ids are int32 in the block ledger, so a pool holds at most this many blocks.
inline constexpr int64_t kMaxNumBlocks = std::numeric_limits<int32_t>::max();

// An absolute budget: the pool may use at most `bytes` (`--pool-bytes`).
struct PoolBytesBudget {
  int64_t bytes = 0;
};

// A share of the device memory that is free after weights and activations
// (`--memory-fraction`, `--free-memory`, `--margin`):
//
//   usable = free_bytes x fraction x (1 - margin), rounded down to a whole byte.
//
// fraction is in (0, 1]; margin is in [0, 1). With fraction 1 and the default margin this is
// TGI's `free_memory x TGI_WIGGLE_ROOM`.
struct MemoryFractionBudget {
  int64_t free_bytes = 0;
  double fraction = 1.0;
  double margin = kDefaultMemoryMargin;
};

// A fixed number of blocks (`--num-blocks`), like vLLM's num_gpu_blocks_override.
struct BlockCountBudget {
  int64_t num_blocks = 0;
};

// Exactly one of the three budget kinds above; the variant makes "exactly one" a type fact.
struct PoolBudget {
  std::variant<PoolBytesBudget, MemoryFractionBudget, BlockCountBudget> kind;

  static PoolBudget Bytes(int64_t bytes) { return {PoolBytesBudget{bytes}}; }
  static PoolBudget FractionOfFree(int64_t free_bytes, double fraction,
                                   double margin = kDefaultMemoryMargin) {
    return {MemoryFractionBudget{free_bytes, fraction, margin}};
  }
  static PoolBudget Blocks(int64_t num_blocks) { return {BlockCountBudget{num_blocks}}; }

  // INVALID_ARGUMENT naming the field when a byte count is negative or zero, free_bytes is
  // negative, fraction is outside (0, 1], margin is outside [0, 1), or num_blocks is not in
  // [1, kMaxNumBlocks]. NaN fails every range check.
  absl::Status Validate() const;

  // Bytes the budget allows before rounding down to whole blocks. For a block count this is
  // num_blocks x bytes_per_block. INVALID_ARGUMENT if that overflows int64.
  // REQUIRES: Validate().ok(), bytes_per_block > 0.
  absl::StatusOr<int64_t> UsableBytes(int64_t bytes_per_block) const;

  // How the usable bytes come about, with the numbers filled in, e.g.
  //   "68719476736 B (64.00 GiB), an absolute budget"
  //   "85899345920 B (80.00 GiB) free x 0.9 fraction x (1 - 0.1 margin)
  //    = 69578470195 B (64.80 GiB)" (on one line)
  //   "4096 blocks x 2097152 B per block = 8589934592 B (8.00 GiB), a fixed block count"
  // REQUIRES: Validate().ok(), bytes_per_block > 0, UsableBytes(bytes_per_block).ok().
  std::string UsableBytesFormula(int64_t bytes_per_block) const;

  // "pool-bytes", "memory-fraction" or "num-blocks": the flag that selects the kind.
  std::string_view KindName() const;
};

// The outcome of PlanPool. All byte counts are exact.
struct PoolPlan {
  KvCacheSpec spec;
  PoolBudget budget;
  int64_t bytes_per_token = 0;  // spec.BytesPerToken()
  int64_t bytes_per_block = 0;  // spec.BytesPerBlock()
  int64_t usable_bytes = 0;     // budget.UsableBytes(bytes_per_block)
  int64_t num_blocks = 0;       // floor(usable_bytes / bytes_per_block), >= 1
  int64_t pool_bytes = 0;       // num_blocks x bytes_per_block: what gets allocated
  int64_t unused_bytes = 0;     // usable_bytes - pool_bytes, < bytes_per_block
  // num_blocks x block_size: the most tokens (prompt + generated, summed over all running
  // sequences) whose KV fits at once. TGI's max_batch_total_tokens.
  int64_t max_total_tokens = 0;
};

// Sizes a pool for `spec` within `budget`.
// Errors:
//   INVALID_ARGUMENT   spec or budget invalid (the message names the field), or the budget
//                      gives more than kMaxNumBlocks blocks (use a larger block size).
//   RESOURCE_EXHAUSTED the budget is valid but smaller than one block: not a malformed
//                      input, just too little memory, as when a device has too little free.
absl::StatusOr<PoolPlan> PlanPool(const KvCacheSpec& spec, const PoolBudget& budget);

// How many sequences of one length fit in a plan's pool, if each has its own blocks (no
// prefix sharing, which can only let more fit).
struct SequenceFit {
  int64_t seq_len = 0;              // tokens per sequence: prompt + generated
  int64_t blocks_per_sequence = 0;  // ceil(seq_len / block_size)
  int64_t num_sequences = 0;        // floor(num_blocks / blocks_per_sequence); may be 0
  // Slots left empty in each sequence's last, partly filled block:
  // blocks_per_sequence x block_size - seq_len, always < block_size.
  int64_t wasted_tokens_per_sequence = 0;
  int64_t wasted_bytes_per_sequence = 0;  // wasted_tokens_per_sequence x bytes_per_token
};

// INVALID_ARGUMENT when seq_len <= 0.
// REQUIRES: `plan` came from PlanPool.
absl::StatusOr<SequenceFit> SequencesThatFit(const PoolPlan& plan, int64_t seq_len);

// Multi-line summary of a plan for people, one "  name = formula" line each for bytes per
// token, bytes per block, usable bytes, num_blocks, pool bytes, unused bytes and max total
// tokens, under a title line naming the spec. Ends with a newline. The cache manager logs
// it at startup; `kvcmctl plan` prints it.
std::string DescribePlan(const PoolPlan& plan);

}  // namespace kvcm
