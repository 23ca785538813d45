// The router's OpenAPI document (GET /openapi.json) kept true against a running stack:
// kvcm-launch runs a cache manager, a router and an executor of a tiny model, and
// tests/openapi/check_openapi.py (BUILD_DIR/venv-openapi, tests/openapi/requirements.txt)
// checks that the document's operations are the router's route table (HttpFrontend::Routes(),
// passed on from here), that real responses of every route, good and bad, match the
// document (status, Content-Type, body; every event of a stream), and then fuzzes the API end
// to end with schemathesis: a bounded run, its seed printed (KVCM_OPENAPI_SEED sets it,
// KVCM_OPENAPI_EXAMPLES the examples per operation, KVCM_OPENAPI_SECONDS the time limit),
// with the checks not_a_server_error, status_code_conformance, content_type_conformance and
// response_schema_conformance. Afterwards the ledger is whole: the
// cache manager's block states sum to the pool, and none stays in use once idle
// (docs/RELIABILITY.md, "API fuzzing").

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "services/router/http_frontend.h"
#include "tests/support/cache_manager_process.h"
#include "tests/support/http_client.h"
#include "tests/support/metrics_text.h"
#include "tests/support/subprocess.h"
#include "tests/support/status_matchers.h"

namespace kvcm {
namespace {

using json = nlohmann::json;
using testing::Subprocess;
using testing::TempDir;

constexpr char kChecker[] = KVCM_SOURCE_DIR "/tests/openapi/check_openapi.py";
constexpr char kPython[] = KVCM_OPENAPI_PYTHON;
const std::vector<std::string> kStates = {"free",   "in_use",      "cached",
                                          "pinned", "quarantined", "draining"};
// 96 tokens: less than --max-total-tokens, so that a request the pool can never hold is
// refused before it is queued (a 422, OpenAI's 400), streamed or not, as check_openapi.py
// checks.
constexpr int32_t kNumBlocks = 24;

using Counts = std::map<std::string, int64_t>;

std::string EnvOr(const char* name, const std::string& otherwise) {
  const char* value = std::getenv(name);
  return value != nullptr && *value != '\0' ? value : otherwise;
}

class OpenApiStackTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(std::filesystem::exists(kPython))
        << kPython << " is missing: scripts/python-env.sh makes it";
    absl::StatusOr<TempDir> dir = TempDir::Create(absl::StrCat("kvcm-openapi-", ::getpid()));
    ASSERT_THAT(dir, IsOk());
    dir_ = std::make_unique<TempDir>(std::move(*dir));
    const std::string model = dir_->path() + "/tiny";
    absl::StatusOr<testing::RunResult> made = testing::RunProgram(
        {testing::KvcmBinaryPath("kvcm-make-tiny-model"), "--output", model, "--seed", "5"}, "",
        absl::Seconds(60));
    ASSERT_TRUE(made.ok() && made->exit_code == 0) << (made.ok() ? made->output : "");
    // The tiny model has no chat template: the router is given ChatML's.
    const std::string chat_template = dir_->path() + "/chatml.jinja";
    {
      std::ofstream out(chat_template);
      out << "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + "
             "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}"
             "{{ '<|im_start|>assistant\n' }}{% endif %}";
    }
    Subprocess::Options options;
    // Short prompts and generations (the fuzzer asks for up to --max-total-tokens each).
    options.argv = {testing::KvcmBinaryPath("kvcm-launch"), "--model", model,
                    "--executors", "1", "--num-blocks", absl::StrCat(kNumBlocks),
                    "--block-size", "4", "--port", "0", "--threads", "1",
                    "--run-dir", dir_->path() + "/run", "--chat-template", chat_template,
                    "--max-input-tokens", "96", "--max-total-tokens", "128"};
    options.output_path = dir_->path() + "/launch.log";
    options.env = {"TMPDIR=" + dir_->path()};
    absl::StatusOr<std::unique_ptr<Subprocess>> launch = Subprocess::Start(options);
    ASSERT_THAT(launch, IsOk());
    launch_ = *std::move(launch);
    auto metrics =
        launch_->WaitForLine("kvcm-cache-manager: ready .* endpoint=(\\S+) .*metrics=(\\S+)",
                             absl::Now() + absl::Seconds(60));
    ASSERT_THAT(metrics, IsOk()) << launch_->Output();
    metrics_url_ = (*metrics)[2];
    auto ready = launch_->WaitForLine("kvcm-launch: ready http=(\\S+) executors=1",
                                      absl::Now() + absl::Seconds(60));
    ASSERT_THAT(ready, IsOk()) << launch_->Output();
    url_ = (*ready)[1];
  }

  // The launcher stops what it started at SIGTERM.
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

  // Every scrape sums to the pool; returns once none is in use (or fails after 20 s).
  void ExpectLedgerWholeOnceIdle() {
    const absl::Time deadline = absl::Now() + absl::Seconds(20);
    Counts counts;
    while (true) {
      counts = ScrapeCounts();
      int64_t total = 0;
      for (const auto& [state, n] : counts) total += n;
      EXPECT_EQ(total, kNumBlocks) << json(counts).dump();
      if (counts["in_use"] == 0 || absl::Now() > deadline) break;
      absl::SleepFor(absl::Milliseconds(200));
    }
    EXPECT_EQ(counts["in_use"], 0) << "blocks still in use once idle: " << json(counts).dump();
    std::printf("openapi: ledger once idle %s\n", json(counts).dump().c_str());
  }

  // Runs the checker; its report (the last line that is a JSON object).
  json Check(const std::vector<std::string>& extra, absl::Duration timeout) {
    std::string routes;
    for (const router::HttpRoute& route : router::HttpFrontend::Routes()) {
      absl::StrAppend(&routes, routes.empty() ? "" : ",", std::string(route.method), " ",
                      std::string(route.path));
    }
    std::vector<std::string> argv = {kPython, kChecker, "--url", url_, "--routes", routes,
                                     "--report-dir", dir_->path() + "/report"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    absl::StatusOr<testing::RunResult> run = testing::RunProgram(argv, "", timeout);
    EXPECT_THAT(run, IsOk());
    if (!run.ok()) return json();
    std::printf("%s\n", run->output.c_str());
    EXPECT_EQ(run->exit_code, 0) << testing::Tail(launch_->Output());
    json report;
    for (absl::string_view line : absl::StrSplit(run->output, '\n')) {
      if (!line.empty() && line.front() == '{') {
        report = json::parse(std::string(line), nullptr, false);
      }
    }
    EXPECT_TRUE(report.is_object()) << run->output;
    return report.is_object() ? report : json();
  }

  std::unique_ptr<TempDir> dir_;
  std::unique_ptr<Subprocess> launch_;
  std::string url_;
  std::string metrics_url_;
};

TEST_F(OpenApiStackTest, RealResponsesMatchTheDocumentAndSchemathesisFindsNothing) {
  const std::string seed = EnvOr("KVCM_OPENAPI_SEED", "20261202");
  std::printf("openapi: schemathesis seed %s (KVCM_OPENAPI_SEED replays it)\n", seed.c_str());
  const std::string seconds = EnvOr("KVCM_OPENAPI_SECONDS", "60");
  const json report = Check({"--seed", seed, "--max-examples",
                             EnvOr("KVCM_OPENAPI_EXAMPLES", "25"), "--max-time", seconds},
                            absl::Seconds(std::stoi(seconds) + 180));
  ASSERT_TRUE(report.is_object());
  EXPECT_TRUE(report["failures"].empty()) << report["failures"].dump(1);
  EXPECT_EQ(report["routes"], router::HttpFrontend::Routes().size());
  EXPECT_GT(report["responses_checked"].get<int>(), 40);
  EXPECT_GT(report["events_checked"].get<int>(), 10);
  EXPECT_EQ(report["schemathesis"]["exit_code"], 0) << report["schemathesis"].dump();
  // Every operation but the document's own, which schemathesis leaves out.
  std::vector<std::string> fuzzed;
  for (const router::HttpRoute& route : router::HttpFrontend::Routes()) {
    if (route.path != "/openapi.json") {
      fuzzed.push_back(absl::StrCat(std::string(route.method), " ", std::string(route.path)));
    }
  }
  std::sort(fuzzed.begin(), fuzzed.end());
  EXPECT_EQ(report["schemathesis"]["operation_names"], json(fuzzed));
  ExpectLedgerWholeOnceIdle();
}

}  // namespace
}  // namespace kvcm
