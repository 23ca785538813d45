#pragma once
// The executor's view of the cache manager's KV pool, behind an interface (PoolSource) so
// that the step logic can run on a real attached pool or on a local buffer in tests.
//
// CacheManagerPool is the real one: it holds the CacheManagerClient session (role Executor;
// the client's heartbeat thread keeps it alive) and the AttachedPool mapping. When the cache
// manager restarts (docs/architecture.md) the pool of the old epoch is gone: Refresh() notices
// the refused session (the heartbeat thread saw it) and Reattach() drops the old mapping,
// registers again and attaches to the new epoch. The model's weights are not touched.
//
// Thread safety: none; one thread (the executor's socket thread) owns a PoolSource.

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/client/cache_manager_client.h"
#include "common/memory/pool_layout.h"
#include "common/memory/pool_memory.h"
#include "common/memory/pool_view.h"
#include "common/sizing/kv_cache_spec.h"
#include "services/executor/executor_metrics.h"

namespace kvcm::executor {

// The KV shape a model needs from the pool.
struct ModelKvShape {
  int32_t num_layers = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  std::vector<int32_t> layer_windows;  // each layer's sliding window, 0 = full attention
};

// OK when a pool of `spec` can hold the KV of a model of `shape` and the kernels handle its
// dtype (fp32, fp16, bf16). Otherwise FAILED_PRECONDITION naming both shapes, e.g.
// "the pool's KV shape (2 layers x 2 KV heads x head dim 8) does not match the model's
// (4 layers x 2 KV heads x head dim 16)"; and a pool that releases blocks behind a sliding
// window only for a model whose every layer attends within it (CheckWindowReads). A pool
// with KV cache groups must have the model's groups and pages of their group_size slots
// (CheckPoolGroups, kv_groups.h).
absl::Status CheckPoolFitsModel(const PoolView& pool, const ModelKvShape& shape);

class PoolSource {
 public:
  virtual ~PoolSource() = default;

  // The pool attached now; null while none is (detached, or an incompatible pool).
  virtual const PoolView* pool() const = 0;

  // Cheap; called often by the socket thread. When the cache-manager session was refused
  // (a new epoch) drops the mapping and attaches again; when no pool is attached, tries to
  // attach (at most once per retry interval). Returns OK when nothing needed doing or the
  // new attachment succeeded; otherwise the attachment's error (the pool stays detached).
  virtual absl::Status Refresh() = 0;

  // Drops the mapping, then attaches to the cache manager's current epoch now. Errors: the
  // attachment's (UNAVAILABLE or DEADLINE_EXCEEDED with the cache manager down), or
  // FAILED_PRECONDITION from CheckPoolFitsModel. The pool is detached after an error.
  virtual absl::Status Reattach() = 0;

  // Ends the cache-manager session (best effort; logs nothing).
  virtual void Goodbye() = 0;

  // The executor's thread is alive and working (CacheManagerClient::NoteProgress): its
  // cache-manager heartbeats go out only while it says so. Cheap; thread-safe.
  virtual void NoteProgress() {}

  // Asks the cache manager (one round trip) whether the epoch of the pool attached is still
  // the one it runs: true when it confirmed it, false when the session is gone (a new
  // epoch, or this executor's lease ran out) or nothing is attached. A step naming another
  // epoch re-attaches only on false: a stale or corrupt step must not make the executor
  // drop a good mapping. UNAVAILABLE or DEADLINE_EXCEEDED when the cache manager cannot
  // answer. A source without a cache manager says whether something is attached.
  virtual absl::StatusOr<bool> AttachedEpochIsCurrent() { return pool() != nullptr; }

  // Fencing (schemas/kvcm_protocol.fbs, Fence). The fences the cache manager asks this
  // executor to honour now, and a number that changes whenever they do (cheap enough to
  // check between layers). A source without a cache manager has none.
  virtual std::vector<FenceNotice> PendingFences() const { return {}; }
  virtual uint64_t fence_generation() const { return 0; }
  // Tells the cache manager that nothing runs, or will run, for these fences' router
  // sessions. REQUIRES: the caller refuses every later step of them.
  virtual absl::Status AcknowledgeFences(std::span<const uint64_t> fence_ids) {
    (void)fence_ids;
    return absl::OkStatus();
  }
};

// The real PoolSource: a CacheManagerClient of role Executor and its AttachedPool.
class CacheManagerPool : public PoolSource {
 public:
  struct Options {
    // The cache manager's request socket ("ipc://RUN_DIR/cache-manager.sock"), this
    // executor's name, timeouts. role is forced to Executor; heartbeats on.
    CacheManagerClient::Options client;
    // What the model needs; an attached pool that does not fit is dropped.
    ModelKvShape model;
    // Called with each pool that fits the model, before it is taken: an error drops the
    // attachment with that error (e.g. the weights cannot go to the pool's device). Unset:
    // a cuda pool is refused, as for a model that runs only on the host.
    std::function<absl::Status(const PoolView&)> accept;
    // Least time between two attach attempts while detached. Each attempt may block the
    // socket thread up to client.call_timeout when the cache manager is down but its
    // socket file remains; it fails at once when nothing listens.
    absl::Duration retry_interval = absl::Milliseconds(200);
  };

  // Connects, registers and attaches once. Errors: Connect's (UNAVAILABLE when no cache
  // manager runs at the endpoint), Attach's, and CheckPoolFitsModel's. `metrics` may be
  // null and must otherwise outlive the pool.
  static absl::StatusOr<std::unique_ptr<CacheManagerPool>> Connect(Options options,
                                                                   ExecutorMetrics* metrics);

  ~CacheManagerPool() override;

  const PoolView* pool() const override;
  absl::Status Refresh() override;
  absl::Status Reattach() override;
  void Goodbye() override;
  absl::StatusOr<bool> AttachedEpochIsCurrent() override;
  void NoteProgress() override { client_->NoteProgress(); }
  std::vector<FenceNotice> PendingFences() const override { return client_->PendingFences(); }
  uint64_t fence_generation() const override { return client_->fence_generation(); }
  absl::Status AcknowledgeFences(std::span<const uint64_t> fence_ids) override {
    return client_->AcknowledgeFences(fence_ids);
  }

  // Successful attachments so far (1 after Connect).
  int attaches() const { return attaches_; }
  CacheManagerClient& client() { return *client_; }

 private:
  CacheManagerPool(Options options, std::unique_ptr<CacheManagerClient> client,
                   ExecutorMetrics* metrics);
  void Detach();

  const Options options_;
  std::unique_ptr<CacheManagerClient> client_;
  ExecutorMetrics* const metrics_;
  std::optional<AttachedPool> attached_;  // reset before attaching again
  absl::Time next_attempt_ = absl::InfinitePast();
  int attaches_ = 0;
};

}  // namespace kvcm::executor
