// The fuzz target of the tokenizer.json parser (ParseTokenizerJson) and BpeTokenizer::FromVocab
// (tests/support/fuzz_target.h): any bytes parse or are refused with INVALID_ARGUMENT or
// UNIMPLEMENTED naming the file, never a crash or an exception; a tokenizer that loads
// encodes to ids inside its vocab and decodes them back. Seeds:
// tests/common/tokenizer/fuzz/tokenizer_json/ (make_seeds.py).

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/tokenizer/bpe_tokenizer.h"
#include "tests/support/fuzz_target.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using kvcm::fuzz::Check;
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<kvcm::BpeVocab> vocab = kvcm::ParseTokenizerJson(text, "fuzz/tokenizer.json");
  if (!vocab.ok()) {
    Check(vocab.status().code() == absl::StatusCode::kInvalidArgument ||
              vocab.status().code() == absl::StatusCode::kUnimplemented,
          "a refused tokenizer.json is INVALID_ARGUMENT or UNIMPLEMENTED");
    Check(vocab.status().message().find("fuzz/tokenizer.json") != std::string_view::npos,
          "a refusal names the file");
    return 0;
  }
  bool loaded = false;
  for (const int32_t vocab_size : {0, 300}) {
    absl::StatusOr<std::unique_ptr<kvcm::BpeTokenizer>> tokenizer =
        kvcm::BpeTokenizer::FromVocab(*vocab, vocab_size);
    if (!tokenizer.ok()) continue;
    loaded = true;
    const kvcm::BpeTokenizer& t = **tokenizer;
    Check(vocab_size == 0 || t.vocab_size() == vocab_size, "the vocab size asked for");
    for (const std::string_view s :
         {std::string_view(""), std::string_view("Hello, world! it's 12345 <|end|>  \n\t x"),
          std::string_view("中文 🇺🇸 ÅΩ ١٢ <mask> kvcm"), text.substr(0, 256)}) {
      absl::StatusOr<std::vector<int32_t>> ids = t.Encode(s);
      if (!ids.ok()) continue;  // not UTF-8, or a regex past its match limit
      for (const int32_t id : *ids) Check(id >= 0 && id < t.vocab_size(), "ids inside the vocab");
      Check(t.Decode(*ids).ok(), "encoded ids decode");
    }
  }
  if (loaded) kvcm::fuzz::NoteAccepted();
  return 0;
}
