// IncrementalDecoder: fed one id at a time, its ready pieces then its last pending text are
// exactly Decode of all the ids, every ready piece is whole UTF-8 characters, and the ids it
// decodes grow linearly with the sequence (the router's streams were quadratic before).
// Tokenizers: bytes (characters split across ids), a trained SentencePiece model (leading
// spaces) and the bundled SmolLM2's byte-level BPE from its GGUF file.

#include "common/tokenizer/incremental_decoder.h"

#include <cstdio>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/base/utf8.h"
#include "common/gguf/gguf_file.h"
#include "common/tokenizer/gguf_tokenizer.h"
#include "common/tokenizer/tokenizer.h"
#include "gtest/gtest.h"
#include "tests/common/tokenizer/sentencepiece_train_for_test.h"
#include "tests/support/real_model.h"
#include "tests/support/status_matchers.h"
#include "tests/support/subprocess.h"

namespace kvcm {
namespace {

// Streams `ids` through a decoder; checks each piece (whole UTF-8, when the ids are text)
// and returns what the stream says.
std::string Stream(const Tokenizer& tokenizer, const std::vector<int32_t>& ids, bool text = true) {
  IncrementalDecoder decoder;
  std::string streamed;
  std::string pending;
  for (size_t n = 1; n <= ids.size(); ++n) {
    absl::StatusOr<IncrementalDecoder::Piece> piece =
        decoder.Next(tokenizer, std::span<const int32_t>(ids).first(n));
    EXPECT_THAT(piece, IsOk());
    if (!piece.ok()) return "";
    if (text) {
      EXPECT_EQ(InvalidUtf8Offset(piece->ready), std::string_view::npos) << "after id " << n;
    }
    streamed += piece->ready;
    pending = piece->pending;
    EXPECT_EQ(decoder.emitted(), streamed.size());
  }
  return streamed + pending;
}

// Counts the ids every Decode is asked for.
class CountingTokenizer final : public Tokenizer {
 public:
  explicit CountingTokenizer(const Tokenizer& inner) : inner_(inner) {}
  absl::StatusOr<std::vector<int32_t>> Encode(std::string_view text) const override {
    return inner_.Encode(text);
  }
  absl::StatusOr<std::string> Decode(std::span<const int32_t> ids) const override {
    decoded_ids += ids.size();
    return inner_.Decode(ids);
  }
  int32_t bos_id() const override { return inner_.bos_id(); }
  int32_t eos_id() const override { return inner_.eos_id(); }
  int32_t vocab_size() const override { return inner_.vocab_size(); }
  bool add_bos() const override { return inner_.add_bos(); }
  bool IsSpecial(int32_t id) const override { return inner_.IsSpecial(id); }
  std::optional<int32_t> TokenId(std::string_view piece) const override {
    return inner_.TokenId(piece);
  }
  mutable size_t decoded_ids = 0;

 private:
  const Tokenizer& inner_;
};

const char* const kTexts[] = {
    "the quick brown fox",
    "  two  spaces, then a tab\tand a newline\n",
    "naïve café, 日本語のテキスト, emoji 🙂🚀 and ß",
    "ends inside nothing: é",
    "",
};

TEST(IncrementalDecoderTest, BytesSplitCharactersAcrossIdsAndTheStreamIsTheWholeText) {
  auto tokenizer = ByteTokenizer::Create(320);
  ASSERT_THAT(tokenizer, IsOk());
  for (const char* text : kTexts) {
    SCOPED_TRACE(text);
    std::vector<int32_t> ids = (*tokenizer)->Encode(text).value();
    EXPECT_EQ(Stream(**tokenizer, ids), text);
    // Special ids anywhere contribute nothing.
    ids.insert(ids.begin() + static_cast<std::ptrdiff_t>(ids.size() / 2), ByteTokenizer::kEosId);
    ids.push_back(ByteTokenizer::kEosId);
    EXPECT_EQ(Stream(**tokenizer, ids), text);
  }
}

TEST(IncrementalDecoderTest, RandomBytesStreamExactlyWhatDecodeGives) {
  auto tokenizer = ByteTokenizer::Create(320);
  ASSERT_THAT(tokenizer, IsOk());
  const uint32_t seed = 20261201;
  std::printf("seed %u\n", seed);
  std::mt19937 rng(seed);
  for (int round = 0; round < 200; ++round) {
    std::vector<int32_t> ids(rng() % 40);
    for (int32_t& id : ids) id = static_cast<int32_t>(rng() % 320);  // invalid UTF-8 too
    // Bytes that are not UTF-8 at all pass through as Decode gives them.
    EXPECT_EQ(Stream(**tokenizer, ids, /*text=*/false), (*tokenizer)->Decode(ids).value())
        << "round " << round;
  }
}

TEST(IncrementalDecoderTest, SentencePieceKeepsTheSpacesBetweenPieces) {
  absl::StatusOr<testing::TempDir> dir = testing::TempDir::Create("kvcm-incremental");
  ASSERT_THAT(dir, IsOk());
  const std::string error = testing::TrainSentencePieceForTest(
      {"the quick brown fox jumps over the lazy dog", "hello world, hello cache, hello block",
       "a paged kv cache keeps the keys and values of every token"},
      dir->path() + "/tokenizer", 80);
  ASSERT_EQ(error, "");
  auto tokenizer = SentencePieceTokenizer::Load(dir->path() + "/tokenizer.model", 320);
  ASSERT_THAT(tokenizer, IsOk());
  for (const char* text : {"the quick brown fox", "hello cache keeps the block",
                           "a lazy dog runs over the pool", "x"}) {
    SCOPED_TRACE(text);
    const std::vector<int32_t> ids = (*tokenizer)->Encode(text).value();
    ASSERT_GT(ids.size(), 0u);
    EXPECT_EQ(Stream(**tokenizer, ids), (*tokenizer)->Decode(ids).value());
    EXPECT_EQ(Stream(**tokenizer, ids), text);
  }
}

TEST(IncrementalDecoderTest, SmolLM2sByteLevelBpeStreamsTheWholeText) {
  const std::string path = testing::SmolLM2GgufPath();
  if (!std::filesystem::exists(path)) GTEST_SKIP() << testing::SmolLM2Missing(path);
  absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::Open(path);
  ASSERT_THAT(file, IsOk());
  TokenizerConfig config;
  config.vocab_size = 49152;
  absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer = LoadGgufTokenizer(**file, config);
  ASSERT_THAT(tokenizer, IsOk());
  for (const char* text : kTexts) {
    SCOPED_TRACE(text);
    const std::vector<int32_t> ids = (*tokenizer)->Encode(text).value();
    EXPECT_EQ(Stream(**tokenizer, ids), text);
  }
}

TEST(IncrementalDecoderTest, TheIdsDecodedGrowLinearlyWithTheStream) {
  auto bytes = ByteTokenizer::Create(320);
  ASSERT_THAT(bytes, IsOk());
  CountingTokenizer tokenizer(**bytes);
  std::string text;
  for (int i = 0; i < 500; ++i) text += "tokens é 🙂 ";  // 2,000 characters, 8,000 ids
  const std::vector<int32_t> ids = tokenizer.Encode(text).value();
  EXPECT_EQ(Stream(tokenizer, ids), text);
  // Decoding the whole stream for each id would ask n(n+1)/2 = 32 million.
  EXPECT_LT(tokenizer.decoded_ids, 8 * ids.size()) << ids.size() << " ids";
}

}  // namespace
}  // namespace kvcm
