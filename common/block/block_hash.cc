#include "common/block/block_hash.h"

#include <openssl/evp.h>

// Header-only use of Debian's xxHash: the hash is inlined into its callers.
#define XXH_INLINE_ALL
#include <xxhash.h>

#include <algorithm>
#include <bit>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "common/base/check.h"

namespace kvcm {
namespace {

static_assert(std::endian::native == std::endian::little,
              "the block hash encoding writes integers little-endian; add byte swaps "
              "before building on a big-endian machine");

constexpr std::string_view kRootTag = "kvcm.root.v1";
constexpr std::string_view kRootTagV2 = "kvcm.root.v2";
// kXxh3V2's seed for a block with extra keys (the message that carries its counts).
constexpr uint64_t kXxh3V2KeyedSeed = 1;
// vLLM's DEFAULT_NONE_HASH_SEED (vllm/v1/core/kv_cache_utils.py).
constexpr std::string_view kVllmNoneHashSeed = "vllm-none-hash";

// One SHA-256 context per thread, initialised once; each digest re-initialises it from
// the pre-fetched algorithm (no per-call algorithm lookup or allocation).
class Sha256Context {
 public:
  Sha256Context() : md_(EVP_MD_fetch(nullptr, "SHA256", nullptr)), ctx_(EVP_MD_CTX_new()) {
    KVCM_CHECK(md_ != nullptr && ctx_ != nullptr) << "OpenSSL has no SHA256";
  }
  ~Sha256Context() {
    EVP_MD_CTX_free(ctx_);
    EVP_MD_free(md_);
  }
  Sha256Context(const Sha256Context&) = delete;
  Sha256Context& operator=(const Sha256Context&) = delete;

  BlockHash Digest(std::span<const uint8_t> bytes) {
    BlockHash out;
    unsigned int len = 0;
    KVCM_CHECK(EVP_DigestInit_ex2(ctx_, md_, nullptr) == 1 &&
               EVP_DigestUpdate(ctx_, bytes.data(), bytes.size()) == 1 &&
               EVP_DigestFinal_ex(ctx_, out.bytes.data(), &len) == 1 && len == 32)
        << "SHA-256 failed";
    return out;
  }

 private:
  EVP_MD* md_;
  EVP_MD_CTX* ctx_;
};

Sha256Context& ThreadSha256() {
  thread_local Sha256Context context;
  return context;
}

// MurmurHash3 x64 128 (Austin Appleby's public-domain algorithm), seed 0.
inline uint64_t FMix64(uint64_t k) {
  k ^= k >> 33;
  k *= 0xff51afd7ed558ccdULL;
  k ^= k >> 33;
  k *= 0xc4ceb9fe1a85ec53ULL;
  k ^= k >> 33;
  return k;
}

inline uint64_t Load64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

BlockHash Murmur3X64128(const uint8_t* data, size_t len) {
  constexpr uint64_t c1 = 0x87c37b91114253d5ULL;
  constexpr uint64_t c2 = 0x4cf5ad432745937fULL;
  uint64_t h1 = 0;
  uint64_t h2 = 0;
  const size_t nblocks = len / 16;
  for (size_t i = 0; i < nblocks; ++i) {
    uint64_t k1 = Load64(data + 16 * i);
    uint64_t k2 = Load64(data + 16 * i + 8);
    k1 *= c1;
    k1 = std::rotl(k1, 31);
    k1 *= c2;
    h1 ^= k1;
    h1 = std::rotl(h1, 27);
    h1 += h2;
    h1 = h1 * 5 + 0x52dce729;
    k2 *= c2;
    k2 = std::rotl(k2, 33);
    k2 *= c1;
    h2 ^= k2;
    h2 = std::rotl(h2, 31);
    h2 += h1;
    h2 = h2 * 5 + 0x38495ab5;
  }
  const uint8_t* tail = data + nblocks * 16;
  const size_t rest = len & 15;
  uint64_t k1 = 0;
  uint64_t k2 = 0;
  for (size_t i = rest; i > 8; --i) k2 ^= uint64_t{tail[i - 1]} << (8 * (i - 9));
  if (rest > 8) {
    k2 *= c2;
    k2 = std::rotl(k2, 33);
    k2 *= c1;
    h2 ^= k2;
  }
  for (size_t i = std::min<size_t>(rest, 8); i > 0; --i)
    k1 ^= uint64_t{tail[i - 1]} << (8 * (i - 1));
  if (rest > 0) {
    k1 *= c1;
    k1 = std::rotl(k1, 31);
    k1 *= c2;
    h1 ^= k1;
  }
  h1 ^= len;
  h2 ^= len;
  h1 += h2;
  h2 += h1;
  h1 = FMix64(h1);
  h2 = FMix64(h2);
  h1 += h2;
  h2 += h1;
  BlockHash out;
  std::memcpy(out.bytes.data(), &h1, 8);
  std::memcpy(out.bytes.data() + 8, &h2, 8);
  return out;
}

// XXH3-128 as BlockHash: the canonical (big-endian) digest in bytes [0, 16).
inline BlockHash Xxh3Canonical(const XXH128_hash_t& h) {
  XXH128_canonical_t canonical;
  XXH128_canonicalFromHash(&canonical, h);
  BlockHash out;
  static_assert(sizeof(canonical.digest) == 16);
  std::memcpy(out.bytes.data(), canonical.digest, sizeof(canonical.digest));
  return out;
}

inline BlockHash Xxh3Of(const uint8_t* data, size_t len, uint64_t seed) {
  return Xxh3Canonical(XXH3_128bits_withSeed(data, len, seed));
}

// kXxh3V2's digest as two words: bytes [0, 8) and [8, 16) read little-endian, which is how
// the next block's message reads its parent (bytes [16, 32) of a kXxh3V2 hash are zero).
struct Xxh3V2Words {
  uint64_t lo;
  uint64_t hi;
};

inline Xxh3V2Words WordsOf(const BlockHash& hash) {
  return {Load64(hash.bytes.data()), Load64(hash.bytes.data() + 8)};
}

inline BlockHash HashOf(Xxh3V2Words words) {
  BlockHash out;  // bytes [16, 32) zero
  std::memcpy(out.bytes.data(), &words.lo, 8);
  std::memcpy(out.bytes.data() + 8, &words.hi, 8);
  return out;
}

// Whether Xxh3V2Step serves blocks of kTokens tokens: its message is 16 + 4 × kTokens bytes,
// which must take XXH3's 17-to-128-byte path with every round but the last past byte 16.
template <size_t kTokens>
inline constexpr bool kHasXxh3V2Step = kTokens >= 8 && 16 + 4 * kTokens <= 128;

// kXxh3V2's ChainBlockHash of kTokens tokens without extra keys: XXH3-128, seed 0, of the
// message parent bytes [0, 16) || tokens, computed the way xxHash's 17-to-128-byte path
// computes it (XXH3's output is fixed by its specification; tests compare this with
// XXH3_128bits on the built message) but with the parent in two registers. Every round of
// that path but the last reads tokens only; the last mixes in bytes [0, 16), the parent.
// So in a chain the token rounds of the next block run while this block's digest is still
// being computed, and the chain's latency per block is one 128-bit multiply, the
// finalisation and two byte swaps instead of the whole hash, built message and digest
// stores included (docs/PERFORMANCE.md, "Block ledger on an allocation trace").
template <size_t kTokens>
[[gnu::always_inline]] inline Xxh3V2Words Xxh3V2Step(Xxh3V2Words parent, const int32_t* tokens) {
  static_assert(kHasXxh3V2Step<kTokens>);
  constexpr size_t kLen = 16 + 4 * kTokens;
  const auto* bytes = reinterpret_cast<const uint8_t*>(tokens);
  // Message offset (at least 16, past the parent) -> where those bytes are.
  auto at = [bytes](size_t offset) { return bytes + (offset - 16); };
  const uint8_t* secret = XXH3_kSecret;
  XXH128_hash_t acc;
  acc.low64 = kLen * XXH_PRIME64_1;
  acc.high64 = 0;
  if constexpr (kLen > 64) {
    if constexpr (kLen > 96) acc = XXH128_mix32B(acc, at(48), at(kLen - 64), secret + 96, 0);
    acc = XXH128_mix32B(acc, at(32), at(kLen - 48), secret + 64, 0);
  }
  acc = XXH128_mix32B(acc, at(16), at(kLen - 32), secret + 32, 0);
  // The last round, XXH128_mix32B(acc, message, message + kLen - 16, secret, 0), with the
  // message's first 16 bytes being the parent's words.
  const uint8_t* last = at(kLen - 16);
  acc.low64 +=
      XXH3_mul128_fold64(parent.lo ^ XXH_readLE64(secret), parent.hi ^ XXH_readLE64(secret + 8));
  acc.low64 ^= XXH_readLE64(last) + XXH_readLE64(last + 8);
  acc.high64 += XXH3_mix16B(last, secret + 16, 0);
  acc.high64 ^= parent.lo + parent.hi;
  // The path's finalisation (seed 0).
  const uint64_t low = XXH3_avalanche(acc.low64 + acc.high64);
  const uint64_t high = 0 - XXH3_avalanche(acc.low64 * XXH_PRIME64_1 + acc.high64 * XXH_PRIME64_4 +
                                           kLen * XXH_PRIME64_2);
  // The canonical digest is high then low, each big-endian; read back little-endian.
  return {__builtin_bswap64(high), __builtin_bswap64(low)};
}

// Which of the two encodings (common/block/block_hash.h) an XXH3 block hash is over.
enum class Xxh3Message { kV1, kV2 };

// kXxh3's or kXxh3V2's ChainBlockHash of a block of kTokens tokens without extra keys
// (nearly every block): the message built with its length known to the compiler, so XXH3's
// length dispatch folds away and the message is assembled in a few stores.
template <Xxh3Message kMessage, size_t kTokens>
[[gnu::always_inline]] inline BlockHash Xxh3BlockOf(const BlockHash& parent,
                                                    const int32_t* tokens) {
  if constexpr (kMessage == Xxh3Message::kV2 && kHasXxh3V2Step<kTokens>) {
    return HashOf(Xxh3V2Step<kTokens>(WordsOf(parent), tokens));
  }
  constexpr size_t kSize =
      kMessage == Xxh3Message::kV1 ? 32 + 4 + 4 * kTokens + 4 : 16 + 4 * kTokens;
  uint8_t message[kSize];
  if constexpr (kMessage == Xxh3Message::kV1) {
    std::memcpy(message, parent.bytes.data(), 32);
    const uint32_t count = kTokens;
    std::memcpy(message + 32, &count, 4);
    std::memcpy(message + 36, tokens, 4 * kTokens);
    const uint32_t no_keys = 0;
    std::memcpy(message + 36 + 4 * kTokens, &no_keys, 4);
  } else {
    std::memcpy(message, parent.bytes.data(), 16);
    std::memcpy(message + 16, tokens, 4 * kTokens);
  }
  // What XXH3_128bits(message, kSize) calls, forced inline (xxhash.h's own inline path for
  // XXH_INLINE_ALL users), so that the constant length picks the mixing rounds at compile
  // time: the public function is an out-of-line call that tests the length at run time.
  return Xxh3Canonical(XXH3_128bits_internal(message, kSize, 0, XXH3_kSecret, sizeof(XXH3_kSecret),
                                             XXH3_hashLong_128b_default));
}

// The block sizes with a fast path (a power of two from 8 to 32: the sizes deployments use).
inline bool HasXxh3FastPath(size_t tokens) { return tokens == 16 || tokens == 32 || tokens == 8; }

// Xxh3BlockOf for one of the sizes HasXxh3FastPath accepts.
template <Xxh3Message kMessage>
inline BlockHash Xxh3BlockFast(const BlockHash& parent, const int32_t* tokens, size_t n) {
  switch (n) {
    case 8:
      return Xxh3BlockOf<kMessage, 8>(parent, tokens);
    case 32:
      return Xxh3BlockOf<kMessage, 32>(parent, tokens);
    default:
      return Xxh3BlockOf<kMessage, 16>(parent, tokens);
  }
}

// Appends `blocks` chained block hashes of kTokens tokens each to `out`, whose capacity
// holds them (so that `parent`, which may be out->back(), stays put). Flattened: with the
// hash forced inline the compiler no longer inlined push_back, and its call was about a
// sixth of the chain's instructions (sizing the vector first instead costs a memset).
template <Xxh3Message kMessage, size_t kTokens>
[[gnu::flatten]] void Xxh3ChainOf(const BlockHash& parent, const int32_t* tokens, size_t blocks,
                                  std::vector<BlockHash>* out) {
  if constexpr (kMessage == Xxh3Message::kV2 && kHasXxh3V2Step<kTokens>) {
    // The parent stays in registers from block to block (Xxh3V2Step), and the tokens are
    // prefetched kPrefetchBytes ahead: a prompt's tokens may come from memory rather than
    // cache (the trace replay's always do), and the hardware prefetcher alone left the chain
    // waiting on them at about twice its in-cache time per block (docs/PERFORMANCE.md).
    constexpr size_t kBlockBytes = 4 * kTokens;
    constexpr size_t kPrefetchBytes = 1024;
    const auto* bytes = reinterpret_cast<const char*>(tokens);
    const size_t total = blocks * kBlockBytes;
    for (size_t at = 0; at < std::min(total, kPrefetchBytes); at += 64) {
      __builtin_prefetch(bytes + at);
    }
    Xxh3V2Words prev = WordsOf(parent);
    for (size_t i = 0; i < blocks; ++i, tokens += kTokens) {
      const size_t ahead = i * kBlockBytes + kPrefetchBytes;
      if (ahead < total) __builtin_prefetch(bytes + ahead);
      prev = Xxh3V2Step<kTokens>(prev, tokens);
      out->push_back(HashOf(prev));
    }
  } else {
    BlockHash prev = parent;
    for (size_t i = 0; i < blocks; ++i, tokens += kTokens) {
      prev = Xxh3BlockOf<kMessage, kTokens>(prev, tokens);
      out->push_back(prev);
    }
  }
}

// Xxh3ChainOf for one of the sizes HasXxh3FastPath accepts.
template <Xxh3Message kMessage>
void Xxh3Chain(const BlockHash& parent, const int32_t* tokens, size_t n, size_t blocks,
               std::vector<BlockHash>* out) {
  switch (n) {
    case 8:
      return Xxh3ChainOf<kMessage, 8>(parent, tokens, blocks, out);
    case 32:
      return Xxh3ChainOf<kMessage, 32>(parent, tokens, blocks, out);
    default:
      return Xxh3ChainOf<kMessage, 16>(parent, tokens, blocks, out);
  }
}

// Builds the encoded message in a reusable per-thread buffer.
class Encoder {
 public:
  void Clear() { buf_.clear(); }
  void PutU32(uint32_t v) { PutBytes(&v, sizeof(v)); }
  void PutBytes(const void* p, size_t n) {
    const size_t at = buf_.size();
    buf_.resize(at + n);
    if (n != 0) std::memcpy(buf_.data() + at, p, n);
  }
  std::span<const uint8_t> bytes() const { return buf_; }
  void Resize(size_t n) { buf_.resize(n); }
  uint8_t* data() { return buf_.data(); }

 private:
  std::vector<uint8_t> buf_;
};

Encoder& ThreadEncoder() {
  thread_local Encoder encoder;
  return encoder;
}

BlockHash Digest(HashAlgorithm algorithm, std::span<const uint8_t> bytes) {
  switch (algorithm) {
    case HashAlgorithm::kSha256:
    case HashAlgorithm::kVllmSha256Cbor:
      return Sha256Digest(bytes);
    case HashAlgorithm::kFast128:
      return Fast128Digest(bytes);
    case HashAlgorithm::kXxh3:
    case HashAlgorithm::kXxh3V2:
      return Xxh3Digest(bytes);
  }
  KVCM_CHECK(false) << "unknown hash algorithm " << static_cast<int>(algorithm);
  return {};
}

// Canonical CBOR (RFC 8949 4.2.1, as cbor2.dumps(..., canonical=True) writes the values
// vLLM hashes): each head in its shortest form. Writes into a buffer the caller sized with
// the Max* bounds below.
class CborWriter {
 public:
  // The most bytes a head, an integer or a string of `n` bytes takes.
  static constexpr size_t kMaxHead = 9;
  static constexpr size_t MaxString(size_t n) { return kMaxHead + n; }

  explicit CborWriter(uint8_t* out) : p_(out) {}

  void Head(uint8_t major, uint64_t value) {
    const auto type = static_cast<uint8_t>(major << 5);
    if (value < 24) {
      *p_++ = static_cast<uint8_t>(type | value);
    } else if (value <= 0xff) {
      *p_++ = type | 24;
      *p_++ = static_cast<uint8_t>(value);
    } else if (value <= 0xffff) {
      *p_++ = type | 25;
      BigEndian(value, 2);
    } else if (value <= 0xffffffff) {
      *p_++ = type | 26;
      BigEndian(value, 4);
    } else {
      *p_++ = type | 27;
      BigEndian(value, 8);
    }
  }
  // Major type 0 for n >= 0, 1 (encoding -1 - n) below.
  void Int(int64_t n) {
    if (n >= 0) {
      Head(0, static_cast<uint64_t>(n));
    } else {
      Head(1, static_cast<uint64_t>(-1 - n));
    }
  }
  void Bytes(std::span<const uint8_t> bytes) {
    Head(2, bytes.size());
    Raw(bytes.data(), bytes.size());
  }
  void Text(std::string_view text) {
    Head(3, text.size());
    Raw(text.data(), text.size());
  }
  void Array(size_t n) { Head(4, n); }
  void Null() { *p_++ = 0xf6; }

  uint8_t* end() const { return p_; }

 private:
  void BigEndian(uint64_t value, int n) {
    for (int i = n - 1; i >= 0; --i) *p_++ = static_cast<uint8_t>(value >> (8 * i));
  }
  void Raw(const void* bytes, size_t n) {
    if (n != 0) std::memcpy(p_, bytes, n);
    p_ += n;
  }

  uint8_t* p_;
};

// SHA-256(CBOR([parent, [tokens...], extra_keys or null])): vLLM's hash_block_tokens with
// sha256_cbor. Token is int32_t or int64_t.
template <typename Token>
BlockHash VllmChainHash(const BlockHash& parent, std::span<const Token> tokens,
                        std::span<const std::string_view> extra_keys) {
  size_t size = 1 + CborWriter::MaxString(parent.bytes.size()) + CborWriter::kMaxHead +
                tokens.size() * CborWriter::kMaxHead + CborWriter::kMaxHead;
  for (std::string_view key : extra_keys) size += CborWriter::MaxString(key.size());
  constexpr size_t kStackBytes = 512;  // a 16-token block takes at most 125
  uint8_t stack[kStackBytes];
  uint8_t* out = stack;
  if (size > kStackBytes) {
    Encoder& enc = ThreadEncoder();
    enc.Resize(size);
    out = enc.data();
  }
  CborWriter cbor(out);
  cbor.Array(3);
  cbor.Bytes(parent.bytes);
  cbor.Array(tokens.size());
  for (Token t : tokens) cbor.Int(t);
  if (extra_keys.empty()) {
    cbor.Null();
  } else {
    cbor.Array(extra_keys.size());
    for (std::string_view key : extra_keys) cbor.Text(key);
  }
  return Sha256Digest(std::span<const uint8_t>(out, static_cast<size_t>(cbor.end() - out)));
}

}  // namespace

std::string_view HashAlgorithmName(HashAlgorithm algorithm) {
  switch (algorithm) {
    case HashAlgorithm::kSha256:
      return "sha256";
    case HashAlgorithm::kFast128:
      return "fast128";
    case HashAlgorithm::kXxh3:
      return "xxh3";
    case HashAlgorithm::kVllmSha256Cbor:
      return "sha256_cbor";
    case HashAlgorithm::kXxh3V2:
      return "xxh3_v2";
  }
  return "unknown";
}

absl::StatusOr<HashAlgorithm> ParseHashAlgorithm(std::string_view name) {
  if (name == "sha256") return HashAlgorithm::kSha256;
  if (name == "fast128") return HashAlgorithm::kFast128;
  if (name == "xxh3") return HashAlgorithm::kXxh3;
  if (name == "xxh3_v2") return HashAlgorithm::kXxh3V2;
  if (name == "sha256_cbor") return HashAlgorithm::kVllmSha256Cbor;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown hash algorithm '", std::string(name),
                   "' (expected xxh3_v2, xxh3, sha256, sha256_cbor or fast128)"));
}

std::string BlockHash::ToHex() const {
  return absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()));
}

BlockHash Sha256Digest(std::span<const uint8_t> bytes) { return ThreadSha256().Digest(bytes); }

BlockHash Fast128Digest(std::span<const uint8_t> bytes) {
  return Murmur3X64128(bytes.data(), bytes.size());
}

BlockHash Xxh3Digest(std::span<const uint8_t> bytes, uint64_t seed) {
  return Xxh3Of(bytes.data(), bytes.size(), seed);
}

BlockHash RootHash(HashAlgorithm algorithm, std::string_view salt) {
  if (algorithm == HashAlgorithm::kVllmSha256Cbor) {
    // NONE_HASH = sha256_cbor(seed): the seed a CBOR text string.
    const std::string_view seed = salt.empty() ? kVllmNoneHashSeed : salt;
    Encoder& enc = ThreadEncoder();
    enc.Resize(CborWriter::MaxString(seed.size()));
    CborWriter cbor(enc.data());
    cbor.Text(seed);
    return Sha256Digest(
        std::span<const uint8_t>(enc.data(), static_cast<size_t>(cbor.end() - enc.data())));
  }
  Encoder& enc = ThreadEncoder();
  enc.Clear();
  const std::string_view tag = algorithm == HashAlgorithm::kXxh3V2 ? kRootTagV2 : kRootTag;
  enc.PutBytes(tag.data(), tag.size());
  enc.PutU32(static_cast<uint32_t>(salt.size()));
  enc.PutBytes(salt.data(), salt.size());
  return Digest(algorithm, enc.bytes());
}

BlockHash ChainBlockHash(HashAlgorithm algorithm, const BlockHash& parent,
                         std::span<const int32_t> tokens,
                         std::span<const std::string_view> extra_keys) {
  if (extra_keys.empty() && HasXxh3FastPath(tokens.size())) {
    if (algorithm == HashAlgorithm::kXxh3V2) {
      return Xxh3BlockFast<Xxh3Message::kV2>(parent, tokens.data(), tokens.size());
    }
    if (algorithm == HashAlgorithm::kXxh3) {
      return Xxh3BlockFast<Xxh3Message::kV1>(parent, tokens.data(), tokens.size());
    }
  }
  if (algorithm == HashAlgorithm::kVllmSha256Cbor) {
    return VllmChainHash(parent, tokens, extra_keys);
  }
  const bool v2 = algorithm == HashAlgorithm::kXxh3V2;
  const bool counts = !v2 || !extra_keys.empty();  // version 2 drops them without keys
  const size_t parent_bytes = v2 ? 16 : parent.bytes.size();
  size_t size = parent_bytes + tokens.size_bytes() + (counts ? 8 : 0);
  for (std::string_view key : extra_keys) size += 4 + key.size();
  // Most messages (a block of up to 110 tokens without extra keys) are built on the stack.
  constexpr size_t kStackBytes = 512;
  uint8_t stack[kStackBytes];
  uint8_t* out = stack;
  if (size > kStackBytes) {
    Encoder& enc = ThreadEncoder();
    enc.Resize(size);
    out = enc.data();
  }
  uint8_t* p = out;
  auto put = [&p](const void* bytes, size_t n) {
    if (n != 0) std::memcpy(p, bytes, n);
    p += n;
  };
  auto put_u32 = [&put](size_t v) {
    const auto u = static_cast<uint32_t>(v);
    put(&u, sizeof(u));
  };
  put(parent.bytes.data(), parent_bytes);
  if (counts) put_u32(tokens.size());
  put(tokens.data(), tokens.size_bytes());
  if (counts) put_u32(extra_keys.size());
  for (std::string_view key : extra_keys) {
    put_u32(key.size());
    put(key.data(), key.size());
  }
  if (v2) return Xxh3Of(out, size, extra_keys.empty() ? 0 : kXxh3V2KeyedSeed);
  return Digest(algorithm, std::span<const uint8_t>(out, size));
}

BlockHash VllmSha256CborBlockHash(const BlockHash& parent, std::span<const int64_t> tokens,
                                  std::span<const std::string_view> extra_keys) {
  return VllmChainHash(parent, tokens, extra_keys);
}

void HashFullBlocks(HashAlgorithm algorithm, const BlockHash& parent,
                    std::span<const int32_t> tokens, int32_t block_size,
                    std::vector<BlockHash>* out) {
  KVCM_CHECK(block_size > 0) << "block_size " << block_size;
  const BlockHash first_parent = parent;  // `parent` may live in *out, which may move
  const size_t full = tokens.size() / static_cast<size_t>(block_size);
  // Geometric growth: callers append chunk after chunk to one vector (a reserve of exactly
  // size + full would reallocate and copy the whole vector on every call).
  if (out->size() + full > out->capacity()) {
    out->reserve(std::max(out->size() + full, 2 * out->capacity()));
  }
  if (HasXxh3FastPath(static_cast<size_t>(block_size))) {
    if (algorithm == HashAlgorithm::kXxh3V2) {
      Xxh3Chain<Xxh3Message::kV2>(first_parent, tokens.data(), static_cast<size_t>(block_size),
                                  full, out);
      return;
    }
    if (algorithm == HashAlgorithm::kXxh3) {
      Xxh3Chain<Xxh3Message::kV1>(first_parent, tokens.data(), static_cast<size_t>(block_size),
                                  full, out);
      return;
    }
  }
  BlockHash prev = first_parent;
  for (size_t i = 0; i < full; ++i) {
    prev = ChainBlockHash(algorithm, prev, tokens.subspan(i * block_size, block_size));
    out->push_back(prev);
  }
}

}  // namespace kvcm
