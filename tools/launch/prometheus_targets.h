#pragma once
// The Prometheus target file kvcm-launch keeps with --prometheus-targets FILE: every process
// it runs, in the JSON of Prometheus's file-based service discovery (file_sd_configs), as
// monitoring/prometheus/prometheus.yml reads it (docs/operations.md, "Monitoring").
//
//   [{"targets": ["127.0.0.1:41234"],
//     "labels": {"__kvcm_component": "executor", "instance": "node1:executor-0"}}, ...]
//
// __kvcm_component (cache-manager, router, executor) picks the scrape job and is dropped by
// Prometheus after relabelling; `instance` is HOST:NAME, not the address, so a process that
// restarts on a new port (each picks a free one) keeps its series, and the alerts that
// compare a series with its own past (a cache-manager restart) see one series.
//
// The launcher rewrites the file, whole and atomically (a temp file beside it, then
// rename(2)), when it starts (no targets yet), whenever a process reports its metrics
// address (at each start or restart), and when it stops (no targets: a stopped server is
// not "down"). A process that died stays listed at its last address until it reports a
// new one, so Prometheus sees it down (up == 0) meanwhile.
//
// Thread safety: plain values and functions.

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"

namespace kvcm::launch {

// One process to scrape.
struct ScrapeTarget {
  std::string component;  // "cache-manager", "router" or "executor"
  std::string name;       // the process's name: "cache-manager", "executor-0"
  std::string address;    // "HOST:PORT"
  std::string metrics_path = "/metrics";
};

// The file's JSON, targets in the order given (one group each); `host` names this node in
// each `instance` label. A non-default metrics path is given as __metrics_path__.
std::string RenderPrometheusTargets(const std::vector<ScrapeTarget>& targets,
                                    std::string_view host);

// Where a process's "ready" log line says its metrics are: the line holds ": ready " and,
// after it, " metrics=http://HOST:PORT/PATH". The wildcard host 0.0.0.0 becomes 127.0.0.1
// (scraped from this node). nullopt for any other line or a URL that does not parse.
struct MetricsEndpoint {
  std::string address;  // "HOST:PORT"
  std::string path;     // "/metrics"
};
std::optional<MetricsEndpoint> MetricsEndpointFromReadyLine(std::string_view line);

}  // namespace kvcm::launch
