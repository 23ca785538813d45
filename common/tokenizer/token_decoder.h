#pragma once
// TokenDecoder: Hugging Face `tokenizers`' decoders for SentencePiece-style BPE (a
// tokenizer.json's "decoder" when the model's tokens are spelled as text, not in the
// byte-level alphabet: Llama 2, Mistral, Gemma).
//
// A decoder turns the list of the tokens' spellings (special tokens left out) into text, each
// step rewriting the list as its Hugging Face namesake's decode_chain does; the text is the
// final list joined:
//   Replace       every match of `pattern` in each token replaced by `content` (a String
//                 pattern is literal, a Regex one as the Replace normalizer reads it)
//   ByteFallback  each run of tokens spelled "<0xNN>" (two hex digits, either case) becomes
//                 its bytes when they are valid UTF-8, else one U+FFFD per token of the run
//   Fuse          the tokens joined into one
//   Strip         up to `start` leading and `stop` trailing `content` characters removed from
//                 each token (after Fuse: from the text)
//   Metaspace     `replacement` becomes a space, except in the first token, where it is
//                 dropped (unless prepend_scheme is "never")
// A Sequence of decoders is the steps one after the other (flattened by the parser).
//
// Llama 2 and Mistral v0.1: Replace("▁", " "), ByteFallback, Fuse, Strip(" ", 1, 0), so the
// space that the normalizer put before the text is removed once, at the start of the text.
//
// Thread safety: immutable after Create; Decode may run concurrently.

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace kvcm {

struct TokenDecoderStep {
  enum class Kind { kReplace, kByteFallback, kFuse, kStrip, kMetaspace };
  Kind kind = Kind::kFuse;
  // kReplace: the pattern (literal unless pattern_is_regex) and its replacement.
  std::string pattern;
  bool pattern_is_regex = false;
  // kReplace: the replacement; kStrip: the character stripped; kMetaspace: the replacement
  // character.
  std::string content;
  // kStrip: how many characters at most to strip at each end.
  size_t start = 0;
  size_t stop = 0;
  // kMetaspace: prepend_scheme is "always" or "first" (the first token's replacements are
  // dropped, not made spaces).
  bool prepend = true;
};

class TokenDecoder {
 public:
  TokenDecoder();  // no steps: the tokens joined
  TokenDecoder(TokenDecoder&&) noexcept;
  TokenDecoder& operator=(TokenDecoder&&) noexcept;
  ~TokenDecoder();

  // INVALID_ARGUMENT naming `source` for an empty Replace pattern, a Regex that does not
  // compile, a Strip or Metaspace character that is not exactly one character, or text that
  // is not UTF-8.
  static absl::StatusOr<TokenDecoder> Create(std::vector<TokenDecoderStep> steps,
                                             std::string_view source);

  // *out = the text of `tokens` (REQUIRES: each valid UTF-8). INTERNAL when a regex fails.
  absl::Status Decode(std::vector<std::string> tokens, std::string* out) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

namespace internal {
// The byte a token spelled "<0xNN>" stands for (Hugging Face's ByteFallback: six bytes,
// "<0x", two hex digits of either case, ">"), or -1.
int ByteFallbackValue(std::string_view token);
}  // namespace internal

}  // namespace kvcm
