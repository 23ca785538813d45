// The StatsReply codec: every value the cache manager encodes decodes to itself, and a reply
// whose KV cache spec is out of range is refused with the text the client has always given.

#include "common/wire/stats_codec.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/status_matchers.h"

namespace kvcm {
namespace {

using ::testing::HasSubstr;

KvCacheSpec Spec() {
  KvCacheSpec spec;
  spec.num_layers = 3;
  spec.num_kv_heads = 5;
  spec.head_dim = 7;
  spec.dtype = DType::kFloat16;
  spec.block_size = 11;
  return spec;
}

// Every field with a value of its own, none a default.
StatsSnapshot Distinct() {
  StatsSnapshot s;
  s.num_blocks = 101;
  s.block_size = 11;
  s.free_blocks = 12;
  s.in_use_blocks = 13;
  s.cached_blocks = 14;
  s.pinned_blocks = 15;
  s.quarantined_blocks = 16;
  s.draining_blocks = 17;
  s.open_fences = 18;
  s.live_sequences = 19;
  s.usage_ratio = 0.25;
  s.occupancy_ratio = 0.75;
  s.prefix_query_tokens = 20;
  s.prefix_hit_tokens = 21;
  s.blocks_allocated = 22;
  s.blocks_released = 23;
  s.evictions = 24;
  s.allocation_failures = 25;
  s.cow_copies = 26;
  s.epoch = 27;
  s.sessions = 2;
  s.events_published = 28;
  s.backend = PoolBackend::kCuda;
  s.pool_bytes = uint64_t{1} << 40;
  s.block_bytes = 29;
  s.spec = Spec();
  s.uptime_seconds = 30.5;
  s.rejected_messages = 31;
  s.events_endpoint = "ipc:///run/kvcm/events.sock";
  s.metrics_url = "http://127.0.0.1:9100/metrics";
  s.session_list = {
      {7, wire::Role::Router, 1234, true, "router-0", false, 3, 0},
      {9, wire::Role::Executor, 4321, false, "executor-1", true, 0, 2},
  };
  s.tiers = {
      {"host", 32, 33, 34, uint64_t{1} << 35, 36, 37},
      {"disk", 38, 39, 40, 41, 42, uint64_t{1} << 43},
  };
  s.tier_held_blocks = 44;
  s.tier_loading_blocks = 45;
  s.tier_refusals_total = 46;
  s.tier_recovered_blocks = 47;
  return s;
}

absl::StatusOr<StatsSnapshot> RoundTrip(const StatsSnapshot& stats) {
  flatbuffers::FlatBufferBuilder builder;
  builder.Finish(EncodeStatsReply(builder, stats));
  flatbuffers::Verifier verifier(builder.GetBufferPointer(), builder.GetSize());
  EXPECT_TRUE(verifier.VerifyBuffer<wire::StatsReply>(nullptr));
  return DecodeStatsReply(*flatbuffers::GetRoot<wire::StatsReply>(builder.GetBufferPointer()));
}

TEST(StatsCodecTest, EveryFieldSurvives) {
  const StatsSnapshot stats = Distinct();
  absl::StatusOr<StatsSnapshot> decoded = RoundTrip(stats);
  ASSERT_THAT(decoded, IsOk());
  EXPECT_EQ(*decoded, stats);
  // Field by field too, so that a failure names the field.
  EXPECT_EQ(decoded->draining_blocks, 17);
  EXPECT_EQ(decoded->open_fences, 18u);
  EXPECT_EQ(decoded->backend, PoolBackend::kCuda);
  EXPECT_EQ(decoded->pool_bytes, uint64_t{1} << 40);
  EXPECT_EQ(decoded->spec, Spec());
  EXPECT_EQ(decoded->metrics_url, "http://127.0.0.1:9100/metrics");
  ASSERT_EQ(decoded->session_list.size(), 2u);
  EXPECT_EQ(decoded->session_list[1].name, "executor-1");
  EXPECT_TRUE(decoded->session_list[1].quarantined);
  EXPECT_EQ(decoded->session_list[1].pending_fences, 2);
  EXPECT_EQ(decoded->session_list[0].role, wire::Role::Router);
  EXPECT_TRUE(decoded->session_list[0].pid_verified);
  ASSERT_EQ(decoded->tiers.size(), 2u);
  EXPECT_EQ(decoded->tiers[0].name, "host");
  EXPECT_EQ(decoded->tiers[0].capacity_blocks, 32);
  EXPECT_EQ(decoded->tiers[0].ready_blocks, 33);
  EXPECT_EQ(decoded->tiers[0].writing_blocks, 34);
  EXPECT_EQ(decoded->tiers[0].stored_total, uint64_t{1} << 35);
  EXPECT_EQ(decoded->tiers[1].name, "disk");
  EXPECT_EQ(decoded->tiers[1].loaded_total, 42u);
  EXPECT_EQ(decoded->tiers[1].evicted_total, uint64_t{1} << 43);
  EXPECT_EQ(decoded->tier_held_blocks, 44);
  EXPECT_EQ(decoded->tier_loading_blocks, 45);
  EXPECT_EQ(decoded->tier_refusals_total, 46u);
  EXPECT_EQ(decoded->tier_recovered_blocks, 47u);
}

TEST(StatsCodecTest, NoTiersEncodesNoList) {
  StatsSnapshot stats = Distinct();
  stats.tiers.clear();
  stats.tier_held_blocks = 0;
  stats.tier_loading_blocks = 0;
  stats.tier_refusals_total = 0;
  stats.tier_recovered_blocks = 0;
  flatbuffers::FlatBufferBuilder builder;
  builder.Finish(EncodeStatsReply(builder, stats));
  EXPECT_EQ(flatbuffers::GetRoot<wire::StatsReply>(builder.GetBufferPointer())->tiers(), nullptr);
  absl::StatusOr<StatsSnapshot> decoded = RoundTrip(stats);
  ASSERT_THAT(decoded, IsOk());
  EXPECT_EQ(*decoded, stats);
}

TEST(StatsCodecTest, ShmAndAnEmptySessionListSurvive) {
  StatsSnapshot stats = Distinct();
  stats.backend = PoolBackend::kShm;
  stats.session_list.clear();
  stats.events_endpoint.clear();
  absl::StatusOr<StatsSnapshot> decoded = RoundTrip(stats);
  ASSERT_THAT(decoded, IsOk());
  EXPECT_EQ(*decoded, stats);
}

TEST(StatsCodecTest, AnEmptyReplyReadsAsDefaults) {
  flatbuffers::FlatBufferBuilder builder;
  wire::StatsReplyBuilder reply(builder);
  builder.Finish(reply.Finish());
  absl::StatusOr<StatsSnapshot> decoded =
      DecodeStatsReply(*flatbuffers::GetRoot<wire::StatsReply>(builder.GetBufferPointer()));
  ASSERT_THAT(decoded, IsOk());
  EXPECT_EQ(*decoded, StatsSnapshot());
}

TEST(StatsCodecTest, AnUnknownBackendReadsAsShm) {
  EXPECT_EQ(PoolBackendFromWire(static_cast<wire::PoolBackend>(7)), PoolBackend::kShm);
  EXPECT_EQ(PoolBackendFromWire(wire::PoolBackend::Cuda), PoolBackend::kCuda);
  EXPECT_EQ(PoolBackendToWire(PoolBackend::kCuda), wire::PoolBackend::Cuda);
  EXPECT_EQ(PoolBackendToWire(PoolBackend::kShm), wire::PoolBackend::Shm);
}

TEST(StatsCodecTest, AnOutOfRangeSpecIsRefused) {
  flatbuffers::FlatBufferBuilder builder;
  const auto spec = wire::CreateKvCacheSpec(builder, 3, 5, 7, wire::DType::Float16, 11);
  wire::StatsReplyBuilder reply(builder);
  reply.add_spec(spec);
  builder.Finish(reply.Finish());
  // A spec the encoder could write: accepted.
  ASSERT_THAT(DecodeStatsReply(*flatbuffers::GetRoot<wire::StatsReply>(builder.GetBufferPointer())),
              IsOk());

  flatbuffers::FlatBufferBuilder bad;
  const auto huge = wire::CreateKvCacheSpec(bad, (1u << 30) + 1, 5, 7, wire::DType::Float16, 11);
  wire::StatsReplyBuilder bad_reply(bad);
  bad_reply.add_spec(huge);
  bad.Finish(bad_reply.Finish());
  absl::StatusOr<StatsSnapshot> refused =
      DecodeStatsReply(*flatbuffers::GetRoot<wire::StatsReply>(bad.GetBufferPointer()));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInternal);
  EXPECT_EQ(refused.status().message(), "StatsReply: KV cache spec has a dimension above 2^30");
}

}  // namespace
}  // namespace kvcm
