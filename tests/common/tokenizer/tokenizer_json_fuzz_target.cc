// A fuzz target for the tokenizer.json parser (ParseTokenizerJson) and BpeTokenizer::FromVocab:
// any bytes must parse or be refused with a status, never crash or throw; a tokenizer that
// loads must encode to ids inside its vocab and decode them back.
//
// Built into tokenizer_json_fuzz_test (seeded mutations, tokenizer_json_fuzz_test.cc).

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "common/tokenizer/bpe_tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<kvcm::BpeVocab> vocab = kvcm::ParseTokenizerJson(text, "fuzz/tokenizer.json");
  if (!vocab.ok()) return 0;
  for (const int32_t vocab_size : {0, 300}) {
    absl::StatusOr<std::unique_ptr<kvcm::BpeTokenizer>> tokenizer =
        kvcm::BpeTokenizer::FromVocab(*vocab, vocab_size);
    if (!tokenizer.ok()) continue;
    const kvcm::BpeTokenizer& t = **tokenizer;
    if (vocab_size > 0 && t.vocab_size() != vocab_size) std::abort();
    for (const std::string_view s :
         {std::string_view(""), std::string_view("Hello, world! it's 12345 <|end|>  \n\t x"),
          std::string_view("中文 🇺🇸 ÅΩ ١٢ <mask> kvcm"), text.substr(0, 256)}) {
      absl::StatusOr<std::vector<int32_t>> ids = t.Encode(s);
      if (!ids.ok()) continue;  // not UTF-8, or a regex past its match limit
      for (const int32_t id : *ids) {
        if (id < 0 || id >= t.vocab_size()) std::abort();
      }
      if (!t.Decode(*ids).ok()) std::abort();
    }
  }
  return 0;
}
