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

#include "tests/faults/launched_stack.h"
#include "tests/support/wait_for.h"

namespace kvcm::faults {
namespace {

using testing::HttpPost;
using testing::HttpResponse;

// Prompts long enough to fill many 4-token blocks, distinct from their first byte.
std::vector<std::string> LongPrompts() {
  std::vector<std::string> prompts;
  for (int p = 0; p < 3; ++p) {
    std::string text;
    for (int i = 0; text.size() < 160; ++i) {
      text += std::string(1, static_cast<char>('a' + p)) + absl::StrCat(" tiered cache line ", i, "; ");
    }
    prompts.push_back(text);
  }
  return prompts;
}

class TierRestartTest : public LaunchedStackTest {
 protected:
  TierRestartTest() : LaunchedStackTest("kvcm-tier-restart") {}

  std::vector<std::string> TierFlags() const {
    return {"--cache-manager-arg=--disk-tier-dir=" + dir_->path() + "/tier",
            "--cache-manager-arg=--disk-tier-bytes=64MiB",
            "--cache-manager-arg=--host-tier-bytes=8MiB"};
  }

  // POST /v1/completions, greedy: the usage's cached prompt tokens and the prompt tokens.
  std::pair<int, int> CachedTokens(const std::string& text) const {
    const json body = {{"model", "tiny"}, {"prompt", text}, {"max_tokens", 4},
                       {"temperature", 0}};
    absl::StatusOr<HttpResponse> reply = HttpPost(url_ + "/v1/completions", body.dump());
    EXPECT_THAT(reply, IsOk());
    if (!reply.ok()) return {-1, -1};
    EXPECT_EQ(reply->status, 200) << reply->body;
    const json parsed = json::parse(reply->body, nullptr, /*allow_exceptions=*/false);
    if (!parsed.is_object() || !parsed.contains("usage")) return {-1, -1};
    return {parsed["usage"]["prompt_tokens_details"]["cached_tokens"].get<int>(),
            parsed["usage"]["prompt_tokens"].get<int>()};
  }

  // The cache manager's value of one series (its whole name with labels); -1 when absent.
  double Metric(const std::string& series) const {
    absl::StatusOr<HttpResponse> reply = testing::HttpGet(CacheManagerMetricsUrl(), absl::Seconds(2));
    if (!reply.ok() || reply->status != 200) return -1;
    for (absl::string_view line : absl::StrSplit(reply->body, '\n')) {
      if (absl::StartsWith(line, series + " ")) {
        return std::stod(std::string(line.substr(series.size() + 1)));
      }
    }
    return -1;
  }

  // Until the disk tier has written at least `blocks` blocks (the write-through is the
  // mover's, after the step that committed them).
  void AwaitStoredOnDisk(double blocks) const {
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    double stored = -1;
    while (absl::Now() < deadline) {
      stored = Metric("kvcm_cache_manager_tier_stored_blocks_total{tier=\"disk\"}");
      if (stored >= blocks) return;
      absl::SleepFor(absl::Milliseconds(50));
    }
    FAIL() << "the disk tier stored " << stored << " blocks, want " << blocks;
  }

  // Every prompt once, with its reference tokens; returns the full blocks they commit.
  int ServeAll(const std::vector<std::string>& prompts) {
    int blocks = 0;
    for (const std::string& text : prompts) {
      const Outcome outcome = Request(text, 6, absl::Seconds(60));
      EXPECT_EQ(outcome.kind, "completed") << outcome.detail;
      blocks += static_cast<int>(text.size() + 1) / 4;  // BOS and one token per byte
    }
    return blocks;
  }

  // SIGKILL to every process of the stack at once, and until each has exited (its
  // descriptors closed: the disk directory's lock free), as after a node's crash.
  void KillEverything() {
    const std::vector<pid_t> pids = AllPids();
    for (pid_t pid : pids) ::kill(pid, SIGKILL);
    ASSERT_THAT(launch_->Signal(SIGKILL), IsOk());
    ASSERT_THAT(launch_->Wait(absl::Seconds(30)), IsOk());
    for (pid_t pid : pids) {
      ASSERT_THAT(testing::WaitFor([&] { return Exited(pid); }, absl::Seconds(30),
                                   absl::StrCat("pid ", pid, " to exit")),
                  IsOk());
    }
  }
  // Gone, or a zombie (its descriptors are closed).
  static bool Exited(pid_t pid) {
    const std::string stat = testing::ReadFileOrEmpty(absl::StrCat("/proc/", pid, "/stat"));
    if (stat.empty()) return true;
    const size_t close = stat.rfind(')');
    return close != std::string::npos && close + 2 < stat.size() && stat[close + 2] == 'Z';
  }

  void ExpectIdle() {
    std::optional<Scrape> last;
    EXPECT_TRUE(AwaitIdle(absl::Seconds(20), &last)) << "blocks still held after the requests";
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
