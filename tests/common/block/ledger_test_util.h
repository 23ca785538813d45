#pragma once

// Helpers shared by the ledger tests: token/hash builders and a full observable snapshot of
// a ledger, so that "an error leaves the ledger exactly as it was" is one comparison.

#include <map>
#include <numeric>
#include <ostream>
#include <vector>

#include "common/block/block_hash.h"
#include "common/block/block_ledger.h"
#include "gtest/gtest.h"

namespace kvcm::testing {

inline std::vector<int32_t> Iota(int32_t n, int32_t start = 0) {
  std::vector<int32_t> v(static_cast<size_t>(n));
  std::iota(v.begin(), v.end(), start);
  return v;
}

// Chained SHA-256 hashes of every full block of `tokens`.
inline std::vector<BlockHash> HashesOf(const std::vector<int32_t>& tokens, int32_t block_size,
                                       std::string_view salt = "") {
  std::vector<BlockHash> out;
  HashFullBlocks(HashAlgorithm::kSha256, RootHash(HashAlgorithm::kSha256, salt), tokens, block_size,
                 &out);
  return out;
}

// Everything a caller can observe about a ledger, minus monotonic counters.
struct LedgerSnapshot {
  std::vector<BlockState> states;
  std::vector<int32_t> ref_counts;
  std::vector<BlockId> eviction_order;
  std::map<SeqId, std::vector<BlockId>> tables;
  std::map<SeqId, std::pair<int32_t, int32_t>> tokens;  // (num_tokens, committed)
  int32_t free = 0, in_use = 0, cached = 0, pinned = 0, live = 0;

  friend bool operator==(const LedgerSnapshot&, const LedgerSnapshot&) = default;
};

inline LedgerSnapshot Snapshot(const BlockLedger& ledger, const std::vector<SeqId>& seqs) {
  LedgerSnapshot snap;
  for (BlockId b = 0; b < ledger.num_blocks(); ++b) {
    snap.states.push_back(ledger.StateOf(b));
    snap.ref_counts.push_back(ledger.RefCount(b));
  }
  snap.eviction_order = ledger.EvictionOrderForTest();
  for (SeqId s : seqs) {
    if (!ledger.IsLive(s)) continue;
    snap.tables[s] = *ledger.BlockTable(s);
    snap.tokens[s] = {*ledger.NumTokens(s), *ledger.NumCommittedTokens(s)};
  }
  const LedgerStats stats = ledger.Stats();
  snap.free = stats.free_blocks;
  snap.in_use = stats.in_use_blocks;
  snap.cached = stats.cached_blocks;
  snap.pinned = stats.pinned_blocks;
  snap.live = stats.live_sequences;
  return snap;
}

inline std::ostream& operator<<(std::ostream& os, const LedgerSnapshot& s) {
  os << "{free " << s.free << ", in_use " << s.in_use << ", cached " << s.cached << ", pinned "
     << s.pinned << ", live " << s.live << ", states";
  for (BlockState st : s.states) os << " " << BlockStateName(st);
  return os << "}";
}

}  // namespace kvcm::testing
