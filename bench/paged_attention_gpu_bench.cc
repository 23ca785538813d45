// CUDA paged-attention decode throughput against the device's own copy bandwidth, measured
// in the same run. Needs a CUDA device (scripts/gpu-check.sh runs it); exits 1 without one.
//
//   build-gpu/bench/paged_attention_gpu_bench
//
// Shape: Llama-3-8B attention, one layer: 32 query heads over 8 KV heads, head dim 128,
// block size 16, one query token per sequence (decode, batch.max_query_len = 1).
// Batches: 4 x 8192, 32 x 8192 and 128 x 2048 context tokens; fp16, bf16 and fp32 storage;
// blocks in a random permutation of the pool (ascending too for one shape). 128 MiB to 2 GiB
// of K/V, all past the 50-60 MB L2. Timed with CUDA events (manual time), one call per
// iteration, on the default stream.
//
// Unit: one byte.
//   GpuCopy/<shape>        baseline: cudaMemcpyAsync device-to-device of the same number of
//                          bytes as the K/V read; a byte counts once read and once written,
//                          so its ns/unit is time / (2 x bytes): the copy bandwidth
//                          (read + write), the usual HBM figure.
//   GpuPagedDecode/<shape> cuda::PagedAttention: time / K/V bytes read (the queries, block
//                          tables and outputs, < 0.1% of it, are not counted).
// Ratio = attention's time per byte / copy's time per byte; <= 1.25 means the kernel reads
// K/V at >= 0.8x the copy bandwidth (FlashInfer's decode reaches 0.7-0.9x of peak).

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "bench/ratio_reporter.h"
#include "common/base/dtype.h"
#include "common/memory/pool_layout.h"
#include "common/sizing/kv_cache_spec.h"
#include "kernels/paged_attention.h"
#include "kernels/paged_kv.h"

namespace kvcm {
namespace {

constexpr int32_t kKvHeads = 8;
constexpr int32_t kQHeads = 32;
constexpr int32_t kHeadDim = 128;
constexpr int32_t kBlockSize = 16;

#define BENCH_CUDA(expr)                                                 \
  do {                                                                   \
    const cudaError_t err_ = (expr);                                     \
    if (err_ != cudaSuccess) {                                           \
      std::fprintf(stderr, "%s: %s\n", #expr, cudaGetErrorString(err_)); \
      std::exit(1);                                                      \
    }                                                                    \
  } while (false)

struct Shape {
  DType dtype;  // fp32, fp16 or bf16
  int32_t seqs;
  int32_t context;
  bool shuffled;

  std::string Name() const {
    return std::string(DTypeName(dtype)) + "/" + std::to_string(seqs) + "x" +
           std::to_string(context) + (shuffled ? "/shuffled" : "/ascending");
  }
  int64_t KvBytes() const {
    return int64_t{seqs} * context * 2 * kKvHeads * kHeadDim * DTypeBytes(dtype);
  }
};

template <typename T>
T* DeviceAlloc(size_t count) {
  void* p = nullptr;
  BENCH_CUDA(cudaMalloc(&p, count * sizeof(T)));
  return static_cast<T*>(p);
}

template <typename T>
T* Upload(const std::vector<T>& host) {
  T* p = DeviceAlloc<T>(host.size());
  BENCH_CUDA(cudaMemcpy(p, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  return p;
}

// Device buffers of one shape. Freed when the next shape is set up (one at a time).
struct Fixture {
  Shape shape{};
  uint8_t* pool = nullptr;
  uint8_t* copy_dst = nullptr;
  kernels::PagedKvView view;
  kernels::PagedAttentionBatch batch;
  int32_t* query_lens = nullptr;
  int32_t* context_lens = nullptr;
  int32_t* tables = nullptr;
  float* query = nullptr;
  float* out = nullptr;
  cudaEvent_t start = nullptr;
  cudaEvent_t stop = nullptr;

  ~Fixture() {
    for (void* p :
         {static_cast<void*>(pool), static_cast<void*>(copy_dst), static_cast<void*>(query_lens),
          static_cast<void*>(context_lens), static_cast<void*>(tables), static_cast<void*>(query),
          static_cast<void*>(out)}) {
      if (p != nullptr) cudaFree(p);
    }
    if (start != nullptr) cudaEventDestroy(start);
    if (stop != nullptr) cudaEventDestroy(stop);
  }
};

Fixture& GetFixture(const Shape& shape) {
  static std::unique_ptr<Fixture> fixture;
  if (fixture && fixture->shape.Name() == shape.Name()) return *fixture;
  fixture.reset();
  auto f = std::make_unique<Fixture>();
  f->shape = shape;
  KvCacheSpec spec;
  spec.num_layers = 1;
  spec.num_kv_heads = kKvHeads;
  spec.head_dim = kHeadDim;
  spec.block_size = kBlockSize;
  spec.dtype = shape.dtype;
  const int32_t blocks_per_seq = shape.context / kBlockSize;
  const int32_t num_blocks = shape.seqs * blocks_per_seq;
  const PoolLayout layout = *PoolLayout::For(spec, num_blocks);
  f->pool = DeviceAlloc<uint8_t>(static_cast<size_t>(layout.total_bytes));
  // 0x3c bytes: 1.06 in fp16, 0.0115 in bf16 and fp32; plain device memory has no
  // compression, so constant values cost the same bandwidth as random ones.
  BENCH_CUDA(cudaMemset(f->pool, 0x3c, static_cast<size_t>(layout.total_bytes)));
  f->copy_dst = DeviceAlloc<uint8_t>(static_cast<size_t>(shape.KvBytes()));
  f->view = *kernels::LayerView(f->pool, layout, spec, 0);

  std::vector<int32_t> tables(static_cast<size_t>(num_blocks));
  std::iota(tables.begin(), tables.end(), 0);
  std::mt19937_64 rng(2);
  if (shape.shuffled) std::shuffle(tables.begin(), tables.end(), rng);
  f->tables = Upload(tables);
  f->query_lens = Upload(std::vector<int32_t>(static_cast<size_t>(shape.seqs), 1));
  f->context_lens = Upload(std::vector<int32_t>(static_cast<size_t>(shape.seqs), shape.context));
  std::vector<float> query(static_cast<size_t>(shape.seqs) * kQHeads * kHeadDim);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  for (float& x : query) x = uniform(rng);
  f->query = Upload(query);
  f->out = DeviceAlloc<float>(query.size());

  f->batch.num_seqs = shape.seqs;
  f->batch.num_q_heads = kQHeads;
  f->batch.query_lens = f->query_lens;
  f->batch.context_lens = f->context_lens;
  f->batch.block_tables = f->tables;
  f->batch.max_blocks_per_seq = blocks_per_seq;
  f->batch.scale = 1.0f / std::sqrt(static_cast<float>(kHeadDim));
  f->batch.max_query_len = 1;
  BENCH_CUDA(cudaEventCreate(&f->start));
  BENCH_CUDA(cudaEventCreate(&f->stop));
  BENCH_CUDA(cudaDeviceSynchronize());
  fixture = std::move(f);
  return *fixture;
}

template <typename Body>
void TimeEachIteration(benchmark::State& state, Fixture& f, Body body) {
  body();  // warm-up (first use of the scratch pool, module load)
  BENCH_CUDA(cudaDeviceSynchronize());
  for (auto _ : state) {
    BENCH_CUDA(cudaEventRecord(f.start, nullptr));
    body();
    BENCH_CUDA(cudaEventRecord(f.stop, nullptr));
    BENCH_CUDA(cudaEventSynchronize(f.stop));
    float ms = 0.0f;
    BENCH_CUDA(cudaEventElapsedTime(&ms, f.start, f.stop));
    state.SetIterationTime(ms / 1e3);
  }
  BENCH_CUDA(cudaGetLastError());
}

void GpuCopy(benchmark::State& state, Shape shape) {
  Fixture& f = GetFixture(shape);
  const size_t bytes = static_cast<size_t>(shape.KvBytes());
  TimeEachIteration(state, f, [&] {
    BENCH_CUDA(cudaMemcpyAsync(f.copy_dst, f.pool, bytes, cudaMemcpyDeviceToDevice, nullptr));
  });
  state.counters["units"] = 2.0 * static_cast<double>(bytes);  // read + written
  state.counters["GB/s"] = benchmark::Counter(2.0 * static_cast<double>(bytes),
                                              benchmark::Counter::kIsIterationInvariantRate);
}

void GpuPagedDecode(benchmark::State& state, Shape shape) {
  Fixture& f = GetFixture(shape);
  TimeEachIteration(
      state, f, [&] { kernels::cuda::PagedAttention(f.view, f.batch, f.query, f.out, nullptr); });
  state.counters["units"] = static_cast<double>(shape.KvBytes());
  state.counters["GB/s"] = benchmark::Counter(static_cast<double>(shape.KvBytes()),
                                              benchmark::Counter::kIsIterationInvariantRate);
}

void RegisterAll() {
  std::vector<Shape> shapes;
  for (DType dtype : {DType::kFloat16, DType::kBFloat16, DType::kFloat32}) {
    for (auto [seqs, context] : {std::pair{4, 8192}, std::pair{32, 8192}, std::pair{128, 2048}}) {
      shapes.push_back({dtype, seqs, context, true});
    }
  }
  shapes.push_back({DType::kFloat16, 32, 8192, false});
  for (const Shape& shape : shapes) {
    benchmark::RegisterBenchmark(("GpuCopy/" + shape.Name()).c_str(), GpuCopy, shape)
        ->UseManualTime()
        ->Unit(benchmark::kMicrosecond);
    benchmark::RegisterBenchmark(("GpuPagedDecode/" + shape.Name()).c_str(), GpuPagedDecode, shape)
        ->UseManualTime()
        ->Unit(benchmark::kMicrosecond);
  }
}

}  // namespace
}  // namespace kvcm

int main(int argc, char** argv) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::fprintf(stderr, "paged_attention_gpu_bench: no CUDA device\n");
    return 1;
  }
  cudaDeviceProp prop;
  BENCH_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("paged_attention_gpu_bench: %s, %d SMs\n", prop.name, prop.multiProcessorCount);
  kvcm::RegisterAll();
  kvcm::bench::RatioReporter reporter;
  reporter.AddPair("GpuPagedDecode/", "GpuCopy/", 1.25, "byte");
  return kvcm::bench::RunWithRatios(argc, argv, reporter);
}
