#pragma once
// Who sent a ZeroMQ message, as far as the transport can tell.
//
// Over ipc:// libzmq reads SO_PEERCRED when the connection is accepted and exposes it in
// each message's "Peer-Address" property as "localhost:uid:gid:pid". Over tcp:// the
// property is the peer's IP address and the credentials are unknown.
//
// Thread safety: plain values and a stateless parser.

#include <sys/types.h>

#include <optional>
#include <string_view>

namespace kvcm::cache_manager {

struct PeerCredentials {
  uid_t uid = 0;
  gid_t gid = 0;
  pid_t pid = 0;
};

// Parses "localhost:uid:gid:pid" (or ":uid:gid:pid"); nullopt for anything else (a tcp://
// address such as "127.0.0.1" or "::1:2:3", garbage).
std::optional<PeerCredentials> ParseIpcPeerAddress(std::string_view peer_address);

}  // namespace kvcm::cache_manager
