#pragma once
// Normalizer: Hugging Face `tokenizers`' normalizers (a tokenizer.json's "normalizer"), the
// text transformations applied to each piece of text between added tokens before the
// pre-tokenizer (see bpe_tokenizer.h, Encode).
//
// Each step does what its Hugging Face namesake does to a NormalizedString, character by
// character where Hugging Face works so:
//   NFC, NFD, NFKC, NFKD  Unicode normalization, through ICU (as the NFC that came first)
//   Lowercase             each character's full lowercase mapping (Rust's char::to_lowercase:
//                         "İ" -> "i̇"), one character at a time, so no final-sigma rule
//   Strip                 White_Space removed at the left and/or right end
//   StripAccents          marks (Mn, Mc, Me) removed, no decomposition (pair it with NFD)
//   Prepend               `content` put before a piece that is not empty
//   Replace               every match of `pattern` replaced by `content`, left to right; a
//                         String pattern is literal, a Regex one is PCRE2 (UTF, UCP) with
//                         Oniguruma's \s; an empty match inserts `content` too, except one
//                         where the previous match ended (Oniguruma's find_iter)
//   BertNormalizer        clean_text (NUL, U+FFFD and Cc, Cf, Co, Cs characters but \t \n \r
//                         removed, whitespace made a space), handle_chinese_chars (spaces
//                         around CJK ideographs), strip_accents (NFD, then the nonspacing
//                         marks, Mn alone, removed; default: `lowercase`), lowercase
// A Sequence of normalizers is the steps one after the other (flattened by the parser).
//
// Thread safety: immutable after Create; Apply may run concurrently.

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace kvcm {

struct NormalizerStep {
  enum class Kind {
    kNfc,
    kNfd,
    kNfkc,
    kNfkd,
    kLowercase,
    kStrip,
    kStripAccents,
    kPrepend,
    kReplace,
    kBert
  };
  Kind kind = Kind::kNfc;
  // kStrip: which ends.
  bool strip_left = true;
  bool strip_right = true;
  // kPrepend: the prefix; kReplace: the replacement.
  std::string content;
  // kReplace: the pattern, a literal string unless pattern_is_regex.
  std::string pattern;
  bool pattern_is_regex = false;
  // kBert: Hugging Face's BertNormalizer options (strip_accents: 1 yes, 0 no, -1 = lowercase).
  bool clean_text = true;
  bool handle_chinese_chars = true;
  int strip_accents = -1;
  bool lowercase = true;
};

class Normalizer {
 public:
  Normalizer();  // no steps: Apply copies the text
  Normalizer(Normalizer&&) noexcept;
  Normalizer& operator=(Normalizer&&) noexcept;
  ~Normalizer();

  // INVALID_ARGUMENT naming `source` for an empty Replace pattern, a Regex pattern that does
  // not compile, or a content or pattern that is not valid UTF-8.
  static absl::StatusOr<Normalizer> Create(std::vector<NormalizerStep> steps,
                                           std::string_view source);

  bool empty() const;
  // *out = the steps applied to `text`. REQUIRES: text is valid UTF-8 (the output is too).
  // INTERNAL when ICU or PCRE2 fails.
  absl::Status Apply(std::string_view text, std::string* out) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

namespace internal {
// `pattern` with \s and \S (outside \Q..\E) rewritten as \p{White_Space} and its negation:
// Oniguruma's \s, which Hugging Face's regexes use, whatever PCRE2's UCP version says.
std::string OnigurumaWhitespace(std::string_view pattern);
}  // namespace internal

}  // namespace kvcm
