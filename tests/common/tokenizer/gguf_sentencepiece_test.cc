// A GGUF file's SentencePiece tokenizer (tokenizer.ggml.model "llama": Llama 1/2, Mistral,
// TinyLlama): a model trained here the way Llama's was (BPE, byte fallback, the identity
// normalizer, whitespace kept) is written into a GGUF as llama.cpp's conversion writes it
// (tokens, scores, token_type, ids), and LoadGgufTokenizer must encode and decode exactly as
// SentencePiece does with the original tokenizer.model.

#include <cstdio>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "common/gguf/gguf_file.h"
#include "common/gguf/gguf_writer.h"
#include "common/tokenizer/gguf_tokenizer.h"
#include "common/tokenizer/tokenizer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/common/tokenizer/sentencepiece_train_for_test.h"
#include "tests/support/status_matchers.h"
#include "tests/support/subprocess.h"

namespace kvcm {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr int32_t kVocab = 400;

class GgufSentencePieceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<testing::TempDir> dir = testing::TempDir::Create("kvcm-gguf-spm");
    ASSERT_THAT(dir, IsOk());
    dir_.emplace(std::move(*dir));
    const std::string error = testing::TrainSentencePieceForTest(
        {"the quick brown fox jumps over the lazy dog", "a paged kv cache keeps every token",
         "hello world, hello cache, hello block; naïve café", "  spaces   stay  as they are",
         "blocks are shared between sequences with a common prefix"},
        dir_->path() + "/tokenizer", 360,
        {{"byte_fallback", "true"},
         {"normalization_rule_name", "identity"},
         {"remove_extra_whitespaces", "false"}});
    ASSERT_EQ(error, "");
    // tokenizer.vocab: "piece<TAB>score" per id; the types follow from the pieces.
    std::ifstream vocab(dir_->path() + "/tokenizer.vocab");
    for (std::string line; std::getline(vocab, line);) {
      std::vector<std::string> fields = absl::StrSplit(line, '\t');
      ASSERT_EQ(fields.size(), 2u) << line;
      float score = 0;
      ASSERT_TRUE(absl::SimpleAtof(fields[1], &score)) << line;
      const std::string& piece = fields[0];
      int32_t type = 1;  // normal
      if (piece == "<unk>") type = 2;
      if (piece == "<s>" || piece == "</s>") type = 3;
      if (piece.size() == 6 && piece.rfind("<0x", 0) == 0 && piece.back() == '>') type = 6;
      tokens_.push_back(piece);
      scores_.push_back(score);
      types_.push_back(type);
    }
    ASSERT_GT(tokens_.size(), 259u);  // 3 specials, 256 bytes, merges
    auto original = SentencePieceTokenizer::Load(dir_->path() + "/tokenizer.model", kVocab);
    ASSERT_THAT(original, IsOk());
    original_ = *std::move(original);
  }

  // The GGUF as llama.cpp's conversion writes it; `edit` may change the writer first.
  absl::StatusOr<std::unique_ptr<Tokenizer>> FromGguf(
      const std::function<void(GgufWriter&)>& edit = nullptr) {
    GgufWriter w;
    EXPECT_THAT(w.Add("tokenizer.ggml.model", GgufValue::String("llama")), IsOk());
    EXPECT_THAT(w.Add("tokenizer.ggml.tokens", GgufValue::StringArray(tokens_)), IsOk());
    EXPECT_THAT(w.Add("tokenizer.ggml.scores", GgufValue::Float32Array(scores_)), IsOk());
    EXPECT_THAT(w.Add("tokenizer.ggml.token_type", GgufValue::Int32Array(types_)), IsOk());
    EXPECT_THAT(w.Add("tokenizer.ggml.unknown_token_id", GgufValue::Uint32(0)), IsOk());
    EXPECT_THAT(w.Add("tokenizer.ggml.bos_token_id", GgufValue::Uint32(1)), IsOk());
    EXPECT_THAT(w.Add("tokenizer.ggml.eos_token_id", GgufValue::Uint32(2)), IsOk());
    if (edit) edit(w);
    bytes_ = w.Serialize();
    absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::FromBuffer(
        "llama2-like.gguf",
        std::span(reinterpret_cast<const std::byte*>(bytes_.data()), bytes_.size()));
    if (!file.ok()) return file.status();
    TokenizerConfig config;
    config.vocab_size = kVocab;
    return LoadGgufTokenizer(**file, config);
  }

  std::optional<testing::TempDir> dir_;
  std::vector<std::string> tokens_;
  std::vector<float> scores_;
  std::vector<int32_t> types_;
  std::unique_ptr<SentencePieceTokenizer> original_;
  std::string bytes_;
};

TEST_F(GgufSentencePieceTest, EncodesAndDecodesAsTheOriginalModel) {
  absl::StatusOr<std::unique_ptr<Tokenizer>> gguf = FromGguf();
  ASSERT_THAT(gguf, IsOk());
  EXPECT_EQ((*gguf)->bos_id(), 1);
  EXPECT_EQ((*gguf)->eos_id(), 2);
  EXPECT_TRUE((*gguf)->add_bos());
  EXPECT_TRUE((*gguf)->IsSpecial(1));
  EXPECT_EQ((*gguf)->TokenId("</s>"), 2);
  std::vector<std::string> texts = {"the quick brown fox",
                                    "  leading and   inner spaces  ",
                                    "hello cache, hello block",
                                    "unseen: 日本語 and emoji 🙂 go to bytes",
                                    "naïve café",
                                    "",
                                    "x",
                                    "tab\tand\nnewline"};
  // And seeded random strings over letters, spaces and a few multi-byte characters.
  const uint32_t seed = 20261202;
  std::printf("seed %u\n", seed);
  std::mt19937 rng(seed);
  const std::vector<std::string> alphabet = {"a",  "e", "t",  "h", "o", " ",
                                             "  ", "é", "日", "q", ","};
  for (int i = 0; i < 200; ++i) {
    std::string text;
    for (int n = static_cast<int>(rng() % 24); n > 0; --n)
      text += alphabet[rng() % alphabet.size()];
    texts.push_back(text);
  }
  for (const std::string& text : texts) {
    SCOPED_TRACE(text);
    const std::vector<int32_t> want = original_->Encode(text).value();
    const std::vector<int32_t> got = (*gguf)->Encode(text).value();
    EXPECT_EQ(got, want);
    EXPECT_EQ((*gguf)->Decode(got).value(), original_->Decode(want).value());
    EXPECT_EQ((*gguf)->Decode(got).value(), text);  // identity normalizer, byte fallback
  }
}

TEST_F(GgufSentencePieceTest, WithoutTheSpacePrefixTheFirstWordIsNotPrefixed) {
  absl::StatusOr<std::unique_ptr<Tokenizer>> plain = FromGguf();
  absl::StatusOr<std::unique_ptr<Tokenizer>> bare = FromGguf([](GgufWriter& w) {
    ASSERT_THAT(w.Add("tokenizer.ggml.add_space_prefix", GgufValue::Bool(false)), IsOk());
  });
  ASSERT_TRUE(plain.ok() && bare.ok());
  const std::vector<int32_t> with = (*plain)->Encode("the fox").value();
  const std::vector<int32_t> without = (*bare)->Encode("the fox").value();
  EXPECT_NE(with, without);  // "▁the" against "t" "he" or the like
  EXPECT_EQ((*bare)->Decode(without).value(), "the fox");
}

TEST_F(GgufSentencePieceTest, BadArraysAreRefusedNamingTheFileAndKey) {
  auto write = [this](const std::vector<float>& scores, const std::vector<int32_t>& types,
                      uint32_t eos) -> absl::Status {
    GgufWriter w;
    EXPECT_THAT(w.Add("tokenizer.ggml.model", GgufValue::String("llama")), IsOk());
    EXPECT_THAT(w.Add("tokenizer.ggml.tokens", GgufValue::StringArray(tokens_)), IsOk());
    EXPECT_THAT(w.Add("tokenizer.ggml.scores", GgufValue::Float32Array(scores)), IsOk());
    EXPECT_THAT(w.Add("tokenizer.ggml.token_type", GgufValue::Int32Array(types)), IsOk());
    EXPECT_THAT(w.Add("tokenizer.ggml.eos_token_id", GgufValue::Uint32(eos)), IsOk());
    const std::string bytes = w.Serialize();
    absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::FromBuffer(
        "bad.gguf", std::span(reinterpret_cast<const std::byte*>(bytes.data()), bytes.size()));
    if (!file.ok()) return file.status();
    TokenizerConfig config;
    config.vocab_size = kVocab;
    return LoadGgufTokenizer(**file, config).status();
  };
  std::vector<float> short_scores(scores_.begin(), scores_.begin() + 10);
  absl::Status s = write(short_scores, types_, 2);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), AllOf(HasSubstr("bad.gguf"), HasSubstr("tokenizer.ggml.scores")));
  std::vector<int32_t> bad_types = types_;
  bad_types[7] = 9;
  s = write(scores_, bad_types, 2);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), AllOf(HasSubstr("bad.gguf"), HasSubstr("token_type[7] = 9")));
  s = write(scores_, types_, 100000);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), AllOf(HasSubstr("bad.gguf"), HasSubstr("eos_token_id")));
  // More pieces than the model embeds.
  GgufWriter w;
  ASSERT_THAT(w.Add("tokenizer.ggml.model", GgufValue::String("llama")), IsOk());
  ASSERT_THAT(w.Add("tokenizer.ggml.tokens", GgufValue::StringArray(tokens_)), IsOk());
  const std::string bytes = w.Serialize();
  absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::FromBuffer(
      "small-vocab.gguf",
      std::span(reinterpret_cast<const std::byte*>(bytes.data()), bytes.size()));
  ASSERT_THAT(file, IsOk());
  TokenizerConfig config;
  config.vocab_size = 100;
  s = LoadGgufTokenizer(**file, config).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), AllOf(HasSubstr("small-vocab.gguf"), HasSubstr("vocab_size 100")));
}

}  // namespace
}  // namespace kvcm
