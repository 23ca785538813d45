// SentencePiece-style tokenizer.json files (BPE over Unicode characters with byte_fallback,
// as Llama 2, Mistral and Gemma ship them) against Hugging Face `tokenizers` 0.23.3.
//
// tests/reference/sentencepiece_bpe/<flavour>/ holds a tokenizer.json, its
// tokenizer_config.json and expected.json, written by
//   tests/common/tokenizer/bpe_reference.py sentencepiece --out-dir DIR --count 500
// from one small BPE (700 tokens: <unk>, <s>, </s>, the 256 "<0xNN>", 150 characters and
// 291 merges) that tokenizers' own trainer made from the script's corpus (seed printed in
// expected.json): the ids and decoded text of every corpus text and edge case, and the
// decoded text of id sequences no text encodes to. They are committed, so this test needs no
// Python. Flavours:
//   llama2            normalizer Prepend("▁") + Replace(" ", "▁"), no pre-tokenizer, decoder
//                     Replace("▁", " "), ByteFallback, Fuse, Strip(" ", 1, 0) (Llama 2,
//                     Mistral v0.1)
//   metaspace         pre-tokenizer and decoder Metaspace(prepend_scheme "first", split
//                     false), no normalizer (the newer spelling)
//   metaspace_legacy  Metaspace spelled with add_prefix_space (prepend "always", split)
//   gemma             normalizer Replace(" ", "▁"), decoder Replace, ByteFallback, Fuse
//   llama2_unk        llama2 with "<0xE4>" and "<0xF0>" missing and fuse_unk false: unk
//                     among byte-fallback tokens
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_join.h"
#include "common/base/utf8.h"
#include "common/tokenizer/bpe_tokenizer.h"
#include "common/tokenizer/incremental_decoder.h"
#include "common/tokenizer/tokenizer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/status_matchers.h"
#include "tests/support/subprocess.h"

namespace kvcm {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using Json = nlohmann::json;

const std::vector<std::string> kFlavours = {"llama2", "metaspace", "metaspace_legacy", "gemma",
                                            "llama2_unk"};

std::string Folder(const std::string& flavour) {
  return std::string(KVCM_SENTENCEPIECE_BPE_FIXTURES) + "/" + flavour;
}

std::string ReadText(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

std::string Escaped(const std::string& s) { return absl::CHexEscape(s); }

// Streams `ids` through an IncrementalDecoder, one more id each call; every ready piece must
// be whole UTF-8. Returns the ready pieces, then the last pending text.
std::string Stream(const Tokenizer& tokenizer, const std::vector<int32_t>& ids) {
  IncrementalDecoder decoder;
  std::string streamed;
  std::string pending;
  for (size_t n = 1; n <= ids.size(); ++n) {
    absl::StatusOr<IncrementalDecoder::Piece> piece =
        decoder.Next(tokenizer, std::span<const int32_t>(ids).first(n));
    EXPECT_THAT(piece, IsOk());
    if (!piece.ok()) return "";
    EXPECT_EQ(InvalidUtf8Offset(piece->ready), std::string_view::npos) << "after id " << n;
    streamed += piece->ready;
    pending = piece->pending;
  }
  return streamed + pending;
}

class SentencePieceBpeTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    expected_ = Json::parse(ReadText(Folder(GetParam()) + "/expected.json"));
    ASSERT_EQ(expected_["tokenizers"].get<std::string>(), "0.23.3");
    ASSERT_GE(expected_["cases"].size(), 500u);
    absl::StatusOr<std::unique_ptr<Tokenizer>> loaded =
        LoadTokenizer(Folder(GetParam()), TokenizerConfig());
    ASSERT_THAT(loaded, IsOk());
    loaded_ = std::move(*loaded);
    tokenizer_ = dynamic_cast<const BpeTokenizer*>(loaded_.get());
    ASSERT_NE(tokenizer_, nullptr);
  }
  bool HasByteToken(const std::vector<int32_t>& ids) const {
    for (const int32_t id : ids) {
      if (id >= 3 && id < 3 + 256) return true;  // "<0x00>" .. "<0xFF>"
    }
    return false;
  }

  Json expected_;
  std::unique_ptr<Tokenizer> loaded_;
  const BpeTokenizer* tokenizer_ = nullptr;
};

// Every case: tokenizers' ids (cached and not), its decoded text, and the same text streamed
// through IncrementalDecoder one id at a time.
TEST_P(SentencePieceBpeTest, IdsAndTextAreThoseOfTokenizers) {
  int mismatches = 0;
  int byte_fallback = 0;
  for (const Json& c : expected_["cases"]) {
    const std::string text = c["text"].get<std::string>();
    const std::vector<int32_t> want = c["ids"].get<std::vector<int32_t>>();
    absl::StatusOr<std::vector<int32_t>> got = tokenizer_->Encode(text);
    ASSERT_THAT(got, IsOk());
    if (*got != want) {
      if (++mismatches <= 10) {
        ADD_FAILURE() << "text \"" << Escaped(text) << "\"\n  kvcm " << absl::StrJoin(*got, " ")
                      << "\n  HF   " << absl::StrJoin(want, " ");
      }
      continue;
    }
    EXPECT_EQ(tokenizer_->EncodeUncached(text).value(), want) << Escaped(text);
    const std::string decoded = c["decoded"].get<std::string>();
    EXPECT_EQ(tokenizer_->Decode(want).value(), decoded) << Escaped(text);
    EXPECT_EQ(Stream(*tokenizer_, want), decoded) << Escaped(text);
    byte_fallback += HasByteToken(want);
  }
  EXPECT_EQ(mismatches, 0) << "of " << expected_["cases"].size() << " cases";
  std::printf(
      "%s: %zu texts compared with tokenizers %s (seed %d), %d of them with "
      "byte-fallback tokens\n",
      GetParam().c_str(), expected_["cases"].size(),
      expected_["tokenizers"].get<std::string>().c_str(), expected_["seed"].get<int>(),
      byte_fallback);
  EXPECT_GT(byte_fallback, 50);
}

// Id sequences no text encodes to: bytes that are no UTF-8 (one U+FFFD per byte of the run),
// characters cut short, lone "▁", specials between bytes.
TEST_P(SentencePieceBpeTest, DecodeOfAnyIdsIsThatOfTokenizers) {
  int streamed = 0;
  for (const Json& c : expected_["decode_cases"]) {
    const std::vector<int32_t> ids = c["ids"].get<std::vector<int32_t>>();
    const std::string decoded = c["decoded"].get<std::string>();
    EXPECT_EQ(tokenizer_->Decode(ids).value(), decoded) << absl::StrJoin(ids, " ");
    // Streamed, every piece is whole UTF-8 (Stream checks), and the text is Decode's unless
    // bytes that are no UTF-8 made U+FFFD of text already returned (incremental_decoder.h).
    const std::string stream = Stream(*tokenizer_, ids);
    if (decoded.find("\xEF\xBF\xBD") == std::string::npos) {
      EXPECT_EQ(stream, decoded) << absl::StrJoin(ids, " ");
      ++streamed;
    }
  }
  EXPECT_GT(streamed, 10);
  std::printf(
      "%s: %zu id sequences decoded as tokenizers does, %d of them (those without "
      "U+FFFD) streamed to the same text\n",
      GetParam().c_str(), expected_["decode_cases"].size(), streamed);
}

TEST_P(SentencePieceBpeTest, SpecialTokensAndBos) {
  EXPECT_EQ(tokenizer_->add_bos(), expected_["add_bos"].get<bool>());
  EXPECT_EQ(tokenizer_->bos_id(), expected_["bos_id"].get<int32_t>());
  EXPECT_EQ(tokenizer_->eos_id(), expected_["eos_id"].get<int32_t>());
  EXPECT_TRUE(tokenizer_->IsSpecial(tokenizer_->bos_id()));
  EXPECT_TRUE(tokenizer_->IsSpecial(tokenizer_->eos_id()));
  EXPECT_EQ(tokenizer_->TokenId("<unk>"), 0);
  EXPECT_EQ(tokenizer_->TokenId("<0x41>"), 3 + 0x41);
  EXPECT_FALSE(tokenizer_->IsSpecial(3 + 0x41));
  EXPECT_EQ(tokenizer_->vocab_size(), 700);
  const absl::Status bad = tokenizer_->Encode("ok \xff").status();
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.message(), HasSubstr("byte 3"));
}

INSTANTIATE_TEST_SUITE_P(Flavours, SentencePieceBpeTest, ::testing::ValuesIn(kFlavours),
                         [](const ::testing::TestParamInfo<std::string>& param) {
                           return param.param;
                         });

// A character split across byte-fallback tokens streams as nothing until it is whole; the
// space before the first word is stripped once, at the start of the text only.
TEST(SentencePieceBpeStreamTest, SplitCharactersWaitAndTheFirstSpaceGoesOnce) {
  absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer =
      LoadTokenizer(Folder("llama2"), TokenizerConfig());
  ASSERT_THAT(tokenizer, IsOk());
  const Tokenizer& t = **tokenizer;
  const std::vector<int32_t> ids = t.Encode("\xe9\xbe\x98 a").value();  // U+9F98: never seen
  ASSERT_GE(ids.size(), 4u);
  IncrementalDecoder decoder;
  std::vector<std::string> ready;
  for (size_t n = 1; n <= ids.size(); ++n) {
    absl::StatusOr<IncrementalDecoder::Piece> piece =
        decoder.Next(t, std::span<const int32_t>(ids).first(n));
    ASSERT_THAT(piece, IsOk());
    ready.push_back(piece->ready);
  }
  // "▁" (stripped: the start of the text), then <0xE9> <0xBE> <0x98>, then "▁a".
  EXPECT_EQ(t.Decode(std::vector<int32_t>{ids[0]}).value(), "");
  EXPECT_EQ(absl::StrJoin(ready, "|"), "|||\xe9\xbe\x98| a");
  EXPECT_EQ(t.Decode(ids).value(), "\xe9\xbe\x98 a");
  // Special ids before and between: Strip takes the first space of the text only.
  std::vector<int32_t> with_bos = {t.bos_id()};
  const std::vector<int32_t> words = t.Encode("a a").value();
  with_bos.insert(with_bos.end(), words.begin(), words.end());
  with_bos.insert(with_bos.begin() + 2, t.eos_id());
  EXPECT_EQ(Stream(t, with_bos), t.Decode(with_bos).value());
  EXPECT_EQ(t.Decode(with_bos).value(), "a a");
}

// The services load a model folder through LoadTokenizer: a SentencePiece-style
// tokenizer.json loads from tokenizer.json, also with a tokenizer.model beside it (which is
// never read, as Hugging Face's AutoTokenizer prefers the fast tokenizer).
TEST(SentencePieceBpeFolderTest, AFolderWithTokenizerJsonAndTokenizerModelLoadsTheJson) {
  absl::StatusOr<testing::TempDir> dir = testing::TempDir::Create("kvcm-sp-bpe");
  ASSERT_THAT(dir, IsOk());
  for (const char* name : {"tokenizer.json", "tokenizer_config.json"}) {
    std::filesystem::copy_file(Folder("llama2") + "/" + name, dir->path() + "/" + name);
  }
  std::ofstream(dir->path() + "/tokenizer.model") << "not a SentencePiece model";
  TokenizerConfig config;
  config.vocab_size = 768;  // a padded embedding
  config.eos_token_ids = {2};
  absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer = LoadTokenizer(dir->path(), config);
  ASSERT_THAT(tokenizer, IsOk());
  ASSERT_NE(dynamic_cast<const BpeTokenizer*>(tokenizer->get()), nullptr);
  EXPECT_EQ((*tokenizer)->vocab_size(), 768);
  EXPECT_TRUE((*tokenizer)->add_bos());
  EXPECT_EQ((*tokenizer)->bos_id(), 1);
  EXPECT_EQ((*tokenizer)->eos_id(), 2);
  EXPECT_TRUE((*tokenizer)->IsSpecial(767));
  const Json expected = Json::parse(ReadText(Folder("llama2") + "/expected.json"));
  for (const Json& c : expected["cases"]) {
    const std::vector<int32_t> want = c["ids"].get<std::vector<int32_t>>();
    ASSERT_EQ((*tokenizer)->Encode(c["text"].get<std::string>()).value(), want);
    ASSERT_EQ((*tokenizer)->Decode(want).value(), c["decoded"].get<std::string>());
  }
}

// ---- What is still refused, each naming its key. ----

class SentencePieceBpeRefusalTest : public ::testing::Test {
 protected:
  void SetUp() override {
    base_ = Json::parse(ReadText(Folder("llama2") + "/tokenizer.json"));
    absl::StatusOr<testing::TempDir> dir = testing::TempDir::Create("kvcm-sp-bpe-refused");
    ASSERT_THAT(dir, IsOk());
    dir_.emplace(std::move(*dir));
  }
  // Through FromTokenizerJson: what the parser takes and FromVocab refuses (a regex) too.
  absl::Status Load(const Json& root) const {
    const std::string path = dir_->path() + "/tokenizer.json";
    std::ofstream(path, std::ios::binary | std::ios::trunc) << root.dump();
    return BpeTokenizer::FromTokenizerJson(path, TokenizerConfig()).status();
  }
  void ExpectRefused(const Json& root, absl::StatusCode code,
                     const std::vector<std::string>& words) const {
    const absl::Status s = Load(root);
    EXPECT_EQ(s.code(), code) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr("tokenizer.json")) << s;
    for (const std::string& word : words) {
      EXPECT_THAT(std::string(s.message()), HasSubstr(word)) << s;
    }
  }
  Json base_;
  std::optional<testing::TempDir> dir_;
};

TEST_F(SentencePieceBpeRefusalTest, DecodersPreTokenizersAndModelOptions) {
  using Code = absl::StatusCode;
  const Json metaspace = {{"type", "Metaspace"}, {"replacement", "\u2581"}};
  const Json byte_level = {{"type", "ByteLevel"}, {"add_prefix_space", false}};
  struct Case {
    std::string path;  // JSON pointer
    Json value;
    Code code;
    std::vector<std::string> words;
  };
  const std::vector<Case> cases = {
      {"/decoder",
       {{"type", "WordPiece"}, {"prefix", "##"}},
       Code::kUnimplemented,
       {"decoder", "WordPiece"}},
      {"/decoder/decoders/1",
       {{"type", "CTC"}},
       Code::kUnimplemented,
       {"decoder.decoders[1]", "CTC"}},
      {"/decoder/decoders/2",
       {{"type", "BPEDecoder"}},
       Code::kUnimplemented,
       {"decoder.decoders[2]", "BPEDecoder"}},
      {"/decoder", {{"type", "ByteLevel"}}, Code::kUnimplemented, {"decoder", "ByteLevel"}},
      {"/decoder", nullptr, Code::kUnimplemented, {"decoder", "null"}},
      {"/decoder/decoders/3/content",
       "  ",
       Code::kInvalidArgument,
       {"decoder.decoders[3].content", "one character"}},
      {"/decoder/decoders/3/stop", -1, Code::kInvalidArgument, {"decoder.decoders[3].stop"}},
      {"/decoder/decoders/0/pattern", {{"Regex", "(open"}}, Code::kInvalidArgument, {"(open"}},
      {"/pre_tokenizer",
       {{"type", "Whitespace"}},
       Code::kUnimplemented,
       {"pre_tokenizer", "Whitespace"}},
      {"/pre_tokenizer",
       {{"type", "Sequence"}, {"pretokenizers", {metaspace, byte_level}}},
       Code::kUnimplemented,
       {"pre_tokenizer", "Metaspace", "ByteLevel"}},
      {"/pre_tokenizer",
       {{"type", "Metaspace"}},
       Code::kInvalidArgument,
       {"pre_tokenizer.replacement"}},
      {"/pre_tokenizer",
       {{"type", "Metaspace"}, {"replacement", "\u2581\u2581"}},
       Code::kInvalidArgument,
       {"pre_tokenizer.replacement", "one character"}},
      {"/pre_tokenizer",
       {{"type", "Metaspace"}, {"replacement", "\u2581"}, {"prepend_scheme", "First"}},
       Code::kInvalidArgument,
       {"pre_tokenizer.prepend_scheme"}},
      {"/pre_tokenizer",
       {{"type", "Metaspace"}, {"replacement", "\u2581"}, {"prepend_scheme", nullptr}},
       Code::kInvalidArgument,
       {"pre_tokenizer.prepend_scheme"}},
      // tokenizers 0.23.3 refuses it too ("add_prefix_space does not match declared
      // prepend_scheme").
      {"/pre_tokenizer",
       {{"type", "Metaspace"}, {"replacement", "\u2581"}, {"add_prefix_space", false}},
       Code::kInvalidArgument,
       {"pre_tokenizer.add_prefix_space"}},
      {"/pre_tokenizer",
       {{"type", "Metaspace"}, {"replacement", "\u2581"}, {"split", "yes"}},
       Code::kInvalidArgument,
       {"pre_tokenizer.split", "boolean"}},
      {"/model/byte_fallback", "yes", Code::kInvalidArgument, {"model.byte_fallback", "boolean"}},
      {"/model/dropout", 0.1, Code::kUnimplemented, {"model.dropout"}},
      {"/model/continuing_subword_prefix",
       "##",
       Code::kUnimplemented,
       {"model.continuing_subword_prefix"}},
      {"/model/end_of_word_suffix", "</w>", Code::kUnimplemented, {"model.end_of_word_suffix"}},
      {"/model/type", "WordPiece", Code::kUnimplemented, {"model.type", "WordPiece"}},
      {"/model/type", "WordLevel", Code::kUnimplemented, {"model.type", "WordLevel"}},
      {"/model/merges/0", {"\u2581 a", "b"}, Code::kUnimplemented, {"model.merges[0]", "space"}},
      {"/normalizer",
       {{"type", "Precompiled"}, {"precompiled_charsmap", "AAAA"}},
       Code::kUnimplemented,
       {"normalizer", "Precompiled"}},
      {"/post_processor",
       {{"type", "RobertaProcessing"}},
       Code::kUnimplemented,
       {"post_processor", "RobertaProcessing"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.path + " = " + c.value.dump());
    Json root = base_;
    root[Json::json_pointer(c.path)] = c.value;
    ExpectRefused(root, c.code, c.words);
  }
  // byte_fallback with the byte-level alphabet.
  Json root = base_;
  root["pre_tokenizer"] = byte_level;
  root["decoder"] = {{"type", "ByteLevel"}};
  ExpectRefused(root, Code::kUnimplemented, {"model.byte_fallback", "ByteLevel"});
}

// What loads: the legacy Metaspace spellings tokenizers 0.23.3 reads, with the schemes they
// stand for, and the schemes' effect on a hand-checked text.
TEST_F(SentencePieceBpeRefusalTest, MetaspaceSpellingsThatLoad) {
  using Scheme = BpePreTokenizerStep::PrependScheme;
  struct Case {
    Json pre;
    Scheme scheme;
    bool split;
  };
  const std::vector<Case> cases = {
      {{{"type", "Metaspace"}, {"replacement", "\u2581"}}, Scheme::kAlways, true},
      {{{"type", "Metaspace"}, {"replacement", "\u2581"}, {"add_prefix_space", true}},
       Scheme::kAlways,
       true},
      {{{"type", "Metaspace"},
        {"replacement", "\u2581"},
        {"add_prefix_space", false},
        {"prepend_scheme", "never"}},
       Scheme::kNever,
       true},
      {{{"type", "Metaspace"},
        {"replacement", "\u2581"},
        {"add_prefix_space", true},
        {"prepend_scheme", "first"},
        {"split", nullptr},
        {"str_rep", "\u2581"}},
       Scheme::kFirst,
       true},
      {{{"type", "Metaspace"}, {"replacement", "_"}, {"prepend_scheme", "never"}, {"split", false}},
       Scheme::kNever,
       false},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.pre.dump());
    Json root = base_;
    root["normalizer"] = nullptr;
    root["pre_tokenizer"] = c.pre;
    absl::StatusOr<BpeVocab> vocab = ParseTokenizerJson(root.dump(), "tokenizer.json");
    ASSERT_THAT(vocab, IsOk());
    EXPECT_FALSE(vocab->byte_level);
    EXPECT_TRUE(vocab->byte_fallback);
    ASSERT_EQ(vocab->pre_tokenizer.size(), 1u);
    EXPECT_EQ(vocab->pre_tokenizer[0].prepend_scheme, c.scheme);
    EXPECT_EQ(vocab->pre_tokenizer[0].split, c.split);
    EXPECT_EQ(vocab->decoder.size(), 4u);
  }
  // The schemes on "<s>a b": "always" puts "▁" before each piece between added tokens,
  // "first" only before the text's first, "never" nowhere. Split or not, "▁a" and "▁b" are
  // tokens of their own here (the vocab has no merge across "▁").
  for (const auto& [scheme, want] : std::vector<std::pair<std::string, std::string>>{
           {"always", "<s> ▁a ▁b"}, {"first", "<s> a ▁b"}, {"never", "<s> a ▁b"}}) {
    SCOPED_TRACE(scheme);
    Json root = base_;
    root["normalizer"] = nullptr;
    root["pre_tokenizer"] = {
        {"type", "Metaspace"}, {"replacement", "\u2581"}, {"prepend_scheme", scheme}};
    absl::StatusOr<BpeVocab> vocab = ParseTokenizerJson(root.dump(), "tokenizer.json");
    ASSERT_THAT(vocab, IsOk());
    const std::vector<std::string> tokens = vocab->tokens;
    auto tokenizer = BpeTokenizer::FromVocab(*std::move(vocab), 0);
    ASSERT_THAT(tokenizer, IsOk());
    std::vector<std::string> spelled;
    const std::vector<int32_t> ids = (*tokenizer)->Encode("<s>a b").value();
    for (const int32_t id : ids) {
      spelled.push_back(tokens[static_cast<size_t>(id)]);
    }
    EXPECT_EQ(absl::StrJoin(spelled, " "), want);
    // A text that starts with a piece gets "▁" under "first" too.
    const std::vector<int32_t> a = (*tokenizer)->Encode("a").value();
    ASSERT_EQ(a.size(), 1u);
    EXPECT_EQ(tokens[static_cast<size_t>(a[0])], scheme == "never" ? "a" : "\u2581a");
  }
}

}  // namespace
}  // namespace kvcm
