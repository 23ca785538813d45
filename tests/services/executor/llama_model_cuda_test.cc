// LlamaCudaModel against the CPU forward (LlamaModel::Forward, the reference), label gpu:
// the same tiny model, the same batches and block tables, one pool in host memory and one
// in device memory (the cuda pool backend's cudaMalloc) holding the same garbage to start.
//
//   - batched prefill, chunked prefill over a cached prefix mixed with decode, then decode
//     token by token: logits within tolerance of the CPU's every step, and the same greedy
//     tokens (fed to both);
//   - the K/V written into the device pool: within tolerance of the CPU pool's, slot by slot;
//   - copy-on-write orders: destination blocks equal their sources on the device;
//   - refused pools and batches: clear errors, and the device pool is untouched.
//
// Tolerances, max |gpu - cpu| / max(1, max |cpu|) over a logits row: the device sums in
// another order and fuses multiply-adds, so the two drift by fp32 rounding through the
// layers; a fp16/bf16 cache can round a K/V element differently when the inputs differ by
// one ulp. fp32 1e-4, fp16 4e-3, bf16 3e-2 (the CPU's own paged-vs-contiguous bounds are
// 1e-5 / 2e-3 / 1.5e-2). The worst error seen is printed.
//
// Without a device every test skips with "no CUDA device: ..."; with KVCM_REQUIRE_GPU=1
// (scripts/gpu-check.sh sets it) they fail instead.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/base/check.h"
#include "common/memory/pool_layout.h"
#include "common/memory/pool_memory.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/copy_blocks.h"
#include "services/executor/llama_model.h"
#include "services/executor/llama_model_cuda.h"
#include "services/executor/sampler.h"
#include "tests/services/executor/executor_test_util.h"
#include "tests/support/gpu_test.h"
#include "tests/support/subprocess.h"
#include "tools/make_tiny_model/tiny_model.h"

namespace kvcm {
namespace {

using ::testing::HasSubstr;

constexpr int32_t kNumBlocks = 96;

double Tolerance(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return 1e-4;
    case DType::kFloat16:
      return 4e-3;
    default:
      return 3e-2;
  }
}

// max |a - ref| / max(1, max |ref|) over rows of `vocab`.
double WorstRowError(const std::vector<float>& a, const std::vector<float>& ref, int32_t vocab) {
  KVCM_CHECK(a.size() == ref.size()) << a.size() << " vs " << ref.size();
  double worst = 0;
  for (size_t row = 0; row * vocab < ref.size(); ++row) {
    double diff = 0;
    double scale = 1;
    for (size_t i = row * vocab; i < (row + 1) * vocab; ++i) {
      diff = std::max(diff, static_cast<double>(std::abs(a[i] - ref[i])));
      scale = std::max(scale, static_cast<double>(std::abs(ref[i])));
    }
    worst = std::max(worst, diff / scale);
  }
  return worst;
}

// One model and its device copy for the whole suite.
class Models {
 public:
  static Models& Get() {
    static Models* models = new Models();
    return *models;
  }
  const LlamaModel& host() const { return *host_; }
  // Null until a test with a device asked for it.
  const LlamaCudaModel* device() {
    if (device_ == nullptr) {
      absl::StatusOr<std::unique_ptr<LlamaCudaModel>> made = LlamaCudaModel::Create(*host_, 0);
      KVCM_CHECK(made.ok()) << made.status();
      device_ = std::move(*made);
      std::printf("weights on device 0: %llu bytes\n",
                  static_cast<unsigned long long>(device_->weight_bytes()));
    }
    return device_.get();
  }

 private:
  Models() {
    absl::StatusOr<testing::TempDir> dir = testing::TempDir::Create("kvcm-cuda-model");
    KVCM_CHECK(dir.ok()) << dir.status();
    TinyModelOptions options;
    std::printf("tiny model seed %llu\n", static_cast<unsigned long long>(options.seed));
    KVCM_CHECK(WriteTinyModel(dir->path(), options).ok());
    auto model = LlamaModel::Load(dir->path());
    KVCM_CHECK(model.ok()) << model.status();
    host_ = std::move(*model);
  }
  std::unique_ptr<LlamaModel> host_;
  std::unique_ptr<LlamaCudaModel> device_;
};

// The same pool twice: in host memory (for the CPU forward) and in device memory (for the
// device one), with the same starting garbage and the same shuffled free list.
class TwinPools {
 public:
  TwinPools(const LlamaConfig& config, DType dtype, int32_t block_size, uint64_t seed) {
    spec_ = config.KvSpec(dtype, block_size).value();
    layout_ = PoolLayout::For(spec_, kNumBlocks).value();
    host_.assign(static_cast<size_t>(layout_.total_bytes), 0x5a);
    absl::StatusOr<std::unique_ptr<PoolMemory>> device =
        CreateCudaPoolMemory(0, static_cast<uint64_t>(layout_.total_bytes));
    KVCM_CHECK(device.ok()) << device.status();
    device_ = std::move(*device);
    KVCM_CHECK(CopyToPool(*device_, 0, host_.data(), host_.size()).ok());
    for (int32_t b = 0; b < kNumBlocks; ++b) free_.push_back(b);
    std::mt19937_64 rng(seed);
    std::shuffle(free_.begin(), free_.end(), rng);
  }

  PagedPool HostPool() { return PagedPool{host_.data(), layout_, spec_, -1}; }
  PagedPool DevicePool() const {
    return PagedPool{static_cast<uint8_t*>(device_->base()), layout_, spec_, 0};
  }
  std::vector<uint8_t> DeviceBytes() const {
    std::vector<uint8_t> bytes(host_.size());
    KVCM_CHECK(CopyFromPool(*device_, 0, bytes.data(), bytes.size()).ok());
    return bytes;
  }
  const std::vector<uint8_t>& HostBytes() const { return host_; }
  int32_t TakeBlock() {
    KVCM_CHECK(!free_.empty());
    const int32_t b = free_.back();
    free_.pop_back();
    return b;
  }
  const PoolLayout& layout() const { return layout_; }
  const KvCacheSpec& spec() const { return spec_; }

 private:
  KvCacheSpec spec_;
  PoolLayout layout_;
  std::vector<uint8_t> host_;
  std::unique_ptr<PoolMemory> device_;
  std::vector<int32_t> free_;
};

struct Sequence {
  std::vector<int32_t> tokens;  // all tokens so far, including ones not yet run
  int32_t cached = 0;           // tokens whose K/V are in the pool
  std::vector<int32_t> blocks;  // block table
};

using Param = std::tuple<int32_t /*block_size*/, DType>;

class LlamaCudaForwardTest : public ::testing::TestWithParam<Param> {
 protected:
  void SetUp() override { KVCM_SKIP_WITHOUT_GPU(); }
  int32_t block_size() const { return std::get<0>(GetParam()); }
  DType dtype() const { return std::get<1>(GetParam()); }

  // One step on both pools; the batch is built from `work` (sequence, new tokens), blocks
  // taken as needed. Returns the worst relative error of the device's all-token logits;
  // sets *cpu_logits to the CPU's and counts the rows whose greedy token differs.
  double Step(TwinPools& pools, const std::vector<std::pair<Sequence*, int32_t>>& work,
              std::vector<float>* cpu_logits) {
    ForwardBatch batch;
    int32_t max_blocks = 1;
    for (const auto& [seq, n] : work) {
      while (static_cast<int32_t>(seq->blocks.size()) * block_size() < seq->cached + n) {
        seq->blocks.push_back(pools.TakeBlock());
      }
      max_blocks = std::max(max_blocks, static_cast<int32_t>(seq->blocks.size()));
    }
    batch.max_blocks_per_seq = max_blocks + 1;  // a spare entry, to be ignored
    for (const auto& [seq, n] : work) {
      batch.query_lens.push_back(n);
      batch.context_lens.push_back(seq->cached + n);
      for (int32_t i = seq->cached; i < seq->cached + n; ++i) {
        batch.token_ids.push_back(seq->tokens[static_cast<size_t>(i)]);
      }
      for (int32_t j = 0; j < batch.max_blocks_per_seq; ++j) {
        batch.block_tables.push_back(j < static_cast<int32_t>(seq->blocks.size())
                                         ? seq->blocks[static_cast<size_t>(j)]
                                         : -1);
      }
    }
    std::vector<float> gpu_logits;
    const absl::Status cpu = Models::Get().host().Forward(batch, pools.HostPool(), cpu_logits,
                                                          LogitsScope::kAllTokens);
    EXPECT_TRUE(cpu.ok()) << cpu;
    const absl::Status gpu = Models::Get().device()->Forward(batch, pools.DevicePool(),
                                                             &gpu_logits, LogitsScope::kAllTokens);
    EXPECT_TRUE(gpu.ok()) << gpu;
    for (const auto& [seq, n] : work) seq->cached += n;
    if (!cpu.ok() || !gpu.ok()) return INFINITY;
    const size_t vocab = static_cast<size_t>(Models::Get().host().config().vocab_size);
    for (size_t row = 0; row * vocab < cpu_logits->size(); ++row) {
      greedy_differences_ +=
          Greedy(std::span<const float>(gpu_logits).subspan(row * vocab, vocab)) !=
          Greedy(std::span<const float>(*cpu_logits).subspan(row * vocab, vocab));
    }
    return WorstRowError(gpu_logits, *cpu_logits, static_cast<int32_t>(vocab));
  }

  int32_t greedy_differences_ = 0;
};

TEST_P(LlamaCudaForwardTest, LogitsAndKvMatchTheCpuForward) {
  const LlamaModel& model = Models::Get().host();
  const int32_t vocab = model.config().vocab_size;
  const uint64_t seed =
      2000 + static_cast<uint64_t>(block_size()) * 10 + static_cast<uint64_t>(dtype());
  std::printf("seed %llu (block size %d, %s cache)\n", static_cast<unsigned long long>(seed),
              block_size(), std::string(DTypeName(dtype())).c_str());
  std::mt19937_64 rng(seed);
  TwinPools pools(model.config(), dtype(), block_size(), seed);

  std::vector<Sequence> seqs(3);
  const int32_t prompt_lens[] = {1, 9, 33};
  for (size_t i = 0; i < seqs.size(); ++i) {
    for (int32_t t = 0; t < prompt_lens[i]; ++t) {
      seqs[i].tokens.push_back(static_cast<int32_t>(rng() % static_cast<uint64_t>(vocab)));
    }
  }
  double worst = 0;
  std::vector<float> cpu_logits;
  // Greedy next token of every sequence in `work` from the CPU's logits (fed to both).
  auto extend = [&](const std::vector<std::pair<Sequence*, int32_t>>& work) {
    size_t row = 0;
    for (const auto& [seq, n] : work) {
      row += static_cast<size_t>(n);
      if (seq->cached == static_cast<int32_t>(seq->tokens.size())) {
        seq->tokens.push_back(Greedy(std::span<const float>(cpu_logits).subspan(
            (row - 1) * static_cast<size_t>(vocab), static_cast<size_t>(vocab))));
      }
    }
  };
  // 1. Prefill of two prompts and the first 20 tokens of the third.
  std::vector<std::pair<Sequence*, int32_t>> work = {{&seqs[0], 1}, {&seqs[1], 9}, {&seqs[2], 20}};
  worst = std::max(worst, Step(pools, work, &cpu_logits));
  extend(work);
  // 2. The rest of the third prompt over its cached prefix, with decode of the others.
  work = {{&seqs[0], 1}, {&seqs[2], 13}, {&seqs[1], 1}};
  worst = std::max(worst, Step(pools, work, &cpu_logits));
  extend(work);
  // 3. Decode, sequences dropping out at different steps.
  for (int32_t step = 0; step < 10; ++step) {
    work.clear();
    for (size_t i = 0; i < seqs.size(); ++i) {
      if (step < 10 - 3 * static_cast<int32_t>(i)) work.emplace_back(&seqs[i], 1);
    }
    worst = std::max(worst, Step(pools, work, &cpu_logits));
    extend(work);
  }
  std::printf("logits: worst relative error %.3g (tolerance %.1g)\n", worst, Tolerance(dtype()));
  EXPECT_LE(worst, Tolerance(dtype()));
  // The device's greedy pick is the CPU's on every row. With a fp32 cache the logits agree
  // to ~1e-6, far inside any gap between the top two here; a fp16/bf16 cache may flip a
  // near-tie, so it is only reported.
  std::printf("greedy tokens that differ: %d\n", greedy_differences_);
  if (dtype() == DType::kFloat32) {
    EXPECT_EQ(greedy_differences_, 0);
  }

  // Every written K/V element, slot by slot.
  const std::vector<uint8_t> device = pools.DeviceBytes();
  const std::vector<uint8_t>& host = pools.HostBytes();
  const PoolLayout& layout = pools.layout();
  const KvCacheSpec& spec = pools.spec();
  double kv_worst = 0;
  int64_t compared = 0;
  for (const Sequence& seq : seqs) {
    kvcm::testing::ForEachWrittenKvVector(layout, spec, seq.blocks, seq.cached, [&](int64_t at) {
      kv_worst = std::max(kv_worst, kvcm::testing::WorstKvVectorError(
                                        device.data(), host.data(), at, layout, spec));
      compared += spec.head_dim;
    });
  }
  std::printf("K/V: %lld elements, worst relative error %.3g\n",
              static_cast<long long>(compared), kv_worst);
  EXPECT_GT(compared, 0);
  EXPECT_LE(kv_worst, Tolerance(dtype()));
}

INSTANTIATE_TEST_SUITE_P(
    Caches, LlamaCudaForwardTest,
    ::testing::Combine(::testing::Values(1, 4, 16),
                       ::testing::Values(DType::kFloat32, DType::kFloat16, DType::kBFloat16)),
    [](const auto& test_param) {
      return absl::StrCat("block", std::get<0>(test_param.param), "_",
                          std::string(DTypeName(std::get<1>(test_param.param))));
    });

class LlamaCudaModelTest : public ::testing::Test {
 protected:
  void SetUp() override { KVCM_SKIP_WITHOUT_GPU(); }
};

TEST_F(LlamaCudaModelTest, CopyOrdersMakeDestinationsEqualTheirSources) {
  const LlamaModel& model = Models::Get().host();
  TwinPools pools(model.config(), DType::kFloat16, 4, 11);
  // Give the sources distinct contents: run a prompt into blocks 0..3.
  ForwardBatch batch;
  batch.token_ids = {5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20};
  batch.query_lens = {16};
  batch.context_lens = {16};
  batch.block_tables = {0, 1, 2, 3};
  batch.max_blocks_per_seq = 4;
  std::vector<float> logits;
  ASSERT_TRUE(Models::Get().device()->Forward(batch, pools.DevicePool(), &logits).ok());
  const std::vector<kernels::BlockCopy> copies = {{0, 10}, {3, 11}, {2, 40}};
  const absl::Status copied = Models::Get().device()->CopyBlocks(pools.DevicePool(), copies);
  ASSERT_TRUE(copied.ok()) << copied;
  const std::vector<uint8_t> bytes = pools.DeviceBytes();
  const PoolLayout& layout = pools.layout();
  for (const kernels::BlockCopy& c : copies) {
    for (int32_t layer = 0; layer < pools.spec().num_layers; ++layer) {
      for (int32_t kv = 0; kv < 2; ++kv) {
        const int64_t src = layout.Offset(layer, kv, c.src, 0, 0);
        const int64_t dst = layout.Offset(layer, kv, c.dst, 0, 0);
        EXPECT_EQ(std::memcmp(bytes.data() + src, bytes.data() + dst,
                              static_cast<size_t>(layout.block_stride)),
                  0)
            << "copy " << c.src << " -> " << c.dst << ", layer " << layer << ", kv " << kv;
      }
    }
  }
}

TEST_F(LlamaCudaModelTest, RefusalsLeaveTheDevicePoolUntouched) {
  const LlamaModel& model = Models::Get().host();
  const LlamaCudaModel& device = *Models::Get().device();
  TwinPools pools(model.config(), DType::kFloat32, 4, 12);
  const std::vector<uint8_t> before = pools.DeviceBytes();
  ForwardBatch batch;
  batch.token_ids = {3, 4, 5};
  batch.query_lens = {3};
  batch.context_lens = {3};
  batch.block_tables = {0};
  batch.max_blocks_per_seq = 1;
  std::vector<float> logits;

  absl::Status s = device.Forward(batch, pools.HostPool(), &logits);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(s.message(), HasSubstr("in host memory"));
  PagedPool elsewhere = pools.DevicePool();
  elsewhere.cuda_device = 7;
  s = device.Forward(batch, elsewhere, &logits);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(s.message(), HasSubstr("CUDA device 7"));

  ForwardBatch bad = batch;
  bad.token_ids[1] = model.config().vocab_size;
  s = device.Forward(bad, pools.DevicePool(), &logits);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("token_ids[1]"));
  bad = batch;
  bad.block_tables[0] = kNumBlocks;
  s = device.Forward(bad, pools.DevicePool(), &logits);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;

  const std::vector<kernels::BlockCopy> twice = {{0, 5}, {1, 5}};
  s = device.CopyBlocks(pools.DevicePool(), twice);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  const std::vector<kernels::BlockCopy> outside = {{0, kNumBlocks}};
  s = device.CopyBlocks(pools.DevicePool(), outside);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_EQ(pools.DeviceBytes(), before) << "a refused call wrote the device pool";
}

}  // namespace
}  // namespace kvcm
