// SessionTable alone (services/cache_manager/session_table.h): ids, the ended ids it
// remembers, the epoch and identity checks, registration, leases and the retry ring, with
// scripted random bits and times given by the test.

#include "services/cache_manager/session_table.h"

#include <cstdint>
#include <deque>
#include <optional>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvcm::cache_manager {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;
using ::testing::UnorderedElementsAre;
using Refusal = SessionTable::Refusal;
using End = SessionTable::End;

constexpr uint64_t kEpoch = 9;
constexpr absl::Duration kTimeout = absl::Seconds(5);
const absl::Time kStart = absl::FromUnixSeconds(1000);

// Random bits from a script, then from a counter (so that a test never loops for ever).
class ScriptedRandom {
 public:
  explicit ScriptedRandom(std::vector<uint64_t> script) : script_(script.begin(), script.end()) {}
  uint64_t operator()() {
    if (script_.empty()) return ++counter_;
    const uint64_t bits = script_.front();
    script_.pop_front();
    return bits;
  }

 private:
  std::deque<uint64_t> script_;
  uint64_t counter_ = uint64_t{1} << 40;
};

SessionTable::Options TableOptions(size_t ended_ids_kept = 4096) {
  SessionTable::Options options;
  options.epoch = kEpoch;
  options.heartbeat_timeout = kTimeout;
  options.ended_ids_kept = ended_ids_kept;
  return options;
}

struct NewSession {
  uint64_t id = 0;
  SessionRole role = SessionRole::kRouter;
  pid_t pid = 0;
  bool pid_verified = false;
  int32_t num_seqs = 0;
  absl::Time last_seen = kStart;
};

SessionTable::Session& Add(SessionTable& table, const NewSession& fields) {
  SessionTable::Session session;
  session.id = fields.id;
  session.role = fields.role;
  session.pid = fields.pid;
  session.pid_verified = fields.pid_verified;
  session.num_seqs = fields.num_seqs;
  session.last_seen = fields.last_seen;
  return table.Add(std::move(session));
}

// --- Ids -----------------------------------------------------------------------------------

TEST(SessionTableTest, ANewIdSkipsZeroLiveAndEndedIdsAndDropsTheBitsFrom53Up) {
  SessionTable::Options options = TableOptions();
  options.random = ScriptedRandom({
      0,                             // never an id
      11,                            // live
      12,                            // ended
      uint64_t{1} << 53,             // 0 once cut to 53 bits
      (uint64_t{0x7ff} << 53) | 11,  // 11 once cut: live
      (uint64_t{0x5} << 53) | 42,    // 42
  });
  SessionTable table(options);
  Add(table, {.id = 11});
  Add(table, {.id = 12});
  ASSERT_TRUE(table.Remove(12).has_value());
  EXPECT_EQ(table.NewId(), 42u);
}

TEST(SessionTableTest, IdsFromTheKernelAreDistinctNonZeroAndBelowTwoToThe53) {
  SessionTable table(TableOptions());
  absl::flat_hash_set<uint64_t> seen;
  for (int i = 0; i < 1000; ++i) {
    const uint64_t id = table.NewId();
    EXPECT_NE(id, 0u);
    EXPECT_LT(id, uint64_t{1} << 53);
    Add(table, {.id = id});  // live now: never given again
    EXPECT_TRUE(seen.insert(id).second) << id;
  }
  EXPECT_EQ(table.size(), 1000);
}

TEST(SessionTableDeathTest, AddingAnIdThatEndedIsABug) {
  SessionTable table(TableOptions());
  Add(table, {.id = 5});
  table.Remove(5);
  EXPECT_DEATH(Add(table, {.id = 5}), "issued before");
}

// --- Ended ids -----------------------------------------------------------------------------

TEST(SessionTableTest, RemoveTakesTheSessionOutWhole) {
  SessionTable table(TableOptions());
  Add(table, {.id = 5, .role = SessionRole::kExecutor, .pid = 77, .num_seqs = 0});
  table.Find(5)->pending_fences.insert(3);
  const std::optional<SessionTable::Session> removed = table.Remove(5);
  ASSERT_TRUE(removed.has_value());
  EXPECT_EQ(removed->id, 5u);
  EXPECT_EQ(removed->pid, 77);
  EXPECT_THAT(removed->pending_fences, UnorderedElementsAre(3u));
  EXPECT_EQ(table.Find(5), nullptr);
  EXPECT_EQ(table.size(), 0);
  EXPECT_TRUE(table.WasEnded(5));
}

TEST(SessionTableTest, RemovingAnIdNotLiveReturnsNothingAndRemembersNothing) {
  SessionTable table(TableOptions());
  EXPECT_FALSE(table.Remove(5).has_value());
  EXPECT_FALSE(table.WasEnded(5));
  EXPECT_EQ(table.Check(kEpoch, 5, std::nullopt).refusal, Refusal::kNotRegistered);
}

TEST(SessionTableTest, OnlyTheLastEndedIdsAreRememberedAndTheOldestIsForgottenFirst) {
  SessionTable::Options options = TableOptions(/*ended_ids_kept=*/3);
  options.random = ScriptedRandom({2, 3, 4, 1});
  SessionTable table(options);
  for (uint64_t id = 1; id <= 4; ++id) Add(table, {.id = id});
  for (uint64_t id = 1; id <= 4; ++id) table.Remove(id);
  // 1 fell out of the ring of three: a late request for it is told it never existed.
  EXPECT_FALSE(table.WasEnded(1));
  EXPECT_EQ(table.Check(kEpoch, 1, std::nullopt).refusal, Refusal::kNotRegistered);
  for (uint64_t id = 2; id <= 4; ++id) {
    EXPECT_TRUE(table.WasEnded(id)) << id;
    EXPECT_EQ(table.Check(kEpoch, id, std::nullopt).refusal, Refusal::kEnded) << id;
  }
  // 2, 3 and 4 are never given again while remembered; 1 may be.
  EXPECT_EQ(table.NewId(), 1u);
}

// --- Checks --------------------------------------------------------------------------------

TEST(SessionTableTest, AnotherEpochIsRefusedBeforeTheSessionIsLookedAt) {
  SessionTable table(TableOptions());
  Add(table, {.id = 5, .pid = 10, .pid_verified = true});
  table.Find(5)->quarantined = true;
  const SessionTable::Checked checked = table.Check(kEpoch + 1, 5, /*peer_pid=*/11);
  EXPECT_EQ(checked.refusal, Refusal::kStaleEpoch);
  EXPECT_EQ(checked.session, nullptr);
  EXPECT_EQ(table.Check(kEpoch - 1, 6, std::nullopt).refusal, Refusal::kStaleEpoch);
}

TEST(SessionTableTest, ALiveSessionInTheEpochPassesAndIsReturned) {
  SessionTable table(TableOptions());
  Add(table, {.id = 5, .pid = 10, .pid_verified = true});
  const SessionTable::Checked checked = table.Check(kEpoch, 5, 10);
  EXPECT_EQ(checked.refusal, Refusal::kNone);
  EXPECT_EQ(checked.session, table.Find(5));
}

TEST(SessionTableTest, AVouchedForSessionAnswersOnlyToItsOwnProcessNeverToTcp) {
  SessionTable table(TableOptions());
  Add(table, {.id = 5, .pid = 10, .pid_verified = true});
  EXPECT_EQ(table.Check(kEpoch, 5, 11).refusal, Refusal::kOtherProcess);
  EXPECT_EQ(table.Check(kEpoch, 5, std::nullopt).refusal, Refusal::kOtherProcess);
  EXPECT_EQ(table.Check(kEpoch, 5, 11).session, table.Find(5));  // for the refusal's words
}

TEST(SessionTableTest, ASessionWhosePidWasOnlyClaimedAnswersToAnyPeer) {
  SessionTable table(TableOptions());
  Add(table, {.id = 5, .pid = 10, .pid_verified = false});
  EXPECT_EQ(table.Check(kEpoch, 5, std::nullopt).refusal, Refusal::kNone);
  EXPECT_EQ(table.Check(kEpoch, 5, 11).refusal, Refusal::kNone);
}

TEST(SessionTableTest, AQuarantinedSessionIsRefusedAfterTheIdentityCheck) {
  SessionTable table(TableOptions());
  Add(table, {.id = 5, .pid = 10, .pid_verified = true});
  table.Find(5)->quarantined = true;
  EXPECT_EQ(table.Check(kEpoch, 5, 10).refusal, Refusal::kQuarantined);
  // Another process learns nothing about the session's lease.
  EXPECT_EQ(table.Check(kEpoch, 5, 11).refusal, Refusal::kOtherProcess);
}

// --- Registration --------------------------------------------------------------------------

TEST(SessionTableTest, OnlyAVouchedForPidReplacesItsQuarantinedVouchedForSessions) {
  SessionTable table(TableOptions());
  Add(table, {.id = 1, .pid = 10, .pid_verified = true});   // quarantined: replaced
  Add(table, {.id = 2, .pid = 10, .pid_verified = true});   // live: stays
  Add(table, {.id = 3, .pid = 10, .pid_verified = false});  // quarantined, claimed: stays
  Add(table, {.id = 4, .pid = 20, .pid_verified = true});   // another process
  table.Find(1)->quarantined = true;
  table.Find(3)->quarantined = true;
  table.Find(4)->quarantined = true;

  const SessionTable::Registration vouched = table.PlanRegistration(10, true);
  EXPECT_THAT(vouched.replaced, ElementsAre(1u));
  EXPECT_EQ(vouched.others, 2);
  // Over tcp:// the pid may be anyone's: nothing is replaced.
  const SessionTable::Registration claimed = table.PlanRegistration(10, false);
  EXPECT_THAT(claimed.replaced, IsEmpty());
  EXPECT_EQ(claimed.others, 3);
  EXPECT_EQ(table.size(), 4);  // a plan changes nothing
}

TEST(SessionTableTest, TheSessionsOfAProcessAreOnlyThoseTheKernelVouchedFor) {
  SessionTable table(TableOptions());
  Add(table, {.id = 1, .pid = 10, .pid_verified = true});
  Add(table, {.id = 2, .pid = 10, .pid_verified = false});
  Add(table, {.id = 3, .pid = 11, .pid_verified = true});
  EXPECT_THAT(table.VerifiedSessionsOf(10), ElementsAre(1u));
  EXPECT_THAT(table.VerifiedSessionsOf(12), IsEmpty());
}

TEST(SessionTableTest, EveryExecutorSessionIsAWriterQuarantinedOrNot) {
  SessionTable table(TableOptions());
  Add(table, {.id = 1, .role = SessionRole::kExecutor, .pid = 10});
  Add(table, {.id = 2, .role = SessionRole::kExecutor, .pid = 11});
  Add(table, {.id = 3, .role = SessionRole::kRouter, .pid = 12});
  Add(table, {.id = 4, .role = SessionRole::kControl, .pid = 13});
  table.Find(2)->quarantined = true;
  EXPECT_THAT(table.Executors(), UnorderedElementsAre(1u, 2u));
}

// --- Leases --------------------------------------------------------------------------------

TEST(SessionTableTest, ASessionSilentForExactlyTheTimeoutIsNotQuarantinedAndOneNanosecondMoreIs) {
  SessionTable table(TableOptions());
  // A router holding sequences over ipc://: quarantined, never ended by its lease.
  Add(table, {.id = 1, .pid = 10, .pid_verified = true, .num_seqs = 1});
  const SessionTable::Expiry at_timeout = table.Expire(kStart + kTimeout);
  EXPECT_EQ(at_timeout.quarantined, 0);
  EXPECT_THAT(at_timeout.to_end, IsEmpty());
  EXPECT_FALSE(table.Find(1)->quarantined);

  const SessionTable::Expiry past = table.Expire(kStart + kTimeout + absl::Nanoseconds(1));
  EXPECT_EQ(past.quarantined, 1);
  EXPECT_THAT(past.to_end, IsEmpty());
  EXPECT_TRUE(table.Find(1)->quarantined);
  // Quarantined once: not counted again.
  EXPECT_EQ(table.Expire(kStart + 10 * kTimeout).quarantined, 0);
}

TEST(SessionTableTest, ExpiryReturnsExactlyTheSessionsToEndInOrderAndEndsNone) {
  SessionTable table(TableOptions());
  const absl::Time late = kStart + kTimeout + absl::Seconds(1);
  // Silent since kStart.
  Add(table, {.id = 1, .role = SessionRole::kRouter, .pid = 10, .num_seqs = 2});  // tcp://
  Add(table, {.id = 2,
              .role = SessionRole::kRouter,
              .pid = 11,
              .pid_verified = true,
              .num_seqs = 2});                                      // stays quarantined
  Add(table, {.id = 3, .role = SessionRole::kControl, .pid = 12});  // holds nothing
  Add(table, {.id = 4, .role = SessionRole::kRouter, .pid = 13, .pid_verified = true});
  Add(table, {.id = 5, .role = SessionRole::kExecutor, .pid = 14, .pid_verified = true});
  Add(table, {.id = 6, .role = SessionRole::kExecutor, .pid = 15, .pid_verified = true});
  // Heard from in time.
  Add(table, {.id = 7,
              .role = SessionRole::kExecutor,
              .pid = 14,
              .pid_verified = true,
              .last_seen = late});
  Add(table, {.id = 8, .role = SessionRole::kRouter, .pid = 16, .num_seqs = 1, .last_seen = late});

  const SessionTable::Expiry expiry = table.Expire(late);
  EXPECT_EQ(expiry.quarantined, 6);
  // The tcp:// router with sequences first, then the executor whose process lives on in
  // session 7, then the sessions holding nothing; a hung executor (6) and a router the
  // kernel vouched for (2) stay quarantined.
  ASSERT_EQ(expiry.to_end.size(), 4u);
  EXPECT_EQ(expiry.to_end[0], (End{1, ReclaimReason::kLeaseExpired, 0}));
  EXPECT_EQ(expiry.to_end[1], (End{5, ReclaimReason::kSessionReplaced, 7}));
  EXPECT_THAT(std::vector<End>(expiry.to_end.begin() + 2, expiry.to_end.end()),
              UnorderedElementsAre(End{3, ReclaimReason::kClientDied, 0},
                                   End{4, ReclaimReason::kClientDied, 0}));
  EXPECT_EQ(table.size(), 8);  // the caller ends them
  for (uint64_t id : {1, 2, 3, 4, 5, 6}) EXPECT_TRUE(table.Find(id)->quarantined) << id;
  for (uint64_t id : {7, 8}) EXPECT_FALSE(table.Find(id)->quarantined) << id;
}

TEST(SessionTableTest, AGivenUpExecutorSessionGoesToTheLiveOneHeardFromLast) {
  SessionTable table(TableOptions());
  const absl::Time late = kStart + kTimeout + absl::Seconds(1);
  Add(table, {.id = 1, .role = SessionRole::kExecutor, .pid = 14, .pid_verified = true});
  Add(table, {.id = 2,
              .role = SessionRole::kExecutor,
              .pid = 14,
              .pid_verified = true,
              .last_seen = late - absl::Seconds(1)});
  Add(table, {.id = 3,
              .role = SessionRole::kExecutor,
              .pid = 14,
              .pid_verified = true,
              .last_seen = late});
  const SessionTable::Expiry expiry = table.Expire(late);
  EXPECT_THAT(expiry.to_end, ElementsAre(End{1, ReclaimReason::kSessionReplaced, 3}));
}

TEST(SessionTableTest, AnExecutorWhosePidWasOnlyClaimedIsNeverReplacedByExpiry) {
  SessionTable table(TableOptions());
  const absl::Time late = kStart + kTimeout + absl::Seconds(1);
  Add(table, {.id = 1, .role = SessionRole::kExecutor, .pid = 14});
  Add(table, {.id = 2, .role = SessionRole::kExecutor, .pid = 14, .last_seen = late});
  const SessionTable::Expiry expiry = table.Expire(late);
  EXPECT_EQ(expiry.quarantined, 1);
  EXPECT_THAT(expiry.to_end, IsEmpty());
}

TEST(SessionTableTest, ExtendingLeasesMovesActiveSessionsForwardNeverBackAndSparesQuarantine) {
  SessionTable table(TableOptions());
  Add(table, {.id = 1});
  Add(table, {.id = 2, .last_seen = kStart + absl::Seconds(10)});
  Add(table, {.id = 3, .num_seqs = 1});
  table.Find(3)->quarantined = true;
  table.ExtendLeases(kStart + absl::Seconds(4));
  EXPECT_EQ(table.Find(1)->last_seen, kStart + absl::Seconds(4));
  EXPECT_EQ(table.Find(2)->last_seen, kStart + absl::Seconds(10));
  EXPECT_EQ(table.Find(3)->last_seen, kStart);
  // Extended: session 1 is not quarantined until kTimeout after the extension.
  EXPECT_EQ(table.Expire(kStart + absl::Seconds(4) + kTimeout).quarantined, 0);
  EXPECT_EQ(table.Expire(kStart + absl::Seconds(4) + kTimeout + absl::Nanoseconds(1)).quarantined,
            1);
}

// --- Retries -------------------------------------------------------------------------------

std::vector<uint8_t> Bytes(size_t size, uint8_t value) { return std::vector<uint8_t>(size, value); }

TEST(SessionTableTest, ASessionKeepsTheRepliesOfItsLastFourStepsAndForgetsTheOldest) {
  SessionTable::Session session;
  for (uint64_t id = 1; id <= 5; ++id) {
    const std::vector<uint8_t> reply = Bytes(id, static_cast<uint8_t>(id));
    session.KeepSentStep(id, /*request_hash=*/id * 100, /*request_size=*/id * 10, reply);
    EXPECT_EQ(session.last_step_request_id, id);
  }
  EXPECT_EQ(session.FindSentStep(1), nullptr);  // the fifth went over the first
  for (uint64_t id = 2; id <= 5; ++id) {
    const SessionTable::Session::SentStep* sent = session.FindSentStep(id);
    ASSERT_NE(sent, nullptr) << id;
    EXPECT_EQ(sent->request_hash, id * 100);
    EXPECT_EQ(sent->request_size, id * 10);
    EXPECT_EQ(sent->reply, Bytes(id, static_cast<uint8_t>(id)));
  }
  EXPECT_EQ(session.FindSentStep(6), nullptr);
  EXPECT_EQ(SessionTable::kSentStepsKept, 4u);
}

TEST(SessionTableTest, RequestIdZeroIsNeverFoundAmongTheKeptSteps) {
  SessionTable::Session session;
  EXPECT_EQ(session.FindSentStep(0), nullptr);  // the empty ring's slots
  session.KeepSentStep(0, 1, 1, Bytes(3, 1));
  EXPECT_EQ(session.FindSentStep(0), nullptr);
}

TEST(SessionTableTest, ALargeKeptBufferIsGivenBackWhenASmallReplyTakesItsSlot) {
  SessionTable::Session session;
  session.KeepSentStep(1, 0, 0, Bytes(size_t{256} << 10, 1));
  for (uint64_t id = 2; id <= 4; ++id) session.KeepSentStep(id, 0, 0, Bytes(10, 2));
  session.KeepSentStep(5, 0, 0, Bytes(100, 3));  // over step 1's slot
  const SessionTable::Session::SentStep* sent = session.FindSentStep(5);
  ASSERT_NE(sent, nullptr);
  EXPECT_EQ(sent->reply, Bytes(100, 3));
  EXPECT_LT(sent->reply.capacity(), size_t{64} << 10);
}

}  // namespace
}  // namespace kvcm::cache_manager
