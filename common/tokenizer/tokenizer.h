#pragma once
// Tokenizer: text <-> token ids for a model folder.
//
//   BpeTokenizer            the folder's `tokenizer.json` (Hugging Face fast tokenizer,
//                           byte-level BPE: GPT-2, Llama 3, Qwen2, SmolLM, ...; or
//                           SentencePiece-style BPE with byte_fallback: Llama 2, Mistral,
//                           Gemma); see common/tokenizer/bpe_tokenizer.h.
//   SentencePieceTokenizer  the folder's `tokenizer.model` (Llama 1/2, Mistral), through
//                           libsentencepiece.
//   ByteTokenizer           no tokenizer file: one token per UTF-8 byte (the tiny test
//                           models). Ids:
//                             0                      <unk>/<pad> (never produced by Encode)
//                             1                      BOS
//                             2                      EOS
//                             3 + b                  byte b, b = 0 .. 255  (so 3 .. 258)
//                             259 .. vocab_size - 1  unused; decode to nothing
//                           This is the Llama SentencePiece layout (<unk>, <s>, </s>, then
//                           the byte-fallback pieces <0x00> .. <0xFF>), so a model needs
//                           vocab_size >= 259.
//
// Encode never adds BOS; callers prepend bos_id() when add_bos() says prompts get one.
// Decode skips special ids (IsSpecial: BOS, EOS, <unk>, control and unused ids and, for
// SentencePiece, ids past the model's pieces that a padded vocab_size allows); an id
// outside [0, vocab_size) is INVALID_ARGUMENT.
//
// Thread safety: all methods are const and safe to call concurrently.

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace kvcm {

// What a model's config.json says about its tokenizer (the executor reads it with the rest
// of the model's config; the router with the model's metadata).
struct TokenizerConfig {
  int32_t vocab_size = 0;
  int32_t bos_token_id = -1;           // -1: not given
  std::vector<int32_t> eos_token_ids;  // empty: not given
};

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;

  // Token ids of `text`, without BOS.
  virtual absl::StatusOr<std::vector<int32_t>> Encode(std::string_view text) const = 0;
  // The text of `ids`; special ids contribute nothing.
  virtual absl::StatusOr<std::string> Decode(std::span<const int32_t> ids) const = 0;

  virtual int32_t bos_id() const = 0;  // -1 when there is none
  virtual int32_t eos_id() const = 0;  // -1 when there is none
  // Ids are in [0, vocab_size()); equals the model's vocab_size.
  virtual int32_t vocab_size() const = 0;
  // Whether prompts start with bos_id() (SmolLM2 says no, Llama 2 and 3 yes).
  virtual bool add_bos() const = 0;
  // Whether Decode skips `id` (a special, control or unused id); false outside the vocab.
  virtual bool IsSpecial(int32_t id) const = 0;
  // The id of the token spelled `piece` (`<|im_end|>`, `</s>`), nullopt when there is none.
  virtual std::optional<int32_t> TokenId(std::string_view piece) const = 0;
};

class ByteTokenizer final : public Tokenizer {
 public:
  static constexpr int32_t kUnkId = 0;
  static constexpr int32_t kBosId = 1;
  static constexpr int32_t kEosId = 2;
  static constexpr int32_t kByteOffset = 3;  // byte b is id b + kByteOffset
  static constexpr int32_t kMinVocabSize = kByteOffset + 256;

  // INVALID_ARGUMENT when vocab_size < kMinVocabSize.
  static absl::StatusOr<std::unique_ptr<ByteTokenizer>> Create(int32_t vocab_size);

  absl::StatusOr<std::vector<int32_t>> Encode(std::string_view text) const override;
  absl::StatusOr<std::string> Decode(std::span<const int32_t> ids) const override;
  int32_t bos_id() const override { return kBosId; }
  int32_t eos_id() const override { return kEosId; }
  int32_t vocab_size() const override { return vocab_size_; }
  bool add_bos() const override { return true; }
  bool IsSpecial(int32_t id) const override;
  // "<unk>", "<s>", "</s>" and "<0xNN>" (NN: two upper-case hex digits), as SentencePiece
  // spells them.
  std::optional<int32_t> TokenId(std::string_view piece) const override;

 private:
  explicit ByteTokenizer(int32_t vocab_size) : vocab_size_(vocab_size) {}
  int32_t vocab_size_;
};

namespace internal {
class AddedTokenMatcher;
class SentencePieceBackend;
}  // namespace internal

class SentencePieceTokenizer final : public Tokenizer {
 public:
  // Loads `path` (a tokenizer.model). NOT_FOUND when the file is missing; INVALID_ARGUMENT
  // naming the path when the library rejects it or when it has more pieces than
  // `vocab_size` (the model's), which would produce ids the model cannot embed.
  static absl::StatusOr<std::unique_ptr<SentencePieceTokenizer>> Load(const std::string& path,
                                                                      int32_t vocab_size);
  // The same from a serialized ModelProto (built from a GGUF file's arrays, for one);
  // `source` names it in errors.
  static absl::StatusOr<std::unique_ptr<SentencePieceTokenizer>> FromModelProto(
      std::string_view model_proto, int32_t vocab_size, const std::string& source);
  ~SentencePieceTokenizer() override;

  absl::StatusOr<std::vector<int32_t>> Encode(std::string_view text) const override;
  absl::StatusOr<std::string> Decode(std::span<const int32_t> ids) const override;
  int32_t bos_id() const override;
  int32_t eos_id() const override;
  int32_t vocab_size() const override { return vocab_size_; }
  bool add_bos() const override { return true; }
  // Control and unknown pieces, and ids past the model's pieces.
  bool IsSpecial(int32_t id) const override;
  std::optional<int32_t> TokenId(std::string_view piece) const override;

 private:
  SentencePieceTokenizer(std::unique_ptr<internal::SentencePieceBackend> backend,
                         int32_t vocab_size);
  std::unique_ptr<internal::SentencePieceBackend> backend_;
  // The control and unknown pieces ("<s>", "<start_of_turn>", ...), matched whole in the text
  // before SentencePiece sees it, as Hugging Face's special tokens and llama.cpp's are.
  std::unique_ptr<internal::AddedTokenMatcher> specials_;
  int32_t vocab_size_;
};

// The tokenizer of the model in `folder`: BpeTokenizer::FromTokenizerJson when
// `tokenizer.json` exists (it wins over a `tokenizer.model` beside it, as Hugging Face's
// AutoTokenizer with use_fast=True picks the fast tokenizer, SentencePiece-style ones
// included; its errors, UNIMPLEMENTED for a tokenizer.json holding what BpeTokenizer does not
// implement included, are returned, never hidden by a fallback); else SentencePieceTokenizer when
// `tokenizer.model` exists; otherwise ByteTokenizer, for which config.json's bos_token_id must be
// absent or 1 and its eos_token_id absent or 2 (INVALID_ARGUMENT naming the key otherwise, since a
// config that expects other ids was made for another tokenizer).
absl::StatusOr<std::unique_ptr<Tokenizer>> LoadTokenizer(const std::string& folder,
                                                         const TokenizerConfig& config);

}  // namespace kvcm
