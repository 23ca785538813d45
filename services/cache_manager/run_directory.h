#pragma once
// RunDirectory: the cache manager's directory of sockets and its single-instance lock
// (docs/architecture.md).
//
// Acquire() creates the directory (mode 0700; an existing one must belong to this user and
// is narrowed to 0700), then takes an exclusive flock on `cache-manager.lock` and writes
// the pid into it. A second cache manager on the same directory fails there with
// ALREADY_EXISTS naming the first one's pid, before it touches any socket: libzmq would
// otherwise let it bind the same ipc:// path and silently steal it. The kernel drops the
// lock when the holder dies, so a crash leaves nothing that blocks a restart; stale socket
// files are removed by the next holder.
//
// Thread safety: plain value; create and destroy on one thread.

#include <string>

#include "absl/status/statusor.h"
#include "common/base/run_dir.h"
#include "common/base/unique_fd.h"

namespace kvcm::cache_manager {

class RunDirectory {
 public:
  // Endpoint file names inside the directory (common/base/run_dir.h).
  static constexpr const auto& kRequestSocket = kvcm::kCacheManagerSocket;
  static constexpr const auto& kEventSocket = kvcm::kEventSocket;
  static constexpr const auto& kFdChannelSocket = kvcm::kFdChannelSocket;
  static constexpr const auto& kLockFile = kvcm::kCacheManagerLockFile;
  static constexpr const auto& kTcpSecretFile = kvcm::kTcpSecretFile;
  static constexpr const auto& kVllmEventsSeqFile = kvcm::kVllmEventsSeqFile;

  // DefaultRunDirFromEnvironment(): $XDG_RUNTIME_DIR/kvcm when set, else /tmp/kvcm-$UID.
  // Read by main() only.
  static std::string DefaultPath() { return DefaultRunDirFromEnvironment(); }

  // Errors: ALREADY_EXISTS (another instance holds the lock), PERMISSION_DENIED (directory
  // owned by another user), INVALID_ARGUMENT (path too long for a Unix socket address),
  // INTERNAL (mkdir/open failed, with errno text).
  static absl::StatusOr<RunDirectory> Acquire(const std::string& path);

  RunDirectory(RunDirectory&&) = default;
  RunDirectory& operator=(RunDirectory&&) = default;
  // Removes the socket files this instance created, then releases the lock.
  ~RunDirectory();

  const std::string& path() const { return path_; }
  std::string File(const char* name) const { return path_ + "/" + name; }
  std::string IpcEndpoint(const char* name) const { return IpcEndpointIn(path_, name); }

  // Writes a new random secret (32 bytes from getrandom, as 64 hex digits) into
  // kTcpSecretFile, mode 0600, replacing any earlier one; returns it. Removed with the
  // directory's other files. INTERNAL when it cannot be written.
  absl::StatusOr<std::string> CreateTcpSecret();

 private:
  RunDirectory(std::string path, UniqueFd lock) : path_(std::move(path)), lock_(std::move(lock)) {}

  std::string path_;
  UniqueFd lock_;  // holds the flock; invalid after a move
};

}  // namespace kvcm::cache_manager
