// SpecFromGgufFile and SpecFromModelPath: the KV shape of a GGUF model from its metadata.

#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/gguf/gguf_file.h"
#include "common/gguf/gguf_writer.h"
#include "common/sizing/kv_cache_spec.h"
#include "common/sizing/model_config.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/real_model.h"
#include "tests/support/status_matchers.h"
#include "tests/support/subprocess.h"

namespace kvcm {
namespace {

using ::testing::HasSubstr;

// A GGUF file with llama metadata and one token embedding tensor of `embedding_type`.
std::string WriteGguf(const testing::TempDir& dir, const std::string& name,
                      const std::vector<std::pair<std::string, GgufValue>>& keys,
                      GgmlType embedding_type = GgmlType::kQ8_0) {
  GgufWriter writer;
  EXPECT_THAT(writer.Add("general.architecture", GgufValue::String("llama")), IsOk());
  for (const auto& [key, value] : keys) EXPECT_THAT(writer.Add(key, value), IsOk()) << key;
  const std::vector<float> embeddings(64 * 4, 0.5f);
  EXPECT_THAT(writer.AddTensor("token_embd.weight", {64, 4}, embedding_type, embeddings), IsOk());
  const std::string path = dir.path() + "/" + name;
  EXPECT_THAT(writer.WriteFile(path), IsOk());
  return path;
}

TEST(SpecFromGgufTest, ShapeFromTheMetadataAndFp16ForQuantizedWeights) {
  auto dir = testing::TempDir::Create("kvcm-gguf-spec");
  ASSERT_THAT(dir, IsOk());
  const std::string path = WriteGguf(*dir, "m.gguf",
                                     {{"llama.block_count", GgufValue::Uint32(30)},
                                      {"llama.attention.head_count", GgufValue::Uint32(9)},
                                      {"llama.attention.head_count_kv", GgufValue::Uint32(3)},
                                      {"llama.embedding_length", GgufValue::Uint32(576)}});
  std::vector<std::string> notes;
  absl::StatusOr<KvCacheSpec> spec = SpecFromModelPath(path, 16, std::nullopt, &notes);
  ASSERT_THAT(spec, IsOk());
  EXPECT_EQ(spec->num_layers, 30);
  EXPECT_EQ(spec->num_kv_heads, 3);
  EXPECT_EQ(spec->head_dim, 64);
  EXPECT_EQ(spec->block_size, 16);
  EXPECT_EQ(spec->dtype, DType::kFloat16);
  ASSERT_EQ(notes.size(), 1u);
  EXPECT_THAT(notes[0], HasSubstr("Q8_0"));
  EXPECT_THAT(notes[0], HasSubstr("--dtype"));

  spec = SpecFromGgufFile(path, 16, DType::kBFloat16, &notes);
  ASSERT_THAT(spec, IsOk());
  EXPECT_EQ(spec->dtype, DType::kBFloat16);
}

TEST(SpecFromGgufTest, FloatEmbeddingsGiveTheirDtypeAndKeyLengthWins) {
  auto dir = testing::TempDir::Create("kvcm-gguf-spec");
  ASSERT_THAT(dir, IsOk());
  const std::string path = WriteGguf(*dir, "m.gguf",
                                     {{"llama.block_count", GgufValue::Uint32(2)},
                                      {"llama.attention.head_count", GgufValue::Uint32(4)},
                                      {"llama.attention.key_length", GgufValue::Uint32(128)},
                                      {"llama.embedding_length", GgufValue::Uint32(256)}},
                                     GgmlType::kF32);
  absl::StatusOr<KvCacheSpec> spec = SpecFromGgufFile(path, 32, std::nullopt);
  ASSERT_THAT(spec, IsOk());
  EXPECT_EQ(spec->num_kv_heads, 4);  // no head_count_kv: multi-head attention
  EXPECT_EQ(spec->head_dim, 128);
  EXPECT_EQ(spec->dtype, DType::kFloat32);
}

TEST(SpecFromGgufTest, MalformedMetadataNamesTheFileAndKey) {
  auto dir = testing::TempDir::Create("kvcm-gguf-spec");
  ASSERT_THAT(dir, IsOk());
  const std::string missing =
      WriteGguf(*dir, "missing.gguf", {{"llama.attention.head_count", GgufValue::Uint32(4)}});
  absl::Status s = SpecFromGgufFile(missing, 16, std::nullopt).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("missing.gguf"));
  EXPECT_THAT(s.message(), HasSubstr("llama.block_count"));

  const std::string indivisible =
      WriteGguf(*dir, "gqa.gguf",
                {{"llama.block_count", GgufValue::Uint32(2)},
                 {"llama.attention.head_count", GgufValue::Uint32(9)},
                 {"llama.attention.head_count_kv", GgufValue::Uint32(4)},
                 {"llama.embedding_length", GgufValue::Uint32(576)}});
  s = SpecFromGgufFile(indivisible, 16, std::nullopt).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("llama.attention.head_count_kv"));

  const std::string wrong_type = WriteGguf(*dir, "type.gguf",
                                           {{"llama.block_count", GgufValue::String("thirty")},
                                            {"llama.attention.head_count", GgufValue::Uint32(4)}});
  s = SpecFromGgufFile(wrong_type, 16, std::nullopt).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("llama.block_count"));

  const std::string not_gguf = dir->path() + "/not.gguf";
  {
    std::FILE* f = std::fopen(not_gguf.c_str(), "wb");
    std::fputs("GGUF", f);
    std::fclose(f);
  }
  s = SpecFromModelPath(not_gguf, 16, std::nullopt).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("not.gguf"));
}

TEST(SpecFromGgufTest, TheBundledModel) {
  const std::string path = testing::SmolLM2GgufPath();
  ASSERT_TRUE(std::filesystem::exists(path)) << testing::SmolLM2Missing(path);
  absl::StatusOr<KvCacheSpec> spec = SpecFromModelPath(path, 16, std::nullopt);
  ASSERT_THAT(spec, IsOk());
  EXPECT_EQ(spec->num_layers, 30);
  EXPECT_EQ(spec->num_kv_heads, 3);
  EXPECT_EQ(spec->head_dim, 64);
  EXPECT_EQ(spec->dtype, DType::kFloat16);  // Q8_0 embeddings
}

}  // namespace
}  // namespace kvcm
