#pragma once
// Text matching for BpeTokenizer (common/tokenizer/bpe_tokenizer.cc): a pre-tokenizer
// regex through PCRE2 (JIT, per-thread match state), the leftmost-longest matcher of added
// tokens, and UTF-8 helpers. Internal to common/tokenizer.
//
// Thread safety: Regex::Find and AddedTokenMatcher::Find are const and may be called
// concurrently (each thread has its own PCRE2 match data); Add and Finish before any Find.

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace kvcm::internal {

// A pre-tokenizer regex.
class Regex {
 public:
  // Compiles `pattern` (Oniguruma's \s rewritten for PCRE2); INVALID_ARGUMENT naming
  // `source` and the offset when it does not compile.
  static absl::StatusOr<std::unique_ptr<Regex>> Compile(std::string_view pattern,
                                                        std::string_view source);
  ~Regex() { pcre2_code_free(code_); }
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // The first match in subject[start..]: 1 with *begin/*end set, 0 when there is none, an
  // error otherwise. `subject` must be valid UTF-8 (checked once by Encode).
  int Find(std::string_view subject, size_t start, size_t* begin, size_t* end) const;

 private:
  Regex(pcre2_code* code, bool jit) : code_(code), jit_(jit) {}
  pcre2_code* code_;
  bool jit_;
};

// INTERNAL naming PCRE2's message for a failed match.
absl::Status RegexError(int rc);

// UTF-8 helpers, inline: the tokenizer calls them once per character.

// The code point at text[i] (valid UTF-8) and its length.
inline uint32_t DecodeAt(std::string_view text, size_t i, size_t* len) {
  const auto c = static_cast<unsigned char>(text[i]);
  if (c < 0x80) {
    *len = 1;
    return c;
  }
  size_t n = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : 2;
  if (i + n > text.size()) n = text.size() - i;
  uint32_t cp = c & (n == 2 ? 0x1F : n == 3 ? 0x0F : 0x07);
  for (size_t k = 1; k < n; ++k) cp = (cp << 6) | (static_cast<unsigned char>(text[i + k]) & 0x3F);
  *len = n;
  return cp;
}

// The start of the code point that ends at `end` (exclusive).
inline size_t PreviousStart(std::string_view text, size_t end) {
  size_t i = end - 1;
  while (i > 0 && (static_cast<unsigned char>(text[i]) & 0xC0) == 0x80) --i;
  return i;
}

// Unicode White_Space (Rust's char::is_whitespace, which Hugging Face's lstrip/rstrip use).
inline bool IsWhiteSpace(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F ||
         cp == 0x205F || cp == 0x3000;
}

// Added tokens matched leftmost-longest (Hugging Face uses an Aho-Corasick automaton with
// that semantics). Candidates are looked up by their first byte and length: a hash lookup
// per distinct length, so thousands of tokens sharing a first byte (Gemma's <unused...>)
// cost little.
class AddedTokenMatcher {
 public:
  AddedTokenMatcher() = default;
  // Movable (the views stay valid: a moved vector keeps its elements), not copyable.
  AddedTokenMatcher(AddedTokenMatcher&&) = default;
  AddedTokenMatcher& operator=(AddedTokenMatcher&&) = default;
  AddedTokenMatcher(const AddedTokenMatcher&) = delete;
  AddedTokenMatcher& operator=(const AddedTokenMatcher&) = delete;

  void Add(int index, const std::string& content) {
    if (content.empty()) return;
    contents_.push_back({index, content});
  }
  void Finish();
  bool empty() const { return contents_.empty(); }

  // The leftmost-longest match at or after `from`: true with *begin, *end and *index set.
  // Of equal contents, the one added first.
  bool Find(std::string_view text, size_t from, size_t* begin, size_t* end, int* index) const;

 private:
  std::vector<std::pair<int, std::string>> contents_;
  absl::flat_hash_map<std::string_view, int> index_of_;  // views into contents_
  // The distinct lengths of the contents starting with each byte, longest first.
  std::array<std::vector<size_t>, 256> lengths_by_first_byte_;
};

}  // namespace kvcm::internal
