#pragma once
// Helpers for the tests that run a real kvcm-cache-manager process
// (cache_manager_fault_test.cc, cache_manager_process_test.cc): start it, connect, start a
// fault_client holding blocks, and a second router that drives load and checks that it is
// never handed a forbidden block.

#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/client/cache_manager_client.h"
#include "common/wire/envelope.h"
#include "gtest/gtest.h"
#include "tests/support/cache_manager_process.h"
#include "tests/support/http_client.h"
#include "tests/support/metrics_text.h"
#include "tests/support/prometheus_server.h"
#include "tests/support/promtool.h"
#include "tests/support/status_matchers.h"
#include "tests/support/subprocess.h"
#include "tests/support/wait_for.h"
#include "zmq.hpp"

namespace kvcm::live_test {

using kvcm::testing::CacheManagerOptions;
using kvcm::testing::CacheManagerProcess;
using kvcm::testing::Subprocess;

constexpr int32_t kBlocks = 2048;
constexpr int32_t kBlockSize = 4;
constexpr int32_t kHeld = 1000;

// A heartbeat timeout no session of a test outlives by accident: a loaded machine may leave
// a client's heartbeat thread unscheduled for seconds, and a test that is not about leases
// must not see its own sessions quarantined for it (docs/RELIABILITY.md, "Timing in tests").
// A test about leases passes its own, and waits for the quarantine it expects.
constexpr int32_t kGenerousHeartbeatTimeoutMs = 30000;

inline std::unique_ptr<CacheManagerProcess> StartManager(
    int32_t heartbeat_interval_ms = 1000,
    int32_t heartbeat_timeout_ms = kGenerousHeartbeatTimeoutMs) {
  CacheManagerOptions options;
  options.num_blocks = kBlocks;
  options.block_size = kBlockSize;
  options.heartbeat_interval_ms = heartbeat_interval_ms;
  options.heartbeat_timeout_ms = heartbeat_timeout_ms;
  auto manager = CacheManagerProcess::Start(options);
  EXPECT_THAT(manager, IsOk());
  return manager.ok() ? *std::move(manager) : nullptr;
}

inline std::unique_ptr<CacheManagerClient> Connect(const CacheManagerProcess& manager,
                                                   wire::Role role = wire::Role::Router) {
  CacheManagerClient::Options options;
  options.endpoint = manager.endpoint();
  options.role = role;
  options.name = "test";
  auto client = CacheManagerClient::Connect(options);
  EXPECT_THAT(client, IsOk());
  return client.ok() ? *std::move(client) : nullptr;
}

// A fault_client process holding kHeld blocks; returns it and the blocks it holds.
inline std::unique_ptr<Subprocess> StartHolder(const CacheManagerProcess& manager,
                                               absl::flat_hash_set<int32_t>* held,
                                               const std::string& output_path) {
  Subprocess::Options options;
  options.argv = {FAULT_CLIENT_PATH, "--endpoint", manager.endpoint(), "--blocks",
                  absl::StrCat(kHeld)};
  options.output_path = output_path;
  auto process = Subprocess::Start(options);
  EXPECT_THAT(process, IsOk());
  if (!process.ok()) return nullptr;
  auto ready = (*process)->WaitForLine("ready session=([0-9]+)", absl::Now() + absl::Seconds(30));
  EXPECT_THAT(ready, IsOk()) << "\n" << (*process)->Output();
  const std::vector<std::string> lines = absl::StrSplit((*process)->Output(), '\n');
  for (const std::string& line : lines) {
    if (line.rfind("held ", 0) != 0) continue;
    std::vector<std::string> fields = absl::StrSplit(line, ' ');
    for (size_t i = 2; i < fields.size(); ++i) {
      int32_t block = 0;
      EXPECT_TRUE(absl::SimpleAtoi(fields[i], &block));
      held->insert(block);
    }
  }
  EXPECT_EQ(held->size(), static_cast<size_t>(kHeld));
  return *std::move(process);
}

// Polls `client`'s Stats until `blocks` blocks are quarantined or `timeout` passes; returns
// the last Stats (check quarantined_blocks).
inline StatsSnapshot AwaitQuarantined(CacheManagerClient& client, int32_t blocks,
                                      absl::Duration timeout = absl::Seconds(60)) {
  StatsSnapshot stats;
  (void)kvcm::testing::WaitFor(
      [&] {
        auto s = client.Stats();
        EXPECT_THAT(s, IsOk());
        if (!s.ok()) return true;  // nothing more to wait for
        stats = *s;
        return stats.quarantined_blocks == blocks;
      },
      timeout);
  return stats;
}

// A bare DEALER on the cache manager's request socket, for messages no client would send.
inline zmq::socket_t RawDealer(zmq::context_t& context, const CacheManagerProcess& manager) {
  zmq::socket_t dealer(context, zmq::socket_type::dealer);
  dealer.set(zmq::sockopt::linger, 0);
  dealer.set(zmq::sockopt::rcvtimeo, 60000);  // a bound on each wait for a reply
  dealer.connect(manager.endpoint());
  return dealer;
}

// The value of metric `name` with `labels` in a scrape of `metrics_url`; -1 (and a test
// failure) when it cannot be read.
inline double MetricValue(const std::string& metrics_url, const std::string& name,
                          const kvcm::testing::MetricLabels& labels = {}) {
  auto metrics = kvcm::testing::HttpGet(metrics_url);
  EXPECT_THAT(metrics, IsOk());
  if (!metrics.ok()) return -1;
  auto parsed = kvcm::testing::ParseMetricsText(metrics->body);
  EXPECT_THAT(parsed, IsOk());
  if (!parsed.ok()) return -1;
  auto value = parsed->Value(name, labels);
  EXPECT_THAT(value, IsOk());
  return value.ok() ? *value : -1;
}

inline void ExpectWhole(const StatsSnapshot& stats) {
  EXPECT_EQ(stats.free_blocks + stats.in_use_blocks + stats.cached_blocks + stats.pinned_blocks,
            stats.num_blocks);
}

// Drives allocate/free traffic as a second router and checks that it never receives a
// block from `forbidden`.
class Survivor {
 public:
  Survivor(CacheManagerClient* client, const absl::flat_hash_set<int32_t>* forbidden)
      : client_(client), forbidden_(forbidden) {}

  // One step: allocate 8 sequences of 10 blocks, free the 8 of the previous step.
  void Step() {
    BlockOps batch;
    for (uint64_t seq : live_) batch.Free(seq);
    std::vector<uint64_t> next;
    for (int i = 0; i < 8; ++i) {
      next.push_back(next_seq_++);
      batch.Allocate(next.back(), 10 * kBlockSize);
    }
    auto outcome = client_->Step(batch);
    ASSERT_THAT(outcome, IsOk());
    for (const OpOutcome& op : *outcome) {
      ASSERT_THAT(op.status, IsOk());
      for (int32_t block : op.blocks) {
        if (forbidden_ != nullptr) {
          ASSERT_FALSE(forbidden_->contains(block)) << "block " << block << " reissued";
        }
      }
    }
    live_ = std::move(next);
    ++steps_;
  }
  int32_t blocks_held() const { return static_cast<int32_t>(live_.size()) * 10; }
  int steps() const { return steps_; }
  void set_forbidden(const absl::flat_hash_set<int32_t>* forbidden) { forbidden_ = forbidden; }

 private:
  CacheManagerClient* client_;
  const absl::flat_hash_set<int32_t>* forbidden_;
  std::vector<uint64_t> live_;
  uint64_t next_seq_ = 1;
  int steps_ = 0;
};

}  // namespace kvcm::live_test
