#pragma once
// The cache-manager protocol's KV events (schemas/kvcm_protocol.fbs: KvEvent, EventBatch,
// EventSnapshotReply) as plain values, and the one codec between them and the wire. The
// cache manager encodes its ledger's events as batches on its PUB socket and its prefix
// index as a snapshot; the client and the KV event subscriber decode them.
//
//   builder.Finish(EncodeEventBatch(builder, batch));                        // cache manager
//   KVCM_ASSIGN_OR_RETURN(KvEventBatch batch, DecodeEventBatch(*root));      // subscriber
//
// Thread safety: stateless functions.

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "common/block/block_hash.h"
#include "common/block/block_ledger.h"
#include "flatbuffers/flatbuffers.h"
#include "schemas/kvcm_protocol_generated.h"

namespace kvcm {

// One KV event (schemas/kvcm_protocol.fbs KvEvent).
enum class KvEventKind : uint8_t { kBlockStored, kBlockRemoved, kAllBlocksCleared };

struct KvEventRecord {
  KvEventKind kind = KvEventKind::kBlockStored;
  BlockHash hash{};  // Stored and Removed
  // Stored: the previous block's hash; has_parent is false for a sequence's first block
  // (its parent is the root of the chain, RootHash(salt), known to the router only).
  BlockHash parent_hash{};
  BlockId block = kNoBlock;  // Stored and Removed
  bool has_parent = false;
  friend bool operator==(const KvEventRecord&, const KvEventRecord&) = default;
};

// One PUB message (EventBatch): batch `seq` of `epoch`'s stream.
struct KvEventBatch {
  uint64_t seq = 0;
  uint64_t epoch = 0;
  std::vector<KvEventRecord> events;
  friend bool operator==(const KvEventBatch&, const KvEventBatch&) = default;
};

// An EventSnapshotReply: every block in the prefix index as BlockStored events, and `seq`,
// the last batch published before it (apply batches after it).
struct EventSnapshot {
  uint64_t seq = 0;
  uint64_t epoch = 0;
  std::vector<KvEventRecord> events;
  friend bool operator==(const EventSnapshot&, const EventSnapshot&) = default;
};

// Appends one KvEvent to `builder`: the hash for Stored and Removed, the parent hash when
// has_parent, the block always (kNoBlock for AllBlocksCleared).
flatbuffers::Offset<wire::KvEvent> EncodeKvEvent(flatbuffers::FlatBufferBuilder& builder,
                                                 const KvEventRecord& event);
flatbuffers::Offset<flatbuffers::Vector<flatbuffers::Offset<wire::KvEvent>>> EncodeKvEvents(
    flatbuffers::FlatBufferBuilder& builder, std::span<const KvEventRecord> events);

// Decodes a KvEvent vector (null reads as empty). INTERNAL ("cache manager protocol error:
// KV event 3 has unknown kind 7", "... has no block hash") for an unknown kind or a
// Stored/Removed event without its hash.
absl::StatusOr<std::vector<KvEventRecord>> DecodeKvEvents(
    const flatbuffers::Vector<flatbuffers::Offset<wire::KvEvent>>* events);

// An EventBatch (the PUB message's root, finished by the caller) and back; decoding fails
// as DecodeKvEvents does. Whether `seq` matches the message's frame is the subscriber's call.
flatbuffers::Offset<wire::EventBatch> EncodeEventBatch(flatbuffers::FlatBufferBuilder& builder,
                                                       const KvEventBatch& batch);
absl::StatusOr<KvEventBatch> DecodeEventBatch(const wire::EventBatch& batch);

// An EventSnapshotReply (before the envelope's root is started) and back.
flatbuffers::Offset<wire::EventSnapshotReply> EncodeEventSnapshotReply(
    flatbuffers::FlatBufferBuilder& builder, const EventSnapshot& snapshot);
absl::StatusOr<EventSnapshot> DecodeEventSnapshotReply(const wire::EventSnapshotReply& reply);

}  // namespace kvcm
