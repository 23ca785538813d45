#include "services/cache_manager/session_table.h"

#include <sys/random.h>

#include <algorithm>
#include <utility>

#include "common/base/check.h"

namespace kvcm::cache_manager {
namespace {

// A kept reply's buffer larger than this and than twice the next reply it holds is given
// back rather than reused.
constexpr size_t kKeptReplyCapacity = size_t{64} << 10;

uint64_t KernelRandom() {
  while (true) {
    uint64_t bits = 0;
    // Up to 256 bytes are never cut short once the pool is initialised; EINTR is retried.
    if (::getrandom(&bits, sizeof(bits), 0) == static_cast<ssize_t>(sizeof(bits))) return bits;
  }
}

}  // namespace

// --- Session: the retry ring ---------------------------------------------------------------

const SessionTable::Session::SentStep* SessionTable::Session::FindSentStep(
    uint64_t request_id) const {
  if (request_id == 0) return nullptr;
  for (const SentStep& sent : sent_steps) {
    if (sent.request_id == request_id) return &sent;
  }
  return nullptr;
}

void SessionTable::Session::KeepSentStep(uint64_t request_id, size_t request_hash,
                                         size_t request_size, std::span<const uint8_t> reply) {
  last_step_request_id = request_id;
  SentStep& sent = sent_steps[next_sent];
  next_sent = (next_sent + 1) % sent_steps.size();
  sent.request_id = request_id;
  sent.request_hash = request_hash;
  sent.request_size = request_size;
  if (sent.reply.capacity() > kKeptReplyCapacity && sent.reply.capacity() > 2 * reply.size()) {
    std::vector<uint8_t>().swap(sent.reply);
  }
  sent.reply.assign(reply.begin(), reply.end());
}

// --- SessionTable --------------------------------------------------------------------------

SessionTable::SessionTable(Options options) : options_(std::move(options)) {
  KVCM_CHECK(options_.ended_ids_kept > 0);
}

uint64_t SessionTable::NewId() {
  // Unguessable and below 2^53: a peer cannot name another's session by counting.
  while (true) {
    uint64_t id = options_.random ? options_.random() : KernelRandom();
    id &= (uint64_t{1} << 53) - 1;
    if (id != 0 && !sessions_.contains(id) && !ended_ids_.contains(id)) return id;
  }
}

SessionTable::Session& SessionTable::Add(Session session) {
  const uint64_t id = session.id;
  KVCM_CHECK(id != 0 && !ended_ids_.contains(id)) << "session id " << id << " was issued before";
  auto [it, added] = sessions_.emplace(id, std::move(session));
  KVCM_CHECK(added) << "session " << id << " is already live";
  return it->second;
}

std::optional<SessionTable::Session> SessionTable::Remove(uint64_t id) {
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return std::nullopt;
  // Remembered for a while, so that a late request is told its session ended.
  ended_ids_.insert(id);
  ended_order_.push_back(id);
  if (ended_order_.size() > options_.ended_ids_kept) {
    ended_ids_.erase(ended_order_.front());
    ended_order_.pop_front();
  }
  std::optional<Session> session(std::move(it->second));
  sessions_.erase(it);
  return session;
}

SessionTable::Session* SessionTable::Find(uint64_t id) {
  auto it = sessions_.find(id);
  return it == sessions_.end() ? nullptr : &it->second;
}

const SessionTable::Session* SessionTable::Find(uint64_t id) const {
  auto it = sessions_.find(id);
  return it == sessions_.end() ? nullptr : &it->second;
}

SessionTable::Checked SessionTable::Check(uint64_t epoch, uint64_t session_id,
                                          std::optional<pid_t> peer_pid) {
  if (epoch != options_.epoch) return {Refusal::kStaleEpoch, nullptr};
  Session* session = Find(session_id);
  if (session == nullptr) {
    return {ended_ids_.contains(session_id) ? Refusal::kEnded : Refusal::kNotRegistered, nullptr};
  }
  // A session the kernel vouched for accepts requests only with matching credentials:
  // never from tcp://, never from another process.
  if (session->pid_verified && (!peer_pid || *peer_pid != session->pid)) {
    return {Refusal::kOtherProcess, session};
  }
  if (session->quarantined) return {Refusal::kQuarantined, session};
  return {Refusal::kNone, session};
}

SessionTable::Registration SessionTable::PlanRegistration(pid_t pid, bool kernel_vouched) const {
  Registration registration;
  for (const auto& [id, session] : sessions_) {
    if (session.pid != pid) continue;
    if (session.quarantined && kernel_vouched && session.pid_verified) {
      registration.replaced.push_back(id);
    } else {
      ++registration.others;
    }
  }
  return registration;
}

std::vector<uint64_t> SessionTable::VerifiedSessionsOf(pid_t pid) const {
  std::vector<uint64_t> ids;
  for (const auto& [id, session] : sessions_) {
    if (session.pid == pid && session.pid_verified) ids.push_back(id);
  }
  return ids;
}

absl::flat_hash_set<uint64_t> SessionTable::Executors() const {
  absl::flat_hash_set<uint64_t> writers;
  for (const auto& [id, session] : sessions_) {
    if (session.role == SessionRole::kExecutor) writers.insert(id);
  }
  return writers;
}

SessionTable::Expiry SessionTable::Expire(absl::Time now) {
  Expiry expiry;
  for (auto& [id, session] : sessions_) {
    if (!session.quarantined && now - session.last_seen > options_.heartbeat_timeout) {
      session.quarantined = true;
      ++expiry.quarantined;
    }
  }
  // The three kinds below are disjoint, and ending one changes none of what decides the
  // others (only routers hold sequences; successors are live), so they are all found now
  // and ended in this order.
  //
  // A router whose pid cannot be verified (tcp://) can never be proven dead nor replaced:
  // once its lease ran out it ends, and its sequences drain behind a fence for the
  // executors, which are the writers (counted as lease_expired).
  for (const auto& [id, session] : sessions_) {
    if (session.quarantined && !session.pid_verified && session.num_seqs > 0) {
      expiry.to_end.push_back({id, ReclaimReason::kLeaseExpired, 0});
    }
  }
  // A process the kernel vouched for that holds a quarantined executor session and a live
  // one has given up the first: a Hello retried after its reply came too late (lost, or the
  // cache manager stalled) leaves a session the client never learnt of. It would never
  // answer nor be ended by its lease, and wait in every fence for ever. The process is one
  // writer (as when it registers again after quarantine), so its fences move to the live
  // session, which acknowledges them once it runs no step of theirs. Of two live ones, the
  // one heard from last: the other is likely unused too.
  absl::flat_hash_map<pid_t, uint64_t> live_executor;
  for (const auto& [id, session] : sessions_) {
    if (session.role != SessionRole::kExecutor || !session.pid_verified || session.quarantined) {
      continue;
    }
    auto [it, added] = live_executor.emplace(session.pid, id);
    if (!added && sessions_.at(it->second).last_seen < session.last_seen) it->second = id;
  }
  for (const auto& [id, session] : sessions_) {
    if (session.role != SessionRole::kExecutor || !session.pid_verified || !session.quarantined) {
      continue;
    }
    if (auto live = live_executor.find(session.pid); live != live_executor.end()) {
      expiry.to_end.push_back({id, ReclaimReason::kSessionReplaced, live->second});
    }
  }
  // Sessions holding nothing have nothing to quarantine: end them at once (a kvcmctl that
  // was killed between calls). An executor holds no sequences but may still be writing: it
  // stays (quarantined, and waiting in its fences) until it answers or its process is
  // proven dead.
  for (const auto& [id, session] : sessions_) {
    if (session.quarantined && session.num_seqs == 0 && session.role != SessionRole::kExecutor) {
      expiry.to_end.push_back({id, ReclaimReason::kClientDied, 0});
    }
  }
  return expiry;
}

void SessionTable::ExtendLeases(absl::Time now) {
  for (auto& [id, session] : sessions_) {
    if (!session.quarantined) session.last_seen = std::max(session.last_seen, now);
  }
}

}  // namespace kvcm::cache_manager
