// Randomized property test: many seeds × thousands of random operations on small pools.
// After every operation the ledger must pass CheckInvariants() and agree with a shadow
// model — a deliberately naive second implementation of the same policy (linear scans,
// timestamps instead of lists, std::map instead of hash maps) — on the result of the
// operation, the state and reference count of every block, the eviction order, every block
// table and the counters.
//
// Each seed is printed. To replay one: KVCM_LEDGER_SEED=<seed> ./block_ledger_property_test

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "common/block/block_ledger.h"
#include "gtest/gtest.h"
#include "tests/common/block/ledger_test_util.h"
#include "tests/support/status_matchers.h"

namespace kvcm {
namespace {

using ::kvcm::testing::HashesOf;
using Code = absl::StatusCode;

// --- The shadow model ------------------------------------------------------------------

class ShadowLedger {
 public:
  ShadowLedger(int32_t n, int32_t bs, int32_t window, int32_t max_pinned)
      : n_(n), bs_(bs), window_(window), max_pinned_(max_pinned), blocks_(n) {}

  struct Outcome {
    Code code = Code::kOk;
    std::vector<BlockId> blocks;  // Allocate: table; Append: new blocks
    std::vector<CopyOrder> copies;
    int32_t cached_tokens = 0;
    int32_t count = 0;  // Lookup / EvictAllCached
  };
  static Outcome Err(Code code) {
    Outcome out;
    out.code = code;
    return out;
  }

  Outcome Allocate(SeqId id, int32_t ntok, const std::vector<BlockHash>& hashes, bool dry) {
    if (seqs_.contains(id)) return Err(Code::kAlreadyExists);
    if (ntok < 0) return Err(Code::kInvalidArgument);
    const int32_t total = Ceil(ntok);
    if (total > n_) return Err(Code::kInvalidArgument);
    if (static_cast<int32_t>(hashes.size()) > ntok / bs_) return Err(Code::kInvalidArgument);
    const int32_t matchable =
        std::min<int32_t>(static_cast<int32_t>(hashes.size()), ntok > 0 ? (ntok - 1) / bs_ : 0);
    std::vector<BlockId> hits;
    for (int32_t i = 0; i < matchable; ++i) {
      auto it = index_.find(Key(hashes[i]));
      if (it == index_.end()) break;
      hits.push_back(it->second);
    }
    int32_t hits_cached = 0;
    for (BlockId b : hits) hits_cached += State(b) == BlockState::kCached ? 1 : 0;
    const int32_t need = total - static_cast<int32_t>(hits.size());
    if (need > Count(BlockState::kFree) + Count(BlockState::kCached) - hits_cached) {
      if (!dry) ++failures_;
      return Err(Code::kResourceExhausted);
    }
    Outcome out;
    if (dry) return out;
    Seq s;
    s.tokens = ntok;
    s.committed = static_cast<int32_t>(hits.size()) * bs_;
    s.registered = static_cast<int32_t>(hits.size());
    for (const BlockHash& h : hashes) s.hashes.push_back(Key(h));
    for (BlockId b : hits) {
      ++blocks_[b].ref;
      s.blocks.push_back(b);
    }
    for (int32_t i = 0; i < need; ++i) s.blocks.push_back(Take());
    out.blocks = s.blocks;
    out.cached_tokens = s.committed;
    query_tokens_ += static_cast<uint64_t>(ntok);
    hit_tokens_ += static_cast<uint64_t>(s.committed);
    seqs_[id] = std::move(s);
    return out;
  }

  Outcome Append(SeqId id, int32_t add, bool dry) {
    auto it = seqs_.find(id);
    if (it == seqs_.end()) return Err(Code::kNotFound);
    Seq& s = it->second;
    if (add < 0) return Err(Code::kInvalidArgument);
    if (int64_t{s.tokens} + add > int64_t{n_} * bs_) return Err(Code::kInvalidArgument);
    const bool cow = add > 0 && s.tokens % bs_ != 0 && blocks_[s.blocks.back()].ref > 1;
    // The copy reads the shared block's KV: all of it must be committed.
    if (cow && s.committed < s.tokens) return Err(Code::kFailedPrecondition);
    const int32_t need = Ceil(s.tokens + add) - static_cast<int32_t>(s.blocks.size()) + cow;
    if (need > Count(BlockState::kFree) + Count(BlockState::kCached)) {
      if (!dry) ++failures_;
      return Err(Code::kResourceExhausted);
    }
    Outcome out;
    if (dry) return out;
    if (cow) {
      const BlockId old = s.blocks.back();
      const BlockId copy = Take();
      out.copies.push_back({old, copy});
      s.blocks.back() = copy;
      Release(old);
      ++cow_;
    }
    for (int32_t i = cow; i < need; ++i) {
      s.blocks.push_back(Take());
      out.blocks.push_back(s.blocks.back());
    }
    s.tokens += add;
    return out;
  }

  Outcome Fork(SeqId parent, SeqId child) {
    if (!seqs_.contains(parent)) return Err(Code::kNotFound);
    if (seqs_.contains(child)) return Err(Code::kAlreadyExists);
    Seq c = seqs_[parent];
    for (BlockId b : c.blocks) {
      if (b != kNoBlock) ++blocks_[b].ref;
    }
    seqs_[child] = std::move(c);
    return {};
  }

  Outcome Commit(SeqId id, int32_t c, const std::vector<BlockHash>& add) {
    auto it = seqs_.find(id);
    if (it == seqs_.end()) return Err(Code::kNotFound);
    Seq& s = it->second;
    if (c < s.committed || c > s.tokens) return Err(Code::kInvalidArgument);
    if (static_cast<int32_t>(s.hashes.size() + add.size()) > s.tokens / bs_) {
      return Err(Code::kInvalidArgument);
    }
    for (const BlockHash& h : add) s.hashes.push_back(Key(h));
    s.committed = c;
    const int32_t limit = std::min<int32_t>(static_cast<int32_t>(s.hashes.size()), c / bs_);
    for (int32_t i = s.registered; i < limit; ++i) {
      const BlockId b = s.blocks[i];
      if (b == kNoBlock || blocks_[b].indexed || blocks_[b].duplicate) continue;
      if (index_.contains(s.hashes[i])) {  // a duplicate: takes over if the original goes
        blocks_[b].duplicate = true;
        blocks_[b].hash = s.hashes[i];
        dups_[s.hashes[i]].push_back(b);
        continue;
      }
      index_[s.hashes[i]] = b;
      blocks_[b].indexed = true;
      blocks_[b].hash = s.hashes[i];
    }
    s.registered = std::max(s.registered, limit);
    if (window_ > 0) {
      const int64_t first_needed = int64_t{c} - window_ + 1;
      if (first_needed > 0) {
        const int32_t upto = static_cast<int32_t>(
            std::min<int64_t>(first_needed / bs_, static_cast<int64_t>(s.blocks.size())));
        for (int32_t i = 0; i < upto; ++i) {
          if (s.blocks[i] == kNoBlock) continue;
          Release(s.blocks[i]);
          s.blocks[i] = kNoBlock;
          ++window_released_;
        }
      }
    }
    return {};
  }

  Outcome Free(SeqId id) {
    auto it = seqs_.find(id);
    if (it == seqs_.end()) return Err(Code::kNotFound);
    for (auto b = it->second.blocks.rbegin(); b != it->second.blocks.rend(); ++b) {
      if (*b != kNoBlock) Release(*b);
    }
    seqs_.erase(it);
    return {};
  }

  Outcome Lookup(const std::vector<BlockHash>& hashes) const {
    Outcome out;
    for (const BlockHash& h : hashes) {
      if (!index_.contains(Key(h))) break;
      ++out.count;
    }
    return out;
  }

  Outcome Pin(const std::string& name, const std::vector<BlockHash>& hashes) {
    if (name.empty() || hashes.empty()) return Err(Code::kInvalidArgument);
    if (pins_.contains(name)) return Err(Code::kAlreadyExists);
    std::vector<BlockId> bl;
    for (const BlockHash& h : hashes) {
      auto it = index_.find(Key(h));
      if (it == index_.end()) return Err(Code::kNotFound);
      if (std::find(bl.begin(), bl.end(), it->second) == bl.end()) bl.push_back(it->second);
    }
    int32_t pinned = 0, fresh = 0;
    for (const Blk& b : blocks_) pinned += b.pin > 0 ? 1 : 0;
    for (BlockId b : bl) fresh += blocks_[b].pin == 0 ? 1 : 0;
    if (pinned + fresh > max_pinned_) return Err(Code::kResourceExhausted);
    for (BlockId b : bl) ++blocks_[b].pin;
    pins_[name] = bl;
    return {};
  }

  Outcome Unpin(const std::string& name) {
    auto it = pins_.find(name);
    if (it == pins_.end()) return Err(Code::kNotFound);
    for (auto b = it->second.rbegin(); b != it->second.rend(); ++b) {
      if (--blocks_[*b].pin == 0 && blocks_[*b].ref == 0) blocks_[*b].stamp = ++clock_;
    }
    pins_.erase(it);
    return {};
  }

  Outcome EvictAllCached() {
    Outcome out;
    while (Count(BlockState::kCached) > 0) {
      Evict(Victim());
      ++out.count;
    }
    return out;
  }

  BlockState State(BlockId b) const {
    if (blocks_[b].ref > 0) return BlockState::kInUse;
    if (blocks_[b].pin > 0) return BlockState::kPinned;
    if (blocks_[b].indexed) return BlockState::kCached;
    return BlockState::kFree;
  }
  int32_t Ref(BlockId b) const { return blocks_[b].ref; }
  std::vector<BlockId> EvictionOrder() const {
    std::vector<BlockId> order;
    for (BlockId b = 0; b < n_; ++b) {
      if (State(b) == BlockState::kCached) order.push_back(b);
    }
    std::sort(order.begin(), order.end(),
              [&](BlockId a, BlockId b) { return blocks_[a].stamp < blocks_[b].stamp; });
    return order;
  }
  const std::vector<BlockId>* Table(SeqId id) const {
    auto it = seqs_.find(id);
    return it == seqs_.end() ? nullptr : &it->second.blocks;
  }
  std::pair<int32_t, int32_t> Tokens(SeqId id) const {
    const auto& s = seqs_.at(id);
    return {s.tokens, s.committed};
  }
  int32_t NumKnownHashes(SeqId id) const {
    return static_cast<int32_t>(seqs_.at(id).hashes.size());
  }
  int32_t Count(BlockState st) const {
    int32_t c = 0;
    for (BlockId b = 0; b < n_; ++b) c += State(b) == st ? 1 : 0;
    return c;
  }

  uint64_t evictions_ = 0, cow_ = 0, failures_ = 0, window_released_ = 0;
  uint64_t query_tokens_ = 0, hit_tokens_ = 0;

 private:
  struct Blk {
    int32_t ref = 0, pin = 0;
    bool indexed = false;
    bool duplicate = false;  // holds `hash`, indexed in another block
    std::string hash;
    uint64_t stamp = 0;  // when it last became cached
  };
  struct Seq {
    int32_t tokens = 0, committed = 0, registered = 0;
    std::vector<BlockId> blocks;
    std::vector<std::string> hashes;
  };

  static std::string Key(const BlockHash& h) { return h.ToHex(); }
  int32_t Ceil(int32_t t) const { return (t + bs_ - 1) / bs_; }

  BlockId Victim() const { return EvictionOrder().front(); }
  void Evict(BlockId b) {
    const std::string hash = blocks_[b].hash;
    index_.erase(hash);
    blocks_[b].indexed = false;
    ++evictions_;
    // The latest duplicate still in use becomes the indexed block.
    auto dup = dups_.find(hash);
    if (dup == dups_.end()) return;
    const BlockId d = dup->second.back();
    dup->second.pop_back();
    if (dup->second.empty()) dups_.erase(dup);
    blocks_[d].duplicate = false;
    blocks_[d].indexed = true;
    index_[hash] = d;
  }
  BlockId Take() {
    BlockId b = kNoBlock;
    for (BlockId i = 0; i < n_ && b == kNoBlock; ++i) {
      if (State(i) == BlockState::kFree) b = i;
    }
    if (b == kNoBlock) {
      b = Victim();
      Evict(b);
    }
    blocks_[b].ref = 1;
    return b;
  }
  void Release(BlockId b) {
    if (--blocks_[b].ref == 0 && State(b) == BlockState::kCached) blocks_[b].stamp = ++clock_;
    if (blocks_[b].ref == 0 && blocks_[b].duplicate) {  // freed: it stands in for nothing
      std::erase(dups_[blocks_[b].hash], b);
      if (dups_[blocks_[b].hash].empty()) dups_.erase(blocks_[b].hash);
      blocks_[b].duplicate = false;
    }
  }

  int32_t n_, bs_, window_, max_pinned_;
  std::vector<Blk> blocks_;
  std::map<std::string, BlockId> index_;
  std::map<std::string, std::vector<BlockId>> dups_;  // in commit order
  std::map<SeqId, Seq> seqs_;
  std::map<std::string, std::vector<BlockId>> pins_;
  uint64_t clock_ = 0;
};

// --- The driver ----------------------------------------------------------------------------

class PropertyRun {
 public:
  explicit PropertyRun(uint32_t seed) : rng_(seed) {
    n_ = 4 + Uniform(44);
    const int32_t sizes[] = {1, 2, 3, 4, 16};
    bs_ = sizes[Uniform(5)];
    window_ = Uniform(3) == 0 ? 1 + Uniform(4 * bs_) : 0;
    max_pinned_ = 1 + Uniform(n_);
    BlockLedger::Options options;
    options.num_blocks = n_;
    options.block_size = bs_;
    options.sliding_window_tokens = window_;
    options.max_pinned_blocks = max_pinned_;
    ledger_.emplace(*BlockLedger::Create(options));
    shadow_.emplace(n_, bs_, window_, max_pinned_);
    // Four documents; prompts are prefixes of them, so prefixes are shared.
    for (auto& doc : docs_) {
      doc.resize(static_cast<size_t>(n_ * bs_));
      for (auto& t : doc) t = Uniform(50);
    }
  }

  std::string Describe() const {
    return "num_blocks=" + std::to_string(n_) + " block_size=" + std::to_string(bs_) +
           " window=" + std::to_string(window_) + " max_pinned=" + std::to_string(max_pinned_);
  }

  // Returns false (with a gtest failure) at the first disagreement.
  bool Step(int op_index) {
    const int op = Uniform(100);
    const SeqId id = 1 + static_cast<SeqId>(Uniform(24));
    std::string what;
    ShadowLedger::Outcome want;
    ShadowLedger::Outcome got;
    if (op < 24) {  // Allocate (or its dry run)
      const bool dry = op < 4;
      const int32_t len = Uniform(std::min(n_ * bs_ + 2, 6 * bs_ + 3));
      const auto& doc = docs_[Uniform(4)];
      std::vector<int32_t> prompt(doc.begin(), doc.begin() + std::min<size_t>(len, doc.size()));
      while (static_cast<int32_t>(prompt.size()) < len) prompt.push_back(Uniform(50));
      if (Uniform(4) == 0 && !prompt.empty()) prompt.back() = 1000 + Uniform(50);
      auto hashes = HashesOf(prompt, bs_);
      hashes.resize(static_cast<size_t>(Uniform(static_cast<int32_t>(hashes.size()) + 1)));
      if (Uniform(20) == 0) hashes.push_back(hashes.empty() ? BlockHash{} : hashes.back());
      what = (dry ? "CanAllocate(" : "Allocate(") + std::to_string(id) + ", " +
             std::to_string(len) + " tokens, " + std::to_string(hashes.size()) + " hashes)";
      want = shadow_->Allocate(id, len, hashes, dry);
      if (dry) {
        got.code = ledger_->CanAllocate(id, len, hashes).status().code();
      } else {
        auto r = ledger_->Allocate(id, len, hashes);
        got.code = r.status().code();
        if (r.ok()) {
          got.blocks = r->blocks;
          got.cached_tokens = r->num_cached_tokens;
          tokens_[id] = prompt;
        }
      }
    } else if (op < 48) {  // Append
      const bool dry = op < 28;
      const int32_t add = Uniform(10) == 0 ? -1 : Uniform(2 * bs_ + 1);
      what =
          (dry ? "CanAppend(" : "Append(") + std::to_string(id) + ", " + std::to_string(add) + ")";
      want = shadow_->Append(id, add, dry);
      if (dry) {
        got.code = ledger_->CanAppend(id, add).status().code();
      } else {
        auto r = ledger_->Append(id, add);
        got.code = r.status().code();
        if (r.ok()) {
          got.blocks = r->new_blocks;
          got.copies = r->copies;
          for (int32_t i = 0; i < add; ++i) tokens_[id].push_back(Uniform(50));
        }
      }
    } else if (op < 70) {  // Commit
      int32_t c = Uniform(8);
      std::vector<BlockHash> add;
      if (ledger_->IsLive(id)) {
        const auto [ntok, committed] = shadow_->Tokens(id);
        c = committed + Uniform(ntok - committed + 1);
        if (Uniform(15) == 0) c = committed - 1;  // backwards
        if (Uniform(15) == 0) c = ntok + 1;       // beyond
        const auto all = HashesOf(tokens_[id], bs_);
        const int32_t known = shadow_->NumKnownHashes(id);
        const int32_t can = static_cast<int32_t>(all.size()) - known;
        const int32_t k = Uniform(can + 1) + (Uniform(15) == 0 ? 1 : 0);  // sometimes too many
        for (int32_t i = 0; i < k; ++i) {
          add.push_back(known + i < static_cast<int32_t>(all.size()) ? all[known + i]
                                                                     : BlockHash{});
        }
      }
      what = "Commit(" + std::to_string(id) + ", " + std::to_string(c) + ", " +
             std::to_string(add.size()) + " hashes)";
      want = shadow_->Commit(id, c, add);
      got.code = ledger_->Commit(id, c, add).code();
    } else if (op < 84) {  // Free
      what = "Free(" + std::to_string(id) + ")";
      want = shadow_->Free(id);
      got.code = ledger_->Free(id).code();
      if (got.code == Code::kOk) tokens_.erase(id);
    } else if (op < 90) {  // Fork
      const SeqId child = 1 + static_cast<SeqId>(Uniform(24));
      what = "Fork(" + std::to_string(id) + ", " + std::to_string(child) + ")";
      want = shadow_->Fork(id, child);
      got.code = ledger_->Fork(id, child).code();
      if (got.code == Code::kOk) tokens_[child] = tokens_[id];
    } else if (op < 94) {  // Pin
      const std::string name = "pin" + std::to_string(Uniform(4));
      const auto& doc = docs_[Uniform(4)];
      std::vector<int32_t> prefix(doc.begin(), doc.begin() + bs_ * (1 + Uniform(3)));
      const auto hashes = HashesOf(prefix, bs_);
      what = "Pin(" + name + ", " + std::to_string(hashes.size()) + " blocks)";
      want = shadow_->Pin(name, hashes);
      got.code = ledger_->Pin(name, hashes).code();
    } else if (op < 97) {  // Unpin
      const std::string name = "pin" + std::to_string(Uniform(4));
      what = "Unpin(" + name + ")";
      want = shadow_->Unpin(name);
      got.code = ledger_->Unpin(name).code();
    } else if (op < 99) {  // Lookup
      const auto& doc = docs_[Uniform(4)];
      std::vector<int32_t> prefix(doc.begin(), doc.begin() + bs_ * Uniform(n_ + 1));
      const auto hashes = HashesOf(prefix, bs_);
      what = "Lookup(" + std::to_string(hashes.size()) + " blocks)";
      want = shadow_->Lookup(hashes);
      got.count = ledger_->Lookup(hashes);
    } else {
      what = "EvictAllCached()";
      want = shadow_->EvictAllCached();
      got.count = ledger_->EvictAllCached();
    }
    const std::string kind = what.substr(0, what.find('('));
    ++tally_[kind][got.code == Code::kOk ? 0 : 1];
    const std::string where = "op " + std::to_string(op_index) + ": " + what;
    EXPECT_EQ(got.code, want.code) << where;
    EXPECT_EQ(got.blocks, want.blocks) << where;
    EXPECT_EQ(got.copies, want.copies) << where;
    EXPECT_EQ(got.cached_tokens, want.cached_tokens) << where;
    EXPECT_EQ(got.count, want.count) << where;
    return !::testing::Test::HasFailure() && Agree(where);
  }

  bool Agree(const std::string& where) {
    const absl::Status inv = ledger_->CheckInvariants();
    EXPECT_THAT(inv, IsOk()) << where << ": " << inv;
    for (BlockId b = 0; b < n_; ++b) {
      EXPECT_EQ(ledger_->StateOf(b), shadow_->State(b)) << where << ", block " << b;
      EXPECT_EQ(ledger_->RefCount(b), shadow_->Ref(b)) << where << ", block " << b;
    }
    EXPECT_EQ(ledger_->EvictionOrderForTest(), shadow_->EvictionOrder()) << where;
    for (SeqId id = 1; id <= 24; ++id) {
      const auto* table = shadow_->Table(id);
      EXPECT_EQ(ledger_->IsLive(id), table != nullptr) << where << ", seq " << id;
      if (table == nullptr || !ledger_->IsLive(id)) continue;
      EXPECT_EQ(*ledger_->BlockTable(id), *table) << where << ", seq " << id;
      EXPECT_EQ(*ledger_->NumTokens(id), shadow_->Tokens(id).first) << where;
      EXPECT_EQ(*ledger_->NumCommittedTokens(id), shadow_->Tokens(id).second) << where;
    }
    const LedgerStats st = ledger_->Stats();
    EXPECT_EQ(st.free_blocks + st.in_use_blocks + st.cached_blocks + st.pinned_blocks, n_);
    EXPECT_EQ(st.pinned_blocks, shadow_->Count(BlockState::kPinned)) << where;
    EXPECT_EQ(st.evictions, shadow_->evictions_) << where;
    EXPECT_EQ(st.cow_copies, shadow_->cow_) << where;
    EXPECT_EQ(st.allocation_failures, shadow_->failures_) << where;
    EXPECT_EQ(st.window_released, shadow_->window_released_) << where;
    EXPECT_EQ(st.prefix_query_tokens, shadow_->query_tokens_) << where;
    EXPECT_EQ(st.prefix_hit_tokens, shadow_->hit_tokens_) << where;
    return !::testing::Test::HasFailure();
  }

  // Per operation kind: {succeeded, refused}.
  const std::map<std::string, std::array<int, 2>>& tally() const { return tally_; }
  LedgerStats stats() const { return ledger_->Stats(); }

 private:
  int32_t Uniform(int32_t bound) {  // [0, bound)
    return bound <= 0 ? 0 : static_cast<int32_t>(rng_() % static_cast<uint32_t>(bound));
  }

  std::mt19937 rng_;
  int32_t n_ = 0, bs_ = 0, window_ = 0, max_pinned_ = 0;
  std::optional<BlockLedger> ledger_;
  std::optional<ShadowLedger> shadow_;
  std::vector<int32_t> docs_[4];
  std::map<SeqId, std::vector<int32_t>> tokens_;
  std::map<std::string, std::array<int, 2>> tally_;
};

constexpr int kOpsPerSeed = 20000;

void RunSeed(uint32_t seed) {
  PropertyRun run(seed);
  std::printf("ledger property seed=%u %s (replay: KVCM_LEDGER_SEED=%u)\n", seed,
              run.Describe().c_str(), seed);
  std::fflush(stdout);
  for (int i = 0; i < kOpsPerSeed; ++i) {
    if (!run.Step(i)) {
      ADD_FAILURE() << "seed " << seed << " (" << run.Describe() << ") diverged at op " << i
                    << "; replay with KVCM_LEDGER_SEED=" << seed;
      return;
    }
  }
  // The run must have exercised the ledger, not only its error paths.
  std::string summary;
  for (const auto& [kind, counts] : run.tally()) {
    summary += " " + kind + "=" + std::to_string(counts[0]) + "/" + std::to_string(counts[1]);
  }
  const LedgerStats st = run.stats();
  std::printf("  ok/refused:%s; evictions=%llu cow=%llu window_released=%llu hit_tokens=%llu\n",
              summary.c_str(), static_cast<unsigned long long>(st.evictions),
              static_cast<unsigned long long>(st.cow_copies),
              static_cast<unsigned long long>(st.window_released),
              static_cast<unsigned long long>(st.prefix_hit_tokens));
  for (const char* kind : {"Allocate", "Append", "Commit", "Free", "Fork"}) {
    auto it = run.tally().find(kind);
    EXPECT_TRUE(it != run.tally().end() && it->second[0] > 0)
        << "seed " << seed << ": no successful " << kind;
  }
}

class LedgerPropertyTest : public ::testing::TestWithParam<uint32_t> {};

TEST_P(LedgerPropertyTest, AgreesWithShadowModel) {
  if (const char* only = std::getenv("KVCM_LEDGER_SEED")) {
    if (static_cast<uint32_t>(std::strtoul(only, nullptr, 10)) != GetParam()) {
      GTEST_SKIP() << "KVCM_LEDGER_SEED=" << only;
    }
  }
  RunSeed(GetParam());
}

// 64 seeds, one test case each, so ctest spreads them over cores.
INSTANTIATE_TEST_SUITE_P(Seeds, LedgerPropertyTest, ::testing::Range<uint32_t>(1, 65));

}  // namespace
}  // namespace kvcm
