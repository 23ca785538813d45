#include "services/cache_manager/vllm_event_publisher.h"

#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/base/atomic_file.h"
#include "common/base/log.h"
#include "common/transport/zmq_util.h"

namespace kvcm::cache_manager {
namespace {

constexpr char kComponent[] = "kvcm-cache-manager";
void Log(std::string_view text) { LogLine(kComponent, text); }

// Batches waiting for one slow subscriber before the PUB drops them for it (it then sees a
// gap in the sequence numbers and replays).
constexpr int kPubHighWaterMark = 100000;
// A replay request is three frames of at most 8 bytes; anything larger is no request.
constexpr size_t kMaxReplayRequestBytes = 256;
// Malformed replay requests logged one by one; after that, one line per this many.
constexpr uint64_t kMalformedLoggedInFull = 10;
constexpr uint64_t kMalformedLogEvery = 1000;

// The seq file: a comment line, then the first sequence number not yet reserved.
constexpr char kSeqFileComment[] =
    "# kvcm-cache-manager: vLLM-format KV event sequence numbers below this one are used "
    "or reserved; the next start goes on from it (docs/protocol.md)";
constexpr size_t kMaxSeqFileBytes = 4096;

// The number in a seq file; 0 when there is none yet.
absl::StatusOr<uint64_t> ReadSeqFile(const std::string& path) {
  absl::StatusOr<std::string> content = ReadSmallFile(path, kMaxSeqFileBytes);
  if (absl::IsNotFound(content.status())) return 0;
  if (!content.ok()) return absl::InternalError(content.status().message());
  std::optional<uint64_t> value;
  for (absl::string_view line : absl::StrSplit(*content, '\n')) {
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line[0] == '#') continue;
    uint64_t number = 0;
    if (value.has_value() || !absl::SimpleAtoi(line, &number)) {
      value.reset();
      break;
    }
    value = number;
  }
  if (!value.has_value() || *value > VllmEventPublisher::kMaxVllmSeq) {
    return absl::InvalidArgumentError(absl::StrCat(
        path,
        " does not hold a sequence number as kvcm-cache-manager writes it; delete it "
        "to start the vLLM-format KV events again from 0, and register this node with its "
        "cluster router again"));
  }
  return *value;
}

void PutBigEndian(uint64_t value, uint8_t out[8]) {
  for (int i = 7; i >= 0; --i) {
    out[i] = static_cast<uint8_t>(value & 0xff);
    value >>= 8;
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<VllmEventPublisher>> VllmEventPublisher::Create(
    zmq::context_t& context, const Options& options, CacheManagerMetrics* metrics) {
  if (options.endpoint.empty()) {
    return absl::InvalidArgumentError("the vLLM-format KV event stream needs an endpoint");
  }
  if (options.buffer_steps < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--kv-events-buffer-steps ", options.buffer_steps, ": keep at least one batch"));
  }
  if (options.topic.empty()) {
    return absl::InvalidArgumentError("--kv-events-topic must not be empty");
  }
  if (options.info.block_size <= 0) {
    return absl::InvalidArgumentError("block size must be positive");
  }
  std::unique_ptr<VllmEventPublisher> publisher(new VllmEventPublisher(options, metrics));
  if (!options.seq_file.empty()) {
    absl::StatusOr<uint64_t> first = ReadSeqFile(options.seq_file);
    if (!first.ok()) return first.status();
    publisher->first_seq_ = publisher->next_seq_ = *first;
    const absl::Status reserved = publisher->ReserveSeqsUpTo(*first + kSeqReservation);
    if (!reserved.ok()) {
      return absl::InternalError(absl::StrCat(
          "cannot reserve vLLM-format KV event sequence numbers: ", reserved.message()));
    }
  }
  try {
    publisher->pub_ = zmq::socket_t(context, zmq::socket_type::xpub);
    publisher->pub_.set(zmq::sockopt::sndhwm, kPubHighWaterMark);
    // Every subscription reaches ServeSubscriptions, repeated ones too (header comment).
    publisher->pub_.set(zmq::sockopt::xpub_verbose, 1);
    // Subscribers send only their subscriptions.
    LimitInboundMessages(publisher->pub_, 1024);
    publisher->pub_.set(zmq::sockopt::linger, 1000);
    publisher->pub_.bind(options.endpoint);
    publisher->endpoint_ = publisher->pub_.get(zmq::sockopt::last_endpoint);
    if (!options.replay_endpoint.empty()) {
      publisher->replay_ = zmq::socket_t(context, zmq::socket_type::router);
      // A full replay to one peer queues the whole buffer and the end marker; past that
      // its sends fail (router_mandatory) and the replay stops, visibly.
      publisher->replay_.set(zmq::sockopt::sndhwm, options.buffer_steps + 2);
      publisher->replay_.set(zmq::sockopt::router_mandatory, 1);
      LimitInboundMessages(publisher->replay_, kMaxReplayRequestBytes);
      publisher->replay_.set(zmq::sockopt::linger, 0);
      publisher->replay_.bind(options.replay_endpoint);
      publisher->replay_endpoint_ = publisher->replay_.get(zmq::sockopt::last_endpoint);
    }
  } catch (const zmq::error_t& error) {
    return absl::UnavailableError(
        absl::StrCat("cannot bind the vLLM-format KV event sockets (", options.endpoint,
                     options.replay_endpoint.empty() ? "" : ", " + options.replay_endpoint,
                     "): ", error.what()));
  }
  if (metrics != nullptr) metrics->SetVllmBufferBatches(0);
  return publisher;
}

VllmEventPublisher::~VllmEventPublisher() {
  replay_.close();
  pub_.close();
}

absl::Status VllmEventPublisher::ReserveSeqsUpTo(uint64_t limit) {
  absl::Status written = WriteFileAtomically(
      options_.seq_file, absl::StrCat(kSeqFileComment, "\n", limit, "\n"), 0600);
  if (written.ok()) reserved_until_ = limit;
  return written;
}

void VllmEventPublisher::Publish(std::span<const VllmEvent> events, double timestamp) {
  if (events.empty()) return;
  if (next_seq_ == reserved_until_) {
    // Reserve the next chunk before sending any of it. Should that fail, the stream goes
    // on (its consumers need it more than its numbering across a restart), and the next
    // start, reading the old mark, would reuse numbers consumers saw: say so once.
    const absl::Status reserved = ReserveSeqsUpTo(next_seq_ + kSeqReservation);
    if (!reserved.ok()) {
      reserved_until_ = ~uint64_t{0};
      Log(absl::StrCat("cannot reserve more vLLM-format KV event sequence numbers (",
                       reserved.message(),
                       "): after a restart this node must be registered "
                       "with its cluster router again"));
    }
  }
  Batch batch;
  batch.seq = next_seq_++;
  EncodeVllmBatch(timestamp, events, options_.info, &batch.payload);
  const bool sent = SendOnPub(batch);
  if (metrics_ != nullptr) {
    metrics_->CountVllmBatch(sent);
    if (sent) {
      for (const VllmEvent& event : events) metrics_->CountVllmEvent(static_cast<int>(event.kind));
    }
  }
  buffer_.push_back(std::move(batch));
  while (buffer_.size() + (first_.has_value() ? 1 : 0) >
         static_cast<size_t>(options_.buffer_steps)) {
    if (buffer_.front().seq == first_seq_ && options_.buffer_steps > 1) {
      first_ = std::move(buffer_.front());  // the start's AllBlocksCleared stays
    }
    buffer_.pop_front();
  }
  if (metrics_ != nullptr) metrics_->SetVllmBufferBatches(static_cast<int64_t>(buffered()));
}

bool VllmEventPublisher::SendOnPub(const Batch& batch) {
  uint8_t seq_be[8];
  PutBigEndian(batch.seq, seq_be);
  try {
    pub_.send(zmq::const_buffer(options_.topic.data(), options_.topic.size()),
              zmq::send_flags::sndmore);
    pub_.send(zmq::const_buffer(seq_be, sizeof(seq_be)), zmq::send_flags::sndmore);
    return pub_
        .send(zmq::const_buffer(batch.payload.data(), batch.payload.size()), zmq::send_flags::none)
        .has_value();
  } catch (const zmq::error_t& error) {
    Log(absl::StrCat("publishing vLLM-format event batch ", batch.seq, ": ", error.what(),
                     " (kept for replay)"));
    return false;
  }
}

void VllmEventPublisher::ServeSubscriptions() {
  int subscriptions = 0;
  while (true) {
    absl::StatusOr<std::vector<zmq::message_t>> message = ReceiveMessage(pub_);
    if (!message.ok()) {
      Log(absl::StrCat("vLLM-format PUB socket: ", message.status().message()));
      break;
    }
    if (message->empty()) break;
    // [0x01 topic prefix] subscribes, [0x00 ...] unsubscribes; nothing else comes.
    const zmq::message_t& frame = message->front();
    if (frame.size() >= 1 && static_cast<const uint8_t*>(frame.data())[0] == 1) {
      ++subscriptions;
    }
  }
  if (subscriptions == 0) return;
  if (metrics_ != nullptr) metrics_->CountVllmSubscriptions(subscriptions);
  // One answer for all of them: the latest batch (the start's own first while it is alone).
  const Batch* latest = !buffer_.empty() ? &buffer_.back() : (first_ ? &*first_ : nullptr);
  if (latest != nullptr) SendOnPub(*latest);
}

bool VllmEventPublisher::SendReplayFrame(const zmq::message_t& identity, const Batch* batch) {
  uint8_t seq_be[8];
  PutBigEndian(batch != nullptr ? batch->seq : ~uint64_t{0}, seq_be);
  const std::string_view topic = batch != nullptr ? std::string_view(options_.topic) : "";
  const std::string_view payload = batch != nullptr ? std::string_view(batch->payload) : "";
  try {
    constexpr auto kMore = zmq::send_flags::sndmore | zmq::send_flags::dontwait;
    if (!replay_.send(zmq::const_buffer(identity.data(), identity.size()), kMore)) return false;
    replay_.send(zmq::const_buffer("", 0), kMore);
    replay_.send(zmq::const_buffer(topic.data(), topic.size()), kMore);
    replay_.send(zmq::const_buffer(seq_be, sizeof(seq_be)), kMore);
    return replay_
        .send(zmq::const_buffer(payload.data(), payload.size()), zmq::send_flags::dontwait)
        .has_value();
  } catch (const zmq::error_t&) {
    return false;  // the peer is gone (router_mandatory: EHOSTUNREACH)
  }
}

void VllmEventPublisher::RefuseReplay(std::string_view why) {
  ++malformed_;
  if (metrics_ != nullptr) metrics_->CountVllmReplayRequest(/*malformed=*/true, 0);
  if (malformed_ <= kMalformedLoggedInFull || malformed_ % kMalformedLogEvery == 0) {
    Log(absl::StrCat(
        "vLLM-format replay request refused (", malformed_, " so far): ", std::string(why),
        "; a request is an empty frame, then the start ", "sequence number as 8 bytes big-endian"));
  }
}

void VllmEventPublisher::ServeReplay() {
  if (!replay_) return;
  while (true) {
    absl::StatusOr<std::vector<zmq::message_t>> message = ReceiveMessage(replay_);
    if (!message.ok()) {
      Log(absl::StrCat("vLLM-format replay socket: ", message.status().message()));
      return;
    }
    if (message->empty()) return;
    std::vector<zmq::message_t>& frames = *message;
    // frames[0] is the identity the ROUTER prepended.
    if (frames.size() != 3) {
      RefuseReplay(absl::StrCat(frames.size() - 1, " frame(s) instead of 2"));
      continue;
    }
    if (frames[1].size() != 0) {
      RefuseReplay(
          absl::StrCat("the first frame has ", frames[1].size(), " bytes instead of being empty"));
      continue;
    }
    if (frames[2].size() != 8) {
      RefuseReplay(
          absl::StrCat("the sequence number has ", frames[2].size(), " bytes instead of 8"));
      continue;
    }
    uint64_t start = 0;
    const auto* bytes = static_cast<const uint8_t*>(frames[2].data());
    for (int i = 0; i < 8; ++i) start = (start << 8) | bytes[i];
    int sent = 0;
    bool delivered = true;
    auto send = [&](const Batch& batch) {
      if (!delivered || batch.seq < start) return;
      delivered = SendReplayFrame(frames[0], &batch);
      sent += delivered ? 1 : 0;
    };
    if (first_.has_value()) send(*first_);
    for (const Batch& batch : buffer_) send(batch);
    if (delivered) delivered = SendReplayFrame(frames[0], nullptr);
    if (!delivered) {
      Log(absl::StrCat("vLLM-format replay from seq ", start,
                       ": the subscriber stopped "
                       "reading or left after ",
                       sent, " batch(es); the rest is not sent"));
    }
    if (metrics_ != nullptr) metrics_->CountVllmReplayRequest(/*malformed=*/false, sent);
  }
}

}  // namespace kvcm::cache_manager
