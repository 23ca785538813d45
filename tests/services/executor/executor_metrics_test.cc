// kvcm-executor's metrics: the one list is what /metrics serves, every label set is there at
// 0 from the start, updates land where they should, and promtool finds nothing to lint.

#include "services/executor/executor_metrics.h"

#include <memory>
#include <set>
#include <string>

#include "common/metrics/metrics_server.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/http_client.h"
#include "tests/support/metrics_text.h"
#include "tests/support/promtool.h"
#include "tests/support/status_matchers.h"

namespace kvcm::executor {
namespace {

using ::kvcm::testing::HttpGet;
using ::kvcm::testing::MetricLabels;
using ::kvcm::testing::MetricsText;
using ::kvcm::testing::ParseMetricsText;

class ExecutorMetricsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto server = MetricsServer::Start("127.0.0.1:0", metrics_.registry());
    ASSERT_THAT(server, IsOk());
    server_ = std::move(*server);
  }

  std::string Body() {
    auto response = HttpGet(server_->url());
    EXPECT_THAT(response, IsOk());
    return response.ok() ? response->body : "";
  }

  MetricsText Scrape() {
    auto text = ParseMetricsText(Body());
    EXPECT_THAT(text, IsOk());
    return text.ok() ? *text : MetricsText{};
  }

  static double Value(const MetricsText& text, const std::string& name,
                      const MetricLabels& labels = {}) {
    auto value = text.Value(name, labels);
    EXPECT_THAT(value, IsOk()) << name << ": " << value.status();
    return value.ok() ? *value : -1;
  }

  ExecutorMetrics metrics_{{"tiny", "bfloat16"}};
  std::unique_ptr<MetricsServer> server_;
};

TEST_F(ExecutorMetricsTest, EveryDeclaredMetricAndLabelSetIsServedAtZero) {
  const MetricsText text = Scrape();
  std::set<std::string> served;
  // The exposer adds its own exposer_* families; ours all start with kvcm_.
  for (const auto& [name, type] : text.types) {
    if (name.rfind("kvcm_", 0) == 0) served.insert(name);
  }
  for (const MetricSpec& spec : ExecutorMetrics::Specs()) {
    EXPECT_TRUE(served.contains(spec.name)) << spec.name;
    served.erase(spec.name);
  }
  EXPECT_TRUE(served.empty()) << "served but not in the list: " << *served.begin();

  EXPECT_EQ(Value(text, "kvcm_executor_info", {{"model", "tiny"}, {"weight_dtype", "bfloat16"}}),
            1);
  for (const char* phase : {"prefill", "decode"}) {
    EXPECT_EQ(Value(text, "kvcm_executor_tokens_processed_total", {{"phase", phase}}), 0);
    EXPECT_EQ(Value(text, "kvcm_executor_step_duration_seconds_count", {{"phase", phase}}), 0);
  }
  for (const char* reason :
       {"malformed", "invalid_argument", "stale_epoch", "no_pool", "internal"}) {
    EXPECT_EQ(Value(text, "kvcm_executor_step_errors_total", {{"reason", reason}}), 0);
  }
  EXPECT_EQ(Value(text, "kvcm_executor_attaches_total"), 0);
  EXPECT_EQ(Value(text, "kvcm_executor_model_loads_total"), 0);
  EXPECT_EQ(Value(text, "kvcm_executor_pool_attached"), 0);
}

TEST_F(ExecutorMetricsTest, UpdatesLandOnTheirSeries) {
  metrics_.ObserveModelLoad(0.25);
  metrics_.ObserveAttach(0.002, 4096, 17);
  metrics_.ObserveStep(/*num_seqs=*/3, /*prefill_tokens=*/33, /*decode_tokens=*/0,
                       /*sampled=*/3, 0.01);
  metrics_.ObserveStep(3, 0, 3, 3, 0.001);
  metrics_.ObserveStep(2, 0, 2, 1, 0.001);
  metrics_.CountStepError(StepError::kMalformed);
  metrics_.CountStepError(StepError::kStaleEpoch);
  MetricsText text = Scrape();
  EXPECT_EQ(Value(text, "kvcm_executor_model_loads_total"), 1);
  EXPECT_EQ(Value(text, "kvcm_executor_model_load_duration_seconds"), 0.25);
  EXPECT_EQ(Value(text, "kvcm_executor_attaches_total"), 1);
  EXPECT_EQ(Value(text, "kvcm_executor_mapped_bytes"), 4096);
  EXPECT_EQ(Value(text, "kvcm_executor_epoch"), 17);
  EXPECT_EQ(Value(text, "kvcm_executor_pool_attached"), 1);
  EXPECT_EQ(Value(text, "kvcm_executor_steps_total"), 3);
  EXPECT_EQ(Value(text, "kvcm_executor_step_duration_seconds_count", {{"phase", "prefill"}}), 1);
  EXPECT_EQ(Value(text, "kvcm_executor_step_duration_seconds_count", {{"phase", "decode"}}), 2);
  EXPECT_EQ(Value(text, "kvcm_executor_tokens_processed_total", {{"phase", "prefill"}}), 33);
  EXPECT_EQ(Value(text, "kvcm_executor_tokens_processed_total", {{"phase", "decode"}}), 5);
  EXPECT_EQ(Value(text, "kvcm_executor_tokens_sampled_total"), 7);
  EXPECT_EQ(Value(text, "kvcm_executor_batch_size_count"), 3);
  EXPECT_EQ(Value(text, "kvcm_executor_batch_size_sum"), 8);
  EXPECT_EQ(Value(text, "kvcm_executor_step_errors_total", {{"reason", "malformed"}}), 1);
  EXPECT_EQ(Value(text, "kvcm_executor_step_errors_total", {{"reason", "stale_epoch"}}), 1);

  metrics_.ObserveDetach();
  text = Scrape();
  EXPECT_EQ(Value(text, "kvcm_executor_mapped_bytes"), 0);
  EXPECT_EQ(Value(text, "kvcm_executor_pool_attached"), 0);
  EXPECT_EQ(Value(text, "kvcm_executor_attaches_total"), 1);
}

TEST_F(ExecutorMetricsTest, PromtoolFindsNothing) {
  metrics_.ObserveStep(1, 4, 0, 1, 0.01);
  auto result = kvcm::testing::PromtoolCheckMetrics(Body());
  ASSERT_THAT(result, IsOk());  // says to run scripts/bootstrap.sh
  EXPECT_EQ(result->output, "");
  EXPECT_EQ(result->exit_code, 0) << result->output;
}

}  // namespace
}  // namespace kvcm::executor
