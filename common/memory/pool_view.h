#pragma once
// PoolView: a KV pool as the code that reads and writes its blocks addresses it (the
// executor's step logic, the model's forward, the benchmarks): where block 0 of layer 0
// starts and how the blocks are laid out (docs/architecture.md, "The pool and how processes
// reach it"). The one view of a pool: CacheManagerClient::Attach() returns one beside the
// mapping that backs it.
//
// Thread safety: a plain value; the memory it points at is the owner's business.

#include <cstdint>

#include "common/memory/pool_layout.h"
#include "common/memory/pool_memory.h"
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
};

}  // namespace kvcm
