// Block ledger and block hash benchmarks, each beside a baseline measured in the same run.
//
//   build/bench/block_ledger_bench                 # ratios at the end
//   build/bench/block_ledger_bench --benchmark_filter=Hash
//
// Baselines:
//   BareFreeList/N   a vector of free block ids: pop N, push N back. The floor for handing
//                    out blocks; it keeps no sequence, no state, no order.
//   BareFreeListWithSeqMap/N  the same plus inserting and erasing the sequence's table in a
//                    hash map and copying it out: the fixed cost per sequence (informative).
//   BareSha256/T     SHA-256 (OpenSSL EVP, algorithm fetched once, context reused) over the
//                    exact bytes that hashing one block of T tokens feeds it.
// Goals (issue "Foundation"): ledger ≤ 2× the bare free list per block; block hashing ≤ 1.3×
// bare SHA-256 per token.

#include <openssl/evp.h>

#include <cstring>
#include <numeric>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "bench/ratio_reporter.h"
#include "common/block/block_hash.h"
#include "common/block/block_ledger.h"

namespace kvcm {
namespace {

constexpr int32_t kPoolBlocks = 8192;
constexpr int32_t kBlockSize = 16;

void BareFreeList(benchmark::State& state) {
  const int32_t batch = static_cast<int32_t>(state.range(0));
  std::vector<int32_t> free_list(kPoolBlocks);
  std::iota(free_list.rbegin(), free_list.rend(), 0);
  std::vector<int32_t> taken;
  taken.reserve(batch);
  for (auto _ : state) {
    for (int32_t i = 0; i < batch; ++i) {
      taken.push_back(free_list.back());
      free_list.pop_back();
    }
    benchmark::DoNotOptimize(taken.data());
    for (auto it = taken.rbegin(); it != taken.rend(); ++it) free_list.push_back(*it);
    taken.clear();
    benchmark::ClobberMemory();
  }
  state.counters["units"] = batch;
}

// The same free list plus the least a sequence-aware allocator must do: insert the
// sequence's block table into a hash map and erase it again. Shows the fixed cost per
// sequence that no ledger can avoid; printed as a second, informative baseline.
void BareFreeListWithSeqMap(benchmark::State& state) {
  const int32_t batch = static_cast<int32_t>(state.range(0));
  std::vector<int32_t> free_list(kPoolBlocks);
  std::iota(free_list.rbegin(), free_list.rend(), 0);
  absl::flat_hash_map<uint64_t, std::vector<int32_t>> seqs;
  for (uint64_t s = 1000; s < 1064; ++s) seqs[s];
  for (auto _ : state) {
    std::vector<int32_t>& taken = seqs[1];
    for (int32_t i = 0; i < batch; ++i) {
      taken.push_back(free_list.back());
      free_list.pop_back();
    }
    std::vector<int32_t> copy = taken;  // the table handed back to the caller
    benchmark::DoNotOptimize(copy.data());
    auto it = seqs.find(1);
    for (auto b = it->second.rbegin(); b != it->second.rend(); ++b) free_list.push_back(*b);
    seqs.erase(it);
    benchmark::ClobberMemory();
  }
  state.counters["units"] = batch;
}

BlockLedger MakeLedger() {
  BlockLedger::Options options;
  options.num_blocks = kPoolBlocks;
  options.block_size = kBlockSize;
  return *BlockLedger::Create(options);
}

// Allocate a sequence of `batch` blocks and free it: one round of the ledger's hot path
// (sequence table insert/erase, block table, free set, ref counts).
void LedgerAllocateFree(benchmark::State& state) {
  const int32_t batch = static_cast<int32_t>(state.range(0));
  BlockLedger ledger = MakeLedger();
  // Some long-lived sequences so the pool is not empty.
  for (SeqId s = 1000; s < 1064; ++s) (void)ledger.Allocate(s, 8 * kBlockSize);
  for (auto _ : state) {
    auto result = ledger.Allocate(1, batch * kBlockSize);
    benchmark::DoNotOptimize(result->blocks.data());
    (void)ledger.Free(1);
  }
  state.counters["units"] = batch;
}

// Allocate with `batch` leading blocks already cached (and one new block for the last
// token), then free: prefix lookup, sharing, LRU removal and reinsertion.
void LedgerAllocateFreePrefixHit(benchmark::State& state) {
  const int32_t batch = static_cast<int32_t>(state.range(0));
  BlockLedger ledger = MakeLedger();
  std::vector<int32_t> prompt(static_cast<size_t>(batch * kBlockSize + 1));
  std::iota(prompt.begin(), prompt.end(), 7);
  std::vector<BlockHash> hashes;
  HashFullBlocks(HashAlgorithm::kSha256, RootHash(HashAlgorithm::kSha256, ""), prompt, kBlockSize,
                 &hashes);
  const int32_t ntok = static_cast<int32_t>(prompt.size());
  (void)ledger.Allocate(1, ntok, hashes);
  (void)ledger.Commit(1, ntok);
  (void)ledger.Free(1);
  for (auto _ : state) {
    auto result = ledger.Allocate(2, ntok, hashes);
    benchmark::DoNotOptimize(result->blocks.data());
    (void)ledger.Free(2);
  }
  if (ledger.Stats().prefix_hit_tokens == 0) state.SkipWithError("no prefix hits");
  state.counters["units"] = batch;
}

BENCHMARK(BareFreeList)->Arg(1)->Arg(16)->Arg(256);
BENCHMARK(BareFreeListWithSeqMap)->Arg(1)->Arg(16)->Arg(256);
BENCHMARK(LedgerAllocateFree)->Arg(1)->Arg(16)->Arg(256);
BENCHMARK(LedgerAllocateFreePrefixHit)->Arg(1)->Arg(16)->Arg(256);

// --- Hashing ---------------------------------------------------------------------------------

class BareSha256 {
 public:
  BareSha256() : md_(EVP_MD_fetch(nullptr, "SHA256", nullptr)), ctx_(EVP_MD_CTX_new()) {}
  ~BareSha256() {
    EVP_MD_CTX_free(ctx_);
    EVP_MD_free(md_);
  }
  void Digest(const uint8_t* data, size_t n, uint8_t* out) {
    unsigned int len = 0;
    EVP_DigestInit_ex2(ctx_, md_, nullptr);
    EVP_DigestUpdate(ctx_, data, n);
    EVP_DigestFinal_ex(ctx_, out, &len);
  }

 private:
  EVP_MD* md_;
  EVP_MD_CTX* ctx_;
};

// Same byte count as ChainBlockHash feeds SHA-256: parent, count, tokens, extra-key count.
size_t EncodedBytes(int32_t tokens) { return 32 + 4 + 4 * static_cast<size_t>(tokens) + 4; }

void BareSha256PerBlock(benchmark::State& state) {
  const int32_t tokens = static_cast<int32_t>(state.range(0));
  std::vector<uint8_t> bytes(EncodedBytes(tokens), 0x5a);
  uint8_t out[32];
  BareSha256 sha;
  for (auto _ : state) {
    sha.Digest(bytes.data(), bytes.size(), out);
    bytes[0] = out[0];  // chain, as a real block hash does
  }
  state.counters["units"] = tokens;
}

void ChainHash(benchmark::State& state, HashAlgorithm algorithm) {
  const int32_t tokens = static_cast<int32_t>(state.range(0));
  std::vector<int32_t> block(static_cast<size_t>(tokens));
  std::iota(block.begin(), block.end(), 1);
  BlockHash h = RootHash(algorithm, "");
  for (auto _ : state) {
    h = ChainBlockHash(algorithm, h, block);
    benchmark::DoNotOptimize(h);
  }
  state.counters["units"] = tokens;
}
void ChainHashSha256(benchmark::State& state) { ChainHash(state, HashAlgorithm::kSha256); }
void ChainHashFast128(benchmark::State& state) { ChainHash(state, HashAlgorithm::kFast128); }
void ChainHashXxh3V2(benchmark::State& state) { ChainHash(state, HashAlgorithm::kXxh3V2); }

// A prompt of 64 blocks of 16 tokens hashed as the router hashes it (HashFullBlocks, the
// default hash, into a reused vector), its tokens in cache: the chain's own floor per
// block, without the memory waits of the trace replay's cold prompts.
void PromptHash(benchmark::State& state, HashAlgorithm algorithm) {
  const int32_t blocks = static_cast<int32_t>(state.range(0));
  std::vector<int32_t> tokens(static_cast<size_t>(blocks * kBlockSize));
  std::iota(tokens.begin(), tokens.end(), 1);
  const BlockHash root = RootHash(algorithm, "");
  std::vector<BlockHash> hashes;
  for (auto _ : state) {
    hashes.clear();
    HashFullBlocks(algorithm, root, tokens, kBlockSize, &hashes);
    benchmark::DoNotOptimize(hashes.data());
    tokens[0] = static_cast<int32_t>(hashes.back().bytes[0]);  // no hoisting across runs
  }
  state.counters["units"] = static_cast<double>(tokens.size());
}
void PromptHashXxh3V2(benchmark::State& state) { PromptHash(state, HashAlgorithm::kXxh3V2); }
void PromptHashXxh3(benchmark::State& state) { PromptHash(state, HashAlgorithm::kXxh3); }

BENCHMARK(BareSha256PerBlock)->Arg(16)->Arg(64)->Arg(256);
BENCHMARK(ChainHashSha256)->Arg(16)->Arg(64)->Arg(256);
BENCHMARK(ChainHashFast128)->Arg(16)->Arg(64)->Arg(256);
BENCHMARK(ChainHashXxh3V2)->Arg(16)->Arg(64)->Arg(256);
BENCHMARK(PromptHashXxh3)->Arg(64);
BENCHMARK(PromptHashXxh3V2)->Arg(64);

}  // namespace
}  // namespace kvcm

int main(int argc, char** argv) {
  kvcm::bench::RatioReporter reporter;
  reporter.AddPair("LedgerAllocateFree/", "BareFreeList/", 2.0, "block");
  reporter.AddPair("LedgerAllocateFreePrefixHit/", "BareFreeList/", 2.0, "block");
  reporter.AddPair("LedgerAllocateFree/", "BareFreeListWithSeqMap/", 2.0, "block");
  reporter.AddPair("ChainHashSha256/", "BareSha256PerBlock/", 1.3, "token");
  reporter.AddPair("ChainHashFast128/", "BareSha256PerBlock/", 1.3, "token");
  reporter.AddPair("ChainHashXxh3V2/", "BareSha256PerBlock/", 0, "token");
  reporter.AddPair("PromptHashXxh3V2/", "PromptHashXxh3/", 0, "token");
  return kvcm::bench::RunWithRatios(argc, argv, reporter);
}
