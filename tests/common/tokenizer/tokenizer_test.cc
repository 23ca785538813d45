#include "common/tokenizer/tokenizer.h"

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/common/tokenizer/sentencepiece_train_for_test.h"
#include "tests/support/status_matchers.h"
#include "tests/support/subprocess.h"

namespace kvcm {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

TokenizerConfig Config(int32_t vocab_size) {
  TokenizerConfig config;
  config.vocab_size = vocab_size;
  config.bos_token_id = 1;
  config.eos_token_ids = {2};
  return config;
}

TEST(ByteTokenizerTest, EveryByteRoundTrips) {
  auto tokenizer = ByteTokenizer::Create(320);
  ASSERT_THAT(tokenizer, IsOk());
  std::string text;
  for (int b = 0; b < 256; ++b) text.push_back(static_cast<char>(b));
  text += "héllo, wörld ✓";
  const std::vector<int32_t> ids = (*tokenizer)->Encode(text).value();
  ASSERT_EQ(ids.size(), text.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    EXPECT_EQ(ids[i], static_cast<unsigned char>(text[i]) + ByteTokenizer::kByteOffset);
  }
  EXPECT_EQ((*tokenizer)->Decode(ids).value(), text);
}

TEST(ByteTokenizerTest, MappingAndSpecialIds) {
  auto tokenizer = ByteTokenizer::Create(320);
  ASSERT_THAT(tokenizer, IsOk());
  EXPECT_THAT((*tokenizer)->Encode("Hi").value(), ElementsAre('H' + 3, 'i' + 3));
  EXPECT_EQ((*tokenizer)->bos_id(), 1);
  EXPECT_EQ((*tokenizer)->eos_id(), 2);
  EXPECT_EQ((*tokenizer)->vocab_size(), 320);
  // BOS, EOS, <unk> and the unused ids 259 .. 319 decode to nothing.
  const std::vector<int32_t> ids = {1, 'H' + 3, 0, 300, 'i' + 3, 2, 319};
  EXPECT_EQ((*tokenizer)->Decode(ids).value(), "Hi");
  const std::vector<int32_t> bad = {'H' + 3, 320};
  const absl::Status s = (*tokenizer)->Decode(bad).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("ids[1] = 320"));
}

TEST(ByteTokenizerTest, VocabTooSmallIsInvalid) {
  const absl::Status s = ByteTokenizer::Create(258).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), AllOf(HasSubstr("258"), HasSubstr("259")));
  EXPECT_THAT(ByteTokenizer::Create(259), IsOk());
}

class LoadTokenizerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<testing::TempDir> dir = testing::TempDir::Create("kvcm-tokenizer");
    ASSERT_THAT(dir, IsOk());
    dir_.emplace(std::move(*dir));
  }
  std::string Path(const std::string& name) const { return dir_->path() + "/" + name; }

  // Trains tokenizer.model (at most 80 pieces) in the temp folder.
  void TrainModel() {
    const std::vector<std::string> lines = {
        "the quick brown fox jumps over the lazy dog",
        "a paged kv cache keeps the keys and values of every token",
        "blocks are shared between sequences with a common prefix",
        "the executor maps the pool and runs the model",
        "hello world, hello cache, hello block",
        "the quick cache keeps the lazy block",
    };
    const std::string error = testing::TrainSentencePieceForTest(lines, Path("tokenizer"), 80);
    ASSERT_EQ(error, "");
    std::filesystem::remove(Path("tokenizer.vocab"));
  }

  std::optional<testing::TempDir> dir_;
};

TEST_F(LoadTokenizerTest, NoTokenizerFileMeansBytes) {
  auto tokenizer = LoadTokenizer(dir_->path(), Config(320));
  ASSERT_THAT(tokenizer, IsOk());
  EXPECT_NE(dynamic_cast<const ByteTokenizer*>(tokenizer->get()), nullptr);
  EXPECT_EQ((*tokenizer)->Decode((*tokenizer)->Encode("abc").value()).value(), "abc");

  TokenizerConfig no_ids = Config(320);
  no_ids.bos_token_id = -1;
  no_ids.eos_token_ids.clear();
  EXPECT_THAT(LoadTokenizer(dir_->path(), no_ids), IsOk());
}

TEST_F(LoadTokenizerTest, BytesWithConflictingConfigIdsAreInvalid) {
  TokenizerConfig bos = Config(320);
  bos.bos_token_id = 5;
  absl::Status s = LoadTokenizer(dir_->path(), bos).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("bos_token_id 5"));

  TokenizerConfig eos = Config(320);
  eos.eos_token_ids = {2, 300};
  s = LoadTokenizer(dir_->path(), eos).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("eos_token_id [2, 300]"));

  EXPECT_EQ(LoadTokenizer(dir_->path(), Config(100)).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(LoadTokenizerTest, TokenizerJsonErrorsAreReturnedNotHidden) {
  // A tokenizer.json is the BPE tokenizer's; a broken one is an error naming it, never a
  // fallback to the tokenizer.model beside it or to bytes.
  std::ofstream(Path("tokenizer.json")) << "{}";
  TrainModel();
  const absl::Status s = LoadTokenizer(dir_->path(), Config(320)).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), AllOf(HasSubstr("tokenizer.json"), HasSubstr("model")));
}

TEST(ByteTokenizerTest, NamesAndSpecialIds) {
  auto tokenizer = ByteTokenizer::Create(320);
  ASSERT_THAT(tokenizer, IsOk());
  EXPECT_TRUE((*tokenizer)->add_bos());
  EXPECT_EQ((*tokenizer)->TokenId("<s>"), 1);
  EXPECT_EQ((*tokenizer)->TokenId("</s>"), 2);
  EXPECT_EQ((*tokenizer)->TokenId("<unk>"), 0);
  EXPECT_EQ((*tokenizer)->TokenId("<0x41>"), 'A' + 3);
  EXPECT_EQ((*tokenizer)->TokenId("<0xFF>"), 255 + 3);
  EXPECT_EQ((*tokenizer)->TokenId("<0xfg>"), std::nullopt);
  EXPECT_EQ((*tokenizer)->TokenId("A"), std::nullopt);
  for (const int32_t id : {0, 1, 2, 259, 319}) EXPECT_TRUE((*tokenizer)->IsSpecial(id)) << id;
  for (const int32_t id : {3, 258, 320, -1}) EXPECT_FALSE((*tokenizer)->IsSpecial(id)) << id;
}

TEST_F(LoadTokenizerTest, CorruptSentencePieceModelIsInvalidNamingThePath) {
  std::ofstream(Path("tokenizer.model")) << "this is not a protobuf";
  const absl::Status s = LoadTokenizer(dir_->path(), Config(320)).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("tokenizer.model"));
  EXPECT_EQ(SentencePieceTokenizer::Load(Path("absent.model"), 320).status().code(),
            absl::StatusCode::kNotFound);
}

TEST_F(LoadTokenizerTest, SentencePieceRoundTrip) {
  TrainModel();
  auto tokenizer = LoadTokenizer(dir_->path(), Config(320));
  ASSERT_THAT(tokenizer, IsOk());
  EXPECT_NE(dynamic_cast<const SentencePieceTokenizer*>(tokenizer->get()), nullptr);
  EXPECT_EQ((*tokenizer)->bos_id(), 1);
  EXPECT_EQ((*tokenizer)->eos_id(), 2);
  EXPECT_EQ((*tokenizer)->vocab_size(), 320);

  for (const std::string text :
       {"the quick brown fox", "hello cache keeps the block", "a lazy dog runs over the pool"}) {
    SCOPED_TRACE(text);
    const std::vector<int32_t> ids = (*tokenizer)->Encode(text).value();
    EXPECT_FALSE(ids.empty());
    EXPECT_LT(ids.size(), text.size());  // merges happened
    for (const int32_t id : ids) {
      EXPECT_GE(id, 3);
      EXPECT_LT(id, 320);
    }
    EXPECT_EQ((*tokenizer)->Decode(ids).value(), text);
  }
  // BOS/EOS and ids past the model's pieces (a padded vocab) contribute nothing.
  std::vector<int32_t> ids = (*tokenizer)->Encode("hello").value();
  ids.insert(ids.begin(), 1);
  ids.push_back(2);
  ids.push_back(319);
  EXPECT_EQ((*tokenizer)->Decode(ids).value(), "hello");
  EXPECT_EQ((*tokenizer)->Decode(std::vector<int32_t>{320}).status().code(),
            absl::StatusCode::kInvalidArgument);

  EXPECT_TRUE((*tokenizer)->add_bos());
  EXPECT_EQ((*tokenizer)->TokenId("<s>"), 1);
  EXPECT_EQ((*tokenizer)->TokenId("</s>"), 2);
  EXPECT_EQ((*tokenizer)->TokenId("no such piece"), std::nullopt);
  EXPECT_TRUE((*tokenizer)->IsSpecial(1));
  EXPECT_TRUE((*tokenizer)->IsSpecial(2));
  EXPECT_TRUE((*tokenizer)->IsSpecial(319));  // past the model's pieces
  EXPECT_FALSE((*tokenizer)->IsSpecial(320));
  const std::vector<int32_t> hello = (*tokenizer)->Encode("hello").value();
  EXPECT_FALSE((*tokenizer)->IsSpecial(hello[0]));
}

TEST_F(LoadTokenizerTest, SentencePieceWithMorePiecesThanTheVocabIsInvalid) {
  TrainModel();
  const absl::Status s = LoadTokenizer(dir_->path(), Config(40)).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), AllOf(HasSubstr("pieces"), HasSubstr("vocab_size 40")));
}

}  // namespace
}  // namespace kvcm
