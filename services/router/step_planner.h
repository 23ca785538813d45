#pragma once
// StepPlanner: the router's scheduler as a pure state machine (docs/architecture.md, "The
// life of a step"). No sockets and no clock: the router's loop feeds it requests, the
// cache manager's StepReply and the executors' StepResults, and sends what it plans.
//
//   planner.Enqueue(request, prompt_tokens, max_new_tokens, sampling);
//   StepPlan plan = planner.Plan(available_blocks, executors);   // 1. block ops
//   ... one Step with plan.ops to the cache manager ...
//   ExecutorWork& work = planner.Apply(plan, outcomes);           // 2. per-executor batches
//   ... one StepBatch per executor in work.batches ...
//   std::vector<TokenEvent> events = planner.Complete(results);   // 3. sampled tokens
//
// A step, in op order: frees (finished, cancelled, preempted sequences), commits (the KV
// written so far, when it fills a block or before a fork), forks (several answers to one
// prompt), appends (room for this step's new tokens: up to the end of the block a new
// token falls in, so once a block), allocations (admissions).
// Scheduling rules:
// - Continuous batching with chunked prefill: every running sequence that is decoding gets
//   its one token; then sequences still in prefill, oldest admission first, get chunks of
//   at most max_batch_prefill_tokens in all; then requests are admitted from the queue,
//   first come first served, while the prefill budget, the block estimate, max_running and
//   max_batch_total_tokens (KV tokens of the running sequences after the step) allow. The
//   queue's head is never passed over: a later request waits behind it.
// - Prefix caching: admissions carry the chained hashes of their prompt's full blocks; the
//   cache manager shares the cached prefix, and the prefill starts after it. The last
//   prompt token is always computed (its logits give the first new token). A sequence's
//   tokens are committed in the step after the StepResult that wrote them, once they fill
//   a block (or before the sequence is forked).
// - Preemption by recompute: when the blocks estimated free do not cover the decodes, the
//   latest admitted sequences are freed and go back to the head of the queue with the
//   tokens generated so far; recomputing them gives the same greedy tokens.
// - An op the cache manager refuses (RESOURCE_EXHAUSTED: the estimate was optimistic)
//   changes nothing there: a refused admission goes back to the queue head, a refused
//   append preempts its sequence.
// - Several answers to one prompt (RequestOutputs::sequences = n): the request's sequence
//   computes the prompt once; the step that samples its first token also draws the first
//   tokens of the n - 1 others (fork seeds), and the next step forks them from it after its
//   commit (Fork shares every block; a sequence's first Append copies the shared, partly
//   filled last block). A finished sequence whose forks are still to be made is freed a
//   step later.
// - Executors: each sequence is bound to one (new ones to the least loaded). A sequence
//   whose executor is gone moves to a live one; the KV written by steps that were answered
//   stays valid in the pool, so only an unanswered step is redone.
//
// Thread safety: none; one thread (the router's loop) owns it.

#include <algorithm>
#include <cstdint>
#include <deque>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "common/block/block_hash.h"
#include "common/block/block_ledger.h"
#include "common/wire/executor_protocol.h"
#include "common/wire/step_codec.h"

namespace kvcm::router {

using RequestId = uint64_t;
using ExecutorId = uint64_t;

struct PlannerOptions {
  int32_t block_size = 16;
  // Prompt tokens computed in one step, in all sequences together.
  int32_t max_batch_prefill_tokens = 4096;
  // KV tokens of every running sequence after a step (TGI's max_batch_total_tokens); at
  // most what the pool holds.
  int64_t max_batch_total_tokens = 1 << 20;
  // Sequences in one step.
  int32_t max_running = 256;
  // The pool's size: a request needing more blocks can never run and is rejected.
  int32_t num_blocks = 0;
  HashAlgorithm hash_algorithm = kDefaultHashAlgorithm;
  BlockHash root_hash;  // RootHash(hash_algorithm, salt): the cache manager's salt
  // Commits carry the token ids of their new full blocks (CommitOp.new_block_tokens): the
  // cache manager asked for them (HelloReply.wants_commit_tokens, for its vLLM-format KV
  // events). Updated when the cache manager comes back (SetCommitTokens).
  bool commit_tokens = false;
  // > 0: the cache manager releases a sequence's blocks that lie wholly before
  // committed - sliding_window_tokens + 1 (HelloReply.sliding_window_tokens). Their table
  // entries go to executors as -1, and they no longer count as held.
  int32_t sliding_window_tokens = 0;
  // The pool's KV cache groups by window (HelloReply.group_windows; 0 = full attention);
  // empty: none. With groups each sequence holds a block table per group: admissions and
  // appends count blocks in every group, and each group's table goes to executors with -1
  // where its own window released blocks (docs/architecture.md, "The hybrid KV cache").
  std::vector<int32_t> group_windows;
};

// What one step asks of the cache manager, and what Apply needs to finish it.
struct StepPlan {
  uint64_t step_id = 0;
  std::vector<BlockOp> ops;
  // Per op: the sequence it is for (0 for none) and whether it is an admission.
  struct OpRole {
    SeqId seq = 0;
    enum Kind : uint8_t { kFree, kCommit, kFork, kAppend, kAdmit } kind = kFree;
  };
  std::vector<OpRole> roles;
  // Tokens each scheduled sequence computes this step (its chunk), in schedule order.
  struct Chunk {
    SeqId seq = 0;
    int32_t tokens = 0;
  };
  std::vector<Chunk> chunks;
  int32_t prefill_tokens = 0;  // planned (before prefix hits shorten admissions)
  int32_t decode_tokens = 0;
  int32_t preempted = 0;
  // Requests that can never finish (prompt plus max_new_tokens needs more blocks than the
  // pool, or more tokens than max_batch_total_tokens): the caller fails them (the HTTP
  // layer refuses most before they are queued); they are gone from the planner.
  std::vector<RequestId> rejected;
};

// The executors' part of a step, after the cache manager answered.
struct ExecutorWork {
  struct Batch {
    ExecutorId executor = 0;
    StepBatch step;  // epoch and router_session are the caller's to fill in
  };
  std::vector<Batch> batches;
  // Of first admissions: prompt tokens found in the prefix cache, and those to compute.
  int32_t cached_prompt_tokens = 0;
  int32_t computed_prompt_tokens = 0;
  // Of cached_prompt_tokens, those the cache manager loaded from its host and disk tiers.
  int32_t host_tier_prompt_tokens = 0;
  int32_t disk_tier_prompt_tokens = 0;
  // Admissions refused while the cache manager loads their prefix from a tier (UNAVAILABLE,
  // docs/architecture.md "Tiers"): back at the queue's head, sent again in a later step.
  int32_t loading_admissions = 0;
  // Of re-admissions after a preemption: tokens that had been committed but are computed
  // again (their cached blocks were evicted meanwhile).
  int32_t recomputed_committed_tokens = 0;
  // Tokens the batches compute (after prefix-cache hits): decodes (the one new token of a
  // sequence past its prompt) and the rest, prefill.
  int32_t prefill_tokens = 0;
  int32_t decode_tokens = 0;
};

// What a request wants reported beside its tokens (the executor computes it).
struct RequestOutputs {
  bool logprobs = false;         // each generated token's log-probability
  int32_t top_n = 0;             // and its top_n most likely alternatives (<= kMaxTopN)
  bool prompt_logprobs = false;  // each prompt token's, after the first
  // Answers to generate from the one prompt (OpenAI's n, TGI's best_of): choice 0 is the
  // request's own sequence; choices 1.. are forked from it once its prompt is computed
  // (sharing its blocks, copy-on-write for the partly filled last one) and sample with
  // seed + choice. At most kMaxForkSeeds + 1.
  int32_t sequences = 1;
};

// A token a request generated (or its end), for the caller to stream. The planner fills it
// from a step's results; RouterCore adds what only it knows (EOS, errors) and hands the same
// event to the HTTP front end.
struct TokenEvent {
  RequestId request = 0;
  int32_t choice = 0;  // which of RequestOutputs::sequences
  int32_t token = -1;  // -1 with `finished` only: ended without a new token
  int32_t index = 0;   // 0 for the first generated token
  // This choice ended: from the planner, max_new_tokens reached (the sequence is freed next
  // step); from RouterCore also an EOS token, or (with `error`) every choice of the request.
  bool finished = false;
  std::string finish_reason;         // RouterCore's: "length", "eos_token"
  absl::Status error;                // RouterCore's: the request failed (finished is true)
  int32_t cached_prompt_tokens = 0;  // of its prompt, found in the prefix cache at admission
  // With RequestOutputs::logprobs / top_n:
  float logprob = 0.0f;
  std::vector<int32_t> top_ids;
  std::vector<float> top_logprobs;
  // With RequestOutputs::prompt_logprobs, on the first token only: one per prompt token,
  // NaN for the first (nothing comes before it).
  std::vector<float> prompt_logprobs;
};

class StepPlanner {
 public:
  explicit StepPlanner(PlannerOptions options) : options_(std::move(options)) {}

  // Queues a request. `tokens`: its prompt (at least one token). A request that wants its
  // prompt's log-probabilities computes its whole prompt (no prefix-cache hit: a cached
  // block's tokens were never scored), then commits it for others as usual.
  void Enqueue(RequestId request, std::vector<int32_t> tokens, int32_t max_new_tokens,
               SamplingParams sampling = {}, RequestOutputs outputs = {});
  // Ends a request's choice (-1: all of them; a stop sequence or EOS seen by the caller, or
  // the client left): queued, it is dropped; running, its sequence is freed in the next
  // step. Unknown ids are ignored.
  void Finish(RequestId request, int32_t choice = -1);

  // Step 1. `available_blocks`: blocks the cache manager can hand out now (free or
  // evictable), as last reported. `executors`: the live ones.
  StepPlan Plan(int32_t available_blocks, std::span<const ExecutorId> executors);
  // Step 2, with the StepReply's outcomes for plan.ops (same order, same count). The work
  // is the planner's, valid until the next Apply: its batches and their sequences' vectors
  // are filled again in place each step, so that a step allocates nothing for them once
  // they have grown to the batch's size.
  ExecutorWork& Apply(const StepPlan& plan, std::span<const OpOutcome> outcomes);
  // Step 3, with every result the executors returned for the step; sequences without a
  // result (their executor died or answered with an error) redo the step.
  std::vector<TokenEvent> Complete(std::span<const SeqResult> results);

  // `executor` was dropped without proof that it stopped (silent, or a step unanswered): it
  // may still be writing the slots of its last step. Each sequence it ran is freed with
  // drain in the next Plan (its blocks are reused only once every executor acknowledged the
  // fence, or died) and its request goes back to the queue's head with the tokens it has, as
  // a preemption does; its committed full blocks stay in the prefix cache, so only the rest
  // is computed again. Call between steps (after Complete, before Plan).
  void Abandon(ExecutorId executor);

  // The cache manager restarted: its ledger, and every sequence in it, is gone. Running
  // requests go back to the queue's head in admission order, with the tokens they have so
  // far (their committed tokens count as recomputed when they run again); finishing ones
  // are dropped. Call between steps (after Complete, before Plan).
  void ResetAll();
  // Whether later Commits carry token ids (PlannerOptions::commit_tokens).
  void SetCommitTokens(bool on) { options_.commit_tokens = on; }
  // The cache manager's window (PlannerOptions::sliding_window_tokens), after ResetAll.
  void SetSlidingWindow(int32_t tokens) { options_.sliding_window_tokens = tokens; }
  // The cache manager's KV cache groups (PlannerOptions::group_windows), after ResetAll.
  void SetGroupWindows(std::vector<int32_t> windows) {
    options_.group_windows = std::move(windows);
  }

  // State, for metrics and tests.
  size_t queued() const { return queue_.size(); }
  size_t running() const { return running_.size(); }
  uint64_t preemptions() const { return preemptions_; }
  // Ops the cache manager refused for a reason other than a lack of blocks: a Fork, or an
  // Append refused with anything but RESOURCE_EXHAUSTED. Each is a bug of the router or
  // the cache manager; its sequence is computed again (an Append's counts as a preemption
  // too), so answers stay right, and this keeps the bug visible. The last one's status.
  uint64_t refused_ops() const { return refused_ops_; }
  const absl::Status& last_refusal() const { return last_refusal_; }
  // Blocks the running sequences hold, as far as the planner knows.
  int64_t held_blocks() const;
  // One running sequence as an operator sees it (the router's /dashboard).
  struct RunningSummary {
    RequestId request = 0;
    int32_t choice = 0;
    SeqId seq = 0;
    int32_t prompt_tokens = 0;
    int32_t generated_tokens = 0;
    int32_t blocks = 0;  // that the cache manager holds for it
    ExecutorId executor = 0;
  };
  // The first `max` running sequences in admission order, oldest first. O(max).
  std::vector<RunningSummary> RunningSummaries(size_t max) const;
  // The tokens (prompt and generated) of a request the planner knows, for tests.
  std::optional<std::vector<int32_t>> TokensOf(RequestId request) const;

 private:
  struct Queued {
    RequestId request = 0;
    std::vector<int32_t> tokens;  // prompt, then what was generated before a preemption
    int32_t prompt_len = 0;
    int32_t generated = 0;
    int32_t max_new_tokens = 0;
    SamplingParams sampling;
    RequestOutputs outputs;
    // With outputs.prompt_logprobs: per prompt token (NaN: not scored yet), and how many of
    // the first are scored (the first needs nothing).
    std::vector<float> prompt_logprobs;
    int32_t prompt_scored = 1;
    int32_t cached_prompt_tokens = 0;  // at its first admission
    int32_t choice = 0;
    int32_t forks_wanted = 0;      // sequences to fork at its first sample (n - 1; then 0)
    bool readmitted = false;       // preempted before
    int32_t committed_before = 0;  // tokens it had committed when it was preempted
  };
  struct Running {
    Queued req;
    SeqId seq = 0;
    ExecutorId executor = 0;
    uint64_t admitted = 0;          // admission order, for preemption (latest first)
    int32_t held = 0;               // tokens the cache manager holds for it
    int32_t computed = 0;           // tokens whose KV is written
    int32_t committed = 0;          // tokens committed
    int32_t hashes_sent = 0;        // full-block hashes the cache manager knows
    std::vector<BlockHash> hashes;  // of its full blocks, from the root
    std::vector<BlockId> blocks;    // its block table (group 0's, with KV cache groups)
    // With KV cache groups: the tables of groups 1.., each as long as `blocks`.
    std::vector<std::vector<BlockId>> group_blocks;
    bool finishing = false;  // freed at the next step
    // Forked from this sequence at the next Plan (0: it exists in the cache manager).
    SeqId fork_parent = 0;
    int32_t forks_pending = 0;  // children still to be forked from it (its free waits)
    // This step:
    int32_t chunk = 0;  // tokens it computes (0: not scheduled)
    int32_t start = 0;  // first token computed
  };

  // Whether some prompt token still lacks its score.
  static bool Unscored(const Queued& q) {
    return q.prompt_scored < static_cast<int32_t>(q.prompt_logprobs.size());
  }
  int32_t BlocksFor(int32_t tokens) const {
    return (tokens + options_.block_size - 1) / options_.block_size;
  }
  // Block tables per sequence: 1 without KV cache groups.
  int32_t NumGroups() const {
    return options_.group_windows.empty() ? 1 : static_cast<int32_t>(options_.group_windows.size());
  }
  // Group g's window (the pool's one without groups).
  int32_t WindowOf(int32_t group) const {
    return options_.group_windows.empty() ? options_.sliding_window_tokens
                                          : options_.group_windows[static_cast<size_t>(group)];
  }
  // The leading blocks of `run`'s table of `group` that the cache manager has released
  // behind the group's window.
  int32_t ReleasedBlocks(const Running& run, int32_t group = 0) const {
    const int32_t window = WindowOf(group);
    if (window <= 0 || run.committed < window) return 0;
    return std::min(BlocksFor(run.held), (run.committed - window + 1) / options_.block_size);
  }
  // Blocks `run` holds in the pool, in every group, those released behind a window left
  // out; and the tokens whose KV group 0 holds.
  int32_t LiveBlocks(const Running& run) const {
    int32_t blocks = BlocksFor(run.held) - ReleasedBlocks(run);
    for (int32_t g = 1; g < NumGroups(); ++g)
      blocks += BlocksFor(run.held) - ReleasedBlocks(run, g);
    return blocks;
  }
  int32_t LiveTokens(const Running& run) const {
    return run.held - ReleasedBlocks(run) * options_.block_size;
  }
  // An Append's copy-on-write orders: each replaces the last block of the group table it
  // copies.
  void ApplyCopies(Running& run, std::span<const CopyOrder> copies) const;
  // Whether an Allocate's or Append's OpOutcome::group_blocks has (groups - 1) x its
  // blocks; the refusal that says it has not.
  bool GroupBlocksFit(const OpOutcome& outcome) const;
  absl::Status GroupBlocksMismatch(const OpOutcome& outcome) const;
  // An Allocate's tables of groups 1.. (OpOutcome::group_blocks) into run.group_blocks.
  void SplitGroupBlocks(const OpOutcome& outcome, Running& run) const;
  // Makes run.hashes cover every full block of the first `tokens` tokens.
  void HashUpTo(Running& run, int32_t tokens) const;
  // The Commit of every token `run` has computed, with the hashes (and, when the cache
  // manager wants them, the token ids) of the full blocks it completes.
  BlockOp CommitOf(Running& run) const;
  ExecutorId LeastLoaded(std::span<const ExecutorId> executors) const;
  // Back to the queue's head; `preempted` (not a refused admission) marks it readmitted.
  void Requeue(Running&& run, bool preempted);
  // After `parent` sampled its first token: its forks_wanted children, with their first
  // tokens (outcome.fork_tokens), forked in the next Plan; their events go to `events`.
  void Fork(Running& parent, const SeqResult& outcome, std::vector<TokenEvent>* events);

  PlannerOptions options_;  // only commit_tokens changes
  std::deque<Queued> queue_;
  // By sequence id, and the admission order of the live ones.
  absl::flat_hash_map<SeqId, Running> running_;
  std::vector<SeqId> order_;
  // The live sequences of each request (its choices).
  absl::flat_hash_map<RequestId, std::vector<SeqId>> seq_of_;
  // Removes `seq` from running_, order_ and seq_of_.
  void Forget(SeqId seq);
  std::vector<SeqId> to_free_;   // freed in the next Plan()
  std::vector<SeqId> to_drain_;  // freed with drain in the next Plan() (Abandon)
  SeqId next_seq_ = 1;
  uint64_t next_step_ = 1;
  uint64_t next_admission_ = 1;
  uint64_t preemptions_ = 0;
  uint64_t refused_ops_ = 0;
  absl::Status last_refusal_;
  void NoteRefusal(const absl::Status& status) {
    ++refused_ops_;
    last_refusal_ = status;
  }
  std::vector<SeqId> scheduled_;  // of the step in flight, in schedule order
  // Apply's passes.
  void ApplyOutcomes(const StepPlan& plan, std::span<const OpOutcome> outcomes, ExecutorWork& work);
  void FillBatches(const StepPlan& plan, ExecutorWork& work);
  // What Apply returns, and its scratch: kept from step to step for their capacity.
  ExecutorWork work_;
  absl::flat_hash_map<SeqId, std::vector<CopyOrder>> step_copies_;
  std::vector<SeqId> still_scheduled_;
  std::vector<Running*> live_;  // Plan's: the running sequences in admission order
};

}  // namespace kvcm::router
