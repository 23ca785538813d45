// The CUDA kernels against the CPU ones (the reference), on the same random inputs in a
// pool allocated by the cuda pool backend. Label: gpu.
//
// Without a device every test skips with "no CUDA device: ..."; with KVCM_REQUIRE_GPU=1 in
// the environment (scripts/gpu-check.sh sets it) they fail instead.
//
// Tolerances: WriteKv and CopyBlocks must give the CPU's bytes exactly. PagedAttention:
// max |gpu - cpu| / max |cpu| < 1e-5 for every dtype (both read the same stored bytes and
// compute in fp32; only the order of the sums differs), and the same bound against the
// float64 reference.

#include <cuda_runtime.h>

#include <iostream>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "common/memory/pool_memory.h"
#include "gtest/gtest.h"
#include "kernels/copy_blocks.h"
#include "kernels/paged_attention.h"
#include "kernels/paged_kv.h"
#include "kernels/write_kv.h"
#include "tests/kernels/attention_case.h"
#include "tests/support/gpu_test.h"
#include "tests/support/status_matchers.h"

namespace kvcm::kernels {
namespace {

using testing_util::AttentionCase;
using testing_util::AttentionInputs;
using testing_util::MakeAttentionInputs;
using testing_util::ReferenceAttention;
using testing_util::RelativeError;
using testing_util::StandardAttentionCases;

constexpr double kMaxRelativeError = 1e-5;

class CudaDeviceTest : public ::testing::Test {
 protected:
  void SetUp() override { KVCM_SKIP_WITHOUT_GPU(); }
};

void Check(cudaError_t err, const char* what) {
  ASSERT_EQ(err, cudaSuccess) << what << ": " << cudaGetErrorString(err);
}

// A device array of T, freed on destruction.
template <typename T>
class DeviceArray {
 public:
  explicit DeviceArray(size_t n) : n_(n) {
    if (n_ > 0) Check(cudaMalloc(&ptr_, n_ * sizeof(T)), "cudaMalloc");
  }
  explicit DeviceArray(const std::vector<T>& host) : DeviceArray(host.size()) {
    if (n_ > 0) {
      Check(cudaMemcpy(ptr_, host.data(), n_ * sizeof(T), cudaMemcpyHostToDevice), "upload");
    }
  }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  ~DeviceArray() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  T* get() const { return static_cast<T*>(ptr_); }
  std::vector<T> Download() const {
    std::vector<T> host(n_);
    if (n_ > 0) {
      Check(cudaMemcpy(host.data(), ptr_, n_ * sizeof(T), cudaMemcpyDeviceToHost), "download");
    }
    return host;
  }

 private:
  size_t n_;
  void* ptr_ = nullptr;
};

// The pool of `in` on the device, through the cuda pool backend.
std::unique_ptr<PoolMemory> UploadPool(const std::vector<uint8_t>& bytes) {
  absl::StatusOr<std::unique_ptr<PoolMemory>> pool = CreateCudaPoolMemory(0, bytes.size());
  EXPECT_THAT(pool, IsOk());
  if (!pool.ok()) return nullptr;
  const absl::Status copied = CopyToPool(**pool, 0, bytes.data(), bytes.size());
  EXPECT_THAT(copied, IsOk());
  return std::move(*pool);
}

std::vector<uint8_t> DownloadPool(const PoolMemory& pool) {
  std::vector<uint8_t> bytes(pool.size_bytes());
  const absl::Status copied = CopyFromPool(pool, 0, bytes.data(), bytes.size());
  EXPECT_THAT(copied, IsOk());
  return bytes;
}

const std::vector<AttentionCase>& Cases() {
  static const std::vector<AttentionCase> cases = StandardAttentionCases();
  return cases;
}

// How the launcher is told max_query_len: the exact value, 0 (unknown: no partitions, one
// thread block per sequence and head group), or 1 (decode-style partitions even where a
// sequence has more query tokens: those must still be right).
enum class Hint { kExact, kUnknown, kOne };

std::string HintName(Hint hint) {
  switch (hint) {
    case Hint::kExact:
      return "exact";
    case Hint::kUnknown:
      return "unknown";
    case Hint::kOne:
      return "one";
  }
  return "?";
}

void PrintTo(Hint hint, std::ostream* os) { *os << HintName(hint); }

class CudaPagedAttentionTest : public CudaDeviceTest,
                               public ::testing::WithParamInterface<std::tuple<int, DType, Hint>> {
};

TEST_P(CudaPagedAttentionTest, MatchesCpu) {
  const auto [index, dtype, hint] = GetParam();
  const AttentionCase& c = Cases()[static_cast<size_t>(index)];
  std::cout << "case " << c.name << " seed " << c.seed << " dtype " << DTypeName(dtype) << " hint "
            << HintName(hint) << std::endl;
  const std::unique_ptr<AttentionInputs> in = MakeAttentionInputs(c, dtype);
  std::vector<float> cpu_out(static_cast<size_t>(in->OutputSize()));
  cpu::PagedAttention(in->view, in->batch, in->query.data(), cpu_out.data());

  const std::unique_ptr<PoolMemory> pool = UploadPool(in->pool);
  ASSERT_NE(pool, nullptr);
  const absl::StatusOr<PagedKvView> view =
      LayerView(static_cast<uint8_t*>(pool->base()), in->layout, in->spec, 1);
  ASSERT_THAT(view, IsOk());
  const DeviceArray<int32_t> query_lens(in->query_lens);
  const DeviceArray<int32_t> context_lens(in->context_lens);
  const DeviceArray<int32_t> tables(in->block_tables);
  const DeviceArray<float> query(in->query);
  const DeviceArray<float> out(std::vector<float>(cpu_out.size(), -12345.0f));
  PagedAttentionBatch batch = in->batch;
  batch.query_lens = query_lens.get();
  batch.context_lens = context_lens.get();
  batch.block_tables = tables.get();
  batch.max_query_len = hint == Hint::kExact ? in->max_query_len : hint == Hint::kOne ? 1 : 0;
  cuda::PagedAttention(*view, batch, query.get(), out.get(), nullptr);
  Check(cudaDeviceSynchronize(), "PagedAttention");
  const std::vector<float> gpu_out = out.Download();

  const double vs_cpu = RelativeError(gpu_out, cpu_out);
  const double vs_ref = RelativeError(gpu_out, ReferenceAttention(*in));
  std::cout << "  relative error vs cpu " << vs_cpu << ", vs float64 reference " << vs_ref
            << std::endl;
  EXPECT_LT(vs_cpu, kMaxRelativeError);
  EXPECT_LT(vs_ref, kMaxRelativeError);
}

std::string CaseName(const ::testing::TestParamInfo<std::tuple<int, DType, Hint>>& param) {
  const int index = std::get<0>(param.param);
  return Cases()[static_cast<size_t>(index)].name + "_" +
         std::string(DTypeName(std::get<1>(param.param))) + "_" +
         HintName(std::get<2>(param.param));
}

INSTANTIATE_TEST_SUITE_P(
    Cases, CudaPagedAttentionTest,
    ::testing::Combine(::testing::Range(0, static_cast<int>(Cases().size())),
                       ::testing::Values(DType::kFloat32, DType::kFloat16, DType::kBFloat16),
                       ::testing::Values(Hint::kExact, Hint::kUnknown, Hint::kOne)),
    CaseName);

class CudaWriteKvTest : public CudaDeviceTest, public ::testing::WithParamInterface<DType> {};

TEST_P(CudaWriteKvTest, SameBytesAsCpu) {
  const DType dtype = GetParam();
  KvCacheSpec spec;
  spec.num_layers = 2;
  spec.num_kv_heads = 3;
  spec.head_dim = 40;
  spec.block_size = 5;
  spec.dtype = dtype;
  const absl::StatusOr<PoolLayout> layout = PoolLayout::For(spec, 11);
  ASSERT_THAT(layout, IsOk());
  std::mt19937_64 rng(17);
  std::vector<uint8_t> host(static_cast<size_t>(layout->total_bytes));
  for (uint8_t& b : host) b = static_cast<uint8_t>(rng());
  const std::unique_ptr<PoolMemory> pool = UploadPool(host);
  ASSERT_NE(pool, nullptr);

  const std::vector<int64_t> slots = {0, 54, -1, 12, 13, -3, 6, 20, 41};
  const int32_t n = static_cast<int32_t>(slots.size());
  std::vector<float> key(static_cast<size_t>(n * spec.num_kv_heads * spec.head_dim));
  std::vector<float> value(key.size());
  std::uniform_real_distribution<float> uniform(-70000.0f, 70000.0f);  // fp16 overflow too
  for (float& x : key) x = uniform(rng);
  for (float& x : value) x = uniform(rng) * 1e-9f;  // and fp16 subnormals
  for (int32_t layer = 0; layer < 2; ++layer) {
    const absl::StatusOr<PagedKvView> host_view = LayerView(host.data(), *layout, spec, layer);
    const absl::StatusOr<PagedKvView> dev_view =
        LayerView(static_cast<uint8_t*>(pool->base()), *layout, spec, layer);
    ASSERT_TRUE(host_view.ok() && dev_view.ok());
    cpu::WriteKv(*host_view, key.data(), value.data(), slots.data(), n);
    const DeviceArray<float> dkey(key);
    const DeviceArray<float> dvalue(value);
    const DeviceArray<int64_t> dslots(slots);
    cuda::WriteKv(*dev_view, dkey.get(), dvalue.get(), dslots.get(), n, nullptr);
    Check(cudaDeviceSynchronize(), "WriteKv");
  }
  const std::vector<uint8_t> got = DownloadPool(*pool);
  size_t mismatches = 0;
  for (size_t i = 0; i < got.size(); ++i) mismatches += got[i] != host[i];
  EXPECT_EQ(mismatches, 0u);
}

std::string DtypeName(const ::testing::TestParamInfo<DType>& param) {
  return std::string(DTypeName(param.param));
}

INSTANTIATE_TEST_SUITE_P(Dtypes, CudaWriteKvTest,
                         ::testing::Values(DType::kFloat32, DType::kFloat16, DType::kBFloat16),
                         DtypeName);

// The kernels have no fp8 path: they abort before any CUDA call, so no device is needed.
TEST(CudaKernelsDeathTest, RefuseFp8) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  PagedKvView view;
  view.dtype = DType::kFloat8E4M3;
  view.num_blocks = 1;
  view.block_size = 16;
  view.num_kv_heads = 1;
  view.head_dim = 64;
  EXPECT_DEATH(cuda::WriteKv(view, nullptr, nullptr, nullptr, 1, nullptr),
               "no kernel for KV-cache dtype fp8_e4m3");
  PagedAttentionBatch batch;
  batch.num_seqs = 1;
  batch.num_q_heads = 1;
  EXPECT_DEATH(cuda::PagedAttention(view, batch, nullptr, nullptr, nullptr),
               "no kernel for KV-cache dtype fp8_e4m3");
}

using CudaCopyBlocksTest = CudaDeviceTest;

TEST_F(CudaCopyBlocksTest, SameBytesAsCpu) {
  // 16-byte words (Llama-like rows) and single bytes (head_dim 3 x bf16: 6-byte rows).
  for (int32_t head_dim : {128, 3}) {
    KvCacheSpec spec;
    spec.num_layers = 4;
    spec.num_kv_heads = 2;
    spec.head_dim = head_dim;
    spec.block_size = 3;
    spec.dtype = DType::kBFloat16;
    const absl::StatusOr<PoolLayout> layout = PoolLayout::For(spec, 10);
    ASSERT_THAT(layout, IsOk());
    std::mt19937_64 rng(23);
    std::vector<uint8_t> host(static_cast<size_t>(layout->total_bytes));
    for (uint8_t& b : host) b = static_cast<uint8_t>(rng());
    const std::unique_ptr<PoolMemory> pool = UploadPool(host);
    ASSERT_NE(pool, nullptr);
    const std::vector<BlockCopy> copies = {{2, 5}, {0, 9}, {7, 1}, {3, 4}};
    const int32_t n = static_cast<int32_t>(copies.size());
    cpu::CopyBlocks(host.data(), *layout, copies.data(), n);
    const DeviceArray<BlockCopy> dcopies(copies);
    cuda::CopyBlocks(static_cast<uint8_t*>(pool->base()), *layout, dcopies.get(), n, nullptr);
    Check(cudaDeviceSynchronize(), "CopyBlocks");
    EXPECT_TRUE(DownloadPool(*pool) == host) << "head_dim " << head_dim;
  }
}

TEST(CudaKernelsCompiledTest, True) { EXPECT_TRUE(CudaKernelsCompiled()); }

}  // namespace
}  // namespace kvcm::kernels
