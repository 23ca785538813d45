#pragma once
// ProcessWatcher: the seam through which the cache manager learns that a client process
// died. The real one (PidfdWatcher, in cache_manager_server.cc) holds a pidfd per process
// in the socket thread's poller; tests use a fake and call
// CacheManagerService::OnProcessExited themselves.

#include <sys/types.h>

#include "absl/status/status.h"

namespace kvcm {

class ProcessWatcher {
 public:
  virtual ~ProcessWatcher() = default;
  // Starts watching `pid` (idempotent). When it exits, the owner of the watcher calls
  // CacheManagerService::OnProcessExited(pid). NOT_FOUND if the process is already gone.
  virtual absl::Status Watch(pid_t pid) = 0;
  // Stops watching `pid` (no-op if not watched).
  virtual void Unwatch(pid_t pid) = 0;
};

}  // namespace kvcm
