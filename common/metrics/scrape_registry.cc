#include "common/metrics/scrape_registry.h"

#include <iterator>
#include <utility>

namespace kvcm {

void ScrapeRegistry::AddCollector(std::weak_ptr<const prometheus::Collectable> collector) {
  MutexLock lock(&mu_);
  collectors_.push_back(std::move(collector));
}

std::vector<prometheus::MetricFamily> ScrapeRegistry::Collect() const {
  std::vector<prometheus::MetricFamily> families = prometheus::Registry::Collect();
  std::vector<std::shared_ptr<const prometheus::Collectable>> live;
  {
    MutexLock lock(&mu_);
    for (const auto& weak : collectors_) {
      if (auto collector = weak.lock()) live.push_back(std::move(collector));
    }
  }
  // Outside mu_: a collector takes its own lock and may be slow.
  for (const auto& collector : live) {
    std::vector<prometheus::MetricFamily> more = collector->Collect();
    families.insert(families.end(), std::make_move_iterator(more.begin()),
                    std::make_move_iterator(more.end()));
  }
  return families;
}

}  // namespace kvcm
