#pragma once
// The device kernels of LlamaCudaModel's forward pass (llama_model_cuda.h) other than the
// paged-KV ops of kernels/: each launcher mirrors one private step of LlamaModel's CPU
// forward (llama_model.cc), which is its reference. All pointers are device pointers; every
// launcher is asynchronous on `stream` (a cudaStream_t) and CHECK-fails when the launch
// does (kernels/cuda_check.h). Row-major throughout; activations are fp32, weight matrices
// fp32, fp16 or bf16 (DType; the launchers CHECK-fail on the fp8 values).
//
// This header is C++17 (nvcc compiles its .cu file as such): no C++20 types here.

#include <cstdint>

#include "common/base/dtype.h"

namespace kvcm::executor::llama_cuda {

// A weight matrix is stored on the device as fp32 (DType::kFloat32), or as IEEE binary16
// (kFloat16) or bfloat16 (kBFloat16) bits in uint16_t.

// x[r][:] = table[tokens[r]][:] widened to fp32 (exact), r < rows; table is [vocab][h] of
// `type`.
void Embed(const int32_t* tokens, int64_t rows, const void* table, DType type, int64_t h, float* x,
           void* stream);

// out[i] = x[i] rounded to `type` (kFloat16 or kBFloat16), to nearest, ties to even, as
// common/base/float16.h rounds on the host; i < n.
void NarrowTo(const float* x, int64_t n, DType type, uint16_t* out, void* stream);

// y[r][i] += bias[i], r < rows, i < width (a projection's bias, LlamaModel's AddBias).
void AddBias(float* y, int64_t rows, int64_t width, const float* bias, void* stream);

// out[r][i] = weight[i] * (x[r][i] / sqrt(mean_i(x[r][i]^2) + eps)); the sum of squares is
// taken in double, as on the CPU.
void RmsNorm(const float* x, int64_t rows, int64_t h, const float* weight, double eps, float* out,
             void* stream);

// y[rows][out] = x[rows][in] . w[out][in]^T, all fp32 (the fp32 weight path; 16-bit
// weights go through cuBLAS, llama_model_cuda.cc). Few rows (decode): one warp per output
// feature, reading w once, coalesced; otherwise 16 x 16 shared-memory tiles.
void MatMul(const float* x, int64_t rows, int64_t in, const float* w, int64_t out, float* y,
            void* stream);

// Rotates `heads` heads of head_dim d of each row of x in place by positions[r] (HF's
// rotate_half convention), with angles position * inv_freq[i] in double.
void Rope(float* x, int64_t rows, int32_t heads, int32_t d, const int32_t* positions,
          const double* inv_freq, void* stream);

// x[i] += y[i], i < n.
void Add(float* x, const float* y, int64_t n, void* stream);

// gate[i] = SiLU(gate[i]) * up[i], i < n.
void SiluMul(float* gate, const float* up, int64_t n, void* stream);

// out[i][:] = x[rows[i]][:], i < n; x is [*][h].
void GatherRows(const float* x, const int64_t* rows, int64_t n, int64_t h, float* out,
                void* stream);

}  // namespace kvcm::executor::llama_cuda
