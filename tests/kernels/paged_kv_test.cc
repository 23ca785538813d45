// LayerView from a real PoolLayout.

#include "kernels/paged_kv.h"

#include <vector>

#include "common/memory/pool_layout.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/status_matchers.h"

namespace kvcm::kernels {
namespace {

using ::testing::HasSubstr;

KvCacheSpec Llama8BSpec(DType dtype) {
  KvCacheSpec spec;
  spec.num_layers = 32;
  spec.num_kv_heads = 8;
  spec.head_dim = 128;
  spec.dtype = dtype;
  spec.block_size = 16;
  return spec;
}

TEST(LayerViewTest, PointsIntoTheLayoutOfEachLayer) {
  const KvCacheSpec spec = Llama8BSpec(DType::kBFloat16);
  const absl::StatusOr<PoolLayout> layout = PoolLayout::For(spec, 100);
  ASSERT_THAT(layout, IsOk());
  uint8_t* base = reinterpret_cast<uint8_t*>(uintptr_t{1} << 20);  // never dereferenced
  for (int32_t layer : {0, 1, 31}) {
    const absl::StatusOr<PagedKvView> view = LayerView(base, *layout, spec, layer);
    ASSERT_THAT(view, IsOk());
    EXPECT_EQ(view->k, base + layout->Offset(layer, 0, 0, 0, 0));
    EXPECT_EQ(view->v, base + layout->Offset(layer, 1, 0, 0, 0));
    EXPECT_EQ(view->dtype, DType::kBFloat16);
    EXPECT_EQ(view->num_blocks, 100);
    EXPECT_EQ(view->block_size, 16);
    EXPECT_EQ(view->num_kv_heads, 8);
    EXPECT_EQ(view->head_dim, 128);
    EXPECT_EQ(view->head_stride, 128 * 2);
    EXPECT_EQ(view->token_stride, 8 * 128 * 2);
    EXPECT_EQ(view->block_stride, 16 * 8 * 128 * 2);
    // Element (b, t, h, d) of K by the view's formula is the layout's address.
    const int64_t b = 57, t = 9, h = 5, d = 100;
    EXPECT_EQ(view->k + b * view->block_stride + t * view->token_stride + h * view->head_stride +
                  d * DTypeBytes(view->dtype),
              base + layout->Offset(layer, 0, 57, 9, 5) + d * layout->elem_bytes);
  }
}

TEST(LayerViewTest, MapsEachDtype) {
  for (DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    const KvCacheSpec spec = Llama8BSpec(dtype);
    const absl::StatusOr<PoolLayout> layout = PoolLayout::For(spec, 4);
    ASSERT_THAT(layout, IsOk());
    std::vector<uint8_t> pool(16);
    const absl::StatusOr<PagedKvView> view = LayerView(pool.data(), *layout, spec, 0);
    ASSERT_THAT(view, IsOk());
    EXPECT_EQ(view->dtype, dtype);
    EXPECT_EQ(DTypeBytes(view->dtype), layout->elem_bytes);
  }
}

TEST(IsKernelDTypeTest, AcceptsTheFloatTypesOnly) {
  static_assert(IsKernelDType(DType::kFloat32));
  static_assert(IsKernelDType(DType::kFloat16));
  static_assert(IsKernelDType(DType::kBFloat16));
  static_assert(!IsKernelDType(DType::kFloat8E4M3));
  static_assert(!IsKernelDType(DType::kFloat8E5M2));
  EXPECT_DEATH(NoKernelForDType(DType::kFloat8E5M2), "no kernel for KV-cache dtype fp8_e5m2");
}

TEST(LayerViewTest, RejectsFp8AndLayersOutOfRange) {
  const KvCacheSpec fp8 = Llama8BSpec(DType::kFloat8E4M3);
  const absl::StatusOr<PoolLayout> fp8_layout = PoolLayout::For(fp8, 4);
  ASSERT_THAT(fp8_layout, IsOk());
  std::vector<uint8_t> pool(16);
  const absl::StatusOr<PagedKvView> no_kernel = LayerView(pool.data(), *fp8_layout, fp8, 0);
  EXPECT_EQ(no_kernel.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(no_kernel.status().message()), HasSubstr("fp8_e4m3"));

  const KvCacheSpec spec = Llama8BSpec(DType::kFloat16);
  const absl::StatusOr<PoolLayout> layout = PoolLayout::For(spec, 4);
  ASSERT_THAT(layout, IsOk());
  for (int32_t layer : {-1, 32}) {
    const absl::StatusOr<PagedKvView> view = LayerView(pool.data(), *layout, spec, layer);
    EXPECT_EQ(view.status().code(), absl::StatusCode::kInvalidArgument) << layer;
  }
}

TEST(CudaKernelsCompiledTest, MatchesTheBuild) {
#if defined(KVCM_TEST_CUDA_ENABLED)
  EXPECT_TRUE(CudaKernelsCompiled());
#else
  EXPECT_FALSE(CudaKernelsCompiled());
#endif
}

}  // namespace
}  // namespace kvcm::kernels
