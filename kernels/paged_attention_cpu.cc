// cpu::PagedAttention: splits the batch into work items, runs them on the thread pool with
// the inner loops of the best ISA, and merges split contexts. The inner loops are in
// paged_attention_cpu_core.inc, compiled three times below (portable, AVX2, AVX-512).

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "common/base/check.h"
#include "common/base/float16.h"
#include "kernels/cpu_isa.h"
#include "kernels/cpu_thread_pool.h"
#include "kernels/paged_attention.h"
#include "kernels/paged_attention_cpu_internal.h"

namespace kvcm::kernels::cpu {
namespace internal {

// Vector types of the inner loops (GCC vector extensions, also understood by Clang).
typedef float V8 __attribute__((vector_size(32)));
typedef float V4 __attribute__((vector_size(16)));
typedef int32_t I8 __attribute__((vector_size(32)));
typedef uint32_t U8 __attribute__((vector_size(32)));
typedef uint16_t H8 __attribute__((vector_size(16)));

#if defined(__clang__)
#define KVCM_SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define KVCM_SHUFFLE(a, b, ...) __builtin_shuffle(a, b, I8{__VA_ARGS__})
#endif

namespace portable {
#define KVCM_ISA_AVX2 0
#define KVCM_ISA_AVX512 0
#include "kernels/paged_attention_cpu_core.inc"  // NOLINT(build/include)
#undef KVCM_ISA_AVX512
#undef KVCM_ISA_AVX2
}  // namespace portable

#if defined(__x86_64__)
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif
namespace avx2 {
#define KVCM_ISA_AVX2 1
#define KVCM_ISA_AVX512 0
#include "kernels/paged_attention_cpu_core.inc"  // NOLINT(build/include)
#undef KVCM_ISA_AVX512
#undef KVCM_ISA_AVX2
}  // namespace avx2
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

// The AVX2 code again, with the dot products and value accumulation in 16-float chunks.
#if defined(__clang__)
#pragma clang attribute push(                                                    \
    __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512dq"))), \
    apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512dq")
// GCC 12's AVX-512 intrinsics start from _mm512_undefined_*(), a self-initialised
// variable, which -Wmaybe-uninitialized reports once inlined.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
namespace avx512 {
#define KVCM_ISA_AVX2 1
#define KVCM_ISA_AVX512 1
#include "kernels/paged_attention_cpu_core.inc"  // NOLINT(build/include)
#undef KVCM_ISA_AVX512
#undef KVCM_ISA_AVX2
}  // namespace avx512
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC diagnostic pop
#pragma GCC pop_options
#endif
#else
namespace avx2 {
AttentionWorkFn GetWorkFn(DType) { return nullptr; }
}  // namespace avx2
namespace avx512 {
AttentionWorkFn GetWorkFn(DType) { return nullptr; }
}  // namespace avx512
#endif

#undef KVCM_SHUFFLE

void MergeGroup(const AttentionJob& job, const AttentionGroup& group) {
  const int32_t g = job.group_size;
  const int32_t num_q_heads = job.batch.num_q_heads;
  const int32_t head_dim = job.view.head_dim;
  const int32_t rows = group.q_count * g;
  const int64_t head_rows = int64_t{job.view.num_kv_heads} * rows;
  const int64_t row_stride = job.PartialRowStride();
  const int64_t part_stride = head_rows * row_stride;
  const int64_t first_token = job.query_start[static_cast<size_t>(group.seq)] + group.q_begin;
  thread_local std::vector<float> acc;
  acc.resize(static_cast<size_t>(head_dim));
  for (int64_t hr = 0; hr < head_rows; ++hr) {
    const float* part0 = job.partials + group.first_offset + hr * row_stride;
    float max = -std::numeric_limits<float>::infinity();
    for (int32_t p = 0; p < group.num_parts; ++p) max = std::max(max, part0[p * part_stride]);
    float sum = 0.0f;
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int32_t p = 0; p < group.num_parts; ++p) {
      const float* part = part0 + p * part_stride;
      if (part[1] == 0.0f) continue;  // this part saw none of the row's context
      const float weight = std::exp(part[0] - max);
      sum += weight * part[1];
      for (int32_t d = 0; d < head_dim; ++d) acc[static_cast<size_t>(d)] += weight * part[2 + d];
    }
    const int64_t h = hr / rows;
    const int64_t r = hr % rows;
    float* o = job.out + ((first_token + r / g) * num_q_heads + h * g + r % g) * head_dim;
    const float inv = 1.0f / sum;
    for (int32_t d = 0; d < head_dim; ++d) o[d] = acc[static_cast<size_t>(d)] * inv;
  }
}

}  // namespace internal

namespace {

using internal::AttentionGroup;
using internal::AttentionJob;
using internal::AttentionWork;
using internal::AttentionWorkFn;
using internal::kQueryTile;
using internal::kTile;

// A context is split only into pieces of at least this many positions: below it, merging
// partial states costs more than an idle thread.
constexpr int32_t kMinSplitPositions = 256;

AttentionWorkFn WorkFn(DType dtype) {
  const CpuIsa isa = ActiveCpuIsa();
  if (isa == CpuIsa::kAvx512) {
    if (AttentionWorkFn fn = internal::avx512::GetWorkFn(dtype)) return fn;
  }
  if (isa == CpuIsa::kAvx2 || isa == CpuIsa::kAvx512) {
    if (AttentionWorkFn fn = internal::avx2::GetWorkFn(dtype)) return fn;
  }
  return internal::portable::GetWorkFn(dtype);
}

// The first position a query at `pos` attends to.
int32_t FirstVisible(const PagedAttentionBatch& batch, int32_t pos) {
  return batch.sliding_window > 0 ? std::max(0, pos - batch.sliding_window + 1) : 0;
}

void CheckBatch(const PagedKvView& view, const PagedAttentionBatch& batch) {
  if (!IsKernelDType(view.dtype)) NoKernelForDType(view.dtype);
  KVCM_CHECK(view.num_kv_heads > 0 && view.head_dim > 0 && view.block_size > 0);
  KVCM_CHECK(batch.num_q_heads > 0 && batch.num_q_heads % view.num_kv_heads == 0)
      << "num_q_heads " << batch.num_q_heads << " is not a multiple of num_kv_heads "
      << view.num_kv_heads;
  KVCM_CHECK(batch.sliding_window >= 0) << "sliding_window " << batch.sliding_window;
  for (int32_t s = 0; s < batch.num_seqs; ++s) {
    const int32_t query_len = batch.query_lens[s];
    const int32_t context_len = batch.context_lens[s];
    KVCM_CHECK(query_len >= 1 && query_len <= context_len)
        << "sequence " << s << ": query_len " << query_len << ", context_len " << context_len;
    const int32_t blocks = (context_len + view.block_size - 1) / view.block_size;
    KVCM_CHECK(blocks <= batch.max_blocks_per_seq)
        << "sequence " << s << ": " << context_len << " tokens need " << blocks
        << " blocks, max_blocks_per_seq is " << batch.max_blocks_per_seq;
    const int32_t* table = batch.block_tables + int64_t{s} * batch.max_blocks_per_seq;
    // Blocks wholly before the first query's window are never read.
    const int32_t first_read = FirstVisible(batch, context_len - query_len) / view.block_size;
    for (int32_t j = first_read; j < blocks; ++j) {
      KVCM_CHECK(table[j] >= 0 && table[j] < view.num_blocks)
          << "sequence " << s << ": block " << table[j] << " at " << j << " of " << view.num_blocks;
    }
  }
}

}  // namespace

void PagedAttention(const PagedKvView& view, const PagedAttentionBatch& batch, const float* query,
                    float* out, int32_t num_threads) {
  if (batch.num_seqs <= 0) return;
  CheckBatch(view, batch);
  CpuThreadPool& pool = CpuThreadPool::Default();
  const int32_t threads =
      num_threads <= 0 ? pool.max_threads() : std::min(num_threads, pool.max_threads());

  // Reused across calls from the same thread, so that a decode step allocates nothing.
  // (Named through references: a lambda naming a thread_local would reach the worker's.)
  thread_local AttentionJob tls_job;
  thread_local std::vector<float> tls_partials;
  AttentionJob& job = tls_job;
  std::vector<float>& partials = tls_partials;
  job.view = view;
  job.batch = batch;
  job.query = query;
  job.out = out;
  job.group_size = batch.num_q_heads / view.num_kv_heads;
  job.padded_dim = (view.head_dim + 7) / 8 * 8;
  job.query_start.resize(static_cast<size_t>(batch.num_seqs));
  job.work.clear();
  job.groups.clear();

  // Work items: tiles of query tokens. Total context positions read, to size splits.
  int64_t start = 0;
  int64_t positions = 0;
  for (int32_t s = 0; s < batch.num_seqs; ++s) {
    job.query_start[static_cast<size_t>(s)] = start;
    const int32_t query_len = batch.query_lens[s];
    const int32_t first_pos = batch.context_lens[s] - query_len;
    for (int32_t q = 0; q < query_len; q += kQueryTile) {
      AttentionWork w;
      w.seq = s;
      w.q_begin = q;
      w.q_count = std::min(kQueryTile, query_len - q);
      w.pos_begin = FirstVisible(batch, first_pos + q);
      w.pos_end = first_pos + q + w.q_count;  // one past the tile's last position
      positions += w.pos_end - w.pos_begin;
      job.work.push_back(w);
    }
    start += query_len;
  }

  // Fewer items than threads x 4: split long contexts so every thread has work.
  const int64_t target_items = int64_t{threads} * 4;
  if (threads > 1 && static_cast<int64_t>(job.work.size()) < target_items) {
    const int64_t per_item = (positions + target_items - 1) / target_items;
    const int32_t split = static_cast<int32_t>(
        std::max<int64_t>(kMinSplitPositions, (per_item + kTile - 1) / kTile * kTile));
    std::vector<AttentionWork> whole;
    whole.swap(job.work);
    int64_t offset = 0;
    for (const AttentionWork& w : whole) {
      if (w.pos_end - w.pos_begin <= split) {
        job.work.push_back(w);
        continue;
      }
      AttentionGroup group;
      group.seq = w.seq;
      group.q_begin = w.q_begin;
      group.q_count = w.q_count;
      group.first_offset = offset;
      group.num_parts = (w.pos_end - w.pos_begin + split - 1) / split;
      const int64_t part_floats = int64_t{batch.num_q_heads} * w.q_count * job.PartialRowStride();
      for (int32_t p = 0; p < group.num_parts; ++p) {
        AttentionWork part = w;
        part.pos_begin = w.pos_begin + p * split;
        part.pos_end = std::min(w.pos_end, w.pos_begin + (p + 1) * split);
        part.partial_offset = offset;
        part.group = static_cast<int32_t>(job.groups.size());
        offset += part_floats;
        job.work.push_back(part);
      }
      job.groups.push_back(group);
    }
    if (partials.size() < static_cast<size_t>(offset)) partials.resize(static_cast<size_t>(offset));
    job.partials = partials.data();
    if (job.group_done_capacity < job.groups.size()) {
      job.group_done = std::make_unique<std::atomic<int32_t>[]>(job.groups.size());
      job.group_done_capacity = job.groups.size();
    }
    for (size_t g = 0; g < job.groups.size(); ++g) job.group_done[g].store(0);
  }

  const AttentionWorkFn fn = WorkFn(view.dtype);
  pool.ParallelFor(static_cast<int64_t>(job.work.size()), threads,
                   [&](int64_t i) { fn(job, job.work[static_cast<size_t>(i)]); });
}

}  // namespace kvcm::kernels::cpu
