#ifndef KVCM_SERVICES_CACHE_MANAGER_SEEN_CONNECTIONS_H_
#define KVCM_SERVICES_CACHE_MANAGER_SEEN_CONNECTIONS_H_

// SeenConnections: the request socket's connections whose acceptance the server has already
// read from the socket's monitor, so that it reads the monitor only for a request that may
// come from a connection accepted since (docs/architecture.md, "Identity": a client's pidfd is
// taken when its connection is accepted, before its first request is handled).
//
// A connection is named by its descriptor and the routing id ROUTER gave it. ROUTER
// generates a new routing id for every connection, so a descriptor reused for a new
// connection is told apart from the old one even before the monitor has said so. Only a
// client that sets the same ZMQ_ROUTING_ID on a new connection that lands on the same
// descriptor can pass as seen; its Hello then opens the pidfd by pid, as on kernels
// without SO_PEERPIDFD.
//
//   if (!seen.Contains(fd, routing_id)) { DrainMonitor(); seen.Remember(fd, routing_id); }
//   ... the monitor says fd was accepted or closed: seen.Forget(fd);

#include <cstddef>
#include <string>
#include <string_view>

#include "absl/container/flat_hash_map.h"

namespace kvcm::cache_manager {

class SeenConnections {
 public:
  // Whether `fd` (-1: unknown, never seen) was last remembered with `routing_id`.
  bool Contains(int fd, std::string_view routing_id) const {
    if (fd < 0) return false;
    const auto it = ids_.find(fd);
    return it != ids_.end() && it->second == routing_id;
  }
  // After the monitor has been read: the connection on `fd` is seen.
  void Remember(int fd, std::string_view routing_id) {
    if (fd >= 0) ids_.insert_or_assign(fd, std::string(routing_id));
  }
  // The monitor told `fd` accepted anew or closed.
  void Forget(int fd) { ids_.erase(fd); }
  size_t size() const { return ids_.size(); }

 private:
  absl::flat_hash_map<int, std::string> ids_;  // by descriptor: its connection's routing id
};

}  // namespace kvcm::cache_manager

#endif  // KVCM_SERVICES_CACHE_MANAGER_SEEN_CONNECTIONS_H_
