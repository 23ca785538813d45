#pragma once
// The CPU matrix product of the model's projections, y = x . W^T, with W kept in its
// quantized form (docs/architecture.md, "Models"). Two paths: MatMulInt8 (the executor's
// default for quantized matrices) and MatMul (fp32, the reference).
//
//   WeightMatrix  W [rows][cols] (out features x in features), packed once at load into
//                 panels of 16 rows: an fp32 panel holds W's values k by k ([cols][16]
//                 floats); a coded panel holds, per group of 32 (Q6_K: 16) columns, one fp32
//                 scale and bias per row (16 scales, then 16 biases) and the unsigned codes
//                 u (4 bits for Q4_0, Q4_1, Q4_K; 8 bits for Q5_0, Q5_1, Q8_0, Q5_K, Q6_K),
//                 value = float(u - code_offset) * scale + bias. That is ggml's reference
//                 dequantization for every type below, operation for operation (the
//                 K-quants' sub-block scale products d * sc are folded into `scale` exactly as
//                 ggml computes them), so DequantizeRow gives bitwise the floats of
//                 Dequantize (common/gguf/ggml_types.h). The codes of a group lie in blocks
//                 of 64 bytes, one dword per row: 4 consecutive columns of 8-bit codes, or 8
//                 of 4-bit codes (4 in the low nibbles, the next 4 in the high ones), so one
//                 vpdpbusd multiplies 4 columns of 16 rows by 4 broadcast activation bytes.
//                 Types with no code form here (F16, BF16, and any other type Dequantize
//                 implements) are dequantized to fp32 panels.
//   MatMul        y = x . W^T in fp32: four coded panels at a time are dequantized 128
//                 columns at a time into an fp32 buffer in L1 and reused for up to ~512 KiB of
//                 rows of x (the partial sums wait in y, exactly); the register tile is up to
//                 6 rows of x by 64 columns of y (AVX-512), 3 by 32 (AVX2).
//   MatMulInt8    y = x8 . W^T with integer dot products, as llama.cpp multiplies its quantized
//                 types: each row of x is quantized per group of W's group size to int8 codes
//                 q with one fp32 scale d = max|x| / 127 (round to nearest even, QuantizeRows),
//                 and per group and output
//                   y += float(isum) * (w_scale * d) + w_bias * (d * float(qsum))  (two FMAs)
//                 where isum = sum (u - code_offset) * q is exact in int32 and qsum = sum q
//                 (the bias term only for types with a min: Q4_1, Q5_1, Q4_K, Q5_K). Inner
//                 loops: AVX-512 VNNI (vpdpbusd of the unsigned codes by the signed q, less
//                 code_offset * qsum), AVX2 (vpmaddubsw + vpmaddwd; 8-bit codes through the
//                 sign trick, so no int16 sum saturates) and portable C++ (std::fma); register
//                 tiles up to 4 rows of x by 32 columns of y. fp32 matrices take MatMul.
//                 With `residual` (the int8x2 path) each group's rounding residual
//                 r = x - q * d is quantized again, to codes q' with d' = d / 254
//                 (QuantizeResiduals), and a second pass over the same weights continues
//                 every output's chain with q' and d': x is then carried to within d / 508
//                 (about 15 bits per group instead of 8) for twice the integer work.
//
// Determinism: in MatMul every y[i][j] is one chain of multiply-adds over k = 0 .. cols - 1 in
// order, from 0, fused (FMA) on AVX2 and AVX-512 and unfused in the portable code. It does
// not depend on m, on which other rows x holds, on the thread count, nor on AVX2 vs AVX-512
// (the same bits); the portable code differs from those in rounding only. In MatMulInt8 a
// row is quantized on its own, the integer sums are exact and every y[i][j] is the same
// chain of two FMAs per group in group order on every ISA (portable, AVX2, VNNI), then the
// residual's groups in order: the same bits whatever m, the other rows, the threads or the
// ISA.
//
// Thread safety: a WeightMatrix is immutable after construction; MatMul and MatMulInt8 may
// run concurrently (their parallel loops take turns on the kernels' thread pool).

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "common/gguf/ggml_types.h"

namespace kvcm::kernels {

class WeightMatrix {
 public:
  enum class Format : uint8_t {
    kFloat32,  // fp32 panels
    kCodes4,   // 4-bit unsigned codes (two per byte), fp32 scale and bias per group
    kCodes8,   // 8-bit unsigned codes (code_offset 128), fp32 scale and bias per group
  };

  static constexpr int64_t kPanelRows = 16;

  WeightMatrix() = default;  // empty: 0 x 0
  WeightMatrix(WeightMatrix&&) = default;
  WeightMatrix& operator=(WeightMatrix&&) = default;
  WeightMatrix(const WeightMatrix&) = delete;
  WeightMatrix& operator=(const WeightMatrix&) = delete;

  // W from fp32 values, row-major [rows][cols]. REQUIRES: w.size() == rows * cols.
  static WeightMatrix FromFloat(std::span<const float> w, int64_t rows, int64_t cols);

  // W from a GGUF tensor of `type`: `data` holds `rows` rows of `cols` elements each, as ggml
  // lays them out (a row is cols / block_size blocks). Row r of W is row row_order[r] of the
  // data (row_order empty: row r). Errors: INVALID_ARGUMENT when cols is not a multiple of
  // the type's block size, data is not exactly rows rows, or row_order is not rows entries
  // in [0, rows); UNIMPLEMENTED for a type Dequantize does not implement (naming it).
  static absl::StatusOr<WeightMatrix> FromGgml(GgmlType type, std::span<const std::byte> data,
                                               int64_t rows, int64_t cols,
                                               std::span<const int64_t> row_order = {});

  int64_t rows() const { return rows_; }
  int64_t cols() const { return cols_; }
  bool empty() const { return rows_ == 0; }
  Format format() const { return format_; }
  // Columns sharing one scale and bias (coded formats); 1 for fp32.
  int64_t group() const { return group_; }
  // The bytes the packed panels take.
  int64_t bytes() const { return static_cast<int64_t>(data_.size()); }

  // out[cols] = row r of W in fp32. REQUIRES: 0 <= r < rows().
  void DequantizeRow(int64_t r, float* out) const;
  // W in fp32, row-major [rows][cols] (for a device upload).
  std::vector<float> Dequantize() const;

  // Internal layout, for MatMul.
  int64_t num_panels() const { return (rows_ + kPanelRows - 1) / kPanelRows; }
  int64_t panel_bytes() const { return panel_bytes_; }
  int64_t group_bytes() const;
  const uint8_t* panel(int64_t p) const { return data_.data() + p * panel_bytes_; }
  // Value code = stored unsigned code - code_offset() (Q4_0: 8; 8-bit codes: 128; else 0).
  int32_t code_offset() const { return code_offset_; }
  // Whether the biases may be nonzero (types with a min); MatMulInt8 skips them otherwise.
  bool has_bias() const { return has_bias_; }

 private:
  void Allocate(Format format, int64_t rows, int64_t cols, int64_t group, int32_t code_offset);
  uint8_t* mutable_panel(int64_t p) { return data_.data() + p * panel_bytes_; }
  // Stores row r's codes (cols of them), scales and biases (cols / group each).
  void SetCodedRow(int64_t r, const int8_t* codes, const float* scales, const float* biases);
  void SetFloatRow(int64_t r, const float* values);

  Format format_ = Format::kFloat32;
  int64_t rows_ = 0;
  int64_t cols_ = 0;
  int64_t group_ = 1;
  int32_t code_offset_ = 0;  // value code = stored code - code_offset_
  bool has_bias_ = false;
  int64_t panel_bytes_ = 0;
  std::vector<uint8_t> data_;
};

// y[m][w.rows()] = x[m][w.cols()] . W^T (row-major, y not aliasing x), split over W's
// panels on up to num_threads threads of CpuThreadPool::Default() (<= 0: all). m may be 0.
void MatMul(const float* x, int64_t m, const WeightMatrix& w, float* y, int32_t num_threads);

// Which path a caller (LlamaModel) multiplies its coded matrices on.
enum class MatMulPath : uint8_t {
  kInt8,    // MatMulInt8 (fp32 matrices still take MatMul)
  kFp32,    // MatMul, the reference
  kInt8x2,  // MatMulInt8 with residual = true
};
std::string_view MatMulPathName(MatMulPath path);  // "int8", "fp32", "int8x2"
bool ParseMatMulPath(std::string_view name, MatMulPath* path);

// Rows of activations quantized to 8 bits per group of `group` columns, as MatMulInt8
// multiplies them: codes[r][k] = round_to_nearest_even(x[r][k] / d) with d = scales[r][g] =
// max_k |x[r][k]| / 127 over the group (fp32 division; 1 / d multiplies, 0 for d = 0),
// sums[r][g] = sum of the group's codes, scaled_sums[r][g] = d * float(sums[r][g]).
struct QuantizedRows {
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t group = 0;
  std::vector<int8_t> codes;       // [rows][cols]
  std::vector<float> scales;       // [rows][cols / group]
  std::vector<int32_t> sums;       // [rows][cols / group]
  std::vector<float> scaled_sums;  // [rows][cols / group]
};
// *out = x[m][cols] quantized (on the calling thread, ActiveCpuIsa()'s loops, which all give
// the same codes). REQUIRES: cols % group == 0.
void QuantizeRows(const float* x, int64_t m, int64_t cols, int64_t group, QuantizedRows* out);
// *out = the residuals of q = QuantizeRows(x): per element r = x - float(code) * d (two fp32
// roundings), quantized with the group's d' = d / 254 (out->scales) to
// codes = clamp(round_to_nearest_even(r * (1 / d')), -127, 127) (1 / d' is 0 for d' = 0),
// with sums and scaled sums as QuantizeRows's. On the calling thread, one loop for every ISA.
void QuantizeResiduals(const float* x, const QuantizedRows& q, QuantizedRows* out);

// One product of a MatMulInt8 call: y[m][w->rows()] = x . W^T.
struct MatMulOutput {
  const WeightMatrix* w;
  float* y;
};

// y = x[m][cols] . W^T for each output (all of the same cols; y not aliasing x), on the
// integer path for coded matrices (x quantized once per group size and shared by them, and
// one parallel loop for all of them: q, k and v, or gate and up, take one) and MatMul for
// fp32 ones; with `residual`, a second pass multiplies the residuals' codes (see above). Up
// to num_threads threads of CpuThreadPool::Default() (<= 0: all). m may be 0.
void MatMulInt8(const float* x, int64_t m, std::span<const MatMulOutput> outputs,
                int32_t num_threads, bool residual = false);
inline void MatMulInt8(const float* x, int64_t m, const WeightMatrix& w, float* y,
                       int32_t num_threads, bool residual = false) {
  const MatMulOutput output{&w, y};
  MatMulInt8(x, m, std::span<const MatMulOutput>(&output, 1), num_threads, residual);
}

}  // namespace kvcm::kernels
