#pragma once
// PoolStrides: the byte strides of a KV pool as the cache manager sends them in its
// AttachReply (schemas/kvcm_protocol.fbs: PoolLayout), as a plain value with no generated
// code, so the cache manager's service header can hold one (common/wire/attach_codec.h
// encodes and decodes it).

#include <cstdint>

namespace kvcm {

// Byte strides of [layer][K|V][block][token][kv head][dim], the element size and the whole
// pool's bytes.
struct PoolStrides {
  uint64_t layer_stride = 0;
  uint64_t kv_stride = 0;
  uint64_t block_stride = 0;
  uint64_t token_stride = 0;
  uint64_t head_stride = 0;
  uint32_t elem_bytes = 0;
  uint64_t total_bytes = 0;
  friend bool operator==(const PoolStrides&, const PoolStrides&) = default;
};

}  // namespace kvcm
