// GgufFile, GgufWriter and ggml_types without the Python reference: the typed getters, a
// writer round trip, and one test per class of malformed file, each checking that the
// error is INVALID_ARGUMENT naming the file and the key or tensor.

#include "common/gguf/gguf_file.h"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/base/float16.h"
#include "common/gguf/ggml_types.h"
#include "common/gguf/gguf_writer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/status_matchers.h"
#include "tests/support/subprocess.h"

namespace kvcm {
namespace {

using ::testing::HasSubstr;

// Raw GGUF bytes, for files GgufWriter would refuse to write.
struct Bytes {
  std::string s;
  template <typename T>
  Bytes& Put(T v) {
    char buf[sizeof(T)];
    std::memcpy(buf, &v, sizeof(T));
    s.append(buf, sizeof(T));
    return *this;
  }
  Bytes& U32(uint32_t v) { return Put(v); }
  Bytes& U64(uint64_t v) { return Put(v); }
  Bytes& Str(const std::string& v) {
    U64(v.size());
    s += v;
    return *this;
  }
  Bytes& Header(uint64_t tensors, uint64_t kvs, uint32_t version = 3) {
    s += "GGUF";
    return U32(version).U64(tensors).U64(kvs);
  }
  Bytes& KvU32(const std::string& key, uint32_t v) {
    return Str(key).U32(static_cast<uint32_t>(GgufValueType::kUint32)).U32(v);
  }
  Bytes& KvStr(const std::string& key, const std::string& v) {
    return Str(key).U32(static_cast<uint32_t>(GgufValueType::kString)).Str(v);
  }
  Bytes& Tensor(const std::string& name, const std::vector<uint64_t>& dims, GgmlType type,
                uint64_t offset) {
    Str(name).U32(static_cast<uint32_t>(dims.size()));
    for (uint64_t d : dims) U64(d);
    return U32(static_cast<uint32_t>(type)).U64(offset);
  }
  Bytes& PadTo(size_t alignment) {
    s.append((alignment - s.size() % alignment) % alignment, '\0');
    return *this;
  }
  Bytes& Zeros(size_t n) {
    s.append(n, '\0');
    return *this;
  }
};

absl::StatusOr<std::unique_ptr<GgufFile>> Parse(const std::string& bytes) {
  return GgufFile::FromBuffer(
      "test.gguf",
      std::span<const std::byte>(reinterpret_cast<const std::byte*>(bytes.data()), bytes.size()));
}

// The parse fails with INVALID_ARGUMENT whose message names the file and has `needle`.
void ExpectInvalid(const std::string& bytes, const std::string& needle) {
  absl::StatusOr<std::unique_ptr<GgufFile>> file = Parse(bytes);
  ASSERT_FALSE(file.ok()) << "parsed, expected an error with " << needle;
  EXPECT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument) << file.status();
  EXPECT_THAT(std::string(file.status().message()), HasSubstr("test.gguf: "));
  EXPECT_THAT(std::string(file.status().message()), HasSubstr(needle));
}

// A valid file: two keys, tensors "a" (F32 [8]) and "b" (Q8_0 [32, 2]).
Bytes ValidFile() {
  Bytes b;
  b.Header(2, 2).KvStr("general.architecture", "llama").KvU32("llama.block_count", 2);
  b.Tensor("a", {8}, GgmlType::kF32, 0).Tensor("b", {32, 2}, GgmlType::kQ8_0, 32);
  b.PadTo(32).Zeros(32 + 68);
  return b;
}

TEST(GgufFileTest, ReadsAValidFile) {
  absl::StatusOr<std::unique_ptr<GgufFile>> file = Parse(ValidFile().s);
  ASSERT_THAT(file, IsOk());
  EXPECT_EQ((*file)->version(), 3u);
  EXPECT_EQ((*file)->alignment(), 32u);
  ASSERT_EQ((*file)->metadata().size(), 2u);
  EXPECT_EQ((*file)->metadata()[1].key, "llama.block_count");
  EXPECT_EQ(*(*file)->GetInt("llama.block_count"), 2);
  ASSERT_EQ((*file)->tensors().size(), 2u);
  absl::StatusOr<const GgufTensorInfo*> b = (*file)->FindTensor("b");
  ASSERT_THAT(b, IsOk());
  EXPECT_EQ((*b)->dims, (std::vector<int64_t>{32, 2}));
  EXPECT_EQ((*b)->element_count, 64);
  EXPECT_EQ((*b)->byte_size, 68);
  EXPECT_EQ((*b)->offset, 32u);
  EXPECT_EQ((*b)->data.data(), (*file)->bytes().data() + (*file)->data_offset() + 32);
}

TEST(GgufFileTest, Version2ReadsLikeVersion3) {
  Bytes b;
  b.Header(0, 1, 2).KvU32("k", 7);
  absl::StatusOr<std::unique_ptr<GgufFile>> file = Parse(b.s);
  ASSERT_THAT(file, IsOk());
  EXPECT_EQ((*file)->version(), 2u);
  EXPECT_EQ(*(*file)->GetInt("k"), 7);
}

TEST(GgufFileTest, GettersCheckTypes) {
  GgufWriter w;
  ASSERT_THAT(w.Add("s", GgufValue::String("x")), IsOk());
  ASSERT_THAT(w.Add("u8", GgufValue::Uint8(200)), IsOk());
  ASSERT_THAT(w.Add("i16", GgufValue::Int16(-5)), IsOk());
  ASSERT_THAT(w.Add("u64big", GgufValue::Uint64(~uint64_t{0})), IsOk());
  ASSERT_THAT(w.Add("f32", GgufValue::Float32(0.25f)), IsOk());
  ASSERT_THAT(w.Add("f64", GgufValue::Float64(1e300)), IsOk());
  ASSERT_THAT(w.Add("b", GgufValue::Bool(true)), IsOk());
  ASSERT_THAT(w.Add("ints", GgufValue::Array(GgufValueType::kUint16,
                                             {GgufValue::Uint16(1), GgufValue::Uint16(65535)})),
              IsOk());
  ASSERT_THAT(w.Add("floats", GgufValue::Float32Array(std::vector<float>{1.5f})), IsOk());
  ASSERT_THAT(w.Add("strs", GgufValue::StringArray({"p", "q"})), IsOk());
  const std::string bytes = w.Serialize();
  absl::StatusOr<std::unique_ptr<GgufFile>> file = Parse(bytes);
  ASSERT_THAT(file, IsOk());
  const GgufFile& f = **file;
  EXPECT_EQ(*f.GetString("s"), "x");
  EXPECT_EQ(*f.GetInt("u8"), 200);
  EXPECT_EQ(*f.GetInt("i16"), -5);
  EXPECT_EQ(*f.GetFloat("f32"), 0.25);
  EXPECT_EQ(*f.GetFloat("f64"), 1e300);
  EXPECT_TRUE(*f.GetBool("b"));
  EXPECT_EQ(*f.GetIntArray("ints"), (std::vector<int64_t>{1, 65535}));
  EXPECT_EQ(*f.GetFloatArray("floats"), (std::vector<double>{1.5}));
  EXPECT_EQ(*f.GetStringArray("strs"), (std::vector<std::string>{"p", "q"}));
  EXPECT_TRUE(f.Has("s"));
  EXPECT_FALSE(f.Has("nope"));
  EXPECT_EQ(f.GetString("nope").status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(f.GetString("nope").status().message()), HasSubstr("'nope'"));
  EXPECT_EQ(f.FindTensor("nope").status().code(), absl::StatusCode::kNotFound);
  for (const absl::Status& status :
       {f.GetString("u8").status(), f.GetInt("s").status(), f.GetFloat("u8").status(),
        f.GetBool("u8").status(), f.GetStringArray("ints").status(), f.GetIntArray("strs").status(),
        f.GetFloatArray("ints").status(), f.GetInt("u64big").status(), f.GetInt("ints").status()}) {
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_THAT(std::string(status.message()), HasSubstr("test.gguf: metadata key '"));
  }
  EXPECT_THAT(std::string(f.GetString("u8").status().message()),
              HasSubstr("'u8' is uint8, not a string"));
}

TEST(GgufFileTest, WriterRoundTrip) {
  std::mt19937 rng(1234);
  std::normal_distribution<float> normal;
  std::vector<float> x(64 * 3);
  for (float& v : x) v = normal(rng);
  GgufWriter w;
  ASSERT_THAT(w.SetAlignment(256), IsOk());
  ASSERT_THAT(w.Add("nested", GgufValue::Array(GgufValueType::kArray,
                                               {GgufValue::StringArray({"a"}),
                                                GgufValue::Int32Array(std::vector<int32_t>{3})})),
              IsOk());
  ASSERT_THAT(w.AddTensor("q", {64, 3}, GgmlType::kQ4_1, x), IsOk());
  ASSERT_THAT(w.AddTensor("f", {64, 3}, GgmlType::kF32, x), IsOk());
  const std::string bytes = w.Serialize();
  absl::StatusOr<std::unique_ptr<GgufFile>> file = Parse(bytes);
  ASSERT_THAT(file, IsOk());
  EXPECT_EQ((*file)->alignment(), 256u);
  EXPECT_EQ((*file)->data_offset() % 256, 0u);
  const GgufValue& nested = *(*(*file)->GetValue("nested"));
  ASSERT_EQ(nested.elements.size(), 2u);
  EXPECT_EQ(nested.elements[0].elements[0].string_value, "a");
  EXPECT_EQ(nested.elements[1].elements[0].int_value, 3);
  const GgufTensorInfo* f = *(*file)->FindTensor("f");
  std::vector<float> back(x.size());
  ASSERT_THAT(Dequantize(f->type, f->data, back), IsOk());
  EXPECT_EQ(back, x);
  const GgufTensorInfo* q = *(*file)->FindTensor("q");
  EXPECT_EQ(q->offset % 256, 0u);
  ASSERT_THAT(Dequantize(q->type, q->data, back), IsOk());
  for (size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(back[i], x[i], 0.5f) << i;
}

TEST(GgufWriterTest, RefusesBadInput) {
  GgufWriter w;
  ASSERT_THAT(w.Add("k", GgufValue::Uint8(1)), IsOk());
  EXPECT_THAT(std::string(w.Add("k", GgufValue::Uint8(1)).message()), HasSubstr("duplicate"));
  EXPECT_FALSE(w.Add("general.alignment", GgufValue::Uint32(64)).ok());
  EXPECT_FALSE(w.SetAlignment(48).ok());
  EXPECT_FALSE(w.Add("bad\xff", GgufValue::Uint8(1)).ok());
  EXPECT_THAT(
      std::string(
          w.Add("mixed", GgufValue::Array(GgufValueType::kInt32, {GgufValue::Uint8(1)})).message()),
      HasSubstr("'mixed'"));
  std::vector<float> x(32);
  EXPECT_THAT(std::string(w.AddTensor("t", {33}, GgmlType::kF32, x).message()), HasSubstr("'t'"));
  EXPECT_THAT(std::string(w.AddTensor("t", {31}, GgmlType::kQ8_0, x).message()),
              HasSubstr("whole blocks"));
  EXPECT_EQ(w.AddTensor("t", {256}, GgmlType::kQ4_K, std::vector<float>(256)).code(),
            absl::StatusCode::kUnimplemented);
  EXPECT_FALSE(w.AddTensor("t", {}, GgmlType::kF32, {}).ok());
  EXPECT_FALSE(w.AddTensor("t", {0}, GgmlType::kF32, {}).ok());
  ASSERT_THAT(w.AddTensor("t", {32}, GgmlType::kF32, x), IsOk());
  EXPECT_THAT(std::string(w.AddTensor("t", {32}, GgmlType::kF32, x).message()),
              HasSubstr("duplicate tensor 't'"));
}

TEST(GgmlTypesTest, TraitsAndNames) {
  EXPECT_EQ(static_cast<uint32_t>(GgmlType::kBF16), 30u);
  EXPECT_EQ(GgmlTypeName(GgmlType::kQ6_K), "Q6_K");
  EXPECT_EQ(GgmlTypeName(static_cast<GgmlType>(4)), "type 4");
  EXPECT_EQ(GetGgmlTypeTraits(GgmlType::kQ4_K)->type_size, 144);
  EXPECT_EQ(GetGgmlTypeTraits(GgmlType::kQ6_K)->type_size, 210);
  EXPECT_EQ(GetGgmlTypeTraits(GgmlType::kQ5_K)->type_size, 176);
  EXPECT_EQ(*TypeBytes(GgmlType::kQ8_0, 64), 68);
  EXPECT_FALSE(TypeBytes(GgmlType::kQ8_0, 65).ok());
}

TEST(GgmlTypesTest, DequantizeChecksSizesAndTypes) {
  std::vector<std::byte> src(34);
  std::vector<float> dst(32);
  EXPECT_THAT(Dequantize(GgmlType::kQ8_0, src, dst), IsOk());
  EXPECT_EQ(Dequantize(GgmlType::kQ8_0, std::span(src).first(33), dst).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Dequantize(GgmlType::kQ8_0, src, std::span(dst).first(31)).code(),
            absl::StatusCode::kInvalidArgument);
  absl::Status unimplemented = Dequantize(GgmlType::kQ2_K, src, dst);
  EXPECT_EQ(unimplemented.code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(std::string(unimplemented.message()), HasSubstr("Q2_K"));
  EXPECT_EQ(Dequantize(static_cast<GgmlType>(5), src, dst).code(),
            absl::StatusCode::kInvalidArgument);
  std::vector<float> in(32);
  EXPECT_EQ(Quantize(GgmlType::kQ6_K, in, src).code(), absl::StatusCode::kUnimplemented);
  EXPECT_EQ(Quantize(GgmlType::kQ8_0, in, std::span(src).first(30)).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(GgmlTypesTest, HalfConversionsRoundTripEveryPattern) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = FloatFromHalf(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    ASSERT_EQ(HalfFromFloatKeepingNanPayload(f), h) << h;
    ASSERT_EQ(BFloat16FromFloat(FloatFromBFloat16(static_cast<uint16_t>(h))), h) << h;
  }
  EXPECT_EQ(FloatFromHalf(0x3C00), 1.0f);
  EXPECT_EQ(FloatFromHalf(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(HalfFromFloatKeepingNanPayload(65520.0f), 0x7C00);  // rounds up to infinity
  EXPECT_EQ(HalfFromFloatKeepingNanPayload(65519.0f), 0x7BFF);
  EXPECT_EQ(HalfFromFloatKeepingNanPayload(std::ldexp(1.0f, -25)), 0x0000);  // a tie, to even
  EXPECT_EQ(HalfFromFloatKeepingNanPayload(std::ldexp(1.5f, -25)), 0x0001);
}

// --- malformed files: one test per error class ---------------------------------------

TEST(GgufMalformedTest, BadMagic) {
  Bytes b = ValidFile();
  b.s[0] = 'X';
  ExpectInvalid(b.s, "bad magic");
}

TEST(GgufMalformedTest, Version1Refused) {
  Bytes b;
  b.Header(0, 0, 1);
  ExpectInvalid(b.s, "version 1 is not supported");
}

TEST(GgufMalformedTest, UnknownVersion) {
  Bytes b;
  b.Header(0, 0, 4);
  ExpectInvalid(b.s, "unsupported GGUF version 4");
}

TEST(GgufMalformedTest, TruncatedHeader) {
  ExpectInvalid(ValidFile().s.substr(0, 3), "truncated header");
  ExpectInvalid(ValidFile().s.substr(0, 12), "truncated header");
}

TEST(GgufMalformedTest, TruncatedMetadata) {
  Bytes b;
  b.Header(0, 1).Str("my.key").U32(static_cast<uint32_t>(GgufValueType::kUint64)).U32(7);
  ExpectInvalid(b.s, "truncated metadata key 'my.key'");
}

TEST(GgufMalformedTest, TruncatedTensorInfo) {
  Bytes b;
  b.Header(1, 0).Str("blk.0.attn_q.weight").U32(2).U64(32);  // the second dim is missing
  ExpectInvalid(b.s, "truncated tensor 'blk.0.attn_q.weight'");
}

TEST(GgufMalformedTest, CountsLargerThanTheFile) {
  Bytes kv;
  kv.Header(0, uint64_t{1} << 60);
  ExpectInvalid(kv.s, "cannot fit");
  Bytes tensors;
  tensors.Header(~uint64_t{0} / 2, 0);
  ExpectInvalid(tensors.s, "cannot fit");
}

TEST(GgufMalformedTest, StringLengthLargerThanTheFile) {
  Bytes b;
  b.Header(0, 1).Str("name").U32(static_cast<uint32_t>(GgufValueType::kString));
  b.U64(uint64_t{1} << 62).Zeros(16);
  ExpectInvalid(b.s, "metadata key 'name': string of 4611686018427387904 bytes");
}

TEST(GgufMalformedTest, ArrayCountLargerThanTheFile) {
  Bytes b;
  b.Header(0, 1).Str("tokenizer.ggml.tokens").U32(static_cast<uint32_t>(GgufValueType::kArray));
  b.U32(static_cast<uint32_t>(GgufValueType::kString)).U64(uint64_t{1} << 40).Zeros(64);
  ExpectInvalid(b.s, "metadata key 'tokenizer.ggml.tokens': array of 1099511627776");
}

TEST(GgufMalformedTest, MoreMetadataValuesThanTheLimit) {
  // An array the file holds the bytes of, but more elements than the limit (refused before
  // anything is allocated for them).
  const uint64_t count = GgufFile::kMaxMetadataValues + 1;
  Bytes b;
  b.Header(0, 1).Str("tokenizer.ggml.token_type");
  b.U32(static_cast<uint32_t>(GgufValueType::kArray));
  b.U32(static_cast<uint32_t>(GgufValueType::kUint8)).U64(count).Zeros(count);
  ExpectInvalid(b.s, absl::StrCat("metadata key 'tokenizer.ggml.token_type': array of ", count,
                                  " elements takes the file past"));
}

TEST(GgufMalformedTest, InvalidUtf8) {
  Bytes key;
  key.Header(0, 1).KvU32("bad\xc3(key", 1);
  ExpectInvalid(key.s,
                "metadata key/value 0 of 1 (its key): string 'bad\\xc3(key' is not valid UTF-8");
  Bytes value;
  value.Header(0, 1).KvStr("general.name", "overlong \xc0\xaf");
  ExpectInvalid(value.s,
                "metadata key 'general.name': string 'overlong \\xc0\\xaf' is not valid UTF-8");
  Bytes surrogate;
  surrogate.Header(0, 1).KvStr("general.name", "\xed\xa0\x80");
  ExpectInvalid(surrogate.s, "metadata key 'general.name'");
  Bytes tensor;
  tensor.Header(1, 0).Tensor("w\xff", {32}, GgmlType::kF32, 0).PadTo(32).Zeros(128);
  ExpectInvalid(tensor.s, "tensor info 0 of 1 (its name): string 'w\\xff' is not valid UTF-8");
}

TEST(GgufMalformedTest, DuplicateKey) {
  Bytes b;
  b.Header(0, 2).KvU32("llama.block_count", 1).KvU32("llama.block_count", 2);
  ExpectInvalid(b.s, "duplicate metadata key 'llama.block_count'");
}

TEST(GgufMalformedTest, DuplicateTensor) {
  Bytes b;
  b.Header(2, 0).Tensor("w", {8}, GgmlType::kF32, 0).Tensor("w", {8}, GgmlType::kF32, 32);
  b.PadTo(32).Zeros(64);
  ExpectInvalid(b.s, "duplicate tensor 'w'");
}

TEST(GgufMalformedTest, UnknownValueTypes) {
  Bytes b;
  b.Header(0, 1).Str("odd").U32(13).U32(0);
  ExpectInvalid(b.s, "metadata key 'odd': unknown value type 13");
  Bytes a;
  a.Header(0, 1).Str("odd.array").U32(static_cast<uint32_t>(GgufValueType::kArray)).U32(99).U64(0);
  ExpectInvalid(a.s, "metadata key 'odd.array': unknown array element type 99");
}

TEST(GgufMalformedTest, BoolNotZeroOrOne) {
  Bytes b;
  b.Header(0, 1).Str("flag").U32(static_cast<uint32_t>(GgufValueType::kBool)).Put<uint8_t>(2);
  ExpectInvalid(b.s, "metadata key 'flag': bool value 2");
}

TEST(GgufMalformedTest, ArraysNestedTooDeep) {
  Bytes b;
  b.Header(0, 1).Str("deep").U32(static_cast<uint32_t>(GgufValueType::kArray));
  for (int i = 0; i < 40; ++i) b.U32(static_cast<uint32_t>(GgufValueType::kArray)).U64(1);
  b.U32(static_cast<uint32_t>(GgufValueType::kUint8)).U64(0);
  ExpectInvalid(b.s, "metadata key 'deep': arrays nested deeper than");
}

TEST(GgufMalformedTest, AlignmentNotAUint32PowerOfTwo) {
  Bytes b;
  b.Header(0, 1).KvU32("general.alignment", 48);
  ExpectInvalid(b.s, "'general.alignment' is 48, not a power of two");
  Bytes zero;
  zero.Header(0, 1).KvU32("general.alignment", 0);
  ExpectInvalid(zero.s, "'general.alignment' is 0");
  Bytes type;
  type.Header(0, 1).KvStr("general.alignment", "32");
  ExpectInvalid(type.s, "'general.alignment' is string, not uint32");
}

TEST(GgufMalformedTest, UnknownTensorType) {
  Bytes b;
  b.Header(1, 0).Tensor("w", {32}, static_cast<GgmlType>(4), 0).PadTo(32).Zeros(64);
  ExpectInvalid(b.s, "tensor 'w': unknown tensor type 4");
}

TEST(GgufMalformedTest, BadDims) {
  Bytes zero;
  zero.Header(1, 0).Tensor("w.zero", {32, 0}, GgmlType::kF32, 0).PadTo(32);
  ExpectInvalid(zero.s, "tensor 'w.zero': dim 1 is zero");
  Bytes overflow;
  overflow.Header(1, 0).Tensor("w.big", {1u << 20, 1u << 20, 1u << 20, 1u << 20}, GgmlType::kF32,
                               0);
  ExpectInvalid(overflow.s, "tensor 'w.big': dims overflow int64");
  Bytes huge;
  huge.Header(1, 0).Tensor("w.huge", {~uint64_t{0}}, GgmlType::kF32, 0);
  ExpectInvalid(huge.s, "tensor 'w.huge': dims overflow int64");
  Bytes bytes_overflow;  // elements fit int64, their bytes do not
  bytes_overflow.Header(1, 0).Tensor("w.bytes", {uint64_t{1} << 62}, GgmlType::kF32, 0);
  ExpectInvalid(bytes_overflow.s, "tensor 'w.bytes'");
  Bytes none;
  none.Header(1, 0).Tensor("w.none", {}, GgmlType::kF32, 0).Zeros(32);
  ExpectInvalid(none.s, "tensor 'w.none' has 0 dims");
  Bytes five;
  five.Header(1, 0).Tensor("w.five", {1, 1, 1, 1, 1}, GgmlType::kF32, 0).PadTo(32).Zeros(32);
  ExpectInvalid(five.s, "tensor 'w.five' has 5 dims");
  Bytes row;
  row.Header(1, 0).Tensor("w.row", {33, 2}, GgmlType::kQ8_0, 0).PadTo(32).Zeros(128);
  ExpectInvalid(row.s, "tensor 'w.row': a row of 33 Q8_0 elements is not whole blocks of 32");
}

TEST(GgufMalformedTest, UnalignedOffset) {
  Bytes b;
  b.Header(1, 0).Tensor("w", {8}, GgmlType::kF32, 16).PadTo(32).Zeros(64);
  ExpectInvalid(b.s, "tensor 'w': offset 16 is not a multiple of the alignment 32");
}

TEST(GgufMalformedTest, DataPastTheEnd) {
  Bytes b = ValidFile();
  b.s.resize(b.s.size() - 1);
  ExpectInvalid(b.s, "tensor 'b': data at 32 + 68 bytes runs past the end");
  Bytes far;
  far.Header(1, 0).Tensor("w", {8}, GgmlType::kF32, ~uint64_t{0} - 31).PadTo(32).Zeros(64);
  ExpectInvalid(far.s, "tensor 'w': data at");
}

TEST(GgufMalformedTest, OverlappingTensors) {
  Bytes b;
  b.Header(2, 0).Tensor("first", {16}, GgmlType::kF32, 0).Tensor("second", {8}, GgmlType::kF32, 32);
  b.PadTo(32).Zeros(128);
  ExpectInvalid(b.s, "tensor 'first' (offset 0, 64 bytes) overlaps tensor 'second'");
}

TEST(GgufOpenTest, MissingAndEmptyFiles) {
  absl::StatusOr<std::unique_ptr<GgufFile>> missing = GgufFile::Open("no/such/model.gguf");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(missing.status().message()), HasSubstr("no/such/model.gguf"));
  absl::StatusOr<kvcm::testing::TempDir> dir = kvcm::testing::TempDir::Create("kvcm-gguf");
  ASSERT_THAT(dir, IsOk());
  const std::string empty = dir->path() + "/empty.gguf";
  { std::ofstream(empty, std::ios::binary); }
  absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::Open(empty);
  EXPECT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(file.status().message()), HasSubstr("empty.gguf: truncated header"));
  const std::string valid = dir->path() + "/valid.gguf";
  {
    std::ofstream out(valid, std::ios::binary);
    const std::string bytes = ValidFile().s;
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
  file = GgufFile::Open(valid);
  ASSERT_THAT(file, IsOk());
  EXPECT_EQ(*(*file)->GetString("general.architecture"), "llama");
  EXPECT_EQ((*file)->name(), valid);
}

}  // namespace
}  // namespace kvcm
