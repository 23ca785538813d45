// The monitoring of monitoring/ against a real stack: kvcm-launch runs a cache manager, a
// router and two executors of a tiny model with --prometheus-targets; a real Prometheus
// (Debian's) runs monitoring/prometheus/prometheus.yml with its rules, only faster (1 s
// scrapes and evaluations), and finds every process through that target file. Under load
// (HTTP requests to the router that share a prefix), every panel query of every dashboard in
// monitoring/grafana/dashboards returns data through Prometheus's HTTP API, every recording
// rule produces series, and no alert fires on the healthy stack. An executor killed is seen
// down (KvcmExecutorDown pending) until it restarts, then found at its new port under the
// same instance.

#include <signal.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/support/cache_manager_process.h"
#include "tests/support/http_client.h"
#include "tests/support/prometheus_server.h"
#include "tests/support/status_matchers.h"
#include "tests/support/subprocess.h"
#include "tests/support/wait_for.h"

namespace kvcm {
namespace {

using json = nlohmann::json;
using testing::PrometheusServer;
using testing::Subprocess;
using testing::TempDir;

constexpr char kMonitoring[] = KVCM_SOURCE_DIR "/monitoring";
// What the test gives Grafana's $__rate_interval: longer than the whole load, so that the
// rates over it see all of it.
constexpr char kRateInterval[] = "1m";
constexpr int kClients = 4;
constexpr int kRequestsPerClient = 3;

std::string ReadAll(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// monitoring/prometheus/prometheus.yml with 1 s intervals instead of 15 s (and a 1 s scrape
// timeout), everything else as it is. Fails the test if a setting is not there to change.
std::string FastConfig() {
  std::string config = ReadAll(std::string(kMonitoring) + "/prometheus/prometheus.yml");
  for (const auto& [from, to] : std::vector<std::pair<std::string, std::string>>{
           {"  scrape_interval: 15s\n", "  scrape_interval: 1s\n"},
           {"  scrape_timeout: 10s\n", "  scrape_timeout: 1s\n"},
           {"  evaluation_interval: 15s\n", "  evaluation_interval: 1s\n"}}) {
    const size_t at = config.find(from);
    EXPECT_NE(at, std::string::npos) << "prometheus.yml has no \"" << from << "\"";
    if (at != std::string::npos) config.replace(at, from.size(), to);
  }
  return config;
}

// Every panel query of every dashboard: "dashboard / panel / refId" -> PromQL, with the
// Grafana variables a Prometheus does not know replaced as Grafana would.
std::map<std::string, std::string> PanelQueries() {
  std::map<std::string, std::string> queries;
  for (const auto& entry :
       std::filesystem::directory_iterator(std::string(kMonitoring) + "/grafana/dashboards")) {
    if (entry.path().extension() != ".json") continue;
    const json dashboard = json::parse(ReadAll(entry.path().string()));
    std::vector<json> panels(dashboard["panels"].begin(), dashboard["panels"].end());
    for (size_t i = 0; i < panels.size(); ++i) {
      const json panel = panels[i];  // a copy: push_back may move the elements
      for (const json& nested : panel.value("panels", json::array())) panels.push_back(nested);
      for (const json& target : panel.value("targets", json::array())) {
        const std::string expr = absl::StrReplaceAll(target["expr"].get<std::string>(),
                                                     {{"$__rate_interval", kRateInterval}});
        queries[absl::StrCat(dashboard["uid"].get<std::string>(), " / ",
                             panel["title"].get<std::string>(), " / ",
                             target["refId"].get<std::string>())] = expr;
      }
    }
  }
  return queries;
}

bool HasANumber(const std::vector<PrometheusServer::Series>& result) {
  for (const auto& series : result) {
    if (!std::isnan(series.value)) return true;
  }
  return false;
}

bool HasSeries(const std::vector<PrometheusServer::Series>& result) { return !result.empty(); }

std::string Describe(const absl::StatusOr<std::vector<PrometheusServer::Series>>& result) {
  if (!result.ok()) return result.status().ToString();
  std::vector<std::string> parts;
  for (const auto& series : *result) {
    std::vector<std::string> labels;
    for (const auto& [name, value] : series.labels) labels.push_back(name + "=" + value);
    parts.push_back(absl::StrCat("{", absl::StrJoin(labels, ","), "} ", series.value));
  }
  return parts.empty() ? "no series" : absl::StrJoin(parts, "; ");
}

class MonitoringStackTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<TempDir> dir = TempDir::Create("kvcm-monitoring-test");
    ASSERT_THAT(dir, IsOk());
    dir_ = std::make_unique<TempDir>(std::move(*dir));
    // Prometheus's folder: the configuration, its rules, and the target file's folder.
    prometheus_dir_ = dir_->path() + "/prometheus";
    std::filesystem::create_directories(prometheus_dir_ + "/targets");
    std::filesystem::copy(std::string(kMonitoring) + "/prometheus/rules",
                          prometheus_dir_ + "/rules");
    std::ofstream(prometheus_dir_ + "/prometheus.yml") << FastConfig();
    targets_path_ = prometheus_dir_ + "/targets/kvcm.json";

    model_dir_ = dir_->path() + "/tiny";
    absl::StatusOr<testing::RunResult> made = testing::RunProgram(
        {testing::KvcmBinaryPath("kvcm-make-tiny-model"), "--output", model_dir_, "--seed", "5"},
        "", absl::Seconds(60));
    ASSERT_TRUE(made.ok() && made->exit_code == 0) << (made.ok() ? made->output : "");
  }

  // The target file, as (instance -> address), with the component of each.
  std::map<std::string, std::pair<std::string, std::string>> Targets() const {
    std::map<std::string, std::pair<std::string, std::string>> targets;
    const json groups = json::parse(ReadAll(targets_path_), nullptr, false);
    if (!groups.is_array()) return targets;
    for (const json& group : groups) {
      targets[group["labels"]["instance"].get<std::string>()] = {
          group["labels"]["__kvcm_component"].get<std::string>(),
          group["targets"][0].get<std::string>()};
    }
    return targets;
  }

  std::unique_ptr<TempDir> dir_;
  std::string prometheus_dir_;
  std::string targets_path_;
  std::string model_dir_;
};

TEST_F(MonitoringStackTest, EveryPanelQueryAndRecordingRuleHasDataFromAStackUnderLoad) {
  Subprocess::Options options;
  options.argv = {testing::KvcmBinaryPath("kvcm-launch"),
                  "--model",
                  model_dir_,
                  "--executors",
                  "2",
                  "--num-blocks",
                  "256",
                  "--block-size",
                  "4",
                  "--port",
                  "0",
                  "--threads",
                  "1",
                  "--restart-backoff-ms",
                  "2000",
                  "--prometheus-targets",
                  targets_path_};
  options.output_path = dir_->path() + "/launch.log";
  options.env = {"TMPDIR=" + dir_->path()};
  absl::StatusOr<std::unique_ptr<Subprocess>> launch = Subprocess::Start(options);
  ASSERT_THAT(launch, IsOk());
  auto ready = (*launch)->WaitForLine("kvcm-launch: ready http=(\\S+) executors=2",
                                      absl::Now() + absl::Seconds(60));
  ASSERT_THAT(ready, IsOk()) << (*launch)->Output();
  const std::string url = (*ready)[1];

  // The target file lists the four processes, each under HOST:NAME.
  std::map<std::string, std::pair<std::string, std::string>> targets = Targets();
  ASSERT_EQ(targets.size(), 4u) << ReadAll(targets_path_);
  std::map<std::string, std::string> components;  // name -> component
  std::string executor1;
  for (const auto& [instance, target] : targets) {
    const std::string name = instance.substr(instance.rfind(':') + 1);
    components[name] = target.first;
    if (name == "executor-1") executor1 = instance;
  }
  EXPECT_EQ(components, (std::map<std::string, std::string>{{"cache-manager", "cache-manager"},
                                                            {"router", "router"},
                                                            {"executor-0", "executor"},
                                                            {"executor-1", "executor"}}));
  ASSERT_FALSE(executor1.empty());

  PrometheusServer::Options prometheus_options;
  prometheus_options.config_file = prometheus_dir_ + "/prometheus.yml";
  absl::StatusOr<std::unique_ptr<PrometheusServer>> prometheus =
      PrometheusServer::Start(prometheus_options);
  ASSERT_THAT(prometheus, IsOk());
  const std::string all_up = "up{job=~\"kvcm-cache-manager|kvcm-router|kvcm-executor\"} == 1";
  auto four = [](const std::vector<PrometheusServer::Series>& result) {
    return result.size() == 4;
  };
  // Every process found through the target file, in its job, and up.
  ASSERT_THAT((*prometheus)->WaitFor(all_up, four, absl::Seconds(60)), IsOk())
      << (*prometheus)->LogTail();

  // An executor killed with SIGKILL stays listed while it is dead, so Prometheus sees it
  // down (and KvcmExecutorDown pending); restarted on another port, the file follows it
  // and its series goes on under the same instance. The launcher is stopped (SIGSTOP)
  // until Prometheus has seen it down: its restart must not come first, however long a
  // loaded machine takes to scrape and evaluate (docs/RELIABILITY.md, "Timing in tests";
  // the alert waits 1 minute before it fires).
  const std::string old_address = targets[executor1].second;
  std::smatch pid;
  const std::string output = (*launch)->Output();
  ASSERT_TRUE(std::regex_search(output, pid, std::regex("started executor-1 \\(pid ([0-9]+)\\)")));
  ASSERT_THAT((*launch)->Signal(SIGSTOP), IsOk());
  ASSERT_EQ(::kill(std::stoi(pid[1]), SIGKILL), 0);
  const std::string selector = absl::StrCat("{instance=\"", executor1, "\"}");
  EXPECT_THAT((*prometheus)->WaitForValue("up" + selector, 0, absl::Seconds(60)), IsOk());
  EXPECT_TRUE(
      (*prometheus)
          ->WaitForValue(absl::StrCat("count(ALERTS{alertname=\"KvcmExecutorDown\",",
                                      "alertstate=\"pending\",instance=\"", executor1, "\"})"),
                         1, absl::Seconds(50))
          .ok());
  ASSERT_THAT((*launch)->Signal(SIGCONT), IsOk());
  const absl::Status moved =
      testing::WaitFor([&] { return Targets()[executor1].second != old_address; },
                       absl::Seconds(60), "executor-1 in the target file at its new port");
  ASSERT_THAT(moved, IsOk()) << "\n" << (*launch)->Output();
  targets = Targets();
  EXPECT_EQ(targets.size(), 4u);
  ASSERT_THAT((*prometheus)->WaitFor(all_up, four, absl::Seconds(60)), IsOk());
  absl::StatusOr<json> active = (*prometheus)->GetApi("/api/v1/targets?state=active");
  ASSERT_THAT(active, IsOk());
  std::map<std::string, std::string> jobs;  // instance -> job
  for (const json& target : (*active)["activeTargets"]) {
    jobs[target["labels"]["instance"]] = target["labels"]["job"];
    if (target["labels"]["instance"] == executor1) {
      EXPECT_EQ(target["scrapeUrl"], "http://" + targets[executor1].second + "/metrics");
    }
    EXPECT_FALSE(target["labels"].contains("__kvcm_component"));
  }
  EXPECT_EQ(jobs.size(), 4u);
  EXPECT_EQ(jobs[executor1], "kvcm-executor");

  // Load: concurrent clients whose prompts share a prefix (prefix-cache hits), through both
  // APIs.
  std::vector<std::thread> clients;
  std::atomic<int> ok{0};
  for (int c = 0; c < kClients; ++c) {
    clients.emplace_back([&, c] {
      for (int r = 0; r < kRequestsPerClient; ++r) {
        const std::string prompt = absl::StrCat(
            "Monitoring shares this prefix across every request; client ", c, " request ", r);
        const bool openai = (c + r) % 2 == 1;
        const json body = openai
                              ? json{{"model", "tiny"}, {"prompt", prompt}, {"max_tokens", 8}}
                              : json{{"inputs", prompt}, {"parameters", {{"max_new_tokens", 8}}}};
        absl::StatusOr<testing::HttpResponse> reply = testing::HttpPost(
            url + (openai ? "/v1/completions" : "/generate"), body.dump(), absl::Seconds(60));
        if (reply.ok() && reply->status == 200) ++ok;
      }
    });
  }
  for (std::thread& client : clients) client.join();
  ASSERT_EQ(ok.load(), kClients * kRequestsPerClient) << (*launch)->Output();
  // Prometheus has scraped the router after the last request.
  ASSERT_TRUE((*prometheus)
                  ->WaitForValue("sum(kvcm_router_requests_total{outcome=\"ok\"})",
                                 kClients * kRequestsPerClient, absl::Seconds(60))
                  .ok());

  // Every panel query returns series, and at least one is a number (not NaN: a ratio or a
  // quantile with nothing under it). This stack runs without tiers, so nothing is loaded
  // from one: the tier load-time quantiles have their series (every tier's buckets are
  // exported at 0), but only NaN in them.
  const std::set<std::string> no_number_without_tiers = {"kvcm-cache / Tier load time / A",
                                                         "kvcm-cache / Tier load time / B"};
  const std::map<std::string, std::string> queries = PanelQueries();
  ASSERT_GE(queries.size(), 30u);
  for (const auto& [panel, expr] : queries) {
    EXPECT_EQ(expr.find('$'), std::string::npos) << panel << ": a variable left in " << expr;
    const bool number = !no_number_without_tiers.contains(panel);
    absl::Status has_data =
        (*prometheus)->WaitFor(expr, number ? HasANumber : HasSeries, absl::Seconds(30));
    EXPECT_THAT(has_data, IsOk()) << panel << ": " << has_data;
  }

  // Every recording rule is evaluated without error and produces series with a number.
  absl::StatusOr<json> rules = (*prometheus)->GetApi("/api/v1/rules");
  ASSERT_THAT(rules, IsOk());
  int recording = 0;
  int alerting = 0;
  for (const json& group : (*rules)["groups"]) {
    for (const json& rule : group["rules"]) {
      if (rule["type"] == "alerting") {
        ++alerting;
        continue;
      }
      ++recording;
      const std::string name = rule["name"];
      EXPECT_EQ(rule.value("lastError", ""), "") << name;
      absl::Status has_data = (*prometheus)->WaitFor(name, HasANumber, absl::Seconds(30));
      EXPECT_THAT(has_data, IsOk()) << name << ": " << has_data;
    }
  }
  EXPECT_GE(recording, 20);
  EXPECT_GE(alerting, 9);

  // A healthy stack fires nothing (every alert has a case that fires in
  // monitoring/prometheus/tests/).
  absl::StatusOr<std::vector<PrometheusServer::Series>> firing =
      (*prometheus)->Query("ALERTS{alertstate=\"firing\"}");
  ASSERT_THAT(firing, IsOk());
  EXPECT_TRUE(firing->empty()) << Describe(firing);

  // At SIGTERM the launcher empties the target file: a stopped server is not down.
  ASSERT_THAT((*launch)->Signal(SIGTERM), IsOk());
  absl::StatusOr<int> code = (*launch)->Wait(absl::Seconds(60));
  ASSERT_THAT(code, IsOk()) << (*launch)->Output();
  EXPECT_EQ(*code, 0);
  EXPECT_EQ(json::parse(ReadAll(targets_path_)), json::array());
}

TEST_F(MonitoringStackTest, ATargetFileThatCannotBeWrittenFailsTheLaunchBeforeAnythingStarts) {
  absl::StatusOr<testing::RunResult> run =
      testing::RunProgram({testing::KvcmBinaryPath("kvcm-launch"), "--model", model_dir_,
                           "--prometheus-targets", dir_->path() + "/no-such-folder/kvcm.json"},
                          "", absl::Seconds(30));
  ASSERT_THAT(run, IsOk());
  EXPECT_EQ(run->exit_code, 1);
  EXPECT_THAT(run->output, ::testing::HasSubstr("--prometheus-targets: create "));
  EXPECT_THAT(run->output, ::testing::Not(::testing::HasSubstr("started")));
}

}  // namespace
}  // namespace kvcm
