#pragma once
// A step loop around StepPlanner for tests, with nothing faked but the model: the block ops
// run on a real ledger (a GroupedLedger, as the cache manager's: one full-attention group
// unless PlannerOptions::group_windows names groups; with the cache manager's own rule that
// a Commit covers only tokens that existed before the step), and a simulated executor
// writes each token into a pool of token slots through every group's block table and
// "samples" the next token from the context it reads back through group 0's table (which
// must attend fully), checking that each window group's table gives back what its window
// reads. A block table that points at the wrong
// block, a prefix hit on the wrong KV, a missed copy-on-write or a read of an unwritten slot
// shows up as a wrong token or a failed check.

#include <algorithm>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/block/block_ledger.h"
#include "common/block/grouped_ledger.h"
#include "services/router/step_planner.h"

namespace kvcm::router::testing {

// The "model": the next token of a context (depends on every token and its position).
inline int32_t NextToken(std::span<const int32_t> context) {
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < context.size(); ++i) {
    h = (h ^ static_cast<uint64_t>(context[i] + 1) * (i + 7)) * 1099511628211ull;
  }
  return static_cast<int32_t>(3 + h % 250);
}

// The "model's" log-probability of `token` at `position` (what input_logprobs reports).
inline float Score(int32_t position, int32_t token) {
  return -0.001f * static_cast<float>((position * 31 + token) % 1000) - 0.125f;
}

// The "model's" first token of a forked sequence drawn with `seed` (fork seeds).
inline int32_t ForkToken(std::span<const int32_t> context, uint64_t seed) {
  return static_cast<int32_t>(3 + (static_cast<uint64_t>(NextToken(context)) * 31 + seed) % 250);
}

// Greedy generation of one request alone, the reference.
inline std::vector<int32_t> Reference(std::vector<int32_t> tokens, int32_t max_new_tokens) {
  const size_t prompt = tokens.size();
  for (int32_t i = 0; i < max_new_tokens; ++i) tokens.push_back(NextToken(tokens));
  return std::vector<int32_t>(tokens.begin() + static_cast<std::ptrdiff_t>(prompt), tokens.end());
}

// Choice `choice` > 0 of a request with sampling seed `seed`: its first token drawn with
// seed + choice, then the reference's.
inline std::vector<int32_t> ForkReference(const std::vector<int32_t>& prompt,
                                          int32_t max_new_tokens, uint64_t seed, int32_t choice) {
  std::vector<int32_t> out = {ForkToken(prompt, seed + static_cast<uint64_t>(choice))};
  std::vector<int32_t> context = prompt;
  context.push_back(out[0]);
  const std::vector<int32_t> rest = Reference(context, max_new_tokens - 1);
  out.insert(out.end(), rest.begin(), rest.end());
  return out;
}

class PlannerSim {
 public:
  PlannerSim(const PlannerOptions& options, int32_t num_blocks)
      : options_(options),
        ledger_(MakeLedger(options, num_blocks)),
        pool_(static_cast<size_t>(num_blocks) * options.block_size, -1),
        planner_(options) {}

  static GroupedLedger MakeLedger(const PlannerOptions& options, int32_t num_blocks) {
    GroupedLedger::Options ledger;
    ledger.pool = {.num_blocks = num_blocks, .block_size = options.block_size};
    ledger.group_windows =
        options.group_windows.empty() ? std::vector<int32_t>{0} : options.group_windows;
    ledger.hash_algorithm = options.hash_algorithm;
    return *GroupedLedger::Create(ledger);
  }

  StepPlanner& planner() { return planner_; }
  // The cache manager restarts: a new, empty ledger and pool; the planner is told.
  void RestartCacheManager() {
    const int32_t num_blocks = ledger_.pool().num_blocks();
    ledger_ = MakeLedger(options_, num_blocks);
    std::fill(pool_.begin(), pool_.end(), -1);
    live_.clear();
    written_.clear();
    planner_.ResetAll();
  }
  // The pool's ledger (every group's blocks); the grouped one.
  const BlockLedger& ledger() const { return ledger_.pool(); }
  const GroupedLedger& grouped_ledger() const { return ledger_; }
  // What each request generated so far (its choice 0), and each choice of it.
  absl::flat_hash_map<RequestId, std::vector<int32_t>>& generated() { return generated_; }
  std::vector<int32_t>& generated(RequestId request, int32_t choice) {
    return choices_[{request, choice}];
  }
  const std::vector<StepPlan>& plans() const { return plans_; }
  // Each step's batches, as sent to the executors.
  const std::vector<ExecutorWork>& works() const { return works_; }
  int64_t cached_prompt_tokens() const { return cached_prompt_tokens_; }
  const std::vector<RequestId>& rejected() const { return rejected_; }
  // Tokens the ledger holds for every live sequence.
  int64_t LiveTokens() const {
    int64_t tokens = 0;
    for (SeqId seq : live_) tokens += *ledger_.NumTokens(seq);
    return tokens;
  }
  // First failure of a check, or "".
  const std::string& failure() const { return failure_; }
  // Changes what the planner is told of each op (after the ledger ran it): a cache manager
  // that answers wrongly.
  void set_tamper(std::function<void(const BlockOp&, OpOutcome&)> tamper) {
    tamper_ = std::move(tamper);
  }

  // Sequences freed with drain, in order.
  const std::vector<SeqId>& drained() const { return drained_; }

  // One step; `lose_executor`: every result of that executor is lost (it died mid-step).
  std::vector<TokenEvent> Step(std::span<const ExecutorId> executors,
                               ExecutorId lose_executor = 0) {
    // What the cache manager reports: free blocks and evictable cached ones.
    const LedgerStats stats = ledger_.pool().Stats();
    StepPlan plan = planner_.Plan(stats.free_blocks + stats.cached_blocks, executors);
    rejected_.insert(rejected_.end(), plan.rejected.begin(), plan.rejected.end());
    std::vector<OpOutcome> outcomes = RunOps(plan.ops);
    if (tamper_) {
      for (size_t i = 0; i < plan.ops.size(); ++i) tamper_(plan.ops[i], outcomes[i]);
    }
    ExecutorWork& work = planner_.Apply(plan, outcomes);
    cached_prompt_tokens_ += work.cached_prompt_tokens;
    std::vector<SeqResult> results;
    int64_t computed = 0;
    for (const ExecutorWork::Batch& batch : work.batches) {
      for (const SeqWork& seq : batch.step.seqs)
        computed += static_cast<int64_t>(seq.tokens.size());
      RunBatch(batch.step, batch.executor == lose_executor ? nullptr : &results);
    }
    if (computed != work.prefill_tokens + work.decode_tokens) {
      Fail(absl::StrCat("step ", plan.step_id, " computes ", computed, " tokens, its work says ",
                        work.prefill_tokens, " prefill + ", work.decode_tokens, " decode"));
    }
    plans_.push_back(std::move(plan));
    works_.push_back(std::move(work));
    std::vector<TokenEvent> events = planner_.Complete(results);
    for (const TokenEvent& event : events) {
      if (event.choice == 0) generated_[event.request].push_back(event.token);
      choices_[{event.request, event.choice}].push_back(event.token);
    }
    return events;
  }

  // A slot holds a token and the group that wrote it: a table that names another group's
  // block reads the wrong group.
  static int32_t Slot(int32_t token, int32_t group) { return token * 8 + group; }
  int32_t TokenIn(int32_t slot, int32_t group) {
    if (slot < 0) return -1;
    if (slot % 8 != group) {
      Fail(absl::StrCat("group ", group, " reads a slot group ", slot % 8, " wrote"));
    }
    return slot / 8;
  }
  // Block tables per sequence.
  int32_t NumGroups() const {
    return options_.group_windows.empty() ? 1 : static_cast<int32_t>(options_.group_windows.size());
  }

 private:
  void Fail(const std::string& what) {
    if (failure_.empty()) failure_ = what;
  }

  std::vector<OpOutcome> RunOps(const std::vector<BlockOp>& ops) {
    // Tokens each sequence had before the step (what a Commit may cover).
    absl::flat_hash_map<SeqId, int32_t> before;
    for (const BlockOp& op : ops) {
      if (auto tokens = ledger_.NumTokens(op.seq); tokens.ok()) before.try_emplace(op.seq, *tokens);
    }
    std::vector<OpOutcome> outcomes(ops.size());
    for (size_t i = 0; i < ops.size(); ++i) {
      const BlockOp& op = ops[i];
      OpOutcome& out = outcomes[i];
      switch (op.kind) {
        case wire::StepOp::AllocateOp: {
          if (std::find(drained_.begin(), drained_.end(), op.seq) != drained_.end()) {
            Fail(absl::StrCat("sequence ", op.seq, " was allocated again after its drain"));
          }
          GroupedTables allocated;
          out.status = ledger_.Allocate(op.seq, op.num_tokens, op.hashes, &allocated);
          if (!out.status.ok()) break;
          out.blocks = allocated.groups[0];
          for (size_t g = 1; g < allocated.groups.size(); ++g) {
            out.group_blocks.insert(out.group_blocks.end(), allocated.groups[g].begin(),
                                    allocated.groups[g].end());
          }
          out.num_cached_tokens = allocated.num_cached_tokens;
          live_.insert(op.seq);
          written_[op.seq] = allocated.num_cached_tokens;  // written by whoever cached them
          break;
        }
        case wire::StepOp::AppendOp: {
          if (std::find(drained_.begin(), drained_.end(), op.seq) != drained_.end()) {
            Fail(absl::StrCat("sequence ", op.seq, " grew after its drain"));
          }
          GroupedAppendResult appended;
          out.status = ledger_.Append(op.seq, op.num_tokens, &appended);
          if (!out.status.ok()) {
            // Only a lack of blocks is the planner's to meet (by preempting); any other
            // refusal is a bug it would hide, recomputing the sequence.
            if (!absl::IsResourceExhausted(out.status)) {
              Fail(absl::StrCat("append refused: ", out.status.ToString()));
            }
            break;
          }
          out.blocks = appended.groups[0].new_blocks;
          for (size_t g = 0; g < appended.groups.size(); ++g) {
            const AppendResult& group = appended.groups[g];
            if (g > 0) {
              out.group_blocks.insert(out.group_blocks.end(), group.new_blocks.begin(),
                                      group.new_blocks.end());
            }
            out.copies.insert(out.copies.end(), group.copies.begin(), group.copies.end());
          }
          break;
        }
        case wire::StepOp::CommitOp: {
          auto it = before.find(op.seq);
          if (it == before.end() || op.num_tokens > it->second) {
            Fail(absl::StrCat("commit of ", op.num_tokens, " tokens of sequence ", op.seq,
                              " that did not exist before the step"));
          }
          if (op.num_tokens > written_[op.seq]) {
            Fail(absl::StrCat("commit of ", op.num_tokens, " tokens of sequence ", op.seq,
                              ", of which only ", written_[op.seq], " were written"));
          }
          out.status = ledger_.Commit(op.seq, op.num_tokens, op.hashes);
          if (!out.status.ok()) Fail(absl::StrCat("commit refused: ", out.status.ToString()));
          break;
        }
        case wire::StepOp::FreeOp:
          out.status = ledger_.Free(op.seq);
          live_.erase(op.seq);
          if (op.drain) drained_.push_back(op.seq);
          break;
        case wire::StepOp::ForkOp:
          out.status = ledger_.Fork(op.seq, op.child);
          if (out.status.ok()) {
            live_.insert(op.child);
            written_[op.child] = written_[op.seq];  // the shared blocks hold the parent's KV
          } else {
            Fail(absl::StrCat("fork refused: ", out.status.ToString()));
          }
          break;
        default:
          Fail("unexpected op");
      }
    }
    return outcomes;
  }

  // `results` null: the executor died; it may have written some of the KV (it did, here).
  void RunBatch(const StepBatch& step, std::vector<SeqResult>* results) {
    const int32_t bs = options_.block_size;
    for (const CopyOrder& copy : step.copies) {
      for (int32_t j = 0; j < bs; ++j) pool_[copy.dst * bs + j] = pool_[copy.src * bs + j];
    }
    for (const SeqWork& seq : step.seqs) {
      if (seq.tokens.empty()) {  // the executor refuses it (DecodeStepBatch)
        Fail(absl::StrCat("sequence ", seq.seq, " scheduled without new tokens"));
        return;
      }
      const int32_t first = seq.context_len - static_cast<int32_t>(seq.tokens.size());
      if (static_cast<int32_t>(seq.block_table.size()) * bs < seq.context_len) {
        Fail(absl::StrCat("block table of sequence ", seq.seq, " too short"));
        return;
      }
      const int32_t groups = NumGroups();
      const size_t n = seq.block_table.size();
      if (seq.group_tables.size() != (static_cast<size_t>(groups) - 1) * n) {
        Fail(absl::StrCat("sequence ", seq.seq, " has ", seq.group_tables.size(),
                          " group table entries for ", groups, " groups of ", n));
        return;
      }
      auto table_of = [&](int32_t g) {
        return g == 0 ? std::span<const BlockId>(seq.block_table)
                      : std::span<const BlockId>(seq.group_tables).subspan((g - 1) * n, n);
      };
      // The tables are the ledger's, released entries included.
      if (auto tables = ledger_.BlockTables(seq.seq); tables.ok()) {
        for (int32_t g = 0; g < groups; ++g) {
          const std::vector<BlockId>& own = tables->groups[static_cast<size_t>(g)];
          const std::span<const BlockId> sent = table_of(g);
          if (own.size() < sent.size() || !std::equal(sent.begin(), sent.end(), own.begin())) {
            Fail(absl::StrCat("sequence ", seq.seq, ": group ", g, "'s table is not the ledger's"));
          }
        }
      }
      for (int32_t g = 0; g < groups; ++g) {
        const std::span<const BlockId> table = table_of(g);
        for (size_t k = 0; k < seq.tokens.size(); ++k) {
          const int32_t p = first + static_cast<int32_t>(k);
          if (table[p / bs] < 0) {
            Fail(absl::StrCat("sequence ", seq.seq, " writes position ", p, " of group ", g,
                              " into a released block"));
            return;
          }
          pool_[table[p / bs] * bs + p % bs] = Slot(seq.tokens[k], g);
        }
      }
      SeqResult result;
      result.seq = seq.seq;
      if (seq.sample) {
        std::vector<int32_t> context(static_cast<size_t>(seq.context_len));
        for (int32_t p = 0; p < seq.context_len; ++p) {
          context[p] = seq.block_table[p / bs] < 0
                           ? -1
                           : TokenIn(pool_[seq.block_table[p / bs] * bs + p % bs], 0);
          if (context[p] < 0) Fail(absl::StrCat("sequence ", seq.seq, " read unwritten KV"));
        }
        // Each window group gives back what its window reads for the step's first query
        // (the later queries read less of the past).
        for (int32_t g = 1; g < groups; ++g) {
          const int32_t window = options_.group_windows[static_cast<size_t>(g)];
          const std::span<const BlockId> table = table_of(g);
          for (int32_t p = window == 0 ? 0 : std::max(0, first - window + 1); p < seq.context_len;
               ++p) {
            const int32_t got =
                table[p / bs] < 0 ? -1 : TokenIn(pool_[table[p / bs] * bs + p % bs], g);
            if (got != context[p]) {
              Fail(absl::StrCat("sequence ", seq.seq, " reads ", got, " at position ", p,
                                " of group ", g, ", group 0 holds ", context[p]));
            }
          }
        }
        result.token = NextToken(context);
        // Penalties need the whole context, and only penalized sequences pay for it.
        if (seq.sampling.penalized()) {
          if (seq.penalty_tokens != context) {
            Fail(absl::StrCat("sequence ", seq.seq, " has penalty tokens other than its context"));
          }
        } else if (!seq.penalty_tokens.empty()) {
          Fail(absl::StrCat("sequence ", seq.seq, " has penalty tokens but no penalty"));
        }
        if (seq.logprobs) result.logprob = Score(seq.context_len, result.token);
        for (uint64_t seed : seq.fork_seeds) {
          result.fork_tokens.push_back(ForkToken(context, seed));
          if (seq.logprobs)
            result.fork_logprobs.push_back(Score(seq.context_len, result.fork_tokens.back()));
        }
        for (int32_t k = 0; k < seq.top_n; ++k) {
          result.top_ids.push_back(k);
          result.top_logprobs.push_back(Score(seq.context_len, k));
        }
      } else if (seq.logprobs || seq.top_n > 0 || !seq.penalty_tokens.empty() ||
                 !seq.fork_seeds.empty()) {
        Fail(absl::StrCat("sequence ", seq.seq, " asks for sampling outputs without sampling"));
      }
      if (seq.input_logprobs) {
        for (size_t k = 1; k < seq.tokens.size(); ++k) {
          result.input_logprobs.push_back(Score(first + static_cast<int32_t>(k), seq.tokens[k]));
        }
        if (seq.score_next >= 0)
          result.input_logprobs.push_back(Score(seq.context_len, seq.score_next));
      }
      if (results != nullptr) {
        results->push_back(result);
        // Written and answered: positions before context_len hold this sequence's KV.
        if (first <= written_[seq.seq]) {
          written_[seq.seq] = std::max(written_[seq.seq], seq.context_len);
        }
      }
    }
  }

  PlannerOptions options_;
  GroupedLedger ledger_;
  std::vector<int32_t> pool_;  // one token id per KV slot
  StepPlanner planner_;
  std::vector<ExecutorWork> works_;
  absl::flat_hash_map<RequestId, std::vector<int32_t>> generated_;
  absl::flat_hash_map<std::pair<RequestId, int32_t>, std::vector<int32_t>> choices_;
  std::vector<StepPlan> plans_;
  std::vector<RequestId> rejected_;
  int64_t cached_prompt_tokens_ = 0;
  absl::flat_hash_set<SeqId> live_;
  absl::flat_hash_map<SeqId, int32_t> written_;  // leading tokens whose KV is written
  std::string failure_;
  std::function<void(const BlockOp&, OpOutcome&)> tamper_;
  std::vector<SeqId> drained_;
};

}  // namespace kvcm::router::testing
