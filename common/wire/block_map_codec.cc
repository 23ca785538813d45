#include "common/wire/block_map_codec.h"

#include <algorithm>
#include <string>

#include "absl/strings/str_cat.h"

namespace kvcm {
namespace {

absl::Status Malformed(const std::string& what) {
  return absl::InternalError(absl::StrCat("BlockMapReply: ", what));
}

}  // namespace

int32_t BlockMapCellsFor(uint32_t requested) {
  if (requested == 0) return kDefaultBlockMapCells;
  return static_cast<int32_t>(std::min<uint32_t>(requested, kMaxBlockMapCells));
}

flatbuffers::Offset<wire::BlockMapReply> EncodeBlockMapReply(
    flatbuffers::FlatBufferBuilder& builder, const BlockMap& map) {
  static_assert(sizeof(MapState) == 1);
  const auto cells =
      builder.CreateVector(reinterpret_cast<const uint8_t*>(map.cells.data()), map.cells.size());
  const auto counts = builder.CreateVector(map.counts.data(), map.counts.size());
  return wire::CreateBlockMapReply(builder, map.num_blocks, map.blocks_per_cell, cells, counts);
}

absl::StatusOr<BlockMap> DecodeBlockMapReply(const wire::BlockMapReply& reply) {
  BlockMap map;
  map.num_blocks = reply.num_blocks();
  map.blocks_per_cell = reply.blocks_per_cell();
  if (map.num_blocks < 0 || map.blocks_per_cell < 1) {
    return Malformed(absl::StrCat(map.num_blocks, " blocks in runs of ", map.blocks_per_cell));
  }
  const int64_t want_cells =
      (int64_t{map.num_blocks} + map.blocks_per_cell - 1) / map.blocks_per_cell;
  const size_t cells = reply.cells() == nullptr ? 0 : reply.cells()->size();
  if (static_cast<int64_t>(cells) != want_cells) {
    return Malformed(absl::StrCat(cells, " cells for ", map.num_blocks, " blocks in runs of ",
                                  map.blocks_per_cell, " (", want_cells, " expected)"));
  }
  map.cells.resize(cells);
  for (size_t i = 0; i < cells; ++i) {
    const uint8_t state = reply.cells()->Get(static_cast<flatbuffers::uoffset_t>(i));
    if (state >= kMapStates) return Malformed(absl::StrCat("cell ", i, " has state ", state));
    map.cells[i] = static_cast<MapState>(state);
  }
  const size_t counts = reply.counts() == nullptr ? 0 : reply.counts()->size();
  if (counts != kMapStates) {
    return Malformed(absl::StrCat(counts, " counts; expected one per state, ", kMapStates));
  }
  int64_t sum = 0;
  for (size_t s = 0; s < counts; ++s) {
    const int32_t count = reply.counts()->Get(static_cast<flatbuffers::uoffset_t>(s));
    if (count < 0) return Malformed(absl::StrCat("negative count ", count, " at state ", s));
    map.counts[s] = count;
    sum += count;
  }
  if (sum != map.num_blocks) {
    return Malformed(absl::StrCat("counts sum to ", sum, ", not ", map.num_blocks, " blocks"));
  }
  return map;
}

}  // namespace kvcm
