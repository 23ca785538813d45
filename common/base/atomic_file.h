#pragma once
// Small, durable files: what a process keeps for its next start (the cache manager's
// vllm-events.seq) or hands to another program (kvcm-launch's Prometheus targets).

#include <sys/types.h>

#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace kvcm {

// Replaces `path` with `content` atomically and durably: writes PATH.tmp-PID beside it,
// fsyncs it, renames it over `path` (mode `mode`), then fsyncs the folder so that the
// rename survives a crash of the machine. A reader sees the old file or the new one, never
// a part. Errors: the failing step's errno as a Status (NOT_FOUND for a missing folder,
// PERMISSION_DENIED, ...), naming the path; the temp file is removed.
absl::Status WriteFileAtomically(const std::string& path, std::string_view content,
                                 mode_t mode = 0644);

// The whole of `path`, refusing more than `max_bytes`. NOT_FOUND when it does not exist,
// FAILED_PRECONDITION when it is larger, else the errno of the failing step; each naming
// the path.
absl::StatusOr<std::string> ReadSmallFile(const std::string& path, size_t max_bytes);

}  // namespace kvcm
