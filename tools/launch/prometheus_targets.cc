#include "tools/launch/prometheus_targets.h"

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace kvcm::launch {

std::string RenderPrometheusTargets(const std::vector<ScrapeTarget>& targets,
                                    std::string_view host) {
  nlohmann::json groups = nlohmann::json::array();
  for (const ScrapeTarget& target : targets) {
    nlohmann::json labels = {{"__kvcm_component", target.component},
                             {"instance", absl::StrCat(std::string(host), ":", target.name)}};
    if (target.metrics_path != "/metrics") labels["__metrics_path__"] = target.metrics_path;
    groups.push_back({{"targets", {target.address}}, {"labels", labels}});
  }
  return groups.dump(2) + "\n";
}

std::optional<MetricsEndpoint> MetricsEndpointFromReadyLine(std::string_view line) {
  const size_t ready = line.find(": ready ");
  if (ready == std::string_view::npos) return std::nullopt;
  constexpr std::string_view kKey = " metrics=http://";
  const size_t key = line.find(kKey, ready);
  if (key == std::string_view::npos) return std::nullopt;
  std::string_view url = line.substr(key + kKey.size());
  url = url.substr(0, url.find(' '));
  const size_t slash = url.find('/');
  std::string_view host_port = url.substr(0, slash);
  const std::string_view path = slash == std::string_view::npos ? "/" : url.substr(slash);
  const size_t colon = host_port.rfind(':');
  int port = 0;
  if (colon == std::string_view::npos || colon == 0 ||
      !absl::SimpleAtoi(std::string(host_port.substr(colon + 1)), &port) || port <= 0 ||
      port > 65535) {
    return std::nullopt;
  }
  std::string_view host = host_port.substr(0, colon);
  if (host == "0.0.0.0") host = "127.0.0.1";
  return MetricsEndpoint{absl::StrCat(std::string(host), ":", port), std::string(path)};
}

}  // namespace kvcm::launch
