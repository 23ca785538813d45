#include "services/cache_manager/peer_credentials.h"

#include "gtest/gtest.h"

namespace kvcm::cache_manager {
namespace {

TEST(PeerCredentialsTest, ParsesWhatLibzmqWritesForUnixSockets) {
  auto creds = ParseIpcPeerAddress("localhost:1000:100:4242");
  ASSERT_TRUE(creds.has_value());
  EXPECT_EQ(creds->uid, 1000u);
  EXPECT_EQ(creds->gid, 100u);
  EXPECT_EQ(creds->pid, 4242);
  EXPECT_TRUE(ParseIpcPeerAddress(":0:0:7").has_value());
}

TEST(PeerCredentialsTest, TcpAddressesAndGarbageAreNotCredentials) {
  for (const char* text :
       {"127.0.0.1", "::1", "fe80::1:2:3", "::ffff:127.0.0.1", "", "localhost", "localhost:1:2",
        "localhost:1:2:0", "localhost:a:b:c", "localhost:1:2:3:4", "localhost:1:2:99999999999"}) {
    EXPECT_FALSE(ParseIpcPeerAddress(text).has_value()) << text;
  }
}

}  // namespace
}  // namespace kvcm::cache_manager
