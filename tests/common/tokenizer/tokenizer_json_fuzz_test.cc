// Drives LLVMFuzzerTestOneInput (tests/common/tokenizer/tokenizer_json_fuzz_target.cc) with
// seeded random mutations of a small valid tokenizer.json: bit flips, truncations, random
// byte ranges, JSON fragments and extreme numbers inserted, bytes deleted and duplicated. A
// fixed number of iterations, the seed printed; KVCM_TEST_SEED and KVCM_FUZZ_ITERATIONS
// override them. The target aborts on a broken contract.

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/tokenizer/bpe_tokenizer.h"
#include "common/tokenizer/byte_level.h"
#include "gtest/gtest.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace kvcm {
namespace {

uint64_t EnvOr(const char* name, uint64_t fallback) {
  if (const char* s = std::getenv(name); s != nullptr && *s != '\0') {
    return std::strtoull(s, nullptr, 10);
  }
  return fallback;
}

// Every byte, a few merges, added tokens with each flag, a Sequence of every pre-tokenizer
// kind, a TemplateProcessing post-processor.
std::string SeedFile() {
  using Json = nlohmann::json;
  Json vocab = Json::object();
  int id = 0;
  for (int b = 0; b < 256; ++b) {
    std::string spelled;
    internal::ByteLevelEncode(std::string(1, static_cast<char>(b)), &spelled);
    vocab[spelled] = id++;
  }
  Json merges = Json::array();
  for (const auto& [a, b] : std::vector<std::pair<std::string, std::string>>{
           {"Ġ", "t"}, {"h", "e"}, {"Ġt", "he"}, {"l", "l"}, {"e", "ll"}, {"H", "ell"}}) {
    if (!vocab.contains(a + b)) vocab[a + b] = id++;
    merges.push_back(Json::array({a, b}));
  }
  Json added = Json::array();
  for (const auto& [content, special, lstrip, rstrip, single] :
       std::vector<std::tuple<std::string, bool, bool, bool, bool>>{
           {"<|end|>", true, false, false, false},
           {"<mask>", true, true, false, false},
           {"[END]", true, false, true, false},
           {"kvcm", false, false, false, true}}) {
    added.push_back({{"id", id++}, {"content", content}, {"special", special}, {"lstrip", lstrip},
                     {"rstrip", rstrip}, {"single_word", single}, {"normalized", !special}});
  }
  Json root = {
      {"version", "1.0"},
      {"truncation", nullptr},
      {"padding", nullptr},
      {"added_tokens", added},
      {"normalizer", nullptr},
      {"pre_tokenizer",
       {{"type", "Sequence"},
        {"pretokenizers",
         Json::array({{{"type", "Split"},
                       {"pattern", {{"Regex", R"((?i:'s|'ll)|\p{L}+|\p{N}{1,3}|\s+(?!\S)|\s+)"}}},
                       {"behavior", "Isolated"},
                       {"invert", false}},
                      {{"type", "Split"},
                       {"pattern", {{"String", "-"}}},
                       {"behavior", "MergedWithNext"},
                       {"invert", false}},
                      {{"type", "Digits"}, {"individual_digits", true}},
                      {{"type", "ByteLevel"},
                       {"add_prefix_space", false},
                       {"trim_offsets", true},
                       {"use_regex", true}}})}}},
      {"post_processor",
       {{"type", "TemplateProcessing"},
        {"single", Json::array({{{"SpecialToken", {{"id", "<|end|>"}, {"type_id", 0}}}},
                                {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}})},
        {"special_tokens",
         {{"<|end|>", {{"id", "<|end|>"}, {"ids", Json::array({262})}, {"tokens", {"<|end|>"}}}}}}}},
      {"decoder", {{"type", "ByteLevel"}}},
      {"model",
       {{"type", "BPE"},
        {"dropout", nullptr},
        {"unk_token", nullptr},
        {"fuse_unk", false},
        {"byte_fallback", false},
        {"ignore_merges", true},
        {"vocab", vocab},
        {"merges", merges}}}};
  return root.dump(1);
}

void Mutate(std::mt19937_64& rng, std::string* s) {
  auto pick = [&](uint64_t n) { return n == 0 ? uint64_t{0} : rng() % n; };
  static const char* kFragments[] = {
      "{", "}", "[", "]", "\"", ",", ":", "null", "true", "false", "-1", "0", "2147483648",
      "99999999999", "1e308", "-0.5", "\"\"", "\\u0000", "\\ud800", "\xff", "\xc3", "\"type\"",
      "\"BPE\"", "\"Split\"", "\"Regex\"", "\"(\"", "\"[\"", "\"\\\\p{\"", "\"id\"",
      "\"content\"", "\"merges\"", "[\"a\",\"b\"]", "\"Ġ t\"", "{\"type\":\"Sequence\"}",
      "\"Contiguous\"", "\"MergedWithPrevious\"", "\"Removed\""};
  switch (pick(7)) {
    case 0:  // flip a bit
      if (!s->empty()) (*s)[pick(s->size())] ^= static_cast<char>(1u << pick(8));
      break;
    case 1:  // truncate
      s->resize(pick(s->size() + 1));
      break;
    case 2: {  // overwrite a range with random bytes
      if (s->empty()) return;
      const size_t at = pick(s->size());
      const size_t n = std::min<size_t>(s->size() - at, 1 + pick(8));
      for (size_t i = 0; i < n; ++i) (*s)[at + i] = static_cast<char>(rng());
      break;
    }
    case 3:
    case 4: {  // insert a JSON fragment
      const char* fragment = kFragments[pick(sizeof(kFragments) / sizeof(kFragments[0]))];
      s->insert(pick(s->size() + 1), fragment);
      break;
    }
    case 5: {  // delete bytes
      if (s->empty()) return;
      s->erase(pick(s->size()), 1 + pick(16));
      break;
    }
    case 6: {  // duplicate a range
      if (s->empty()) return;
      const size_t at = pick(s->size());
      const std::string range = s->substr(at, 1 + pick(64));
      s->insert(pick(s->size() + 1), range);
      break;
    }
  }
}

TEST(TokenizerJsonFuzzTest, SeededMutationsOfAValidFile) {
  const uint64_t seed = EnvOr("KVCM_TEST_SEED", 20240917);
  const uint64_t iterations = EnvOr("KVCM_FUZZ_ITERATIONS", 20000);
  std::printf("seed %llu, %llu iterations (KVCM_TEST_SEED, KVCM_FUZZ_ITERATIONS override)\n",
              static_cast<unsigned long long>(seed), static_cast<unsigned long long>(iterations));
  std::mt19937_64 rng(seed);
  const std::string valid = SeedFile();
  {
    absl::StatusOr<BpeVocab> vocab = ParseTokenizerJson(valid, "seed");
    ASSERT_TRUE(vocab.ok()) << vocab.status();
    auto tokenizer = BpeTokenizer::FromVocab(*vocab, 0);
    ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
    EXPECT_TRUE((*tokenizer)->add_bos());
    EXPECT_EQ((*tokenizer)->Decode((*tokenizer)->Encode("Hello the-kvcm 42").value()).value(),
              "Hello the-kvcm 42");
  }
  uint64_t accepted = 0;
  for (uint64_t i = 0; i < iterations; ++i) {
    std::string s = valid;
    const uint64_t mutations = 1 + rng() % 4;
    for (uint64_t m = 0; m < mutations; ++m) Mutate(rng, &s);
    std::vector<uint8_t> buffer(s.begin(), s.end());
    LLVMFuzzerTestOneInput(buffer.data(), buffer.size());
    absl::StatusOr<BpeVocab> vocab = ParseTokenizerJson(s, "mutant");
    if (vocab.ok()) {
      ++accepted;
    } else {
      ASSERT_TRUE(vocab.status().code() == absl::StatusCode::kInvalidArgument ||
                  vocab.status().code() == absl::StatusCode::kUnimplemented)
          << vocab.status();
      ASSERT_NE(vocab.status().message().find("mutant"), std::string_view::npos) << vocab.status();
    }
  }
  std::printf("%llu of %llu mutants parsed, the rest refused naming the file\n",
              static_cast<unsigned long long>(accepted),
              static_cast<unsigned long long>(iterations));
  EXPECT_GT(accepted, 0u);
  EXPECT_LT(accepted, iterations);
}

}  // namespace
}  // namespace kvcm
