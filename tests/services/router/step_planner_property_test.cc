// StepPlanner property test: random arrivals, prompt lengths with shared prefixes, output
// lengths, pool sizes, budgets, cancellations, executor deaths and hangs, on a real
// BlockLedger and a simulated executor (tests/services/router/planner_sim.h). For every
// seed (printed): no check of the simulation fails (a drained sequence never used again,
// block tables, prefix hits, copy-on-write, commits only of written KV), the prefill budget
// and max_batch_total_tokens are never exceeded, every request that is not cancelled or
// rejected finishes (nobody starves) with exactly the tokens of running it alone, and at
// the end no block is left in use.

#include <cstdio>
#include <random>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "gtest/gtest.h"
#include "services/router/step_planner.h"
#include "tests/services/router/planner_sim.h"

namespace kvcm::router {
namespace {

using testing::PlannerSim;
using testing::Reference;

constexpr int kSeeds = 16;
constexpr int kRequests = 24;
constexpr int kMaxSteps = 4000;

struct Request {
  RequestId id = 0;
  std::vector<int32_t> prompt;
  int32_t max_new_tokens = 0;
  int arrival = 0;
  bool cancelled = false;
  SamplingParams sampling;
  RequestOutputs outputs;
};

TEST(StepPlannerPropertyTest, BudgetsHoldNobodyStarvesAndGreedyTokensEqualTheReference) {
  for (int seed = 1; seed <= kSeeds; ++seed) {
    std::printf("seed %d\n", seed);
    SCOPED_TRACE(seed);
    std::mt19937 rng(static_cast<uint32_t>(seed));
    auto pick = [&rng](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
    PlannerOptions options;
    options.block_size = std::vector<int>{1, 2, 4, 8}[pick(0, 3)];
    options.max_batch_prefill_tokens = pick(1, 40);
    options.num_blocks = pick(4, 48) * (options.block_size == 1 ? 4 : 1);
    const int64_t pool_tokens = int64_t{options.num_blocks} * options.block_size;
    options.max_batch_total_tokens = pick(0, 1) ? pool_tokens : pick(8, 64);
    options.max_running = pick(1, 12);
    options.root_hash = RootHash(options.hash_algorithm, "seed");
    PlannerSim sim(options, options.num_blocks);

    // Three system prompts (0 to 3 blocks) that requests share.
    std::vector<std::vector<int32_t>> prefixes(3);
    for (auto& prefix : prefixes) {
      const int n = pick(0, 3) * options.block_size;
      for (int i = 0; i < n; ++i) prefix.push_back(pick(3, 250));
    }
    std::vector<Request> requests(kRequests);
    for (int r = 0; r < kRequests; ++r) {
      Request& q = requests[r];
      q.id = static_cast<RequestId>(r + 1);
      q.prompt = prefixes[pick(0, 2)];
      const int suffix = pick(1, 10);
      for (int i = 0; i < suffix; ++i) q.prompt.push_back(pick(3, 250));
      q.max_new_tokens = pick(1, 12);
      q.arrival = pick(0, 40);
      if (pick(0, 3) == 0) q.sampling.frequency_penalty = 0.5f;  // carries its context
      q.outputs.logprobs = pick(0, 3) == 0;
      q.outputs.prompt_logprobs = pick(0, 3) == 0;             // skips the prefix cache, scored
      q.outputs.sequences = pick(0, 3) == 0 ? pick(2, 3) : 1;  // forks
      q.sampling.seed = static_cast<uint64_t>(pick(0, 1000));
    }
    std::vector<ExecutorId> executors = {1, 2};
    ExecutorId next_executor = 3;
    int finished = 0;
    absl::flat_hash_set<RequestId> done;
    absl::flat_hash_map<RequestId, int> choices_done;
    for (int step = 0; step < kMaxSteps && finished < kRequests; ++step) {
      for (Request& q : requests) {
        if (q.arrival == step) {
          sim.planner().Enqueue(q.id, q.prompt, q.max_new_tokens, q.sampling, q.outputs);
        }
      }
      // Now and then a client leaves, an executor dies mid-step, or one joins.
      if (pick(0, 30) == 0) {
        Request& q = requests[pick(0, kRequests - 1)];
        if (q.arrival <= step && !done.contains(q.id)) {
          q.cancelled = true;
          sim.planner().Finish(q.id);
          done.insert(q.id);
          ++finished;
        }
      }
      ExecutorId lose = 0;
      if (pick(0, 25) == 0 && executors.size() > 1) lose = executors[pick(0, 1)];
      if (pick(0, 40) == 0) executors.push_back(next_executor++);
      const std::vector<TokenEvent> events = sim.Step(executors, lose);
      if (lose != 0) {
        std::erase(executors, lose);
        // Half the losses are hangs (dropped for silence, not proven dead): its sequences
        // are freed with drain and computed again.
        if (pick(0, 1) == 0) sim.planner().Abandon(lose);
      }
      ASSERT_EQ(sim.failure(), "") << "step " << step;

      const StepPlan& plan = sim.plans().back();
      EXPECT_LE(plan.prefill_tokens, options.max_batch_prefill_tokens);
      for (RequestId id : plan.rejected) {
        if (done.insert(id).second) ++finished;
      }
      for (const TokenEvent& event : events) {
        if (event.finished &&
            ++choices_done[event.request] == requests[event.request - 1].outputs.sequences &&
            done.insert(event.request).second) {
          ++finished;
        }
        const Request& q = requests[event.request - 1];
        if (event.index == 0 && event.choice == 0 && q.outputs.prompt_logprobs) {
          // Every prompt token scored once, whatever the chunks, preemptions and failovers.
          ASSERT_EQ(event.prompt_logprobs.size(), q.prompt.size()) << "request " << q.id;
          for (size_t p = 1; p < q.prompt.size(); ++p) {
            EXPECT_EQ(event.prompt_logprobs[p],
                      testing::Score(static_cast<int32_t>(p), q.prompt[p]))
                << "request " << q.id << " position " << p;
          }
        } else {
          EXPECT_TRUE(event.prompt_logprobs.empty()) << "request " << q.id;
        }
      }
      // The KV tokens of every live sequence stay under max_batch_total_tokens.
      EXPECT_LE(sim.LiveTokens(), options.max_batch_total_tokens) << "step " << step;
      EXPECT_LE(sim.planner().running(), static_cast<size_t>(options.max_running));
    }
    ASSERT_EQ(finished, kRequests) << "some request starved: " << sim.planner().queued()
                                   << " queued, " << sim.planner().running() << " running";
    int completed = 0;
    for (const Request& q : requests) {
      if (q.cancelled) continue;
      if (std::find(sim.rejected().begin(), sim.rejected().end(), q.id) != sim.rejected().end()) {
        // Only requests that can never finish are rejected.
        const int64_t whole = static_cast<int64_t>(q.prompt.size()) + q.max_new_tokens;
        const int64_t blocks = (whole + options.block_size - 1) / options.block_size;
        EXPECT_TRUE(blocks > options.num_blocks || whole > options.max_batch_total_tokens ||
                    q.outputs.sequences > options.max_running)
            << "request " << q.id;
        continue;
      }
      EXPECT_EQ(sim.generated()[q.id], Reference(q.prompt, q.max_new_tokens)) << "request " << q.id;
      for (int32_t choice = 1; choice < q.outputs.sequences; ++choice) {
        EXPECT_EQ(sim.generated(q.id, choice),
                  testing::ForkReference(q.prompt, q.max_new_tokens, q.sampling.seed, choice))
            << "request " << q.id << " choice " << choice;
      }
      ++completed;
    }
    // The last frees go out with the next step; then nothing is in use.
    sim.Step(executors);
    EXPECT_EQ(sim.planner().running(), 0u);
    EXPECT_EQ(sim.ledger().Stats().in_use_blocks, 0);
    std::printf(
        "  block size %d, %d blocks, prefill budget %d, total %lld: %d completed, "
        "%llu preemptions, %lld prompt tokens cached, %zu steps\n",
        options.block_size, options.num_blocks, options.max_batch_prefill_tokens,
        static_cast<long long>(options.max_batch_total_tokens), completed,
        static_cast<unsigned long long>(sim.planner().preemptions()),
        static_cast<long long>(sim.cached_prompt_tokens()), sim.plans().size());
  }
}

}  // namespace
}  // namespace kvcm::router
