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
//
// And TGI's own schema: real responses of every TGI route the router serves have every
// member TGI's OpenAPI document requires, of its type, nested objects included
// (tests/openapi/tgi_required_fields.json: a copy of those lists, naming the TGI commit
// they come from; docs/router.md, "TGI's schema").

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "services/router/http_frontend.h"
#include "tests/support/cache_manager_process.h"
#include "tests/support/http_client.h"
#include "tests/support/metrics_text.h"
#include "tests/support/status_matchers.h"
#include "tests/support/subprocess.h"

namespace kvcm {
namespace {

using json = nlohmann::json;
using testing::Subprocess;
using testing::TempDir;

constexpr char kChecker[] = KVCM_SOURCE_DIR "/tests/openapi/check_openapi.py";
constexpr char kTgiRequired[] = KVCM_SOURCE_DIR "/tests/openapi/tgi_required_fields.json";
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
    options.argv = {testing::KvcmBinaryPath("kvcm-launch"),
                    "--model",
                    model,
                    "--executors",
                    "1",
                    "--num-blocks",
                    absl::StrCat(kNumBlocks),
                    "--block-size",
                    "4",
                    "--port",
                    "0",
                    "--threads",
                    "1",
                    "--run-dir",
                    dir_->path() + "/run",
                    "--chat-template",
                    chat_template,
                    "--max-input-tokens",
                    "96",
                    "--max-total-tokens",
                    "128"};
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
    std::vector<std::string> argv = {
        kPython,    kChecker, "--url",        url_,
        "--routes", routes,   "--report-dir", dir_->path() + "/report"};
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

// Checks JSON values against TGI's required members (tgi_required_fields.json), collecting
// what is missing or of another type.
class TgiRequired {
 public:
  explicit TgiRequired(json lists) : lists_(std::move(lists)) {}

  // `value` against `type`: a JSON type, "T|null", "T[]" or a schema's name.
  void Check(const json& value, std::string type, const std::string& where) {
    ++checked_;
    if (absl::EndsWith(type, "|null")) {
      type.resize(type.size() - 5);
      if (value.is_null()) return;
    }
    if (absl::EndsWith(type, "[]")) {
      if (!value.is_array()) return Fail(where, absl::StrCat("is not an array: ", value.dump()));
      const std::string item = type.substr(0, type.size() - 2);
      for (size_t i = 0; i < value.size(); ++i) {
        Check(value[i], item, absl::StrCat(where, "[", i, "]"));
      }
      return;
    }
    const json& schemas = lists_["schemas"];
    if (schemas.contains(type)) {
      if (!value.is_object()) return Fail(where, absl::StrCat("is not a ", type, " object"));
      const json& schema = schemas[type];
      for (const auto& [member, member_type] : schema["required"].items()) {
        const std::string at = absl::StrCat(where, ".", member);
        if (!value.contains(member)) {
          Fail(at, absl::StrCat("is missing (TGI's ", type, " requires it)"));
        } else if (!Excepted(type, member, value[member])) {
          Check(value[member], member_type.get<std::string>(), at);
        }
      }
      if (schema.contains("optional")) {
        for (const auto& [member, member_type] : schema["optional"].items()) {
          if (value.contains(member)) {
            Check(value[member], member_type.get<std::string>(), absl::StrCat(where, ".", member));
          }
        }
      }
      return;
    }
    const bool ok = type == "string"    ? value.is_string()
                    : type == "integer" ? value.is_number_integer()
                    : type == "number"  ? value.is_number()
                    : type == "boolean" ? value.is_boolean()
                    : type == "array"   ? value.is_array()
                    : type == "object"  ? value.is_object()
                                        : false;
    if (!ok) Fail(where, absl::StrCat("is not a ", type, ": ", value.dump()));
  }

  // The media type `media` of route `route`'s 200 as TGI documents it.
  std::string Type(const std::string& route, const std::string& media) const {
    const json& path = lists_["paths"][route];
    return path.contains(media) ? path[media].get<std::string>() : "";
  }
  std::string ErrorType() const { return lists_["errors"].get<std::string>(); }

  const std::vector<std::string>& failures() const { return failures_; }
  int checked() const { return checked_; }

 private:
  // Where the router keeps OpenAI's rule against TGI's (docs/router.md, "TGI's schema"): a
  // completions stream's finish_reason is null until the choice's last chunk (TGI writes
  // "").
  static bool Excepted(const std::string& type, const std::string& member, const json& value) {
    return type == "CompletionComplete" && member == "finish_reason" && value.is_null();
  }
  void Fail(const std::string& where, const std::string& what) {
    failures_.push_back(absl::StrCat(where, " ", what));
  }

  json lists_;
  std::vector<std::string> failures_;
  int checked_ = 0;
};

// The JSON of each event of a server-sent event stream ("data:" or "data: "), [DONE] left
// out.
std::vector<json> Events(const std::string& body) {
  std::vector<json> events;
  for (absl::string_view event : absl::StrSplit(body, "\n\n", absl::SkipEmpty())) {
    if (!absl::ConsumePrefix(&event, "data:")) continue;
    absl::ConsumePrefix(&event, " ");
    if (event == "[DONE]") continue;
    events.push_back(json::parse(std::string(event), nullptr, false));
  }
  return events;
}

TEST_F(OpenApiStackTest, RealResponsesHaveEveryMemberTgiRequires) {
  std::ifstream file(kTgiRequired);
  ASSERT_TRUE(file.good()) << kTgiRequired;
  const json lists = json::parse(file, nullptr, false);
  ASSERT_TRUE(lists.is_object()) << kTgiRequired;
  std::printf("openapi: TGI's required members from %s at %s (%s)\n",
              lists["repository"].get<std::string>().c_str(),
              lists["commit"].get<std::string>().c_str(),
              lists["version"].get<std::string>().c_str());
  TgiRequired tgi(lists);
  std::set<std::string> routes_checked;
  // Sends a request and checks its reply: `status`, then the body as TGI's `route` has it
  // for `media` (a 200) or as its error (any other status). Returns the body's JSON (each
  // event's, for a stream).
  auto ask = [&](const std::string& method, const std::string& route, const std::string& body,
                 const std::string& media, int status = 200) {
    absl::StatusOr<testing::HttpResponse> reply =
        testing::HttpRequest(method, url_ + route, body, absl::Seconds(30));
    std::vector<json> values;
    EXPECT_TRUE(reply.ok()) << method << " " << route << ": " << reply.status();
    if (!reply.ok()) return values;
    const std::string name = absl::StrCat(method, " ", route);
    EXPECT_EQ(reply->status, status) << name << " " << body << ": " << reply->body;
    if (reply->status != status) return values;
    if (status != 200) {
      values.push_back(json::parse(reply->body, nullptr, false));
      tgi.Check(values.back(), tgi.ErrorType(), absl::StrCat(name, " (", status, ")"));
      return values;
    }
    routes_checked.insert(name);
    if (media.empty()) {  // TGI's 200 has no content
      EXPECT_EQ(reply->body, "") << name;
      return values;
    }
    const std::string type = tgi.Type(name, media);
    EXPECT_FALSE(type.empty()) << name << " " << media << " is not TGI's";
    if (media == "text/event-stream") {
      values = Events(reply->body);
      EXPECT_FALSE(values.empty()) << name << ": " << reply->body;
      for (size_t i = 0; i < values.size(); ++i) {
        tgi.Check(values[i], type, absl::StrCat(name, " event ", i));
      }
    } else if (media == "application/json") {
      values.push_back(json::parse(reply->body, nullptr, false));
      tgi.Check(values.back(), type, name);
    } else {
      EXPECT_TRUE(absl::StrContains(reply->headers, "Content-Type: " + media)) << reply->headers;
    }
    return values;
  };

  const std::string inputs_bytes = "Hello, w\xc3\xb6rld";  // a character of two bytes
  const std::vector<json> tokens =
      ask("POST", "/tokenize", json({{"inputs", inputs_bytes}}).dump(), "application/json");
  ASSERT_EQ(tokens.size(), 1u);
  ASSERT_TRUE(tokens[0].is_array() && !tokens[0].empty());
  // The spans cover the input, each character's ids spanning it whole.
  EXPECT_EQ(tokens[0].back().value("stop", -1), static_cast<int>(inputs_bytes.size()))
      << tokens[0].dump();
  ask("POST", "/generate",
      json({{"inputs", inputs_bytes},
            {"parameters",
             {{"max_new_tokens", 3},
              {"details", true},
              {"decoder_input_details", true},
              {"top_n_tokens", 2}}}})
          .dump(),
      "application/json");
  ask("POST", "/generate",
      json({{"inputs", inputs_bytes},
            {"parameters",
             {{"max_new_tokens", 3}, {"details", true}, {"do_sample", true}, {"best_of", 2}}}})
          .dump(),
      "application/json");
  const std::vector<json> events =
      ask("POST", "/generate_stream",
          json({{"inputs", inputs_bytes}, {"parameters", {{"max_new_tokens", 3}}}}).dump(),
          "text/event-stream");
  ASSERT_FALSE(events.empty());
  // The last event's details: input_length is the prompt's tokens, as /tokenize counts them.
  const json& details = events.back().contains("details") ? events.back()["details"] : json();
  EXPECT_EQ(details.is_object() ? details.value("input_length", -1) : -1,
            static_cast<int>(tokens[0].size()))
      << events.back().dump();
  ask("POST", "/", json({{"inputs", inputs_bytes}, {"parameters", {{"max_new_tokens", 2}}}}).dump(),
      "application/json");
  ask("POST", "/",
      json({{"inputs", inputs_bytes}, {"stream", true}, {"parameters", {{"max_new_tokens", 2}}}})
          .dump(),
      "text/event-stream");
  const std::vector<json> info = ask("GET", "/info", "", "application/json");
  ASSERT_EQ(info.size(), 1u);
  EXPECT_EQ(info[0]["validation_workers"], 1) << info[0].dump();
  EXPECT_EQ(info[0]["max_client_batch_size"], 1) << info[0].dump();
  ask("GET", "/health", "", "");
  ask("GET", "/metrics", "", "text/plain");
  ask("POST", "/v1/completions", json({{"prompt", inputs_bytes}, {"max_tokens", 3}}).dump(),
      "application/json");
  ask("POST", "/v1/completions",
      json({{"prompt", inputs_bytes},
            {"max_tokens", 3},
            {"stream", true},
            {"stream_options", {{"include_usage", true}}}})
          .dump(),
      "text/event-stream");
  const json messages = json::array({{{"role", "user"}, {"content", inputs_bytes}}});
  ask("POST", "/v1/chat/completions",
      json({{"messages", messages}, {"max_tokens", 3}, {"logprobs", true}, {"top_logprobs", 2}})
          .dump(),
      "application/json");
  ask("POST", "/v1/chat/completions",
      json({{"messages", messages},
            {"max_tokens", 3},
            {"stream", true},
            {"logprobs", true},
            {"stream_options", {{"include_usage", true}}}})
          .dump(),
      "text/event-stream");
  // /v1/models answers OpenAI's list, {"object": "list", "data": [model]}, where TGI's
  // document has the one model: each entry is TGI's ModelInfo (docs/router.md, "TGI's
  // schema").
  {
    absl::StatusOr<testing::HttpResponse> reply =
        testing::HttpGet(url_ + "/v1/models", absl::Seconds(10));
    ASSERT_TRUE(reply.ok() && reply->status == 200);
    const json list = json::parse(reply->body, nullptr, false);
    ASSERT_TRUE(list.contains("data")) << reply->body;
    tgi.Check(list["data"], tgi.Type("GET /v1/models", "application/json") + "[]",
              "GET /v1/models data");
    routes_checked.insert("GET /v1/models");
  }
  // TGI's error shape on TGI's routes (OpenAI's routes answer OpenAI's).
  ask("POST", "/generate", R"({"inputs": 5})", "", 422);
  ask("POST", "/generate_stream", R"({"inputs": 5})", "", 422);
  ask("POST", "/tokenize", R"({"inputs": 5})", "", 422);

  EXPECT_TRUE(tgi.failures().empty()) << absl::StrJoin(tgi.failures(), "\n");
  EXPECT_GT(tgi.checked(), 200);
  // Every TGI route the router serves was asked.
  std::set<std::string> served;
  for (const router::HttpRoute& route : router::HttpFrontend::Routes()) {
    const std::string name = absl::StrCat(std::string(route.method), " ", std::string(route.path));
    if (lists["paths"].contains(name)) served.insert(name);
  }
  EXPECT_EQ(routes_checked, served);
  std::printf("openapi: %d values checked against TGI's required members, %zu routes\n",
              tgi.checked(), routes_checked.size());
}

TEST_F(OpenApiStackTest, RealResponsesMatchTheDocumentAndSchemathesisFindsNothing) {
  const std::string seed = EnvOr("KVCM_OPENAPI_SEED", "20261202");
  std::printf("openapi: schemathesis seed %s (KVCM_OPENAPI_SEED replays it)\n", seed.c_str());
  const std::string seconds = EnvOr("KVCM_OPENAPI_SECONDS", "60");
  const json report = Check({"--seed", seed, "--max-examples", EnvOr("KVCM_OPENAPI_EXAMPLES", "25"),
                             "--max-time", seconds},
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
