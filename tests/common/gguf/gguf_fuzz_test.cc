// Drives LLVMFuzzerTestOneInput (tests/common/gguf/gguf_fuzz_target.cc) with seeded random
// mutations of a small valid GGUF: bit flips, truncations, random byte ranges, integer
// fields set to extremes, inserted and deleted bytes. A fixed number of iterations (not a
// time), the seed printed; KVCM_TEST_SEED and KVCM_FUZZ_ITERATIONS override them. The
// target aborts on a broken contract; run under KVCM_SANITIZE for out-of-bounds reads.

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/gguf/ggml_types.h"
#include "common/gguf/gguf_file.h"
#include "common/gguf/gguf_writer.h"
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

// A small file with every value type, nested arrays and tensors of every implemented
// type (the k-quants from random bytes).
std::string SeedFile(std::mt19937_64& rng) {
  GgufWriter w;
  EXPECT_TRUE(w.Add("general.architecture", GgufValue::String("llama")).ok());
  EXPECT_TRUE(w.SetAlignment(32).ok());
  EXPECT_TRUE(w.Add("llama.block_count", GgufValue::Uint32(2)).ok());
  EXPECT_TRUE(w.Add("i8", GgufValue::Int8(-3)).ok());
  EXPECT_TRUE(w.Add("u16", GgufValue::Uint16(7)).ok());
  EXPECT_TRUE(w.Add("i64", GgufValue::Int64(-9)).ok());
  EXPECT_TRUE(w.Add("u64", GgufValue::Uint64(9)).ok());
  EXPECT_TRUE(w.Add("f32", GgufValue::Float32(0.5f)).ok());
  EXPECT_TRUE(w.Add("f64", GgufValue::Float64(0.25)).ok());
  EXPECT_TRUE(w.Add("b", GgufValue::Bool(true)).ok());
  EXPECT_TRUE(w.Add("tokens", GgufValue::StringArray({"<s>", "a", "Ġb", "é"})).ok());
  EXPECT_TRUE(w.Add("types", GgufValue::Int32Array(std::vector<int32_t>{1, 2, 3, 1})).ok());
  EXPECT_TRUE(w.Add("scores", GgufValue::Float32Array(std::vector<float>{0, -1, -2, -3})).ok());
  EXPECT_TRUE(w.Add("nested", GgufValue::Array(GgufValueType::kArray,
                                               {GgufValue::StringArray({"x"}),
                                                GgufValue::Int32Array(std::vector<int32_t>{5})}))
                  .ok());
  std::normal_distribution<float> normal;
  for (GgmlType type : {GgmlType::kF32, GgmlType::kF16, GgmlType::kBF16, GgmlType::kQ8_0,
                        GgmlType::kQ4_0, GgmlType::kQ4_1, GgmlType::kQ5_0, GgmlType::kQ5_1}) {
    std::vector<float> x(64);
    for (float& v : x) v = normal(rng);
    EXPECT_TRUE(w.AddTensor(absl::StrCat("t.", GgmlTypeName(type)), {32, 2}, type, x).ok());
  }
  for (GgmlType type : {GgmlType::kQ4_K, GgmlType::kQ5_K, GgmlType::kQ6_K}) {
    std::vector<std::byte> raw(static_cast<size_t>(*TypeBytes(type, 256)));
    for (std::byte& b : raw) b = static_cast<std::byte>(rng());
    EXPECT_TRUE(w.AddTensorBytes(absl::StrCat("t.", GgmlTypeName(type)), {256}, type, raw).ok());
  }
  return w.Serialize();
}

void Mutate(std::mt19937_64& rng, std::string* s) {
  auto pick = [&](uint64_t n) { return n == 0 ? uint64_t{0} : rng() % n; };
  static const uint64_t kExtremes[] = {0,
                                       1,
                                       2,
                                       3,
                                       4,
                                       7,
                                       8,
                                       9,
                                       12,
                                       13,
                                       31,
                                       32,
                                       33,
                                       64,
                                       255,
                                       256,
                                       0x7FFFFFFFu,
                                       0x80000000u,
                                       0xFFFFFFFFu,
                                       uint64_t{1} << 32,
                                       uint64_t{1} << 40,
                                       uint64_t{1} << 62,
                                       uint64_t{1} << 63,
                                       ~uint64_t{0},
                                       ~uint64_t{0} - 31};
  switch (pick(7)) {
    case 0: {  // flip a bit
      if (s->empty()) return;
      (*s)[pick(s->size())] ^= static_cast<char>(1u << pick(8));
      break;
    }
    case 1:  // truncate
      s->resize(pick(s->size() + 1));
      break;
    case 2: {  // overwrite a range with random bytes
      if (s->empty()) return;
      const size_t at = pick(s->size());
      const size_t n = std::min<size_t>(s->size() - at, 1 + pick(16));
      for (size_t i = 0; i < n; ++i) (*s)[at + i] = static_cast<char>(rng());
      break;
    }
    case 3:
    case 4: {  // an integer field (4 or 8 bytes, anywhere) set to an extreme
      const size_t width = pick(2) == 0 ? 4 : 8;
      if (s->size() < width) return;
      const size_t at = pick(s->size() - width + 1);
      uint64_t v = kExtremes[pick(sizeof(kExtremes) / sizeof(kExtremes[0]))];
      if (pick(4) == 0) v = s->size() - pick(64);  // near the file size
      std::memcpy(s->data() + at, &v, width);
      break;
    }
    case 5: {  // insert bytes
      const size_t at = pick(s->size() + 1);
      s->insert(at, std::string(1 + pick(8), static_cast<char>(rng())));
      break;
    }
    case 6: {  // delete bytes
      if (s->empty()) return;
      const size_t at = pick(s->size());
      s->erase(at, 1 + pick(8));
      break;
    }
  }
}

TEST(GgufFuzzTest, SeededMutationsOfAValidFile) {
  const uint64_t seed = EnvOr("KVCM_TEST_SEED", 20250601);
  const uint64_t iterations = EnvOr("KVCM_FUZZ_ITERATIONS", 200000);
  std::printf("seed %llu, %llu iterations (KVCM_TEST_SEED, KVCM_FUZZ_ITERATIONS override)\n",
              static_cast<unsigned long long>(seed), static_cast<unsigned long long>(iterations));
  std::mt19937_64 rng(seed);
  const std::string valid = SeedFile(rng);
  {
    absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::FromBuffer(
        "seed", std::span(reinterpret_cast<const std::byte*>(valid.data()), valid.size()));
    ASSERT_TRUE(file.ok()) << file.status();
    ASSERT_EQ((*file)->tensors().size(), 11u);
  }
  uint64_t accepted = 0;
  for (uint64_t i = 0; i < iterations; ++i) {
    std::string s = valid;
    const uint64_t mutations = 1 + rng() % 4;
    for (uint64_t m = 0; m < mutations; ++m) Mutate(rng, &s);
    // A copy in a buffer of exactly its size, so a read past the end is one past the
    // allocation (which AddressSanitizer reports).
    std::vector<uint8_t> buffer(s.begin(), s.end());
    LLVMFuzzerTestOneInput(buffer.data(), buffer.size());
    absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::FromBuffer(
        "mutant", std::span(reinterpret_cast<const std::byte*>(buffer.data()), buffer.size()));
    if (file.ok()) {
      ++accepted;
    } else {
      ASSERT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument) << file.status();
    }
  }
  std::printf("%llu of %llu mutants parsed, the rest refused with INVALID_ARGUMENT\n",
              static_cast<unsigned long long>(accepted),
              static_cast<unsigned long long>(iterations));
  EXPECT_GT(accepted, 0u);
  EXPECT_LT(accepted, iterations);
}

}  // namespace
}  // namespace kvcm
