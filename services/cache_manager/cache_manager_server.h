#pragma once
// CacheManagerServer: the cache manager's sockets and its one socket thread.
//
// It wires the transport to CacheManagerService (which holds the logic):
// - a ROUTER socket on ipc://RUN_DIR/cache-manager.sock (and optionally tcp://) for
//   requests: each message is [routing id, envelope]; the peer's pid comes from libzmq's
//   "Peer-Address" property (SO_PEERCRED) over ipc://;
// - a PUB socket on ipc://RUN_DIR/events.sock: [topic, seq u64 big-endian, EventBatch];
// - optionally the vLLM-format event stream's PUB and replay ROUTER
//   (vllm_event_publisher.h), fed from the same ledger events;
// - the Unix socket side channel RUN_DIR/pool-fd.sock handing the shm pool's memfd to
//   processes of this user (header: the epoch, 8 bytes little-endian);
// - a pidfd per registered client process, so that a death is noticed at once: taken when
//   its connection is accepted (SO_PEERPIDFD, Linux 6.5+), else opened by pid at Hello;
// - a signalfd for SIGTERM/SIGINT (the signals must be blocked in every thread before the
//   ZeroMQ context and the metrics server start; main() does it).
//
// Run() turns one EventLoop (common/transport/event_loop.h) over all of them, with the
// lease-expiry timer; nothing else ever touches the sockets.
// On a signal it stops accepting (closes the fd channel), refuses new block operations with
// Unavailable while it drains (until no request came for 100 ms, or Options::shutdown_drain
// under load), publishes the last events and returns; the destructor closes the sockets and
// releases the pool.
//
// Thread safety: create, Run() and destroy on one thread.

#include <sys/types.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/base/unique_fd.h"
#include "common/memory/fd_channel.h"
#include "common/memory/pool_memory.h"
#include "common/transport/event_loop.h"
#include "flatbuffers/flatbuffers.h"
#include "services/cache_manager/cache_manager_metrics.h"
#include "services/cache_manager/cache_manager_service.h"
#include "services/cache_manager/run_directory.h"
#include "services/cache_manager/seen_connections.h"
#include "services/cache_manager/vllm_event_publisher.h"
#include "zmq.hpp"

namespace kvcm::cache_manager {

class CacheManagerServer {
 public:
  struct Options {
    // Extra ROUTER endpoint, e.g. "tcp://127.0.0.1:5557"; empty = ipc:// only. Over tcp://
    // the client's pid cannot be verified, so a dead client is noticed by its heartbeat
    // timeout only.
    std::string tcp_endpoint;
    // A signalfd for SIGTERM/SIGINT (owned by the caller); -1 = run until the process dies.
    int signal_fd = -1;
    // How long closing sockets may wait to deliver the last replies and events.
    absl::Duration linger = absl::Seconds(1);
    // Requests handled per wakeup before events and gauges are refreshed.
    int max_batch = 256;
    // At SIGTERM, how long the cache manager goes on answering (Steps, Hello and Attach
    // with Unavailable, the rest as usual) before it exits; it exits sooner once no request
    // came for 100 ms.
    absl::Duration shutdown_drain = absl::Seconds(2);
    // A connection that has sent nothing this long after it was accepted is closed: it
    // holds a descriptor and is no client (a client says Hello at once). Zero: never.
    absl::Duration hello_timeout = absl::Seconds(10);
    // The vLLM-format KV event stream (vllm_event_publisher.h); unset: off. Its block size
    // and medium are taken from the pool.
    std::optional<VllmEventPublisher::Options> vllm_events;
    // The host and disk tiers (tiers/kv_tiers.h); off unless enabled(). They copy to and
    // from `memory` on their own threads.
    tiers::TierOptions tiers;
  };

  // Binds every socket in `run_dir` (which the caller has acquired) and starts the service.
  // `service_options.pool` is filled in here from `memory`. Errors: the service's option
  // checks, UNAVAILABLE when a socket cannot be bound.
  static absl::StatusOr<std::unique_ptr<CacheManagerServer>> Create(
      const Options& options, RunDirectory run_dir, std::unique_ptr<PoolMemory> memory,
      CacheManagerService::Options service_options, CacheManagerMetrics* metrics);

  ~CacheManagerServer();

  // Serves until a signal arrives on signal_fd. Returns OK after a clean shutdown.
  absl::Status Run();

  uint64_t epoch() const { return service_->epoch(); }
  std::string request_endpoint() const;
  // The tcp:// endpoint bound (with the port chosen for "*"); empty without one.
  const std::string& tcp_endpoint() const { return tcp_bound_; }
  std::string tcp_secret_path() const { return run_dir_.File(RunDirectory::kTcpSecretFile); }
  std::string event_endpoint() const;
  // The vLLM-format stream's endpoints as bound (port 0 resolved); empty when it is off.
  std::string vllm_events_endpoint() const {
    return vllm_events_ ? vllm_events_->endpoint() : std::string();
  }
  std::string vllm_replay_endpoint() const {
    return vllm_events_ ? vllm_events_->replay_endpoint() : std::string();
  }
  // The stream's first sequence number in this start (0 on a node's first start).
  uint64_t vllm_first_seq() const { return vllm_events_ ? vllm_events_->first_seq() : 0; }

 private:
  absl::Status BindSockets(const Options& options);
  CacheManagerServer(const Options& options, RunDirectory run_dir,
                     std::unique_ptr<PoolMemory> memory, CacheManagerMetrics* metrics);

  class PidfdWatcher;

  // The watched process of `session` exited: the session ends.
  void OnSessionProcessExited(uint64_t session, pid_t pid);
  // Every heartbeat_interval / 2: leases are judged (after the queued input is read), and
  // extended instead when the loop itself ran `late` by more than half the timeout.
  void OnExpiryTimer(absl::Duration late);
  // Handles up to max_batch queued requests; returns how many.
  int DrainRequests();
  // After a signal: answers requests until none came for a while or shutdown_drain passed.
  struct DrainResult {
    int answered = 0;
    bool deadline_passed = false;
  };
  DrainResult DrainForShutdown();
  void ServeFdChannel();
  // Stops accepting connections (unbinds the request endpoints, which also closes the
  // connections made through them) while fewer than a reserve of descriptors are left
  // under RLIMIT_NOFILE, and binds them again once twice the reserve is free: a flood of
  // idle connections does not starve pidfds, the fd channel and metrics of descriptors.
  // (Connections that arrive faster than this reacts are closed at accept by the accept
  // guard, common/transport/accept_guard.h, not left to abort libzmq.) Clients
  // connect again by themselves (ZeroMQ) and keep their sessions; a reply lost meanwhile is
  // learnt by retrying (the Step replay cache).
  void GuardDescriptors();
  // Drains the request socket's monitor (connections accepted or closed); true if any.
  bool DrainMonitor();
  // For a connection just accepted: offers its peer's pidfd (SO_PEERPIDFD) to the watcher.
  void TakeConnectPidfd(int connection);
  // Closes the connections that have said nothing since they were accepted
  // hello_timeout ago (Options::hello_timeout).
  void CloseSilentConnections(absl::Time now);

  void PublishEvents();
  void PublishSnapshot();

  const Options options_;
  RunDirectory run_dir_;
  std::unique_ptr<PoolMemory> memory_;
  // After memory_ and before service_: destroyed after the service, before the memory.
  std::unique_ptr<tiers::KvTiers> tiers_;
  CacheManagerMetrics* const metrics_;
  EventLoop loop_;
  bool changed_ = false;  // the turn changed the ledger: publish its events after it
  std::unique_ptr<PidfdWatcher> watcher_;
  std::unique_ptr<CacheManagerService> service_;
  std::unique_ptr<FdChannelListener> fd_channel_;

  zmq::context_t context_;
  zmq::socket_t requests_;
  zmq::socket_t monitor_;  // PAIR on requests_'s monitor: accepted and closed connections
  bool accepting_ = true;
  uint64_t dropped_reported_ = 0;  // ConnectionsDroppedAtDescriptorLimit() last logged
  UniqueFd fd_dir_;                // /proc/self/fd, to count descriptors when none is free
  // Connections accepted that have sent nothing yet, by descriptor (the inode tells a
  // descriptor reused for another connection apart).
  struct Silent {
    absl::Time accepted;
    uint64_t inode = 0;
  };
  absl::flat_hash_map<int, Silent> silent_;
  uint64_t silent_closed_ = 0;
  // Connections whose acceptance the monitor has told: a request from another one reads the
  // monitor first (services/cache_manager/seen_connections.h).
  SeenConnections seen_;
  zmq::socket_t events_;
  std::unique_ptr<VllmEventPublisher> vllm_events_;  // null when off
  uint64_t vllm_without_tokens_reported_ = 0;        // the service's count already in the metrics

  flatbuffers::FlatBufferBuilder reply_;
  flatbuffers::FlatBufferBuilder event_batch_;
  uint64_t unroutable_replies_ = 0;
  std::string tcp_bound_;
};

}  // namespace kvcm::cache_manager
