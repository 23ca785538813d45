#pragma once
// The shared allocation trace (format KVTRACE1) as the ledger benchmarks read it
// (bench/ledger_trace_bench.cc, bench/tier_capacity_bench.cc), and what else they print
// alike. The format, little-endian:
//   8 bytes  magic "KVTRACE1"
//   u32 num_blocks, block_size, num_requests, max_live, num_sys, sys_len
//   u64 seed, total_prompt_tokens
//   i32[num_requests][3]   per request: P (prompt tokens), G (generated tokens), sys_id
//   u32[total_prompt_tokens] the prompts, concatenated in request order
// Generated tokens are not in the trace: GeneratedToken draws them from a fixed function of
// (request, position), so their blocks hash like real ones and are cached and evicted, but
// never hit.

#include <cstdint>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "common/base/check.h"

namespace kvcm::bench {

struct TraceRequest {
  int32_t prompt = 0;
  int32_t generated = 0;
  int32_t sys_id = -1;
  int64_t offset = 0;      // of its prompt in AllocationTrace::tokens
  int64_t gen_offset = 0;  // of its generated tokens in AllocationTrace::generated
};

struct AllocationTrace {
  int32_t num_blocks = 0;
  int32_t block_size = 0;
  int32_t max_live = 0;
  uint64_t seed = 0;
  std::vector<TraceRequest> requests;
  std::vector<int32_t> tokens;
  // Every request's generated tokens, drawn before any clock starts (the router has them
  // from the executor); empty unless ReadAllocationTrace was asked for them.
  std::vector<int32_t> generated;
};

// The generated token at `position` of request `request`: a fixed function (splitmix64).
inline int32_t GeneratedToken(uint64_t request, int64_t position) {
  uint64_t z = (request << 32) + static_cast<uint64_t>(position) + 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return static_cast<int32_t>((z ^ (z >> 31)) % 128000);
}

// Reads `path` (CHECK-fails on a missing, foreign or truncated file); with
// `draw_generated`, also fills AllocationTrace::generated.
inline AllocationTrace ReadAllocationTrace(const std::string& path, bool draw_generated) {
  const auto u32_at = [](const std::string& b, size_t at) {
    uint32_t v;
    std::memcpy(&v, b.data() + at, sizeof(v));
    return v;
  };
  std::ifstream in(path, std::ios::binary);
  KVCM_CHECK(in) << "cannot open trace " << path;
  std::string head(8 + 6 * 4 + 2 * 8, '\0');
  in.read(head.data(), static_cast<std::streamsize>(head.size()));
  KVCM_CHECK(in && head.compare(0, 8, "KVTRACE1") == 0) << path << " is not a KVTRACE1 file";
  AllocationTrace t;
  t.num_blocks = static_cast<int32_t>(u32_at(head, 8));
  t.block_size = static_cast<int32_t>(u32_at(head, 12));
  const uint32_t n = u32_at(head, 16);
  t.max_live = static_cast<int32_t>(u32_at(head, 20));
  std::memcpy(&t.seed, head.data() + 32, sizeof(t.seed));
  uint64_t total = 0;
  std::memcpy(&total, head.data() + 40, sizeof(total));
  std::vector<int32_t> table(static_cast<size_t>(n) * 3);
  in.read(reinterpret_cast<char*>(table.data()),
          static_cast<std::streamsize>(table.size() * sizeof(int32_t)));
  t.tokens.resize(total);
  in.read(reinterpret_cast<char*>(t.tokens.data()),
          static_cast<std::streamsize>(total * sizeof(int32_t)));
  KVCM_CHECK(in) << path << " is truncated";
  int64_t offset = 0;
  t.requests.resize(n);
  for (uint32_t i = 0; i < n; ++i) {
    TraceRequest& r = t.requests[i];
    r.prompt = table[3 * i];
    r.generated = table[3 * i + 1];
    r.sys_id = table[3 * i + 2];
    r.offset = offset;
    offset += r.prompt;
    if (!draw_generated) continue;
    r.gen_offset = static_cast<int64_t>(t.generated.size());
    for (int32_t g = 0; g < r.generated; ++g)
      t.generated.push_back(GeneratedToken(i, r.prompt + g));
  }
  KVCM_CHECK(offset == static_cast<int64_t>(total)) << "prompt lengths do not add up";
  return t;
}

// The CPU's model name from /proc/cpuinfo, for the figures' machine; "unknown" without it.
inline std::string CpuModel() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0) {
      const size_t colon = line.find(':');
      if (colon != std::string::npos) return line.substr(colon + 2);
    }
  }
  return "unknown";
}

}  // namespace kvcm::bench
