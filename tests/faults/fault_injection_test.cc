// Fault injection on the real stack (docs/RELIABILITY.md, "Fault injection"): kvcm-launch
// runs the cache manager, the router and two executors of a tiny model; clients send
// greedy requests for a bounded time while a seeded script kills (SIGKILL) and stops
// (SIGSTOP, then SIGCONT) the executors, the router and the cache manager, one fault at a
// time, and waits for the stack to serve again after each (kvcm-launch restarts what died).
//
// Checked: every request either completed with the tokens of the model run alone (a
// fault-free run) or got a clear error (an HTTP error with its JSON body, or a connection
// the killed router refused or dropped); no request hangs; the cache manager's block
// states sum to its capacity at every scrape; once the faults stop and the clients are
// idle, no block is in use, quarantined or draining; every fault recovered; and at
// SIGTERM every process ever started is gone, no socket or shared-memory object is left
// behind and the run directory's lock is free.
//
//   KVCM_FAULT_SECONDS   how long faults are injected (default 40)
//   KVCM_FAULT_SEED      the script's seed (default 20261202), printed to replay a run
//
// The figures (requests by outcome, faults by kind, recovery time p50/p99/max) are printed
// in one block at the end: docs/RELIABILITY.md has the command.

#include <signal.h>

#include <atomic>
#include <iostream>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/base/mutex.h"
#include "gtest/gtest.h"
#include "tests/faults/launched_stack.h"
#include "tests/support/wait_for.h"

namespace kvcm::faults {
namespace {

// Requests by outcome, from the client threads.
struct Tally {
  Mutex mutex;
  std::map<std::string, int> outcomes ABSL_GUARDED_BY(mutex);
  std::vector<std::string> bad ABSL_GUARDED_BY(mutex);  // neither completed nor a clear error
  std::map<std::string, std::string> example ABSL_GUARDED_BY(mutex);  // an error of each kind
};

class FaultInjectionTest : public LaunchedStackTest {
 protected:
  static constexpr int kNumBlocks = 256;
  static constexpr int kExecutors = 2;
  static constexpr int kClients = 4;

  FaultInjectionTest() : LaunchedStackTest("kvcm-fault-test") {}
};

TEST_F(FaultInjectionTest, KillsAndStopsOfEveryProcessLoseNoRequestAndNoBlock) {
  const int64_t seconds = EnvOr("KVCM_FAULT_SECONDS", 40);
  const uint64_t seed = static_cast<uint64_t>(EnvOr("KVCM_FAULT_SEED", 20261202));
  std::cout << "fault injection: seed " << seed << ", " << seconds
            << " s of faults (KVCM_FAULT_SEED, KVCM_FAULT_SECONDS)" << std::endl;
  const std::set<std::string> shm_before = DevShmEntries();

  ASSERT_NO_FATAL_FAILURE(Launch(kExecutors, kNumBlocks));

  // The prompts: a few sharing a prefix (so prefix-cache hits happen under faults too).
  std::vector<std::pair<std::string, int32_t>> prompts;
  for (int i = 0; i < 12; ++i) {
    prompts.push_back({absl::StrCat(i % 2 == 0 ? "a shared system prompt, then " : "", "request ",
                                    i, " of the fault run"),
                       8 + 4 * (i % 4)});
  }
  for (const auto& prompt : prompts) references_[prompt] = Reference(prompt.first, prompt.second);
  references_[{"probe after a fault", 2}] = Reference("probe after a fault", 2);
  // A fault-free run first: the stack serves every prompt with the model's own tokens.
  for (const auto& [text, n] : prompts) {
    const Outcome outcome = Request(text, n, absl::Seconds(60));
    ASSERT_EQ(outcome.kind, "completed") << outcome.detail << "\n"
                                         << testing::Tail(launch_->Output());
  }

  std::atomic<bool> stop_load{false};
  Tally tally;
  std::vector<std::thread> clients;
  for (int c = 0; c < kClients; ++c) {
    clients.emplace_back([&, c] {
      std::mt19937_64 rng(seed * 31 + static_cast<uint64_t>(c));
      while (!stop_load.load()) {
        const auto& [text, n] = prompts[rng() % prompts.size()];
        const Outcome outcome = Request(text, n, absl::Seconds(60));
        MutexLock lock(&tally.mutex);
        ++tally.outcomes[outcome.kind];
        if (!outcome.acceptable) tally.bad.push_back(outcome.kind + ": " + outcome.detail);
        if (!outcome.detail.empty()) tally.example.try_emplace(outcome.kind, outcome.detail);
        if (!outcome.acceptable || outcome.kind != "completed") {
          // A refused or dropped connection: back off a little, as a client would (pacing
          // the load, not a wait for a peer: its length changes no outcome).
          absl::SleepFor(absl::Milliseconds(50));
        }
      }
    });
  }

  // The scraper: block states sum to capacity at every scrape the cache manager answers.
  std::atomic<bool> stop_scrape{false};
  int scrapes = 0, unanswered = 0;
  std::vector<std::string> violations;
  std::thread scraper([&] {
    while (!stop_scrape.load()) {
      std::optional<Scrape> scrape = ScrapeCacheManager();
      if (!scrape) {
        ++unanswered;
      } else {
        ++scrapes;
        double sum = 0;
        for (const auto& [state, count] : scrape->blocks) sum += count;
        if (sum != scrape->capacity || scrape->capacity != kNumBlocks) {
          violations.push_back(
              absl::StrCat("states sum to ", sum, ", capacity ", scrape->capacity));
        }
      }
      // Pacing: a scrape every 200 ms or so, not a wait for a peer (every scrape is checked).
      absl::SleepFor(absl::Milliseconds(200));
    }
  });

  // The script: one fault at a time, then until the stack serves again.
  struct Fault {
    std::string process;
    bool kill;  // SIGKILL; else SIGSTOP for a while, then SIGCONT
  };
  const std::vector<Fault> kinds = {{"executor-0", true},    {"executor-1", true},
                                    {"executor-0", false},   {"executor-1", false},
                                    {"router", true},        {"router", false},
                                    {"cache-manager", true}, {"cache-manager", false}};
  std::mt19937_64 script(seed);
  std::map<std::string, int> injected;
  std::map<std::string, std::vector<double>> recovery_ms;  // by fault
  std::vector<std::string> unrecovered;
  const absl::Time end = absl::Now() + absl::Seconds(seconds);
  while (absl::Now() < end) {
    const Fault& fault = kinds[script() % kinds.size()];
    const pid_t pid = CurrentPid(fault.process);
    ASSERT_GT(pid, 0) << fault.process;
    const std::string name = absl::StrCat(fault.kill ? "SIGKILL " : "SIGSTOP ", fault.process);
    // Recovery counts from the kill, or from the SIGCONT that ends a stop.
    absl::Time at = absl::Now();
    if (fault.kill) {
      ASSERT_EQ(::kill(pid, SIGKILL), 0) << name;
    } else {
      ASSERT_EQ(::kill(pid, SIGSTOP), 0) << name;
      // The stop's length is the fault itself (a process hung for a while); any length, a
      // slow machine's longer one too, must end in recovery.
      absl::SleepFor(absl::Milliseconds(500 + static_cast<int64_t>(script() % 2500)));
      ::kill(pid, SIGCONT);
      at = absl::Now();
    }
    ++injected[name];
    // Recovered: a request completes with the right tokens (a short one, probed until it does;
    // 60 s only guards against a hang).
    const bool recovered =
        testing::WaitFor(
            [&] {
              return Request("probe after a fault", 2, absl::Seconds(10)).kind == "completed";
            },
            at + absl::Seconds(60), "a probe to complete after the fault")
            .ok();
    if (!recovered) {
      unrecovered.push_back(name);
      break;
    }
    recovery_ms[name].push_back(absl::ToDoubleMilliseconds(absl::Now() - at));
    // Pacing the script: a seeded pause of load between faults, not a wait for a peer.
    absl::SleepFor(absl::Milliseconds(300 + static_cast<int64_t>(script() % 1700)));
  }
  stop_load = true;
  for (std::thread& t : clients) t.join();

  // Idle: every block returns to free or cached within the lease bound.
  std::optional<Scrape> last;
  const bool idle = AwaitIdle(absl::Seconds(30), &last);
  stop_scrape = true;
  scraper.join();

  int requests = 0;
  std::string by_outcome;
  {
    MutexLock lock(&tally.mutex);
    for (const auto& [kind, count] : tally.outcomes) {
      requests += count;
      absl::StrAppend(&by_outcome, "\n    ", kind, ": ", count);
      if (auto it = tally.example.find(kind); it != tally.example.end()) {
        absl::StrAppend(&by_outcome, " (e.g. ", it->second, ")");
      }
    }
  }
  std::string by_fault;
  int faults = 0;
  std::vector<double> all_recoveries;
  for (const auto& [name, count] : injected) {
    faults += count;
    const std::vector<double>& times = recovery_ms[name];
    absl::StrAppend(&by_fault, "\n    ", name, ": ", count, ", recovered in ",
                    absl::StrFormat("%.0f", Quantile(times, 0.5)), " ms (median), ",
                    absl::StrFormat("%.0f", Quantile(times, 1.0)), " ms (max)");
    all_recoveries.insert(all_recoveries.end(), times.begin(), times.end());
  }
  std::cout << "fault injection: seed " << seed << ", " << seconds << " s, " << kClients
            << " clients, " << kExecutors << " executors, " << kNumBlocks << " blocks\n"
            << "  requests: " << requests << by_outcome << "\n"
            << "  faults: " << faults << by_fault << "\n"
            << "  recovery (the kill or the SIGCONT to the next correct reply), ms: p50 "
            << absl::StrFormat("%.0f", Quantile(all_recoveries, 0.5)) << ", p99 "
            << absl::StrFormat("%.0f", Quantile(all_recoveries, 0.99)) << ", max "
            << absl::StrFormat("%.0f", Quantile(all_recoveries, 1.0)) << "\n"
            << "  scrapes: " << scrapes << " answered, " << unanswered
            << " unanswered (cache manager down or stopped), " << violations.size()
            << " with states not summing to capacity" << std::endl;

  {
    MutexLock lock(&tally.mutex);
    EXPECT_TRUE(tally.bad.empty()) << tally.bad.size() << " requests neither completed nor got "
                                   << "a clear error; the first: " << tally.bad.front();
    EXPECT_GT(tally.outcomes["completed"], 0);
  }
  EXPECT_TRUE(unrecovered.empty())
      << "no correct reply within 60 s after " << unrecovered.front() << "\n"
      << testing::Tail(launch_->Output(), 8000);
  EXPECT_GT(faults, 0);
  EXPECT_TRUE(violations.empty()) << violations.front();
  EXPECT_TRUE(idle) << "blocks still held once idle: in_use "
                    << (last ? last->blocks["in_use"] : -1) << ", quarantined "
                    << (last ? last->blocks["quarantined"] : -1) << ", draining "
                    << (last ? last->blocks["draining"] : -1);

  // SIGTERM: every process ever started is gone, nothing is left behind.
  ExpectCleanShutdown(shm_before);
}

}  // namespace
}  // namespace kvcm::faults
