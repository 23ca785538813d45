// StepPlanner on scripted cases: a step's op order, chunked prefill, prefix caching, commits
// a step late, preemption by recompute, executor loss, rejection.

#include "services/router/step_planner.h"

#include <cmath>
#include <numeric>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/services/router/planner_sim.h"

namespace kvcm::router {
namespace {

using ::testing::ElementsAre;
using testing::PlannerSim;
using testing::Reference;

constexpr int32_t kBlockSize = 4;

PlannerOptions Options() {
  PlannerOptions options;
  options.block_size = kBlockSize;
  options.max_batch_prefill_tokens = 64;
  options.root_hash = RootHash(options.hash_algorithm, "test");
  return options;
}

std::vector<int32_t> Tokens(int32_t n, int32_t first = 10) {
  std::vector<int32_t> tokens(static_cast<size_t>(n));
  std::iota(tokens.begin(), tokens.end(), first);
  return tokens;
}

const ExecutorId kOne[] = {1};

TEST(StepPlannerTest, AStepFreesThenCommitsThenAppendsThenAdmits) {
  PlannerSim sim(Options(), 64);
  sim.planner().Enqueue(1, Tokens(6), 3);
  sim.Step(kOne);  // admits 1, prefills 6, samples its first token
  sim.planner().Enqueue(2, Tokens(5, 50), 1);
  sim.Step(kOne);  // commits 1, appends 1, admits 2
  const StepPlan& second = sim.plans()[1];
  std::vector<wire::StepOp> kinds;
  for (const BlockOp& op : second.ops) kinds.push_back(op.kind);
  EXPECT_THAT(
      kinds, ElementsAre(wire::StepOp::CommitOp, wire::StepOp::AppendOp, wire::StepOp::AllocateOp));
  EXPECT_EQ(second.ops[0].num_tokens, 6);  // what the first step wrote, a step late
  EXPECT_EQ(second.decode_tokens, 1);
  EXPECT_EQ(second.prefill_tokens, 5);
  sim.Step(kOne);  // request 2 is done: freed first in the next step
  sim.Step(kOne);
  // Request 1 is done by then: committed first (the KV its last step wrote, so that its
  // full blocks stay cached), then freed.
  std::vector<std::pair<wire::StepOp, int32_t>> ops;
  for (const BlockOp& op : sim.plans()[3].ops) ops.emplace_back(op.kind, op.num_tokens);
  using P = std::pair<wire::StepOp, int32_t>;
  EXPECT_THAT(ops, ElementsAre(P{wire::StepOp::CommitOp, 8}, P{wire::StepOp::FreeOp, 0}));
  EXPECT_EQ(sim.failure(), "");
  EXPECT_EQ(sim.generated()[1], Reference(Tokens(6), 3));
  EXPECT_EQ(sim.generated()[2], Reference(Tokens(5, 50), 1));
}

// Regression: a request that ended in the step that computed its prompt (one new token)
// was freed without a commit, so none of its prompt stayed in the prefix cache (nor reached
// the cache manager's tiers), and the same prompt again computed everything.
TEST(StepPlannerTest, ARequestEndingInItsPrefillStepLeavesItsPromptCached) {
  PlannerSim sim(Options(), 64);
  sim.planner().Enqueue(1, Tokens(9), 1);  // two full blocks of 4 and one token
  sim.Step(kOne);                          // prefills 9, samples its only token
  sim.Step(kOne);                          // commits 9 and frees it
  EXPECT_EQ(sim.ledger().Stats().cached_blocks, 2);
  EXPECT_EQ(sim.ledger().Stats().in_use_blocks, 0);
  sim.planner().Enqueue(2, Tokens(9), 1);
  sim.Step(kOne);
  EXPECT_EQ(sim.plans()[2].ops.back().kind, wire::StepOp::AllocateOp);
  EXPECT_EQ(sim.failure(), "");
  EXPECT_EQ(sim.generated()[2], Reference(Tokens(9), 1));
}

TEST(StepPlannerTest, ADecodingSequenceAppendsAndCommitsOnceABlockNotOnceAToken) {
  PlannerSim sim(Options(), 64);
  sim.planner().Enqueue(1, Tokens(5), 10);  // 15 tokens at most: blocks of 4 end at 8, 12, 15
  for (int step = 0; step < 11; ++step) sim.Step(kOne);
  // Per plan after the admission: (commit's tokens or 0, append's tokens or 0).
  std::vector<std::pair<int32_t, int32_t>> ops;
  for (size_t i = 1; i < sim.plans().size(); ++i) {
    std::pair<int32_t, int32_t> commit_append = {0, 0};
    for (const BlockOp& op : sim.plans()[i].ops) {
      if (op.kind == wire::StepOp::CommitOp) commit_append.first = op.num_tokens;
      if (op.kind == wire::StepOp::AppendOp) commit_append.second = op.num_tokens;
    }
    ops.push_back(commit_append);
  }
  using P = std::pair<int32_t, int32_t>;
  EXPECT_THAT(ops, ElementsAre(P{5, 3},  // the prompt's full block; room up to 8 tokens
                               P{0, 0}, P{0, 0}, P{8, 4},  // a block filled; room up to 12
                               P{0, 0}, P{0, 0}, P{0, 0},
                               P{12, 3},  // up to 15, the most it can reach, not 16
                               P{0, 0}, P{0, 0}));
  EXPECT_EQ(sim.failure(), "");
  EXPECT_EQ(sim.generated()[1], Reference(Tokens(5), 10));
}

TEST(StepPlannerTest, ALongPromptIsChunkedWithinThePrefillBudgetAndDecodesKeepRunning) {
  PlannerOptions options = Options();
  options.max_batch_prefill_tokens = 8;
  PlannerSim sim(options, 64);
  sim.planner().Enqueue(1, Tokens(3), 6);
  sim.Step(kOne);
  sim.planner().Enqueue(2, Tokens(30, 100), 2);
  for (int step = 0; step < 12; ++step) sim.Step(kOne);
  for (const StepPlan& plan : sim.plans()) EXPECT_LE(plan.prefill_tokens, 8);
  // Request 1 decoded in every step while request 2's 30 tokens went in chunks of 8.
  EXPECT_EQ(sim.plans()[1].decode_tokens, 1);
  EXPECT_EQ(sim.plans()[1].prefill_tokens, 8);
  EXPECT_EQ(sim.failure(), "");
  EXPECT_EQ(sim.generated()[1], Reference(Tokens(3), 6));
  EXPECT_EQ(sim.generated()[2], Reference(Tokens(30, 100), 2));
}

TEST(StepPlannerTest, ASharedPrefixIsNotComputedAgainButTheLastPromptTokenIs) {
  PlannerSim sim(Options(), 64);
  // 12 tokens of prefix (3 blocks), then different suffixes.
  std::vector<int32_t> a = Tokens(12);
  std::vector<int32_t> b = a;
  a.insert(a.end(), {90, 91});
  b.insert(b.end(), {70, 71, 72});
  sim.planner().Enqueue(1, a, 2);
  sim.Step(kOne);
  sim.Step(kOne);  // commits a's prompt: its full blocks enter the prefix index
  sim.planner().Enqueue(2, b, 2);
  sim.Step(kOne);
  EXPECT_EQ(sim.cached_prompt_tokens(), 12);
  // What the step computes: b's 3 tokens after the cached 12, no decode (a has finished).
  EXPECT_EQ(sim.plans().back().prefill_tokens, 15);  // planned before the prefix was known
  EXPECT_EQ(sim.works().back().prefill_tokens, 3);
  EXPECT_EQ(sim.works().back().decode_tokens, 0);
  // Exactly the whole prompt cached: still its last token is computed.
  sim.planner().Enqueue(3, Tokens(12), 1);
  for (int step = 0; step < 4; ++step) sim.Step(kOne);
  EXPECT_EQ(sim.cached_prompt_tokens(), 12 + 8);  // 2 blocks: the one with the last token is not
  EXPECT_EQ(sim.failure(), "");
  EXPECT_EQ(sim.generated()[1], Reference(a, 2));
  EXPECT_EQ(sim.generated()[2], Reference(b, 2));
  EXPECT_EQ(sim.generated()[3], Reference(Tokens(12), 1));
}

TEST(StepPlannerTest, OutOfBlocksTheLatestAdmittedIsPreemptedAndRecomputedToTheSameTokens) {
  // 6 blocks of 4: two requests of 8 prompt tokens and 10 new ones cannot both finish.
  PlannerOptions options = Options();
  options.num_blocks = 6;
  PlannerSim sim(options, 6);
  sim.planner().Enqueue(1, Tokens(8), 10);
  sim.planner().Enqueue(2, Tokens(8, 40), 10);
  for (int step = 0; step < 60 && sim.generated()[2].size() < 10; ++step) sim.Step(kOne);
  EXPECT_GE(sim.planner().preemptions(), 1u);
  EXPECT_EQ(sim.failure(), "");
  EXPECT_EQ(sim.generated()[1], Reference(Tokens(8), 10));
  EXPECT_EQ(sim.generated()[2], Reference(Tokens(8, 40), 10));
}

TEST(StepPlannerTest, ALostExecutorsSequencesMoveAndOnlyTheLostStepIsRedone) {
  PlannerSim sim(Options(), 64);
  const ExecutorId two[] = {1, 2};
  sim.planner().Enqueue(1, Tokens(5), 6);
  sim.planner().Enqueue(2, Tokens(7, 30), 6);
  sim.Step(two);
  sim.Step(two);
  // Executor 2 dies mid-step: its results are lost; its sequence moves to executor 1.
  const std::vector<TokenEvent> lost = sim.Step(two, /*lose_executor=*/2);
  EXPECT_EQ(lost.size(), 1u);
  const ExecutorId one[] = {1};
  for (int step = 0; step < 10; ++step) sim.Step(one);
  // Nothing was allocated again: the moved sequence kept its blocks and its written KV.
  int allocations = 0;
  for (const StepPlan& plan : sim.plans()) {
    for (const BlockOp& op : plan.ops) allocations += op.kind == wire::StepOp::AllocateOp;
  }
  EXPECT_EQ(allocations, 2);
  EXPECT_EQ(sim.failure(), "");
  EXPECT_EQ(sim.generated()[1], Reference(Tokens(5), 6));
  EXPECT_EQ(sim.generated()[2], Reference(Tokens(7, 30), 6));
  EXPECT_EQ(sim.planner().preemptions(), 0u);
}

TEST(StepPlannerTest, AHungExecutorsSequencesAreFreedWithDrainAndComputedAgainElsewhere) {
  PlannerSim sim(Options(), 64);
  const ExecutorId two[] = {1, 2};
  sim.planner().Enqueue(1, Tokens(5), 6);
  sim.planner().Enqueue(2, Tokens(9, 30), 6);
  sim.Step(two);
  sim.Step(two);
  // Executor 2 stops answering mid-step and is dropped without proof that it stopped: it may
  // still write the slots of that step, so its sequence must not keep (or give back) them.
  const std::vector<TokenEvent> lost = sim.Step(two, /*lose_executor=*/2);
  EXPECT_EQ(lost.size(), 1u);
  sim.planner().Abandon(2);
  EXPECT_EQ(sim.planner().queued(), 1u);
  const size_t abandoned_at = sim.plans().size();
  const ExecutorId one[] = {1};
  for (int step = 0; step < 12; ++step) sim.Step(one);
  // Its sequence was freed with drain, once, and the request computed again under a new id
  // (its committed full blocks found in the prefix cache), to the same tokens.
  ASSERT_EQ(sim.drained().size(), 1u);
  int allocations = 0;
  for (size_t i = 0; i < sim.plans().size(); ++i) {
    for (const BlockOp& op : sim.plans()[i].ops) {
      allocations += op.kind == wire::StepOp::AllocateOp;
      if (i >= abandoned_at &&
          (op.kind == wire::StepOp::AllocateOp || op.kind == wire::StepOp::AppendOp)) {
        EXPECT_NE(op.seq, sim.drained().front()) << "a drained sequence id came back";
      }
    }
  }
  EXPECT_EQ(allocations, 3);
  EXPECT_EQ(sim.planner().preemptions(), 1u);
  EXPECT_EQ(sim.failure(), "");
  EXPECT_EQ(sim.generated()[1], Reference(Tokens(5), 6));
  EXPECT_EQ(sim.generated()[2], Reference(Tokens(9, 30), 6));
}

TEST(StepPlannerTest, AfterACacheManagerRestartRunningRequestsStartAgainAndKeepTheirTokens) {
  PlannerSim sim(Options(), 64);
  sim.planner().Enqueue(1, Tokens(9), 8);
  sim.planner().Enqueue(2, Tokens(5, 40), 8);
  for (int step = 0; step < 4; ++step) sim.Step(kOne);
  ASSERT_EQ(sim.generated()[1].size(), 4u);
  sim.RestartCacheManager();
  EXPECT_EQ(sim.planner().running(), 0u);
  EXPECT_EQ(sim.planner().queued(), 2u);
  for (int step = 0; step < 20; ++step) sim.Step(kOne);
  EXPECT_EQ(sim.failure(), "");
  // The tokens already sent stay, and the rest follow as if nothing happened.
  EXPECT_EQ(sim.generated()[1], Reference(Tokens(9), 8));
  EXPECT_EQ(sim.generated()[2], Reference(Tokens(5, 40), 8));
}

TEST(StepPlannerTest, ARequestThatCanNeverFitIsRejectedAndTheQueueMovesOn) {
  PlannerOptions options = Options();
  options.num_blocks = 4;
  PlannerSim sim(options, 4);
  sim.planner().Enqueue(1, Tokens(17), 1);  // 5 blocks
  sim.planner().Enqueue(2, Tokens(3), 1);
  sim.Step(kOne);
  EXPECT_THAT(sim.rejected(), ElementsAre(1u));
  sim.Step(kOne);
  EXPECT_EQ(sim.generated()[2], Reference(Tokens(3), 1));
}

TEST(StepPlannerTest, OnlyPenalizedSequencesCarryTheirContextAndOnlyWhenTheySample) {
  PlannerOptions options = Options();
  options.max_batch_prefill_tokens = 4;  // a prompt of 9 goes in 3 chunks
  PlannerSim sim(options, 64);
  SamplingParams penalized;
  penalized.repetition_penalty = 1.3f;
  sim.planner().Enqueue(1, Tokens(9), 4, penalized);
  sim.planner().Enqueue(2, Tokens(3, 70), 4);
  for (int step = 0; step < 12; ++step) sim.Step(kOne);
  int penalized_samples = 0;
  for (const ExecutorWork& work : sim.works()) {
    for (const auto& batch : work.batches) {
      for (const SeqWork& seq : batch.step.seqs) {
        if (!seq.penalty_tokens.empty()) {
          ++penalized_samples;
          EXPECT_EQ(seq.penalty_prompt_len, 9);
          EXPECT_EQ(static_cast<int32_t>(seq.penalty_tokens.size()), seq.context_len);
        }
      }
    }
  }
  EXPECT_EQ(penalized_samples, 4);  // one per generated token; none for the prefill chunks
  EXPECT_EQ(sim.failure(), "");     // the sim checks the tokens are the context
  EXPECT_EQ(sim.generated()[1], Reference(Tokens(9), 4));
}

TEST(StepPlannerTest, TokenLogprobsAndAlternativesComeWithEachToken) {
  PlannerSim sim(Options(), 64);
  RequestOutputs outputs;
  outputs.logprobs = true;
  outputs.top_n = 3;
  sim.planner().Enqueue(1, Tokens(6), 3, {}, outputs);
  sim.planner().Enqueue(2, Tokens(6, 40), 3);
  std::vector<TokenEvent> events;
  for (int step = 0; step < 5; ++step) {
    for (TokenEvent& e : sim.Step(kOne)) events.push_back(std::move(e));
  }
  int checked = 0;
  for (const TokenEvent& e : events) {
    if (e.request == 2) {
      EXPECT_TRUE(e.top_ids.empty());
      continue;
    }
    EXPECT_EQ(e.logprob, testing::Score(6 + e.index, e.token));
    EXPECT_THAT(e.top_ids, ElementsAre(0, 1, 2));
    EXPECT_EQ(e.top_logprobs.size(), 3u);
    ++checked;
  }
  EXPECT_EQ(checked, 3);
  EXPECT_EQ(sim.failure(), "");
}

TEST(StepPlannerTest, PromptLogprobsScoreEveryPromptTokenAcrossChunksAndSkipThePrefixCache) {
  PlannerOptions options = Options();
  options.max_batch_prefill_tokens = 8;
  PlannerSim sim(options, 64);
  const std::vector<int32_t> prompt = Tokens(30, 100);
  sim.planner().Enqueue(1, prompt, 2);
  for (int step = 0; step < 6; ++step) sim.Step(kOne);  // its blocks are committed
  RequestOutputs outputs;
  outputs.prompt_logprobs = true;
  sim.planner().Enqueue(2, prompt, 2, {}, outputs);
  std::vector<float> scores;
  for (int step = 0; step < 8; ++step) {
    for (const TokenEvent& e : sim.Step(kOne)) {
      if (e.request != 2) continue;
      if (e.index == 0) {
        scores = e.prompt_logprobs;
      } else {
        EXPECT_TRUE(e.prompt_logprobs.empty());
      }
    }
  }
  EXPECT_EQ(sim.cached_prompt_tokens(), 0);  // the cached prompt was computed again, scored
  ASSERT_EQ(scores.size(), prompt.size());
  EXPECT_TRUE(std::isnan(scores[0]));
  for (size_t p = 1; p < prompt.size(); ++p) {
    EXPECT_EQ(scores[p], testing::Score(static_cast<int32_t>(p), prompt[p])) << "position " << p;
  }
  // A request without scores still hits the cache the scored one committed.
  sim.planner().Enqueue(3, prompt, 1);
  for (int step = 0; step < 6; ++step) sim.Step(kOne);
  EXPECT_EQ(sim.cached_prompt_tokens(), 28);
  EXPECT_EQ(sim.failure(), "");
  EXPECT_EQ(sim.generated()[2], Reference(prompt, 2));
}

TEST(StepPlannerTest, SeveralAnswersShareThePromptByForkAndCopyTheLastBlockOnWrite) {
  PlannerSim sim(Options(), 64);
  // 10 prompt tokens: 2 full blocks and a partly filled third, which the forks share.
  const std::vector<int32_t> prompt = Tokens(10);
  SamplingParams sampling;
  sampling.seed = 500;
  RequestOutputs outputs;
  outputs.sequences = 3;
  sim.planner().Enqueue(1, prompt, 6, sampling, outputs);
  sim.Step(kOne);  // the prompt, once; its first token and the forks' first tokens
  EXPECT_EQ(sim.plans()[0].prefill_tokens, 10);
  sim.Step(kOne);  // commit, two forks, three appends with copy-on-write
  std::vector<wire::StepOp> kinds;
  for (const BlockOp& op : sim.plans()[1].ops) kinds.push_back(op.kind);
  EXPECT_THAT(kinds,
              ElementsAre(wire::StepOp::CommitOp, wire::StepOp::ForkOp, wire::StepOp::ForkOp,
                          wire::StepOp::AppendOp, wire::StepOp::AppendOp, wire::StepOp::AppendOp));
  size_t copies = 0;
  for (const auto& batch : sim.works()[1].batches) copies += batch.step.copies.size();
  EXPECT_EQ(copies, 2u);  // two of the three sharers copy; the last one keeps the block
  for (int step = 0; step < 10; ++step) sim.Step(kOne);
  EXPECT_EQ(sim.failure(), "");
  // Choice 0 is the request's own sequence; each other starts from its own seed.
  EXPECT_EQ(sim.generated(1, 0), Reference(prompt, 6));
  EXPECT_EQ(sim.generated(1, 1), testing::ForkReference(prompt, 6, 500, 1));
  EXPECT_EQ(sim.generated(1, 2), testing::ForkReference(prompt, 6, 500, 2));
  EXPECT_NE(sim.generated(1, 1), sim.generated(1, 2));
  sim.Step(kOne);
  EXPECT_EQ(sim.planner().running(), 0u);
  EXPECT_EQ(sim.ledger().Stats().in_use_blocks, 0);
}

// A prompt inside one block fills none, so only the fork makes the parent commit: the
// children's Appends copy the shared partial block, which needs its KV committed.
TEST(StepPlannerTest, AParentWhosePromptFillsNoBlockCommitsBeforeItIsForked) {
  PlannerSim sim(Options(), 64);
  const std::vector<int32_t> prompt = Tokens(kBlockSize - 1);
  RequestOutputs outputs;
  outputs.sequences = 3;
  sim.planner().Enqueue(1, prompt, 4, {}, outputs);
  sim.Step(kOne);  // the prompt
  sim.Step(kOne);  // commit, forks, appends
  const std::vector<BlockOp>& ops = sim.plans()[1].ops;
  ASSERT_GE(ops.size(), 3u);
  EXPECT_EQ(ops[0].kind, wire::StepOp::CommitOp);
  EXPECT_EQ(ops[0].num_tokens, kBlockSize - 1);
  EXPECT_EQ(ops[1].kind, wire::StepOp::ForkOp);
  EXPECT_EQ(ops[1].seq, ops[0].seq);
  EXPECT_EQ(ops[2].kind, wire::StepOp::ForkOp);
  EXPECT_EQ(sim.failure(), "");
  for (int step = 0; step < 8; ++step) sim.Step(kOne);
  EXPECT_EQ(sim.failure(), "");
  EXPECT_EQ(sim.generated(1, 0), Reference(prompt, 4));
  EXPECT_EQ(sim.generated(1, 1), testing::ForkReference(prompt, 4, 0, 1));
  EXPECT_EQ(sim.generated(1, 2), testing::ForkReference(prompt, 4, 0, 2));
}

// An Append refused for another reason than room is a bug of one side: counted apart (the
// router logs it), while its sequence is computed again and the answer stays right.
TEST(StepPlannerTest, AnAppendRefusedForAnotherReasonThanRoomIsCountedAndComputedAgain) {
  PlannerSim sim(Options(), 64);
  const std::vector<int32_t> prompt = Tokens(6);
  sim.planner().Enqueue(1, prompt, 4, {}, RequestOutputs{});
  int refused = 0;
  sim.set_tamper([&refused](const BlockOp& op, OpOutcome& outcome) {
    if (op.kind != wire::StepOp::AppendOp || refused > 0) return;
    ++refused;
    outcome = OpOutcome{};
    outcome.status = absl::FailedPreconditionError("refused by the test");
  });
  for (int step = 0; step < 12; ++step) sim.Step(kOne);
  EXPECT_EQ(refused, 1);
  EXPECT_EQ(sim.planner().refused_ops(), 1u);
  EXPECT_EQ(sim.planner().last_refusal().message(), "refused by the test");
  EXPECT_EQ(sim.planner().preemptions(), 1u);
  EXPECT_EQ(sim.failure(), "");
  EXPECT_EQ(sim.generated()[1], Reference(prompt, 4));
  EXPECT_EQ(sim.planner().running(), 0u);
  EXPECT_EQ(sim.ledger().Stats().in_use_blocks, 0);
}

TEST(StepPlannerTest, ARequestWhoseFirstTokenEndsItStillForksItsOthers) {
  PlannerSim sim(Options(), 64);
  RequestOutputs outputs;
  outputs.sequences = 2;
  sim.planner().Enqueue(1, Tokens(7), 3, {}, outputs);
  sim.Step(kOne);
  sim.planner().Finish(1, /*choice=*/0);  // say choice 0 drew EOS
  for (int step = 0; step < 6; ++step) sim.Step(kOne);
  EXPECT_EQ(sim.failure(), "");
  EXPECT_EQ(sim.generated(1, 0).size(), 1u);
  EXPECT_EQ(sim.generated(1, 1), testing::ForkReference(Tokens(7), 3, 0, 1));
  EXPECT_EQ(sim.planner().running(), 0u);
  EXPECT_EQ(sim.ledger().Stats().in_use_blocks, 0);
}

TEST(StepPlannerTest, WithoutExecutorsNothingIsAdmitted) {
  PlannerSim sim(Options(), 16);
  sim.planner().Enqueue(1, Tokens(3), 1);
  sim.Step({});
  EXPECT_EQ(sim.planner().queued(), 1u);
  EXPECT_TRUE(sim.plans()[0].ops.empty());
  sim.Step(kOne);
  EXPECT_EQ(sim.generated()[1], Reference(Tokens(3), 1));
}

// KV cache groups (docs/architecture.md, "The hybrid KV cache"): a full group and a window
// group of 8 tokens. Every group's table reaches the executor, the window group's with -1
// behind its window; the simulated executor writes every group and checks that each window
// group gives back what its window reads; answers are the reference's.
PlannerOptions GroupedOptions() {
  PlannerOptions options = Options();
  options.group_windows = {0, 8};
  return options;
}

TEST(StepPlannerGroupsTest, EachGroupsTableReachesTheExecutorWithItsWindowsReleases) {
  PlannerSim sim(GroupedOptions(), 64);
  sim.planner().Enqueue(1, Tokens(30), 20);
  sim.planner().Enqueue(2, Tokens(9, 40), 25);
  bool window_released = false;
  for (int step = 0; step < 40; ++step) {
    sim.Step(kOne);
    for (const auto& batch : sim.works().back().batches) {
      for (const SeqWork& seq : batch.step.seqs) {
        ASSERT_EQ(seq.group_tables.size(), seq.block_table.size());
        // Group 0 attends fully: never a released entry.
        EXPECT_EQ(std::count(seq.block_table.begin(), seq.block_table.end(), -1), 0);
        window_released |= std::count(seq.group_tables.begin(), seq.group_tables.end(), -1) > 0;
      }
    }
  }
  EXPECT_TRUE(window_released);
  EXPECT_EQ(sim.failure(), "");
  EXPECT_EQ(sim.generated()[1], Reference(Tokens(30), 20));
  EXPECT_EQ(sim.generated()[2], Reference(Tokens(9, 40), 25));
  EXPECT_EQ(sim.planner().running(), 0u);
  EXPECT_EQ(sim.ledger().Stats().in_use_blocks, 0);
  EXPECT_TRUE(sim.grouped_ledger().CheckInvariants().ok());
}

TEST(StepPlannerGroupsTest, TheWindowGroupHoldsOnlyItsWindowWhileDecoding) {
  PlannerSim sim(GroupedOptions(), 64);
  sim.planner().Enqueue(1, Tokens(40), 30);
  for (int step = 0; step < 20; ++step) sim.Step(kOne);
  ASSERT_EQ(sim.planner().running(), 1u);
  // Group 0 holds every block of the context; the window group at most its 8 tokens and
  // the blocks being filled: 2 + 2 blocks of 4.
  const std::vector<StepPlanner::RunningSummary> running = sim.planner().RunningSummaries(1);
  const int32_t context = running[0].prompt_tokens + running[0].generated_tokens;
  EXPECT_LE(running[0].blocks, (context + kBlockSize - 1) / kBlockSize + 4);
  EXPECT_EQ(sim.planner().held_blocks(), sim.ledger().Stats().in_use_blocks);
  for (int step = 0; step < 20; ++step) sim.Step(kOne);
  EXPECT_EQ(sim.failure(), "");
  EXPECT_EQ(sim.generated()[1], Reference(Tokens(40), 30));
}

TEST(StepPlannerGroupsTest, ASharedPrefixHitsInEveryGroupAndForksCopyEveryGroup) {
  PlannerSim sim(GroupedOptions(), 96);
  std::vector<int32_t> a = Tokens(24);
  std::vector<int32_t> b = a;
  a.insert(a.end(), {90, 91});
  b.insert(b.end(), {70, 71, 72});
  sim.planner().Enqueue(1, a, 2);
  sim.Step(kOne);
  sim.Step(kOne);
  sim.planner().Enqueue(2, b, 2);
  RequestOutputs outputs;
  outputs.sequences = 3;
  sim.planner().Enqueue(3, Tokens(13, 200), 6, {}, outputs);
  for (int step = 0; step < 16; ++step) sim.Step(kOne);
  EXPECT_EQ(sim.cached_prompt_tokens(), 24);
  EXPECT_EQ(sim.failure(), "");
  EXPECT_EQ(sim.generated()[1], Reference(a, 2));
  EXPECT_EQ(sim.generated()[2], Reference(b, 2));
  EXPECT_EQ(sim.generated(3, 0), Reference(Tokens(13, 200), 6));
  EXPECT_EQ(sim.generated(3, 2), testing::ForkReference(Tokens(13, 200), 6, 0, 2));
  EXPECT_EQ(sim.ledger().Stats().in_use_blocks, 0);
}

TEST(StepPlannerGroupsTest, OutOfBlocksInAnyGroupTheLatestIsPreemptedToTheSameTokens) {
  PlannerOptions options = GroupedOptions();
  options.num_blocks = 14;
  PlannerSim sim(options, 14);
  sim.planner().Enqueue(1, Tokens(8), 12);
  sim.planner().Enqueue(2, Tokens(8, 40), 12);
  for (int step = 0; step < 80 && sim.generated()[2].size() < 12; ++step) sim.Step(kOne);
  EXPECT_GE(sim.planner().preemptions(), 1u);
  EXPECT_EQ(sim.failure(), "");
  EXPECT_EQ(sim.generated()[1], Reference(Tokens(8), 12));
  EXPECT_EQ(sim.generated()[2], Reference(Tokens(8, 40), 12));
}

// A cache manager whose reply lacks the other groups' blocks is refused, never misread:
// counted, the sequence freed and computed again.
TEST(StepPlannerGroupsTest, AReplyWithoutTheOtherGroupsBlocksIsRefusedNotMisread) {
  PlannerSim sim(GroupedOptions(), 64);
  int tampered = 0;
  sim.set_tamper([&tampered](const BlockOp& op, OpOutcome& outcome) {
    if (op.kind != wire::StepOp::AllocateOp || tampered > 0 || !outcome.status.ok()) return;
    ++tampered;
    outcome.group_blocks.clear();
  });
  sim.planner().Enqueue(1, Tokens(10), 5);
  for (int step = 0; step < 12; ++step) sim.Step(kOne);
  EXPECT_EQ(tampered, 1);
  EXPECT_EQ(sim.planner().refused_ops(), 1u);
  EXPECT_EQ(sim.failure(), "");
  EXPECT_EQ(sim.generated()[1], Reference(Tokens(10), 5));
  EXPECT_EQ(sim.ledger().Stats().in_use_blocks, 0);
}

}  // namespace
}  // namespace kvcm::router
