// The cache manager's Step round trip with the tiers on (a host tier and a disk tier, the
// mover copying every stored block) beside the same cache manager with the tiers off,
// measured in the same run (docs/PERFORMANCE.md, "Tiers and the step path").
//
//   build/bench/tier_step_bench              # --steps N --paced-steps N --rounds N; ~12 s
//
// Two real kvcm-cache-manager processes (tests/support/cache_manager_process.h), started
// alike: shm pool of 65,536 blocks, the KV shape of bench/cache_manager_bench.cc (2 layers,
// 2 KV heads, head dim 64, fp16, block size 16: 16 KiB a block), given as a config.json
// written in a temp directory (--model-config, which the disk tier needs; both processes
// get it), heartbeats every 1 s, timeout 600 s. The second adds --host-tier-bytes 64MiB
// (4,096 slots), --disk-tier-dir (a fresh directory under $TMPDIR, else /tmp)
// --disk-tier-bytes 256MiB, one mover thread.
//
// The step: cache_manager_bench's ServiceHandleDecodeStep/once_a_block shape with N = 64
// running sequences: per sequence a Commit when its last token filled a block (with that
// block's hash) or after its prefill, and an Append when its next token needs a new block;
// a sequence reaching 256 tokens is freed and a new one of 64 prompt tokens (4 full blocks,
// their hashes given) allocated in its place. Hashes are distinct (a counter), so every
// committed full block enters the prefix index and, with the tiers on, is written through
// to both tiers (about 5 blocks a step); nothing hits a prefix, so no prefetch runs. Both
// processes get the same step stream (each its own copy).
//
// Measurement, two modes, each with the sides taking turns (the order alternating between
// rounds), every step timed from CacheManagerClient::Step's call to its return (one DEALER
// round trip; every outcome checked OK), after 300 warm-up steps each:
//   back to back  per round, --steps steps (default 500) to one side then to the other, each
//                 step sent as soon as the last was answered: the mover's copies share the
//                 two CPUs with the steps. Before every tiers-off run the benchmark waits,
//                 outside the clock, until the tiered process's mover is idle, so that its
//                 copies do not load the baseline. Also each process's CPU time per step
//                 (all threads, /proc/PID/task/*/schedstat), the tiered one's mover included.
//   paced         per round, --paced-steps steps (default 125) to each side, each step sent
//                 only once that side's mover is idle (no block held, no slot being
//                 written; StatsReply, polled outside the clock; one Stats round trip for
//                 the untiered side too), as when a model's step separates two Steps.
// --rounds (default 16). p50 and p99 over all timed steps of each side and mode; ratio
// tiers-on / tiers-off.
// Goal (issue "Tiers"): the tiered Step round trip <= 1.05x the untiered at p50 and p99.
// Nothing is random.

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "bench/allocation_trace.h"
#include "common/base/check.h"
#include "common/block/block_hash.h"
#include "common/client/cache_manager_client.h"
#include "tests/support/cache_manager_process.h"
#include "tests/support/subprocess.h"

namespace kvcm {
namespace {

using Clock = std::chrono::steady_clock;

constexpr int32_t kNumBlocks = 65536;
constexpr int32_t kLayers = 2;
constexpr int32_t kKvHeads = 2;
constexpr int32_t kHeadDim = 64;
constexpr int32_t kBlockSize = 16;
constexpr int32_t kDecodePromptTokens = 64;
constexpr int32_t kDecodeEndTokens = 256;
constexpr int kWarmupSteps = 300;

// bench/cache_manager_bench.cc's DecodeStepStream, once a block.
class DecodeStepStream {
 public:
  explicit DecodeStepStream(int n) : live_(static_cast<size_t>(n)) {}

  const BlockOps& Prime() {
    ops_.Clear();
    const int32_t span = kDecodeEndTokens - kDecodePromptTokens;
    for (size_t i = 0; i < live_.size(); ++i) {
      Allocate(&live_[i],
               kDecodePromptTokens + static_cast<int32_t>((i * 97) % static_cast<size_t>(span)));
    }
    return ops_;
  }

  const BlockOps& Next() {
    ops_.Clear();
    for (Seq& seq : live_) {
      if (seq.tokens >= kDecodeEndTokens) {
        ops_.Free(seq.id);
        Allocate(&seq, kDecodePromptTokens);
        continue;
      }
      hashes_.clear();
      const bool filled = seq.tokens % kBlockSize == 0 && seq.tokens > seq.prompt;
      if (filled) hashes_.push_back(NextHash());
      const bool prefilled = seq.tokens == seq.prompt && seq.prompt >= kBlockSize;
      if (filled || prefilled) {
        ops_.Commit(seq.id, seq.tokens, hashes_);
        stored_ += filled ? 1 : static_cast<uint64_t>(seq.prompt / kBlockSize);
      }
      if (seq.tokens + 1 > seq.held) {
        const int32_t reach = (seq.tokens / kBlockSize + 1) * kBlockSize;
        ops_.Append(seq.id, reach - seq.held);
        seq.held = reach;
      }
      ++seq.tokens;
    }
    return ops_;
  }

  // Full blocks committed with a hash so far (each enters the prefix index).
  uint64_t stored() const { return stored_; }

 private:
  struct Seq {
    SeqId id = 0;
    int32_t prompt = 0;
    int32_t tokens = 0;
    int32_t held = 0;
  };

  void Allocate(Seq* seq, int32_t tokens) {
    seq->id = next_seq_++;
    seq->prompt = tokens;
    seq->tokens = tokens;
    seq->held = tokens;
    hashes_.clear();
    for (int32_t b = 0; b < tokens / kBlockSize; ++b) hashes_.push_back(NextHash());
    ops_.Allocate(seq->id, tokens, hashes_);
  }

  BlockHash NextHash() {
    BlockHash h;
    const uint64_t word = ++hash_counter_ * 0x9E3779B97F4A7C15ULL;
    std::memcpy(h.bytes.data(), &word, sizeof(word));
    std::memcpy(h.bytes.data() + 8, &hash_counter_, sizeof(hash_counter_));
    return h;
  }

  std::vector<Seq> live_;
  BlockOps ops_;
  std::vector<BlockHash> hashes_;
  SeqId next_seq_ = 1;
  uint64_t hash_counter_ = 0;
  uint64_t stored_ = 0;
};

uint64_t ProcessCpuNs(pid_t pid) {
  uint64_t total = 0;
  std::error_code error;
  const std::string tasks = "/proc/" + std::to_string(pid) + "/task";
  for (const auto& task : std::filesystem::directory_iterator(tasks, error)) {
    std::ifstream in(task.path() / "schedstat");
    uint64_t ns = 0;
    if (in >> ns) total += ns;
  }
  return total;
}

struct Side {
  explicit Side(const char* side_name) : name(side_name) {}
  const char* name;
  std::unique_ptr<testing::CacheManagerProcess> process;
  std::unique_ptr<CacheManagerClient> client;
  DecodeStepStream stream{64};
  std::vector<double> samples;        // seconds, back to back
  std::vector<double> paced_samples;  // seconds, each after the mover went idle
  uint64_t cpu_ns = 0;                // the process's, over the back-to-back steps
};

// Until `side`'s mover has nothing in hand (outside the clock); one Stats round trip when
// it has no tiers.
void WaitMoverIdle(Side& side, std::chrono::microseconds poll) {
  const auto deadline = Clock::now() + std::chrono::seconds(30);
  while (Clock::now() < deadline) {
    absl::StatusOr<StatsSnapshot> stats = side.client->Stats();
    KVCM_CHECK(stats.ok()) << stats.status();
    bool busy = stats->tier_held_blocks > 0;
    for (const TierListing& tier : stats->tiers) busy = busy || tier.writing_blocks > 0;
    if (!busy) return;
    std::this_thread::sleep_for(poll);
  }
  KVCM_CHECK(false) << "the mover is still busy after 30 s";
}

// `steps` steps of `side`; timed into `samples` (and its CPU time into *cpu_ns) unless
// null (the CPU time over the whole run: the copies the steps queued may finish after
// it); paced: each step only once the side's mover is idle.
void RunSteps(Side& side, int steps, std::vector<double>* samples, uint64_t* cpu_ns, bool paced) {
  const uint64_t cpu_start = cpu_ns != nullptr ? ProcessCpuNs(side.process->process().pid()) : 0;
  for (int i = 0; i < steps; ++i) {
    if (paced) WaitMoverIdle(side, std::chrono::microseconds(100));
    const BlockOps& ops = side.stream.Next();
    const auto start = Clock::now();
    absl::StatusOr<std::vector<OpOutcome>> outcomes = side.client->Step(ops);
    const auto end = Clock::now();
    KVCM_CHECK(outcomes.ok()) << side.name << ": " << outcomes.status();
    for (const OpOutcome& outcome : *outcomes) {
      KVCM_CHECK(outcome.status.ok()) << side.name << ": " << outcome.status;
    }
    if (samples != nullptr) samples->push_back(std::chrono::duration<double>(end - start).count());
  }
  if (cpu_ns != nullptr) *cpu_ns += ProcessCpuNs(side.process->process().pid()) - cpu_start;
}

double Percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  const auto rank = static_cast<size_t>(std::ceil(p / 100.0 * static_cast<double>(v.size())));
  return v[std::max<size_t>(rank, 1) - 1];
}

int FlagInt(int argc, char** argv, std::string_view name, int fallback) {
  for (int i = 1; i + 1 < argc; ++i) {
    if (argv[i] == name) return std::atoi(argv[i + 1]);
  }
  return fallback;
}

int Main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  const int steps = FlagInt(argc, argv, "--steps", 500);  // per run
  const int rounds = FlagInt(argc, argv, "--rounds", 16);
  const int paced_steps = FlagInt(argc, argv, "--paced-steps", 125);  // per run
  std::printf("cpu: %s (%ld online); nothing random (no seed)\n", bench::CpuModel().c_str(),
              ::sysconf(_SC_NPROCESSORS_ONLN));

  absl::StatusOr<testing::TempDir> dir = testing::TempDir::Create("kvcm-tier-step");
  KVCM_CHECK(dir.ok()) << dir.status();
  const std::string config = dir->path() + "/config.json";
  {
    std::ofstream out(config);
    out << "{\"num_hidden_layers\": " << kLayers << ", \"num_attention_heads\": " << kKvHeads
        << ", \"num_key_value_heads\": " << kKvHeads << ", \"head_dim\": " << kHeadDim
        << ", \"hidden_size\": " << kKvHeads * kHeadDim << ", \"torch_dtype\": \"float16\"}\n";
  }
  const std::string disk_dir = dir->path() + "/disk-tier";
  std::filesystem::create_directory(disk_dir);

  Side off("tiers off");
  Side on("tiers on");
  for (Side* side : {&off, &on}) {
    testing::CacheManagerOptions options;
    options.num_blocks = kNumBlocks;
    options.layers = 0;  // from --model-config
    options.kv_heads = 0;
    options.head_dim = 0;
    options.dtype = "fp16";
    options.block_size = kBlockSize;
    options.heartbeat_interval_ms = 1000;
    options.heartbeat_timeout_ms = 600000;
    options.extra_args = {"--model-config", config};
    if (side == &on) {
      options.extra_args.insert(options.extra_args.end(),
                                {"--host-tier-bytes", "64MiB", "--disk-tier-dir", disk_dir,
                                 "--disk-tier-bytes", "256MiB", "--tier-mover-threads", "1"});
    }
    auto started = testing::CacheManagerProcess::Start(options);
    KVCM_CHECK(started.ok()) << side->name << ": " << started.status();
    side->process = *std::move(started);
    CacheManagerClient::Options client;
    client.endpoint = side->process->endpoint();
    client.role = wire::Role::Router;
    client.name = "tier-step-bench";
    client.heartbeats = false;
    auto connected = CacheManagerClient::Connect(client);
    KVCM_CHECK(connected.ok()) << connected.status();
    side->client = *std::move(connected);
    absl::StatusOr<std::vector<OpOutcome>> primed = side->client->Step(side->stream.Prime());
    KVCM_CHECK(primed.ok()) << primed.status();
  }
  absl::StatusOr<StatsSnapshot> first = on.client->Stats();
  KVCM_CHECK(first.ok() && first->tiers.size() == 2) << "the tiered process has no two tiers";
  std::printf(
      "tiers on: host %d slots, disk %d slots in %s; block 16 KiB (2 layers x 2 KV "
      "heads x 64, fp16, 16 tokens); 64 sequences, decode steps once a block\n",
      first->tiers[0].capacity_blocks, first->tiers[1].capacity_blocks, disk_dir.c_str());

  RunSteps(off, kWarmupSteps, nullptr, nullptr, false);
  RunSteps(on, kWarmupSteps, nullptr, nullptr, false);
  for (int round = 0; round < rounds; ++round) {
    Side* order[2] = {&on, &off};
    if (round % 2 == 1) std::swap(order[0], order[1]);
    for (Side* side : order) {
      if (side == &off) WaitMoverIdle(on, std::chrono::milliseconds(1));
      RunSteps(*side, steps, &side->samples, &side->cpu_ns, false);
    }
  }
  for (int round = 0; round < rounds; ++round) {
    Side* order[2] = {&on, &off};
    if (round % 2 == 1) std::swap(order[0], order[1]);
    for (Side* side : order) RunSteps(*side, paced_steps, &side->paced_samples, nullptr, true);
  }
  WaitMoverIdle(on, std::chrono::milliseconds(1));

  absl::StatusOr<StatsSnapshot> stats = on.client->Stats();
  KVCM_CHECK(stats.ok()) << stats.status();
  const double committed = static_cast<double>(on.stream.stored());
  std::printf(
      "%d rounds of %d back-to-back and %d paced steps each side (+%d warm-up); "
      "%.2f blocks stored per step; tiered: host stored %llu, disk stored %llu of %.0f "
      "committed full blocks\n",
      rounds, steps, paced_steps, kWarmupSteps,
      committed / static_cast<double>(rounds * (steps + paced_steps) + kWarmupSteps),
      static_cast<unsigned long long>(stats->tiers[0].stored_total),
      static_cast<unsigned long long>(stats->tiers[1].stored_total), committed);
  for (int mode = 0; mode < 2; ++mode) {
    std::printf("\n%s\n%-10s %10s %10s %10s %18s\n",
                mode == 0 ? "back to back (the mover shares the CPUs with the steps):"
                          : "paced (each step once the mover is idle, as between model steps):",
                "", "p50 us", "p99 us", "mean us", "server cpu us/step");
    double p50[2], p99[2];
    int k = 0;
    for (Side* side : {&off, &on}) {
      const std::vector<double>& v = mode == 0 ? side->samples : side->paced_samples;
      p50[k] = Percentile(v, 50);
      p99[k] = Percentile(v, 99);
      double mean = 0;
      for (double x : v) mean += x;
      mean /= static_cast<double>(v.size());
      if (mode == 0) {
        std::printf("%-10s %10.1f %10.1f %10.1f %18.1f\n", side->name, p50[k] * 1e6, p99[k] * 1e6,
                    mean * 1e6,
                    static_cast<double>(side->cpu_ns) / 1e3 / static_cast<double>(v.size()));
      } else {
        std::printf("%-10s %10.1f %10.1f %10.1f\n", side->name, p50[k] * 1e6, p99[k] * 1e6,
                    mean * 1e6);
      }
      ++k;
    }
    std::printf("tiers on / off: p50 %.3fx, p99 %.3fx (goal <= 1.05x: %s)\n", p50[1] / p50[0],
                p99[1] / p99[0],
                p50[1] / p50[0] <= 1.05 && p99[1] / p99[0] <= 1.05 ? "met" : "missed");
  }
  for (Side* side : {&off, &on}) {
    side->client.reset();
    absl::StatusOr<int> code = side->process->Terminate();
    KVCM_CHECK(code.ok() && *code == 0) << side->name << " did not exit cleanly:\n"
                                        << side->process->Output();
  }
  return 0;
}

}  // namespace
}  // namespace kvcm

int main(int argc, char** argv) { return kvcm::Main(argc, argv); }
