#include "common/client/kv_event_subscriber.h"

#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/base/monotonic_clock.h"
#include "common/base/status_macros.h"
#include "common/transport/zmq_util.h"
#include "common/wire/envelope.h"
#include "flatbuffers/flatbuffers.h"
#include "schemas/kvcm_protocol_generated.h"

namespace kvcm {
namespace {

// At most this many messages per Poll(), so that a flood cannot keep the caller inside.
constexpr int kMaxMessagesPerPoll = 100000;
// An event batch holds the events of one request (a Step of thousands of ops at most).
constexpr size_t kMaxEventBatchBytes = size_t{256} << 20;

uint64_t ReadBigEndian64(const zmq::message_t& frame) {
  const auto* bytes = static_cast<const uint8_t*>(frame.data());
  uint64_t value = 0;
  for (size_t i = 0; i < sizeof(value); ++i) value = (value << 8) | bytes[i];
  return value;
}

}  // namespace

KvEventSubscriber::KvEventSubscriber(Options options)
    : options_(std::move(options)), context_(1), socket_(context_, zmq::socket_type::sub) {}

KvEventSubscriber::~KvEventSubscriber() = default;

absl::StatusOr<std::unique_ptr<KvEventSubscriber>> KvEventSubscriber::Connect(Options options) {
  if (options.endpoint.empty()) {
    return absl::InvalidArgumentError("KV event endpoint is empty");
  }
  KVCM_RETURN_IF_ERROR(CheckIpcDirectory(options.endpoint));
  KVCM_RETURN_IF_ERROR(ProbeIpcListener(options.endpoint));
  std::unique_ptr<KvEventSubscriber> subscriber(new KvEventSubscriber(std::move(options)));
  try {
    subscriber->socket_.set(zmq::sockopt::linger, 0);
    LimitInboundMessages(subscriber->socket_, kMaxEventBatchBytes);
    subscriber->socket_.set(zmq::sockopt::subscribe, kKvEventTopic);
  } catch (const zmq::error_t& error) {
    return absl::InternalError(absl::StrCat("SUB socket setup failed: ", error.what()));
  }
  KVCM_RETURN_IF_ERROR(ConnectAndAwaitHandshake(
      subscriber->context_, subscriber->socket_, subscriber->options_.endpoint,
      MonotonicNow() + subscriber->options_.connect_timeout));
  return subscriber;
}

bool KvEventSubscriber::Decode(const std::vector<zmq::message_t>& frames, Batch* batch) {
  constexpr size_t kTopicSize = sizeof(kKvEventTopic) - 1;
  if (frames.size() != 3 || frames[0].size() != kTopicSize ||
      std::memcmp(frames[0].data(), kKvEventTopic, kTopicSize) != 0 ||
      frames[1].size() != sizeof(uint64_t)) {
    return false;
  }
  const auto* data = static_cast<const uint8_t*>(frames[2].data());
  const size_t size = frames[2].size();
  if (size > kDefaultMaxMessageBytes) return false;
  flatbuffers::Verifier verifier(data, size, kVerifierMaxDepth, kVerifierMaxTables);
  if (!verifier.VerifyBuffer<wire::EventBatch>(nullptr)) return false;
  const wire::EventBatch* root = flatbuffers::GetRoot<wire::EventBatch>(data);
  batch->seq = ReadBigEndian64(frames[1]);
  if (root->seq() != batch->seq || batch->seq == 0) return false;
  batch->epoch = root->epoch();
  absl::StatusOr<std::vector<KvEventRecord>> events = DecodeKvEvents(root->events());
  if (!events.ok()) return false;
  batch->events = std::move(*events);
  return true;
}

void KvEventSubscriber::Apply(const Batch& batch) {
  for (const KvEventRecord& event : batch.events) {
    switch (event.kind) {
      case KvEventKind::kBlockStored:
        blocks_[event.hash] = event.block;
        break;
      case KvEventKind::kBlockRemoved:
        blocks_.erase(event.hash);
        break;
      case KvEventKind::kAllBlocksCleared:
        blocks_.clear();
        break;
    }
  }
  last_seq_ = batch.seq;
  ++batches_applied_;
  if (options_.on_batch_applied) options_.on_batch_applied(batch.seq, batch.epoch, batch.events);
}

void KvEventSubscriber::Buffer(Batch batch) {
  if (buffered_.size() >= options_.max_buffered_batches) buffered_.pop_front();
  if (options_.max_buffered_batches > 0) buffered_.push_back(std::move(batch));
}

bool KvEventSubscriber::Accept(Batch batch) {
  if (batch.seq == 1 && (!synced_ || batch.epoch != epoch_)) {
    // The first batch of an epoch: the index started empty, so the mirror is complete.
    blocks_.clear();
    buffered_.clear();
    epoch_ = batch.epoch;
    synced_ = true;
    Apply(batch);
    return true;
  }
  if (!synced_) {
    Buffer(std::move(batch));
    return false;
  }
  if (batch.epoch != epoch_) {
    // A restart whose first batches we missed: the old pool is gone, the new one unknown.
    blocks_.clear();
    ++gaps_;
    synced_ = false;
    epoch_ = batch.epoch;
    last_seq_ = 0;
    Buffer(std::move(batch));
    return false;
  }
  if (batch.seq <= last_seq_) return false;  // already covered by a snapshot
  if (batch.seq != last_seq_ + 1) {
    ++gaps_;
    synced_ = false;
    Buffer(std::move(batch));
    return false;
  }
  Apply(batch);
  return true;
}

int KvEventSubscriber::Replay() {
  std::deque<Batch> pending = std::exchange(buffered_, {});
  int applied = 0;
  for (Batch& batch : pending) {
    // Batches of another epoch predate (or postdate) the snapshot's pool: never replayed.
    if (batch.epoch != epoch_) continue;
    if (Accept(std::move(batch))) ++applied;
  }
  return applied;
}

absl::StatusOr<int> KvEventSubscriber::Poll(absl::Duration timeout) {
  int applied = 0;
  const absl::Time deadline = MonotonicNow() + timeout;
  for (int i = 0; i < kMaxMessagesPerPoll; ++i) {
    KVCM_ASSIGN_OR_RETURN(
        std::vector<zmq::message_t> frames,
        i == 0 ? ReceiveMessageUntil(socket_, deadline) : ReceiveMessage(socket_));
    if (frames.empty()) break;
    ++messages_received_;
    Batch batch;
    if (!Decode(frames, &batch)) {
      ++rejected_batches_;
      continue;
    }
    if (drop_next_) {
      drop_next_ = false;
      continue;
    }
    if (Accept(std::move(batch))) ++applied;
  }
  return applied;
}

absl::Status KvEventSubscriber::ApplySnapshot(const EventSnapshot& snapshot) {
  absl::flat_hash_map<BlockHash, int32_t, BlockHashHasher> blocks;
  blocks.reserve(snapshot.events.size());
  for (size_t i = 0; i < snapshot.events.size(); ++i) {
    const KvEventRecord& event = snapshot.events[i];
    // A snapshot starts with AllBlocksCleared: the mirror is replaced as a whole anyway.
    if (i == 0 && event.kind == KvEventKind::kAllBlocksCleared) continue;
    if (event.kind != KvEventKind::kBlockStored) {
      return absl::InvalidArgumentError(
          absl::StrCat("event snapshot of epoch ", snapshot.epoch,
                       " holds an event other than BlockStored after its first"));
    }
    blocks[event.hash] = event.block;
  }
  blocks_ = std::move(blocks);
  epoch_ = snapshot.epoch;
  last_seq_ = snapshot.seq;
  synced_ = true;
  Replay();
  return absl::OkStatus();
}

absl::Status KvEventSubscriber::Resync(CacheManagerClient& client) {
  // Buffer what is already here, so it can be replayed after the snapshot.
  KVCM_RETURN_IF_ERROR(Poll(absl::ZeroDuration()).status());
  KVCM_ASSIGN_OR_RETURN(const EventSnapshot snapshot, client.Snapshot());
  return ApplySnapshot(snapshot);
}

}  // namespace kvcm
