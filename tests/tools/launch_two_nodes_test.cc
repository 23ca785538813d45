// Two kvcm nodes on one machine (docs/cluster.md, "Two nodes on one machine"): two
// kvcm-launch processes, started at the same moment with their own run directories, a tiny
// model and the HTTP port picked free, each run a cache manager, a router and an executor
// without a clash; each answers its own requests with the model's tokens, and every
// process's /metrics is scraped from its own port, where each node's figures are its own (its
// pool size, its request count, its executor's steps). A third launcher that names node A's
// HTTP port, or node A's run directory, fails with the reason, and node A serves on.

#include <signal.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/services/executor/executor_test_util.h"
#include "tests/support/http_client.h"
#include "tests/support/metrics_text.h"
#include "tests/support/status_matchers.h"
#include "tests/support/subprocess.h"
#include "tests/support/wait_for.h"

namespace kvcm {
namespace {

using json = nlohmann::json;
using ::testing::HasSubstr;
using testing::HttpGet;
using testing::HttpPost;
using testing::Subprocess;
using testing::TempDir;

struct Node {
  std::string name;  // "a", "b"
  int num_blocks = 0;
  std::string run_dir;
  std::string targets;  // --prometheus-targets
  std::unique_ptr<Subprocess> launch;
  std::string url;
};

class LaunchTwoNodesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<TempDir> dir = TempDir::Create("kvcm-2n");
    ASSERT_THAT(dir, IsOk());
    dir_ = std::make_unique<TempDir>(std::move(*dir));
    model_dir_ = dir_->path() + "/tiny";
    ASSERT_THAT(testing::MakeTinyModel(model_dir_, /*seed=*/5), IsOk());
    absl::StatusOr<std::unique_ptr<executor::LlamaModel>> model =
        executor::LlamaModel::Load(model_dir_);
    ASSERT_THAT(model, IsOk());
    model_ = *std::move(model);
  }

  std::unique_ptr<Subprocess> Launch(const std::string& log, std::vector<std::string> args) {
    Subprocess::Options options;
    options.argv = {testing::KvcmBinaryPath("kvcm-launch"),
                    "--model",
                    model_dir_,
                    "--threads",
                    "1",
                    "--block-size",
                    "4"};
    options.argv.insert(options.argv.end(), args.begin(), args.end());
    options.output_path = dir_->path() + "/" + log;
    options.env = {"TMPDIR=" + dir_->path()};
    absl::StatusOr<std::unique_ptr<Subprocess>> started = Subprocess::Start(options);
    EXPECT_THAT(started, IsOk());
    return started.ok() ? *std::move(started) : nullptr;
  }

  void Start(Node& node) {
    node.run_dir = dir_->path() + "/run-" + node.name;
    node.targets = dir_->path() + "/targets-" + node.name + ".json";
    node.launch = Launch("launch-" + node.name + ".log",
                         {"--run-dir", node.run_dir, "--port", "0", "--num-blocks",
                          absl::StrCat(node.num_blocks), "--prometheus-targets", node.targets});
  }

  std::vector<int32_t> Generate(const std::string& url, const std::string& text, int32_t n) {
    absl::StatusOr<testing::HttpResponse> reply = HttpPost(
        url + "/generate",
        json{{"inputs", text}, {"parameters", {{"max_new_tokens", n}, {"details", true}}}}.dump(),
        absl::Seconds(60));
    std::vector<int32_t> ids;
    EXPECT_TRUE(reply.ok() && reply->status == 200) << (reply.ok() ? reply->body : "");
    if (!reply.ok() || reply->status != 200) return ids;
    const json body = json::parse(reply->body);
    for (const json& t : body["details"]["tokens"]) ids.push_back(t["id"].get<int32_t>());
    return ids;
  }
  std::vector<int32_t> Reference(const std::string& text, int32_t n) const {
    std::vector<int32_t> prompt = {1};
    for (unsigned char c : text) prompt.push_back(3 + c);
    return testing::ReferenceAnswer(*model_, prompt, n);
  }

  // component ("cache-manager", "router", "executor") -> "HOST:PORT", from the node's
  // Prometheus target file, once it lists all three.
  static std::map<std::string, std::string> Targets(const Node& node) {
    std::map<std::string, std::string> out;
    (void)testing::WaitFor(
        [&] {
          out.clear();
          const std::string text = testing::ReadFileOrEmpty(node.targets);
          const json file = json::parse(text, nullptr, /*allow_exceptions=*/false);
          if (file.is_array()) {
            for (const json& group : file) {
              out[group["labels"]["__kvcm_component"].get<std::string>()] =
                  group["targets"][0].get<std::string>();
            }
          }
          return out.size() == 3;
        },
        absl::Seconds(60));
    return out;
  }

  static testing::MetricsText Scrape(const std::string& address) {
    absl::StatusOr<testing::HttpResponse> reply = HttpGet("http://" + address + "/metrics");
    EXPECT_TRUE(reply.ok() && reply->status == 200) << address;
    if (!reply.ok() || reply->status != 200) return {};
    absl::StatusOr<testing::MetricsText> parsed = testing::ParseMetricsText(reply->body);
    EXPECT_THAT(parsed, IsOk());
    return parsed.ok() ? *std::move(parsed) : testing::MetricsText{};
  }
  static double Sum(const testing::MetricsText& metrics, const std::string& name) {
    double sum = 0;
    for (const testing::MetricSample& s : metrics.Samples(name)) sum += s.value;
    return sum;
  }

  std::unique_ptr<TempDir> dir_;
  std::string model_dir_;
  std::unique_ptr<executor::LlamaModel> model_;
};

TEST_F(LaunchTwoNodesTest, TwoNodesServeSideBySideEachOnItsOwnPorts) {
  Node a;
  a.name = "a";
  a.num_blocks = 128;
  Node b;
  b.name = "b";
  b.num_blocks = 96;
  // Both at once: they race for ports and files, as two nodes started together would.
  Start(a);
  Start(b);
  for (Node* node : {&a, &b}) {
    ASSERT_NE(node->launch, nullptr);
    auto ready =
        node->launch->WaitForLine("kvcm-launch: ready http=(\\S+) executors=1 run_dir=(\\S+)",
                                  absl::Now() + absl::Seconds(90));
    ASSERT_THAT(ready, IsOk()) << node->name << ": " << ready.status() << node->launch->Output();
    node->url = (*ready)[1];
    EXPECT_EQ((*ready)[2], node->run_dir);
    EXPECT_TRUE(std::filesystem::exists(node->run_dir + "/cache-manager.sock"));
    EXPECT_TRUE(std::filesystem::exists(node->run_dir + "/router-executors.sock"));
  }
  EXPECT_NE(a.url, b.url);

  // Each answers: one request to A, two to B, with the tokens of the model run alone.
  EXPECT_EQ(Generate(a.url, "node a", 5), Reference("node a", 5)) << a.launch->Output();
  EXPECT_EQ(Generate(b.url, "node b", 5), Reference("node b", 5)) << b.launch->Output();
  EXPECT_EQ(Generate(b.url, "node b again", 4), Reference("node b again", 4));

  // Six processes, six ports; the router's metrics are on its HTTP port.
  const std::map<std::string, std::string> ta = Targets(a);
  const std::map<std::string, std::string> tb = Targets(b);
  ASSERT_EQ(ta.size(), 3u) << testing::ReadFileOrEmpty(a.targets);
  ASSERT_EQ(tb.size(), 3u) << testing::ReadFileOrEmpty(b.targets);
  std::set<std::string> addresses;
  for (const auto* targets : {&ta, &tb}) {
    for (const auto& [component, address] : *targets) addresses.insert(address);
  }
  EXPECT_EQ(addresses.size(), 6u);
  EXPECT_EQ("http://" + ta.at("router"), a.url);
  EXPECT_EQ("http://" + tb.at("router"), b.url);

  // Each node's figures come from its own ports.
  for (const auto& [node, targets] : {std::pair{&a, &ta}, std::pair{&b, &tb}}) {
    SCOPED_TRACE("node " + node->name);
    const testing::MetricsText cm = Scrape(targets->at("cache-manager"));
    EXPECT_EQ(Sum(cm, "kvcm_cache_capacity_blocks"), node->num_blocks);
    const testing::MetricsText router = Scrape(targets->at("router"));
    EXPECT_EQ(Sum(router, "kvcm_router_requests_total"), node == &a ? 1 : 2);
    const testing::MetricsText executor = Scrape(targets->at("executor"));
    EXPECT_GT(Sum(executor, "kvcm_executor_steps_total"), 0);
  }

  // A third launcher on A's HTTP port fails, saying so, before it is ready.
  const std::string a_port = a.url.substr(a.url.rfind(':') + 1);
  std::unique_ptr<Subprocess> clash =
      Launch("launch-port-clash.log", {"--port", a_port, "--num-blocks", "32"});
  ASSERT_NE(clash, nullptr);
  absl::StatusOr<int> code = clash->Wait(absl::Seconds(60));
  ASSERT_THAT(code, IsOk()) << clash->Output();
  EXPECT_EQ(*code, 1);
  EXPECT_THAT(clash->Output(), HasSubstr("cannot listen on 127.0.0.1:" + a_port));
  EXPECT_THAT(clash->Output(), HasSubstr("router failed before it was ready"));

  // And one on A's run directory: A's cache manager holds it.
  std::unique_ptr<Subprocess> same_dir =
      Launch("launch-dir-clash.log", {"--run-dir", a.run_dir, "--port", "0", "--num-blocks", "32"});
  ASSERT_NE(same_dir, nullptr);
  code = same_dir->Wait(absl::Seconds(60));
  ASSERT_THAT(code, IsOk()) << same_dir->Output();
  EXPECT_EQ(*code, 1);
  EXPECT_THAT(same_dir->Output(),
              HasSubstr("kvcm-cache-manager is already running on " + a.run_dir));
  EXPECT_THAT(same_dir->Output(), HasSubstr("cache-manager failed before it was ready"));

  // Node A lost nothing: its sockets are there and it answers.
  EXPECT_TRUE(std::filesystem::exists(a.run_dir + "/cache-manager.sock"));
  EXPECT_EQ(Generate(a.url, "node a, later", 5), Reference("node a, later", 5))
      << a.launch->Output();

  for (Node* node : {&a, &b}) {
    ASSERT_THAT(node->launch->Signal(SIGTERM), IsOk());
    absl::StatusOr<int> stopped = node->launch->Wait(absl::Seconds(60));
    ASSERT_THAT(stopped, IsOk()) << node->launch->Output();
    EXPECT_EQ(*stopped, 0) << node->launch->Output();
  }
}

}  // namespace
}  // namespace kvcm
