#include <cstring>

#include "common/base/check.h"
#include "common/base/float16.h"
#include "kernels/write_kv.h"

namespace kvcm::kernels::cpu {
namespace {

template <typename Convert>
void StoreRow(uint8_t* dst, const float* src, int32_t n, Convert convert) {
  for (int32_t d = 0; d < n; ++d) {
    const uint16_t bits = convert(src[d]);
    std::memcpy(dst + int64_t{d} * 2, &bits, sizeof(bits));
  }
}

void StoreHead(DType dtype, uint8_t* dst, const float* src, int32_t head_dim) {
  switch (dtype) {
    case DType::kFloat32:
      std::memcpy(dst, src, static_cast<size_t>(head_dim) * sizeof(float));
      return;
    case DType::kFloat16:
      StoreRow(dst, src, head_dim, HalfFromFloat);
      return;
    case DType::kBFloat16:
      StoreRow(dst, src, head_dim, BFloat16FromFloat);
      return;
    case DType::kFloat8E4M3:
    case DType::kFloat8E5M2:
      break;
  }
  NoKernelForDType(dtype);
}

}  // namespace

// Single-threaded: a step writes a few K/V rows per sequence (one in decode), far less than
// attention then reads.
void WriteKv(const PagedKvView& view, const float* key, const float* value, const int64_t* slots,
             int32_t num_tokens) {
  const int64_t capacity = int64_t{view.num_blocks} * view.block_size;
  const int64_t token_elems = int64_t{view.num_kv_heads} * view.head_dim;
  for (int32_t i = 0; i < num_tokens; ++i) {
    const int64_t slot = slots[i];
    if (slot < 0) continue;
    KVCM_CHECK(slot < capacity) << "slot " << slot << " of " << capacity;
    const int64_t offset =
        (slot / view.block_size) * view.block_stride + (slot % view.block_size) * view.token_stride;
    for (int32_t h = 0; h < view.num_kv_heads; ++h) {
      const int64_t src = i * token_elems + int64_t{h} * view.head_dim;
      const int64_t dst = offset + h * view.head_stride;
      StoreHead(view.dtype, view.k + dst, key + src, view.head_dim);
      StoreHead(view.dtype, view.v + dst, value + src, view.head_dim);
    }
  }
}

}  // namespace kvcm::kernels::cpu
