// kernels::WeightMatrix and kernels::MatMul against ggml's reference dequantization
// (common/gguf/ggml_types.h) and a float64 matrix product of the dequantized weights, for
// every packed type, on every ISA this CPU has; and the determinism MatMul promises: a row's
// result does not depend on the other rows, the thread count or AVX2 vs AVX-512.
//
// Error bound per output: |y - ref| <= 1e-5 * sum_k |x_k| |w_k| (fp32 rounding of a
// K-term sum is far below it; a wrong weight or a lost term is far above it).

#include "kernels/matmul_cpu.h"

#include <cmath>
#include <cstring>
#include <iostream>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "kernels/cpu_isa.h"
#include "tests/kernels/matmul_test_matrices.h"
#include "tests/support/status_matchers.h"

namespace kvcm::kernels {
namespace {

constexpr uint32_t kSeed = 20261201;

using matmul_test::RandomTensor;

std::vector<float> RandomFloats(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& f : v) f = normal(rng);
  return v;
}

// Row r of the tensor, dequantized by ggml's reference.
std::vector<float> ReferenceRow(GgmlType type, const std::vector<std::byte>& data, int64_t cols,
                                int64_t r) {
  const int64_t row_bytes = TypeBytes(type, cols).value();
  std::vector<float> out(static_cast<size_t>(cols));
  EXPECT_THAT(Dequantize(type,
                         std::span<const std::byte>(data).subspan(
                             static_cast<size_t>(r * row_bytes), static_cast<size_t>(row_bytes)),
                         out),
              IsOk());
  return out;
}

const GgmlType kTypes[] = {GgmlType::kF32,  GgmlType::kF16,  GgmlType::kBF16, GgmlType::kQ4_0,
                           GgmlType::kQ4_1, GgmlType::kQ5_0, GgmlType::kQ5_1, GgmlType::kQ8_0,
                           GgmlType::kQ4_K, GgmlType::kQ5_K, GgmlType::kQ6_K};

class WeightMatrixTest : public ::testing::TestWithParam<GgmlType> {};

TEST_P(WeightMatrixTest, RowsAreGgmlsDequantizationInTheGivenOrder) {
  const GgmlType type = GetParam();
  const int64_t rows = 37;
  const int64_t cols = 512;
  std::cout << "type " << GgmlTypeName(type) << " seed " << kSeed << std::endl;
  const std::vector<std::byte> data = RandomTensor(type, rows, cols, kSeed);
  std::vector<int64_t> order(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) order[static_cast<size_t>(r)] = (r * 7 + 3) % rows;
  absl::StatusOr<WeightMatrix> w = WeightMatrix::FromGgml(type, data, rows, cols, order);
  ASSERT_THAT(w, IsOk());
  const std::vector<float> all = w->Dequantize();
  std::vector<float> row(static_cast<size_t>(cols));
  for (int64_t r = 0; r < rows; ++r) {
    const std::vector<float> ref = ReferenceRow(type, data, cols, order[static_cast<size_t>(r)]);
    w->DequantizeRow(r, row.data());
    for (int64_t k = 0; k < cols; ++k) {
      // ==, not memcmp: a code of 0 times a scale may be -0 in ggml and +0 here.
      ASSERT_EQ(row[static_cast<size_t>(k)], ref[static_cast<size_t>(k)])
          << "row " << r << " col " << k;
      ASSERT_EQ(all[static_cast<size_t>(r * cols + k)], ref[static_cast<size_t>(k)]);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Types, WeightMatrixTest, ::testing::ValuesIn(kTypes),
                         [](const ::testing::TestParamInfo<GgmlType>& param) {
                           return GgmlTypeName(param.param);
                         });

// y = x . W^T on `isa`, `threads` threads.
std::vector<float> RunMatMul(const std::vector<float>& x, int64_t m, const WeightMatrix& w,
                             CpuIsa isa, int32_t threads) {
  SetCpuIsaForTest(isa);
  std::vector<float> y(static_cast<size_t>(m * w.rows()), -12345.0f);
  MatMul(x.data(), m, w, y.data(), threads);
  SetCpuIsaForTest(BestCpuIsa());
  return y;
}

void ExpectNearReference(const std::vector<float>& x, int64_t m, const WeightMatrix& w,
                         const std::vector<float>& y) {
  const std::vector<float> wf = w.Dequantize();
  const int64_t n = w.rows();
  const int64_t k = w.cols();
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double ref = 0;
      double magnitude = 0;
      for (int64_t e = 0; e < k; ++e) {
        const double p =
            double{x[static_cast<size_t>(i * k + e)]} * double{wf[static_cast<size_t>(j * k + e)]};
        ref += p;
        magnitude += std::abs(p);
      }
      const float got = y[static_cast<size_t>(i * n + j)];
      ASSERT_LE(std::abs(got - ref), 1e-5 * magnitude + 1e-30)
          << "y[" << i << "][" << j << "] = " << got << ", reference " << ref;
    }
  }
}

class MatMulTest : public ::testing::TestWithParam<std::tuple<GgmlType, CpuIsa>> {};

TEST_P(MatMulTest, MatchesFloat64ProductOfTheDequantizedWeights) {
  const auto [type, isa] = GetParam();
  if (static_cast<int>(isa) > static_cast<int>(BestCpuIsa())) {
    GTEST_SKIP() << "this CPU has no " << CpuIsaName(isa);
  }
  std::cout << "type " << GgmlTypeName(type) << " isa " << CpuIsaName(isa) << " seed " << kSeed
            << std::endl;
  // 40 rows: one pair of panels and a lone panel of 8 rows.
  // 352 columns: two whole chunks of 128 columns and a part one (not for the K-quants, whose
  // rows are 256-element blocks).
  for (const auto& [rows, cols] :
       {std::pair<int64_t, int64_t>{40, 256}, {64, 512}, {3, 256}, {20, 352}}) {
    if (cols % GetGgmlTypeTraits(type)->block_size != 0) continue;
    const std::vector<std::byte> data = RandomTensor(type, rows, cols, kSeed + 1);
    absl::StatusOr<WeightMatrix> w = WeightMatrix::FromGgml(type, data, rows, cols);
    ASSERT_THAT(w, IsOk());
    for (const int64_t m : {1, 5, 8, 13, 70}) {
      SCOPED_TRACE(testing::Message() << rows << " x " << cols << ", m " << m);
      const std::vector<float> x = RandomFloats(m * cols, kSeed + 2);
      ExpectNearReference(x, m, *w, RunMatMul(x, m, *w, isa, 2));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(TypesAndIsas, MatMulTest,
                         ::testing::Combine(::testing::ValuesIn(kTypes),
                                            ::testing::Values(CpuIsa::kPortable, CpuIsa::kAvx2,
                                                              CpuIsa::kAvx512)),
                         [](const ::testing::TestParamInfo<std::tuple<GgmlType, CpuIsa>>& param) {
                           return GgmlTypeName(std::get<0>(param.param)) + "_" +
                                  std::string(CpuIsaName(std::get<1>(param.param)));
                         });

TEST(MatMulTest, Fp32WeightsOfAnyWidthMatchTheFloat64Product) {
  for (const auto& [rows, cols] : {std::pair<int64_t, int64_t>{17, 7}, {33, 1}, {5, 130}}) {
    const std::vector<float> wf = RandomFloats(rows * cols, kSeed + 3);
    const WeightMatrix w = WeightMatrix::FromFloat(wf, rows, cols);
    EXPECT_EQ(w.Dequantize(), wf);
    for (const int64_t m : {1, 9, 23}) {
      SCOPED_TRACE(testing::Message() << rows << " x " << cols << ", m " << m);
      const std::vector<float> x = RandomFloats(m * cols, kSeed + 4);
      ExpectNearReference(x, m, w, RunMatMul(x, m, w, BestCpuIsa(), 3));
    }
  }
}

bool SameBits(const float* a, const float* b, int64_t n) {
  return std::memcmp(a, b, static_cast<size_t>(n) * sizeof(float)) == 0;
}

TEST(MatMulTest, ARowsResultDoesNotDependOnTheOtherRowsNorOnTheThreads) {
  for (const GgmlType type : {GgmlType::kF32, GgmlType::kQ4_1, GgmlType::kQ8_0, GgmlType::kQ6_K}) {
    SCOPED_TRACE(GgmlTypeName(type));
    const int64_t rows = 200;
    const int64_t cols = 768;
    const std::vector<std::byte> data = RandomTensor(type, rows, cols, kSeed + 5);
    const WeightMatrix w = WeightMatrix::FromGgml(type, data, rows, cols).value();
    // More rows than one pass over the weights takes (block_rows = 170 for 768 columns).
    const int64_t m = 301;
    const std::vector<float> x = RandomFloats(m * cols, kSeed + 6);
    const std::vector<float> all = RunMatMul(x, m, w, BestCpuIsa(), 0);
    for (const int32_t threads : {1, 2, 3}) {
      EXPECT_TRUE(SameBits(RunMatMul(x, m, w, BestCpuIsa(), threads).data(), all.data(), m * rows))
          << threads << " threads";
    }
    for (const int64_t begin : {0, 7, 170, 300}) {
      for (const int64_t count : {1, 3, 8, 9}) {
        if (begin + count > m) continue;
        const std::vector<float> part(x.begin() + begin * cols, x.begin() + (begin + count) * cols);
        const std::vector<float> y = RunMatMul(part, count, w, BestCpuIsa(), 2);
        EXPECT_TRUE(SameBits(y.data(), all.data() + begin * rows, count * rows))
            << "rows " << begin << " .. " << begin + count - 1;
      }
    }
  }
}

TEST(MatMulTest, Avx2AndAvx512GiveTheSameBits) {
  if (BestCpuIsa() != CpuIsa::kAvx512) GTEST_SKIP() << "this CPU has no AVX-512";
  for (const GgmlType type : {GgmlType::kF32, GgmlType::kQ4_0, GgmlType::kQ5_K}) {
    SCOPED_TRACE(GgmlTypeName(type));
    const std::vector<std::byte> data = RandomTensor(type, 72, 512, kSeed + 7);
    const WeightMatrix w = WeightMatrix::FromGgml(type, data, 72, 512).value();
    const std::vector<float> x = RandomFloats(11 * 512, kSeed + 8);
    const std::vector<float> a = RunMatMul(x, 11, w, CpuIsa::kAvx2, 2);
    const std::vector<float> b = RunMatMul(x, 11, w, CpuIsa::kAvx512, 2);
    EXPECT_TRUE(SameBits(a.data(), b.data(), 11 * 72));
  }
}

TEST(WeightMatrixTest, FromGgmlRefusesBadShapesAndTypes) {
  const std::vector<std::byte> data = RandomTensor(GgmlType::kQ4_1, 4, 64, kSeed);
  EXPECT_EQ(WeightMatrix::FromGgml(GgmlType::kQ4_1, data, 4, 48).status().code(),
            absl::StatusCode::kInvalidArgument);  // not whole blocks
  EXPECT_EQ(WeightMatrix::FromGgml(GgmlType::kQ4_1, data, 3, 64).status().code(),
            absl::StatusCode::kInvalidArgument);  // size disagrees
  const std::vector<int64_t> short_order = {0, 1, 2};
  EXPECT_EQ(WeightMatrix::FromGgml(GgmlType::kQ4_1, data, 4, 64, short_order).status().code(),
            absl::StatusCode::kInvalidArgument);
  const std::vector<int64_t> outside = {0, 1, 2, 4};
  EXPECT_EQ(WeightMatrix::FromGgml(GgmlType::kQ4_1, data, 4, 64, outside).status().code(),
            absl::StatusCode::kInvalidArgument);
  const std::vector<std::byte> q2k(static_cast<size_t>(TypeBytes(GgmlType::kQ2_K, 256).value()));
  EXPECT_EQ(WeightMatrix::FromGgml(GgmlType::kQ2_K, q2k, 1, 256).status().code(),
            absl::StatusCode::kUnimplemented);
}

}  // namespace
}  // namespace kvcm::kernels
