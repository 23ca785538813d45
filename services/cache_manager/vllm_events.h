#pragma once
// KV events in vLLM's wire format (docs/protocol.md, "vLLM-format KV events"), so that
// cluster routers that consume vLLM engines' events (NVIDIA Dynamo's KV router, llm-d's
// indexer) can consume a kvcm node's. This file is the format only: the values and their
// msgpack encoding. The sockets are VllmEventPublisher's (vllm_event_publisher.h).
//
// A batch's payload is the msgpack array [ts (float64, seconds since 1970), [event...],
// data_parallel_rank (int)], each event a map with a "type" key:
//   {"type":"BlockStored","block_hashes":[u64...],"parent_block_hash":u64|nil,
//    "token_ids":[u32...],"block_size":N,"lora_id":nil,"medium":M,"lora_name":nil}
//   {"type":"BlockRemoved","block_hashes":[u64...],"medium":M}
//   {"type":"AllBlocksCleared"}
// An event of a KV cache group (VllmEvent::group; docs/protocol.md, "vLLM-format KV events")
// carries vLLM's group fields after those: BlockStored "extra_keys":nil, "group_idx":g,
// "kv_cache_spec_kind":"full_attention"|"sliding_window",
// "kv_cache_spec_sliding_window":W|nil; BlockRemoved "group_idx":g. Without groups the
// events carry none of them (the bytes of a stream without groups do not change).
// Hashes are msgpack unsigned integers, never bin.
//
// Thread safety: stateless functions.

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/block/block_hash.h"

namespace kvcm::cache_manager {

// Where an event's blocks are (or were): its "medium". vLLM names its device pool "GPU" and
// its CPU offloading tier "CPU"; NVIDIA Dynamo's router reads "GPU" as its device tier,
// "CPU" as its host tier and "DISK" as its disk tier. kvcm: the pool is "GPU" (cuda) or
// "CPU" (shm), the host tier "CPU", the disk tier "DISK".
enum class VllmMedium : uint8_t { kGpu, kCpu, kDisk };
// "GPU", "CPU", "DISK".
std::string_view VllmMediumName(VllmMedium medium);

// The KV cache group an event's blocks belong to (docs/architecture.md, "The hybrid KV
// cache"): its index and the tokens its layers attend within (0 = full attention).
struct VllmGroup {
  int32_t index = 0;
  int32_t window = 0;
  friend bool operator==(const VllmGroup&, const VllmGroup&) = default;
};

struct VllmEvent {
  enum class Kind : uint8_t { kBlockStored, kBlockRemoved, kAllBlocksCleared };
  Kind kind = Kind::kAllBlocksCleared;
  // Stored: a chain of blocks, each the child of the one before; Removed: any blocks.
  std::vector<uint64_t> block_hashes;
  std::optional<uint64_t> parent_block_hash;  // Stored: the first block's parent, if any
  // Stored: block_hashes.size() * block_size token ids, block after block.
  std::vector<uint32_t> token_ids;
  VllmMedium medium = VllmMedium::kGpu;  // Stored and Removed
  // Stored and Removed of a pool with KV cache groups: the group's fields are written.
  std::optional<VllmGroup> group;
};

// What every event of one stream says alike.
struct VllmStreamInfo {
  int32_t block_size = 16;
  int32_t data_parallel_rank = 0;
};

// The id an event names a block by, a pure function of the hash (so BlockRemoved names the
// ids BlockStored did): under kVllmSha256Cbor vLLM's own, the digest's last 8 bytes read
// big-endian (BlockHash::Low64BigEndian); otherwise the first 8 bytes read big-endian (the
// digest's leading bytes, where xxh3 and fast128 put theirs: common/block/block_hash.h).
uint64_t VllmBlockId(const BlockHash& hash, HashAlgorithm algorithm = kDefaultHashAlgorithm);

// The msgpack payload of one batch, appended to `out` (cleared first).
void EncodeVllmBatch(double timestamp, std::span<const VllmEvent> events,
                     const VllmStreamInfo& info, std::string* out);

// "BlockStored", "BlockRemoved", "AllBlocksCleared".
std::string_view VllmEventTypeName(VllmEvent::Kind kind);

}  // namespace kvcm::cache_manager
