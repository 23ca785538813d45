// KvTiers on a real shm pool, a real host tier and a real disk tier in a fresh directory:
// write-through and loads byte for byte, the LRU of a full host tier, a damaged disk slot,
// a restart, cancelled stores and a disk tier of another model. Results come from the mover
// threads: the tests wait on wake_fd() with poll(2), never for a fixed time.

#include "services/cache_manager/tiers/kv_tiers.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstring>
#include <iostream>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/services/cache_manager/tier_test_env.h"
#include "tests/support/status_matchers.h"
#include "tests/support/wait_for.h"

namespace kvcm::cache_manager::tiers {
namespace {

using testenv::Env;
using testenv::HashOf;
using testenv::PollUntil;
using Done = KvTiers::Done;

constexpr uint64_t kSeed = 20250611;

void FlipByte(const std::string& path, uint64_t offset) {
  const int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  ASSERT_GE(fd, 0) << path << ": " << std::strerror(errno);
  uint8_t byte = 0;
  ASSERT_EQ(::pread(fd, &byte, 1, static_cast<off_t>(offset)), 1);
  byte ^= 0x5A;
  ASSERT_EQ(::pwrite(fd, &byte, 1, static_cast<off_t>(offset)), 1);
  ::close(fd);
}

class KvTiersTest : public ::testing::Test {
 protected:
  KvTiersTest() : env_(8) {
    RecordProperty("seed", std::to_string(kSeed));
    std::cout << "random data seed " << kSeed << "\n";
  }

  // Polls into done_ until `done` holds.
  void PollTill(KvTiers& tiers, const std::function<bool()>& done) {
    ASSERT_TRUE(PollUntil(
        tiers.wake_fd(), [&] { tiers.Poll(&done_); }, done))
        << "hang guard: the movers never reported";
  }
  int CountDone(Done::Kind kind, BlockId block) const {
    int n = 0;
    for (const Done& d : done_) n += d.kind == kind && d.block == block;
    return n;
  }
  static bool Idle(const KvTiers& tiers) {
    const TierSnapshot s = tiers.Snapshot();
    return s.queued_stores == 0 && s.queued_loads == 0 && s.writing[0] == 0 && s.writing[1] == 0;
  }

  // Fills pool block `block` with seed `seed`, stores it as `hash` and waits until it is
  // released and written. Returns its bytes.
  std::vector<uint8_t> StoreAndWait(KvTiers& tiers, BlockId block, const BlockHash& hash,
                                    uint64_t seed, BlockLineage lineage = {}) {
    std::vector<uint8_t> bytes = env_.FillBlock(block, seed);
    EXPECT_TRUE(tiers.WantStore(hash));
    tiers.Store(block, hash, std::move(lineage));
    tiers.Flush();
    EXPECT_FALSE(tiers.WantStore(hash));  // being written
    const int before = CountDone(Done::Kind::kReleased, block);
    PollTill(tiers,
             [&] { return CountDone(Done::Kind::kReleased, block) == before + 1 && Idle(tiers); });
    const BlockHash one[] = {hash};
    EXPECT_EQ(tiers.LeadingReady(one), 1);
    return bytes;
  }

  // Loads `hash` into pool block `block` (cleared first) and returns the result.
  Done LoadAndWait(KvTiers& tiers, uint64_t ticket, BlockId block, const BlockHash& hash) {
    env_.ClearBlock(block);
    tiers.Load(ticket, block, hash);
    tiers.Flush();
    Done result;
    bool found = false;
    PollTill(tiers, [&] {
      for (const Done& d : done_) {
        if (d.ticket == ticket && d.kind != Done::Kind::kReleased) {
          result = d;
          found = true;
        }
      }
      return found;
    });
    EXPECT_EQ(result.block, block);
    return result;
  }

  Env env_;
  std::vector<Done> done_;
};

TEST_F(KvTiersTest, HostTierRoundTrip) {
  auto tiers = env_.MakeTiers(env_.Options(/*host_blocks=*/4, /*disk_slots=*/0));
  ASSERT_NE(tiers, nullptr);
  const std::vector<uint8_t> bytes = StoreAndWait(*tiers, 0, HashOf(0), kSeed);
  EXPECT_EQ(tiers->SourceOf(HashOf(0)), Tier::kHost);
  const Done loaded = LoadAndWait(*tiers, 7, 3, HashOf(0));
  EXPECT_EQ(loaded.kind, Done::Kind::kLoaded);
  EXPECT_EQ(loaded.tier, Tier::kHost);
  EXPECT_EQ(env_.ReadBlock(3), bytes);
  const TierSnapshot s = tiers->Snapshot();
  EXPECT_EQ(s.slots[0], 4);
  EXPECT_EQ(s.slots[1], 0);
  EXPECT_EQ(s.ready[0], 1);
  EXPECT_EQ(s.counters.stored[0], 1u);
  EXPECT_EQ(s.counters.loaded[0], 1u);
  EXPECT_EQ(s.counters.stored[1], 0u);
  EXPECT_EQ(tiers->TakeLoadSeconds().size(), 1u);
}

TEST_F(KvTiersTest, DiskTierRoundTrip) {
  auto tiers = env_.MakeTiers(env_.Options(/*host_blocks=*/0, /*disk_slots=*/8));
  ASSERT_NE(tiers, nullptr);
  const std::vector<uint8_t> bytes = StoreAndWait(*tiers, 1, HashOf(1), kSeed + 1);
  EXPECT_EQ(tiers->SourceOf(HashOf(1)), Tier::kDisk);
  const Done loaded = LoadAndWait(*tiers, 9, 4, HashOf(1));
  EXPECT_EQ(loaded.kind, Done::Kind::kLoaded);
  EXPECT_EQ(loaded.tier, Tier::kDisk);
  EXPECT_EQ(env_.ReadBlock(4), bytes);
  const TierSnapshot s = tiers->Snapshot();
  EXPECT_EQ(s.slots[1], 8);
  EXPECT_EQ(s.counters.stored[1], 1u);
  EXPECT_EQ(s.counters.loaded[1], 1u);
  EXPECT_GT(s.counters.bytes_written, 0u);
  EXPECT_GT(s.counters.bytes_read, 0u);
}

TEST_F(KvTiersTest, BothTiersLoadFromHost) {
  auto tiers = env_.MakeTiers(env_.Options(/*host_blocks=*/4, /*disk_slots=*/8));
  ASSERT_NE(tiers, nullptr);
  const std::vector<uint8_t> bytes = StoreAndWait(*tiers, 2, HashOf(2), kSeed + 2);
  const TierSnapshot s = tiers->Snapshot();
  EXPECT_EQ(s.counters.stored[0], 1u);
  EXPECT_EQ(s.counters.stored[1], 1u);
  EXPECT_EQ(tiers->SourceOf(HashOf(2)), Tier::kHost);
  const Done loaded = LoadAndWait(*tiers, 11, 5, HashOf(2));
  EXPECT_EQ(loaded.kind, Done::Kind::kLoaded);
  EXPECT_EQ(loaded.tier, Tier::kHost);
  EXPECT_EQ(env_.ReadBlock(5), bytes);
  EXPECT_EQ(tiers->Snapshot().counters.loaded[1], 0u);
}

TEST_F(KvTiersTest, LeadingReadyCountsLeadingStoredHashesOnly) {
  auto tiers = env_.MakeTiers(env_.Options(4, 0));
  ASSERT_NE(tiers, nullptr);
  StoreAndWait(*tiers, 0, HashOf(0), kSeed);
  StoreAndWait(*tiers, 2, HashOf(2), kSeed + 2);
  const BlockHash gap[] = {HashOf(0), HashOf(1), HashOf(2)};
  EXPECT_EQ(tiers->LeadingReady(gap), 1);
  const BlockHash missing_first[] = {HashOf(1), HashOf(0)};
  EXPECT_EQ(tiers->LeadingReady(missing_first), 0);
  EXPECT_EQ(tiers->LeadingReady({}), 0);
  StoreAndWait(*tiers, 1, HashOf(1), kSeed + 1);
  EXPECT_EQ(tiers->LeadingReady(gap), 3);
}

TEST_F(KvTiersTest, FullHostTierEvictsLeastRecentlyUsed) {
  auto tiers = env_.MakeTiers(env_.Options(/*host_blocks=*/2, 0));
  ASSERT_NE(tiers, nullptr);
  StoreAndWait(*tiers, 0, HashOf(0), kSeed);
  StoreAndWait(*tiers, 1, HashOf(1), kSeed + 1);
  StoreAndWait(*tiers, 2, HashOf(2), kSeed + 2);
  const BlockHash h0[] = {HashOf(0)}, h1[] = {HashOf(1)}, h2[] = {HashOf(2)};
  EXPECT_EQ(tiers->LeadingReady(h0), 0);
  EXPECT_EQ(tiers->LeadingReady(h1), 1);
  EXPECT_EQ(tiers->LeadingReady(h2), 1);
  EXPECT_EQ(tiers->Snapshot().counters.evicted[0], 1u);
  EXPECT_EQ(tiers->Snapshot().ready[0], 2);
  // A load makes its block the most recently used: block 1 (older) goes next, not block 2.
  EXPECT_EQ(LoadAndWait(*tiers, 1, 6, HashOf(1)).kind, Done::Kind::kLoaded);
  const std::vector<uint8_t> bytes3 = StoreAndWait(*tiers, 3, HashOf(3), kSeed + 3);
  EXPECT_EQ(tiers->LeadingReady(h1), 1);
  EXPECT_EQ(tiers->LeadingReady(h2), 0);
  EXPECT_EQ(LoadAndWait(*tiers, 2, 7, HashOf(3)).kind, Done::Kind::kLoaded);
  EXPECT_EQ(env_.ReadBlock(7), bytes3);
}

TEST_F(KvTiersTest, HostEvictionKeepsTheDiskCopy) {
  auto tiers = env_.MakeTiers(env_.Options(/*host_blocks=*/2, /*disk_slots=*/8));
  ASSERT_NE(tiers, nullptr);
  const std::vector<uint8_t> bytes0 = StoreAndWait(*tiers, 0, HashOf(0), kSeed);
  StoreAndWait(*tiers, 1, HashOf(1), kSeed + 1);
  StoreAndWait(*tiers, 2, HashOf(2), kSeed + 2);
  const BlockHash all[] = {HashOf(0), HashOf(1), HashOf(2)};
  EXPECT_EQ(tiers->LeadingReady(all), 3);
  EXPECT_EQ(tiers->SourceOf(HashOf(0)), Tier::kDisk);
  EXPECT_EQ(tiers->SourceOf(HashOf(2)), Tier::kHost);
  const Done loaded = LoadAndWait(*tiers, 3, 5, HashOf(0));
  EXPECT_EQ(loaded.kind, Done::Kind::kLoaded);
  EXPECT_EQ(loaded.tier, Tier::kDisk);
  EXPECT_EQ(env_.ReadBlock(5), bytes0);
}

TEST_F(KvTiersTest, FlippedByteOnDiskIsRefusedAndDropped) {
  auto tiers = env_.MakeTiers(env_.Options(0, /*disk_slots=*/8));
  ASSERT_NE(tiers, nullptr);
  StoreAndWait(*tiers, 0, HashOf(0), kSeed);
  // The first store takes slot 0: file 0 (8 slots in 4 files), offset 0; its data follows
  // the 4096-byte header.
  FlipByte(env_.disk_dir() + "/tier-0.kvcm", 4096 + 17);
  const Done failed = LoadAndWait(*tiers, 5, 3, HashOf(0));
  EXPECT_EQ(failed.kind, Done::Kind::kLoadFailed);
  EXPECT_EQ(failed.tier, Tier::kDisk);
  const TierSnapshot s = tiers->Snapshot();
  EXPECT_EQ(s.counters.refused[static_cast<size_t>(Refusal::kChecksum)], 1u);
  EXPECT_EQ(s.counters.load_failures, 1u);
  EXPECT_EQ(s.counters.loaded[1], 0u);
  EXPECT_EQ(s.ready[1], 0);
  const BlockHash h0[] = {HashOf(0)};
  EXPECT_EQ(tiers->LeadingReady(h0), 0);
  EXPECT_TRUE(tiers->WantStore(HashOf(0)));  // computed again, stored again
  StoreAndWait(*tiers, 0, HashOf(0), kSeed);
  EXPECT_EQ(LoadAndWait(*tiers, 6, 3, HashOf(0)).kind, Done::Kind::kLoaded);
}

// A request's loads from the disk tier in one Flush, up to disk_read_depth read at once by
// the one mover: each block verified alone, a damaged slot and a truncated one refused by
// reason among loads that succeed, every good block's bytes exact.
class KvTiersReadDepthTest : public KvTiersTest, public ::testing::WithParamInterface<int32_t> {};

TEST_P(KvTiersReadDepthTest, LoadsReadTogetherAreEachVerified) {
  TierOptions options = env_.Options(0, /*disk_slots=*/8);
  options.disk_read_depth = GetParam();
  auto tiers = env_.MakeTiers(options);
  ASSERT_NE(tiers, nullptr);
  // Block i in slot i (the lowest free slot first): 8 slots in 4 files, 2 in each.
  std::vector<std::vector<uint8_t>> bytes;
  for (int i = 0; i < 8; ++i) {
    bytes.push_back(StoreAndWait(*tiers, 0, HashOf(i), kSeed + static_cast<uint64_t>(i)));
  }
  FlipByte(env_.disk_dir() + "/tier-1.kvcm", 4096 + 17);  // slot 2's data
  // File 3 cut 100 bytes into its second slot: slot 6 whole, slot 7 read short.
  ASSERT_EQ(::truncate((env_.disk_dir() + "/tier-3.kvcm").c_str(),
                       static_cast<off_t>(testenv::kDiskSlotBytes + 100)),
            0);
  for (BlockId b = 1; b < 8; ++b) env_.ClearBlock(b);
  for (int i = 1; i < 8; ++i) tiers->Load(static_cast<uint64_t>(100 + i), i, HashOf(i));
  tiers->Flush();
  std::map<uint64_t, Done> results;
  PollTill(*tiers, [&] {
    for (const Done& d : done_) {
      if (d.ticket >= 100 && d.kind != Done::Kind::kReleased) results[d.ticket] = d;
    }
    return results.size() == 7;
  });
  for (int i = 1; i < 8; ++i) {
    const Done& d = results[static_cast<uint64_t>(100 + i)];
    EXPECT_EQ(d.block, i);
    EXPECT_EQ(d.tier, Tier::kDisk);
    if (i == 2 || i == 7) {
      EXPECT_EQ(d.kind, Done::Kind::kLoadFailed) << "block " << i;
      continue;
    }
    EXPECT_EQ(d.kind, Done::Kind::kLoaded) << "block " << i;
    EXPECT_EQ(env_.ReadBlock(i), bytes[static_cast<size_t>(i)]) << "block " << i;
  }
  const TierSnapshot s = tiers->Snapshot();
  EXPECT_EQ(s.counters.refused[static_cast<size_t>(Refusal::kChecksum)], 1u);
  EXPECT_EQ(s.counters.refused[static_cast<size_t>(Refusal::kTruncated)], 1u);
  EXPECT_EQ(s.counters.load_failures, 2u);
  EXPECT_EQ(s.counters.loaded[1], 5u);
  EXPECT_EQ(s.ready[1], 6);  // the two refused slots left the index
  const BlockHash two[] = {HashOf(2)};
  EXPECT_EQ(tiers->LeadingReady(two), 0);
}

INSTANTIATE_TEST_SUITE_P(Depths, KvTiersReadDepthTest, ::testing::Values(1, 4),
                         [](const ::testing::TestParamInfo<int32_t>& param) {
                           return absl::StrCat("Depth", param.param);
                         });

TEST_F(KvTiersTest, ReadDepthOutOfRangeIsRefusedNamingTheFlag) {
  TierOptions options = env_.Options(0, 8);
  for (const int32_t depth : {0, 65}) {
    options.disk_read_depth = depth;
    const absl::Status s = CheckTierOptions(options);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << depth;
    EXPECT_THAT(s.message(), ::testing::HasSubstr("--disk-tier-read-depth")) << depth;
  }
  options.disk_read_depth = 64;
  EXPECT_THAT(CheckTierOptions(options), IsOk());
}

TEST_F(KvTiersTest, RestartRecoversTheDiskTier) {
  std::vector<std::vector<uint8_t>> bytes;
  {
    auto tiers = env_.MakeTiers(env_.Options(2, 8));
    ASSERT_NE(tiers, nullptr);
    for (int i = 0; i < 3; ++i) {
      bytes.push_back(StoreAndWait(*tiers, i, HashOf(i), kSeed + static_cast<uint64_t>(i)));
    }
  }
  for (BlockId b = 0; b < 8; ++b) env_.ClearBlock(b);
  auto tiers = env_.MakeTiers(env_.Options(2, 8));
  ASSERT_NE(tiers, nullptr);
  EXPECT_EQ(tiers->disk_report().recovered, 3);
  EXPECT_EQ(tiers->Snapshot().counters.recovered, 3u);
  EXPECT_EQ(tiers->Snapshot().ready[1], 3);
  EXPECT_EQ(tiers->Snapshot().ready[0], 0);
  const BlockHash all[] = {HashOf(0), HashOf(1), HashOf(2), HashOf(3)};
  EXPECT_EQ(tiers->LeadingReady(all), 3);
  for (int i = 0; i < 3; ++i) {
    EXPECT_FALSE(tiers->WantStore(HashOf(i)));
    const Done loaded = LoadAndWait(*tiers, 100 + static_cast<uint64_t>(i), 4 + i, HashOf(i));
    EXPECT_EQ(loaded.kind, Done::Kind::kLoaded) << i;
    EXPECT_EQ(loaded.tier, Tier::kDisk);
    EXPECT_EQ(env_.ReadBlock(4 + i), bytes[static_cast<size_t>(i)]) << i;
  }
  // Writes continue with new slots and serials: a fourth block survives another restart.
  StoreAndWait(*tiers, 3, HashOf(3), kSeed + 3);
  tiers.reset();
  tiers = env_.MakeTiers(env_.Options(2, 8));
  ASSERT_NE(tiers, nullptr);
  EXPECT_EQ(tiers->LeadingReady(all), 4);
}

// Block i's lineage in the event tests: parent HashOf(i - 1) (none for i = 0) and 4 tokens.
BlockLineage LineageOf(int i) {
  BlockLineage lineage;
  if (i > 0) {
    lineage.parent = HashOf(i - 1);
    lineage.has_parent = true;
  }
  for (int32_t t = 0; t < 4; ++t) lineage.tokens.push_back(100 * i + t);
  return lineage;
}

// "stored host 1", "removed disk 0", ... with the lineage checked against LineageOf.
std::vector<std::string> Describe(const std::vector<TierEvent>& events) {
  std::vector<std::string> out;
  for (const TierEvent& event : events) {
    int i = 0;
    while (i < 100 && !(HashOf(i) == event.hash)) ++i;
    const bool stored = event.kind == TierEvent::Kind::kStored;
    out.push_back(
        absl::StrCat(stored ? "stored " : "removed ", std::string(TierName(event.tier)), " ", i));
    if (!stored) continue;
    const BlockLineage want = LineageOf(i);
    EXPECT_EQ(event.lineage.has_parent, want.has_parent) << out.back();
    if (want.has_parent) {
      EXPECT_EQ(event.lineage.parent, want.parent) << out.back();
    }
    EXPECT_EQ(event.lineage.tokens, want.tokens) << out.back();
  }
  return out;
}

TEST_F(KvTiersTest, EventsAnnounceWhatEachTierGainsAndLosesWithTheBlocksLineage) {
  TierOptions options = env_.Options(/*host_blocks=*/2, /*disk_slots=*/8);
  options.record_events = true;
  auto tiers = env_.MakeTiers(options);
  ASSERT_NE(tiers, nullptr);
  EXPECT_FALSE(tiers->has_events());  // an empty disk tier recovered nothing
  for (int i = 0; i < 3; ++i) {
    StoreAndWait(*tiers, i, HashOf(i), kSeed + static_cast<uint64_t>(i), LineageOf(i));
  }
  EXPECT_TRUE(tiers->has_events());
  // Block 2's store took block 0's host slot, the least recently used: removed from the
  // host tier when the store was staged, before block 2 was written.
  EXPECT_THAT(
      Describe(tiers->TakeEvents()),
      ::testing::ElementsAre("stored host 0", "stored disk 0", "stored host 1", "stored disk 1",
                             "removed host 0", "stored host 2", "stored disk 2"));
  EXPECT_FALSE(tiers->has_events());
  // A disk slot refused at load is gone from the disk tier: announced removed.
  FlipByte(env_.disk_dir() + "/tier-0.kvcm", 4096 + 17);  // block 0's slot 0
  EXPECT_EQ(LoadAndWait(*tiers, 5, 6, HashOf(0)).kind, Done::Kind::kLoadFailed);
  EXPECT_THAT(Describe(tiers->TakeEvents()), ::testing::ElementsAre("removed disk 0"));
}

TEST_F(KvTiersTest, RecoveredBlocksAreAnnouncedEachAfterItsParent) {
  {
    auto tiers = env_.MakeTiers(env_.Options(0, 8));
    ASSERT_NE(tiers, nullptr);
    // Children first, so that slot order (the order of the scan) is not chain order: slots
    // 0..2 hold blocks 3, 2, 1; block 0 (the root) is never stored; block 6's parent 5 is
    // not on disk either.
    for (int i : {3, 2, 1, 6}) {
      StoreAndWait(*tiers, i, HashOf(i), kSeed + static_cast<uint64_t>(i), LineageOf(i));
    }
    EXPECT_FALSE(tiers->has_events());  // record_events off: nothing kept
  }
  TierOptions options = env_.Options(0, 8);
  options.record_events = true;
  auto tiers = env_.MakeTiers(options);
  ASSERT_NE(tiers, nullptr);
  EXPECT_THAT(
      Describe(tiers->TakeEvents()),
      ::testing::ElementsAre("stored disk 1", "stored disk 2", "stored disk 3", "stored disk 6"));
}

TEST_F(KvTiersTest, CancelQueuedStoresReturnsEachUnstartedBlockOnce) {
  auto tiers = env_.MakeTiers(env_.Options(8, 8));
  ASSERT_NE(tiers, nullptr);
  constexpr int kStores = 6;
  for (int i = 0; i < kStores; ++i) {
    env_.FillBlock(i, kSeed + static_cast<uint64_t>(i));
    tiers->Store(i, HashOf(i));
    if (i % 2 == 1) tiers->Flush();  // the movers may start some; others wait, staged
  }
  const std::vector<BlockId> cancelled = tiers->CancelQueuedStores();
  EXPECT_EQ(tiers->queued_stores(), 0);
  std::cout << cancelled.size() << " of " << kStores << " stores cancelled\n";
  // Every store is either cancelled or released, never both, never twice.
  std::multiset<BlockId> released;
  PollTill(*tiers, [&] {
    released.clear();
    for (const Done& d : done_) {
      if (d.kind == Done::Kind::kReleased) released.insert(d.block);
    }
    return released.size() + cancelled.size() == kStores && Idle(*tiers);
  });
  std::multiset<BlockId> all(cancelled.begin(), cancelled.end());
  all.insert(released.begin(), released.end());
  EXPECT_EQ(all, (std::multiset<BlockId>{0, 1, 2, 3, 4, 5}));
  const TierSnapshot s = tiers->Snapshot();
  EXPECT_EQ(s.counters.stores_dropped, cancelled.size());
  EXPECT_EQ(s.ready[0], static_cast<int32_t>(released.size()));
  EXPECT_EQ(s.ready[1], static_cast<int32_t>(released.size()));
  for (int i = 0; i < kStores; ++i) {
    const BlockHash h[] = {HashOf(i)};
    const bool was_cancelled = all.count(i) == 1 && released.count(i) == 0;
    EXPECT_EQ(tiers->LeadingReady(h), was_cancelled ? 0 : 1) << i;
    EXPECT_EQ(tiers->WantStore(HashOf(i)), was_cancelled) << i;
  }
  // A cancelled store's slots are free again: the tiers take as many blocks as before.
  for (BlockId b : cancelled) StoreAndWait(*tiers, b, HashOf(b), kSeed + 50);
  EXPECT_EQ(tiers->Snapshot().ready[0], kStores);
}

TEST_F(KvTiersTest, DiskTierOfAnotherModelRecoversNothing) {
  {
    auto tiers = env_.MakeTiers(env_.Options(0, 8));
    ASSERT_NE(tiers, nullptr);
    StoreAndWait(*tiers, 0, HashOf(0), kSeed);
    StoreAndWait(*tiers, 1, HashOf(1), kSeed + 1);
  }
  const std::string other = env_.root() + "/other-model.gguf";
  Env::WriteModel(other, 2);
  TierOptions options = env_.Options(0, 8);
  options.model_path = other;
  auto tiers = env_.MakeTiers(options);
  ASSERT_NE(tiers, nullptr);
  EXPECT_EQ(tiers->disk_report().recovered, 0);
  EXPECT_EQ(tiers->disk_report().refused[static_cast<size_t>(Refusal::kOtherIdentity)], 2);
  EXPECT_EQ(tiers->Snapshot().counters.recovered, 0u);
  const BlockHash both[] = {HashOf(0), HashOf(1)};
  EXPECT_EQ(tiers->LeadingReady(both), 0);
  EXPECT_TRUE(tiers->WantStore(HashOf(0)));
  // And the first model's tier, opened again, still has them.
  tiers.reset();
  tiers = env_.MakeTiers(env_.Options(0, 8));
  ASSERT_NE(tiers, nullptr);
  EXPECT_EQ(tiers->LeadingReady(both), 2);
}

// The movers sync the disk tier on their own, never the ledger thread: until unsynced_writes
// is 0 (a poll of the snapshot: a sync posts no result).
bool AwaitSynced(const KvTiers& tiers) {
  return kvcm::testing::WaitFor([&] { return tiers.Snapshot().unsynced_writes == 0; },
                                absl::Now() + testenv::kHangGuard, "the disk tier's sync")
      .ok();
}

TEST_F(KvTiersTest, MoversSyncTheDiskTierAtMostOncePerInterval) {
  TierOptions options = env_.Options(/*host_blocks=*/0, /*disk_slots=*/8);
  options.disk_sync_interval = absl::Hours(1);
  auto tiers = env_.MakeTiers(options);
  ASSERT_NE(tiers, nullptr);
  EXPECT_EQ(tiers->Snapshot().counters.syncs, 0u);
  // No sync before: the first write is synced at once.
  StoreAndWait(*tiers, 0, HashOf(0), kSeed);
  ASSERT_TRUE(AwaitSynced(*tiers)) << "the first write was never synced";
  EXPECT_EQ(tiers->Snapshot().counters.syncs, 1u);
  // The next one waits for the interval (an hour): written, not synced.
  StoreAndWait(*tiers, 1, HashOf(1), kSeed + 1);
  const TierSnapshot s = tiers->Snapshot();
  EXPECT_EQ(s.counters.stored[1], 2u);
  EXPECT_EQ(s.unsynced_writes, 1u);
  EXPECT_EQ(s.counters.syncs, 1u);
  EXPECT_EQ(s.counters.sync_errors, 0u);
}

TEST_F(KvTiersTest, ZeroSyncIntervalSyncsAfterEveryWrite) {
  TierOptions options = env_.Options(/*host_blocks=*/0, /*disk_slots=*/8);
  options.disk_sync_interval = absl::ZeroDuration();
  auto tiers = env_.MakeTiers(options);
  ASSERT_NE(tiers, nullptr);
  for (int i = 0; i < 3; ++i) {
    StoreAndWait(*tiers, i, HashOf(i), kSeed + static_cast<uint64_t>(i));
    ASSERT_TRUE(AwaitSynced(*tiers)) << "write " << i << " was never synced";
    EXPECT_EQ(tiers->Snapshot().counters.syncs, static_cast<uint64_t>(i + 1));
  }
}

TEST_F(KvTiersTest, NegativeSyncIntervalIsRefusedNamingTheFlag) {
  TierOptions options = env_.Options(/*host_blocks=*/0, /*disk_slots=*/8);
  options.disk_sync_interval = absl::Milliseconds(-1);
  const absl::Status checked = CheckTierOptions(options);
  EXPECT_TRUE(absl::IsInvalidArgument(checked)) << checked;
  EXPECT_THAT(std::string(checked.message()), ::testing::HasSubstr("--disk-tier-sync-ms"));
}

}  // namespace
}  // namespace kvcm::cache_manager::tiers
