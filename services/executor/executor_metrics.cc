#include "services/executor/executor_metrics.h"

#include <vector>

#include "common/base/check.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace kvcm::executor {
namespace {

using prometheus::MetricType;

// --- The executor's metrics: the one list ------------------------------------------------

constexpr MetricSpec kInfo{"kvcm_executor_info", MetricType::Gauge, "model,weight_dtype",
                           "Always 1; the labels name the model served and its weight dtype."};
constexpr MetricSpec kModelLoads{
    "kvcm_executor_model_loads_total", MetricType::Counter, "",
    "Times the model's weights were loaded. 1 for the process's life: re-attaching to a "
    "restarted cache manager keeps the weights."};
constexpr MetricSpec kModelLoadSeconds{"kvcm_executor_model_load_duration_seconds",
                                       MetricType::Gauge, "",
                                       "Time the weights took to load at start-up."};
constexpr MetricSpec kSteps{"kvcm_executor_steps_total", MetricType::Counter, "",
                            "Step batches run (forward pass done and reply sent)."};
constexpr MetricSpec kStepDuration{
    "kvcm_executor_step_duration_seconds", MetricType::Histogram, "phase",
    "Time to run a step batch, from receipt to reply: copies, forward pass and sampling. "
    "phase=prefill when the step had any prefill token, else decode."};
constexpr MetricSpec kTokensProcessed{
    "kvcm_executor_tokens_processed_total", MetricType::Counter, "phase",
    "New tokens whose K/V was computed and written into the pool, by phase: prefill (a "
    "sequence's tokens in a step with several new tokens or no earlier context) or decode."};
constexpr MetricSpec kTokensSampled{"kvcm_executor_tokens_sampled_total", MetricType::Counter, "",
                                    "Tokens sampled and returned to the router."};
constexpr MetricSpec kBatchSize{"kvcm_executor_batch_size", MetricType::Histogram, "",
                                "Sequences per step batch."};
constexpr MetricSpec kStepErrorsSpec{
    "kvcm_executor_step_errors_total", MetricType::Counter, "reason",
    "Inbound messages refused with an error reply, by reason; a refused step changes "
    "nothing in the pool."};
constexpr MetricSpec kAttaches{"kvcm_executor_attaches_total", MetricType::Counter, "",
                               "Pool attachments: 1 at start, +1 per cache-manager restart."};
constexpr MetricSpec kAttachDuration{
    "kvcm_executor_attach_duration_seconds", MetricType::Histogram, "",
    "Time to attach to the pool: descriptor request, fd or IPC handle, mapping."};
constexpr MetricSpec kMappedBytes{"kvcm_executor_mapped_bytes", MetricType::Gauge, "",
                                  "Bytes of KV-cache pool mapped now (0 while detached)."};
constexpr MetricSpec kAttached{"kvcm_executor_pool_attached", MetricType::Gauge, "",
                               "1 while a pool is attached and matches the model, else 0."};
constexpr MetricSpec kEpoch{"kvcm_executor_epoch", MetricType::Gauge, "",
                            "Epoch of the cache manager whose pool is attached (0: none)."};

// Not in this list: kvcm_executor_config_info, the effective configuration (a gauge at 1,
// one label per option), which main.cc adds to the same registry (common/config/config.h):
// its labels are the binary's flags, so it is declared from the flags themselves.
constexpr std::array kSpecs = {
    kInfo,          kModelLoads, kModelLoadSeconds, kSteps,    kStepDuration,   kTokensProcessed,
    kTokensSampled, kBatchSize,  kStepErrorsSpec,   kAttaches, kAttachDuration, kMappedBytes,
    kAttached,      kEpoch,
};

constexpr std::array<std::string_view, kStepPhases> kPhaseNames = {"prefill", "decode"};
constexpr std::array<std::string_view, kStepErrors> kErrorNames = {
    "malformed", "invalid_argument", "stale_epoch", "no_pool", "internal", "fenced"};

// Step durations: 100 µs (a decode step of a tiny model) to 10 s (a long prefill on CPU).
std::vector<double> StepBucketsSeconds() {
  return {1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2,
          5e-2, 0.1,    0.25, 0.5,  1.0,    2.5,  5.0,  10.0};
}
// Attach: a memfd over a Unix socket takes about a millisecond; a CUDA IPC open longer.
std::vector<double> AttachBucketsSeconds() {
  return {1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 5.0};
}
// Sequences per step: powers of two up to 1024.
std::vector<double> BatchSizeBuckets() {
  std::vector<double> buckets;
  for (double b = 1; b <= 1024; b *= 2) buckets.push_back(b);
  return buckets;
}

template <typename Enum, size_t N>
std::string_view NameOf(const std::array<std::string_view, N>& names, Enum value) {
  const size_t index = static_cast<size_t>(value);
  KVCM_CHECK(index < N) << "enum value " << index << " has no label";
  return names[index];
}

}  // namespace

std::string_view StepPhaseName(StepPhase phase) { return NameOf(kPhaseNames, phase); }
std::string_view StepErrorName(StepError error) { return NameOf(kErrorNames, error); }

ExecutorMetrics::ExecutorMetrics(const ExecutorInfo& info)
    : registry_(std::make_shared<prometheus::Registry>()) {
  AddGaugeFamily(*registry_, kInfo)
      .Add({{"model", info.model}, {"weight_dtype", info.weight_dtype}})
      .Set(1);
  model_loads_ = &AddCounterFamily(*registry_, kModelLoads).Add({});
  model_load_seconds_ = &AddGaugeFamily(*registry_, kModelLoadSeconds).Add({});
  steps_ = &AddCounterFamily(*registry_, kSteps).Add({});
  auto& durations = AddHistogramFamily(*registry_, kStepDuration);
  auto& tokens = AddCounterFamily(*registry_, kTokensProcessed);
  for (int i = 0; i < kStepPhases; ++i) {
    const std::string phase(kPhaseNames[i]);
    step_durations_[i] = &durations.Add({{"phase", phase}}, StepBucketsSeconds());
    tokens_[i] = &tokens.Add({{"phase", phase}});
  }
  sampled_ = &AddCounterFamily(*registry_, kTokensSampled).Add({});
  batch_size_ = &AddHistogramFamily(*registry_, kBatchSize).Add({}, BatchSizeBuckets());
  auto& errors = AddCounterFamily(*registry_, kStepErrorsSpec);
  for (int i = 0; i < kStepErrors; ++i) {
    step_errors_[i] = &errors.Add({{"reason", std::string(kErrorNames[i])}});
  }
  attaches_ = &AddCounterFamily(*registry_, kAttaches).Add({});
  attach_durations_ =
      &AddHistogramFamily(*registry_, kAttachDuration).Add({}, AttachBucketsSeconds());
  mapped_bytes_ = &AddGaugeFamily(*registry_, kMappedBytes).Add({});
  attached_ = &AddGaugeFamily(*registry_, kAttached).Add({});
  epoch_ = &AddGaugeFamily(*registry_, kEpoch).Add({});
}

ExecutorMetrics::~ExecutorMetrics() = default;

void ExecutorMetrics::ObserveModelLoad(double seconds) {
  model_loads_->Increment();
  model_load_seconds_->Set(seconds);
}

void ExecutorMetrics::ObserveStep(int32_t num_seqs, int32_t prefill_tokens, int32_t decode_tokens,
                                  int32_t sampled, double seconds) {
  KVCM_CHECK(num_seqs >= 0 && prefill_tokens >= 0 && decode_tokens >= 0 && sampled >= 0)
      << num_seqs << " " << prefill_tokens << " " << decode_tokens << " " << sampled;
  steps_->Increment();
  const StepPhase phase = prefill_tokens > 0 ? StepPhase::kPrefill : StepPhase::kDecode;
  step_durations_[static_cast<size_t>(phase)]->Observe(seconds);
  tokens_[static_cast<size_t>(StepPhase::kPrefill)]->Increment(prefill_tokens);
  tokens_[static_cast<size_t>(StepPhase::kDecode)]->Increment(decode_tokens);
  sampled_->Increment(sampled);
  batch_size_->Observe(num_seqs);
}

void ExecutorMetrics::CountStepError(StepError error) {
  const size_t i = static_cast<size_t>(error);
  KVCM_CHECK(i < step_errors_.size()) << i;
  step_errors_[i]->Increment();
}

void ExecutorMetrics::ObserveAttach(double seconds, uint64_t mapped_bytes, uint64_t epoch) {
  attaches_->Increment();
  attach_durations_->Observe(seconds);
  mapped_bytes_->Set(static_cast<double>(mapped_bytes));
  attached_->Set(1);
  epoch_->Set(static_cast<double>(epoch));
}

void ExecutorMetrics::ObserveDetach() {
  mapped_bytes_->Set(0);
  attached_->Set(0);
  epoch_->Set(0);
}

std::shared_ptr<prometheus::Registry> ExecutorMetrics::registry() const { return registry_; }

std::span<const MetricSpec> ExecutorMetrics::Specs() { return kSpecs; }

}  // namespace kvcm::executor
