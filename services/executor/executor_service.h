#pragma once
// ExecutorService: kvcm-executor's logic, without sockets (docs/architecture.md). It speaks
// the executor protocol (schemas/kvcm_executor.fbs) with the router and runs step batches on
// the model and the attached pool. ExecutorServer (executor_server.h) feeds it the frames of
// its DEALER socket and sends what it builds; tests feed it bytes or StepBatches directly.
//
// A StepBatch, in order (nothing is written to the pool before the last check passes):
//   1. VerifyExecutorEnvelope, DecodeStepBatch (Malformed / InvalidArgument).
//   2. The router session: refused (StaleSession) once the cache manager fenced it (see
//      ApplyFences). The pool: none attached -> Unavailable "no pool attached". The step's epoch is
//      the cache-manager epoch its block tables were granted in. Earlier than the pool's:
//      StaleEpoch (the router must re-admit). Later: the cache manager restarted and this
//      executor has not noticed yet: PoolSource::Reattach() (the weights stay loaded), and
//      StaleEpoch all the same ("stale epoch, re-attached: ..."; "re-attaching" if the
//      epochs still differ): this executor was in no session of that epoch when the step
//      was sent, so no fence of its router session waits for it. Steps of the new epoch
//      run once the Hello that announces it reached the router.
//   3. Against the pool: every block id (tables and copies) < num_blocks, each table holds
//      at least ceil(context_len / block_size) blocks, no copy destination twice or also a
//      source; with KV cache groups, a table per group (SeqWork::group_tables), -1 only
//      behind its group's window; then LlamaModel::CheckBatch (token ids, positions, slots
//      written twice). InvalidArgument naming the sequence.
//   4. Copy-on-write orders, then one forward pass for all sequences, on the host or on the
//      pool's CUDA device (ExecutorModel), then a token for each sequence that asked for one.
// A refused message gets an ErrorReply with a code and a reason and is counted in
// kvcm_executor_step_errors_total{reason}.
//
// Sampling is a pure function of (logits, SamplingParams, index of the token chosen), done
// by the model's Sampler (sampler.h) with the index SeqWork.sample_index (context_len when
// -1): a request's tokens do not depend on how it is batched, on which executor runs it, or
// on the steps before. Greedy (temperature 0) takes the argmax, lowest id on ties. Logits
// holding a NaN fail that sequence alone (its SeqResult has FailedPrecondition).
//
// Registration with the router: the service builds ExecutorHello (again whenever the router
// answers NotRegistered or says Goodbye, the attached epoch changes, or a Hello goes
// unanswered for hello_retry), Heartbeat (when idle for the router's heartbeat interval) and
// Goodbye, and takes in their replies. Replies are never answered.
//
// Thread safety: none; one thread (the server's socket thread) owns the service. The model
// and the pool source must outlive it.

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/wire/executor_codec.h"
#include "flatbuffers/flatbuffers.h"
#include "services/executor/executor_metrics.h"
#include "services/executor/executor_model.h"
#include "services/executor/executor_pool.h"
#include "services/executor/model/llama_model.h"
#include "services/executor/model/sampler.h"

namespace kvcm::executor {

class ExecutorService {
 public:
  struct Options {
    std::string name = "executor";  // in ExecutorHello and logs; at most 128 bytes
    std::string model_name;         // ModelSummary.name
    std::string metrics_url;        // announced in ExecutorHello ("" if none)
    int32_t pid = 0;                // announced in ExecutorHello
    // Inbound messages larger than this are refused as malformed (oversized).
    size_t max_message_bytes = kDefaultMaxMessageBytes;
    // The most block-table entries (sequences x longest needed table) one step may use:
    // 256 MiB of int32 by default, far above any real batch (256 sequences of 128K tokens
    // in blocks of 16 take 2M). A step over it is refused before anything is allocated.
    size_t max_block_table_entries = size_t{1} << 26;
    // A Hello unanswered this long is sent again (the router may not have been up).
    absl::Duration hello_retry = absl::Seconds(1);
    // Fault tests only: sleep this long after each layer of a step's forward pass, so that
    // a step is seconds into writing the pool when a test kills its router. 0 in service.
    absl::Duration fault_layer_delay = absl::ZeroDuration();
    // Tokens that end generation besides the model's EOS ids (config.json's, or the GGUF's
    // eos and eot): generation_config.json's eos_token_id, as the router reads it. min_tokens
    // holds all of them back (ChooseToken).
    std::vector<int32_t> end_token_ids;
  };

  // What the service did with an inbound message.
  struct Handled {
    bool reply = false;  // `reply` holds an envelope to send back
    wire::ExecutorMessage type = wire::ExecutorMessage::NONE;  // inbound type (NONE if refused)
  };

  // `model` and `pool` must outlive the service; `metrics` may be null (tests).
  ExecutorService(Options options, const ExecutorModel* model, PoolSource* pool,
                  ExecutorMetrics* metrics);

  // ---- From the router ----------------------------------------------------------------------

  // Handles one inbound frame. For a request (StepBatch, Heartbeat, Goodbye) and for one that
  // fails verification, writes exactly one reply envelope into `reply` (cleared first) and
  // sets Handled::reply. Replies to this executor's own requests update its registration.
  Handled Handle(std::span<const uint8_t> bytes, absl::Time now,
                 flatbuffers::FlatBufferBuilder* reply);

  // Runs one decoded step (checks 2-4 above). The error statuses carry the codes of the
  // ErrorReply (via ToWireCode): UNAVAILABLE (no pool), ABORTED (stale epoch),
  // INVALID_ARGUMENT, INTERNAL (the forward pass failed after the checks).
  absl::StatusOr<StepResult> RunStep(const StepBatch& step);

  // Fencing (docs/architecture.md, "Fencing"). Call between steps: takes the fences the
  // cache manager sent, refuses every later step of their router sessions (StaleSession),
  // and acknowledges them. Returns how many were acknowledged now. A step whose router
  // session is fenced while it runs stops at the next layer boundary (host pool) and is
  // answered StaleSession; it is acknowledged at the next call, after it stopped.
  int ApplyFences();
  // Router sessions whose steps are refused.
  const absl::flat_hash_set<uint64_t>& fenced_sessions() const { return fenced_; }
  // Steps that stopped midway because their router session was fenced.
  uint64_t abandoned_steps() const { return abandoned_steps_; }

  // ---- To the router ------------------------------------------------------------------------

  // True when an ExecutorHello should go out now (see the header comment). False while no
  // pool is attached: an executor without a pool cannot serve steps.
  bool WantsHello(absl::Time now) const;
  // True when registered, heartbeats are asked for and nothing went to the router for the
  // heartbeat interval.
  bool WantsHeartbeat(absl::Time now) const;
  // Build the message (a finished envelope in `out`, cleared first) and note it as sent.
  void BuildHello(absl::Time now, flatbuffers::FlatBufferBuilder* out);
  void BuildHeartbeat(absl::Time now, flatbuffers::FlatBufferBuilder* out);
  void BuildGoodbye(absl::Time now, flatbuffers::FlatBufferBuilder* out);
  // The Hello just built could not be sent (not connected yet): WantsHello() is true again.
  void HelloNotSent();
  // Note that some other message (a StepResult) went to the router at `now`.
  void NoteSent(absl::Time now) { last_sent_ = now; }
  // Called on the calling thread between two layers of a step's forward pass on a host pool
  // (a long CPU prefill takes seconds): the server sends its heartbeat there, so that the
  // router does not take a busy executor for a hung one.
  void SetBetweenLayers(std::function<void()> hook) { between_layers_ = std::move(hook); }

  const Options& options() const { return options_; }
  bool registered() const { return executor_id_ != 0; }
  uint64_t executor_id() const { return executor_id_; }
  bool goodbye_answered() const { return goodbye_answered_; }
  uint64_t steps() const { return steps_; }
  // The Hello this executor announces (from the model and the attached pool).
  ExecutorHello HelloInfo() const;

 private:
  // Writes an ErrorReply for `status` and counts it.
  void Refuse(uint64_t request_id, wire::ErrorCode code, std::string_view reason, StepError error,
              flatbuffers::FlatBufferBuilder* reply);
  void HandleStep(const wire::ExecutorEnvelope& envelope, absl::Time received,
                  flatbuffers::FlatBufferBuilder* reply);
  // The pool for a step of `epoch`, re-attaching when the step is of a newer epoch.
  absl::StatusOr<const PoolView*> PoolForEpoch(uint64_t epoch);
  // CANCELLED when `step` is refused: its router session was fenced, or one of its
  // sequences was (a sequence fence of a router that lives on).
  absl::Status CheckNotFenced(const StepBatch& step) const;
  // True when a pending fence names `step`'s router session, or one of its sequences; it
  // is then recorded as fenced.
  bool FenceNames(const StepBatch& step);
  // True when the fences changed since the last check and one names `step`.
  bool FencedSinceStepBegan(const StepBatch& step);
  // Records `fence` as refused from now on.
  void RecordFence(const FenceNotice& fence);
  // Checks 3 above; fills forward_ on success.
  absl::Status CheckAndBuild(const StepBatch& step, const PoolView& pool);
  void BuildForward(const StepBatch& step, size_t max_blocks, int64_t total_tokens,
                    int32_t num_tables);
  uint64_t attached_epoch() const;

  const Options options_;
  const ExecutorModel* const model_;
  PoolSource* const pool_;
  ExecutorMetrics* const metrics_;
  ModelSummary model_info_;
  // What min_tokens holds back: the model's EOS ids and Options::end_token_ids.
  std::vector<int32_t> end_ids_;

  // Fencing.
  absl::flat_hash_set<uint64_t> fenced_;
  // (router session, sequence) of sequence fences: refused for good (the cache manager
  // refuses the router a drained id again).
  absl::flat_hash_set<std::pair<uint64_t, uint64_t>> fenced_seqs_;
  uint64_t seen_fence_generation_ = 0;     // by the running step
  uint64_t applied_fence_generation_ = 0;  // by ApplyFences
  bool fence_ack_failed_ = false;
  absl::Time fence_ack_retry_at_ = absl::InfinitePast();
  uint64_t abandoned_steps_ = 0;

  // Registration with the router.
  uint64_t executor_id_ = 0;
  absl::Duration heartbeat_interval_ = absl::ZeroDuration();
  uint64_t next_request_id_ = 1;
  uint64_t hello_request_id_ = 0;  // the Hello awaiting its reply (0: none)
  absl::Time hello_sent_ = absl::InfinitePast();
  uint64_t announced_epoch_ = 0;  // the epoch in the last Hello
  bool hello_needed_ = true;      // never sent, or the router forgot us
  absl::Time last_sent_ = absl::InfinitePast();
  std::function<void()> between_layers_;
  bool goodbye_answered_ = false;
  uint64_t steps_ = 0;

  // Scratch reused across steps.
  ForwardBatch forward_;
  std::vector<float> logits_;
};

// A sampled token, with its log-probability and the most likely alternatives when the
// sequence asked for them (SeqWork::logprobs, top_n).
struct ChosenToken {
  int32_t token = -1;
  float logprob = 0.0f;
  std::vector<TokenLogprob> top;
  std::vector<int32_t> fork_tokens;  // one per SeqWork::fork_seeds
  std::vector<float> fork_logprobs;  // with SeqWork::logprobs
};

// The token chosen from `logits` (one row, [vocab]) for `seq` as the request's generated
// token number `index`: while index < seq.sampling.min_tokens the `end_ids` (the tokens that
// would end the request: the model's EOS ids) held back (ApplyMinTokens), then its penalties
// applied (ApplyPenalties over seq.penalty_tokens), then Sampler (sampler.h); log-probabilities
// are of that row. Fork seeds draw as token number 0. FAILED_PRECONDITION when the logits hold
// a NaN (a broken model or pool: sampling would hide it); INVALID_ARGUMENT from
// ValidateSamplingParams.
absl::StatusOr<ChosenToken> ChooseToken(std::span<const float> logits, const SeqWork& seq,
                                        int64_t index, std::span<const int32_t> end_ids = {});

}  // namespace kvcm::executor
