#include "common/memory/pool_layout.h"

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/sizing/kv_cache_spec.h"

namespace kvcm {
namespace {

// a x b, or nullopt when the product does not fit in an int64.
std::optional<int64_t> CheckedMul(int64_t a, int64_t b) {
  int64_t product = 0;
  if (__builtin_mul_overflow(a, b, &product)) return std::nullopt;
  return product;
}

absl::Status Overflow(const KvCacheSpec& spec, int32_t num_blocks) {
  return absl::InvalidArgumentError(absl::StrCat("pool layout: ", num_blocks, " blocks of ",
                                                 spec.ToString(), " overflow int64 bytes"));
}

}  // namespace

absl::StatusOr<PoolLayout> PoolLayout::For(const KvCacheSpec& spec, int32_t num_blocks) {
  if (absl::Status s = spec.Validate(); !s.ok()) return s;
  if (num_blocks <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("pool layout: num_blocks must be positive, got ", num_blocks));
  }
  // spec.Validate() guarantees BytesPerBlock() fits, so the strides inside one block do.
  PoolLayout layout;
  layout.num_blocks = num_blocks;
  layout.elem_bytes = DTypeBytes(spec.dtype);
  layout.head_stride = int64_t{spec.head_dim} * layout.elem_bytes;
  layout.token_stride = int64_t{spec.num_kv_heads} * layout.head_stride;
  layout.block_stride = int64_t{spec.block_size} * layout.token_stride;
  const std::optional<int64_t> kv_stride = CheckedMul(num_blocks, layout.block_stride);
  if (!kv_stride) return Overflow(spec, num_blocks);
  const std::optional<int64_t> layer_stride = CheckedMul(2, *kv_stride);
  if (!layer_stride) return Overflow(spec, num_blocks);
  const std::optional<int64_t> total = CheckedMul(spec.num_layers, *layer_stride);
  if (!total) return Overflow(spec, num_blocks);
  layout.kv_stride = *kv_stride;
  layout.layer_stride = *layer_stride;
  layout.total_bytes = *total;
  return layout;
}

absl::Status PoolLayout::Validate(const KvCacheSpec& spec) const {
  absl::StatusOr<PoolLayout> expected = For(spec, num_blocks);
  if (!expected.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("pool layout does not fit the spec: ", expected.status().message()));
  }
  struct Field {
    const char* name;
    int64_t got;
    int64_t want;
  };
  const Field fields[] = {
      {"elem_bytes", elem_bytes, expected->elem_bytes},
      {"head_stride", head_stride, expected->head_stride},
      {"token_stride", token_stride, expected->token_stride},
      {"block_stride", block_stride, expected->block_stride},
      {"kv_stride", kv_stride, expected->kv_stride},
      {"layer_stride", layer_stride, expected->layer_stride},
      {"total_bytes", total_bytes, expected->total_bytes},
  };
  for (const Field& f : fields) {
    if (f.got != f.want) {
      return absl::InvalidArgumentError(absl::StrCat("pool layout: ", f.name, " is ", f.got,
                                                     " but ", num_blocks, " blocks of ",
                                                     spec.ToString(), " need ", f.want));
    }
  }
  return absl::OkStatus();
}

std::string PoolLayout::ToString() const {
  return absl::StrCat("PoolLayout{num_blocks=", num_blocks, ", elem_bytes=", elem_bytes,
                      ", head_stride=", head_stride, ", token_stride=", token_stride,
                      ", block_stride=", block_stride, ", kv_stride=", kv_stride,
                      ", layer_stride=", layer_stride, ", total_bytes=", total_bytes, "}");
}

bool operator==(const PoolLayout& a, const PoolLayout& b) {
  return a.num_blocks == b.num_blocks && a.elem_bytes == b.elem_bytes &&
         a.head_stride == b.head_stride && a.token_stride == b.token_stride &&
         a.block_stride == b.block_stride && a.kv_stride == b.kv_stride &&
         a.layer_stride == b.layer_stride && a.total_bytes == b.total_bytes;
}

}  // namespace kvcm
