#include "common/metrics/scrape_registry.h"

#include <memory>
#include <string>
#include <vector>

#include "common/metrics/metric_spec.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/histogram.h"
#include "prometheus/text_serializer.h"

namespace kvcm {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr MetricSpec kWidgets{"kvcm_test_widgets", prometheus::MetricType::Gauge, "color",
                              "Widgets by color."};
constexpr MetricSpec kEvents{"kvcm_test_events_total", prometheus::MetricType::Counter, "",
                             "Events."};
constexpr MetricSpec kLatency{"kvcm_test_latency_seconds", prometheus::MetricType::Histogram, "",
                              "Latency."};

class FixedCollector : public prometheus::Collectable {
 public:
  explicit FixedCollector(double value) : value_(value) {}
  std::vector<prometheus::MetricFamily> Collect() const override {
    prometheus::MetricFamily family = NewFamily(kWidgets);
    AddSample(family, value_, {{"color", "red"}});
    AddSample(family, 2 * value_, {{"color", "blue"}});
    return {family};
  }

 private:
  double value_;
};

std::vector<std::string> Names(const std::vector<prometheus::MetricFamily>& families) {
  std::vector<std::string> names;
  for (const auto& family : families) names.push_back(family.name);
  return names;
}

TEST(ScrapeRegistryTest, AppendsCollectorsAfterItsOwnFamilies) {
  ScrapeRegistry registry;
  AddCounterFamily(registry, kEvents).Add({}).Increment(5);
  auto collector = std::make_shared<FixedCollector>(7);
  registry.AddCollector(collector);

  const std::vector<prometheus::MetricFamily> families = registry.Collect();
  EXPECT_THAT(Names(families), ElementsAre("kvcm_test_events_total", "kvcm_test_widgets"));
  const std::string text = prometheus::TextSerializer().Serialize(families);
  EXPECT_THAT(text, HasSubstr("kvcm_test_events_total 5"));
  EXPECT_THAT(text, HasSubstr("# HELP kvcm_test_widgets Widgets by color."));
  EXPECT_THAT(text, HasSubstr("# TYPE kvcm_test_widgets gauge"));
  EXPECT_THAT(text, HasSubstr("kvcm_test_widgets{color=\"red\"} 7"));
  EXPECT_THAT(text, HasSubstr("kvcm_test_widgets{color=\"blue\"} 14"));
}

TEST(ScrapeRegistryTest, SkipsCollectorsThatAreGone) {
  ScrapeRegistry registry;
  auto collector = std::make_shared<FixedCollector>(1);
  registry.AddCollector(collector);
  EXPECT_THAT(Names(registry.Collect()), ElementsAre("kvcm_test_widgets"));
  collector.reset();
  EXPECT_TRUE(registry.Collect().empty());
}

TEST(MetricSpecTest, CounterSamplesAreCountersAndHistogramsGetBuckets) {
  prometheus::MetricFamily events = NewFamily(kEvents);
  AddSample(events, 3);
  EXPECT_EQ(events.type, prometheus::MetricType::Counter);
  ASSERT_EQ(events.metric.size(), 1u);
  EXPECT_EQ(events.metric[0].counter.value, 3);

  ScrapeRegistry registry;
  AddHistogramFamily(registry, kLatency).Add({}, RequestLatencyBucketsSeconds()).Observe(2e-3);
  const std::string text = prometheus::TextSerializer().Serialize(registry.Collect());
  EXPECT_THAT(text, HasSubstr("kvcm_test_latency_seconds_count 1"));
}

TEST(MetricSpecTest, RequestLatencyBucketsSpanFiveMicrosecondsToOneSecond) {
  const std::vector<double> bounds = RequestLatencyBucketsSeconds();
  ASSERT_EQ(bounds.size(), 17u);
  EXPECT_DOUBLE_EQ(bounds.front(), 5e-6);
  EXPECT_DOUBLE_EQ(bounds.back(), 1.0);
  for (size_t i = 1; i < bounds.size(); ++i) {
    EXPECT_LT(bounds[i - 1], bounds[i]);
    EXPECT_LE(bounds[i] / bounds[i - 1], 2.5 + 1e-9);  // no gap wider than 2.5x
  }
}

}  // namespace
}  // namespace kvcm
