#include "kernels/paged_kv.h"

#include <cstdlib>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/base/check.h"

namespace kvcm::kernels {

absl::StatusOr<PagedKvView> LayerView(uint8_t* base, const PoolLayout& layout,
                                      const KvCacheSpec& spec, int32_t layer) {
  PagedKvView view;
  if (!IsKernelDType(spec.dtype)) {
    return absl::InvalidArgumentError(absl::StrCat("no attention kernel for KV-cache dtype ",
                                                   std::string(DTypeName(spec.dtype))));
  }
  view.dtype = spec.dtype;
  if (layer < 0 || layer >= spec.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", layer, " out of range [0, ", spec.num_layers, ")"));
  }
  const int64_t offset = layout.Offset(layer, 0, 0, 0, 0);
  view.k = base + offset;
  view.v = base + offset + layout.kv_stride;
  view.num_blocks = layout.num_blocks;
  view.block_size = spec.block_size;
  view.num_kv_heads = spec.num_kv_heads;
  view.head_dim = spec.head_dim;
  view.block_stride = layout.block_stride;
  view.token_stride = layout.token_stride;
  view.head_stride = layout.head_stride;
  return view;
}

void NoKernelForDType(DType dtype) {
  KVCM_CHECK(false) << "no kernel for KV-cache dtype " << DTypeName(dtype);
  std::abort();
}

}  // namespace kvcm::kernels
