#pragma once

// ExecutorMetrics: every Prometheus metric of kvcm-executor, declared once in one list
// (executor_metrics.cc, also returned by Specs()), and the calls that update them. main.cc
// serves registry() with a MetricsServer.
//
// All are prometheus-cpp counters, gauges and histograms updated as things happen: steps on
// the socket thread, attachments wherever the pool is (re)attached. Every known label set
// (each StepPhase and StepError) is exported from construction, at 0, so that rate() and
// absent() work from the first scrape; label values come only from these enums and the
// fixed ExecutorInfo.
//
// Thread safety: all methods may be called from any thread, concurrently with scrapes.

#include <array>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "common/metrics/metric_spec.h"

namespace prometheus {
class Counter;
class Gauge;
class Histogram;
class Registry;
}  // namespace prometheus

namespace kvcm::executor {

// Which kind of work a step or a token was (label `phase`): prefill = the new tokens of a
// sequence with more than one new token or no earlier context; decode = one new token after
// an earlier context. A step with any prefill token is a prefill step.
enum class StepPhase : uint8_t { kPrefill, kDecode, kCount };
inline constexpr int kStepPhases = static_cast<int>(StepPhase::kCount);
// "prefill", "decode". REQUIRES: phase != kCount.
std::string_view StepPhaseName(StepPhase phase);

// Why a StepBatch (or another inbound message) was refused (label `reason`).
enum class StepError : uint8_t {
  kMalformed,        // failed the Verifier or the envelope checks, or is too large
  kInvalidArgument,  // contradicts itself or the pool (block id out of range, short table)
  kStaleEpoch,       // names an earlier cache-manager epoch, or a newer one not attachable
  kNoPool,           // no pool attached (cache manager down or incompatible)
  kInternal,         // the forward pass failed
  kFenced,           // its router session was fenced (refused, or abandoned mid-step)
  kCount
};
inline constexpr int kStepErrors = static_cast<int>(StepError::kCount);
// "malformed", "invalid_argument", "stale_epoch", "no_pool", "internal", "fenced".
std::string_view StepErrorName(StepError error);

class ExecutorMetrics {
 public:
  // What does not change while the executor runs: exported as kvcm_executor_info.
  struct ExecutorInfo {
    std::string model;         // the model's name
    std::string weight_dtype;  // e.g. "bf16"
  };

  explicit ExecutorMetrics(const ExecutorInfo& info);
  ExecutorMetrics(const ExecutorMetrics&) = delete;
  ExecutorMetrics& operator=(const ExecutorMetrics&) = delete;
  ~ExecutorMetrics();

  // The model's weights were loaded, taking `seconds`.
  void ObserveModelLoad(double seconds);
  // One StepBatch ran: `num_seqs` sequences, `prefill_tokens` + `decode_tokens` new tokens,
  // `sampled` tokens returned, in `seconds` (receipt to reply).
  void ObserveStep(int32_t num_seqs, int32_t prefill_tokens, int32_t decode_tokens, int32_t sampled,
                   double seconds);
  // One inbound message was refused.
  void CountStepError(StepError error);
  // The pool was attached (mapped) in `seconds`: `mapped_bytes` of epoch `epoch`.
  void ObserveAttach(double seconds, uint64_t mapped_bytes, uint64_t epoch);
  // The mapping was dropped (the cache manager restarted or went away).
  void ObserveDetach();

  std::shared_ptr<prometheus::Registry> registry() const;

  // Every metric exported, in the order declared: the one list.
  static std::span<const MetricSpec> Specs();

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  // Resolved once; owned by registry_'s families.
  prometheus::Counter* model_loads_ = nullptr;
  prometheus::Gauge* model_load_seconds_ = nullptr;
  prometheus::Counter* steps_ = nullptr;
  std::array<prometheus::Histogram*, kStepPhases> step_durations_{};
  std::array<prometheus::Counter*, kStepPhases> tokens_{};
  prometheus::Counter* sampled_ = nullptr;
  prometheus::Histogram* batch_size_ = nullptr;
  std::array<prometheus::Counter*, kStepErrors> step_errors_{};
  prometheus::Counter* attaches_ = nullptr;
  prometheus::Histogram* attach_durations_ = nullptr;
  prometheus::Gauge* mapped_bytes_ = nullptr;
  prometheus::Gauge* attached_ = nullptr;
  prometheus::Gauge* epoch_ = nullptr;
};

}  // namespace kvcm::executor
