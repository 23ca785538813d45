#pragma once
// Accepting connections at the descriptor limit without dying (docs/operations.md, "When a
// client fails": a flood of connections).
//
// libzmq 4.3's IPC listener treats accept() failing with EMFILE as a broken invariant and
// aborts the process (it tolerates ENFILE only), so a flood of connections that reaches
// RLIMIT_NOFILE faster than the service can stop listening kills it. The process that calls
// InstallAcceptGuard() gets its own accept() and accept4(), which every library in it calls
// instead of libc's (ELF symbol interposition: the executable's definition comes first).
// They behave as the system calls, except that at the limit they close one descriptor kept
// in reserve, accept and close the pending connection with it (the peer reads a reset and,
// being a ZeroMQ socket, connects again later), take the reserve again, and fail with
// ECONNABORTED, which every listener treats as "try the next one".
//
// Thread safety: the accept functions may be called from any thread.

#include <cstdint>

#include "absl/status/status.h"

namespace kvcm {

// Opens the reserve descriptor. Call once, early in main(), before threads start.
absl::Status InstallAcceptGuard();

// Connections accepted and closed at the descriptor limit since the start.
uint64_t ConnectionsDroppedAtDescriptorLimit();

}  // namespace kvcm
