// cpu::PagedAttention against a naive float64 reference (tests/kernels/attention_case.h),
// for every standard case x storage dtype x ISA (portable and, where the CPU has them, AVX2
// and AVX-512; skipped where it has not).
//
// Error: max |out - ref| / max |ref| over the whole output. Limit 1e-5 for every dtype: the
// reference is computed on the stored (rounded) K/V, so what is measured is the kernel's
// fp32 arithmetic, not the storage's precision.

#include "kernels/paged_attention.h"

#include <iostream>
#include <string>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu_isa.h"
#include "tests/kernels/attention_case.h"

namespace kvcm::kernels {

void PrintTo(CpuIsa isa, std::ostream* os) { *os << CpuIsaName(isa); }

namespace {

using testing_util::AttentionCase;
using testing_util::MakeAttentionInputs;
using testing_util::ReferenceAttention;
using testing_util::RelativeError;
using testing_util::StandardAttentionCases;

constexpr double kMaxRelativeError = 1e-5;

const std::vector<AttentionCase>& Cases() {
  static const std::vector<AttentionCase> cases = StandardAttentionCases();
  return cases;
}

// Runs the kernel with the given ISA, then restores the best one.
std::vector<float> RunCpu(const testing_util::AttentionInputs& in, CpuIsa isa,
                          int32_t num_threads) {
  SetCpuIsaForTest(isa);
  std::vector<float> out(static_cast<size_t>(in.OutputSize()), -12345.0f);
  cpu::PagedAttention(in.view, in.batch, in.query.data(), out.data(), num_threads);
  SetCpuIsaForTest(BestCpuIsa());
  return out;
}

class PagedAttentionCpuTest : public ::testing::TestWithParam<std::tuple<int, DType, CpuIsa>> {};

TEST_P(PagedAttentionCpuTest, MatchesFloat64Reference) {
  const auto [index, dtype, isa] = GetParam();
  if (static_cast<int>(isa) > static_cast<int>(BestCpuIsa())) {
    GTEST_SKIP() << "this CPU has no " << CpuIsaName(isa);
  }
  const AttentionCase& c = Cases()[static_cast<size_t>(index)];
  std::cout << "case " << c.name << " seed " << c.seed << " dtype " << DTypeName(dtype) << " isa "
            << CpuIsaName(isa) << std::endl;
  const auto in = MakeAttentionInputs(c, dtype);
  const std::vector<double> ref = ReferenceAttention(*in);
  // All threads (contexts split when items are few) and one thread (never split).
  for (int32_t threads : {0, 1}) {
    const double err = RelativeError(RunCpu(*in, isa, threads), ref);
    std::cout << "  threads " << threads << ": relative error " << err << std::endl;
    EXPECT_LT(err, kMaxRelativeError) << c.name << " threads " << threads;
  }
}

std::string CaseName(const ::testing::TestParamInfo<std::tuple<int, DType, CpuIsa>>& param) {
  const int index = std::get<0>(param.param);
  return Cases()[static_cast<size_t>(index)].name + "_" +
         std::string(DTypeName(std::get<1>(param.param))) + "_" +
         std::string(CpuIsaName(std::get<2>(param.param)));
}

INSTANTIATE_TEST_SUITE_P(
    Cases, PagedAttentionCpuTest,
    ::testing::Combine(::testing::Range(0, static_cast<int>(Cases().size())),
                       ::testing::Values(DType::kFloat32, DType::kFloat16, DType::kBFloat16),
                       ::testing::Values(CpuIsa::kPortable, CpuIsa::kAvx2, CpuIsa::kAvx512)),
    CaseName);

// Softmax is shift-invariant: huge scores (up to ~1e4) must not overflow exp.
TEST(PagedAttentionCpuTest, LargeScoresStayFinite) {
  AttentionCase c{.name = "large_scores",
                  .block_size = 16,
                  .num_kv_heads = 1,
                  .group_size = 2,
                  .head_dim = 64,
                  .seqs = {{300, 1}, {50, 5}},
                  .value_range = 12.0f,
                  .seed = 7};
  const auto in = MakeAttentionInputs(c, DType::kFloat32);
  in->batch.scale = 1.0f;
  const std::vector<double> ref = ReferenceAttention(*in);
  for (CpuIsa isa : {CpuIsa::kPortable, CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    if (static_cast<int>(isa) > static_cast<int>(BestCpuIsa())) continue;
    const double err = RelativeError(RunCpu(*in, isa, 0), ref);
    // Scores of ~1e4 carry fp32 rounding of ~1e-3 absolute into exp(): a looser bound.
    EXPECT_LT(err, 1e-2) << CpuIsaName(isa);
  }
}

// The same inputs give the same outputs whatever the thread count's split (within fp32
// reassociation), and the call is repeatable.
TEST(PagedAttentionCpuTest, RepeatedCallsAgree) {
  const AttentionCase& c = Cases()[0];
  const auto in = MakeAttentionInputs(c, DType::kFloat16);
  const std::vector<float> a = RunCpu(*in, BestCpuIsa(), 0);
  const std::vector<float> b = RunCpu(*in, BestCpuIsa(), 0);
  EXPECT_EQ(a, b);
}

// The windowed cases' reference differs from full attention: ignoring the window fails
// the comparison above (each window case can fail), while honouring it passes.
TEST(PagedAttentionCpuTest, IgnoringTheWindowFailsTheReference) {
  int checked = 0;
  for (const AttentionCase& c : Cases()) {
    if (c.sliding_window == 0 || c.release_behind_window) continue;
    const auto in = MakeAttentionInputs(c, DType::kFloat32);
    const std::vector<double> ref = ReferenceAttention(*in);
    in->batch.sliding_window = 0;
    const double err = RelativeError(RunCpu(*in, BestCpuIsa(), 0), ref);
    std::cout << c.name << ": without the window, relative error " << err << std::endl;
    EXPECT_GT(err, 100 * kMaxRelativeError) << c.name;
    ++checked;
  }
  EXPECT_GE(checked, 6);
}

// The kernel has no fp8 path: it aborts rather than read fp8 bytes as another type.
TEST(PagedAttentionCpuDeathTest, RefusesFp8) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const auto in = MakeAttentionInputs(Cases()[0], DType::kFloat32);
  in->view.dtype = DType::kFloat8E4M3;
  std::vector<float> out(static_cast<size_t>(in->OutputSize()));
  EXPECT_DEATH(cpu::PagedAttention(in->view, in->batch, in->query.data(), out.data()),
               "no kernel for KV-cache dtype fp8_e4m3");
}

}  // namespace
}  // namespace kvcm::kernels
