#include "services/executor/executor_pool.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/base/monotonic_clock.h"
#include "common/base/status_macros.h"
#include "common/transport/zmq_util.h"
#include "services/executor/kv_groups.h"

namespace kvcm::executor {
namespace {

std::string DescribeShape(int32_t layers, int32_t kv_heads, int32_t head_dim) {
  return absl::StrCat(layers, " layers x ", kv_heads, " KV heads x head dim ", head_dim);
}

}  // namespace

absl::Status CheckPoolFitsModel(const PoolView& pool, const ModelKvShape& shape) {
  const KvCacheSpec& spec = pool.spec;
  // With KV cache groups the pool's layers are a page's slots: the groups decide them.
  KVCM_RETURN_IF_ERROR(CheckPoolGroups(pool, shape.layer_windows));
  const bool grouped = !pool.kv_groups.empty();
  if ((!grouped && spec.num_layers != shape.num_layers) ||
      spec.num_kv_heads != shape.num_kv_heads || spec.head_dim != shape.head_dim) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the pool's KV shape (", DescribeShape(spec.num_layers, spec.num_kv_heads, spec.head_dim),
        ") does not match the model's (",
        DescribeShape(shape.num_layers, shape.num_kv_heads, shape.head_dim),
        "): start the cache manager with the model's config.json (--model-config)"));
  }
  if (spec.dtype != DType::kFloat32 && spec.dtype != DType::kFloat16 &&
      spec.dtype != DType::kBFloat16) {
    return absl::FailedPreconditionError(
        absl::StrCat("the pool's KV dtype ", std::string(DTypeName(spec.dtype)),
                     " has no kernel here (fp32, fp16 and bf16 do)"));
  }
  return CheckWindowReads(pool.sliding_window_tokens, shape.layer_windows);
}

absl::StatusOr<std::unique_ptr<CacheManagerPool>> CacheManagerPool::Connect(
    Options options, ExecutorMetrics* metrics) {
  options.client.role = wire::Role::Executor;
  options.client.heartbeats = true;
  // A wedged socket thread stops renewing the lease (ExecutorServer notes progress every
  // loop turn and every layer).
  options.client.require_progress = true;
  KVCM_ASSIGN_OR_RETURN(std::unique_ptr<CacheManagerClient> client,
                        CacheManagerClient::Connect(options.client));
  std::unique_ptr<CacheManagerPool> pool(
      new CacheManagerPool(std::move(options), std::move(client), metrics));
  KVCM_RETURN_IF_ERROR(pool->Reattach());
  return pool;
}

CacheManagerPool::CacheManagerPool(Options options, std::unique_ptr<CacheManagerClient> client,
                                   ExecutorMetrics* metrics)
    : options_(std::move(options)), client_(std::move(client)), metrics_(metrics) {}

CacheManagerPool::~CacheManagerPool() {
  // The mapping goes before the client (whose destructor joins the heartbeat thread).
  attached_.reset();
}

const PoolView* CacheManagerPool::pool() const {
  return attached_.has_value() ? &attached_->view : nullptr;
}

void CacheManagerPool::Detach() {
  if (!attached_.has_value()) return;
  attached_.reset();
  if (metrics_ != nullptr) metrics_->ObserveDetach();
}

absl::Status CacheManagerPool::Refresh() {
  if (attached_.has_value() && !client_->session_lost()) return absl::OkStatus();
  const absl::Time now = MonotonicNow();
  if (!attached_.has_value() && now < next_attempt_) {
    return absl::UnavailableError("no pool attached; waiting to retry");
  }
  return Reattach();
}

absl::Status CacheManagerPool::Reattach() {
  // The old epoch's mapping goes first: its memory belongs to a dead (or dying) process, and
  // a cuda IPC mapping must be closed before another is opened.
  Detach();
  next_attempt_ = MonotonicNow() + options_.retry_interval;
  // Fail fast when nothing listens (the cache manager is down): no call timeout to wait.
  KVCM_RETURN_IF_ERROR(ProbeIpcListener(client_->options().endpoint));
  const absl::Time start = MonotonicNow();
  // The session is gone (a new epoch, or the lease ran out): this executor is between steps
  // and holds no mapping any more, so nothing writes for the old session; register again.
  // Its open fences go with it to the new session (the cache manager moves them).
  if (absl::Status session = client_->EnsureSession(); absl::IsAborted(session)) {
    KVCM_RETURN_IF_ERROR(client_->Reregister());
  } else if (!session.ok()) {
    return session;
  }
  absl::StatusOr<AttachedPool> attached = client_->Attach();
  // A refusal met only now (the heartbeat had not seen the restart yet): register and
  // attach once more.
  if (absl::IsAborted(attached.status())) {
    KVCM_RETURN_IF_ERROR(client_->Reregister());
    attached = client_->Attach();
  }
  if (!attached.ok()) return attached.status();
  KVCM_RETURN_IF_ERROR(CheckPoolFitsModel(attached->view, options_.model));
  // The attachment's own time; what `accept` does (copying weights to a device) is not.
  const double seconds = absl::ToDoubleSeconds(MonotonicNow() - start);
  const PoolView& view = attached->view;
  if (!options_.accept && view.backend == PoolBackend::kCuda) {
    return absl::FailedPreconditionError(
        "the pool is in CUDA memory but this executor runs the model on the host: start the "
        "cache manager with --backend shm");
  }
  if (options_.accept) KVCM_RETURN_IF_ERROR(options_.accept(view));
  attached_ = *std::move(attached);
  ++attaches_;
  if (metrics_ != nullptr) {
    metrics_->ObserveAttach(seconds, attached_->mapping->size_bytes(), attached_->view.epoch);
  }
  return absl::OkStatus();
}

absl::StatusOr<bool> CacheManagerPool::AttachedEpochIsCurrent() {
  if (!attached_.has_value() || client_->session_lost()) return false;
  const absl::Status beat = client_->Heartbeat();
  if (absl::IsAborted(beat)) return false;  // the session (and maybe its epoch) is gone
  if (!beat.ok()) return beat;
  return client_->epoch() == attached_->view.epoch;
}

void CacheManagerPool::Goodbye() {
  Detach();
  // Nobody to say it to when nothing listens; don't wait out a call timeout.
  if (ProbeIpcListener(client_->options().endpoint).ok()) (void)client_->Goodbye();
}

}  // namespace kvcm::executor
