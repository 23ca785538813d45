#pragma once
// The run directory the cache manager's sockets live in (docs/architecture.md), as every process
// that looks for them names it: the cache manager (services/cache_manager/run_directory.h),
// the executor, the router and kvcmctl.

#include <sys/types.h>
#include <unistd.h>

#include <cstdlib>
#include <string>
#include <string_view>

namespace kvcm {

// File names inside the run directory.
inline constexpr char kCacheManagerSocket[] = "cache-manager.sock";  // requests (ROUTER)
inline constexpr char kEventSocket[] = "events.sock";                // KV events (PUB)
inline constexpr char kFdChannelSocket[] = "pool-fd.sock";           // the shm pool's memfd
inline constexpr char kCacheManagerLockFile[] = "cache-manager.lock";
// The router's socket for its executors (it binds it, executors connect).
inline constexpr char kRouterExecutorsSocket[] = "router-executors.sock";
// With --tcp-address: the secret a Router or Executor gives in Hello over tcp:// (mode 0600).
inline constexpr char kTcpSecretFile[] = "tcp-secret";
// With --kv-events-endpoint: the vLLM-format stream's sequence numbers reserved so far, so
// that a restart goes on above them (services/cache_manager/vllm_event_publisher.h). Kept
// across restarts, like the directory.
inline constexpr char kVllmEventsSeqFile[] = "vllm-events.seq";

// $XDG_RUNTIME_DIR/kvcm when that is an absolute path, else /tmp/kvcm-<euid>.
inline std::string DefaultRunDir(const char* xdg_runtime_dir, uid_t euid) {
  if (xdg_runtime_dir != nullptr && xdg_runtime_dir[0] == '/') {
    return std::string(xdg_runtime_dir) + "/kvcm";
  }
  return "/tmp/kvcm-" + std::to_string(euid);
}

// DefaultRunDir of this process's environment. For main() and command-line tools only:
// nothing below them reads the environment.
inline std::string DefaultRunDirFromEnvironment() {
  return DefaultRunDir(std::getenv("XDG_RUNTIME_DIR"), ::geteuid());
}

// "ipc://RUN_DIR/NAME".
inline std::string IpcEndpointIn(std::string_view run_dir, std::string_view name) {
  std::string endpoint = "ipc://";
  endpoint.append(run_dir);
  endpoint.push_back('/');
  endpoint.append(name);
  return endpoint;
}

}  // namespace kvcm
