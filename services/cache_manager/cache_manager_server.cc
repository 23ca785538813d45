#include "services/cache_manager/cache_manager_server.h"

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/base/log.h"
#include "common/base/monotonic_clock.h"
#include "common/base/unique_fd.h"
#include "common/memory/pool_layout.h"
#include "common/transport/accept_guard.h"
#include "common/transport/descriptor_limit.h"
#include "common/transport/event_loop.h"
#include "common/transport/zmq_util.h"
#include "common/wire/envelope.h"
#include "schemas/kvcm_protocol_generated.h"

namespace kvcm::cache_manager {
namespace {

constexpr char kComponent[] = "kvcm-cache-manager";
constexpr char kEventTopic[] = "kvcm.events";
// Events waiting for slow subscribers before PUB drops them (they then see a gap and ask
// for a snapshot).
constexpr int kEventHighWaterMark = 100000;
// Batches of queued requests answered before leases are judged, at most.
constexpr int kMaxDrainTurnsBeforeExpiry = 64;
// Connections that have not finished the ZeroMQ handshake by then are dropped (libzmq's
// default is 30 s), so that idle raw connections do not hold descriptors for long.
constexpr int kHandshakeMs = 5000;
// Descriptors kept free under RLIMIT_NOFILE for pidfds, the fd channel, metrics and the
// sessions already connected: below it, new connections are not accepted.
constexpr int kMinFdReserve = 32;
#ifndef SO_PEERPIDFD
#define SO_PEERPIDFD 77  // Linux 6.5; the headers of older distributions lack it
#endif
constexpr char kMonitorEndpoint[] = "inproc://kvcm-cache-manager-requests-monitor";
// Events read from the monitor at once, so that a flood of connections does not hold the
// loop; the rest are read in the next turn.
constexpr int kMaxMonitorEventsPerRead = 10000;

// At shutdown, the drain ends once no request came for this long (or at the deadline).
constexpr absl::Duration kShutdownQuiet = absl::Milliseconds(100);

void Log(std::string_view text) { LogLine(kComponent, text); }

}  // namespace

// Watches client processes with pidfds (Linux 5.3+) in the server's event loop, and calls
// `on_exit` on the loop's thread for each one that exits.
class CacheManagerServer::PidfdWatcher : public ProcessWatcher {
 public:
  PidfdWatcher(CacheManagerMetrics* metrics, EventLoop* loop,
               std::function<void(uint64_t, pid_t)> on_exit)
      : metrics_(metrics), loop_(loop), on_exit_(std::move(on_exit)) {}

  // A pidfd the kernel gave for the process at the other end of a connection when it was
  // accepted (SO_PEERPIDFD): Watch takes it instead of looking the pid up later, when it
  // may already name another process.
  void OfferConnectPidfd(pid_t pid, UniqueFd pidfd) {
    // A process's other connections (those that never say Hello) leave their pidfds here
    // unclaimed: dropped once the process has exited, so that each restart of a client does
    // not keep one more fd open (tests/faults/soak_test.cc counted one per executor
    // restart) until the cap below clears them all.
    for (auto it = connect_pidfds_.begin(); it != connect_pidfds_.end();) {
      if (Exited(it->second.get())) {
        connect_pidfds_.erase(it++);
      } else {
        ++it;
      }
    }
    if (connect_pidfds_.size() >= kMaxConnectPidfds) connect_pidfds_.clear();
    connect_pidfds_.insert_or_assign(pid, std::move(pidfd));
  }

  // One pidfd per session: the connection's when it was offered; else one of another live
  // session of the same pid (the same process, while its pidfd has not fired); else
  // pidfd_open.
  absl::Status Watch(uint64_t session, pid_t pid) override {
    if (watched_.contains(session)) return absl::OkStatus();
    if (auto offered = connect_pidfds_.extract(pid); !offered.empty()) {
      Add(session, pid, std::move(offered.mapped()));
      if (metrics_ != nullptr) metrics_->CountProcessWatch(true);
      return absl::OkStatus();
    }
    for (const auto& [other, watched] : watched_) {
      if (watched.pid != pid || Exited(watched.pidfd.get())) continue;
      const int dup = ::fcntl(watched.pidfd.get(), F_DUPFD_CLOEXEC, 0);
      if (dup < 0) break;
      Add(session, pid, UniqueFd(dup));
      return absl::OkStatus();
    }
    const long fd = ::syscall(SYS_pidfd_open, pid, 0);
    if (fd < 0) {
      if (errno == ESRCH) {
        // Already gone: reported later in this turn of the loop, as if its pidfd had fired.
        loop_->Post([this, session, pid] { on_exit_(session, pid); });
        return absl::OkStatus();
      }
      return absl::InternalError(absl::StrCat("pidfd_open(", pid, "): ", std::strerror(errno)));
    }
    Add(session, pid, UniqueFd(static_cast<int>(fd)));
    if (metrics_ != nullptr) metrics_->CountProcessWatch(false);
    return absl::OkStatus();
  }
  void Unwatch(uint64_t session) override {
    if (auto it = watched_.find(session); it != watched_.end()) {
      loop_->Cancel(it->second.watch);
      watched_.erase(it);
    }
  }

 private:
  struct Watched {
    pid_t pid = 0;
    UniqueFd pidfd;
    EventLoop::Id watch = 0;
  };
  // Whether the process of `pidfd` has exited (its pidfd is readable).
  static bool Exited(int pidfd) {
    pollfd p{pidfd, POLLIN, 0};
    return ::poll(&p, 1, 0) > 0;
  }
  void Add(uint64_t session, pid_t pid, UniqueFd pidfd) {
    const int fd = pidfd.get();
    const EventLoop::Id watch =
        loop_->WatchFd(fd, [this, session, pid] { on_exit_(session, pid); });
    watched_.insert_or_assign(session, Watched{pid, std::move(pidfd), watch});
  }

  static constexpr size_t kMaxConnectPidfds = 1024;
  CacheManagerMetrics* const metrics_;
  EventLoop* const loop_;
  const std::function<void(uint64_t, pid_t)> on_exit_;
  absl::flat_hash_map<uint64_t, Watched> watched_;
  absl::flat_hash_map<pid_t, UniqueFd> connect_pidfds_;
};

namespace {

// What an attaching executor needs to map the pool: its backend, layout and handle.
void FillPoolExport(const PoolLayout& layout, const PoolMemory& memory, const RunDirectory& run_dir,
                    PoolExport* pool) {
  pool->backend =
      memory.backend() == PoolBackend::kCuda ? wire::PoolBackend::Cuda : wire::PoolBackend::Shm;
  pool->layout = {.layer_stride = static_cast<uint64_t>(layout.layer_stride),
                  .kv_stride = static_cast<uint64_t>(layout.kv_stride),
                  .block_stride = static_cast<uint64_t>(layout.block_stride),
                  .token_stride = static_cast<uint64_t>(layout.token_stride),
                  .head_stride = static_cast<uint64_t>(layout.head_stride),
                  .elem_bytes = static_cast<uint32_t>(layout.elem_bytes),
                  .total_bytes = static_cast<uint64_t>(layout.total_bytes)};
  pool->cuda_device = memory.cuda_device();
  if (auto handle = memory.cuda_ipc_handle()) {
    pool->cuda_ipc_handle.assign(handle->begin(), handle->end());
  }
  if (memory.backend() == PoolBackend::kShm) {
    pool->fd_channel_path = run_dir.File(RunDirectory::kFdChannelSocket);
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<CacheManagerServer>> CacheManagerServer::Create(
    const Options& options, RunDirectory run_dir, std::unique_ptr<PoolMemory> memory,
    CacheManagerService::Options service_options, CacheManagerMetrics* metrics) {
  auto layout = PoolLayout::For(service_options.spec, service_options.ledger.num_blocks);
  if (!layout.ok()) return layout.status();
  if (static_cast<uint64_t>(layout->total_bytes) > memory->size_bytes()) {
    return absl::InvalidArgumentError(absl::StrCat("pool memory of ", memory->size_bytes(),
                                                   " bytes is smaller than the layout's ",
                                                   layout->total_bytes));
  }
  service_options.events_endpoint = run_dir.IpcEndpoint(RunDirectory::kEventSocket);
  service_options.vllm_events = options.vllm_events.has_value();
  FillPoolExport(*layout, *memory, run_dir, &service_options.pool);

  std::unique_ptr<CacheManagerServer> server(
      new CacheManagerServer(options, std::move(run_dir), std::move(memory), metrics));
  if (absl::Status loop = server->loop_.Init(); !loop.ok()) return loop;
  if (options.tiers.enabled()) {
    tiers::KvTiers::PoolAccess access{server->memory_.get(), *layout,
                                      service_options.spec.num_layers};
    tiers::TierOptions tier_options = options.tiers;
    // The vLLM-format stream announces what the tiers gain and lose.
    tier_options.record_events = options.vllm_events.has_value();
    auto tiers =
        tiers::KvTiers::Create(tier_options, service_options.spec, service_options.hash_algorithm,
                               access, [](std::string line) { Log(line); });
    if (!tiers.ok()) return tiers.status();
    server->tiers_ = *std::move(tiers);
    service_options.tiers = server->tiers_.get();
  }
  auto service =
      CacheManagerService::Create(service_options, server->watcher_.get(), metrics, MonotonicNow());
  if (!service.ok()) return service.status();
  server->service_ = *std::move(service);

  if (server->memory_->backend() == PoolBackend::kShm) {
    // The memfd goes to the uids the service serves, no others.
    auto channel = FdChannelListener::Create(server->service_->options().pool.fd_channel_path,
                                             server->service_->allowed_uids());
    if (!channel.ok()) return channel.status();
    server->fd_channel_ = std::make_unique<FdChannelListener>(*std::move(channel));
  }

  if (absl::Status bound = server->BindSockets(options); !bound.ok()) return bound;
  if (options.vllm_events.has_value()) {
    VllmEventPublisher::Options vllm = *options.vllm_events;
    vllm.info.block_size = server->service_->ledger().block_size();
    vllm.seq_file = server->run_dir_.File(RunDirectory::kVllmEventsSeqFile);
    auto publisher = VllmEventPublisher::Create(server->context_, vllm, metrics);
    if (!publisher.ok()) return publisher.status();
    server->vllm_events_ = *std::move(publisher);
  }
  // The first batch (AllBlocksCleared) tells subscribers of an earlier epoch to forget it.
  server->PublishEvents();
  server->PublishSnapshot();
  return server;
}

// The request socket (ipc://, and tcp:// when asked), its monitor, and the event socket.
absl::Status CacheManagerServer::BindSockets(const Options& options) {
  const int linger_ms = static_cast<int>(absl::ToInt64Milliseconds(options.linger));
  try {
    requests_ = zmq::socket_t(context_, zmq::socket_type::router);
    requests_.set(zmq::sockopt::router_mandatory, 1);
    requests_.set(zmq::sockopt::handshake_ivl, kHandshakeMs);
    LimitInboundMessages(requests_, service_->options().max_message_bytes);
    requests_.set(zmq::sockopt::linger, linger_ms);
    requests_.bind(request_endpoint());
    if (!options.tcp_endpoint.empty()) {
      requests_.bind(options.tcp_endpoint);
      tcp_bound_ = requests_.get(zmq::sockopt::last_endpoint);
    }
    if (zmq_socket_monitor(requests_.handle(), kMonitorEndpoint,
                           ZMQ_EVENT_ACCEPTED | ZMQ_EVENT_DISCONNECTED | ZMQ_EVENT_CLOSED) != 0) {
      throw zmq::error_t();
    }
    monitor_ = zmq::socket_t(context_, zmq::socket_type::pair);
    monitor_.set(zmq::sockopt::linger, 0);
    monitor_.connect(kMonitorEndpoint);
    fd_dir_ = UniqueFd(::open("/proc/self/fd", O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    events_ = zmq::socket_t(context_, zmq::socket_type::pub);
    events_.set(zmq::sockopt::sndhwm, kEventHighWaterMark);
    // Subscribers send only their subscriptions.
    LimitInboundMessages(events_, 1024);
    events_.set(zmq::sockopt::linger, linger_ms);
    events_.bind(event_endpoint());
  } catch (const zmq::error_t& error) {
    return absl::UnavailableError(
        absl::StrCat("cannot bind the cache manager's sockets: ", error.what()));
  }
  return absl::OkStatus();
}

CacheManagerServer::CacheManagerServer(const Options& options, RunDirectory run_dir,
                                       std::unique_ptr<PoolMemory> memory,
                                       CacheManagerMetrics* metrics)
    : options_(options),
      run_dir_(std::move(run_dir)),
      memory_(std::move(memory)),
      metrics_(metrics),
      watcher_(std::make_unique<PidfdWatcher>(
          metrics, &loop_,
          [this](uint64_t session, pid_t pid) { OnSessionProcessExited(session, pid); })),
      context_(1) {}

CacheManagerServer::~CacheManagerServer() {
  // Sockets close (with linger) before the pool is released and the run directory's
  // socket files are removed.
  if (requests_.handle() != nullptr) zmq_socket_monitor(requests_.handle(), nullptr, 0);
  monitor_.close();
  requests_.close();
  events_.close();
  vllm_events_.reset();
  context_.close();
  fd_channel_.reset();
}

std::string CacheManagerServer::request_endpoint() const {
  return run_dir_.IpcEndpoint(RunDirectory::kRequestSocket);
}

std::string CacheManagerServer::event_endpoint() const {
  return run_dir_.IpcEndpoint(RunDirectory::kEventSocket);
}

void CacheManagerServer::OnSessionProcessExited(uint64_t session, pid_t pid) {
  const int32_t before = service_->ledger().Stats().in_use_blocks;
  if (!service_->OnSessionProcessExited(session)) return;
  Log(absl::StrCat("client pid ", pid, " exited; its session ", session, " ended (",
                   before - service_->ledger().Stats().in_use_blocks, " blocks no longer in use)"));
  changed_ = true;
}

void CacheManagerServer::OnExpiryTimer(absl::Duration late) {
  // A loop this late was itself stopped (SIGSTOP, swap, a debugger) or starved: the
  // silence was ours, not the clients', and what they sent meanwhile may still sit in the
  // kernel's socket buffers. Nobody is charged for it.
  if (late > service_->options().heartbeat_timeout / 2) {
    service_->ExtendLeases(MonotonicNow());
    Log(absl::StrCat("the cache manager's own loop ran ", absl::FormatDuration(late),
                     " late (stopped or starved): every lease extended"));
  }
  // Leases are judged only after the input already queued is read (a heartbeat waiting in
  // the queue counts). Under a flood that does not let up, expiry waits for the next turn:
  // postponing it only delays a quarantine.
  bool caught_up = false;
  for (int turn = 0; turn < kMaxDrainTurnsBeforeExpiry && !caught_up; ++turn) {
    const int n = DrainRequests();
    changed_ |= n > 0;
    caught_up = n < options_.max_batch;
  }
  if (caught_up) {
    if (const int hung = service_->ExpireSessions(MonotonicNow()); hung > 0) {
      Log(absl::StrCat(hung, " session(s) missed their heartbeats: quarantined (",
                       service_->QuarantinedBlocks(), " blocks quarantined)"));
    }
  }
  GuardDescriptors();  // also while no connection comes or goes
  CloseSilentConnections(MonotonicNow());
  changed_ = true;
}

absl::Status CacheManagerServer::Run() {
  // One turn of the loop (common/transport/event_loop.h): requests, the signal, the fd
  // channel, connections accepted or closed, exited clients; then lease expiry; then the
  // events the turn caused are published.
  int signal = 0;
  const EventLoop::Id requests =
      loop_.WatchSocket(requests_, [this] { changed_ |= DrainRequests() > 0; });
  std::vector<EventLoop::Id> watches = {requests};
  if (options_.signal_fd >= 0) {
    watches.push_back(loop_.WatchSignals(options_.signal_fd, [this, &signal](int signo) {
      if (signal == 0) signal = signo;
      loop_.Stop();
    }));
  }
  if (fd_channel_) {
    watches.push_back(loop_.WatchFd(fd_channel_->listen_fd(), [this] { ServeFdChannel(); }));
  }
  // The monitor is watched through its ZMQ_FD, which the kernel's poll covers: as a ZeroMQ
  // item it would cost two command checks (a poll and a getpid each) in every turn.
  // ZMQ_FD is edge-triggered; every read of monitor_ drains it (DrainMonitor).
  watches.push_back(loop_.WatchFd(monitor_.get(zmq::sockopt::fd), [this] {
    if (DrainMonitor()) GuardDescriptors();
  }));
  if (vllm_events_) {
    watches.push_back(loop_.WatchSocket(vllm_events_->pub_socket(),
                                        [this] { vllm_events_->ServeSubscriptions(); }));
  }
  if (vllm_events_ && vllm_events_->replay_socket() != nullptr) {
    watches.push_back(
        loop_.WatchSocket(*vllm_events_->replay_socket(), [this] { vllm_events_->ServeReplay(); }));
  }
  if (tiers_ != nullptr) {
    watches.push_back(loop_.WatchFd(tiers_->wake_fd(), [this] {
      if (service_->PollTiers(MonotonicNow())) changed_ = true;
    }));
  }
  watches.push_back(loop_.AddTimer(service_->options().heartbeat_interval / 2,
                                   [this](absl::Duration late) { OnExpiryTimer(late); }));
  loop_.SetAfterTurn([this] {
    if (!changed_) return;
    changed_ = false;
    PublishEvents();
    PublishSnapshot();
  });
  const absl::Status ran = loop_.Run();
  for (EventLoop::Id id : watches) loop_.Cancel(id);
  loop_.SetAfterTurn(nullptr);
  if (!ran.ok()) return ran;

  Log(absl::StrCat("received ", strsignal(signal),
                   ": no new attachments or block operations; draining"));
  fd_channel_.reset();
  service_->BeginShutdown();
  const DrainResult drained = DrainForShutdown();
  PublishEvents();
  PublishSnapshot();
  Log(absl::StrCat("shutting down: answered ", drained.answered, " request(s) while draining",
                   drained.deadline_passed ? " (stopped at the drain deadline, under load)" : "",
                   "; ", service_->num_sessions(), " session(s) open; releasing the pool of ",
                   memory_->size_bytes(), " bytes"));
  return absl::OkStatus();
}

CacheManagerServer::DrainResult CacheManagerServer::DrainForShutdown() {
  DrainResult result;
  const absl::Time deadline = MonotonicNow() + options_.shutdown_drain;
  absl::Time quiet_until = MonotonicNow() + kShutdownQuiet;
  while (true) {
    const absl::Time now = MonotonicNow();
    if (now >= deadline) {
      result.deadline_passed = true;
      return result;
    }
    if (const int n = DrainRequests(); n > 0) {
      result.answered += n;
      PublishEvents();
      quiet_until = MonotonicNow() + kShutdownQuiet;
      continue;
    }
    if (now >= quiet_until) return result;
    if (!WaitReadable(requests_, std::min(quiet_until, deadline)).ok()) return result;
  }
}

int CacheManagerServer::DrainRequests() {
  int handled = 0;
  for (; handled < options_.max_batch; ++handled) {
    zmq::message_t identity;
    if (!requests_.recv(identity, zmq::recv_flags::dontwait)) break;
    zmq::message_t body;
    if (!identity.more() || !requests_.recv(body, zmq::recv_flags::dontwait)) continue;
    // A DEALER sends one frame; every further frame of the message is read and dropped
    // here, so that none of them is taken for the next message's routing id.
    int frames = 1;
    for (bool more = body.more(); more; ++frames) {
      zmq::message_t extra;
      if (!requests_.recv(extra, zmq::recv_flags::dontwait)) break;
      more = extra.more();
    }
    const int source_fd = zmq_msg_get(body.handle(), ZMQ_SRCFD);
    // A connection accepted since the monitor was last read: its pidfd first.
    if (!seen_.Contains(source_fd, identity.to_string_view())) {
      if (DrainMonitor()) GuardDescriptors();
      seen_.Remember(source_fd, identity.to_string_view());
    }
    std::optional<PeerCredentials> peer;
    if (const char* address = zmq_msg_gets(body.handle(), "Peer-Address")) {
      peer = ParseIpcPeerAddress(address);
    }
    AlignFrame(body);  // after reading its metadata, which the copy does not keep
    const std::span<const uint8_t> bytes(static_cast<const uint8_t*>(body.data()), body.size());
    if (frames == 1) {
      service_->Handle(peer, bytes, MonotonicNow(), &reply_);
    } else {
      service_->RefuseMalformed(PeekRequestId<wire::Envelope>(bytes, kEnvelopeIdentifier),
                                absl::StrCat("a request is one frame; this message had ", frames),
                                &reply_);
    }
    // A connection is no longer silent once a request of it is taken (a Hello, or a request
    // of a live session after a reconnection); one that only sends what is refused is
    // still closed at the deadline.
    if (!silent_.empty() && source_fd >= 0 && reply_.GetSize() > 0 &&
        wire::GetEnvelope(reply_.GetBufferPointer())->payload_type() != wire::Message::ErrorReply) {
      silent_.erase(source_fd);
    }
    // Events of this request go out before the next request is handled, so that an
    // EventSnapshot's seq counts every change it contains.
    PublishEvents();
    bool delivered = false;
    bool queue_full = false;
    try {
      // With router_mandatory a full queue is EAGAIN (an empty result), an unknown peer
      // EHOSTUNREACH; both are checked on the first frame.
      if (requests_.send(identity, zmq::send_flags::sndmore | zmq::send_flags::dontwait)) {
        delivered = requests_
                        .send(zmq::const_buffer(reply_.GetBufferPointer(), reply_.GetSize()),
                              zmq::send_flags::dontwait)
                        .has_value();
      }
      queue_full = !delivered;
    } catch (const zmq::error_t& error) {
      queue_full = error.num() == EAGAIN;
    }
    // The copies this request staged start now, after its reply (tier_coordinator.h).
    service_->FlushTiers();
    if (!delivered) {
      // The client disconnected before its reply (its session stays until its process exits
      // or its lease expires), or it stopped reading and its queue is full. Either way the
      // reply is lost, visibly: the client learns a Step's outcome by retrying it (the same
      // request id is answered from the replay cache) or with DescribeSession.
      ++unroutable_replies_;
      if (metrics_ != nullptr) metrics_->CountUndeliveredReply(queue_full);
      if ((unroutable_replies_ & (unroutable_replies_ - 1)) == 0) {  // 1, 2, 4, 8, ...
        Log(absl::StrCat("a reply could not be delivered (",
                         queue_full ? "the client's queue is full" : "the client is gone", "); ",
                         unroutable_replies_,
                         " so far (kvcm_cache_manager_undelivered_replies_total)"));
      }
    }
  }
  return handled;
}

bool CacheManagerServer::DrainMonitor() {
  bool any = false;
  for (int i = 0; i < kMaxMonitorEventsPerRead; ++i) {
    // Each event is two frames: u16 event and u32 value (the fd for ACCEPTED), then the
    // endpoint.
    zmq::message_t event;
    if (!monitor_.recv(event, zmq::recv_flags::dontwait)) return any;
    while (event.more()) {
      zmq::message_t rest;
      if (!monitor_.recv(rest, zmq::recv_flags::dontwait) || !rest.more()) break;
    }
    any = true;
    if (event.size() < 6) continue;
    uint16_t type = 0;
    int32_t fd = -1;
    std::memcpy(&type, event.data(), sizeof(type));
    std::memcpy(&fd, static_cast<const uint8_t*>(event.data()) + 2, sizeof(fd));
    if (fd >= 0) seen_.Forget(fd);  // accepted anew or closed
    if (type == ZMQ_EVENT_ACCEPTED && fd >= 0) {
      TakeConnectPidfd(fd);
      struct stat st {};
      if (options_.hello_timeout > absl::ZeroDuration() && ::fstat(fd, &st) == 0) {
        silent_[fd] = Silent{MonotonicNow(), static_cast<uint64_t>(st.st_ino)};
      }
    } else if ((type == ZMQ_EVENT_DISCONNECTED || type == ZMQ_EVENT_CLOSED) && fd >= 0) {
      silent_.erase(fd);
    }
  }
  // More may be queued, and ZMQ_FD does not fire again for them (it is edge-triggered):
  // read on in the next turn, after the requests that came meanwhile.
  loop_.Post([this] {
    if (DrainMonitor()) GuardDescriptors();
  });
  return any;
}

void CacheManagerServer::CloseSilentConnections(absl::Time now) {
  if (silent_.empty()) return;
  int closed = 0;
  for (auto it = silent_.begin(); it != silent_.end();) {
    auto current = it++;
    if (now - current->second.accepted < options_.hello_timeout) continue;
    // Still the connection that was accepted (not a descriptor reused since)?
    struct stat st {};
    if (::fstat(current->first, &st) == 0 &&
        static_cast<uint64_t>(st.st_ino) == current->second.inode) {
      // libzmq reads the end of the stream and drops the connection itself.
      ::shutdown(current->first, SHUT_RDWR);
      ++closed;
    }
    silent_.erase(current);
  }
  if (closed == 0) return;
  silent_closed_ += static_cast<uint64_t>(closed);
  if (metrics_ != nullptr) metrics_->CountSilentConnectionsClosed(closed);
  Log(absl::StrCat("closed ", closed, " connection(s) that made no valid request within ",
                   absl::FormatDuration(options_.hello_timeout), " of connecting; ", silent_closed_,
                   " so far (kvcm_cache_manager_silent_connections_closed_total)"));
}

void CacheManagerServer::TakeConnectPidfd(int connection) {
  // Read right after the accept, on the connection's own descriptor: the pid and the pidfd
  // both name the process that connected. Kernels before 6.5 lack SO_PEERPIDFD, and a
  // tcp:// connection has no peer: then Hello looks the pid up with pidfd_open.
  ucred peer{};
  socklen_t peer_len = sizeof(peer);
  int pidfd = -1;
  socklen_t pidfd_len = sizeof(pidfd);
  if (::getsockopt(connection, SOL_SOCKET, SO_PEERCRED, &peer, &peer_len) != 0 || peer.pid <= 0 ||
      ::getsockopt(connection, SOL_SOCKET, SO_PEERPIDFD, &pidfd, &pidfd_len) != 0 || pidfd < 0) {
    return;
  }
  UniqueFd owned(pidfd);
  // The descriptor may have been closed and reused by the time the event was read: keep the
  // pidfd only if it names the pid read from the same connection.
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/self/fdinfo/%d", pidfd);
  std::FILE* info = std::fopen(path, "r");
  if (info == nullptr) return;
  char line[128];
  pid_t named = -1;
  while (std::fgets(line, sizeof(line), info) != nullptr) {
    if (std::sscanf(line, "Pid: %d", &named) == 1) break;
  }
  std::fclose(info);
  if (named == peer.pid) watcher_->OfferConnectPidfd(peer.pid, std::move(owned));
}

void CacheManagerServer::GuardDescriptors() {
  const int limit = DescriptorLimit();
  const int open = OpenDescriptors(fd_dir_.get());
  if (limit < 0 || open < 0) return;
  const int reserve = std::max(kMinFdReserve, limit / 16);
  const int left = limit - open;
  if (const uint64_t dropped = ConnectionsDroppedAtDescriptorLimit();
      dropped != dropped_reported_) {
    Log(absl::StrCat(dropped - dropped_reported_,
                     " connections closed at accept: no descriptor was free"));
    dropped_reported_ = dropped;
  }
  std::vector<std::string> endpoints = {request_endpoint()};
  if (!tcp_bound_.empty()) endpoints.push_back(tcp_bound_);
  if (accepting_ && left < reserve) {
    for (const std::string& endpoint : endpoints) {
      try {
        requests_.unbind(endpoint);
      } catch (const zmq::error_t& error) {
        Log(absl::StrCat("unbinding ", endpoint, ": ", error.what()));
      }
    }
    accepting_ = false;
    if (metrics_ != nullptr) metrics_->SetAccepting(false);
    // Unbinding also closes every connection made through the endpoints: the idle flood
    // goes, and real clients connect again by themselves (ZeroMQ) into their sessions.
    Log(absl::StrCat(open, " of ", limit, " descriptors open: not accepting connections until ",
                     2 * reserve,
                     " are free again; the connections made so far were closed "
                     "(clients connect again; their sessions stay)"));
  } else if (!accepting_ && left >= 2 * reserve) {
    try {
      for (const std::string& endpoint : endpoints) requests_.bind(endpoint);
      accepting_ = true;
      if (metrics_ != nullptr) metrics_->SetAccepting(true);
      Log(absl::StrCat(open, " of ", limit, " descriptors open: accepting connections again"));
    } catch (const zmq::error_t& error) {
      Log(absl::StrCat("binding the request endpoints again: ", error.what()));
    }
  }
}

void CacheManagerServer::ServeFdChannel() {
  uint8_t header[8];
  const uint64_t epoch = service_->epoch();
  for (int i = 0; i < 8; ++i) header[i] = static_cast<uint8_t>(epoch >> (8 * i));
  auto served = fd_channel_->ServeOne(memory_->shareable_fd(), header);
  if (!served.ok() && !absl::IsUnavailable(served.status())) {
    Log(absl::StrCat("pool fd channel: ", served.status().ToString()));
    // Counted by the service, so that StatsReply and /metrics agree.
    if (absl::IsPermissionDenied(served.status())) {
      service_->CountRejected(RejectReason::kPermissionDenied);
    }
  }
}

void CacheManagerServer::PublishEvents() {
  while (const uint64_t seq = service_->TakeEventBatch(&event_batch_)) {
    uint8_t seq_be[8];
    for (int i = 0; i < 8; ++i) seq_be[i] = static_cast<uint8_t>(seq >> (56 - 8 * i));
    try {
      events_.send(zmq::const_buffer(kEventTopic, sizeof(kEventTopic) - 1),
                   zmq::send_flags::sndmore);
      events_.send(zmq::const_buffer(seq_be, sizeof(seq_be)), zmq::send_flags::sndmore);
      events_.send(zmq::const_buffer(event_batch_.GetBufferPointer(), event_batch_.GetSize()),
                   zmq::send_flags::none);
    } catch (const zmq::error_t& error) {
      Log(absl::StrCat("publishing event batch ", seq, ": ", error.what()));
    }
  }
  if (vllm_events_) {
    const std::vector<VllmEvent> events = service_->TakeVllmEvents();
    if (!events.empty()) {
      vllm_events_->Publish(events, absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch()));
    }
    const uint64_t without_tokens = service_->vllm_blocks_without_tokens();
    if (metrics_ != nullptr && without_tokens > vllm_without_tokens_reported_) {
      metrics_->CountVllmBlocksWithoutTokens(
          static_cast<int64_t>(without_tokens - vllm_without_tokens_reported_));
    }
    vllm_without_tokens_reported_ = without_tokens;
  }
}

void CacheManagerServer::PublishSnapshot() {
  if (metrics_ == nullptr) return;
  metrics_->PublishSnapshot(service_->Snapshot());
  const std::vector<std::pair<tiers::Tier, double>> loads = service_->TakeTierLoadSeconds();
  if (!loads.empty()) metrics_->ObserveTierLoads(loads);
}

}  // namespace kvcm::cache_manager
