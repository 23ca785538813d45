#pragma once

// StepApplier: a Step's ops checked against the block ledger and applied to it, as plain
// values: no messages, no sockets, no clock, no sessions table. The ops come in decoded
// (BlockOp, common/wire/step_codec.h), the facts it needs of the sending session come in as
// a StepSession, and the results go out as OpOutcomes in op order.
// CacheManagerService (cache_manager_service.h) owns one and keeps the rest of a Step:
// decoding the message, the session checks (only a router's Steps reach here), the retry
// ring, the reply's size bound and its encoding; it does the effects beyond the ledger
// (a drain's fence, a commit's token ids) when Apply() calls them, in op order.
//
// Contract (docs/protocol.md, "Step — one round trip per scheduler step"):
// - Validate() checks the whole op list against the ledger as the ops before each would
//   leave it, changing nothing in the ledger: token counts in [0, num_blocks x
//   block_size]; at most one hash per full block; every sequence named live and held by
//   this session (or allocated or forked earlier in the same step and not freed since);
//   a new id neither live, nor reserved (>= kFirstDrainingSeq, docs/architecture.md,
//   "Fencing"), nor freed with drain by this session; at most max_sequences_per_session
//   live sequences after each op; a Commit covering only tokens its sequence had before
//   the step (a fork's child: its parent's), with whole blocks of token ids, no more than
//   it commits. The first op that fails is the answer: a StepRefusal naming it ("op 3
//   (append): sequence 17 is not live"), and the whole Step is refused.
// - A Free of a sequence nobody holds (a retried free) passes validation and fails alone
//   in its result (NOT_FOUND); another session's sequence refuses the whole Step.
// - Apply() runs validated ops in order, each all-or-nothing in the ledger: an op the
//   ledger refuses (RESOURCE_EXHAUSTED, ...) gets that status in its outcome, changes
//   nothing, and the ops after it still run. It sets the session as owner of what it
//   allocates or forks (BlockLedger::SetOwner), and returns one outcome per op, in op
//   order, and the session's count of live sequences after them.
// - Storage (the outcomes' vectors, the step's table of sequences) is reused from Step to
//   Step: a decode step (a Commit and an Append per running sequence) allocates nothing
//   once grown. The outcomes stay valid until the next Validate() or Apply().
//
// Thread safety: none; one thread (the service's) owns it.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "common/block/block_ledger.h"
#include "common/block/grouped_ledger.h"
#include "services/cache_manager/cache_manager_metrics.h"

// Defined in common/wire/step_codec.h, which the callers include.
namespace kvcm {
struct BlockOp;
struct OpOutcome;
}  // namespace kvcm

namespace kvcm::cache_manager {

// What the applier needs of the session that sent the Step.
struct StepSession {
  uint64_t id = 0;       // the owner of its sequences in the ledger (never 0)
  int32_t num_seqs = 0;  // live sequences it holds before the step
  // Ids it freed with drain (SessionTable::Session::drained_ids); null: none.
  const absl::flat_hash_set<SeqId>* drained_ids = nullptr;
};

// Why Validate() refused a Step: the reason it is counted under, and the code and the
// message of the ErrorReply (absl::StatusCode, as the wire's ErrorCode maps it).
struct StepRefusal {
  RejectReason reason = RejectReason::kInvalidArgument;
  absl::Status status;  // never OK
};

class StepApplier {
 public:
  struct Options {
    int32_t max_sequences_per_session = 1 << 20;  // > 0
  };

  // What Apply() asks the caller to do beyond the ledger, at the op's place in the order.
  class Effects {
   public:
    virtual ~Effects() = default;
    // A Free with drain of `seq`, which the session holds: the caller takes it from the
    // session (remembering the id as drained) and fences its blocks. The applier counts it
    // as no longer the session's.
    virtual void Drain(SeqId seq) = 0;
    // A Commit of `seq` that carried token ids succeeded (called only when `tokens` is not
    // empty).
    virtual void CommittedTokens(SeqId seq, int32_t num_committed_tokens,
                                 std::span<const int32_t> tokens) = 0;
    // Before an Allocate runs: a status to refuse it with instead (its prefix is loading
    // from a tier, tier_coordinator.h), with `outcome`'s tier counts set; nullopt to run it.
    virtual std::optional<absl::Status> BeforeAllocate(const BlockOp& op, OpOutcome* outcome) {
      (void)op;
      (void)outcome;
      return std::nullopt;
    }
  };

  struct Applied {
    std::span<const OpOutcome> outcomes;  // one per op, in op order
    int32_t num_seqs = 0;                 // the session's live sequences after the ops
  };

  // `ledger` must outlive the applier.
  StepApplier(GroupedLedger* ledger, Options options);
  ~StepApplier();
  StepApplier(const StepApplier&) = delete;
  StepApplier& operator=(const StepApplier&) = delete;

  // Checks `ops` for `session` (see the contract); nullopt when every op passes.
  std::optional<StepRefusal> Validate(std::span<const BlockOp> ops, const StepSession& session);

  // Applies `ops`, which Validate() passed for `session` with the ledger as it is now.
  Applied Apply(std::span<const BlockOp> ops, const StepSession& session, Effects& effects);

 private:
  // A sequence a Step's ops so far allocated, forked or freed (one table, so that an op
  // touches one entry): whether it is live after them, and the tokens an allocated or
  // forked one had before the step (kNotWritten for one only freed: the ledger knows).
  struct StepSeq {
    static constexpr int32_t kNotWritten = -1;
    bool live = false;
    int32_t written = kNotWritten;
  };
  // Who holds a sequence after the ops validated so far.
  enum class Holder { kThisSession, kOtherSession, kNobody };

  // One check per op kind: true when the op passes (and the step's table records it);
  // otherwise false with *refusal set. `i` is the op's index, for the message.
  bool ValidateAllocate(size_t i, const BlockOp& op, StepRefusal* refusal);
  bool ValidateAppend(size_t i, const BlockOp& op, StepRefusal* refusal);
  bool ValidateFork(size_t i, const BlockOp& op, StepRefusal* refusal);
  bool ValidateCommit(size_t i, const BlockOp& op, StepRefusal* refusal);
  bool ValidateCanAllocate(size_t i, const BlockOp& op, StepRefusal* refusal);
  bool ValidateFree(size_t i, const BlockOp& op, StepRefusal* refusal);

  // Shared checks; each sets *refusal when it fails.
  bool CheckTokens(size_t i, const BlockOp& op, const char* field, StepRefusal* refusal) const;
  bool CheckHashes(size_t i, const BlockOp& op, const char* what, StepRefusal* refusal) const;
  bool CheckHeld(size_t i, const BlockOp& op, StepRefusal* refusal) const;
  bool CheckNew(size_t i, const BlockOp& op, SeqId seq, StepRefusal* refusal) const;
  bool CheckRoom(size_t i, const BlockOp& op, StepRefusal* refusal);
  Holder HolderOf(SeqId seq) const;
  // Tokens of `seq` whose KV can be written by now: those it had before this step.
  int32_t Writable(SeqId seq) const;

  // Applies one op into `outcome`; returns the change in the session's live sequences.
  int32_t ApplyOne(const BlockOp& op, uint64_t session_id, Effects& effects, OpOutcome& outcome);

  GroupedLedger* const ledger_;
  const Options options_;

  // Validate()'s state for the Step being checked.
  const StepSession* session_ = nullptr;
  int64_t live_seqs_ = 0;  // live sequences of the session after the ops so far
  int64_t max_tokens_ = 0;
  // Only the steps that allocate, fork or free put anything in these: a decode step
  // leaves them empty, and its lookups skip them.
  absl::flat_hash_map<SeqId, StepSeq> step_seqs_;
  absl::flat_hash_set<SeqId> step_drained_;  // freed with drain by the step

  // Apply()'s results, their storage reused.
  std::vector<OpOutcome> outcomes_;
  // What the ledger answers an Allocate or Append into; swapped with the outcomes'
  // vectors, so that neither allocates once grown.
  AllocateResult allocated_;
  AppendResult appended_;
};

}  // namespace kvcm::cache_manager
