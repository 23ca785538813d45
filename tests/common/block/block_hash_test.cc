#include "common/block/block_hash.h"

#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "gtest/gtest.h"
#include "tests/support/status_matchers.h"

namespace kvcm {
namespace {

// Expected digests come from tools/block_hash_reference.py, an independent implementation of
// the byte encoding documented in common/block/block_hash.h (Python hashlib and mmh3). A
// change here is a wire change: caches and peers built with the old encoding stop matching.
constexpr char kRootSha[] = "8c9082fa5d3a4c3cac833d8ac1072441f1186b25142614bc16cebc5a653fdb92";
constexpr char kRootSaltSha[] = "8b28482fa8d151e376299e35fa88d95b1f686df13c640c1c3c5f8a33c4ac8399";
constexpr char kBlock0Sha[] = "5da00b179036ba4b20f0db6b24d87a012ea20fc76afcea50b885ac05429ffef6";
constexpr char kBlock1Sha[] = "0eff7bf9c0453beb736638ddb0ab3c48eb9bc1ed8b49e0393b6abcd3d46d0ad2";
constexpr char kRootFast[] = "8191260192c41afbaf2c19d6f7ca3d6d00000000000000000000000000000000";
constexpr char kBlock0Fast[] = "9971f11f30493bcf64193fde4058db8000000000000000000000000000000000";

std::span<const uint8_t> Bytes(std::string_view s) {
  return {reinterpret_cast<const uint8_t*>(s.data()), s.size()};
}

TEST(BlockHashTest, Sha256MatchesTheDocumentedEncoding) {
  const BlockHash root = RootHash(HashAlgorithm::kSha256, "");
  EXPECT_EQ(root.ToHex(), kRootSha);
  EXPECT_EQ(RootHash(HashAlgorithm::kSha256, "llama").ToHex(), kRootSaltSha);
  const std::vector<int32_t> block0 = {1, 2, 3, 4};
  const BlockHash h0 = ChainBlockHash(HashAlgorithm::kSha256, root, block0);
  EXPECT_EQ(h0.ToHex(), kBlock0Sha);
  const std::vector<int32_t> block1 = {5, 6, 7, -1};
  const std::vector<std::string_view> extra = {"img"};
  EXPECT_EQ(ChainBlockHash(HashAlgorithm::kSha256, h0, block1, extra).ToHex(), kBlock1Sha);
}

TEST(BlockHashTest, Fast128MatchesMurmur3Reference) {
  // MurmurHash3 x64 128, seed 0: published vectors ("" hashes to zero).
  EXPECT_EQ(Fast128Digest(Bytes("")).ToHex(), std::string(64, '0'));
  EXPECT_EQ(Fast128Digest(Bytes("hello")).ToHex().substr(0, 32),
            "029bbd41b3a7d8cb191dae486a901e5b");
  EXPECT_EQ(
      Fast128Digest(Bytes("The quick brown fox jumps over the lazy dog")).ToHex().substr(0, 32),
      "6c1b07bc7bbc4be347939ac4a93c437a");
  const BlockHash root = RootHash(HashAlgorithm::kFast128, "");
  EXPECT_EQ(root.ToHex(), kRootFast);
  const std::vector<int32_t> block0 = {1, 2, 3, 4};
  EXPECT_EQ(ChainBlockHash(HashAlgorithm::kFast128, root, block0).ToHex(), kBlock0Fast);
}

// Vectors from the Python `xxhash` package (4.1.0, xxHash 0.8): tools/block_hash_reference.py
// prints them when it is installed.
TEST(BlockHashTest, Xxh3MatchesTheXxhashReference) {
  EXPECT_EQ(Xxh3Digest(Bytes("")).ToHex().substr(0, 32), "99aa06d3014798d86001c324468d497f");
  EXPECT_EQ(Xxh3Digest(Bytes("hello")).ToHex(),
            "b5e9c1ad071b3e7fc779cfaa5e523818" + std::string(32, '0'));
  const BlockHash root = RootHash(HashAlgorithm::kXxh3, "");
  EXPECT_EQ(root.ToHex(), "5899b711f0a210b11947a2aec42bdd21" + std::string(32, '0'));
  const std::vector<int32_t> block0 = {1, 2, 3, 4};
  EXPECT_EQ(ChainBlockHash(HashAlgorithm::kXxh3, root, block0).ToHex(),
            "76a791762b3e240a195bfb91fb9e43bf" + std::string(32, '0'));
}

// kXxh3V2 (the version-2 message) against tools/block_hash_reference.py, which builds it
// with Python's struct and hashes it with the `xxhash` package.
TEST(BlockHashTest, Xxh3V2MatchesTheDocumentedEncoding) {
  const BlockHash root = RootHash(HashAlgorithm::kXxh3V2, "");
  EXPECT_EQ(root.ToHex(), "357f2dc8406bd0ab06a020c1af03954c" + std::string(32, '0'));
  EXPECT_EQ(RootHash(HashAlgorithm::kXxh3V2, "llama").ToHex(),
            "eeeba20a8b5f2ccbcc83b9225c0de330" + std::string(32, '0'));
  const std::vector<int32_t> block0 = {1, 2, 3, 4};
  const BlockHash h0 = ChainBlockHash(HashAlgorithm::kXxh3V2, root, block0);
  EXPECT_EQ(h0.ToHex(), "383ba6d5e27ec80c29c95cee6b9d9ba5" + std::string(32, '0'));
  const std::vector<int32_t> block1 = {5, 6, 7, -1};
  const std::vector<std::string_view> extra = {"img"};
  EXPECT_EQ(ChainBlockHash(HashAlgorithm::kXxh3V2, h0, block1, extra).ToHex(),
            "9566f861211e3badcdaf2e289448db7a" + std::string(32, '0'));
  // A 16-token block: the fast path's 80-byte message.
  std::vector<int32_t> block16(16);
  for (int i = 0; i < 16; ++i) block16[i] = 100 + i;
  EXPECT_EQ(ChainBlockHash(HashAlgorithm::kXxh3V2, root, block16).ToHex(),
            "ad1373209cb360f675afcbc8ceb7e1ab" + std::string(32, '0'));
  std::vector<BlockHash> chained;
  HashFullBlocks(HashAlgorithm::kXxh3V2, root, block16, 16, &chained);
  ASSERT_EQ(chained.size(), 1u);
  EXPECT_EQ(chained[0].ToHex(), "ad1373209cb360f675afcbc8ceb7e1ab" + std::string(32, '0'));
  // Version 2 is a different hash from version 1 over the same inputs.
  EXPECT_NE(h0, ChainBlockHash(HashAlgorithm::kXxh3, root, block0));
}

// vLLM's sha256_cbor, from vLLM 0.33.0's own functions (tests/reference/vllm/
// vllm_hash_reference.py prints them; vllm_hash_reference_test checks many more live).
TEST(BlockHashTest, VllmSha256CborMatchesVllm) {
  const BlockHash none = RootHash(HashAlgorithm::kVllmSha256Cbor, "");
  EXPECT_EQ(none.ToHex(), "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0");
  std::vector<BlockHash> hashes;
  const std::vector<int32_t> tokens = {1, 2, 3, 4, 5, 6, 7, 8, 9};
  HashFullBlocks(HashAlgorithm::kVllmSha256Cbor, none, tokens, 4, &hashes);
  ASSERT_EQ(hashes.size(), 2u);
  EXPECT_EQ(hashes[0].ToHex(), "58d0879dff3800f65f8c5fd449d73048c0f7699dd238a03b84b146b151d55111");
  EXPECT_EQ(hashes[1].ToHex(), "e1bc29393a2da9fd798f35ff04d215f846aee6df4b803ce3d43b57df56b58fb1");
  EXPECT_EQ(hashes[0].Low64BigEndian(), 9561501211280363793ULL);  // vLLM's event id
  EXPECT_EQ(hashes[1].Low64BigEndian(), 15292913576410714033ULL);

  // PYTHONHASHSEED=abc; 2^32 - 1 (a 5-byte integer), 0, 24 (2 bytes), 23 (1 byte); extra
  // keys ("lora",) on the first block, None on the second.
  const BlockHash seeded = RootHash(HashAlgorithm::kVllmSha256Cbor, "abc");
  EXPECT_EQ(seeded.ToHex(), "a6d89baf01ac02637da09835b28485b2db68576834d01869fc15e36b124c617c");
  const std::vector<int64_t> b0 = {4294967295LL, 0};
  const std::vector<int64_t> b1 = {24, 23};
  const std::vector<std::string_view> lora = {"lora"};
  const BlockHash h0 = VllmSha256CborBlockHash(seeded, b0, lora);
  EXPECT_EQ(h0.ToHex(), "cfece4699db2ec90916f565f87a72522b20d339888b7eb0b08d505a958384306");
  EXPECT_EQ(VllmSha256CborBlockHash(h0, b1).ToHex(),
            "a07e9de9017c980e80fd98faa076ffe5c61020ec8cfc2270a4e24616134a6fcd");
  EXPECT_EQ(VllmSha256CborBlockHash(h0, b1).Low64BigEndian(), 11881135827583659981ULL);
}

TEST(BlockHashTest, HashAlgorithmNamesRoundTrip) {
  for (HashAlgorithm algo : {HashAlgorithm::kSha256, HashAlgorithm::kFast128, HashAlgorithm::kXxh3,
                             HashAlgorithm::kVllmSha256Cbor, HashAlgorithm::kXxh3V2}) {
    absl::StatusOr<HashAlgorithm> parsed = ParseHashAlgorithm(HashAlgorithmName(algo));
    ASSERT_THAT(parsed, IsOk());
    EXPECT_EQ(*parsed, algo);
  }
  EXPECT_EQ(HashAlgorithmName(HashAlgorithm::kVllmSha256Cbor), "sha256_cbor");
  absl::StatusOr<HashAlgorithm> bad = ParseHashAlgorithm("sha256-cbor");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("sha256_cbor"), std::string_view::npos);
}

TEST(BlockHashTest, Fast128HandlesEveryTailLength) {
  // Every tail length 0..15 and several block counts give distinct digests.
  absl::flat_hash_set<std::string> seen;
  std::string data;
  for (int len = 0; len < 64; ++len) {
    EXPECT_TRUE(seen.insert(Fast128Digest(Bytes(data)).ToHex()).second) << len;
    data.push_back(static_cast<char>('a' + len % 26));
  }
}

TEST(BlockHashTest, ChainDependsOnEveryInput) {
  for (HashAlgorithm algo : {HashAlgorithm::kSha256, HashAlgorithm::kFast128, HashAlgorithm::kXxh3,
                             HashAlgorithm::kVllmSha256Cbor, HashAlgorithm::kXxh3V2}) {
    const BlockHash root = RootHash(algo, "");
    const std::vector<int32_t> tokens = {10, 20, 30, 40};
    const BlockHash base = ChainBlockHash(algo, root, tokens);
    EXPECT_EQ(base, ChainBlockHash(algo, root, tokens));                        // deterministic
    EXPECT_NE(base, ChainBlockHash(algo, RootHash(algo, "tenant-b"), tokens));  // salt
    std::vector<int32_t> other = tokens;
    other[3] = 41;
    EXPECT_NE(base, ChainBlockHash(algo, root, other));  // tokens
    const std::vector<int32_t> shorter = {10, 20, 30};
    EXPECT_NE(base, ChainBlockHash(algo, root, shorter));  // length
    const std::vector<std::string_view> extra = {"lora-7"};
    EXPECT_NE(base, ChainBlockHash(algo, root, tokens, extra));  // extra keys
    // Extra keys are length-prefixed: ("ab","c") differs from ("a","bc").
    const std::vector<std::string_view> k1 = {"ab", "c"};
    const std::vector<std::string_view> k2 = {"a", "bc"};
    EXPECT_NE(ChainBlockHash(algo, root, tokens, k1), ChainBlockHash(algo, root, tokens, k2));
  }
}

TEST(BlockHashTest, HashFullBlocksChainsAndSkipsPartialBlock) {
  std::vector<int32_t> tokens(10);
  for (int i = 0; i < 10; ++i) tokens[i] = i;
  const BlockHash root = RootHash(HashAlgorithm::kSha256, "");
  std::vector<BlockHash> hashes;
  HashFullBlocks(HashAlgorithm::kSha256, root, tokens, 4, &hashes);
  ASSERT_EQ(hashes.size(), 2u);
  EXPECT_EQ(hashes[0], ChainBlockHash(HashAlgorithm::kSha256, root, std::span(tokens).first(4)));
  EXPECT_EQ(hashes[1],
            ChainBlockHash(HashAlgorithm::kSha256, hashes[0], std::span(tokens).subspan(4, 4)));
  // Same prefix, different continuation: the first block matches, the second does not.
  std::vector<int32_t> forked = tokens;
  forked[5] = 99;
  std::vector<BlockHash> other;
  HashFullBlocks(HashAlgorithm::kSha256, root, forked, 4, &other);
  EXPECT_EQ(other[0], hashes[0]);
  EXPECT_NE(other[1], hashes[1]);
}

// Appending block after block to one vector (as a sequence grows) must grow it
// geometrically: a reserve of exactly size + new blocks copied the whole vector on every
// call, which made a long replay quadratic.
TEST(BlockHashTest, HashFullBlocksAppendingOneBlockAtATimeDoesNotReallocateEachCall) {
  std::vector<int32_t> tokens(4, 7);
  std::vector<BlockHash> hashes;
  BlockHash parent = RootHash(HashAlgorithm::kFast128, "");
  int reallocations = 0;
  const BlockHash* data = nullptr;
  for (int i = 0; i < 1000; ++i) {
    HashFullBlocks(HashAlgorithm::kFast128, parent, tokens, 4, &hashes);
    parent = hashes.back();
    if (hashes.data() != data) ++reallocations;
    data = hashes.data();
  }
  ASSERT_EQ(hashes.size(), 1000u);
  EXPECT_LE(reallocations, 12);  // about log2(1000) with doubling
}
TEST(BlockHashTest, ParsesAlgorithmNames) {
  EXPECT_EQ(*ParseHashAlgorithm("sha256"), HashAlgorithm::kSha256);
  EXPECT_EQ(*ParseHashAlgorithm("fast128"), HashAlgorithm::kFast128);
  EXPECT_EQ(*ParseHashAlgorithm("xxh3"), HashAlgorithm::kXxh3);
  EXPECT_EQ(HashAlgorithmName(HashAlgorithm::kXxh3), "xxh3");
  EXPECT_EQ(*ParseHashAlgorithm("xxh3_v2"), HashAlgorithm::kXxh3V2);
  EXPECT_EQ(HashAlgorithmName(HashAlgorithm::kXxh3V2), "xxh3_v2");
  EXPECT_EQ(kDefaultHashAlgorithm, HashAlgorithm::kXxh3V2);
  EXPECT_EQ(ParseHashAlgorithm("md5").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(HashAlgorithmName(HashAlgorithm::kFast128), "fast128");
}

// kXxh3's fast path (a block of 8, 16 or 32 tokens without extra keys, built with its length
// known at compile time) must give exactly the digest of the documented version-1 message,
// here built byte by byte and hashed by Xxh3Digest; other sizes and extra keys take the
// general path, checked the same way. Random tokens and parents from a printed seed.
std::vector<uint8_t> Version1Message(const BlockHash& parent, std::span<const int32_t> tokens) {
  std::vector<uint8_t> m(parent.bytes.begin(), parent.bytes.end());
  auto put_u32 = [&m](uint32_t v) {
    for (int i = 0; i < 4; ++i) m.push_back(static_cast<uint8_t>(v >> (8 * i)));
  };
  put_u32(static_cast<uint32_t>(tokens.size()));
  for (int32_t t : tokens) put_u32(static_cast<uint32_t>(t));
  put_u32(0);  // no extra keys
  return m;
}

// The version-2 message: the parent's 16 digest bytes and the tokens, nothing else.
std::vector<uint8_t> Version2Message(const BlockHash& parent, std::span<const int32_t> tokens) {
  std::vector<uint8_t> m(parent.bytes.begin(), parent.bytes.begin() + 16);
  for (int32_t t : tokens) {
    for (int i = 0; i < 4; ++i)
      m.push_back(static_cast<uint8_t>(static_cast<uint32_t>(t) >> (8 * i)));
  }
  return m;
}

// The same for kXxh3V2: its fast path against the version-2 message built byte by byte, and
// a block with extra keys against the version-1 layout of its tail hashed with seed 1. For
// blocks of 8 and 16 tokens the fast path is Xxh3V2Step, XXH3's 17-to-128-byte path written
// out with the parent in registers: the chain of three blocks checks it against xxHash's own
// XXH3_128bits_withSeed (Xxh3Digest) on random parents and tokens.
TEST(BlockHashTest, Xxh3V2FastPathEqualsTheVersion2Message) {
  constexpr uint64_t kSeed = 20261203;
  std::printf("seed %llu\n", static_cast<unsigned long long>(kSeed));
  std::mt19937_64 rng(kSeed);
  for (size_t block_size : {1, 4, 8, 12, 15, 16, 17, 31, 32, 64}) {
    for (int round = 0; round < 50; ++round) {
      BlockHash parent;
      for (int i = 0; i < 16; ++i) parent.bytes[i] = static_cast<uint8_t>(rng());
      std::vector<int32_t> tokens(block_size * 3 + block_size / 2);  // 3 full, a partial
      for (int32_t& t : tokens) t = static_cast<int32_t>(rng());
      const std::span<const int32_t> first(tokens.data(), block_size);
      const BlockHash h0 = ChainBlockHash(HashAlgorithm::kXxh3V2, parent, first);
      ASSERT_EQ(h0, Xxh3Digest(Version2Message(parent, first)))
          << "block size " << block_size << " round " << round;
      std::vector<BlockHash> chained = {BlockHash{}};
      HashFullBlocks(HashAlgorithm::kXxh3V2, parent, tokens, static_cast<int32_t>(block_size),
                     &chained);
      ASSERT_EQ(chained.size(), 4u);
      BlockHash expected = parent;
      for (size_t b = 0; b < 3; ++b) {
        expected = Xxh3Digest(
            Version2Message(expected, std::span(tokens).subspan(b * block_size, block_size)));
        ASSERT_EQ(chained[b + 1], expected) << "block size " << block_size << " block " << b;
      }
      // With extra keys: parent bytes [0, 16), then the version-1 message's tail, seed 1.
      const std::vector<std::string_view> extra = {"img"};
      std::vector<uint8_t> keyed(parent.bytes.begin(), parent.bytes.begin() + 16);
      const std::vector<uint8_t> v1 = Version1Message(parent, first);
      keyed.insert(keyed.end(), v1.begin() + 32, v1.end() - 4);
      const uint8_t keys[] = {1, 0, 0, 0, 3, 0, 0, 0, 'i', 'm', 'g'};  // 1 key, "img"
      keyed.insert(keyed.end(), std::begin(keys), std::end(keys));
      EXPECT_EQ(ChainBlockHash(HashAlgorithm::kXxh3V2, parent, first, extra), Xxh3Digest(keyed, 1))
          << "block size " << block_size << " round " << round;
      EXPECT_NE(Xxh3Digest(keyed, 1), Xxh3Digest(keyed));
    }
  }
}

TEST(BlockHashTest, Xxh3FastPathEqualsTheVersion1Message) {
  constexpr uint64_t kSeed = 20261202;
  std::printf("seed %llu\n", static_cast<unsigned long long>(kSeed));
  std::mt19937_64 rng(kSeed);
  for (size_t block_size : {1, 4, 8, 12, 15, 16, 17, 31, 32, 64}) {
    for (int round = 0; round < 50; ++round) {
      BlockHash parent;
      for (int i = 0; i < 16; ++i) parent.bytes[i] = static_cast<uint8_t>(rng());
      std::vector<int32_t> tokens(block_size * 3 + block_size / 2);  // 3 full, a partial
      for (int32_t& t : tokens) t = static_cast<int32_t>(rng());
      const std::span<const int32_t> first(tokens.data(), block_size);
      const BlockHash h0 = ChainBlockHash(HashAlgorithm::kXxh3, parent, first);
      ASSERT_EQ(h0, Xxh3Digest(Version1Message(parent, first)))
          << "block size " << block_size << " round " << round;
      // HashFullBlocks chains the same hashes (3 full blocks, the partial one skipped).
      std::vector<BlockHash> chained = {BlockHash{}};
      HashFullBlocks(HashAlgorithm::kXxh3, parent, tokens, static_cast<int32_t>(block_size),
                     &chained);
      ASSERT_EQ(chained.size(), 4u);
      BlockHash expected = parent;
      for (size_t b = 0; b < 3; ++b) {
        expected = Xxh3Digest(
            Version1Message(expected, std::span(tokens).subspan(b * block_size, block_size)));
        ASSERT_EQ(chained[b + 1], expected) << "block size " << block_size << " block " << b;
      }
      // Extra keys leave the fast path and still change the hash.
      const std::vector<std::string_view> extra = {"img"};
      EXPECT_NE(ChainBlockHash(HashAlgorithm::kXxh3, parent, first, extra), h0);
    }
  }
}

// The parent may be an element of the vector the hashes are appended to, which may move.
TEST(BlockHashTest, HashFullBlocksTakesItsParentFromTheOutputVector) {
  for (HashAlgorithm algo :
       {HashAlgorithm::kXxh3, HashAlgorithm::kXxh3V2, HashAlgorithm::kSha256}) {
    const std::vector<int32_t> tokens(16 * 40, 3);
    std::vector<BlockHash> hashes = {RootHash(algo, "")};
    hashes.shrink_to_fit();
    HashFullBlocks(algo, hashes.back(), tokens, 16, &hashes);  // reallocates
    ASSERT_EQ(hashes.size(), 41u);
    EXPECT_EQ(hashes[1], ChainBlockHash(algo, RootHash(algo, ""), std::span(tokens).first(16)));
    EXPECT_EQ(hashes[40], ChainBlockHash(algo, hashes[39], std::span(tokens).first(16)));
  }
}

}  // namespace
}  // namespace kvcm
