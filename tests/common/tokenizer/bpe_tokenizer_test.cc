// BpeTokenizer against Hugging Face `tokenizers`, run live: bpe_reference.py (the reference
// venv) builds each family's tokenizer, encodes a seeded corpus and writes what it gets;
// kvcm loads the same tokenizer and must give the same ids and text.
#include "common/tokenizer/bpe_tokenizer.h"

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
#include "absl/time/time.h"
#include "common/gguf/gguf_file.h"
#include "common/gguf/gguf_writer.h"
#include "common/tokenizer/byte_level.h"
#include "common/tokenizer/gguf_tokenizer.h"
#include "common/tokenizer/tokenizer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/real_model.h"
#include "tests/support/status_matchers.h"
#include "tests/support/subprocess.h"

namespace kvcm {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using Json = nlohmann::json;

constexpr int kSeed = 20240917;  // the corpus; the trained tokenizers use kSeed + 1
constexpr int kCorpusSize = 1200;

std::string Escaped(const std::string& s) { return absl::CHexEscape(std::string(s)); }

// Runs bpe_reference.py with `args`; the empty string on success, else why not.
std::string RunReference(const std::vector<std::string>& args, const std::string& dir) {
  testing::Subprocess::Options options;
  options.argv = {KVCM_REFERENCE_PYTHON, KVCM_BPE_REFERENCE_SCRIPT};
  options.argv.insert(options.argv.end(), args.begin(), args.end());
  options.output_path = dir + "/reference.log";
  options.env = {"TOKENIZERS_PARALLELISM=false", "RAYON_NUM_THREADS=1"};
  absl::StatusOr<std::unique_ptr<testing::Subprocess>> child = testing::Subprocess::Start(options);
  if (!child.ok()) return child.status().ToString();
  absl::StatusOr<int> code = (*child)->Wait(absl::Seconds(240));
  const std::string output = (*child)->Output();
  std::printf("%s", output.c_str());
  if (!code.ok()) return code.status().ToString() + "\n" + output;
  if (*code != 0) return "bpe_reference.py exited with " + std::to_string(*code) + "\n" + output;
  return "";
}

Json ReadJson(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return Json::parse(text.str());
}

struct Family {
  std::string name;
  int32_t model_vocab_size;  // what config.json would say (0: the tokenizer's own size)
};

class BpeFamilyTest : public ::testing::TestWithParam<Family> {
 protected:
  void SetUp() override {
    absl::StatusOr<testing::TempDir> dir = testing::TempDir::Create("kvcm-bpe");
    ASSERT_THAT(dir, IsOk());
    dir_.emplace(std::move(*dir));
    std::printf("corpus seed %d, %d strings, family %s\n", kSeed, kCorpusSize,
                GetParam().name.c_str());
    std::vector<std::string> args;
    if (GetParam().name == "smollm2") {
      const std::string gguf = testing::SmolLM2GgufPath();
      ASSERT_TRUE(std::filesystem::exists(gguf)) << testing::SmolLM2Missing(gguf);
      args = {"smollm2", "--gguf", gguf};
    } else {
      args = {"train", "--family", GetParam().name};
    }
    args.insert(args.end(), {"--out-dir", Folder(), "--seed", std::to_string(kSeed), "--count",
                             std::to_string(kCorpusSize)});
    const std::string error = RunReference(args, dir_->path());
    ASSERT_EQ(error, "");
    expected_ = ReadJson(Folder() + "/expected.json");
    ASSERT_EQ(expected_["seed"].get<int>(), kSeed);
    ASSERT_GE(expected_["cases"].size(), 1000u);
  }
  std::string Folder() const { return dir_->path() + "/model"; }

  TokenizerConfig Config() const {
    TokenizerConfig config;
    config.vocab_size = GetParam().model_vocab_size;
    return config;
  }

  // Every case: Hugging Face's ids and decoded text; the text back when no special token is
  // in the ids; token-by-token decoding gives the same bytes (nothing replaced).
  void ExpectMatchesReference(const BpeTokenizer& tokenizer) {
    int mismatches = 0;
    int round_trips = 0;
    for (const Json& c : expected_["cases"]) {
      const std::string text = c["text"].get<std::string>();
      const std::vector<int32_t> want = c["ids"].get<std::vector<int32_t>>();
      absl::StatusOr<std::vector<int32_t>> got = tokenizer.Encode(text);
      ASSERT_THAT(got, IsOk());
      if (*got != want) {
        if (++mismatches <= 10) {
          ADD_FAILURE() << "text \"" << Escaped(text) << "\"\n  kvcm " << absl::StrJoin(*got, " ")
                        << "\n  HF   " << absl::StrJoin(want, " ");
        }
        continue;
      }
      EXPECT_EQ(tokenizer.EncodeUncached(text).value(), want) << Escaped(text);
      const std::string decoded = tokenizer.Decode(want).value();
      EXPECT_EQ(decoded, c["decoded"].get<std::string>()) << Escaped(text);
      std::string piecewise;
      bool special = false;
      for (const int32_t id : want) {
        piecewise += tokenizer.Decode(std::vector<int32_t>{id}).value();
        special |= tokenizer.IsSpecial(id);
      }
      EXPECT_EQ(piecewise, decoded) << Escaped(text);
      if (!special) {
        // A normalizer (Qwen2's NFC) gives back the normalized text.
        const std::string normalized =
            c.contains("normalized") ? c["normalized"].get<std::string>() : text;
        EXPECT_EQ(decoded, normalized)
            << "decode(encode(s)) != normalize(s) for \"" << Escaped(text) << "\"";
        ++round_trips;
      }
    }
    EXPECT_EQ(mismatches, 0) << "of " << expected_["cases"].size() << " cases (seed " << kSeed
                             << ")";
    EXPECT_GT(round_trips, 900);
  }

  std::optional<testing::TempDir> dir_;
  Json expected_;
};

TEST_P(BpeFamilyTest, TokenizerJsonMatchesHuggingFace) {
  absl::StatusOr<std::unique_ptr<Tokenizer>> loaded = LoadTokenizer(Folder(), Config());
  ASSERT_THAT(loaded, IsOk());
  const auto* tokenizer = dynamic_cast<const BpeTokenizer*>(loaded->get());
  ASSERT_NE(tokenizer, nullptr);
  ExpectMatchesReference(*tokenizer);
  EXPECT_EQ(tokenizer->add_bos(), expected_["add_bos"].get<bool>());
  if (tokenizer->add_bos()) {
    EXPECT_EQ(tokenizer->bos_id(), expected_["bos_id"].get<int32_t>());
  }
}

TEST_P(BpeFamilyTest, SpecialTokensByName) {
  absl::StatusOr<std::unique_ptr<Tokenizer>> loaded = LoadTokenizer(Folder(), Config());
  ASSERT_THAT(loaded, IsOk());
  const Tokenizer& tokenizer = **loaded;
  const Json config = ReadJson(Folder() + "/tokenizer_config.json");
  const std::optional<int32_t> eos = tokenizer.TokenId(config["eos_token"].get<std::string>());
  ASSERT_TRUE(eos.has_value());
  EXPECT_EQ(tokenizer.eos_id(), *eos);
  EXPECT_TRUE(tokenizer.IsSpecial(*eos));
  EXPECT_EQ(tokenizer.Decode(std::vector<int32_t>{*eos}).value(), "");
  EXPECT_EQ(tokenizer.TokenId("no such token, surely"), std::nullopt);
  EXPECT_FALSE(tokenizer.IsSpecial(-1));
  EXPECT_FALSE(tokenizer.IsSpecial(tokenizer.vocab_size()));
  const std::optional<int32_t> space_a = tokenizer.TokenId("Ġa");  // byte-level spelling
  if (space_a.has_value()) {
    EXPECT_EQ(tokenizer.Decode(std::vector<int32_t>{*space_a}).value(), " a");
    EXPECT_FALSE(tokenizer.IsSpecial(*space_a));
  }
  const absl::Status s = tokenizer.Decode(std::vector<int32_t>{0, tokenizer.vocab_size()}).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("ids[1]"));
  // Encode refuses bytes that are not UTF-8, naming where.
  const absl::Status bad = tokenizer.Encode("ok \xff").status();
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.message(), HasSubstr("byte 3"));
}

INSTANTIATE_TEST_SUITE_P(Families, BpeFamilyTest,
                         ::testing::Values(Family{"smollm2", 49152}, Family{"llama3", 4096},
                                           Family{"qwen2", 0}, Family{"gpt2", 0}),
                         [](const ::testing::TestParamInfo<Family>& param) {
                           return param.param.name;
                         });

// The GGUF's own arrays (tokens, merges, token_type, pre "smollm", bos/eos, add_bos_token)
// through FromVocab, on the same corpus.
class SmolLM2GgufVocabTest : public BpeFamilyTest {};

TEST_P(SmolLM2GgufVocabTest, FromVocabMatchesHuggingFace) {
  const Json gguf = ReadJson(Folder() + "/gguf_vocab.json");
  BpeVocab vocab;
  vocab.source = "gguf_vocab.json";
  vocab.tokens = gguf["tokens"].get<std::vector<std::string>>();
  vocab.merges = gguf["merges"].get<std::vector<std::string>>();
  const std::vector<int> types = gguf["token_type"].get<std::vector<int>>();
  for (size_t id = 0; id < types.size(); ++id) {
    if (types[id] == 3 || types[id] == 4) {
      BpeAddedToken token;
      token.content = vocab.tokens[id];
      token.id = static_cast<int32_t>(id);
      token.special = types[id] == 3;
      vocab.added_tokens.push_back(token);
    }
  }
  vocab.pre = gguf["pre"].get<std::string>();
  EXPECT_EQ(vocab.pre, "smollm");
  vocab.bos_id = gguf["bos_id"].get<int32_t>();
  vocab.eos_id = gguf["eos_id"].get<int32_t>();
  vocab.add_bos = gguf["add_bos"].get<bool>();
  absl::StatusOr<std::unique_ptr<BpeTokenizer>> tokenizer =
      BpeTokenizer::FromVocab(std::move(vocab), 49152);
  ASSERT_THAT(tokenizer, IsOk());
  ExpectMatchesReference(**tokenizer);
  EXPECT_FALSE((*tokenizer)->add_bos());  // tokenizer.ggml.add_bos_token = false
  EXPECT_EQ((*tokenizer)->bos_id(), 1);
  EXPECT_EQ((*tokenizer)->eos_id(), 2);
  EXPECT_EQ((*tokenizer)->TokenId("<|im_end|>"), 2);
  EXPECT_EQ((*tokenizer)->TokenId("<|im_start|>"), 1);
}

// The GGUF file itself through LoadGgufTokenizer.
TEST_P(SmolLM2GgufVocabTest, LoadGgufTokenizerMatchesHuggingFace) {
  absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::Open(testing::SmolLM2GgufPath());
  ASSERT_THAT(file, IsOk());
  TokenizerConfig config;
  config.vocab_size = 49152;
  absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer = LoadGgufTokenizer(**file, config);
  ASSERT_THAT(tokenizer, IsOk());
  const auto* bpe = dynamic_cast<const BpeTokenizer*>(tokenizer->get());
  ASSERT_NE(bpe, nullptr);
  ExpectMatchesReference(*bpe);
  EXPECT_FALSE(bpe->add_bos());
  EXPECT_EQ(bpe->bos_id(), 1);
  EXPECT_EQ(bpe->eos_id(), 2);
  EXPECT_EQ(bpe->TokenId("<|im_end|>"), 2);
  EXPECT_TRUE(bpe->IsSpecial(2));
}

INSTANTIATE_TEST_SUITE_P(SmolLM2, SmolLM2GgufVocabTest, ::testing::Values(Family{"smollm2", 49152}),
                         [](const ::testing::TestParamInfo<Family>& param) {
                           return param.param.name;
                         });

// Every normalizer of normalizer.h on the bundled GGUF's vocabulary, each tokenizer.json
// written by `tokenizers` with the normalizer (bpe_reference.py's NORMALIZERS) and an added
// token "kvcm" matched after it: the ids, the decoded text and decode(encode(s)) ==
// normalize(s) on the corpus and bpe_reference.py's NORMALIZER_TEXTS. One test for all of
// them, so that the reference runs once (ctest runs each test in a process of its own).
class BpeNormalizerTest : public BpeFamilyTest {
 protected:
  void SetUp() override {
    absl::StatusOr<testing::TempDir> dir = testing::TempDir::Create("kvcm-bpe-normalizers");
    ASSERT_THAT(dir, IsOk());
    dir_.emplace(std::move(*dir));
    const std::string gguf = testing::SmolLM2GgufPath();
    ASSERT_TRUE(std::filesystem::exists(gguf)) << testing::SmolLM2Missing(gguf);
    std::printf("corpus seed %d, %d strings\n", kSeed, kCorpusSize);
    ASSERT_EQ(RunReference({"normalizers", "--gguf", gguf, "--out-dir", dir_->path(), "--seed",
                            std::to_string(kSeed), "--count", std::to_string(kCorpusSize)},
                           dir_->path()),
              "");
  }
};

TEST_P(BpeNormalizerTest, EveryNormalizerMatchesHuggingFace) {
  for (const std::string name :
       {"nfd", "nfkc", "nfkd", "lowercase", "strip", "strip_right", "strip_accents",
        "sentencepiece", "replace_regex", "bert", "bert_cased", "sequence"}) {
    SCOPED_TRACE(name);
    const std::string folder = dir_->path() + "/" + name;
    expected_ = ReadJson(folder + "/expected.json");
    ASSERT_EQ(expected_["seed"].get<int>(), kSeed);
    ASSERT_GE(expected_["cases"].size(), 1000u);
    absl::StatusOr<std::unique_ptr<Tokenizer>> loaded = LoadTokenizer(folder, TokenizerConfig());
    ASSERT_THAT(loaded, IsOk());
    const auto* tokenizer = dynamic_cast<const BpeTokenizer*>(loaded->get());
    ASSERT_NE(tokenizer, nullptr);
    ExpectMatchesReference(*tokenizer);
    // The normalizer changed some of the corpus (else this would prove nothing).
    int changed = 0;
    for (const Json& c : expected_["cases"]) changed += c["normalized"] != c["text"];
    std::printf("%s: the normalizer changes %d of %zu texts\n", name.c_str(), changed,
                expected_["cases"].size());
    EXPECT_GT(changed, 10);
  }
}

INSTANTIATE_TEST_SUITE_P(Normalizers, BpeNormalizerTest, ::testing::Values(Family{"smollm2", 0}),
                         [](const ::testing::TestParamInfo<Family>& param) {
                           return param.param.name;
                         });

// The SentencePiece-style fixtures the tree keeps (tests/reference/sentencepiece_bpe, read by
// sentencepiece_bpe_test without Python) are what bpe_reference.py writes with the reference
// venv's tokenizers today, byte for byte.
TEST(SentencePieceBpeFixturesTest, TheCommittedFixturesAreWhatTheReferenceWrites) {
  absl::StatusOr<testing::TempDir> dir = testing::TempDir::Create("kvcm-sp-fixtures");
  ASSERT_THAT(dir, IsOk());
  ASSERT_EQ(RunReference({"sentencepiece", "--out-dir", dir->path() + "/out", "--seed",
                          std::to_string(kSeed), "--count", "500"},
                         dir->path()),
            "");
  int compared = 0;
  for (const char* flavour : {"llama2", "metaspace", "metaspace_legacy", "gemma", "llama2_unk"}) {
    for (const char* name : {"tokenizer.json", "tokenizer_config.json", "expected.json"}) {
      const std::string relative = std::string(flavour) + "/" + name;
      const std::string committed =
          testing::ReadFileOrEmpty(std::string(KVCM_SENTENCEPIECE_BPE_FIXTURES) + "/" + relative);
      ASSERT_FALSE(committed.empty()) << relative;
      EXPECT_TRUE(committed == testing::ReadFileOrEmpty(dir->path() + "/out/" + relative))
          << relative << " differs: run bpe_reference.py sentencepiece --out-dir "
          << "tests/reference/sentencepiece_bpe --count 500";
      ++compared;
    }
  }
  EXPECT_EQ(compared, 15);
}

// Replace with a regex that matches empty strings. `tokenizers` 0.23.3 panics encoding
// with one ("index out of bounds" on the corpus), so it cannot be the live reference; these
// are what its normalizer gives alone (normalizers.Replace(Regex("x*"), "-").normalize_str).
TEST(NormalizerTest, AnEmptyMatchWhereThePreviousEndedIsNotReplaced) {
  NormalizerStep step;
  step.kind = NormalizerStep::Kind::kReplace;
  step.pattern = "x*";
  step.pattern_is_regex = true;
  step.content = "-";
  absl::StatusOr<Normalizer> n = Normalizer::Create({step}, "test");
  ASSERT_THAT(n, IsOk());
  for (const auto& [in, want] : std::vector<std::pair<std::string, std::string>>{
           {"abc", "-a-b-c-"}, {"xxaxb", "-a-b-"}, {"", ""}, {"\u00e9 x", "-\u00e9- -"}}) {
    std::string out;
    ASSERT_THAT(n->Apply(in, &out), IsOk());
    EXPECT_EQ(out, want) << in;
  }
}

// A normalizer built in code (not from JSON, which is UTF-8 checked) with bytes that are not
// UTF-8 is refused before any text reaches it.
TEST(NormalizerTest, ContentThatIsNotUtf8IsRefused) {
  NormalizerStep step;
  step.kind = NormalizerStep::Kind::kPrepend;
  step.content = "\xe2\x96";  // a truncated U+2581
  const absl::Status s = Normalizer::Create({step}, "test vocab").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), AllOf(HasSubstr("test vocab"), HasSubstr("UTF-8")));
}

// ---- Small hand-made tokenizers: errors and options. ----

// A byte-level tokenizer.json: the 256 bytes, then `merges` (each "a b" in byte-level
// spelling, results added to the vocab), then `extra` appended to the top-level object.
std::string TinyTokenizerJson(
    const std::vector<std::pair<std::string, std::string>>& merges, const std::string& extra = "",
    const std::string& pre_tokenizer =
        R"({"type": "ByteLevel", "add_prefix_space": false, "use_regex": true})") {
  Json vocab = Json::object();
  int id = 0;
  for (int b = 0; b < 256; ++b) {
    std::string spelled;
    internal::ByteLevelEncode(std::string(1, static_cast<char>(b)), &spelled);
    vocab[spelled] = id++;
  }
  Json merge_list = Json::array();
  for (const auto& [a, b] : merges) {
    if (!vocab.contains(a + b)) vocab[a + b] = id++;
    merge_list.push_back(a + " " + b);
  }
  Json root = {{"version", "1.0"},
               {"added_tokens", Json::array({{{"id", id},
                                              {"content", "<|end|>"},
                                              {"special", true},
                                              {"lstrip", false},
                                              {"rstrip", false},
                                              {"single_word", false},
                                              {"normalized", false}}})},
               {"normalizer", nullptr},
               {"pre_tokenizer", Json::parse(pre_tokenizer)},
               {"post_processor", {{"type", "ByteLevel"}}},
               {"decoder", {{"type", "ByteLevel"}}},
               {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", merge_list}}}};
  std::string text = root.dump();
  if (!extra.empty()) text = text.substr(0, text.size() - 1) + "," + extra + "}";
  return text;
}

class BpeTokenizerJsonTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<testing::TempDir> dir = testing::TempDir::Create("kvcm-bpe-json");
    ASSERT_THAT(dir, IsOk());
    dir_.emplace(std::move(*dir));
  }
  std::string Write(const std::string& text, const std::string& name = "tokenizer.json") {
    const std::string path = dir_->path() + "/" + name;
    std::ofstream(path, std::ios::binary) << text;
    return path;
  }
  absl::Status Load(const std::string& text) {
    return BpeTokenizer::FromTokenizerJson(Write(text), TokenizerConfig()).status();
  }
  std::optional<testing::TempDir> dir_;
};

TEST_F(BpeTokenizerJsonTest, TinyTokenizerMergesByRank) {
  // "Ġ t" first, then "h e", then "Ġt he": " the" is one token, "the" two ("t" "he").
  auto tokenizer = BpeTokenizer::FromTokenizerJson(
      Write(TinyTokenizerJson({{"Ġ", "t"}, {"h", "e"}, {"Ġt", "he"}})), TokenizerConfig());
  ASSERT_THAT(tokenizer, IsOk());
  const int32_t space_t = (*tokenizer)->TokenId("Ġt").value();
  const int32_t he = (*tokenizer)->TokenId("he").value();
  const int32_t space_the = (*tokenizer)->TokenId("Ġthe").value();
  const int32_t end = (*tokenizer)->TokenId("<|end|>").value();
  EXPECT_EQ((*tokenizer)->Encode(" the").value(), std::vector<int32_t>{space_the});
  EXPECT_EQ((*tokenizer)->Encode("the<|end|> t").value(),
            (std::vector<int32_t>{'t', he, end, space_t}));
  EXPECT_EQ((*tokenizer)->Encode("").value(), std::vector<int32_t>{});
  EXPECT_EQ((*tokenizer)->vocab_size(), end + 1);
  EXPECT_FALSE((*tokenizer)->add_bos());
  EXPECT_EQ((*tokenizer)->bos_id(), -1);
  // A lone byte of a multi-byte character decodes to that byte, unreplaced.
  const std::vector<int32_t> euro = (*tokenizer)->Encode("€").value();
  ASSERT_EQ(euro.size(), 3u);
  EXPECT_EQ((*tokenizer)->Decode(std::vector<int32_t>{euro[0]}).value(), "\xe2");
}

TEST_F(BpeTokenizerJsonTest, IgnoreMergesTakesAWordOfTheVocabWhole) {
  // "Ġthe" is in the vocab but no merge makes it; "h e" splits the rest.
  std::string text = TinyTokenizerJson({{"h", "e"}});
  const std::string vocab_key = R"("vocab":{)";
  text.replace(text.find(vocab_key), vocab_key.size(), vocab_key + R"("Ġthe":300,)");
  for (const bool ignore : {false, true}) {
    SCOPED_TRACE(ignore);
    std::string variant = text;
    const std::string model_key = R"("model":{)";
    variant.replace(
        variant.find(model_key), model_key.size(),
        model_key + (ignore ? R"("ignore_merges":true,)" : R"("ignore_merges":false,)"));
    auto tokenizer = BpeTokenizer::FromTokenizerJson(Write(variant), TokenizerConfig());
    ASSERT_THAT(tokenizer, IsOk());
    const int32_t he = (*tokenizer)->TokenId("he").value();
    const std::vector<int32_t> want =
        ignore ? std::vector<int32_t>{300} : std::vector<int32_t>{' ', 't', he};
    EXPECT_EQ((*tokenizer)->Encode(" the").value(), want);
  }
}

TEST_F(BpeTokenizerJsonTest, TokenizerConfigSetsBosEosAndAddBos) {
  Write(TinyTokenizerJson({{"Ġ", "t"}}), "tokenizer.json");
  Write(R"({"add_bos_token": true, "bos_token": {"content": "<|end|>"}, "eos_token": "<|end|>"})",
        "tokenizer_config.json");
  TokenizerConfig config;
  config.vocab_size = 300;
  absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer = LoadTokenizer(dir_->path(), config);
  ASSERT_THAT(tokenizer, IsOk());
  EXPECT_TRUE((*tokenizer)->add_bos());
  EXPECT_EQ((*tokenizer)->bos_id(), 257);
  EXPECT_EQ((*tokenizer)->eos_id(), 257);
  EXPECT_EQ((*tokenizer)->vocab_size(), 300);
  EXPECT_TRUE((*tokenizer)->IsSpecial(299));  // padding past the tokens
  EXPECT_EQ((*tokenizer)->Decode(std::vector<int32_t>{299, 'a'}).value(), "a");

  Write(R"({"eos_token": "<|nope|>"})", "tokenizer_config.json");
  const absl::Status s = LoadTokenizer(dir_->path(), config).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), AllOf(HasSubstr("tokenizer_config.json"), HasSubstr("eos_token"),
                                 HasSubstr("<|nope|>")));
}

TEST_F(BpeTokenizerJsonTest, TokenizerJsonWinsOverTokenizerModel) {
  Write(TinyTokenizerJson({}), "tokenizer.json");
  Write("not a SentencePiece model", "tokenizer.model");
  absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer =
      LoadTokenizer(dir_->path(), TokenizerConfig());
  ASSERT_THAT(tokenizer, IsOk());
  EXPECT_NE(dynamic_cast<const BpeTokenizer*>(tokenizer->get()), nullptr);
}

TEST_F(BpeTokenizerJsonTest, MalformedFilesNameTheFileAndKey) {
  struct Case {
    std::string text;
    absl::StatusCode code;
    std::vector<std::string> words;
  };
  const std::string ok = TinyTokenizerJson({{"Ġ", "t"}});
  auto replace = [&](const std::string& from, const std::string& to) {
    std::string text = ok;
    const size_t at = text.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    return text.replace(at, from.size(), to);
  };
  const std::vector<Case> cases = {
      {"{\"model\": ", absl::StatusCode::kInvalidArgument, {"not valid JSON"}},
      {"[1, 2]", absl::StatusCode::kInvalidArgument, {"top level"}},
      {R"({"version": "1.0"})", absl::StatusCode::kInvalidArgument, {"\"model\"", "missing"}},
      {replace(R"("type":"BPE")", R"("type":"Frobnicate")"),
       absl::StatusCode::kInvalidArgument,
       {"model.type", "Frobnicate"}},
      {replace(R"("type":"BPE")", R"("type":"Unigram")"),
       absl::StatusCode::kUnimplemented,
       {"model.type", "Unigram"}},
      {replace(R"("Ġ t")", R"("Ġ zz")"),
       absl::StatusCode::kInvalidArgument,
       {"model.merges[0]", "zz"}},
      {replace(R"("Ġ t")", R"("Ġt")"), absl::StatusCode::kInvalidArgument, {"model.merges[0]"}},
      {replace(R"("id":257)", R"("id":-4)"),
       absl::StatusCode::kInvalidArgument,
       {"added_tokens[0].id", "-4"}},
      {replace(R"("id":257)", R"("id":99999999)"),
       absl::StatusCode::kInvalidArgument,
       {"added_tokens[0].id", "dense"}},
      // Refused before the vocabulary is sized for it (found by the tokenizer_json fuzzer:
      // the table of 2^31 strings was allocated first, then the file refused).
      {replace(R"("Ġt":256)", R"("Ġt":2147483646)"),
       absl::StatusCode::kInvalidArgument,
       {"model.vocab", "2147483646", "dense"}},
      {replace(R"("id":257)", R"("id":"x")"),
       absl::StatusCode::kInvalidArgument,
       {"added_tokens[0].id"}},
      {replace(R"("content":"<|end|>")", "\"content\":\"<|\xff|>\""),
       absl::StatusCode::kInvalidArgument,
       {"not valid JSON", "UTF-8"}},
      {replace(R"("normalizer":null)", R"("normalizer":{"type":"Precompiled"})"),
       absl::StatusCode::kUnimplemented,
       {"normalizer", "Precompiled"}},
      {replace(R"("normalizer":null)",
               R"("normalizer":{"type":"Sequence","normalizers":[{"type":"NFKC"},
                   {"type":"Nmt"}]})"),
       absl::StatusCode::kUnimplemented,
       {"normalizer.normalizers[1]", "Nmt"}},
      {replace(R"("normalizer":null)", R"("normalizer":{"type":"Sequence"})"),
       absl::StatusCode::kInvalidArgument,
       {"normalizer.normalizers", "array"}},
      {replace(R"("normalizer":null)", R"("normalizer":{"type":"Prepend"})"),
       absl::StatusCode::kInvalidArgument,
       {"normalizer.prepend"}},
      {replace(R"("normalizer":null)",
               R"("normalizer":{"type":"Replace","pattern":{"String":""},"content":"x"})"),
       absl::StatusCode::kInvalidArgument,
       {"normalizer.pattern", "empty"}},
      {replace(R"("normalizer":null)",
               R"("normalizer":{"type":"Replace","pattern":{"Regex":"(open"},"content":"x"})"),
       absl::StatusCode::kInvalidArgument,
       {"Replace", "(open"}},
      {replace(R"("normalizer":null)",
               R"("normalizer":{"type":"BertNormalizer","lowercase":"yes"})"),
       absl::StatusCode::kInvalidArgument,
       {"normalizer.lowercase", "boolean"}},
      {replace(R"("decoder":{"type":"ByteLevel"})", R"("decoder":{"type":"Metaspace"})"),
       absl::StatusCode::kUnimplemented,
       {"decoder", "Metaspace"}},
      {replace(R"("model":{)", R"("model":{"byte_fallback":true,)"),
       absl::StatusCode::kUnimplemented,
       {"model.byte_fallback"}},
      {replace(R"("model":{)", R"("model":{"dropout":0.1,)"),
       absl::StatusCode::kUnimplemented,
       {"model.dropout"}},
      {replace(R"("vocab":{)", R"("vocab":{"zz":"seven",)"),
       absl::StatusCode::kInvalidArgument,
       {"model.vocab[\"zz\"]"}},
      {replace(R"("vocab":{)", R"("vocab":{"zz":0,)"),
       absl::StatusCode::kInvalidArgument,
       {"model.vocab", "id 0"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(Escaped(c.text.substr(0, 200)));
    const absl::Status s = Load(c.text);
    EXPECT_EQ(s.code(), c.code) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr("tokenizer.json")) << s;
    for (const std::string& word : c.words)
      EXPECT_THAT(std::string(s.message()), HasSubstr(word)) << s;
  }
  // Unknown pre-tokenizers (Metaspace is SentencePiece-style BPE's, not with ByteLevel), a
  // bad regex.
  absl::Status s = Load(TinyTokenizerJson({}, "",
                                          R"({"type": "Sequence", "pretokenizers": [
                                               {"type": "Metaspace", "replacement": "_"},
                                               {"type": "ByteLevel", "use_regex": false}]})"));
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented) << s;
  EXPECT_THAT(s.message(), AllOf(HasSubstr("pre_tokenizer"), HasSubstr("Metaspace")));
  s = Load(TinyTokenizerJson({}, "", R"({"type": "WhitespaceSplit"})"));
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented) << s;
  EXPECT_THAT(s.message(), AllOf(HasSubstr("pre_tokenizer"), HasSubstr("WhitespaceSplit")));
  s = Load(TinyTokenizerJson({}, "",
                             R"({"type": "Sequence", "pretokenizers": [
                                  {"type": "Split", "pattern": {"Regex": "(unclosed"},
                                   "behavior": "Isolated", "invert": false},
                                  {"type": "ByteLevel", "use_regex": false}]})"));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), AllOf(HasSubstr("tokenizer.json"), HasSubstr("(unclosed")));
  // More ids than the model's vocab_size.
  TokenizerConfig small;
  small.vocab_size = 200;
  s = BpeTokenizer::FromTokenizerJson(Write(ok), small).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), AllOf(HasSubstr("tokenizer.json"), HasSubstr("vocab_size 200")));
  EXPECT_EQ(BpeTokenizer::FromTokenizerJson(dir_->path() + "/absent.json", small).status().code(),
            absl::StatusCode::kNotFound);
}

TEST(BpePreTokenizerTest, SplitBehaviors) {
  // Split on "-" with each behavior (Hugging Face's documented examples).
  struct Case {
    std::string behavior;
    bool invert;
    std::vector<std::string> words;
  };
  const std::vector<Case> cases = {
      {"Removed", false, {"the", "final", "countdown"}},
      {"Isolated", false, {"the", "-", "final", "-", "-", "countdown"}},
      {"MergedWithPrevious", false, {"the-", "final-", "-", "countdown"}},
      {"MergedWithNext", false, {"the", "-final", "-", "-countdown"}},
      {"Contiguous", false, {"the", "-", "final", "--", "countdown"}},
      {"Removed", true, {"-", "-", "-"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.behavior + (c.invert ? " inverted" : ""));
    // Every word becomes its own token ids; a vocab of the words shows the split.
    BpeVocab vocab;
    for (int b = 0; b < 256; ++b) {
      std::string spelled;
      internal::ByteLevelEncode(std::string(1, static_cast<char>(b)), &spelled);
      vocab.tokens.push_back(spelled);
    }
    BpePreTokenizerStep split;
    split.regex = "-";
    split.behavior =
        c.behavior == "Removed"              ? BpePreTokenizerStep::Behavior::kRemoved
        : c.behavior == "Isolated"           ? BpePreTokenizerStep::Behavior::kIsolated
        : c.behavior == "MergedWithPrevious" ? BpePreTokenizerStep::Behavior::kMergedWithPrevious
        : c.behavior == "MergedWithNext"     ? BpePreTokenizerStep::Behavior::kMergedWithNext
                                             : BpePreTokenizerStep::Behavior::kContiguous;
    split.invert = c.invert;
    BpePreTokenizerStep bytes;
    bytes.kind = BpePreTokenizerStep::Kind::kByteLevel;
    bytes.use_regex = false;
    vocab.pre_tokenizer = {split, bytes};
    // Merges that join any two letters or dashes: each word merges completely.
    std::vector<std::string> words = c.words;
    for (const std::string& word : words) {
      std::string prefix(1, word[0]);
      for (size_t i = 1; i < word.size(); ++i) {
        const std::string next = prefix + word[i];
        if (std::find(vocab.tokens.begin(), vocab.tokens.end(), next) == vocab.tokens.end()) {
          vocab.tokens.push_back(next);
          vocab.merges.push_back(prefix + " " + std::string(1, word[i]));
        }
        prefix = next;
      }
    }
    auto tokenizer = BpeTokenizer::FromVocab(vocab, 0);
    ASSERT_THAT(tokenizer, IsOk());
    std::vector<int32_t> want;
    for (const std::string& word : words) want.push_back((*tokenizer)->TokenId(word).value());
    EXPECT_EQ((*tokenizer)->Encode("the-final--countdown").value(), want);
  }
}

TEST(GgufTokenizerTest, ModelsAndKeys) {
  auto load = [](GgufWriter& w) -> absl::Status {
    const std::string bytes = w.Serialize();
    absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::FromBuffer(
        "tiny.gguf", std::span(reinterpret_cast<const std::byte*>(bytes.data()), bytes.size()));
    if (!file.ok()) return file.status();
    return LoadGgufTokenizer(**file, TokenizerConfig()).status();
  };
  std::vector<std::string> tokens;
  for (int b = 0; b < 256; ++b) {
    std::string spelled;
    internal::ByteLevelEncode(std::string(1, static_cast<char>(b)), &spelled);
    tokens.push_back(spelled);
  }
  tokens.push_back("<|end|>");
  {
    GgufWriter w;
    ASSERT_THAT(w.Add("general.architecture", GgufValue::String("llama")), IsOk());
    const absl::Status s = load(w);
    EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
    EXPECT_THAT(s.message(), HasSubstr("tokenizer.ggml.model"));
  }
  {
    GgufWriter w;
    ASSERT_THAT(w.Add("tokenizer.ggml.model", GgufValue::String("llama")), IsOk());
    const absl::Status s = load(w);
    EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
    EXPECT_THAT(s.message(), AllOf(HasSubstr("tiny.gguf"), HasSubstr("tokenizer.ggml.tokens")));
  }
  {
    GgufWriter w;
    ASSERT_THAT(w.Add("tokenizer.ggml.model", GgufValue::String("gpt2")), IsOk());
    ASSERT_THAT(w.Add("tokenizer.ggml.tokens", GgufValue::StringArray(tokens)), IsOk());
    ASSERT_THAT(
        w.Add("tokenizer.ggml.token_type", GgufValue::Int32Array(std::vector<int32_t>{1, 3})),
        IsOk());
    const absl::Status s = load(w);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(s.message(), AllOf(HasSubstr("tiny.gguf"), HasSubstr("token_type")));
  }
  {
    GgufWriter w;
    ASSERT_THAT(w.Add("tokenizer.ggml.model", GgufValue::String("gpt2")), IsOk());
    ASSERT_THAT(w.Add("tokenizer.ggml.pre", GgufValue::String("chameleon")), IsOk());
    ASSERT_THAT(w.Add("tokenizer.ggml.tokens", GgufValue::StringArray(tokens)), IsOk());
    const absl::Status s = load(w);
    EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented) << s;
    EXPECT_THAT(s.message(), AllOf(HasSubstr("tiny.gguf"), HasSubstr("chameleon")));
  }
  {
    GgufWriter w;
    ASSERT_THAT(w.Add("tokenizer.ggml.model", GgufValue::String("gpt2")), IsOk());
    ASSERT_THAT(w.Add("tokenizer.ggml.pre", GgufValue::String("llama-bpe")), IsOk());
    ASSERT_THAT(w.Add("tokenizer.ggml.tokens", GgufValue::StringArray(tokens)), IsOk());
    ASSERT_THAT(w.Add("tokenizer.ggml.bos_token_id", GgufValue::Uint32(256)), IsOk());
    ASSERT_THAT(w.Add("tokenizer.ggml.add_bos_token", GgufValue::Bool(true)), IsOk());
    EXPECT_THAT(load(w), IsOk());
    ASSERT_THAT(w.Add("tokenizer.ggml.eos_token_id", GgufValue::Uint32(9999)), IsOk());
    const absl::Status s = load(w);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(s.message(), AllOf(HasSubstr("tiny.gguf"), HasSubstr("eos_token_id")));
  }
}

TEST(BpePreTokenizerTest, NamesOfLlamaCpp) {
  for (const char* name : {"gpt2", "default", "llama-bpe", "qwen2", "smollm", "starcoder"}) {
    EXPECT_THAT(BpePreTokenizerForName(name), IsOk()) << name;
  }
  const absl::Status s = BpePreTokenizerForName("chameleon").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(s.message(), HasSubstr("chameleon"));
}

}  // namespace
}  // namespace kvcm
