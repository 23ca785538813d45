#include "common/sizing/pool_plan.h"

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <variant>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/base/check.h"
#include "common/base/status_macros.h"
#include "common/sizing/byte_size.h"
#include "common/sizing/checked_math.h"
#include "common/sizing/kv_cache_spec.h"

namespace kvcm {

using sizing_internal::CheckedMul;

absl::Status PoolBudget::Validate() const {
  if (const auto* b = std::get_if<PoolBytesBudget>(&kind)) {
    if (b->bytes <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("pool budget: pool bytes must be positive, got ", b->bytes));
    }
  } else if (const auto* f = std::get_if<MemoryFractionBudget>(&kind)) {
    if (f->free_bytes < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("pool budget: free memory must not be negative, got ", f->free_bytes));
    }
    // Written so that NaN fails: every comparison with NaN is false.
    if (!(f->fraction > 0.0 && f->fraction <= 1.0)) {
      return absl::InvalidArgumentError(
          absl::StrCat("pool budget: memory fraction must be in (0, 1], got ", f->fraction));
    }
    if (!(f->margin >= 0.0 && f->margin < 1.0)) {
      return absl::InvalidArgumentError(
          absl::StrCat("pool budget: margin must be in [0, 1), got ", f->margin));
    }
  } else {
    const auto& c = std::get<BlockCountBudget>(kind);
    if (c.num_blocks <= 0 || c.num_blocks > kMaxNumBlocks) {
      return absl::InvalidArgumentError(absl::StrCat("pool budget: num_blocks must be in [1, ",
                                                     kMaxNumBlocks, "], got ", c.num_blocks));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> PoolBudget::UsableBytes(int64_t bytes_per_block) const {
  KVCM_CHECK(bytes_per_block > 0) << bytes_per_block;
  KVCM_CHECK(Validate().ok()) << Validate();
  if (const auto* b = std::get_if<PoolBytesBudget>(&kind)) return b->bytes;
  if (const auto* f = std::get_if<MemoryFractionBudget>(&kind)) {
    // long double keeps every int64 exact, so fraction 1 and margin 0 give back free_bytes
    // to the byte. The product is <= free_bytes, so it fits.
    const long double usable = static_cast<long double>(f->free_bytes) *
                               static_cast<long double>(f->fraction) *
                               (1.0L - static_cast<long double>(f->margin));
    return static_cast<int64_t>(std::floor(usable));
  }
  const auto& c = std::get<BlockCountBudget>(kind);
  const std::optional<int64_t> bytes = CheckedMul(c.num_blocks, bytes_per_block);
  if (!bytes.has_value()) {
    return absl::InvalidArgumentError(absl::StrCat("pool budget: ", c.num_blocks, " blocks x ",
                                                   bytes_per_block,
                                                   " B per block overflows int64"));
  }
  return *bytes;
}

std::string PoolBudget::UsableBytesFormula(int64_t bytes_per_block) const {
  const absl::StatusOr<int64_t> usable = UsableBytes(bytes_per_block);
  KVCM_CHECK(usable.ok()) << usable.status();
  if (std::holds_alternative<PoolBytesBudget>(kind)) {
    return absl::StrCat(ExactBytes(*usable), ", an absolute budget");
  }
  if (const auto* f = std::get_if<MemoryFractionBudget>(&kind)) {
    return absl::StrCat(ExactBytes(f->free_bytes), " free x ", f->fraction, " fraction x (1 - ",
                        f->margin, " margin) = ", ExactBytes(*usable));
  }
  return absl::StrCat(std::get<BlockCountBudget>(kind).num_blocks, " blocks x ", bytes_per_block,
                      " B per block = ", ExactBytes(*usable), ", a fixed block count");
}

std::string_view PoolBudget::KindName() const {
  if (std::holds_alternative<PoolBytesBudget>(kind)) return "pool-bytes";
  if (std::holds_alternative<MemoryFractionBudget>(kind)) return "memory-fraction";
  return "num-blocks";
}

absl::StatusOr<PoolPlan> PlanPool(const KvCacheSpec& spec, const PoolBudget& budget) {
  KVCM_RETURN_IF_ERROR(spec.Validate());
  KVCM_RETURN_IF_ERROR(budget.Validate());

  PoolPlan plan;
  plan.spec = spec;
  plan.budget = budget;
  plan.bytes_per_token = spec.BytesPerToken();
  plan.bytes_per_block = spec.BytesPerBlock();
  KVCM_ASSIGN_OR_RETURN(plan.usable_bytes, budget.UsableBytes(plan.bytes_per_block));
  plan.num_blocks = plan.usable_bytes / plan.bytes_per_block;
  if (plan.num_blocks == 0) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "not one KV-cache block fits: usable memory is ", ExactBytes(plan.usable_bytes),
        " but one block of ", spec.ToString(), " needs ", ExactBytes(plan.bytes_per_block),
        "; give more memory, a smaller block size or a smaller KV dtype"));
  }
  if (plan.num_blocks > kMaxNumBlocks) {
    return absl::InvalidArgumentError(
        absl::StrCat("the budget gives ", plan.num_blocks, " blocks, more than the maximum ",
                     kMaxNumBlocks, " block ids; use a larger block size or a smaller budget"));
  }
  // num_blocks x bytes_per_block <= usable_bytes, and num_blocks <= INT32_MAX with
  // block_size <= kMaxBlockSize: neither product overflows.
  plan.pool_bytes = plan.num_blocks * plan.bytes_per_block;
  plan.unused_bytes = plan.usable_bytes - plan.pool_bytes;
  plan.max_total_tokens = plan.num_blocks * spec.block_size;
  return plan;
}

absl::StatusOr<SequenceFit> SequencesThatFit(const PoolPlan& plan, int64_t seq_len) {
  if (seq_len <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("sequence length must be positive, got ", seq_len));
  }
  const int64_t block_size = plan.spec.block_size;
  KVCM_CHECK(block_size > 0 && plan.num_blocks > 0) << "plan not from PlanPool";
  SequenceFit fit;
  fit.seq_len = seq_len;
  // seq_len / block_size + (remainder != 0): no overflow near INT64_MAX.
  fit.blocks_per_sequence = seq_len / block_size + (seq_len % block_size != 0 ? 1 : 0);
  fit.num_sequences = plan.num_blocks / fit.blocks_per_sequence;
  fit.wasted_tokens_per_sequence = (block_size - seq_len % block_size) % block_size;
  fit.wasted_bytes_per_sequence = fit.wasted_tokens_per_sequence * plan.bytes_per_token;
  return fit;
}

std::string DescribePlan(const PoolPlan& plan) {
  std::string out = absl::StrCat("KV-cache plan for ", plan.spec.ToString(), "\n");
  absl::StrAppend(&out, "  bytes per token  = ", BytesPerTokenFormula(plan.spec), "\n");
  absl::StrAppend(&out, "  bytes per block  = ", BytesPerBlockFormula(plan.spec), "\n");
  absl::StrAppend(
      &out, "  usable bytes     = ", plan.budget.UsableBytesFormula(plan.bytes_per_block), "\n");
  absl::StrAppend(&out, "  num_blocks       = floor(", plan.usable_bytes, " / ",
                  plan.bytes_per_block, ") = ", plan.num_blocks, "\n");
  absl::StrAppend(&out, "  pool bytes       = ", plan.num_blocks, " blocks x ",
                  plan.bytes_per_block, " B = ", ExactBytes(plan.pool_bytes), "\n");
  absl::StrAppend(&out, "  unused bytes     = ", plan.usable_bytes, " - ", plan.pool_bytes, " = ",
                  ExactBytes(plan.unused_bytes), "\n");
  absl::StrAppend(&out, "  max total tokens = ", plan.num_blocks, " blocks x ",
                  plan.spec.block_size, " tokens = ", plan.max_total_tokens,
                  " (TGI's max_batch_total_tokens)\n");
  return out;
}

}  // namespace kvcm
