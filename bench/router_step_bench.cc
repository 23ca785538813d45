// The router's own cost per scheduler step, with the real cache manager, beside the bare
// cache-manager round trip measured in the same run.
//
//   build/bench/router_step_bench
//
// The cache manager is the real binary (started once, shm pool of 65536 blocks of 16
// tokens). N requests of 64 to 79 prompt tokens (so that, as in a real batch, their
// sequences enter and fill blocks in different steps: with equal prompts all would in the
// same step, and most steps would need no round trip) are admitted and prefilled first;
// then every measured iteration is one decode step of all N: StepPlanner::Plan (counting
// on the free blocks the previous StepReply reported), the cache manager's Step (commits
// and appends, when the step has any), Apply, and Complete with a token for every
// sequence, as an executor of zero cost would answer.
//
//   RouterDecodeStep/N    that step, per step (N = 64, 256)
//   PlannerOnly/N         Plan + Apply + Complete alone (the Step's outcomes replayed), per
//                         step: the router's CPU without the round trips
//   CacheManagerStats     one Stats round trip: the baseline (a step is one round trip)
//
// Goal (issue "Router"): the router's and the cache manager's share of a step <= 2%. A
// model's decode step is not run here; compare RouterDecodeStep with the executors'
// kvcm_executor_step_duration_seconds for the model served.

#include <benchmark/benchmark.h>

#include <chrono>
#include <memory>
#include <vector>

#include "bench/ratio_reporter.h"
#include "common/base/check.h"
#include "common/client/cache_manager_client.h"
#include "services/router/step_planner.h"
#include "tests/support/cache_manager_process.h"

namespace kvcm {
namespace {

constexpr int32_t kBlockSize = 16;
constexpr int32_t kPromptTokens = 64;
// More than a repetition's steps make: each repetition admits its own sequences and runs
// kIterations steps, so 256 sequences of at most 79 + 1,002 tokens (17,408 blocks) fit the
// pool and nothing is preempted.
constexpr int32_t kMaxNewTokens = 4096;
constexpr int kIterations = 1000;

struct Environment {
  std::unique_ptr<testing::CacheManagerProcess> cm;
  static Environment& Get() {
    static Environment* env = [] {
      auto* e = new Environment();
      testing::CacheManagerOptions options;
      options.num_blocks = 65536;
      options.block_size = kBlockSize;
      options.layers = 2;
      options.kv_heads = 2;
      options.head_dim = 8;
      auto started = testing::CacheManagerProcess::Start(options);
      KVCM_CHECK(started.ok()) << started.status();
      e->cm = std::move(*started);
      return e;
    }();
    return *env;
  }
};

// An executor's answer: `token` sampled for `seq`.
SeqResult Sampled(SeqId seq, int32_t token) {
  SeqResult result;
  result.seq = seq;
  result.token = token;
  return result;
}

std::unique_ptr<CacheManagerClient> Connect() {
  CacheManagerClient::Options options;
  options.endpoint = Environment::Get().cm->endpoint();
  options.role = wire::Role::Router;
  options.name = "router-bench";
  auto client = CacheManagerClient::Connect(options);
  KVCM_CHECK(client.ok()) << client.status();
  return *std::move(client);
}

router::PlannerOptions Options(int32_t n, const SessionInfo& session) {
  router::PlannerOptions options;
  options.block_size = kBlockSize;
  options.num_blocks = session.num_blocks;
  options.max_running = n;
  options.max_batch_prefill_tokens = n * (kPromptTokens + kBlockSize);
  options.max_batch_total_tokens = int64_t{session.num_blocks} * kBlockSize;
  options.hash_algorithm = session.hash_algorithm;
  options.root_hash = RootHash(options.hash_algorithm, "bench");
  return options;
}

// One step against the cache manager; returns the plan and outcomes (for replay).
void RunStep(router::StepPlanner& planner, CacheManagerClient& client,
             std::vector<OpOutcome>* outcomes_out = nullptr, router::StepPlan* plan_out = nullptr) {
  // As the router does: the last StepReply's available blocks; Stats only before the first.
  int32_t available = client.available_blocks_after_last_step();
  if (available < 0) {
    absl::StatusOr<StatsSnapshot> stats = client.Stats();
    KVCM_CHECK(stats.ok()) << stats.status();
    available = stats->free_blocks + stats->cached_blocks;
  }
  const std::vector<router::ExecutorId> executors = {1};
  router::StepPlan plan = planner.Plan(available, executors);
  BlockOps ops;
  for (const BlockOp& op : plan.ops) ops.Add(op);
  absl::StatusOr<std::vector<OpOutcome>> outcomes = client.Step(ops);
  KVCM_CHECK(outcomes.ok()) << outcomes.status();
  router::ExecutorWork& work = planner.Apply(plan, *outcomes);
  std::vector<SeqResult> results;
  for (const auto& batch : work.batches) {
    for (const SeqWork& seq : batch.step.seqs) results.push_back(Sampled(seq.seq, 5));
  }
  planner.Complete(results);
  if (outcomes_out != nullptr) *outcomes_out = *std::move(outcomes);
  if (plan_out != nullptr) *plan_out = std::move(plan);
}

void Admit(router::StepPlanner& planner, CacheManagerClient& client, int32_t n) {
  for (int32_t i = 0; i < n; ++i) {
    std::vector<int32_t> prompt(static_cast<size_t>(kPromptTokens + i % kBlockSize));
    for (size_t t = 0; t < prompt.size(); ++t) {
      prompt[t] = static_cast<int32_t>(3 + (static_cast<size_t>(i) * 131 + t * 7) % 250);
    }
    planner.Enqueue(static_cast<router::RequestId>(i + 1), std::move(prompt), kMaxNewTokens);
  }
  while (planner.queued() > 0) RunStep(planner, client);
  RunStep(planner, client);  // every sequence decoding
  KVCM_CHECK(planner.running() == static_cast<size_t>(n)) << planner.running() << " of " << n;
}

void RouterDecodeStep(benchmark::State& state) {
  const auto n = static_cast<int32_t>(state.range(0));
  auto client = Connect();
  router::StepPlanner planner(Options(n, client->session()));
  Admit(planner, *client, n);
  for (auto _ : state) RunStep(planner, *client);
  KVCM_CHECK(planner.running() == static_cast<size_t>(n) && planner.preemptions() == 0);
  state.counters["units"] = 1;
  state.counters["sequences"] = n;
  KVCM_CHECK(client->Goodbye().ok());
}

void PlannerOnly(benchmark::State& state) {
  const auto n = static_cast<int32_t>(state.range(0));
  auto client = Connect();
  router::StepPlanner planner(Options(n, client->session()));
  Admit(planner, *client, n);
  std::vector<SeqResult> results;
  const std::vector<router::ExecutorId> executors = {1};
  for (auto _ : state) {
    // The same shape of step without the round trips: outcomes made up as the cache
    // manager answers a decode step (a new block every 16th token, no copies).
    router::StepPlan plan = planner.Plan(1 << 20, executors);
    std::vector<OpOutcome> outcomes(plan.ops.size());
    for (size_t i = 0; i < plan.ops.size(); ++i) {
      if (plan.ops[i].kind == wire::StepOp::AppendOp) outcomes[i].blocks = {0};
    }
    router::ExecutorWork& work = planner.Apply(plan, outcomes);
    results.clear();
    for (const auto& batch : work.batches) {
      for (const SeqWork& seq : batch.step.seqs) results.push_back(Sampled(seq.seq, 5));
    }
    benchmark::DoNotOptimize(planner.Complete(results));
  }
  KVCM_CHECK(planner.running() == static_cast<size_t>(n));
  state.counters["units"] = 1;
  (void)client->Goodbye();
}

void CacheManagerStats(benchmark::State& state) {
  auto client = Connect();
  for (auto _ : state) {
    absl::StatusOr<StatsSnapshot> stats = client->Stats();
    KVCM_CHECK(stats.ok());
  }
  state.counters["units"] = 1;
}

BENCHMARK(CacheManagerStats)->Iterations(kIterations)->Unit(benchmark::kMicrosecond);
BENCHMARK(RouterDecodeStep)
    ->Arg(64)
    ->Arg(256)
    ->Iterations(kIterations)
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(PlannerOnly)->Arg(64)->Arg(256)->Iterations(kIterations)->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace kvcm

int main(int argc, char** argv) {
  kvcm::bench::RatioReporter reporter;
  // Informative ratios: a step against one bare round trip (it makes two).
  reporter.AddPair("RouterDecodeStep/64/", "CacheManagerStats/", 4.0, "step");
  reporter.AddPair("RouterDecodeStep/256/", "CacheManagerStats/", 4.0, "step");
  return kvcm::bench::RunWithRatios(argc, argv, reporter);
}
