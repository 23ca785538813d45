#pragma once

// PrometheusServer: a real Prometheus server (Debian package `prometheus`, installed by
// scripts/bootstrap.sh) that scrapes given targets, for integration tests of /metrics
// endpoints: a MetricsServer in the test process, or a running kvcm-cache-manager.
//
//   PrometheusServer::Options options;
//   options.targets = {"127.0.0.1:9400"};
//   auto prometheus = PrometheusServer::Start(options);
//   ASSERT_THAT(prometheus, IsOk());
//   EXPECT_THAT((*prometheus)->WaitForValue("kvcm_cache_capacity_blocks", 64,
//                                           absl::Seconds(30)), IsOk());
//
// It runs in a fresh temp dir (config, TSDB, log) on a free 127.0.0.1 port; destruction
// stops it (SIGTERM, then SIGKILL) and removes the dir. Waits poll with a deadline.
// Thread safety: none; one owner (start it from the test's main thread, see Subprocess).

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "nlohmann/json.hpp"
#include "tests/support/metrics_text.h"
#include "tests/support/status_matchers.h"
#include "tests/support/subprocess.h"

namespace kvcm::testing {

class PrometheusServer {
 public:
  struct Options {
    std::vector<std::string> targets;  // "HOST:PORT" each, scraped at /metrics
    // A whole configuration to run instead of the one made from `targets` (which must then
    // be empty), used as it is: its relative paths (rule files, file_sd target files)
    // resolve from its folder.
    std::string config_file;
    absl::Duration scrape_interval = absl::Seconds(1);
    absl::Duration start_timeout = absl::Seconds(60);  // until /-/ready answers 200
    std::string binary = "prometheus";                 // a path, or a name on PATH
  };

  // One series of an instant query's result.
  struct Series {
    MetricLabels labels;
    double value = 0;
  };

  // Errors: FAILED_PRECONDITION (prometheus not installed: the message says to run
  // scripts/bootstrap.sh), INVALID_ARGUMENT (no targets and no config_file, or both),
  // UNAVAILABLE (it exited or never became ready; the message carries its log), INTERNAL.
  static absl::StatusOr<std::unique_ptr<PrometheusServer>> Start(const Options& options);

  PrometheusServer(const PrometheusServer&) = delete;
  PrometheusServer& operator=(const PrometheusServer&) = delete;
  ~PrometheusServer();

  // "http://127.0.0.1:PORT".
  std::string url() const;

  // Evaluates `promql` now (GET /api/v1/query). A vector result gives one Series per
  // element; a scalar gives one Series without labels.
  // Errors: UNAVAILABLE (HTTP), INVALID_ARGUMENT (Prometheus refused the query),
  // INTERNAL (an answer that does not parse).
  absl::StatusOr<std::vector<Series>> Query(const std::string& promql) const;

  // Polls Query(promql) until `done` accepts its result, up to `timeout`.
  // Errors: DEADLINE_EXCEEDED naming the last result or error, with the log tail.
  absl::Status WaitFor(const std::string& promql,
                       const std::function<bool(const std::vector<Series>&)>& done,
                       absl::Duration timeout) const;
  // GETs `path_and_query` (e.g. "/api/v1/rules") and returns the answer's "data" member.
  // Errors: as Query.
  absl::StatusOr<nlohmann::json> GetApi(const std::string& path_and_query) const;

  // WaitFor one series whose value is `want`.
  absl::Status WaitForValue(const std::string& promql, double want, absl::Duration timeout) const;

  // The last `max_lines` lines of its log, for failure messages.
  std::string LogTail(int max_lines = 20) const;

 private:
  PrometheusServer(TempDir dir, std::unique_ptr<Subprocess> process, int port);

  TempDir dir_;
  std::unique_ptr<Subprocess> process_;  // declared after dir_: stopped before it is removed
  int port_;
};

}  // namespace kvcm::testing
