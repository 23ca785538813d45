#pragma once
// The clock of every lease, deadline and timeout in kvcm (docs/architecture.md, "Leases").
//
// MonotonicNow() reads CLOCK_MONOTONIC: it never steps when an administrator or NTP sets
// the wall clock, so a jump of the wall clock can neither quarantine every session nor stall
// a heartbeat for an hour. It is returned as an absl::Time so that deadline arithmetic
// reads as usual, but its origin is arbitrary (the boot): compare and subtract such values
// only with each other, never with absl::Now(), and never print them as a date. Wall-clock
// time (absl::Now()) is for log lines and the epoch only.

#include <time.h>

#include "absl/time/time.h"

namespace kvcm {

inline absl::Time MonotonicNow() {
  timespec now{};
  ::clock_gettime(CLOCK_MONOTONIC, &now);
  return absl::UnixEpoch() + absl::Seconds(now.tv_sec) + absl::Nanoseconds(now.tv_nsec);
}

}  // namespace kvcm
