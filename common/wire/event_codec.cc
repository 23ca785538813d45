#include "common/wire/event_codec.h"

#include <cstring>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/base/status_macros.h"

namespace kvcm {
namespace {

absl::Status ProtocolError(absl::string_view what) {
  return absl::InternalError(absl::StrCat("cache manager protocol error: ", what));
}

wire::BlockHash HashToWire(const BlockHash& hash) {
  wire::BlockHash out;
  static_assert(sizeof(out) == sizeof(hash));
  std::memcpy(static_cast<void*>(&out), &hash, sizeof(hash));
  return out;
}

BlockHash HashFromWire(const wire::BlockHash* hash) {
  BlockHash out;
  std::memcpy(out.bytes.data(), hash->bytes()->Data(), out.bytes.size());
  return out;
}

wire::EventKind KindToWire(KvEventKind kind) {
  switch (kind) {
    case KvEventKind::kBlockStored:
      return wire::EventKind::BlockStored;
    case KvEventKind::kBlockRemoved:
      return wire::EventKind::BlockRemoved;
    case KvEventKind::kAllBlocksCleared:
      return wire::EventKind::AllBlocksCleared;
  }
  return wire::EventKind::AllBlocksCleared;
}

}  // namespace

flatbuffers::Offset<wire::KvEvent> EncodeKvEvent(flatbuffers::FlatBufferBuilder& builder,
                                                 const KvEventRecord& record) {
  const bool has_hash = record.kind != KvEventKind::kAllBlocksCleared;
  const wire::BlockHash hash = HashToWire(record.hash);
  const wire::BlockHash parent = HashToWire(record.parent_hash);
  wire::KvEventBuilder event(builder);
  event.add_kind(KindToWire(record.kind));
  if (has_hash) event.add_hash(&hash);
  if (record.has_parent) event.add_parent_hash(&parent);
  event.add_block(record.block);
  return event.Finish();
}

flatbuffers::Offset<flatbuffers::Vector<flatbuffers::Offset<wire::KvEvent>>> EncodeKvEvents(
    flatbuffers::FlatBufferBuilder& builder, std::span<const KvEventRecord> events) {
  std::vector<flatbuffers::Offset<wire::KvEvent>> encoded;
  encoded.reserve(events.size());
  for (const KvEventRecord& event : events) encoded.push_back(EncodeKvEvent(builder, event));
  return builder.CreateVector(encoded);
}

absl::StatusOr<std::vector<KvEventRecord>> DecodeKvEvents(
    const flatbuffers::Vector<flatbuffers::Offset<wire::KvEvent>>* events) {
  std::vector<KvEventRecord> out;
  if (events == nullptr) return out;
  out.reserve(events->size());
  for (flatbuffers::uoffset_t i = 0; i < events->size(); ++i) {
    const wire::KvEvent* event = events->Get(i);
    KvEventRecord record;
    switch (event->kind()) {
      case wire::EventKind::BlockStored:
        record.kind = KvEventKind::kBlockStored;
        break;
      case wire::EventKind::BlockRemoved:
        record.kind = KvEventKind::kBlockRemoved;
        break;
      case wire::EventKind::AllBlocksCleared:
        record.kind = KvEventKind::kAllBlocksCleared;
        break;
      default:
        return ProtocolError(
            absl::StrCat("KV event ", i, " has unknown kind ", static_cast<int>(event->kind())));
    }
    if (record.kind != KvEventKind::kAllBlocksCleared) {
      if (event->hash() == nullptr) {
        return ProtocolError(absl::StrCat("KV event ", i, " has no block hash"));
      }
      record.hash = HashFromWire(event->hash());
      record.block = event->block();
    }
    if (event->parent_hash() != nullptr) {
      record.parent_hash = HashFromWire(event->parent_hash());
      record.has_parent = true;
    }
    out.push_back(record);
  }
  return out;
}

flatbuffers::Offset<wire::EventBatch> EncodeEventBatch(flatbuffers::FlatBufferBuilder& builder,
                                                       const KvEventBatch& batch) {
  const auto events = EncodeKvEvents(builder, batch.events);
  return wire::CreateEventBatch(builder, batch.seq, batch.epoch, events);
}

absl::StatusOr<KvEventBatch> DecodeEventBatch(const wire::EventBatch& batch) {
  KvEventBatch out;
  out.seq = batch.seq();
  out.epoch = batch.epoch();
  KVCM_ASSIGN_OR_RETURN(out.events, DecodeKvEvents(batch.events()));
  return out;
}

flatbuffers::Offset<wire::EventSnapshotReply> EncodeEventSnapshotReply(
    flatbuffers::FlatBufferBuilder& builder, const EventSnapshot& snapshot) {
  const auto events = EncodeKvEvents(builder, snapshot.events);
  return wire::CreateEventSnapshotReply(builder, snapshot.seq, snapshot.epoch, events);
}

absl::StatusOr<EventSnapshot> DecodeEventSnapshotReply(const wire::EventSnapshotReply& reply) {
  EventSnapshot out;
  out.seq = reply.seq();
  out.epoch = reply.epoch();
  KVCM_ASSIGN_OR_RETURN(out.events, DecodeKvEvents(reply.events()));
  return out;
}

}  // namespace kvcm
