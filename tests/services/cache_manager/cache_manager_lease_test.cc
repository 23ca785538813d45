// Leases of the real kvcm-cache-manager process are charged only for a client's own
// silence (docs/architecture.md, "Leases"): a cache manager stopped past the heartbeat
// timeout quarantines nobody when it resumes, and steps of its wall clock, forward or back,
// change no lease (the clock is stepped inside the process by an LD_PRELOAD library,
// tests/support/clock_offset_preload.cc, as `date -s` or NTP would step it).

#include <fstream>

#include "absl/strings/numbers.h"
#include "absl/time/civil_time.h"
#include "tests/services/cache_manager/live_cache_manager.h"
#include "tests/support/status_matchers.h"

namespace kvcm::live_test {
namespace {

// The routers of these tests heartbeat every kIntervalMs and must never be quarantined,
// while a stopped client must be: kTimeoutMs is what a heartbeat thread of this process may
// be left unscheduled on a loaded machine before a router is taken for hung
// (docs/RELIABILITY.md, "Timing in tests"), and what the tests' waits are measured in.
constexpr int32_t kIntervalMs = 100;
constexpr int32_t kTimeoutMs = 2000;

// A router holding one sequence of 10 blocks.
struct Holder {
  std::unique_ptr<CacheManagerClient> client;
  uint64_t seq = 0;
};

Holder StartRouter(const CacheManagerProcess& manager, uint64_t seq) {
  Holder holder{Connect(manager), seq};
  if (holder.client == nullptr) return holder;
  BlockOps batch;
  batch.Allocate(seq, 10 * kBlockSize);
  auto outcome = holder.client->Step(batch);
  EXPECT_TRUE(outcome.ok() && (*outcome)[0].status.ok());
  return holder;
}

// Every router can still step (its session was never quarantined) and nothing is
// quarantined, checked over `span` (several heartbeat timeouts). A fixed span, to show that
// something does not happen: a slow machine can only make it miss a late quarantine, not
// report one.
void ExpectNobodyQuarantinedFor(std::vector<Holder>& routers, absl::Duration span) {
  const absl::Time until = absl::Now() + span;
  int rounds = 0;
  while (absl::Now() < until) {
    for (Holder& router : routers) {
      BlockOps batch;
      batch.Append(router.seq, 1);
      auto outcome = router.client->Step(batch);
      ASSERT_THAT(outcome, IsOk()) << "router of seq " << router.seq << ": " << outcome.status();
      ASSERT_THAT((*outcome)[0].status, IsOk());
    }
    auto stats = routers.front().client->Stats();
    ASSERT_THAT(stats, IsOk());
    ASSERT_EQ(stats->quarantined_blocks, 0);
    ExpectWhole(*stats);
    ++rounds;
    absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_GT(rounds, 5);
}

TEST(CacheManagerLeaseTest, AStoppedCacheManagerQuarantinesNobodyWhenItResumes) {
  auto manager = StartManager(kIntervalMs, kTimeoutMs);
  ASSERT_NE(manager, nullptr);
  std::vector<Holder> routers;
  for (uint64_t seq = 1; seq <= 3; ++seq) {
    routers.push_back(StartRouter(*manager, seq));
    ASSERT_NE(routers.back().client, nullptr);
  }

  // Stopped for three and a half timeouts while the routers keep heartbeating into its
  // queue (the point of the test is the time that passes, so this is a plain sleep).
  ASSERT_THAT(manager->process().Signal(SIGSTOP), IsOk());
  absl::SleepFor(absl::Milliseconds(kTimeoutMs * 7 / 2));
  ASSERT_THAT(manager->process().Signal(SIGCONT), IsOk());

  ExpectNobodyQuarantinedFor(routers, absl::Milliseconds(kTimeoutMs * 5 / 2));
  for (const Holder& router : routers) EXPECT_FALSE(router.client->session_lost());
  EXPECT_NE(manager->Output().find("every lease extended"), std::string::npos) << manager->Output();

  // A client that really stops is still quarantined afterwards.
  auto log = kvcm::testing::TempDir::Create("kvcm-lease");
  ASSERT_THAT(log, IsOk());
  absl::flat_hash_set<int32_t> held;
  auto stopped = StartHolder(*manager, &held, log->path() + "/holder.log");
  ASSERT_NE(stopped, nullptr);
  ASSERT_THAT(stopped->Signal(SIGSTOP), IsOk());
  const StatsSnapshot stats = AwaitQuarantined(*routers.front().client, kHeld);
  EXPECT_EQ(stats.quarantined_blocks, kHeld);
  ExpectWhole(stats);
  ASSERT_THAT(stopped->Signal(SIGKILL), IsOk());
}

// Sets the cache manager's wall clock `seconds` away from the real one.
void StepClock(const std::string& offset_file, int64_t seconds) {
  const std::string staged = offset_file + ".new";
  std::ofstream(staged) << seconds << "\n";
  ASSERT_EQ(std::rename(staged.c_str(), offset_file.c_str()), 0);
}

// The date of the cache manager's log line matching `regex` (its timestamp's first field).
absl::CivilDay LogDay(CacheManagerProcess& manager, const std::string& regex) {
  auto line = manager.process().WaitForLine(
      "([0-9]{4})-([0-9]{2})-([0-9]{2})T[^ ]* kvcm-cache-manager: " + regex,
      absl::Now() + absl::Seconds(60));
  EXPECT_THAT(line, IsOk()) << "\n" << manager.Output();
  if (!line.ok()) return absl::CivilDay();
  int year = 0, month = 0, day = 0;
  EXPECT_TRUE(absl::SimpleAtoi((*line)[1], &year) && absl::SimpleAtoi((*line)[2], &month) &&
              absl::SimpleAtoi((*line)[3], &day));
  return absl::CivilDay(year, month, day);
}

TEST(CacheManagerLeaseTest, StepsOfTheWallClockChangeNoLease) {
  auto dir = kvcm::testing::TempDir::Create("kvcm-clock");
  ASSERT_THAT(dir, IsOk());
  const std::string offset_file = dir->path() + "/offset";
  StepClock(offset_file, 0);
  CacheManagerOptions options;
  options.num_blocks = kBlocks;
  options.block_size = kBlockSize;
  options.heartbeat_interval_ms = kIntervalMs;
  options.heartbeat_timeout_ms = kTimeoutMs;
  options.env = {"LD_PRELOAD=" CLOCK_OFFSET_LIBRARY, "KVCM_TEST_CLOCK_OFFSET_FILE=" + offset_file,
                 // Under AddressSanitizer the preloaded library comes before its runtime.
                 "ASAN_OPTIONS=verify_asan_link_order=0"};
  auto started = CacheManagerProcess::Start(options);
  ASSERT_THAT(started, IsOk());
  CacheManagerProcess& manager = **started;
  std::vector<Holder> routers;
  for (uint64_t seq = 1; seq <= 2; ++seq) {
    routers.push_back(StartRouter(manager, seq));
    ASSERT_NE(routers.back().client, nullptr);
  }
  absl::flat_hash_set<int32_t> held;
  auto doomed = StartHolder(manager, &held, dir->path() + "/doomed.log");
  ASSERT_NE(doomed, nullptr);
  const absl::CivilDay today = absl::ToCivilDay(absl::Now(), absl::UTCTimeZone());

  // Ten days forward: a lease on the wall clock would have run out for everybody.
  constexpr int64_t kTenDays = 10 * 24 * 3600;
  StepClock(offset_file, kTenDays);
  ExpectNobodyQuarantinedFor(routers, absl::Milliseconds(kTimeoutMs * 5 / 2));
  // The step did reach the cache manager: the line about the killed client is dated ten
  // days ahead.
  ASSERT_THAT(doomed->Signal(SIGKILL), IsOk());
  const absl::CivilDay logged =
      LogDay(manager, absl::StrCat("client pid ", doomed->pid(), " exited"));
  EXPECT_GE(logged - today, 9) << "the clock step did not reach the cache manager";

  // Ten days back from the real time: a lease on the wall clock would never run out, so a
  // client that stops now would keep its blocks forever.
  StepClock(offset_file, -kTenDays);
  absl::flat_hash_set<int32_t> stopped_held;
  auto stopped = StartHolder(manager, &stopped_held, dir->path() + "/stopped.log");
  ASSERT_NE(stopped, nullptr);
  ASSERT_THAT(stopped->Signal(SIGSTOP), IsOk());
  const StatsSnapshot stats = AwaitQuarantined(*routers.front().client, kHeld);
  EXPECT_EQ(stats.quarantined_blocks, kHeld) << "a stopped client was never quarantined";
  ExpectWhole(stats);
  for (const Holder& router : routers) EXPECT_FALSE(router.client->session_lost());
  ASSERT_THAT(stopped->Signal(SIGKILL), IsOk());
}

}  // namespace
}  // namespace kvcm::live_test
