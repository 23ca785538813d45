#include "common/safetensors/safetensors.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/status_matchers.h"
#include "tests/support/subprocess.h"

namespace kvcm {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::vector<std::byte> Bytes(const std::vector<float>& values, const std::string& dtype) {
  absl::StatusOr<std::vector<std::byte>> bytes = EncodeFloat32As(values, dtype);
  EXPECT_THAT(bytes, IsOk());
  return bytes.value_or(std::vector<std::byte>{});
}

std::vector<std::byte> Int64Bytes(const std::vector<int64_t>& values) {
  std::vector<std::byte> out(values.size() * 8);
  std::memcpy(out.data(), values.data(), out.size());
  return out;
}

void WriteText(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string ReadText(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// A raw file: 8-byte length (the header's own unless `header_len` is given), header, data.
std::string RawFile(const std::string& header, size_t data_bytes,
                    uint64_t header_len = UINT64_MAX) {
  if (header_len == UINT64_MAX) header_len = header.size();
  std::string out(8, '\0');
  std::memcpy(out.data(), &header_len, 8);
  return out + header + std::string(data_bytes, '\x11');
}

class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<testing::TempDir> dir = testing::TempDir::Create("kvcm-safetensors");
    ASSERT_THAT(dir, IsOk());
    dir_.emplace(std::move(*dir));
  }
  std::string Path(const std::string& name) const { return dir_->path() + "/" + name; }

  // Writes `raw` as a file and returns Open's status.
  absl::Status OpenRaw(const std::string& raw) {
    const std::string path = Path("raw.safetensors");
    WriteText(path, raw);
    return SafetensorsFile::Open(path).status();
  }

  std::optional<testing::TempDir> dir_;
};

TEST_F(SafetensorsTest, RoundTripAllDTypesAndMetadata) {
  const std::string path = Path("model.safetensors");
  const std::vector<SafetensorsTensorToWrite> tensors = {
      {"a.f32", "F32", {2, 3}, Bytes({1, -2, 3.5f, 0, 1e-8f, -7}, "F32")},
      {"b.bf16", "BF16", {4}, Bytes({0.5f, -2, 1.25f, 384}, "BF16")},
      {"c.f16", "F16", {2, 2}, Bytes({0.5f, -2, 1.25f, 65504}, "F16")},
      {"d.scalar", "F32", {}, Bytes({42}, "F32")},
      {"e.empty", "F32", {0, 4}, {}},
      {"f.i64", "I64", {3}, Int64Bytes({1, 2, 3})},
  };
  ASSERT_THAT(WriteSafetensors(path, tensors, {{"format", "pt"}}), IsOk());

  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(path);
  ASSERT_THAT(file, IsOk());
  EXPECT_EQ((*file)->metadata().at("format"), "pt");
  EXPECT_EQ((*file)->tensors().size(), 6u);
  EXPECT_THAT((*file)->Find("a.f32")->shape, ElementsAre(2, 3));
  EXPECT_THAT((*file)->LoadFloat32("a.f32").value(), ElementsAre(1, -2, 3.5f, 0, 1e-8f, -7));
  EXPECT_THAT((*file)->LoadFloat32("b.bf16").value(), ElementsAre(0.5f, -2, 1.25f, 384));
  EXPECT_THAT((*file)->LoadFloat32("c.f16").value(), ElementsAre(0.5f, -2, 1.25f, 65504));
  EXPECT_THAT((*file)->LoadFloat32("d.scalar").value(), ElementsAre(42));
  EXPECT_TRUE((*file)->LoadFloat32("e.empty").value().empty());

  const absl::Status i64 = (*file)->LoadFloat32("f.i64").status();
  EXPECT_EQ(i64.code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(i64.message(), AllOf(HasSubstr("f.i64"), HasSubstr("I64"), HasSubstr(path)));
  EXPECT_EQ((*file)->RawBytes("f.i64").value().size(), 24u);

  const absl::Status missing = (*file)->LoadFloat32("nope").status();
  EXPECT_EQ(missing.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.message(), HasSubstr("nope"));
}

TEST_F(SafetensorsTest, HeaderIsPaddedToEightBytes) {
  const std::string path = Path("m.safetensors");
  ASSERT_THAT(WriteSafetensors(path, {{"x", "F32", {1}, Bytes({1}, "F32")}}), IsOk());
  const std::string raw = ReadText(path);
  uint64_t header_len = 0;
  std::memcpy(&header_len, raw.data(), 8);
  EXPECT_EQ(header_len % 8, 0u);
  EXPECT_EQ(raw.size(), 8 + header_len + 4);
}

TEST_F(SafetensorsTest, WriterRejectsInconsistentTensors) {
  EXPECT_EQ(WriteSafetensors(Path("w"), {{"x", "F32", {2}, Bytes({1}, "F32")}}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(WriteSafetensors(Path("w"), {{"x", "F32", {1}, Bytes({1}, "F32")},
                                         {"x", "F32", {1}, Bytes({1}, "F32")}})
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(WriteSafetensors(Path("w"), {{"x", "Q4", {1}, Bytes({1}, "F32")}}).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(SafetensorsTest, MissingFileIsNotFound) {
  const absl::Status s = SafetensorsFile::Open(Path("absent.safetensors")).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(s.message(), HasSubstr("absent.safetensors"));
}

TEST_F(SafetensorsTest, TruncatedDataIsDataLossNamingTensorAndFile) {
  const std::string path = Path("t.safetensors");
  ASSERT_THAT(WriteSafetensors(path, {{"first", "F32", {4}, Bytes({1, 2, 3, 4}, "F32")},
                                      {"second", "F32", {4}, Bytes({5, 6, 7, 8}, "F32")}}),
              IsOk());
  std::string raw = ReadText(path);
  raw.resize(raw.size() - 3);
  WriteText(path, raw);
  const absl::Status s = SafetensorsFile::Open(path).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), AllOf(HasSubstr("\"second\""), HasSubstr(path), HasSubstr("truncated")));
}

TEST_F(SafetensorsTest, ShorterThanLengthPrefixIsDataLoss) {
  const absl::Status s = OpenRaw(std::string("\x05\x00\x00", 3));
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr("raw.safetensors"));
  EXPECT_EQ(OpenRaw("").code(), absl::StatusCode::kDataLoss);
}

TEST_F(SafetensorsTest, HeaderLengthPastEndOfFileIsDataLoss) {
  const std::string header = R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})";
  const absl::Status s = OpenRaw(RawFile(header, 4, header.size() + 100));
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), AllOf(HasSubstr("header length"), HasSubstr("raw.safetensors")));
}

TEST_F(SafetensorsTest, AbsurdHeaderLengthIsInvalid) {
  const absl::Status s = OpenRaw(RawFile("{}", 0, uint64_t{1} << 40));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("exceeds the limit"));
}

TEST_F(SafetensorsTest, BadJsonIsInvalid) {
  const absl::Status s = OpenRaw(RawFile(R"({"x": {"dtype": "F32",)", 0));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), AllOf(HasSubstr("not valid JSON"), HasSubstr("raw.safetensors")));
  EXPECT_EQ(OpenRaw(RawFile("[1, 2]", 0)).code(), absl::StatusCode::kInvalidArgument);
}

struct HeaderCase {
  const char* name;
  std::string header;
  size_t data_bytes;
  absl::StatusCode code;
  std::vector<std::string> substrings;  // all must appear in the message
};

TEST_F(SafetensorsTest, EveryMalformedHeaderIsRejectedNamingTheTensor) {
  const std::vector<HeaderCase> cases = {
      {"offsets past the data section",
       R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[8,24]}})",
       16,
       absl::StatusCode::kDataLoss,
       {"\"w\"", "[8, 24]"}},
      {"begin after end",
       R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[8,4]}})",
       16,
       absl::StatusCode::kInvalidArgument,
       {"\"w\"", "begin after end"}},
      {"overlapping tensors",
       R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
       R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
       12,
       absl::StatusCode::kInvalidArgument,
       {"\"a\"", "\"b\"", "overlap"}},
      {"shape does not match bytes",
       R"({"w":{"dtype":"BF16","shape":[3,2],"data_offsets":[0,8]}})",
       8,
       absl::StatusCode::kInvalidArgument,
       {"\"w\"", "[3, 2]", "BF16", "needs 12 bytes"}},
      {"shape overflows",
       R"({"w":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}})",
       8,
       absl::StatusCode::kInvalidArgument,
       {"\"w\"", "2^64"}},
      {"unknown dtype",
       R"({"w":{"dtype":"Q4_K","shape":[1],"data_offsets":[0,1]}})",
       1,
       absl::StatusCode::kInvalidArgument,
       {"\"w\"", "unknown dtype", "Q4_K"}},
      {"missing dtype",
       R"({"w":{"shape":[1],"data_offsets":[0,4]}})",
       4,
       absl::StatusCode::kInvalidArgument,
       {"\"w\"", "dtype"}},
      {"negative dim",
       R"({"w":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})",
       4,
       absl::StatusCode::kInvalidArgument,
       {"\"w\"", "shape"}},
      {"one offset",
       R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0]}})",
       4,
       absl::StatusCode::kInvalidArgument,
       {"\"w\"", "data_offsets"}},
      {"entry not an object",
       R"({"w":[1,2]})",
       0,
       absl::StatusCode::kInvalidArgument,
       {"\"w\"", "object"}},
      {"metadata value not a string",
       R"({"__metadata__":{"format":3}})",
       0,
       absl::StatusCode::kInvalidArgument,
       {"__metadata__", "format"}},
  };
  for (const HeaderCase& c : cases) {
    SCOPED_TRACE(c.name);
    const absl::Status s = OpenRaw(RawFile(c.header, c.data_bytes));
    EXPECT_EQ(s.code(), c.code) << s;
    EXPECT_THAT(s.message(), HasSubstr("raw.safetensors"));
    for (const std::string& sub : c.substrings) EXPECT_THAT(s.message(), HasSubstr(sub));
  }
}

TEST_F(SafetensorsTest, GapsAndEmptyTensorsAreTolerated) {
  const std::string header = R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                             R"("z":{"dtype":"F32","shape":[0],"data_offsets":[2,2]},)"
                             R"("b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})";
  EXPECT_THAT(OpenRaw(RawFile(header, 12)), IsOk());
}

// Random byte flips in a valid file must give an error or a valid file, never a crash or
// an out-of-range read (run under the sanitizers to see the latter).
TEST_F(SafetensorsTest, RandomCorruptionNeverCrashes) {
  const std::string path = Path("fuzz.safetensors");
  ASSERT_THAT(WriteSafetensors(path, {{"alpha", "F32", {2, 2}, Bytes({1, 2, 3, 4}, "F32")},
                                      {"beta", "BF16", {3}, Bytes({1, 2, 3}, "BF16")}}),
              IsOk());
  const std::string original = ReadText(path);
  const uint64_t seed = 20240611;
  std::printf("RandomCorruptionNeverCrashes seed %llu\n", static_cast<unsigned long long>(seed));
  std::mt19937_64 rng(seed);
  int ok = 0;
  for (int i = 0; i < 2000; ++i) {
    std::string raw = original;
    const int flips = 1 + static_cast<int>(rng() % 4);
    for (int f = 0; f < flips; ++f) {
      raw[rng() % raw.size()] = static_cast<char>(rng() & 0xff);
    }
    if (rng() % 8 == 0) raw.resize(rng() % raw.size());
    WriteText(path, raw);
    absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(path);
    if (!file.ok()) continue;
    ++ok;
    for (const SafetensorsTensorInfo& t : (*file)->tensors()) {
      (void)(*file)->LoadFloat32(t.name);
    }
  }
  std::printf("%d of 2000 corrupted files still parsed\n", ok);
}

TEST_F(SafetensorsTest, FolderWithIndexLoadsEveryShard) {
  ASSERT_THAT(WriteSafetensors(Path("model-00001-of-00002.safetensors"),
                               {{"a", "F32", {1}, Bytes({1}, "F32")}}),
              IsOk());
  ASSERT_THAT(WriteSafetensors(Path("model-00002-of-00002.safetensors"),
                               {{"b", "F16", {2}, Bytes({2, 3}, "F16")}}),
              IsOk());
  WriteText(Path("model.safetensors.index.json"),
            R"({"metadata":{},"weight_map":{"a":"model-00001-of-00002.safetensors",)"
            R"("b":"model-00002-of-00002.safetensors"}})");
  absl::StatusOr<std::unique_ptr<SafetensorsFolder>> folder = SafetensorsFolder::Open(dir_->path());
  ASSERT_THAT(folder, IsOk());
  EXPECT_EQ((*folder)->files().size(), 2u);
  EXPECT_THAT((*folder)->LoadFloat32("a").value(), ElementsAre(1));
  EXPECT_THAT((*folder)->LoadFloat32("b").value(), ElementsAre(2, 3));
  EXPECT_EQ((*folder)->LoadFloat32("c").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(SafetensorsTest, IndexNamingTheWrongShardIsInvalid) {
  ASSERT_THAT(WriteSafetensors(Path("one.safetensors"), {{"a", "F32", {1}, Bytes({1}, "F32")}}),
              IsOk());
  ASSERT_THAT(WriteSafetensors(Path("two.safetensors"), {{"b", "F32", {1}, Bytes({1}, "F32")}}),
              IsOk());
  WriteText(Path("model.safetensors.index.json"),
            R"({"weight_map":{"a":"two.safetensors","b":"two.safetensors"}})");
  const absl::Status s = SafetensorsFolder::Open(dir_->path()).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), AllOf(HasSubstr("\"a\""), HasSubstr("two.safetensors")));

  WriteText(Path("model.safetensors.index.json"), R"({"weight_map":{"a":"../one.safetensors"}})");
  EXPECT_EQ(SafetensorsFolder::Open(dir_->path()).status().code(),
            absl::StatusCode::kInvalidArgument);
  WriteText(Path("model.safetensors.index.json"), R"({"weight_map":)");
  EXPECT_EQ(SafetensorsFolder::Open(dir_->path()).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(SafetensorsTest, TensorInTwoShardsIsInvalid) {
  ASSERT_THAT(WriteSafetensors(Path("one.safetensors"), {{"a", "F32", {1}, Bytes({1}, "F32")}}),
              IsOk());
  ASSERT_THAT(WriteSafetensors(Path("two.safetensors"), {{"a", "F32", {1}, Bytes({2}, "F32")}}),
              IsOk());
  const absl::Status s = SafetensorsFolder::Open(dir_->path()).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), AllOf(HasSubstr("\"a\""), HasSubstr("one.safetensors"),
                                 HasSubstr("two.safetensors")));
}

TEST_F(SafetensorsTest, FolderWithoutShardsIsNotFound) {
  WriteText(Path("config.json"), "{}");
  const absl::Status s = SafetensorsFolder::Open(dir_->path()).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(s.message(), HasSubstr("no .safetensors"));
}

}  // namespace
}  // namespace kvcm
