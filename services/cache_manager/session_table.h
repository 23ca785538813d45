#pragma once

// SessionTable: the cache manager's client sessions, as plain values: no messages, no
// sockets, no clock reads (every time is passed in, on the monotonic clock), no ledger.
// CacheManagerService (cache_manager_service.h) owns one and does what it decides: the
// sequences a session owns live in the ledger (BlockLedger::SetOwner) and are only counted
// here; the fences an executor session waits in live in FenceTable (fence_table.h) and are
// only named here.
//
// Contract:
// - Ids (docs/architecture.md, "Identity"): NewId() is random (the kernel's CSPRNG unless
//   Options::random is set), below 2^53 so that JSON and Prometheus carry it exactly, never
//   0, and never the id of a live session nor of one of the last ended ones.
// - Ended ids: Remove() remembers the id, so that Check() tells a late request its session
//   ended (kEnded) rather than that it never existed (kNotRegistered). Only the last
//   Options::ended_ids_kept are remembered, oldest forgotten first.
// - Check(): a request other than Hello must carry the current epoch, the id of a live
//   session, come from the process that registered it when the kernel vouched for that
//   one (never from tcp://, never from another pid), and name a session not quarantined.
//   The first check that fails is the answer.
// - Registration (Hello): the quarantined sessions of a process the kernel vouches for
//   are replaced by its new one (PlanRegistration); a pid claimed over tcp:// replaces
//   nothing, since it may be anyone's.
// - Leases (docs/architecture.md, "Leases"): the caller renews a session's lease with each
//   of its messages (Session::last_seen). Expire(now) quarantines every session silent for
//   longer than heartbeat_timeout and returns the sessions to end now, in the order to end
//   them, each with its reason (and an executor's successor); it ends none itself: the
//   caller frees or fences their sequences and calls Remove(). ExtendLeases(now) counts
//   every session not quarantined as seen at `now` (the caller's own loop was late).
// - Retries (docs/architecture.md, "Retries and resynchronisation"): a session keeps the
//   replies of its last kSentStepsKept applied Steps by request id (FindSentStep,
//   KeepSentStep), in a ring whose buffers are reused.
//
// Thread safety: none; one thread (the service's) owns it.

#include <sys/types.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/time/time.h"
#include "common/block/block_ledger.h"
#include "services/cache_manager/cache_manager_metrics.h"

namespace kvcm::cache_manager {

class SessionTable {
 public:
  // Applied Steps whose replies a session keeps for retries.
  static constexpr size_t kSentStepsKept = 4;

  struct Options {
    uint64_t epoch = 1;  // the cache manager's; Check() refuses any other
    absl::Duration heartbeat_timeout = absl::Seconds(5);
    size_t ended_ids_kept = 4096;  // > 0
    // Random bits for NewId(); null: getrandom(2). Tests script it.
    std::function<uint64_t()> random = nullptr;
  };

  struct Session {
    uint64_t id = 0;
    SessionRole role = SessionRole::kControl;
    pid_t pid = 0;              // 0 when unknown (tcp:// client)
    bool pid_verified = false;  // pid came from ipc:// credentials (and is watched)
    // ipc:// (the kernel vouched for the peer) or tcp:// with the secret. Otherwise only
    // reads: no Attach, Pin, Unpin or Step.
    bool authenticated = false;
    std::string name;
    absl::Time last_seen;
    bool quarantined = false;
    // Sequences this session allocated and still owns: the ledger keeps each one's owner
    // (BlockLedger::SetOwner), so that a Step's op finds it in the sequence's own record.
    int32_t num_seqs = 0;
    absl::flat_hash_set<uint64_t> pending_fences;  // executors: fences not acknowledged yet
    // Replies of the last kSentStepsKept Steps applied, for retries. Each reply is at most
    // max_message_bytes (a Step whose reply could be larger is refused before it runs), so
    // a session holds at most four times that here (64 MiB at the default 16 MiB), and in
    // practice the size of its last four replies.
    struct SentStep {
      uint64_t request_id = 0;  // 0: empty
      size_t request_hash = 0;
      size_t request_size = 0;
      std::vector<uint8_t> reply;
    };
    std::array<SentStep, kSentStepsKept> sent_steps;
    size_t next_sent = 0;
    uint64_t last_step_request_id = 0;  // of the last Step applied
    // Ids freed with drain: never live again in this session, since executors refuse
    // steps naming them for good.
    absl::flat_hash_set<SeqId> drained_ids;

    // The kept Step with `request_id` (never 0); null if none is kept.
    const SentStep* FindSentStep(uint64_t request_id) const;
    // Keeps `reply` as the reply to Step `request_id` (the last applied now), over the
    // oldest kept one. A buffer much larger than `reply` is given back rather than reused,
    // so that one large step does not pin its size in the session for good.
    void KeepSentStep(uint64_t request_id, size_t request_hash, size_t request_size,
                      std::span<const uint8_t> reply);
  };

  // Why Check() refused a request, in the order the checks run.
  enum class Refusal {
    kNone,
    kStaleEpoch,     // another epoch's message
    kNotRegistered,  // an id never issued, or ended too long ago to remember
    kEnded,          // an id that ended recently
    kOtherProcess,   // the session's pid was vouched for, and this peer is not that process
    kQuarantined,    // the session missed its heartbeats
  };
  struct Checked {
    Refusal refusal = Refusal::kNone;
    // The session named, whenever it is live (also when refused as kOtherProcess or
    // kQuarantined); null otherwise.
    Session* session = nullptr;
  };

  // What a Hello from `pid` finds: the sessions it replaces (quarantined sessions of that
  // pid, when the kernel vouched for it now and then) and how many others that pid holds.
  struct Registration {
    std::vector<uint64_t> replaced;
    int32_t others = 0;
  };

  // A session Expire() hands back to be ended.
  struct End {
    uint64_t id = 0;
    ReclaimReason reason = ReclaimReason::kClientDied;
    uint64_t successor = 0;  // an executor's live session taking its fences; 0: none
    bool operator==(const End&) const = default;
  };
  struct Expiry {
    int quarantined = 0;      // sessions quarantined by this call
    std::vector<End> to_end;  // in the order to end them
  };

  explicit SessionTable(Options options);

  // A fresh id: see the contract.
  uint64_t NewId();
  // Adds a session. REQUIRES: session.id != 0 and is neither live nor remembered as ended.
  Session& Add(Session session);
  // Takes the session out (nullopt if it is not live) and remembers its id as ended.
  std::optional<Session> Remove(uint64_t id);

  Session* Find(uint64_t id);
  const Session* Find(uint64_t id) const;
  bool WasEnded(uint64_t id) const { return ended_ids_.contains(id); }
  int32_t size() const { return static_cast<int32_t>(sessions_.size()); }
  // Every live session by id (for reports and counts; the order is the map's).
  const absl::flat_hash_map<uint64_t, Session>& sessions() const { return sessions_; }

  // The session checks for a request (not Hello) naming `session_id` in `epoch`, from a
  // peer whose pid the kernel reported (nullopt: tcp://).
  Checked Check(uint64_t epoch, uint64_t session_id, std::optional<pid_t> peer_pid);

  Registration PlanRegistration(pid_t pid, bool kernel_vouched) const;
  // The sessions of process `pid` whose pid the kernel vouched for.
  std::vector<uint64_t> VerifiedSessionsOf(pid_t pid) const;
  // Every executor session, quarantined ones included: the writers a fence waits for.
  absl::flat_hash_set<uint64_t> Executors() const;

  // Leases: see the contract. `now` is on the monotonic clock.
  Expiry Expire(absl::Time now);
  void ExtendLeases(absl::Time now);

 private:
  Options options_;
  absl::flat_hash_map<uint64_t, Session> sessions_;
  // Ended ids remembered, and the same oldest first.
  absl::flat_hash_set<uint64_t> ended_ids_;
  std::deque<uint64_t> ended_order_;
};

}  // namespace kvcm::cache_manager
