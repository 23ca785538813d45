#pragma once
// RouterCore: the router's scheduling thread (docs/architecture.md, "The life of a step").
// It owns the cache-manager session, the ExecutorLink and the StepPlanner, and turns
// steps one at a time on an EventLoop: plan, one Step to the cache manager, one StepBatch
// to each executor with work, then (once every executor answered, or was dropped) the
// sampled tokens go to the requests' sinks and the next step starts.
//
// Thread safety: Submit() and Cancel() may be called from any thread (they post to the
// loop); everything else runs on the thread that calls Run().

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/client/cache_manager_client.h"
#include "common/transport/event_loop.h"
#include "services/router/executor_link.h"
#include "services/router/router_metrics.h"
#include "services/router/step_planner.h"
#include "services/router/step_trace.h"

namespace kvcm::router {

// A request as the front end hands it in: tokenized and checked.
struct Submission {
  uint64_t id = 0;
  std::vector<int32_t> prompt;
  int32_t max_new_tokens = 1;
  SamplingParams sampling;
  RequestOutputs outputs;
  Api api = Api::kTgi;  // shown by /dashboard
  // vLLM's ignore_eos: the model's EOS tokens end nothing (they are generated as any other
  // token); only max_new_tokens, a stop string or a cancel ends the request.
  bool ignore_eos = false;
};

// The scheduler as /dashboard shows it (services/router/dashboard.h), taken on the core's
// thread at one moment. Holds no handles or session ids: it is served to any HTTP client.
struct RouterView {
  struct Sequence {
    uint64_t request = 0;
    int32_t choice = 0;
    Api api = Api::kTgi;
    int32_t prompt_tokens = 0;
    int32_t generated_tokens = 0;
    int32_t blocks = 0;
    uint64_t executor = 0;
  };
  struct Executor {
    uint64_t id = 0;
    std::string name;
    int32_t pid = 0;
    bool busy = false;  // owes the router a step's result now
    uint64_t steps = 0;
    double last_step_seconds = 0;  // the last step's duration, as the executor measured it
    double connected_seconds = 0;  // since it registered
    double silent_seconds = 0;     // since the router last heard from it
  };
  uint64_t steps = 0;
  size_t queued = 0;
  size_t running = 0;               // sequences; `sequences` lists the oldest of them
  std::vector<Sequence> sequences;  // at most the max_sequences asked for
  std::vector<Executor> executors;  // by id
  bool recovering = false;          // the cache manager does not answer
  bool draining = false;            // a signal asked the router to stop
};

class RouterCore {
 public:
  struct Options {
    std::string cache_manager_endpoint;
    std::string executor_endpoint;
    std::string name = "router";
    int32_t max_batch_prefill_tokens = 4096;
    int64_t max_batch_total_tokens = 0;  // 0: what the pool holds
    int32_t max_running = 256;
    // A step an executor has not answered by then is redone without it.
    absl::Duration step_timeout = absl::Seconds(30);
    std::vector<int32_t> eos_token_ids;  // generation ends at any of them
    RouterMetrics* metrics = nullptr;    // optional; outlives the core
    StepTrace* step_trace = nullptr;     // optional; outlives the core
    // A call to the cache manager that gets no answer this long fails (and is retried).
    absl::Duration cache_manager_timeout = absl::Seconds(2);
    // How long requests wait for a cache manager that is down or restarting before they
    // fail with 503.
    absl::Duration recovery_timeout = absl::Seconds(60);
    // At SIGTERM/SIGINT, running requests get this long to finish; new ones are refused
    // (503). A second signal stops at once.
    absl::Duration drain_timeout = absl::Seconds(10);
  };
  using Sink = std::function<void(std::vector<TokenEvent>)>;

  // Connects to the cache manager and binds the executor endpoint.
  static absl::StatusOr<std::unique_ptr<RouterCore>> Create(const Options& options, Sink sink);
  ~RouterCore();

  const SessionInfo& session() const { return session_; }
  // The pool's descriptor as the cache manager described it at Create (its spec, window and
  // KV cache groups; CacheManagerClient::DescribePool), for /info.
  const PoolDescriptorInfo& pool() const { return pool_; }
  const PlannerOptions& planner_options() const { return planner_options_; }

  // True once a signal asked the router to stop: new requests are refused (any thread).
  bool draining() const { return draining_.load(); }
  // Executors registered now (any thread).
  int live_executors() const { return live_executors_.load(); }

  void Submit(Submission submission);
  // Takes a RouterView with at most `max_sequences` sequences on the core's thread, between
  // steps, and hands it to `done` there (any thread may call; `done` must not block). O(that
  // many sequences and the executors). If the core has stopped, `done` never runs.
  void RequestView(size_t max_sequences, std::function<void(RouterView)> done);
  // Cancels a request's choice (-1: all of them).
  void Cancel(uint64_t id, int32_t choice = -1);
  // Serves until a signal arrives on `signal_fd` (or Stop()).
  absl::Status Run(int signal_fd);
  void Stop();

 private:
  RouterCore(const Options& options, Sink sink);
  void Turn();  // starts a step if none is in flight and there is work
  void ScheduleTurn();
  // A turn `delay` from now (one at a time): while admissions wait for tier loads.
  void ScheduleTurnAfter(absl::Duration delay);
  // How often a router with nothing else to run asks again for an admission whose prefix
  // the cache manager is loading from a tier: a block loads in well under a millisecond
  // from host memory or a local disk.
  static constexpr absl::Duration kTierLoadPoll = absl::Milliseconds(1);
  void OnResult(uint64_t executor, uint64_t step_id, absl::StatusOr<StepResult> report);
  // Hands the planner the executors dropped without proof that they stopped (Abandon).
  void AbandonUnconfirmed();
  void FinishStep();
  void FailAll(const absl::Status& status);
  // The rest of a step once the cache manager answered its Step.
  void ContinueStep(StepPlan plan, std::vector<OpOutcome> outcomes);
  // A call to the cache manager failed: steps stop until Recover() succeeds.
  void CacheManagerFailed(const absl::Status& status, std::optional<StepPlan> unanswered);
  // Every 200 ms while recovering: retries the unanswered Step (answered from the cache
  // manager's replay cache if it was applied), or registers again after a restart (the old
  // ledger is gone: running requests start again with their tokens so far).
  void Recover();

  const Options options_;
  const Sink sink_;
  zmq::context_t context_;
  EventLoop loop_;
  std::unique_ptr<CacheManagerClient> cache_manager_;
  SessionInfo session_;
  PoolDescriptorInfo pool_;
  std::unique_ptr<ExecutorLink> link_;
  PlannerOptions planner_options_;
  std::unique_ptr<StepPlanner> planner_;
  // Requests queued or running, and which of their choices have not finished.
  absl::flat_hash_map<uint64_t, std::vector<bool>> known_;
  absl::flat_hash_map<uint64_t, Api> api_of_;  // of the requests in known_
  absl::flat_hash_set<uint64_t> ignore_eos_;   // those of them that ignore EOS
  // Those of them with vLLM's min_tokens: an EOS id (held back by the executors; one that
  // comes anyway, from an executor that does not honour min_tokens) before it ends nothing.
  absl::flat_hash_map<uint64_t, int32_t> min_tokens_;
  // Marks `choice` (-1: every one) of `id` finished; forgets `id` when none is left.
  // Returns whether that choice was still open.
  bool FinishChoice(uint64_t id, int32_t choice);
  bool turn_scheduled_ = false;
  bool waiting_for_tiers_ = false;  // the last step only had admissions waiting for loads
  EventLoop::Id delayed_turn_ = 0;  // ScheduleTurnAfter's timer, 0 when none
  // The client's available_blocks_after_last_step() is of the step just answered.
  bool fresh_available_ = false;
  uint64_t steps_ = 0;
  std::atomic<int> live_executors_{0};
  std::atomic<bool> draining_{false};
  absl::Time drain_deadline_;

  // While the cache manager does not answer.
  bool recovering_ = false;
  absl::Time recovery_deadline_;
  std::optional<StepPlan> unanswered_;  // a Step sent but not answered
  absl::Status fatal_;                  // why Run() stopped on its own, if it did

  // The step in flight.
  bool in_flight_ = false;
  uint64_t step_id_ = 0;
  absl::Time step_deadline_;
  absl::Time step_started_;
  int32_t step_sequences_ = 0;
  int32_t step_prefill_ = 0;
  int32_t step_decode_ = 0;
  StepTraceEntry trace_;  // of the step in flight, with options_.step_trace
  // While ExecutorLink reads the executors' socket: when the loop woke to read it.
  std::optional<absl::Time> reading_since_;
  uint64_t preemptions_reported_ = 0;
  uint64_t refused_ops_reported_ = 0;
  absl::flat_hash_set<uint64_t> awaiting_;  // executors that owe a result
  std::vector<SeqResult> results_;
};

}  // namespace kvcm::router
