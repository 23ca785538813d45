#pragma once

// MetricsServer: serves one prometheus::Registry as Prometheus text at
// http://HOST:PORT/metrics (prometheus-cpp's Exposer, i.e. civetweb, on its own threads).
// Every kvcm process owns one, started from main.cc with its `--metrics_address` flag.
//
//   KVCM_ASSIGN_OR_RETURN(auto server, MetricsServer::Start("127.0.0.1:9400", registry));
//   LOG << "metrics at " << server->url();
//
// Thread safety: the accessors are const and safe from any thread. The registry is
// collected on the server's threads at each scrape, so whatever it holds must be safe
// against concurrent updates (prometheus-cpp's own metrics are; scrape-time collectors
// must lock, see ScrapeRegistry). The server stops, and joins its threads, on destruction.

#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace prometheus {
class Exposer;
class Registry;
}  // namespace prometheus

namespace kvcm {

class MetricsServer {
 public:
  // Listens on `address`, "HOST:PORT": HOST is an IPv4 literal or "localhost" (127.0.0.1;
  // 0.0.0.0 = every interface); PORT is 0..65535, 0 = let the kernel pick one (read it
  // back with port()). Not IPv6: Debian 12's civetweb, under prometheus-cpp, lacks it.
  // Serves `registry` at /metrics and keeps it alive.
  // REQUIRES: registry != nullptr.
  // Errors: INVALID_ARGUMENT (address does not parse or is IPv6, port out of range, HOST not an
  // address of this machine), UNAVAILABLE (address already in use), PERMISSION_DENIED
  // (privileged port), INTERNAL (any other failure to listen). Messages name the address.
  static absl::StatusOr<std::unique_ptr<MetricsServer>> Start(
      const std::string& address, std::shared_ptr<prometheus::Registry> registry);

  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;
  ~MetricsServer();

  // The port listened on (the picked one when started with port 0).
  int port() const { return port_; }
  // Where to scrape, e.g. "http://127.0.0.1:9400/metrics". The wildcard host 0.0.0.0 is
  // reported as 127.0.0.1, so the URL works from here.
  std::string url() const;

 private:
  MetricsServer(std::string host, int port, std::unique_ptr<prometheus::Exposer> exposer,
                std::shared_ptr<prometheus::Registry> registry);

  std::string host_;  // IPv4 literal
  int port_;
  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<prometheus::Exposer> exposer_;  // declared last: stopped first
};

}  // namespace kvcm
