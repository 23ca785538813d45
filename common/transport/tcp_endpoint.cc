#include "common/transport/tcp_endpoint.h"

#include <arpa/inet.h>
#include <netinet/in.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"

namespace kvcm {

std::string TcpEndpoint::BindEndpoint() const {
  const std::string port_text = port == 0 ? "*" : absl::StrCat(port);
  if (host.find(':') != std::string::npos) return absl::StrCat("tcp://[", host, "]:", port_text);
  return absl::StrCat("tcp://", host, ":", port_text);
}

absl::StatusOr<TcpEndpoint> CheckTcpEndpoint(std::string_view endpoint_view,
                                             std::string_view flag_view, bool allow_remote) {
  const std::string endpoint(endpoint_view);
  const std::string flag(flag_view);
  auto bad = [&](const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat(
        flag, " ", endpoint, ": ", why, " (expected tcp://HOST:PORT, e.g. tcp://127.0.0.1:5557)"));
  };
  absl::string_view rest = endpoint;
  if (!absl::ConsumePrefix(&rest, "tcp://")) return bad("not a tcp:// endpoint");
  const size_t colon = rest.rfind(':');
  if (colon == absl::string_view::npos) return bad("no port");
  absl::string_view host = rest.substr(0, colon);
  const absl::string_view port_text = rest.substr(colon + 1);
  TcpEndpoint out;
  int64_t port = -1;
  if (port_text == "*") {
    port = 0;
  } else if (port_text.empty() || !absl::SimpleAtoi(port_text, &port)) {
    return bad(absl::StrCat("port \"", port_text, "\" is not a number"));
  }
  if (port < 0 || port > 65535) {
    return bad(absl::StrCat("port ", port, " is outside 1-65535 (0 or * picks a free one)"));
  }
  out.port = static_cast<int32_t>(port);
  if (host == "localhost") host = "127.0.0.1";
  const bool bracketed = absl::ConsumePrefix(&host, "[") && absl::ConsumeSuffix(&host, "]");
  out.host = std::string(host);
  in_addr v4{};
  in6_addr v6{};
  if (!bracketed && ::inet_pton(AF_INET, out.host.c_str(), &v4) == 1) {
    out.loopback = (ntohl(v4.s_addr) >> 24) == 127;
  } else if (bracketed && ::inet_pton(AF_INET6, out.host.c_str(), &v6) == 1) {
    out.loopback = IN6_IS_ADDR_LOOPBACK(&v6);
  } else {
    return bad(
        absl::StrCat("host \"", host, "\" is not an IP address (IPv4, [IPv6], or localhost)"));
  }
  if (!out.loopback && !allow_remote) {
    return absl::InvalidArgumentError(absl::StrCat(
        flag, " ", endpoint, ": ", out.host,
        " is not a loopback address; peers over TCP carry no credentials, so other machines "
        "are refused unless you also pass --tcp-allow-remote"));
  }
  return out;
}

}  // namespace kvcm
