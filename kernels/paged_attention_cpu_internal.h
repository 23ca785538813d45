#pragma once
// Internals of cpu::PagedAttention shared by its driver (paged_attention_cpu.cc) and the
// per-ISA copies of its inner loops (paged_attention_cpu_core.inc). Not a public header.

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "kernels/paged_attention.h"
#include "kernels/paged_kv.h"

namespace kvcm::kernels::cpu::internal {

// Context positions per online-softmax step. Scores of one step live in rows x kTile floats.
inline constexpr int32_t kTile = 32;
// Query tokens per work item in prefill: rows = query tokens x query heads per KV head.
inline constexpr int32_t kQueryTile = 8;

// One work item: query tokens [q_begin, q_begin + q_count) of sequence `seq` (indices among
// its new tokens) against context positions [pos_begin, pos_end), every KV head.
struct AttentionWork {
  int32_t seq = 0;
  int32_t q_begin = 0;
  int32_t q_count = 0;
  int32_t pos_begin = 0;
  int32_t pos_end = 0;
  // -1: the item covers the rows' whole context and writes `out`. Otherwise it writes its
  // partial softmax state at partials + partial_offset and counts itself into group `group`.
  int64_t partial_offset = -1;
  int32_t group = -1;
};

// Work items whose context was split, merged by the last one to finish.
struct AttentionGroup {
  int32_t seq = 0;
  int32_t q_begin = 0;
  int32_t q_count = 0;
  int64_t first_offset = 0;  // partial of the group's first item; the others follow
  int32_t num_parts = 0;
};

// Everything a work item reads. Partial states: per item, rows (kv head, query token,
// query head of the group) of [m, l, acc[padded_dim]].
struct AttentionJob {
  PagedKvView view;
  PagedAttentionBatch batch;
  const float* query = nullptr;
  float* out = nullptr;
  std::vector<int64_t> query_start;  // [num_seqs]
  int32_t group_size = 0;            // query heads per KV head
  int32_t padded_dim = 0;            // head_dim rounded up to a multiple of 8
  std::vector<AttentionWork> work;
  std::vector<AttentionGroup> groups;
  std::unique_ptr<std::atomic<int32_t>[]> group_done;  // [>= groups.size()]
  size_t group_done_capacity = 0;
  float* partials = nullptr;  // each item writes only its own rows, so through a const job

  int64_t PartialRowStride() const { return int64_t{padded_dim} + 2; }
};

// Runs one work item (and, when it completes a group, the group's merge).
using AttentionWorkFn = void (*)(const AttentionJob& job, const AttentionWork& work);

// Combines the partial states of `group` into `out`. Scalar; the same for every ISA.
void MergeGroup(const AttentionJob& job, const AttentionGroup& group);

// Each GetWorkFn returns nullptr for a dtype IsKernelDType refuses (fp8).
namespace portable {
AttentionWorkFn GetWorkFn(DType dtype);
}  // namespace portable
namespace avx2 {
// nullptr when the build has no AVX2 path (not x86-64).
AttentionWorkFn GetWorkFn(DType dtype);
}  // namespace avx2
namespace avx512 {
// nullptr when the build has no AVX-512 path (not x86-64).
AttentionWorkFn GetWorkFn(DType dtype);
}  // namespace avx512

}  // namespace kvcm::kernels::cpu::internal
