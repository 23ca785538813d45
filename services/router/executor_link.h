#pragma once
// ExecutorLink: the router's ROUTER socket for its executors (docs/executor.md): their
// registration (ExecutorHello, checked against the first executor's model), heartbeats,
// Goodbye, and the StepResults of the batches the router sends. Liveness: the process that
// registered is watched with a pidfd in the router's event loop, so a death (kill -9 closes
// no ZeroMQ session the router could see) drops it at once; an executor that stays silent
// for `silence_limit` (hung, or on another host) is dropped too.
//
// Thread safety: one thread (the router's event loop) owns it.

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/base/unique_fd.h"
#include "common/transport/event_loop.h"
#include "common/wire/executor_codec.h"
#include "zmq.hpp"

namespace kvcm::router {

class ExecutorLink {
 public:
  struct Options {
    std::string endpoint;  // bound, e.g. ipc://RUN_DIR/router-executors.sock
    uint32_t heartbeat_interval_ms = 500;
    absl::Duration silence_limit = absl::Seconds(3);
    size_t max_message_bytes = 64 << 20;
  };
  struct Executor {
    uint64_t id = 0;
    std::string identity;  // the DEALER's routing id
    ExecutorHello hello;
    // The cache-manager epoch its Hello announced (the envelope's): it holds an executor
    // session in that epoch, so every fence that epoch's router sessions get waits for it.
    // An executor that attaches to another epoch says Hello again.
    uint64_t epoch = 0;
    absl::Time last_heard;
    uint64_t pending_request = 0;  // the StepBatch it owes a result for (0: none)
    uint64_t pending_step = 0;
    UniqueFd pidfd;  // the registered process; invalid if it could not be opened
    EventLoop::Id pid_watch = 0;
    absl::Time registered;
    uint64_t steps = 0;         // StepResults it returned
    uint64_t last_step_us = 0;  // the last one's duration, as the executor measured it
  };
  // A StepResult (or its refusal) for step `step_id` from `executor`.
  using ResultHandler =
      std::function<void(uint64_t executor, uint64_t step_id, absl::StatusOr<StepResult>)>;

  // `loop` (which outlives the link) watches the executors' pidfds.
  ExecutorLink(zmq::context_t& context, EventLoop* loop, Options options);
  ~ExecutorLink();
  absl::Status Bind();
  zmq::socket_t& socket() { return socket_; }

  void set_on_result(ResultHandler handler) { on_result_ = std::move(handler); }
  void set_on_change(std::function<void()> handler) { on_change_ = std::move(handler); }

  // Reads every queued message.
  void HandleReadable(absl::Time now);
  // Drops executors silent for too long; returns the ids dropped.
  std::vector<uint64_t> DropSilent(absl::Time now);
  // `stopped`: the executor is proven to write nothing more (its pidfd said it exited, or it
  // said Goodbye after its last step). Otherwise (silence, a step not answered in time) it
  // may be hung mid-step and wake up: its id is kept for TakeUnconfirmed(), so that the
  // router frees what it was running with drain (docs/architecture.md, "Fencing").
  void Drop(uint64_t executor, bool stopped = false) {
    Remove(executor, stopped, /*announce=*/true);
  }
  // The executors dropped without proof that they stopped, since the last call.
  std::vector<uint64_t> TakeUnconfirmed() { return std::exchange(unconfirmed_, {}); }

  // Sends `step` to `executor` (epoch and router_session filled in by the caller).
  absl::Status SendStep(uint64_t executor, const StepBatch& step, absl::Time now);
  // Goodbye to every executor (the router stops).
  void SayGoodbye();

  std::vector<uint64_t> Live() const;
  // The executors that announced cache-manager epoch `epoch`, the only ones a step of that
  // epoch may go to (docs/architecture.md, "Fencing"): one still attached to an earlier
  // epoch would re-attach on reading it, after the router session that sent it may have
  // ended with a fence that does not wait for it.
  std::vector<uint64_t> LiveInEpoch(uint64_t epoch) const;
  const absl::flat_hash_map<uint64_t, Executor>& executors() const { return executors_; }
  // The model every executor serves (the first one's); nullopt before any registered.
  const std::optional<ModelSummary>& model() const { return model_; }

 private:
  // Drop's work; `announce` false leaves on_change_ to the caller (an executor registered
  // again is replaced in one change, so the count never shows it gone in between).
  void Remove(uint64_t executor, bool stopped, bool announce);

  // HandleReadable's messages that take more than a reply.
  void HandleHello(const std::string& identity, const wire::ExecutorEnvelope& envelope,
                   Executor* executor, absl::Time now);
  void HandleResult(const wire::ExecutorEnvelope& envelope, Executor* executor);
  void Reply(const std::string& identity, const flatbuffers::FlatBufferBuilder& message);
  void Refuse(const std::string& identity, uint64_t request_id, wire::ErrorCode code,
              const std::string& reason);

  zmq::socket_t socket_;
  EventLoop* const loop_;
  const Options options_;
  bool bound_ = false;
  absl::flat_hash_map<uint64_t, Executor> executors_;
  absl::flat_hash_map<std::string, uint64_t> by_identity_;
  std::optional<ModelSummary> model_;
  uint64_t next_executor_ = 1;
  uint64_t next_request_ = 1;
  ResultHandler on_result_;
  std::function<void()> on_change_;
  std::vector<uint64_t> unconfirmed_;
  flatbuffers::FlatBufferBuilder out_;
};

}  // namespace kvcm::router
