#include "common/metrics/labeled_histograms.h"

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/metrics/metric_spec.h"
#include "common/metrics/scrape_registry.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "prometheus/text_serializer.h"

namespace kvcm {
namespace {

using ::testing::HasSubstr;

constexpr MetricSpec kLatency{"kvcm_test_latency_seconds", prometheus::MetricType::Histogram,
                              "kind", "Latency by kind."};
constexpr MetricSpec kCount{"kvcm_test_requests_total", prometheus::MetricType::Counter, "kind",
                            "Requests by kind."};

const prometheus::MetricFamily& FamilyOf(const std::vector<prometheus::MetricFamily>& families,
                                         const std::string& name) {
  for (const prometheus::MetricFamily& family : families) {
    if (family.name == name) return family;
  }
  ADD_FAILURE() << "no family " << name;
  static const prometheus::MetricFamily kNone;
  return kNone;
}

const prometheus::ClientMetric& MetricOf(const prometheus::MetricFamily& family,
                                         const std::string& kind) {
  for (const prometheus::ClientMetric& metric : family.metric) {
    if (metric.label.size() == 1 && metric.label[0].value == kind) return metric;
  }
  ADD_FAILURE() << "no " << kind << " in " << family.name;
  static const prometheus::ClientMetric kNone;
  return kNone;
}

TEST(LabeledHistogramsTest, EveryValueIsExportedAtZeroFromTheStart) {
  LabeledHistograms histograms(kLatency, kCount, "kind", {"a", "b"}, {1e-3, 1e-2});
  const std::string text = prometheus::TextSerializer().Serialize(histograms.Collect());
  EXPECT_THAT(text, HasSubstr("# TYPE kvcm_test_latency_seconds histogram"));
  EXPECT_THAT(text, HasSubstr("# TYPE kvcm_test_requests_total counter"));
  for (const char* kind : {"a", "b"}) {
    EXPECT_THAT(text, HasSubstr(std::string("kvcm_test_requests_total{kind=\"") + kind + "\"} 0"));
    EXPECT_THAT(text,
                HasSubstr(std::string("kvcm_test_latency_seconds_count{kind=\"") + kind + "\"} 0"));
    EXPECT_THAT(text, HasSubstr(std::string("kvcm_test_latency_seconds_bucket{kind=\"") + kind +
                                "\",le=\"+Inf\"} 0"));
  }
}

// The same observations into prometheus-cpp's own Histogram and Counter give the same
// buckets, counts and (to the nanosecond) sums.
TEST(LabeledHistogramsTest, ExportsWhatPrometheusCppsHistogramAndCounterWould) {
  const std::vector<double> bounds = RequestLatencyBucketsSeconds();
  LabeledHistograms histograms(kLatency, kCount, "kind", {"fast", "slow"}, bounds);
  prometheus::Registry reference;
  auto& reference_histograms = AddHistogramFamily(reference, kLatency);
  auto& reference_counters = AddCounterFamily(reference, kCount);
  prometheus::Histogram* reference_histogram[] = {
      &reference_histograms.Add({{"kind", "fast"}}, bounds),
      &reference_histograms.Add({{"kind", "slow"}}, bounds)};
  prometheus::Counter* reference_counter[] = {&reference_counters.Add({{"kind", "fast"}}),
                                              &reference_counters.Add({{"kind", "slow"}})};
  // Below, on and above bounds, past the last one, and a clock that stepped back.
  const std::vector<double> seconds = {3e-6, 5e-6, 5.5e-6, 1e-5, 2e-4, 0.7, 1.0, 3.0, -1e-6};
  for (size_t i = 0; i < seconds.size(); ++i) {
    for (size_t kind = 0; kind < 2; ++kind) {
      if (kind == 1 && i % 2 == 0) continue;
      histograms.Observe(kind, seconds[i]);
      reference_histogram[kind]->Observe(seconds[i]);
      reference_counter[kind]->Increment();
    }
  }
  const std::vector<prometheus::MetricFamily> ours = histograms.Collect();
  const std::vector<prometheus::MetricFamily> theirs = reference.Collect();
  ASSERT_EQ(ours.size(), 2u);
  ASSERT_EQ(theirs.size(), 2u);
  for (const char* kind : {"fast", "slow"}) {
    SCOPED_TRACE(kind);
    const prometheus::ClientMetric& histogram = MetricOf(FamilyOf(ours, kLatency.name), kind);
    const prometheus::ClientMetric& reference_histogram_metric =
        MetricOf(FamilyOf(theirs, kLatency.name), kind);
    EXPECT_EQ(histogram.histogram.sample_count, reference_histogram_metric.histogram.sample_count);
    ASSERT_EQ(histogram.histogram.bucket.size(),
              reference_histogram_metric.histogram.bucket.size());
    for (size_t b = 0; b < histogram.histogram.bucket.size(); ++b) {
      EXPECT_EQ(histogram.histogram.bucket[b].upper_bound,
                reference_histogram_metric.histogram.bucket[b].upper_bound);
      EXPECT_EQ(histogram.histogram.bucket[b].cumulative_count,
                reference_histogram_metric.histogram.bucket[b].cumulative_count)
          << "le " << histogram.histogram.bucket[b].upper_bound;
    }
    // Theirs adds the negative time (observed as "fast" only); ours counts it as 0.
    const double negative = std::string(kind) == "fast" ? 1e-6 : 0;
    EXPECT_NEAR(histogram.histogram.sample_sum,
                reference_histogram_metric.histogram.sample_sum + negative, 1e-8);
    EXPECT_EQ(MetricOf(FamilyOf(ours, kCount.name), kind).counter.value,
              MetricOf(FamilyOf(theirs, kCount.name), kind).counter.value);
  }
  EXPECT_EQ(MetricOf(FamilyOf(ours, kCount.name), "fast").counter.value, 9);
  EXPECT_EQ(MetricOf(FamilyOf(ours, kCount.name), "slow").counter.value, 4);
}

// Scrapes while other threads observe: every scrape is a valid histogram (cumulative
// buckets, _count equal to +Inf, the counter equal to _count), and the last one has
// every observation.
TEST(LabeledHistogramsTest, ScrapesDuringObservationsAreValidAndNothingIsLost) {
  auto histograms = std::make_shared<LabeledHistograms>(
      kLatency, kCount, "kind", std::vector<std::string>{"a", "b"}, RequestLatencyBucketsSeconds());
  ScrapeRegistry registry;
  registry.AddCollector(histograms);
  constexpr int kThreads = 4;
  constexpr int kPerThread = 200000;
  std::atomic<int> running = kThreads;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&histograms, &running, t] {
      for (int i = 0; i < kPerThread; ++i) {
        histograms->Observe(static_cast<size_t>(t % 2), 1e-6 * (i % 3000));
      }
      --running;
    });
  }
  auto check = [](const std::vector<prometheus::MetricFamily>& families) {
    ASSERT_EQ(families.size(), 2u);
    for (const char* kind : {"a", "b"}) {
      const prometheus::ClientMetric& metric = MetricOf(families[1], kind);
      uint64_t previous = 0;
      for (const auto& bucket : metric.histogram.bucket) {
        EXPECT_GE(bucket.cumulative_count, previous);
        previous = bucket.cumulative_count;
      }
      EXPECT_EQ(metric.histogram.sample_count, previous);
      EXPECT_EQ(MetricOf(families[0], kind).counter.value,
                static_cast<double>(metric.histogram.sample_count));
    }
  };
  int scrapes = 0;
  do {
    check(registry.Collect());
    ++scrapes;
  } while (running > 0);
  std::printf("%d scrapes while the observers ran\n", scrapes);
  for (std::thread& thread : threads) thread.join();
  const std::vector<prometheus::MetricFamily> last = registry.Collect();
  check(last);
  for (const char* kind : {"a", "b"}) {
    EXPECT_EQ(MetricOf(last[1], kind).histogram.sample_count,
              static_cast<uint64_t>(kThreads / 2 * kPerThread));
  }
}

}  // namespace
}  // namespace kvcm
