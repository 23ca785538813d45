#include "common/metrics/metrics_server.h"

#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "prometheus/counter.h"
#include "prometheus/registry.h"
#include "tests/support/http_client.h"
#include "tests/support/metrics_text.h"
#include "tests/support/status_matchers.h"

namespace kvcm {
namespace {

using ::kvcm::testing::HttpGet;
using ::kvcm::testing::ParseMetricsText;
using ::testing::HasSubstr;

std::shared_ptr<prometheus::Registry> RegistryWithCounter(double value) {
  auto registry = std::make_shared<prometheus::Registry>();
  prometheus::BuildCounter()
      .Name("kvcm_test_events_total")
      .Help("Events in a test.")
      .Register(*registry)
      .Add({})
      .Increment(value);
  return registry;
}

TEST(MetricsServerTest, ServesRegistryOnPickedPort) {
  auto server = MetricsServer::Start("127.0.0.1:0", RegistryWithCounter(3));
  ASSERT_THAT(server, IsOk());
  const int port = (*server)->port();
  EXPECT_GT(port, 0);
  EXPECT_EQ((*server)->url(), absl::StrCat("http://127.0.0.1:", port, "/metrics"));

  auto response = HttpGet((*server)->url());
  ASSERT_THAT(response, IsOk());
  EXPECT_EQ(response->status, 200);
  auto text = ParseMetricsText(response->body);
  ASSERT_THAT(text, IsOk());
  EXPECT_EQ(text->types.at("kvcm_test_events_total"), "counter");
  EXPECT_EQ(text->Value("kvcm_test_events_total").value_or(-1), 3);
}

TEST(MetricsServerTest, LocalhostAndWildcardGiveFetchableUrls) {
  auto local = MetricsServer::Start("localhost:0", RegistryWithCounter(1));
  ASSERT_THAT(local, IsOk());
  EXPECT_THAT((*local)->url(), HasSubstr("http://127.0.0.1:"));
  auto any = MetricsServer::Start("0.0.0.0:0", RegistryWithCounter(2));
  ASSERT_THAT(any, IsOk());
  EXPECT_EQ((*any)->url(), absl::StrCat("http://127.0.0.1:", (*any)->port(), "/metrics"));
  auto response = HttpGet((*any)->url());
  ASSERT_THAT(response, IsOk());
  EXPECT_THAT(response->body, HasSubstr("kvcm_test_events_total 2"));
}

TEST(MetricsServerTest, TakenPortIsAClearErrorAndTheFirstServerKeepsServing) {
  auto first = MetricsServer::Start("127.0.0.1:0", RegistryWithCounter(1));
  ASSERT_THAT(first, IsOk());
  const std::string address = absl::StrCat("127.0.0.1:", (*first)->port());

  auto second = MetricsServer::Start(address, RegistryWithCounter(2));
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable) << second.status();
  EXPECT_EQ(second.status().message(),
            absl::StrCat("metrics address ", address, " is already in use"));

  auto response = HttpGet((*first)->url());
  ASSERT_THAT(response, IsOk());
  EXPECT_EQ(response->status, 200);
  EXPECT_THAT(response->body, HasSubstr("kvcm_test_events_total 1"));
}

TEST(MetricsServerTest, RejectsAddressesThatDoNotParse) {
  for (const char* address :
       {"nonsense", "", ":9400", "127.0.0.1:", "127.0.0.1:65536", "127.0.0.1:123456",
        "127.0.0.1:-1", "127.0.0.1:+80", "127.0.0.1:9x", "127.0.0.1: 80", "300.1.1.1:80",
        "metrics.example.com:80", "[::1]:0", "[::]:9400"}) {
    SCOPED_TRACE(address);
    auto server = MetricsServer::Start(address, RegistryWithCounter(1));
    ASSERT_FALSE(server.ok());
    EXPECT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument) << server.status();
    EXPECT_THAT(server.status().message(), HasSubstr(absl::StrCat("\"", address, "\"")));
  }
}

TEST(MetricsServerTest, RejectsAHostThatIsNotThisMachine) {
  // 192.0.2.0/24 is TEST-NET-1 (RFC 5737): never assigned to a host.
  auto server = MetricsServer::Start("192.0.2.1:0", RegistryWithCounter(1));
  ASSERT_FALSE(server.ok());
  EXPECT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument) << server.status();
  EXPECT_THAT(server.status().message(), HasSubstr("not an address of this machine"));
}

TEST(MetricsServerTest, StopsServingOnDestruction) {
  auto server = MetricsServer::Start("127.0.0.1:0", RegistryWithCounter(1));
  ASSERT_THAT(server, IsOk());
  const std::string url = (*server)->url();
  ASSERT_THAT(HttpGet(url), IsOk());
  server->reset();
  auto response = HttpGet(url);
  EXPECT_FALSE(response.ok());
  EXPECT_EQ(response.status().code(), absl::StatusCode::kUnavailable) << response.status();
}

}  // namespace
}  // namespace kvcm
