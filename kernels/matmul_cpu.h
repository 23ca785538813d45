#pragma once
// The CPU matrix product of the model's projections, y = x . W^T, with W kept in its
// quantized form (docs/architecture.md, "Models").
//
//   WeightMatrix  W [rows][cols] (out features x in features), packed once at load into
//                 panels of 16 rows: an fp32 panel holds W's values k by k ([cols][16]
//                 floats); a coded panel holds, per group of 32 (Q6_K: 16) columns, one fp32
//                 scale and bias per row and the integer codes (4 bits for Q4_0, Q4_1,
//                 Q4_K; 8 bits for Q5_0, Q5_1, Q8_0, Q5_K, Q6_K), value = code * scale + bias.
//                 That is ggml's reference dequantization for every type below, operation
//                 for operation (the K-quants' sub-block scale products d * sc are folded
//                 into `scale` exactly as ggml computes them), so DequantizeRow gives
//                 bitwise the floats of Dequantize (common/gguf/ggml_types.h). Types with no
//                 code form here (F16, BF16, and any other type Dequantize implements) are
//                 dequantized to fp32 panels.
//   MatMul        y[m][rows] = x[m][cols] . W^T in fp32: four coded panels at a time are
//                 dequantized 128 columns at a time into an fp32 buffer in L1 and reused for
//                 up to ~512 KiB of rows of x (the partial sums wait in y, exactly); the
//                 register tile is up to 6 rows of x by 64 columns of y (AVX-512), 3 by 32
//                 (AVX2).
//
// Determinism: every y[i][j] is one chain of multiply-adds over k = 0 .. cols - 1 in order,
// from 0, fused (FMA) on AVX2 and AVX-512 and unfused in the portable code. It does not
// depend on m, on which other rows x holds, on the thread count, nor on AVX2 vs AVX-512
// (the same bits); the portable code differs from those in rounding only.
//
// Thread safety: a WeightMatrix is immutable after construction; MatMul may run
// concurrently (its parallel loops take turns on the kernels' thread pool).

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "common/gguf/ggml_types.h"

namespace kvcm::kernels {

class WeightMatrix {
 public:
  enum class Format : uint8_t {
    kFloat32,  // fp32 panels
    kCodes4,   // 4-bit codes (two per byte), fp32 scale and bias per group
    kCodes8,   // 8-bit signed codes, fp32 scale and bias per group
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
  int32_t code_offset() const { return code_offset_; }

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
  int32_t code_offset_ = 0;  // kCodes4: value code = stored nibble - code_offset_
  int64_t panel_bytes_ = 0;
  std::vector<uint8_t> data_;
};

// y[m][w.rows()] = x[m][w.cols()] . W^T (row-major, y not aliasing x), split over W's
// panels on up to num_threads threads of CpuThreadPool::Default() (<= 0: all). m may be 0.
void MatMul(const float* x, int64_t m, const WeightMatrix& w, float* y, int32_t num_threads);

}  // namespace kvcm::kernels
