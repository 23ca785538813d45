#pragma once

// MetricSpec: one metric's declaration (name, type, labels, help), so that a component can
// declare all its metrics once, in one list, next to it, and build both prometheus-cpp
// families (updated as things happen) and scrape-time families (built from a snapshot by a
// collector, see ScrapeRegistry) from the same declarations.
//
// Conventions (docs/architecture.md): prefix `kvcm_`, base
// units (`_seconds`, `_bytes`), `_total` on counters, `_ratio` for 0–1 values, no
// unbounded label values, every known label set exported at 0 from start-up.

#include <string>
#include <vector>

#include "prometheus/client_metric.h"
#include "prometheus/metric_family.h"
#include "prometheus/metric_type.h"

namespace prometheus {
class Counter;
class Gauge;
class Histogram;
class Registry;
template <typename T>
class Family;
}  // namespace prometheus

namespace kvcm {

struct MetricSpec {
  const char* name;             // full name, with the `kvcm_` prefix and unit suffix
  prometheus::MetricType type;  // Counter, Gauge or Histogram
  const char* labels;           // label names as exported, comma-separated; "" = none
  const char* help;             // what the value means, for someone reading a dashboard
};

// Histogram bucket upper bounds, in seconds, for request latencies: 5 µs to 1 s in a
// 1-2.5-5 series (17 buckets; the histogram adds +Inf). Fine enough at the bottom for
// in-process handlers, and still resolves the slowest request a client would wait for.
std::vector<double> RequestLatencyBucketsSeconds();

// --- Families updated as things happen (prometheus-cpp metrics, thread-safe) -------------

// REQUIRES: spec.type matches the function.
prometheus::Family<prometheus::Counter>& AddCounterFamily(prometheus::Registry& registry,
                                                          const MetricSpec& spec);
prometheus::Family<prometheus::Gauge>& AddGaugeFamily(prometheus::Registry& registry,
                                                      const MetricSpec& spec);
prometheus::Family<prometheus::Histogram>& AddHistogramFamily(prometheus::Registry& registry,
                                                              const MetricSpec& spec);

// --- Families built at scrape time --------------------------------------------------------

// An empty family for `spec`. REQUIRES: spec.type is Counter or Gauge.
prometheus::MetricFamily NewFamily(const MetricSpec& spec);

// Appends a sample with `labels` ({name, value} pairs; none for a family without a label).
void AddSample(prometheus::MetricFamily& family, double value,
               std::vector<prometheus::ClientMetric::Label> labels = {});

}  // namespace kvcm
