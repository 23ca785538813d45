// SeenConnections decides when the cache manager reads its connection monitor before a
// request: every request that may come from a connection accepted since the monitor was last
// read must be unseen.

#include "services/cache_manager/seen_connections.h"

#include <string>

#include "gtest/gtest.h"

namespace kvcm::cache_manager {
namespace {

// ROUTER's generated routing ids: a zero byte, then a 32-bit counter.
std::string GeneratedId(uint32_t n) {
  std::string id(5, '\0');
  for (int i = 0; i < 4; ++i) id[1 + i] = static_cast<char>(n >> (8 * i));
  return id;
}

TEST(SeenConnectionsTest, AConnectionIsUnseenUntilRemembered) {
  SeenConnections seen;
  EXPECT_FALSE(seen.Contains(12, GeneratedId(1)));
  seen.Remember(12, GeneratedId(1));
  EXPECT_TRUE(seen.Contains(12, GeneratedId(1)));
  EXPECT_FALSE(seen.Contains(13, GeneratedId(1)));
}

TEST(SeenConnectionsTest, ADescriptorReusedByANewConnectionIsUnseenBeforeTheMonitorSaysSo) {
  SeenConnections seen;
  seen.Remember(12, GeneratedId(1));
  // The old connection closed and a new one was accepted on descriptor 12; the monitor's
  // DISCONNECTED and ACCEPTED are not read yet. The new connection's routing id differs.
  EXPECT_FALSE(seen.Contains(12, GeneratedId(2)));
  seen.Remember(12, GeneratedId(2));
  EXPECT_TRUE(seen.Contains(12, GeneratedId(2)));
  EXPECT_FALSE(seen.Contains(12, GeneratedId(1)));
  EXPECT_EQ(seen.size(), 1u);
}

TEST(SeenConnectionsTest, ForgettingADescriptorMakesEveryConnectionOnItUnseen) {
  SeenConnections seen;
  seen.Remember(12, "client-chosen id");
  seen.Remember(14, GeneratedId(7));
  seen.Forget(12);  // the monitor said closed (or accepted anew)
  EXPECT_FALSE(seen.Contains(12, "client-chosen id"));
  EXPECT_TRUE(seen.Contains(14, GeneratedId(7)));
  seen.Forget(99);  // never remembered: nothing happens
  EXPECT_EQ(seen.size(), 1u);
}

TEST(SeenConnectionsTest, AMessageWithoutADescriptorIsNeverSeen) {
  // zmq_msg_get(ZMQ_SRCFD) is -1 for a message that did not come through a socket's engine.
  SeenConnections seen;
  seen.Remember(-1, GeneratedId(3));
  EXPECT_FALSE(seen.Contains(-1, GeneratedId(3)));
  EXPECT_EQ(seen.size(), 0u);
}

}  // namespace
}  // namespace kvcm::cache_manager
