#include "services/router/executor_link.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/base/log.h"
#include "common/transport/zmq_util.h"
#include "common/wire/envelope.h"

namespace kvcm::router {
namespace {

constexpr char kComponent[] = "kvcm-router";
void Log(std::string_view text) { LogLine(kComponent, text); }

// What must agree between executors for them to serve the same model.
std::string ModelMismatch(const ModelSummary& want, const ModelSummary& got) {
  auto differ = [](const char* what, auto a, auto b) {
    return absl::StrCat(what, " ", b, " (the others serve ", a, ")");
  };
  if (want.num_layers != got.num_layers)
    return differ("num_layers", want.num_layers, got.num_layers);
  if (want.hidden_size != got.hidden_size) {
    return differ("hidden_size", want.hidden_size, got.hidden_size);
  }
  if (want.num_kv_heads != got.num_kv_heads) {
    return differ("num_kv_heads", want.num_kv_heads, got.num_kv_heads);
  }
  if (want.head_dim != got.head_dim) return differ("head_dim", want.head_dim, got.head_dim);
  if (want.vocab_size != got.vocab_size) {
    return differ("vocab_size", want.vocab_size, got.vocab_size);
  }
  if (want.eos_token_ids != got.eos_token_ids) return "other eos_token_ids";
  return "";
}

}  // namespace

ExecutorLink::ExecutorLink(zmq::context_t& context, EventLoop* loop, Options options)
    : socket_(context, zmq::socket_type::router), loop_(loop), options_(std::move(options)) {}

ExecutorLink::~ExecutorLink() {
  for (auto& [id, executor] : executors_) {
    if (executor.pid_watch != 0) loop_->Cancel(executor.pid_watch);
  }
  socket_.close();
  // libzmq leaves an ipc:// socket file behind: the router removes what it bound.
  if (bound_) {
    if (std::optional<std::string> path = IpcPath(options_.endpoint)) ::unlink(path->c_str());
  }
}

absl::Status ExecutorLink::Bind() {
  // Binding an ipc:// path replaces whatever socket file is there: a second router on the
  // same run directory would take the executors of the first without a word.
  if (IpcPath(options_.endpoint).has_value() && ProbeIpcListener(options_.endpoint).ok()) {
    return absl::AlreadyExistsError(
        absl::StrCat("another router listens on ", options_.endpoint,
                     " (stop it, or give this one another --executor-endpoint or --run-dir)"));
  }
  try {
    socket_.set(zmq::sockopt::linger, 0);
    socket_.set(zmq::sockopt::router_mandatory, 1);
    LimitInboundMessages(socket_, options_.max_message_bytes);
    socket_.bind(options_.endpoint);
    bound_ = true;
  } catch (const zmq::error_t& error) {
    return absl::UnavailableError(
        absl::StrCat("cannot bind the executor endpoint ", options_.endpoint, ": ", error.what()));
  }
  return absl::OkStatus();
}

void ExecutorLink::Reply(const std::string& identity,
                         const flatbuffers::FlatBufferBuilder& message) {
  try {
    socket_.send(zmq::const_buffer(identity.data(), identity.size()), zmq::send_flags::sndmore);
    socket_.send(zmq::const_buffer(message.GetBufferPointer(), message.GetSize()),
                 zmq::send_flags::dontwait);
  } catch (const zmq::error_t& error) {
    Log(absl::StrCat("replying to an executor: ", error.what()));
  }
}

void ExecutorLink::Refuse(const std::string& identity, uint64_t request_id, wire::ErrorCode code,
                          const std::string& reason) {
  out_.Clear();
  FinishExecutorError(out_, request_id, 0, 0, code, reason);
  Reply(identity, out_);
}

void ExecutorLink::HandleReadable(absl::Time now) {
  for (int i = 0; i < 256; ++i) {
    zmq::message_t identity_frame;
    if (!socket_.recv(identity_frame, zmq::recv_flags::dontwait)) return;
    if (!identity_frame.more()) continue;
    zmq::message_t body;
    if (!socket_.recv(body, zmq::recv_flags::dontwait)) continue;
    bool extra = false;
    while (body.more()) {  // an executor sends one frame: the rest is dropped
      zmq::message_t more;
      if (!socket_.recv(more, zmq::recv_flags::dontwait)) break;
      extra = true;
      if (!more.more()) break;
    }
    AlignFrame(body);
    const std::string identity(static_cast<const char*>(identity_frame.data()),
                               identity_frame.size());
    const VerifiedExecutorEnvelope verified =
        VerifyExecutorEnvelope(FrameBytes(body), options_.max_message_bytes);
    if (verified.envelope == nullptr || extra) {
      Refuse(identity, verified.request_id, wire::ErrorCode::Malformed,
             extra ? "a message of more than one frame" : verified.reason);
      continue;
    }
    const wire::ExecutorEnvelope& envelope = *verified.envelope;
    auto known = by_identity_.find(identity);
    Executor* executor = known == by_identity_.end() ? nullptr : &executors_.at(known->second);
    if (executor != nullptr) executor->last_heard = now;
    switch (envelope.payload_type()) {
      case wire::ExecutorMessage::ExecutorHello:
        HandleHello(identity, envelope, executor, now);
        break;
      case wire::ExecutorMessage::Heartbeat:
        if (executor == nullptr) {
          Refuse(identity, envelope.request_id(), wire::ErrorCode::NotRegistered,
                 "say ExecutorHello first");
          break;
        }
        out_.Clear();
        FinishExecutorEnvelope(out_, envelope.request_id(), executor->id, 0,
                               wire::ExecutorMessage::HeartbeatReply,
                               wire::CreateHeartbeatReply(out_).Union());
        Reply(identity, out_);
        break;
      case wire::ExecutorMessage::Goodbye: {
        out_.Clear();
        FinishExecutorEnvelope(out_, envelope.request_id(), 0, 0,
                               wire::ExecutorMessage::GoodbyeReply,
                               wire::CreateGoodbyeReply(out_, 0).Union());
        Reply(identity, out_);
        if (executor != nullptr) {
          Log(absl::StrCat("executor ", executor->id, " said Goodbye"));
          Drop(executor->id, /*stopped=*/true);
        }
        break;
      }
      case wire::ExecutorMessage::StepResult:
      case wire::ExecutorMessage::ErrorReply:
        HandleResult(envelope, executor);
        break;
      case wire::ExecutorMessage::GoodbyeReply:
      case wire::ExecutorMessage::HeartbeatReply:
        break;
      default:
        Refuse(
            identity, envelope.request_id(), wire::ErrorCode::Malformed,
            absl::StrCat("unexpected ", std::string(ExecutorMessageName(envelope.payload_type()))));
    }
  }
}

// ExecutorHello: registers the sender (again, when `executor` already names it), if it
// serves the router's model (the first executor's sets it).
void ExecutorLink::HandleHello(const std::string& identity, const wire::ExecutorEnvelope& envelope,
                               Executor* executor, absl::Time now) {
  absl::StatusOr<ExecutorHello> hello = DecodeExecutorHello(*envelope.payload_as_ExecutorHello());
  if (!hello.ok()) {
    Refuse(identity, envelope.request_id(), wire::ErrorCode::InvalidArgument,
           std::string(hello.status().message()));
    return;
  }
  if (model_.has_value()) {
    if (const std::string why = ModelMismatch(*model_, hello->model); !why.empty()) {
      Log(absl::StrCat("refused executor ", hello->name, ": it serves another model (", why, ")"));
      Refuse(identity, envelope.request_id(), wire::ErrorCode::InvalidArgument,
             absl::StrCat("this router serves another model: ", why));
      return;
    }
  } else {
    model_ = hello->model;
  }
  if (executor != nullptr) {  // registered again (restarted, or a new pool epoch)
    const uint64_t old = executor->id;
    Remove(old, /*stopped=*/false, /*announce=*/false);
  }
  Executor fresh;
  fresh.id = next_executor_++;
  fresh.identity = identity;
  fresh.hello = *std::move(hello);
  fresh.epoch = envelope.epoch();
  fresh.last_heard = now;
  fresh.registered = now;
  Log(absl::StrCat("executor ", fresh.id, " (", fresh.hello.name, ", pid ", fresh.hello.pid,
                   ") registered in cache-manager epoch ", fresh.epoch));
  out_.Clear();
  FinishExecutorEnvelope(
      out_, envelope.request_id(), fresh.id, 0, wire::ExecutorMessage::ExecutorHelloReply,
      wire::CreateExecutorHelloReply(out_, fresh.id, options_.heartbeat_interval_ms).Union());
  // Its death is seen at once. (The pid is the one it claims: a wrong claim only
  // hurts its own liveness, and silence still drops it.)
  const long pidfd = ::syscall(SYS_pidfd_open, fresh.hello.pid, 0);
  if (pidfd >= 0) {
    fresh.pidfd = UniqueFd(static_cast<int>(pidfd));
    const uint64_t id = fresh.id;
    fresh.pid_watch = loop_->WatchFd(fresh.pidfd.get(), [this, id] {
      Log(absl::StrCat("executor ", id, " exited: dropped"));
      Drop(id, /*stopped=*/true);
    });
  }
  by_identity_[identity] = fresh.id;
  executors_.emplace(fresh.id, std::move(fresh));
  // The router counts it before the executor hears it is registered: the executor's
  // "registered" line is what kvcm-launch's ready waits for, and a request sent at that
  // line must not find no executor (docs/operations.md, "kvcm-launch").
  if (on_change_) on_change_();
  Reply(identity, out_);
}

// A StepResult or an ErrorReply: the pending step's report, to on_result_.
void ExecutorLink::HandleResult(const wire::ExecutorEnvelope& envelope, Executor* executor) {
  if (executor == nullptr || executor->pending_request != envelope.request_id()) return;
  const uint64_t step = executor->pending_step;
  const uint64_t id = executor->id;
  executor->pending_request = 0;
  executor->pending_step = 0;
  absl::StatusOr<StepResult> report;
  if (const wire::ErrorReply* error = envelope.payload_as_ErrorReply()) {
    report = FromWire(error->code(), error->reason() == nullptr ? "" : error->reason()->str());
  } else {
    report = DecodeStepResult(*envelope.payload_as_StepResult());
    ++executor->steps;
    executor->last_step_us = report->duration_us;
  }
  if (on_result_) on_result_(id, step, std::move(report));
}

std::vector<uint64_t> ExecutorLink::DropSilent(absl::Time now) {
  std::vector<uint64_t> dropped;
  for (const auto& [id, executor] : executors_) {
    if (now - executor.last_heard > options_.silence_limit) dropped.push_back(id);
  }
  for (uint64_t id : dropped) {
    Log(absl::StrCat("executor ", id, " silent for more than ",
                     absl::FormatDuration(options_.silence_limit), ": dropped"));
    Drop(id);
  }
  return dropped;
}

void ExecutorLink::Remove(uint64_t id, bool stopped, bool announce) {
  auto it = executors_.find(id);
  if (it == executors_.end()) return;
  if (!stopped) unconfirmed_.push_back(id);  // before on_result_: the step's end takes it
  const uint64_t step = it->second.pending_step;
  if (it->second.pid_watch != 0) loop_->Cancel(it->second.pid_watch);
  by_identity_.erase(it->second.identity);
  executors_.erase(it);
  if (step != 0 && on_result_) {
    on_result_(id, step, absl::UnavailableError(absl::StrCat("executor ", id, " is gone")));
  }
  if (announce && on_change_) on_change_();
}

absl::Status ExecutorLink::SendStep(uint64_t id, const StepBatch& step, absl::Time now) {
  auto it = executors_.find(id);
  if (it == executors_.end()) return absl::NotFoundError(absl::StrCat("no executor ", id));
  Executor& executor = it->second;
  const uint64_t request_id = next_request_++;
  out_.Clear();
  EncodeStepBatch(out_, request_id, id, step);
  try {
    socket_.send(zmq::const_buffer(executor.identity.data(), executor.identity.size()),
                 zmq::send_flags::sndmore);
    if (!socket_.send(zmq::const_buffer(out_.GetBufferPointer(), out_.GetSize()),
                      zmq::send_flags::dontwait)) {
      return absl::UnavailableError("the executor's queue is full");
    }
  } catch (const zmq::error_t& error) {
    return absl::UnavailableError(absl::StrCat("sending to executor ", id, ": ", error.what()));
  }
  executor.pending_request = request_id;
  executor.pending_step = step.step_id;
  executor.last_heard = now;  // the step's time is its own: silence counts from here
  return absl::OkStatus();
}

void ExecutorLink::SayGoodbye() {
  for (const auto& [id, executor] : executors_) {
    out_.Clear();
    FinishExecutorEnvelope(out_, next_request_++, id, 0, wire::ExecutorMessage::Goodbye,
                           wire::CreateGoodbye(out_).Union());
    Reply(executor.identity, out_);
  }
}

std::vector<uint64_t> ExecutorLink::Live() const {
  std::vector<uint64_t> ids;
  ids.reserve(executors_.size());
  for (const auto& [id, executor] : executors_) ids.push_back(id);
  std::sort(ids.begin(), ids.end());
  return ids;
}

std::vector<uint64_t> ExecutorLink::LiveInEpoch(uint64_t epoch) const {
  std::vector<uint64_t> ids;
  ids.reserve(executors_.size());
  for (const auto& [id, executor] : executors_) {
    if (executor.epoch == epoch) ids.push_back(id);
  }
  std::sort(ids.begin(), ids.end());
  return ids;
}

}  // namespace kvcm::router
