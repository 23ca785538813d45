#pragma once
// The cache-manager protocol's BlockMap and BlockMapReply (schemas/kvcm_protocol.fbs) and
// the one codec between BlockMapReply and kvcm::BlockMap (common/block/block_map.h): the
// cache manager encodes, the client decodes, the tests do both.
//
// Thread safety: stateless functions.

#include <cstdint>

#include "absl/status/statusor.h"
#include "common/block/block_map.h"
#include "flatbuffers/flatbuffers.h"
#include "schemas/kvcm_protocol_generated.h"

namespace kvcm {

// The cells a BlockMap request asks for, bounded: 0 (absent) gives kDefaultBlockMapCells,
// and more than kMaxBlockMapCells gives that many.
int32_t BlockMapCellsFor(uint32_t requested);

flatbuffers::Offset<wire::BlockMapReply> EncodeBlockMapReply(
    flatbuffers::FlatBufferBuilder& builder, const BlockMap& map);

// A verified BlockMapReply as a BlockMap. INTERNAL when its values contradict each other: a
// negative pool or a run below 1, a cell count other than ceil(num_blocks /
// blocks_per_cell), a state outside BlockMapState, counts not one per state or not summing
// to num_blocks.
absl::StatusOr<BlockMap> DecodeBlockMapReply(const wire::BlockMapReply& reply);

}  // namespace kvcm
