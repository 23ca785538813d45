#include "services/router/router_core.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/base/log.h"
#include "common/base/monotonic_clock.h"
#include "common/base/status_macros.h"

namespace kvcm::router {
namespace {

constexpr char kComponent[] = "kvcm-router";
void Log(std::string_view text) { LogLine(kComponent, text); }

// How often silent executors and late steps are looked for.
constexpr absl::Duration kHousekeeping = absl::Milliseconds(100);

}  // namespace

RouterCore::RouterCore(const Options& options, Sink sink)
    : options_(options), sink_(std::move(sink)), context_(1) {}

RouterCore::~RouterCore() {
  link_.reset();
  context_.close();
}

absl::StatusOr<std::unique_ptr<RouterCore>> RouterCore::Create(const Options& options, Sink sink) {
  std::unique_ptr<RouterCore> core(new RouterCore(options, std::move(sink)));
  KVCM_RETURN_IF_ERROR(core->loop_.Init());
  CacheManagerClient::Options client;
  client.endpoint = options.cache_manager_endpoint;
  client.role = wire::Role::Router;
  client.name = options.name;
  client.call_timeout = options.cache_manager_timeout;
  // Heartbeats vouch for the scheduling thread: a router whose loop deadlocked stops renewing
  // its lease and is quarantined (its housekeeping timer notes progress, every 100 ms).
  client.require_progress = true;
  KVCM_ASSIGN_OR_RETURN(core->cache_manager_, CacheManagerClient::Connect(client));
  core->session_ = core->cache_manager_->session();
  KVCM_ASSIGN_OR_RETURN(core->pool_, core->cache_manager_->DescribePool());

  PlannerOptions& planner = core->planner_options_;
  planner.block_size = core->session_.block_size;
  planner.num_blocks = core->session_.num_blocks;
  planner.sliding_window_tokens = core->session_.sliding_window_tokens;
  planner.group_windows = core->session_.group_windows;
  planner.max_batch_prefill_tokens = options.max_batch_prefill_tokens;
  const int64_t pool_tokens = int64_t{core->session_.num_blocks} * core->session_.block_size;
  planner.max_batch_total_tokens = options.max_batch_total_tokens > 0
                                       ? std::min(options.max_batch_total_tokens, pool_tokens)
                                       : pool_tokens;
  planner.max_running = options.max_running;
  planner.hash_algorithm = core->session_.hash_algorithm;
  planner.root_hash = RootHash(planner.hash_algorithm, "");
  planner.commit_tokens = core->session_.wants_commit_tokens;
  core->planner_ = std::make_unique<StepPlanner>(planner);

  ExecutorLink::Options link;
  link.endpoint = options.executor_endpoint;
  core->link_ = std::make_unique<ExecutorLink>(core->context_, &core->loop_, link);
  KVCM_RETURN_IF_ERROR(core->link_->Bind());
  RouterCore* self = core.get();
  core->link_->set_on_result(
      [self](uint64_t executor, uint64_t step, absl::StatusOr<StepResult> report) {
        self->OnResult(executor, step, std::move(report));
      });
  core->link_->set_on_change([self] {
    self->live_executors_.store(static_cast<int>(self->link_->executors().size()));
    if (RouterMetrics* m = self->options_.metrics) {
      m->SetState(self->planner_->queued(), self->planner_->running(),
                  self->live_executors_.load());
    }
    self->ScheduleTurn();
  });
  return core;
}

void RouterCore::Submit(Submission submission) {
  loop_.Post([this, s = std::move(submission)]() mutable {
    if (draining_.load()) {  // arrived after the signal: not started
      TokenEvent p;
      p.request = s.id;
      p.finished = true;
      p.error = absl::UnavailableError("the router is shutting down");
      sink_({std::move(p)});
      return;
    }
    known_[s.id].assign(static_cast<size_t>(s.outputs.sequences), true);
    api_of_[s.id] = s.api;
    if (s.ignore_eos) ignore_eos_.insert(s.id);
    if (s.sampling.min_tokens > 0) min_tokens_[s.id] = s.sampling.min_tokens;
    planner_->Enqueue(s.id, std::move(s.prompt), s.max_new_tokens, s.sampling, s.outputs);
    ScheduleTurn();
  });
}

bool RouterCore::FinishChoice(uint64_t id, int32_t choice) {
  auto it = known_.find(id);
  if (it == known_.end()) return false;
  std::vector<bool>& open = it->second;
  bool was_open = false;
  for (size_t c = 0; c < open.size(); ++c) {
    if (choice < 0 || static_cast<int32_t>(c) == choice) {
      was_open = was_open || open[c];
      open[c] = false;
    }
  }
  if (std::none_of(open.begin(), open.end(), [](bool b) { return b; })) {
    known_.erase(it);
    api_of_.erase(id);
    ignore_eos_.erase(id);
    min_tokens_.erase(id);
  }
  return was_open;
}

void RouterCore::RequestView(size_t max_sequences, std::function<void(RouterView)> done) {
  loop_.Post([this, max_sequences, done = std::move(done)] {
    RouterView view;
    view.steps = steps_;
    view.queued = planner_->queued();
    view.running = planner_->running();
    view.recovering = recovering_;
    view.draining = draining_.load();
    for (const StepPlanner::RunningSummary& run : planner_->RunningSummaries(max_sequences)) {
      const auto api = api_of_.find(run.request);
      view.sequences.push_back({run.request, run.choice,
                                api == api_of_.end() ? Api::kTgi : api->second, run.prompt_tokens,
                                run.generated_tokens, run.blocks, run.executor});
    }
    const absl::Time now = MonotonicNow();
    for (const auto& [id, executor] : link_->executors()) {
      view.executors.push_back({id, executor.hello.name, executor.hello.pid,
                                executor.pending_request != 0, executor.steps,
                                static_cast<double>(executor.last_step_us) * 1e-6,
                                absl::ToDoubleSeconds(now - executor.registered),
                                absl::ToDoubleSeconds(now - executor.last_heard)});
    }
    std::sort(
        view.executors.begin(), view.executors.end(),
        [](const RouterView::Executor& a, const RouterView::Executor& b) { return a.id < b.id; });
    done(std::move(view));
  });
}

void RouterCore::Cancel(uint64_t id, int32_t choice) {
  loop_.Post([this, id, choice] {
    if (FinishChoice(id, choice)) planner_->Finish(id, choice);  // freed in the next step
    ScheduleTurn();
  });
}

void RouterCore::Stop() {
  loop_.Post([this] { loop_.Stop(); });
}

void RouterCore::ScheduleTurn() {
  if (turn_scheduled_) return;
  turn_scheduled_ = true;
  loop_.Post([this] {
    turn_scheduled_ = false;
    Turn();
  });
}

void RouterCore::FailAll(const absl::Status& status) {
  std::vector<TokenEvent> failed;
  for (const auto& [id, open] : known_) {
    TokenEvent p;
    p.request = id;
    p.finished = true;
    p.error = status;
    failed.push_back(std::move(p));
    planner_->Finish(id);
  }
  known_.clear();
  api_of_.clear();
  ignore_eos_.clear();
  min_tokens_.clear();
  if (!failed.empty()) sink_(std::move(failed));
}

void RouterCore::CacheManagerFailed(const absl::Status& status,
                                    std::optional<StepPlan> unanswered) {
  if (!recovering_) {
    Log(absl::StrCat("the cache manager failed a call (", status.ToString(),
                     "): steps wait until it answers again"));
    recovering_ = true;
    recovery_deadline_ = MonotonicNow() + options_.recovery_timeout;
  }
  if (unanswered.has_value()) unanswered_ = std::move(unanswered);
}

void RouterCore::Recover() {
  if (!recovering_) return;
  if (cache_manager_->session_lost()) {
    // A new epoch: the old ledger, and the sequences in it, are gone; so is the step.
    if (absl::Status again = cache_manager_->Reregister(); !again.ok()) {
      if (MonotonicNow() > recovery_deadline_) {
        recovering_ = false;
        unanswered_.reset();
        planner_->ResetAll();
        FailAll(absl::UnavailableError(
            absl::StrCat("the cache manager did not come back: ", again.message())));
      }
      return;
    }
    const SessionInfo fresh = cache_manager_->session();
    if (fresh.block_size != session_.block_size || fresh.num_blocks != session_.num_blocks) {
      // The planner was built for the old shape: this router cannot serve the new pool.
      fatal_ = absl::FailedPreconditionError(
          absl::StrCat("the cache manager came back with another pool (", fresh.num_blocks,
                       " blocks of ", fresh.block_size, " tokens, was ", session_.num_blocks,
                       " of ", session_.block_size, "): restart the router"));
      Log(std::string(fatal_.message()));
      planner_->ResetAll();
      FailAll(fatal_);
      loop_.Stop();
      return;
    }
    session_ = fresh;
    unanswered_.reset();
    planner_->ResetAll();
    planner_->SetCommitTokens(session_.wants_commit_tokens);
    planner_->SetSlidingWindow(session_.sliding_window_tokens);
    planner_->SetGroupWindows(session_.group_windows);
    recovering_ = false;
    Log(absl::StrCat("registered again with the cache manager (epoch ", session_.epoch,
                     "): ", planner_->queued(), " request(s) start again"));
    ScheduleTurn();
    return;
  }
  if (unanswered_.has_value()) {
    absl::StatusOr<std::vector<OpOutcome>> reply = cache_manager_->RetryLastStep();
    if (reply.ok()) {
      recovering_ = false;
      StepPlan plan = *std::move(unanswered_);
      unanswered_.reset();
      Log(absl::StrCat("the cache manager answered step ", plan.step_id, " on retry"));
      ContinueStep(std::move(plan), *std::move(reply));
      return;
    }
    if (absl::IsAborted(reply.status())) return;  // lost: registered again next time
  } else if (cache_manager_->Stats().ok()) {
    recovering_ = false;
    ScheduleTurn();
    return;
  }
  if (MonotonicNow() > recovery_deadline_) {
    Log("the cache manager did not answer within the recovery timeout: failing every request");
    recovering_ = false;
    unanswered_.reset();
    planner_->ResetAll();
    FailAll(absl::UnavailableError("the cache manager does not answer"));
  }
}

void RouterCore::AbandonUnconfirmed() {
  for (uint64_t executor : link_->TakeUnconfirmed()) {
    const size_t before = planner_->running();
    planner_->Abandon(executor);
    Log(absl::StrCat("executor ", executor, " may still be writing: its ",
                     before - planner_->running(),
                     " sequence(s) are freed with drain and computed again elsewhere"));
  }
}

void RouterCore::Turn() {
  if (in_flight_ || recovering_) return;
  AbandonUnconfirmed();
  if (planner_->queued() == 0 && planner_->running() == 0) return;
  // Only executors registered in this epoch: a step must meet every fence its router
  // session may get (docs/architecture.md, "Fencing"). The others say Hello again once they
  // have attached to it.
  const std::vector<uint64_t> executors = link_->LiveInEpoch(session_.epoch);
  // The last StepReply said how many blocks could be taken after it; only the first step
  // (and one after a failure) asks Stats, a round trip more.
  int32_t available = fresh_available_ ? cache_manager_->available_blocks_after_last_step() : -1;
  if (available < 0) {
    absl::StatusOr<StatsSnapshot> stats = cache_manager_->Stats();
    if (!stats.ok()) return CacheManagerFailed(stats.status(), std::nullopt);
    available = stats->free_blocks + stats->cached_blocks;
  }
  fresh_available_ = false;
  trace_ = StepTraceEntry{};
  trace_.planned_ns = absl::ToUnixNanos(MonotonicNow());
  StepPlan plan = planner_->Plan(available, executors);
  std::vector<TokenEvent> rejected;
  for (RequestId id : plan.rejected) {
    known_.erase(id);
    api_of_.erase(id);
    ignore_eos_.erase(id);
    min_tokens_.erase(id);
    TokenEvent p;
    p.request = id;
    p.finished = true;
    p.error = absl::ResourceExhaustedError(
        "the prompt and max_new_tokens need more KV cache than the pool holds");
    rejected.push_back(std::move(p));
  }
  if (!rejected.empty()) sink_(std::move(rejected));
  std::vector<OpOutcome> outcomes;
  if (!plan.ops.empty()) {
    const absl::Time asked = MonotonicNow();
    absl::StatusOr<std::vector<OpOutcome>> reply = cache_manager_->Step(plan.ops);
    trace_.cache_manager_ns = absl::ToInt64Nanoseconds(MonotonicNow() - asked);
    if (!reply.ok()) {
      // Not answered: maybe applied (then its retry is answered from the replay cache), maybe
      // not; after a restart, gone with the old ledger.
      return CacheManagerFailed(reply.status(), std::move(plan));
    }
    outcomes = *std::move(reply);
    fresh_available_ = true;
  }
  ContinueStep(std::move(plan), std::move(outcomes));
}

void RouterCore::ContinueStep(StepPlan plan, std::vector<OpOutcome> outcomes) {
  ExecutorWork& work = planner_->Apply(plan, outcomes);
  if (const uint64_t refused = planner_->refused_ops(); refused > refused_ops_reported_) {
    Log(absl::StrCat("the cache manager refused ", refused - refused_ops_reported_,
                     " op(s) of step ", plan.step_id, " for a reason other than room (",
                     planner_->last_refusal().ToString(),
                     "): a bug of the router or the "
                     "cache manager; the sequences are computed again"));
    refused_ops_reported_ = refused;
  }
  if (RouterMetrics* m = options_.metrics) {
    m->CountPromptTokens(work.cached_prompt_tokens, work.computed_prompt_tokens);
    m->CountTierPromptTokens(work.host_tier_prompt_tokens, work.disk_tier_prompt_tokens);
    m->CountRecomputedCommittedTokens(work.recomputed_committed_tokens);
    m->CountPreemptions(static_cast<int64_t>(planner_->preemptions() - preemptions_reported_));
    preemptions_reported_ = planner_->preemptions();
  }
  step_sequences_ = 0;
  for (const ExecutorWork::Batch& batch : work.batches) {
    step_sequences_ += static_cast<int32_t>(batch.step.seqs.size());
  }
  // Nothing ran and an admission waits for its prefix to load from a tier: the next step
  // comes after a pause, not at once (it would only be refused again).
  waiting_for_tiers_ = work.loading_admissions > 0 && step_sequences_ == 0;
  step_prefill_ = work.prefill_tokens;
  step_decode_ = work.decode_tokens;
  step_started_ = MonotonicNow();
  step_id_ = plan.step_id;
  ++steps_;
  results_.clear();
  awaiting_.clear();
  const absl::Time now = MonotonicNow();
  for (ExecutorWork::Batch& batch : work.batches) {
    batch.step.epoch = session_.epoch;
    batch.step.router_session = session_.session_id;
    if (absl::Status sent = link_->SendStep(batch.executor, batch.step, now); !sent.ok()) {
      Log(absl::StrCat("step ", step_id_, ": ", sent.ToString()));
      continue;  // its sequences redo the step
    }
    awaiting_.insert(batch.executor);
  }
  in_flight_ = true;
  step_deadline_ = now + options_.step_timeout;
  trace_.dispatched_ns = absl::ToUnixNanos(MonotonicNow());
  trace_.executors = static_cast<int32_t>(awaiting_.size());
  if (awaiting_.empty()) FinishStep();
}

void RouterCore::OnResult(uint64_t executor, uint64_t step_id, absl::StatusOr<StepResult> report) {
  if (!in_flight_ || step_id != step_id_ || awaiting_.erase(executor) == 0) return;
  if (report.ok()) {
    for (SeqResult& outcome : report->results) results_.push_back(std::move(outcome));
  } else {
    Log(absl::StrCat("executor ", executor, " refused step ", step_id, ": ",
                     report.status().ToString()));
  }
  if (awaiting_.empty()) FinishStep();
}

void RouterCore::FinishStep() {
  in_flight_ = false;
  // The answer came when the loop woke to read it, before it was verified and decoded: that
  // part is the router's too (docs/router.md, "Step trace").
  trace_.answered_ns = absl::ToUnixNanos(reading_since_.value_or(MonotonicNow()));
  std::vector<TokenEvent> events = planner_->Complete(results_);
  AbandonUnconfirmed();
  // The events go on as they are, less those of choices cancelled meanwhile, with what only
  // the router knows: whether the token is an EOS that ends its choice.
  std::vector<TokenEvent> delivering;
  delivering.reserve(events.size());
  for (TokenEvent& event : events) {
    auto live = known_.find(event.request);
    if (live == known_.end() || static_cast<size_t>(event.choice) >= live->second.size() ||
        !live->second[static_cast<size_t>(event.choice)]) {
      continue;  // cancelled meanwhile
    }
    const auto min_tokens = min_tokens_.find(event.request);
    const bool eos = !ignore_eos_.contains(event.request) &&
                     (min_tokens == min_tokens_.end() || event.index >= min_tokens->second) &&
                     std::find(options_.eos_token_ids.begin(), options_.eos_token_ids.end(),
                               event.token) != options_.eos_token_ids.end();
    if (eos || event.finished) {
      event.finished = true;
      event.finish_reason = eos ? "eos_token" : "length";
      planner_->Finish(event.request, event.choice);
      FinishChoice(event.request, event.choice);
    }
    delivering.push_back(std::move(event));
  }
  const absl::Time finished = MonotonicNow();
  // The tokens first: the metrics can wait until the HTTP thread has them.
  const auto delivered = static_cast<int32_t>(delivering.size());
  if (!delivering.empty()) sink_(std::move(delivering));
  if (options_.step_trace != nullptr) trace_.delivered_ns = absl::ToUnixNanos(MonotonicNow());
  if (RouterMetrics* m = options_.metrics) {
    m->ObserveStep(absl::ToDoubleSeconds(finished - step_started_), step_sequences_, step_prefill_,
                   step_decode_);
    m->CountGeneratedTokens(static_cast<int64_t>(events.size()));
    m->SetState(planner_->queued(), planner_->running(),
                static_cast<int>(link_->executors().size()));
  }
  if (StepTrace* trace = options_.step_trace) {
    trace_.step = step_id_;
    trace_.sequences = step_sequences_;
    trace_.prefill_tokens = step_prefill_;
    trace_.decode_tokens = step_decode_;
    trace_.tokens = delivered;
    trace->Record(trace_);
  }
  if (waiting_for_tiers_) return ScheduleTurnAfter(kTierLoadPoll);
  ScheduleTurn();
}

void RouterCore::ScheduleTurnAfter(absl::Duration delay) {
  if (delayed_turn_ != 0) return;
  delayed_turn_ = loop_.AddTimer(delay, [this](absl::Duration) {
    loop_.Cancel(delayed_turn_);
    delayed_turn_ = 0;
    ScheduleTurn();
  });
}

absl::Status RouterCore::Run(int signal_fd) {
  loop_.WatchSocket(link_->socket(), [this] {
    reading_since_ = MonotonicNow();
    link_->HandleReadable(*reading_since_);
    reading_since_.reset();
  });
  if (signal_fd >= 0) {
    loop_.WatchSignals(signal_fd, [this](int signo) {
      if (draining_.load()) {
        Log(absl::StrCat("received ", strsignal(signo), " again: stopping now"));
        loop_.Stop();
        return;
      }
      // No new request starts; those running finish, within the drain timeout.
      Log(absl::StrCat("received ", strsignal(signo), ": finishing ", known_.size(),
                       " request(s) (at most ", absl::FormatDuration(options_.drain_timeout),
                       "), refusing new ones"));
      draining_.store(true);
      drain_deadline_ = MonotonicNow() + options_.drain_timeout;
      if (known_.empty()) loop_.Stop();
    });
  }
  loop_.AddTimer(absl::Milliseconds(200), [this](absl::Duration) { Recover(); });
  loop_.AddTimer(kHousekeeping, [this](absl::Duration) {
    cache_manager_->NoteProgress();  // this thread turns: its heartbeats may go out
    const absl::Time now = MonotonicNow();
    if (draining_.load() && (known_.empty() || now > drain_deadline_)) {
      if (!known_.empty()) {
        Log(absl::StrCat("drain timeout: cancelling ", known_.size(), " request(s)"));
      }
      loop_.Stop();
      return;
    }
    link_->DropSilent(now);
    if (in_flight_ && now > step_deadline_) {
      for (uint64_t executor : std::vector<uint64_t>(awaiting_.begin(), awaiting_.end())) {
        Log(absl::StrCat("executor ", executor, " did not answer step ", step_id_, " within ",
                         absl::FormatDuration(options_.step_timeout), ": dropped"));
        link_->Drop(executor);
      }
    }
  });
  KVCM_RETURN_IF_ERROR(loop_.Run());
  if (!fatal_.ok()) return fatal_;
  Log(absl::StrCat("stopping after ", steps_, " step(s), ", planner_->preemptions(),
                   " preemption(s); ", known_.size(), " request(s) still open"));
  FailAll(absl::UnavailableError("the router is shutting down"));
  link_->SayGoodbye();
  (void)cache_manager_->Goodbye();
  return absl::OkStatus();
}

}  // namespace kvcm::router
