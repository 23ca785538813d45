// LlamaCudaModel against the CPU forward (LlamaModel::Forward, the reference), label gpu:
// the same tiny model, the same batches and block tables, one pool in host memory and one
// in device memory (the cuda pool backend's cudaMalloc) holding the same garbage to start.
//
//   - batched prefill, chunked prefill over a cached prefix mixed with decode, then decode
//     token by token: logits within tolerance of the CPU's every step, and the same greedy
//     tokens (fed to both) with fp32 weights and a fp32 cache;
//   - the K/V written into the device pool: within tolerance of the CPU pool's, slot by slot;
//   - copy-on-write orders: destination blocks equal their sources on the device;
//   - refused pools and batches: clear errors, and the device pool is untouched.
//
// Two suites run that scenario. Caches: a tiny llama with fp32 weights on the device (the
// tiled fp32 kernel), block sizes 1, 4, 16 and each cache dtype. Weights: tiny llama, qwen2
// (a bias on q, k and v, N(0, 0.5), large enough to move every logit) and llama-bias
// (Llama's attention_bias: q, k, v and o) models with each device weight dtype (bf16 and
// fp16 through cuBLAS, fp32), block size 16, a fp32 cache.
//
// Tolerances, max |gpu - cpu| / max(1, max |cpu|) over a logits row (and the same over a
// K/V vector), the sum of a cache share and a weight share:
//   - cache: the device sums in another order and fuses multiply-adds, so the two drift by
//     fp32 rounding through the layers; a fp16/bf16 cache can round a K/V element
//     differently when the inputs differ by one ulp. fp32 1e-4, fp16 4e-3, bf16 3e-2 (the
//     CPU's own paged-vs-contiguous bounds are 1e-5 / 2e-3 / 1.5e-2).
//   - weights: 0 for fp32. For a 16-bit type with unit roundoff u (bf16: 8 significant
//     bits, u = 2^-8; fp16: 11 bits, u = 2^-11) every product rounds both its weights and
//     its input, so each term w * x carries a relative error of up to 2u. The 4-layer model
//     has 4 such products in a row per layer plus the LM head, and an error entering the
//     residual stream stays there: 17 rounding stages of up to 2u, added in the worst case.
//     Their signs are random, so the observed error is well below that sum; the bound taken
//     is 16u (bf16 6.25e-2, fp16 7.8e-3), i.e. about half the worst case. It is checked
//     against the CPU itself by WeightRoundingAloneStaysWithinHalfTheTolerance (no device
//     needed): the CPU forward of the same model with its weights rounded to the type (the
//     device rounds the activations too, about as much again) must stay within half of it.
//     A wrong transpose, leading dimension or missing bias moves logits by their own size,
//     far beyond either share.
// With 16-bit weights a near-tie may flip a greedy token: the differences are only
// reported. The worst errors seen are printed.
//
// Without a device every test but those marked "no device needed" (the CPU calibration,
// the biases' effect, the refused weight dtype) skips with "no CUDA device: ..."; with
// KVCM_REQUIRE_GPU=1 (scripts/gpu-check.sh sets it) they fail instead.

#include "services/executor/model/llama_model_cuda.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <ostream>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "common/base/check.h"
#include "common/memory/pool_layout.h"
#include "common/memory/pool_memory.h"
#include "common/sizing/kv_cache_groups.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/copy_blocks.h"
#include "services/executor/model/llama_model.h"
#include "services/executor/model/sampler.h"
#include "tests/services/executor/executor_test_util.h"
#include "tests/support/gpu_test.h"
#include "tests/support/status_matchers.h"
#include "tests/support/subprocess.h"
#include "tools/make_tiny_model/tiny_model.h"

namespace kvcm::executor {
namespace {

using ::testing::HasSubstr;

constexpr int32_t kNumBlocks = 96;

// The cache dtype's share of the tolerance (see the top of the file).
double CacheTolerance(DType cache) {
  switch (cache) {
    case DType::kFloat32:
      return 1e-4;
    case DType::kFloat16:
      return 4e-3;
    default:
      return 3e-2;
  }
}

// The device weight dtype's share: 16 unit roundoffs (see the top of the file).
double WeightTolerance(DType weights) {
  switch (weights) {
    case DType::kFloat16:
      return 16 * std::ldexp(1.0, -11);
    case DType::kBFloat16:
      return 16 * std::ldexp(1.0, -8);
    default:
      return 0;
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

// A tiny random model of `architecture` ("llama", "qwen2", or "llama-bias": llama with
// attention_bias) whose file stores its weights in `file_dtype`, loaded on the host.
std::unique_ptr<LlamaModel> LoadTinyModel(const std::string& architecture, DType file_dtype) {
  absl::StatusOr<testing::TempDir> dir = testing::TempDir::Create("kvcm-cuda-model");
  KVCM_CHECK(dir.ok()) << dir.status();
  TinyModelOptions options;
  options.architecture = architecture == "qwen2" ? "qwen2" : "llama";
  options.attention_bias = architecture == "llama-bias";
  options.dtype = file_dtype;
  std::printf("tiny %s model seed %llu, %s in the file\n", architecture.c_str(),
              static_cast<unsigned long long>(options.seed),
              std::string(DTypeName(file_dtype)).c_str());
  const absl::Status written = WriteTinyModel(dir->path(), options);
  KVCM_CHECK(written.ok()) << written;
  auto model = LlamaModel::Load(dir->path());
  KVCM_CHECK(model.ok()) << model.status();
  KVCM_CHECK(model->get()->config().qkv_bias == (architecture != "llama"));
  KVCM_CHECK(model->get()->config().o_bias == (architecture == "llama-bias"));
  return std::move(*model);
}

// The host models and their device copies, made on first use, for the whole suite.
class Models {
 public:
  static Models& Get() {
    static Models* models = new Models();
    return *models;
  }
  const LlamaModel& host(const std::string& architecture) {
    std::unique_ptr<LlamaModel>& model = hosts_[architecture];
    if (model == nullptr) model = LoadTinyModel(architecture, DType::kFloat32);
    return *model;
  }
  // Only in a test with a device.
  const LlamaCudaModel* device(const std::string& architecture, DType weights) {
    std::unique_ptr<LlamaCudaModel>& device = devices_[{architecture, weights}];
    if (device == nullptr) {
      LlamaCudaModelOptions options;
      options.weight_dtype = weights;
      absl::StatusOr<std::unique_ptr<LlamaCudaModel>> made =
          LlamaCudaModel::Create(host(architecture), 0, options);
      KVCM_CHECK(made.ok()) << made.status();
      device = std::move(*made);
      KVCM_CHECK(device->weight_dtype() == weights);
      std::printf("%s weights on device 0 in %s: %llu bytes\n", architecture.c_str(),
                  std::string(DTypeName(weights)).c_str(),
                  static_cast<unsigned long long>(device->weight_bytes()));
    }
    return device.get();
  }
  // The llama model with fp32 weights on the device: the exact reference.
  const LlamaModel& host() { return host("llama"); }
  const LlamaCudaModel* device() { return device("llama", DType::kFloat32); }

 private:
  Models() = default;
  std::map<std::string, std::unique_ptr<LlamaModel>> hosts_;
  std::map<std::pair<std::string, DType>, std::unique_ptr<LlamaCudaModel>> devices_;
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

  PoolView HostPool() { return View(host_.data(), PoolBackend::kShm, -1); }
  PoolView DevicePool() const {
    return View(static_cast<uint8_t*>(device_->base()), PoolBackend::kCuda, 0);
  }
  PoolView View(uint8_t* base, PoolBackend backend, int32_t cuda_device) const {
    PoolView view;
    view.base = base;
    view.spec = spec_;
    view.num_blocks = layout_.num_blocks;
    view.layout = layout_;
    view.backend = backend;
    view.cuda_device = cuda_device;
    return view;
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

struct Case {
  std::string architecture;  // of the tiny model: LoadTinyModel's
  DType weights;             // on the device
  int32_t block_size;
  DType cache;
};

std::string CaseName(const ::testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  return absl::StrCat(absl::StrReplaceAll(c.architecture, {{"-", "_"}}), "_",
                      std::string(DTypeName(c.weights)), "_weights_block", c.block_size, "_",
                      std::string(DTypeName(c.cache)), "_cache");
}

// How gtest (and so ctest's test list) prints a case.
void PrintTo(const Case& c, std::ostream* os) {
  *os << c.architecture << ", " << DTypeName(c.weights) << " weights, block size " << c.block_size
      << ", " << DTypeName(c.cache) << " cache";
}

class LlamaCudaForwardTest : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override { KVCM_SKIP_WITHOUT_GPU(); }
  const std::string& architecture() const { return GetParam().architecture; }
  DType weights() const { return GetParam().weights; }
  int32_t block_size() const { return GetParam().block_size; }
  DType dtype() const { return GetParam().cache; }
  double tolerance() const { return CacheTolerance(dtype()) + WeightTolerance(weights()); }
  const LlamaModel& host() const { return Models::Get().host(architecture()); }
  const LlamaCudaModel& device() const { return *Models::Get().device(architecture(), weights()); }

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
    const absl::Status cpu =
        host().Forward(batch, pools.HostPool(), cpu_logits, LogitsScope::kAllTokens);
    EXPECT_THAT(cpu, IsOk());
    const absl::Status gpu =
        device().Forward(batch, pools.DevicePool(), &gpu_logits, LogitsScope::kAllTokens);
    EXPECT_THAT(gpu, IsOk());
    for (const auto& [seq, n] : work) seq->cached += n;
    if (!cpu.ok() || !gpu.ok()) return INFINITY;
    const size_t vocab = static_cast<size_t>(host().config().vocab_size);
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
  const LlamaModel& model = host();
  const int32_t vocab = model.config().vocab_size;
  const uint64_t seed =
      2000 + static_cast<uint64_t>(block_size()) * 10 + static_cast<uint64_t>(dtype());
  std::printf("seed %llu (%s, %s weights, block size %d, %s cache)\n",
              static_cast<unsigned long long>(seed), architecture().c_str(),
              std::string(DTypeName(weights())).c_str(), block_size(),
              std::string(DTypeName(dtype())).c_str());
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
        seq->tokens.push_back(Greedy(
            std::span<const float>(cpu_logits)
                .subspan((row - 1) * static_cast<size_t>(vocab), static_cast<size_t>(vocab))));
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
  std::printf("logits: worst relative error %.3g (tolerance %.2g)\n", worst, tolerance());
  EXPECT_LE(worst, tolerance());
  // The device's greedy pick is the CPU's on every row. With fp32 weights and a fp32 cache
  // the logits agree to ~1e-6, far inside any gap between the top two here; 16-bit weights
  // or a fp16/bf16 cache may flip a near-tie, so it is only reported.
  std::printf("greedy tokens that differ: %d\n", greedy_differences_);
  if (dtype() == DType::kFloat32 && weights() == DType::kFloat32) {
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
      kv_worst = std::max(kv_worst, kvcm::testing::WorstKvVectorError(device.data(), host.data(),
                                                                      at, layout, spec));
      compared += spec.head_dim;
    });
  }
  std::printf("K/V: %lld elements, worst relative error %.3g\n", static_cast<long long>(compared),
              kv_worst);
  EXPECT_GT(compared, 0);
  EXPECT_LE(kv_worst, tolerance());
}

std::vector<Case> CacheCases() {
  std::vector<Case> cases;
  for (const int32_t block_size : {1, 4, 16}) {
    for (const DType cache : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
      cases.push_back({"llama", DType::kFloat32, block_size, cache});
    }
  }
  return cases;
}

std::vector<Case> WeightCases() {
  std::vector<Case> cases;
  for (const char* architecture : {"llama", "qwen2", "llama-bias"}) {
    for (const DType weights : {DType::kBFloat16, DType::kFloat16, DType::kFloat32}) {
      cases.push_back({architecture, weights, 16, DType::kFloat32});
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Caches, LlamaCudaForwardTest, ::testing::ValuesIn(CacheCases()), CaseName);
INSTANTIATE_TEST_SUITE_P(Weights, LlamaCudaForwardTest, ::testing::ValuesIn(WeightCases()),
                         CaseName);

// The calibration of WeightTolerance, on the CPU (no device needed): the same tiny model
// with its weights rounded to the 16-bit type in the file (the generator draws the same
// values, then rounds them to nearest even, as the device upload does) against the fp32
// file, through the contiguous reference forward of one 48-token sequence. That is the
// weights' share of the device's error; rounding the activations adds about as much, so it
// must stay within half of WeightTolerance.
struct Rounding {
  const char* architecture;
  DType weights;
};

void PrintTo(const Rounding& r, std::ostream* os) {
  *os << r.architecture << ", " << DTypeName(r.weights);
}

class WeightRoundingTest : public ::testing::TestWithParam<Rounding> {};

TEST_P(WeightRoundingTest, WeightRoundingAloneStaysWithinHalfTheTolerance) {
  const auto& [architecture, weights] = GetParam();
  const LlamaModel& exact = Models::Get().host(architecture);
  const std::unique_ptr<LlamaModel> rounded = LoadTinyModel(architecture, weights);
  std::mt19937_64 rng(3000 + static_cast<uint64_t>(weights));
  std::vector<int32_t> tokens;
  for (int32_t t = 0; t < 48; ++t) {
    tokens.push_back(
        static_cast<int32_t>(rng() % static_cast<uint64_t>(exact.config().vocab_size)));
  }
  absl::StatusOr<std::vector<float>> reference = exact.ForwardContiguous(tokens);
  ASSERT_THAT(reference, IsOk());
  absl::StatusOr<std::vector<float>> logits = rounded->ForwardContiguous(tokens);
  ASSERT_THAT(logits, IsOk());
  const double worst = WorstRowError(*logits, *reference, exact.config().vocab_size);
  std::printf("%s weights rounded to %s: worst relative error %.3g (half the tolerance %.2g)\n",
              architecture, std::string(DTypeName(weights)).c_str(), worst,
              WeightTolerance(weights) / 2);
  EXPECT_GT(worst, 0) << "the rounded file should differ from the fp32 one";
  EXPECT_LE(worst, WeightTolerance(weights) / 2);
}

INSTANTIATE_TEST_SUITE_P(
    Cpu, WeightRoundingTest,
    ::testing::Values(Rounding{"llama", DType::kBFloat16}, Rounding{"llama", DType::kFloat16},
                      Rounding{"qwen2", DType::kBFloat16}, Rounding{"qwen2", DType::kFloat16},
                      Rounding{"llama-bias", DType::kBFloat16}),
    [](const auto& test_param) {
      return absl::StrCat(absl::StrReplaceAll(test_param.param.architecture, {{"-", "_"}}), "_",
                          std::string(DTypeName(test_param.param.weights)));
    });

// The tiny qwen2 and llama-bias models are the tiny llama one (same seed, same draws per
// tensor name) plus their biases: so a device pass that dropped them would be as far from
// the CPU's logits as these are from the llama model's, far beyond the loosest tolerance
// (bf16 weights). No device needed.
TEST(TinyBiasedModelsTest, TheirBiasesMoveTheLogitsFarBeyondTheTolerance) {
  const std::vector<int32_t> tokens = {1, 72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100};
  absl::StatusOr<std::vector<float>> llama = Models::Get().host("llama").ForwardContiguous(tokens);
  ASSERT_THAT(llama, IsOk());
  for (const char* architecture : {"qwen2", "llama-bias"}) {
    absl::StatusOr<std::vector<float>> biased =
        Models::Get().host(architecture).ForwardContiguous(tokens);
    ASSERT_THAT(biased, IsOk());
    const double moved =
        WorstRowError(*biased, *llama, Models::Get().host("llama").config().vocab_size);
    std::printf("the %s biases move the logits by %.3g relative\n", architecture, moved);
    EXPECT_GT(moved, 4 * (CacheTolerance(DType::kFloat32) + WeightTolerance(DType::kBFloat16)))
        << architecture;
  }
}

// Checked before any device call: no device needed.
TEST(LlamaCudaModelOptionsTest, AWeightDtypeOtherThanBf16Fp16OrFp32IsRefused) {
  LlamaCudaModelOptions options;
  options.weight_dtype = DType::kFloat8E4M3;
  const absl::StatusOr<std::unique_ptr<LlamaCudaModel>> made =
      LlamaCudaModel::Create(Models::Get().host(), 0, options);
  EXPECT_EQ(made.status().code(), absl::StatusCode::kInvalidArgument) << made.status();
  EXPECT_THAT(made.status().message(), HasSubstr("must be bf16, fp16 or fp32"));
}

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
  ASSERT_THAT(Models::Get().device()->Forward(batch, pools.DevicePool(), &logits), IsOk());
  const std::vector<kernels::BlockCopy> copies = {{0, 10}, {3, 11}, {2, 40}};
  const absl::Status copied = Models::Get().device()->CopyBlocks(pools.DevicePool(), copies);
  ASSERT_THAT(copied, IsOk());
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
  PoolView elsewhere = pools.DevicePool();
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

  // KV cache groups (even the one group of a model whose layers are all alike): the device
  // forward reads every layer through one table, so it refuses them rather than misread.
  PoolView grouped = pools.DevicePool();
  grouped.kv_groups = GroupLayers(model.config().layer_windows).value().groups;
  s = device.Forward(batch, grouped, &logits);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented) << s;
  EXPECT_THAT(s.message(), HasSubstr("KV cache groups are served by the CPU model only"));
  const std::vector<kernels::BlockCopy> one = {{0, 5}};
  s = device.CopyBlocks(grouped, one);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented) << s;
  EXPECT_EQ(pools.DeviceBytes(), before) << "a refused call wrote the device pool";
}

}  // namespace
}  // namespace kvcm::executor
