// The router's live pool view (GET /dashboard, services/router/dashboard.h) in a real
// browser: kvcm-launch runs a cache manager, a router and two executors of a tiny model;
// requests sharing a prefix leave cached blocks, a control session pins some of them, one
// router session of the test holds blocks in use and another, silent, has its blocks
// quarantined. Headless chromium, driven by Selenium (tests/dashboard/check_dashboard.py),
// opens /dashboard; once the pool is idle, the counts its legend shows equal the cache
// manager's /metrics scraped before and after, its block map has one cell per block (or per
// run of blocks, for a large pool) coloured as the counts say, the browser logged no error,
// and a screenshot is written (KVCM_DASHBOARD_SCREENSHOT=PATH copies it there: that is how
// docs/images/dashboard.png is made).
//
// The browser tests skip when chromium or chromedriver is missing (scripts/bootstrap.sh
// installs both); one more checks the page and its state without a browser.

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/client/cache_manager_client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/support/cache_manager_process.h"
#include "tests/support/http_client.h"
#include "tests/support/metrics_text.h"
#include "tests/support/status_matchers.h"
#include "tests/support/subprocess.h"
#include "tests/support/wait_for.h"

namespace kvcm {
namespace {

using json = nlohmann::json;
using testing::Subprocess;
using testing::TempDir;

constexpr char kChecker[] = KVCM_SOURCE_DIR "/tests/dashboard/check_dashboard.py";
constexpr char kPython[] = KVCM_DASHBOARD_PYTHON;
const std::vector<std::string> kStates = {"free",   "in_use",      "cached",
                                          "pinned", "quarantined", "draining"};
constexpr int32_t kBlockSize = 4;
constexpr char kPrefix[] =
    "The dashboard test shares this prefix across all of its requests, so that blocks stay "
    "cached";

using Counts = std::map<std::string, int64_t>;

class DashboardBrowserTest : public ::testing::Test {
 protected:
  // Skips the test without a browser (call first, then return if IsSkipped()).
  void RequireBrowser() {
    absl::StatusOr<std::string> chromium = testing::FindProgram("chromium");
    absl::StatusOr<std::string> driver = testing::FindProgram("chromedriver");
    if (!chromium.ok() || !driver.ok()) {
      GTEST_SKIP() << "chromium or chromedriver is not installed (Debian's chromium and "
                      "chromium-driver; scripts/bootstrap.sh installs them)";
    }
    chromium_ = *chromium;
    chromedriver_ = *driver;
    ASSERT_TRUE(std::filesystem::exists(kPython))
        << kPython << " is missing: scripts/python-env.sh makes it";
  }

  // The launcher stops what it started at SIGTERM (SIGKILL, the Subprocess's destructor,
  // would leave its children running).
  void TearDown() override {
    if (launch_ == nullptr) return;
    EXPECT_THAT(launch_->Signal(SIGTERM), IsOk());
    absl::StatusOr<int> code = launch_->Wait(absl::Seconds(30));
    EXPECT_THAT(code, IsOk()) << launch_->Output();
    if (code.ok()) {
      EXPECT_EQ(*code, 0) << testing::Tail(launch_->Output());
    }
    launch_.reset();
  }

  void SetUp() override {
    absl::StatusOr<TempDir> dir = TempDir::Create(absl::StrCat("kvcm-dash-", ::getpid()));
    ASSERT_THAT(dir, IsOk());
    dir_ = std::make_unique<TempDir>(std::move(*dir));
    model_dir_ = dir_->path() + "/tiny";
    absl::StatusOr<testing::RunResult> made = testing::RunProgram(
        {testing::KvcmBinaryPath("kvcm-make-tiny-model"), "--output", model_dir_, "--seed", "5"},
        "", absl::Seconds(60));
    ASSERT_TRUE(made.ok() && made->exit_code == 0) << (made.ok() ? made->output : "");
  }

  // Starts the stack with a pool of `num_blocks`; sets url_, metrics_url_, endpoint_.
  void Launch(int32_t num_blocks) {
    Subprocess::Options options;
    options.argv = {testing::KvcmBinaryPath("kvcm-launch"),
                    "--model",
                    model_dir_,
                    "--executors",
                    "2",
                    "--num-blocks",
                    absl::StrCat(num_blocks),
                    "--block-size",
                    absl::StrCat(kBlockSize),
                    "--port",
                    "0",
                    "--threads",
                    "1",
                    "--run-dir",
                    dir_->path() + "/run"};
    // The cache manager's default heartbeat timeout (5 s): the test's silent session is
    // quarantined after it, and no other session (the router's, the executors', the test's
    // live holder) for a stall of a loaded machine with chromium starting beside them
    // (docs/RELIABILITY.md, "Timing in tests").
    options.output_path = dir_->path() + "/launch.log";
    options.env = {"TMPDIR=" + dir_->path()};
    absl::StatusOr<std::unique_ptr<Subprocess>> launch = Subprocess::Start(options);
    ASSERT_THAT(launch, IsOk());
    launch_ = *std::move(launch);
    auto metrics =
        launch_->WaitForLine("kvcm-cache-manager: ready .* endpoint=(\\S+) .*metrics=(\\S+)",
                             absl::Now() + absl::Seconds(60));
    ASSERT_THAT(metrics, IsOk()) << launch_->Output();
    endpoint_ = (*metrics)[1];
    metrics_url_ = (*metrics)[2];
    auto ready = launch_->WaitForLine("kvcm-launch: ready http=(\\S+) executors=2",
                                      absl::Now() + absl::Seconds(60));
    ASSERT_THAT(ready, IsOk()) << launch_->Output();
    url_ = (*ready)[1];
  }

  // Requests whose prompts share kPrefix, through both APIs, 4 at a time.
  void Load(int requests) {
    std::vector<std::thread> clients;
    std::atomic<int> ok{0};
    for (int c = 0; c < 4; ++c) {
      clients.emplace_back([&, c] {
        for (int r = c; r < requests; r += 4) {
          const std::string prompt = absl::StrCat(kPrefix, "; request ", r);
          const bool openai = r % 2 == 1;
          const json body = openai
                                ? json{{"model", "tiny"}, {"prompt", prompt}, {"max_tokens", 6}}
                                : json{{"inputs", prompt}, {"parameters", {{"max_new_tokens", 6}}}};
          absl::StatusOr<testing::HttpResponse> reply = testing::HttpPost(
              url_ + (openai ? "/v1/completions" : "/generate"), body.dump(), absl::Seconds(60));
          if (reply.ok() && reply->status == 200) ++ok;
        }
      });
    }
    for (std::thread& client : clients) client.join();
    ASSERT_EQ(ok.load(), requests) << launch_->Output();
  }

  std::unique_ptr<CacheManagerClient> Connect(wire::Role role, bool heartbeats) {
    CacheManagerClient::Options options;
    options.endpoint = endpoint_;
    options.role = role;
    options.name = "dashboard-test";
    options.heartbeats = heartbeats;
    absl::StatusOr<std::unique_ptr<CacheManagerClient>> client =
        CacheManagerClient::Connect(options);
    EXPECT_THAT(client, IsOk());
    return client.ok() ? *std::move(client) : nullptr;
  }

  // The cache manager's kvcm_cache_blocks{state}, scraped now.
  Counts ScrapeCounts() {
    Counts counts;
    absl::StatusOr<testing::HttpResponse> reply = testing::HttpGet(metrics_url_, absl::Seconds(5));
    EXPECT_TRUE(reply.ok() && reply->status == 200) << metrics_url_;
    if (!reply.ok()) return counts;
    absl::StatusOr<testing::MetricsText> text = testing::ParseMetricsText(reply->body);
    EXPECT_THAT(text, IsOk());
    if (!text.ok()) return counts;
    for (const std::string& state : kStates) {
      absl::StatusOr<double> value = text->Value("kvcm_cache_blocks", {{"state", state}});
      EXPECT_THAT(value, IsOk()) << state << ": " << value.status();
      counts[state] = value.ok() ? static_cast<int64_t>(*value) : -1;
    }
    return counts;
  }

  // Waits until `want` holds for two successive scrapes that agree. `want` must name the
  // settled state itself (no block in use but the test's own): agreeing scrapes alone do
  // not mean that the router's last frees went out, however far apart they are.
  Counts WaitForStableCounts(const std::function<bool(const Counts&)>& want) {
    Counts last = ScrapeCounts();
    const absl::Status settled = testing::WaitFor(
        [&] {
          Counts now = ScrapeCounts();
          const bool stable = now == last && want(now);
          last = std::move(now);
          return stable;
        },
        absl::Seconds(60));
    EXPECT_THAT(settled, IsOk()) << "the block counts did not settle: " << json(last).dump();
    return last;
  }

  // Runs the browser; its report.
  json OpenInBrowser(const std::string& screenshot, int min_polls = 3) {
    absl::StatusOr<testing::RunResult> run =
        testing::RunProgram({kPython, kChecker, "--url", url_ + "/dashboard", "--screenshot",
                             screenshot, "--chromium", chromium_, "--chromedriver", chromedriver_,
                             "--min-polls", absl::StrCat(min_polls), "--timeout", "120"},
                            "", absl::Seconds(180));
    EXPECT_THAT(run, IsOk());
    if (!run.ok()) return json();
    EXPECT_EQ(run->exit_code, 0) << run->output;
    // The report is the last line that is a JSON object.
    json report;
    for (absl::string_view line : absl::StrSplit(run->output, '\n')) {
      if (!line.empty() && line.front() == '{') {
        report = json::parse(std::string(line), nullptr, false);
      }
    }
    EXPECT_TRUE(report.is_object()) << run->output;
    return report.is_object() ? report : json();
  }

  static void ExpectPng(const std::string& path) {
    const std::string bytes = testing::ReadFileOrEmpty(path);
    ASSERT_GT(bytes.size(), 1000u) << path;
    EXPECT_EQ(bytes.substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8));
  }

  std::string chromium_;
  std::string chromedriver_;
  std::unique_ptr<TempDir> dir_;
  std::string model_dir_;
  std::unique_ptr<Subprocess> launch_;
  std::string url_;
  std::string metrics_url_;
  std::string endpoint_;
};

// Without a browser: the page is self-contained and the state it polls has the cache
// manager's counts.
TEST_F(DashboardBrowserTest, TheStateHasTheCacheManagersCountsAndThePageFetchesNothingElse) {
  ASSERT_NO_FATAL_FAILURE(Launch(64));
  ASSERT_NO_FATAL_FAILURE(Load(4));
  const Counts counts = WaitForStableCounts(
      [](const Counts& c) { return c.at("cached") > 0 && c.at("in_use") == 0; });
  // The first poll starts a fetch and is answered "pending"; a later one has the pool.
  json state;
  bool answered = true;
  (void)testing::WaitFor(
      [&] {
        absl::StatusOr<testing::HttpResponse> polled =
            testing::HttpGet(url_ + "/dashboard/state", absl::Seconds(60));
        answered = polled.ok() && polled->status == 200;
        if (!answered) return true;
        EXPECT_THAT(polled->headers, ::testing::HasSubstr("application/json"));
        state = json::parse(polled->body);
        return state.contains("pool");
      },
      absl::Seconds(60));
  ASSERT_TRUE(answered);
  ASSERT_TRUE(state.contains("pool")) << state.dump();
  EXPECT_TRUE(state["error"].is_null()) << state.dump();
  for (const std::string& s : kStates) EXPECT_EQ(state["pool"]["counts"][s], counts.at(s)) << s;
  EXPECT_EQ(state["pool"]["cells"].get<std::string>().size(), 64u);
  EXPECT_EQ(state["router"]["executors"].size(), 2u);
  // Nothing in it names a session.
  EXPECT_EQ(state.dump().find("session"), std::string::npos);

  absl::StatusOr<testing::HttpResponse> page =
      testing::HttpGet(url_ + "/dashboard", absl::Seconds(5));
  ASSERT_TRUE(page.ok() && page->status == 200);
  EXPECT_THAT(page->headers, ::testing::HasSubstr("text/html"));
  EXPECT_THAT(page->headers, ::testing::HasSubstr("Content-Security-Policy: default-src 'none'"));
  for (const char* outside : {"src=\"http", "href=\"http", "@import", "//cdn", "url(http"}) {
    EXPECT_EQ(page->body.find(outside), std::string::npos) << outside;
  }
  EXPECT_THAT(page->body, ::testing::HasSubstr("fetch(\"/dashboard/state\""));
}

TEST_F(DashboardBrowserTest, ThePageShowsTheCacheManagersCountsAndAMapColouredByThem) {
  ASSERT_NO_FATAL_FAILURE(RequireBrowser());
  if (IsSkipped()) return;
  const absl::Time started = absl::Now();
  ASSERT_NO_FATAL_FAILURE(Launch(256));
  ASSERT_NO_FATAL_FAILURE(Load(8));

  // Pins two blocks of the prefix index (the snapshot lists them by block id).
  std::unique_ptr<CacheManagerClient> control = Connect(wire::Role::Control, true);
  ASSERT_NE(control, nullptr);
  absl::StatusOr<EventSnapshot> index = control->Snapshot();
  ASSERT_THAT(index, IsOk());
  std::vector<BlockHash> prefix;
  for (const KvEventRecord& e : index->events) {
    if (e.kind == KvEventKind::kBlockStored && prefix.size() < 2) prefix.push_back(e.hash);
  }
  ASSERT_EQ(prefix.size(), 2u) << "fewer than two cached blocks";
  const absl::Status pinned = control->Pin("dashboard-test", prefix);
  ASSERT_THAT(pinned, IsOk());

  // A live session of the test's holds 6 blocks; a silent one's 3 blocks are quarantined.
  // Their sequence ids are far above the router's, which count from 1.
  std::unique_ptr<CacheManagerClient> holder = Connect(wire::Role::Router, true);
  std::unique_ptr<CacheManagerClient> silent = Connect(wire::Role::Router, false);
  ASSERT_NE(holder, nullptr);
  ASSERT_NE(silent, nullptr);
  BlockOps ops;
  ops.Allocate(SeqId{1} << 40, 6 * kBlockSize);
  ASSERT_THAT(holder->Step(ops), IsOk());
  ops.Clear();
  ops.Allocate((SeqId{1} << 40) + 1, 3 * kBlockSize);
  ASSERT_THAT(silent->Step(ops), IsOk());

  // Idle: nothing but the test's sessions holds blocks.
  const Counts before = WaitForStableCounts([](const Counts& c) {
    return c.at("quarantined") == 3 && c.at("in_use") == 6 && c.at("pinned") == 2;
  });
  EXPECT_GT(before.at("cached"), 0);
  const std::string screenshot = dir_->path() + "/dashboard.png";
  const json page = OpenInBrowser(screenshot);
  const Counts after = ScrapeCounts();
  ASSERT_TRUE(page.is_object());
  std::printf("dashboard: browser %.2f s, whole test so far %.2f s, page %s\n",
              page["seconds"].get<double>(), absl::ToDoubleSeconds(absl::Now() - started),
              page.dump().c_str());

  EXPECT_EQ(before, after) << "the pool changed while the page was open";
  EXPECT_TRUE(page["console"].empty()) << page["console"].dump();
  EXPECT_EQ(page["error"], "");
  int64_t total = 0;
  for (const std::string& state : kStates) {
    EXPECT_EQ(page["counts"][state], before.at(state)) << state;
    total += before.at(state);
  }
  EXPECT_EQ(total, 256);
  // One cell per block, each in its state's legend colour.
  EXPECT_EQ(page["blocks_per_cell"], 1);
  EXPECT_EQ(page["cells"], 256);
  EXPECT_EQ(page["unmatched_cells"], 0);
  for (const std::string& state : kStates) {
    EXPECT_EQ(page["cell_states"][state], before.at(state)) << state;
  }
  EXPECT_EQ(page["executors"], "2");
  EXPECT_EQ(page["executor_rows"], 2);
  EXPECT_EQ(page["running"], "0");
  ExpectPng(screenshot);

  // For docs/images/dashboard.png: the same page a few seconds into a steady load, with
  // sequences running (nothing is compared: the pool changes all the time).
  if (const char* keep = std::getenv("KVCM_DASHBOARD_SCREENSHOT")) {
    std::atomic<bool> stop{false};
    std::vector<std::thread> clients;
    for (int c = 0; c < 6; ++c) {
      clients.emplace_back([&, c] {
        for (int r = 0; !stop.load(); ++r) {
          const json body = {{"inputs", absl::StrCat(kPrefix, "; client ", c, " request ", r)},
                             {"parameters", {{"max_new_tokens", 120}}}};
          (void)testing::HttpPost(url_ + "/generate", body.dump(), absl::Seconds(60));
        }
      });
    }
    const json busy = OpenInBrowser(keep, 20);
    stop.store(true);
    for (std::thread& client : clients) client.join();
    EXPECT_TRUE(busy.is_object() && busy["console"].empty()) << busy.dump();
  }
}

// A pool of more blocks than the page's 4096 cells: each cell is a run of 3 blocks, coloured
// by its dominant state as the state the page polled says, and the counts are still exact.
TEST_F(DashboardBrowserTest, ALargePoolIsShownInRunsOfBlocksWithExactCounts) {
  ASSERT_NO_FATAL_FAILURE(RequireBrowser());
  if (IsSkipped()) return;
  constexpr int32_t kBlocks = 10000;
  ASSERT_NO_FATAL_FAILURE(Launch(kBlocks));
  ASSERT_NO_FATAL_FAILURE(Load(4));
  std::unique_ptr<CacheManagerClient> holder = Connect(wire::Role::Router, true);
  ASSERT_NE(holder, nullptr);
  BlockOps ops;
  ops.Allocate(SeqId{1} << 40, 900 * kBlockSize);
  ASSERT_THAT(holder->Step(ops), IsOk());
  const Counts before = WaitForStableCounts([](const Counts& c) { return c.at("in_use") == 900; });
  const json page = OpenInBrowser(dir_->path() + "/large.png");
  absl::StatusOr<testing::HttpResponse> polled =
      testing::HttpGet(url_ + "/dashboard/state", absl::Seconds(5));
  const Counts after = ScrapeCounts();
  ASSERT_TRUE(page.is_object());
  ASSERT_TRUE(polled.ok() && polled->status == 200);
  EXPECT_EQ(before, after);
  EXPECT_TRUE(page["console"].empty()) << page["console"].dump();
  for (const std::string& state : kStates) {
    EXPECT_EQ(page["counts"][state], before.at(state)) << state;
  }
  EXPECT_EQ(page["blocks_per_cell"], 3);
  EXPECT_EQ(page["cells"], (kBlocks + 2) / 3);
  EXPECT_THAT(page["cell_note"].get<std::string>(), ::testing::HasSubstr("of 3 blocks each"));
  EXPECT_EQ(page["unmatched_cells"], 0);
  // The cells' colours are the states the router served for them.
  const json state = json::parse(polled->body);
  const std::string cells = state["pool"]["cells"];
  ASSERT_EQ(cells.size(), static_cast<size_t>((kBlocks + 2) / 3));
  std::map<std::string, int64_t> served;
  for (char c : cells) ++served[kStates[static_cast<size_t>(c - '0')]];
  for (const std::string& s : kStates) {
    EXPECT_EQ(page["cell_states"][s], served[s]) << s;
  }
  // 900 blocks in use from block 0 or so: at least 299 cells in use.
  EXPECT_GE(served["in_use"], 299);
}

}  // namespace
}  // namespace kvcm
