// The host and disk tiers seen from outside (docs/architecture.md, "Tiers"): the real stack
// of kvcm-launch (cache manager, router, executor of a tiny model) on a disk-tier directory,
// stopped or killed whole and started again on the same directory. The long prompts it
// served before must report at least 90% of their prompt tokens cached and give the same
// tokens; a slot file with flipped bytes, or the directory of another model, must serve
// nothing and change no output. The ledger is whole afterwards (no block in use).

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
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
  absl::StatusOr<std::unique_ptr<LlamaModel>> model = LlamaModel::Load(model_dir_);
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

}  // namespace
}  // namespace kvcm::faults
