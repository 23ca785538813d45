#include "common/metrics/labeled_histograms.h"

#include <algorithm>
#include <limits>
#include <utility>

#include "common/base/check.h"

namespace kvcm {

LabeledHistograms::LabeledHistograms(const MetricSpec& histogram, const MetricSpec& counter,
                                     std::string label, std::vector<std::string> values,
                                     std::vector<double> bounds_seconds)
    : histogram_(histogram),
      counter_(counter),
      label_(std::move(label)),
      values_(std::move(values)),
      bounds_(std::move(bounds_seconds)),
      lines_per_row_((bounds_.size() + 2 + 7) / 8),
      lines_(values_.size() * lines_per_row_) {
  KVCM_CHECK(histogram_.type == prometheus::MetricType::Histogram) << histogram_.name;
  KVCM_CHECK(counter_.type == prometheus::MetricType::Counter) << counter_.name;
  KVCM_CHECK(std::is_sorted(bounds_.begin(), bounds_.end()) &&
             std::adjacent_find(bounds_.begin(), bounds_.end()) == bounds_.end())
      << histogram_.name << ": bucket bounds must ascend";
}

std::vector<prometheus::MetricFamily> LabeledHistograms::Collect() const {
  prometheus::MetricFamily histograms;
  histograms.name = histogram_.name;
  histograms.help = histogram_.help;
  histograms.type = prometheus::MetricType::Histogram;
  prometheus::MetricFamily counters = NewFamily(counter_);
  for (size_t v = 0; v < values_.size(); ++v) {
    prometheus::ClientMetric metric;
    metric.label = {{label_, values_[v]}};
    uint64_t cumulative = 0;
    for (size_t b = 0; b <= bounds_.size(); ++b) {
      cumulative += Cell(v, 1 + b).load(std::memory_order_relaxed);
      metric.histogram.bucket.push_back(
          {cumulative, b < bounds_.size() ? bounds_[b] : std::numeric_limits<double>::infinity()});
    }
    metric.histogram.sample_count = cumulative;
    metric.histogram.sample_sum =
        static_cast<double>(Cell(v, 0).load(std::memory_order_relaxed)) * 1e-9;
    histograms.metric.push_back(std::move(metric));
    AddSample(counters, static_cast<double>(cumulative), {{label_, values_[v]}});
  }
  std::vector<prometheus::MetricFamily> families;
  families.push_back(std::move(counters));
  families.push_back(std::move(histograms));
  return families;
}

}  // namespace kvcm
