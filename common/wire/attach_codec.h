#pragma once
// The cache-manager protocol's AttachReply (schemas/kvcm_protocol.fbs: AttachReply,
// PoolDescriptor, PoolLayout) as plain values, and the one codec between them and the wire:
// the cache manager encodes where its pool is and how it is laid out, an executor decodes it
// to map the pool.
//
//   const auto payload = EncodeAttachReply(builder, descriptor);                // cache manager
//   KVCM_ASSIGN_OR_RETURN(PoolDescriptorInfo pool, DecodeAttachReply(*reply));  // client
//
// Thread safety: stateless functions.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/sizing/kv_cache_groups.h"
#include "common/sizing/kv_cache_spec.h"
#include "common/wire/pool_strides.h"
#include "flatbuffers/flatbuffers.h"
#include "schemas/kvcm_protocol_generated.h"

namespace kvcm {

// What an AttachReply tells an executor about the pool.
struct PoolDescriptorInfo {
  KvCacheSpec spec;
  int32_t num_blocks = 0;
  PoolStrides layout;
  wire::PoolBackend backend = wire::PoolBackend::Shm;
  uint64_t epoch = 0;
  std::string fd_channel_path;           // shm: the Unix socket passing the memfd
  int32_t cuda_device = -1;              // cuda
  std::vector<uint8_t> cuda_ipc_handle;  // cuda: 64 bytes
  int32_t sliding_window_tokens = 0;     // > 0: blocks behind the window are released
  // The pool's KV cache groups (PoolDescriptor.kv_groups); empty: none.
  std::vector<KvCacheGroup> kv_groups;
  friend bool operator==(const PoolDescriptorInfo&, const PoolDescriptorInfo&) = default;
};

// Appends an AttachReply of `pool` to `builder` (before the envelope's root is started).
flatbuffers::Offset<wire::AttachReply> EncodeAttachReply(flatbuffers::FlatBufferBuilder& builder,
                                                         const PoolDescriptorInfo& pool);

// The values of a verified AttachReply; absent strings and handles read as empty. INTERNAL
// "pool descriptor: missing" or "pool descriptor: layout missing" when either table is
// absent, and "pool descriptor: " with FromWire's error for an absent or invalid spec (the
// client adds "cache manager protocol error: "). The other values are taken as given:
// whether they fit the spec and the session is the client's call (CheckPoolDescriptor).
absl::StatusOr<PoolDescriptorInfo> DecodeAttachReply(const wire::AttachReply& reply);

}  // namespace kvcm
