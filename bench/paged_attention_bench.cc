// CPU paged-attention decode throughput against a plain memory read, measured in the same run.
//
//   build/bench/paged_attention_bench                           # ratios at the end
//   build/bench/paged_attention_bench --benchmark_filter=fp16
//   build/bench/paged_attention_bench --isa=portable            # without AVX2/FMA/F16C
//   build/bench/paged_attention_bench --isa=avx2                # without AVX-512
//
// Two attention shapes, one layer each, head dim 128, block size 16; 8 sequences of 2048 or
// 8192 context tokens, one query token each (decode); fp16 and fp32 storage; all hardware
// threads:
//   (no label)  Llama-3-8B: 32 query heads over 8 KV heads (GQA, 4 query heads per KV head).
//               4 FMAs per K/V element read: on few cores, bound by arithmetic.
//   mha/        Llama-2-7B: 32 query heads over 32 KV heads (MHA, one per KV head). 1 FMA
//               per K/V element read: bound by memory, so it shows how close the kernel's
//               K/V reads come to a plain read.
//
// Unit: one KiB of K or V read (8 seqs x context x 2 x KV heads x 128 x dtype bytes: 64 MiB
// to 512 MiB for GQA, 256 MiB to 2 GiB for MHA, well past the last-level cache); GB/s is
// printed beside each.
//
//   MemRead/[mha/]<dtype>/<ctx>               baseline: sum of the floats of one contiguous
//                                             buffer of the same size, on the same thread
//                                             pool and thread count
//   PagedDecodeAscending/[mha/]<dtype>/<ctx>  cpu::PagedAttention, each sequence's blocks
//                                             ascending
//   PagedDecodeShuffled/[mha/]<dtype>/<ctx>   the same with the pool's blocks randomly
//                                             permuted
//
// Goals (issue "Kernels"): ascending >= 0.8x MemRead's bandwidth (time per byte <= 1.25x);
// shuffled no more than 1.25x slower than ascending.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "bench/ratio_reporter.h"
#include "common/base/dtype.h"
#include "common/memory/pool_layout.h"
#include "common/sizing/kv_cache_spec.h"
#include "kernels/cpu_isa.h"
#include "kernels/cpu_thread_pool.h"
#include "kernels/paged_attention.h"
#include "kernels/paged_kv.h"

namespace kvcm {
namespace {

constexpr int32_t kSeqs = 8;
constexpr int32_t kQHeads = 32;
constexpr int32_t kHeadDim = 128;
constexpr int32_t kBlockSize = 16;

// An attention shape: its prefix in benchmark names ("" or "mha/") and its KV heads.
struct Shape {
  const char* label;
  int32_t kv_heads;
};

constexpr Shape kGqa{"", 8};       // Llama-3-8B
constexpr Shape kMha{"mha/", 32};  // Llama-2-7B

int64_t KvBytes(int32_t kv_heads, DType dtype, int32_t context) {
  return int64_t{kSeqs} * context * 2 * kv_heads * kHeadDim * DTypeBytes(dtype);
}

// One pool for a (KV heads, dtype, context), kept while consecutive benchmarks use it.
struct Fixture {
  int32_t kv_heads = 0;
  DType dtype = DType::kFloat32;
  int32_t context = 0;
  KvCacheSpec spec;
  PoolLayout layout;
  std::vector<uint8_t> pool;
  kernels::PagedKvView view;
  std::vector<int32_t> ascending;  // block tables
  std::vector<int32_t> shuffled;
  std::vector<int32_t> query_lens;
  std::vector<int32_t> context_lens;
  std::vector<float> query;
  std::vector<float> out;
  std::vector<float> plain;  // the baseline's buffer: KvBytes() bytes of floats
};

// Random values in +-[0.5, 1) straight into the bit patterns: no NaN, no subnormals.
void FillPool(std::vector<uint8_t>& pool, DType dtype) {
  std::mt19937_64 rng(1);
  if (dtype == DType::kFloat32) {
    for (size_t i = 0; i + 4 <= pool.size(); i += 4) {
      const uint32_t bits = (static_cast<uint32_t>(rng()) & 0x807fffffu) | 0x3f000000u;
      std::memcpy(&pool[i], &bits, 4);
    }
  } else {
    const uint16_t keep = dtype == DType::kFloat16 ? 0x83ff : 0x807f;
    const uint16_t set = dtype == DType::kFloat16 ? 0x3800 : 0x3f00;
    for (size_t i = 0; i + 8 <= pool.size(); i += 8) {
      uint64_t r = rng();
      for (int j = 0; j < 4; ++j, r >>= 16) {
        const uint16_t bits = static_cast<uint16_t>((r & keep) | set);
        std::memcpy(&pool[i + 2 * j], &bits, 2);
      }
    }
  }
}

Fixture& GetFixture(int32_t kv_heads, DType dtype, int32_t context) {
  static std::unique_ptr<Fixture> fixture;
  if (fixture && fixture->kv_heads == kv_heads && fixture->dtype == dtype &&
      fixture->context == context) {
    return *fixture;
  }
  fixture.reset();  // free the previous pool first (up to 2 GiB, plus as much for `plain`)
  auto f = std::make_unique<Fixture>();
  f->kv_heads = kv_heads;
  f->dtype = dtype;
  f->context = context;
  f->spec.num_layers = 1;
  f->spec.num_kv_heads = kv_heads;
  f->spec.head_dim = kHeadDim;
  f->spec.block_size = kBlockSize;
  f->spec.dtype = dtype;
  const int32_t blocks_per_seq = context / kBlockSize;
  const int32_t num_blocks = kSeqs * blocks_per_seq;
  f->layout = *PoolLayout::For(f->spec, num_blocks);
  f->pool.resize(static_cast<size_t>(f->layout.total_bytes));
  FillPool(f->pool, dtype);
  f->view = *kernels::LayerView(f->pool.data(), f->layout, f->spec, 0);
  f->ascending.resize(static_cast<size_t>(num_blocks));
  std::iota(f->ascending.begin(), f->ascending.end(), 0);
  f->shuffled = f->ascending;
  std::mt19937_64 rng(2);
  std::shuffle(f->shuffled.begin(), f->shuffled.end(), rng);
  f->query_lens.assign(kSeqs, 1);
  f->context_lens.assign(kSeqs, context);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  f->query.resize(static_cast<size_t>(kSeqs) * kQHeads * kHeadDim);
  for (float& x : f->query) x = uniform(rng);
  f->out.resize(f->query.size());
  f->plain.resize(static_cast<size_t>(KvBytes(kv_heads, dtype, context) / 4));
  for (size_t i = 0; i < f->plain.size(); ++i) f->plain[i] = static_cast<float>(i % 7);
  fixture = std::move(f);
  return *fixture;
}

typedef float V8 __attribute__((vector_size(32)));

// Sum of n floats with 4 independent vector accumulators: bound by memory, not by adds.
float SumFloats(const float* p, size_t n) {
  V8 a0 = {}, a1 = {}, a2 = {}, a3 = {};
  size_t i = 0;
  for (; i + 32 <= n; i += 32) {
    V8 x0, x1, x2, x3;
    std::memcpy(&x0, p + i, sizeof(V8));
    std::memcpy(&x1, p + i + 8, sizeof(V8));
    std::memcpy(&x2, p + i + 16, sizeof(V8));
    std::memcpy(&x3, p + i + 24, sizeof(V8));
    a0 += x0;
    a1 += x1;
    a2 += x2;
    a3 += x3;
  }
  const V8 s = (a0 + a1) + (a2 + a3);
  float sum = 0.0f;
  for (int j = 0; j < 8; ++j) sum += s[j];
  for (; i < n; ++i) sum += p[i];
  return sum;
}

void SetCounters(benchmark::State& state, int64_t kv_bytes) {
  state.counters["units"] = static_cast<double>(kv_bytes) / 1024.0;
  state.counters["GB/s"] = benchmark::Counter(static_cast<double>(kv_bytes),
                                              benchmark::Counter::kIsIterationInvariantRate);
}

void MemRead(benchmark::State& state, Shape shape, DType dtype, int32_t context) {
  Fixture& f = GetFixture(shape.kv_heads, dtype, context);
  kernels::CpuThreadPool& pool = kernels::CpuThreadPool::Default();
  // As many tasks per thread as PagedDecode has work items (8 sequences over the threads).
  const int64_t tasks = kSeqs;
  const size_t per_task = f.plain.size() / static_cast<size_t>(tasks);
  std::vector<float> sums(static_cast<size_t>(tasks));
  for (auto _ : state) {
    pool.ParallelFor(tasks, 0, [&](int64_t t) {
      sums[static_cast<size_t>(t)] =
          SumFloats(f.plain.data() + static_cast<size_t>(t) * per_task, per_task);
    });
    benchmark::DoNotOptimize(sums.data());
  }
  SetCounters(state, KvBytes(shape.kv_heads, dtype, context));
}

void PagedDecode(benchmark::State& state, Shape shape, DType dtype, int32_t context,
                 bool shuffled) {
  Fixture& f = GetFixture(shape.kv_heads, dtype, context);
  kernels::PagedAttentionBatch batch;
  batch.num_seqs = kSeqs;
  batch.num_q_heads = kQHeads;
  batch.query_lens = f.query_lens.data();
  batch.context_lens = f.context_lens.data();
  batch.block_tables = shuffled ? f.shuffled.data() : f.ascending.data();
  batch.max_blocks_per_seq = context / kBlockSize;
  batch.scale = 1.0f / std::sqrt(static_cast<float>(kHeadDim));
  batch.max_query_len = 1;
  for (auto _ : state) {
    kernels::cpu::PagedAttention(f.view, batch, f.query.data(), f.out.data());
    benchmark::DoNotOptimize(f.out.data());
  }
  SetCounters(state, KvBytes(shape.kv_heads, dtype, context));
}

// Benchmarks sharing a fixture run one after the other. The MHA rows have their own
// MemRead baseline of their own bytes; the ratio table pairs "X/mha/..." with
// "MemRead/mha/...".
void RegisterAll() {
  for (const Shape& shape : {kGqa, kMha}) {
    for (DType dtype : {DType::kFloat16, DType::kFloat32}) {
      for (int32_t context : {2048, 8192}) {
        const std::string suffix =
            shape.label + std::string(DTypeName(dtype)) + "/" + std::to_string(context);
        benchmark::RegisterBenchmark(("MemRead/" + suffix).c_str(), MemRead, shape, dtype, context)
            ->UseRealTime();
        benchmark::RegisterBenchmark(("PagedDecodeAscending/" + suffix).c_str(), PagedDecode, shape,
                                     dtype, context, false)
            ->UseRealTime();
        benchmark::RegisterBenchmark(("PagedDecodeShuffled/" + suffix).c_str(), PagedDecode, shape,
                                     dtype, context, true)
            ->UseRealTime();
      }
    }
  }
}

}  // namespace
}  // namespace kvcm

int main(int argc, char** argv) {
  // --isa=portable|avx2|avx512: measure those inner loops instead of the best ones (removed
  // from the arguments before Google Benchmark sees them).
  std::vector<char*> args;
  for (int i = 0; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (arg.starts_with("--isa=")) {
      kvcm::kernels::CpuIsa isa;
      if (!kvcm::kernels::ParseCpuIsa(arg.substr(6), &isa)) {
        std::fprintf(stderr, "unknown ISA in %s (portable, avx2, avx512)\n", argv[i]);
        return 2;
      }
      if (static_cast<int>(isa) > static_cast<int>(kvcm::kernels::BestCpuIsa())) {
        std::fprintf(stderr, "this CPU has no %s\n", argv[i] + 6);
        return 2;
      }
      kvcm::kernels::SetCpuIsaForTest(isa);
    } else {
      args.push_back(argv[i]);
    }
  }
  argc = static_cast<int>(args.size());
  argv = args.data();
  std::printf("paged_attention_bench: %d threads, CPU kernels %s\n",
              kvcm::kernels::CpuThreadPool::Default().max_threads(),
              std::string(kvcm::kernels::CpuIsaName(kvcm::kernels::ActiveCpuIsa())).c_str());
  kvcm::RegisterAll();
  kvcm::bench::RatioReporter reporter;
  reporter.AddPair("PagedDecodeAscending/", "MemRead/", 1.25, "KiB");
  reporter.AddPair("PagedDecodeShuffled/", "PagedDecodeAscending/", 1.25, "KiB");
  reporter.AddPair("PagedDecodeShuffled/", "MemRead/", 1.25, "KiB");
  return kvcm::bench::RunWithRatios(argc, argv, reporter);
}
