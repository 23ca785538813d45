// cuda::PagedAttention.
//
// Grid: x = context partition, y = (KV head, group of up to kMaxHeads of its query heads),
// z = (sequence, query split). Block: kWarps warps. A thread block takes one query token at
// a time and its context range in chunks of kChunk positions:
//
//   offsets  byte offset of each position's K/V row, from the block table, into shared memory
//   K pass   lanes_per_token lanes per token (each 32 bytes of the row), 32 / lanes_per_token
//            tokens per warp; dot products with every query head of the group, reduced over
//            the token's lanes with shuffles; scores into shared memory
//   softmax  one warp per query head: running max, exp, running sum (exact expf)
//   V pass   same token mapping; p x V summed per lane, reduced over the warp's tokens, added
//            into the warp's accumulator in shared memory (rescaled when the max grew)
//
// K and V rows are read exactly once per (query token, group of query heads): the whole
// group of a KV head is one thread block, so decode reads each K/V byte once for GQA.
// Partitions (decode only, when batch.max_query_len == 1) write (max, sum, acc) partial
// states that MergeKernel combines; a context that fits one partition is written directly.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <mutex>

#include "common/base/check.h"
#include "common/base/dtype.h"
#include "kernels/cuda_check.h"
#include "kernels/paged_attention.h"

namespace kvcm::kernels::cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kChunk = 256;  // context positions per online-softmax step
constexpr int kMaxHeadDim = 512;
constexpr int kMaxDevices = 64;

struct Params {
  const uint8_t* k;
  const uint8_t* v;
  int64_t block_stride;
  int64_t token_stride;
  int64_t head_stride;
  int32_t block_size;
  int32_t block_shift;  // log2(block_size), or -1 when not a power of two
  int32_t head_dim;
  int32_t num_seqs;
  int32_t num_q_heads;
  int32_t group_size;  // query heads per KV head
  int32_t heads_per_cta;
  int32_t head_groups;  // thread blocks per KV head
  int32_t lanes_per_token;
  int32_t query_split;
  int32_t num_partitions;
  int32_t partition_size;  // positions; meaningful when num_partitions > 1
  bool aligned;            // K/V rows and strides 16-byte aligned
  const int32_t* query_lens;
  const int32_t* context_lens;
  const int32_t* block_tables;
  int32_t max_blocks_per_seq;
  float scale;
  int32_t sliding_window;  // 0: full causal attention
  const float* query;
  float* out;
  float* partials;  // [seq][q head][partition][2 + head_dim]
};

// ---- element loads -------------------------------------------------------------------------

template <DType kDType>
struct Elem;

template <>
struct Elem<DType::kFloat32> {
  static constexpr int kBytes = 4;
  __device__ static float Load1(const uint8_t* p) { return *reinterpret_cast<const float*>(p); }
  // Word w of a row as its 1 (fp32) or 2 (16-bit) elements.
  __device__ static void Unpack(uint32_t w, float* x) { x[0] = __uint_as_float(w); }
  static constexpr int kPerWord = 1;
};

template <>
struct Elem<DType::kFloat16> {
  static constexpr int kBytes = 2;
  __device__ static float Load1(const uint8_t* p) {
    return __half2float(__ushort_as_half(*reinterpret_cast<const unsigned short*>(p)));
  }
  __device__ static void Unpack(uint32_t w, float* x) {
    __half2 h;
    static_assert(sizeof(h) == sizeof(w));
    memcpy(&h, &w, sizeof(w));
    const float2 f = __half22float2(h);
    x[0] = f.x;
    x[1] = f.y;
  }
  static constexpr int kPerWord = 2;
};

template <>
struct Elem<DType::kBFloat16> {
  static constexpr int kBytes = 2;
  __device__ static float Load1(const uint8_t* p) {
    return __uint_as_float(uint32_t{*reinterpret_cast<const unsigned short*>(p)} << 16);
  }
  __device__ static void Unpack(uint32_t w, float* x) {
    x[0] = __uint_as_float(w << 16);
    x[1] = __uint_as_float(w & 0xffff0000u);
  }
  static constexpr int kPerWord = 2;
};

// Elements [d0, d0 + kE) of a row (zeros past head_dim).
template <DType kDType, int kE>
__device__ __forceinline__ void LoadRow(const uint8_t* row, int d0, int head_dim, bool aligned,
                                        float (&x)[kE]) {
  using E = Elem<kDType>;
  constexpr int kBytes = kE * E::kBytes;
  static_assert(kBytes % 16 == 0);
  if (aligned && d0 + kE <= head_dim) {
    const uint4* p = reinterpret_cast<const uint4*>(row + d0 * E::kBytes);
#pragma unroll
    for (int i = 0; i < kBytes / 16; ++i) {
      const uint4 w = p[i];
      const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) E::Unpack(words[j], &x[(i * 4 + j) * E::kPerWord]);
    }
  } else {
#pragma unroll
    for (int e = 0; e < kE; ++e) {
      const int d = d0 + e;
      x[e] = d < head_dim ? E::Load1(row + d * E::kBytes) : 0.0f;
    }
  }
}

// ---- block-wide helpers --------------------------------------------------------------------

// sum(query_lens[0 .. seq)): where the sequence's query tokens start. Every thread calls it.
__device__ int64_t QueryStart(const int32_t* query_lens, int32_t seq) {
  __shared__ int64_t warp_sums[kWarps];
  int64_t sum = 0;
  for (int32_t i = threadIdx.x; i < seq; i += kThreads) sum += query_lens[i];
#pragma unroll
  for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = sum;
  __syncthreads();
  int64_t total = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) total += warp_sums[w];
  __syncthreads();
  return total;
}

__device__ __forceinline__ float WarpMax(float x) {
#pragma unroll
  for (int off = 16; off > 0; off /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, off));
  return x;
}

__device__ __forceinline__ float WarpSum(float x) {
#pragma unroll
  for (int off = 16; off > 0; off /= 2) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

// ---- the attention kernel ------------------------------------------------------------------

// Dynamic shared memory, in floats unless noted:
//   q    [heads_per_cta][head_dim]           scaled queries
//   acc  [kWarps][heads_per_cta][head_dim]   per-warp running sum of p x V
//   s    [kChunk][kMaxHeads]                 scores, then probabilities
//   off  [kChunk] int64                      row offsets of the chunk's positions
template <int kMaxHeads>
__host__ __device__ constexpr size_t SmemBytes(int heads, int head_dim) {
  return sizeof(float) * (size_t(heads) * head_dim * (1 + kWarps) + size_t(kChunk) * kMaxHeads) +
         sizeof(int64_t) * kChunk;
}

template <DType kDType, int kE, int kMaxHeads>
__global__ void __launch_bounds__(kThreads, 3) AttentionKernel(Params prm) {
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ float m_s[kMaxHeads];
  __shared__ float l_s[kMaxHeads];
  __shared__ float alpha_s[kMaxHeads];

  const int head_dim = prm.head_dim;
  const int gc_max = prm.heads_per_cta;
  int64_t* off_s = reinterpret_cast<int64_t*>(smem);
  float* q_s = reinterpret_cast<float*>(smem + sizeof(int64_t) * kChunk);
  float* acc_s = q_s + gc_max * head_dim;
  float* s_s = acc_s + kWarps * gc_max * head_dim;

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int lanes = prm.lanes_per_token;
  const int tokens_per_warp = 32 / lanes;
  const int li = lane % lanes;
  const int grp = lane / lanes;
  const int d0 = li * kE;

  const int32_t seq = blockIdx.z / prm.query_split;
  const int32_t q_first = blockIdx.z % prm.query_split;
  const int32_t kv_head = blockIdx.y / prm.head_groups;
  const int32_t g0 = (blockIdx.y % prm.head_groups) * gc_max;
  const int gc = min(gc_max, prm.group_size - g0);
  const int32_t part = blockIdx.x;

  const int32_t context_len = prm.context_lens[seq];
  const int32_t query_len = prm.query_lens[seq];
  const bool split = prm.num_partitions > 1 && query_len == 1 && context_len > prm.partition_size;
  if (part > 0 && !split) return;
  if (split && int64_t{part} * prm.partition_size >= context_len) return;
  if (q_first >= query_len) return;
  const int64_t query_start = QueryStart(prm.query_lens, seq);
  const int32_t* table = prm.block_tables + int64_t{seq} * prm.max_blocks_per_seq;
  const uint8_t* k_head = prm.k + kv_head * prm.head_stride;
  const uint8_t* v_head = prm.v + kv_head * prm.head_stride;
  const int32_t first_q_head = kv_head * prm.group_size + g0;

  for (int32_t q = q_first; q < query_len; q += prm.query_split) {
    const int64_t token = query_start + q;
    int32_t begin = 0;
    int32_t end = context_len - query_len + q + 1;
    if (split) {
      begin = part * prm.partition_size;
      end = min(end, begin + prm.partition_size);
    }
    // A sliding window: nothing before its first position is read (a partition wholly before
    // it stays empty, and its partial state weighs nothing in MergeKernel).
    if (prm.sliding_window > 0) {
      begin = max(begin, context_len - query_len + q + 1 - prm.sliding_window);
    }

    for (int i = tid; i < gc * head_dim; i += kThreads) {
      const int g = i / head_dim;
      q_s[i] = prm.query[(token * prm.num_q_heads + first_q_head + g) * head_dim + i % head_dim] *
               prm.scale;
    }
    for (int i = tid; i < kWarps * gc_max * head_dim; i += kThreads) acc_s[i] = 0.0f;
    if (tid < kMaxHeads) {
      m_s[tid] = -INFINITY;
      l_s[tid] = 0.0f;
    }

    for (int32_t c0 = begin; c0 < end; c0 += kChunk) {
      const int n = min(kChunk, end - c0);
      for (int i = tid; i < n; i += kThreads) {
        const int32_t pos = c0 + i;
        const int32_t b = prm.block_shift >= 0 ? pos >> prm.block_shift : pos / prm.block_size;
        const int32_t t = pos - b * prm.block_size;
        off_s[i] = table[b] * prm.block_stride + t * prm.token_stride;
      }
      __syncthreads();  // offsets, q_s, acc_s and the previous chunk's readers

      // K pass.
      {
        float qr[kMaxHeads][kE];
#pragma unroll
        for (int g = 0; g < kMaxHeads; ++g) {
#pragma unroll
          for (int e = 0; e < kE; ++e) {
            qr[g][e] = g < gc && d0 + e < head_dim ? q_s[g * head_dim + d0 + e] : 0.0f;
          }
        }
#pragma unroll 2
        for (int base = warp * tokens_per_warp; base < n; base += kWarps * tokens_per_warp) {
          const int t = base + grp;
          float kx[kE];
          if (t < n) {
            LoadRow<kDType, kE>(k_head + off_s[t], d0, head_dim, prm.aligned, kx);
          } else {
#pragma unroll
            for (int e = 0; e < kE; ++e) kx[e] = 0.0f;
          }
#pragma unroll
          for (int g = 0; g < kMaxHeads; ++g) {
            float dot = 0.0f;
#pragma unroll
            for (int e = 0; e < kE; ++e) dot = fmaf(qr[g][e], kx[e], dot);
            for (int off = lanes / 2; off > 0; off /= 2) {
              dot += __shfl_xor_sync(0xffffffffu, dot, off);
            }
            if (li == 0 && t < n && g < gc) s_s[t * kMaxHeads + g] = dot;
          }
        }
      }
      __syncthreads();

      // Online softmax, one warp per query head.
      for (int g = warp; g < gc; g += kWarps) {
        float mx = -INFINITY;
        for (int t = lane; t < n; t += 32) mx = fmaxf(mx, s_s[t * kMaxHeads + g]);
        mx = WarpMax(mx);
        const float m_old = m_s[g];
        const float m_new = fmaxf(m_old, mx);
        float sum = 0.0f;
        for (int t = lane; t < n; t += 32) {
          const float p = expf(s_s[t * kMaxHeads + g] - m_new);
          s_s[t * kMaxHeads + g] = p;
          sum += p;
        }
        sum = WarpSum(sum);
        if (lane == 0) {
          const float alpha = expf(m_old - m_new);  // 0 on the first chunk
          alpha_s[g] = alpha;
          l_s[g] = l_s[g] * alpha + sum;
          m_s[g] = m_new;
        }
      }
      __syncthreads();

      // V pass.
      {
        float acc[kMaxHeads][kE];
#pragma unroll
        for (int g = 0; g < kMaxHeads; ++g) {
#pragma unroll
          for (int e = 0; e < kE; ++e) acc[g][e] = 0.0f;
        }
#pragma unroll 2
        for (int base = warp * tokens_per_warp; base < n; base += kWarps * tokens_per_warp) {
          const int t = base + grp;
          if (t >= n) continue;
          float vx[kE];
          LoadRow<kDType, kE>(v_head + off_s[t], d0, head_dim, prm.aligned, vx);
#pragma unroll
          for (int g = 0; g < kMaxHeads; ++g) {
            const float p = g < gc ? s_s[t * kMaxHeads + g] : 0.0f;
#pragma unroll
            for (int e = 0; e < kE; ++e) acc[g][e] = fmaf(p, vx[e], acc[g][e]);
          }
        }
        // Sum over the warp's tokens: lanes with the same li hold the same elements.
        for (int off = lanes; off < 32; off *= 2) {
#pragma unroll
          for (int g = 0; g < kMaxHeads; ++g) {
#pragma unroll
            for (int e = 0; e < kE; ++e) acc[g][e] += __shfl_xor_sync(0xffffffffu, acc[g][e], off);
          }
        }
        if (grp == 0) {
#pragma unroll
          for (int g = 0; g < kMaxHeads; ++g) {
            if (g >= gc) continue;
            float* a = acc_s + (warp * gc_max + g) * head_dim;
            const float alpha = alpha_s[g];
#pragma unroll
            for (int e = 0; e < kE; ++e) {
              if (d0 + e < head_dim) a[d0 + e] = a[d0 + e] * alpha + acc[g][e];
            }
          }
        }
      }
      __syncthreads();
    }

    // Sum the warps' accumulators; write the output or this partition's partial state.
    const bool direct = !split;
    for (int i = tid; i < gc * head_dim; i += kThreads) {
      const int g = i / head_dim;
      const int d = i % head_dim;
      float a = 0.0f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) a += acc_s[(w * gc_max + g) * head_dim + d];
      const int64_t q_head = first_q_head + g;
      if (direct) {
        prm.out[(token * prm.num_q_heads + q_head) * head_dim + d] = a / l_s[g];
      } else {
        float* p =
            prm.partials + ((int64_t{seq} * prm.num_q_heads + q_head) * prm.num_partitions + part) *
                               (head_dim + 2);
        if (d == 0) {
          p[0] = m_s[g];
          p[1] = l_s[g];
        }
        p[2 + d] = a;
      }
    }
    __syncthreads();  // before the next query token reuses q_s, acc_s, m_s, l_s
  }
}

// Combines the partitions of each split decode sequence: one thread block per (sequence,
// query head).
__global__ void __launch_bounds__(kThreads) MergeKernel(Params prm) {
  const int32_t seq = blockIdx.x;
  const int32_t q_head = blockIdx.y;
  const int32_t context_len = prm.context_lens[seq];
  if (prm.query_lens[seq] != 1 || context_len <= prm.partition_size) return;
  const int64_t token = QueryStart(prm.query_lens, seq);
  const int32_t parts = (context_len + prm.partition_size - 1) / prm.partition_size;
  const int64_t row = prm.head_dim + 2;
  const float* p =
      prm.partials + (int64_t{seq} * prm.num_q_heads + q_head) * prm.num_partitions * row;
  float max = -INFINITY;
  for (int32_t i = 0; i < parts; ++i) max = fmaxf(max, p[i * row]);
  float sum = 0.0f;
  for (int32_t i = 0; i < parts; ++i) sum += expf(p[i * row] - max) * p[i * row + 1];
  const float inv = 1.0f / sum;
  for (int d = threadIdx.x; d < prm.head_dim; d += kThreads) {
    float a = 0.0f;
    for (int32_t i = 0; i < parts; ++i) a += expf(p[i * row] - max) * p[i * row + 2 + d];
    prm.out[(token * prm.num_q_heads + q_head) * prm.head_dim + d] = a * inv;
  }
}

// ---- host side -----------------------------------------------------------------------------

struct DeviceInfo {
  int num_sms = 0;
  cudaMemPool_t scratch = nullptr;  // private pool for partial states, never trimmed
};

// Per-device facts and the scratch pool, set up on first use.
const DeviceInfo& Device() {
  static std::mutex mu;
  static DeviceInfo infos[kMaxDevices];
  int device = 0;
  KVCM_CUDA_CHECK(cudaGetDevice(&device));
  KVCM_CHECK(device >= 0 && device < kMaxDevices) << "device " << device;
  std::lock_guard<std::mutex> lock(mu);
  DeviceInfo& info = infos[device];
  if (info.num_sms == 0) {
    KVCM_CUDA_CHECK(cudaDeviceGetAttribute(&info.num_sms, cudaDevAttrMultiProcessorCount, device));
    cudaMemPoolProps props = {};
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = device;
    KVCM_CUDA_CHECK(cudaMemPoolCreate(&info.scratch, &props));
    uint64_t keep = std::numeric_limits<uint64_t>::max();
    KVCM_CUDA_CHECK(cudaMemPoolSetAttribute(info.scratch, cudaMemPoolAttrReleaseThreshold, &keep));
  }
  return info;
}

template <DType kDType, int kE, int kMaxHeads>
void Launch(const Params& prm, dim3 grid, cudaStream_t stream) {
  const size_t smem = SmemBytes<kMaxHeads>(prm.heads_per_cta, prm.head_dim);
  auto* kernel = &AttentionKernel<kDType, kE, kMaxHeads>;
  if (smem > 48 * 1024) {
    KVCM_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem)));
  }
  kernel<<<grid, kThreads, smem, stream>>>(prm);
  KVCM_CUDA_CHECK(cudaGetLastError());
}

template <DType kDType>
void LaunchForDType(const Params& prm, dim3 grid, cudaStream_t stream, int elems_per_lane) {
  if constexpr (kDType == DType::kFloat32) {
    if (elems_per_lane == 8) return Launch<kDType, 8, 8>(prm, grid, stream);
  }
  Launch<kDType, 16, 4>(prm, grid, stream);
}

int CeilPow2(int x) {
  int p = 1;
  while (p < x) p *= 2;
  return p;
}

}  // namespace

void PagedAttention(const PagedKvView& view, const PagedAttentionBatch& batch, const float* query,
                    float* out, void* stream) {
  if (batch.num_seqs <= 0) return;
  KVCM_CHECK(view.num_kv_heads > 0 && batch.num_q_heads % view.num_kv_heads == 0)
      << "num_q_heads " << batch.num_q_heads << ", num_kv_heads " << view.num_kv_heads;
  KVCM_CHECK(view.head_dim > 0 && view.head_dim <= kMaxHeadDim) << "head_dim " << view.head_dim;
  KVCM_CHECK(view.block_size > 0);
  if (!IsKernelDType(view.dtype)) NoKernelForDType(view.dtype);
  const DeviceInfo& device = Device();
  cudaStream_t s = static_cast<cudaStream_t>(stream);

  Params prm = {};
  prm.k = view.k;
  prm.v = view.v;
  prm.block_stride = view.block_stride;
  prm.token_stride = view.token_stride;
  prm.head_stride = view.head_stride;
  prm.block_size = view.block_size;
  prm.block_shift = -1;
  for (int shift = 0; shift < 31; ++shift) {
    if ((1 << shift) == view.block_size) prm.block_shift = shift;
  }
  prm.head_dim = view.head_dim;
  prm.num_seqs = batch.num_seqs;
  prm.num_q_heads = batch.num_q_heads;
  prm.group_size = batch.num_q_heads / view.num_kv_heads;
  prm.query_lens = batch.query_lens;
  prm.context_lens = batch.context_lens;
  prm.block_tables = batch.block_tables;
  prm.max_blocks_per_seq = batch.max_blocks_per_seq;
  prm.scale = batch.scale;
  prm.sliding_window = batch.sliding_window;
  prm.query = query;
  prm.out = out;

  // 32 bytes of a row per lane: 16 elements of fp16/bf16, 8 of fp32 (16 past head dim 256).
  const int elems_per_lane = view.dtype == DType::kFloat32 && view.head_dim <= 256 ? 8 : 16;
  const int max_heads = elems_per_lane == 8 ? 8 : 4;
  prm.lanes_per_token = CeilPow2((view.head_dim + elems_per_lane - 1) / elems_per_lane);
  prm.head_groups = (prm.group_size + max_heads - 1) / max_heads;
  prm.heads_per_cta = (prm.group_size + prm.head_groups - 1) / prm.head_groups;
  const uintptr_t misalign =
      reinterpret_cast<uintptr_t>(view.k) | reinterpret_cast<uintptr_t>(view.v) |
      static_cast<uintptr_t>(view.block_stride) | static_cast<uintptr_t>(view.token_stride) |
      static_cast<uintptr_t>(view.head_stride);
  prm.aligned = misalign % 16 == 0;

  const int64_t base_ctas = int64_t{batch.num_seqs} * view.num_kv_heads * prm.head_groups;
  KVCM_CHECK(int64_t{view.num_kv_heads} * prm.head_groups <= 65535 && batch.num_seqs <= 65535)
      << "grid y/z limit: " << view.num_kv_heads << " kv heads, " << batch.num_seqs << " seqs";
  prm.query_split = static_cast<int32_t>(
      std::clamp<int64_t>(batch.max_query_len, 1, std::max(1, 65535 / batch.num_seqs)));
  prm.num_partitions = 1;
  prm.partition_size = std::numeric_limits<int32_t>::max();
  if (batch.max_query_len == 1) {
    // Enough partitions for about 4 thread blocks per SM, of at least kChunk positions each.
    const int64_t max_context = int64_t{batch.max_blocks_per_seq} * view.block_size;
    const int64_t want = (4 * int64_t{device.num_sms} + base_ctas - 1) / base_ctas;
    const int64_t size =
        std::max<int64_t>(kChunk, ((max_context + want - 1) / want + kChunk - 1) / kChunk * kChunk);
    prm.partition_size = static_cast<int32_t>(std::min<int64_t>(size, 1 << 30));
    prm.num_partitions = static_cast<int32_t>((max_context + size - 1) / size);
    if (prm.num_partitions <= 1) {
      prm.num_partitions = 1;
      prm.partition_size = std::numeric_limits<int32_t>::max();
    }
  }

  float* partials = nullptr;
  if (prm.num_partitions > 1) {
    const size_t bytes = sizeof(float) * static_cast<size_t>(batch.num_seqs) *
                         static_cast<size_t>(batch.num_q_heads) *
                         static_cast<size_t>(prm.num_partitions) *
                         static_cast<size_t>(view.head_dim + 2);
    void* ptr = nullptr;
    KVCM_CUDA_CHECK(cudaMallocFromPoolAsync(&ptr, bytes, device.scratch, s));
    partials = static_cast<float*>(ptr);
    prm.partials = partials;
  }

  const dim3 grid(static_cast<unsigned>(prm.num_partitions),
                  static_cast<unsigned>(view.num_kv_heads * prm.head_groups),
                  static_cast<unsigned>(int64_t{batch.num_seqs} * prm.query_split));
  switch (view.dtype) {
    case DType::kFloat32:
      LaunchForDType<DType::kFloat32>(prm, grid, s, elems_per_lane);
      break;
    case DType::kFloat16:
      LaunchForDType<DType::kFloat16>(prm, grid, s, elems_per_lane);
      break;
    case DType::kBFloat16:
      LaunchForDType<DType::kBFloat16>(prm, grid, s, elems_per_lane);
      break;
    case DType::kFloat8E4M3:
    case DType::kFloat8E5M2:
      NoKernelForDType(view.dtype);
  }
  if (partials != nullptr) {
    MergeKernel<<<dim3(static_cast<unsigned>(batch.num_seqs),
                       static_cast<unsigned>(batch.num_q_heads)),
                  kThreads, 0, s>>>(prm);
    KVCM_CUDA_CHECK(cudaGetLastError());
    KVCM_CUDA_CHECK(cudaFreeAsync(partials, s));
  }
}

}  // namespace kvcm::kernels::cuda
