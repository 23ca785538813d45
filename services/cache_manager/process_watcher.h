#pragma once
// ProcessWatcher: the seam through which the cache manager learns that a client process
// died. The real one (PidfdWatcher, in cache_manager_server.cc) holds a pidfd per session,
// taken when its connection was accepted where the kernel can (SO_PEERPIDFD), in the
// socket thread's poller: a pid reused by another process after a client died never names
// the new one's sessions. Tests use a fake and call CacheManagerService::OnProcessExited or
// OnSessionProcessExited themselves.

#include <sys/types.h>

#include <cstdint>

#include "absl/status/status.h"

namespace kvcm::cache_manager {

class ProcessWatcher {
 public:
  virtual ~ProcessWatcher() = default;
  // Starts watching the process `pid` of `session` (idempotent per session). When it exits,
  // the owner of the watcher calls CacheManagerService::OnSessionProcessExited(session).
  virtual absl::Status Watch(uint64_t session, pid_t pid) = 0;
  // Stops watching for `session` (no-op if not watched).
  virtual void Unwatch(uint64_t session) = 0;
};

}  // namespace kvcm::cache_manager
