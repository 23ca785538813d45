#pragma once
// ExecutorServer: kvcm-executor's socket and its one socket thread.
//
// It wires the transport to ExecutorService (which holds the logic):
// - a DEALER socket connected to the router's ROUTER (Options::router_endpoint, e.g.
//   ipc://RUN_DIR/router-executors.sock): every message is one frame, an ExecutorEnvelope.
//   ZMQ_IMMEDIATE: nothing is queued while the router is away (no burst of stale Hellos
//   when it comes back); the Hello is retried every tick until one goes out;
// - a signalfd for SIGTERM/SIGINT (the signals must be blocked in every thread before the
//   ZeroMQ context, the metrics server and the cache-manager client start; main() does it);
// - the PoolSource, refreshed every tick: a refused cache-manager session (new epoch) or a
//   missing pool triggers a re-attachment on this thread, between steps.
//
// Run() turns an EventLoop (common/transport/event_loop.h) over the DEALER and the
// signalfd; nothing else touches the socket. Steps run on this thread (the model parallelizes
// inside Forward), so a signal is seen between steps: the step in progress always completes and is
// answered. On a signal it answers the messages already queued, says Goodbye to the router (waiting
// up to goodbye_timeout for the reply), ends the cache-manager session and returns OK.
//
// Thread safety: create, Run() and destroy on one thread.

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "flatbuffers/flatbuffers.h"
#include "services/executor/executor_pool.h"
#include "services/executor/executor_service.h"
#include "zmq.hpp"

namespace kvcm::executor {

class ExecutorServer {
 public:
  struct Options {
    // The router's ROUTER socket, "ipc://..." or "tcp://HOST:PORT". The DEALER connects (and
    // reconnects) in the background; the router may start later.
    std::string router_endpoint;
    // A signalfd for SIGTERM/SIGINT (owned by the caller); -1 = run until the process dies.
    int signal_fd = -1;
    // Upkeep period: pool refresh, Hello retries and heartbeats are checked this often while
    // idle. Shorter notices a cache-manager restart sooner at a little idle CPU.
    absl::Duration tick = absl::Milliseconds(50);
    // How long shutdown waits for the router's GoodbyeReply.
    absl::Duration goodbye_timeout = absl::Seconds(1);
    // How long closing the socket may wait to deliver the last messages.
    absl::Duration linger = absl::Seconds(1);
    // Messages handled per wakeup before the upkeep runs again.
    int max_batch = 64;
  };

  // Connects the DEALER. `service` and `pool` must outlive the server. INVALID_ARGUMENT for an
  // endpoint ZeroMQ refuses.
  static absl::StatusOr<std::unique_ptr<ExecutorServer>> Create(const Options& options,
                                                                ExecutorService* service,
                                                                PoolSource* pool);
  ~ExecutorServer();

  // Serves until a signal arrives on signal_fd. OK after a clean shutdown; INTERNAL when
  // zmq_poll fails.
  absl::Status Run();

 private:
  ExecutorServer(const Options& options, ExecutorService* service, PoolSource* pool);

  // Re-attaches when needed, sends Hello or a Heartbeat when due; logs pool changes.
  void Upkeep();
  // Handles up to max_batch queued messages; returns how many. With `shutting_down`, steps
  // are refused as Unavailable instead of run.
  int Drain(bool shutting_down);
  // False when it could not be queued (not connected, or the queue is full).
  bool Send(const flatbuffers::FlatBufferBuilder& message);
  // Goodbye to the router, waiting for its reply; then to the cache manager.
  void SayGoodbye();

  const Options options_;
  ExecutorService* const service_;
  PoolSource* const pool_;
  zmq::context_t context_;
  zmq::socket_t router_;
  flatbuffers::FlatBufferBuilder out_;
  flatbuffers::FlatBufferBuilder reply_;
  uint64_t logged_epoch_ = 0;   // the pool epoch last logged
  std::string logged_failure_;  // the last attach failure logged (not repeated)
  uint64_t unsent_ = 0;         // messages dropped: not connected or queue full
};

}  // namespace kvcm::executor
