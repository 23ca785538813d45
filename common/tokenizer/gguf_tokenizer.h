#pragma once
// LoadGgufTokenizer: the tokenizer a GGUF file carries in its tokenizer.ggml.* keys.
//
//   tokenizer.ggml.model "gpt2"   BpeTokenizer from tokens (id = index), merges ("a b", rank =
//                                 index), token_type (3 = control: a special added token;
//                                 4 = user-defined: an added token that is not special),
//                                 pre (llama.cpp's pre-tokenizer name, "default" when
//                                 absent; see BpePreTokenizerForName), bos_token_id,
//                                 eos_token_id, add_bos_token (false when absent).
//   "llama"                       SentencePieceTokenizer (Llama 1/2, Mistral, TinyLlama): the
//                                 BPE model with byte fallback rebuilt as a ModelProto from
//                                 tokens, scores (0 when absent), token_type (SentencePiece's
//                                 piece types, 1 normal .. 6 byte; normal when absent),
//                                 unknown/bos/eos_token_id and add_space_prefix (true when
//                                 absent), with the identity normalizer, as llama.cpp reads it.
//   anything else                 UNIMPLEMENTED naming it.
//
// config.vocab_size is the model's, as in BpeTokenizer::FromVocab; config.bos_token_id and
// the first eos_token_ids stand in for ids the file does not give.
// Errors name the file and the key: NOT_FOUND for a missing tokenizer.ggml.model or tokens,
// INVALID_ARGUMENT for a value of the wrong type, a token_type array of another length, an
// id out of range, and what FromVocab refuses.
//
// Thread safety: reads `file` only; the result is independent of it.

#include <memory>

#include "absl/status/statusor.h"
#include "common/tokenizer/tokenizer.h"

namespace kvcm {

class GgufFile;

absl::StatusOr<std::unique_ptr<Tokenizer>> LoadGgufTokenizer(const GgufFile& file,
                                                             const TokenizerConfig& config);

}  // namespace kvcm
