// kernels::MatMulInt8 and kernels::QuantizeRows (kernels/matmul_cpu.h), for every coded
// type, on every ISA this CPU has:
//   - QuantizeRows gives the codes its definition names, the same on every ISA;
//   - each variant (portable, AVX2, AVX-512 VNNI) gives bitwise the same y;
//   - y against an exact float64 reference from the same quantized activations and the
//     packed codes, scales and biases: per output the path rounds fl(w_scale * d), then
//     adds 2 terms per group (1 without a bias) with one rounding each, so
//       |y - ref| <= (n + 2) * 2^-24 * sum |terms| * 1.01,  n = terms added;
//   - y against the fp32 path (MatMul): quantizing x moves each x_k by at most half a step,
//     d_g / 2 (plus 2^-23 relative for the rounding of x_k / d), so
//       |y8 - y32| <= sum_g (d_g / 2) (1 + 2^-20) sum_{k in g} |w_k|  + both paths' rounding
//     (MatMul's test bound 1e-5 sum |x_k w_k|, the line above for MatMulInt8);
//   - y does not depend on m, on the other rows, nor on the threads.
// All of it again with the residual pass (the int8x2 path): QuantizeResiduals gives the codes
// its definition names, the exact reference adds the residual's terms, and x is carried to
// within d' / 2 = d / 508 plus the roundings of r = x - code * d (2^-24 (|x| + d) each), so
//   |y - y32| <= sum_k |w_k| (d'_g / 2 (1 + 2^-20) + 2^-23 (|x_k| + d_g))  + the roundings.
// Fixed seeds, printed.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "kernels/cpu_isa.h"
#include "kernels/matmul_cpu.h"
#include "tests/kernels/matmul_test_matrices.h"
#include "tests/support/status_matchers.h"

namespace kvcm::kernels {
namespace {

constexpr uint32_t kSeed = 20261206;
constexpr double kUnit = 1.0 / (1 << 24);  // fp32 unit roundoff

using matmul_test::RandomTensor;

// N(0, 1) activations with a few outliers (as a model's hidden states have), and some groups
// all zero (d = 0).
std::vector<float> RandomActivations(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& f : v) f = normal(rng);
  for (int64_t i = 0; i < n; i += 97) v[static_cast<size_t>(i)] *= 20.0f;
  for (int64_t i = 64; i + 32 <= n; i += 1000) {
    std::fill(v.begin() + i, v.begin() + i + 32, 0.0f);
  }
  return v;
}

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  // memcmp may not be given the null data() of an empty vector, even for 0 bytes.
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

const GgmlType kCodedTypes[] = {GgmlType::kQ4_0, GgmlType::kQ4_1, GgmlType::kQ5_0, GgmlType::kQ5_1,
                                GgmlType::kQ8_0, GgmlType::kQ4_K, GgmlType::kQ5_K, GgmlType::kQ6_K};
const CpuIsa kIsas[] = {CpuIsa::kPortable, CpuIsa::kAvx2, CpuIsa::kAvx512};

bool Supported(CpuIsa isa) { return static_cast<int>(isa) <= static_cast<int>(BestCpuIsa()); }

std::string IsaLabel(CpuIsa isa) {
  if (isa == CpuIsa::kAvx512) return CpuHasAvx512Vnni() ? "avx512-vnni" : "avx512 (avx2 loops)";
  return std::string(CpuIsaName(isa));
}

std::vector<float> RunInt8(const std::vector<float>& x, int64_t m, const WeightMatrix& w,
                           CpuIsa isa, int32_t threads, bool residual) {
  SetCpuIsaForTest(isa);
  std::vector<float> y(static_cast<size_t>(m * w.rows()), -12345.0f);
  MatMulInt8(x.data(), m, w, y.data(), threads, residual);
  SetCpuIsaForTest(BestCpuIsa());
  return y;
}

std::vector<float> RunFp32(const std::vector<float>& x, int64_t m, const WeightMatrix& w) {
  std::vector<float> y(static_cast<size_t>(m * w.rows()), -12345.0f);
  MatMul(x.data(), m, w, y.data(), 2);
  return y;
}

// Row r's group g as packed (the layout of matmul_cpu.h): codes (u - code_offset), scale,
// bias.
struct Group {
  std::vector<int> codes;
  float scale;
  float bias;
};
Group PackedGroup(const WeightMatrix& w, int64_t r, int64_t g) {
  const int64_t lanes = WeightMatrix::kPanelRows;
  const int64_t lane = r % lanes;
  const uint8_t* gp = w.panel(r / lanes) + g * w.group_bytes();
  Group out;
  std::memcpy(&out.scale, gp + lane * 4, sizeof(float));
  std::memcpy(&out.bias, gp + (lanes + lane) * 4, sizeof(float));
  const uint8_t* c = gp + 2 * lanes * 4;
  for (int64_t j = 0; j < w.group(); ++j) {
    int u;
    if (w.format() == WeightMatrix::Format::kCodes4) {
      u = (c[(j / 8) * 64 + lane * 4 + j % 4] >> (4 * ((j % 8) / 4))) & 0xF;
    } else {
      u = c[(j / 4) * 64 + lane * 4 + j % 4];
    }
    out.codes.push_back(u - w.code_offset());
  }
  return out;
}

// The packed groups of every row, checked against DequantizeRow (itself checked against
// ggml by matmul_cpu_test.cc), and has_bias() against the biases.
std::vector<std::vector<Group>> AllGroups(const WeightMatrix& w) {
  std::vector<std::vector<Group>> out(static_cast<size_t>(w.rows()));
  std::vector<float> row(static_cast<size_t>(w.cols()));
  for (int64_t r = 0; r < w.rows(); ++r) {
    w.DequantizeRow(r, row.data());
    for (int64_t g = 0; g < w.cols() / w.group(); ++g) {
      Group grp = PackedGroup(w, r, g);
      if (!w.has_bias()) {
        EXPECT_EQ(grp.bias, 0.0f) << "row " << r << " group " << g;
      }
      for (int64_t j = 0; j < w.group(); ++j) {
        EXPECT_EQ(static_cast<float>(grp.codes[static_cast<size_t>(j)]) * grp.scale + grp.bias,
                  row[static_cast<size_t>(g * w.group() + j)]);
      }
      out[static_cast<size_t>(r)].push_back(std::move(grp));
    }
  }
  return out;
}

// x quantized as MatMulInt8 multiplies it: the codes, then (with `residual`) their residuals.
std::vector<QuantizedRows> Passes(const std::vector<float>& x, int64_t m, const WeightMatrix& w,
                                  bool residual) {
  std::vector<QuantizedRows> passes(residual ? 2 : 1);
  QuantizeRows(x.data(), m, w.cols(), w.group(), &passes[0]);
  if (residual) QuantizeResiduals(x.data(), passes[0], &passes[1]);
  return passes;
}

// y against the exact float64 value of the integer path's sum, from the same quantized
// activations, within the rounding bound of the file comment. Returns the worst
// |y - ref| / bound.
double CheckAgainstExact(const std::vector<float>& x, int64_t m, const WeightMatrix& w,
                         const std::vector<std::vector<Group>>& groups, bool residual,
                         const std::vector<float>& y) {
  const std::vector<QuantizedRows> passes = Passes(x, m, w, residual);
  const int64_t ng = w.cols() / w.group();
  double worst = 0;
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t o = 0; o < w.rows(); ++o) {
      double ref = 0;
      double magnitude = 0;
      int terms = 0;
      for (const QuantizedRows& q : passes) {
        for (int64_t g = 0; g < ng; ++g) {
          const Group& grp = groups[static_cast<size_t>(o)][static_cast<size_t>(g)];
          int64_t isum = 0;
          for (int64_t j = 0; j < w.group(); ++j) {
            isum += int64_t{grp.codes[static_cast<size_t>(j)]} *
                    q.codes[static_cast<size_t>(i * w.cols() + g * w.group() + j)];
          }
          const double d = q.scales[static_cast<size_t>(i * ng + g)];
          const double t1 = static_cast<double>(isum) * grp.scale * d;
          const double t2 = double{grp.bias} * d * q.sums[static_cast<size_t>(i * ng + g)];
          ref += t1;
          magnitude += std::abs(t1);
          ++terms;
          if (w.has_bias()) {
            ref += t2;
            magnitude += std::abs(t2);
            ++terms;
          }
        }
      }
      const double bound = (terms + 2) * kUnit * magnitude * 1.01 + 1e-30;
      const double err = std::abs(y[static_cast<size_t>(i * w.rows() + o)] - ref);
      EXPECT_LE(err, bound) << "y[" << i << "][" << o
                            << "] = " << y[static_cast<size_t>(i * w.rows() + o)] << ", exact "
                            << ref;
      worst = std::max(worst, err / bound);
    }
  }
  return worst;
}

// y8 against MatMul's y32 within the bound of the file comment; returns the worst
// |y8 - y32| / bound.
double CheckAgainstFp32(const std::vector<float>& x, int64_t m, const WeightMatrix& w,
                        bool residual, const std::vector<float>& y8,
                        const std::vector<float>& y32) {
  const std::vector<float> wf = w.Dequantize();
  const std::vector<QuantizedRows> passes = Passes(x, m, w, residual);
  const QuantizedRows& q = passes[0];
  const int64_t k = w.cols();
  const int64_t ng = k / w.group();
  double worst = 0;
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t o = 0; o < w.rows(); ++o) {
      double step = 0;
      double magnitude = 0;
      for (int64_t g = 0; g < ng; ++g) {
        const size_t gi = static_cast<size_t>(i * ng + g);
        const double d = q.scales[gi];
        const double half_step = (residual ? passes[1].scales[gi] : d) / 2.0;
        for (int64_t j = 0; j < w.group(); ++j) {
          const double wk = wf[static_cast<size_t>(o * k + g * w.group() + j)];
          const double xk = x[static_cast<size_t>(i * k + g * w.group() + j)];
          magnitude += std::abs(wk * xk);
          const double carried = residual ? 0x1p-23 * (std::abs(xk) + d) : 0.0;
          step += std::abs(wk) * (half_step * (1 + 1.0 / (1 << 20)) + carried);
        }
      }
      // MatMul's bound, and the integer path's rounding: at most 2 per group, relative to
      // terms no larger than |w| (|x| + d / 2).
      const double bound = step + 1e-5 * magnitude +
                           (2 * ng * (residual ? 2 : 1) + 2) * kUnit * 1.01 * (magnitude + step) +
                           1e-30;
      const double err = std::abs(double{y8[static_cast<size_t>(i * w.rows() + o)]} -
                                  y32[static_cast<size_t>(i * w.rows() + o)]);
      EXPECT_LE(err, bound) << "y[" << i << "][" << o << "]: int8 "
                            << y8[static_cast<size_t>(i * w.rows() + o)] << ", fp32 "
                            << y32[static_cast<size_t>(i * w.rows() + o)];
      worst = std::max(worst, err / bound);
    }
  }
  return worst;
}

TEST(QuantizeRowsTest, CodesFollowTheirDefinitionOnEveryIsa) {
  std::cout << "seed " << kSeed << std::endl;
  for (const int64_t group : {16, 32}) {
    const int64_t m = 5;
    const int64_t cols = 1088;
    const std::vector<float> x = RandomActivations(m * cols, kSeed);
    QuantizedRows ref;
    SetCpuIsaForTest(CpuIsa::kPortable);
    QuantizeRows(x.data(), m, cols, group, &ref);
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t g = 0; g < cols / group; ++g) {
        float amax = 0;
        for (int64_t j = 0; j < group; ++j) {
          amax = std::max(amax, std::abs(x[static_cast<size_t>(i * cols + g * group + j)]));
        }
        const float d = amax / 127.0f;
        const size_t gi = static_cast<size_t>(i * (cols / group) + g);
        ASSERT_EQ(ref.scales[gi], d);
        int32_t sum = 0;
        for (int64_t j = 0; j < group; ++j) {
          const size_t at = static_cast<size_t>(i * cols + g * group + j);
          const int c = ref.codes[at];
          sum += c;
          ASSERT_LE(std::abs(c), 127);
          // Round to nearest: within half a step (and the rounding of x / d).
          ASSERT_LE(std::abs(double{x[at]} - double{d} * c), d * (0.5 + 1e-6) + 1e-30)
              << "x " << x[at] << " d " << d << " code " << c;
        }
        ASSERT_EQ(ref.sums[gi], sum);
        ASSERT_EQ(ref.scaled_sums[gi], d * static_cast<float>(sum));
      }
    }
    for (const CpuIsa isa : kIsas) {
      if (!Supported(isa)) continue;
      SCOPED_TRACE(IsaLabel(isa));
      SetCpuIsaForTest(isa);
      QuantizedRows q;
      QuantizeRows(x.data(), m, cols, group, &q);
      EXPECT_EQ(q.codes, ref.codes);
      EXPECT_EQ(q.scales, ref.scales);
      EXPECT_EQ(q.sums, ref.sums);
      EXPECT_EQ(q.scaled_sums, ref.scaled_sums);
    }
    SetCpuIsaForTest(BestCpuIsa());
  }
}

TEST(QuantizeRowsTest, ResidualsFollowTheirDefinition) {
  std::cout << "seed " << kSeed << std::endl;
  for (const int64_t group : {16, 32}) {
    const int64_t m = 5;
    const int64_t cols = 1088;
    const std::vector<float> x = RandomActivations(m * cols, kSeed + 5);
    QuantizedRows q;
    QuantizeRows(x.data(), m, cols, group, &q);
    QuantizedRows r;
    QuantizeResiduals(x.data(), q, &r);
    ASSERT_EQ(r.rows, m);
    ASSERT_EQ(r.cols, cols);
    ASSERT_EQ(r.group, group);
    double worst = 0;  // |x - d code - d' residual code| / d'
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t g = 0; g < cols / group; ++g) {
        const size_t gi = static_cast<size_t>(i * (cols / group) + g);
        const float d = q.scales[gi];
        const float dr = d / 254.0f;
        ASSERT_EQ(r.scales[gi], dr);
        const float id = dr != 0.0f ? 1.0f / dr : 0.0f;
        int32_t sum = 0;
        for (int64_t j = 0; j < group; ++j) {
          const size_t at = static_cast<size_t>(i * cols + g * group + j);
          const float residual = x[at] - static_cast<float>(q.codes[at]) * d;
          const int expected =
              std::clamp(static_cast<int>(std::nearbyint(residual * id)), -127, 127);
          ASSERT_EQ(r.codes[at], expected) << "x " << x[at] << " d " << d;
          sum += r.codes[at];
          const double left = double{x[at]} - double{d} * q.codes[at] - double{dr} * r.codes[at];
          ASSERT_LE(std::abs(left), dr * (0.5 + 1e-5) + 0x1p-23 * (std::abs(x[at]) + d) + 1e-30)
              << "x " << x[at] << " d " << d << " codes " << int{q.codes[at]} << ", "
              << int{r.codes[at]};
          if (dr > 0) worst = std::max(worst, std::abs(left) / dr);
        }
        ASSERT_EQ(r.sums[gi], sum);
        ASSERT_EQ(r.scaled_sums[gi], dr * static_cast<float>(sum));
      }
    }
    std::cout << "group " << group << ": worst |x - d code - d' residual| / d' " << worst
              << std::endl;
    EXPECT_GT(worst, 0.4);  // the bound is not loose: rounding leaves close to half a step
  }
}

class MatMulInt8Test : public ::testing::TestWithParam<GgmlType> {};

TEST_P(MatMulInt8Test, EveryIsaMatchesTheExactSumAndTheFp32Path) {
  const GgmlType type = GetParam();
  std::cout << "type " << GgmlTypeName(type) << " seed " << kSeed << ", best ISA "
            << IsaLabel(BestCpuIsa()) << std::endl;
  double worst_exact[2] = {0, 0};
  double worst_fp32[2] = {0, 0};
  // Odd row counts (a partial panel, a partial unit of 4 panels); 352 columns are 11 groups
  // of 32 (not for the K-quants, whose rows are 256-element blocks).
  for (const auto& [rows, cols] :
       {std::pair<int64_t, int64_t>{37, 256}, {83, 512}, {5, 352}, {16, 256}}) {
    if (cols % GetGgmlTypeTraits(type)->block_size != 0) continue;
    const std::vector<std::byte> data = RandomTensor(type, rows, cols, kSeed + 1);
    absl::StatusOr<WeightMatrix> w = WeightMatrix::FromGgml(type, data, rows, cols);
    ASSERT_THAT(w, IsOk());
    ASSERT_NE(w->format(), WeightMatrix::Format::kFloat32);
    const std::vector<std::vector<Group>> groups = AllGroups(*w);
    const int64_t max_m = 33;
    const std::vector<float> x = RandomActivations(max_m * cols, kSeed + 2);
    const std::vector<float> y32 = RunFp32(x, max_m, *w);
    for (const bool residual : {false, true}) {
      // All 33 rows at once, on the best ISA and all threads: the reference bits.
      const std::vector<float> all = RunInt8(x, max_m, *w, BestCpuIsa(), 0, residual);
      worst_exact[residual] =
          std::max(worst_exact[residual], CheckAgainstExact(x, max_m, *w, groups, residual, all));
      worst_fp32[residual] =
          std::max(worst_fp32[residual], CheckAgainstFp32(x, max_m, *w, residual, all, y32));
      for (const int64_t m : {0, 1, 2, 3, 5, 6, 7, 8, 33}) {
        for (const int64_t begin : {int64_t{0}, max_m - m}) {
          const std::vector<float> part(x.begin() + begin * cols, x.begin() + (begin + m) * cols);
          const std::vector<float> expected(all.begin() + begin * rows,
                                            all.begin() + (begin + m) * rows);
          for (const CpuIsa isa : kIsas) {
            if (!Supported(isa)) continue;
            for (const int32_t threads : {1, 2}) {
              SCOPED_TRACE(testing::Message()
                           << rows << " x " << cols << ", m " << m << " from row " << begin << ", "
                           << IsaLabel(isa) << ", " << threads << " thread(s)"
                           << (residual ? ", residual" : ""));
              EXPECT_TRUE(SameBits(RunInt8(part, m, *w, isa, threads, residual), expected));
            }
          }
        }
      }
    }
  }
  for (const bool residual : {false, true}) {
    std::cout << (residual ? "int8x2" : "int8") << ": worst |y - exact| / bound "
              << worst_exact[residual] << ", worst |y8 - y32| / bound " << worst_fp32[residual]
              << std::endl;
  }
}

INSTANTIATE_TEST_SUITE_P(Types, MatMulInt8Test, ::testing::ValuesIn(kCodedTypes),
                         [](const ::testing::TestParamInfo<GgmlType>& param) {
                           return GgmlTypeName(param.param);
                         });

TEST(MatMulInt8Test, SeveralOutputsShareOneCallAndFp32MatricesTakeMatMul) {
  const int64_t cols = 512;
  const std::vector<float> x = RandomActivations(9 * cols, kSeed + 3);
  std::vector<WeightMatrix> ws;
  for (const auto& [type, rows] : {std::pair<GgmlType, int64_t>{GgmlType::kQ4_1, 70},
                                   {GgmlType::kQ6_K, 21},
                                   {GgmlType::kF16, 19},
                                   {GgmlType::kQ8_0, 130}}) {
    ws.push_back(WeightMatrix::FromGgml(type, RandomTensor(type, rows, cols, kSeed + 4), rows, cols)
                     .value());
  }
  std::vector<std::vector<float>> ys(ws.size());
  std::vector<MatMulOutput> outputs;
  for (size_t i = 0; i < ws.size(); ++i) {
    ys[i].assign(static_cast<size_t>(9 * ws[i].rows()), -1.0f);
    outputs.push_back({&ws[i], ys[i].data()});
  }
  for (const bool residual : {false, true}) {
    MatMulInt8(x.data(), 9, outputs, 2, residual);
    for (size_t i = 0; i < ws.size(); ++i) {
      SCOPED_TRACE(testing::Message() << i << (residual ? ", residual" : ""));
      const std::vector<float> alone = ws[i].format() == WeightMatrix::Format::kFloat32
                                           ? RunFp32(x, 9, ws[i])
                                           : RunInt8(x, 9, ws[i], BestCpuIsa(), 1, residual);
      EXPECT_TRUE(SameBits(ys[i], alone));
    }
  }
}

TEST(MatMulPathTest, NamesRoundTrip) {
  for (const MatMulPath path : {MatMulPath::kInt8, MatMulPath::kInt8x2, MatMulPath::kFp32}) {
    MatMulPath parsed = path == MatMulPath::kInt8 ? MatMulPath::kFp32 : MatMulPath::kInt8;
    EXPECT_TRUE(ParseMatMulPath(MatMulPathName(path), &parsed));
    EXPECT_EQ(parsed, path);
  }
  MatMulPath parsed;
  EXPECT_FALSE(ParseMatMulPath("int4", &parsed));
}

}  // namespace
}  // namespace kvcm::kernels
