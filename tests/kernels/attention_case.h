#pragma once
// Shared by the kernel tests (CPU and GPU): random paged-attention inputs in a real pool
// layout, and a naive contiguous reference in float64.
//
// A case's K/V are random fp32 values written with cpu::WriteKv into the blocks of each
// sequence's table (a random permutation of the pool's block ids when `shuffled`). Every
// byte not written holds 0xFF, a NaN in every dtype, so a kernel that reads a position past
// a context, or an unused block, produces NaN. The reference reads the stored (rounded)
// K/V back through PoolLayout::Offset and decodes them with its own conversions, so its
// result is exact for the stored values and the tolerance is about the kernel alone.

#include <cstdint>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "common/base/dtype.h"
#include "common/memory/pool_layout.h"
#include "common/sizing/kv_cache_spec.h"
#include "kernels/paged_attention.h"
#include "kernels/paged_kv.h"

namespace kvcm {

// Names the dtype in test output ("fp16") instead of dumping its bytes.
inline void PrintTo(DType dtype, std::ostream* os) { *os << DTypeName(dtype); }

}  // namespace kvcm

namespace kvcm::kernels::testing_util {

struct SeqShape {
  int32_t context_len = 0;
  int32_t query_len = 0;
};

struct AttentionCase {
  std::string name;
  int32_t block_size = 16;
  int32_t num_kv_heads = 2;
  int32_t group_size = 4;  // query heads per KV head
  int32_t head_dim = 64;
  std::vector<SeqShape> seqs;
  bool shuffled = true;
  float value_range = 1.0f;  // Q, K and V uniform in [-value_range, value_range]
  uint64_t seed = 0;
  // > 0: sliding-window attention (PagedAttentionBatch::sliding_window).
  int32_t sliding_window = 0;
  // With a window: the table entries of the blocks wholly before every query's window are
  // -1 (as the cache manager's release leaves them), so a kernel that reads one fails.
  bool release_behind_window = false;
};

// The cases every attention test runs (block sizes 1, 3, 5, 16, 32; GQA 1, 2, 3, 4, 8 and
// MQA; head dims 8, 20, 64, 128; decode, prefill over a cached prefix, mixed batches,
// contexts long enough to be split across threads or thread blocks; sliding windows of
// several lengths, with and without the blocks behind them released), with fixed seeds.
std::vector<AttentionCase> StandardAttentionCases();

// Inputs of one case in host memory. Not movable: batch points into it.
struct AttentionInputs {
  AttentionInputs() = default;
  AttentionInputs(const AttentionInputs&) = delete;
  AttentionInputs& operator=(const AttentionInputs&) = delete;

  KvCacheSpec spec;  // 2 layers; the case uses layer 1
  PoolLayout layout;
  std::vector<uint8_t> pool;
  PagedKvView view;  // layer 1 of pool
  std::vector<int32_t> query_lens;
  std::vector<int32_t> context_lens;
  std::vector<int32_t> block_tables;  // [seq][max_blocks_per_seq], unused entries -1
  int32_t max_blocks_per_seq = 0;
  int32_t max_query_len = 0;
  int64_t total_query_tokens = 0;
  std::vector<float> query;
  PagedAttentionBatch batch;  // points into the vectors above (host pointers)
  int64_t OutputSize() const { return total_query_tokens * batch.num_q_heads * spec.head_dim; }
};

std::unique_ptr<AttentionInputs> MakeAttentionInputs(const AttentionCase& c, DType dtype);

// Element `d` of the K (kv = 0) or V (kv = 1) row of (block, token, head) in layer 1,
// decoded independently of common/base/float16.h.
double ReadPoolElement(const AttentionInputs& in, int32_t kv, int32_t block, int32_t token,
                       int32_t head, int32_t d);

// Naive attention over contiguous copies of each sequence's K/V, in float64 (within the
// window when the case has one).
std::vector<double> ReferenceAttention(const AttentionInputs& in);

// max |got - want| / max |want| (the error relative to the output's scale; outputs are
// convex combinations of V rows, so max |want| is of the order of the values). NaN in
// `got` gives infinity.
double RelativeError(const std::vector<float>& got, const std::vector<double>& want);
double RelativeError(const std::vector<float>& got, const std::vector<float>& want);

// Decodes fp16 / bf16 bits with ldexp, without the bit tricks of common/base/float16.h.
double DecodeHalfIndependent(uint16_t h);
double DecodeBFloat16Independent(uint16_t b);

}  // namespace kvcm::kernels::testing_util
