#include "common/metrics/metric_spec.h"

#include <utility>

#include "common/base/check.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace kvcm {

std::vector<double> RequestLatencyBucketsSeconds() {
  return {5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3,
          5e-3, 1e-2, 2.5e-2, 5e-2, 0.1,  0.25,   0.5,  1.0};
}

prometheus::Family<prometheus::Counter>& AddCounterFamily(prometheus::Registry& registry,
                                                          const MetricSpec& spec) {
  KVCM_CHECK(spec.type == prometheus::MetricType::Counter) << spec.name;
  return prometheus::BuildCounter().Name(spec.name).Help(spec.help).Register(registry);
}

prometheus::Family<prometheus::Gauge>& AddGaugeFamily(prometheus::Registry& registry,
                                                      const MetricSpec& spec) {
  KVCM_CHECK(spec.type == prometheus::MetricType::Gauge) << spec.name;
  return prometheus::BuildGauge().Name(spec.name).Help(spec.help).Register(registry);
}

prometheus::Family<prometheus::Histogram>& AddHistogramFamily(prometheus::Registry& registry,
                                                              const MetricSpec& spec) {
  KVCM_CHECK(spec.type == prometheus::MetricType::Histogram) << spec.name;
  return prometheus::BuildHistogram().Name(spec.name).Help(spec.help).Register(registry);
}

prometheus::MetricFamily NewFamily(const MetricSpec& spec) {
  KVCM_CHECK(spec.type == prometheus::MetricType::Counter ||
             spec.type == prometheus::MetricType::Gauge)
      << spec.name;
  prometheus::MetricFamily family;
  family.name = spec.name;
  family.help = spec.help;
  family.type = spec.type;
  return family;
}

void AddSample(prometheus::MetricFamily& family, double value,
               std::vector<prometheus::ClientMetric::Label> labels) {
  prometheus::ClientMetric metric;
  metric.label = std::move(labels);
  if (family.type == prometheus::MetricType::Counter) {
    metric.counter.value = value;
  } else {
    KVCM_CHECK(family.type == prometheus::MetricType::Gauge) << family.name;
    metric.gauge.value = value;
  }
  family.metric.push_back(std::move(metric));
}

}  // namespace kvcm
