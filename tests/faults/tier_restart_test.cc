// The host and disk tiers seen from outside (docs/architecture.md, "Tiers"): the real stack
// of kvcm-launch (cache manager, router, executor of a tiny model) on a disk-tier directory,
// stopped or killed whole and started again on the same directory. The long prompts it
// served before must report at least 90% of their prompt tokens cached and give the same
// tokens; a slot file with flipped bytes, or the directory of another model, must serve
// nothing and change no output. The ledger is whole afterwards (no block in use).
//
// Killed once the disk tier reports every write done and synced (no block in use or held,
// no slot being written, kvcm_cache_manager_tier_unsynced_writes 0: polled, never slept
// for), the cache manager alone or every process: every full block of every prompt must be
// recovered, and each prompt sent again must report all of them cached and give the same
// greedy tokens.

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <iostream>
#include <regex>
#include <string>
#include <vector>

#include "tests/faults/tier_stack.h"
#include "tests/support/wait_for.h"

namespace kvcm::faults {
namespace {

class TierRestartTest : public TierStackTest {
 protected:
  TierRestartTest() : TierStackTest("kvcm-tier-restart") {}

  std::vector<std::string> TierFlags() const {
    return {"--cache-manager-arg=--disk-tier-dir=" + dir_->path() + "/tier",
            "--cache-manager-arg=--disk-tier-bytes=64MiB",
            "--cache-manager-arg=--host-tier-bytes=8MiB"};
  }
  // TierFlags() with the disk syncs (through kvcm-launch's route of the flag), and loads that
  // never time out: what a prompt reports cached then depends on the disk alone.
  std::vector<std::string> SyncedTierFlags() const {
    std::vector<std::string> flags = TierFlags();
    flags.push_back("--disk-tier-sync-ms=200");
    flags.push_back("--tier-load-timeout-ms=600000");
    return flags;
  }

  // Until one scrape of the cache manager shows no block in use (every request's blocks
  // committed and freed, none held for a store), no disk slot being written, every disk
  // write covered by a sync and a sync done: what the disk tier holds then survives a crash
  // of the process and of the machine. Returns the blocks stored on disk, -1 past the hang
  // guard.
  double AwaitDiskSynced() const {
    const std::vector<std::string> series = {
        "kvcm_cache_blocks{state=\"in_use\"}",
        "kvcm_cache_manager_tier_held_blocks",
        "kvcm_cache_manager_tier_blocks{tier=\"disk\",state=\"writing\"}",
        "kvcm_cache_manager_tier_unsynced_writes",
        "kvcm_cache_manager_tier_syncs_total",
        "kvcm_cache_manager_tier_stored_blocks_total{tier=\"disk\"}",
        "kvcm_cache_manager_tier_stores_dropped_total",
        "kvcm_cache_manager_tier_sync_errors_total"};
    std::vector<double> last;
    const absl::Status synced = testing::WaitFor(
        [&] {
          last = ScrapeSeries(CacheManagerMetricsUrl(), series);
          return last[0] == 0 && last[1] == 0 && last[2] == 0 && last[3] == 0 && last[4] > 0 &&
                 last[5] > 0;
        },
        absl::Seconds(60), "every disk write done and synced");
    std::string values;
    for (size_t i = 0; i < series.size(); ++i) {
      absl::StrAppend(&values, "\n  ", series[i], " ", last.empty() ? -1 : last[i]);
    }
    EXPECT_THAT(synced, IsOk()) << values;
    if (!synced.ok()) return -1;
    EXPECT_EQ(last[6], 0) << "stores dropped: their blocks were never written" << values;
    EXPECT_EQ(last[7], 0) << values;
    std::cout << "disk tier synced:" << values << "\n";
    return last[5];
  }

  // Until kvcm-launch has started the cache manager again after `old_pid` died and a
  // request completes with the model's tokens (a hang guard of 90 s).
  void AwaitCacheManagerRestarted(pid_t old_pid) {
    ASSERT_THAT(testing::WaitFor([&] { return CurrentPid("cache-manager") != old_pid; },
                                 absl::Seconds(90), "the cache manager to be started again"),
                IsOk())
        << testing::Tail(launch_->Output(), 6000);
    ASSERT_THAT(testing::WaitFor(
                    [&] {
                      return Request("probe after a restart", 2, absl::Seconds(10)).kind ==
                             "completed";
                    },
                    absl::Seconds(90), "a request to complete after the restart"),
                IsOk())
        << testing::Tail(launch_->Output(), 6000);
  }

  // Each prompt again: every full block but the one holding its last token (computed anyway,
  // for its logits) cached, all of them loaded from disk, and the model's greedy tokens.
  void ExpectEveryFullBlockFromDisk(const std::vector<std::string>& prompts) {
    int want_loaded = 0;
    for (const std::string& text : prompts) {
      const auto [cached, total] = CachedTokens(text);
      EXPECT_EQ(cached, (total - 1) / 4 * 4) << "'" << text << "': " << cached << " of " << total;
      want_loaded += (total - 1) / 4;
      const Outcome outcome = Request(text, 6, absl::Seconds(60));
      EXPECT_EQ(outcome.kind, "completed") << outcome.detail;
    }
    EXPECT_GE(Metric("kvcm_cache_manager_tier_loaded_blocks_total{tier=\"disk\"}"), want_loaded);
  }
};

TEST_F(TierRestartTest, KilledWholeAndRestartedTheLongPromptsComeFromDisk) {
  const std::vector<std::string> prompts = LongPrompts();
  ASSERT_NO_FATAL_FAILURE(Launch(/*executors=*/1, /*num_blocks=*/256, TierFlags()));
  AwaitStoredOnDisk(ServeAll(prompts) * 0.9);
  ASSERT_NO_FATAL_FAILURE(KillEverything());

  ASSERT_NO_FATAL_FAILURE(Launch(/*executors=*/1, /*num_blocks=*/256, TierFlags()));
  EXPECT_GT(Metric("kvcm_cache_manager_tier_recovered_blocks_total"), 0)
      << testing::Tail(launch_->Output(), 6000);
  for (const std::string& text : prompts) {
    const auto [cached, total] = CachedTokens(text);
    EXPECT_GE(cached, 0.9 * total) << "'" << text << "': " << cached << " of " << total;
    const Outcome outcome = Request(text, 6, absl::Seconds(60));
    EXPECT_EQ(outcome.kind, "completed") << outcome.detail;
  }
  EXPECT_GT(Metric("kvcm_cache_manager_tier_loaded_blocks_total{tier=\"disk\"}"), 0);
  ExpectIdle();
  ExpectCleanShutdown({});
}

TEST_F(TierRestartTest, StoppedCleanlyAndRestartedTheLongPromptsComeFromDisk) {
  const std::vector<std::string> prompts = LongPrompts();
  ASSERT_NO_FATAL_FAILURE(Launch(/*executors=*/1, /*num_blocks=*/256, TierFlags()));
  AwaitStoredOnDisk(ServeAll(prompts) * 0.9);
  ExpectCleanShutdown({});

  ASSERT_NO_FATAL_FAILURE(Launch(/*executors=*/1, /*num_blocks=*/256, TierFlags()));
  for (const std::string& text : prompts) {
    const auto [cached, total] = CachedTokens(text);
    EXPECT_GE(cached, 0.9 * total) << "'" << text << "': " << cached << " of " << total;
  }
  ExpectIdle();
  ExpectCleanShutdown({});
}

TEST_F(TierRestartTest, FlippedBytesInTheSlotsAreNeverServedAndChangeNoOutput) {
  const std::vector<std::string> prompts = LongPrompts();
  ASSERT_NO_FATAL_FAILURE(Launch(/*executors=*/1, /*num_blocks=*/256, TierFlags()));
  AwaitStoredOnDisk(ServeAll(prompts) * 0.9);
  ExpectCleanShutdown({});

  // Byte 100 of every 4 KiB page of every slot file flipped: in a slot's header page it
  // falls in the bytes its header checksum covers, in a data page within the block's bytes
  // (services/cache_manager/tiers/disk_tier.h).
  int files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir_->path() + "/tier")) {
    if (entry.path().extension() != ".kvcm") continue;
    ++files;
    const int fd = ::open(entry.path().c_str(), O_RDWR | O_CLOEXEC);
    ASSERT_GE(fd, 0);
    struct stat st {};
    ASSERT_EQ(::fstat(fd, &st), 0);
    for (off_t page = 0; page + 4096 <= st.st_size; page += 4096) {
      unsigned char byte = 0;
      if (::pread(fd, &byte, 1, page + 100) != 1) break;
      byte ^= 0x40;
      ASSERT_EQ(::pwrite(fd, &byte, 1, page + 100), 1);
    }
    ::close(fd);
  }
  ASSERT_GT(files, 0);

  // Restarted on the damaged directory: nothing damaged is served; the tokens are the
  // model's own.
  ASSERT_NO_FATAL_FAILURE(Launch(/*executors=*/1, /*num_blocks=*/256, TierFlags()));
  ServeAll(prompts);
  for (const std::string& text : prompts) {
    const auto [cached, total] = CachedTokens(text);
    EXPECT_GE(total, 100);
    (void)cached;
  }
  const double checksum = Metric("kvcm_cache_manager_tier_refusals_total{reason=\"checksum\"}");
  const double header = Metric("kvcm_cache_manager_tier_refusals_total{reason=\"bad_header\"}");
  EXPECT_GT(checksum + header, 0) << "no damaged slot was counted";
  EXPECT_EQ(Metric("kvcm_cache_manager_tier_loaded_blocks_total{tier=\"disk\"}"), 0);
  ExpectIdle();
  ExpectCleanShutdown({});
}

TEST_F(TierRestartTest, TheDirectoryOfAnotherModelServesNothing) {
  const std::vector<std::string> prompts = LongPrompts();
  ASSERT_NO_FATAL_FAILURE(Launch(/*executors=*/1, /*num_blocks=*/256, TierFlags()));
  AwaitStoredOnDisk(ServeAll(prompts) * 0.9);
  ExpectCleanShutdown({});

  // Another model (other weights, the same shape and tokenizer) on the same directory.
  model_dir_ = dir_->path() + "/other";
  ASSERT_THAT(testing::MakeTinyModel(model_dir_, /*seed=*/12), IsOk());
  absl::StatusOr<std::unique_ptr<executor::LlamaModel>> model =
      executor::LlamaModel::Load(model_dir_);
  ASSERT_THAT(model, IsOk());
  model_ = *std::move(model);
  ASSERT_NO_FATAL_FAILURE(Launch(/*executors=*/1, /*num_blocks=*/256, TierFlags()));
  EXPECT_EQ(Metric("kvcm_cache_manager_tier_recovered_blocks_total"), 0);
  EXPECT_GT(Metric("kvcm_cache_manager_tier_refusals_total{reason=\"other_identity\"}"), 0);
  ServeAll(prompts);  // the other model's tokens: computed, not read from the tier
  EXPECT_EQ(Metric("kvcm_cache_manager_tier_loaded_blocks_total{tier=\"disk\"}"), 0);
  ExpectIdle();
  ExpectCleanShutdown({});
}

TEST_F(TierRestartTest, CacheManagerKilledAfterTheLastSyncRecoversEveryFullBlock) {
  const std::vector<std::string> prompts = LongPrompts();
  ASSERT_NO_FATAL_FAILURE(Launch(/*executors=*/1, /*num_blocks=*/256, SyncedTierFlags()));
  const int full_blocks = ServeAll(prompts);
  const double stored = AwaitDiskSynced();
  ASSERT_GE(stored, full_blocks);

  const pid_t cache_manager = CurrentPid("cache-manager");
  ASSERT_GT(cache_manager, 0);
  ASSERT_EQ(::kill(cache_manager, SIGKILL), 0);
  ASSERT_NO_FATAL_FAILURE(AwaitCacheManagerRestarted(cache_manager));
  // Every block stored, none more: nothing was written after the scrape.
  EXPECT_EQ(Metric("kvcm_cache_manager_tier_recovered_blocks_total"), stored)
      << testing::Tail(launch_->Output(), 6000);
  ExpectEveryFullBlockFromDisk(prompts);
  ExpectIdle();
  ExpectCleanShutdown({});
}

TEST_F(TierRestartTest, EveryProcessKilledAfterTheLastSyncRecoversEveryFullBlock) {
  const std::vector<std::string> prompts = LongPrompts();
  ASSERT_NO_FATAL_FAILURE(Launch(/*executors=*/1, /*num_blocks=*/256, SyncedTierFlags()));
  const int full_blocks = ServeAll(prompts);
  const double stored = AwaitDiskSynced();
  ASSERT_GE(stored, full_blocks);
  ASSERT_NO_FATAL_FAILURE(KillEverything());

  ASSERT_NO_FATAL_FAILURE(Launch(/*executors=*/1, /*num_blocks=*/256, SyncedTierFlags()));
  EXPECT_EQ(Metric("kvcm_cache_manager_tier_recovered_blocks_total"), stored)
      << testing::Tail(launch_->Output(), 6000);
  ExpectEveryFullBlockFromDisk(prompts);
  ExpectIdle();
  ExpectCleanShutdown({});
}

}  // namespace
}  // namespace kvcm::faults
