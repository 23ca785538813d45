// kvcm-cache-manager: owns the KV block pool and the block ledger; see
// services/cache_manager/cache_manager_server.h and docs/operations.md.
//
// Flags are parsed here into the Options of the pieces below (a flag not on the command line
// may come from KVCM_CACHE_MANAGER_<FLAG> or --config FILE: common/config/config.h); nothing
// below main reads flags or the environment. Exit status: 0 after SIGTERM/SIGINT; 1 on a bad
// command line or a start-up or run failure (already running, port in use, no CUDA device),
// with the reason on stderr.

#include <signal.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/usage.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/base/command_line.h"
#include "common/base/log.h"
#include "common/base/status_macros.h"
#include "common/base/termination_signals.h"
#include "common/base/unique_fd.h"
#include "common/block/block_hash.h"
#include "common/config/config.h"
#include "common/memory/pool_memory.h"
#include "common/metrics/metrics_server.h"
#include "common/model/model_config.h"
#include "common/sizing/byte_size.h"
#include "common/sizing/kv_cache_groups.h"
#include "common/sizing/model_config.h"
#include "common/sizing/pool_plan.h"
#include "common/transport/accept_guard.h"
#include "common/transport/descriptor_limit.h"
#include "common/transport/tcp_endpoint.h"
#include "services/cache_manager/cache_manager_metrics.h"
#include "services/cache_manager/cache_manager_server.h"
#include "services/cache_manager/run_directory.h"

ABSL_FLAG(std::string, run_dir, "",
          "Directory for the sockets and the lock (mode 0700). Default: $XDG_RUNTIME_DIR/kvcm, "
          "else /tmp/kvcm-$UID.");
ABSL_FLAG(std::string, backend, "auto",
          "Pool memory: auto (cuda when a device exists, else shm), shm (memfd shared over a "
          "Unix socket) or cuda (cudaMalloc shared with CUDA IPC handles).");
ABSL_FLAG(int32_t, cuda_device, 0, "CUDA device of the pool (cuda backend).");
ABSL_FLAG(int32_t, block_size, 16, "Tokens per KV block.");
ABSL_FLAG(int32_t, layers, 0, "KV shape: transformer layers (or --model-config).");
ABSL_FLAG(int32_t, kv_heads, 0, "KV shape: KV heads per layer (or --model-config).");
ABSL_FLAG(int32_t, head_dim, 0, "KV shape: elements per head (or --model-config).");
ABSL_FLAG(std::string, dtype, "",
          "KV element type: fp32, fp16, bf16, fp8_e4m3, fp8_e5m2. Default: bf16, or the "
          "model config's torch_dtype.");
ABSL_FLAG(std::string, model_config, "",
          "The model whose KV shape the pool holds, instead of --layers/--kv-heads/--head-dim: "
          "a Hugging Face config.json, a model folder (its config.json) or a GGUF file.");
ABSL_FLAG(int64_t, num_blocks, 0, "Pool size as a block count (one of three sizing flags).");
ABSL_FLAG(std::string, pool_bytes, "",
          "Pool size as a byte budget, e.g. 24GiB (one of three sizing flags).");
ABSL_FLAG(double, memory_fraction, 0,
          "Pool size as a fraction of free memory (device memory for cuda, MemAvailable for "
          "shm), minus a 10% margin (one of three sizing flags).");
ABSL_FLAG(std::string, metrics_address, "127.0.0.1:9400",
          "HOST:PORT serving /metrics (port 0 picks a free one; it is logged).");
ABSL_FLAG(std::string, tcp_address, "",
          "Also accept requests on this tcp:// endpoint, e.g. tcp://127.0.0.1:5557. Clients "
          "over tcp cannot be watched by pid: only heartbeats detect their failure. Loopback "
          "addresses only, unless --tcp-allow-remote.");
ABSL_FLAG(bool, tcp_allow_remote, false,
          "Let --tcp-address name a non-loopback address (reachable from other machines).");
ABSL_FLAG(int32_t, heartbeat_interval_ms, 1000, "How often clients must heartbeat.");
ABSL_FLAG(int32_t, heartbeat_timeout_ms, 5000,
          "Silence after which a client's session is quarantined.");
ABSL_FLAG(std::string, hash_algorithm, "xxh3_v2",
          "Block hash announced to clients: xxh3_v2 (fast; every client trusted), xxh3 (its "
          "version-1 message, for clients that do not know xxh3_v2), sha256 "
          "(collision-resistant; for clients that are not all trusted), sha256_cbor (vLLM's "
          "own, byte for byte: docs/cluster.md) or fast128.");
ABSL_FLAG(int32_t, sliding_window_tokens, -1,
          "Release a sequence's blocks that lie wholly behind a sliding attention window of "
          "this many tokens; 0 keeps every block, in one table. Default (-1): from "
          "--model-config: KV cache groups when its layers are of more than one attention "
          "type (full, or each window size): a block table per group, each window group "
          "releasing what its window passed (docs/operations.md); else the window when every "
          "layer has one; else 0. Executors whose layers do not all attend within it refuse "
          "the pool.");
ABSL_FLAG(int32_t, max_pinned_blocks, 0, "Most blocks named pins may hold; 0 = half the pool.");
ABSL_FLAG(int32_t, max_ops_per_step, 4096, "Most operations in one Step message.");
ABSL_FLAG(int64_t, max_message_bytes, 16 << 20,
          "Largest request, and largest reply a Step may need, in bytes (64 KiB to 1 GiB); "
          "larger are refused as oversized.");
ABSL_FLAG(int32_t, max_hashes_per_message, 1 << 16,
          "Most block hashes in one message (a Step's commits, a prefix request).");
ABSL_FLAG(int32_t, max_sessions, 4096, "Most sessions open at once; more Hellos are refused.");
ABSL_FLAG(int32_t, max_sessions_per_process, 64, "Most sessions one client process may hold open.");
ABSL_FLAG(int32_t, max_sequences_per_session, 1 << 20,
          "Most live sequences one session may hold; Steps allocating more are refused.");
ABSL_FLAG(int32_t, hello_timeout_ms, 10000,
          "A connection that sends nothing this long after it was accepted is closed (it "
          "holds a descriptor and is no client: clients say Hello at once); 0: never.");
ABSL_FLAG(std::string, kv_events_endpoint, "",
          "Also publish KV events in vLLM's format (for NVIDIA Dynamo's KV router, llm-d) on "
          "a PUB bound here, e.g. tcp://127.0.0.1:5557 (port 0 picks a free one; it is "
          "logged); empty: off. docs/cluster.md.");
ABSL_FLAG(std::string, kv_events_replay_endpoint, "",
          "With --kv-events-endpoint: a ROUTER bound here replays buffered batches to a "
          "subscriber that asks, e.g. tcp://127.0.0.1:5558 (port 0: any free one); empty: "
          "no replay.");
ABSL_FLAG(std::string, kv_events_topic, "",
          "First frame of every vLLM-format event batch. Default: kv@<host name>@<model>, the "
          "model the --model-config file's name (or \"kvcm\").");
ABSL_FLAG(int32_t, kv_events_buffer_steps, 10000,
          "vLLM-format event batches kept for replay (the start's AllBlocksCleared is kept "
          "besides).");
ABSL_FLAG(bool, kv_events_allow_remote, false,
          "Let the --kv-events endpoints name a non-loopback address (reachable from other "
          "machines, as a cluster router on another host needs).");
ABSL_FLAG(std::string, host_tier_bytes, "",
          "Host-memory tier (T1) below the pool, e.g. 8GiB: every block the pool caches is "
          "written through to it, and a prompt whose prefix it holds is loaded back instead "
          "of computed. Empty or 0: off. docs/architecture.md, \"Tiers\".");
ABSL_FLAG(std::string, disk_tier_dir, "",
          "Disk tier (T2): a directory of preallocated slot files, kept across restarts and "
          "verified at every read (the model's bytes, the KV layout, a checksum). One cache "
          "manager per directory. Needs --disk-tier-bytes and --model-config. Empty: off.");
ABSL_FLAG(std::string, disk_tier_bytes, "", "The disk tier's capacity, e.g. 100GiB.");
ABSL_FLAG(int32_t, tier_mover_threads, 1,
          "Threads copying blocks between the pool and the tiers (never the socket thread).");
ABSL_FLAG(int32_t, tier_load_timeout_ms, 2000,
          "A request waits at most this long for its prefix to load from a tier; past it, "
          "what did not arrive is computed.");
ABSL_FLAG(bool, disk_tier_direct_io, true,
          "Read and write the disk tier with O_DIRECT where the file system allows it.");
ABSL_FLAG(int32_t, disk_tier_read_depth, 8,
          "Disk-tier reads each mover thread keeps in flight (1 to 64, io_uring): the disk "
          "reads a prompt's next blocks while the mover verifies and copies one. 1: one at a "
          "time. Where the kernel refuses io_uring (a container's seccomp filter), one at a "
          "time, logged once.");
ABSL_FLAG(int32_t, disk_tier_sync_ms, 1000,
          "At most this often, fdatasync the disk tier's files when blocks were written since "
          "the last sync (a mover thread does it): a block survives a crash of the machine "
          "this long after its write. 0: after every write.");

namespace kvcm::cache_manager {
namespace {

constexpr char kComponent[] = "kvcm-cache-manager";
void Log(std::string_view text) { LogLine(kComponent, text); }

absl::StatusOr<KvCacheSpec> SpecFromFlags() {
  const int32_t block_size = absl::GetFlag(FLAGS_block_size);
  std::optional<DType> dtype;
  if (!absl::GetFlag(FLAGS_dtype).empty()) {
    auto parsed = ParseDType(absl::GetFlag(FLAGS_dtype));
    if (!parsed.ok()) return parsed.status();
    dtype = *parsed;
  }
  if (!absl::GetFlag(FLAGS_model_config).empty()) {
    if (absl::GetFlag(FLAGS_layers) != 0 || absl::GetFlag(FLAGS_kv_heads) != 0 ||
        absl::GetFlag(FLAGS_head_dim) != 0) {
      return absl::InvalidArgumentError(
          "give either --model-config or --layers/--kv-heads/--head-dim, not both");
    }
    std::vector<std::string> notes;
    auto spec = SpecFromModelPath(absl::GetFlag(FLAGS_model_config), block_size, dtype, &notes);
    if (spec.ok()) {
      for (const std::string& note : notes) Log(absl::StrCat("model config: ", note));
    }
    return spec;
  }
  KvCacheSpec spec;
  spec.num_layers = absl::GetFlag(FLAGS_layers);
  spec.num_kv_heads = absl::GetFlag(FLAGS_kv_heads);
  spec.head_dim = absl::GetFlag(FLAGS_head_dim);
  spec.block_size = block_size;
  spec.dtype = dtype.value_or(DType::kBFloat16);
  if (spec.num_layers == 0 || spec.num_kv_heads == 0 || spec.head_dim == 0) {
    return absl::InvalidArgumentError(
        "the KV shape is needed: --layers, --kv-heads and --head-dim, or --model-config");
  }
  if (absl::Status valid = spec.Validate(); !valid.ok()) return valid;
  return spec;
}

// Picks the backend: an explicit cuda without a device is an error, auto falls back.
absl::StatusOr<PoolBackend> ChooseBackend() {
  const std::string name = absl::GetFlag(FLAGS_backend);
  if (name == "auto") {
    auto devices = CudaDeviceCount();
    if (devices.ok() && *devices > absl::GetFlag(FLAGS_cuda_device)) return PoolBackend::kCuda;
    Log(absl::StrCat(
        "backend auto: using shm (",
        devices.ok() ? std::string("no such CUDA device") : std::string(devices.status().message()),
        ")"));
    return PoolBackend::kShm;
  }
  auto backend = ParsePoolBackend(name);
  if (!backend.ok()) return backend.status();
  if (*backend == PoolBackend::kCuda) {
    auto devices = CudaDeviceCount();
    if (!devices.ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat("--backend cuda needs a CUDA device: ", devices.status().message()));
    }
    if (*devices <= absl::GetFlag(FLAGS_cuda_device)) {
      return absl::FailedPreconditionError(
          absl::StrCat("--cuda-device ", absl::GetFlag(FLAGS_cuda_device), " does not exist (",
                       *devices, " device(s))"));
    }
  }
  return *backend;
}

// The tiers' flags, checked (tiers::CheckTierOptions) before anything is acquired.
absl::StatusOr<tiers::TierOptions> TierOptionsFromFlags() {
  tiers::TierOptions options;
  const auto bytes = [](const char* flag, const std::string& value) -> absl::StatusOr<uint64_t> {
    if (value.empty() || value == "0") return 0;
    absl::StatusOr<int64_t> parsed = ParseByteSize(value);
    if (!parsed.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(flag, ": ", parsed.status().message()));
    }
    return static_cast<uint64_t>(*parsed);
  };
  absl::StatusOr<uint64_t> host = bytes("--host-tier-bytes", absl::GetFlag(FLAGS_host_tier_bytes));
  if (!host.ok()) return host.status();
  absl::StatusOr<uint64_t> disk = bytes("--disk-tier-bytes", absl::GetFlag(FLAGS_disk_tier_bytes));
  if (!disk.ok()) return disk.status();
  options.host_bytes = *host;
  options.disk_bytes = *disk;
  options.disk_dir = absl::GetFlag(FLAGS_disk_tier_dir);
  options.model_path = absl::GetFlag(FLAGS_model_config);
  options.mover_threads = absl::GetFlag(FLAGS_tier_mover_threads);
  options.load_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_tier_load_timeout_ms));
  options.direct_io = absl::GetFlag(FLAGS_disk_tier_direct_io);
  options.disk_read_depth = absl::GetFlag(FLAGS_disk_tier_read_depth);
  options.disk_sync_interval = absl::Milliseconds(absl::GetFlag(FLAGS_disk_tier_sync_ms));
  if (absl::Status checked = tiers::CheckTierOptions(options); !checked.ok()) return checked;
  return options;
}

absl::StatusOr<PoolBudget> BudgetFromFlags(PoolBackend backend) {
  const int64_t num_blocks = absl::GetFlag(FLAGS_num_blocks);
  const std::string pool_bytes = absl::GetFlag(FLAGS_pool_bytes);
  const double fraction = absl::GetFlag(FLAGS_memory_fraction);
  if (FlagGiven("num_blocks") && num_blocks <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--num-blocks ", num_blocks,
                     ": a pool needs at least one block (or size it with "
                     "--pool-bytes or --memory-fraction instead)"));
  }
  if (FlagGiven("memory_fraction") && !(fraction > 0 && fraction <= 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--memory-fraction ", fraction, ": give a fraction of free memory in (0, 1]"));
  }
  const int given = (num_blocks != 0) + !pool_bytes.empty() + (fraction != 0);
  if (given != 1) {
    return absl::InvalidArgumentError(
        "give exactly one of --num-blocks, --pool-bytes and --memory-fraction");
  }
  if (num_blocks != 0) return PoolBudget::Blocks(num_blocks);
  if (!pool_bytes.empty()) {
    auto bytes = ParseByteSize(pool_bytes);
    if (!bytes.ok()) return bytes.status();
    return PoolBudget::Bytes(*bytes);
  }
  int64_t free_bytes = 0;
  if (backend == PoolBackend::kCuda) {
    auto info = CudaMemoryInfo(absl::GetFlag(FLAGS_cuda_device));
    if (!info.ok()) return info.status();
    free_bytes = static_cast<int64_t>(info->first);
  } else {
    auto available = AvailableHostMemoryBytes();
    if (!available.ok()) return available.status();
    free_bytes = static_cast<int64_t>(*available);
  }
  return PoolBudget::FractionOfFree(free_bytes, fraction);
}

// The vLLM-format event stream's options from the flags; nullopt when it is off.
absl::StatusOr<std::optional<VllmEventPublisher::Options>> VllmEventsFromFlags() {
  const std::string endpoint = absl::GetFlag(FLAGS_kv_events_endpoint);
  const std::string replay = absl::GetFlag(FLAGS_kv_events_replay_endpoint);
  if (endpoint.empty()) {
    if (!replay.empty()) {
      return absl::InvalidArgumentError("--kv-events-replay-endpoint needs --kv-events-endpoint");
    }
    return std::nullopt;
  }
  const bool allow_remote = absl::GetFlag(FLAGS_kv_events_allow_remote);
  VllmEventPublisher::Options options;
  auto pub = CheckTcpEndpoint(endpoint, "--kv-events-endpoint", allow_remote);
  if (!pub.ok()) return pub.status();
  options.endpoint = pub->BindEndpoint();
  if (!replay.empty()) {
    auto router = CheckTcpEndpoint(replay, "--kv-events-replay-endpoint", allow_remote);
    if (!router.ok()) return router.status();
    if (router->port != 0 && router->port == pub->port && router->host == pub->host) {
      return absl::InvalidArgumentError(
          "--kv-events-endpoint and --kv-events-replay-endpoint must differ");
    }
    options.replay_endpoint = router->BindEndpoint();
  }
  options.buffer_steps = absl::GetFlag(FLAGS_kv_events_buffer_steps);
  if (options.buffer_steps < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--kv-events-buffer-steps ", options.buffer_steps, ": keep at least one batch"));
  }
  options.topic = absl::GetFlag(FLAGS_kv_events_topic);
  if (options.topic.empty()) {
    char host[256] = {};
    if (::gethostname(host, sizeof(host) - 1) != 0 || host[0] == '\0') {
      std::snprintf(host, sizeof(host), "localhost");
    }
    std::string model = "kvcm";
    if (const std::string path = absl::GetFlag(FLAGS_model_config); !path.empty()) {
      std::string name = std::filesystem::path(path).filename().string();
      if (name == "config.json") {
        name = std::filesystem::path(path).parent_path().filename().string();
      } else if (const size_t dot = name.rfind('.'); dot != std::string::npos && dot > 0) {
        name.resize(dot);
      }
      if (!name.empty()) model = name;
    }
    options.topic = absl::StrCat("kv@", host, "@", model);
  }
  return options;
}

// --sliding-window-tokens, checked against --model-config's layers when both are given: a
// window that some layer reads beyond would release blocks it still needs.
absl::StatusOr<int32_t> SlidingWindowFromFlags() {
  const int32_t flag = absl::GetFlag(FLAGS_sliding_window_tokens);
  if (flag < -1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--sliding-window-tokens ", flag, ": give a window in tokens, 0 (none) or -1 (auto)"));
  }
  const std::string path = absl::GetFlag(FLAGS_model_config);
  if (path.empty()) return std::max(flag, 0);
  KVCM_ASSIGN_OR_RETURN(const ModelConfig model, ReadModelConfig(path));
  KVCM_ASSIGN_OR_RETURN(const int32_t model_window, ReleasableWindow(model));
  if (flag == -1) {
    if (model_window > 0) {
      Log(absl::StrCat("model config: every layer attends within ", model_window,
                       " tokens: blocks behind that window are released "
                       "(--sliding-window-tokens 0 keeps them)"));
    }
    return model_window;
  }
  if (flag > 0 && (model_window == 0 || flag < model_window)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--sliding-window-tokens ", flag, " would release blocks that the model (", path,
        ") still reads: ",
        model_window == 0 ? "some of its layers attend to the whole context"
                          : absl::StrCat("its layers attend to up to ", model_window, " tokens")));
  }
  return flag;
}

// The KV cache groups of --model-config when --sliding-window-tokens is -1 (auto) and its
// layers are of more than one attention type (docs/architecture.md, "The hybrid KV
// cache"); nullopt otherwise (one table for every layer, as ever). With groups, the
// features that do not know groups yet are refused by their flags.
absl::StatusOr<std::optional<KvCacheGroups>> KvGroupsFromFlags() {
  const std::string path = absl::GetFlag(FLAGS_model_config);
  if (path.empty() || absl::GetFlag(FLAGS_sliding_window_tokens) != -1) return std::nullopt;
  KVCM_ASSIGN_OR_RETURN(const ModelConfig model, ReadModelConfig(path));
  KVCM_ASSIGN_OR_RETURN(const std::vector<int32_t> windows, LayerWindows(model));
  KVCM_ASSIGN_OR_RETURN(KvCacheGroups groups, GroupLayers(windows));
  if (groups.num_groups() < 2) return std::nullopt;
  std::vector<std::string> refused;
  const std::string host_bytes = absl::GetFlag(FLAGS_host_tier_bytes);
  if (!host_bytes.empty() && host_bytes != "0") refused.push_back("--host-tier-bytes");
  if (!absl::GetFlag(FLAGS_disk_tier_dir).empty()) refused.push_back("--disk-tier-dir");
  if (!refused.empty()) {
    return absl::UnimplementedError(absl::StrCat(
        absl::StrJoin(refused, ", "),
        ": the host and disk tiers do not support KV cache "
        "groups yet, and the model (",
        path, ") has layers of more than one attention type: ", groups.ToString(),
        "; give --sliding-window-tokens 0 to keep every layer's blocks in one table instead"));
  }
  return groups;
}

// The pool's spec: the model's, or with KV cache groups a page's (PageSpec: group_size
// layer slots), and the groups, logged.
struct PoolSpec {
  KvCacheSpec spec;
  std::optional<KvCacheGroups> groups;
};
absl::StatusOr<PoolSpec> PoolSpecFromFlags() {
  PoolSpec pool;
  KVCM_ASSIGN_OR_RETURN(const KvCacheSpec model_spec, SpecFromFlags());
  KVCM_ASSIGN_OR_RETURN(pool.groups, KvGroupsFromFlags());
  pool.spec = pool.groups.has_value() ? PageSpec(model_spec, *pool.groups) : model_spec;
  if (pool.groups.has_value()) {
    Log(
        absl::StrCat("model config: layers of more than one attention type: KV cache groups, "
                     "a block table each, whose window groups release what their window "
                     "passed: ",
                     pool.groups->ToString(), " (--sliding-window-tokens 0 keeps one table)"));
  }
  return pool;
}

// The service's options from the flags, given the pool's KV spec (a page's with groups),
// the pool plan, the hash and the KV cache groups, if any.
absl::StatusOr<CacheManagerService::Options> ServiceOptionsFromFlags(
    const KvCacheSpec& spec, const PoolPlan& plan, HashAlgorithm hash_algorithm,
    const std::optional<KvCacheGroups>& groups) {
  CacheManagerService::Options service;
  service.spec = spec;
  if (groups.has_value()) service.kv_groups = *groups;
  service.ledger.num_blocks = static_cast<int32_t>(plan.num_blocks);
  // With groups the windows are the groups' (a model of several window sizes has groups).
  if (!groups.has_value()) {
    KVCM_ASSIGN_OR_RETURN(service.ledger.sliding_window_tokens, SlidingWindowFromFlags());
  }
  service.ledger.max_pinned_blocks = absl::GetFlag(FLAGS_max_pinned_blocks);
  service.hash_algorithm = hash_algorithm;
  // Microseconds since 1970: different at every start, and below 2^53 until 2255. Compared
  // for equality only (a clock set back may give a later start a lower one).
  service.epoch = static_cast<uint64_t>(absl::ToUnixMicros(absl::Now()));
  service.heartbeat_interval = absl::Milliseconds(absl::GetFlag(FLAGS_heartbeat_interval_ms));
  service.heartbeat_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_heartbeat_timeout_ms));
  service.max_ops_per_step = absl::GetFlag(FLAGS_max_ops_per_step);
  // The limit travels in HelloReply as 32 bits; below 64 KiB not even a modest Step fits.
  const int64_t max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  if (max_message_bytes < (int64_t{64} << 10) || max_message_bytes > (int64_t{1} << 30)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max-message-bytes ", max_message_bytes, " is outside 65536-1073741824"));
  }
  service.max_message_bytes = static_cast<size_t>(max_message_bytes);
  service.max_hashes_per_message = absl::GetFlag(FLAGS_max_hashes_per_message);
  service.max_sessions = absl::GetFlag(FLAGS_max_sessions);
  service.max_sessions_per_process = absl::GetFlag(FLAGS_max_sessions_per_process);
  service.max_sequences_per_session = absl::GetFlag(FLAGS_max_sequences_per_session);
  if (absl::Status checked = CacheManagerService::CheckOptions(service); !checked.ok()) {
    return checked;
  }
  return service;
}

// The ready line (launchers wait for it) and what a peer needs to know to connect.
void LogReady(const CacheManagerServer& server, const std::string& metrics_url,
              const std::optional<VllmEventPublisher::Options>& vllm_events) {
  Log(absl::StrCat("ready epoch=", server.epoch(), " endpoint=", server.request_endpoint(),
                   " events=", server.event_endpoint(), " metrics=", metrics_url,
                   server.tcp_endpoint().empty() ? "" : " tcp=" + server.tcp_endpoint()));
  if (!server.vllm_events_endpoint().empty()) {
    Log(absl::StrCat(
        "vLLM-format KV events on ", server.vllm_events_endpoint(), " topic=", vllm_events->topic,
        " replay=",
        server.vllm_replay_endpoint().empty() ? std::string("none") : server.vllm_replay_endpoint(),
        " buffer_steps=", vllm_events->buffer_steps, " first_seq=", server.vllm_first_seq()));
  }
  if (!server.tcp_endpoint().empty()) {  // a tcp:// endpoint always has a secret
    Log(absl::StrCat("routers and executors on ", server.tcp_endpoint(),
                     " must give the secret in ", server.tcp_secret_path(),
                     " (mode 0600); without it a peer gets a read-only control session"));
  }
}

// --tcp-address, checked, as the endpoint to bind; empty without it.
absl::StatusOr<std::string> TcpEndpointFromFlags() {
  if (absl::GetFlag(FLAGS_tcp_address).empty()) return std::string();
  KVCM_ASSIGN_OR_RETURN(TcpEndpoint tcp,
                        CheckTcpEndpoint(absl::GetFlag(FLAGS_tcp_address), "--tcp-address",
                                         absl::GetFlag(FLAGS_tcp_allow_remote)));
  return tcp.BindEndpoint();
}

// What the metrics' info series says of the pool.
CacheManagerMetrics::CacheInfo CacheInfoOf(const KvCacheSpec& spec, const PoolPlan& plan,
                                           PoolBackend backend, HashAlgorithm hash_algorithm,
                                           const CacheManagerService::Options& service) {
  CacheManagerMetrics::CacheInfo info;
  info.group_windows = {service.ledger.sliding_window_tokens};
  if (service.kv_groups.num_groups() > 1) {
    info.group_windows.clear();
    for (const KvCacheGroup& group : service.kv_groups.groups) {
      info.group_windows.push_back(group.window);
    }
  }
  info.num_blocks = static_cast<int32_t>(plan.num_blocks);
  info.block_size = spec.block_size;
  info.block_bytes = spec.BytesPerBlock();
  info.pool_bytes = static_cast<uint64_t>(plan.pool_bytes);
  info.dtype = std::string(DTypeName(spec.dtype));
  info.backend = std::string(PoolBackendName(backend));
  info.hash_algorithm = std::string(HashAlgorithmName(hash_algorithm));
  return info;
}

int Main(const std::vector<config::Setting>& settings) {
  Log(config::Describe(settings, config::ConfigFilePath()));
  // Before any thread starts: see common/base/termination_signals.h.
  UniqueFd signal_fd = BlockTerminationSignals();
  if (!signal_fd.valid()) {
    Log("cannot create a signalfd");
    return 1;
  }
  // A disk tier file past RLIMIT_FSIZE must fail its fallocate or pwrite with EFBIG (a
  // clear error at start, a counted disk-full write while serving), not kill the process.
  signal(SIGXFSZ, SIG_IGN);

  auto fail = [](const absl::Status& status) {
    Log(absl::StrCat("error: ", status.message()));
    return 1;
  };
  // A flood of connections at the descriptor limit must not abort the process in libzmq.
  if (absl::Status guard = InstallAcceptGuard(); !guard.ok()) return fail(guard);

  auto pool_spec = PoolSpecFromFlags();
  if (!pool_spec.ok()) return fail(pool_spec.status());
  const KvCacheSpec spec = pool_spec->spec;
  auto backend = ChooseBackend();
  if (!backend.ok()) return fail(backend.status());
  auto budget = BudgetFromFlags(*backend);
  if (!budget.ok()) return fail(budget.status());
  auto plan = PlanPool(spec, *budget);
  if (!plan.ok()) return fail(plan.status());
  auto hash_algorithm = ParseHashAlgorithm(absl::GetFlag(FLAGS_hash_algorithm));
  if (!hash_algorithm.ok()) return fail(hash_algorithm.status());
  auto tcp_endpoint = TcpEndpointFromFlags();
  if (!tcp_endpoint.ok()) return fail(tcp_endpoint.status());

  // Every flag is checked before anything is acquired (the lock, the pool, the port).
  absl::StatusOr<CacheManagerService::Options> service_options =
      ServiceOptionsFromFlags(spec, *plan, *hash_algorithm, pool_spec->groups);
  if (!service_options.ok()) return fail(service_options.status());
  CacheManagerService::Options service = *std::move(service_options);
  auto vllm_events = VllmEventsFromFlags();
  if (!vllm_events.ok()) return fail(vllm_events.status());
  auto tier_options = TierOptionsFromFlags();
  if (!tier_options.ok()) return fail(tier_options.status());
  if (absl::GetFlag(FLAGS_hello_timeout_ms) < 0) {
    return fail(absl::InvalidArgumentError(
        "--hello-timeout-ms must be >= 0 (0: never close a silent connection)"));
  }

  // Every connection holds a descriptor: the soft limit (often 1024) goes up to the hard one.
  if (std::optional<RaisedLimit> raised = RaiseDescriptorLimit(); raised.has_value()) {
    Log(absl::StrCat("file descriptor limit raised from ", raised->before, " to ", raised->after));
  }
  // The lock first: a second instance must fail before it allocates or binds anything.
  const std::string run_dir_path = absl::GetFlag(FLAGS_run_dir).empty()
                                       ? RunDirectory::DefaultPath()
                                       : absl::GetFlag(FLAGS_run_dir);
  auto run_dir = RunDirectory::Acquire(run_dir_path);
  if (!run_dir.ok()) return fail(run_dir.status());
  if (!tcp_endpoint->empty()) {
    auto secret = run_dir->CreateTcpSecret();
    if (!secret.ok()) return fail(secret.status());
    service.tcp_secret = *std::move(secret);
  }

  Log(absl::StrCat("pool plan (", std::string(PoolBackendName(*backend)), " backend):\n",
                   DescribePlan(*plan)));
  const auto pool_bytes = static_cast<uint64_t>(plan->pool_bytes);
  absl::StatusOr<std::unique_ptr<PoolMemory>> memory =
      *backend == PoolBackend::kCuda
          ? CreateCudaPoolMemory(absl::GetFlag(FLAGS_cuda_device), pool_bytes)
          : CreateShmPoolMemory(pool_bytes, "kvcm-pool");
  if (!memory.ok()) return fail(memory.status());

  CacheManagerMetrics metrics(CacheInfoOf(spec, *plan, *backend, *hash_algorithm, service));
  config::ExportInfoMetric(*metrics.registry(), "kvcm_cache_manager_config_info", settings,
                           config::ConfigFilePath());
  auto metrics_server =
      MetricsServer::Start(absl::GetFlag(FLAGS_metrics_address), metrics.registry());
  if (!metrics_server.ok()) return fail(metrics_server.status());

  service.metrics_url = (*metrics_server)->url();

  CacheManagerServer::Options options;
  options.tcp_endpoint = *tcp_endpoint;
  options.hello_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_hello_timeout_ms));
  options.signal_fd = signal_fd.get();
  options.vllm_events = *vllm_events;
  options.tiers = *tier_options;
  auto server = CacheManagerServer::Create(options, *std::move(run_dir), *std::move(memory),
                                           service, &metrics);
  if (!server.ok()) return fail(server.status());

  LogReady(**server, (*metrics_server)->url(), *vllm_events);
  const absl::Status ran = (*server)->Run();
  server->reset();
  if (!ran.ok()) return fail(ran);
  Log("stopped");
  return 0;
}

}  // namespace
}  // namespace kvcm::cache_manager

int main(int argc, char** argv) {
  return kvcm::config::RunMain(
      argc, argv,
      {.binary = "kvcm-cache-manager",
       .section = "cache_manager",
       .usage = "owns the KV block pool and serves it to routers and executors.\n"
                "  kvcm-cache-manager --layers 32 --kv-heads 8 --head-dim 128 --num-blocks 4096\n"
                "  kvcm-cache-manager --model-config config.json --memory-fraction 0.9",
       .defining_file = __FILE__,
       .run = &kvcm::cache_manager::Main});
}
