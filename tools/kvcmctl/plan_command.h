#pragma once

// `kvcmctl plan`: how many KV-cache blocks a memory budget buys for a model shape, and what
// that means in tokens and sequences. Pure arithmetic: it touches no device and no running
// cache manager.
//
//   kvcmctl plan --layers 32 --kv-heads 8 --head-dim 128 --dtype bf16 --block-size 16
//                --pool-bytes 64GiB   (one line)
//   kvcmctl plan --model-config path/config.json --memory-fraction 0.9 --free-memory 80GiB
//   kvcmctl plan --model-config path/config.json --dtype fp8 --num-blocks 4096 --json
//   kvcmctl plan ... --host-tier-bytes 256GiB --disk-tier-bytes 2TiB   (the tiers below)
//
// Split into parse / build / format so that each step is testable without a process.

#include <cstdint>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/sizing/kv_cache_groups.h"
#include "common/sizing/kv_cache_spec.h"
#include "common/sizing/pool_plan.h"

namespace kvcm::kvcmctl {

// Sequence lengths always shown, besides --seq-len.
inline constexpr int64_t kStandardSeqLens[] = {1024, 4096, 32768};

// The options of `kvcmctl plan`, one field per flag.
struct PlanOptions {
  bool help = false;  // --help / -h: print usage and exit 0

  // Model shape: from a config.json (--model-config), or from --layers, --kv-heads and
  // --head-dim together; never both.
  std::string model_config;  // --model-config PATH; empty: use the dimension flags
  int32_t num_layers = 0;    // --layers N
  int32_t num_kv_heads = 0;  // --kv-heads N: KV heads, fewer than query heads under GQA
  int32_t head_dim = 0;      // --head-dim N

  // --dtype: the KV-cache dtype. Unset: the config's torch_dtype with --model-config, bf16
  // with the dimension flags (2 bytes, as fp16).
  std::optional<DType> dtype;

  // --block-size: tokens per block. Default 16, TGI's and vLLM's CUDA default: smaller
  // blocks waste less and share prefixes more finely, larger ones cost less bookkeeping.
  int32_t block_size = 16;

  // Exactly one of --pool-bytes BYTES, --memory-fraction F (with --free-memory BYTES and
  // optional --margin M, default 0.10), or --num-blocks N.
  PoolBudget budget;

  // --seq-len N: a sequence length (prompt + generated) to show how many fit, besides
  // kStandardSeqLens. Default 4096.
  int64_t seq_len = 4096;

  bool json = false;  // --json: print one JSON object instead of text

  // --host-tier-bytes, --disk-tier-bytes: the cache manager's flags of the same names (the
  // host and disk tiers below the pool); 0: not shown.
  int64_t host_tier_bytes = 0;
  int64_t disk_tier_bytes = 0;
};

// What a tier below the pool holds, computed as the cache manager does (KvTiers::Create,
// DiskTier::Open): the host tier holds floor(bytes / bytes per block) blocks; a disk tier
// slot is a 4096-byte header and the block rounded up to 4096 bytes, the slots (at least 1)
// are split evenly among kDiskTierFiles files (at most one per slot) and a remainder is
// dropped.
inline constexpr int64_t kDiskTierSlotHeaderBytes = 4096;
inline constexpr int64_t kDiskTierFiles = 4;
struct TierPlan {
  std::string tier;        // "host" or "disk"
  int64_t bytes = 0;       // the flag's value
  int64_t slot_bytes = 0;  // host: bytes per block; disk: header + rounded block
  int64_t blocks = 0;
  int64_t tokens = 0;  // blocks x block size
};

// Parses the words after "plan". INVALID_ARGUMENT naming the flag for an unknown or
// repeated flag, a bad value, a missing or conflicting model shape, or not exactly one pool
// size.
absl::StatusOr<PlanOptions> ParsePlanOptions(absl::Span<const std::string> args);

// The usage text of `kvcmctl plan`.
std::string PlanUsage();

// One sequence length for a model served by KV cache groups (common/sizing/
// kv_cache_groups.h): what a decoding sequence holds in every group together, against all
// its layers kept in full (SequenceFit's blocks).
struct GroupedFit {
  int64_t seq_len = 0;
  int64_t pages_per_sequence = 0;       // BlocksHeldByGroups
  int64_t bytes_per_sequence = 0;       // pages_per_sequence x bytes per page
  int64_t full_bytes_per_sequence = 0;  // blocks_per_sequence x bytes per block
  double ratio = 0;                     // bytes_per_sequence / full_bytes_per_sequence
  int64_t num_sequences = 0;            // floor(num_pages / pages_per_sequence); may be 0
};

// A model whose layers are of more than one type (full attention, windows) laid out as KV
// cache groups. The pool of such a model is laid out by pages of group_size layers, so it
// holds floor(usable bytes / bytes per page) of them, not floor(usable bytes / bytes per
// block) full blocks.
struct GroupedPlan {
  KvCacheGroups groups;
  int64_t bytes_per_page = 0;    // PageSpec(spec, groups).BytesPerBlock()
  int64_t num_pages = 0;         // floor(usable_bytes / bytes_per_page)
  std::vector<GroupedFit> fits;  // one per PlanReport::fits, in its order
};

// Everything `plan` prints.
struct PlanReport {
  std::string model_config;        // the config.json read, if any
  std::vector<std::string> notes;  // choices made from it (SpecFromHfConfig's notes)
  // The window behind which the cache manager releases blocks for this model
  // (ReleasableWindow; 0: none, or no model config).
  int32_t sliding_window = 0;
  PoolPlan plan;
  std::vector<SequenceFit> fits;  // kStandardSeqLens and seq_len, ascending, no repeats
  std::vector<TierPlan> tiers;    // host, then disk, those given
  // With --model-config, for a model of more than one KV cache group; else none.
  std::optional<GroupedPlan> grouped;
};

// Reads the model config if any and plans the pool. Errors: those of SpecFromHfConfigFile
// and PlanPool (NOT_FOUND for an unreadable config, RESOURCE_EXHAUSTED when not one block
// fits, INVALID_ARGUMENT otherwise); those of LayerWindows; INVALID_ARGUMENT for a tier the
// cache manager would refuse (a host tier smaller than one block, more than 2^31 - 1 slots),
// for more than 2^31 - 1 pages in a grouped pool, or a --seq-len whose bytes overflow int64.
// REQUIRES: `options` came from ParsePlanOptions with help == false.
absl::StatusOr<PlanReport> BuildPlanReport(const PlanOptions& options);

// The breakdown for people: formulas with the numbers filled in, then the sequences table.
std::string FormatPlanText(const PlanReport& report);

// The same figures as one JSON object (pretty-printed, ends with a newline), keys in this
// order: model_config (only with --model-config), num_layers, num_kv_heads, head_dim, dtype
// (DTypeName), dtype_bytes, block_size, bytes_per_token, bytes_per_block, budget
// ({"kind": "pool-bytes", "pool_bytes"} | {"kind": "memory-fraction", "free_bytes",
// "fraction", "margin"} | {"kind": "num-blocks", "num_blocks"}), usable_bytes, num_blocks,
// pool_bytes, unused_bytes, max_total_tokens, sliding_window_tokens (only with a window),
// sequences (one object per SequenceFit with its field names; with a window also
// window_blocks_per_sequence and window_sequences: what a decoding sequence holds and how
// many of them fit), kv_cache_groups (only with `grouped`: group_size, num_groups,
// padding_slots, groups (each {"window", "layers"}), bytes_per_page, num_pages, and
// sequences, one object per GroupedFit with its field names), tiers (only with a tier flag:
// one object per TierPlan with its field names). Counts are JSON integers, exact.
std::string FormatPlanJson(const PlanReport& report);

// The `plan` entry of main.cc's command table: parse, build, print.
// Exit codes: kExitOk; kExitUsage for a bad command line; kExitFailure when planning fails.
int RunPlanCommand(absl::Span<const std::string> args, std::ostream& out, std::ostream& err);

}  // namespace kvcm::kvcmctl
