// The seed driver of a fuzz target (tests/support/fuzz_target.h), built into every
// NAME_seed_test by kvcm_fuzz_target (cmake/KvcmFuzz.cmake): it needs no clang and no
// libFuzzer, so the normal build and CI run every target.
//
//   1. Every file of the target's seed corpus (KVCM_FUZZ_CORPUS_DIR) goes through
//      LLVMFuzzerTestOneInput and must be accepted (fuzz::NoteAccepted): the seeds are valid
//      inputs, so a decoder that starts refusing one fails here.
//   2. A fixed number of seeded mutations of the seeds (KVCM_FUZZ_ITERATIONS): bit flips,
//      truncations, random byte ranges, integer fields set to extremes, dictionary entries
//      (KVCM_FUZZ_DICT, libFuzzer's format) inserted or written over, bytes deleted,
//      duplicated and spliced from another seed. None may break the target's contract;
//      some must be accepted and some refused (a mutator that changes nothing, or a decoder
//      that refuses everything, fails here).
//   3. Every input in KVCM_FUZZ_REGRESSIONS_DIR (one that once broke the target, found by
//      libFuzzer and kept as it was) goes through the target, accepted or not.
//
// Each input is copied into a heap buffer of exactly its size, so that a read past its end
// is a read past an allocation (which AddressSanitizer reports under KVCM_SANITIZE).
// KVCM_TEST_SEED and KVCM_FUZZ_ITERATIONS override the seed and the count; both are printed.

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/support/fuzz_target.h"

namespace kvcm::fuzz {
namespace {

uint64_t EnvOr(const char* name, uint64_t fallback) {
  if (const char* s = std::getenv(name); s != nullptr && *s != '\0') {
    return std::strtoull(s, nullptr, 10);
  }
  return fallback;
}

std::string ReadFile(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

struct Seed {
  std::string name;
  std::string bytes;
};

// The corpus, sorted by file name (so that a seed's mutations do not depend on the order
// the file system lists them in).
std::vector<Seed> ReadCorpus(const std::string& dir) {
  std::vector<Seed> seeds;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    if (!entry.is_regular_file()) continue;
    seeds.push_back({entry.path().filename().string(), ReadFile(entry.path())});
  }
  std::sort(seeds.begin(), seeds.end(),
            [](const Seed& a, const Seed& b) { return a.name < b.name; });
  return seeds;
}

int HexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// A libFuzzer dictionary: one `name="value"` or `"value"` a line, `#` comments, escapes
// \\ \" and \xAB. A line it cannot read fails the test (libFuzzer would refuse it too).
std::vector<std::string> ReadDictionary(const std::string& path) {
  std::vector<std::string> entries;
  if (path.empty()) return entries;
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << "cannot read " << path;
  std::string line;
  int number = 0;
  while (std::getline(in, line)) {
    ++number;
    const size_t start = line.find_first_not_of(" \t");
    if (start == std::string::npos || line[start] == '#') continue;
    const size_t open = line.find('"');
    const size_t close = line.rfind('"');
    if (open == std::string::npos || close <= open) {
      ADD_FAILURE() << path << ":" << number << ": not a dictionary entry: " << line;
      continue;
    }
    std::string value;
    for (size_t i = open + 1; i < close; ++i) {
      if (line[i] != '\\') {
        value += line[i];
      } else if (i + 1 < close && (line[i + 1] == '\\' || line[i + 1] == '"')) {
        value += line[++i];
      } else if (i + 3 < close && line[i + 1] == 'x' && HexValue(line[i + 2]) >= 0 &&
                 HexValue(line[i + 3]) >= 0) {
        value += static_cast<char>(HexValue(line[i + 2]) * 16 + HexValue(line[i + 3]));
        i += 3;
      } else {
        ADD_FAILURE() << path << ":" << number << ": bad escape: " << line;
        break;
      }
    }
    entries.push_back(std::move(value));
  }
  return entries;
}

class Mutator {
 public:
  Mutator(uint64_t seed, const std::vector<Seed>* seeds, std::vector<std::string> dictionary,
          size_t max_len)
      : rng_(seed), seeds_(seeds), dictionary_(std::move(dictionary)), max_len_(max_len) {}

  // A mutant of a seed picked at random: one to four edits.
  std::string Next() {
    std::string s = (*seeds_)[Pick(seeds_->size())].bytes;
    const uint64_t edits = 1 + Pick(4);
    for (uint64_t e = 0; e < edits; ++e) Edit(&s);
    if (s.size() > max_len_) s.resize(max_len_);
    return s;
  }

 private:
  uint64_t Pick(uint64_t n) { return n == 0 ? 0 : rng_() % n; }

  void Edit(std::string* s) {
    static constexpr uint64_t kExtremes[] = {0,
                                             1,
                                             2,
                                             7,
                                             8,
                                             31,
                                             32,
                                             255,
                                             256,
                                             0x7FFFFFFFu,
                                             0x80000000u,
                                             0xFFFFFFFFu,
                                             uint64_t{1} << 32,
                                             uint64_t{1} << 62,
                                             uint64_t{1} << 63,
                                             ~uint64_t{0}};
    switch (Pick(dictionary_.empty() ? 8 : 10)) {
      case 0:  // flip a bit
        if (!s->empty()) (*s)[Pick(s->size())] ^= static_cast<char>(1u << Pick(8));
        break;
      case 1:  // truncate
        s->resize(Pick(s->size() + 1));
        break;
      case 2: {  // overwrite a range with random bytes
        if (s->empty()) return;
        const size_t at = Pick(s->size());
        const size_t n = std::min<size_t>(s->size() - at, 1 + Pick(16));
        for (size_t i = 0; i < n; ++i) (*s)[at + i] = static_cast<char>(rng_());
        break;
      }
      case 3: {  // an integer field (1, 2, 4 or 8 bytes, anywhere) set to an extreme
        const size_t width = size_t{1} << Pick(4);
        if (s->size() < width) return;
        const size_t at = Pick(s->size() - width + 1);
        uint64_t v = kExtremes[Pick(std::size(kExtremes))];
        if (Pick(4) == 0) v = s->size() - Pick(64);  // near the input's size
        std::memcpy(s->data() + at, &v, width);
        break;
      }
      case 4:  // insert random bytes
        s->insert(Pick(s->size() + 1), std::string(1 + Pick(8), static_cast<char>(rng_())));
        break;
      case 5:  // delete bytes
        if (!s->empty()) s->erase(Pick(s->size()), 1 + Pick(16));
        break;
      case 6: {  // duplicate a range
        if (s->empty()) return;
        const std::string range = s->substr(Pick(s->size()), 1 + Pick(64));
        s->insert(Pick(s->size() + 1), range);
        break;
      }
      case 7: {  // splice: a range of another seed over the tail of this one
        const std::string& other = (*seeds_)[Pick(seeds_->size())].bytes;
        if (other.empty()) return;
        const size_t from = Pick(other.size());
        s->resize(Pick(s->size() + 1));
        s->append(other, from, 1 + Pick(other.size() - from));
        break;
      }
      case 8:  // insert a dictionary entry
        s->insert(Pick(s->size() + 1), dictionary_[Pick(dictionary_.size())]);
        break;
      default: {  // write a dictionary entry over the bytes at a random place
        const std::string& entry = dictionary_[Pick(dictionary_.size())];
        const size_t at = Pick(s->size() + 1);
        s->replace(at, std::min(entry.size(), s->size() - at), entry);
        break;
      }
    }
  }

  std::mt19937_64 rng_;
  const std::vector<Seed>* seeds_;
  const std::vector<std::string> dictionary_;
  const size_t max_len_;
};

// Runs one input from an exactly sized heap buffer; true when the target accepted it.
bool RunOne(const std::string& input) {
  const uint64_t before = AcceptedCount();
  std::vector<uint8_t> buffer(input.begin(), input.end());
  LLVMFuzzerTestOneInput(buffer.data(), buffer.size());
  return AcceptedCount() > before;
}

// KVCM_FUZZ_SUITE: the target's name in CamelCase, then FuzzSeedTest (GgufFuzzSeedTest).
TEST(KVCM_FUZZ_SUITE, EverySeedOfTheCorpusIsAccepted) {
  const std::vector<Seed> seeds = ReadCorpus(KVCM_FUZZ_CORPUS_DIR);
  ASSERT_FALSE(seeds.empty()) << "no seeds in " << KVCM_FUZZ_CORPUS_DIR;
  for (const Seed& seed : seeds) {
    EXPECT_LE(seed.bytes.size(), size_t{KVCM_FUZZ_MAX_LEN})
        << seed.name << " is longer than the target's -max_len";
    EXPECT_TRUE(RunOne(seed.bytes)) << KVCM_FUZZ_NAME << ": seed " << seed.name << " was refused";
  }
  std::printf("%s: %zu seeds from %s, all accepted\n", KVCM_FUZZ_NAME, seeds.size(),
              KVCM_FUZZ_CORPUS_DIR);
}

TEST(KVCM_FUZZ_SUITE, InputsThatOnceBrokeTheTargetKeepItsContract) {
  if (std::string(KVCM_FUZZ_REGRESSIONS_DIR).empty()) GTEST_SKIP() << "no regression inputs";
  const std::vector<Seed> inputs = ReadCorpus(KVCM_FUZZ_REGRESSIONS_DIR);
  ASSERT_FALSE(inputs.empty()) << "no inputs in " << KVCM_FUZZ_REGRESSIONS_DIR;
  for (const Seed& input : inputs) {
    const bool accepted = RunOne(input.bytes);
    std::printf("%s: %s %s\n", KVCM_FUZZ_NAME, input.name.c_str(),
                accepted ? "accepted" : "refused");
  }
}

TEST(KVCM_FUZZ_SUITE, SeededMutationsAreAcceptedOrRefusedWithoutBreakingTheContract) {
  const uint64_t seed = EnvOr("KVCM_TEST_SEED", 20261201);
  const uint64_t iterations = EnvOr("KVCM_FUZZ_ITERATIONS", KVCM_FUZZ_ITERATIONS);
  std::printf("%s: seed %llu, %llu iterations (KVCM_TEST_SEED, KVCM_FUZZ_ITERATIONS override)\n",
              KVCM_FUZZ_NAME, static_cast<unsigned long long>(seed),
              static_cast<unsigned long long>(iterations));
  const std::vector<Seed> seeds = ReadCorpus(KVCM_FUZZ_CORPUS_DIR);
  ASSERT_FALSE(seeds.empty()) << "no seeds in " << KVCM_FUZZ_CORPUS_DIR;
  Mutator mutator(seed, &seeds, ReadDictionary(KVCM_FUZZ_DICT), KVCM_FUZZ_MAX_LEN);
  uint64_t accepted = 0;
  for (uint64_t i = 0; i < iterations; ++i) accepted += RunOne(mutator.Next()) ? 1 : 0;
  std::printf("%s: %llu of %llu mutants accepted, the rest refused\n", KVCM_FUZZ_NAME,
              static_cast<unsigned long long>(accepted),
              static_cast<unsigned long long>(iterations));
  EXPECT_GT(accepted, 0u);
  EXPECT_LT(accepted, iterations);
}

}  // namespace
}  // namespace kvcm::fuzz
