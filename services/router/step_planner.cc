#include "services/router/step_planner.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/base/check.h"

namespace kvcm::router {

void StepPlanner::Enqueue(RequestId request, std::vector<int32_t> tokens, int32_t max_new_tokens,
                          SamplingParams sampling, RequestOutputs outputs) {
  KVCM_CHECK(!tokens.empty()) << "request " << request << " has no prompt tokens";
  Queued queued;
  queued.request = request;
  queued.prompt_len = static_cast<int32_t>(tokens.size());
  queued.tokens = std::move(tokens);
  queued.max_new_tokens = max_new_tokens;
  queued.sampling = sampling;
  queued.outputs = outputs;
  KVCM_CHECK(outputs.sequences >= 1 && outputs.sequences <= kMaxForkSeeds + 1)
      << outputs.sequences << " sequences";
  queued.forks_wanted = outputs.sequences - 1;
  if (outputs.prompt_logprobs) {
    queued.prompt_logprobs.assign(queued.tokens.size(), std::numeric_limits<float>::quiet_NaN());
  }
  queue_.push_back(std::move(queued));
}

BlockOp StepPlanner::CommitOf(Running& run) const {
  HashUpTo(run, run.computed);
  const int32_t full = run.computed / options_.block_size;
  std::vector<BlockHash> fresh;
  if (full > run.hashes_sent) {
    fresh.assign(run.hashes.begin() + run.hashes_sent, run.hashes.begin() + full);
  }
  // The token ids of the full blocks this commit completes (those past the committed
  // ones), when the cache manager asked for them.
  std::span<const int32_t> fresh_tokens;
  if (const int32_t from = run.committed / options_.block_size;
      options_.commit_tokens && full > from) {
    const auto bs = static_cast<size_t>(options_.block_size);
    fresh_tokens =
        std::span<const int32_t>(run.req.tokens)
            .subspan(static_cast<size_t>(from) * bs, static_cast<size_t>(full - from) * bs);
  }
  return BlockOp::Commit(run.seq, run.computed, fresh, fresh_tokens);
}

void StepPlanner::Finish(RequestId request, int32_t choice) {
  if (auto it = seq_of_.find(request); it != seq_of_.end()) {
    for (SeqId seq : it->second) {
      Running& run = running_.at(seq);
      if (choice < 0 || run.req.choice == choice) run.finishing = true;
    }
  }
  std::erase_if(queue_, [request, choice](const Queued& q) {
    return q.request == request && (choice < 0 || q.choice == choice);
  });
}

void StepPlanner::Forget(SeqId seq) {
  auto it = running_.find(seq);
  if (it == running_.end()) return;
  if (auto of = seq_of_.find(it->second.req.request); of != seq_of_.end()) {
    std::erase(of->second, seq);
    if (of->second.empty()) seq_of_.erase(of);
  }
  std::erase(order_, seq);
  running_.erase(it);
}

void StepPlanner::HashUpTo(Running& run, int32_t tokens) const {
  const size_t bs = static_cast<size_t>(options_.block_size);
  const size_t full = static_cast<size_t>(tokens) / bs;
  const size_t have = run.hashes.size();
  if (have >= full) return;
  // The blocks [have, full) in one chain: HashFullBlocks keeps the parent in registers from
  // block to block with the default hash (common/block/block_hash.cc, Xxh3V2Step).
  // A reference into run.hashes is safe: HashFullBlocks copies the parent before appending.
  const BlockHash& parent = have == 0 ? options_.root_hash : run.hashes.back();
  HashFullBlocks(options_.hash_algorithm, parent,
                 std::span<const int32_t>(run.req.tokens.data() + have * bs, (full - have) * bs),
                 options_.block_size, &run.hashes);
}

ExecutorId StepPlanner::LeastLoaded(std::span<const ExecutorId> executors) const {
  absl::flat_hash_map<ExecutorId, int> load;
  for (ExecutorId e : executors) load[e] = 0;
  for (const auto& [seq, run] : running_) {
    if (auto it = load.find(run.executor); it != load.end()) ++it->second;
  }
  ExecutorId best = executors.front();
  for (ExecutorId e : executors) {
    if (load[e] < load[best]) best = e;
  }
  return best;
}

void StepPlanner::Requeue(Running&& run, bool preempted) {
  Queued queued = std::move(run.req);
  if (preempted) {
    queued.readmitted = true;
    queued.committed_before = std::max(queued.committed_before, run.committed);
  }
  const SeqId seq = run.seq;
  if (run.fork_parent != 0) {  // never forked: its parent's free need not wait for it
    if (auto parent = running_.find(run.fork_parent); parent != running_.end()) {
      --parent->second.forks_pending;
    }
  }
  Forget(seq);
  queue_.push_front(std::move(queued));
}

void StepPlanner::Abandon(ExecutorId executor) {
  std::vector<SeqId> seqs;
  for (SeqId seq : order_) {
    if (running_.at(seq).executor == executor) seqs.push_back(seq);
  }
  // Latest admission first, each to the queue's head: the earliest ends up first.
  for (auto it = seqs.rbegin(); it != seqs.rend(); ++it) {
    Running& run = running_.at(*it);
    if (run.fork_parent == 0) to_drain_.push_back(*it);  // a fork not yet made holds nothing
    if (run.finishing) {
      if (run.fork_parent != 0) {
        if (auto parent = running_.find(run.fork_parent); parent != running_.end()) {
          --parent->second.forks_pending;
        }
      }
      Forget(*it);
      continue;
    }
    ++preemptions_;
    Requeue(std::move(run), /*preempted=*/true);
  }
}

void StepPlanner::ResetAll() {
  for (auto it = order_.rbegin(); it != order_.rend(); ++it) {
    Running& run = running_.at(*it);
    if (run.finishing) continue;
    Queued queued = std::move(run.req);
    queued.readmitted = true;
    queued.committed_before = std::max(queued.committed_before, run.committed);
    queue_.push_front(std::move(queued));
  }
  running_.clear();
  order_.clear();
  seq_of_.clear();
  to_free_.clear();
  to_drain_.clear();
  scheduled_.clear();
}

int64_t StepPlanner::held_blocks() const {
  int64_t blocks = 0;
  for (const auto& [seq, run] : running_) blocks += LiveBlocks(run);
  return blocks;
}

std::vector<StepPlanner::RunningSummary> StepPlanner::RunningSummaries(size_t max) const {
  std::vector<RunningSummary> out;
  out.reserve(std::min(max, order_.size()));
  for (SeqId seq : order_) {
    if (out.size() == max) break;
    auto it = running_.find(seq);
    if (it == running_.end()) continue;
    const Running& run = it->second;
    out.push_back({run.req.request, run.req.choice, seq, run.req.prompt_len, run.req.generated,
                   LiveBlocks(run), run.executor});
  }
  return out;
}

std::optional<std::vector<int32_t>> StepPlanner::TokensOf(RequestId request) const {
  if (auto it = seq_of_.find(request); it != seq_of_.end()) {
    return running_.at(it->second.front()).req.tokens;
  }
  for (const Queued& q : queue_) {
    if (q.request == request) return q.tokens;
  }
  return std::nullopt;
}

StepPlan StepPlanner::Plan(int32_t available_blocks, std::span<const ExecutorId> executors) {
  StepPlan plan;
  plan.step_id = next_step_++;
  // At most a commit and an append or chunk per running sequence (a decoding one has them
  // once a block), and the frees: one allocation each instead of a vector grown op by op
  // (admissions may still grow them).
  const size_t expected_ops = 2 * order_.size() + to_free_.size() + to_drain_.size() + 8;
  plan.ops.reserve(expected_ops);
  plan.roles.reserve(expected_ops);
  plan.chunks.reserve(order_.size() + 8);
  int64_t available = available_blocks;
  auto add = [&plan](BlockOp op, SeqId seq, StepPlan::OpRole::Kind kind) {
    plan.ops.push_back(std::move(op));
    plan.roles.push_back({seq, kind});
  };
  scheduled_.clear();

  // 1. Frees: what Apply refused last step, and what finished.
  for (SeqId seq : to_free_) add(BlockOp::Free(seq), seq, StepPlan::OpRole::kFree);
  to_free_.clear();
  for (SeqId seq : to_drain_) {
    add(BlockOp::Free(seq, /*drain=*/true), seq, StepPlan::OpRole::kFree);
  }
  to_drain_.clear();
  std::vector<SeqId> done;
  for (SeqId seq : order_) {
    const Running& run = running_.at(seq);
    // A sequence with forks still to be made is freed once they are (next step).
    if (run.finishing && run.forks_pending == 0) done.push_back(seq);
  }
  for (SeqId seq : done) {
    Running& run = running_.at(seq);
    if (run.fork_parent != 0) {  // never forked: nothing to free in the cache manager
      --running_.at(run.fork_parent).forks_pending;
    } else {
      // The full blocks its last step wrote are committed first, so that they stay cached
      // (and reach the cache manager's tiers) after the free: a request that ends in the
      // step that computed its prompt would otherwise leave none of its prompt behind.
      if (run.computed / options_.block_size > run.committed / options_.block_size) {
        add(CommitOf(run), seq, StepPlan::OpRole::kCommit);
      }
      add(BlockOp::Free(seq), seq, StepPlan::OpRole::kFree);
      available += LiveBlocks(run);  // an estimate: shared blocks stay taken
    }
    Forget(seq);
  }

  // The live sequences in admission order, looked up once for the passes below: running_
  // does not change until the admissions but for preemptions of the latest, which drop
  // their pointer from the back as they drop their id from order_.
  std::vector<Running*>& live = live_;
  live.clear();
  for (SeqId seq : order_) live.push_back(&running_.at(seq));

  // Sequences of executors that are gone move to live ones.
  for (Running* run_ptr : live) {
    Running& run = *run_ptr;
    if (!executors.empty() &&
        std::find(executors.begin(), executors.end(), run.executor) == executors.end()) {
      run.executor = LeastLoaded(executors);
    }
  }

  // 2. Commits: the KV the last step wrote, when it fills a block (what a commit makes
  // matchable) or before the sequence is forked (a child's copy-on-write needs the shared
  // partial block committed). A decode step inside a block commits nothing: the cache
  // manager then learns a sequence's progress a block at a time.
  for (Running* run_ptr : live) {
    Running& run = *run_ptr;
    const SeqId seq = run.seq;
    if (run.fork_parent != 0 || run.computed <= run.committed) continue;
    if (run.computed / options_.block_size == run.committed / options_.block_size &&
        run.forks_pending == 0) {
      continue;
    }
    add(CommitOf(run), seq, StepPlan::OpRole::kCommit);
  }

  // Forks: after the parent's commit, so that each child holds the same committed prompt
  // (and may copy its shared last block when it appends).
  for (Running* run_ptr : live) {
    Running& run = *run_ptr;
    const SeqId seq = run.seq;
    if (run.fork_parent == 0) continue;
    Running& parent = running_.at(run.fork_parent);
    // The child holds what the parent holds. Had the parent reserved past what it wrote
    // (the decodes below), the two would write the reserved tokens of the shared last block
    // with no Append to copy it first: a parent forks before its first decode.
    KVCM_CHECK(parent.held <= parent.computed)
        << "sequence " << parent.seq << " forks holding " << parent.held << " tokens, "
        << parent.computed << " written";
    add(BlockOp::Fork(parent.seq, seq), seq, StepPlan::OpRole::kFork);
    --parent.forks_pending;
    run.committed = parent.computed;  // the parent's commit just above covers it
    run.hashes = parent.hashes;
    run.hashes_sent = parent.computed / options_.block_size;
    run.fork_parent = 0;
  }
  if (executors.empty()) return plan;  // nobody to run anything: commits and frees only

  int64_t total_tokens = 0;
  for (const auto& [seq, run] : running_) total_tokens += LiveTokens(run);
  auto preempt_latest = [&]() -> SeqId {
    const SeqId victim = order_.back();
    Running& run = running_.at(victim);
    add(BlockOp::Free(victim), victim, StepPlan::OpRole::kFree);
    available += LiveBlocks(run);
    total_tokens -= LiveTokens(run);
    ++plan.preempted;
    ++preemptions_;
    Requeue(std::move(run), /*preempted=*/true);
    live.pop_back();
    KVCM_CHECK(live.size() == order_.size()) << "the preempted sequence was not the latest";
    return victim;
  };

  // 3. Decodes: one token each, oldest admission first; preempting from the latest.
  int32_t scheduled = 0;
  for (size_t i = 0; i < order_.size() && scheduled < options_.max_running; ++i) {
    const SeqId seq = order_[i];
    Running& run = *live[i];
    const auto size = static_cast<int32_t>(run.req.tokens.size());
    if (run.finishing || size - run.computed != 1) continue;  // in prefill, or done
    // A sequence holds its tokens a block at a time: past what it holds, it grows to the
    // end of the block its next token falls in (never past the most it can reach), so that
    // a decode step appends for it once a block instead of once a token. Where the token
    // budget is too tight for that, it grows by the token alone.
    int32_t reach = run.held;
    if (size > run.held) {
      const int32_t most = run.req.prompt_len + run.req.max_new_tokens;
      reach = std::max(size, std::min(BlocksFor(size) * options_.block_size, most));
      if (total_tokens + (reach - run.held) > options_.max_batch_total_tokens) reach = size;
    }
    const int32_t grow = reach - run.held;
    const int32_t blocks = (BlocksFor(reach) - BlocksFor(run.held)) * NumGroups();
    bool preempted_self = false;
    while (blocks > available || total_tokens + grow > options_.max_batch_total_tokens) {
      if (preempt_latest() == seq) {
        preempted_self = true;
        break;
      }
    }
    if (preempted_self) break;  // it was the latest: nobody after it runs either
    if (grow > 0) {
      add(BlockOp::Append(seq, grow), seq, StepPlan::OpRole::kAppend);
      available -= blocks;
      total_tokens += grow;
    }
    run.chunk = 1;
    plan.chunks.push_back({seq, 1});
    scheduled_.push_back(seq);
    ++plan.decode_tokens;
    ++scheduled;
  }

  // 4. Prefill chunks of admitted sequences, oldest first, within the prefill budget.
  int32_t budget = options_.max_batch_prefill_tokens;
  for (size_t i = 0; i < order_.size() && budget > 0 && scheduled < options_.max_running; ++i) {
    const SeqId seq = order_[i];
    Running& run = *live[i];
    const int32_t need = static_cast<int32_t>(run.req.tokens.size()) - run.computed;
    if (run.finishing || need <= 1) continue;  // decoding (scheduled above, or preempted)
    run.chunk = std::min(need, budget);
    budget -= run.chunk;
    plan.chunks.push_back({seq, run.chunk});
    scheduled_.push_back(seq);
    plan.prefill_tokens += run.chunk;
    ++scheduled;
  }

  // 5. Admissions, first come first served; the head is never passed over. Sequences still
  // to be forked hold their place in max_running from their request's admission.
  int64_t reserved = 0;
  if (!queue_.empty()) {  // only admissions need it
    for (const auto& [seq, run] : running_) reserved += run.req.forks_wanted;
  }
  while (!queue_.empty() && budget > 0 && scheduled < options_.max_running) {
    Queued& head = queue_.front();
    const auto size = static_cast<int32_t>(head.tokens.size());
    // Every group takes the whole prompt's blocks at admission (window groups release
    // theirs as the prefill's commits pass them).
    const int32_t blocks = BlocksFor(size) * NumGroups();
    // Whole, it would hold its prompt and every token it may generate: if that can never
    // fit, it could be preempted for ever. Nor can more sequences than max_running.
    const int64_t whole = int64_t{head.prompt_len} + head.max_new_tokens;
    if ((options_.num_blocks > 0 &&
         int64_t{BlocksFor(static_cast<int32_t>(std::min<int64_t>(whole, INT32_MAX - 64)))} *
                 NumGroups() >
             options_.num_blocks) ||
        whole > options_.max_batch_total_tokens || head.forks_wanted + 1 > options_.max_running) {
      plan.rejected.push_back(head.request);
      queue_.pop_front();
      continue;
    }
    if (static_cast<int64_t>(running_.size()) + reserved + head.forks_wanted + 1 >
        options_.max_running) {
      break;
    }
    if (blocks > available || total_tokens + size > options_.max_batch_total_tokens) break;
    reserved += head.forks_wanted;
    Running run;
    run.req = std::move(head);
    queue_.pop_front();
    run.seq = next_seq_++;
    run.executor = LeastLoaded(executors);
    run.admitted = next_admission_++;
    // Hashes of every full block of the prompt. The cache manager's hit never covers the
    // last prompt token (BlockLedger::Allocate), so it is always computed and never written
    // into a block another sequence shares.
    HashUpTo(run, size);
    run.chunk = std::min(size, budget);
    budget -= run.chunk;
    available -= blocks;
    total_tokens += size;
    // A prompt still to be scored is computed whole: no hashes, no hit.
    const bool scoring = run.req.outputs.prompt_logprobs && Unscored(run.req);
    add(BlockOp::Allocate(run.seq, size, scoring ? std::vector<BlockHash>{} : run.hashes), run.seq,
        StepPlan::OpRole::kAdmit);
    plan.chunks.push_back({run.seq, run.chunk});
    plan.prefill_tokens += run.chunk;
    scheduled_.push_back(run.seq);
    ++scheduled;
    seq_of_[run.req.request].push_back(run.seq);
    order_.push_back(run.seq);
    const SeqId seq = run.seq;
    running_.emplace(seq, std::move(run));
  }
  return plan;
}

namespace {

// The `i`-th sequence of `seqs`, as a fresh SeqWork: an element left from an earlier step
// is reset to the defaults but keeps its vectors' capacity.
SeqWork& FreshSeqWork(std::vector<SeqWork>& seqs, size_t i) {
  if (i == seqs.size()) return seqs.emplace_back();
  auto emptied = [](auto& v) {
    auto kept = std::move(v);
    kept.clear();
    return kept;
  };
  SeqWork& step = seqs[i];
  SeqWork fresh;
  fresh.tokens = emptied(step.tokens);
  fresh.block_table = emptied(step.block_table);
  fresh.penalty_tokens = emptied(step.penalty_tokens);
  fresh.fork_seeds = emptied(step.fork_seeds);
  fresh.group_tables = emptied(step.group_tables);
  step = std::move(fresh);
  return step;
}

}  // namespace

ExecutorWork& StepPlanner::Apply(const StepPlan& plan, std::span<const OpOutcome> outcomes) {
  KVCM_CHECK(outcomes.size() == plan.ops.size())
      << outcomes.size() << " outcomes for " << plan.ops.size() << " ops";
  ExecutorWork& work = work_;
  work.cached_prompt_tokens = 0;
  work.computed_prompt_tokens = 0;
  work.host_tier_prompt_tokens = 0;
  work.disk_tier_prompt_tokens = 0;
  work.loading_admissions = 0;
  work.recomputed_committed_tokens = 0;
  work.prefill_tokens = 0;
  work.decode_tokens = 0;
  // 1. The outcomes, op by op: blocks, commits, preemptions, refused admissions.
  ApplyOutcomes(plan, outcomes, work);
  // 2. The batches: each scheduled sequence's work, on its executor's batch.
  FillBatches(plan, work);
  return work;
}

void StepPlanner::ApplyCopies(Running& run, std::span<const CopyOrder> copies) const {
  // Each copy replaced the shared, partly filled last block of one group's table: the one
  // whose last block it copies.
  for (const CopyOrder& copy : copies) {
    if (!run.blocks.empty() && run.blocks.back() == copy.src) {
      run.blocks.back() = copy.dst;
      continue;
    }
    for (std::vector<BlockId>& table : run.group_blocks) {
      if (!table.empty() && table.back() == copy.src) {
        table.back() = copy.dst;
        break;
      }
    }
  }
}

bool StepPlanner::GroupBlocksFit(const OpOutcome& outcome) const {
  return outcome.group_blocks.size() ==
         static_cast<size_t>(NumGroups() - 1) * outcome.blocks.size();
}

absl::Status StepPlanner::GroupBlocksMismatch(const OpOutcome& outcome) const {
  return absl::InternalError(
      absl::StrCat("cache manager protocol error: ", outcome.group_blocks.size(),
                   " blocks of KV cache groups 1.. beside ", outcome.blocks.size(),
                   " of group 0, for ", NumGroups(), " groups"));
}

void StepPlanner::SplitGroupBlocks(const OpOutcome& outcome, Running& run) const {
  run.group_blocks.resize(static_cast<size_t>(NumGroups() - 1));
  const size_t n = outcome.blocks.size();
  for (size_t g = 0; g < run.group_blocks.size(); ++g) {
    const auto from = outcome.group_blocks.begin() + static_cast<ptrdiff_t>(g * n);
    run.group_blocks[g].assign(from, from + static_cast<ptrdiff_t>(n));
  }
}

// Apply's pass 1. Copy-on-write orders go to step_copies_ by sequence (only sequences that
// have some are in it).
void StepPlanner::ApplyOutcomes(const StepPlan& plan, std::span<const OpOutcome> outcomes,
                                ExecutorWork& work) {
  absl::flat_hash_map<SeqId, std::vector<CopyOrder>>& copies = step_copies_;
  copies.clear();
  std::vector<SeqId> refused_admissions;
  for (size_t i = 0; i < plan.ops.size(); ++i) {
    const BlockOp& op = plan.ops[i];
    const OpOutcome& outcome = outcomes[i];
    auto it = running_.find(plan.roles[i].seq);
    switch (plan.roles[i].kind) {
      case StepPlan::OpRole::kFree:
        break;  // NOT_FOUND (already gone) is as good as freed
      case StepPlan::OpRole::kFork:
        // Refused (a bug of either side): the child starts again from its tokens.
        if (!outcome.status.ok()) {
          NoteRefusal(outcome.status);
          if (it != running_.end()) Requeue(std::move(it->second), /*preempted=*/true);
        }
        break;
      case StepPlan::OpRole::kCommit:
        if (outcome.status.ok() && it != running_.end()) {
          it->second.committed = op.num_tokens;
          it->second.hashes_sent += static_cast<int32_t>(op.hashes.size());
        }
        break;
      case StepPlan::OpRole::kAppend:
        if (it == running_.end()) break;
        if (outcome.status.ok() && !GroupBlocksFit(outcome)) {
          NoteRefusal(GroupBlocksMismatch(outcome));
          to_free_.push_back(it->second.seq);
          Requeue(std::move(it->second), /*preempted=*/true);
          break;
        }
        if (outcome.status.ok()) {
          Running& run = it->second;
          run.held += op.num_tokens;
          // Copy-on-write: the copy replaced the shared, partly filled last block.
          if (!outcome.copies.empty()) ApplyCopies(run, outcome.copies);
          const size_t added = outcome.blocks.size();
          run.blocks.insert(run.blocks.end(), outcome.blocks.begin(), outcome.blocks.end());
          for (size_t g = 0; g < run.group_blocks.size(); ++g) {
            const auto from = outcome.group_blocks.begin() + static_cast<ptrdiff_t>(g * added);
            run.group_blocks[g].insert(run.group_blocks[g].end(), from,
                                       from + static_cast<ptrdiff_t>(added));
          }
          if (!outcome.copies.empty()) {
            auto& own = copies[run.seq];
            own.insert(own.end(), outcome.copies.begin(), outcome.copies.end());
          }
        } else {
          // No room after all: preempted, freed in the next step. Any other refusal is a
          // bug (e.g. a copy-on-write of uncommitted KV), met the same way and counted.
          if (!absl::IsResourceExhausted(outcome.status)) NoteRefusal(outcome.status);
          to_free_.push_back(it->second.seq);
          ++preemptions_;
          Requeue(std::move(it->second), /*preempted=*/true);
        }
        break;
      case StepPlan::OpRole::kAdmit:
        if (it == running_.end()) break;
        if (outcome.status.ok() && !GroupBlocksFit(outcome)) {
          // Allocated, but its tables cannot be read: freed, and admitted again later.
          NoteRefusal(GroupBlocksMismatch(outcome));
          to_free_.push_back(it->second.seq);
          refused_admissions.push_back(it->second.seq);
          break;
        }
        if (outcome.status.ok()) {
          Running& run = it->second;
          run.blocks = outcome.blocks;
          SplitGroupBlocks(outcome, run);
          run.held = op.num_tokens;
          run.committed = outcome.num_cached_tokens;
          run.computed = outcome.num_cached_tokens;
          run.hashes_sent = static_cast<int32_t>(op.hashes.size());
          if (run.req.readmitted) {
            work.recomputed_committed_tokens +=
                std::max(0, run.req.committed_before - outcome.num_cached_tokens);
          } else {
            run.req.cached_prompt_tokens = outcome.num_cached_tokens;
            work.cached_prompt_tokens += outcome.num_cached_tokens;
            work.host_tier_prompt_tokens += outcome.host_tokens;
            work.disk_tier_prompt_tokens += outcome.disk_tokens;
            work.computed_prompt_tokens += op.num_tokens - outcome.num_cached_tokens;
          }
        } else {
          if (absl::IsUnavailable(outcome.status)) ++work.loading_admissions;
          refused_admissions.push_back(it->second.seq);
        }
        break;
    }
  }
  // Refused admissions go back to the queue's head in their order.
  for (auto seq = refused_admissions.rbegin(); seq != refused_admissions.rend(); ++seq) {
    Requeue(std::move(running_.at(*seq)), /*preempted=*/false);
  }
}

// Apply's pass 2. The batches of earlier steps are filled again.
void StepPlanner::FillBatches(const StepPlan& plan, ExecutorWork& work) {
  const absl::flat_hash_map<SeqId, std::vector<CopyOrder>>& copies = step_copies_;
  // `batches` and `filled` count what this step has used of them (batches are few: one per
  // executor, found by a linear search).
  size_t batches = 0;
  std::vector<size_t> filled;
  auto batch_for = [&](ExecutorId executor) -> size_t {
    for (size_t b = 0; b < batches; ++b) {
      if (work.batches[b].executor == executor) return b;
    }
    if (batches == work.batches.size()) work.batches.emplace_back();
    ExecutorWork::Batch& batch = work.batches[batches];
    batch.executor = executor;
    batch.step.step_id = plan.step_id;
    batch.step.epoch = 0;
    batch.step.router_session = 0;
    batch.step.copies.clear();
    filled.push_back(0);
    return batches++;
  };
  std::vector<SeqId>& still = still_scheduled_;
  still.clear();
  for (SeqId seq : scheduled_) {
    auto it = running_.find(seq);
    if (it == running_.end() || it->second.chunk == 0) continue;
    Running& run = it->second;
    const auto size = static_cast<int32_t>(run.req.tokens.size());
    run.start = run.computed;
    const int32_t end = std::min(size, run.start + run.chunk);
    run.chunk = end - run.start;
    if (run.chunk == 1 && run.start >= run.req.prompt_len) {
      ++work.decode_tokens;
    } else {
      work.prefill_tokens += run.chunk;
    }
    const size_t b = batch_for(run.executor);
    StepBatch& step = work.batches[b].step;
    SeqWork& seq_step = FreshSeqWork(step.seqs, filled[b]++);
    seq_step.seq = seq;
    seq_step.tokens.assign(run.req.tokens.begin() + run.start, run.req.tokens.begin() + end);
    seq_step.context_len = end;
    seq_step.block_table.assign(run.blocks.begin(), run.blocks.begin() + BlocksFor(end));
    std::fill_n(seq_step.block_table.begin(), ReleasedBlocks(run), kNoBlock);
    for (size_t g = 0; g < run.group_blocks.size(); ++g) {
      const size_t at = seq_step.group_tables.size();
      seq_step.group_tables.insert(seq_step.group_tables.end(), run.group_blocks[g].begin(),
                                   run.group_blocks[g].begin() + BlocksFor(end));
      std::fill_n(seq_step.group_tables.begin() + static_cast<ptrdiff_t>(at),
                  ReleasedBlocks(run, static_cast<int32_t>(g + 1)), kNoBlock);
    }
    seq_step.sampling = run.req.sampling;
    seq_step.sample = end == size;
    seq_step.sample_index = run.req.generated;
    if (seq_step.sample) {
      if (run.req.sampling.penalized()) {
        seq_step.penalty_tokens.assign(run.req.tokens.begin(), run.req.tokens.begin() + end);
        seq_step.penalty_prompt_len = run.req.prompt_len;
      }
      seq_step.logprobs = run.req.outputs.logprobs;
      seq_step.top_n = run.req.outputs.top_n;
      for (int32_t choice = 1; choice <= run.req.forks_wanted; ++choice) {
        seq_step.fork_seeds.push_back(run.req.sampling.seed + static_cast<uint64_t>(choice));
      }
    }
    if (run.req.outputs.prompt_logprobs && Unscored(run.req) && run.start < run.req.prompt_len) {
      seq_step.input_logprobs = true;
      if (end < size) seq_step.score_next = run.req.tokens[static_cast<size_t>(end)];
    }
    if (auto c = copies.find(seq); c != copies.end()) {
      step.copies.insert(step.copies.end(), c->second.begin(), c->second.end());
    }
    still.push_back(seq);
  }
  work.batches.resize(batches);
  for (size_t b = 0; b < batches; ++b) work.batches[b].step.seqs.resize(filled[b]);
  scheduled_.swap(still);
}

void StepPlanner::Fork(Running& parent, const SeqResult& outcome, std::vector<TokenEvent>* events) {
  const int32_t forks = parent.req.forks_wanted;
  parent.req.forks_wanted = 0;
  const std::vector<int32_t> prompt(parent.req.tokens.begin(),
                                    parent.req.tokens.begin() + parent.req.prompt_len);
  // Made first, added after: adding to running_ may move `parent`.
  std::vector<Running> children;
  for (int32_t choice = 1; choice <= forks; ++choice) {
    const auto k = static_cast<size_t>(choice - 1);
    Running child;
    child.req = parent.req;
    child.req.tokens = prompt;
    child.req.tokens.push_back(outcome.fork_tokens[k]);
    child.req.choice = choice;
    child.req.sampling.seed = parent.req.sampling.seed + static_cast<uint64_t>(choice);
    child.req.outputs.prompt_logprobs = false;  // the request's own sequence reports them
    child.req.prompt_logprobs.clear();
    child.req.prompt_scored = 1;
    child.seq = next_seq_++;
    child.executor = parent.executor;
    child.admitted = next_admission_++;
    child.held = parent.held;
    child.computed = parent.computed;
    child.committed = parent.committed;
    child.hashes = parent.hashes;
    child.hashes_sent = parent.hashes_sent;
    child.blocks = parent.blocks;
    child.group_blocks = parent.group_blocks;
    child.fork_parent = parent.seq;
    TokenEvent event;
    event.request = child.req.request;
    event.choice = choice;
    event.token = outcome.fork_tokens[k];
    event.index = 0;
    event.finished = child.req.generated >= child.req.max_new_tokens;
    event.cached_prompt_tokens = child.req.cached_prompt_tokens;
    if (k < outcome.fork_logprobs.size()) event.logprob = outcome.fork_logprobs[k];
    event.top_ids = outcome.top_ids;  // the same distribution as the parent's first token
    event.top_logprobs = outcome.top_logprobs;
    if (event.finished) child.finishing = true;
    events->push_back(std::move(event));
    children.push_back(std::move(child));
  }
  parent.forks_pending += forks;
  for (Running& child : children) {
    seq_of_[child.req.request].push_back(child.seq);
    order_.push_back(child.seq);
    const SeqId seq = child.seq;
    running_.emplace(seq, std::move(child));
  }
}

std::vector<TokenEvent> StepPlanner::Complete(std::span<const SeqResult> results) {
  // Results come in the order the sequences were scheduled, executor by executor: each is
  // looked for at the next position first, and in a map only when it is not there.
  size_t next_result = 0;
  absl::flat_hash_map<SeqId, const SeqResult*> by_seq;  // built on the first miss
  auto result_of = [&](SeqId seq) -> const SeqResult* {
    if (next_result < results.size() && results[next_result].seq == seq) {
      return &results[next_result++];
    }
    if (by_seq.empty()) {
      by_seq.reserve(results.size());
      for (const SeqResult& result : results) by_seq[result.seq] = &result;
    }
    auto it = by_seq.find(seq);
    return it == by_seq.end() ? nullptr : it->second;
  };
  std::vector<TokenEvent> events;
  events.reserve(scheduled_.size());
  std::vector<std::pair<SeqId, const SeqResult*>> to_fork;
  for (SeqId seq : scheduled_) {
    auto it = running_.find(seq);
    if (it == running_.end()) continue;
    Running& run = it->second;
    const int32_t chunk = run.chunk;
    run.chunk = 0;
    const SeqResult* result = result_of(seq);
    if (result == nullptr || !result->status.ok()) continue;  // redone
    const SeqResult& outcome = *result;
    const int32_t end = run.start + chunk;
    const bool sampled = end == static_cast<int32_t>(run.req.tokens.size());
    if (sampled && outcome.token < 0) continue;  // asked for a token, got none
    run.computed = end;
    // Scores of positions start + 1 .. (the prompt's only).
    std::vector<float>& scores = run.req.prompt_logprobs;
    for (size_t j = 0; j < outcome.input_logprobs.size(); ++j) {
      const size_t position = static_cast<size_t>(run.start) + 1 + j;
      if (position < scores.size()) scores[position] = outcome.input_logprobs[j];
    }
    while (run.req.prompt_scored < static_cast<int32_t>(scores.size()) &&
           !std::isnan(scores[static_cast<size_t>(run.req.prompt_scored)])) {
      ++run.req.prompt_scored;
    }
    if (!sampled) continue;
    run.req.tokens.push_back(outcome.token);
    TokenEvent event;
    event.request = run.req.request;
    event.token = outcome.token;
    event.index = run.req.generated++;
    event.finished = run.req.generated >= run.req.max_new_tokens;
    event.cached_prompt_tokens = run.req.cached_prompt_tokens;
    event.choice = run.req.choice;
    event.logprob = outcome.logprob;
    event.top_ids = outcome.top_ids;
    event.top_logprobs = outcome.top_logprobs;
    if (event.index == 0 && run.req.outputs.prompt_logprobs) event.prompt_logprobs = scores;
    if (event.finished) run.finishing = true;
    events.push_back(std::move(event));
    if (run.req.forks_wanted > 0 &&
        static_cast<int32_t>(outcome.fork_tokens.size()) == run.req.forks_wanted) {
      to_fork.emplace_back(seq, &outcome);  // after the loop: forking adds to running_
    }
  }
  for (const auto& [seq, outcome] : to_fork) Fork(running_.at(seq), *outcome, &events);
  scheduled_.clear();
  return events;
}

}  // namespace kvcm::router
