#pragma once

// A parser for the Prometheus text exposition format (version 0.0.4), enough to check what
// a /metrics endpoint serves: samples with labels and values, and each family's TYPE and
// HELP. Test support only.

#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace kvcm::testing {

using MetricLabels = std::map<std::string, std::string>;

struct MetricSample {
  std::string name;  // as written: histogram samples end in _bucket, _sum, _count
  MetricLabels labels;
  double value = 0;
};

struct MetricsText {
  std::vector<MetricSample> samples;         // in order
  std::map<std::string, std::string> types;  // family name -> "counter", "gauge", ...
  std::map<std::string, std::string> helps;  // family name -> help text

  // The samples named `name`, in order.
  std::vector<MetricSample> Samples(std::string_view name) const;
  // The value of the sample named `name` with exactly `labels`.
  // Errors: NOT_FOUND, FAILED_PRECONDITION (more than one such sample).
  absl::StatusOr<double> Value(std::string_view name, const MetricLabels& labels = {}) const;
};

// Errors: INVALID_ARGUMENT naming the line that does not parse.
absl::StatusOr<MetricsText> ParseMetricsText(std::string_view text);

}  // namespace kvcm::testing
