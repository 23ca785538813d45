#include "tests/support/prometheus_server.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "nlohmann/json.hpp"
#include "tests/support/http_client.h"
#include "tests/support/wait_for.h"

namespace kvcm::testing {
namespace {

constexpr absl::Duration kStopGrace = absl::Seconds(10);
constexpr int kStartAttempts = 3;  // the free port may be taken before Prometheus binds it

// A port that was free a moment ago (the kernel's pick for port 0).
absl::StatusOr<int> PickFreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError("socket");
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof(address);
  const bool ok = bind(fd, reinterpret_cast<const sockaddr*>(&address), sizeof(address)) == 0 &&
                  getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) == 0;
  close(fd);
  if (!ok) return absl::InternalError("cannot pick a free port");
  return ntohs(address.sin_port);
}

std::string Config(const PrometheusServer::Options& options) {
  const std::string interval =
      absl::StrCat(absl::ToInt64Milliseconds(options.scrape_interval), "ms");
  std::vector<std::string> quoted;
  for (const std::string& target : options.targets) quoted.push_back("\"" + target + "\"");
  return absl::StrCat("global:\n  scrape_interval: ", interval, "\n  scrape_timeout: ", interval,
                      "\n  evaluation_interval: ", interval,
                      "\nscrape_configs:\n  - job_name: kvcm\n    static_configs:\n"
                      "      - targets: [",
                      absl::StrJoin(quoted, ", "), "]\n");
}

std::string Describe(const std::vector<PrometheusServer::Series>& result) {
  if (result.empty()) return "empty result";
  std::vector<std::string> parts;
  for (const auto& series : result) {
    std::vector<std::string> labels;
    for (const auto& [name, value] : series.labels) labels.push_back(name + "=" + value);
    parts.push_back(absl::StrCat("{", absl::StrJoin(labels, ","), "} ", series.value));
  }
  return absl::StrJoin(parts, "; ");
}

absl::StatusOr<double> ParseSampleValue(const nlohmann::json& pair) {
  // [unix_time, "value"]
  if (!pair.is_array() || pair.size() != 2 || !pair[1].is_string()) {
    return absl::InternalError(absl::StrCat("bad sample ", pair.dump()));
  }
  const std::string text = pair[1].get<std::string>();
  char* end = nullptr;
  const double value = std::strtod(text.c_str(), &end);
  if (text.empty() || end != text.c_str() + text.size()) {
    return absl::InternalError(absl::StrCat("bad sample value ", text));
  }
  return value;
}

}  // namespace

absl::StatusOr<std::unique_ptr<PrometheusServer>> PrometheusServer::Start(const Options& options) {
  if (options.targets.empty() == options.config_file.empty()) {
    return absl::InvalidArgumentError("give either scrape targets or a config file");
  }
  absl::StatusOr<std::string> binary = FindProgram(options.binary);
  if (!binary.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat(binary.status().message(),
                     ": install the Debian package `prometheus` (run scripts/bootstrap.sh)"));
  }
  absl::StatusOr<TempDir> dir = TempDir::Create("kvcm-prometheus");
  if (!dir.ok()) return dir.status();
  std::string config_path = options.config_file;
  if (config_path.empty()) {
    config_path = dir->path() + "/prometheus.yml";
    std::ofstream config(config_path);
    config << Config(options);
    if (!config) return absl::InternalError(absl::StrCat("cannot write ", config_path));
  }
  const std::string log_path = dir->path() + "/prometheus.log";

  std::string last_log;
  for (int attempt = 0; attempt < kStartAttempts; ++attempt) {
    absl::StatusOr<int> port = PickFreePort();
    if (!port.ok()) return port.status();
    Subprocess::Options process_options;
    process_options.argv = {
        *binary, "--config.file=" + config_path, "--storage.tsdb.path=" + dir->path() + "/data",
        absl::StrCat("--web.listen-address=127.0.0.1:", *port), "--log.level=warn"};
    process_options.output_path = log_path;
    absl::StatusOr<std::unique_ptr<Subprocess>> process = Subprocess::Start(process_options);
    if (!process.ok()) return process.status();
    const std::string ready_url = absl::StrCat("http://127.0.0.1:", *port, "/-/ready");
    bool ready = false;
    (void)::kvcm::testing::WaitFor(
        [&] {
          if ((*process)->Poll().has_value()) return true;
          absl::StatusOr<HttpResponse> reply = HttpGet(ready_url, absl::Seconds(2));
          ready = reply.ok() && reply->status == 200;
          return ready;
        },
        options.start_timeout, "prometheus to be ready");
    if (ready) {
      return std::unique_ptr<PrometheusServer>(
          new PrometheusServer(std::move(*dir), std::move(*process), *port));
    }
    const std::optional<int> exit_code = (*process)->Poll();
    (*process)->Stop(kStopGrace);
    last_log = ReadFileOrEmpty(log_path);
    if (!exit_code.has_value()) {
      return absl::UnavailableError(absl::StrCat("prometheus not ready after ",
                                                 absl::FormatDuration(options.start_timeout),
                                                 "; log:\n", last_log));
    }
    if (last_log.find("address already in use") == std::string::npos) break;
  }
  return absl::UnavailableError(absl::StrCat("prometheus exited at start; log:\n", last_log));
}

PrometheusServer::PrometheusServer(TempDir dir, std::unique_ptr<Subprocess> process, int port)
    : dir_(std::move(dir)), process_(std::move(process)), port_(port) {}

PrometheusServer::~PrometheusServer() { process_->Stop(kStopGrace); }

std::string PrometheusServer::url() const { return absl::StrCat("http://127.0.0.1:", port_); }

absl::StatusOr<nlohmann::json> PrometheusServer::GetApi(const std::string& path_and_query) const {
  absl::StatusOr<HttpResponse> response = HttpGet(url() + path_and_query);
  if (!response.ok()) return response.status();
  nlohmann::json answer = nlohmann::json::parse(response->body, nullptr, false);
  if (answer.is_discarded() || !answer.is_object()) {
    return absl::InternalError(absl::StrCat(path_and_query, ": HTTP ", response->status,
                                            ", not JSON: ", response->body.substr(0, 200)));
  }
  if (answer.value("status", "") != "success") {
    return absl::InvalidArgumentError(absl::StrCat(path_and_query, ": ", answer.dump()));
  }
  return std::move(answer["data"]);
}

absl::StatusOr<std::vector<PrometheusServer::Series>> PrometheusServer::Query(
    const std::string& promql) const {
  absl::StatusOr<nlohmann::json> answer =
      GetApi(absl::StrCat("/api/v1/query?query=", UrlEncode(promql)));
  if (!answer.ok()) {
    return absl::Status(answer.status().code(),
                        absl::StrCat("query ", promql, ": ", answer.status().message()));
  }
  const nlohmann::json& data = *answer;
  const std::string type = data.value("resultType", "");
  std::vector<Series> result;
  if (type == "scalar") {
    absl::StatusOr<double> value = ParseSampleValue(data["result"]);
    if (!value.ok()) return value.status();
    result.push_back({{}, *value});
  } else if (type == "vector") {
    for (const nlohmann::json& element : data["result"]) {
      Series series;
      for (const auto& [name, value] : element["metric"].items()) {
        series.labels[name] = value.get<std::string>();
      }
      absl::StatusOr<double> value = ParseSampleValue(element["value"]);
      if (!value.ok()) return value.status();
      series.value = *value;
      result.push_back(std::move(series));
    }
  } else {
    return absl::InternalError(absl::StrCat("query ", promql, ": result type ", type));
  }
  return result;
}

absl::Status PrometheusServer::WaitFor(const std::string& promql,
                                       const std::function<bool(const std::vector<Series>&)>& done,
                                       absl::Duration timeout) const {
  std::string last;
  const absl::Status waited = ::kvcm::testing::WaitFor(
      [&] {
        absl::StatusOr<std::vector<Series>> result = Query(promql);
        if (result.ok() && done(*result)) return true;
        last = result.ok() ? Describe(*result) : result.status().ToString();
        return false;
      },
      timeout);
  if (waited.ok()) return absl::OkStatus();
  return absl::DeadlineExceededError(absl::StrCat("query ", promql, " after ",
                                                  absl::FormatDuration(timeout), ": ", last,
                                                  "\nprometheus log:\n", LogTail()));
}

absl::Status PrometheusServer::WaitForValue(const std::string& promql, double want,
                                            absl::Duration timeout) const {
  return WaitFor(
      promql,
      [want](const std::vector<Series>& result) {
        return result.size() == 1 && result[0].value == want;
      },
      timeout);
}

std::string PrometheusServer::LogTail(int max_lines) const {
  std::vector<std::string> lines =
      absl::StrSplit(ReadFileOrEmpty(dir_.path() + "/prometheus.log"), '\n', absl::SkipEmpty());
  if (static_cast<int>(lines.size()) > max_lines) {
    lines.erase(lines.begin(), lines.end() - max_lines);
  }
  return absl::StrJoin(lines, "\n");
}

}  // namespace kvcm::testing
