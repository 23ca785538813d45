#pragma once
// The process's file descriptors against RLIMIT_NOFILE, for the services that accept
// connections from anyone on the node and must shed them before the limit rather than fail
// at it (docs/operations.md, "When a client fails": a flood of connections). With
// accept_guard.h, which handles what arrives with no descriptor left.
//
// Thread safety: each function may be called from any thread; OpenDescriptors() on one
// directory descriptor from one thread at a time (it moves that descriptor's offset).

#include <cstdint>
#include <optional>

namespace kvcm {

// The soft RLIMIT_NOFILE; -1 when unlimited or unknown.
int DescriptorLimit();

// Open descriptors of this process: the entries of /proc/self/fd, read through
// `proc_self_fd` (that directory, opened at start) less `proc_self_fd` itself. Reading it
// takes no descriptor, so it still works when none is free; -1 if it cannot be read.
int OpenDescriptors(int proc_self_fd);

// Raises the soft RLIMIT_NOFILE to the hard one (every connection holds a descriptor, and
// the soft limit is often 1024). Returns the soft limit before, when it was raised.
struct RaisedLimit {
  uint64_t before = 0;
  uint64_t after = 0;
};
std::optional<RaisedLimit> RaiseDescriptorLimit();

}  // namespace kvcm
