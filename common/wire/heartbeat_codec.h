#pragma once
// The cache-manager protocol's Heartbeat and HeartbeatReply (schemas/kvcm_protocol.fbs:
// Heartbeat, Fence, SequenceFence, HeartbeatReply) as plain values, and the one codec
// between them and the wire. An executor acknowledges fences in its Heartbeat; the cache
// manager answers with the fences still waiting for it.
//
//   const auto heartbeat = EncodeHeartbeat(builder, acks);                  // client
//   std::vector<FenceNotice> open = DecodeHeartbeatReply(*reply);           // client
//
// Thread safety: stateless functions.

#include <cstdint>
#include <span>
#include <vector>

#include "common/block/block_ledger.h"
#include "flatbuffers/flatbuffers.h"
#include "schemas/kvcm_protocol_generated.h"

namespace kvcm {

// A fence the cache manager asks an executor to honour: stop writing for router session
// `router_session`, then acknowledge `id`.
struct FenceNotice {
  uint64_t id = 0;
  uint64_t router_session = 0;
  // Empty: the whole router session ended (a Fence). Otherwise only these sequences of a
  // router that lives on (a SequenceFence, after its FreeOp.drain).
  std::vector<SeqId> seqs;
  bool operator==(const FenceNotice&) const = default;
};

// A Heartbeat acknowledging `fence_acks` (none: the vector is left out).
flatbuffers::Offset<wire::Heartbeat> EncodeHeartbeat(flatbuffers::FlatBufferBuilder& builder,
                                                     std::span<const uint64_t> fence_acks = {});
// The fences a verified Heartbeat acknowledges, in its order; absent reads as none.
std::vector<uint64_t> DecodeHeartbeat(const wire::Heartbeat& heartbeat);

// A HeartbeatReply listing `fences`: those without seqs as Fences, the others as
// SequenceFences, each kind in the order given.
flatbuffers::Offset<wire::HeartbeatReply> EncodeHeartbeatReply(
    flatbuffers::FlatBufferBuilder& builder, std::span<const FenceNotice> fences);
// The fences of a verified HeartbeatReply: its Fences, then its SequenceFences, each in
// the reply's order; absent lists read as empty.
std::vector<FenceNotice> DecodeHeartbeatReply(const wire::HeartbeatReply& reply);

}  // namespace kvcm
