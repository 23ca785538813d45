// A property test of the ledger under in-flight writers (docs/architecture.md, "Fencing"),
// the ledger's half of what tests/services/cache_manager/cache_manager_fence_property_test.cc
// checks through the service. Several routers run steps on their sequences. Each step is a
// writer that writes the KV of the step's new tokens into the blocks that hold them, and
// finishes some operations later; only then are its tokens committed. Routers die while
// their writers run. A dead router's sequences that a writer may still write are renamed
// out of the routers' ids (BlockLedger::Rename, as the cache manager's fence does) and
// freed when the writer finishes; the others are freed at once.
//
// The property: the blocks a new writer writes are never blocks another writer in flight
// may still write (no block is held by two writers), every writer's blocks stay in its
// sequence's table (under its new id after a rename) until it finishes, and the ledger
// passes CheckInvariants() after every operation. The same run without the fence (a dead
// router's sequences freed at once) must break the property, so the check can fail.
//
// Seeds are fixed and printed. To replay one: KVCM_LEDGER_WRITERS_SEED=<seed>.

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "common/block/block_ledger.h"
#include "gtest/gtest.h"
#include "tests/common/block/ledger_test_util.h"

namespace kvcm {
namespace {

using ::kvcm::testing::HashesOf;

constexpr int32_t kBlocks = 32;
constexpr int32_t kBlockSize = 4;
constexpr int kRouters = 3;
constexpr int kOpsPerSeed = 6000;
constexpr SeqId kFirstDrainingId = SeqId{1} << 63;

class WritersRun {
 public:
  WritersRun(uint32_t seed, bool fence) : rng_(seed), fence_(fence) {
    BlockLedger::Options options;
    options.num_blocks = kBlocks;
    options.block_size = kBlockSize;
    ledger_.emplace(*BlockLedger::Create(options));
    // Four prompts, two of which share a head, so that prefixes are matched and shared.
    for (int p = 0; p < 4; ++p) {
      for (int32_t t = 0; t < 24; ++t) prompts_[p].push_back(p == 1 && t < 10 ? t : 100 * p + t);
    }
  }

  // One random operation; false (and `failure_` set) once the property broke.
  bool Step() {
    const int op = Uniform(100);
    if (op < 25) {
      Allocate();
    } else if (op < 50) {
      Append();
    } else if (op < 58) {
      Fork();
    } else if (op < 68) {
      Free();
    } else if (op < 94) {
      Tick();
    } else {
      KillRouter(Uniform(kRouters));
    }
    if (failure_.empty()) {
      const absl::Status invariants = ledger_->CheckInvariants();
      if (!invariants.ok()) failure_ = std::string(invariants.message());
    }
    return failure_.empty();
  }

  // Lets every writer finish and frees every sequence: the pool must be whole again.
  bool Finish() {
    while (!writers_.empty() && failure_.empty()) Tick();
    for (const auto& [id, seq] : seqs_) (void)ledger_->Free(id);
    seqs_.clear();
    const LedgerStats stats = ledger_->Stats();
    if (failure_.empty() && stats.free_blocks + stats.cached_blocks != kBlocks) {
      failure_ = "blocks are missing after every sequence was freed";
    }
    return failure_.empty();
  }

  const std::string& failure() const { return failure_; }
  std::string Summary() const {
    return "writers=" + std::to_string(writers_started_) + " renamed=" + std::to_string(renamed_) +
           " deaths=" + std::to_string(deaths_) +
           " prefix_hit_tokens=" + std::to_string(ledger_->Stats().prefix_hit_tokens) +
           " cow=" + std::to_string(ledger_->Stats().cow_copies);
  }
  int writers_started() const { return writers_started_; }
  int renamed() const { return renamed_; }

 private:
  struct Seq {
    int router = 0;
    std::vector<int32_t> tokens;  // all of them, committed or not
    int32_t hashed_blocks = 0;    // full blocks whose hashes the ledger was given
    bool writing = false;         // a writer is in flight
  };
  struct Writer {
    SeqId seq = 0;            // its current id (renamed while it drains)
    bool draining = false;    // its router died: freed when it finishes
    bool orphaned = false;    // without the fence: its sequence was freed under it
    int32_t first_token = 0;  // it writes tokens [first_token, end_token)
    int32_t end_token = 0;
    std::vector<BlockId> blocks;  // the blocks those tokens are in
    int ticks_left = 0;
  };

  int32_t Uniform(int32_t bound) {  // [0, bound)
    return bound <= 0 ? 0 : static_cast<int32_t>(rng_() % static_cast<uint32_t>(bound));
  }

  // A sequence that no writer writes and whose tokens are all committed, or 0.
  SeqId PickIdle() {
    std::vector<SeqId> idle;
    for (const auto& [id, seq] : seqs_) {
      if (!seq.writing) idle.push_back(id);
    }
    return idle.empty() ? 0 : idle[static_cast<size_t>(Uniform(static_cast<int32_t>(idle.size())))];
  }

  // Starts a writer of `seq`'s tokens [first, end), checking that no writer in flight
  // writes any of their blocks.
  void StartWriter(SeqId id, int32_t first, int32_t end) {
    const std::vector<BlockId> table = *ledger_->BlockTable(id);
    Writer writer{id, false, false, first, end, {}, 1 + Uniform(8)};
    for (int32_t b = first / kBlockSize; b <= (end - 1) / kBlockSize; ++b) {
      writer.blocks.push_back(table[static_cast<size_t>(b)]);
    }
    for (const Writer& other : writers_) {
      for (BlockId block : writer.blocks) {
        if (std::find(other.blocks.begin(), other.blocks.end(), block) != other.blocks.end()) {
          failure_ = "block " + std::to_string(block) + " handed to a writer of sequence " +
                     std::to_string(id) + " while a writer of sequence " +
                     std::to_string(other.seq) + " may still write it";
          return;
        }
      }
    }
    seqs_[id].writing = true;
    writers_.push_back(std::move(writer));
    ++writers_started_;
  }

  void Allocate() {
    const int router = Uniform(kRouters);
    const std::vector<int32_t>& prompt = prompts_[Uniform(4)];
    const int32_t n = 1 + Uniform(static_cast<int32_t>(prompt.size()));
    Seq seq{router, std::vector<int32_t>(prompt.begin(), prompt.begin() + n), 0, false};
    const std::vector<BlockHash> hashes = HashesOf(seq.tokens, kBlockSize);
    const SeqId id = next_id_++;
    absl::StatusOr<AllocateResult> allocated = ledger_->Allocate(id, n, hashes);
    if (!allocated.ok()) return;  // the pool is full: nothing changed
    seq.hashed_blocks = static_cast<int32_t>(hashes.size());
    seqs_[id] = std::move(seq);
    StartWriter(id, allocated->num_cached_tokens, n);
  }

  void Append() {
    const SeqId id = PickIdle();
    if (id == 0) return;
    Seq& seq = seqs_[id];
    const auto before = static_cast<int32_t>(seq.tokens.size());
    const int32_t k = 1 + Uniform(6);
    if (!ledger_->Append(id, k).ok()) return;
    for (int32_t i = 0; i < k; ++i) seq.tokens.push_back(static_cast<int32_t>(id * 7 + before + i));
    StartWriter(id, before, before + k);
  }

  void Fork() {
    const SeqId parent = PickIdle();
    if (parent == 0) return;
    const SeqId child = next_id_++;
    if (!ledger_->Fork(parent, child).ok()) return;
    seqs_[child] = seqs_[parent];
  }

  void Free() {
    const SeqId id = PickIdle();
    if (id == 0) return;
    (void)ledger_->Free(id);
    seqs_.erase(id);
  }

  // Every writer gets one tick nearer its end; those that reach it finish: a draining one's
  // sequence is freed, any other's tokens are committed with the hashes of newly full blocks.
  void Tick() {
    for (size_t i = 0; i < writers_.size() && failure_.empty();) {
      Writer& writer = writers_[i];
      if (--writer.ticks_left > 0) {
        ++i;
        continue;
      }
      if (writer.orphaned) {  // it stops writing; nothing of it is left to commit or free
        writers_.erase(writers_.begin() + static_cast<std::ptrdiff_t>(i));
        continue;
      }
      const std::vector<BlockId> table = *ledger_->BlockTable(writer.seq);
      for (size_t b = 0; b < writer.blocks.size(); ++b) {
        const size_t index = static_cast<size_t>(writer.first_token / kBlockSize) + b;
        if (index >= table.size() || table[index] != writer.blocks[b]) {
          failure_ = "the blocks a writer of sequence " + std::to_string(writer.seq) +
                     " wrote left its table before it finished";
          return;
        }
      }
      Seq& seq = seqs_[writer.seq];
      if (writer.draining) {
        (void)ledger_->Free(writer.seq);
        seqs_.erase(writer.seq);
      } else {
        const std::vector<BlockHash> all = HashesOf(
            std::vector<int32_t>(seq.tokens.begin(), seq.tokens.begin() + writer.end_token),
            kBlockSize);
        const std::span<const BlockHash> fresh =
            std::span<const BlockHash>(all).subspan(static_cast<size_t>(seq.hashed_blocks));
        const absl::Status committed = ledger_->Commit(writer.seq, writer.end_token, fresh);
        if (!committed.ok()) {
          failure_ = "commit after a writer of sequence " + std::to_string(writer.seq) +
                     " finished: " + std::string(committed.message());
          return;
        }
        seq.hashed_blocks = static_cast<int32_t>(all.size());
        seq.writing = false;
      }
      writers_.erase(writers_.begin() + static_cast<std::ptrdiff_t>(i));
    }
  }

  // The router dies (kill -9): sequences nobody writes are freed at once; those a writer
  // may still write are renamed out of the routers' ids and wait for it (with the fence).
  void KillRouter(int router) {
    ++deaths_;
    std::vector<SeqId> ids;
    for (const auto& [id, seq] : seqs_) {
      if (seq.router == router && id < kFirstDrainingId) ids.push_back(id);
    }
    for (SeqId id : ids) {
      auto writer = std::find_if(writers_.begin(), writers_.end(), [&](const Writer& w) {
        return w.seq == id && !w.draining && !w.orphaned;
      });
      if (writer == writers_.end() || !fence_) {
        (void)ledger_->Free(id);
        seqs_.erase(id);
        if (writer != writers_.end()) writer->orphaned = true;  // it still writes
        continue;
      }
      const SeqId draining = next_draining_++;
      const absl::Status renamed = ledger_->Rename(id, draining);
      if (!renamed.ok()) {
        failure_ =
            "rename of sequence " + std::to_string(id) + ": " + std::string(renamed.message());
        return;
      }
      seqs_[draining] = seqs_[id];
      seqs_.erase(id);
      writer->seq = draining;
      writer->draining = true;
      ++renamed_;
    }
  }

  std::mt19937 rng_;
  const bool fence_;
  std::optional<BlockLedger> ledger_;
  std::vector<int32_t> prompts_[4];
  std::map<SeqId, Seq> seqs_;
  std::vector<Writer> writers_;  // in flight, orphaned ones included
  SeqId next_id_ = 1;
  SeqId next_draining_ = kFirstDrainingId;
  std::string failure_;
  int writers_started_ = 0;
  int renamed_ = 0;
  int deaths_ = 0;
};

std::vector<uint32_t> Seeds() {
  std::vector<uint32_t> seeds;
  for (uint32_t i = 0; i < 16; ++i) seeds.push_back(7100 + i);
  return seeds;
}

bool Selected(uint32_t seed) {
  const char* only = std::getenv("KVCM_LEDGER_WRITERS_SEED");
  return only == nullptr || static_cast<uint32_t>(std::strtoul(only, nullptr, 10)) == seed;
}

TEST(LedgerWritersPropertyTest, NoBlockIsHeldByTwoWritersWhenADeadRoutersSequencesDrain) {
  int writers = 0, renamed = 0;
  for (uint32_t seed : Seeds()) {
    if (!Selected(seed)) continue;
    WritersRun run(seed, /*fence=*/true);
    int op = 0;
    while (op < kOpsPerSeed && run.Step()) ++op;
    if (op == kOpsPerSeed) run.Finish();
    std::printf("ledger writers seed=%u %s (replay: KVCM_LEDGER_WRITERS_SEED=%u)\n", seed,
                run.Summary().c_str(), seed);
    EXPECT_EQ(run.failure(), "") << "seed " << seed << ", op " << op;
    writers += run.writers_started();
    renamed += run.renamed();
  }
  // The runs exercised what the property is about.
  if (std::getenv("KVCM_LEDGER_WRITERS_SEED") == nullptr) {
    EXPECT_GT(writers, 1000);
    EXPECT_GT(renamed, 100);
  }
}

// Without the fence the same runs hand a block to a second writer: the check can fail.
TEST(LedgerWritersPropertyTest, WithoutTheFenceABlockIsHandedToASecondWriter) {
  int broken = 0;
  for (uint32_t seed : Seeds()) {
    if (!Selected(seed)) continue;
    WritersRun run(seed, /*fence=*/false);
    int op = 0;
    while (op < kOpsPerSeed && run.Step()) ++op;
    if (!run.failure().empty()) {
      ++broken;
      std::printf("ledger writers without fence seed=%u: op %d: %s\n", seed, op,
                  run.failure().c_str());
    }
  }
  if (std::getenv("KVCM_LEDGER_WRITERS_SEED") == nullptr) {
    EXPECT_GT(broken, 8);
  }
}

}  // namespace
}  // namespace kvcm
