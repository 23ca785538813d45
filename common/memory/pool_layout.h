#pragma once

// PoolLayout: where each K/V element of the pool lives, as byte strides into one arena.
//
// The pool is one arena per device, laid out (outermost first)
//
//   [layer][K=0 | V=1][block][token-in-block][kv-head][dim]
//
// so that each layer's K (and V) is a contiguous [num_blocks, block_size, num_kv_heads,
// head_dim] tensor: the per-layer NHD paged layout of vLLM and FlashInfer. With
// e = DTypeBytes(spec.dtype):
//
//   head_stride  = head_dim x e
//   token_stride = num_kv_heads x head_stride
//   block_stride = block_size x token_stride          (= BytesPerBlock() / (2 x num_layers))
//   kv_stride    = num_blocks x block_stride
//   layer_stride = 2 x kv_stride
//   total_bytes  = num_layers x layer_stride          (= num_blocks x BytesPerBlock())
//
// The strides travel in the pool descriptor (docs/architecture.md): the descriptor, not the
// code, fixes the layout. A process that receives a layout from a peer calls Validate()
// before using it to compute addresses.
//
// Thread safety: a plain value.

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/sizing/kv_cache_spec.h"

namespace kvcm {

struct PoolLayout {
  int32_t num_blocks = 0;
  int64_t elem_bytes = 0;  // DTypeBytes(spec.dtype)
  int64_t head_stride = 0;
  int64_t token_stride = 0;
  int64_t block_stride = 0;
  int64_t kv_stride = 0;
  int64_t layer_stride = 0;
  int64_t total_bytes = 0;

  // The layout of a pool of `num_blocks` blocks shaped by `spec`. INVALID_ARGUMENT when
  // the spec is invalid, num_blocks is not positive, or total_bytes overflows an int64.
  static absl::StatusOr<PoolLayout> For(const KvCacheSpec& spec, int32_t num_blocks);

  // OK when this layout (typically decoded from a peer's descriptor) is exactly what
  // For(spec, num_blocks) gives. Otherwise INVALID_ARGUMENT naming the first field that
  // differs, with both values. Use it before computing any address from a peer's strides.
  absl::Status Validate(const KvCacheSpec& spec) const;

  // Byte offset from the arena base of element 0 of the head vector at
  // (layer, kv, block, token, head); element d of it is at Offset(...) + d x elem_bytes.
  // REQUIRES: every index within its dimension and kv in {0, 1} (not checked: hot path).
  int64_t Offset(int32_t layer, int32_t kv, int32_t block, int32_t token, int32_t head) const {
    return layer * layer_stride + kv * kv_stride + block * block_stride + token * token_stride +
           head * head_stride;
  }

  // One line for logs: every field, e.g. "PoolLayout{num_blocks=10, elem_bytes=2, ...}".
  std::string ToString() const;
};

bool operator==(const PoolLayout& a, const PoolLayout& b);

}  // namespace kvcm
