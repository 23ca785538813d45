#include "services/cache_manager/step_applier.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/base/check.h"
#include "common/wire/step_codec.h"
#include "services/cache_manager/fence_table.h"

namespace kvcm::cache_manager {
namespace {

// A sequence id no router can allocate: the ledger's dry runs name it.
constexpr SeqId kDryRunSeq = ~SeqId{0};

// "op 3 (append): " and `what`.
StepRefusal Refuse(RejectReason reason, absl::StatusCode code, size_t i, const BlockOp& op,
                   absl::string_view what) {
  return StepRefusal{
      reason, absl::Status(code, absl::StrCat("op ", i, " (", BlockOpName(op.kind), "): ", what))};
}

StepRefusal Invalid(size_t i, const BlockOp& op, absl::string_view what) {
  return Refuse(RejectReason::kInvalidArgument, absl::StatusCode::kInvalidArgument, i, op, what);
}

}  // namespace

StepApplier::StepApplier(GroupedLedger* ledger, Options options)
    : ledger_(ledger), options_(options) {}

StepApplier::~StepApplier() = default;

// --- Validation ----------------------------------------------------------------------------
//
// Each check is a test that passes inline; only a failing one builds its StepRefusal. A
// decode step is a Commit and an Append per running sequence, and a refusal built or
// returned per check was most of the validation's time.

std::optional<StepRefusal> StepApplier::Validate(std::span<const BlockOp> ops,
                                                 const StepSession& session) {
  session_ = &session;
  live_seqs_ = session.num_seqs;
  max_tokens_ = int64_t{ledger_->num_blocks()} * ledger_->block_size();
  if (!step_seqs_.empty()) step_seqs_.clear();
  if (!step_drained_.empty()) step_drained_.clear();
  StepRefusal refusal;
  for (size_t i = 0; i < ops.size(); ++i) {
    const BlockOp& op = ops[i];
    bool ok = false;
    switch (op.kind) {
      case wire::StepOp::AllocateOp:
        ok = ValidateAllocate(i, op, &refusal);
        break;
      case wire::StepOp::AppendOp:
        ok = ValidateAppend(i, op, &refusal);
        break;
      case wire::StepOp::ForkOp:
        ok = ValidateFork(i, op, &refusal);
        break;
      case wire::StepOp::CommitOp:
        ok = ValidateCommit(i, op, &refusal);
        break;
      case wire::StepOp::CanAllocateOp:
        ok = ValidateCanAllocate(i, op, &refusal);
        break;
      case wire::StepOp::FreeOp:
        ok = ValidateFree(i, op, &refusal);
        break;
      default:  // DecodeStep let only the union's types through
        KVCM_CHECK(false) << "decoded step op of unknown type";
    }
    if (!ok) {
      session_ = nullptr;
      return refusal;
    }
  }
  session_ = nullptr;
  return std::nullopt;
}

bool StepApplier::ValidateAllocate(size_t i, const BlockOp& op, StepRefusal* refusal) {
  if (!CheckTokens(i, op, "num_tokens", refusal)) return false;
  if (!CheckHashes(i, op, " block hashes for ", refusal)) return false;
  if (!CheckNew(i, op, op.seq, refusal)) return false;
  if (!CheckRoom(i, op, refusal)) return false;
  step_seqs_[op.seq] = StepSeq{true, 0};
  return true;
}

bool StepApplier::ValidateAppend(size_t i, const BlockOp& op, StepRefusal* refusal) {
  return CheckTokens(i, op, "num_tokens", refusal) && CheckHeld(i, op, refusal);
}

bool StepApplier::ValidateFork(size_t i, const BlockOp& op, StepRefusal* refusal) {
  if (!CheckHeld(i, op, refusal)) return false;
  if (!CheckNew(i, op, op.child, refusal)) return false;
  if (!CheckRoom(i, op, refusal)) return false;
  const int32_t written = Writable(op.seq);
  step_seqs_[op.child] = StepSeq{true, written};
  return true;
}

bool StepApplier::ValidateCommit(size_t i, const BlockOp& op, StepRefusal* refusal) {
  if (!CheckTokens(i, op, "num_committed_tokens", refusal)) return false;
  if (!CheckHashes(i, op, " new block hashes for committing ", refusal)) return false;
  if (!CheckHeld(i, op, refusal)) return false;
  if (const auto block_size = static_cast<size_t>(ledger_->block_size());
      op.tokens.size() % block_size != 0 ||
      op.tokens.size() / block_size >
          static_cast<size_t>(std::max(op.num_tokens, 0)) / block_size) {
    *refusal = Invalid(i, op,
                       absl::StrCat("carries ", op.tokens.size(), " token ids for a commit of ",
                                    op.num_tokens, " tokens: give whole blocks of ", block_size,
                                    " tokens, the last full blocks ", "committed, or none"));
    return false;
  }
  if (const int32_t before = Writable(op.seq); op.num_tokens > before) {
    *refusal = Invalid(
        i, op,
        absl::StrCat("commits ", op.num_tokens, " tokens of sequence ", op.seq, ", which had ",
                     before,
                     " before this step: the KV of tokens added in the same step cannot have been "
                     "written yet (commit them in the next step)"));
    return false;
  }
  return true;
}

bool StepApplier::ValidateCanAllocate(size_t i, const BlockOp& op, StepRefusal* refusal) {
  return CheckTokens(i, op, "num_tokens", refusal) &&
         CheckHashes(i, op, " block hashes for ", refusal);
}

bool StepApplier::ValidateFree(size_t i, const BlockOp& op, StepRefusal* refusal) {
  if (op.seq >= kFirstDrainingSeq) {
    *refusal = Invalid(i, op,
                       absl::StrCat("sequence id ", op.seq,
                                    " is reserved (ids from 2^63 up are the "
                                    "cache manager's)"));
    return false;
  }
  // A sequence nobody holds (freed already: a retried free) fails alone, as NOT_FOUND in
  // its result; another session's is refused with the whole step.
  const Holder held = HolderOf(op.seq);
  if (held == Holder::kOtherSession) return CheckHeld(i, op, refusal);
  if (held == Holder::kThisSession) --live_seqs_;
  step_seqs_[op.seq].live = false;
  if (op.drain) step_drained_.insert(op.seq);
  return true;
}

bool StepApplier::CheckTokens(size_t i, const BlockOp& op, const char* field,
                              StepRefusal* refusal) const {
  if (op.num_tokens >= 0 && op.num_tokens <= max_tokens_) return true;
  *refusal = Invalid(i, op,
                     absl::StrCat(field, " = ", op.num_tokens, " is outside [0, ", max_tokens_,
                                  "] (the pool's capacity in tokens)"));
  return false;
}

// At most one hash per full block of the op's tokens.
bool StepApplier::CheckHashes(size_t i, const BlockOp& op, const char* what,
                              StepRefusal* refusal) const {
  if (static_cast<int64_t>(op.hashes.size()) <= op.num_tokens / ledger_->block_size()) {
    return true;
  }
  *refusal = Invalid(
      i, op,
      absl::StrCat(op.hashes.size(), what, op.num_tokens, " tokens (at most one per full block)"));
  return false;
}

// op.seq is held by this session after the ops so far.
bool StepApplier::CheckHeld(size_t i, const BlockOp& op, StepRefusal* refusal) const {
  const Holder held = HolderOf(op.seq);
  if (held == Holder::kThisSession) return true;
  if (held == Holder::kOtherSession) {
    *refusal = Refuse(RejectReason::kWrongOwner, absl::StatusCode::kPermissionDenied, i, op,
                      absl::StrCat("sequence ", op.seq, " belongs to another session"));
  } else {
    *refusal = Refuse(RejectReason::kUnknownSequence, absl::StatusCode::kNotFound, i, op,
                      absl::StrCat("sequence ", op.seq, " is not live"));
  }
  return false;
}

// `seq` may become live: not reserved, not drained by this session, not live now.
bool StepApplier::CheckNew(size_t i, const BlockOp& op, SeqId seq, StepRefusal* refusal) const {
  if (seq >= kFirstDrainingSeq) {
    *refusal = Invalid(i, op,
                       absl::StrCat("sequence id ", seq,
                                    " is reserved (ids from 2^63 up are the cache "
                                    "manager's)"));
    return false;
  }
  if ((session_->drained_ids != nullptr && session_->drained_ids->contains(seq)) ||
      step_drained_.contains(seq)) {
    *refusal = Invalid(i, op,
                       absl::StrCat("sequence id ", seq,
                                    " was freed with drain and cannot be live again "
                                    "(the executors refuse it for good): choose a "
                                    "new id"));
    return false;
  }
  auto it = step_seqs_.find(seq);
  const bool live = it != step_seqs_.end() ? it->second.live : ledger_->IsLive(seq);
  if (!live) return true;
  *refusal = Refuse(RejectReason::kDuplicateSequence, absl::StatusCode::kAlreadyExists, i, op,
                    absl::StrCat("sequence ", seq, " is already live"));
  return false;
}

// One more live sequence for the session.
bool StepApplier::CheckRoom(size_t i, const BlockOp& op, StepRefusal* refusal) {
  if (++live_seqs_ <= options_.max_sequences_per_session) return true;
  *refusal = Refuse(RejectReason::kLimitExceeded, absl::StatusCode::kResourceExhausted, i, op,
                    absl::StrCat("the session would hold more than ",
                                 options_.max_sequences_per_session, " live sequences, its limit"));
  return false;
}

StepApplier::Holder StepApplier::HolderOf(SeqId seq) const {
  if (!step_seqs_.empty()) {
    if (auto it = step_seqs_.find(seq); it != step_seqs_.end()) {
      return it->second.live ? Holder::kThisSession : Holder::kNobody;
    }
  }
  const uint64_t owner = ledger_->OwnerOf(seq);
  if (owner == 0) return Holder::kNobody;
  return owner == session_->id ? Holder::kThisSession : Holder::kOtherSession;
}

// The executors write a step's tokens only after its reply, so a Commit may cover only
// what its sequence had before the step (a fork's child: what its parent had).
int32_t StepApplier::Writable(SeqId seq) const {
  if (!step_seqs_.empty()) {
    if (auto it = step_seqs_.find(seq);
        it != step_seqs_.end() && it->second.written != StepSeq::kNotWritten) {
      return it->second.written;
    }
  }
  absl::StatusOr<int32_t> tokens = ledger_->NumTokens(seq);
  return tokens.ok() ? *tokens : 0;
}

// --- Application ---------------------------------------------------------------------------

StepApplier::Applied StepApplier::Apply(std::span<const BlockOp> ops, const StepSession& session,
                                        Effects& effects) {
  // Never shrunk: resize() would destroy the outcomes past ops.size() and their storage.
  if (outcomes_.size() < ops.size()) outcomes_.resize(ops.size());
  int32_t num_seqs = session.num_seqs;
  for (size_t i = 0; i < ops.size(); ++i) {
    num_seqs += ApplyOne(ops[i], session.id, effects, outcomes_[i]);
  }
  return Applied{std::span<const OpOutcome>(outcomes_.data(), ops.size()), num_seqs};
}

int32_t StepApplier::ApplyOne(const BlockOp& op, uint64_t session_id, Effects& effects,
                              OpOutcome& outcome) {
  outcome.status = absl::OkStatus();
  outcome.blocks.clear();
  outcome.copies.clear();
  outcome.group_blocks.clear();
  outcome.num_cached_tokens = 0;
  outcome.blocks_needed = 0;
  outcome.host_tokens = 0;
  outcome.disk_tokens = 0;
  switch (op.kind) {
    case wire::StepOp::AllocateOp:
      if (std::optional<absl::Status> loading = effects.BeforeAllocate(op, &outcome)) {
        outcome.status = *std::move(loading);
        return 0;
      }
      outcome.status =
          ledger_->Allocate(op.seq, op.num_tokens, op.hashes, &allocated_, &outcome.group_blocks);
      if (!outcome.status.ok()) return 0;
      KVCM_CHECK(ledger_->SetOwner(op.seq, session_id).ok());
      outcome.blocks.swap(allocated_.blocks);
      outcome.num_cached_tokens = allocated_.num_cached_tokens;
      return 1;
    case wire::StepOp::AppendOp:
      outcome.status = ledger_->Append(op.seq, op.num_tokens, &appended_, &outcome.group_blocks);
      if (!outcome.status.ok()) return 0;
      outcome.blocks.swap(appended_.new_blocks);
      outcome.copies.swap(appended_.copies);
      return 0;
    case wire::StepOp::ForkOp:
      outcome.status = ledger_->Fork(op.seq, op.child);
      if (!outcome.status.ok()) return 0;
      KVCM_CHECK(ledger_->SetOwner(op.child, session_id).ok());
      return 1;
    case wire::StepOp::CommitOp:
      outcome.status = ledger_->Commit(op.seq, op.num_tokens, op.hashes);
      if (outcome.status.ok() && !op.tokens.empty()) {
        effects.CommittedTokens(op.seq, op.num_tokens, op.tokens);
      }
      return 0;
    case wire::StepOp::FreeOp:
      if (ledger_->OwnerOf(op.seq) != session_id) {
        outcome.status = absl::NotFoundError(absl::StrCat("sequence ", op.seq, " is not live"));
        return 0;
      }
      if (op.drain) {
        // Its blocks wait until every executor stopped writing it (a SequenceFence).
        effects.Drain(op.seq);
        return -1;
      }
      outcome.status = ledger_->Free(op.seq);
      return outcome.status.ok() ? -1 : 0;
    case wire::StepOp::CanAllocateOp: {
      auto plan = ledger_->CanAllocate(kDryRunSeq, op.num_tokens, op.hashes);
      if (!plan.ok()) {
        outcome.status = plan.status();
        return 0;
      }
      outcome.num_cached_tokens = plan->prefix_hit_blocks * ledger_->block_size();
      outcome.blocks_needed = plan->blocks_needed;
      return 0;
    }
    default:
      KVCM_CHECK(false) << "op type passed validation but is unknown";
      return 0;
  }
}

}  // namespace kvcm::cache_manager
