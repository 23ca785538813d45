#include "services/cache_manager/vllm_events.h"

#include <cstring>

#include "msgpack.hpp"

namespace kvcm::cache_manager {
namespace {

// msgpack's packer writes to any type with write(const char*, size_t).
class StringBuffer {
 public:
  explicit StringBuffer(std::string* out) : out_(out) {}
  void write(const char* data, size_t size) { out_->append(data, size); }

 private:
  std::string* out_;
};

void PackString(msgpack::packer<StringBuffer>& packer, std::string_view text) {
  packer.pack_str(static_cast<uint32_t>(text.size()));
  packer.pack_str_body(text.data(), static_cast<uint32_t>(text.size()));
}

void PackHashes(msgpack::packer<StringBuffer>& packer, std::span<const uint64_t> hashes) {
  packer.pack_array(static_cast<uint32_t>(hashes.size()));
  for (uint64_t hash : hashes) packer.pack_uint64(hash);
}

// Always msgpack's float64 (0xcb and 8 bytes big-endian): the packer's pack_double writes a
// double with an integral value as an integer, which is not vLLM's format.
void PackFloat64(StringBuffer& buffer, double value) {
  uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(bits));
  char bytes[9];
  bytes[0] = static_cast<char>(0xcb);
  for (int i = 8; i >= 1; --i) {
    bytes[i] = static_cast<char>(bits & 0xff);
    bits >>= 8;
  }
  buffer.write(bytes, sizeof(bytes));
}

// The head of a BlockStored or BlockRemoved map of `fields` entries: its type and hashes.
void PackMapHead(msgpack::packer<StringBuffer>& packer, uint32_t fields, std::string_view type,
                 const VllmEvent& event) {
  packer.pack_map(fields);
  PackString(packer, "type");
  PackString(packer, type);
  PackString(packer, "block_hashes");
  PackHashes(packer, event.block_hashes);
}

// vLLM's group_idx, which BlockStored and BlockRemoved both carry for a hybrid model.
void PackGroupIndex(msgpack::packer<StringBuffer>& packer, const VllmGroup& group) {
  PackString(packer, "group_idx");
  packer.pack_int32(group.index);
}

// A BlockStored map; with a group, vLLM's group fields after the others (vllm_events.h).
void PackStored(msgpack::packer<StringBuffer>& packer, const VllmEvent& event,
                const VllmStreamInfo& info) {
  PackMapHead(packer, event.group.has_value() ? 12 : 8, "BlockStored", event);
  PackString(packer, "parent_block_hash");
  if (event.parent_block_hash.has_value()) {
    packer.pack_uint64(*event.parent_block_hash);
  } else {
    packer.pack_nil();
  }
  PackString(packer, "token_ids");
  packer.pack_array(static_cast<uint32_t>(event.token_ids.size()));
  for (uint32_t token : event.token_ids) packer.pack_uint32(token);
  PackString(packer, "block_size");
  packer.pack_int32(info.block_size);
  PackString(packer, "lora_id");
  packer.pack_nil();
  PackString(packer, "medium");
  PackString(packer, VllmMediumName(event.medium));
  PackString(packer, "lora_name");
  packer.pack_nil();
  if (!event.group.has_value()) return;
  PackString(packer, "extra_keys");
  packer.pack_nil();
  PackGroupIndex(packer, *event.group);
  PackString(packer, "kv_cache_spec_kind");
  PackString(packer, event.group->window > 0 ? "sliding_window" : "full_attention");
  PackString(packer, "kv_cache_spec_sliding_window");
  if (event.group->window > 0) {
    packer.pack_int32(event.group->window);
  } else {
    packer.pack_nil();
  }
}

}  // namespace

uint64_t VllmBlockId(const BlockHash& hash, HashAlgorithm algorithm) {
  if (algorithm == HashAlgorithm::kVllmSha256Cbor) return hash.Low64BigEndian();
  uint64_t id = 0;
  for (int i = 0; i < 8; ++i) id = (id << 8) | hash.bytes[static_cast<size_t>(i)];
  return id;
}

std::string_view VllmEventTypeName(VllmEvent::Kind kind) {
  switch (kind) {
    case VllmEvent::Kind::kBlockStored:
      return "BlockStored";
    case VllmEvent::Kind::kBlockRemoved:
      return "BlockRemoved";
    case VllmEvent::Kind::kAllBlocksCleared:
      return "AllBlocksCleared";
  }
  return "AllBlocksCleared";
}

std::string_view VllmMediumName(VllmMedium medium) {
  switch (medium) {
    case VllmMedium::kGpu:
      return "GPU";
    case VllmMedium::kCpu:
      return "CPU";
    case VllmMedium::kDisk:
      return "DISK";
  }
  return "GPU";
}

void EncodeVllmBatch(double timestamp, std::span<const VllmEvent> events,
                     const VllmStreamInfo& info, std::string* out) {
  out->clear();
  StringBuffer buffer(out);
  msgpack::packer<StringBuffer> packer(buffer);
  packer.pack_array(3);
  PackFloat64(buffer, timestamp);
  packer.pack_array(static_cast<uint32_t>(events.size()));
  for (const VllmEvent& event : events) {
    switch (event.kind) {
      case VllmEvent::Kind::kBlockStored:
        PackStored(packer, event, info);
        break;
      case VllmEvent::Kind::kBlockRemoved:
        PackMapHead(packer, event.group.has_value() ? 4 : 3, "BlockRemoved", event);
        PackString(packer, "medium");
        PackString(packer, VllmMediumName(event.medium));
        if (event.group.has_value()) PackGroupIndex(packer, *event.group);
        break;
      case VllmEvent::Kind::kAllBlocksCleared:
        packer.pack_map(1);
        PackString(packer, "type");
        PackString(packer, "AllBlocksCleared");
        break;
    }
  }
  packer.pack_int32(info.data_parallel_rank);
}

}  // namespace kvcm::cache_manager
