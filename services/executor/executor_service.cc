#include "services/executor/executor_service.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/base/check.h"
#include "common/base/log.h"
#include "common/base/monotonic_clock.h"
#include "common/base/status_macros.h"
#include "kernels/copy_blocks.h"
#include "kernels/cpu_thread_pool.h"
#include "services/executor/kv_groups.h"
#include "services/executor/model/sampler.h"

namespace kvcm::executor {
namespace {

constexpr char kComponent[] = "kvcm-executor";
// Between two failed fence acknowledgements. Short: the blocks stay draining meanwhile.
// Not shorter: each attempt may block the socket thread for a call timeout.
constexpr absl::Duration kFenceAckRetry = absl::Seconds(1);

std::string SeqName(size_t index, uint64_t seq) {
  return absl::StrCat("seq[", index, "] (id ", seq, ")");
}

StepError ErrorKind(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kUnavailable:
      return StepError::kNoPool;
    case absl::StatusCode::kAborted:
      return StepError::kStaleEpoch;
    case absl::StatusCode::kInvalidArgument:
      return StepError::kInvalidArgument;
    case absl::StatusCode::kCancelled:
      return StepError::kFenced;
    default:
      return StepError::kInternal;
  }
}

wire::ErrorCode WireCodeFor(const absl::Status& status) {
  // ABORTED has no generic wire code; on this path it always means a stale epoch. CANCELLED
  // means the router session was fenced: it is gone as far as the cache manager knows.
  if (absl::IsAborted(status)) return wire::ErrorCode::StaleEpoch;
  if (absl::IsCancelled(status)) return wire::ErrorCode::StaleSession;
  return ToWireCode(status.code());
}

}  // namespace

ExecutorService::ExecutorService(Options options, const ExecutorModel* model, PoolSource* pool,
                                 ExecutorMetrics* metrics)
    : options_(std::move(options)), model_(model), pool_(pool), metrics_(metrics) {
  KVCM_CHECK(model_ != nullptr && pool_ != nullptr);
  const LlamaConfig& c = model_->host().config();
  model_info_.name = options_.model_name;
  model_info_.num_layers = c.num_hidden_layers;
  model_info_.hidden_size = c.hidden_size;
  model_info_.num_attention_heads = c.num_attention_heads;
  model_info_.num_kv_heads = c.num_key_value_heads;
  model_info_.head_dim = c.head_dim;
  model_info_.vocab_size = c.vocab_size;
  model_info_.max_position_embeddings = c.max_position_embeddings;
  model_info_.eos_token_ids = c.eos_token_ids;
  end_ids_ = c.eos_token_ids;
  for (const int32_t id : options_.end_token_ids) {
    if (std::find(end_ids_.begin(), end_ids_.end(), id) == end_ids_.end()) end_ids_.push_back(id);
  }
  // The checkpoint's dtype, as written in config.json (weights compute in fp32).
  absl::StatusOr<DType> dtype = ParseDType(c.torch_dtype.empty() ? "fp32" : c.torch_dtype);
  model_info_.weight_dtype = dtype.ok() ? *dtype : DType::kFloat32;
}

uint64_t ExecutorService::attached_epoch() const {
  const PoolView* pool = pool_->pool();
  return pool == nullptr ? 0 : pool->epoch;
}

// ---- From the router ------------------------------------------------------------------------

ExecutorService::Handled ExecutorService::Handle(std::span<const uint8_t> bytes, absl::Time now,
                                                 flatbuffers::FlatBufferBuilder* reply) {
  Handled handled;
  reply->Clear();
  const VerifiedExecutorEnvelope verified =
      VerifyExecutorEnvelope(bytes, options_.max_message_bytes);
  if (verified.envelope == nullptr) {
    const wire::ErrorCode code = verified.fault == EnvelopeFault::kUnsupportedVersion
                                     ? wire::ErrorCode::UnsupportedVersion
                                     : wire::ErrorCode::Malformed;
    // Named by its request id when that much could be read (0 otherwise).
    Refuse(verified.request_id, code, verified.reason, StepError::kMalformed, reply);
    handled.reply = true;
    return handled;
  }
  const wire::ExecutorEnvelope& envelope = *verified.envelope;
  handled.type = envelope.payload_type();
  switch (envelope.payload_type()) {
    case wire::ExecutorMessage::StepBatch:
      HandleStep(envelope, now, reply);
      handled.reply = true;
      return handled;
    case wire::ExecutorMessage::Heartbeat:
      FinishExecutorEnvelope(*reply, envelope.request_id(), executor_id_, attached_epoch(),
                             wire::ExecutorMessage::HeartbeatReply,
                             wire::CreateHeartbeatReply(*reply).Union());
      handled.reply = true;
      return handled;
    case wire::ExecutorMessage::ExecutorHelloReply: {
      // Answers to our earlier Hellos (retries) count the same; with none pending, a stray.
      if (hello_request_id_ == 0) return handled;
      const auto* hello = envelope.payload_as_ExecutorHelloReply();
      if (hello->executor_id() == 0) {
        LogLine(kComponent, "the router answered ExecutorHello with executor id 0; ignored");
        return handled;
      }
      if (executor_id_ != hello->executor_id()) {
        LogLine(kComponent,
                absl::StrCat("registered with the router as executor ", hello->executor_id()));
      }
      executor_id_ = hello->executor_id();
      heartbeat_interval_ = absl::Milliseconds(hello->heartbeat_interval_ms());
      hello_request_id_ = 0;
      hello_needed_ = false;
      return handled;
    }
    case wire::ExecutorMessage::Goodbye:
      // The router is going away: forget the registration; Hello again when it is back.
      FinishExecutorEnvelope(*reply, envelope.request_id(), executor_id_, attached_epoch(),
                             wire::ExecutorMessage::GoodbyeReply,
                             wire::CreateGoodbyeReply(*reply, 0).Union());
      if (registered()) LogLine(kComponent, "the router said goodbye");
      executor_id_ = 0;
      hello_needed_ = true;
      hello_request_id_ = 0;
      handled.reply = true;
      return handled;
    case wire::ExecutorMessage::GoodbyeReply:
      goodbye_answered_ = true;
      return handled;
    case wire::ExecutorMessage::HeartbeatReply:
      return handled;
    case wire::ExecutorMessage::ErrorReply: {
      const auto* error = envelope.payload_as_ErrorReply();
      if (error->code() == wire::ErrorCode::NotRegistered ||
          error->code() == wire::ErrorCode::StaleSession) {
        // The router restarted or forgot this executor: introduce ourselves again.
        if (registered()) {
          LogLine(kComponent, "the router no longer knows this executor; sending ExecutorHello");
        }
        executor_id_ = 0;
        hello_needed_ = true;
        hello_request_id_ = 0;
      } else {
        LogLine(kComponent, absl::StrCat("the router refused request ", envelope.request_id(), ": ",
                                         std::string(WireCodeName(error->code())), " ",
                                         error->reason() == nullptr ? "" : error->reason()->str()));
      }
      return handled;
    }
    default:
      Refuse(envelope.request_id(), wire::ErrorCode::InvalidArgument,
             absl::StrCat("an executor does not accept ",
                          std::string(ExecutorMessageName(envelope.payload_type()))),
             StepError::kInvalidArgument, reply);
      handled.reply = true;
      return handled;
  }
}

void ExecutorService::Refuse(uint64_t request_id, wire::ErrorCode code, std::string_view reason,
                             StepError error, flatbuffers::FlatBufferBuilder* reply) {
  reply->Clear();
  FinishExecutorError(*reply, request_id, executor_id_, attached_epoch(), code, reason);
  if (metrics_ != nullptr) metrics_->CountStepError(error);
}

void ExecutorService::HandleStep(const wire::ExecutorEnvelope& envelope, absl::Time received,
                                 flatbuffers::FlatBufferBuilder* reply) {
  absl::StatusOr<StepBatch> step = DecodeStepBatch(*envelope.payload_as_StepBatch());
  if (!step.ok()) {
    Refuse(envelope.request_id(), wire::ErrorCode::InvalidArgument,
           std::string(step.status().message()), StepError::kInvalidArgument, reply);
    return;
  }
  absl::StatusOr<StepResult> report = RunStep(*step);
  if (!report.ok()) {
    Refuse(envelope.request_id(), WireCodeFor(report.status()),
           std::string(report.status().message()), ErrorKind(report.status()), reply);
    return;
  }
  const double seconds = absl::ToDoubleSeconds(MonotonicNow() - received);
  report->duration_us = static_cast<uint64_t>(std::max(0.0, seconds * 1e6));
  reply->Clear();
  EncodeStepResult(*reply, envelope.request_id(), executor_id_, attached_epoch(), *report);
  if (metrics_ != nullptr) {
    int32_t sampled = 0;
    for (const SeqResult& outcome : report->results) sampled += outcome.token >= 0 ? 1 : 0;
    metrics_->ObserveStep(static_cast<int32_t>(step->seqs.size()), report->prefill_tokens,
                          report->decode_tokens, sampled, seconds);
  }
}

absl::StatusOr<const PoolView*> ExecutorService::PoolForEpoch(uint64_t epoch) {
  const PoolView* pool = pool_->pool();
  if (pool != nullptr && epoch == pool->epoch) return pool;
  // Epochs are compared for equality only (docs/architecture.md, "Leases"). Another epoch
  // than the pool's: only the cache manager can say which is current.
  if (pool != nullptr) {
    absl::StatusOr<bool> current = pool_->AttachedEpochIsCurrent();
    if (!current.ok()) {
      return absl::AbortedError(absl::StrCat(
          "stale epoch: the step is of cache-manager epoch ", epoch, ", the pool attached of ",
          pool->epoch,
          ", and the cache manager cannot say which is current: ", current.status().message()));
    }
    if (*current) {
      return absl::AbortedError(
          absl::StrCat("stale epoch: the step's block tables are of cache-manager epoch ", epoch,
                       " but the cache manager runs epoch ", pool->epoch,
                       ", the pool attached (re-admit the sequences)"));
    }
  }
  // The attached epoch is gone (the cache manager restarted and the heartbeat has not told
  // us yet), or nothing is attached: attach again now; the weights stay loaded.
  const uint64_t before = pool == nullptr ? 0 : pool->epoch;
  const absl::Status reattached = pool_->Reattach();
  pool = pool_->pool();
  if (!reattached.ok() || pool == nullptr) {
    if (before == 0 && epoch == 0) {
      return absl::UnavailableError(absl::StrCat("no pool attached: ", reattached.message()));
    }
    return absl::AbortedError(absl::StrCat("stale epoch, re-attaching: the step is of epoch ",
                                           epoch, "; attaching failed: ", reattached.message()));
  }
  if (pool->epoch != epoch) {
    return absl::AbortedError(absl::StrCat("stale epoch, re-attaching: the step is of epoch ",
                                           epoch, " but the cache manager is in epoch ",
                                           pool->epoch));
  }
  // Attached to the step's epoch only now: when the step was sent this executor had no
  // session in it, so a fence of the router session that sent it (which may have ended
  // since) need not wait for this executor, and its blocks may be another sequence's by
  // now (docs/architecture.md, "Fencing"). Refused; the next Hello announces the epoch,
  // and the router sends steps of it from then on.
  return absl::AbortedError(absl::StrCat(
      "stale epoch, re-attached: the step is of cache-manager epoch ", epoch,
      ", in which this executor was not registered when it was sent; steps of it run once "
      "the router has its Hello in that epoch"));
}

namespace {

// One table of a sequence (`name`, e.g. "block_table"): within the pool, and -1 only for a
// block wholly behind the window its layers read (the first `released` entries), which the
// cache manager has released.
absl::Status CheckTable(size_t index, const SeqWork& s, const char* name,
                        std::span<const BlockId> table, int64_t released, int32_t block_size,
                        int32_t num_blocks) {
  for (size_t j = 0; j < table.size(); ++j) {
    if (table[j] == -1 && static_cast<int64_t>(j) >= released) {
      return absl::InvalidArgumentError(absl::StrCat(
          SeqName(index, s.seq), " has no block at ", name, "[", j,
          "], which its window still reads (the pool releases only blocks wholly before ",
          released * block_size, ")"));
    }
    if (table[j] >= num_blocks) {
      return absl::InvalidArgumentError(absl::StrCat(SeqName(index, s.seq), " names block ",
                                                     table[j], " at ", name, "[", j,
                                                     "]; the pool has ", num_blocks, " blocks"));
    }
  }
  return absl::OkStatus();
}

// With KV cache groups, the tables of groups 1.. (SeqWork::group_tables): one per group
// after the first, each checked as block_table with its group's window. Without groups
// there must be none: a step that does not fit the pool is refused, never misread.
absl::Status CheckGroupTables(size_t index, const SeqWork& s, const PoolView& pool) {
  const size_t len = s.block_table.size();
  const size_t want = (static_cast<size_t>(NumBlockTables(pool)) - 1) * len;
  if (s.group_tables.size() != want) {
    return absl::InvalidArgumentError(
        absl::StrCat(SeqName(index, s.seq), " has ", s.group_tables.size(),
                     " group table entries; the pool has ", pool.kv_groups.size(),
                     " KV cache groups, so it needs ", want, " (a table of ", len,
                     " entries for each group after the first)"));
  }
  const int64_t first_query = s.context_len - static_cast<int64_t>(s.tokens.size());
  for (size_t g = 1; g < pool.kv_groups.size(); ++g) {
    const std::span<const BlockId> table(s.group_tables.data() + (g - 1) * len, len);
    const std::string name = absl::StrCat("group_tables (KV cache group ", g, ")");
    KVCM_RETURN_IF_ERROR(
        CheckTable(index, s, name.c_str(), table,
                   ReleasedBlocks(pool.kv_groups[g].window, first_query, pool.spec.block_size),
                   pool.spec.block_size, pool.num_blocks));
  }
  return absl::OkStatus();
}

// Each sequence's block tables (one per KV cache group, one without groups): long enough for
// its context, within the pool (-1 only for a block wholly behind the window of the table's
// layers: the pool's sliding window without groups, the group's own with them; released
// by the cache manager), and all of them within `max_entries` once made dense (max_blocks
// wide); its new tokens are counted.
absl::Status CheckBlockTables(const StepBatch& step, const PoolView& pool, size_t max_entries,
                              size_t* max_blocks, int64_t* total_tokens) {
  const int32_t block_size = pool.spec.block_size;
  const int32_t num_blocks = pool.num_blocks;
  // Group 0's table is block_table.
  const int32_t window =
      pool.kv_groups.empty() ? pool.sliding_window_tokens : pool.kv_groups[0].window;
  for (size_t i = 0; i < step.seqs.size(); ++i) {
    const SeqWork& s = step.seqs[i];
    const int64_t first_query = s.context_len - static_cast<int64_t>(s.tokens.size());
    const int64_t needed = (int64_t{s.context_len} + block_size - 1) / block_size;
    if (needed > num_blocks || static_cast<int64_t>(s.block_table.size()) > num_blocks) {
      return absl::InvalidArgumentError(
          absl::StrCat(SeqName(i, s.seq), " has context_len ", s.context_len, " and ",
                       s.block_table.size(), " blocks in its table; the pool holds ", num_blocks,
                       " blocks of ", block_size, " tokens"));
    }
    if (static_cast<int64_t>(s.block_table.size()) < needed) {
      return absl::InvalidArgumentError(absl::StrCat(
          SeqName(i, s.seq), " has ", s.block_table.size(), " blocks in its table; context_len ",
          s.context_len, " needs ", needed, " blocks of ", block_size, " tokens"));
    }
    KVCM_RETURN_IF_ERROR(CheckTable(i, s, "block_table", s.block_table,
                                    ReleasedBlocks(window, first_query, block_size), block_size,
                                    num_blocks));
    KVCM_RETURN_IF_ERROR(CheckGroupTables(i, s, pool));
    // Entries past the context are never read: the dense table keeps only what is needed.
    *max_blocks = std::max(*max_blocks, static_cast<size_t>(needed));
    *total_tokens += static_cast<int64_t>(s.tokens.size());
  }
  const size_t tables = static_cast<size_t>(NumBlockTables(pool));
  if (step.seqs.size() * *max_blocks * tables > max_entries) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the step's block tables would take ", step.seqs.size(), " sequences x ", *max_blocks,
        " blocks", tables > 1 ? absl::StrCat(" x ", tables, " KV cache groups") : "",
        ", more than the ", max_entries, " entries one step may use"));
  }
  return absl::OkStatus();
}

// Copy orders within the pool, no destination twice, none copied from after it is written.
absl::Status CheckCopies(const StepBatch& step, int32_t num_blocks) {
  absl::flat_hash_set<int32_t> destinations;
  for (size_t i = 0; i < step.copies.size(); ++i) {
    const auto [src, dst] = step.copies[i];
    if (src >= num_blocks || dst >= num_blocks) {
      return absl::InvalidArgumentError(absl::StrCat(
          "copies[", i, "] ", src, " -> ", dst, " names a block outside the pool's ", num_blocks));
    }
    if (src == dst || !destinations.insert(dst).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("copies[", i, "] ", src, " -> ", dst, " repeats a destination"));
    }
  }
  for (size_t i = 0; i < step.copies.size(); ++i) {
    if (destinations.contains(step.copies[i].src)) {
      return absl::InvalidArgumentError(
          absl::StrCat("copies[", i, "] copies from block ", step.copies[i].src,
                       ", which another order of the step overwrites"));
    }
  }

  return absl::OkStatus();
}

// Penalty and scored tokens within the vocabulary.
absl::Status CheckTokenIds(const StepBatch& step, int32_t vocab) {
  for (size_t i = 0; i < step.seqs.size(); ++i) {
    const SeqWork& s = step.seqs[i];
    for (int32_t token : s.penalty_tokens) {
      if (token >= vocab) {
        return absl::InvalidArgumentError(absl::StrCat(
            SeqName(i, s.seq), " has penalty token ", token, " outside the vocabulary of ", vocab));
      }
    }
    if (s.score_next >= vocab) {
      return absl::InvalidArgumentError(absl::StrCat(SeqName(i, s.seq), " asks to score token ",
                                                     s.score_next, " outside the vocabulary of ",
                                                     vocab));
    }
  }

  return absl::OkStatus();
}

}  // namespace

absl::Status ExecutorService::CheckAndBuild(const StepBatch& step, const PoolView& pool) {
  size_t max_blocks = 1;
  int64_t total_tokens = 0;
  KVCM_RETURN_IF_ERROR(
      CheckBlockTables(step, pool, options_.max_block_table_entries, &max_blocks, &total_tokens));
  KVCM_RETURN_IF_ERROR(CheckCopies(step, pool.num_blocks));
  KVCM_RETURN_IF_ERROR(CheckTokenIds(step, model_->host().config().vocab_size));
  BuildForward(step, max_blocks, total_tokens, NumBlockTables(pool));
  // The pool was checked against the model when attached; Forward checks it again, but only
  // after the copies ran: check first so that a refusal changes nothing.
  if (absl::Status fits = model_->host().CheckPool(pool); !fits.ok()) {
    return absl::InternalError(
        absl::StrCat("the attached pool does not fit the model: ", fits.message()));
  }
  return model_->host().CheckBatch(forward_, pool);
}

// The step's sequences as one batch of the model's forward (forward_), block tables dense
// and max_blocks wide: group 0's in block_tables, those of groups 1 .. num_tables - 1 in
// group_block_tables (empty without KV cache groups).
void ExecutorService::BuildForward(const StepBatch& step, size_t max_blocks, int64_t total_tokens,
                                   int32_t num_tables) {
  forward_.token_ids.clear();
  forward_.query_lens.clear();
  forward_.context_lens.clear();
  forward_.all_logits.clear();
  forward_.token_ids.reserve(static_cast<size_t>(total_tokens));
  forward_.max_blocks_per_seq = static_cast<int32_t>(max_blocks);
  forward_.block_tables.assign(step.seqs.size() * max_blocks, 0);
  for (size_t i = 0; i < step.seqs.size(); ++i) {
    const SeqWork& s = step.seqs[i];
    forward_.token_ids.insert(forward_.token_ids.end(), s.tokens.begin(), s.tokens.end());
    forward_.query_lens.push_back(static_cast<int32_t>(s.tokens.size()));
    forward_.context_lens.push_back(s.context_len);
    if (s.input_logprobs) {
      forward_.all_logits.resize(step.seqs.size(), 0);
      forward_.all_logits[i] = 1;
    }
    const size_t used = std::min(s.block_table.size(), max_blocks);
    std::copy(s.block_table.begin(), s.block_table.begin() + static_cast<std::ptrdiff_t>(used),
              forward_.block_tables.begin() + static_cast<std::ptrdiff_t>(i * max_blocks));
  }
  forward_.group_block_tables.clear();
  if (num_tables <= 1) return;
  const size_t table_entries = step.seqs.size() * max_blocks;
  forward_.group_block_tables.assign(static_cast<size_t>(num_tables - 1) * table_entries, 0);
  for (size_t g = 1; g < static_cast<size_t>(num_tables); ++g) {
    for (size_t i = 0; i < step.seqs.size(); ++i) {
      const SeqWork& s = step.seqs[i];
      // Checked: group_tables holds (num_tables - 1) tables as long as block_table.
      const size_t len = s.block_table.size();
      const auto from = s.group_tables.begin() + static_cast<std::ptrdiff_t>((g - 1) * len);
      std::copy(from, from + static_cast<std::ptrdiff_t>(std::min(len, max_blocks)),
                forward_.group_block_tables.begin() +
                    static_cast<std::ptrdiff_t>((g - 1) * table_entries + i * max_blocks));
    }
  }
}

absl::Status ExecutorService::CheckNotFenced(const StepBatch& step) const {
  if (fenced_.contains(step.router_session)) {
    return absl::CancelledError(absl::StrCat(
        "router session ", step.router_session,
        " was fenced by the cache manager (its router ended): its blocks may belong to "
        "someone else now, so this executor writes nothing for it"));
  }
  for (const SeqWork& s : step.seqs) {
    if (fenced_seqs_.contains({step.router_session, s.seq})) {
      return absl::CancelledError(absl::StrCat(
          "sequence ", s.seq, " of router session ", step.router_session,
          " was fenced by the cache manager (freed while an executor may still write it): "
          "its blocks may belong to someone else now"));
    }
  }
  return absl::OkStatus();
}

void ExecutorService::RecordFence(const FenceNotice& fence) {
  if (fence.seqs.empty()) {
    fenced_.insert(fence.router_session);
    return;
  }
  for (uint64_t seq : fence.seqs) fenced_seqs_.insert({fence.router_session, seq});
}

bool ExecutorService::FenceNames(const StepBatch& step) {
  bool named = false;
  for (const FenceNotice& fence : pool_->PendingFences()) {
    if (fence.router_session != step.router_session) continue;
    bool hits = fence.seqs.empty();
    for (size_t i = 0; !hits && i < step.seqs.size(); ++i) {
      hits = std::find(fence.seqs.begin(), fence.seqs.end(), step.seqs[i].seq) != fence.seqs.end();
    }
    if (hits) {
      RecordFence(fence);
      named = true;
    }
  }
  return named;
}

bool ExecutorService::FencedSinceStepBegan(const StepBatch& step) {
  const uint64_t generation = pool_->fence_generation();
  if (generation == seen_fence_generation_) return false;
  seen_fence_generation_ = generation;
  return FenceNames(step);
}

int ExecutorService::ApplyFences() {
  // Called every loop turn: nothing to do unless the fences changed, or an acknowledgement
  // failed (the cache manager is down or busy) and its retry is due. Each attempt may block
  // for a call timeout, so failed ones are spaced.
  const uint64_t generation = pool_->fence_generation();
  if (generation == applied_fence_generation_ &&
      (!fence_ack_failed_ || MonotonicNow() < fence_ack_retry_at_)) {
    return 0;
  }
  applied_fence_generation_ = generation;
  const std::vector<FenceNotice> fences = pool_->PendingFences();
  if (fences.empty()) {
    fence_ack_failed_ = false;
    return 0;
  }
  // Between steps: nothing runs. From here on every step of these sessions is refused, so
  // the acknowledgement is true when it leaves.
  std::vector<uint64_t> ids;
  ids.reserve(fences.size());
  for (const FenceNotice& fence : fences) {
    RecordFence(fence);
    ids.push_back(fence.id);
  }
  if (absl::Status acked = pool_->AcknowledgeFences(ids); !acked.ok()) {
    if (!fence_ack_failed_) {
      LogLine(kComponent,
              absl::StrCat("cannot acknowledge ", ids.size(), " fence(s) yet (retrying every ",
                           absl::FormatDuration(kFenceAckRetry), "): ", acked.message()));
    }
    fence_ack_failed_ = true;
    fence_ack_retry_at_ = MonotonicNow() + kFenceAckRetry;
    return 0;
  }
  fence_ack_failed_ = false;
  for (const FenceNotice& fence : fences) {
    LogLine(
        kComponent,
        absl::StrCat("fenced ",
                     fence.seqs.empty() ? "" : absl::StrCat(fence.seqs.size(), " sequence(s) of "),
                     "router session ", fence.router_session,
                     ": no step of it runs here any more (fence ", fence.id, " acknowledged)"));
  }
  return static_cast<int>(fences.size());
}

absl::StatusOr<StepResult> ExecutorService::RunStep(const StepBatch& step) {
  KVCM_RETURN_IF_ERROR(CheckNotFenced(step));
  absl::StatusOr<const PoolView*> found = PoolForEpoch(step.epoch);
  if (!found.ok()) return found.status();
  const PoolView& pool = **found;
  if (absl::Status checked = CheckAndBuild(step, pool); !checked.ok()) return checked;
  // A fence the heartbeat thread learnt of since the last ApplyFences: nothing written yet.
  seen_fence_generation_ = pool_->fence_generation();
  if (FenceNames(step)) return CheckNotFenced(step);

  StepResult report;
  report.step_id = step.step_id;
  report.results.reserve(step.seqs.size());
  if (!step.copies.empty()) {
    std::vector<kernels::BlockCopy> copies;
    copies.reserve(step.copies.size());
    for (const CopyOrder& copy : step.copies) copies.push_back({copy.src, copy.dst});
    if (absl::Status copied = model_->CopyBlocks(pool, copies); !copied.ok()) {
      return absl::InternalError(absl::StrCat("copy-on-write failed: ", copied.message()));
    }
  }
  if (!step.seqs.empty()) {
    // Between layers: a fault test's delay, and the check that the router was not fenced
    // meanwhile (the cache-manager heartbeat thread may have learnt so mid-step).
    const std::function<bool(int32_t)> after_layer = [&](int32_t) {
      const absl::Time until = MonotonicNow() + options_.fault_layer_delay;
      while (true) {
        pool_->NoteProgress();  // a layer done (or, in a fault test, being slept through)
        if (between_layers_) between_layers_();
        if (FencedSinceStepBegan(step)) return false;
        const absl::Duration left = until - MonotonicNow();
        if (left <= absl::ZeroDuration()) return true;
        absl::SleepFor(std::min(left, absl::Milliseconds(5)));
      }
    };
    if (absl::Status ran = model_->Forward(forward_, pool, &logits_, &after_layer); !ran.ok()) {
      if (absl::IsCancelled(ran)) {
        ++abandoned_steps_;
        LogLine(kComponent, absl::StrCat("abandoned step ", step.step_id, " (", ran.message(),
                                         "): router session ", step.router_session, " was fenced"));
        return absl::CancelledError(absl::StrCat("step abandoned: router session ",
                                                 step.router_session, " was fenced (",
                                                 ran.message(), ")"));
      }
      return absl::InternalError(absl::StrCat("forward pass failed: ", ran.message()));
    }
  }
  const size_t vocab = static_cast<size_t>(model_->host().config().vocab_size);
  size_t rows = 0;
  for (size_t i = 0; i < step.seqs.size(); ++i) {
    rows += !forward_.all_logits.empty() && forward_.all_logits[i] ? step.seqs[i].tokens.size() : 1;
  }
  KVCM_CHECK(logits_.size() >= rows * vocab || step.seqs.empty())
      << logits_.size() << " logits for " << rows << " rows";
  // Each sequence's own rows of logits: every new token's with input_logprobs, else the last.
  auto own_rows_of = [](const SeqWork& s) -> size_t {
    return s.input_logprobs ? s.tokens.size() : 1;
  };
  // The sampled tokens first, on the model's threads: a draw reads only its own row, so the
  // tokens are the same on any number of threads (a draw is a pass over the vocabulary).
  std::vector<size_t> sampled;
  std::vector<size_t> last_rows(step.seqs.size());
  for (size_t i = 0, first_row = 0; i < step.seqs.size(); ++i) {
    first_row += own_rows_of(step.seqs[i]);
    last_rows[i] = first_row - 1;
    if (step.seqs[i].sample) sampled.push_back(i);
  }
  std::vector<absl::StatusOr<ChosenToken>> chosen(step.seqs.size());
  kernels::CpuThreadPool::Default().ParallelFor(
      static_cast<int64_t>(sampled.size()), model_->host().num_threads(), [&](int64_t task) {
        const size_t i = sampled[static_cast<size_t>(task)];
        const SeqWork& s = step.seqs[i];
        const int64_t index = s.sample_index >= 0 ? s.sample_index : s.context_len;
        chosen[i] = ChooseToken(std::span(logits_.data() + last_rows[i] * vocab, vocab), s, index,
                                end_ids_);
      });
  size_t row = 0;  // the sequence's first row of logits
  for (size_t i = 0; i < step.seqs.size(); ++i) {
    const SeqWork& s = step.seqs[i];
    const int32_t new_tokens = static_cast<int32_t>(s.tokens.size());
    if (new_tokens > 1 || s.context_len == new_tokens) {
      report.prefill_tokens += new_tokens;
    } else {
      report.decode_tokens += new_tokens;
    }
    const size_t own_rows = own_rows_of(s);
    const std::span<const float> last(logits_.data() + (row + own_rows - 1) * vocab, vocab);
    SeqResult outcome;
    outcome.seq = s.seq;
    if (s.input_logprobs) {
      // Token j + 1 under the logits of position j; the chunk's next token under the last.
      outcome.input_logprobs.reserve(s.tokens.size());
      for (size_t j = 0; j + 1 < s.tokens.size(); ++j) {
        const std::span<const float> at(logits_.data() + (row + j) * vocab, vocab);
        outcome.input_logprobs.push_back(LogprobOf(at, s.tokens[j + 1]));
      }
      if (s.score_next >= 0) outcome.input_logprobs.push_back(LogprobOf(last, s.score_next));
    }
    if (s.sample) {
      absl::StatusOr<ChosenToken>& token = chosen[i];
      if (token.ok()) {
        outcome.token = token->token;
        outcome.logprob = token->logprob;
        for (const TokenLogprob& top : token->top) {
          outcome.top_ids.push_back(top.token);
          outcome.top_logprobs.push_back(top.logprob);
        }
        outcome.fork_tokens = std::move(token->fork_tokens);
        outcome.fork_logprobs = std::move(token->fork_logprobs);
      } else {
        outcome.status = token.status();
      }
    }
    report.results.push_back(std::move(outcome));
    row += own_rows;
  }
  ++steps_;
  return report;
}

absl::StatusOr<ChosenToken> ChooseToken(std::span<const float> logits, const SeqWork& seq,
                                        int64_t index, std::span<const int32_t> end_ids) {
  if (logits.empty()) return absl::FailedPreconditionError("no logits to sample from");
  for (size_t i = 0; i < logits.size(); ++i) {
    if (std::isnan(logits[i])) {
      return absl::FailedPreconditionError(
          absl::StrCat("the logits hold a NaN (token ", i, "): nothing was sampled"));
    }
  }
  const SamplingParams& params = seq.sampling;
  absl::StatusOr<Sampler> sampler = Sampler::Create(params);
  if (!sampler.ok()) return sampler.status();
  // The row sampled as token number `at`: the end ids held back while at < min_tokens
  // (before the penalties, as vLLM does: -infinity stays so), then the penalties.
  auto row_for = [&](int64_t at, std::vector<float>* row) -> std::span<const float> {
    const bool held_back = at < params.min_tokens && !end_ids.empty();
    if (!held_back && !params.penalized()) return logits;
    row->assign(logits.begin(), logits.end());
    ApplyMinTokens(*row, at, params, end_ids);
    if (params.penalized()) {
      ApplyPenalties(*row, seq.penalty_tokens, seq.penalty_prompt_len, params);
    }
    return *row;
  };
  std::vector<float> row;
  const std::span<const float> sampled = row_for(index, &row);
  ChosenToken chosen;
  chosen.token = sampler->Sample(sampled, index);
  if (seq.logprobs || seq.top_n > 0) {
    chosen.logprob = LogprobOf(sampled, chosen.token, params.temperature);
    chosen.top = TopLogprobs(sampled, seq.top_n, params.temperature);
  }
  // Forked sequences' first tokens: the same row, their own seeds, sample index 0 (whose
  // min_tokens mask differs from index's only when index is past min_tokens).
  std::vector<float> fork_row;
  std::span<const float> fork_sampled = sampled;
  if (!seq.fork_seeds.empty() && (index < params.min_tokens) != (0 < params.min_tokens)) {
    fork_sampled = row_for(0, &fork_row);
  }
  for (uint64_t seed : seq.fork_seeds) {
    SamplingParams fork = params;
    fork.seed = seed;
    const int32_t token = Sampler::Create(fork)->Sample(fork_sampled, 0);
    chosen.fork_tokens.push_back(token);
    if (seq.logprobs) {
      chosen.fork_logprobs.push_back(LogprobOf(fork_sampled, token, params.temperature));
    }
  }
  return chosen;
}

// ---- To the router --------------------------------------------------------------------------

ExecutorHello ExecutorService::HelloInfo() const {
  ExecutorHello hello;
  hello.name = options_.name;
  hello.pid = options_.pid;
  hello.model = model_info_;
  hello.metrics_url = options_.metrics_url;
  if (const PoolView* pool = pool_->pool()) {
    hello.kv_spec = pool->spec;
    hello.num_blocks = pool->num_blocks;
    hello.backend = pool->backend;
  }
  return hello;
}

bool ExecutorService::WantsHello(absl::Time now) const {
  const PoolView* pool = pool_->pool();
  if (pool == nullptr) return false;
  if (hello_request_id_ != 0) return now - hello_sent_ >= options_.hello_retry;
  return hello_needed_ || pool->epoch != announced_epoch_;
}

bool ExecutorService::WantsHeartbeat(absl::Time now) const {
  return registered() && heartbeat_interval_ > absl::ZeroDuration() &&
         now - last_sent_ >= heartbeat_interval_;
}

void ExecutorService::BuildHello(absl::Time now, flatbuffers::FlatBufferBuilder* out) {
  out->Clear();
  hello_request_id_ = next_request_id_++;
  announced_epoch_ = attached_epoch();
  hello_needed_ = true;  // until its reply arrives
  EncodeExecutorHello(*out, hello_request_id_, executor_id_, announced_epoch_, HelloInfo());
  hello_sent_ = now;
  last_sent_ = now;
}

void ExecutorService::HelloNotSent() { hello_request_id_ = 0; }

void ExecutorService::BuildHeartbeat(absl::Time now, flatbuffers::FlatBufferBuilder* out) {
  out->Clear();
  FinishExecutorEnvelope(*out, next_request_id_++, executor_id_, attached_epoch(),
                         wire::ExecutorMessage::Heartbeat, wire::CreateHeartbeat(*out).Union());
  last_sent_ = now;
}

void ExecutorService::BuildGoodbye(absl::Time now, flatbuffers::FlatBufferBuilder* out) {
  out->Clear();
  FinishExecutorEnvelope(*out, next_request_id_++, executor_id_, attached_epoch(),
                         wire::ExecutorMessage::Goodbye, wire::CreateGoodbye(*out).Union());
  last_sent_ = now;
}

}  // namespace kvcm::executor
