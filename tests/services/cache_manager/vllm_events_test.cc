// The vLLM-format event encoder (services/cache_manager/vllm_events.h) read back with
// msgpack's own object model: the exact shape consumers parse (docs/protocol.md,
// "vLLM-format KV events"), and the strict test decoder (tests/support/vllm_event_reader.h).

#include "services/cache_manager/vllm_events.h"

#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "msgpack.hpp"
#include "tests/support/status_matchers.h"
#include "tests/support/vllm_event_reader.h"

namespace kvcm::cache_manager {
namespace {

std::string Str(const msgpack::object& o) {
  EXPECT_EQ(o.type, msgpack::type::STR);
  return o.type == msgpack::type::STR ? std::string(o.via.str.ptr, o.via.str.size) : "";
}

// The map's keys in order, and the value of `key`.
std::vector<std::string> Keys(const msgpack::object& map) {
  std::vector<std::string> keys;
  for (uint32_t i = 0; i < map.via.map.size; ++i) keys.push_back(Str(map.via.map.ptr[i].key));
  return keys;
}
const msgpack::object& Value(const msgpack::object& map, const std::string& key) {
  for (uint32_t i = 0; i < map.via.map.size; ++i) {
    if (Str(map.via.map.ptr[i].key) == key) return map.via.map.ptr[i].val;
  }
  ADD_FAILURE() << "no key " << key;
  return map;
}

TEST(VllmEventsTest, BatchIsAnArrayOfThreeWithTaggedMaps) {
  VllmEvent cleared;
  cleared.kind = VllmEvent::Kind::kAllBlocksCleared;
  VllmEvent stored;
  stored.kind = VllmEvent::Kind::kBlockStored;
  // Ids above 2^63: still unsigned integers on the wire.
  stored.block_hashes = {0xfedcba9876543210ull, 7};
  stored.parent_block_hash = 0x8000000000000001ull;
  stored.token_ids = {1, 2, 3, 4, 70000, 6, 7, 4000000000u};
  stored.medium = VllmMedium::kCpu;
  VllmEvent root;
  root.kind = VllmEvent::Kind::kBlockStored;
  root.block_hashes = {9};
  root.token_ids = {5, 5, 5, 5};
  VllmEvent removed;
  removed.kind = VllmEvent::Kind::kBlockRemoved;
  removed.block_hashes = {7, 0xfedcba9876543210ull};
  removed.medium = VllmMedium::kDisk;
  const std::vector<VllmEvent> events = {cleared, stored, root, removed};
  VllmStreamInfo info;
  info.block_size = 4;
  std::string payload;
  EncodeVllmBatch(1764000000.25, events, info, &payload);

  msgpack::object_handle handle = msgpack::unpack(payload.data(), payload.size());
  const msgpack::object& batch = handle.get();
  ASSERT_EQ(batch.type, msgpack::type::ARRAY);
  ASSERT_EQ(batch.via.array.size, 3u);
  ASSERT_EQ(batch.via.array.ptr[0].type, msgpack::type::FLOAT64);
  EXPECT_DOUBLE_EQ(batch.via.array.ptr[0].via.f64, 1764000000.25);
  ASSERT_EQ(batch.via.array.ptr[2].type, msgpack::type::POSITIVE_INTEGER);
  EXPECT_EQ(batch.via.array.ptr[2].via.u64, 0u);
  const msgpack::object& list = batch.via.array.ptr[1];
  ASSERT_EQ(list.type, msgpack::type::ARRAY);
  ASSERT_EQ(list.via.array.size, 4u);

  const msgpack::object& e0 = list.via.array.ptr[0];
  ASSERT_EQ(e0.type, msgpack::type::MAP);
  EXPECT_EQ(Keys(e0), std::vector<std::string>{"type"});
  EXPECT_EQ(Str(Value(e0, "type")), "AllBlocksCleared");

  const msgpack::object& e1 = list.via.array.ptr[1];
  ASSERT_EQ(e1.type, msgpack::type::MAP);
  EXPECT_EQ(Keys(e1),
            (std::vector<std::string>{"type", "block_hashes", "parent_block_hash", "token_ids",
                                      "block_size", "lora_id", "medium", "lora_name"}));
  EXPECT_EQ(Str(Value(e1, "type")), "BlockStored");
  const msgpack::object& hashes = Value(e1, "block_hashes");
  ASSERT_EQ(hashes.type, msgpack::type::ARRAY);
  ASSERT_EQ(hashes.via.array.size, 2u);
  for (uint32_t i = 0; i < 2; ++i) {
    ASSERT_EQ(hashes.via.array.ptr[i].type, msgpack::type::POSITIVE_INTEGER);  // never bin
    EXPECT_EQ(hashes.via.array.ptr[i].via.u64, stored.block_hashes[i]);
  }
  ASSERT_EQ(Value(e1, "parent_block_hash").type, msgpack::type::POSITIVE_INTEGER);
  EXPECT_EQ(Value(e1, "parent_block_hash").via.u64, 0x8000000000000001ull);
  const msgpack::object& tokens = Value(e1, "token_ids");
  ASSERT_EQ(tokens.via.array.size, 8u);
  for (uint32_t i = 0; i < 8; ++i) EXPECT_EQ(tokens.via.array.ptr[i].via.u64, stored.token_ids[i]);
  EXPECT_EQ(Value(e1, "block_size").via.u64, 4u);
  EXPECT_EQ(Value(e1, "lora_id").type, msgpack::type::NIL);
  EXPECT_EQ(Value(e1, "lora_name").type, msgpack::type::NIL);
  EXPECT_EQ(Str(Value(e1, "medium")), "CPU");
  EXPECT_EQ(Str(Value(list.via.array.ptr[2], "medium")), "GPU");  // the default

  const msgpack::object& e2 = list.via.array.ptr[2];
  EXPECT_EQ(Value(e2, "parent_block_hash").type, msgpack::type::NIL);

  const msgpack::object& e3 = list.via.array.ptr[3];
  EXPECT_EQ(Keys(e3), (std::vector<std::string>{"type", "block_hashes", "medium"}));
  EXPECT_EQ(Str(Value(e3, "type")), "BlockRemoved");
  EXPECT_EQ(Str(Value(e3, "medium")), "DISK");
  EXPECT_EQ(Value(e3, "block_hashes").via.array.ptr[1].via.u64, 0xfedcba9876543210ull);

  // The strict reader agrees.
  absl::StatusOr<testing::ReadVllmBatch> read = testing::DecodeVllmPayload(payload);
  ASSERT_THAT(read, IsOk());
  ASSERT_EQ(read->events.size(), 4u);
  EXPECT_EQ(read->events[1].token_ids, stored.token_ids);
  EXPECT_EQ(read->events[1].parent_block_hash, stored.parent_block_hash);
  EXPECT_EQ(read->events[3].block_hashes, removed.block_hashes);
}

// An event of a KV cache group carries vLLM's group fields after the others, in its
// field order; full attention's window is nil.
TEST(VllmEventsTest, GroupedEventsCarryTheGroupsFieldsAfterTheOthers) {
  VllmEvent full;
  full.kind = VllmEvent::Kind::kBlockStored;
  full.block_hashes = {11, 12};
  full.parent_block_hash = 10;
  full.token_ids = {1, 2, 3, 4, 5, 6, 7, 8};
  full.group = VllmGroup{0, 0};
  VllmEvent window = full;
  window.group = VllmGroup{1, 512};
  VllmEvent removed;
  removed.kind = VllmEvent::Kind::kBlockRemoved;
  removed.block_hashes = {11};
  removed.group = VllmGroup{1, 512};
  const std::vector<VllmEvent> events = {full, window, removed};
  VllmStreamInfo info;
  info.block_size = 4;
  std::string payload;
  EncodeVllmBatch(1764000000.5, events, info, &payload);

  msgpack::object_handle handle = msgpack::unpack(payload.data(), payload.size());
  const msgpack::object& list = handle.get().via.array.ptr[1];
  ASSERT_EQ(list.via.array.size, 3u);
  const std::vector<std::string> stored_keys = {
      "type",      "block_hashes",       "parent_block_hash",
      "token_ids", "block_size",         "lora_id",
      "medium",    "lora_name",          "extra_keys",
      "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window"};
  const msgpack::object& e0 = list.via.array.ptr[0];
  EXPECT_EQ(Keys(e0), stored_keys);
  EXPECT_EQ(Value(e0, "extra_keys").type, msgpack::type::NIL);
  ASSERT_EQ(Value(e0, "group_idx").type, msgpack::type::POSITIVE_INTEGER);
  EXPECT_EQ(Value(e0, "group_idx").via.u64, 0u);
  EXPECT_EQ(Str(Value(e0, "kv_cache_spec_kind")), "full_attention");
  EXPECT_EQ(Value(e0, "kv_cache_spec_sliding_window").type, msgpack::type::NIL);
  const msgpack::object& e1 = list.via.array.ptr[1];
  EXPECT_EQ(Keys(e1), stored_keys);
  EXPECT_EQ(Value(e1, "group_idx").via.u64, 1u);
  EXPECT_EQ(Str(Value(e1, "kv_cache_spec_kind")), "sliding_window");
  ASSERT_EQ(Value(e1, "kv_cache_spec_sliding_window").type, msgpack::type::POSITIVE_INTEGER);
  EXPECT_EQ(Value(e1, "kv_cache_spec_sliding_window").via.u64, 512u);
  const msgpack::object& e2 = list.via.array.ptr[2];
  EXPECT_EQ(Keys(e2), (std::vector<std::string>{"type", "block_hashes", "medium", "group_idx"}));
  EXPECT_EQ(Value(e2, "group_idx").via.u64, 1u);

  // The strict reader agrees.
  absl::StatusOr<testing::ReadVllmBatch> read = testing::DecodeVllmPayload(payload);
  ASSERT_THAT(read, IsOk());
  ASSERT_EQ(read->events.size(), 3u);
  EXPECT_EQ(read->events[0].group_idx, 0);
  EXPECT_EQ(read->events[0].kv_cache_spec_kind, "full_attention");
  EXPECT_EQ(read->events[0].sliding_window, std::nullopt);
  EXPECT_EQ(read->events[1].group_idx, 1);
  EXPECT_EQ(read->events[1].kv_cache_spec_kind, "sliding_window");
  EXPECT_EQ(read->events[1].sliding_window, 512);
  EXPECT_EQ(read->events[1].block_hashes, full.block_hashes);
  EXPECT_EQ(read->events[2].group_idx, 1);
  // Without a group none of these fields is written (the stream without groups is as ever).
  full.group.reset();
  EncodeVllmBatch(1764000000.5, std::vector<VllmEvent>{full}, info, &payload);
  read = testing::DecodeVllmPayload(payload);
  ASSERT_THAT(read, IsOk());
  EXPECT_EQ(read->events[0].group_idx, std::nullopt);
  EXPECT_EQ(read->events[0].kv_cache_spec_kind, "");
}

TEST(VllmEventsTest, RandomBatchesRoundTripThroughTheReader) {
  const uint32_t seed = 20261202;
  std::printf("seed %u\n", seed);
  std::mt19937_64 rng(seed);
  for (int round = 0; round < 200; ++round) {
    VllmStreamInfo info;
    info.block_size = 1 + static_cast<int32_t>(rng() % 32);
    std::vector<VllmEvent> events(rng() % 6);
    uint64_t next_id = rng();
    for (VllmEvent& event : events) {
      event.kind = static_cast<VllmEvent::Kind>(rng() % 3);
      if (event.kind == VllmEvent::Kind::kAllBlocksCleared) continue;
      event.medium = static_cast<VllmMedium>(rng() % 3);
      const size_t blocks = 1 + rng() % 5;
      for (size_t b = 0; b < blocks; ++b) event.block_hashes.push_back(next_id++);
      if (event.kind == VllmEvent::Kind::kBlockStored) {
        if (rng() % 2) event.parent_block_hash = next_id++;
        for (size_t t = 0; t < blocks * static_cast<size_t>(info.block_size); ++t) {
          event.token_ids.push_back(static_cast<uint32_t>(rng()));
        }
      }
    }
    std::string payload;
    EncodeVllmBatch(static_cast<double>(round), events, info, &payload);
    absl::StatusOr<testing::ReadVllmBatch> read = testing::DecodeVllmPayload(payload);
    ASSERT_THAT(read, IsOk()) << " (round " << round << ")";
    ASSERT_EQ(read->events.size(), events.size());
    for (size_t i = 0; i < events.size(); ++i) {
      EXPECT_EQ(read->events[i].type, VllmEventTypeName(events[i].kind));
      EXPECT_EQ(read->events[i].block_hashes, events[i].block_hashes);
      EXPECT_EQ(read->events[i].parent_block_hash, events[i].parent_block_hash);
      EXPECT_EQ(read->events[i].token_ids, events[i].token_ids);
      if (events[i].kind != VllmEvent::Kind::kAllBlocksCleared) {
        EXPECT_EQ(read->events[i].medium, VllmMediumName(events[i].medium));
      }
    }
  }
}

TEST(VllmEventsTest, ReaderRefusesWhatConsumersRefuse) {
  auto pack = [](auto&& fill) {
    msgpack::sbuffer buffer;
    msgpack::packer<msgpack::sbuffer> packer(buffer);
    fill(packer);
    return std::string(buffer.data(), buffer.size());
  };
  // Two elements (Dynamo rejects it).
  EXPECT_FALSE(testing::DecodeVllmPayload(pack([](auto& p) {
                 p.pack_array(2);
                 p.pack_double(1.0);
                 p.pack_array(0);
               })).ok());
  // A bin hash.
  EXPECT_FALSE(testing::DecodeVllmPayload(pack([](auto& p) {
                 p.pack_array(3);
                 p.pack_double(1.0);
                 p.pack_array(1);
                 p.pack_map(3);
                 p.pack(std::string("type"));
                 p.pack(std::string("BlockRemoved"));
                 p.pack(std::string("block_hashes"));
                 p.pack_array(1);
                 p.pack_bin(8);
                 p.pack_bin_body("12345678", 8);
                 p.pack(std::string("medium"));
                 p.pack(std::string("GPU"));
                 p.pack(0);
               })).ok());
  // A BlockRemoved whose group_idx is not an unsigned integer.
  EXPECT_FALSE(testing::DecodeVllmPayload(pack([](auto& p) {
                 p.pack_array(3);
                 p.pack_double(1.0);
                 p.pack_array(1);
                 p.pack_map(4);
                 p.pack(std::string("type"));
                 p.pack(std::string("BlockRemoved"));
                 p.pack(std::string("block_hashes"));
                 p.pack_array(0);
                 p.pack(std::string("medium"));
                 p.pack(std::string("GPU"));
                 p.pack(std::string("group_idx"));
                 p.pack(std::string("1"));
                 p.pack(0);
               })).ok());
  // A grouped BlockStored without its kind and window.
  {
    VllmEvent stored;
    stored.kind = VllmEvent::Kind::kBlockStored;
    stored.block_hashes = {1};
    stored.token_ids = {1, 2, 3, 4};
    stored.group = VllmGroup{1, 8};
    VllmStreamInfo info;
    info.block_size = 4;
    std::string payload;
    EncodeVllmBatch(1.0, std::vector<VllmEvent>{stored}, info, &payload);
    ASSERT_THAT(testing::DecodeVllmPayload(payload), IsOk());
    // Drop the last two keys (kind and window) and make the map header say 10.
    const std::string window_key = "kv_cache_spec_kind";
    const size_t at = payload.find(window_key);
    ASSERT_NE(at, std::string::npos);
    std::string cut = payload.substr(0, at - 1) + payload.substr(payload.size() - 1);
    const size_t header = cut.find(static_cast<char>(0x8c));  // fixmap of 12
    ASSERT_NE(header, std::string::npos);
    cut[header] = static_cast<char>(0x8a);  // fixmap of 10
    const absl::StatusOr<testing::ReadVllmBatch> refused = testing::DecodeVllmPayload(cut);
    ASSERT_FALSE(refused.ok());
    EXPECT_NE(refused.status().message().find("BlockStored"), std::string::npos)
        << refused.status();
  }
  // Not msgpack at all.
  EXPECT_FALSE(testing::DecodeVllmPayload("\xc1garbage").ok());
}

TEST(VllmEventsTest, BlockIdIsTheHashsFirstEightBytesBigEndian) {
  BlockHash hash;
  for (size_t i = 0; i < hash.bytes.size(); ++i) hash.bytes[i] = static_cast<uint8_t>(i + 1);
  EXPECT_EQ(VllmBlockId(hash), 0x0102030405060708ull);
  hash.bytes[0] = 0xff;
  EXPECT_EQ(VllmBlockId(hash), 0xff02030405060708ull);
  EXPECT_EQ(VllmBlockId(hash, HashAlgorithm::kSha256), 0xff02030405060708ull);
  // vLLM's sha256_cbor: its own id, the digest's last 8 bytes big-endian.
  EXPECT_EQ(VllmBlockId(hash, HashAlgorithm::kVllmSha256Cbor), 0x191a1b1c1d1e1f20ull);
}

}  // namespace
}  // namespace kvcm::cache_manager
