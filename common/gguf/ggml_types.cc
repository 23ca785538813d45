#include "common/gguf/ggml_types.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "common/base/float16.h"

namespace kvcm {
namespace {

constexpr int64_t kQK = 32;    // elements per block of the 32-element types (QK4_0 etc.)
constexpr int64_t kQKK = 256;  // QK_K: elements per super-block of the k-quants
constexpr int kKScaleSize = 12;

struct TypeRow {
  GgmlType type;
  GgmlTypeTraits traits;
};

// gguf's GGML_QUANT_SIZES (ggml.c's type_traits).
constexpr std::array<TypeRow, 34> kTypes = {{
    {GgmlType::kF32, {"F32", 1, 4}},
    {GgmlType::kF16, {"F16", 1, 2}},
    {GgmlType::kQ4_0, {"Q4_0", kQK, 2 + 16}},
    {GgmlType::kQ4_1, {"Q4_1", kQK, 2 + 2 + 16}},
    {GgmlType::kQ5_0, {"Q5_0", kQK, 2 + 4 + 16}},
    {GgmlType::kQ5_1, {"Q5_1", kQK, 2 + 2 + 4 + 16}},
    {GgmlType::kQ8_0, {"Q8_0", kQK, 2 + 32}},
    {GgmlType::kQ8_1, {"Q8_1", kQK, 4 + 4 + 32}},
    {GgmlType::kQ2_K, {"Q2_K", kQKK, 2 + 2 + kQKK / 16 + kQKK / 4}},
    {GgmlType::kQ3_K, {"Q3_K", kQKK, 2 + kQKK / 4 + kQKK / 8 + 12}},
    {GgmlType::kQ4_K, {"Q4_K", kQKK, 2 + 2 + kQKK / 2 + 12}},
    {GgmlType::kQ5_K, {"Q5_K", kQKK, 2 + 2 + kQKK / 2 + kQKK / 8 + 12}},
    {GgmlType::kQ6_K, {"Q6_K", kQKK, 2 + kQKK / 2 + kQKK / 4 + kQKK / 16}},
    {GgmlType::kQ8_K, {"Q8_K", kQKK, 4 + kQKK + kQKK / 8}},
    {GgmlType::kIQ2_XXS, {"IQ2_XXS", kQKK, 2 + kQKK / 4}},
    {GgmlType::kIQ2_XS, {"IQ2_XS", kQKK, 2 + kQKK / 4 + kQKK / 32}},
    {GgmlType::kIQ3_XXS, {"IQ3_XXS", kQKK, 2 + kQKK / 4 + kQKK / 8}},
    {GgmlType::kIQ1_S, {"IQ1_S", kQKK, 2 + kQKK / 8 + kQKK / 16}},
    {GgmlType::kIQ4_NL, {"IQ4_NL", kQK, 2 + 16}},
    {GgmlType::kIQ3_S, {"IQ3_S", kQKK, 2 + kQKK / 4 + kQKK / 8 + kQKK / 32 + 4}},
    {GgmlType::kIQ2_S, {"IQ2_S", kQKK, 2 + kQKK / 4 + kQKK / 16}},
    {GgmlType::kIQ4_XS, {"IQ4_XS", kQKK, 2 + 2 + kQKK / 2 + kQKK / 64}},
    {GgmlType::kI8, {"I8", 1, 1}},
    {GgmlType::kI16, {"I16", 1, 2}},
    {GgmlType::kI32, {"I32", 1, 4}},
    {GgmlType::kI64, {"I64", 1, 8}},
    {GgmlType::kF64, {"F64", 1, 8}},
    {GgmlType::kIQ1_M, {"IQ1_M", kQKK, kQKK / 8 + kQKK / 16 + kQKK / 32}},
    {GgmlType::kBF16, {"BF16", 1, 2}},
    {GgmlType::kTQ1_0, {"TQ1_0", kQKK, 2 + 4 * 13}},
    {GgmlType::kTQ2_0, {"TQ2_0", kQKK, 2 + 64}},
    {GgmlType::kMXFP4, {"MXFP4", kQK, 1 + 16}},
    {GgmlType::kNVFP4, {"NVFP4", 64, 4 + 32}},
    {GgmlType::kQ1_0, {"Q1_0", 128, 2 + 16}},
}};

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
void StoreU16(uint8_t* p, uint16_t v) { std::memcpy(p, &v, sizeof(v)); }
void StoreU32(uint8_t* p, uint32_t v) { std::memcpy(p, &v, sizeof(v)); }

// --- dequantize_row_* (ggml-quants.c) ---------------------------------------------------

void DequantQ4_0(const uint8_t* x, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, x += 18, y += kQK) {
    const float d = LoadF16(x);
    const uint8_t* qs = x + 2;
    for (int j = 0; j < kQK / 2; ++j) {
      const int x0 = (qs[j] & 0x0F) - 8;
      const int x1 = (qs[j] >> 4) - 8;
      y[j] = static_cast<float>(x0) * d;
      y[j + kQK / 2] = static_cast<float>(x1) * d;
    }
  }
}

void DequantQ4_1(const uint8_t* x, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, x += 20, y += kQK) {
    const float d = LoadF16(x);
    const float m = LoadF16(x + 2);
    const uint8_t* qs = x + 4;
    for (int j = 0; j < kQK / 2; ++j) {
      const int x0 = qs[j] & 0x0F;
      const int x1 = qs[j] >> 4;
      y[j] = static_cast<float>(x0) * d + m;
      y[j + kQK / 2] = static_cast<float>(x1) * d + m;
    }
  }
}

void DequantQ5_0(const uint8_t* x, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, x += 22, y += kQK) {
    const float d = LoadF16(x);
    const uint32_t qh = LoadU32(x + 2);
    const uint8_t* qs = x + 6;
    for (int j = 0; j < kQK / 2; ++j) {
      const uint8_t xh0 = static_cast<uint8_t>(((qh >> (j + 0)) << 4) & 0x10);
      const uint8_t xh1 = static_cast<uint8_t>((qh >> (j + 12)) & 0x10);
      const int x0 = ((qs[j] & 0x0F) | xh0) - 16;
      const int x1 = ((qs[j] >> 4) | xh1) - 16;
      y[j] = static_cast<float>(x0) * d;
      y[j + kQK / 2] = static_cast<float>(x1) * d;
    }
  }
}

void DequantQ5_1(const uint8_t* x, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, x += 24, y += kQK) {
    const float d = LoadF16(x);
    const float m = LoadF16(x + 2);
    const uint32_t qh = LoadU32(x + 4);
    const uint8_t* qs = x + 8;
    for (int j = 0; j < kQK / 2; ++j) {
      const uint8_t xh0 = static_cast<uint8_t>(((qh >> (j + 0)) << 4) & 0x10);
      const uint8_t xh1 = static_cast<uint8_t>((qh >> (j + 12)) & 0x10);
      const int x0 = (qs[j] & 0x0F) | xh0;
      const int x1 = (qs[j] >> 4) | xh1;
      y[j] = static_cast<float>(x0) * d + m;
      y[j + kQK / 2] = static_cast<float>(x1) * d + m;
    }
  }
}

void DequantQ8_0(const uint8_t* x, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, x += 34, y += kQK) {
    const float d = LoadF16(x);
    const uint8_t* qs = x + 2;
    for (int j = 0; j < kQK; ++j) {
      y[j] = static_cast<float>(static_cast<int8_t>(qs[j])) * d;
    }
  }
}

// get_scale_min_k4: the 6-bit scale and min of sub-block j of a Q4_K/Q5_K super-block.
inline void ScaleMinK4(int j, const uint8_t* q, uint8_t* d, uint8_t* m) {
  if (j < 4) {
    *d = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *d = static_cast<uint8_t>((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
    *m = static_cast<uint8_t>((q[j + 4] >> 4) | ((q[j - 0] >> 6) << 4));
  }
}

// block_q4_K: d, dmin (fp16), scales[12], qs[128].
void DequantQ4_K(const uint8_t* x, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, x += 144) {
    const float d = LoadF16(x);
    const float min = LoadF16(x + 2);
    const uint8_t* scales = x + 4;
    const uint8_t* q = x + 4 + kKScaleSize;
    int is = 0;
    for (int j = 0; j < kQKK; j += 64) {
      uint8_t sc, m;
      ScaleMinK4(is + 0, scales, &sc, &m);
      const float d1 = d * static_cast<float>(sc);
      const float m1 = min * static_cast<float>(m);
      ScaleMinK4(is + 1, scales, &sc, &m);
      const float d2 = d * static_cast<float>(sc);
      const float m2 = min * static_cast<float>(m);
      for (int l = 0; l < 32; ++l) *y++ = d1 * static_cast<float>(q[l] & 0xF) - m1;
      for (int l = 0; l < 32; ++l) *y++ = d2 * static_cast<float>(q[l] >> 4) - m2;
      q += 32;
      is += 2;
    }
  }
}

// block_q5_K: d, dmin (fp16), scales[12], qh[32], qs[128].
void DequantQ5_K(const uint8_t* x, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, x += 176) {
    const float d = LoadF16(x);
    const float min = LoadF16(x + 2);
    const uint8_t* scales = x + 4;
    const uint8_t* qh = x + 4 + kKScaleSize;
    const uint8_t* ql = qh + kQKK / 8;
    int is = 0;
    unsigned u1 = 1, u2 = 2;
    for (int j = 0; j < kQKK; j += 64) {
      uint8_t sc, m;
      ScaleMinK4(is + 0, scales, &sc, &m);
      const float d1 = d * static_cast<float>(sc);
      const float m1 = min * static_cast<float>(m);
      ScaleMinK4(is + 1, scales, &sc, &m);
      const float d2 = d * static_cast<float>(sc);
      const float m2 = min * static_cast<float>(m);
      for (int l = 0; l < 32; ++l) {
        *y++ = d1 * static_cast<float>((ql[l] & 0xF) + ((qh[l] & u1) != 0 ? 16 : 0)) - m1;
      }
      for (int l = 0; l < 32; ++l) {
        *y++ = d2 * static_cast<float>((ql[l] >> 4) + ((qh[l] & u2) != 0 ? 16 : 0)) - m2;
      }
      ql += 32;
      is += 2;
      u1 <<= 2;
      u2 <<= 2;
    }
  }
}

// block_q6_K: ql[128], qh[64], scales[16] (int8), d (fp16).
void DequantQ6_K(const uint8_t* x, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, x += 210) {
    const float d = LoadF16(x + 128 + 64 + 16);
    const uint8_t* ql = x;
    const uint8_t* qh = x + 128;
    const uint8_t* sc = x + 128 + 64;
    for (int n = 0; n < kQKK; n += 128) {
      for (int l = 0; l < 32; ++l) {
        const int is = l / 16;
        const int q1 = static_cast<int8_t>((ql[l + 0] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
        const int q2 = static_cast<int8_t>((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
        const int q3 = static_cast<int8_t>((ql[l + 0] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
        const int q4 = static_cast<int8_t>((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
        y[l + 0] = d * static_cast<float>(static_cast<int8_t>(sc[is + 0])) * static_cast<float>(q1);
        y[l + 32] =
            d * static_cast<float>(static_cast<int8_t>(sc[is + 2])) * static_cast<float>(q2);
        y[l + 64] =
            d * static_cast<float>(static_cast<int8_t>(sc[is + 4])) * static_cast<float>(q3);
        y[l + 96] =
            d * static_cast<float>(static_cast<int8_t>(sc[is + 6])) * static_cast<float>(q4);
      }
      y += 128;
      ql += 64;
      qh += 32;
      sc += 8;
    }
  }
}

// --- quantize_row_*_ref (ggml-quants.c) -------------------------------------------------

// The element of largest magnitude (the first of equal ones), with its sign.
float SignedAbsMax(const float* x, int n) {
  float amax = 0.0f;
  float max = 0.0f;
  for (int j = 0; j < n; ++j) {
    const float v = x[j];
    if (amax < std::fabs(v)) {
      amax = std::fabs(v);
      max = v;
    }
  }
  return max;
}

void MinMax(const float* x, int n, float* min, float* max) {
  *min = std::numeric_limits<float>::max();
  *max = -std::numeric_limits<float>::max();
  for (int j = 0; j < n; ++j) {
    if (x[j] < *min) *min = x[j];
    if (x[j] > *max) *max = x[j];
  }
}

// v truncated as ggml's (int8_t) cast does, clamped to [0, hi] (gguf's trunc, astype,
// clip); NaN gives 0 (never an out-of-range conversion).
inline uint8_t TruncClamp(float v, int hi) {
  if (!(v >= 0.0f)) return 0;
  if (v >= static_cast<float>(hi)) return static_cast<uint8_t>(hi);
  return static_cast<uint8_t>(static_cast<int>(v));
}

// roundf(v) as an int8 (ggml's Q8_0), saturated; NaN gives 0.
inline int8_t RoundInt8(float v) {
  if (!(v > -128.0f)) return v <= -128.0f ? int8_t{-128} : int8_t{0};
  if (v >= 127.0f) return 127;
  return static_cast<int8_t>(std::roundf(v));
}

void QuantQ4_0(const float* x, uint8_t* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, x += kQK, y += 18) {
    const float max = SignedAbsMax(x, kQK);
    const float d = max / -8;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    StoreU16(y, HalfFromFloatKeepingNanPayload(d));
    for (int j = 0; j < kQK / 2; ++j) {
      const uint8_t xi0 = TruncClamp(x[j] * id + 8.5f, 15);
      const uint8_t xi1 = TruncClamp(x[kQK / 2 + j] * id + 8.5f, 15);
      y[2 + j] = static_cast<uint8_t>(xi0 | (xi1 << 4));
    }
  }
}

void QuantQ4_1(const float* x, uint8_t* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, x += kQK, y += 20) {
    float min, max;
    MinMax(x, kQK, &min, &max);
    const float d = (max - min) / ((1 << 4) - 1);
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    StoreU16(y, HalfFromFloatKeepingNanPayload(d));
    StoreU16(y + 2, HalfFromFloatKeepingNanPayload(min));
    for (int j = 0; j < kQK / 2; ++j) {
      const uint8_t xi0 = TruncClamp((x[j] - min) * id + 0.5f, 15);
      const uint8_t xi1 = TruncClamp((x[kQK / 2 + j] - min) * id + 0.5f, 15);
      y[4 + j] = static_cast<uint8_t>(xi0 | (xi1 << 4));
    }
  }
}

void QuantQ5_0(const float* x, uint8_t* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, x += kQK, y += 22) {
    const float max = SignedAbsMax(x, kQK);
    const float d = max / -16;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    StoreU16(y, HalfFromFloatKeepingNanPayload(d));
    uint32_t qh = 0;
    for (int j = 0; j < kQK / 2; ++j) {
      const uint8_t xi0 = TruncClamp(x[j] * id + 16.5f, 31);
      const uint8_t xi1 = TruncClamp(x[kQK / 2 + j] * id + 16.5f, 31);
      y[6 + j] = static_cast<uint8_t>((xi0 & 0x0F) | ((xi1 & 0x0F) << 4));
      qh |= ((xi0 & 0x10u) >> 4) << (j + 0);
      qh |= ((xi1 & 0x10u) >> 4) << (j + kQK / 2);
    }
    StoreU32(y + 2, qh);
  }
}

void QuantQ5_1(const float* x, uint8_t* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, x += kQK, y += 24) {
    float min, max;
    MinMax(x, kQK, &min, &max);
    const float d = (max - min) / ((1 << 5) - 1);
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    StoreU16(y, HalfFromFloatKeepingNanPayload(d));
    StoreU16(y + 2, HalfFromFloatKeepingNanPayload(min));
    uint32_t qh = 0;
    for (int j = 0; j < kQK / 2; ++j) {
      const uint8_t xi0 = TruncClamp((x[j] - min) * id + 0.5f, 31);
      const uint8_t xi1 = TruncClamp((x[kQK / 2 + j] - min) * id + 0.5f, 31);
      y[8 + j] = static_cast<uint8_t>((xi0 & 0x0F) | ((xi1 & 0x0F) << 4));
      qh |= ((xi0 & 0x10u) >> 4) << (j + 0);
      qh |= ((xi1 & 0x10u) >> 4) << (j + kQK / 2);
    }
    StoreU32(y + 4, qh);
  }
}

void QuantQ8_0(const float* x, uint8_t* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, x += kQK, y += 34) {
    float amax = 0.0f;
    for (int j = 0; j < kQK; ++j) amax = std::max(amax, std::fabs(x[j]));
    const float d = amax / ((1 << 7) - 1);
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    StoreU16(y, HalfFromFloatKeepingNanPayload(d));
    for (int j = 0; j < kQK; ++j) {
      y[2 + j] = static_cast<uint8_t>(RoundInt8(x[j] * id));
    }
  }
}

absl::Status CheckSizes(GgmlType type, size_t elements, size_t bytes, const char* what) {
  const std::optional<GgmlTypeTraits> traits = GetGgmlTypeTraits(type);
  if (!traits.has_value()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": ", GgmlTypeName(type), " is not a ggml type"));
  }
  const size_t block = static_cast<size_t>(traits->block_size);
  if (elements % block != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": ", elements, " elements of ", traits->name, " are not whole blocks of ", block));
  }
  const size_t want = elements / block * static_cast<size_t>(traits->type_size);
  if (bytes != want) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", elements, " elements of ",
                                                   traits->name, " take ", want, " bytes, not ",
                                                   bytes));
  }
  return absl::OkStatus();
}

}  // namespace

std::optional<GgmlTypeTraits> GetGgmlTypeTraits(GgmlType type) {
  for (const TypeRow& row : kTypes) {
    if (row.type == type) return row.traits;
  }
  return std::nullopt;
}

std::string GgmlTypeName(GgmlType type) {
  const std::optional<GgmlTypeTraits> traits = GetGgmlTypeTraits(type);
  if (traits.has_value()) return std::string(traits->name);
  return absl::StrCat("type ", static_cast<uint32_t>(type));
}

bool CanDequantize(GgmlType type) {
  switch (type) {
    case GgmlType::kF32:
    case GgmlType::kF16:
    case GgmlType::kBF16:
    case GgmlType::kQ8_0:
    case GgmlType::kQ4_0:
    case GgmlType::kQ4_1:
    case GgmlType::kQ5_0:
    case GgmlType::kQ5_1:
    case GgmlType::kQ4_K:
    case GgmlType::kQ5_K:
    case GgmlType::kQ6_K:
      return true;
    default:
      return false;
  }
}

bool CanQuantize(GgmlType type) {
  switch (type) {
    case GgmlType::kF32:
    case GgmlType::kF16:
    case GgmlType::kBF16:
    case GgmlType::kQ8_0:
    case GgmlType::kQ4_0:
    case GgmlType::kQ4_1:
    case GgmlType::kQ5_0:
    case GgmlType::kQ5_1:
      return true;
    default:
      return false;
  }
}

absl::StatusOr<int64_t> TypeBytes(GgmlType type, int64_t element_count) {
  const std::optional<GgmlTypeTraits> traits = GetGgmlTypeTraits(type);
  if (!traits.has_value()) {
    return absl::InvalidArgumentError(absl::StrCat(GgmlTypeName(type), " is not a ggml type"));
  }
  if (element_count < 0 || element_count % traits->block_size != 0) {
    return absl::InvalidArgumentError(absl::StrCat(element_count, " elements of ", traits->name,
                                                   " are not whole blocks of ",
                                                   traits->block_size));
  }
  const int64_t blocks = element_count / traits->block_size;
  if (blocks > std::numeric_limits<int64_t>::max() / traits->type_size) {
    return absl::InvalidArgumentError(
        absl::StrCat(element_count, " elements of ", traits->name, " overflow a byte count"));
  }
  return blocks * traits->type_size;
}

absl::Status Dequantize(GgmlType type, std::span<const std::byte> src, std::span<float> dst) {
  if (!CanDequantize(type)) {
    if (!GetGgmlTypeTraits(type).has_value()) {
      return absl::InvalidArgumentError(
          absl::StrCat("dequantize: ", GgmlTypeName(type), " is not a ggml type"));
    }
    return absl::UnimplementedError(
        absl::StrCat("dequantize: ", GgmlTypeName(type), " is not implemented"));
  }
  if (absl::Status status = CheckSizes(type, dst.size(), src.size(), "dequantize"); !status.ok()) {
    return status;
  }
  const uint8_t* x = reinterpret_cast<const uint8_t*>(src.data());
  float* y = dst.data();
  const int64_t n = static_cast<int64_t>(dst.size());
  switch (type) {
    case GgmlType::kF32:
      if (n > 0) std::memcpy(y, x, src.size());
      break;
    case GgmlType::kF16:
      for (int64_t i = 0; i < n; ++i) y[i] = FloatFromHalf(LoadU16(x + 2 * i));
      break;
    case GgmlType::kBF16:
      for (int64_t i = 0; i < n; ++i) y[i] = FloatFromBFloat16(LoadU16(x + 2 * i));
      break;
    case GgmlType::kQ4_0:
      DequantQ4_0(x, y, n / kQK);
      break;
    case GgmlType::kQ4_1:
      DequantQ4_1(x, y, n / kQK);
      break;
    case GgmlType::kQ5_0:
      DequantQ5_0(x, y, n / kQK);
      break;
    case GgmlType::kQ5_1:
      DequantQ5_1(x, y, n / kQK);
      break;
    case GgmlType::kQ8_0:
      DequantQ8_0(x, y, n / kQK);
      break;
    case GgmlType::kQ4_K:
      DequantQ4_K(x, y, n / kQKK);
      break;
    case GgmlType::kQ5_K:
      DequantQ5_K(x, y, n / kQKK);
      break;
    case GgmlType::kQ6_K:
      DequantQ6_K(x, y, n / kQKK);
      break;
    default:
      break;  // excluded by CanDequantize
  }
  return absl::OkStatus();
}

absl::Status Quantize(GgmlType type, std::span<const float> src, std::span<std::byte> dst) {
  if (!CanQuantize(type)) {
    if (!GetGgmlTypeTraits(type).has_value()) {
      return absl::InvalidArgumentError(
          absl::StrCat("quantize: ", GgmlTypeName(type), " is not a ggml type"));
    }
    return absl::UnimplementedError(
        absl::StrCat("quantize: ", GgmlTypeName(type), " is not implemented"));
  }
  if (absl::Status status = CheckSizes(type, src.size(), dst.size(), "quantize"); !status.ok()) {
    return status;
  }
  const float* x = src.data();
  uint8_t* y = reinterpret_cast<uint8_t*>(dst.data());
  const int64_t n = static_cast<int64_t>(src.size());
  switch (type) {
    case GgmlType::kF32:
      if (n > 0) std::memcpy(y, x, dst.size());
      break;
    case GgmlType::kF16:
      for (int64_t i = 0; i < n; ++i) StoreU16(y + 2 * i, HalfFromFloatKeepingNanPayload(x[i]));
      break;
    case GgmlType::kBF16:
      for (int64_t i = 0; i < n; ++i) StoreU16(y + 2 * i, BFloat16FromFloat(x[i]));
      break;
    case GgmlType::kQ4_0:
      QuantQ4_0(x, y, n / kQK);
      break;
    case GgmlType::kQ4_1:
      QuantQ4_1(x, y, n / kQK);
      break;
    case GgmlType::kQ5_0:
      QuantQ5_0(x, y, n / kQK);
      break;
    case GgmlType::kQ5_1:
      QuantQ5_1(x, y, n / kQK);
      break;
    case GgmlType::kQ8_0:
      QuantQ8_0(x, y, n / kQK);
      break;
    default:
      break;  // excluded by CanQuantize
  }
  return absl::OkStatus();
}

}  // namespace kvcm
