// kvcm-executor: loads a Llama model, maps the cache manager's KV pool and runs the router's
// step batches on it; see services/executor/executor_server.h and docs/executor.md.
//
// Flags are parsed here into the Options of the pieces below (a flag not on the command line
// may come from KVCM_EXECUTOR_<FLAG> or --config FILE: common/config/config.h); nothing below
// main reads flags or the environment. Start-up order: load the model (a bad folder fails
// here, before any connection), start /metrics, register with the cache manager as an
// Executor and attach (the pool's KV shape must be the model's; for a pool in CUDA memory the
// weights are copied to its device, once), connect to the router, serve.
//
// Exit status: 0 after SIGTERM/SIGINT (the step in progress is finished and answered, then
// Goodbye to the router and the cache manager); 1 on a bad command line or a start-up
// failure (model folder, cache manager unreachable, pool shape mismatch, a cuda pool in a
// build without CUDA or weights that do not fit the device), with the reason on stderr.

#include <signal.h>
#include <sys/signalfd.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "common/base/check.h"
#include "common/base/command_line.h"
#include "common/base/log.h"
#include "common/base/run_dir.h"
#include "common/base/status_macros.h"
#include "common/base/termination_signals.h"
#include "common/base/unique_fd.h"
#include "common/config/config.h"
#include "common/metrics/metrics_server.h"
#include "common/model/model_config.h"
#include "kernels/matmul_cpu.h"
#include "services/executor/executor_metrics.h"
#include "services/executor/executor_model.h"
#include "services/executor/executor_pool.h"
#include "services/executor/executor_server.h"
#include "services/executor/executor_service.h"
#include "services/executor/model/llama_model.h"

ABSL_FLAG(std::string, model, "",
          "The model: a Hugging Face folder (config.json and *.safetensors) or a GGUF file. "
          "Required.");
ABSL_FLAG(std::string, run_dir, "",
          "The cache manager's run directory; its requests go to ipc://RUN_DIR/"
          "cache-manager.sock. Default: $XDG_RUNTIME_DIR/kvcm, else /tmp/kvcm-$UID (the cache "
          "manager's default).");
ABSL_FLAG(std::string, cache_manager, "",
          "The cache manager's request endpoint instead of --run-dir, e.g. "
          "tcp://127.0.0.1:5557.");
ABSL_FLAG(std::string, cache_manager_secret_file, "",
          "With a tcp:// --cache-manager: the file holding its secret (the cache manager's "
          "RUN_DIR/tcp-secret, copied with mode 0600); an executor without it is refused.");
ABSL_FLAG(std::string, router, "",
          "The router's executor endpoint. Default: ipc://RUN_DIR/router-executors.sock.");
ABSL_FLAG(std::string, name, "",
          "This executor's name in logs, the cache manager and the router (at most 128 "
          "bytes). Default: executor-PID.");
ABSL_FLAG(int32_t, threads, 0,
          "Threads for the forward pass, this one included; 0 = one per CPU this process may "
          "run on (kvcm-launch gives each executor its share). Results do not depend on it.");
ABSL_FLAG(std::string, matmul, "int8",
          "On a shm pool: how the quantized weight matrices multiply. int8 (default): the "
          "activations quantized to 8 bits per group, integer dot products (as llama.cpp); "
          "int8x2: the same products on the 8-bit codes and again on their rounding "
          "residuals (about 15 bits per group: transformers' greedy tokens on the reference "
          "prompts, slower than int8, faster than fp32); fp32: the weights dequantized, fp32 "
          "products (the reference, slowest). fp32 matrices take fp32 either way.");
ABSL_FLAG(std::string, metrics_address, "127.0.0.1:9401",
          "HOST:PORT serving /metrics (port 0 picks a free one; it is logged).");
ABSL_FLAG(int32_t, call_timeout_ms, 2000,
          "Longest wait for one cache-manager reply (attach, goodbye). The socket thread "
          "blocks for it when the cache manager hangs.");
ABSL_FLAG(std::string, cuda_weight_dtype, "bf16",
          "On a cuda pool: the dtype the weight matrices are kept and multiplied in on the "
          "device. bf16 (default) or fp16: cuBLAS on tensor cores, activations rounded to it, "
          "fp32 accumulation; fp32: twice the memory, the CPU's logits within fp32 rounding.");
ABSL_FLAG(int32_t, fault_layer_delay_ms, 0,
          "Fault tests only: sleep this long after each layer of every step, so that a step "
          "is still writing the pool seconds after it began. 0 (default) in service.");

namespace kvcm::executor {
namespace {

constexpr char kComponent[] = "kvcm-executor";
void Log(std::string_view text) { LogLine(kComponent, text); }

// The folder's last component, or the GGUF file's name without ".gguf" (as the router's
// ModelMetadata names it): "models/tiny/" -> "tiny", "m/SmolLM2.Q4_1.gguf" -> "SmolLM2.Q4_1".
std::string ModelName(const std::string& folder) {
  std::string path(absl::StripSuffix(folder, "/"));
  const size_t slash = path.rfind('/');
  if (slash != std::string::npos) path = path.substr(slash + 1);
  return std::string(absl::StripSuffix(path, ".gguf"));
}

// The flags' values that need checking beyond their types: --model given, --run-dir or
// --cache-manager, non-negative counts, --matmul and --cuda-weight-dtype known. INVALID_ARGUMENT
// naming the flag.
absl::Status CheckFlags() {
  if (absl::GetFlag(FLAGS_model).empty()) {
    return absl::InvalidArgumentError("--model (a folder or a GGUF file) is required");
  }
  if (!absl::GetFlag(FLAGS_run_dir).empty() && !absl::GetFlag(FLAGS_cache_manager).empty()) {
    return absl::InvalidArgumentError("give --run-dir or --cache-manager, not both");
  }
  if (absl::GetFlag(FLAGS_fault_layer_delay_ms) < 0) {
    return absl::InvalidArgumentError("--fault-layer-delay-ms must be >= 0");
  }
  if (absl::GetFlag(FLAGS_threads) < 0) {
    return absl::InvalidArgumentError("--threads must be >= 0");
  }
  kernels::MatMulPath matmul_path;
  if (!kernels::ParseMatMulPath(absl::GetFlag(FLAGS_matmul), &matmul_path)) {
    return absl::InvalidArgumentError(absl::StrCat("--matmul must be int8, int8x2 or fp32, got \"",
                                                   absl::GetFlag(FLAGS_matmul), "\""));
  }
  const absl::StatusOr<DType> dtype = ParseDType(absl::GetFlag(FLAGS_cuda_weight_dtype));
  if (!dtype.ok() ||
      (*dtype != DType::kBFloat16 && *dtype != DType::kFloat16 && *dtype != DType::kFloat32)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--cuda-weight-dtype must be bf16, fp16 or fp32, got \"",
                     absl::GetFlag(FLAGS_cuda_weight_dtype), "\""));
  }
  return absl::OkStatus();
}

// Where this executor finds its peers, and its name, from the flags (after CheckFlags).
struct Peers {
  std::string cache_manager;  // the cache manager's request endpoint
  std::string router;         // the router's executor endpoint
  std::string name;
};

Peers PeersFromFlags() {
  const std::string run_dir = std::string(absl::StripSuffix(absl::GetFlag(FLAGS_run_dir).empty()
                                                                ? DefaultRunDirFromEnvironment()
                                                                : absl::GetFlag(FLAGS_run_dir),
                                                            "/"));
  Peers peers;
  peers.cache_manager = absl::GetFlag(FLAGS_cache_manager).empty()
                            ? IpcEndpointIn(run_dir, kCacheManagerSocket)
                            : absl::GetFlag(FLAGS_cache_manager);
  peers.router = absl::GetFlag(FLAGS_router).empty()
                     ? IpcEndpointIn(run_dir, kRouterExecutorsSocket)
                     : absl::GetFlag(FLAGS_router);
  peers.name = absl::GetFlag(FLAGS_name).empty() ? absl::StrCat("executor-", ::getpid())
                                                 : absl::GetFlag(FLAGS_name);
  return peers;
}

// The service's options: its names, the metrics URL it announces, the fault delay, and the
// tokens that end generation as the router reads them (generation_config.json's too), which
// min_tokens holds back (docs/executor.md, "Sampling").
ExecutorService::Options ServiceOptionsFromFlags(const std::string& name,
                                                 const std::string& metrics_url) {
  const std::string folder = absl::GetFlag(FLAGS_model);
  ExecutorService::Options options;
  options.name = name;
  options.model_name = ModelName(folder);
  options.metrics_url = metrics_url;
  options.pid = static_cast<int32_t>(::getpid());
  options.fault_layer_delay = absl::Milliseconds(absl::GetFlag(FLAGS_fault_layer_delay_ms));
  if (absl::StatusOr<std::vector<int32_t>> ends = ReadEndTokenIds(folder); ends.ok()) {
    options.end_token_ids = *std::move(ends);
  } else {
    Log(absl::StrCat("min_tokens holds back config.json's EOS ids only: ",
                     ends.status().ToString()));
  }
  return options;
}

// Runs the executor: checks the flags, then 1. loads the model, 2. serves its metrics,
// 3. attaches the cache manager's pool, 4. serves the router until a signal or a fatal error.
int Main(const std::vector<config::Setting>& settings) {
  Log(config::Describe(settings, config::ConfigFilePath()));
  // Before any thread starts (the model's workers, ZeroMQ's I/O threads, the metrics
  // server, the heartbeat thread): see common/base/termination_signals.h.
  UniqueFd signal_fd = BlockTerminationSignals();
  if (!signal_fd.valid()) {
    Log("error: cannot create a signalfd");
    return 1;
  }

  auto fail = [](std::string_view what, const absl::Status& status) {
    Log(absl::StrCat("error: ", std::string(what), status.message()));
    return 1;
  };
  if (absl::Status flags = CheckFlags(); !flags.ok()) return fail("", flags);
  const std::string folder = absl::GetFlag(FLAGS_model);
  const Peers peers = PeersFromFlags();
  const std::string& cache_manager = peers.cache_manager;
  const std::string& router = peers.router;
  const std::string& name = peers.name;

  // 1. The model: a bad folder fails here with the loader's message (file, tensor, shape).
  const absl::Time load_start = absl::Now();
  LlamaModelOptions model_options;
  model_options.num_threads = absl::GetFlag(FLAGS_threads);
  KVCM_CHECK(kernels::ParseMatMulPath(absl::GetFlag(FLAGS_matmul), &model_options.matmul));
  absl::StatusOr<std::unique_ptr<LlamaModel>> model = LlamaModel::Load(folder, model_options);
  if (!model.ok()) {
    return fail(absl::StrCat("cannot load the model from ", folder, ": "), model.status());
  }
  const double load_seconds = absl::ToDoubleSeconds(absl::Now() - load_start);
  const LlamaConfig& config = (*model)->config();
  Log(absl::StrCat("loaded ", folder, " in ", absl::FormatDuration(absl::Now() - load_start), ": ",
                   config.ToString()));

  // 2. Metrics.
  ExecutorMetrics::ExecutorInfo info;
  info.model = ModelName(folder);
  info.weight_dtype = config.torch_dtype.empty() ? "unknown" : config.torch_dtype;
  ExecutorMetrics metrics(info);
  config::ExportInfoMetric(*metrics.registry(), "kvcm_executor_config_info", settings,
                           config::ConfigFilePath());
  metrics.ObserveModelLoad(load_seconds);
  auto metrics_server =
      MetricsServer::Start(absl::GetFlag(FLAGS_metrics_address), metrics.registry());
  if (!metrics_server.ok()) return fail("", metrics_server.status());

  // 3. The pool, through the cache manager.
  CacheManagerPool::Options pool_options;
  pool_options.client.endpoint = cache_manager;
  pool_options.client.name = name;
  pool_options.client.secret_file = absl::GetFlag(FLAGS_cache_manager_secret_file);
  pool_options.client.call_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_call_timeout_ms));
  pool_options.model = {config.num_hidden_layers, config.num_key_value_heads, config.head_dim,
                        config.layer_windows};
  LlamaCudaModelOptions cuda_options;
  cuda_options.weight_dtype = *ParseDType(absl::GetFlag(FLAGS_cuda_weight_dtype));
  ExecutorModel executor_model(model->get(), cuda_options);
  pool_options.accept = [&executor_model](const PoolView& view) {
    const bool copied_before = executor_model.cuda() != nullptr;
    const absl::Time start = absl::Now();
    KVCM_RETURN_IF_ERROR(executor_model.Prepare(view));
    if (!copied_before && executor_model.cuda() != nullptr) {
      Log(absl::StrCat("copied the weights to CUDA device ", executor_model.cuda()->device(),
                       " as ", std::string(DTypeName(executor_model.cuda()->weight_dtype())), ": ",
                       executor_model.cuda()->weight_bytes(), " bytes in ",
                       absl::FormatDuration(absl::Now() - start)));
    }
    return absl::OkStatus();
  };
  auto pool = CacheManagerPool::Connect(pool_options, &metrics);
  if (!pool.ok()) {
    return fail(absl::StrCat("cannot use the pool of the cache manager at ", cache_manager, ": "),
                pool.status());
  }
  const PoolView& attached = *(*pool)->pool();

  // 4. The router.
  const ExecutorService::Options service_options =
      ServiceOptionsFromFlags(name, (*metrics_server)->url());
  ExecutorService service(service_options, &executor_model, pool->get(), &metrics);
  ExecutorServer::Options server_options;
  server_options.router_endpoint = router;
  server_options.signal_fd = signal_fd.get();
  auto server = ExecutorServer::Create(server_options, &service, pool->get());
  if (!server.ok()) return fail("", server.status());

  Log(absl::StrCat("ready name=", name, " model=", ModelName(folder),
                   " pool=", std::string(PoolBackendName(attached.backend)), ":",
                   attached.num_blocks, "x", attached.spec.block_size, ":",
                   std::string(DTypeName(attached.spec.dtype)), " epoch=", attached.epoch,
                   " router=", router, " metrics=", (*metrics_server)->url()));
  const absl::Status ran = (*server)->Run();
  server->reset();
  if (!ran.ok()) return fail("", ran);
  return 0;
}

}  // namespace
}  // namespace kvcm::executor

int main(int argc, char** argv) {
  return kvcm::config::RunMain(
      argc, argv,
      {.binary = "kvcm-executor",
       .section = "executor",
       .usage = "runs a Llama model on the cache manager's KV pool for a router.\n"
                "  kvcm-executor --model DIR --run-dir RUN_DIR --router "
                "ipc://RUN_DIR/router-executors.sock",
       .defining_file = __FILE__,
       .run = &kvcm::executor::Main});
}
