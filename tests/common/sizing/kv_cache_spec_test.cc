#include "common/sizing/kv_cache_spec.h"

#include <cstdint>
#include <limits>
#include <string>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/status_matchers.h"

namespace kvcm {
namespace {

using ::testing::HasSubstr;

// Llama-3-8B / Llama-3.1-8B: 32 layers, 32 query heads, 8 KV heads (GQA), head dim 128, bf16.
KvCacheSpec Llama3_8B() { return {32, 8, 128, DType::kBFloat16, 16}; }

// Llama-2-7B: 32 layers, 32 heads, all of them KV heads (MHA), head dim 128, fp16.
KvCacheSpec Llama2_7B() { return {32, 32, 128, DType::kFloat16, 16}; }

TEST(DTypeTest, BytesAndNames) {
  EXPECT_EQ(DTypeBytes(DType::kFloat32), 4);
  EXPECT_EQ(DTypeBytes(DType::kFloat16), 2);
  EXPECT_EQ(DTypeBytes(DType::kBFloat16), 2);
  EXPECT_EQ(DTypeBytes(DType::kFloat8E4M3), 1);
  EXPECT_EQ(DTypeBytes(DType::kFloat8E5M2), 1);
  for (DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16, DType::kFloat8E4M3,
                      DType::kFloat8E5M2}) {
    EXPECT_EQ(*ParseDType(DTypeName(dtype)), dtype) << DTypeName(dtype);
  }
}

TEST(DTypeTest, ParsesAliases) {
  EXPECT_EQ(*ParseDType("fp32"), DType::kFloat32);
  EXPECT_EQ(*ParseDType("float32"), DType::kFloat32);
  EXPECT_EQ(*ParseDType("fp16"), DType::kFloat16);
  EXPECT_EQ(*ParseDType("float16"), DType::kFloat16);
  EXPECT_EQ(*ParseDType("half"), DType::kFloat16);
  EXPECT_EQ(*ParseDType("bf16"), DType::kBFloat16);
  EXPECT_EQ(*ParseDType("bfloat16"), DType::kBFloat16);
  EXPECT_EQ(*ParseDType("BF16"), DType::kBFloat16);
  EXPECT_EQ(*ParseDType("fp8"), DType::kFloat8E4M3);
  EXPECT_EQ(*ParseDType("fp8_e4m3"), DType::kFloat8E4M3);
  EXPECT_EQ(*ParseDType("float8_e4m3fn"), DType::kFloat8E4M3);
  EXPECT_EQ(*ParseDType("fp8_e5m2"), DType::kFloat8E5M2);
}

TEST(DTypeTest, RejectsUnknownDType) {
  for (const char* name : {"", "int8", "fp4", "float64", "bf 16"}) {
    const absl::StatusOr<DType> dtype = ParseDType(name);
    EXPECT_EQ(dtype.status().code(), absl::StatusCode::kInvalidArgument) << name;
  }
  EXPECT_THAT(ParseDType("int8").status().message(), HasSubstr("unknown dtype \"int8\""));
  EXPECT_THAT(ParseDType("int8").status().message(), HasSubstr("bf16"));
}

TEST(KvCacheSpecTest, Llama3_8BGqaBf16) {
  const KvCacheSpec spec = Llama3_8B();
  ASSERT_THAT(spec.Validate(), IsOk());
  // 2 x 32 layers x 8 KV heads x 128 dim x 2 bytes = 131072 B (128 KiB) per token.
  EXPECT_EQ(spec.BytesPerToken(), 131072);
  // x 16 tokens = 2097152 B = 2 MiB per block.
  EXPECT_EQ(spec.BytesPerBlock(), 2097152);
}

TEST(KvCacheSpecTest, Llama2_7BMhaFp16) {
  const KvCacheSpec spec = Llama2_7B();
  ASSERT_THAT(spec.Validate(), IsOk());
  // 2 x 32 x 32 x 128 x 2 = 524288 B (512 KiB) per token: 4x Llama-3-8B, because MHA keeps
  // all 32 heads' K and V where GQA keeps 8.
  EXPECT_EQ(spec.BytesPerToken(), 524288);
  EXPECT_EQ(spec.BytesPerBlock(), 8388608);  // 8 MiB per block of 16
}

TEST(KvCacheSpecTest, DTypeAndBlockSizeScaleLinearly) {
  KvCacheSpec spec = Llama3_8B();
  spec.dtype = DType::kFloat8E4M3;
  EXPECT_EQ(spec.BytesPerToken(), 65536);    // half of bf16
  EXPECT_EQ(spec.BytesPerBlock(), 1048576);  // 1 MiB
  spec.dtype = DType::kFloat32;
  EXPECT_EQ(spec.BytesPerToken(), 262144);
  spec.dtype = DType::kBFloat16;
  spec.block_size = 1;
  EXPECT_EQ(spec.BytesPerBlock(), 131072);
  spec.block_size = 24;  // not a power of two: allowed
  ASSERT_THAT(spec.Validate(), IsOk());
  EXPECT_EQ(spec.BytesPerBlock(), 24 * 131072);
  spec.block_size = kMaxBlockSize;
  EXPECT_THAT(spec.Validate(), IsOk());
}

TEST(KvCacheSpecTest, ValidateNamesTheBadField) {
  struct Case {
    KvCacheSpec spec;
    const char* field;
  };
  const Case cases[] = {
      {{0, 8, 128, DType::kBFloat16, 16}, "num_layers"},
      {{32, -1, 128, DType::kBFloat16, 16}, "num_kv_heads"},
      {{32, 8, 0, DType::kBFloat16, 16}, "head_dim"},
      {{32, 8, 128, DType::kBFloat16, 0}, "block_size"},
      {{32, 8, 128, DType::kBFloat16, kMaxBlockSize + 1}, "block_size"},
  };
  for (const Case& c : cases) {
    const absl::Status status = c.spec.Validate();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << c.spec.ToString();
    EXPECT_THAT(status.message(), HasSubstr(c.field)) << status;
  }
}

TEST(KvCacheSpecTest, ValidateRejectsOverflow) {
  constexpr int32_t kBig = std::numeric_limits<int32_t>::max();
  const KvCacheSpec spec{kBig, kBig, kBig, DType::kFloat32, kMaxBlockSize};
  const absl::Status status = spec.Validate();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("overflow"));
}

TEST(KvCacheSpecTest, ToStringAndFormulas) {
  const KvCacheSpec spec = Llama3_8B();
  EXPECT_EQ(spec.ToString(), "32 layers x 8 KV heads x head dim 128, bf16, block size 16");
  EXPECT_EQ(BytesPerTokenFormula(spec),
            "2 (K and V) x 32 layers x 8 KV heads x 128 head dim x 2 bytes (bf16) = 131072 B "
            "(128.00 KiB)");
  EXPECT_EQ(BytesPerBlockFormula(spec),
            "131072 B per token x 16 tokens per block = 2097152 B (2.00 MiB)");
}

TEST(KvCacheSpecDeathTest, SizesRequireAValidSpec) {
  const KvCacheSpec invalid{0, 8, 128, DType::kBFloat16, 16};
  EXPECT_DEATH(invalid.BytesPerToken(), "KVCM_CHECK failed");
  EXPECT_DEATH(invalid.BytesPerBlock(), "KVCM_CHECK failed");
}

TEST(KvCacheSpecTest, Equality) {
  EXPECT_EQ(Llama3_8B(), Llama3_8B());
  EXPECT_FALSE(Llama3_8B() == Llama2_7B());
}

}  // namespace
}  // namespace kvcm
