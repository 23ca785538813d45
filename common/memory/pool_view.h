#pragma once
// PoolView: a KV pool as the code that reads and writes its blocks addresses it (the
// executor's step logic, the model's forward, the benchmarks): where block 0 of layer 0
// starts and how the blocks are laid out (docs/architecture.md, "The pool and how processes
// reach it"). The one view of a pool: CacheManagerClient::Attach() returns one beside the
// mapping that backs it.
//
// Thread safety: a plain value; the memory it points at is the owner's business.

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/memory/pool_layout.h"
#include "common/memory/pool_memory.h"
#include "common/sizing/kv_cache_groups.h"
#include "common/sizing/kv_cache_spec.h"

namespace kvcm {

struct PoolView {
  // Host memory (shm, or a test's buffer) or device memory (cuda); null before a mapping.
  uint8_t* base = nullptr;
  KvCacheSpec spec;
  int32_t num_blocks = 0;
  PoolLayout layout;  // PoolLayout::For(spec, num_blocks), checked where the view is made
  PoolBackend backend = PoolBackend::kShm;
  // cuda: the device `base` lives on (only the CUDA model runs over it); shm: -1.
  int32_t cuda_device = -1;
  uint64_t epoch = 0;  // the cache manager's epoch the pool belongs to; 0 outside a stack
  // > 0: the cache manager releases a sequence's blocks that lie wholly before
  // committed - sliding_window_tokens + 1 (docs/architecture.md, "Sliding windows"), so every
  // layer reading the pool must attend within that many tokens. 0: nothing is released.
  int32_t sliding_window_tokens = 0;
  // Empty: no KV cache groups (every layer has its slot: spec.num_layers is the model's).
  // Otherwise the pool holds pages of spec.num_layers slots, and layer groups[g].layers[i]
  // lives in slot i of the blocks of group g's table (docs/architecture.md, "The hybrid KV
  // cache").
  std::vector<KvCacheGroup> kv_groups;
};

// OK when a model whose layers attend within `layer_windows` (tokens each, 0 = the whole
// context) can read a pool that releases blocks behind `pool_window` tokens (0: none):
// every layer must have a window, none wider than the pool's. Otherwise
// FAILED_PRECONDITION naming the layer and what the cache manager should be given.
inline absl::Status CheckWindowReads(int32_t pool_window, std::span<const int32_t> layer_windows) {
  if (pool_window <= 0) return absl::OkStatus();
  for (size_t l = 0; l < layer_windows.size(); ++l) {
    const int32_t window = layer_windows[l];
    if (window > 0 && window <= pool_window) continue;
    return absl::FailedPreconditionError(absl::StrCat(
        "the cache manager releases blocks behind a sliding window of ", pool_window,
        " tokens, but layer ", l, " of the model attends to ",
        window == 0 ? std::string("the whole context") : absl::StrCat(window, " tokens"),
        ": run the cache manager with --sliding-window-tokens 0 (keep every block)",
        window == 0 ? "" : absl::StrCat(" or >= ", window)));
  }
  return absl::OkStatus();
}

}  // namespace kvcm
