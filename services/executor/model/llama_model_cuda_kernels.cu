// LlamaCudaModel's own kernels (llama_model_cuda_kernels.h). Each one computes what the
// matching step of LlamaModel's CPU forward computes, in fp32, except that sums run in
// another order and multiply-adds are fused: results agree with the CPU's to fp32
// rounding, not bit for bit.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "common/base/dtype.h"
#include "kernels/cuda_check.h"
#include "services/executor/model/llama_model_cuda_kernels.h"

namespace kvcm::executor::llama_cuda {
namespace {

constexpr int kThreads = 256;

cudaStream_t AsStream(void* stream) { return static_cast<cudaStream_t>(stream); }

// Blocks for a grid-stride loop over n elements.
unsigned GridFor(int64_t n) {
  return static_cast<unsigned>(std::clamp<int64_t>((n + kThreads - 1) / kThreads, 1, 65535));
}

// A stored weight widened to fp32 (exact for each type).
__device__ __forceinline__ float Widen(float w) { return w; }
__device__ __forceinline__ float Widen(__half w) { return __half2float(w); }
__device__ __forceinline__ float Widen(__nv_bfloat16 w) { return __bfloat162float(w); }

template <typename T>
__global__ void EmbedKernel(const int32_t* tokens, const T* table, int64_t h, float* x) {
  const int64_t row = blockIdx.x;
  const T* src = table + int64_t{tokens[row]} * h;
  float* dst = x + row * h;
  for (int64_t i = threadIdx.x; i < h; i += blockDim.x) dst[i] = Widen(src[i]);
}

// Round to nearest, ties to even, as HalfFromFloat / BFloat16FromFloat (common/base/float16.h) do
// on the host.
__global__ void NarrowToHalfKernel(const float* x, int64_t n, __half* out) {
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    out[i] = __float2half_rn(x[i]);
  }
}

__global__ void NarrowToBf16Kernel(const float* x, int64_t n, __nv_bfloat16* out) {
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    out[i] = __float2bfloat16_rn(x[i]);
  }
}

__global__ void AddBiasKernel(float* y, int64_t n, int64_t width, const float* bias) {
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    y[i] += bias[i % width];
  }
}

// One thread block per row.
__global__ void __launch_bounds__(kThreads)
    RmsNormKernel(const float* x, int64_t h, const float* weight, double eps, float* out) {
  __shared__ double partial[kThreads];
  const float* xr = x + int64_t{blockIdx.x} * h;
  double sum = 0;
  for (int64_t i = threadIdx.x; i < h; i += kThreads) {
    sum += static_cast<double>(xr[i]) * xr[i];
  }
  partial[threadIdx.x] = sum;
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) partial[threadIdx.x] += partial[threadIdx.x + stride];
    __syncthreads();
  }
  const float inv_rms = static_cast<float>(1.0 / sqrt(partial[0] / static_cast<double>(h) + eps));
  float* o = out + int64_t{blockIdx.x} * h;
  for (int64_t i = threadIdx.x; i < h; i += kThreads) o[i] = weight[i] * (xr[i] * inv_rms);
}

// Up to kMaxVecRows rows: one warp per output feature o; its lanes stride over `in`, so a
// warp reads w[o] once in 128-byte pieces and x (small, cached) for every row.
constexpr int kMaxVecRows = 8;
constexpr int kWarpsPerBlock = kThreads / 32;

__global__ void __launch_bounds__(kThreads)
    MatVecKernel(const float* x, int rows, int64_t in, const float* w, int64_t out, float* y) {
  const int lane = threadIdx.x % 32;
  const int64_t o = int64_t{blockIdx.x} * kWarpsPerBlock + threadIdx.x / 32;
  if (o >= out) return;  // the whole warp: no block-wide barrier below
  const float* wo = w + o * in;
  float acc[kMaxVecRows] = {};
  for (int64_t k = lane; k < in; k += 32) {
    const float wk = wo[k];
#pragma unroll
    for (int r = 0; r < kMaxVecRows; ++r) {
      if (r < rows) acc[r] += x[r * in + k] * wk;
    }
  }
#pragma unroll
  for (int r = 0; r < kMaxVecRows; ++r) {
    float v = acc[r];
    for (int offset = 16; offset > 0; offset /= 2) v += __shfl_down_sync(0xffffffffu, v, offset);
    if (lane == 0 && r < rows) y[r * out + o] = v;
  }
}

// More rows: a 16 x 16 tile of y per thread block, stepping through `in` 16 at a time.
constexpr int kTile = 16;

__global__ void __launch_bounds__(kTile* kTile)
    MatMulTiledKernel(const float* x, int64_t rows, int64_t in, const float* w, int64_t out,
                      float* y) {
  __shared__ float xs[kTile][kTile + 1];
  __shared__ float ws[kTile][kTile + 1];
  const int tx = threadIdx.x;
  const int ty = threadIdx.y;
  const int64_t r0 = int64_t{blockIdx.y} * kTile;
  const int64_t o0 = int64_t{blockIdx.x} * kTile;
  float acc = 0;
  for (int64_t k0 = 0; k0 < in; k0 += kTile) {
    const int64_t k = k0 + tx;
    xs[ty][tx] = (r0 + ty < rows && k < in) ? x[(r0 + ty) * in + k] : 0.0f;
    ws[ty][tx] = (o0 + ty < out && k < in) ? w[(o0 + ty) * in + k] : 0.0f;
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kTile; ++kk) acc += xs[ty][kk] * ws[tx][kk];
    __syncthreads();
  }
  if (r0 + ty < rows && o0 + tx < out) y[(r0 + ty) * out + o0 + tx] = acc;
}

// One thread block per row; threads over (head, i < d / 2).
__global__ void RopeKernel(float* x, int32_t heads, int32_t d, const int32_t* positions,
                           const double* inv_freq) {
  const int64_t row = blockIdx.x;
  const int32_t half = d / 2;
  const double position = positions[row];
  for (int32_t e = threadIdx.x; e < heads * half; e += blockDim.x) {
    const int32_t head = e / half;
    const int32_t i = e % half;
    const double angle = position * inv_freq[i];
    const float c = static_cast<float>(cos(angle));
    const float s = static_cast<float>(sin(angle));
    float* v = x + (row * heads + head) * d;
    const float x1 = v[i];
    const float x2 = v[i + half];
    v[i] = x1 * c - x2 * s;
    v[i + half] = x2 * c + x1 * s;
  }
}

__global__ void AddKernel(float* x, const float* y, int64_t n) {
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    x[i] += y[i];
  }
}

__global__ void SiluMulKernel(float* gate, const float* up, int64_t n) {
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const float g = gate[i];
    gate[i] = g / (1.0f + expf(-g)) * up[i];
  }
}

__global__ void GatherRowsKernel(const float* x, const int64_t* rows, int64_t h, float* out) {
  const float* src = x + rows[blockIdx.x] * h;
  float* dst = out + int64_t{blockIdx.x} * h;
  for (int64_t i = threadIdx.x; i < h; i += blockDim.x) dst[i] = src[i];
}

}  // namespace

void Embed(const int32_t* tokens, int64_t rows, const void* table, DType type, int64_t h, float* x,
           void* stream) {
  if (rows <= 0) return;
  const unsigned blocks = static_cast<unsigned>(rows);
  switch (type) {
    case DType::kFloat32:
      EmbedKernel<<<blocks, kThreads, 0, AsStream(stream)>>>(
          tokens, static_cast<const float*>(table), h, x);
      break;
    case DType::kFloat16:
      EmbedKernel<<<blocks, kThreads, 0, AsStream(stream)>>>(
          tokens, static_cast<const __half*>(table), h, x);
      break;
    case DType::kBFloat16:
      EmbedKernel<<<blocks, kThreads, 0, AsStream(stream)>>>(
          tokens, static_cast<const __nv_bfloat16*>(table), h, x);
      break;
    case DType::kFloat8E4M3:
    case DType::kFloat8E5M2:
      KVCM_CHECK(false) << "Embed: no kernel for weight dtype " << static_cast<int>(type);
      break;
  }
  KVCM_CUDA_CHECK(cudaGetLastError());
}

void NarrowTo(const float* x, int64_t n, DType type, uint16_t* out, void* stream) {
  if (n <= 0) return;
  KVCM_CHECK(type == DType::kFloat16 || type == DType::kBFloat16) << "NarrowTo needs a 16-bit type";
  if (type == DType::kFloat16) {
    NarrowToHalfKernel<<<GridFor(n), kThreads, 0, AsStream(stream)>>>(
        x, n, reinterpret_cast<__half*>(out));
  } else {
    NarrowToBf16Kernel<<<GridFor(n), kThreads, 0, AsStream(stream)>>>(
        x, n, reinterpret_cast<__nv_bfloat16*>(out));
  }
  KVCM_CUDA_CHECK(cudaGetLastError());
}

void AddBias(float* y, int64_t rows, int64_t width, const float* bias, void* stream) {
  if (rows <= 0 || width <= 0) return;
  AddBiasKernel<<<GridFor(rows * width), kThreads, 0, AsStream(stream)>>>(y, rows * width, width,
                                                                          bias);
  KVCM_CUDA_CHECK(cudaGetLastError());
}

void RmsNorm(const float* x, int64_t rows, int64_t h, const float* weight, double eps, float* out,
             void* stream) {
  if (rows <= 0) return;
  RmsNormKernel<<<static_cast<unsigned>(rows), kThreads, 0, AsStream(stream)>>>(x, h, weight, eps,
                                                                                out);
  KVCM_CUDA_CHECK(cudaGetLastError());
}

void MatMul(const float* x, int64_t rows, int64_t in, const float* w, int64_t out, float* y,
            void* stream) {
  if (rows <= 0 || out <= 0) return;
  if (rows <= kMaxVecRows) {
    const int64_t blocks = (out + kWarpsPerBlock - 1) / kWarpsPerBlock;
    MatVecKernel<<<static_cast<unsigned>(blocks), kThreads, 0, AsStream(stream)>>>(
        x, static_cast<int>(rows), in, w, out, y);
  } else {
    KVCM_CHECK((rows + kTile - 1) / kTile <= 65535) << rows << " rows";
    const dim3 grid(static_cast<unsigned>((out + kTile - 1) / kTile),
                    static_cast<unsigned>((rows + kTile - 1) / kTile));
    MatMulTiledKernel<<<grid, dim3(kTile, kTile), 0, AsStream(stream)>>>(x, rows, in, w, out, y);
  }
  KVCM_CUDA_CHECK(cudaGetLastError());
}

void Rope(float* x, int64_t rows, int32_t heads, int32_t d, const int32_t* positions,
          const double* inv_freq, void* stream) {
  if (rows <= 0) return;
  RopeKernel<<<static_cast<unsigned>(rows), kThreads, 0, AsStream(stream)>>>(x, heads, d, positions,
                                                                             inv_freq);
  KVCM_CUDA_CHECK(cudaGetLastError());
}

void Add(float* x, const float* y, int64_t n, void* stream) {
  if (n <= 0) return;
  AddKernel<<<GridFor(n), kThreads, 0, AsStream(stream)>>>(x, y, n);
  KVCM_CUDA_CHECK(cudaGetLastError());
}

void SiluMul(float* gate, const float* up, int64_t n, void* stream) {
  if (n <= 0) return;
  SiluMulKernel<<<GridFor(n), kThreads, 0, AsStream(stream)>>>(gate, up, n);
  KVCM_CUDA_CHECK(cudaGetLastError());
}

void GatherRows(const float* x, const int64_t* rows, int64_t n, int64_t h, float* out,
                void* stream) {
  if (n <= 0) return;
  GatherRowsKernel<<<static_cast<unsigned>(n), kThreads, 0, AsStream(stream)>>>(x, rows, h, out);
  KVCM_CUDA_CHECK(cudaGetLastError());
}

}  // namespace kvcm::executor::llama_cuda
