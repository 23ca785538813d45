// WeightMatrix packing and the CPU MatMul (see matmul_cpu.h). The inner loops exist three
// times: portable C++ (unfused multiply-add), AVX2 + FMA and AVX-512, through the target
// pragmas of matmul_panels_internal.h; ActiveCpuIsa() picks one per call.
//
// This file is compiled with -ffp-contract=off: the dequantization must be ggml's multiply
// then add, and the portable loops must not be fused differently from one build to another.
// The AVX2 and AVX-512 loops fuse explicitly (_mm*_fmadd_ps).

#include "kernels/matmul_cpu.h"

#include <algorithm>
#include <cstring>
#include <string>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/base/check.h"
#include "common/base/float16.h"
#include "kernels/cpu_isa.h"
#include "kernels/cpu_thread_pool.h"
#include "kernels/matmul_panels_internal.h"

namespace kvcm::kernels {
namespace {

using matmul_internal::kLanes;
using matmul_internal::kScaleBytes;

// --- The code form of ggml's types ---------------------------------------------------------

struct CodeForm {
  WeightMatrix::Format format;
  int64_t group;        // elements sharing a scale and bias
  int32_t code_offset;  // code = stored unsigned code - code_offset
  bool has_bias;        // some bias may be nonzero (a min or a K-quant's -min * m)
};

// The code form of `type`, or false when it has none (it is packed as fp32).
bool GetCodeForm(GgmlType type, CodeForm* form) {
  using F = WeightMatrix::Format;
  switch (type) {
    case GgmlType::kQ4_0:
      *form = {F::kCodes4, 32, 8, false};
      return true;
    case GgmlType::kQ4_1:
    case GgmlType::kQ4_K:
      *form = {F::kCodes4, 32, 0, true};
      return true;
    case GgmlType::kQ5_0:
    case GgmlType::kQ8_0:
      *form = {F::kCodes8, 32, 128, false};
      return true;
    case GgmlType::kQ5_1:
    case GgmlType::kQ5_K:
      *form = {F::kCodes8, 32, 128, true};
      return true;
    case GgmlType::kQ6_K:
      *form = {F::kCodes8, 16, 128, false};
      return true;
    default:
      return false;
  }
}

uint16_t LoadU16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
uint32_t LoadU32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
float LoadF16(const uint8_t* p) { return FloatFromHalf(LoadU16(p)); }

// Where code j (0 .. group - 1) of lane l sits in a group's codes (see matmul_cpu.h): blocks
// of 64 bytes, one little-endian dword per lane, each holding 4 consecutive codes of 8 bits
// (kCodes8) or 8 of 4 bits (kCodes4: codes 8q .. 8q+3 in the low nibbles of the 4 bytes,
// 8q+4 .. 8q+7 in the high ones), so that one vpdpbusd multiplies 4 consecutive k of 16
// rows by one broadcast dword of activations.
struct CodePlace {
  int64_t byte;
  int shift;
};
CodePlace PlaceOf(WeightMatrix::Format format, int64_t j, int64_t lane) {
  if (format == WeightMatrix::Format::kCodes4) {
    return {(j / 8) * 64 + lane * 4 + j % 4, static_cast<int>(4 * ((j % 8) / 4))};
  }
  return {(j / 4) * 64 + lane * 4 + j % 4, 0};
}
// The stored (unsigned) code j of lane l.
int StoredCode(WeightMatrix::Format format, const uint8_t* codes, int64_t j, int64_t lane) {
  const CodePlace at = PlaceOf(format, j, lane);
  return (codes[at.byte] >> at.shift) & (format == WeightMatrix::Format::kCodes4 ? 0xF : 0xFF);
}

// get_scale_min_k4 (ggml-quants.c): the 6-bit scale and min of sub-block j of a Q4_K/Q5_K
// super-block.
void ScaleMinK4(int j, const uint8_t* q, uint8_t* d, uint8_t* m) {
  if (j < 4) {
    *d = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *d = static_cast<uint8_t>((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
    *m = static_cast<uint8_t>((q[j + 4] >> 4) | ((q[j - 0] >> 6) << 4));
  }
}

// DecodeRow (below) for Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0: blocks of 32 elements with an fp16
// scale (and, for Q4_1 and Q5_1, an fp16 min).
void DecodeBlocksOf32(GgmlType type, const uint8_t* x, int64_t cols, int8_t* codes, float* scales,
                      float* biases) {
  for (int64_t b = 0; b < cols / 32; ++b, codes += 32) {
    int8_t* c = codes;
    if (type == GgmlType::kQ8_0) {
      scales[b] = LoadF16(x);
      biases[b] = 0.0f;
      for (int j = 0; j < 32; ++j) c[j] = static_cast<int8_t>(x[2 + j]);
      x += 34;
      continue;
    }
    const bool has_min = type == GgmlType::kQ4_1 || type == GgmlType::kQ5_1;
    const bool five = type == GgmlType::kQ5_0 || type == GgmlType::kQ5_1;
    scales[b] = LoadF16(x);
    biases[b] = has_min ? LoadF16(x + 2) : 0.0f;
    const uint8_t* p = x + (has_min ? 4 : 2);
    uint32_t qh = 0;
    if (five) {
      qh = LoadU32(p);
      p += 4;
    }
    const int sub = type == GgmlType::kQ4_0 ? 8 : type == GgmlType::kQ5_0 ? 16 : 0;
    for (int j = 0; j < 16; ++j) {
      int x0 = p[j] & 0x0F;
      int x1 = p[j] >> 4;
      if (five) {
        x0 |= static_cast<int>(((qh >> (j + 0)) << 4) & 0x10);
        x1 |= static_cast<int>((qh >> (j + 12)) & 0x10);
      }
      c[j] = static_cast<int8_t>(x0 - sub);
      c[j + 16] = static_cast<int8_t>(x1 - sub);
    }
    x += type == GgmlType::kQ4_0   ? 18
         : type == GgmlType::kQ4_1 ? 20
         : type == GgmlType::kQ5_0 ? 22
                                   : 24;
  }
}

// DecodeRow for Q4_K and Q5_K: super-blocks of 256 elements, 8 sub-blocks of 32 with 6-bit
// scales and mins.
void DecodeQ4KOrQ5K(GgmlType type, const uint8_t* x, int64_t cols, int8_t* codes, float* scales,
                    float* biases) {
  const bool five = type == GgmlType::kQ5_K;
  for (int64_t b = 0; b < cols / 256; ++b) {
    const float d = LoadF16(x);
    const float min = LoadF16(x + 2);
    const uint8_t* sc = x + 4;
    const uint8_t* qh = x + 16;
    const uint8_t* q = five ? x + 48 : x + 16;
    for (int j = 0; j < 4; ++j) {  // 64 elements: 32 low nibbles, then 32 high ones
      for (int half = 0; half < 2; ++half) {
        uint8_t s, m;
        ScaleMinK4(2 * j + half, sc, &s, &m);
        *scales++ = d * static_cast<float>(s);
        *biases++ = -(min * static_cast<float>(m));
        const unsigned bit = 1u << (2 * j + half);
        for (int l = 0; l < 32; ++l) {
          int v = half == 0 ? (q[l] & 0xF) : (q[l] >> 4);
          if (five && (qh[l] & bit) != 0) v += 16;
          *codes++ = static_cast<int8_t>(v);
        }
      }
      q += 32;
    }
    x += five ? 176 : 144;
  }
}

// DecodeRow for Q6_K: super-blocks of 256 elements, 16 groups of 16 with 8-bit scales.
void DecodeQ6K(const uint8_t* x, int64_t cols, int8_t* codes, float* scales, float* biases) {
  for (int64_t b = 0; b < cols / 256; ++b) {
    const float d = LoadF16(x + 208);
    const uint8_t* ql = x;
    const uint8_t* qh = x + 128;
    const uint8_t* sc = x + 192;
    for (int g = 0; g < 16; ++g) {
      *scales++ = d * static_cast<float>(static_cast<int8_t>(sc[g]));
      *biases++ = 0.0f;
    }
    for (int n = 0; n < 2; ++n) {  // 128 elements each
      for (int l = 0; l < 32; ++l) {
        codes[l + 0] = static_cast<int8_t>(((ql[l + 0] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32);
        codes[l + 32] = static_cast<int8_t>(((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32);
        codes[l + 64] = static_cast<int8_t>(((ql[l + 0] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
        codes[l + 96] = static_cast<int8_t>(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
      }
      codes += 128;
      ql += 64;
      qh += 32;
    }
    x += 210;
  }
}

// One row of `cols` elements of `type` (a code form) as codes[cols] and, per group,
// scales and biases with value = float(code) * scale + bias: ggml's dequantize_row_* with
// the same float operations (bias 0 for the types without a min; a - m is a + (-m)).
void DecodeRow(GgmlType type, const uint8_t* x, int64_t cols, int8_t* codes, float* scales,
               float* biases) {
  switch (type) {
    case GgmlType::kQ4_0:
    case GgmlType::kQ4_1:
    case GgmlType::kQ5_0:
    case GgmlType::kQ5_1:
    case GgmlType::kQ8_0:
      DecodeBlocksOf32(type, x, cols, codes, scales, biases);
      return;
    case GgmlType::kQ4_K:
    case GgmlType::kQ5_K:
      DecodeQ4KOrQ5K(type, x, cols, codes, scales, biases);
      return;
    case GgmlType::kQ6_K:
      DecodeQ6K(x, cols, codes, scales, biases);
      return;
    default:
      KVCM_CHECK(false) << "no code form for " << GgmlTypeName(type);
  }
}

// --- Inner loops ---------------------------------------------------------------------------
//
// DequantPanel: a panel's values in fp32, [cols][16], into `out`.
// PanelRows: y[r][0 .. valid) for r < rows, from x[r * ldx + 0 .. k) and `np`
// (1 .. kUnitPanels) fp32 panels w[0 .. np) of k columns, each 16 columns of y; valid <= 16 np.
// With `accumulate` the sums start from y's values instead of 0 (the next chunk of k).

constexpr int kUnitPanels = 4;  // panels one pass over the rows of x takes
// Columns of a coded unit dequantized at a time: 4 panels x 128 x 64 bytes = 32 KiB, in L1.
// A multiple of every group size.
constexpr int64_t kChunk = 128;

struct PanelArgs {
  const uint8_t* panel;
  WeightMatrix::Format format;
  int64_t cols;
  int64_t group;
  int64_t group_bytes;
  int32_t code_offset;
};

namespace portable {

void DequantPanel(const PanelArgs& a, float* out) {
  for (int64_t g = 0; g < a.cols / a.group; ++g) {
    const uint8_t* gp = a.panel + g * a.group_bytes;
    float scale[kLanes];
    float bias[kLanes];
    std::memcpy(scale, gp, sizeof(scale));
    std::memcpy(bias, gp + sizeof(scale), sizeof(bias));
    const uint8_t* codes = gp + kScaleBytes;
    float* o = out + g * a.group * kLanes;
    for (int64_t j = 0; j < a.group; ++j) {
      for (int64_t l = 0; l < kLanes; ++l) {
        const int c = StoredCode(a.format, codes, j, l) - a.code_offset;
        o[j * kLanes + l] = static_cast<float>(c) * scale[l] + bias[l];
      }
    }
  }
}

template <int R>
void Tile(const float* x, int64_t ldx, int64_t k, const float* w, float* y, int64_t ldy,
          int64_t valid, bool accumulate) {
  float acc[R][kLanes] = {};
  if (accumulate) {
    for (int r = 0; r < R; ++r) std::memcpy(acc[r], y + r * ldy, static_cast<size_t>(valid) * 4);
  }
  for (int64_t kk = 0; kk < k; ++kk) {
    const float* wk = w + kk * kLanes;
    KVCM_UNROLL
    for (int r = 0; r < R; ++r) {
      const float xv = x[r * ldx + kk];
      KVCM_UNROLL
      for (int64_t l = 0; l < kLanes; ++l) acc[r][l] += xv * wk[l];
    }
  }
  KVCM_UNROLL
  for (int r = 0; r < R; ++r) std::memcpy(y + r * ldy, acc[r], static_cast<size_t>(valid) * 4);
}

void PanelRows(const float* x, int64_t ldx, int64_t rows, int64_t k, const float* const* w, int np,
               float* y, int64_t ldy, int64_t valid, bool accumulate) {
  for (int p = 0; p < np; ++p) {
    const int64_t v = std::min(valid - p * kLanes, kLanes);
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4)
      Tile<4>(x + r * ldx, ldx, k, w[p], y + r * ldy + p * kLanes, ldy, v, accumulate);
    for (; r < rows; ++r)
      Tile<1>(x + r * ldx, ldx, k, w[p], y + r * ldy + p * kLanes, ldy, v, accumulate);
  }
}

}  // namespace portable

#if defined(__x86_64__)
KVCM_TARGET_BEGIN("avx2,fma,f16c")
namespace avx2 {

void DequantPanel(const PanelArgs& a, float* out) {
  const __m256i mask = _mm256_set1_epi32(0xF);
  const __m256i offset = _mm256_set1_epi32(a.code_offset);
  for (int64_t g = 0; g < a.cols / a.group; ++g) {
    const uint8_t* gp = a.panel + g * a.group_bytes;
    const float* sp = reinterpret_cast<const float*>(gp);
    const __m256 s[2] = {_mm256_loadu_ps(sp), _mm256_loadu_ps(sp + 8)};
    const __m256 b[2] = {_mm256_loadu_ps(sp + 16), _mm256_loadu_ps(sp + 24)};
    const uint8_t* codes = gp + kScaleBytes;
    float* o = out + g * a.group * kLanes;
    // A block of 64 bytes: per lane one dword of 4 bytes (layout in SetCodedRow).
    const bool four = a.format == WeightMatrix::Format::kCodes4;
    const int per_block = four ? 8 : 4;
    const __m256i m = four ? mask : _mm256_set1_epi32(0xFF);
    for (int64_t q = 0; q < a.group / per_block; ++q) {
      for (int h = 0; h < 2; ++h) {
        const __m256i d =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + q * 64 + 32 * h));
        for (int e = 0; e < per_block; ++e) {
          const int shift = four ? 8 * (e % 4) + 4 * (e / 4) : 8 * e;
          const __m256i v = _mm256_sub_epi32(
              _mm256_and_si256(_mm256_srl_epi32(d, _mm_cvtsi32_si128(shift)), m), offset);
          _mm256_storeu_ps(o + (q * per_block + e) * kLanes + 8 * h,
                           _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(v), s[h]), b[h]));
        }
      }
    }
  }
}

// R rows by NP panels (16 columns each) of y.
template <int R, int NP>
void Tile(const float* x, int64_t ldx, int64_t k, const float* const* w, float* y, int64_t ldy,
          int64_t valid, bool accumulate) {
  __m256 acc[R][2 * NP];
  KVCM_UNROLL
  for (int r = 0; r < R; ++r) {
    alignas(32) float t[2 * NP * 8] = {};
    if (accumulate) std::memcpy(t, y + r * ldy, static_cast<size_t>(valid) * sizeof(float));
    KVCM_UNROLL
    for (int h = 0; h < 2 * NP; ++h) acc[r][h] = _mm256_load_ps(t + 8 * h);
  }
  for (int64_t kk = 0; kk < k; ++kk) {
    __m256 wv[2 * NP];
    KVCM_UNROLL
    for (int h = 0; h < 2 * NP; ++h) wv[h] = _mm256_loadu_ps(w[h / 2] + kk * kLanes + 8 * (h % 2));
    KVCM_UNROLL
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_broadcast_ss(x + r * ldx + kk);
      KVCM_UNROLL
      for (int h = 0; h < 2 * NP; ++h) acc[r][h] = _mm256_fmadd_ps(xv, wv[h], acc[r][h]);
    }
  }
  KVCM_UNROLL
  for (int r = 0; r < R; ++r) {
    alignas(32) float t[2 * NP * 8];
    KVCM_UNROLL
    for (int h = 0; h < 2 * NP; ++h) _mm256_store_ps(t + 8 * h, acc[r][h]);
    std::memcpy(y + r * ldy, t, static_cast<size_t>(valid) * sizeof(float));
  }
}

// Rows of x in tiles of up to 6 (one panel) or 3 (two panels).
template <int NP>
void Rows(const float* x, int64_t ldx, int64_t rows, int64_t k, const float* const* w, float* y,
          int64_t ldy, int64_t valid, bool accumulate) {
  constexpr int kMax = NP == 1 ? 6 : 3;
  int64_t r = 0;
  for (; r + kMax <= rows; r += kMax)
    Tile<kMax, NP>(x + r * ldx, ldx, k, w, y + r * ldy, ldy, valid, accumulate);
  const float* xr = x + r * ldx;
  float* yr = y + r * ldy;
  if constexpr (NP == 1) {
    switch (rows - r) {
      case 5:
        Tile<5, 1>(xr, ldx, k, w, yr, ldy, valid, accumulate);
        break;
      case 4:
        Tile<4, 1>(xr, ldx, k, w, yr, ldy, valid, accumulate);
        break;
      case 3:
        Tile<3, 1>(xr, ldx, k, w, yr, ldy, valid, accumulate);
        break;
      default:
        break;
    }
  }
  switch (rows - r) {
    case 2:
      Tile<2, NP>(xr, ldx, k, w, yr, ldy, valid, accumulate);
      break;
    case 1:
      Tile<1, NP>(xr, ldx, k, w, yr, ldy, valid, accumulate);
      break;
    default:
      break;
  }
}

void PanelRows(const float* x, int64_t ldx, int64_t rows, int64_t k, const float* const* w, int np,
               float* y, int64_t ldy, int64_t valid, bool accumulate) {
  for (int p = 0; p < np; p += 2) {
    const int64_t v = std::min(valid - p * kLanes, 2 * kLanes);
    if (p + 1 < np) {
      Rows<2>(x, ldx, rows, k, w + p, y + p * kLanes, ldy, v, accumulate);
    } else {
      Rows<1>(x, ldx, rows, k, w + p, y + p * kLanes, ldy, v, accumulate);
    }
  }
}

}  // namespace avx2
KVCM_TARGET_END

KVCM_AVX512_TARGET_BEGIN("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512dq")
namespace avx512 {

// One panel's groups of G columns; kCodes4 with kOffset: code = nibble - offset.
template <int G, bool kFour, bool kOffset>
void DequantGroups(const uint8_t* panel, int64_t groups, int64_t group_bytes, int32_t code_offset,
                   float* out) {
  const __m512i mask = _mm512_set1_epi32(kFour ? 0xF : 0xFF);
  const __m512i offset = _mm512_set1_epi32(code_offset);
  constexpr int kPerBlock = kFour ? 8 : 4;  // codes per lane in a 64-byte block
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* gp = panel + g * group_bytes;
    const float* sp = reinterpret_cast<const float*>(gp);
    const __m512 s = _mm512_loadu_ps(sp);
    const __m512 b = _mm512_loadu_ps(sp + kLanes);
    const uint8_t* codes = gp + kScaleBytes;
    float* o = out + g * G * kLanes;
    KVCM_UNROLL
    for (int q = 0; q < G / kPerBlock; ++q) {
      const __m512i d = _mm512_loadu_si512(codes + q * 64);
      KVCM_UNROLL
      for (int e = 0; e < kPerBlock; ++e) {
        const int shift = kFour ? 8 * (e % 4) + 4 * (e / 4) : 8 * e;
        __m512i v = _mm512_and_si512(_mm512_srli_epi32(d, shift), mask);
        if constexpr (kOffset) v = _mm512_sub_epi32(v, offset);
        _mm512_storeu_ps(o + (q * kPerBlock + e) * kLanes,
                         _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(v), s), b));
      }
    }
  }
}

void DequantPanel(const PanelArgs& a, float* out) {
  const int64_t groups = a.cols / a.group;
  if (a.format == WeightMatrix::Format::kCodes4) {
    KVCM_CHECK(a.group == 32);
    if (a.code_offset != 0) {
      DequantGroups<32, true, true>(a.panel, groups, a.group_bytes, a.code_offset, out);
    } else {
      DequantGroups<32, true, false>(a.panel, groups, a.group_bytes, 0, out);
    }
  } else if (a.group == 16) {
    DequantGroups<16, false, true>(a.panel, groups, a.group_bytes, a.code_offset, out);
  } else {
    KVCM_CHECK(a.group == 32);
    DequantGroups<32, false, true>(a.panel, groups, a.group_bytes, a.code_offset, out);
  }
}

// R rows by NP panels (16 columns each) of y.
template <int R, int NP>
void Tile(const float* x, int64_t ldx, int64_t k, const float* const* w, float* y, int64_t ldy,
          int64_t valid, bool accumulate) {
  __m512 acc[R][NP];
  __mmask16 masks[NP];
  KVCM_UNROLL
  for (int p = 0; p < NP; ++p) {
    const int64_t n = std::clamp<int64_t>(valid - p * kLanes, 0, kLanes);
    masks[p] = static_cast<__mmask16>((1u << n) - 1);
  }
  KVCM_UNROLL
  for (int r = 0; r < R; ++r) {
    KVCM_UNROLL
    for (int p = 0; p < NP; ++p) {
      acc[r][p] = accumulate ? _mm512_maskz_loadu_ps(masks[p], y + r * ldy + p * kLanes)
                             : _mm512_setzero_ps();
    }
  }
  for (int64_t kk = 0; kk < k; ++kk) {
    __m512 wv[NP];
    KVCM_UNROLL
    for (int p = 0; p < NP; ++p) wv[p] = _mm512_loadu_ps(w[p] + kk * kLanes);
    KVCM_UNROLL
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * ldx + kk]);
      KVCM_UNROLL
      for (int p = 0; p < NP; ++p) acc[r][p] = _mm512_fmadd_ps(xv, wv[p], acc[r][p]);
    }
  }
  KVCM_UNROLL
  for (int p = 0; p < NP; ++p) {
    KVCM_UNROLL
    for (int r = 0; r < R; ++r)
      _mm512_mask_storeu_ps(y + r * ldy + p * kLanes, masks[p], acc[r][p]);
  }
}

// Rows of x in tiles of up to 6 (24 accumulators for four panels).
template <int NP>
void Rows(const float* x, int64_t ldx, int64_t rows, int64_t k, const float* const* w, float* y,
          int64_t ldy, int64_t valid, bool accumulate) {
  int64_t r = 0;
  for (; r + 6 <= rows; r += 6)
    Tile<6, NP>(x + r * ldx, ldx, k, w, y + r * ldy, ldy, valid, accumulate);
  const float* xr = x + r * ldx;
  float* yr = y + r * ldy;
  switch (rows - r) {
    case 5:
      Tile<5, NP>(xr, ldx, k, w, yr, ldy, valid, accumulate);
      break;
    case 4:
      Tile<4, NP>(xr, ldx, k, w, yr, ldy, valid, accumulate);
      break;
    case 3:
      Tile<3, NP>(xr, ldx, k, w, yr, ldy, valid, accumulate);
      break;
    case 2:
      Tile<2, NP>(xr, ldx, k, w, yr, ldy, valid, accumulate);
      break;
    case 1:
      Tile<1, NP>(xr, ldx, k, w, yr, ldy, valid, accumulate);
      break;
    default:
      break;
  }
}

void PanelRows(const float* x, int64_t ldx, int64_t rows, int64_t k, const float* const* w, int np,
               float* y, int64_t ldy, int64_t valid, bool accumulate) {
  switch (np) {
    case 4:
      Rows<4>(x, ldx, rows, k, w, y, ldy, valid, accumulate);
      break;
    case 3:
      Rows<3>(x, ldx, rows, k, w, y, ldy, valid, accumulate);
      break;
    case 2:
      Rows<2>(x, ldx, rows, k, w, y, ldy, valid, accumulate);
      break;
    default:
      Rows<1>(x, ldx, rows, k, w, y, ldy, valid, accumulate);
      break;
  }
}

}  // namespace avx512
KVCM_AVX512_TARGET_END
#endif  // __x86_64__

struct Loops {
  void (*dequant_panel)(const PanelArgs&, float*);
  void (*panel_rows)(const float*, int64_t, int64_t, int64_t, const float* const*, int, float*,
                     int64_t, int64_t, bool);
};

Loops LoopsFor(CpuIsa isa) {
#if defined(__x86_64__)
  if (isa == CpuIsa::kAvx512) return {avx512::DequantPanel, avx512::PanelRows};
  if (isa == CpuIsa::kAvx2) return {avx2::DequantPanel, avx2::PanelRows};
#endif
  (void)isa;
  return {portable::DequantPanel, portable::PanelRows};
}

}  // namespace

// --- WeightMatrix ----------------------------------------------------------------------------

int64_t WeightMatrix::group_bytes() const {
  switch (format_) {
    case Format::kCodes4:
      return kScaleBytes + group_ * kLanes / 2;
    case Format::kCodes8:
      return kScaleBytes + group_ * kLanes;
    case Format::kFloat32:
      break;
  }
  return kLanes * static_cast<int64_t>(sizeof(float));
}

void WeightMatrix::Allocate(Format format, int64_t rows, int64_t cols, int64_t group,
                            int32_t code_offset) {
  format_ = format;
  rows_ = rows;
  cols_ = cols;
  group_ = group;
  code_offset_ = code_offset;
  has_bias_ = false;
  panel_bytes_ = cols / group * group_bytes();
  data_.assign(static_cast<size_t>(num_panels() * panel_bytes_), 0);
}

void WeightMatrix::SetFloatRow(int64_t r, const float* values) {
  float* p = reinterpret_cast<float*>(mutable_panel(r / kLanes));
  const int64_t lane = r % kLanes;
  for (int64_t k = 0; k < cols_; ++k) p[k * kLanes + lane] = values[k];
}

void WeightMatrix::SetCodedRow(int64_t r, const int8_t* codes, const float* scales,
                               const float* biases) {
  uint8_t* p = mutable_panel(r / kLanes);
  const int64_t lane = r % kLanes;
  for (int64_t g = 0; g < cols_ / group_; ++g) {
    uint8_t* gp = p + g * group_bytes();
    std::memcpy(gp + lane * 4, &scales[g], sizeof(float));
    std::memcpy(gp + (kLanes + lane) * 4, &biases[g], sizeof(float));
    uint8_t* c = gp + kScaleBytes;
    const int8_t* src = codes + g * group_;
    for (int64_t j = 0; j < group_; ++j) {
      const int u = src[j] + code_offset_;
      KVCM_CHECK(u >= 0 && u < (format_ == Format::kCodes4 ? 16 : 256)) << u;
      const CodePlace at = PlaceOf(format_, j, lane);
      c[at.byte] = static_cast<uint8_t>(c[at.byte] | (u << at.shift));
    }
  }
}

WeightMatrix WeightMatrix::FromFloat(std::span<const float> w, int64_t rows, int64_t cols) {
  KVCM_CHECK(static_cast<int64_t>(w.size()) == rows * cols)
      << w.size() << " != " << rows << "x" << cols;
  WeightMatrix m;
  m.Allocate(Format::kFloat32, rows, cols, 1, 0);
  for (int64_t r = 0; r < rows; ++r) m.SetFloatRow(r, w.data() + r * cols);
  return m;
}

absl::StatusOr<WeightMatrix> WeightMatrix::FromGgml(GgmlType type, std::span<const std::byte> data,
                                                    int64_t rows, int64_t cols,
                                                    std::span<const int64_t> row_order) {
  const std::optional<GgmlTypeTraits> traits = GetGgmlTypeTraits(type);
  if (!traits.has_value()) {
    return absl::InvalidArgumentError(absl::StrCat(GgmlTypeName(type), " is not a ggml type"));
  }
  if (!CanDequantize(type)) {
    return absl::UnimplementedError(
        absl::StrCat("no conversion of ", GgmlTypeName(type), " tensors to float32"));
  }
  if (rows < 0 || cols <= 0 || cols % traits->block_size != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("a ", GgmlTypeName(type), " matrix needs rows of whole ", traits->block_size,
                     "-element blocks, got ", rows, " x ", cols));
  }
  const int64_t row_bytes = cols / traits->block_size * traits->type_size;
  if (static_cast<int64_t>(data.size()) != rows * row_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("a ", rows, " x ", cols, " ", GgmlTypeName(type),
                                                   " matrix takes ", rows * row_bytes,
                                                   " bytes, got ", data.size()));
  }
  if (!row_order.empty()) {
    if (static_cast<int64_t>(row_order.size()) != rows) {
      return absl::InvalidArgumentError(
          absl::StrCat("row_order has ", row_order.size(), " entries for ", rows, " rows"));
    }
    for (const int64_t r : row_order) {
      if (r < 0 || r >= rows) {
        return absl::InvalidArgumentError(
            absl::StrCat("row_order entry ", r, " is outside [0, ", rows, ")"));
      }
    }
  }
  const auto* bytes = reinterpret_cast<const uint8_t*>(data.data());
  auto source_row = [&](int64_t r) {
    return bytes + (row_order.empty() ? r : row_order[static_cast<size_t>(r)]) * row_bytes;
  };
  WeightMatrix m;
  CodeForm form;
  if (GetCodeForm(type, &form)) {
    m.Allocate(form.format, rows, cols, form.group, form.code_offset);
    m.has_bias_ = form.has_bias;
    std::vector<int8_t> codes(static_cast<size_t>(cols));
    std::vector<float> scales(static_cast<size_t>(cols / form.group));
    std::vector<float> biases(scales.size());
    for (int64_t r = 0; r < rows; ++r) {
      DecodeRow(type, source_row(r), cols, codes.data(), scales.data(), biases.data());
      m.SetCodedRow(r, codes.data(), scales.data(), biases.data());
    }
    return m;
  }
  m.Allocate(Format::kFloat32, rows, cols, 1, 0);
  std::vector<float> values(static_cast<size_t>(cols));
  for (int64_t r = 0; r < rows; ++r) {
    const auto* row = reinterpret_cast<const std::byte*>(source_row(r));
    if (absl::Status s = kvcm::Dequantize(type, {row, static_cast<size_t>(row_bytes)}, values);
        !s.ok()) {
      return s;
    }
    m.SetFloatRow(r, values.data());
  }
  return m;
}

void WeightMatrix::DequantizeRow(int64_t r, float* out) const {
  KVCM_CHECK(r >= 0 && r < rows_) << r;
  const uint8_t* p = panel(r / kLanes);
  const int64_t lane = r % kLanes;
  if (format_ == Format::kFloat32) {
    const float* f = reinterpret_cast<const float*>(p);
    for (int64_t k = 0; k < cols_; ++k) out[k] = f[k * kLanes + lane];
    return;
  }
  for (int64_t g = 0; g < cols_ / group_; ++g) {
    const uint8_t* gp = p + g * group_bytes();
    float scale;
    float bias;
    std::memcpy(&scale, gp + lane * 4, sizeof(float));
    std::memcpy(&bias, gp + (kLanes + lane) * 4, sizeof(float));
    const uint8_t* c = gp + kScaleBytes;
    float* o = out + g * group_;
    for (int64_t j = 0; j < group_; ++j) {
      o[j] = static_cast<float>(StoredCode(format_, c, j, lane) - code_offset_) * scale + bias;
    }
  }
}

std::vector<float> WeightMatrix::Dequantize() const {
  std::vector<float> out(static_cast<size_t>(rows_ * cols_));
  for (int64_t r = 0; r < rows_; ++r) DequantizeRow(r, out.data() + r * cols_);
  return out;
}

// --- MatMul ----------------------------------------------------------------------------------

void MatMul(const float* x, int64_t m, const WeightMatrix& w, float* y, int32_t num_threads) {
  if (m <= 0 || w.empty()) return;
  const Loops loops = LoopsFor(ActiveCpuIsa());
  const int64_t k = w.cols();
  const int64_t n = w.rows();
  const int64_t panels = w.num_panels();
  const int64_t units = (panels + kUnitPanels - 1) / kUnitPanels;
  const bool coded = w.format() != WeightMatrix::Format::kFloat32;
  // Rows of x per pass over the weights: about 512 KiB of x, to stay in L2.
  const int64_t block_rows = std::max<int64_t>(8, (int64_t{1} << 17) / k);
  // Enough units per chunk for ~64K multiply-adds, so tiny products stay on one thread.
  const int64_t min_chunk = std::max<int64_t>(1, 65536 / (kUnitPanels * kLanes * k * m));
  CpuThreadPool& pool = CpuThreadPool::Default();
  const int32_t threads =
      num_threads <= 0 ? pool.max_threads() : std::min(num_threads, pool.max_threads());
  // Four chunks per thread: a thread slowed by the machine does not hold up the others.
  const int64_t num_chunks =
      std::min<int64_t>((units + min_chunk - 1) / min_chunk, int64_t{threads} * 4);
  const PanelArgs base{nullptr, w.format(), k, w.group(), w.group_bytes(), w.code_offset()};

  auto run = [&](int64_t chunk) {
    const int64_t begin = chunk * units / num_chunks;
    const int64_t end = (chunk + 1) * units / num_chunks;
    thread_local std::vector<float> buffer;
    if (coded && buffer.size() < static_cast<size_t>(kUnitPanels * kLanes * kChunk)) {
      buffer.resize(static_cast<size_t>(kUnitPanels * kLanes * kChunk));
    }
    for (int64_t r0 = 0; r0 < m; r0 += block_rows) {
      const int64_t rows = std::min(block_rows, m - r0);
      for (int64_t unit = begin; unit < end; ++unit) {
        const int64_t p0 = unit * kUnitPanels;
        const int np = static_cast<int>(std::min<int64_t>(kUnitPanels, panels - p0));
        const int64_t valid = std::min<int64_t>(np * kLanes, n - p0 * kLanes);
        float* yu = y + r0 * n + p0 * kLanes;
        const float* panel_values[kUnitPanels];
        if (!coded) {
          for (int p = 0; p < np; ++p) {
            panel_values[p] = reinterpret_cast<const float*>(w.panel(p0 + p));
          }
          loops.panel_rows(x + r0 * k, k, rows, k, panel_values, np, yu, n, valid, false);
          continue;
        }
        // Coded: kChunk columns at a time, dequantized into L1; y holds the partial sums
        // between chunks (stored and reloaded exactly, so the chain over k is unchanged).
        for (int64_t k0 = 0; k0 < k; k0 += kChunk) {
          const int64_t kc = std::min(kChunk, k - k0);
          for (int p = 0; p < np; ++p) {
            PanelArgs a = base;
            a.panel = w.panel(p0 + p) + k0 / w.group() * w.group_bytes();
            a.cols = kc;
            float* out = buffer.data() + p * kLanes * kChunk;
            loops.dequant_panel(a, out);
            panel_values[p] = out;
          }
          loops.panel_rows(x + r0 * k + k0, k, rows, kc, panel_values, np, yu, n, valid, k0 > 0);
        }
      }
    }
  };
  if (num_chunks <= 1) {
    run(0);
  } else {
    pool.ParallelFor(num_chunks, threads, run);
  }
}

}  // namespace kvcm::kernels
