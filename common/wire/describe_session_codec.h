#pragma once
// The cache-manager protocol's DescribeSessionReply (schemas/kvcm_protocol.fbs:
// DescribeSessionReply, SequenceState) as plain values, and the one codec between them and
// the wire: the cache manager encodes what it holds for a session, a router that lost track
// decodes it to resynchronise.
//
//   const auto payload = EncodeDescribeSessionReply(builder, snapshot);   // cache manager
//   SessionSnapshot snapshot = DecodeDescribeSessionReply(*reply);        // client
//
// Thread safety: stateless functions.

#include <cstdint>
#include <vector>

#include "common/block/block_hash.h"
#include "common/block/block_ledger.h"
#include "flatbuffers/flatbuffers.h"
#include "schemas/kvcm_protocol_generated.h"

namespace kvcm {

// One live sequence of a session, as DescribeSession reports it.
struct SequenceSnapshot {
  SeqId seq = 0;
  int32_t num_tokens = 0;
  int32_t num_committed_tokens = 0;
  std::vector<BlockId> blocks;  // the block table (group 0's with KV cache groups)
  // With KV cache groups: groups 1..'s tables one after another, each as long as `blocks`
  // (kNoBlock where a window group released a block); empty without groups.
  std::vector<BlockId> group_blocks;
  friend bool operator==(const SequenceSnapshot&, const SequenceSnapshot&) = default;
};

// What the cache manager holds for a session (a router's resynchronisation).
struct SessionSnapshot {
  std::vector<SequenceSnapshot> sequences;  // by ascending seq
  uint64_t last_step_request_id = 0;        // of the last Step applied; 0 before any
  friend bool operator==(const SessionSnapshot&, const SessionSnapshot&) = default;
};

// Appends a DescribeSessionReply of `snapshot` to `builder` (before the envelope's root is
// started).
flatbuffers::Offset<wire::DescribeSessionReply> EncodeDescribeSessionReply(
    flatbuffers::FlatBufferBuilder& builder, const SessionSnapshot& snapshot);

// The values of a verified DescribeSessionReply; absent lists read as empty. The values are
// taken as given: which sequences a router still knows is its own call.
SessionSnapshot DecodeDescribeSessionReply(const wire::DescribeSessionReply& reply);

}  // namespace kvcm
