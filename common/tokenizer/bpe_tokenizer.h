#pragma once
// BpeTokenizer: BPE with the ids Hugging Face `tokenizers` gives for the same tokenizer, in
// two kinds:
//   - byte-level BPE (the GPT-2 family: GPT-2, Llama 3, Qwen2, SmolLM, ...): tokens are
//     spelled in the byte-level alphabet and words are merged from their bytes;
//   - SentencePiece-style BPE (Llama 2, Mistral, Gemma: BpeVocab::byte_level false): tokens
//     are spelled as text ("▁the") and words are merged from their Unicode characters; with
//     byte_fallback a character without a token becomes the tokens "<0xNN>" of its UTF-8
//     bytes.
//
// It is built from a BpeVocab, a plain description that both sources fill: a Hugging Face
// tokenizer.json (ParseTokenizerJson, FromTokenizerJson) and a GGUF file's tokenizer.ggml.*
// keys (tokens, merges, token_type, pre, bos/eos ids, add_bos_token; byte-level only).
//
// Encode, as Hugging Face's `encode(text, add_special_tokens=False)` (no BOS; add_bos()
// says whether prompts get one):
//   1. Added tokens are split out of the text first (leftmost, then longest match; those
//      with normalized=false first, then the others in what remains), honouring their
//      single_word, lstrip and rstrip flags. `<|im_start|>` typed in user text IS the special
//      token, as Hugging Face's default (encode_special_tokens=false) has it.
//   2. Each remaining piece goes through the pre-tokenizer steps (regex splits through PCRE2
//      with JIT, UTF-8 and Unicode properties; `\s` means Unicode White_Space as in
//      Oniguruma, which Hugging Face uses; Metaspace), then, for byte-level BPE, the
//      byte-level alphabet.
//   3. Each pre-token is merged by rank (a merge's rank is its index; with ignore_merges a
//      pre-token that is itself in the vocabulary is taken whole, as Llama 3's file asks).
//      Results for words seen before come from a bounded cache.
// Encode fails with INVALID_ARGUMENT (naming the byte offset) when `text` is not UTF-8.
//
// Decode, byte-level: maps the byte-level alphabet back to raw bytes and returns them as they
// are: invalid or incomplete UTF-8 is NOT replaced with U+FFFD (the router streams one token
// at a time and holds back incomplete UTF-8 itself). SentencePiece-style: the tokens'
// spellings through the tokenizer.json's decoder (common/tokenizer/token_decoder.h), exactly
// as Hugging Face's decode(ids, skip_special_tokens=True): its ByteFallback step DOES make
// each byte of a run of "<0xNN>" tokens that is not valid UTF-8 a U+FFFD (IncrementalDecoder
// holds a trailing U+FFFD back until a later token completes the character). Either way,
// special tokens and ids without a token (a padded vocab_size) decode to nothing; non-special
// added tokens decode to their content.
//
// Thread safety: after construction all methods are const and safe to call concurrently
// (the word cache is guarded by a mutex).

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "common/tokenizer/normalizer.h"
#include "common/tokenizer/token_decoder.h"
#include "common/tokenizer/tokenizer.h"

namespace kvcm {

// One step of a pre-tokenizer pipeline (Hugging Face's pre_tokenizers).
struct BpePreTokenizerStep {
  enum class Kind {
    kSplit,      // Split / Digits: split each piece by `regex`
    kByteLevel,  // ByteLevel: the byte-level alphabet (must be the last step)
    kMetaspace,  // Metaspace (SentencePiece-style BPE only): spaces become `replacement`
  };
  // Metaspace: where `replacement` is put before a piece that does not start with it: every
  // piece, only the piece at the start of the text (not after an added token), or none.
  enum class PrependScheme { kAlways, kFirst, kNever };
  // What happens to the regex's matches (Hugging Face's SplitDelimiterBehavior).
  enum class Behavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

  Kind kind = Kind::kSplit;
  // kSplit: a PCRE2 pattern (UTF, UCP). Digits(individual_digits) is "\p{N}" with kIsolated,
  // Digits() "\p{N}" with kContiguous.
  std::string regex;
  Behavior behavior = Behavior::kIsolated;
  bool invert = false;  // kSplit: the matches are what lies between the regex's matches
  // kByteLevel: prepend a space to a piece that does not start with one; split with GPT-2's
  // regex first.
  bool add_prefix_space = false;
  bool use_regex = true;
  // kMetaspace: ' ' (U+0020 only) becomes `replacement` (one character), which is then put
  // before the piece as prepend_scheme says; with `split`, the piece is split before every
  // `replacement` (Hugging Face's MergedWithNext).
  std::string replacement = "\u2581";
  PrependScheme prepend_scheme = PrependScheme::kAlways;
  bool split = true;
};

// GPT-2's pre-tokenizer regex (Hugging Face's ByteLevel(use_regex=true)).
inline constexpr std::string_view kGpt2PreTokenizerRegex =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// The pre-tokenizer of llama.cpp's `tokenizer.ggml.pre` name, as the model's tokenizer.json
// spells it:
//   "gpt2", "default", "mpt", "olmo", "jais"          ByteLevel(use_regex=true)
//   "llama-bpe", "llama3", "llama-v3", "smaug-bpe", "dbrx"
//                                                     Split(Llama 3's regex), ByteLevel
//   "qwen2", "deepseek-r1-qwen", "megrez"             Split(Qwen2's regex), ByteLevel
//   "smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva"
//                                                     Digits(individual), ByteLevel(regex)
// ("default" is taken as GPT-2's; Qwen2's NFC normalizer is not applied, as llama.cpp does
// not.) UNIMPLEMENTED naming any other name.
absl::StatusOr<std::vector<BpePreTokenizerStep>> BpePreTokenizerForName(std::string_view pre);

struct BpeAddedToken {
  std::string content;  // raw text (not byte-level encoded)
  int32_t id = -1;
  bool special = false;      // decodes to nothing; IsSpecial
  bool lstrip = false;       // also takes the whitespace on its left
  bool rstrip = false;       // also takes the whitespace on its right
  bool single_word = false;  // only where no word character touches it
  bool normalized = false;   // matched after the normalizer, in a second pass
};

struct BpeVocab {
  // Byte-level-encoded strings (tokenizer.json's model.vocab, GGUF's tokenizer.ggml.tokens),
  // or, when !byte_level, the text itself (valid UTF-8); id = index; "" for an id without a
  // token.
  std::vector<std::string> tokens;
  // "a b" (GGUF's tokenizer.ggml.merges, tokenizer.json's legacy spelling); rank = index.
  // Tokens in merges never contain a space.
  std::vector<std::string> merges;
  // false: SentencePiece-style BPE (a tokenizer.json without the ByteLevel pre-tokenizer):
  // tokens are text, words are merged from Unicode characters, `pre_tokenizer` is used as it
  // is (empty: none; Split and Metaspace steps, no ByteLevel) and `decoder` makes the text.
  bool byte_level = true;
  // !byte_level: a character without a token becomes the tokens "<0xNN>" (upper-case hex) of
  // its UTF-8 bytes, or, when one of them is missing, unk as below.
  bool byte_fallback = false;
  // !byte_level: the tokenizer.json's decoder (token_decoder.h); empty: the tokens joined.
  std::vector<TokenDecoderStep> decoder;
  // Special and other added tokens (GGUF: token_type 3 = control is special, 4 =
  // user-defined is not). Their ids may lie past `tokens`.
  std::vector<BpeAddedToken> added_tokens;
  // The pre-tokenizer: `pre_tokenizer` when not empty (or when !byte_level), else
  // BpePreTokenizerForName(pre).
  std::string pre = "gpt2";
  std::vector<BpePreTokenizerStep> pre_tokenizer;
  bool ignore_merges = false;
  // What text goes through before the added tokens marked normalized and the pre-tokenizer
  // (Hugging Face's normalizers, common/tokenizer/normalizer.h), in order; empty: nothing.
  std::vector<NormalizerStep> normalizers;
  // A byte (SentencePiece-style: a character, after byte_fallback) without a token becomes
  // unk_id (-1: it is dropped, as Hugging Face does); with fuse_unk consecutive ones become
  // one. As in Hugging Face, an unk waits for the next character that has a token of its own,
  // so byte-fallback tokens of the characters between come before it (and, with fuse_unk,
  // unks on either side of them fuse).
  int32_t unk_id = -1;
  bool fuse_unk = false;
  int32_t bos_id = -1;  // -1: none
  int32_t eos_id = -1;  // -1: none
  bool add_bos = false;
  // What errors name (the file the vocab came from).
  std::string source = "BPE vocab";
};

// A Hugging Face tokenizer.json's text as a BpeVocab (bos/eos from a TemplateProcessing
// post-processor whose single template starts with a special token, which also sets
// add_bos). Understood: model BPE (vocab; merges as "a b" strings or as pairs;
// ignore_merges, unk_token, fuse_unk, byte_fallback); normalizer null, NFC, NFD, NFKC, NFKD,
// Lowercase, Strip, StripAccents, Prepend, Replace, BertNormalizer and Sequences of them
// (normalizer.h); added_tokens with their flags; post_processor ByteLevel,
// TemplateProcessing, Sequence of them. Two kinds of pre-tokenizer and decoder:
//   - byte-level: pre_tokenizer ByteLevel, Split (String or Regex pattern), Digits, Sequence
//     of them, ByteLevel last; decoder ByteLevel (or a Sequence holding only it);
//   - SentencePiece-style (no ByteLevel pre-tokenizer: Llama 2, Mistral, Gemma):
//     pre_tokenizer null, Metaspace (replacement, prepend_scheme, split, the legacy
//     add_prefix_space read as tokenizers 0.23 reads it), Split, Digits, Sequence of them;
//     decoder Replace, ByteFallback, Fuse, Strip, Metaspace and Sequences of them
//     (token_decoder.h).
// truncation and padding are ignored (callers truncate).
// Errors name `file_name` and the key: INVALID_ARGUMENT for bad JSON (including bad UTF-8),
// a missing or mistyped key, a merge naming an unknown token, a negative, duplicate or
// too sparse id, what tokenizers itself refuses (a Metaspace replacement that is not one
// character, add_prefix_space false with a prepend_scheme other than "never");
// UNIMPLEMENTED for a model, normalizer, pre-tokenizer, decoder or option that is understood
// by Hugging Face but not here (dropout, subword prefixes/suffixes, byte_fallback or
// Metaspace with the ByteLevel pre-tokenizer, a ByteLevel decoder without it, the
// Precompiled and Nmt normalizers, the WordPiece, CTC and BPEDecoder decoders, ...), naming
// it.
absl::StatusOr<BpeVocab> ParseTokenizerJson(std::string_view json_text, std::string_view file_name);

class BpeTokenizer final : public Tokenizer {
 public:
  // `vocab_size`: the model's (ids are in [0, vocab_size); <= 0 takes the vocab's own size).
  // INVALID_ARGUMENT naming vocab.source and the offending entry: an id >= vocab_size, a
  // merge naming a token that is not in the vocab (or whose result is not), a bad regex,
  // a byte-level pre-tokenizer without ByteLevel last, a SentencePiece-style token that is
  // not UTF-8; UNIMPLEMENTED for an unknown `pre` name, Metaspace or byte_fallback in
  // byte-level BPE, ByteLevel in SentencePiece-style BPE.
  static absl::StatusOr<std::unique_ptr<BpeTokenizer>> FromVocab(BpeVocab vocab,
                                                                 int32_t vocab_size);

  // Reads the tokenizer.json at `path` (NOT_FOUND when missing) and, when it exists, the
  // tokenizer_config.json beside it: add_bos_token (bool), bos_token and eos_token (a string
  // or an object with "content", naming a token of the vocab) override what tokenizer.json
  // says. Otherwise bos/eos come from tokenizer.json's post-processor, else from `config`
  // (bos_token_id, the first eos_token_ids). config.vocab_size as in FromVocab.
  static absl::StatusOr<std::unique_ptr<BpeTokenizer>> FromTokenizerJson(
      const std::string& path, const TokenizerConfig& config);

  ~BpeTokenizer() override;

  absl::StatusOr<std::vector<int32_t>> Encode(std::string_view text) const override;
  absl::StatusOr<std::string> Decode(std::span<const int32_t> ids) const override;
  int32_t bos_id() const override;
  int32_t eos_id() const override;
  int32_t vocab_size() const override;
  bool add_bos() const override;
  bool IsSpecial(int32_t id) const override;
  // An added token by its content (`<|im_end|>`), else a vocab token by its spelling
  // ("Ġhello" byte-level, "▁hello" SentencePiece-style).
  std::optional<int32_t> TokenId(std::string_view piece) const override;

  // Encode without the word cache (the benchmark compares both).
  absl::StatusOr<std::vector<int32_t>> EncodeUncached(std::string_view text) const;

  struct Impl;

 private:
  explicit BpeTokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvcm
