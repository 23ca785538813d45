#pragma once
// Paged attention over the pool, with grouped-query attention, for any block size.
//
// A batch holds num_seqs sequences. Sequence i has context_lens[i] tokens whose K/V are
// already in the pool (including the new ones: WriteKv runs first), in the blocks
// block_tables[i * max_blocks_per_seq + j], j = 0 .. ceil(context_lens[i] / block_size) - 1.
// Its query_lens[i] new tokens are the LAST query_lens[i] of its context: query token q
// (0-based among the new ones) sits at position p = context_lens[i] - query_lens[i] + q and
// attends causally to positions 0 .. p; with a sliding window of W tokens
// (batch.sliding_window = W > 0) to positions max(0, p - W + 1) .. p only, as Hugging Face
// transformers and llama.cpp mask it. Table entries of blocks that lie wholly before every
// query's window are never read, so they may be anything (kNoBlock where the cache manager
// released them behind the window).
//
//   query: [total_query_tokens][num_q_heads][head_dim] fp32, sequences back to back in
//          batch order (query_start[i] = sum of query_lens before i)
//   out:   same shape as query
//
// Query head h reads KV head h / (num_q_heads / num_kv_heads).
// Decode is the case query_lens[i] == 1 for every i; prefill over a cached prefix is
// query_lens[i] > 1 with context_lens[i] - query_lens[i] cached tokens.
//
// REQUIRES: num_q_heads % view.num_kv_heads == 0; 1 <= query_lens[i] <= context_lens[i];
// every block id in use (within the window) < view.num_blocks; IsKernelDType(view.dtype) (an fp8
// view CHECK-fails).

#include <cstdint>

#include "kernels/paged_kv.h"

namespace kvcm::kernels {

struct PagedAttentionBatch {
  int32_t num_seqs = 0;
  int32_t num_q_heads = 0;
  const int32_t* query_lens = nullptr;    // [num_seqs]
  const int32_t* context_lens = nullptr;  // [num_seqs]
  const int32_t* block_tables = nullptr;  // [num_seqs][max_blocks_per_seq]
  int32_t max_blocks_per_seq = 0;
  float scale = 1.0f;  // usually 1 / sqrt(head_dim)
  // Sliding-window attention: a query at position p sees positions p - sliding_window + 1 ..
  // p. 0 = full causal attention.
  int32_t sliding_window = 0;
  // Optional host-side hint: max(query_lens), or 0 when unknown. The CUDA launcher cannot
  // read the (device) query_lens, so it sizes its grid from this: 1 lets it split long
  // decode contexts across thread blocks, > 1 spreads prefill query tokens over thread
  // blocks. Any value gives the same result; a wrong one only costs speed. The CPU kernel
  // ignores it.
  int32_t max_query_len = 0;
};

namespace cpu {
// Multi-threaded on up to `num_threads` threads (0 = hardware concurrency) of a process-wide
// pool (kernels/cpu_thread_pool.h); the calling thread is one of them. Work items are
// (sequence, tile of up to 8 query tokens, range of context) over all KV heads, reading K/V
// token-major (a token's heads are adjacent) as a few sequential runs; when there are fewer
// items than 4 per thread, long contexts are split into ranges whose partial softmax states
// are merged (flash-decoding). Online softmax: memory per work item is O(rows x head_dim),
// whatever the context length. Compute is fp32; fp16/bf16 are widened on load (AVX2 + FMA +
// F16C when the CPU has them, checked at run time; portable code otherwise). The result
// does not depend on the order of the block table, only its speed slightly
// (docs/PERFORMANCE.md).
// Thread safety: callable from several threads; calls share the pool and take turns. Called
// from inside a task of that pool, it runs on the calling thread alone.
void PagedAttention(const PagedKvView& view, const PagedAttentionBatch& batch, const float* query,
                    float* out, int32_t num_threads = 0);
}  // namespace cpu

namespace cuda {
// Device pointers for everything in `batch` and for query/out. Asynchronous on `stream`.
// One thread block per (sequence, KV head, group of up to 4 of its query heads (8 for fp32
// with head_dim <= 256), context partition, query split); K/V of a head are read once for
// all the query heads of the group (GQA). When batch.max_query_len == 1, long contexts are
// split into partitions merged by a second kernel; the partial states live in a
// stream-ordered allocation from a memory pool private to these kernels. A thread block
// takes one query token at a time, so prefill re-reads the K/V of the prefix once per query
// token (from L2 mostly): correct for any length, but not tiled like FlashAttention, and
// slow for long prompts.
// REQUIRES: view.head_dim <= 512; num_seqs <= 65535.
void PagedAttention(const PagedKvView& view, const PagedAttentionBatch& batch, const float* query,
                    float* out, void* stream);
}  // namespace cuda

}  // namespace kvcm::kernels
