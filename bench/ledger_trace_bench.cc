// The block ledger replaying a realistic allocation trace, beside a peer allocator run on the
// same trace in the same run (docs/PERFORMANCE.md, "Block ledger on an allocation trace").
//
//   build/bench/ledger_trace_bench --trace trace.bin
//   build/bench/ledger_trace_bench --trace trace.bin --peer path/to/tgi_harness --rounds 5
//
// The trace (format KVTRACE1, little-endian):
//   8 bytes  magic "KVTRACE1"
//   u32 num_blocks, block_size, num_requests, max_live, num_sys, sys_len
//   u64 seed, total_prompt_tokens
//   i32[num_requests][3]   per request: P (prompt tokens), G (generated tokens), sys_id
//   u32[total_prompt_tokens] the prompts, concatenated in request order
// Every replay runs the same loop: for each request i, if max_live requests are live, free
// the oldest; allocate request i with its prompt; grow it by G_i tokens one at a time (a new
// block whenever one fills); keep it live. At the end the live ones are freed, oldest first.
// A "block op" is one block-table entry taken (new or a prefix hit) or released; every system
// makes the same number. Time per block op = the replay's wall time / block ops.
//
// kvcm's replays, each through BlockLedger's public API:
//   per-block  what the router's Steps carry (services/router/step_planner.cc): Allocate(seq,
//              P, hashes of the prompt's full blocks); Commit(seq, P) once the prefill ran;
//              then, once a block, an Append up to the block's end (or the request's) and a
//              Commit of it, with the block's hash when it is full. Free when the request
//              ends.
//   per-token  an Append(seq, 1) and a Commit(seq, n) per generated token, with the new
//              block's hash when the token fills a block: the router's Steps before it grew
//              sequences a block at a time, kept to show what that costs.
// Each with the block hashes computed inside the timed loop (the default hash, xxh3_v2; its
// version-1 message, xxh3; and SHA-256)
// and, to separate the ledger's own time, with all hashes computed before the clock starts
// ("precomputed"). Generated tokens are not in the trace: they are drawn from a fixed
// function of (request, position), so their blocks hash like real ones and are cached and
// evicted, but never hit. They are prefetched when their request is allocated (the router has
// them in cache when it hashes them); prompt tokens are not, since kvcm and the peer both
// read those from the trace as they come.
//
// --peer BINARY runs `BINARY TRACE` once per round, interleaved with kvcm's replays; it must
// print one JSON line with "ns_per_block_op" and "hit_blocks" (any other keys are ignored).
// Ratios are medians over rounds: kvcm's ns per block op / the peer's.

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <deque>
#include <fstream>
#include <string>
#include <string_view>
#include <vector>

#include "bench/allocation_trace.h"
#include "common/base/check.h"
#include "common/block/block_hash.h"
#include "common/block/block_ledger.h"

namespace kvcm {
namespace {

using Request = bench::TraceRequest;
using Trace = bench::AllocationTrace;
using bench::GeneratedToken;

Trace ReadTrace(const std::string& path) {
  return bench::ReadAllocationTrace(path, /*draw_generated=*/true);
}

enum class Growth { kPerToken, kPerBlock };
enum class Hashing { kPrecomputed, kInline };

// CPU time of the calling thread: unlike wall time, not inflated while it waits for a core.
double ThreadCpuNs() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) * 1e9 + static_cast<double>(ts.tv_nsec);
}

struct ReplayResult {
  double ns = 0;
  double cpu_ns = 0;
  uint64_t block_ops = 0;
  uint64_t hit_blocks = 0;
  uint64_t evictions = 0;
  size_t ledger_bytes = 0;
  double ns_per_op() const { return ns / static_cast<double>(block_ops); }
};

// Every block hash the replay needs (prompt blocks, then the blocks that generation fills),
// per request, in order. Computed before the clock for the "precomputed" runs.
struct HashPlan {
  std::vector<BlockHash> hashes;
  std::vector<int64_t> first;  // per request, its first hash in `hashes`
};

// Fills `tokens` with request i's whole sequence (prompt, then generated tokens).
void SequenceTokens(const Trace& t, uint32_t i, std::vector<int32_t>* tokens) {
  const Request& r = t.requests[i];
  tokens->assign(t.tokens.begin() + r.offset, t.tokens.begin() + r.offset + r.prompt);
  tokens->insert(tokens->end(), t.generated.begin() + r.gen_offset,
                 t.generated.begin() + r.gen_offset + r.generated);
}

HashPlan PrecomputeHashes(const Trace& t, HashAlgorithm algorithm) {
  HashPlan plan;
  plan.first.reserve(t.requests.size() + 1);
  const BlockHash root = RootHash(algorithm, "");
  std::vector<int32_t> tokens;
  for (uint32_t i = 0; i < t.requests.size(); ++i) {
    plan.first.push_back(static_cast<int64_t>(plan.hashes.size()));
    SequenceTokens(t, i, &tokens);
    HashFullBlocks(algorithm, root, tokens, t.block_size, &plan.hashes);
  }
  plan.first.push_back(static_cast<int64_t>(plan.hashes.size()));
  return plan;
}

ReplayResult Replay(const Trace& t, Growth growth, HashAlgorithm algorithm,
                    const HashPlan* precomputed) {
  BlockLedger::Options options;
  options.num_blocks = t.num_blocks;
  options.block_size = t.block_size;
  BlockLedger ledger = *BlockLedger::Create(options);
  const int32_t bs = t.block_size;
  const BlockHash root = RootHash(algorithm, "");
  std::deque<SeqId> live;
  std::vector<BlockHash> hashes;
  std::vector<int32_t> block_tokens(static_cast<size_t>(bs));
  ReplayResult result;
  uint64_t entries = 0;
  // Kept from call to call, as the cache manager keeps its own (CacheManagerService).
  AllocateResult allocated;
  AppendResult appended;

  auto free_oldest = [&] {
    KVCM_CHECK(ledger.Free(live.front()).ok());
    live.pop_front();
  };
  const auto start = std::chrono::steady_clock::now();
  const double cpu_start = ThreadCpuNs();
  for (uint32_t i = 0; i < t.requests.size(); ++i) {
    const Request& r = t.requests[i];
    if (static_cast<int32_t>(live.size()) == t.max_live) free_oldest();
    const SeqId seq = i + 1;
    const int32_t* prompt = t.tokens.data() + r.offset;
    const int32_t* generated = t.generated.data() + r.gen_offset;
    const int32_t prompt_blocks = r.prompt / bs;
    // The router hashes a filled block from tokens that the executor's StepResult has just
    // brought into its cache; here they lie in a 55 MB array that no cache holds, so their
    // lines are fetched now (docs/PERFORMANCE.md: about 2 ns per block op).
    for (int32_t g = 0; g < r.generated; g += 16) __builtin_prefetch(generated + g);
    std::span<const BlockHash> prompt_hashes;
    const BlockHash* gen_hashes = nullptr;  // precomputed: hashes of blocks filled later
    if (precomputed != nullptr) {
      const BlockHash* first = precomputed->hashes.data() + precomputed->first[i];
      prompt_hashes = std::span(first, static_cast<size_t>(prompt_blocks));
      gen_hashes = first + prompt_blocks;
    } else {
      hashes.clear();
      HashFullBlocks(algorithm, root, std::span(prompt, static_cast<size_t>(r.prompt)), bs,
                     &hashes);
      prompt_hashes = hashes;
    }
    const absl::Status status = ledger.Allocate(seq, r.prompt, prompt_hashes, &allocated);
    KVCM_CHECK(status.ok()) << status;
    result.hit_blocks += static_cast<uint64_t>(allocated.num_cached_tokens / bs);
    KVCM_CHECK(ledger.Commit(seq, r.prompt).ok());
    BlockHash parent = prompt_blocks > 0 ? prompt_hashes.back() : root;
    int32_t n = r.prompt;
    const int32_t end = r.prompt + r.generated;
    // The hash of the block that token position `last` (0-based) completes. The router
    // hashes it from the sequence's tokens in one vector; here they are in two (the prompt's
    // tail and the generated ones), copied in at most two pieces.
    auto filled_block_hash = [&](int32_t last) {
      if (gen_hashes != nullptr) return *gen_hashes++;
      // The block holds a generated token (last >= r.prompt), so at most bs - 1 of the prompt.
      const int32_t block_start = last + 1 - bs;
      const int32_t from_prompt = std::max(r.prompt - block_start, 0);
      if (from_prompt > 0) std::copy(prompt + block_start, prompt + r.prompt, block_tokens.begin());
      const int32_t first_generated = block_start + from_prompt - r.prompt;
      std::copy(generated + first_generated, generated + first_generated + (bs - from_prompt),
                block_tokens.begin() + from_prompt);
      return ChainBlockHash(algorithm, parent, block_tokens);
    };
    if (growth == Growth::kPerToken) {
      while (n < end) {
        KVCM_CHECK(ledger.Append(seq, 1, &appended).ok());
        ++n;
        if (n % bs == 0) {
          parent = filled_block_hash(n - 1);
          KVCM_CHECK(ledger.Commit(seq, n, std::span(&parent, 1)).ok());
        } else {
          KVCM_CHECK(ledger.Commit(seq, n).ok());
        }
      }
    } else {
      while (n < end) {
        const int32_t next = std::min(end, (n / bs + 1) * bs);
        KVCM_CHECK(ledger.Append(seq, next - n, &appended).ok());
        n = next;
        if (n % bs == 0) {
          parent = filled_block_hash(n - 1);
          KVCM_CHECK(ledger.Commit(seq, n, std::span(&parent, 1)).ok());
        } else {
          KVCM_CHECK(ledger.Commit(seq, n).ok());
        }
      }
    }
    entries += static_cast<uint64_t>((end + bs - 1) / bs);
    live.push_back(seq);
  }
  while (!live.empty()) free_oldest();
  result.cpu_ns = ThreadCpuNs() - cpu_start;
  result.ns =
      std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count();
  result.block_ops = 2 * entries;
  result.evictions = ledger.Stats().evictions;
  result.ledger_bytes = ledger.MemoryBytes();
  KVCM_CHECK(ledger.CheckInvariants().ok()) << ledger.CheckInvariants();
  KVCM_CHECK(ledger.Stats().in_use_blocks == 0);
  return result;
}

struct PeerResult {
  double ns_per_op = 0;
  uint64_t hit_blocks = 0;
};

double JsonNumber(const std::string& line, std::string_view key) {
  const std::string quoted = "\"" + std::string(key) + "\":";
  const size_t at = line.find(quoted);
  KVCM_CHECK(at != std::string::npos) << "peer output lacks " << key << ": " << line;
  return std::strtod(line.c_str() + at + quoted.size(), nullptr);
}

PeerResult RunPeer(const std::string& binary, const std::string& trace) {
  const std::string command = "'" + binary + "' '" + trace + "'";
  FILE* pipe = popen(command.c_str(), "r");
  KVCM_CHECK(pipe != nullptr) << "cannot run " << binary;
  std::string out;
  char buf[4096];
  while (size_t got = std::fread(buf, 1, sizeof(buf), pipe)) out.append(buf, got);
  KVCM_CHECK(pclose(pipe) == 0) << binary << " failed: " << out;
  PeerResult r;
  r.ns_per_op = JsonNumber(out, "ns_per_block_op");
  r.hit_blocks = static_cast<uint64_t>(JsonNumber(out, "hit_blocks"));
  return r;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t m = v.size() / 2;
  return v.size() % 2 == 1 ? v[m] : (v[m - 1] + v[m]) / 2;
}

struct Config {
  const char* name;
  Growth growth;
  HashAlgorithm algorithm;
  bool precomputed;
};

int Main(int argc, char** argv) {
  std::string trace_path;
  std::string peer;
  int rounds = 3;
  std::string only;
  size_t requests = 0;  // 0: all
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    auto value = [&]() -> std::string {
      KVCM_CHECK(i + 1 < argc) << arg << " needs a value";
      return argv[++i];
    };
    if (arg == "--trace") {
      trace_path = value();
    } else if (arg == "--peer") {
      peer = value();
    } else if (arg == "--rounds") {
      rounds = std::atoi(value().c_str());
    } else if (arg == "--only") {
      only = value();
    } else if (arg == "--requests") {
      requests = std::strtoul(value().c_str(), nullptr, 10);
    } else {
      std::fprintf(stderr,
                   "usage: %s --trace FILE [--peer BINARY] [--rounds N] [--only NAME|GROUP] "
                   "[--requests N]\n",
                   argv[0]);
      return 2;
    }
  }
  if (trace_path.empty()) {
    std::fprintf(stderr, "--trace FILE is required (format: see bench/ledger_trace_bench.cc)\n");
    return 2;
  }
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  Trace trace = ReadTrace(trace_path);
  if (requests > 0 && requests < trace.requests.size()) {
    // The first N requests only (to profile; the peer still replays the whole trace).
    KVCM_CHECK(peer.empty()) << "--requests cannot be compared with a peer";
    trace.requests.resize(requests);
  }
  std::printf(
      "trace %s: %zu requests, %zu prompt tokens, pool %d blocks of %d, %d live, seed %llu\n",
      trace_path.c_str(), trace.requests.size(), trace.tokens.size(), trace.num_blocks,
      trace.block_size, trace.max_live, static_cast<unsigned long long>(trace.seed));

  const HashAlgorithm fast = kDefaultHashAlgorithm;
  const HashAlgorithm v1 = HashAlgorithm::kXxh3;
  const std::vector<Config> configs = {
      {"per-token/xxh3_v2", Growth::kPerToken, fast, false},
      {"per-token/xxh3", Growth::kPerToken, v1, false},
      {"per-token/sha256", Growth::kPerToken, HashAlgorithm::kSha256, false},
      {"per-token/precomputed", Growth::kPerToken, fast, true},
      {"per-block/xxh3_v2", Growth::kPerBlock, fast, false},
      {"per-block/xxh3", Growth::kPerBlock, v1, false},
      {"per-block/sha256", Growth::kPerBlock, HashAlgorithm::kSha256, false},
      {"per-block/precomputed", Growth::kPerBlock, fast, true},
  };
  std::vector<const Config*> chosen;
  for (const Config& c : configs) {
    // A whole name, or a group: "per-block" or "per-block/" picks every per-block replay.
    const std::string_view name = c.name;
    const bool group = name.size() > only.size() && name.starts_with(only) &&
                       (only.empty() || only.back() == '/' || name[only.size()] == '/');
    if (name == only || group) chosen.push_back(&c);
  }
  HashPlan plan;
  if (std::any_of(chosen.begin(), chosen.end(), [](const Config* c) { return c->precomputed; })) {
    plan = PrecomputeHashes(trace, fast);
  }
  // Hashing alone, as the router hashes a prompt: its full blocks, into a reused vector.
  for (HashAlgorithm algorithm : {HashAlgorithm::kXxh3V2, HashAlgorithm::kXxh3,
                                  HashAlgorithm::kFast128, HashAlgorithm::kSha256}) {
    if (!only.empty()) break;
    const BlockHash root = RootHash(algorithm, "");
    std::vector<BlockHash> hashes;
    uint64_t blocks = 0;
    const double cpu_start = ThreadCpuNs();
    for (const Request& r : trace.requests) {
      hashes.clear();
      HashFullBlocks(algorithm, root,
                     std::span(trace.tokens.data() + r.offset, static_cast<size_t>(r.prompt)),
                     trace.block_size, &hashes);
      blocks += hashes.size();
    }
    const double ns = ThreadCpuNs() - cpu_start;
    std::printf("hashing %-7s %llu prompt blocks: %.2f ns per token, %.1f ns per block (cpu)\n",
                std::string(HashAlgorithmName(algorithm)).c_str(),
                static_cast<unsigned long long>(blocks),
                ns / static_cast<double>(blocks * static_cast<uint64_t>(trace.block_size)),
                ns / static_cast<double>(blocks));
  }

  std::vector<std::vector<double>> ns(chosen.size());
  std::vector<double> peer_ns;
  uint64_t peer_hits = 0;
  std::vector<ReplayResult> last(chosen.size());
  for (int round = 0; round < rounds; ++round) {
    for (size_t c = 0; c < chosen.size(); ++c) {
      last[c] = Replay(trace, chosen[c]->growth, chosen[c]->algorithm,
                       chosen[c]->precomputed ? &plan : nullptr);
      ns[c].push_back(last[c].ns_per_op());
      std::printf("round %d  %-22s %8.2f ns/op  (cpu %.2f)  hits %llu\n", round, chosen[c]->name,
                  last[c].ns_per_op(), last[c].cpu_ns / static_cast<double>(last[c].block_ops),
                  static_cast<unsigned long long>(last[c].hit_blocks));
      if (!peer.empty() && (c + 1) % 2 == 0) {  // the peer between kvcm's runs
        const PeerResult p = RunPeer(peer, trace_path);
        peer_ns.push_back(p.ns_per_op);
        peer_hits = p.hit_blocks;
        std::printf("round %d  %-22s %8.2f ns/op  hits %llu\n", round, "peer", p.ns_per_op,
                    static_cast<unsigned long long>(p.hit_blocks));
      }
    }
  }
  const double peer_median = peer_ns.empty() ? 0 : Median(peer_ns);
  std::printf("\n%-22s %12s %12s %12s %14s %10s\n", "replay", "ns/block op", "block ops",
              "hit blocks", "evictions", "bytes/blk");
  for (size_t c = 0; c < chosen.size(); ++c) {
    const double median = Median(ns[c]);
    std::printf("%-22s %12.2f %12llu %12llu %14llu %10.1f", chosen[c]->name, median,
                static_cast<unsigned long long>(last[c].block_ops),
                static_cast<unsigned long long>(last[c].hit_blocks),
                static_cast<unsigned long long>(last[c].evictions),
                static_cast<double>(last[c].ledger_bytes) / trace.num_blocks);
    if (peer_median > 0) std::printf("   %.2fx peer", median / peer_median);
    std::printf("\n");
  }
  if (peer_median > 0) {
    std::printf("%-22s %12.2f %12s %12llu   (median of %zu runs, interleaved)\n", "peer",
                peer_median, "", static_cast<unsigned long long>(peer_hits), peer_ns.size());
  }
  return 0;
}

}  // namespace
}  // namespace kvcm

int main(int argc, char** argv) { return kvcm::Main(argc, argv); }
