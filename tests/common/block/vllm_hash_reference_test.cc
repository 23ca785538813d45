// HashAlgorithm::kVllmSha256Cbor against vLLM's own functions: vLLM 0.33.0's
// hash_block_tokens, init_none_hash and maybe_convert_block_hash with
// vllm.utils.hashing.sha256_cbor, run by tests/reference/vllm/vllm_hash_reference.py from the
// two files it reads out of the vLLM wheel on PyPI (cached in the build directory), with
// cbor2 from BUILD_DIR/venv-vllm (scripts/python-env.sh). On a seeded set of token
// sequences: many lengths and block sizes, token ids in every CBOR integer width up to
// 2^32 - 1 (and beyond, and negative, through the 64-bit entry point), with and without
// extra keys and a PYTHONHASHSEED. Every digest must be equal byte for byte, and every
// event id (the low 64 bits, big-endian) equal to vLLM's int.
//
// KVCM_TEST_SEED overrides the seed (printed).

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/block/block_hash.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/support/status_matchers.h"
#include "tests/support/subprocess.h"

namespace kvcm {
namespace {

using ::kvcm::testing::RunProgram;
using ::kvcm::testing::TempDir;

uint64_t Seed() {
  if (const char* s = std::getenv("KVCM_TEST_SEED"); s != nullptr && *s != '\0') {
    return std::strtoull(s, nullptr, 10);
  }
  return 20261202;
}

struct Case {
  std::optional<std::string> seed;  // vLLM's PYTHONHASHSEED; kvcm's salt ("" when unset)
  int block_size = 16;
  std::vector<int64_t> tokens;
  // Per full block, when any block has some; an empty list is vLLM's None.
  std::optional<std::vector<std::vector<std::string>>> extra_keys;
};

// A token id of one of the CBOR integer widths (each width's edges included).
int64_t DrawToken(std::mt19937_64& rng, bool wide) {
  static constexpr int64_t kEdges[] = {
      0, 1, 23, 24, 255, 256, 65535, 65536, 151935, 2147483647, 2147483648, 4294967294, 4294967295};
  switch (rng() % (wide ? 7 : 5)) {
    case 0:
      return static_cast<int64_t>(rng() % 24);
    case 1:
      return static_cast<int64_t>(rng() % 256);
    case 2:
      return static_cast<int64_t>(rng() % 65536);
    case 3:
      return static_cast<int64_t>(rng() % 152064);  // a large vocabulary
    case 4: {
      const int64_t edge = kEdges[rng() % std::size(kEdges)];
      return edge > std::numeric_limits<int32_t>::max() ? 2147483647 : edge;
    }
    case 5:
      return kEdges[rng() % std::size(kEdges)];
    default:
      return static_cast<int64_t>(rng() % (uint64_t{1} << 32));  // up to 2^32 - 1
  }
}

std::vector<Case> MakeCases(uint64_t seed) {
  std::mt19937_64 rng(seed);
  static constexpr int kBlockSizes[] = {1, 2, 3, 7, 16, 16, 16, 17, 32, 64, 128, 256};
  static const std::optional<std::string> kSeeds[] = {std::nullopt, std::nullopt, "0", "kvcm-test",
                                                      "1234567890"};
  std::vector<Case> cases;
  for (int i = 0; i < 240; ++i) {
    Case c;
    c.seed = kSeeds[rng() % std::size(kSeeds)];
    c.block_size = kBlockSizes[rng() % std::size(kBlockSizes)];
    const int blocks = static_cast<int>(rng() % 9);
    // Partial last blocks too (no hash for them).
    const int len = blocks * c.block_size + static_cast<int>(rng() % c.block_size);
    const bool wide = i % 3 == 0;  // beyond int32: only the 64-bit entry point takes them
    for (int t = 0; t < len; ++t) c.tokens.push_back(DrawToken(rng, wide));
    if (i % 4 == 1 && blocks > 0) {
      std::vector<std::vector<std::string>> keys(blocks);
      for (int b = 0; b < blocks; ++b) {
        if (rng() % 2 == 0) continue;
        keys[b].push_back(absl::StrCat("lora-", rng() % 1000));
        if (rng() % 2 == 0) keys[b].push_back(std::string(rng() % 40, 'x'));  // 1/2-byte heads
      }
      c.extra_keys = std::move(keys);
    }
    cases.push_back(std::move(c));
  }
  // Negative ids (CBOR major type 1), which Python hashes like any other int.
  Case negative;
  negative.block_size = 4;
  negative.tokens = {-1, -24, -25, -256, -257, -65537, -2147483648LL, -4294967296LL};
  cases.push_back(negative);
  // Beyond 32 bits (a 9-byte head).
  Case huge;
  huge.block_size = 2;
  huge.tokens = {4294967296LL, std::numeric_limits<int64_t>::max()};
  cases.push_back(huge);
  return cases;
}

bool FitsInt32(const std::vector<int64_t>& tokens) {
  for (int64_t t : tokens) {
    if (t < std::numeric_limits<int32_t>::min() || t > std::numeric_limits<int32_t>::max()) {
      return false;
    }
  }
  return true;
}

TEST(VllmHashReferenceTest, EqualsVllmsOwnFunctions) {
  const uint64_t seed = Seed();
  std::printf("vllm_hash_reference_test: seed %llu (KVCM_TEST_SEED)\n",
              static_cast<unsigned long long>(seed));
  const std::vector<Case> cases = MakeCases(seed);

  absl::StatusOr<TempDir> dir = TempDir::Create("vllmhash");
  ASSERT_THAT(dir, IsOk());
  nlohmann::json in = {{"cases", nlohmann::json::array()}};
  for (const Case& c : cases) {
    nlohmann::json j = {{"seed", nullptr}, {"block_size", c.block_size}, {"tokens", c.tokens}};
    if (c.seed.has_value()) j["seed"] = *c.seed;
    if (c.extra_keys.has_value()) {
      nlohmann::json keys = nlohmann::json::array();
      for (const auto& k : *c.extra_keys) {
        keys.push_back(k.empty() ? nlohmann::json(nullptr) : nlohmann::json(k));
      }
      j["extra_keys"] = keys;
    }
    in["cases"].push_back(std::move(j));
  }
  const std::string in_path = dir->path() + "/in.json";
  const std::string out_path = dir->path() + "/out.json";
  {
    FILE* f = std::fopen(in_path.c_str(), "w");
    ASSERT_NE(f, nullptr);
    const std::string text = in.dump();
    ASSERT_EQ(std::fwrite(text.data(), 1, text.size(), f), text.size());
    std::fclose(f);
  }

  ASSERT_TRUE(std::filesystem::exists(KVCM_VLLM_PYTHON))
      << KVCM_VLLM_PYTHON << " is missing: run scripts/python-env.sh";
  const std::vector<std::string> argv = {
      KVCM_VLLM_PYTHON, KVCM_VLLM_HASH_SCRIPT, "--cache", KVCM_VLLM_WHEEL_CACHE, in_path, out_path};
  auto run = RunProgram(argv, "", absl::Minutes(5));
  ASSERT_THAT(run, IsOk());
  std::printf("%s", run->output.c_str());
  ASSERT_EQ(run->exit_code, 0) << absl::StrJoin(argv, " ");

  std::string text;
  {
    FILE* f = std::fopen(out_path.c_str(), "r");
    ASSERT_NE(f, nullptr);
    char buf[65536];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0) text.append(buf, n);
    std::fclose(f);
  }
  const nlohmann::json out = nlohmann::json::parse(text);
  ASSERT_EQ(out["cases"].size(), cases.size());

  int blocks_checked = 0, int32_checked = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    const nlohmann::json& want = out["cases"][i];
    SCOPED_TRACE(absl::StrCat("case ", i, " block_size ", c.block_size, " tokens ", c.tokens.size(),
                              " seed ", c.seed.value_or("(unset)")));
    const std::string salt = c.seed.value_or("");
    const BlockHash root = RootHash(HashAlgorithm::kVllmSha256Cbor, salt);
    ASSERT_EQ(root.ToHex(), want["none_hash"].get<std::string>());

    const size_t full = c.tokens.size() / static_cast<size_t>(c.block_size);
    ASSERT_EQ(want["hashes"].size(), full);
    std::vector<int32_t> tokens32;
    const bool fits = FitsInt32(c.tokens);
    if (fits) tokens32.assign(c.tokens.begin(), c.tokens.end());
    std::vector<BlockHash> chained;
    if (fits && !c.extra_keys.has_value()) {
      HashFullBlocks(HashAlgorithm::kVllmSha256Cbor, root, tokens32, c.block_size, &chained);
      ASSERT_EQ(chained.size(), full);
    }
    BlockHash parent = root;
    BlockHash parent32 = root;
    for (size_t b = 0; b < full; ++b) {
      std::vector<std::string_view> keys;
      if (c.extra_keys.has_value()) {
        for (const std::string& k : (*c.extra_keys)[b]) keys.push_back(k);
      }
      const std::span<const int64_t> block(c.tokens.data() + b * c.block_size,
                                           static_cast<size_t>(c.block_size));
      parent = VllmSha256CborBlockHash(parent, block, keys);
      ASSERT_EQ(parent.ToHex(), want["hashes"][b].get<std::string>()) << "block " << b;
      ASSERT_EQ(parent.Low64BigEndian(), want["ids"][b].get<uint64_t>()) << "block " << b;
      if (fits) {
        parent32 = ChainBlockHash(HashAlgorithm::kVllmSha256Cbor, parent32,
                                  std::span<const int32_t>(tokens32).subspan(
                                      b * c.block_size, static_cast<size_t>(c.block_size)),
                                  keys);
        ASSERT_EQ(parent32, parent) << "block " << b << ": the int32 entry point";
        if (!chained.empty()) {
          ASSERT_EQ(chained[b], parent) << "block " << b;
        }
        ++int32_checked;
      }
      ++blocks_checked;
    }
  }
  std::printf(
      "vllm_hash_reference_test: %zu sequences, %d blocks equal to vLLM's (%d also "
      "through the int32 entry points)\n",
      cases.size(), blocks_checked, int32_checked);
  EXPECT_GT(int32_checked, 100);
}

}  // namespace
}  // namespace kvcm
