// MatMulInt8 and QuantizeRows (see matmul_cpu.h): the integer path of the CPU matmul. The
// inner loops exist three times: portable C++, AVX2 and AVX-512 VNNI, through the target
// pragmas of matmul_panels_internal.h; ActiveCpuIsa() (and CpuHasAvx512Vnni()) picks one per
// call.
//
// Every variant computes, per output and group, the exact int32 isum = sum (u - offset) * q
// and then the same two fused multiply-adds in the same order, so all give the same bits.
// Compiled with -ffp-contract=off: the portable code fuses only where it calls std::fma.

#include <algorithm>
#include <cmath>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "common/base/check.h"
#include "kernels/cpu_isa.h"
#include "kernels/cpu_thread_pool.h"
#include "kernels/matmul_cpu.h"
#include "kernels/matmul_panels_internal.h"

namespace kvcm::kernels {
namespace {

using matmul_internal::kLanes;
using matmul_internal::kScaleBytes;
constexpr int kUnitPanels = 4;  // panels (64 outputs) one work item takes
constexpr int64_t kMaxGroup = 32;
constexpr float kResidualSteps = 254.0f;  // a residual code's step: the code's step / this

// Finishes one group of a row: the codes' sum and the scaled sum.
void FinishGroup(float d, int32_t sum, float* scale, int32_t* sums, float* scaled_sum) {
  *scale = d;
  *sums = sum;
  *scaled_sum = d * static_cast<float>(sum);
}

// d and 1 / d of a group whose largest magnitude is amax (ggml's quantize_row_q8_0).
void GroupScale(float amax, float* d, float* id) {
  *d = amax / 127.0f;
  *id = *d != 0.0f ? 1.0f / *d : 0.0f;
}

namespace portable {

void QuantizeRow(const float* x, int64_t cols, int64_t group, int8_t* codes, float* scales,
                 int32_t* sums, float* scaled_sums) {
  for (int64_t g = 0; g < cols / group; ++g) {
    const float* xg = x + g * group;
    float amax = 0.0f;
    for (int64_t j = 0; j < group; ++j) amax = std::max(amax, std::fabs(xg[j]));
    float d, id;
    GroupScale(amax, &d, &id);
    int32_t sum = 0;
    for (int64_t j = 0; j < group; ++j) {
      const auto q = static_cast<int32_t>(std::nearbyint(xg[j] * id));
      codes[g * group + j] = static_cast<int8_t>(q);
      sum += q;
    }
    FinishGroup(d, sum, &scales[g], &sums[g], &scaled_sums[g]);
  }
}

}  // namespace portable

// The residual of one row (QuantizeResiduals): one implementation for every ISA, so the
// same codes everywhere (compiled with -ffp-contract=off, the product and the difference
// round separately whether or not the compiler vectorizes them).
void QuantizeResidualRow(const float* x, int64_t cols, int64_t group, const int8_t* codes,
                         const float* scales, int8_t* out_codes, float* out_scales,
                         int32_t* out_sums, float* out_scaled_sums) {
  for (int64_t g = 0; g < cols / group; ++g) {
    const float d = scales[g] / kResidualSteps;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    int32_t sum = 0;
    for (int64_t j = g * group; j < (g + 1) * group; ++j) {
      const float residual = x[j] - static_cast<float>(codes[j]) * scales[g];
      // |residual| <= scales[g] / 2 up to the roundings of x / d, so the code is within
      // +-127 already; the clamp only guards the last ulp.
      const auto q = std::clamp(static_cast<int32_t>(std::nearbyint(residual * id)), -127, 127);
      out_codes[j] = static_cast<int8_t>(q);
      sum += q;
    }
    FinishGroup(d, sum, &out_scales[g], &out_sums[g], &out_scaled_sums[g]);
  }
}

// The arguments of one work item: `rows` rows of quantized x against np (1 .. 4) panels.
struct UnitArgs {
  const uint8_t* panels[kUnitPanels];
  int np;
  int64_t groups;
  int64_t group_bytes;
  int32_t offset;     // code_offset
  const int8_t* xc;   // codes of the first row, row stride `cols`
  const float* xd;    // scales, row stride `groups`
  const float* xds;   // scaled sums
  const int32_t* xs;  // sums
  int64_t rows;
  int64_t cols;
  float* y;  // y[0][0] of the unit, row stride ldy
  int64_t ldy;
  int64_t valid;  // outputs of the unit that exist (<= 16 np)
  // Whether y holds partial sums to continue (the residual pass) rather than nothing yet.
  bool accumulate = false;
};

namespace portable {

void Unit(const UnitArgs& a, bool four, int64_t group, bool bias) {
  for (int64_t r = 0; r < a.rows; ++r) {
    const int8_t* xr = a.xc + r * a.cols;
    for (int64_t o = 0; o < a.valid; ++o) {
      const uint8_t* panel = a.panels[o / kLanes];
      const int64_t l = o % kLanes;
      float acc = a.accumulate ? a.y[r * a.ldy + o] : 0.0f;
      for (int64_t g = 0; g < a.groups; ++g) {
        const uint8_t* gp = panel + g * a.group_bytes;
        const uint8_t* codes = gp + kScaleBytes;
        int32_t isum = 0;
        for (int64_t j = 0; j < group; ++j) {
          int u;
          if (four) {
            u = (codes[(j / 8) * 64 + l * 4 + j % 4] >> (4 * ((j % 8) / 4))) & 0xF;
          } else {
            u = codes[(j / 4) * 64 + l * 4 + j % 4];
          }
          isum += (u - a.offset) * xr[g * group + j];
        }
        float ws, wb;
        std::memcpy(&ws, gp + l * 4, sizeof(float));
        std::memcpy(&wb, gp + (kLanes + l) * 4, sizeof(float));
        const int64_t gi = r * a.groups + g;
        acc = std::fma(static_cast<float>(isum), ws * a.xd[gi], acc);
        if (bias) acc = std::fma(wb, a.xds[gi], acc);
      }
      a.y[r * a.ldy + o] = acc;
    }
  }
}

}  // namespace portable

#if defined(__x86_64__)
KVCM_TARGET_BEGIN("avx2,fma,f16c")
namespace avx2 {

void QuantizeRow(const float* x, int64_t cols, int64_t group, int8_t* codes, float* scales,
                 int32_t* sums, float* scaled_sums) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t g = 0; g < cols / group; ++g) {
    const float* xg = x + g * group;
    __m256 m = _mm256_setzero_ps();
    for (int64_t j = 0; j < group; j += 8) {
      m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(xg + j)));
    }
    alignas(32) float t[8];
    _mm256_store_ps(t, m);
    float amax = 0.0f;
    for (float v : t) amax = std::max(amax, v);
    float d, id;
    GroupScale(amax, &d, &id);
    const __m256 vid = _mm256_set1_ps(id);
    __m256i vsum = _mm256_setzero_si256();
    for (int64_t j = 0; j < group; j += 8) {
      // cvtps rounds to nearest even (the default MXCSR mode), as std::nearbyint does.
      const __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xg + j), vid));
      vsum = _mm256_add_epi32(vsum, q);
      alignas(32) int32_t qi[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(qi), q);
      for (int e = 0; e < 8; ++e) codes[g * group + j + e] = static_cast<int8_t>(qi[e]);
    }
    alignas(32) int32_t s[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(s), vsum);
    int32_t sum = 0;
    for (int32_t v : s) sum += v;
    FinishGroup(d, sum, &scales[g], &sums[g], &scaled_sums[g]);
  }
}

int32_t Load32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// R rows by one panel (two halves of 8 lanes).
template <bool kFour, int G, bool kBias, int R>
void Tile(const UnitArgs& a, const uint8_t* panel, int64_t r0, float* y, int64_t valid) {
  __m256 acc[R][2];
  KVCM_UNROLL
  for (int r = 0; r < R; ++r) {
    if (a.accumulate) {
      alignas(32) float t[16] = {};
      std::memcpy(t, y + r * a.ldy, static_cast<size_t>(valid) * sizeof(float));
      acc[r][0] = _mm256_load_ps(t);
      acc[r][1] = _mm256_load_ps(t + 8);
    } else {
      acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    }
  }
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t g = 0; g < a.groups; ++g) {
    const uint8_t* gp = panel + g * a.group_bytes;
    const uint8_t* codes = gp + kScaleBytes;
    __m256i is[R][2];
    const int8_t* xg[R];
    KVCM_UNROLL
    for (int r = 0; r < R; ++r) {
      xg[r] = a.xc + (r0 + r) * a.cols + g * G;
      is[r][0] = is[r][1] = _mm256_setzero_si256();
    }
    if constexpr (kFour) {
      // Products of nibbles (<= 15) by codes (|q| <= 127): a pair sums to at most 3810 in
      // int16, and the 8 of a group of 32 to 30480, so they add up in int16 exactly.
      KVCM_UNROLL
      for (int q = 0; q < G / 8; ++q) {
        KVCM_UNROLL
        for (int h = 0; h < 2; ++h) {
          const __m256i v =
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + q * 64 + 32 * h));
          const __m256i lo = _mm256_and_si256(v, low);
          const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
          KVCM_UNROLL
          for (int r = 0; r < R; ++r) {
            const __m256i b0 = _mm256_set1_epi32(Load32(xg[r] + 8 * q));
            const __m256i b1 = _mm256_set1_epi32(Load32(xg[r] + 8 * q + 4));
            is[r][h] = _mm256_add_epi16(is[r][h], _mm256_add_epi16(_mm256_maddubs_epi16(lo, b0),
                                                                   _mm256_maddubs_epi16(hi, b1)));
          }
        }
      }
      KVCM_UNROLL
      for (int r = 0; r < R; ++r) {
        KVCM_UNROLL
        for (int h = 0; h < 2; ++h) is[r][h] = _mm256_madd_epi16(is[r][h], ones);
      }
    } else {
      // The sign trick: |c| (<= 128, unsigned) times q with c's sign (|.| <= 127) keeps a
      // pair's sum within int16 (<= 32512); c = u - 128 is u with its top bit flipped.
      KVCM_UNROLL
      for (int q = 0; q < G / 4; ++q) {
        KVCM_UNROLL
        for (int h = 0; h < 2; ++h) {
          const __m256i c = _mm256_xor_si256(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + q * 64 + 32 * h)), flip);
          const __m256i mag = _mm256_abs_epi8(c);
          KVCM_UNROLL
          for (int r = 0; r < R; ++r) {
            const __m256i b = _mm256_sign_epi8(_mm256_set1_epi32(Load32(xg[r] + 4 * q)), c);
            is[r][h] =
                _mm256_add_epi32(is[r][h], _mm256_madd_epi16(_mm256_maddubs_epi16(mag, b), ones));
          }
        }
      }
    }
    const float* sp = reinterpret_cast<const float*>(gp);
    KVCM_UNROLL
    for (int h = 0; h < 2; ++h) {
      const __m256 ws = _mm256_loadu_ps(sp + 8 * h);
      const __m256 wb = _mm256_loadu_ps(sp + kLanes + 8 * h);
      KVCM_UNROLL
      for (int r = 0; r < R; ++r) {
        const int64_t gi = (r0 + r) * a.groups + g;
        __m256i isum = is[r][h];
        // The 8-bit codes' sums above are of c = u - 128 already; the nibbles' are of u.
        if (kFour && a.offset != 0) {
          isum = _mm256_sub_epi32(isum, _mm256_set1_epi32(a.offset * a.xs[gi]));
        }
        acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum),
                                    _mm256_mul_ps(ws, _mm256_set1_ps(a.xd[gi])), acc[r][h]);
        if constexpr (kBias) {
          acc[r][h] = _mm256_fmadd_ps(wb, _mm256_set1_ps(a.xds[gi]), acc[r][h]);
        }
      }
    }
  }
  KVCM_UNROLL
  for (int r = 0; r < R; ++r) {
    alignas(32) float t[16];
    _mm256_store_ps(t, acc[r][0]);
    _mm256_store_ps(t + 8, acc[r][1]);
    std::memcpy(y + r * a.ldy, t, static_cast<size_t>(valid) * sizeof(float));
  }
}

template <bool kFour, int G, bool kBias>
void Unit(const UnitArgs& a) {
  for (int p = 0; p < a.np; ++p) {
    const int64_t v = std::min<int64_t>(a.valid - p * kLanes, kLanes);
    float* yp = a.y + p * kLanes;
    int64_t r = 0;
    for (; r + 2 <= a.rows; r += 2) Tile<kFour, G, kBias, 2>(a, a.panels[p], r, yp + r * a.ldy, v);
    if (r < a.rows) Tile<kFour, G, kBias, 1>(a, a.panels[p], r, yp + r * a.ldy, v);
  }
}

}  // namespace avx2
KVCM_TARGET_END

KVCM_AVX512_TARGET_BEGIN("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512dq,avx512vnni")
namespace vnni {

void QuantizeRow(const float* x, int64_t cols, int64_t group, int8_t* codes, float* scales,
                 int32_t* sums, float* scaled_sums) {
  for (int64_t g = 0; g < cols / group; ++g) {
    const float* xg = x + g * group;
    __m512 v[kMaxGroup / 16];
    const int n = static_cast<int>(group / 16);
    __m512 m = _mm512_setzero_ps();
    for (int i = 0; i < n; ++i) {
      v[i] = _mm512_loadu_ps(xg + 16 * i);
      m = _mm512_max_ps(m, _mm512_abs_ps(v[i]));
    }
    float d, id;
    GroupScale(_mm512_reduce_max_ps(m), &d, &id);
    const __m512 vid = _mm512_set1_ps(id);
    __m512i vsum = _mm512_setzero_si512();
    for (int i = 0; i < n; ++i) {
      // Rounds to nearest even (the default MXCSR mode), as std::nearbyint does.
      const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(v[i], vid));
      vsum = _mm512_add_epi32(vsum, q);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + g * group + 16 * i),
                       _mm512_cvtepi32_epi8(q));
    }
    FinishGroup(d, _mm512_reduce_add_epi32(vsum), &scales[g], &sums[g], &scaled_sums[g]);
  }
}

int32_t Load32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// R rows by NP panels of 16 outputs.
template <bool kFour, int G, bool kBias, int R, int NP>
void Tile(const UnitArgs& a, const uint8_t* const* panels, int64_t r0, float* y, int64_t valid) {
  __m512 acc[R][NP];
  __mmask16 masks[NP];
  KVCM_UNROLL
  for (int p = 0; p < NP; ++p) {
    const int64_t n = std::clamp<int64_t>(valid - p * kLanes, 0, kLanes);
    masks[p] = static_cast<__mmask16>((1u << n) - 1);
    KVCM_UNROLL
    for (int r = 0; r < R; ++r) {
      acc[r][p] = a.accumulate ? _mm512_maskz_loadu_ps(masks[p], y + r * a.ldy + p * kLanes)
                               : _mm512_setzero_ps();
    }
  }
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t g = 0; g < a.groups; ++g) {
    __m512i is[R][NP];
    const int8_t* xg[R];
    KVCM_UNROLL
    for (int r = 0; r < R; ++r) {
      xg[r] = a.xc + (r0 + r) * a.cols + g * G;
      KVCM_UNROLL
      for (int p = 0; p < NP; ++p) is[r][p] = _mm512_setzero_si512();
    }
    const uint8_t* codes[NP];
    KVCM_UNROLL
    for (int p = 0; p < NP; ++p) codes[p] = panels[p] + g * a.group_bytes + kScaleBytes;
    if constexpr (kFour) {
      KVCM_UNROLL
      for (int q = 0; q < G / 8; ++q) {
        __m512i lo[NP], hi[NP];
        KVCM_UNROLL
        for (int p = 0; p < NP; ++p) {
          const __m512i v = _mm512_loadu_si512(codes[p] + q * 64);
          lo[p] = _mm512_and_si512(v, low);
          hi[p] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        }
        KVCM_UNROLL
        for (int r = 0; r < R; ++r) {
          const __m512i b0 = _mm512_set1_epi32(Load32(xg[r] + 8 * q));
          const __m512i b1 = _mm512_set1_epi32(Load32(xg[r] + 8 * q + 4));
          KVCM_UNROLL
          for (int p = 0; p < NP; ++p) {
            is[r][p] = _mm512_dpbusd_epi32(is[r][p], lo[p], b0);
            is[r][p] = _mm512_dpbusd_epi32(is[r][p], hi[p], b1);
          }
        }
      }
    } else {
      KVCM_UNROLL
      for (int q = 0; q < G / 4; ++q) {
        __m512i w[NP];
        KVCM_UNROLL
        for (int p = 0; p < NP; ++p) w[p] = _mm512_loadu_si512(codes[p] + q * 64);
        KVCM_UNROLL
        for (int r = 0; r < R; ++r) {
          const __m512i b = _mm512_set1_epi32(Load32(xg[r] + 4 * q));
          KVCM_UNROLL
          for (int p = 0; p < NP; ++p) is[r][p] = _mm512_dpbusd_epi32(is[r][p], w[p], b);
        }
      }
    }
    KVCM_UNROLL
    for (int p = 0; p < NP; ++p) {
      const float* sp = reinterpret_cast<const float*>(panels[p] + g * a.group_bytes);
      const __m512 ws = _mm512_loadu_ps(sp);
      KVCM_UNROLL
      for (int r = 0; r < R; ++r) {
        const int64_t gi = (r0 + r) * a.groups + g;
        // vpdpbusd summed u * q; the codes are u - offset.
        const __m512i isum = _mm512_sub_epi32(is[r][p], _mm512_set1_epi32(a.offset * a.xs[gi]));
        acc[r][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum),
                                    _mm512_mul_ps(ws, _mm512_set1_ps(a.xd[gi])), acc[r][p]);
        if constexpr (kBias) {
          acc[r][p] =
              _mm512_fmadd_ps(_mm512_loadu_ps(sp + kLanes), _mm512_set1_ps(a.xds[gi]), acc[r][p]);
        }
      }
    }
  }
  KVCM_UNROLL
  for (int p = 0; p < NP; ++p) {
    KVCM_UNROLL
    for (int r = 0; r < R; ++r) {
      _mm512_mask_storeu_ps(y + r * a.ldy + p * kLanes, masks[p], acc[r][p]);
    }
  }
}

// Rows r0 .. r0 + R of all np panels, NP at a time.
template <bool kFour, int G, bool kBias, int R, int NP>
void Panels(const UnitArgs& a, int64_t r0) {
  float* y = a.y + r0 * a.ldy;
  int p = 0;
  for (; p + NP <= a.np; p += NP) {
    Tile<kFour, G, kBias, R, NP>(a, a.panels + p, r0, y + p * kLanes, a.valid - p * kLanes);
  }
  for (; p < a.np; ++p) {
    Tile<kFour, G, kBias, R, 1>(a, a.panels + p, r0, y + p * kLanes, a.valid - p * kLanes);
  }
}

// Tiles of 4 rows by 2 panels (8 int32 and 8 fp32 accumulators, 4 code vectors); fewer rows
// take more panels at once, so even one row keeps 4 independent vpdpbusd chains.
template <bool kFour, int G, bool kBias>
void Unit(const UnitArgs& a) {
  int64_t r = 0;
  for (; r + 4 <= a.rows; r += 4) Panels<kFour, G, kBias, 4, 2>(a, r);
  switch (a.rows - r) {
    case 3:
      Panels<kFour, G, kBias, 3, 2>(a, r);
      break;
    case 2:
      Panels<kFour, G, kBias, 2, 4>(a, r);
      break;
    case 1:
      Panels<kFour, G, kBias, 1, 4>(a, r);
      break;
    default:
      break;
  }
}

}  // namespace vnni
KVCM_AVX512_TARGET_END
#endif  // __x86_64__

enum class Variant { kPortable, kAvx2, kVnni };

Variant ActiveVariant() {
  switch (ActiveCpuIsa()) {
    case CpuIsa::kAvx512:
      return CpuHasAvx512Vnni() ? Variant::kVnni : Variant::kAvx2;
    case CpuIsa::kAvx2:
      return Variant::kAvx2;
    case CpuIsa::kPortable:
      break;
  }
  return Variant::kPortable;
}

using QuantizeFn = void (*)(const float*, int64_t, int64_t, int8_t*, float*, int32_t*, float*);
using UnitFn = void (*)(const UnitArgs&);

QuantizeFn QuantizeFor(Variant v) {
#if defined(__x86_64__)
  if (v == Variant::kVnni) return vnni::QuantizeRow;
  if (v == Variant::kAvx2) return avx2::QuantizeRow;
#endif
  (void)v;
  return portable::QuantizeRow;
}

// The unit loop for a matrix of `w`'s form on variant v.
UnitFn UnitFor(Variant v, const WeightMatrix& w) {
  const bool four = w.format() == WeightMatrix::Format::kCodes4;
  const bool bias = w.has_bias();
  const int64_t group = w.group();
  KVCM_CHECK(group == 32 || (group == 16 && !four)) << group;
#if defined(__x86_64__)
#define KVCM_PICK(ns)                                                                    \
  if (four) return bias ? ns::Unit<true, 32, true> : ns::Unit<true, 32, false>;          \
  if (group == 16) return bias ? ns::Unit<false, 16, true> : ns::Unit<false, 16, false>; \
  return bias ? ns::Unit<false, 32, true> : ns::Unit<false, 32, false>;
  if (v == Variant::kVnni) {
    KVCM_PICK(vnni)
  }
  if (v == Variant::kAvx2) {
    KVCM_PICK(avx2)
  }
#undef KVCM_PICK
#endif
  (void)v;
  return nullptr;  // portable: Unit with runtime arguments
}

void QuantizeRange(QuantizeFn fn, const float* x, int64_t r0, int64_t r1, QuantizedRows* q) {
  const int64_t groups = q->cols / q->group;
  for (int64_t r = r0; r < r1; ++r) {
    fn(x + r * q->cols, q->cols, q->group, q->codes.data() + r * q->cols,
       q->scales.data() + r * groups, q->sums.data() + r * groups,
       q->scaled_sums.data() + r * groups);
  }
}

void QuantizeResidualRange(const float* x, const QuantizedRows& q, int64_t r0, int64_t r1,
                           QuantizedRows* out) {
  const int64_t groups = q.cols / q.group;
  for (int64_t r = r0; r < r1; ++r) {
    QuantizeResidualRow(x + r * q.cols, q.cols, q.group, q.codes.data() + r * q.cols,
                        q.scales.data() + r * groups, out->codes.data() + r * q.cols,
                        out->scales.data() + r * groups, out->sums.data() + r * groups,
                        out->scaled_sums.data() + r * groups);
  }
}

void Resize(int64_t m, int64_t cols, int64_t group, QuantizedRows* q) {
  q->rows = m;
  q->cols = cols;
  q->group = group;
  const auto n = static_cast<size_t>(m * cols);
  const auto groups = static_cast<size_t>(m * (cols / group));
  if (q->codes.size() < n) q->codes.resize(n);
  if (q->scales.size() < groups) {
    q->scales.resize(groups);
    q->sums.resize(groups);
    q->scaled_sums.resize(groups);
  }
}

constexpr int kMaxOutputs = 8;  // products one MatMulInt8 call takes

// Runs the outputs of fp32 matrices on the fp32 path (MatMul) and copies those of coded ones
// into `coded`, skipping empty matrices; returns the number of coded outputs.
int RunFp32Outputs(const float* x, int64_t m, std::span<const MatMulOutput> outputs,
                   int32_t num_threads, MatMulOutput* coded) {
  int num_coded = 0;
  for (const MatMulOutput& o : outputs) {
    if (o.w->empty()) continue;
    if (o.w->format() == WeightMatrix::Format::kFloat32) {
      MatMul(x, m, *o.w, o.y, num_threads);
    } else {
      coded[num_coded++] = o;
    }
  }
  return num_coded;
}

// Quantizes the m rows of x into q (and their residuals into residual, unless it is null),
// on this thread unless x is big.
void QuantizeAllRows(QuantizeFn quantize, const float* x, int64_t m, QuantizedRows* q,
                     QuantizedRows* residual, CpuThreadPool& pool, int32_t threads) {
  const int64_t k = q->cols;
  constexpr int64_t kRowsPerTask = 64;
  auto rows = [&](int64_t r0, int64_t r1) {
    QuantizeRange(quantize, x, r0, r1, q);
    if (residual != nullptr) QuantizeResidualRange(x, *q, r0, r1, residual);
  };
  if (m * k < (int64_t{1} << 18) || threads <= 1) {
    rows(0, m);
  } else {
    pool.ParallelFor((m + kRowsPerTask - 1) / kRowsPerTask, threads, [&](int64_t task) {
      rows(task * kRowsPerTask, std::min(m, (task + 1) * kRowsPerTask));
    });
  }
}

// x (m rows of k columns) quantized once per group size of the coded outputs (32 and 16 at
// most); for_output[i] is the one coded[i] takes, and residual_for_output[i] its residual
// (with `residual` only). Thread-local: the buffers are reused from call to call without
// allocating.
void QuantizeForOutputs(QuantizeFn quantize, const float* x, int64_t m, int64_t k,
                        const MatMulOutput* coded, int num_coded, bool residual,
                        CpuThreadPool& pool, int32_t threads, const QuantizedRows** for_output,
                        const QuantizedRows** residual_for_output) {
  thread_local QuantizedRows quantized[2];
  thread_local QuantizedRows residuals[2];
  for (int slot = 0; slot < 2; ++slot) {
    const int64_t group = slot == 0 ? 32 : 16;
    bool needed = false;
    for (int i = 0; i < num_coded; ++i) {
      if (coded[i].w->group() == group) {
        needed = true;
        for_output[i] = &quantized[slot];
        residual_for_output[i] = residual ? &residuals[slot] : nullptr;
      }
    }
    if (!needed) continue;
    QuantizedRows* q = &quantized[slot];
    Resize(m, k, group, q);
    if (residual) Resize(m, k, group, &residuals[slot]);
    QuantizeAllRows(quantize, x, m, q, residual ? &residuals[slot] : nullptr, pool, threads);
  }
}

// The work item of panels p0 .. p0 + 3 of `w` (those that exist) and rows r0 .. r0 + rows - 1
// of x, quantized in q; y is the output of `w`.
UnitArgs UnitAt(const WeightMatrix& w, const QuantizedRows& q, float* y, int64_t p0, int64_t r0,
                int64_t rows) {
  const int64_t k = w.cols();
  const int64_t n = w.rows();
  const int64_t groups = k / w.group();
  UnitArgs a;
  a.np = static_cast<int>(std::min<int64_t>(kUnitPanels, w.num_panels() - p0));
  for (int p = 0; p < a.np; ++p) a.panels[p] = w.panel(p0 + p);
  a.groups = groups;
  a.group_bytes = w.group_bytes();
  a.offset = w.code_offset();
  a.xc = q.codes.data() + r0 * k;
  a.xd = q.scales.data() + r0 * groups;
  a.xds = q.scaled_sums.data() + r0 * groups;
  a.xs = q.sums.data() + r0 * groups;
  a.rows = rows;
  a.cols = k;
  a.y = y + r0 * n + p0 * kLanes;
  a.ldy = n;
  a.valid = std::min<int64_t>(a.np * kLanes, n - p0 * kLanes);
  return a;
}

// Runs a work item of `w` on `fn`, or on the portable loop where there is none.
void RunUnit(UnitFn fn, const UnitArgs& a, const WeightMatrix& w) {
  if (fn != nullptr) {
    fn(a);
  } else {
    const bool four = w.format() == WeightMatrix::Format::kCodes4;
    portable::Unit(a, four, w.group(), w.has_bias());
  }
}

}  // namespace

std::string_view MatMulPathName(MatMulPath path) {
  switch (path) {
    case MatMulPath::kInt8:
      return "int8";
    case MatMulPath::kInt8x2:
      return "int8x2";
    case MatMulPath::kFp32:
      return "fp32";
  }
  return "?";
}

bool ParseMatMulPath(std::string_view name, MatMulPath* path) {
  for (MatMulPath candidate : {MatMulPath::kInt8, MatMulPath::kInt8x2, MatMulPath::kFp32}) {
    if (name == MatMulPathName(candidate)) {
      *path = candidate;
      return true;
    }
  }
  return false;
}

void QuantizeRows(const float* x, int64_t m, int64_t cols, int64_t group, QuantizedRows* out) {
  KVCM_CHECK(group > 0 && group <= kMaxGroup && group % 16 == 0 && cols % group == 0)
      << cols << " / " << group;
  Resize(m, cols, group, out);
  out->codes.resize(static_cast<size_t>(m * cols));
  out->scales.resize(static_cast<size_t>(m * (cols / group)));
  out->sums.resize(out->scales.size());
  out->scaled_sums.resize(out->scales.size());
  QuantizeRange(QuantizeFor(ActiveVariant()), x, 0, m, out);
}

void QuantizeResiduals(const float* x, const QuantizedRows& q, QuantizedRows* out) {
  Resize(q.rows, q.cols, q.group, out);
  out->codes.resize(static_cast<size_t>(q.rows * q.cols));
  out->scales.resize(static_cast<size_t>(q.rows * (q.cols / q.group)));
  out->sums.resize(out->scales.size());
  out->scaled_sums.resize(out->scales.size());
  QuantizeResidualRange(x, q, 0, q.rows, out);
}

void MatMulInt8(const float* x, int64_t m, std::span<const MatMulOutput> outputs,
                int32_t num_threads, bool residual) {
  if (m <= 0) return;
  // fp32 matrices: the fp32 path; the coded ones share the quantized x below.
  KVCM_CHECK(outputs.size() <= kMaxOutputs) << outputs.size();
  MatMulOutput coded[kMaxOutputs];
  const int num_coded = RunFp32Outputs(x, m, outputs, num_threads, coded);
  if (num_coded == 0) return;
  const int64_t k = coded[0].w->cols();
  for (int i = 1; i < num_coded; ++i) KVCM_CHECK(coded[i].w->cols() == k);

  const Variant variant = ActiveVariant();
  CpuThreadPool& pool = CpuThreadPool::Default();
  const int32_t threads =
      num_threads <= 0 ? pool.max_threads() : std::min(num_threads, pool.max_threads());
  const QuantizedRows* for_output[kMaxOutputs];
  const QuantizedRows* residual_for_output[kMaxOutputs];
  QuantizeForOutputs(QuantizeFor(variant), x, m, k, coded, num_coded, residual, pool, threads,
                     for_output, residual_for_output);

  // Work items: units of 4 panels of every output, in order.
  int64_t first_unit[kMaxOutputs + 1];
  first_unit[0] = 0;
  for (int i = 0; i < num_coded; ++i) {
    first_unit[i + 1] = first_unit[i] + (coded[i].w->num_panels() + kUnitPanels - 1) / kUnitPanels;
  }
  const int64_t units = first_unit[num_coded];
  UnitFn unit_fns[kMaxOutputs];
  for (int i = 0; i < num_coded; ++i) unit_fns[i] = UnitFor(variant, *coded[i].w);
  // Rows of x per pass over the weights: about 256 KiB of codes, to stay in L2.
  const int64_t block_rows = std::max<int64_t>(8, (int64_t{1} << 18) / k);
  const int64_t min_chunk = std::max<int64_t>(1, 65536 / (kUnitPanels * kLanes * k * m));
  const int64_t num_chunks =
      std::min<int64_t>((units + min_chunk - 1) / min_chunk, int64_t{threads} * 4);

  auto run = [&](int64_t chunk) {
    const int64_t begin = chunk * units / num_chunks;
    const int64_t end = (chunk + 1) * units / num_chunks;
    for (int64_t r0 = 0; r0 < m; r0 += block_rows) {
      const int64_t rows = std::min(block_rows, m - r0);
      int i = 0;
      for (int64_t unit = begin; unit < end; ++unit) {
        while (unit >= first_unit[i + 1]) ++i;
        const WeightMatrix& w = *coded[i].w;
        const int64_t p0 = (unit - first_unit[i]) * kUnitPanels;
        RunUnit(unit_fns[i], UnitAt(w, *for_output[i], coded[i].y, p0, r0, rows), w);
        if (residual) {
          // The same weights again (in L1 now), continuing each output's chain.
          UnitArgs rest = UnitAt(w, *residual_for_output[i], coded[i].y, p0, r0, rows);
          rest.accumulate = true;
          RunUnit(unit_fns[i], rest, w);
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
