#pragma once

// Chained block hashes for prefix caching.
//
// Block i of a sequence is identified by
//
//   h_i = H(h_{i-1}, tokens of block i, extra keys of block i)     (h_{-1} = RootHash(salt))
//
// so a block matches only if every token before it matches too. The hash is a pure
// function of its inputs — no process-local seeds — so the router can compute it, the
// cache manager can index it, KV events can carry it, and all agree across processes and
// restarts.
//
// Byte encoding (version 1). All integers little-endian. H is applied to exactly:
//
//   RootHash(salt):   "kvcm.root.v1" (12 bytes) || u32 len(salt) || salt bytes
//   BlockHash:        parent (32 bytes) || u32 num_tokens || num_tokens × i32 token ||
//                     u32 num_extra_keys || for each key: u32 len || key bytes
//
// Byte encoding (version 2, kXxh3V2 only): the version-1 message without its constant
// bytes. A 16-byte digest leaves bytes [16, 32) of a BlockHash zero, and a block's token
// count follows from the message's length, so neither is hashed:
//
//   RootHash(salt):   XXH3-128, seed 0, of "kvcm.root.v2" (12 bytes) || u32 len(salt) || salt
//   BlockHash:        without extra keys: XXH3-128, seed 0, of
//                       parent bytes [0, 16) || num_tokens × i32 token
//                     with extra keys: XXH3-128, seed 1, of
//                       parent bytes [0, 16) || u32 num_tokens || num_tokens × i32 token ||
//                       u32 num_extra_keys || for each key: u32 len || key bytes
//
// Each of the two block messages is injective (the first has a fixed-size head and a length
// of 16 + 4 × num_tokens; the second carries its counts), and the seed keeps them apart.
// A 16-token block is 80 bytes instead of 104: three rounds of XXH3's 17-to-128-byte path
// instead of four (docs/PERFORMANCE.md, "Block ledger on an allocation trace").
//
// The salt (model name/revision, tenant, LoRA adapter, ...) enters only through the root,
// and therefore every block hash of the chain. Per-block extra keys carry content that the
// token ids do not (for example the hash of an image whose placeholder tokens fall in the
// block); most callers pass none.
//
// Algorithms:
//   kXxh3V2:  XXH3 128-bit (xxHash, Debian's libxxhash) over the version-2 encoding, its
//             canonical (big-endian) digest in bytes [0, 16); bytes [16, 32) are zero. The
//             default: about ten times faster than SHA-256 on a 16-token block and twice
//             kXxh3 (bench/ledger_trace_bench prints all three). Not collision-resistant: a
//             client that can choose prompts could craft two blocks of equal hash, so
//             deployments whose clients are not all trusted choose kSha256.
//   kXxh3:    the same digest over the version-1 encoding: the default before kXxh3V2,
//             kept for clients that do not know kXxh3V2.
//   kSha256:  SHA-256 (OpenSSL), all 32 bytes. Collision-resistant, so a tenant cannot craft
//             a prompt that reads another tenant's KV.
//   kFast128: MurmurHash3 x64 128-bit, seed 0, in bytes [0, 16); bytes [16, 32) are zero.
//             Kept for clients that speak it; slower than kXxh3 and no safer.
//   kVllmSha256Cbor: vLLM's `sha256_cbor` prefix-caching hash, byte for byte, instead of the
//             version-1 encoding above (docs/cluster.md, "vLLM's block hash"):
//               RootHash(salt)    = SHA-256(CBOR(salt or "vllm-none-hash"))   (NONE_HASH)
//               ChainBlockHash    = SHA-256(CBOR([parent, [t_0, ...], extra_keys or null]))
//             CBOR as Python's cbor2.dumps(..., canonical=True) writes it: the parent a
//             32-byte byte string, tokens the shortest unsigned (or negative) integers,
//             extra keys an array of text strings, no keys null. A salt plays the part of
//             vLLM's PYTHONHASHSEED. For consumers that recompute vLLM's hash.
//
// Thread safety: all functions are thread-safe (SHA-256 contexts are thread-local).

#include <array>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace kvcm {

enum class HashAlgorithm : uint8_t {
  kSha256 = 0,
  kFast128 = 1,
  kXxh3 = 2,
  kVllmSha256Cbor = 3,
  kXxh3V2 = 4,
};

// The default for new deployments (see above).
inline constexpr HashAlgorithm kDefaultHashAlgorithm = HashAlgorithm::kXxh3V2;

// "sha256", "fast128", "xxh3", "xxh3_v2" or "sha256_cbor" (vLLM's name for
// kVllmSha256Cbor).
std::string_view HashAlgorithmName(HashAlgorithm algorithm);
absl::StatusOr<HashAlgorithm> ParseHashAlgorithm(std::string_view name);

struct BlockHash {
  std::array<uint8_t, 32> bytes{};

  // Four word compares, inlined (a defaulted array compare calls memcmp).
  friend bool operator==(const BlockHash& a, const BlockHash& b) {
    uint64_t x[4], y[4];
    std::memcpy(x, a.bytes.data(), sizeof(x));
    std::memcpy(y, b.bytes.data(), sizeof(y));
    return ((x[0] ^ y[0]) | (x[1] ^ y[1]) | (x[2] ^ y[2]) | (x[3] ^ y[3])) == 0;
  }

  // Lower-case hex of all 32 bytes.
  std::string ToHex() const;
  // The first 8 bytes as an integer: already uniformly distributed, used to bucket hashes.
  uint64_t Prefix64() const {
    uint64_t v;
    std::memcpy(&v, bytes.data(), sizeof(v));
    return v;
  }
  // The last 8 bytes read big-endian: the low 64 bits of the digest as a big integer, which
  // is the integer id vLLM's KV events carry for a block
  // (int.from_bytes(digest, "big") & (2**64 - 1)). Meaningful for kSha256/kVllmSha256Cbor,
  // whose 32 bytes are all digest.
  uint64_t Low64BigEndian() const {
    uint64_t v = 0;
    for (size_t i = bytes.size() - 8; i < bytes.size(); ++i) v = (v << 8) | bytes[i];
    return v;
  }
};

// Hash-map functor using the digest's own uniformity (no re-hashing of 32 bytes).
struct BlockHashHasher {
  size_t operator()(const BlockHash& hash) const { return hash.Prefix64(); }
};

// The chain's starting point for a given salt ("" for none).
BlockHash RootHash(HashAlgorithm algorithm, std::string_view salt);

// h_i from h_{i-1}. `tokens` is the block's tokens (block_size of them for a full block).
BlockHash ChainBlockHash(HashAlgorithm algorithm, const BlockHash& parent,
                         std::span<const int32_t> tokens,
                         std::span<const std::string_view> extra_keys = {});

// kVllmSha256Cbor's ChainBlockHash over 64-bit token ids (vLLM's token ids are Python
// integers; kvcm's are int32): the same CBOR, every integer width. For the tests against
// vLLM's own functions.
BlockHash VllmSha256CborBlockHash(const BlockHash& parent, std::span<const int64_t> tokens,
                                  std::span<const std::string_view> extra_keys = {});

// Hashes of every full block of `tokens` (a partial last block gets none), appended to
// `out`. Starts from `parent` (usually RootHash). REQUIRES: block_size > 0.
void HashFullBlocks(HashAlgorithm algorithm, const BlockHash& parent,
                    std::span<const int32_t> tokens, int32_t block_size,
                    std::vector<BlockHash>* out);

// Raw digests over arbitrary bytes, exposed for benchmarks and cross-language tests.
BlockHash Sha256Digest(std::span<const uint8_t> bytes);
BlockHash Fast128Digest(std::span<const uint8_t> bytes);
// XXH3-128 with `seed`, its canonical digest in bytes [0, 16).
BlockHash Xxh3Digest(std::span<const uint8_t> bytes, uint64_t seed = 0);

}  // namespace kvcm
