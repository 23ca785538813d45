#include "services/executor/executor_server.h"

#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/base/log.h"
#include "common/base/monotonic_clock.h"
#include "common/base/status_macros.h"
#include "common/memory/pool_memory.h"
#include "common/transport/event_loop.h"
#include "common/transport/zmq_util.h"

namespace kvcm::executor {
namespace {

constexpr char kComponent[] = "kvcm-executor";
void Log(std::string_view text) { LogLine(kComponent, text); }

}  // namespace

absl::StatusOr<std::unique_ptr<ExecutorServer>> ExecutorServer::Create(const Options& options,
                                                                       ExecutorService* service,
                                                                       PoolSource* pool) {
  std::unique_ptr<ExecutorServer> server(new ExecutorServer(options, service, pool));
  try {
    server->router_ = zmq::socket_t(server->context_, zmq::socket_type::dealer);
    server->router_.set(zmq::sockopt::linger,
                        static_cast<int>(absl::ToInt64Milliseconds(options.linger)));
    server->router_.set(zmq::sockopt::immediate, 1);
    LimitInboundMessages(server->router_, service->options().max_message_bytes);
    server->router_.connect(options.router_endpoint);
  } catch (const zmq::error_t& error) {
    return absl::InvalidArgumentError(absl::StrCat("cannot connect to the router at ",
                                                   options.router_endpoint, ": ", error.what()));
  }
  if (const PoolView* attached = pool->pool()) server->logged_epoch_ = attached->epoch;
  // A step on the CPU can take seconds (a long prefill): its heartbeats go out between
  // layers, on this same thread, so that the router's silence deadline measures a hang, not
  // the length of a step.
  ExecutorServer* raw = server.get();
  service->SetBetweenLayers([raw] {
    const absl::Time now = MonotonicNow();
    if (raw->service_->WantsHeartbeat(now)) {
      raw->service_->BuildHeartbeat(now, &raw->out_);
      raw->Send(raw->out_);
    }
  });
  return server;
}

ExecutorServer::ExecutorServer(const Options& options, ExecutorService* service, PoolSource* pool)
    : options_(options), service_(service), pool_(pool), context_(1) {}

ExecutorServer::~ExecutorServer() {
  service_->SetBetweenLayers(nullptr);
  router_.close();
  context_.close();
}

bool ExecutorServer::Send(const flatbuffers::FlatBufferBuilder& message) {
  try {
    if (router_.send(zmq::const_buffer(message.GetBufferPointer(), message.GetSize()),
                     zmq::send_flags::dontwait)) {
      return true;
    }
    ++unsent_;  // not connected to the router, or its queue is full (it stopped reading)
  } catch (const zmq::error_t& error) {
    ++unsent_;
    Log(absl::StrCat("sending to the router: ", error.what()));
  }
  return false;
}

void ExecutorServer::Upkeep() {
  pool_->NoteProgress();  // the socket thread's loop turns: its heartbeats may go out
  // Between steps: fences first, so that the refresh below can never re-register before
  // they are honoured.
  service_->ApplyFences();
  const absl::Status refreshed = pool_->Refresh();
  const PoolView* attached = pool_->pool();
  const uint64_t epoch = attached == nullptr ? 0 : attached->epoch;
  if (epoch != logged_epoch_) {
    if (epoch != 0) {
      Log(absl::StrCat("re-attached to the pool of epoch ", epoch, " (was ", logged_epoch_, "): ",
                       attached->num_blocks, " blocks of ", attached->spec.block_size, " tokens, ",
                       std::string(PoolBackendName(attached->backend)), "; weights kept"));
    } else {
      Log(absl::StrCat("pool of epoch ", logged_epoch_, " dropped; waiting for the cache manager"));
    }
    logged_epoch_ = epoch;
    logged_failure_.clear();
  }
  if (!refreshed.ok() && attached == nullptr && !absl::IsUnavailable(refreshed)) {
    // UNAVAILABLE (nothing listens, or waiting to retry) is the normal state while the cache
    // manager is down; anything else is logged once per distinct message.
    const std::string failure(refreshed.message());
    if (failure != logged_failure_) {
      Log(absl::StrCat("cannot attach to the pool: ", failure));
      logged_failure_ = failure;
    }
  }
  const absl::Time now = MonotonicNow();
  if (service_->WantsHello(now)) {
    service_->BuildHello(now, &out_);
    if (!Send(out_)) service_->HelloNotSent();
  } else if (service_->WantsHeartbeat(now)) {
    service_->BuildHeartbeat(now, &out_);
    Send(out_);
  }
}

int ExecutorServer::Drain(bool shutting_down) {
  int handled = 0;
  for (; handled < options_.max_batch; ++handled) {
    zmq::message_t frame;
    try {
      if (!router_.recv(frame, zmq::recv_flags::dontwait)) break;
    } catch (const zmq::error_t& error) {
      if (error.num() == EINTR) continue;
      Log(absl::StrCat("receiving from the router: ", error.what()));
      break;
    }
    bool well_formed = true;
    while (frame.more()) {  // the router sends one frame; anything more is malformed
      zmq::message_t extra;
      if (!router_.recv(extra, zmq::recv_flags::dontwait)) break;
      well_formed = false;
      if (!extra.more()) break;
    }
    AlignFrame(frame);
    const std::span<const uint8_t> bytes =
        well_formed ? FrameBytes(frame) : std::span<const uint8_t>();
    const absl::Time now = MonotonicNow();
    if (shutting_down) {
      const VerifiedExecutorEnvelope verified = VerifyExecutorEnvelope(bytes);
      if (verified.envelope != nullptr &&
          verified.envelope->payload_type() == wire::ExecutorMessage::StepBatch) {
        reply_.Clear();
        FinishExecutorError(reply_, verified.envelope->request_id(), service_->executor_id(), 0,
                            wire::ErrorCode::Unavailable, "executor shutting down");
        Send(reply_);
        continue;
      }
    }
    const ExecutorService::Handled result = service_->Handle(bytes, now, &reply_);
    if (result.reply) {
      Send(reply_);
      service_->NoteSent(MonotonicNow());
    }
  }
  return handled;
}

void ExecutorServer::SayGoodbye() {
  if (service_->registered()) {
    service_->BuildGoodbye(MonotonicNow(), &out_);
    Send(out_);
    const absl::Time deadline = MonotonicNow() + options_.goodbye_timeout;
    while (!service_->goodbye_answered() && MonotonicNow() < deadline) {
      absl::StatusOr<bool> ready = WaitReadable(router_, deadline);
      if (!ready.ok()) break;
      if (*ready) Drain(/*shutting_down=*/true);
    }
    Log(service_->goodbye_answered() ? "the router acknowledged Goodbye"
                                     : "the router did not answer Goodbye");
  }
  pool_->Goodbye();
}

absl::Status ExecutorServer::Run() {
  // One turn of the loop (common/transport/event_loop.h): upkeep (pool, Hello, heartbeat),
  // then the router's messages; at most a tick apart.
  EventLoop loop(EventLoop::Options{.max_wait = options_.tick});
  KVCM_RETURN_IF_ERROR(loop.Init());
  int signal = 0;
  loop.SetBeforePoll([this] { Upkeep(); });
  loop.WatchSocket(router_, [this] { Drain(/*shutting_down=*/false); });
  if (options_.signal_fd >= 0) {
    loop.WatchSignals(options_.signal_fd, [&](int signo) {
      if (signal == 0) signal = signo;
      loop.Stop();
    });
  }
  KVCM_RETURN_IF_ERROR(loop.Run());
  Log(absl::StrCat("received ", strsignal(signal),
                   ": answering queued messages, then saying goodbye"));
  // Messages that arrived before the signal are answered (steps run); then goodbye.
  int answered = 0;
  for (int n; (n = Drain(/*shutting_down=*/false)) > 0;) answered += n;
  SayGoodbye();
  Log(absl::StrCat("stopped after ", service_->steps(), " step(s); answered ", answered,
                   " queued message(s) at shutdown",
                   unsent_ > 0 ? absl::StrCat("; ", unsent_, " message(s) not sent") : ""));
  return absl::OkStatus();
}

}  // namespace kvcm::executor
