// The executor's model alone, on a real GGUF (the bundled SmolLM2 by default), measured as
// llama.cpp's llama-batched-bench measures it, and beside it in the same run when its binary is
// given: for B parallel sequences of PP prompt tokens, one prefill of all B x PP tokens (S_PP,
// prompt tokens/s), then TG decode steps of the B sequences (S_TG, generated tokens/s).
//
//   build/bench/model_bench [--model smollm2|gemma3-270m] [--threads 2] [--pp 128] [--tg 32]
//                           [--busy-rounds 3] [--matmul int8|int8x2|fp32] [--llama-batched-bench
//                           PATH] # PATH: scripts/build-llama-cpp.sh
//
// --model gemma3-270m (scripts/get-model.sh gemma3-270m) is the window model: with --pp past
// 512, its window layers attend to the last 512 positions only, in both engines.
//
// kvcm runs LlamaModel::Forward (--matmul: LlamaModelOptions::matmul, int8 by default, as the
// executor) over an fp16 pool in plain memory (the KV dtype kvcm picks
// for a quantized GGUF; llama.cpp's default cache type is f16 too), B = 1, 8 and 32. The
// ratio printed is kvcm / llama.cpp tokens/s (goal >= 1.0 at B >= 8, docs/PERFORMANCE.md).
//
// Then the busy-neighbour case: the decode step at B = 1 and 8 with a process spinning on
// CPU 0 beside it (as the router, the cache manager or another executor would be on one
// node), against the quiet step, alternated --busy-rounds times, medians printed (goal
// busy <= 1.5x quiet). With --llama-batched-bench, llama.cpp's decode gets the same
// neighbour in the same run.

#include <sched.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "bench/server_stack.h"
#include "common/base/check.h"
#include "common/memory/pool_layout.h"
#include "kernels/matmul_cpu.h"
#include "services/executor/model/llama_model.h"
#include "services/executor/model/sampler.h"
#include "tests/support/real_model.h"
#include "tests/support/subprocess.h"

namespace kvcm {
namespace {

constexpr int32_t kBlockSize = 16;
constexpr int kBatches[] = {1, 8, 32};

struct Rates {
  double prefill = 0;  // prompt tokens/s
  double decode = 0;   // generated tokens/s
};

Rates RunKvcm(const executor::LlamaModel& model, int batch, int pp, int tg) {
  PoolView pool;
  pool.spec = model.config().KvSpec(DType::kFloat16, kBlockSize).value();
  const int32_t blocks_per_seq = (pp + tg + kBlockSize - 1) / kBlockSize;
  pool.layout = PoolLayout::For(pool.spec, batch * blocks_per_seq).value();
  std::vector<uint8_t> memory(static_cast<size_t>(pool.layout.total_bytes));
  pool.base = memory.data();
  const size_t vocab = static_cast<size_t>(model.config().vocab_size);

  std::vector<std::vector<int32_t>> tokens(static_cast<size_t>(batch));
  for (int i = 0; i < batch; ++i) {
    for (int t = 0; t < pp; ++t) {
      // Distinct prompts of ordinary ids (no two sequences alike).
      tokens[static_cast<size_t>(i)].push_back(100 + (t * 31 + i * 97) % 20000);
    }
  }
  auto step = [&](int32_t first) {
    executor::ForwardBatch b;
    b.max_blocks_per_seq = blocks_per_seq;
    for (int i = 0; i < batch; ++i) {
      const auto& seq = tokens[static_cast<size_t>(i)];
      const auto size = static_cast<int32_t>(seq.size());
      b.token_ids.insert(b.token_ids.end(), seq.begin() + first, seq.end());
      b.query_lens.push_back(size - first);
      b.context_lens.push_back(size);
      for (int32_t k = 0; k < blocks_per_seq; ++k) b.block_tables.push_back(i * blocks_per_seq + k);
    }
    std::vector<float> logits;
    const absl::Status ran = model.Forward(b, pool, &logits);
    KVCM_CHECK(ran.ok()) << ran;
    for (int i = 0; i < batch; ++i) {
      tokens[static_cast<size_t>(i)].push_back(
          executor::Greedy({logits.data() + static_cast<size_t>(i) * vocab, vocab}));
    }
  };
  Rates rates;
  absl::Time start = absl::Now();
  step(0);
  rates.prefill = batch * pp / absl::ToDoubleSeconds(absl::Now() - start);
  start = absl::Now();
  for (int t = 1; t < tg; ++t) step(pp + t - 1);
  rates.decode = batch * (tg - 1) / absl::ToDoubleSeconds(absl::Now() - start);
  return rates;
}

// A process spinning on CPU 0 from construction to destruction: the busy neighbour.
class Spinner {
 public:
  Spinner() {
    pid_ = fork();
    KVCM_CHECK(pid_ >= 0) << "fork failed";
    if (pid_ == 0) {
      cpu_set_t cpus;
      CPU_ZERO(&cpus);
      CPU_SET(0, &cpus);
      (void)sched_setaffinity(0, sizeof(cpus), &cpus);
      volatile uint64_t sink = 0;
      for (;;) sink = sink + 1;
    }
  }
  ~Spinner() {
    kill(pid_, SIGKILL);
    int status = 0;
    (void)waitpid(pid_, &status, 0);
  }
  Spinner(const Spinner&) = delete;
  Spinner& operator=(const Spinner&) = delete;

 private:
  pid_t pid_ = -1;
};

double Median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

// This process's resident memory (VmRSS of /proc/self/status) in MB; -1 where unknown.
double ResidentMegabytes() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    absl::string_view rest = line;
    int64_t kb = 0;
    if (absl::ConsumePrefix(&rest, "VmRSS:") &&
        absl::SimpleAtoi(absl::StripSuffix(absl::StripAsciiWhitespace(rest), " kB"), &kb)) {
      return static_cast<double>(kb) / 1024.0;
    }
  }
  return -1;
}

// llama-batched-bench's table: "|  PP |  TG |  B | N_KV | T_PP s | S_PP t/s | T_TG s |
// S_TG t/s | T s | S t/s |", one row per B.
std::map<int, Rates> RunLlamaCpp(const std::string& binary, const std::string& gguf, int threads,
                                 int pp, int tg, const std::string& batches) {
  std::map<int, Rates> out;
  // Room for the largest B's sequences whole (llama.cpp splits -c among the sequences).
  int largest = 1;
  for (absl::string_view b : absl::StrSplit(batches, ',')) {
    int v = 0;
    if (absl::SimpleAtoi(b, &v)) largest = std::max(largest, v);
  }
  const int context = std::max(8192, (largest * (pp + tg) + 255) / 256 * 256);
  absl::StatusOr<testing::RunResult> run = testing::RunProgram({binary,
                                                                "-m",
                                                                gguf,
                                                                "-c",
                                                                std::to_string(context),
                                                                "-b",
                                                                "4096",
                                                                "-ub",
                                                                "512",
                                                                "-npp",
                                                                std::to_string(pp),
                                                                "-ntg",
                                                                std::to_string(tg),
                                                                "-npl",
                                                                batches,
                                                                "-t",
                                                                std::to_string(threads),
                                                                "-tb",
                                                                std::to_string(threads),
                                                                "-ngl",
                                                                "0"},
                                                               "", absl::Minutes(10));
  KVCM_CHECK(run.ok()) << run.status();
  for (absl::string_view line : absl::StrSplit(run->output, '\n')) {
    std::vector<std::string> cells;
    for (absl::string_view cell : absl::StrSplit(line, '|')) {
      cells.emplace_back(absl::StripAsciiWhitespace(cell));
    }
    // "", PP, TG, B, N_KV, T_PP, S_PP, T_TG, S_TG, T, S, ""
    int b = 0;
    double s_pp = 0;
    double s_tg = 0;
    if (cells.size() >= 11 && absl::SimpleAtoi(cells[3], &b) && absl::SimpleAtod(cells[6], &s_pp) &&
        absl::SimpleAtod(cells[8], &s_tg)) {
      out[b] = {s_pp, s_tg};
    }
  }
  if (out.empty()) std::printf("llama-batched-bench printed no table:\n%s\n", run->output.c_str());
  return out;
}

int Main(int argc, char** argv) {
  const int threads = bench::FlagValue(argc, argv, "--threads", 2);
  const int pp = bench::FlagValue(argc, argv, "--pp", 128);
  const int tg = bench::FlagValue(argc, argv, "--tg", 32);
  const std::string llama = bench::FlagString(argc, argv, "--llama-batched-bench", "");
  const std::string which = bench::FlagString(argc, argv, "--model", "smollm2");
  if (which != "smollm2" && which != "gemma3-270m") {
    std::printf("--model must be smollm2 or gemma3-270m, got %s\n", which.c_str());
    return 1;
  }
  const bool gemma = which == "gemma3-270m";
  const std::string gguf = gemma ? testing::Gemma3GgufPath() : testing::SmolLM2GgufPath();
  if (!std::filesystem::exists(gguf)) {
    std::printf("%s\n",
                (gemma ? testing::Gemma3Missing(gguf) : testing::SmolLM2Missing(gguf)).c_str());
    return 1;
  }
  executor::LlamaModelOptions options;
  options.num_threads = threads;
  const std::string matmul = bench::FlagString(argc, argv, "--matmul", "int8");
  if (!kernels::ParseMatMulPath(matmul, &options.matmul)) {
    std::printf("--matmul must be int8, int8x2 or fp32, got %s\n", matmul.c_str());
    return 1;
  }
  absl::StatusOr<std::unique_ptr<executor::LlamaModel>> model =
      executor::LlamaModel::Load(gguf, options);
  KVCM_CHECK(model.ok()) << model.status();
  std::printf("%s, %d thread(s), PP %d, TG %d, %s matmuls\n",
              gemma ? "Gemma 3 270M (Q4_K_M GGUF; 15 of 18 layers within a 512-token window)"
                    : "SmolLM2-135M-Instruct (Q4_1 GGUF)",
              threads, pp, tg, matmul.c_str());
  std::printf("weight matrices %.1f MB; resident after load %.1f MB\n",
              static_cast<double>((*model)->weights().matrix_bytes()) / (1 << 20),
              ResidentMegabytes());
  (void)RunKvcm(**model, 1, 16, 4);  // warm-up
  std::map<int, Rates> kvcm;
  for (int b : kBatches) kvcm[b] = RunKvcm(**model, b, pp, tg);
  std::map<int, Rates> reference;
  if (!llama.empty()) reference = RunLlamaCpp(llama, gguf, threads, pp, tg, "1,8,32");
  std::printf("\n%3s %14s %14s %8s %14s %14s %8s\n", "B", "kvcm S_PP", "llama.cpp", "ratio",
              "kvcm S_TG", "llama.cpp", "ratio");
  for (int b : kBatches) {
    const Rates& k = kvcm[b];
    const auto it = reference.find(b);
    if (it == reference.end()) {
      std::printf("%3d %14.1f %14s %8s %14.1f %14s %8s\n", b, k.prefill, "-", "-", k.decode, "-",
                  "-");
      continue;
    }
    std::printf("%3d %14.1f %14.1f %7.2fx %14.1f %14.1f %7.2fx\n", b, k.prefill, it->second.prefill,
                k.prefill / it->second.prefill, k.decode, it->second.decode,
                k.decode / it->second.decode);
  }

  // The busy neighbour: decode step in ms (B / S_TG), quiet and busy alternated.
  const int rounds = bench::FlagValue(argc, argv, "--busy-rounds", 3);
  if (rounds <= 0) return 0;
  constexpr int kBusyBatches[] = {1, 8};
  std::map<int, std::vector<double>> quiet_ms;
  std::map<int, std::vector<double>> busy_ms;
  std::map<int, std::vector<double>> llama_quiet_ms;
  std::map<int, std::vector<double>> llama_busy_ms;
  auto step_ms = [](int b, double decode) { return 1000.0 * b / decode; };
  for (int round = 0; round < rounds; ++round) {
    for (int b : kBusyBatches) {
      quiet_ms[b].push_back(step_ms(b, RunKvcm(**model, b, pp, tg).decode));
      Spinner spinner;
      busy_ms[b].push_back(step_ms(b, RunKvcm(**model, b, pp, tg).decode));
    }
    if (llama.empty()) continue;
    std::map<int, Rates> quiet = RunLlamaCpp(llama, gguf, threads, pp, tg, "1,8");
    std::map<int, Rates> busy;
    {
      Spinner spinner;
      busy = RunLlamaCpp(llama, gguf, threads, pp, tg, "1,8");
    }
    for (int b : kBusyBatches) {
      if (quiet.count(b) == 0 || busy.count(b) == 0) continue;
      llama_quiet_ms[b].push_back(step_ms(b, quiet[b].decode));
      llama_busy_ms[b].push_back(step_ms(b, busy[b].decode));
    }
  }
  std::printf("\ndecode step with a process spinning on CPU 0 beside it, median of %d rounds\n",
              rounds);
  std::printf("%3s %12s %12s %8s %14s %14s %8s\n", "B", "kvcm quiet", "kvcm busy", "ratio",
              "llama.cpp quiet", "llama.cpp busy", "ratio");
  for (int b : kBusyBatches) {
    const double q = Median(quiet_ms[b]);
    const double k = Median(busy_ms[b]);
    if (llama_quiet_ms[b].empty()) {
      std::printf("%3d %10.2fms %10.2fms %7.2fx %14s %14s %8s\n", b, q, k, k / q, "-", "-", "-");
      continue;
    }
    const double lq = Median(llama_quiet_ms[b]);
    const double lb = Median(llama_busy_ms[b]);
    std::printf("%3d %10.2fms %10.2fms %7.2fx %12.2fms %12.2fms %7.2fx\n", b, q, k, k / q, lq, lb,
                lb / lq);
  }
  return 0;
}

}  // namespace
}  // namespace kvcm

int main(int argc, char** argv) { return kvcm::Main(argc, argv); }
