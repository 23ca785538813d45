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
