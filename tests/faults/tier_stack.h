#pragma once

// The real stack of kvcm-launch with the host and disk tiers on (docs/architecture.md,
// "Tiers"), for tests/faults/tier_restart_test.cc and tests/faults/tier_fault_test.cc: the
// helpers both use on top of LaunchedStackTest (metrics, whole-stack kills, the long
// prompts, the tiers' ledger checks). Test support only.

#include <signal.h>
#include <sys/types.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "tests/faults/launched_stack.h"
#include "tests/support/wait_for.h"

namespace kvcm::faults {

// Prompt `p` of the tier tests: "<letter> tiered cache line 0; <letter> tiered cache line
// 1; ..." until it has at least `min_chars` bytes; distinct prompts from their first byte.
inline std::string TieredPrompt(int p, size_t min_chars) {
  std::string text;
  for (int i = 0; text.size() < min_chars; ++i) {
    text +=
        std::string(1, static_cast<char>('a' + p)) + absl::StrCat(" tiered cache line ", i, "; ");
  }
  return text;
}

// Prompts long enough to fill many 4-token blocks, distinct from their first byte.
inline std::vector<std::string> LongPrompts() {
  std::vector<std::string> prompts;
  for (int p = 0; p < 3; ++p) prompts.push_back(TieredPrompt(p, 160));
  return prompts;
}

// Gone, or a zombie (its descriptors are closed).
inline bool Exited(pid_t pid) {
  const std::string stat = testing::ReadFileOrEmpty(absl::StrCat("/proc/", pid, "/stat"));
  if (stat.empty()) return true;
  const size_t close = stat.rfind(')');
  return close != std::string::npos && close + 2 < stat.size() && stat[close + 2] == 'Z';
}

// The value of one series (its whole name with labels) in the exposition at `url`; -1 when
// it cannot be scraped or the series is absent.
inline double MetricAt(const std::string& url, const std::string& series) {
  if (url.empty()) return -1;
  absl::StatusOr<testing::HttpResponse> reply = testing::HttpGet(url, absl::Seconds(2));
  if (!reply.ok() || reply->status != 200) return -1;
  for (absl::string_view line : absl::StrSplit(reply->body, '\n')) {
    if (absl::StartsWith(line, series + " ")) {
      return std::stod(std::string(line.substr(series.size() + 1)));
    }
  }
  return -1;
}

// The values of `series` in one scrape of `url` (so that they are of one moment); -1 for
// each absent one, all -1 when it cannot be scraped.
inline std::vector<double> ScrapeSeries(const std::string& url,
                                        const std::vector<std::string>& series) {
  std::vector<double> values(series.size(), -1);
  if (url.empty()) return values;
  absl::StatusOr<testing::HttpResponse> reply = testing::HttpGet(url, absl::Seconds(2));
  if (!reply.ok() || reply->status != 200) return values;
  for (absl::string_view line : absl::StrSplit(reply->body, '\n')) {
    for (size_t i = 0; i < series.size(); ++i) {
      if (absl::StartsWith(line, series[i] + " ")) {
        values[i] = std::stod(std::string(line.substr(series[i].size() + 1)));
      }
    }
  }
  return values;
}

class TierStackTest : public LaunchedStackTest {
 protected:
  using LaunchedStackTest::LaunchedStackTest;

  // A test that stopped early (a failed ASSERT) leaves its stack running: kill every
  // process of it, so that none outlives the test as an orphan.
  void TearDown() override {
    if (launch_ == nullptr || launch_->Poll().has_value()) return;
    for (pid_t pid : AllPids()) {
      if (!Exited(pid)) ::kill(pid, SIGKILL);
    }
    (void)launch_->Signal(SIGKILL);
    (void)launch_->Wait(absl::Seconds(30));
  }

  // The cache manager's value of one series; -1 when absent or not scrapable.
  double Metric(const std::string& series) const {
    return MetricAt(CacheManagerMetricsUrl(), series);
  }
  // The router's.
  double RouterMetric(const std::string& series) const {
    return MetricAt(url_ + "/metrics", series);
  }

  // POST /v1/completions, greedy: the usage's cached prompt tokens and the prompt tokens.
  std::pair<int, int> CachedTokens(const std::string& text) const {
    const json body = {{"model", "tiny"}, {"prompt", text}, {"max_tokens", 4}, {"temperature", 0}};
    absl::StatusOr<testing::HttpResponse> reply =
        testing::HttpPost(url_ + "/v1/completions", body.dump());
    EXPECT_THAT(reply, IsOk());
    if (!reply.ok()) return {-1, -1};
    EXPECT_EQ(reply->status, 200) << reply->body;
    const json parsed = json::parse(reply->body, nullptr, /*allow_exceptions=*/false);
    if (!parsed.is_object() || !parsed.contains("usage")) return {-1, -1};
    return {parsed["usage"]["prompt_tokens_details"]["cached_tokens"].get<int>(),
            parsed["usage"]["prompt_tokens"].get<int>()};
  }

  // Until the disk tier has written at least `blocks` blocks (the write-through is the
  // mover's, after the step that committed them).
  void AwaitStoredOnDisk(double blocks) const {
    double stored = -1;
    const absl::Status written = testing::WaitFor(
        [&] {
          stored = Metric("kvcm_cache_manager_tier_stored_blocks_total{tier=\"disk\"}");
          return stored >= blocks;
        },
        absl::Seconds(60), "the disk tier's writes");
    ASSERT_THAT(written, IsOk()) << "the disk tier stored " << stored << " blocks, want " << blocks;
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

  void ExpectIdle() {
    std::optional<Scrape> last;
    EXPECT_TRUE(AwaitIdle(absl::Seconds(20), &last)) << "blocks still held after the requests";
  }

  // The ledger whole, tiers included: no block in use, quarantined or draining, none held
  // for a store and none loading for a prefetch (within `timeout`, a hang guard).
  void ExpectLedgerWhole(absl::Duration timeout = absl::Seconds(60)) {
    std::optional<Scrape> last;
    EXPECT_TRUE(AwaitIdle(timeout, &last))
        << "blocks still in use, quarantined or draining: in_use "
        << (last ? last->blocks["in_use"] : -1) << ", quarantined "
        << (last ? last->blocks["quarantined"] : -1) << ", draining "
        << (last ? last->blocks["draining"] : -1);
    double loading = -1, held = -1;
    const absl::Status settled = testing::WaitFor(
        [&] {
          loading = Metric("kvcm_cache_manager_tier_loading_blocks");
          held = Metric("kvcm_cache_manager_tier_held_blocks");
          return loading == 0 && held == 0;
        },
        timeout, "the tiers' loading and held blocks to be 0");
    EXPECT_THAT(settled, IsOk()) << "loading " << loading << ", held " << held;
  }
};

}  // namespace kvcm::faults
