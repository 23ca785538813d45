#pragma once
// Checking a tcp:// endpoint given on a command line before anything binds it
// (docs/operations.md, "TCP").
//
// libzmq accepts much that is not meant: "tcp://127.0.0.1:99999" binds port 99999 mod 65536
// without a word, a host name is resolved at bind time, and "tcp://garbage" fails with a
// bare "Invalid argument". CheckTcpEndpoint refuses all of that with a message naming the
// flag, and refuses non-loopback addresses unless the operator asked for them: over TCP no
// peer credentials exist, and a port on every interface is reachable by the whole network.
//
// Thread safety: stateless.

#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace kvcm {

struct TcpEndpoint {
  std::string host;  // an IPv4 or bracketless IPv6 literal
  int32_t port = 0;  // 1..65535, or 0: any free port (bound as "*")
  bool loopback = false;
  // What to hand zmq_bind: "tcp://HOST:PORT", "tcp://[V6]:PORT", port 0 as "*".
  std::string BindEndpoint() const;
};

// Parses "tcp://HOST:PORT" (HOST an IPv4 literal, "[IPv6]", or "localhost" for 127.0.0.1).
// INVALID_ARGUMENT naming `flag` for anything else, for a port outside 0..65535, and for a
// non-loopback host unless `allow_remote`.
absl::StatusOr<TcpEndpoint> CheckTcpEndpoint(std::string_view endpoint, std::string_view flag,
                                             bool allow_remote);

}  // namespace kvcm
