#pragma once
// Helpers for the tests that run a real kvcm-executor process (executor_process_test.cc):
// start it and parse its ready line, scrape its metrics, read its CPU time, replay a
// driver's steps on a local pool. Test support only.

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <memory>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/base/float16.h"
#include "common/base/run_dir.h"
#include "common/memory/pool_layout.h"
#include "common/sizing/kv_cache_spec.h"
#include "common/wire/executor_codec.h"
#include "services/executor/model/llama_model.h"
#include "services/executor/model/sampler.h"
#include "tests/services/executor/step_driver.h"
#include "tests/support/cache_manager_process.h"
#include "tests/support/http_client.h"
#include "tests/support/metrics_text.h"
#include "tests/support/subprocess.h"

namespace kvcm::testing {

// A real kvcm-executor with its ready line parsed:
//   kvcm-executor: ready name=N model=M pool=shm:256x4:fp32 epoch=E router=R metrics=URL
struct ExecutorProcess {
  std::unique_ptr<TempDir> log_dir;  // holds the output file; removed after the process
  std::unique_ptr<Subprocess> process;
  std::string name;
  uint64_t epoch = 0;
  std::string metrics_url;

  std::string Output() const { return process->Output(); }
};

struct ExecutorArgs {
  std::string model;
  std::string run_dir;
  std::string router;
  std::string name = "exec-test";
  int32_t threads = 2;
  std::vector<std::string> extra;
};

inline std::vector<std::string> ExecutorArgv(const ExecutorArgs& args) {
  std::vector<std::string> argv = {KvcmBinaryPath("kvcm-executor"),
                                   "--model",
                                   args.model,
                                   "--run-dir",
                                   args.run_dir,
                                   "--router",
                                   args.router,
                                   "--name",
                                   args.name,
                                   "--threads",
                                   absl::StrCat(args.threads),
                                   "--metrics-address",
                                   "127.0.0.1:0"};
  argv.insert(argv.end(), args.extra.begin(), args.extra.end());
  return argv;
}

// Starts the executor and waits for its ready line. Errors: WaitForLine's (with the
// output's tail when it exits first).
inline absl::StatusOr<ExecutorProcess> StartExecutor(const ExecutorArgs& args,
                                                     absl::Duration timeout = absl::Seconds(60)) {
  ExecutorProcess executor;
  absl::StatusOr<TempDir> log_dir = TempDir::Create("kvcm-ex-log");
  if (!log_dir.ok()) return log_dir.status();
  Subprocess::Options options;
  options.argv = ExecutorArgv(args);
  options.output_path = log_dir->path() + "/output";
  executor.log_dir = std::make_unique<TempDir>(std::move(*log_dir));
  absl::StatusOr<std::unique_ptr<Subprocess>> process = Subprocess::Start(options);
  if (!process.ok()) return process.status();
  executor.process = std::move(*process);
  absl::StatusOr<std::vector<std::string>> ready = executor.process->WaitForLine(
      R"(kvcm-executor: ready name=(\S+) model=(\S+) pool=(\S+) epoch=([0-9]+) router=(\S+) )"
      R"(metrics=(\S+))",
      absl::Now() + timeout);
  if (!ready.ok()) return ready.status();
  executor.name = (*ready)[1];
  if (!absl::SimpleAtoi((*ready)[4], &executor.epoch)) {
    return absl::InternalError(absl::StrCat("bad epoch in ", (*ready)[0]));
  }
  executor.metrics_url = (*ready)[6];
  return executor;
}

// Writes a tiny random Llama model (weights from `seed`) into `output` with the
// kvcm-make-tiny-model binary. INTERNAL with its output when it fails.
inline absl::Status MakeTinyModel(const std::string& output, uint64_t seed) {
  absl::StatusOr<RunResult> made = RunProgram(
      {KvcmBinaryPath("kvcm-make-tiny-model"), "--output", output, "--seed", absl::StrCat(seed)},
      "", absl::Seconds(60));
  if (!made.ok()) return made.status();
  if (made->exit_code != 0) {
    return absl::InternalError(
        absl::StrCat("kvcm-make-tiny-model exited ", made->exit_code, ": ", made->output));
  }
  return absl::OkStatus();
}

// Three prompts of 5, 11 and 17 byte-level tokens ("Hello", "The quick ", "I am a small
// tes"), for the generation tests.
inline const std::vector<std::vector<int32_t>>& TestPrompts() {
  static const auto* prompts = new std::vector<std::vector<int32_t>>{
      {1, 72, 101, 108, 108},
      {1, 84, 104, 101, 32, 113, 117, 105, 99, 107, 32},
      {1, 40, 32, 97, 109, 32, 97, 32, 115, 109, 97, 108, 108, 32, 116, 101, 115},
  };
  return *prompts;
}

// What the executor process tests run: a cache manager, the scripted driver bound on the
// router's socket, and an executor registered with both.
struct ExecutorStack {
  std::unique_ptr<CacheManagerProcess> cm;
  std::optional<TempDir> sockets;  // holds the router socket
  std::string router;
  std::unique_ptr<StepDriver> driver;
  ExecutorProcess executor;
  ExecutorHello hello;  // what the executor announced
};

// Starts the stack with the model in `model_dir` and waits for the executor's Hello;
// `executor_extra` goes to the executor's command line.
inline absl::Status StartExecutorStack(const std::string& model_dir,
                                       const CacheManagerOptions& manager_options,
                                       ExecutorStack* stack,
                                       std::vector<std::string> executor_extra = {}) {
  absl::StatusOr<std::unique_ptr<CacheManagerProcess>> cm =
      CacheManagerProcess::Start(manager_options);
  if (!cm.ok()) return cm.status();
  stack->cm = std::move(*cm);
  absl::StatusOr<TempDir> sockets = TempDir::Create("kvcm-rt");
  if (!sockets.ok()) return sockets.status();
  stack->sockets.emplace(std::move(*sockets));
  stack->router = IpcEndpointIn(stack->sockets->path(), kRouterExecutorsSocket);
  StepDriver::Options driver_options;
  driver_options.router_endpoint = stack->router;
  driver_options.cache_manager_endpoint = stack->cm->endpoint();
  driver_options.heartbeat_interval_ms = 200;
  absl::StatusOr<std::unique_ptr<StepDriver>> driver = StepDriver::Start(driver_options);
  if (!driver.ok()) return driver.status();
  stack->driver = std::move(*driver);
  ExecutorArgs args;
  args.model = model_dir;
  args.run_dir = stack->cm->run_dir();
  args.router = stack->router;
  args.extra = std::move(executor_extra);
  absl::StatusOr<ExecutorProcess> executor = StartExecutor(args);
  if (!executor.ok()) return executor.status();
  stack->executor = std::move(*executor);
  absl::StatusOr<ExecutorHello> hello = stack->driver->AwaitHello(absl::Now() + absl::Seconds(30));
  if (!hello.ok()) {
    return absl::Status(hello.status().code(),
                        absl::StrCat(hello.status().message(), "\n", stack->executor.Output()));
  }
  stack->hello = std::move(*hello);
  return absl::OkStatus();
}

// One stored K/V element of `dtype` (fp32, fp16 or bf16) at `p`, as a float.
inline float KvElementAsFloat(const uint8_t* p, DType dtype) {
  if (dtype == DType::kFloat32) {
    float f;
    std::memcpy(&f, p, sizeof(f));
    return f;
  }
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return dtype == DType::kFloat16 ? FloatFromHalf(bits) : FloatFromBFloat16(bits);
}

// Calls fn(offset) with the byte offset of every (layer, K|V, KV head) vector a sequence has
// written: positions [0, num_positions) in the blocks of its table `blocks`.
template <typename Fn>
void ForEachWrittenKvVector(const PoolLayout& layout, const KvCacheSpec& spec,
                            std::span<const int32_t> blocks, int32_t num_positions, Fn fn) {
  for (int32_t p = 0; p < num_positions; ++p) {
    const int32_t block = blocks[static_cast<size_t>(p / spec.block_size)];
    for (int32_t layer = 0; layer < spec.num_layers; ++layer) {
      for (int32_t kv = 0; kv < 2; ++kv) {
        for (int32_t head = 0; head < spec.num_kv_heads; ++head) {
          fn(layout.Offset(layer, kv, block, p % spec.block_size, head));
        }
      }
    }
  }
}

// The worst |got - want| / max(1, |want|) over the head_dim elements of the K/V vector at
// `offset` of two pools of the same layout.
inline double WorstKvVectorError(const uint8_t* got, const uint8_t* want, int64_t offset,
                                 const PoolLayout& layout, const KvCacheSpec& spec) {
  double worst = 0;
  for (int32_t d = 0; d < spec.head_dim; ++d) {
    const int64_t at = offset + int64_t{d} * layout.elem_bytes;
    const double w = KvElementAsFloat(want + at, spec.dtype);
    const double g = KvElementAsFloat(got + at, spec.dtype);
    worst = std::max(worst, std::abs(g - w) / std::max(1.0, std::abs(w)));
  }
  return worst;
}

// Greedy generation of `n` tokens after `tokens` with the contiguous reference forward.
inline std::vector<int32_t> ReferenceGreedy(const executor::LlamaModel& model,
                                            std::vector<int32_t> tokens, int32_t n) {
  std::vector<int32_t> out;
  const size_t vocab = static_cast<size_t>(model.config().vocab_size);
  for (int32_t i = 0; i < n; ++i) {
    absl::StatusOr<std::vector<float>> logits = model.ForwardContiguous(tokens);
    if (!logits.ok()) return {};
    out.push_back(
        executor::Greedy(std::span<const float>(logits->data() + logits->size() - vocab, vocab)));
    tokens.push_back(out.back());
  }
  return out;
}

// `tokens` up to and including the first of `eos` (all of them if none is there): what the
// router answers of a greedy generation.
inline std::vector<int32_t> CutAfterEos(std::vector<int32_t> tokens,
                                        const std::vector<int32_t>& eos) {
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (std::find(eos.begin(), eos.end(), tokens[i]) != eos.end()) {
      tokens.resize(i + 1);
      break;
    }
  }
  return tokens;
}

// What the router answers of `n` greedy tokens after the prompt ids `prompt`: the model's
// own greedy tokens, cut after an end-of-sequence id.
inline std::vector<int32_t> ReferenceAnswer(const executor::LlamaModel& model,
                                            std::vector<int32_t> prompt, int32_t n) {
  return CutAfterEos(ReferenceGreedy(model, std::move(prompt), n), model.config().eos_token_ids);
}

// The executor's /metrics, parsed.
inline absl::StatusOr<MetricsText> ScrapeMetrics(const std::string& url) {
  absl::StatusOr<HttpResponse> response = HttpGet(url);
  if (!response.ok()) return response.status();
  if (response->status != 200) {
    return absl::InternalError(absl::StrCat("GET ", url, ": HTTP ", response->status));
  }
  return ParseMetricsText(response->body);
}

// utime + stime of `pid`, in clock ticks (/proc/PID/stat fields 14 and 15).
inline int64_t CpuTicks(pid_t pid) {
  std::ifstream file(absl::StrCat("/proc/", pid, "/stat"));
  std::stringstream text;
  text << file.rdbuf();
  const std::string stat = text.str();
  // The command name (field 2) is in parentheses and may hold spaces: split after it.
  const size_t close = stat.rfind(')');
  if (close == std::string::npos) return -1;
  const std::vector<std::string> fields =
      absl::StrSplit(stat.substr(close + 2), ' ', absl::SkipEmpty());
  // fields[0] is field 3 (state); utime is field 14 -> index 11, stime index 12.
  int64_t utime = 0;
  int64_t stime = 0;
  if (fields.size() < 13 || !absl::SimpleAtoi(fields[11], &utime) ||
      !absl::SimpleAtoi(fields[12], &stime)) {
    return -1;
  }
  return utime + stime;
}

// Replays `steps` (as a StepDriver sent them) on a local pool with LlamaModel::Forward:
// the same tokens, positions and block tables, batched the same way.
inline absl::Status ReplaySteps(const executor::LlamaModel& model,
                                const std::vector<StepBatch>& steps, const PoolView& pool) {
  std::vector<float> logits;
  for (const StepBatch& step : steps) {
    executor::ForwardBatch batch;
    size_t max_blocks = 1;
    for (const SeqWork& s : step.seqs) max_blocks = std::max(max_blocks, s.block_table.size());
    batch.max_blocks_per_seq = static_cast<int32_t>(max_blocks);
    batch.block_tables.assign(step.seqs.size() * max_blocks, 0);
    for (size_t i = 0; i < step.seqs.size(); ++i) {
      const SeqWork& s = step.seqs[i];
      batch.token_ids.insert(batch.token_ids.end(), s.tokens.begin(), s.tokens.end());
      batch.query_lens.push_back(static_cast<int32_t>(s.tokens.size()));
      batch.context_lens.push_back(s.context_len);
      std::copy(s.block_table.begin(), s.block_table.end(),
                batch.block_tables.begin() + static_cast<std::ptrdiff_t>(i * max_blocks));
    }
    if (absl::Status ran = model.Forward(batch, pool, &logits); !ran.ok()) return ran;
  }
  return absl::OkStatus();
}

}  // namespace kvcm::testing
