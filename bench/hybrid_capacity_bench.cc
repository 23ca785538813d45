// Concurrent long sequences that fit in one pool for Gemma-3-shaped models, with KV cache
// groups (common/block/grouped_ledger.h) against every layer kept in full, the same pool
// bytes (docs/PERFORMANCE.md, "The hybrid KV cache's capacity"). Counts, not times:
// nothing here is timed.
//
//   build/bench/hybrid_capacity_bench
//
// For each model shape and sequence length, two pools of the same bytes:
//   all-full  pages of every layer (one group: the layout without groups);
//   groups    pages of group_size layers (GroupLayers: a full group and the window groups),
//             so the same bytes hold num_layers / group_size times the pages.
// Each is filled the way the router fills it (services/router/step_planner.h): sequences
// one after another, each admitted with its whole prompt (Allocate of seq_len - 64 tokens:
// every group takes the prompt's blocks at admission), prefilled in chunks of 2,048 tokens
// (a Commit after each: a window group releases what its window passed), then decoding 64
// tokens (an Append once a block, a Commit a step later), until an Allocate or an Append is
// refused. A sequence counts once it holds all its tokens; every counted sequence is held
// at once at the end. No prefix hits (no hashes): capacity alone.
// Goal: groups >= 4x all-full at 8K and 32K tokens.

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "common/base/check.h"
#include "common/block/grouped_ledger.h"
#include "common/sizing/kv_cache_groups.h"
#include "common/sizing/kv_cache_spec.h"

namespace kvcm {
namespace {

constexpr int32_t kBlockSize = 16;
constexpr int32_t kChunk = 2048;  // tokens of a prefill step
constexpr int32_t kDecode = 64;   // tokens each sequence generates

struct ModelShape {
  const char* name;
  int32_t num_layers;
  int32_t num_kv_heads;
  int32_t head_dim;
  int32_t window;      // of the sliding layers
  int32_t full_every;  // layer l attends fully when (l + 1) % full_every == 0
  int64_t pool_bytes;
};

// Gemma 3's text models (their config.json files: sliding_window_pattern 6, bf16), with a
// pool of a size someone would give each.
constexpr int64_t kGiB = int64_t{1} << 30;
const ModelShape kModels[] = {
    {"gemma-3-1b", 26, 1, 256, 512, 6, 4 * kGiB},
    {"gemma-3-4b", 34, 4, 256, 1024, 6, 24 * kGiB},
    {"gemma-3-27b", 62, 16, 128, 1024, 6, 80 * kGiB},
};

std::vector<int32_t> LayerWindowsOf(const ModelShape& model) {
  std::vector<int32_t> windows;
  for (int32_t l = 0; l < model.num_layers; ++l) {
    windows.push_back((l + 1) % model.full_every == 0 ? 0 : model.window);
  }
  return windows;
}

// Sequences of `seq_len` tokens that fit at once in a pool of `num_blocks` pages shared by
// groups of `group_windows`; `held` receives the pages they hold at the end.
int32_t SequencesThatFit(int32_t num_blocks, const std::vector<int32_t>& group_windows,
                         int32_t seq_len, int64_t* held) {
  GroupedLedger::Options options;
  options.pool.num_blocks = num_blocks;
  options.pool.block_size = kBlockSize;
  options.group_windows = group_windows;
  absl::StatusOr<GroupedLedger> ledger = GroupedLedger::Create(options);
  KVCM_CHECK(ledger.ok()) << ledger.status().ToString();
  int32_t fitted = 0;
  GroupedTables tables;
  GroupedAppendResult appended;
  const int32_t prompt = seq_len - kDecode;
  for (SeqId seq = 1;; ++seq) {
    if (!ledger->Allocate(seq, prompt, {}, &tables).ok()) break;
    for (int32_t done = std::min(kChunk, prompt);; done = std::min(done + kChunk, prompt)) {
      KVCM_CHECK(ledger->Commit(seq, done).ok());
      if (done == prompt) break;
    }
    bool refused = false;
    for (int32_t tokens = prompt; tokens < seq_len; ++tokens) {
      // A decoding sequence grows a block at a time: a step commits what was written, then
      // appends.
      if (tokens % kBlockSize != 0) continue;
      KVCM_CHECK(ledger->Commit(seq, tokens).ok());
      if (!ledger->Append(seq, kBlockSize, &appended).ok()) {
        refused = true;
        break;
      }
    }
    if (refused) break;
    KVCM_CHECK(ledger->Commit(seq, seq_len).ok());
    ++fitted;
  }
  KVCM_CHECK(ledger->CheckInvariants().ok()) << ledger->CheckInvariants().ToString();
  *held = ledger->pool().Stats().in_use_blocks;
  return fitted;
}

int Main() {
  std::printf(
      "Concurrent sequences that fit, groups vs all-full, same pool bytes "
      "(block %d tokens, prefill chunks of %d)\n\n",
      kBlockSize, kChunk);
  const char* header = "%-12s %7s %-22s %9s %9s %9s %10s %10s %7s %7s %5s\n";
  std::printf(header, "model", "tokens", "groups", "pool GiB", "pages", "pages", "all-full",
              "groups", "ratio", "bound", "goal");
  std::printf(header, "", "", "", "", "all-full", "groups", "sequences", "sequences", "", "", "");
  bool all_met = true;
  for (const ModelShape& model : kModels) {
    KvCacheSpec spec;
    spec.num_layers = model.num_layers;
    spec.num_kv_heads = model.num_kv_heads;
    spec.head_dim = model.head_dim;
    spec.dtype = DType::kBFloat16;
    spec.block_size = kBlockSize;
    const std::vector<int32_t> layer_windows = LayerWindowsOf(model);
    absl::StatusOr<KvCacheGroups> groups = GroupLayers(layer_windows);
    KVCM_CHECK(groups.ok()) << groups.status().ToString();
    std::vector<int32_t> group_windows;
    for (const KvCacheGroup& group : groups->groups) group_windows.push_back(group.window);
    const int64_t full_page = spec.BytesPerBlock();
    const int64_t group_page = PageSpec(spec, *groups).BytesPerBlock();
    const int32_t full_blocks = static_cast<int32_t>(model.pool_bytes / full_page);
    const int32_t group_blocks = static_cast<int32_t>(model.pool_bytes / group_page);
    for (int32_t seq_len : {8192, 32768}) {
      int64_t held_full = 0, held_groups = 0;
      const int32_t n_full = SequencesThatFit(full_blocks, {0}, seq_len, &held_full);
      const int32_t n_groups = SequencesThatFit(group_blocks, group_windows, seq_len, &held_groups);
      // The ledger holds at most what the sizing arithmetic (kvcmctl plan) says a decoding
      // sequence holds.
      KVCM_CHECK(held_groups <= n_groups * BlocksHeldByGroups(*groups, seq_len, kBlockSize))
          << held_groups << " pages held by " << n_groups << " sequences";
      const double ratio = n_full > 0 ? double(n_groups) / n_full : 0.0;
      // The most the ratio can be: a decoding sequence's bytes in full over its bytes with
      // groups (padding slots and the window's share of the context count), the
      // admission's whole prompt left out.
      const double bound = double((seq_len + kBlockSize - 1) / kBlockSize * full_page) /
                           double(BlocksHeldByGroups(*groups, seq_len, kBlockSize) * group_page);
      const bool met = ratio >= 4.0;
      all_met = all_met && met;
      const std::string shape = std::to_string(groups->num_groups()) + " x " +
                                std::to_string(groups->group_size) + " slots (" +
                                std::to_string(groups->padding_slots()) + " pad)";
      std::printf("%-12s %7d %-22s %9lld %9d %9d %10d %10d %6.2fx %6.2fx %5s\n", model.name,
                  seq_len, shape.c_str(), static_cast<long long>(model.pool_bytes / kGiB),
                  full_blocks, group_blocks, n_full, n_groups, ratio, bound, met ? "met" : "MISS");
    }
  }
  std::printf("\n%s\n", all_met ? "every goal met (>= 4x)" : "some goal missed (>= 4x)");
  return 0;
}

}  // namespace
}  // namespace kvcm

int main() { return kvcm::Main(); }
