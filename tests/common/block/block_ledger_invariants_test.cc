// BlockLedger::CheckInvariants finds each kind of broken ledger: every test builds a ledger
// whose invariants hold (a live sequence, cached blocks on the LRU, a pin, a hold, free
// blocks), breaks one of them through BlockLedgerTestPeer, and expects INTERNAL naming it.
// Every other test of the ledger relies on CheckInvariants; these show it can fail.

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "common/block/block_ledger.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/common/block/ledger_test_util.h"
#include "tests/support/status_matchers.h"

namespace kvcm {

class BlockLedgerTestPeer {
 public:
  explicit BlockLedgerTestPeer(BlockLedger* ledger) : l_(*ledger) {}

  void AddHoldTotal() { ++l_.holds_total_; }
  void AddRef(BlockId b) { ++l_.meta_[b].ref; }
  void CommitPastTokens(SeqId seq) {
    BlockLedger::Sequence& s = SequenceOf(seq);
    s.num_committed = s.num_tokens + 1;
  }
  void DropLastBlock(SeqId seq) { SequenceOf(seq).blocks.pop_back(); }
  void MarkInLru(BlockId b) { l_.meta_[b].flags |= BlockLedger::kInLru; }
  void AddInUseCount() { ++l_.in_use_blocks_; }
  void RepeatFirstLruEntry() {
    for (size_t i = l_.lru_front_; i < l_.lru_ring_.size(); ++i) {
      if (l_.LruEntryLive(l_.lru_ring_[i])) {
        l_.lru_ring_.push_back(l_.lru_ring_[i]);
        return;
      }
    }
    FAIL() << "no live LRU entry";
  }
  void AddPin(BlockId b) { ++l_.meta_[b].pins; }
  void SetDuplicateFlag(BlockId b) { l_.meta_[b].flags |= BlockLedger::kDuplicate; }

 private:
  BlockLedger::Sequence& SequenceOf(SeqId seq) {
    int32_t slot = -1;
    l_.seq_index_.ForEach([&](SeqId id, int32_t s) {
      if (id == seq) slot = s;
    });
    EXPECT_GE(slot, 0) << "no sequence " << seq;
    return l_.slots_[static_cast<size_t>(slot)];
  }

  BlockLedger& l_;
};

namespace {

using ::kvcm::testing::HashesOf;
using ::kvcm::testing::Iota;
using ::testing::HasSubstr;

constexpr int32_t kBlockSize = 4;

// 12 blocks: sequence 1 holds blocks 0..2 (two full, committed and indexed, one partial);
// sequence 2's two committed blocks (3, 4) were freed and wait on the LRU; block 0 is
// pinned; block 1 is held; the rest are free.
BlockLedger MakeWholeLedger() {
  BlockLedger::Options options;
  options.num_blocks = 12;
  options.block_size = kBlockSize;
  auto created = BlockLedger::Create(options);
  EXPECT_THAT(created, IsOk());
  BlockLedger ledger = std::move(created).value();
  const std::vector<int32_t> one = Iota(2 * kBlockSize + 1);
  std::vector<int32_t> two = Iota(2 * kBlockSize, 1000);
  EXPECT_THAT(ledger.Allocate(1, 2 * kBlockSize + 1), IsOk());
  EXPECT_THAT(ledger.Commit(1, 2 * kBlockSize + 1, HashesOf(one, kBlockSize)), IsOk());
  EXPECT_THAT(ledger.Allocate(2, 2 * kBlockSize), IsOk());
  EXPECT_THAT(ledger.Commit(2, 2 * kBlockSize, HashesOf(two, kBlockSize)), IsOk());
  EXPECT_THAT(ledger.Free(2), IsOk());
  const std::vector<BlockHash> hashes = HashesOf(one, kBlockSize);
  EXPECT_THAT(ledger.Pin("system", std::span(hashes).first(1)), IsOk());
  EXPECT_THAT(ledger.Hold(1), IsOk());
  EXPECT_THAT(ledger.CheckInvariants(), IsOk());
  return ledger;
}

struct Breakage {
  std::string name;
  std::function<void(BlockLedgerTestPeer&)> apply;
  std::string message;  // what CheckInvariants' error names
};

class CheckInvariantsTest : public ::testing::TestWithParam<Breakage> {};

TEST_P(CheckInvariantsTest, FindsTheBrokenInvariant) {
  BlockLedger ledger = MakeWholeLedger();
  BlockLedgerTestPeer peer(&ledger);
  GetParam().apply(peer);
  const absl::Status status = ledger.CheckInvariants();
  EXPECT_EQ(status.code(), absl::StatusCode::kInternal) << status;
  EXPECT_THAT(status.message(), HasSubstr(GetParam().message));
}

INSTANTIATE_TEST_SUITE_P(
    EachPass, CheckInvariantsTest,
    ::testing::Values(
        Breakage{"HoldsTotal", [](BlockLedgerTestPeer& p) { p.AddHoldTotal(); }, "holds total"},
        Breakage{"CommittedPastTheTokens", [](BlockLedgerTestPeer& p) { p.CommitPastTokens(1); },
                 "committed"},
        Breakage{"BlockTableShort", [](BlockLedgerTestPeer& p) { p.DropLastBlock(1); },
                 "blocks for"},
        Breakage{"RefCount", [](BlockLedgerTestPeer& p) { p.AddRef(2); }, "ref count"},
        Breakage{"FreeBlockOnTheLru", [](BlockLedgerTestPeer& p) { p.MarkInLru(11); },
                 "free block 11 not (only) in the free set"},
        Breakage{"DuplicateFlagWithoutADuplicate",
                 [](BlockLedgerTestPeer& p) { p.SetDuplicateFlag(2); }, "duplicate block 2"},
        Breakage{"InUseCount", [](BlockLedgerTestPeer& p) { p.AddInUseCount(); }, "in-use count"},
        Breakage{"LruEntryTwice", [](BlockLedgerTestPeer& p) { p.RepeatFirstLruEntry(); },
                 "twice in the LRU"},
        Breakage{"PinCount", [](BlockLedgerTestPeer& p) { p.AddPin(0); }, "pin count"}),
    [](const ::testing::TestParamInfo<Breakage>& param) { return param.param.name; });

}  // namespace
}  // namespace kvcm
