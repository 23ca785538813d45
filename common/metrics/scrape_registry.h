#pragma once

// ScrapeRegistry: a prometheus::Registry that, at each scrape, also collects the families
// of registered scrape-time collectors. prometheus-cpp 1.0.1 has no callback gauges; a
// collector that builds its families from one snapshot taken under its own lock gives
// values that are consistent with each other (e.g. block states that sum to the capacity),
// which separately set gauges cannot.
//
// Families from the registry's own builders come first, then each collector's, in the
// order they were added. Collector names must not clash with each other or the registry's.
//
// Thread safety: all methods may be called concurrently (Collect runs on the metrics
// server's threads).

#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "common/base/mutex.h"
#include "prometheus/collectable.h"
#include "prometheus/metric_family.h"
#include "prometheus/registry.h"

namespace kvcm {

class ScrapeRegistry : public prometheus::Registry {
 public:
  ScrapeRegistry() = default;

  // Adds `collector`, held weakly: its owner decides its lifetime, and once it is gone it
  // is skipped (the registry may outlive it inside a MetricsServer).
  void AddCollector(std::weak_ptr<const prometheus::Collectable> collector);

  std::vector<prometheus::MetricFamily> Collect() const override;

 private:
  mutable Mutex mu_;
  std::vector<std::weak_ptr<const prometheus::Collectable>> collectors_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvcm
