// CheckTcpEndpoint: what --tcp-address accepts, and what it says about everything else.

#include "common/transport/tcp_endpoint.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/status_matchers.h"

namespace kvcm {
namespace {

using ::testing::HasSubstr;

TEST(TcpEndpointTest, LoopbackAddressesAreAccepted) {
  auto v4 = CheckTcpEndpoint("tcp://127.0.0.1:5557", "--tcp-address", false);
  ASSERT_THAT(v4, IsOk());
  EXPECT_TRUE(v4->loopback);
  EXPECT_EQ(v4->BindEndpoint(), "tcp://127.0.0.1:5557");
  auto other = CheckTcpEndpoint("tcp://127.1.2.3:1", "--tcp-address", false);
  ASSERT_THAT(other, IsOk());
  auto v6 = CheckTcpEndpoint("tcp://[::1]:65535", "--tcp-address", false);
  ASSERT_THAT(v6, IsOk());
  EXPECT_EQ(v6->BindEndpoint(), "tcp://[::1]:65535");
  auto named = CheckTcpEndpoint("tcp://localhost:9", "--tcp-address", false);
  ASSERT_THAT(named, IsOk());
  EXPECT_EQ(named->BindEndpoint(), "tcp://127.0.0.1:9");
  auto any_port = CheckTcpEndpoint("tcp://127.0.0.1:0", "--tcp-address", false);
  ASSERT_THAT(any_port, IsOk());
  EXPECT_EQ(any_port->BindEndpoint(), "tcp://127.0.0.1:*");
}

TEST(TcpEndpointTest, WhatLibzmqWouldMisreadIsRefusedWithTheFlagNamed) {
  struct Case {
    const char* endpoint;
    const char* message;
  };
  for (const Case& c :
       {Case{"tcp://127.0.0.1:99999", "port 99999 is outside 1-65535"},
        Case{"tcp://garbage", "no port"}, Case{"tcp://garbage:5557", "is not an IP address"},
        Case{"tcp://127.0.0.1:http", "is not a number"},
        Case{"tcp://127.0.0.1:", "is not a number"}, Case{"ipc:///tmp/x", "not a tcp:// endpoint"},
        Case{"tcp://::1:5557", "is not an IP address"}}) {
    SCOPED_TRACE(c.endpoint);
    auto checked = CheckTcpEndpoint(c.endpoint, "--tcp-address", false);
    ASSERT_FALSE(checked.ok());
    EXPECT_TRUE(absl::IsInvalidArgument(checked.status()));
    EXPECT_THAT(checked.status().message(), HasSubstr(c.message));
    EXPECT_THAT(checked.status().message(), HasSubstr("--tcp-address"));
    EXPECT_THAT(checked.status().message(), HasSubstr("expected tcp://HOST:PORT"));
  }
}

TEST(TcpEndpointTest, OtherMachinesOnlyWhenAskedFor) {
  for (const char* endpoint : {"tcp://0.0.0.0:5557", "tcp://10.1.2.3:5557", "tcp://[::]:5557"}) {
    SCOPED_TRACE(endpoint);
    auto refused = CheckTcpEndpoint(endpoint, "--tcp-address", false);
    ASSERT_FALSE(refused.ok());
    EXPECT_THAT(refused.status().message(), HasSubstr("--tcp-allow-remote"));
    auto allowed = CheckTcpEndpoint(endpoint, "--tcp-address", true);
    ASSERT_THAT(allowed, IsOk());
    EXPECT_FALSE(allowed->loopback);
  }
}

}  // namespace
}  // namespace kvcm
