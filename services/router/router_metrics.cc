#include "services/router/router_metrics.h"

#include <string>
#include <vector>

#include "common/base/check.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace kvcm::router {
namespace {

using prometheus::MetricType;

// --- The router's metrics: the one list --------------------------------------------------

constexpr MetricSpec kQueued{"kvcm_router_queue_requests", MetricType::Gauge, "",
                             "Requests waiting to be admitted (including preempted ones)."};
constexpr MetricSpec kRunning{"kvcm_router_running_sequences", MetricType::Gauge, "",
                              "Sequences admitted and holding blocks."};
constexpr MetricSpec kExecutors{"kvcm_router_executors", MetricType::Gauge, "",
                                "Executors registered with the router."};
constexpr MetricSpec kSteps{"kvcm_router_steps_total", MetricType::Counter, "",
                            "Scheduler steps run (a Step to the cache manager and a StepBatch "
                            "to each executor with work)."};
constexpr MetricSpec kStepDuration{"kvcm_router_step_duration_seconds", MetricType::Histogram, "",
                                   "Time of a step from planning to the last executor's result."};
constexpr MetricSpec kBatchSequences{"kvcm_router_batch_sequences", MetricType::Histogram, "",
                                     "Sequences computed in a step."};
constexpr MetricSpec kBatchTokens{"kvcm_router_batch_tokens", MetricType::Histogram, "",
                                  "Tokens computed in a step (prefill chunks and decodes)."};
constexpr MetricSpec kPromptTokens{
    "kvcm_router_prompt_tokens_total", MetricType::Counter, "source",
    "Prompt tokens admitted, by source: cached (their KV was found in the prefix cache) or "
    "computed (prefilled)."};
constexpr MetricSpec kTierPromptTokens{
    "kvcm_router_prompt_tokens_from_tier_total", MetricType::Counter, "tier",
    "Of the cached prompt tokens, those the cache manager loaded from its host or disk tier "
    "for the request (docs/architecture.md, \"Tiers\")."};
constexpr MetricSpec kGenerated{"kvcm_router_generated_tokens_total", MetricType::Counter, "",
                                "Tokens generated and sent to clients."};
constexpr MetricSpec kPreemptions{
    "kvcm_router_preemptions_total", MetricType::Counter, "",
    "Sequences preempted for lack of blocks (freed, then re-admitted and recomputed)."};
constexpr MetricSpec kRecomputed{
    "kvcm_router_recomputed_committed_tokens_total", MetricType::Counter, "",
    "Tokens computed again although their KV had been committed: after a preemption whose "
    "cached blocks were evicted meanwhile, or a cache-manager restart (its pool is gone). "
    "An executor's death adds nothing here (only its unanswered step is redone)."};
constexpr MetricSpec kRequests{"kvcm_router_requests_total", MetricType::Counter, "api,outcome",
                               "Requests by API and by how they ended."};
constexpr MetricSpec kTtft{"kvcm_router_time_to_first_token_seconds", MetricType::Histogram, "",
                           "From the request's arrival to its first generated token."};
constexpr MetricSpec kTpot{"kvcm_router_time_per_output_token_seconds", MetricType::Histogram, "",
                           "Between a request's consecutive generated tokens."};
constexpr MetricSpec kE2e{"kvcm_router_request_duration_seconds", MetricType::Histogram, "",
                          "From a request's arrival to its last token."};
constexpr MetricSpec kSlowDropped{
    "kvcm_router_http_slow_requests_dropped_total", MetricType::Counter, "",
    "HTTP connections dropped because their request did not arrive whole within "
    "--http-request-timeout-ms (a slow or slowloris client)."};
constexpr MetricSpec kConnectionsShed{
    "kvcm_router_http_connections_shed_total", MetricType::Counter, "",
    "HTTP connections closed as they arrived because too few file descriptors were left "
    "under RLIMIT_NOFILE (docs/router.md, \"Connections at the descriptor limit\")."};

// Not in this list: kvcm_router_config_info, the effective configuration (a gauge at 1,
// one label per option), which main.cc adds to the same registry (common/config/config.h):
// its labels are the binary's flags, so it is declared from the flags themselves.
constexpr std::array kSpecs = {kQueued,           kRunning,        kExecutors,   kSteps,
                               kStepDuration,     kBatchSequences, kBatchTokens, kPromptTokens,
                               kTierPromptTokens, kGenerated,      kPreemptions, kRecomputed,
                               kRequests,         kTtft,           kTpot,        kE2e,
                               kSlowDropped,      kConnectionsShed};

constexpr std::array<const char*, kRequestOutcomes> kOutcomeNames = {"ok", "invalid", "overloaded",
                                                                     "unavailable", "cancelled"};
constexpr std::array<const char*, kApis> kApiNames = {"tgi", "openai"};

std::vector<double> SecondsBuckets() {
  return {1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2,
          0.1,  0.25,   0.5,  1.0,  2.5,    5.0,  10.0, 30.0,   60.0};
}
std::vector<double> PowersOfTwo(double top) {
  std::vector<double> buckets;
  for (double b = 1; b <= top; b *= 2) buckets.push_back(b);
  return buckets;
}

}  // namespace

RouterMetrics::RouterMetrics() : registry_(std::make_shared<prometheus::Registry>()) {
  queued_ = &AddGaugeFamily(*registry_, kQueued).Add({});
  running_ = &AddGaugeFamily(*registry_, kRunning).Add({});
  executors_ = &AddGaugeFamily(*registry_, kExecutors).Add({});
  steps_ = &AddCounterFamily(*registry_, kSteps).Add({});
  step_duration_ = &AddHistogramFamily(*registry_, kStepDuration).Add({}, SecondsBuckets());
  batch_sequences_ = &AddHistogramFamily(*registry_, kBatchSequences).Add({}, PowersOfTwo(1024));
  batch_tokens_ = &AddHistogramFamily(*registry_, kBatchTokens).Add({}, PowersOfTwo(65536));
  auto& prompt = AddCounterFamily(*registry_, kPromptTokens);
  prompt_cached_ = &prompt.Add({{"source", "cached"}});
  prompt_computed_ = &prompt.Add({{"source", "computed"}});
  auto& tier_prompt = AddCounterFamily(*registry_, kTierPromptTokens);
  prompt_host_tier_ = &tier_prompt.Add({{"tier", "host"}});
  prompt_disk_tier_ = &tier_prompt.Add({{"tier", "disk"}});
  generated_ = &AddCounterFamily(*registry_, kGenerated).Add({});
  preemptions_ = &AddCounterFamily(*registry_, kPreemptions).Add({});
  recomputed_committed_ = &AddCounterFamily(*registry_, kRecomputed).Add({});
  auto& requests = AddCounterFamily(*registry_, kRequests);
  for (int a = 0; a < kApis; ++a) {
    for (int i = 0; i < kRequestOutcomes; ++i) {
      requests_[a][i] = &requests.Add({{"api", kApiNames[a]}, {"outcome", kOutcomeNames[i]}});
    }
  }
  ttft_ = &AddHistogramFamily(*registry_, kTtft).Add({}, SecondsBuckets());
  tpot_ = &AddHistogramFamily(*registry_, kTpot).Add({}, SecondsBuckets());
  e2e_ = &AddHistogramFamily(*registry_, kE2e).Add({}, SecondsBuckets());
  slow_dropped_ = &AddCounterFamily(*registry_, kSlowDropped).Add({});
  connections_shed_ = &AddCounterFamily(*registry_, kConnectionsShed).Add({});
}

RouterMetrics::~RouterMetrics() = default;

void RouterMetrics::ObserveStep(double seconds, int32_t sequences, int32_t prefill_tokens,
                                int32_t decode_tokens) {
  steps_->Increment();
  step_duration_->Observe(seconds);
  batch_sequences_->Observe(sequences);
  batch_tokens_->Observe(prefill_tokens + decode_tokens);
}

void RouterMetrics::SetState(size_t queued, size_t running, int executors) {
  queued_->Set(static_cast<double>(queued));
  running_->Set(static_cast<double>(running));
  executors_->Set(executors);
}

void RouterMetrics::CountPromptTokens(int64_t cached, int64_t computed) {
  prompt_cached_->Increment(static_cast<double>(cached));
  prompt_computed_->Increment(static_cast<double>(computed));
}

void RouterMetrics::CountTierPromptTokens(int64_t host, int64_t disk) {
  prompt_host_tier_->Increment(static_cast<double>(host));
  prompt_disk_tier_->Increment(static_cast<double>(disk));
}

void RouterMetrics::CountGeneratedTokens(int64_t n) {
  generated_->Increment(static_cast<double>(n));
}
void RouterMetrics::CountPreemptions(int64_t n) { preemptions_->Increment(static_cast<double>(n)); }
void RouterMetrics::CountRecomputedCommittedTokens(int64_t n) {
  recomputed_committed_->Increment(static_cast<double>(n));
}

void RouterMetrics::CountRequest(Api api, RequestOutcome outcome) {
  const auto a = static_cast<size_t>(api);
  const auto i = static_cast<size_t>(outcome);
  KVCM_CHECK(a < requests_.size() && i < requests_[a].size()) << a << " " << i;
  requests_[a][i]->Increment();
}

void RouterMetrics::ObserveTimeToFirstToken(double seconds) { ttft_->Observe(seconds); }
void RouterMetrics::ObserveTimePerOutputToken(double seconds) { tpot_->Observe(seconds); }
void RouterMetrics::ObserveRequestDuration(double seconds) { e2e_->Observe(seconds); }
void RouterMetrics::CountSlowRequestDropped() { slow_dropped_->Increment(); }
void RouterMetrics::CountHttpConnectionShed() { connections_shed_->Increment(); }

std::span<const MetricSpec> RouterMetrics::Specs() { return kSpecs; }

}  // namespace kvcm::router
