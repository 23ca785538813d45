#include "services/cache_manager/peer_credentials.h"

#include <charconv>
#include <cstdint>

namespace kvcm::cache_manager {
namespace {

// Reads ":<digits>" from the front of `text`.
std::optional<uint64_t> TakeField(std::string_view& text) {
  if (text.empty() || text.front() != ':') return std::nullopt;
  text.remove_prefix(1);
  uint64_t value = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (error != std::errc() || end == text.data()) return std::nullopt;
  text.remove_prefix(static_cast<size_t>(end - text.data()));
  return value;
}

}  // namespace

std::optional<PeerCredentials> ParseIpcPeerAddress(std::string_view peer_address) {
  // libzmq 4.3 writes "localhost:uid:gid:pid" for a Unix socket peer (older releases left
  // the address empty). Any other prefix is a tcp:// peer: an IPv6 address has colons and
  // must never be read as credentials.
  std::string_view rest = peer_address;
  if (rest.rfind("localhost", 0) == 0) rest.remove_prefix(sizeof("localhost") - 1);
  const auto uid = TakeField(rest);
  const auto gid = TakeField(rest);
  const auto pid = TakeField(rest);
  if (!uid || !gid || !pid || !rest.empty() || *pid == 0 || *pid > INT32_MAX || *uid > UINT32_MAX ||
      *gid > UINT32_MAX) {
    return std::nullopt;
  }
  return PeerCredentials{static_cast<uid_t>(*uid), static_cast<gid_t>(*gid),
                         static_cast<pid_t>(*pid)};
}

}  // namespace kvcm::cache_manager
