#pragma once

// The shape of one KV-cache block: which model dimensions it holds and in what dtype.
//
// A block holds the keys and values of `block_size` consecutive tokens of one sequence, for
// every layer and every KV head (docs/architecture.md). Its size is
//
//   bytes per token = 2 (K and V) x num_layers x num_kv_heads x head_dim x dtype bytes
//   bytes per block = bytes per token x block_size
//
// which is TGI's `total_cache_size` with BLOCK_SIZE = block_size.
//
// Thread safety: plain values; the functions here have no shared state.

#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/base/dtype.h"

namespace kvcm {

// DType and DTypeBytes are in common/base/dtype.h (no Abseil there, for nvcc).

// Short canonical name: "fp32", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2". ParseDType accepts
// each of these.
std::string_view DTypeName(DType dtype);

// Parses a dtype name, case-insensitively:
//   fp32, float32                     -> kFloat32
//   fp16, float16, half               -> kFloat16
//   bf16, bfloat16                    -> kBFloat16
//   fp8, fp8_e4m3, float8_e4m3fn      -> kFloat8E4M3 (the usual choice for an fp8 KV cache)
//   fp8_e5m2, float8_e5m2             -> kFloat8E5M2
// Anything else is INVALID_ARGUMENT listing the accepted names.
absl::StatusOr<DType> ParseDType(std::string_view name);

// Upper bound on KvCacheSpec::block_size. Real engines use 1 to 256 tokens per block; a
// larger value is almost certainly a typo (a byte count given as a token count).
inline constexpr int32_t kMaxBlockSize = 1024;

// The model dimensions that fix the size of a KV-cache block.
//
// A plain struct: fields may hold anything until Validate() says otherwise. The size
// accessors REQUIRE Validate().ok() and CHECK-fail otherwise, so callers that take a spec
// from users validate it first (PlanPool and SpecFromHfConfig do).
struct KvCacheSpec {
  int32_t num_layers = 0;    // transformer layers (num_hidden_layers), each with its own KV
  int32_t num_kv_heads = 0;  // KV heads per layer: fewer than query heads under GQA/MQA
  int32_t head_dim = 0;      // elements per head
  DType dtype = DType::kBFloat16;
  int32_t block_size = 16;  // tokens per block; need not be a power of two

  // OK when every dimension is positive, block_size <= kMaxBlockSize and BytesPerBlock()
  // fits in an int64. Otherwise INVALID_ARGUMENT naming the offending field.
  absl::Status Validate() const;

  // 2 x num_layers x num_kv_heads x head_dim x DTypeBytes(dtype).
  // REQUIRES: Validate().ok().
  int64_t BytesPerToken() const;

  // BytesPerToken() x block_size.
  // REQUIRES: Validate().ok().
  int64_t BytesPerBlock() const;

  // One line for logs, e.g.
  // "32 layers x 8 KV heads x head dim 128, bf16, block size 16".
  std::string ToString() const;
};

bool operator==(const KvCacheSpec& a, const KvCacheSpec& b);

// The bytes-per-token and bytes-per-block formulas with the numbers filled in, for logs and
// `kvcmctl plan`:
//   "2 (K and V) x 32 layers x 8 KV heads x 128 head dim x 2 bytes (bf16) = 131072 B (128.00 KiB)"
//   "131072 B per token x 16 tokens per block = 2097152 B (2.00 MiB)"
// REQUIRES: spec.Validate().ok().
std::string BytesPerTokenFormula(const KvCacheSpec& spec);
std::string BytesPerBlockFormula(const KvCacheSpec& spec);

}  // namespace kvcm
