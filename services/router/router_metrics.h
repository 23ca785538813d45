#pragma once
// RouterMetrics: what kvcm-router exports on /metrics (docs/operations.md, "Router
// metrics"). Updated by the scheduling thread (steps, tokens, preemptions) and by the HTTP
// thread (requests, latencies); prometheus-cpp's metrics are thread-safe.

#include <array>
#include <cstdint>
#include <memory>
#include <span>
#include <string_view>

#include "common/metrics/metric_spec.h"
#include "services/router/api.h"

namespace prometheus {
class Counter;
class Gauge;
class Histogram;
class Registry;
}  // namespace prometheus

namespace kvcm::router {

// How a request ended (label `outcome`).
enum class RequestOutcome : uint8_t {
  kOk,           // generated to max_new_tokens or EOS
  kInvalid,      // refused with a 4xx before it was queued (malformed, unsupported, too long)
  kOverloaded,   // 429: max_concurrent_requests in flight
  kUnavailable,  // 503: no executor, or the cache manager failed a step
  kCancelled,    // the client went away
  kCount
};
inline constexpr int kRequestOutcomes = static_cast<int>(RequestOutcome::kCount);

class RouterMetrics {
 public:
  RouterMetrics();
  RouterMetrics(const RouterMetrics&) = delete;
  RouterMetrics& operator=(const RouterMetrics&) = delete;
  ~RouterMetrics();

  // Scheduling thread.
  void ObserveStep(double seconds, int32_t sequences, int32_t prefill_tokens,
                   int32_t decode_tokens);
  void SetState(size_t queued, size_t running, int executors);
  void CountPromptTokens(int64_t cached, int64_t computed);
  // Of the cached ones, loaded from the cache manager's host and disk tiers.
  void CountTierPromptTokens(int64_t host, int64_t disk);
  void CountGeneratedTokens(int64_t n);
  void CountPreemptions(int64_t n);
  void CountRecomputedCommittedTokens(int64_t n);

  // HTTP thread.
  void CountRequest(Api api, RequestOutcome outcome);
  void ObserveTimeToFirstToken(double seconds);
  void ObserveTimePerOutputToken(double seconds);
  void ObserveRequestDuration(double seconds);
  void CountSlowRequestDropped();
  void CountHttpConnectionShed();  // closed as it arrived, at the descriptor limit

  std::shared_ptr<prometheus::Registry> registry() const { return registry_; }
  static std::span<const MetricSpec> Specs();

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Gauge* queued_ = nullptr;
  prometheus::Gauge* running_ = nullptr;
  prometheus::Gauge* executors_ = nullptr;
  prometheus::Counter* slow_dropped_ = nullptr;
  prometheus::Counter* connections_shed_ = nullptr;
  prometheus::Counter* steps_ = nullptr;
  prometheus::Histogram* step_duration_ = nullptr;
  prometheus::Histogram* batch_sequences_ = nullptr;
  prometheus::Histogram* batch_tokens_ = nullptr;
  prometheus::Counter* prompt_cached_ = nullptr;
  prometheus::Counter* prompt_computed_ = nullptr;
  prometheus::Counter* prompt_host_tier_ = nullptr;
  prometheus::Counter* prompt_disk_tier_ = nullptr;
  prometheus::Counter* generated_ = nullptr;
  prometheus::Counter* preemptions_ = nullptr;
  prometheus::Counter* recomputed_committed_ = nullptr;
  std::array<std::array<prometheus::Counter*, kRequestOutcomes>, kApis> requests_{};
  prometheus::Histogram* ttft_ = nullptr;
  prometheus::Histogram* tpot_ = nullptr;
  prometheus::Histogram* e2e_ = nullptr;
};

}  // namespace kvcm::router
