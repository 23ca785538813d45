#pragma once

// WaitFor: polls a condition until it holds or a deadline passes, so that a test waits for
// what it needs instead of sleeping a fixed time for a peer (docs/RELIABILITY.md, "Timing
// in tests"). Test support only.
//
//   ASSERT_THAT(WaitFor([&] { return Stats().draining_blocks == 0; },
//                       absl::Now() + absl::Seconds(30), "the drained blocks to come back")
//, IsOk());
//   absl::Status quarantined =
//       WaitFor([&] { return Stats().quarantined_blocks == 3; }, absl::Seconds(60));
//   ASSERT_THAT(quarantined, IsOk());
//
// The condition is checked at once, then every kWaitForPollInterval, and once more after the
// deadline has passed, so that a caller descheduled across the deadline still sees a
// condition that came true meanwhile. It runs on the calling thread and may have effects of
// its own (poll a socket, send a request, count its attempts). Deadlines are absl::Now()
// values, as Subprocess::WaitForLine takes them.
// Thread safety: none of its own; the condition decides what it touches.

#include <sys/types.h>

#include <algorithm>
#include <fstream>
#include <string>
#include <type_traits>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "tests/support/status_matchers.h"

namespace kvcm::testing {

// Short, so that a waiting test costs little more than the condition itself takes.
inline constexpr absl::Duration kWaitForPollInterval = absl::Milliseconds(10);

// OK as soon as `condition()` returns true; DEADLINE_EXCEEDED "gave up waiting for <what>
// after <time waited>" once `deadline` has passed and a last check still returned false.
template <typename Condition>
absl::Status WaitFor(Condition&& condition, absl::Time deadline,
                     absl::string_view what = "the condition") {
  static_assert(std::is_convertible_v<std::invoke_result_t<Condition&>, bool>,
                "WaitFor's condition returns bool");
  const absl::Time start = absl::Now();
  while (true) {
    // Read before the check: the last check then comes after the deadline passed.
    const bool past = absl::Now() >= deadline;
    if (condition()) return absl::OkStatus();
    if (past) break;
    absl::SleepFor(std::min(kWaitForPollInterval, deadline - absl::Now()));
  }
  return absl::DeadlineExceededError(absl::StrCat("gave up waiting for ", what, " after ",
                                                  absl::FormatDuration(absl::Now() - start)));
}

// The same with a timeout from now.
template <typename Condition>
absl::Status WaitFor(Condition&& condition, absl::Duration timeout,
                     absl::string_view what = "the condition") {
  return WaitFor(std::forward<Condition>(condition), absl::Now() + timeout, what);
}

// Whether thread `tid` of this process sleeps in the kernel, as a thread blocked in a wait
// does: state S in /proc/self/task/TID/stat (after the name, which may hold anything). For
// a condition "the other thread is blocked now" in place of a guess at how long it takes.
inline bool ThreadSleeps(pid_t tid) {
  std::ifstream file(absl::StrCat("/proc/self/task/", tid, "/stat"));
  std::string stat;
  std::getline(file, stat);
  const size_t name_end = stat.rfind(')');
  return name_end != std::string::npos && stat.compare(name_end, 3, ") S") == 0;
}

}  // namespace kvcm::testing
