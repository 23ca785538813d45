#include "tests/services/executor/step_driver.h"

#include <algorithm>
#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/base/status_macros.h"
#include "common/transport/zmq_util.h"
#include "common/wire/envelope.h"

namespace kvcm::testing {

constexpr uint64_t kExecutorId = 1;

StepDriver::StepDriver(const Options& options) : options_(options), context_(1) {}

StepDriver::~StepDriver() {
  router_.close();
  context_.close();
}

absl::StatusOr<std::unique_ptr<StepDriver>> StepDriver::Start(const Options& options) {
  std::unique_ptr<StepDriver> driver(new StepDriver(options));
  try {
    driver->router_ = zmq::socket_t(driver->context_, zmq::socket_type::router);
    driver->router_.set(zmq::sockopt::linger, 0);
    driver->router_.set(zmq::sockopt::router_mandatory, 1);
    driver->router_.bind(options.router_endpoint);
  } catch (const zmq::error_t& error) {
    return absl::UnavailableError(
        absl::StrCat("cannot bind ", options.router_endpoint, ": ", error.what()));
  }
  if (!options.cache_manager_endpoint.empty()) {
    CacheManagerClient::Options client;
    client.endpoint = options.cache_manager_endpoint;
    client.role = wire::Role::Router;
    client.name = "step-driver";
    KVCM_ASSIGN_OR_RETURN(driver->cache_manager_, CacheManagerClient::Connect(client));
  }
  return driver;
}

int32_t StepDriver::block_size() const {
  return cache_manager_ == nullptr ? 0 : cache_manager_->session().block_size;
}

absl::Status StepDriver::Send(const std::string& identity, std::span<const uint8_t> bytes) {
  try {
    router_.send(zmq::const_buffer(identity.data(), identity.size()), zmq::send_flags::sndmore);
    router_.send(zmq::const_buffer(bytes.data(), bytes.size()), zmq::send_flags::none);
  } catch (const zmq::error_t& error) {
    return absl::UnavailableError(absl::StrCat("sending to the executor: ", error.what()));
  }
  return absl::OkStatus();
}

absl::StatusOr<StepDriver::Inbound> StepDriver::ReceiveOne(absl::Time deadline, bool* timed_out) {
  *timed_out = false;
  Inbound inbound;
  zmq::pollitem_t item{router_.handle(), 0, ZMQ_POLLIN, 0};
  const int64_t wait_ms = std::max<int64_t>(0, absl::ToInt64Milliseconds(deadline - absl::Now()));
  zmq::poll(&item, 1, std::chrono::milliseconds(wait_ms));
  if ((item.revents & ZMQ_POLLIN) == 0) {
    *timed_out = true;
    return inbound;
  }
  zmq::message_t identity;
  if (!router_.recv(identity, zmq::recv_flags::dontwait)) {
    *timed_out = absl::Now() >= deadline;
    return inbound;
  }
  if (!identity.more()) return absl::InternalError("a message without a body frame");
  (void)router_.recv(inbound.frame, zmq::recv_flags::none);
  AlignFrame(inbound.frame);
  const std::string from(static_cast<const char*>(identity.data()), identity.size());
  const VerifiedExecutorEnvelope verified = VerifyExecutorEnvelope(FrameBytes(inbound.frame));
  if (verified.envelope == nullptr) {
    return absl::InternalError(absl::StrCat("the executor sent a bad message: ", verified.reason));
  }
  const wire::ExecutorEnvelope& envelope = *verified.envelope;
  flatbuffers::FlatBufferBuilder reply;
  switch (envelope.payload_type()) {
    case wire::ExecutorMessage::ExecutorHello: {
      KVCM_ASSIGN_OR_RETURN(last_hello_, DecodeExecutorHello(*envelope.payload_as_ExecutorHello()));
      hello_epoch_ = envelope.epoch();
      executor_identity_ = from;
      ++hellos_;
      auto answer =
          wire::CreateExecutorHelloReply(reply, kExecutorId, options_.heartbeat_interval_ms);
      FinishExecutorEnvelope(reply, envelope.request_id(), kExecutorId, epoch(),
                             wire::ExecutorMessage::ExecutorHelloReply, answer.Union());
      KVCM_RETURN_IF_ERROR(Send(from, BufferSpan(reply)));
      return inbound;  // envelope stays null: handled
    }
    case wire::ExecutorMessage::Heartbeat:
      FinishExecutorEnvelope(reply, envelope.request_id(), kExecutorId, epoch(),
                             wire::ExecutorMessage::HeartbeatReply,
                             wire::CreateHeartbeatReply(reply).Union());
      KVCM_RETURN_IF_ERROR(Send(from, BufferSpan(reply)));
      return inbound;
    case wire::ExecutorMessage::Goodbye:
      goodbye_received_ = true;
      FinishExecutorEnvelope(reply, envelope.request_id(), kExecutorId, epoch(),
                             wire::ExecutorMessage::GoodbyeReply,
                             wire::CreateGoodbyeReply(reply, 0).Union());
      KVCM_RETURN_IF_ERROR(Send(from, BufferSpan(reply)));
      return inbound;
    default:
      inbound.envelope = verified.envelope;
      return inbound;
  }
}

absl::StatusOr<ExecutorHello> StepDriver::AwaitHello(absl::Time deadline) {
  const int before = hellos_;
  while (hellos_ == before) {
    bool timed_out = false;
    KVCM_ASSIGN_OR_RETURN(Inbound inbound, ReceiveOne(deadline, &timed_out));
    if (timed_out) return absl::DeadlineExceededError("no ExecutorHello before the deadline");
    if (inbound.envelope != nullptr) {
      return absl::InternalError(
          absl::StrCat("expected ExecutorHello, got ",
                       std::string(ExecutorMessageName(inbound.envelope->payload_type()))));
    }
  }
  return last_hello_;
}

void StepDriver::ServeUntil(absl::Time deadline, bool stop_at_goodbye) {
  while (absl::Now() < deadline && !(stop_at_goodbye && goodbye_received_)) {
    bool timed_out = false;
    absl::StatusOr<Inbound> inbound = ReceiveOne(deadline, &timed_out);
    if (!inbound.ok() || timed_out) return;
  }
}

absl::Status StepDriver::SendRaw(std::span<const uint8_t> bytes) {
  if (executor_identity_.empty()) {
    return absl::FailedPreconditionError("no executor has said Hello yet");
  }
  return Send(executor_identity_, bytes);
}

absl::StatusOr<StepDriver::Inbound> StepDriver::AwaitReply(uint64_t request_id,
                                                           absl::Time deadline) {
  while (true) {
    bool timed_out = false;
    KVCM_ASSIGN_OR_RETURN(Inbound inbound, ReceiveOne(deadline, &timed_out));
    if (timed_out) {
      return absl::DeadlineExceededError(
          absl::StrCat("no reply to request ", request_id, " before the deadline"));
    }
    if (inbound.envelope != nullptr && inbound.envelope->request_id() == request_id) {
      return inbound;
    }
  }
}

absl::StatusOr<uint64_t> StepDriver::SendStep(const StepBatch& request) {
  StepBatch step = request;
  // As a router does: the session that granted the block tables (a made-up one without a
  // cache manager).
  if (step.router_session == 0) {
    step.router_session = cache_manager_ != nullptr ? cache_manager_->session_id() : 1;
  }
  const uint64_t request_id = next_request_id_++;
  flatbuffers::FlatBufferBuilder builder(1024);
  EncodeStepBatch(builder, request_id, kExecutorId, step);
  KVCM_RETURN_IF_ERROR(SendRaw(BufferSpan(builder)));
  sent_steps_.push_back(std::move(step));
  return request_id;
}

absl::StatusOr<StepResult> StepDriver::AwaitStep(uint64_t request_id, absl::Time deadline) {
  KVCM_ASSIGN_OR_RETURN(Inbound inbound, AwaitReply(request_id, deadline));
  const wire::ExecutorEnvelope& envelope = *inbound.envelope;
  if (const wire::ErrorReply* error = envelope.payload_as_ErrorReply()) {
    return FromWire(error->code(), error->reason() == nullptr ? "" : error->reason()->str());
  }
  const wire::StepResult* result = envelope.payload_as_StepResult();
  if (result == nullptr) {
    return absl::InternalError(absl::StrCat(
        "expected StepResult, got ", std::string(ExecutorMessageName(envelope.payload_type()))));
  }
  return DecodeStepResult(*result);
}

absl::StatusOr<StepResult> StepDriver::RunStep(const StepBatch& step) {
  KVCM_ASSIGN_OR_RETURN(const uint64_t request_id, SendStep(step));
  return AwaitStep(request_id, absl::Now() + options_.step_timeout);
}

// ---- Sequences --------------------------------------------------------------------------------

absl::StatusOr<StepDriver::Sequence> StepDriver::Allocate(std::vector<int32_t> tokens) {
  if (cache_manager_ == nullptr) return absl::FailedPreconditionError("no cache manager");
  Sequence seq;
  seq.id = next_seq_++;
  seq.prompt_len = static_cast<int32_t>(tokens.size());
  seq.tokens = std::move(tokens);
  std::vector<BlockHash> hashes;
  const SessionInfo session = cache_manager_->session();
  HashFullBlocks(session.hash_algorithm, RootHash(session.hash_algorithm, ""), seq.tokens,
                 session.block_size, &hashes);
  BlockOps batch;
  batch.Allocate(seq.id, seq.prompt_len, hashes);
  KVCM_ASSIGN_OR_RETURN(std::vector<OpOutcome> outcomes, cache_manager_->Step(batch));
  if (!outcomes[0].status.ok()) return outcomes[0].status;
  seq.blocks = outcomes[0].blocks;
  seq.committed = outcomes[0].num_cached_tokens;
  // The cache manager knows the hashes given at Allocate; Commit continues after them.
  seq.hashes = std::move(hashes);
  return seq;
}

SeqWork StepDriver::WorkFor(const Sequence& seq, bool sample) const {
  SeqWork work;
  work.seq = seq.id;
  const int32_t len = static_cast<int32_t>(seq.tokens.size());
  const int32_t first = std::min(seq.committed, len - 1);
  work.tokens.assign(seq.tokens.begin() + first, seq.tokens.end());
  work.context_len = len;
  work.block_table = seq.blocks;
  work.sampling = options_.sampling;
  work.sample = sample;
  work.sample_index = static_cast<int64_t>(seq.generated.size());
  return work;
}

void StepDriver::AddCommit(Sequence& seq, int32_t committed, BlockOps* batch) const {
  const SessionInfo session = cache_manager_->session();
  std::vector<BlockHash> all;
  HashFullBlocks(session.hash_algorithm, RootHash(session.hash_algorithm, ""),
                 std::span<const int32_t>(seq.tokens.data(), static_cast<size_t>(committed)),
                 session.block_size, &all);
  std::vector<BlockHash> fresh;
  if (all.size() > seq.hashes.size()) {
    fresh.assign(all.begin() + static_cast<std::ptrdiff_t>(seq.hashes.size()), all.end());
  }
  batch->Commit(seq.id, committed, fresh);
  seq.hashes = std::move(all);
  seq.committed = committed;
}

absl::Status StepDriver::Free(std::span<const Sequence> seqs) {
  BlockOps batch;
  for (const Sequence& seq : seqs) batch.Free(seq.id);
  KVCM_ASSIGN_OR_RETURN(std::vector<OpOutcome> outcomes, cache_manager_->Step(batch));
  for (const OpOutcome& outcome : outcomes) KVCM_RETURN_IF_ERROR(outcome.status);
  return absl::OkStatus();
}

absl::StatusOr<std::vector<StepDriver::Sequence>> StepDriver::Generate(
    const std::vector<std::vector<int32_t>>& prompts, int32_t new_tokens, bool free_at_end) {
  std::vector<Sequence> seqs;
  for (const std::vector<int32_t>& prompt : prompts) {
    KVCM_ASSIGN_OR_RETURN(Sequence seq, Allocate(prompt));
    seqs.push_back(std::move(seq));
  }
  for (int32_t n = 0; n < new_tokens; ++n) {
    StepBatch step;
    step.step_id = next_step_++;
    step.epoch = epoch();
    for (const Sequence& seq : seqs) step.seqs.push_back(WorkFor(seq, /*sample=*/true));
    KVCM_ASSIGN_OR_RETURN(StepResult report, RunStep(step));
    if (report.results.size() != seqs.size()) {
      return absl::InternalError(
          absl::StrCat(report.results.size(), " results for ", seqs.size(), " sequences"));
    }
    // The KV of every token so far is written: commit it, and (unless done) make room for
    // the token just sampled, in one cache-manager round trip.
    BlockOps batch;
    for (size_t i = 0; i < seqs.size(); ++i) {
      Sequence& seq = seqs[i];
      const SeqResult& outcome = report.results[i];
      if (!outcome.status.ok()) return outcome.status;
      if (outcome.seq != seq.id) return absl::InternalError("results out of order");
      AddCommit(seq, static_cast<int32_t>(seq.tokens.size()), &batch);
      seq.generated.push_back(outcome.token);
      seq.tokens.push_back(outcome.token);
      if (n + 1 < new_tokens) batch.Append(seq.id, 1);
    }
    KVCM_ASSIGN_OR_RETURN(std::vector<OpOutcome> outcomes, cache_manager_->Step(batch));
    size_t op = 0;
    for (Sequence& seq : seqs) {
      if (!outcomes[op].status.ok()) return outcomes[op].status;  // the commit
      ++op;
      if (n + 1 < new_tokens) {
        const OpOutcome& append = outcomes[op++];
        if (!append.status.ok()) return append.status;
        if (!append.copies.empty()) {
          return absl::UnimplementedError("copy-on-write orders in Generate (no forks here)");
        }
        seq.blocks.insert(seq.blocks.end(), append.blocks.begin(), append.blocks.end());
      }
    }
  }
  if (free_at_end) KVCM_RETURN_IF_ERROR(Free(seqs));
  return seqs;
}

}  // namespace kvcm::testing
