#pragma once

// LabeledHistograms: one latency histogram per value of one label, all with the same
// buckets, and the count of observations of each as a counter family: for the requests a
// service handles on its hot path, by type. Exported at scrape time (a Collectable added
// to a ScrapeRegistry).
//
// An observation is two relaxed atomic adds into one block of memory, after a scan of the
// bucket bounds from the smallest (a fast request stops in the first cache line). A
// prometheus-cpp Counter and Histogram for the same do more than ten cache lines' worth of
// work (objects apart on the heap, a mutex, a compare-and-swap loop on a double), which a
// request handled right after a context switch pays in cache misses
// (docs/PERFORMANCE.md, "Round trip").
//
// A scrape reads each count once: every bucket is cumulative and `_count` equals the +Inf
// bucket, as Prometheus requires; `_sum` (whole nanoseconds) may miss an observation made
// during the scrape.
//
// Thread safety: Observe from any thread, concurrently with Collect.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "common/metrics/metric_spec.h"
#include "prometheus/collectable.h"
#include "prometheus/metric_family.h"

namespace kvcm {

class LabeledHistograms : public prometheus::Collectable {
 public:
  // `histogram` (a Histogram) and `counter` (a Counter) name the two families; each has
  // the one label `label`, whose values are `values` (Observe's index). `bounds_seconds`:
  // the buckets' upper bounds, ascending (+Inf is added). Every label value is exported
  // from construction, at 0.
  LabeledHistograms(const MetricSpec& histogram, const MetricSpec& counter, std::string label,
                    std::vector<std::string> values, std::vector<double> bounds_seconds);

  // REQUIRES: value < number of values.
  void Observe(size_t value, double seconds) {
    size_t bucket = 0;
    while (bucket < bounds_.size() && seconds > bounds_[bucket]) ++bucket;
    // Whole nanoseconds (a negative time, from a clock that stepped back, adds 0).
    const double ns = seconds * 1e9;
    Cell(value, 0).fetch_add(ns > 0 ? static_cast<uint64_t>(ns) : 0, std::memory_order_relaxed);
    Cell(value, 1 + bucket).fetch_add(1, std::memory_order_relaxed);
  }

  std::vector<prometheus::MetricFamily> Collect() const override;

 private:
  // Each value's row starts a cache line: the sum in nanoseconds, then a count per bucket
  // (+Inf last). The sum and the first seven buckets share the row's first line. Every
  // cell starts at 0 (a C++20 atomic is value-initialised).
  struct alignas(64) Line {
    std::atomic<uint64_t> cell[8];
  };
  std::atomic<uint64_t>& Cell(size_t value, size_t i) const {
    return lines_[value * lines_per_row_ + i / 8].cell[i % 8];
  }

  const MetricSpec histogram_;
  const MetricSpec counter_;
  const std::string label_;
  const std::vector<std::string> values_;
  const std::vector<double> bounds_;
  const size_t lines_per_row_;
  mutable std::vector<Line> lines_;
};

}  // namespace kvcm
