#include "common/metrics/metrics_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <exception>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/base/check.h"
#include "prometheus/exposer.h"
#include "prometheus/registry.h"

namespace kvcm {
namespace {

constexpr int kServerThreads = 2;  // scrapes are rare; one spare for a slow client

struct ParsedAddress {
  std::string host;  // IPv4 literal ("localhost" resolved)
  int port = 0;
  sockaddr_in sockaddr{};  // host and port, for diagnosing a failed listen
};

absl::Status BadAddress(const std::string& address, const std::string& why) {
  return absl::InvalidArgumentError(
      absl::StrCat("metrics address \"", address, "\" ", why,
                   " (want IPv4-HOST:PORT, e.g. 127.0.0.1:9400 or 0.0.0.0:0)"));
}

absl::StatusOr<ParsedAddress> ParseAddress(const std::string& address) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos) return BadAddress(address, "has no port");
  const std::string host = address.substr(0, colon);
  const std::string port = address.substr(colon + 1);

  ParsedAddress parsed;
  if (port.empty() || port.size() > 5 ||
      !std::all_of(port.begin(), port.end(), [](char c) { return absl::ascii_isdigit(c); })) {
    return BadAddress(address, "has a port that is not a number");
  }
  parsed.port = std::stoi(port);
  if (parsed.port > 65535) return BadAddress(address, "has a port above 65535");

  if (host.empty()) return BadAddress(address, "has no host (0.0.0.0 listens everywhere)");
  if (host.front() == '[') {
    // Debian 12's civetweb (under prometheus-cpp) is built without IPv6.
    return BadAddress(address, "is IPv6, which this build cannot listen on");
  }
  parsed.host = host == "localhost" ? "127.0.0.1" : host;
  parsed.sockaddr.sin_family = AF_INET;
  parsed.sockaddr.sin_port = htons(static_cast<uint16_t>(parsed.port));
  if (inet_pton(AF_INET, parsed.host.c_str(), &parsed.sockaddr.sin_addr) != 1) {
    return BadAddress(address, "has a host that is not an IPv4 address or localhost");
  }
  return parsed;
}

// civetweb reports a failed listen only as an exception without the cause; binding the same
// address ourselves recovers errno for a message that says what to do.
absl::Status DiagnoseListenFailure(const std::string& address, const ParsedAddress& parsed,
                                   const std::string& what) {
  int error = 0;
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    error = errno;
  } else {
    const int one = 1;  // as civetweb: a socket in TIME_WAIT does not count as in use
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, reinterpret_cast<const sockaddr*>(&parsed.sockaddr), sizeof(parsed.sockaddr)) !=
        0) {
      error = errno;
    }
    close(fd);
  }
  const std::string prefix = absl::StrCat("metrics address ", address);
  switch (error) {
    case EADDRINUSE:
      return absl::UnavailableError(absl::StrCat(prefix, " is already in use"));
    case EACCES:
      return absl::PermissionDeniedError(
          absl::StrCat(prefix, ": no permission to listen on port ", parsed.port));
    case EADDRNOTAVAIL:
      return absl::InvalidArgumentError(
          absl::StrCat(prefix, ": ", parsed.host, " is not an address of this machine"));
    case 0:
      return absl::InternalError(absl::StrCat(prefix, ": cannot listen: ", what));
    default:
      return absl::InternalError(
          absl::StrCat(prefix, ": cannot listen: ", std::string(std::strerror(error))));
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(
    const std::string& address, std::shared_ptr<prometheus::Registry> registry) {
  KVCM_CHECK(registry != nullptr);
  absl::StatusOr<ParsedAddress> parsed = ParseAddress(address);
  if (!parsed.ok()) return parsed.status();

  std::unique_ptr<prometheus::Exposer> exposer;
  try {
    exposer = std::make_unique<prometheus::Exposer>(absl::StrCat(parsed->host, ":", parsed->port),
                                                    kServerThreads);
  } catch (const std::exception& e) {
    return DiagnoseListenFailure(address, *parsed, e.what());
  }
  const std::vector<int> ports = exposer->GetListeningPorts();
  if (ports.size() != 1 || ports[0] <= 0) {
    return absl::InternalError(
        absl::StrCat("metrics address ", address, ": listening, but on no single port"));
  }
  exposer->RegisterCollectable(registry);
  return std::unique_ptr<MetricsServer>(
      new MetricsServer(parsed->host, ports[0], std::move(exposer), std::move(registry)));
}

MetricsServer::MetricsServer(std::string host, int port,
                             std::unique_ptr<prometheus::Exposer> exposer,
                             std::shared_ptr<prometheus::Registry> registry)
    : host_(std::move(host)),
      port_(port),
      registry_(std::move(registry)),
      exposer_(std::move(exposer)) {}

// civetweb's mg_stop (in ~Exposer) joins its accept loop, which polls the listening socket
// with a 2 s timeout; stopping would take up to 2 s. Connecting to the port wakes the poll,
// so the loop sees the stop flag at once: shutdown takes milliseconds.
MetricsServer::~MetricsServer() {
  // host_ and port_ parsed before; a wildcard address is reached through loopback.
  ParsedAddress target = *ParseAddress(absl::StrCat(host_, ":", port_));
  if (target.sockaddr.sin_addr.s_addr == htonl(INADDR_ANY)) {
    target.sockaddr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  }
  std::atomic<bool> stopped{false};
  std::thread waker([&target, &stopped] {
    while (!stopped.load()) {
      const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
      if (fd >= 0) {
        connect(fd, reinterpret_cast<const sockaddr*>(&target.sockaddr), sizeof(target.sockaddr));
        close(fd);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  });
  exposer_.reset();
  stopped.store(true);
  waker.join();
}

std::string MetricsServer::url() const {
  std::string host = host_;
  if (host == "0.0.0.0") host = "127.0.0.1";
  return absl::StrCat("http://", host, ":", port_, "/metrics");
}

}  // namespace kvcm
