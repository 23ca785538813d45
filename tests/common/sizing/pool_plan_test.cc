#include "common/sizing/pool_plan.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#include "absl/status/status.h"
#include "common/sizing/kv_cache_spec.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/status_matchers.h"

namespace kvcm {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kMiB = int64_t{1} << 20;
constexpr int64_t kGiB = int64_t{1} << 30;

// Llama-3-8B: 32 layers, 8 KV heads, head dim 128, bf16 -> 131072 B per token, 2 MiB per
// block of 16 tokens.
KvCacheSpec Llama3_8B() { return {32, 8, 128, DType::kBFloat16, 16}; }

// Llama-2-7B: 32 layers, 32 KV heads (MHA), head dim 128, fp16 -> 524288 B per token, 8 MiB
// per block of 16 tokens.
KvCacheSpec Llama2_7B() { return {32, 32, 128, DType::kFloat16, 16}; }

TEST(PlanPoolTest, AbsoluteBytesLlama3_8B) {
  const absl::StatusOr<PoolPlan> plan = PlanPool(Llama3_8B(), PoolBudget::Bytes(64 * kGiB));
  ASSERT_THAT(plan, IsOk());
  EXPECT_EQ(plan->bytes_per_token, 131072);
  EXPECT_EQ(plan->bytes_per_block, 2 * kMiB);
  EXPECT_EQ(plan->usable_bytes, 64 * kGiB);
  // 64 GiB / 2 MiB = 2^36 / 2^21 = 2^15 = 32768 blocks, exactly: nothing left over.
  EXPECT_EQ(plan->num_blocks, 32768);
  EXPECT_EQ(plan->pool_bytes, 64 * kGiB);
  EXPECT_EQ(plan->unused_bytes, 0);
  // 32768 blocks x 16 tokens = 524288 tokens (TGI's max_batch_total_tokens).
  EXPECT_EQ(plan->max_total_tokens, 524288);
}

TEST(PlanPoolTest, AbsoluteBytesLlama2_7BMha) {
  const absl::StatusOr<PoolPlan> plan = PlanPool(Llama2_7B(), PoolBudget::Bytes(64 * kGiB));
  ASSERT_THAT(plan, IsOk());
  EXPECT_EQ(plan->bytes_per_block, 8 * kMiB);
  // 64 GiB / 8 MiB = 8192 blocks -> 131072 tokens: a quarter of Llama-3-8B's, because MHA
  // stores 4x the KV heads.
  EXPECT_EQ(plan->num_blocks, 8192);
  EXPECT_EQ(plan->max_total_tokens, 131072);
}

TEST(PlanPoolTest, RemainderIsUnused) {
  // 64 GiB + 1 MiB + 5 B: still 32768 whole blocks of 2 MiB; 1048581 B are left over.
  const int64_t budget = 64 * kGiB + kMiB + 5;
  const absl::StatusOr<PoolPlan> plan = PlanPool(Llama3_8B(), PoolBudget::Bytes(budget));
  ASSERT_THAT(plan, IsOk());
  EXPECT_EQ(plan->usable_bytes, budget);
  EXPECT_EQ(plan->num_blocks, 32768);
  EXPECT_EQ(plan->pool_bytes, 64 * kGiB);
  EXPECT_EQ(plan->unused_bytes, 1048581);
  EXPECT_LT(plan->unused_bytes, plan->bytes_per_block);
}

TEST(PlanPoolTest, FractionOfFreeMemoryExact) {
  // 80 GiB free x 0.5 x (1 - 0.25) = 30 GiB exactly (binary fractions, no rounding).
  // 30 GiB / 2 MiB = 15360 blocks -> 245760 tokens.
  const absl::StatusOr<PoolPlan> plan =
      PlanPool(Llama3_8B(), PoolBudget::FractionOfFree(80 * kGiB, 0.5, 0.25));
  ASSERT_THAT(plan, IsOk());
  EXPECT_EQ(plan->usable_bytes, 30 * kGiB);
  EXPECT_EQ(plan->num_blocks, 15360);
  EXPECT_EQ(plan->unused_bytes, 0);
  EXPECT_EQ(plan->max_total_tokens, 245760);
}

TEST(PlanPoolTest, FractionOfFreeMemoryWithDefaultMargin) {
  // 80 GiB = 85899345920 B free x 0.9 x (1 - 0.10) = 69578470195.2 -> 69578470195 B.
  // / 2097152 = 33177.6 -> 33177 blocks = 69577211904 B; 1258291 B unused.
  const PoolBudget budget = PoolBudget::FractionOfFree(80 * kGiB, 0.9);
  ASSERT_EQ(std::get<MemoryFractionBudget>(budget.kind).margin, kDefaultMemoryMargin);
  const absl::StatusOr<PoolPlan> plan = PlanPool(Llama3_8B(), budget);
  ASSERT_THAT(plan, IsOk());
  EXPECT_EQ(plan->usable_bytes, 69578470195);
  EXPECT_EQ(plan->num_blocks, 33177);
  EXPECT_EQ(plan->pool_bytes, 69577211904);
  EXPECT_EQ(plan->unused_bytes, 1258291);
  EXPECT_EQ(plan->max_total_tokens, 530832);  // 33177 x 16
}

TEST(PlanPoolTest, FractionOneMarginZeroUsesAllFreeMemoryToTheByte) {
  const int64_t free_bytes = std::numeric_limits<int64_t>::max() - 12345;
  const PoolBudget budget = PoolBudget::FractionOfFree(free_bytes, 1.0, 0.0);
  EXPECT_EQ(*budget.UsableBytes(2 * kMiB), free_bytes);
}

TEST(PlanPoolTest, FixedBlockCount) {
  // 4096 blocks x 2 MiB = 8 GiB, 65536 tokens; no remainder by construction.
  const absl::StatusOr<PoolPlan> plan = PlanPool(Llama3_8B(), PoolBudget::Blocks(4096));
  ASSERT_THAT(plan, IsOk());
  EXPECT_EQ(plan->num_blocks, 4096);
  EXPECT_EQ(plan->usable_bytes, 8 * kGiB);
  EXPECT_EQ(plan->pool_bytes, 8 * kGiB);
  EXPECT_EQ(plan->unused_bytes, 0);
  EXPECT_EQ(plan->max_total_tokens, 65536);
}

TEST(PlanPoolTest, ZeroBlocksFitIsResourceExhausted) {
  // One byte short of one 2 MiB block.
  const absl::StatusOr<PoolPlan> plan = PlanPool(Llama3_8B(), PoolBudget::Bytes(2 * kMiB - 1));
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(plan.status().message(), HasSubstr("not one KV-cache block fits"));
  EXPECT_THAT(plan.status().message(), HasSubstr("2097152 B"));

  // No free memory at all.
  EXPECT_EQ(PlanPool(Llama3_8B(), PoolBudget::FractionOfFree(0, 0.9)).status().code(),
            absl::StatusCode::kResourceExhausted);
}

TEST(PlanPoolTest, ExactlyOneBlockFits) {
  const absl::StatusOr<PoolPlan> plan = PlanPool(Llama3_8B(), PoolBudget::Bytes(2 * kMiB));
  ASSERT_THAT(plan, IsOk());
  EXPECT_EQ(plan->num_blocks, 1);
  EXPECT_EQ(plan->max_total_tokens, 16);
}

TEST(PlanPoolTest, InvalidBudgetNamesTheField) {
  struct Case {
    PoolBudget budget;
    const char* field;
  };
  const Case cases[] = {
      {PoolBudget::Bytes(0), "pool bytes"},
      {PoolBudget::Bytes(-1), "pool bytes"},
      {PoolBudget::FractionOfFree(-1, 0.9), "free memory"},
      {PoolBudget::FractionOfFree(kGiB, 0.0), "fraction"},
      {PoolBudget::FractionOfFree(kGiB, 1.5), "fraction"},
      {PoolBudget::FractionOfFree(kGiB, std::nan("")), "fraction"},
      {PoolBudget::FractionOfFree(kGiB, 0.9, -0.1), "margin"},
      {PoolBudget::FractionOfFree(kGiB, 0.9, 1.0), "margin"},
      {PoolBudget::Blocks(0), "num_blocks"},
      {PoolBudget::Blocks(kMaxNumBlocks + 1), "num_blocks"},
  };
  for (const Case& c : cases) {
    const absl::StatusOr<PoolPlan> plan = PlanPool(Llama3_8B(), c.budget);
    EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument) << c.field;
    EXPECT_THAT(plan.status().message(), HasSubstr(c.field));
  }
}

TEST(PlanPoolTest, InvalidSpecIsInvalidArgument) {
  KvCacheSpec spec = Llama3_8B();
  spec.num_kv_heads = 0;
  const absl::StatusOr<PoolPlan> plan = PlanPool(spec, PoolBudget::Bytes(64 * kGiB));
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(plan.status().message(), HasSubstr("num_kv_heads"));
}

TEST(PlanPoolTest, MoreBlocksThanBlockIdsIsInvalidArgument) {
  // 2 (K and V) x 1 x 1 x 1 x 1 byte x 1 token = 2 B per block; 8 GiB gives 2^32 blocks.
  const KvCacheSpec tiny{1, 1, 1, DType::kFloat8E4M3, 1};
  const absl::StatusOr<PoolPlan> plan = PlanPool(tiny, PoolBudget::Bytes(8 * kGiB));
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(plan.status().message(), HasSubstr("larger block size"));
}

TEST(PlanPoolTest, BlockCountTimesBlockBytesOverflowIsInvalidArgument) {
  // 2 x 1024 x 1024 x 1024 x 4 B x 1024 tokens = 2^43 B per block; x (2^31 - 1) blocks
  // overflows int64.
  const KvCacheSpec huge{1024, 1024, 1024, DType::kFloat32, 1024};
  ASSERT_THAT(huge.Validate(), IsOk());
  const absl::StatusOr<PoolPlan> plan = PlanPool(huge, PoolBudget::Blocks(kMaxNumBlocks));
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(plan.status().message(), HasSubstr("overflows"));
}

TEST(SequencesThatFitTest, WholeBlocks) {
  const PoolPlan plan = *PlanPool(Llama3_8B(), PoolBudget::Bytes(64 * kGiB));  // 32768 blocks
  // 4096 tokens = 256 blocks of 16 exactly; 32768 / 256 = 128 sequences, no waste.
  const SequenceFit fit = *SequencesThatFit(plan, 4096);
  EXPECT_EQ(fit.seq_len, 4096);
  EXPECT_EQ(fit.blocks_per_sequence, 256);
  EXPECT_EQ(fit.num_sequences, 128);
  EXPECT_EQ(fit.wasted_tokens_per_sequence, 0);
  EXPECT_EQ(fit.wasted_bytes_per_sequence, 0);
  // 32768 tokens = 2048 blocks -> 16 sequences.
  EXPECT_EQ(SequencesThatFit(plan, 32768)->num_sequences, 16);
}

TEST(SequencesThatFitTest, PartlyFilledLastBlock) {
  const PoolPlan plan = *PlanPool(Llama3_8B(), PoolBudget::Bytes(64 * kGiB));  // 32768 blocks
  // 1000 tokens = 62.5 blocks -> 63; 63 x 16 - 1000 = 8 empty slots = 8 x 131072 B = 1 MiB.
  // 32768 / 63 = 520 sequences (520 x 63 = 32760 blocks, 8 blocks spare).
  const SequenceFit fit = *SequencesThatFit(plan, 1000);
  EXPECT_EQ(fit.blocks_per_sequence, 63);
  EXPECT_EQ(fit.num_sequences, 520);
  EXPECT_EQ(fit.wasted_tokens_per_sequence, 8);
  EXPECT_EQ(fit.wasted_bytes_per_sequence, kMiB);
  // A single token takes a whole block: 15 empty slots.
  const SequenceFit one = *SequencesThatFit(plan, 1);
  EXPECT_EQ(one.blocks_per_sequence, 1);
  EXPECT_EQ(one.num_sequences, 32768);
  EXPECT_EQ(one.wasted_tokens_per_sequence, 15);
}

TEST(SequencesThatFitTest, LongerThanThePool) {
  const PoolPlan plan = *PlanPool(Llama3_8B(), PoolBudget::Blocks(4));  // 64 tokens
  EXPECT_EQ(SequencesThatFit(plan, 64)->num_sequences, 1);
  const SequenceFit fit = *SequencesThatFit(plan, 65);
  EXPECT_EQ(fit.blocks_per_sequence, 5);
  EXPECT_EQ(fit.num_sequences, 0);
  EXPECT_EQ(SequencesThatFit(plan, std::numeric_limits<int64_t>::max())->num_sequences, 0);
}

TEST(SequencesThatFitTest, RejectsNonPositiveLength) {
  const PoolPlan plan = *PlanPool(Llama3_8B(), PoolBudget::Blocks(4));
  EXPECT_EQ(SequencesThatFit(plan, 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SequencesThatFit(plan, -5).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(PoolBudgetTest, FormulasAndKindNames) {
  const int64_t block = 2 * kMiB;
  EXPECT_EQ(PoolBudget::Bytes(64 * kGiB).UsableBytesFormula(block),
            "68719476736 B (64.00 GiB), an absolute budget");
  EXPECT_EQ(PoolBudget::FractionOfFree(80 * kGiB, 0.9).UsableBytesFormula(block),
            "85899345920 B (80.00 GiB) free x 0.9 fraction x (1 - 0.1 margin) = 69578470195 B "
            "(64.80 GiB)");
  EXPECT_EQ(PoolBudget::Blocks(4096).UsableBytesFormula(block),
            "4096 blocks x 2097152 B per block = 8589934592 B (8.00 GiB), a fixed block count");
  EXPECT_EQ(PoolBudget::Bytes(1).KindName(), "pool-bytes");
  EXPECT_EQ(PoolBudget::FractionOfFree(1, 1).KindName(), "memory-fraction");
  EXPECT_EQ(PoolBudget::Blocks(1).KindName(), "num-blocks");
}

TEST(DescribePlanTest, ShowsEveryFigure) {
  const PoolPlan plan = *PlanPool(Llama3_8B(), PoolBudget::Bytes(64 * kGiB));
  EXPECT_EQ(DescribePlan(plan),
            "KV-cache plan for 32 layers x 8 KV heads x head dim 128, bf16, block size 16\n"
            "  bytes per token  = 2 (K and V) x 32 layers x 8 KV heads x 128 head dim x 2 bytes "
            "(bf16) = 131072 B (128.00 KiB)\n"
            "  bytes per block  = 131072 B per token x 16 tokens per block = 2097152 B "
            "(2.00 MiB)\n"
            "  usable bytes     = 68719476736 B (64.00 GiB), an absolute budget\n"
            "  num_blocks       = floor(68719476736 / 2097152) = 32768\n"
            "  pool bytes       = 32768 blocks x 2097152 B = 68719476736 B (64.00 GiB)\n"
            "  unused bytes     = 68719476736 - 68719476736 = 0 B\n"
            "  max total tokens = 32768 blocks x 16 tokens = 524288 (TGI's "
            "max_batch_total_tokens)\n");
}

}  // namespace
}  // namespace kvcm
