#include "common/memory/pool_layout.h"

#include <cstdint>
#include <limits>

#include "absl/status/status.h"
#include "common/sizing/kv_cache_spec.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/status_matchers.h"

namespace kvcm {
namespace {

using ::testing::HasSubstr;

// 2 layers x 4 KV heads x head dim 8, fp16, 16 tokens per block: 4096 bytes per block.
KvCacheSpec SmallSpec() { return {2, 4, 8, DType::kFloat16, 16}; }

TEST(PoolLayoutTest, StridesWorkedOutByHand) {
  const absl::StatusOr<PoolLayout> layout = PoolLayout::For(SmallSpec(), 10);
  ASSERT_THAT(layout, IsOk());
  EXPECT_EQ(layout->num_blocks, 10);
  EXPECT_EQ(layout->elem_bytes, 2);
  EXPECT_EQ(layout->head_stride, 8 * 2);       // head_dim x 2 bytes
  EXPECT_EQ(layout->token_stride, 4 * 16);     // 4 KV heads
  EXPECT_EQ(layout->block_stride, 16 * 64);    // 16 tokens
  EXPECT_EQ(layout->kv_stride, 10 * 1024);     // 10 blocks
  EXPECT_EQ(layout->layer_stride, 2 * 10240);  // K and V
  EXPECT_EQ(layout->total_bytes, 2 * 20480);   // 2 layers
  EXPECT_EQ(layout->total_bytes, 10 * SmallSpec().BytesPerBlock());
}

TEST(PoolLayoutTest, OffsetOfFirstAndLastElement) {
  const PoolLayout layout = *PoolLayout::For(SmallSpec(), 10);
  EXPECT_EQ(layout.Offset(0, 0, 0, 0, 0), 0);
  // V of block 0, layer 0 starts right after the K of all 10 blocks of layer 0.
  EXPECT_EQ(layout.Offset(0, 1, 0, 0, 0), 10240);
  EXPECT_EQ(layout.Offset(1, 0, 0, 0, 0), 20480);
  // Last head vector: layer 1, V, block 9, token 15, head 3.
  const int64_t last_head = layout.Offset(1, 1, 9, 15, 3);
  EXPECT_EQ(last_head, 20480 + 10240 + 9 * 1024 + 15 * 64 + 3 * 16);
  // Its last element (dim 7) ends exactly at the end of the arena.
  EXPECT_EQ(last_head + 7 * layout.elem_bytes + layout.elem_bytes, layout.total_bytes);
}

TEST(PoolLayoutTest, Llama3_8BBf16) {
  const KvCacheSpec spec{32, 8, 128, DType::kBFloat16, 16};
  const PoolLayout layout = *PoolLayout::For(spec, 1000);
  EXPECT_EQ(layout.block_stride, 16 * 8 * 128 * 2);  // 32 KiB per layer, K or V
  EXPECT_EQ(layout.total_bytes, int64_t{1000} * spec.BytesPerBlock());
  EXPECT_THAT(layout.Validate(spec), IsOk());
}

TEST(PoolLayoutTest, RejectsBadSpecAndBlockCount) {
  EXPECT_EQ(PoolLayout::For(SmallSpec(), 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PoolLayout::For(SmallSpec(), -1).status().code(), absl::StatusCode::kInvalidArgument);
  KvCacheSpec bad = SmallSpec();
  bad.head_dim = 0;
  EXPECT_THAT(PoolLayout::For(bad, 10).status().message(), HasSubstr("head_dim"));
}

TEST(PoolLayoutTest, RejectsOverflow) {
  // 2^43 bytes per block fits in an int64; 2^31 - 1 blocks of it do not.
  const KvCacheSpec huge{1024, 1024, 1024, DType::kFloat32, 1024};
  ASSERT_THAT(huge.Validate(), IsOk());
  const absl::StatusOr<PoolLayout> layout =
      PoolLayout::For(huge, std::numeric_limits<int32_t>::max());
  EXPECT_EQ(layout.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(layout.status().message(), HasSubstr("overflow"));
}

TEST(PoolLayoutTest, ValidateAcceptsItsOwnLayout) {
  const PoolLayout layout = *PoolLayout::For(SmallSpec(), 10);
  EXPECT_THAT(layout.Validate(SmallSpec()), IsOk());
}

TEST(PoolLayoutTest, ValidateRejectsTamperedFields) {
  const PoolLayout good = *PoolLayout::For(SmallSpec(), 10);
  struct Case {
    const char* field;
    int64_t PoolLayout::*member;
  };
  for (const Case& c :
       {Case{"elem_bytes", &PoolLayout::elem_bytes}, Case{"head_stride", &PoolLayout::head_stride},
        Case{"token_stride", &PoolLayout::token_stride},
        Case{"block_stride", &PoolLayout::block_stride}, Case{"kv_stride", &PoolLayout::kv_stride},
        Case{"layer_stride", &PoolLayout::layer_stride},
        Case{"total_bytes", &PoolLayout::total_bytes}}) {
    PoolLayout tampered = good;
    tampered.*c.member += 2;
    const absl::Status status = tampered.Validate(SmallSpec());
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << c.field;
    EXPECT_THAT(status.message(), HasSubstr(c.field));
  }
}

TEST(PoolLayoutTest, ValidateRejectsWrongSpecOrBlockCount) {
  const PoolLayout layout = *PoolLayout::For(SmallSpec(), 10);
  KvCacheSpec other = SmallSpec();
  other.dtype = DType::kFloat32;
  EXPECT_EQ(layout.Validate(other).code(), absl::StatusCode::kInvalidArgument);

  PoolLayout zero_blocks = layout;
  zero_blocks.num_blocks = 0;
  EXPECT_THAT(zero_blocks.Validate(SmallSpec()).message(), HasSubstr("num_blocks"));

  // More blocks than the strides and size were computed for.
  PoolLayout more_blocks = layout;
  more_blocks.num_blocks = 11;
  EXPECT_THAT(more_blocks.Validate(SmallSpec()).message(), HasSubstr("kv_stride"));
}

TEST(PoolLayoutTest, ToStringNamesEveryField) {
  const std::string text = PoolLayout::For(SmallSpec(), 10)->ToString();
  EXPECT_THAT(text, HasSubstr("num_blocks=10"));
  EXPECT_THAT(text, HasSubstr("total_bytes=40960"));
}

}  // namespace
}  // namespace kvcm
