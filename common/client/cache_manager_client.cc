#include "common/client/cache_manager_client.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "common/base/check.h"
#include "common/base/monotonic_clock.h"
#include "common/base/status_macros.h"
#include "common/base/unique_fd.h"
#include "common/memory/fd_channel.h"
#include "common/transport/zmq_util.h"
#include "common/wire/block_map_codec.h"
#include "common/wire/convert.h"
#include "common/wire/envelope.h"

namespace kvcm {
namespace {

// Replies may be larger than requests (an EventSnapshot of a big prefix index); this caps
// what the client verifies, far above any real reply and below FlatBuffers' 2 GiB.
constexpr size_t kMaxReplyBytes = size_t{1} << 30;
// Hello's name limit (schemas/kvcm_protocol.fbs).
constexpr size_t kMaxNameBytes = 128;

std::string MessageName(wire::Message type) { return wire::EnumNameMessage(type); }

bool IsSessionGone(wire::ErrorCode code) {
  return code == wire::ErrorCode::NotRegistered || code == wire::ErrorCode::StaleSession ||
         code == wire::ErrorCode::StaleEpoch;
}

std::string ReasonOf(const wire::ErrorReply* error) {
  return error->reason() == nullptr ? std::string() : error->reason()->str();
}

absl::Status ProtocolError(absl::string_view what) {
  return absl::InternalError(absl::StrCat("cache manager protocol error: ", what));
}

// The payload of a reply whose type Exchange() has checked. VerifyEnvelope guarantees a
// payload, so the CHECK states what is already true.
template <typename T>
const T& PayloadAs(const wire::Envelope* envelope) {
  const void* payload = envelope->payload();
  KVCM_CHECK(payload != nullptr);
  return *static_cast<const T*>(payload);
}

// Configures a socket for a client: no lingering on close, so neither a destructor nor
// process exit blocks on unsent requests to a cache manager that is gone; and a send that
// finds the queue full (a cache manager that stopped reading) waits at most `send_timeout`.
void ConfigureDealer(zmq::socket_t& socket, absl::Duration send_timeout) {
  socket.set(zmq::sockopt::linger, 0);
  // Replies are bounded by what the client accepts at all (kMaxReplyBytes).
  LimitInboundMessages(socket, kMaxReplyBytes);
  socket.set(zmq::sockopt::sndtimeo,
             static_cast<int>(std::min<int64_t>(absl::ToInt64Milliseconds(send_timeout),
                                                std::numeric_limits<int>::max())));
}

}  // namespace

// ---- Decoding helpers -----------------------------------------------------------------------

absl::StatusOr<PoolView> CheckPoolDescriptor(const PoolDescriptorInfo& descriptor,
                                             int32_t expected_num_blocks) {
  auto bad = [](auto&&... parts) {
    return ProtocolError(absl::StrCat("pool descriptor: ", parts...));
  };
  PoolView pool;
  pool.spec = descriptor.spec;
  pool.num_blocks = descriptor.num_blocks;
  if (pool.num_blocks <= 0) return bad("num_blocks is ", pool.num_blocks);
  if (expected_num_blocks > 0 && pool.num_blocks != expected_num_blocks) {
    return bad("num_blocks is ", pool.num_blocks, " but Hello announced ", expected_num_blocks);
  }
  pool.backend = PoolBackendFromWire(descriptor.backend);
  if (descriptor.backend != wire::PoolBackend::Shm &&
      descriptor.backend != wire::PoolBackend::Cuda) {
    return bad("unknown backend ", static_cast<int>(descriptor.backend));
  }
  pool.epoch = descriptor.epoch;
  if (descriptor.sliding_window_tokens < 0) {
    return bad("sliding_window_tokens is ", descriptor.sliding_window_tokens);
  }
  pool.sliding_window_tokens = descriptor.sliding_window_tokens;
  // Groups: each within the page's slots, no layer twice (whether they are the model's
  // grouping is the executor's call).
  std::vector<bool> seen;
  for (size_t g = 0; g < descriptor.kv_groups.size(); ++g) {
    const KvCacheGroup& group = descriptor.kv_groups[g];
    if (group.window < 0 || group.layers.empty() ||
        group.layers.size() > static_cast<size_t>(pool.spec.num_layers)) {
      return bad("KV cache group ", g, " has window ", group.window, " and ", group.layers.size(),
                 " layers for pages of ", pool.spec.num_layers, " slots");
    }
    for (int32_t layer : group.layers) {
      if (layer < 0 || layer > (1 << 16)) return bad("KV cache group ", g, " has layer ", layer);
      if (seen.size() <= static_cast<size_t>(layer)) seen.resize(static_cast<size_t>(layer) + 1);
      if (seen[static_cast<size_t>(layer)])
        return bad("layer ", layer, " is in two KV cache groups");
      seen[static_cast<size_t>(layer)] = true;
    }
  }
  pool.kv_groups = descriptor.kv_groups;

  absl::StatusOr<PoolLayout> expected = PoolLayout::For(pool.spec, pool.num_blocks);
  if (!expected.ok()) return bad(expected.status().message());
  const PoolStrides& layout = descriptor.layout;
  const struct {
    const char* name;
    uint64_t got;
    int64_t want;
  } fields[] = {
      {"elem_bytes", layout.elem_bytes, expected->elem_bytes},
      {"head_stride", layout.head_stride, expected->head_stride},
      {"token_stride", layout.token_stride, expected->token_stride},
      {"block_stride", layout.block_stride, expected->block_stride},
      {"kv_stride", layout.kv_stride, expected->kv_stride},
      {"layer_stride", layout.layer_stride, expected->layer_stride},
      {"total_bytes", layout.total_bytes, expected->total_bytes},
  };
  for (const auto& field : fields) {
    if (field.got != static_cast<uint64_t>(field.want)) {
      return bad("layout.", field.name, " is ", field.got, " but ", pool.spec.ToString(), " with ",
                 pool.num_blocks, " blocks needs ", field.want,
                 " ([layer][K|V][block][token][kv head][dim])");
    }
  }
  pool.layout = *expected;
  return pool;
}

// ---- CacheManagerClient ---------------------------------------------------------------------

absl::StatusOr<std::string> ReadSecretFile(const std::string& path) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW));
  if (!fd.valid()) {
    return absl::NotFoundError(
        absl::StrCat("cannot open the secret file ", path, ": ", std::strerror(errno)));
  }
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0 || !S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat(path, " is not a regular file"));
  }
  if ((st.st_mode & 077) != 0) {
    return absl::PermissionDeniedError(absl::StrCat(
        "the secret file ", path, " can be read by other users (mode ",
        absl::StrFormat("%04o", st.st_mode & 07777), "): refusing it; it must be 0600"));
  }
  char buffer[256];
  const ssize_t n = ::read(fd.get(), buffer, sizeof(buffer));
  if (n < 0) return absl::InternalError(absl::StrCat("reading ", path, ": ", std::strerror(errno)));
  return std::string(absl::StripAsciiWhitespace(absl::string_view(buffer, static_cast<size_t>(n))));
}

CacheManagerClient::CacheManagerClient(Options options)
    : options_(std::move(options)), context_(1), socket_(context_, zmq::socket_type::dealer) {
  ConfigureDealer(socket_, options_.call_timeout);
}

absl::StatusOr<std::unique_ptr<CacheManagerClient>> CacheManagerClient::Connect(Options options) {
  if (options.endpoint.empty()) {
    return absl::InvalidArgumentError("cache manager endpoint is empty");
  }
  if (options.name.size() > kMaxNameBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("client name is ", options.name.size(), " bytes; at most ", kMaxNameBytes));
  }
  if (options.call_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("call_timeout must be positive");
  }
  KVCM_RETURN_IF_ERROR(CheckIpcDirectory(options.endpoint));
  KVCM_RETURN_IF_ERROR(ProbeIpcListener(options.endpoint));
  if (options.secret.empty() && !options.secret_file.empty()) {
    KVCM_ASSIGN_OR_RETURN(options.secret, ReadSecretFile(options.secret_file));
  }
  std::unique_ptr<CacheManagerClient> client(new CacheManagerClient(std::move(options)));
  try {
    client->socket_.connect(client->options_.endpoint);
  } catch (const zmq::error_t& error) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot connect to ", client->options_.endpoint, ": ", error.what()));
  }
  KVCM_RETURN_IF_ERROR(client->Register());
  if (client->options_.heartbeats) KVCM_RETURN_IF_ERROR(client->StartHeartbeats());
  return client;
}

CacheManagerClient::~CacheManagerClient() { StopHeartbeats(); }

uint64_t CacheManagerClient::session_id() const {
  MutexLock lock(&session_mu_);
  return session_.session_id;
}

uint64_t CacheManagerClient::epoch() const {
  MutexLock lock(&session_mu_);
  return session_.epoch;
}

SessionInfo CacheManagerClient::session() const {
  MutexLock lock(&session_mu_);
  return session_;
}

std::pair<SessionInfo, uint64_t> CacheManagerClient::SessionAndGeneration() const {
  MutexLock lock(&session_mu_);
  return {session_, generation_};
}

bool CacheManagerClient::session_lost() const {
  const uint64_t lost = lost_generation_.load();
  if (lost == 0) return false;
  MutexLock lock(&session_mu_);
  return lost == generation_ && session_.session_id != 0;
}

absl::StatusOr<CacheManagerClient::Reply> CacheManagerClient::Exchange(
    flatbuffers::FlatBufferBuilder& builder, uint64_t request_id, wire::Message request_type,
    wire::Message reply_type) {
  const absl::Time deadline = MonotonicNow() + options_.call_timeout;
  const auto no_answer = [&] {
    return absl::DeadlineExceededError(absl::StrCat(
        "cache manager at ", options_.endpoint, " did not answer ", MessageName(request_type),
        " within ", absl::FormatDuration(options_.call_timeout)));
  };
  if (absl::Status sent = SendFrame(socket_, BufferSpan(builder)); !sent.ok()) {
    // A full send queue: the cache manager has not read earlier requests for call_timeout.
    if (absl::IsResourceExhausted(sent)) return no_answer();
    return sent;
  }
  while (true) {
    KVCM_ASSIGN_OR_RETURN(std::vector<zmq::message_t> frames,
                          ReceiveMessageUntil(socket_, deadline));
    if (frames.empty()) return no_answer();
    if (frames.size() != 1) {
      return ProtocolError(absl::StrCat("reply to ", MessageName(request_type), " has ",
                                        frames.size(), " frames; expected 1"));
    }
    Reply reply;
    reply.frame = std::move(frames[0]);
    VerifiedEnvelope verified = VerifyEnvelope(FrameBytes(reply.frame), kMaxReplyBytes);
    if (verified.envelope == nullptr) {
      return ProtocolError(
          absl::StrCat("reply to ", MessageName(request_type), " refused: ", verified.reason));
    }
    // A reply to an earlier call that timed out: its caller has given up.
    if (verified.envelope->request_id() != request_id) continue;
    reply.envelope = verified.envelope;
    const wire::Message type = reply.envelope->payload_type();
    if (type != reply_type && type != wire::Message::ErrorReply) {
      return ProtocolError(absl::StrCat("reply to ", MessageName(request_type), " is a ",
                                        MessageName(type), "; expected ", MessageName(reply_type)));
    }
    return reply;
  }
}

absl::Status CacheManagerClient::Register() {
  NoteProgress();
  flatbuffers::FlatBufferBuilder builder(256);
  const auto hello = EncodeHello(builder, {.role = options_.role,
                                           .pid = static_cast<int32_t>(getpid()),
                                           .name = options_.name,
                                           .secret = options_.secret});
  const uint64_t request_id = next_request_id_++;
  FinishEnvelope(builder, request_id, /*session_id=*/0, /*epoch=*/0, wire::Message::Hello,
                 hello.Union());
  KVCM_ASSIGN_OR_RETURN(
      Reply reply, Exchange(builder, request_id, wire::Message::Hello, wire::Message::HelloReply));
  if (const wire::ErrorReply* error = reply.envelope->payload_as_ErrorReply()) {
    const absl::Status status = FromWire(error->code(), ReasonOf(error));
    return absl::Status(status.code(),
                        absl::StrCat("cache manager at ", options_.endpoint,
                                     " refused Hello: ", std::string(status.message())));
  }
  absl::StatusOr<SessionInfo> decoded =
      DecodeHelloReply(PayloadAs<wire::HelloReply>(reply.envelope));
  if (!decoded.ok()) return ProtocolError(decoded.status().message());
  const SessionInfo& info = *decoded;
  {
    MutexLock lock(&session_mu_);
    session_ = info;
    ++generation_;
  }
  const bool restart = said_goodbye_ && options_.heartbeats && !heartbeat_thread_.joinable();
  said_goodbye_ = false;
  if (restart) return StartHeartbeats();
  return absl::OkStatus();
}

absl::Status CacheManagerClient::SessionGone(std::string_view why) {
  const auto [current, generation] = SessionAndGeneration();
  lost_generation_.store(generation);
  return absl::AbortedError(
      absl::StrCat("cache manager ended session ", current.session_id, " of epoch ", current.epoch,
                   " (", std::string(why),
                   "); its sequences are gone. Quiesce what writes for it, then call "
                   "Reregister()"));
}

absl::Status CacheManagerClient::CheckSession() {
  if (said_goodbye_) {
    return absl::FailedPreconditionError(
        "no session: this client said Goodbye; call EnsureSession() to register again");
  }
  if (session_lost()) {
    std::string reason;
    {
      MutexLock lock(&session_mu_);
      reason = lost_reason_;
    }
    return SessionGone(
        absl::StrCat("its heartbeat was refused", reason.empty() ? "" : ": ", reason));
  }
  return absl::OkStatus();
}

absl::Status CacheManagerClient::EnsureSession() {
  if (said_goodbye_) return Register();
  return CheckSession();
}

absl::Status CacheManagerClient::Reregister() {
  const SessionInfo old_session = session();
  KVCM_RETURN_IF_ERROR(Register());
  if (session().epoch != old_session.epoch) {
    MutexLock lock(&fence_mu_);
    fences_.clear();
    acked_fences_.clear();
  }
  return absl::OkStatus();
}

void CacheManagerClient::NoteProgress() {
  last_progress_ns_.store(absl::ToUnixNanos(MonotonicNow()), std::memory_order_relaxed);
}

absl::StatusOr<CacheManagerClient::Reply> CacheManagerClient::Call(
    flatbuffers::FlatBufferBuilder& builder, wire::Message type, flatbuffers::Offset<void> payload,
    wire::Message reply_type) {
  NoteProgress();
  KVCM_RETURN_IF_ERROR(CheckSession());
  const SessionInfo current = session();
  const uint64_t request_id = next_request_id_++;
  FinishEnvelope(builder, request_id, current.session_id, current.epoch, type, payload);
  return MapErrorReply(Exchange(builder, request_id, type, reply_type));
}

absl::StatusOr<CacheManagerClient::Reply> CacheManagerClient::MapErrorReply(
    absl::StatusOr<Reply> reply) {
  if (!reply.ok()) return reply;
  if (const wire::ErrorReply* error = reply->envelope->payload_as_ErrorReply()) {
    const std::string reason = ReasonOf(error);
    if (IsSessionGone(error->code())) {
      return SessionGone(absl::StrCat(std::string(WireCodeName(error->code())),
                                      reason.empty() ? "" : ": ", reason));
    }
    return FromWire(error->code(), reason);
  }
  return reply;
}

absl::StatusOr<std::vector<OpOutcome>> CacheManagerClient::Step(std::span<const BlockOp> ops) {
  if (ops.empty()) return std::vector<OpOutcome>{};
  const int32_t max_ops = session().max_ops_per_step;
  if (max_ops > 0 && ops.size() > static_cast<size_t>(max_ops)) {
    return absl::InvalidArgumentError(absl::StrCat("step of ", ops.size(),
                                                   " ops exceeds the cache manager's limit of ",
                                                   max_ops, " ops per step"));
  }
  KVCM_RETURN_IF_ERROR(CheckSession());
  flatbuffers::FlatBufferBuilder builder(256 + ops.size() * 64);
  const SessionInfo current = session();
  const uint64_t request_id = next_request_id_;
  KVCM_RETURN_IF_ERROR(EncodeStep(builder, request_id, current.session_id, current.epoch, ops));
  ++next_request_id_;
  NoteProgress();
  // Kept until answered, for RetryLastStep.
  unanswered_step_.assign(builder.GetBufferPointer(),
                          builder.GetBufferPointer() + builder.GetSize());
  unanswered_step_id_ = request_id;
  unanswered_step_ops_ = ops.size();
  absl::StatusOr<Reply> reply =
      MapErrorReply(Exchange(builder, request_id, wire::Message::Step, wire::Message::StepReply));
  if (!reply.ok()) {
    if (!absl::IsDeadlineExceeded(reply.status())) unanswered_step_.clear();
    return reply.status();
  }
  unanswered_step_.clear();
  return OutcomesOf(*reply, ops.size());
}

absl::StatusOr<std::vector<OpOutcome>> CacheManagerClient::RetryLastStep() {
  if (unanswered_step_.empty()) {
    return absl::FailedPreconditionError("no unanswered Step to retry");
  }
  KVCM_RETURN_IF_ERROR(CheckSession());
  NoteProgress();
  flatbuffers::FlatBufferBuilder builder(unanswered_step_.size() + 64);
  builder.PushBytes(unanswered_step_.data(), unanswered_step_.size());
  absl::StatusOr<Reply> reply = MapErrorReply(
      Exchange(builder, unanswered_step_id_, wire::Message::Step, wire::Message::StepReply));
  if (!reply.ok()) {
    if (!absl::IsDeadlineExceeded(reply.status())) unanswered_step_.clear();
    return reply.status();
  }
  unanswered_step_.clear();
  return OutcomesOf(*reply, unanswered_step_ops_);
}

absl::StatusOr<SessionSnapshot> CacheManagerClient::DescribeSession() {
  flatbuffers::FlatBufferBuilder builder(64);
  const auto describe = wire::CreateDescribeSession(builder);
  KVCM_ASSIGN_OR_RETURN(Reply reply, Call(builder, wire::Message::DescribeSession, describe.Union(),
                                          wire::Message::DescribeSessionReply));
  return DecodeDescribeSessionReply(PayloadAs<wire::DescribeSessionReply>(reply.envelope));
}

absl::StatusOr<int32_t> CacheManagerClient::EndSession(uint64_t session_id) {
  flatbuffers::FlatBufferBuilder builder(64);
  const auto end = wire::CreateEndSession(builder, session_id);
  KVCM_ASSIGN_OR_RETURN(Reply reply, Call(builder, wire::Message::EndSession, end.Union(),
                                          wire::Message::EndSessionReply));
  return PayloadAs<wire::EndSessionReply>(reply.envelope).blocks_released();
}

absl::StatusOr<std::vector<OpOutcome>> CacheManagerClient::OutcomesOf(const Reply& reply,
                                                                      size_t expected) {
  const wire::StepReply& step_reply = PayloadAs<wire::StepReply>(reply.envelope);
  last_available_blocks_ = step_reply.available_blocks();
  return DecodeStepReply(step_reply, expected);
}

absl::StatusOr<int32_t> CacheManagerClient::Lookup(std::span<const BlockHash> block_hashes,
                                                   int32_t num_tokens) {
  flatbuffers::FlatBufferBuilder builder(128 + block_hashes.size_bytes());
  const auto lookup = wire::CreateLookup(builder, ToWire(builder, block_hashes), num_tokens);
  KVCM_ASSIGN_OR_RETURN(Reply reply, Call(builder, wire::Message::Lookup, lookup.Union(),
                                          wire::Message::LookupReply));
  const int32_t cached = PayloadAs<wire::LookupReply>(reply.envelope).num_cached_blocks();
  if (cached < 0 || static_cast<size_t>(cached) > block_hashes.size()) {
    return ProtocolError(absl::StrCat("LookupReply says ", cached, " of ", block_hashes.size(),
                                      " blocks are cached"));
  }
  return cached;
}

absl::Status CacheManagerClient::Pin(std::string_view name,
                                     std::span<const BlockHash> block_hashes) {
  flatbuffers::FlatBufferBuilder builder(128 + block_hashes.size_bytes());
  const auto text = builder.CreateString(name.data(), name.size());
  const auto pin = wire::CreatePin(builder, text, ToWire(builder, block_hashes));
  return Call(builder, wire::Message::Pin, pin.Union(), wire::Message::PinReply).status();
}

absl::Status CacheManagerClient::Unpin(std::string_view name) {
  flatbuffers::FlatBufferBuilder builder(128);
  const auto text = builder.CreateString(name.data(), name.size());
  const auto unpin = wire::CreateUnpin(builder, text);
  return Call(builder, wire::Message::Unpin, unpin.Union(), wire::Message::UnpinReply).status();
}

absl::StatusOr<StatsSnapshot> CacheManagerClient::Stats() {
  flatbuffers::FlatBufferBuilder builder(128);
  const auto stats = wire::CreateStats(builder);
  KVCM_ASSIGN_OR_RETURN(
      Reply reply, Call(builder, wire::Message::Stats, stats.Union(), wire::Message::StatsReply));
  absl::StatusOr<StatsSnapshot> stats_reply =
      DecodeStatsReply(PayloadAs<wire::StatsReply>(reply.envelope));
  if (!stats_reply.ok()) return ProtocolError(stats_reply.status().message());
  return stats_reply;
}

absl::StatusOr<BlockMap> CacheManagerClient::GetBlockMap(uint32_t max_cells) {
  flatbuffers::FlatBufferBuilder builder(128);
  const auto request = wire::CreateBlockMap(builder, max_cells);
  KVCM_ASSIGN_OR_RETURN(Reply reply, Call(builder, wire::Message::BlockMap, request.Union(),
                                          wire::Message::BlockMapReply));
  absl::StatusOr<BlockMap> map =
      DecodeBlockMapReply(PayloadAs<wire::BlockMapReply>(reply.envelope));
  if (!map.ok()) return ProtocolError(map.status().message());
  return map;
}

absl::StatusOr<EventSnapshot> CacheManagerClient::Snapshot() {
  flatbuffers::FlatBufferBuilder builder(128);
  const auto request = wire::CreateEventSnapshot(builder);
  KVCM_ASSIGN_OR_RETURN(Reply reply, Call(builder, wire::Message::EventSnapshot, request.Union(),
                                          wire::Message::EventSnapshotReply));
  return DecodeEventSnapshotReply(PayloadAs<wire::EventSnapshotReply>(reply.envelope));
}

absl::StatusOr<PoolDescriptorInfo> CacheManagerClient::DescribePool() {
  KVCM_ASSIGN_OR_RETURN(CheckedPool checked, DescribeCheckedPool());
  return std::move(checked.descriptor);
}

absl::StatusOr<CacheManagerClient::CheckedPool> CacheManagerClient::DescribeCheckedPool() {
  flatbuffers::FlatBufferBuilder builder(128);
  const auto attach = wire::CreateAttach(builder);
  KVCM_ASSIGN_OR_RETURN(Reply reply, Call(builder, wire::Message::Attach, attach.Union(),
                                          wire::Message::AttachReply));
  absl::StatusOr<PoolDescriptorInfo> descriptor =
      DecodeAttachReply(PayloadAs<wire::AttachReply>(reply.envelope));
  if (!descriptor.ok()) return ProtocolError(descriptor.status().message());
  const SessionInfo current = session();
  KVCM_ASSIGN_OR_RETURN(PoolView view, CheckPoolDescriptor(*descriptor, current.num_blocks));
  if (descriptor->epoch != current.epoch) {
    return ProtocolError(absl::StrCat("pool descriptor of epoch ", descriptor->epoch,
                                      " in session of epoch ", current.epoch));
  }
  return CheckedPool{*std::move(descriptor), view};
}

absl::StatusOr<AttachedPool> CacheManagerClient::Attach() {
  KVCM_ASSIGN_OR_RETURN(CheckedPool checked, DescribeCheckedPool());
  const PoolDescriptorInfo* descriptor = &checked.descriptor;  // as the lines below read it
  AttachedPool attached;
  attached.view = checked.view;
  PoolView& pool = attached.view;
  const uint64_t total_bytes = static_cast<uint64_t>(pool.layout.total_bytes);
  if (pool.backend == PoolBackend::kShm) {
    if (descriptor->fd_channel_path.empty()) {
      return ProtocolError("shm pool descriptor without fd_channel_path");
    }
    const std::string& path = descriptor->fd_channel_path;
    KVCM_ASSIGN_OR_RETURN(ReceivedFd received, ReceiveFdFromChannel(path, options_.call_timeout));
    // The header is the epoch, 8 bytes little-endian: proof that the descriptor came from
    // the cache manager we registered with, not a successor that took over the path.
    uint64_t header_epoch = 0;
    if (received.header.size() != sizeof(header_epoch)) {
      return ProtocolError(absl::StrCat("fd channel ", path, " sent a header of ",
                                        received.header.size(), " bytes; expected 8"));
    }
    for (size_t i = 0; i < sizeof(header_epoch); ++i) {
      header_epoch |= uint64_t{received.header[i]} << (8 * i);
    }
    if (header_epoch != pool.epoch) {
      return ProtocolError(absl::StrCat("fd channel ", path, " is of epoch ", header_epoch,
                                        " but the descriptor says ", pool.epoch));
    }
    KVCM_ASSIGN_OR_RETURN(attached.mapping, MapShmPool(std::move(received.fd), total_bytes));
  } else {
    CudaIpcHandle handle{};
    const std::vector<uint8_t>& bytes = descriptor->cuda_ipc_handle;
    if (bytes.size() != handle.size()) {
      return ProtocolError(absl::StrCat("cuda pool descriptor has an IPC handle of ", bytes.size(),
                                        " bytes; expected ", handle.size()));
    }
    std::memcpy(handle.data(), bytes.data(), handle.size());
    KVCM_ASSIGN_OR_RETURN(attached.mapping,
                          OpenCudaPool(descriptor->cuda_device, handle, total_bytes));
    pool.cuda_device = descriptor->cuda_device;
  }
  if (attached.mapping->size_bytes() != total_bytes) {
    return ProtocolError(absl::StrCat("mapped ", attached.mapping->size_bytes(),
                                      " bytes; the layout needs ", total_bytes));
  }
  pool.base = static_cast<uint8_t*>(attached.mapping->base());
  return attached;
}

absl::Status CacheManagerClient::Heartbeat() { return AcknowledgeFences({}); }

absl::Status CacheManagerClient::AcknowledgeFences(std::span<const uint64_t> fence_ids) {
  flatbuffers::FlatBufferBuilder builder(64 + 8 * fence_ids.size());
  const auto heartbeat = EncodeHeartbeat(builder, fence_ids);
  KVCM_ASSIGN_OR_RETURN(Reply reply, Call(builder, wire::Message::Heartbeat, heartbeat.Union(),
                                          wire::Message::HeartbeatReply));
  MutexLock lock(&fence_mu_);
  acked_fences_.insert(fence_ids.begin(), fence_ids.end());
  TakeFencesLocked(PayloadAs<wire::HeartbeatReply>(reply.envelope));
  return absl::OkStatus();
}

std::vector<FenceNotice> CacheManagerClient::PendingFences() const {
  MutexLock lock(&fence_mu_);
  return fences_;
}

void CacheManagerClient::TakeFencesLocked(const wire::HeartbeatReply& reply) {
  std::vector<FenceNotice> fences = DecodeHeartbeatReply(reply);
  // A reply to a heartbeat sent before an acknowledgement may still list its fence. (A
  // loop, not a lambda: the thread-safety analysis does not see a lambda run under the lock.)
  size_t kept = 0;
  for (size_t i = 0; i < fences.size(); ++i) {
    if (acked_fences_.contains(fences[i].id)) continue;
    if (kept != i) fences[kept] = std::move(fences[i]);
    ++kept;
  }
  fences.resize(kept);
  if (fences != fences_) {
    fences_ = std::move(fences);
    fence_generation_.fetch_add(1);
  }
}

absl::StatusOr<int32_t> CacheManagerClient::Goodbye() {
  // No heartbeat may reach the cache manager after the Goodbye (it would be refused as a
  // stale session and counted): stop the thread once its last heartbeat is answered. It
  // starts again when EnsureSession() registers anew.
  StopHeartbeats(/*finish_pending=*/true);
  flatbuffers::FlatBufferBuilder builder(64);
  const auto goodbye = wire::CreateGoodbye(builder);
  absl::StatusOr<Reply> reply =
      Call(builder, wire::Message::Goodbye, goodbye.Union(), wire::Message::GoodbyeReply);
  if (!reply.ok()) {
    // The session may live on (no answer): keep its lease.
    if (options_.heartbeats && !session_lost()) (void)StartHeartbeats();
    return reply.status();
  }
  said_goodbye_ = true;
  {
    // The heartbeat thread stops sending for session 0.
    MutexLock lock(&session_mu_);
    session_.session_id = 0;
  }
  return PayloadAs<wire::GoodbyeReply>(reply->envelope).blocks_released();
}

// ---- Heartbeat thread -----------------------------------------------------------------------

absl::Status CacheManagerClient::StartHeartbeats() {
  if (session().heartbeat_interval <= absl::ZeroDuration()) return absl::OkStatus();
  // A new name at each start: a closed socket's inproc name is released asynchronously.
  const std::string stop_endpoint =
      absl::StrCat("inproc://kvcm-client-heartbeat-", reinterpret_cast<uintptr_t>(this), "-",
                   ++heartbeat_starts_);
  try {
    stop_ = zmq::socket_t(context_, zmq::socket_type::pair);
    stop_.set(zmq::sockopt::linger, 0);
    stop_.bind(stop_endpoint);
    zmq::socket_t thread_end(context_, zmq::socket_type::pair);
    thread_end.set(zmq::sockopt::linger, 0);
    thread_end.connect(stop_endpoint);
    // The socket moves to the thread before it is used; thread creation orders memory.
    heartbeat_thread_ = std::thread(
        [this, stop = std::move(thread_end)]() mutable { HeartbeatLoop(std::move(stop)); });
  } catch (const zmq::error_t& error) {
    return absl::InternalError(absl::StrCat("heartbeat thread setup failed: ", error.what()));
  }
  return absl::OkStatus();
}

void CacheManagerClient::StopHeartbeats(bool finish_pending) {
  if (!heartbeat_thread_.joinable()) return;
  // Non-blocking: if the thread already ended (it only does on a ZeroMQ failure), its end
  // of the pair is gone and a blocking send would wait forever.
  try {
    const uint8_t stop_byte = finish_pending ? 1 : 0;
    (void)stop_.send(zmq::const_buffer(&stop_byte, 1), zmq::send_flags::dontwait);
  } catch (const zmq::error_t&) {
  }
  heartbeat_thread_.join();
}

void CacheManagerClient::HeartbeatLoop(zmq::socket_t stop) {
  zmq::socket_t dealer;
  try {
    dealer = zmq::socket_t(context_, zmq::socket_type::dealer);
    // A heartbeat that cannot be queued at once is skipped; the next one follows.
    ConfigureDealer(dealer, absl::ZeroDuration());
    dealer.connect(options_.endpoint);
  } catch (const zmq::error_t&) {
    // Connect() connected the caller's socket to the same endpoint, so this cannot fail
    // short of running out of file descriptors; the session then expires visibly (calls
    // return ABORTED) rather than the process dying.
    return;
  }
  uint64_t next_request_id = 1;
  uint64_t pending_request = 0;     // the heartbeat awaiting its reply (0: none)
  uint64_t pending_generation = 0;  // the registration it was sent for
  absl::Time next_send = MonotonicNow() + session().heartbeat_interval;
  flatbuffers::FlatBufferBuilder builder(64);
  while (true) {
    zmq_pollitem_t items[2] = {};
    items[0].socket = stop.handle();
    items[0].events = ZMQ_POLLIN;
    items[1].socket = dealer.handle();
    items[1].events = ZMQ_POLLIN;
    const absl::Duration wait = std::max(next_send - MonotonicNow(), absl::ZeroDuration());
    const long wait_ms =
        static_cast<long>(absl::ToInt64Milliseconds(absl::Ceil(wait, absl::Milliseconds(1))));
    if (zmq_poll(items, 2, wait_ms) < 0 && zmq_errno() != EINTR) return;
    if ((items[0].revents & ZMQ_POLLIN) != 0) {
      zmq::message_t stop_message;
      const bool finish = stop.recv(stop_message, zmq::recv_flags::dontwait) &&
                          stop_message.size() == 1 &&
                          *static_cast<const uint8_t*>(stop_message.data()) == 1;
      // Asked to finish: wait (at most a call timeout) for the reply of the heartbeat in
      // flight, so that it has been handled before the caller goes on.
      if (finish && pending_request != 0) {
        const absl::Time deadline = MonotonicNow() + options_.call_timeout;
        while (MonotonicNow() < deadline) {
          absl::StatusOr<std::vector<zmq::message_t>> frames =
              ReceiveMessageUntil(dealer, deadline);
          if (!frames.ok() || frames->empty()) break;
          if (frames->size() != 1) continue;
          const VerifiedEnvelope verified = VerifyEnvelope(FrameBytes((*frames)[0]));
          if (verified.envelope != nullptr && verified.envelope->request_id() == pending_request) {
            heartbeats_answered_.fetch_add(1);
            break;
          }
        }
      }
      return;
    }
    if ((items[1].revents & ZMQ_POLLIN) != 0) {
      while (true) {
        absl::StatusOr<std::vector<zmq::message_t>> frames = ReceiveMessage(dealer);
        if (!frames.ok() || frames->empty()) break;
        if (frames->size() != 1) continue;
        const VerifiedEnvelope verified = VerifyEnvelope(FrameBytes((*frames)[0]));
        if (verified.envelope == nullptr || pending_request == 0 ||
            verified.envelope->request_id() != pending_request) {
          continue;  // malformed or stale: the next heartbeat goes out regardless
        }
        pending_request = 0;
        heartbeats_answered_.fetch_add(1);
        if (const wire::ErrorReply* error = verified.envelope->payload_as_ErrorReply()) {
          if (IsSessionGone(error->code())) {
            const std::string reason = ReasonOf(error);
            {
              MutexLock lock(&session_mu_);
              lost_reason_ = absl::StrCat(std::string(WireCodeName(error->code())),
                                          reason.empty() ? "" : ": ", reason);
            }
            lost_generation_.store(pending_generation);
          }
        } else if (const auto* reply = verified.envelope->payload_as_HeartbeatReply()) {
          MutexLock lock(&fence_mu_);
          TakeFencesLocked(*reply);
        }
      }
    }
    const absl::Time now = MonotonicNow();
    if (now < next_send) continue;
    const auto [current, generation] = SessionAndGeneration();
    next_send = now + current.heartbeat_interval;
    if (current.session_id == 0 || lost_generation_.load() == generation) continue;
    if (options_.require_progress &&
        now - absl::FromUnixNanos(last_progress_ns_.load(std::memory_order_relaxed)) >
            current.heartbeat_timeout) {
      heartbeats_withheld_.fetch_add(1);  // the caller is stuck: let the lease run out
      continue;
    }
    builder.Clear();
    const auto heartbeat = EncodeHeartbeat(builder);
    pending_request = next_request_id++;
    pending_generation = generation;
    FinishEnvelope(builder, pending_request, current.session_id, current.epoch,
                   wire::Message::Heartbeat, heartbeat.Union());
    if (SendFrame(dealer, BufferSpan(builder)).ok()) heartbeats_sent_.fetch_add(1);
  }
}

}  // namespace kvcm
