// common/gguf against the `gguf` Python package (llama.cpp's gguf-py), run live through
// tests/common/gguf/gguf_reference.py:
//   - Dequantize of random blocks of every implemented type against
//     gguf.quants.dequantize, bitwise: both compute the same float32 operations in the same
//     order on exactly converted fp16 scales (the library is built without contraction into
//     fused multiply-adds), so any difference is a bug, not rounding;
//   - Quantize of random floats against gguf.quants.quantize, byte for byte;
//   - a file written by gguf.GGUFWriter read by GgufFile, and a file written by GgufWriter
//     read by gguf.GGUFReader: the same keys, types, values and tensors;
//   - the bundled SmolLM2 GGUF: metadata and tensor infos as GGUFReader reads them, and two
//     tensors dequantized as gguf dequantizes them.

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/gguf/ggml_types.h"
#include "common/gguf/gguf_file.h"
#include "common/gguf/gguf_writer.h"
#include "gtest/gtest.h"
#include "tests/common/gguf/gguf_test_util.h"
#include "tests/support/real_model.h"
#include "tests/support/status_matchers.h"
#include "tests/support/subprocess.h"

namespace kvcm {
namespace {

using ::kvcm::testing::Hex;
using ::kvcm::testing::MetadataToJson;
using ::kvcm::testing::ReadFileOrEmpty;
using ::kvcm::testing::ReadJson;
using ::kvcm::testing::RunGgufReference;
using ::kvcm::testing::TempDir;
using ::kvcm::testing::ValueToJson;

uint64_t Seed() {
  if (const char* s = std::getenv("KVCM_TEST_SEED"); s != nullptr && *s != '\0') {
    return std::strtoull(s, nullptr, 10);
  }
  return 20250601;
}

uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

struct Record {
  uint32_t kind = 0;  // 0: src blocks, dst floats (dequantize); 1: src floats, dst blocks
  GgmlType type = GgmlType::kF32;
  uint64_t elements = 0;
  std::string src;
  std::string dst;
};

bool ParseRecords(const std::string& bytes, std::vector<Record>* records) {
  size_t pos = 0;
  auto take = [&](void* out, size_t n) {
    if (bytes.size() - pos < n) return false;
    std::memcpy(out, bytes.data() + pos, n);
    pos += n;
    return true;
  };
  while (pos < bytes.size()) {
    Record r;
    uint32_t type = 0;
    uint64_t src_len = 0, dst_len = 0;
    if (!take(&r.kind, 4) || !take(&type, 4) || !take(&r.elements, 8) || !take(&src_len, 8)) {
      return false;
    }
    r.type = static_cast<GgmlType>(type);
    if (bytes.size() - pos < src_len) return false;
    r.src = bytes.substr(pos, src_len);
    pos += src_len;
    if (!take(&dst_len, 8) || bytes.size() - pos < dst_len) return false;
    r.dst = bytes.substr(pos, dst_len);
    pos += dst_len;
    records->push_back(std::move(r));
  }
  return true;
}

std::span<const std::byte> AsBytes(const std::string& s) {
  return {reinterpret_cast<const std::byte*>(s.data()), s.size()};
}

// The first element where `actual` and `expected` (float32 bits) differ, or -1.
int64_t FirstBitDifference(const std::vector<float>& actual, const std::string& expected) {
  if (expected.size() != actual.size() * sizeof(float)) return 0;
  for (size_t i = 0; i < actual.size(); ++i) {
    uint32_t want;
    std::memcpy(&want, expected.data() + i * 4, 4);
    if (FloatBits(actual[i]) != want) return static_cast<int64_t>(i);
  }
  return -1;
}

TEST(GgufReferenceTest, DequantizeAndQuantizeMatchGgufPython) {
  const uint64_t seed = Seed();
  std::printf("seed %llu (KVCM_TEST_SEED overrides)\n", static_cast<unsigned long long>(seed));
  absl::StatusOr<TempDir> dir = TempDir::Create("kvcm-gguf");
  ASSERT_THAT(dir, IsOk());
  const std::string path = dir->path() + "/quants.bin";
  ASSERT_THAT(RunGgufReference({"quants", std::to_string(seed), path}), IsOk());
  std::vector<Record> records;
  ASSERT_TRUE(ParseRecords(ReadFileOrEmpty(path), &records));
  std::map<std::pair<uint32_t, GgmlType>, int> seen;
  for (const Record& r : records) {
    const std::string name = GgmlTypeName(r.type);
    ++seen[{r.kind, r.type}];
    if (r.kind == 0) {
      std::vector<float> out(r.elements);
      absl::Status status = Dequantize(r.type, AsBytes(r.src), out);
      ASSERT_THAT(status, IsOk()) << name << ": " << status;
      const int64_t diff = FirstBitDifference(out, r.dst);
      if (diff >= 0) {
        uint32_t want = 0;
        if (r.dst.size() >= static_cast<size_t>(diff + 1) * 4) {
          std::memcpy(&want, r.dst.data() + diff * 4, 4);
        }
        ADD_FAILURE() << "dequantize " << name << ": element " << diff << " is "
                      << out[static_cast<size_t>(diff)] << " (bits " << std::hex
                      << FloatBits(out[static_cast<size_t>(diff)]) << "), gguf has bits " << want
                      << std::dec << " (block " << diff / GetGgmlTypeTraits(r.type)->block_size
                      << ")";
      }
      if (diff < 0) {
        std::printf("dequantize %s: %llu elements bitwise equal to gguf.quants.dequantize\n",
                    name.c_str(), static_cast<unsigned long long>(r.elements));
      }
    } else {
      std::vector<float> in(r.elements);
      ASSERT_EQ(r.src.size(), in.size() * sizeof(float));
      std::memcpy(in.data(), r.src.data(), r.src.size());
      std::string out(r.dst.size(), '\0');
      absl::Status status = Quantize(
          r.type, in, std::span<std::byte>(reinterpret_cast<std::byte*>(out.data()), out.size()));
      ASSERT_THAT(status, IsOk()) << name << ": " << status;
      if (out != r.dst) {
        size_t i = 0;
        while (i < out.size() && out[i] == r.dst[i]) ++i;
        const int64_t type_size = GetGgmlTypeTraits(r.type)->type_size;
        ADD_FAILURE() << "quantize " << name << ": byte " << i << " (block "
                      << static_cast<int64_t>(i) / type_size << ") is " << Hex(out.data() + i, 1)
                      << ", gguf has " << Hex(r.dst.data() + i, 1);
      }
      if (out == r.dst) {
        std::printf("quantize %s: %llu elements byte for byte equal to gguf.quants.quantize\n",
                    name.c_str(), static_cast<unsigned long long>(r.elements));
      }
    }
  }
  for (GgmlType t : {GgmlType::kF32, GgmlType::kF16, GgmlType::kBF16, GgmlType::kQ4_0,
                     GgmlType::kQ4_1, GgmlType::kQ5_0, GgmlType::kQ5_1, GgmlType::kQ8_0,
                     GgmlType::kQ4_K, GgmlType::kQ5_K, GgmlType::kQ6_K}) {
    EXPECT_EQ(seen[std::make_pair(0u, t)], 1) << "no dequantize case of " << GgmlTypeName(t);
    EXPECT_TRUE(CanDequantize(t));
  }
  for (GgmlType t : {GgmlType::kF32, GgmlType::kF16, GgmlType::kBF16, GgmlType::kQ4_0,
                     GgmlType::kQ4_1, GgmlType::kQ5_0, GgmlType::kQ5_1, GgmlType::kQ8_0}) {
    EXPECT_EQ(seen[std::make_pair(1u, t)], 1) << "no quantize case of " << GgmlTypeName(t);
    EXPECT_TRUE(CanQuantize(t));
  }
}

// The tensors of `file` against gguf_reference.py's list of them.
void ExpectTensorsEqual(const GgufFile& file, const nlohmann::json& expected) {
  ASSERT_EQ(file.tensors().size(), expected.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    const GgufTensorInfo& t = file.tensors()[i];
    const nlohmann::json& e = expected[i];
    SCOPED_TRACE(t.name);
    EXPECT_EQ(t.name, e["name"].get<std::string>());
    EXPECT_EQ(static_cast<uint32_t>(t.type), e["type"].get<uint32_t>());
    EXPECT_EQ(t.dims, e["dims"].get<std::vector<int64_t>>());
    if (e.contains("offset")) {
      EXPECT_EQ(t.offset, e["offset"].get<uint64_t>());
    }
    if (e.contains("n_elements")) {
      EXPECT_EQ(t.element_count, e["n_elements"].get<int64_t>());
    }
    if (e.contains("n_bytes")) {
      EXPECT_EQ(t.byte_size, e["n_bytes"].get<int64_t>());
    }
    if (e.contains("data_offset")) {
      EXPECT_EQ(static_cast<uint64_t>(t.data.data() - file.bytes().data()),
                e["data_offset"].get<uint64_t>());
    }
    if (!e["data"].is_null()) {
      EXPECT_EQ(Hex(t.data.data(), t.data.size()), e["data"].get<std::string>());
    }
  }
}

void ExpectMetadataEqual(const GgufFile& file, const nlohmann::json& expected) {
  const nlohmann::json actual = MetadataToJson(file);
  ASSERT_EQ(actual.size(), expected.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    EXPECT_EQ(actual[i], expected[i]) << "metadata entry " << i;
  }
}

TEST(GgufReferenceTest, ReadsWhatGgufWriterPythonWrote) {
  const uint64_t seed = Seed();
  std::printf("seed %llu (KVCM_TEST_SEED overrides)\n", static_cast<unsigned long long>(seed));
  absl::StatusOr<TempDir> dir = TempDir::Create("kvcm-gguf");
  ASSERT_THAT(dir, IsOk());
  const std::string gguf = dir->path() + "/python.gguf";
  const std::string json = dir->path() + "/python.json";
  ASSERT_THAT(RunGgufReference({"write", std::to_string(seed), gguf, json}), IsOk());
  absl::StatusOr<nlohmann::json> expected = ReadJson(json);
  ASSERT_THAT(expected, IsOk());
  absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::Open(gguf);
  ASSERT_THAT(file, IsOk());
  EXPECT_EQ((*file)->version(), 3u);
  EXPECT_EQ((*file)->alignment(), (*expected)["alignment"].get<uint32_t>());
  EXPECT_EQ((*file)->data_offset() % 64, 0u);
  ExpectMetadataEqual(**file, (*expected)["metadata"]);
  ExpectTensorsEqual(**file, (*expected)["tensors"]);
  // The typed getters on the same values.
  EXPECT_EQ(*(*file)->GetString("general.architecture"), "llama");
  EXPECT_EQ(*(*file)->GetInt("general.alignment"), 64);
  EXPECT_TRUE((*file)->GetBool("test.bool_true").value_or(false));
  EXPECT_EQ((*file)->GetStringArray("test.array_string")->size(), 6u);
  EXPECT_EQ(absl::StatusCode::kInvalidArgument, (*file)->GetInt("test.uint64").status().code())
      << "uint64 near 2^64 does not fit int64";
}

TEST(GgufReferenceTest, GgufReaderPythonReadsWhatGgufWriterWrote) {
  const uint64_t seed = Seed();
  std::printf("seed %llu (KVCM_TEST_SEED overrides)\n", static_cast<unsigned long long>(seed));
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  GgufWriter writer;
  ASSERT_THAT(writer.Add("general.architecture", GgufValue::String("llama")), IsOk());
  ASSERT_THAT(writer.SetAlignment(128), IsOk());
  std::vector<GgufValue> values = {
      GgufValue::Uint8(static_cast<uint8_t>(rng())),
      GgufValue::Int8(static_cast<int8_t>(rng())),
      GgufValue::Uint16(static_cast<uint16_t>(rng())),
      GgufValue::Int16(static_cast<int16_t>(rng())),
      GgufValue::Uint32(static_cast<uint32_t>(rng())),
      GgufValue::Int32(static_cast<int32_t>(rng())),
      GgufValue::Uint64(rng()),
      GgufValue::Int64(static_cast<int64_t>(rng())),
      GgufValue::Float32(normal(rng)),
      GgufValue::Float64(static_cast<double>(normal(rng)) / 3.0),
      GgufValue::Bool(true),
      GgufValue::Bool(false),
      GgufValue::String("ünïcode ✓ 𝄞"),
      GgufValue::String(""),
      GgufValue::StringArray({"a", "", "Ġb", "日本"}),
      GgufValue::Int32Array(std::vector<int32_t>{1, -2, 3}),
      GgufValue::Float32Array(std::vector<float>{0.5f, -1e-30f, 3.25f}),
      GgufValue::Array(GgufValueType::kUint64,
                       {GgufValue::Uint64(~uint64_t{0}), GgufValue::Uint64(0)}),
      GgufValue::Array(GgufValueType::kBool, {GgufValue::Bool(true), GgufValue::Bool(false)}),
      GgufValue::Array(GgufValueType::kArray,
                       {GgufValue::Int32Array(std::vector<int32_t>{7}),
                        GgufValue::Array(GgufValueType::kString, {GgufValue::String("x")}),
                        GgufValue::Array(GgufValueType::kFloat64, {})}),
  };
  for (size_t i = 0; i < values.size(); ++i) {
    ASSERT_THAT(writer.Add(absl::StrCat("test.value", i), values[i]), IsOk()) << i;
  }
  struct Spec {
    const char* name;
    GgmlType type;
    std::vector<int64_t> dims;
  };
  const std::vector<Spec> specs = {
      {"a.weight", GgmlType::kQ8_0, {64, 3}},    {"b.weight", GgmlType::kF32, {5}},
      {"c.weight", GgmlType::kQ4_0, {32, 2, 2}}, {"d.weight", GgmlType::kQ4_1, {96, 1, 1, 2}},
      {"e.weight", GgmlType::kF16, {7, 3}},      {"f.weight", GgmlType::kBF16, {9}},
      {"g.weight", GgmlType::kQ5_0, {32}},       {"h.weight", GgmlType::kQ5_1, {64, 2}},
  };
  std::vector<std::string> bytes;
  for (const Spec& s : specs) {
    int64_t n = 1;
    for (int64_t d : s.dims) n *= d;
    std::vector<float> x(static_cast<size_t>(n));
    for (float& v : x) v = normal(rng);
    ASSERT_THAT(writer.AddTensor(s.name, s.dims, s.type, x), IsOk()) << s.name;
    std::string q(static_cast<size_t>(*TypeBytes(s.type, n)), '\0');
    ASSERT_THAT(
        Quantize(s.type, x, std::span<std::byte>(reinterpret_cast<std::byte*>(q.data()), q.size())),
        IsOk());
    bytes.push_back(std::move(q));
  }
  absl::StatusOr<TempDir> dir = TempDir::Create("kvcm-gguf");
  ASSERT_THAT(dir, IsOk());
  const std::string gguf = dir->path() + "/kvcm.gguf";
  const std::string json = dir->path() + "/kvcm.json";
  ASSERT_THAT(writer.WriteFile(gguf), IsOk());
  ASSERT_THAT(RunGgufReference({"dump", gguf, json}), IsOk());
  absl::StatusOr<nlohmann::json> dump = ReadJson(json);
  ASSERT_THAT(dump, IsOk());

  // What was added, in order (general.alignment where SetAlignment put it).
  nlohmann::json expected = nlohmann::json::array();
  auto entry = [](const std::string& key, const GgufValue& v) {
    nlohmann::json e = ValueToJson(v);
    e["key"] = key;
    return e;
  };
  expected.push_back(entry("general.architecture", GgufValue::String("llama")));
  expected.push_back(entry("general.alignment", GgufValue::Uint32(128)));
  for (size_t i = 0; i < values.size(); ++i) {
    expected.push_back(entry(absl::StrCat("test.value", i), values[i]));
  }
  ASSERT_EQ((*dump)["metadata"].size(), expected.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    EXPECT_EQ((*dump)["metadata"][i], expected[i]) << "metadata entry " << i;
  }
  EXPECT_EQ((*dump)["alignment"].get<uint32_t>(), 128u);
  const nlohmann::json& tensors = (*dump)["tensors"];
  ASSERT_EQ(tensors.size(), specs.size());
  for (size_t i = 0; i < specs.size(); ++i) {
    SCOPED_TRACE(specs[i].name);
    EXPECT_EQ(tensors[i]["name"], specs[i].name);
    EXPECT_EQ(tensors[i]["type"].get<uint32_t>(), static_cast<uint32_t>(specs[i].type));
    EXPECT_EQ(tensors[i]["dims"].get<std::vector<int64_t>>(), specs[i].dims);
    EXPECT_EQ(tensors[i]["data"], Hex(bytes[i].data(), bytes[i].size()));
    EXPECT_EQ(tensors[i]["offset"].get<uint64_t>() % 128, 0u);
  }
  // And GgufFile reads the same layout GGUFReader does.
  absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::Open(gguf);
  ASSERT_THAT(file, IsOk());
  EXPECT_EQ((*file)->data_offset(), (*dump)["data_offset"].get<uint64_t>());
  ExpectMetadataEqual(**file, (*dump)["metadata"]);
  ExpectTensorsEqual(**file, tensors);
}

TEST(GgufReferenceTest, SmolLM2MatchesGgufReader) {
  const std::string path = kvcm::testing::SmolLM2GgufPath();
  ASSERT_TRUE(std::filesystem::exists(path)) << kvcm::testing::SmolLM2Missing(path);
  absl::StatusOr<std::unique_ptr<GgufFile>> opened = GgufFile::Open(path);
  ASSERT_THAT(opened, IsOk());
  const GgufFile& file = **opened;

  absl::StatusOr<TempDir> dir = TempDir::Create("kvcm-gguf");
  ASSERT_THAT(dir, IsOk());
  const std::string json = dir->path() + "/smollm2.json";
  const std::string embd = dir->path() + "/token_embd.f32";
  const std::string down = dir->path() + "/ffn_down.f32";
  ASSERT_THAT(RunGgufReference(
                  {"dump", path, json, "token_embd.weight", embd, "blk.0.ffn_down.weight", down}),
              IsOk());
  absl::StatusOr<nlohmann::json> dump = ReadJson(json);
  ASSERT_THAT(dump, IsOk());
  EXPECT_EQ(file.alignment(), (*dump)["alignment"].get<uint32_t>());
  EXPECT_EQ(file.data_offset(), (*dump)["data_offset"].get<uint64_t>());
  ExpectMetadataEqual(file, (*dump)["metadata"]);
  ExpectTensorsEqual(file, (*dump)["tensors"]);

  // What a llama loader reads, through the typed getters.
  EXPECT_EQ(*file.GetString("general.architecture"), "llama");
  EXPECT_EQ(*file.GetInt("llama.block_count"), 30);
  EXPECT_EQ(*file.GetInt("llama.attention.head_count"), 9);
  EXPECT_EQ(*file.GetInt("llama.attention.head_count_kv"), 3);
  EXPECT_EQ(*file.GetInt("llama.embedding_length"), 576);
  EXPECT_EQ(*file.GetString("tokenizer.ggml.model"), "gpt2");
  EXPECT_EQ(*file.GetString("tokenizer.ggml.pre"), "smollm");
  EXPECT_EQ(file.GetStringArray("tokenizer.ggml.tokens")->size(), 49152u);
  EXPECT_EQ(file.GetStringArray("tokenizer.ggml.merges")->size(), 48900u);
  EXPECT_EQ(file.GetIntArray("tokenizer.ggml.token_type")->size(), 49152u);
  EXPECT_GT(*file.GetFloat("llama.attention.layer_norm_rms_epsilon"), 0.0);
  EXPECT_EQ(file.tensors().size(), (*dump)["tensors"].size());

  for (const auto& [name, out, type] : std::vector<std::tuple<std::string, std::string, GgmlType>>{
           {"token_embd.weight", embd, GgmlType::kQ8_0},
           {"blk.0.ffn_down.weight", down, GgmlType::kQ4_1}}) {
    SCOPED_TRACE(name);
    absl::StatusOr<const GgufTensorInfo*> t = file.FindTensor(name);
    ASSERT_THAT(t, IsOk());
    EXPECT_EQ((*t)->type, type);
    std::vector<float> values(static_cast<size_t>((*t)->element_count));
    ASSERT_THAT(Dequantize((*t)->type, (*t)->data, values), IsOk());
    const int64_t diff = FirstBitDifference(values, ReadFileOrEmpty(out));
    ASSERT_EQ(diff, -1) << "first difference from gguf.quants.dequantize at element " << diff;
    std::printf("%s (%s, %zu elements): bitwise equal to gguf.quants.dequantize\n", name.c_str(),
                GgmlTypeName(type).c_str(), values.size());
  }
}

}  // namespace
}  // namespace kvcm
