#include "common/tokenizer/gguf_tokenizer.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "common/gguf/gguf_file.h"
#include "common/tokenizer/bpe_tokenizer.h"

namespace kvcm {
namespace {

// An optional integer key: `fallback` when absent.
absl::StatusOr<int64_t> OptionalInt(const GgufFile& file, const char* key, int64_t fallback) {
  if (!file.Has(key)) return fallback;
  return file.GetInt(key);
}

// Protocol-buffer wire format, as much of it as a ModelProto needs.
void PutVarint(std::string* out, uint64_t v) {
  while (v >= 0x80) {
    out->push_back(static_cast<char>((v & 0x7F) | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}
void PutTag(std::string* out, uint32_t field, uint32_t wire_type) {
  PutVarint(out, (uint64_t{field} << 3) | wire_type);
}
void PutBytes(std::string* out, uint32_t field, std::string_view bytes) {
  PutTag(out, field, 2);
  PutVarint(out, bytes.size());
  out->append(bytes);
}
void PutInt(std::string* out, uint32_t field, int64_t v) {
  PutTag(out, field, 0);
  PutVarint(out, static_cast<uint64_t>(v));  // negative ids as ten-byte varints, as protobuf
}
void PutFloat(std::string* out, uint32_t field, float v) {
  PutTag(out, field, 5);
  char bytes[4];
  std::memcpy(bytes, &v, 4);  // little-endian, as x86 and protobuf are
  out->append(bytes, 4);
}

// The SentencePiece model llama.cpp's conversion took apart (tokenizer.model of Llama 1/2,
// Mistral, TinyLlama): BPE, byte fallback, pieces with their scores and types, and the
// identity normalizer with a dummy prefix (tokenizer.ggml.add_space_prefix) that only
// escapes whitespace. Field numbers are sentencepiece_model.proto's.
std::string SentencePieceModelProto(const std::vector<std::string>& tokens,
                                    const std::vector<double>& scores,
                                    const std::vector<int64_t>& types, int64_t unk_id,
                                    int64_t bos_id, int64_t eos_id, bool add_space_prefix) {
  std::string model;
  for (size_t id = 0; id < tokens.size(); ++id) {
    std::string piece;
    // SentencePiece matches user-defined pieces in the text after it escaped spaces as
    // U+2581; llama.cpp's gemma3 files spell the whitespace runs among them ("  ", "   ", ...)
    // with plain spaces, as Hugging Face's added tokens do.
    PutBytes(
        &piece, 1,
        types[id] == 4 ? absl::StrReplaceAll(tokens[id], {{" ", "\xe2\x96\x81"}}) : tokens[id]);
    PutFloat(&piece, 2, static_cast<float>(scores[id]));
    PutInt(&piece, 3, types[id]);
    PutBytes(&model, 1, piece);  // ModelProto.pieces
  }
  std::string trainer;
  PutInt(&trainer, 3, 2);                                    // model_type BPE
  PutInt(&trainer, 4, static_cast<int64_t>(tokens.size()));  // vocab_size
  PutInt(&trainer, 35, 1);                                   // byte_fallback
  PutInt(&trainer, 40, unk_id);
  PutInt(&trainer, 41, bos_id);
  PutInt(&trainer, 42, eos_id);
  PutInt(&trainer, 43, -1);  // pad_id: none
  // The pieces SentencePiece looks the special ids up by (bos_id() is PieceToId(bos_piece));
  // its defaults "<unk>", "<s>" and "</s>" are Llama's, Gemma's are "<unk>", "<bos>", "<eos>".
  const std::pair<uint32_t, int64_t> special_pieces[] = {{45, unk_id}, {46, bos_id}, {47, eos_id}};
  for (const auto& [field, id] : special_pieces) {
    if (id >= 0) PutBytes(&trainer, field, tokens[static_cast<size_t>(id)]);
  }
  PutBytes(&model, 2, trainer);
  std::string normalizer;
  PutBytes(&normalizer, 1, "identity");
  PutInt(&normalizer, 3, add_space_prefix ? 1 : 0);  // add_dummy_prefix
  PutInt(&normalizer, 4, 0);                         // remove_extra_whitespaces
  PutInt(&normalizer, 5, 1);                         // escape_whitespaces
  PutBytes(&model, 3, normalizer);
  return model;
}

// tokenizer.ggml.model "llama": a SentencePiece model rebuilt from the file's arrays.
absl::StatusOr<std::unique_ptr<Tokenizer>> LoadGgufSentencePiece(const GgufFile& file,
                                                                 const TokenizerConfig& config) {
  absl::StatusOr<std::vector<std::string>> tokens = file.GetStringArray("tokenizer.ggml.tokens");
  if (!tokens.ok()) return tokens.status();
  const size_t n = tokens->size();
  if (n > static_cast<size_t>(config.vocab_size)) {
    return absl::InvalidArgumentError(absl::StrCat(file.name(), ": tokenizer.ggml.tokens has ", n,
                                                   " tokens, more than the model's vocab_size ",
                                                   config.vocab_size));
  }
  std::vector<double> scores(n, 0.0);
  if (file.Has("tokenizer.ggml.scores")) {
    absl::StatusOr<std::vector<double>> read = file.GetFloatArray("tokenizer.ggml.scores");
    if (!read.ok()) return read.status();
    scores = *std::move(read);
  }
  std::vector<int64_t> types(n, 1);  // normal
  if (file.Has("tokenizer.ggml.token_type")) {
    absl::StatusOr<std::vector<int64_t>> read = file.GetIntArray("tokenizer.ggml.token_type");
    if (!read.ok()) return read.status();
    types = *std::move(read);
  }
  for (const auto& [key, size] :
       {std::pair<const char*, size_t>{"tokenizer.ggml.scores", scores.size()},
        {"tokenizer.ggml.token_type", types.size()}}) {
    if (size != n) {
      return absl::InvalidArgumentError(
          absl::StrCat(file.name(), ": ", key, " has ", size, " entries for ", n, " tokens"));
    }
  }
  for (size_t id = 0; id < n; ++id) {
    if (types[id] < 1 || types[id] > 6) {
      return absl::InvalidArgumentError(
          absl::StrCat(file.name(), ": tokenizer.ggml.token_type[", id, "] = ", types[id],
                       " is not a SentencePiece piece type (1 normal .. 6 byte)"));
    }
  }
  const int64_t fallback_eos = config.eos_token_ids.empty() ? -1 : config.eos_token_ids[0];
  int64_t ids[3] = {0, config.bos_token_id, fallback_eos};
  const char* const keys[3] = {"tokenizer.ggml.unknown_token_id", "tokenizer.ggml.bos_token_id",
                               "tokenizer.ggml.eos_token_id"};
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<int64_t> id = OptionalInt(file, keys[i], ids[i]);
    if (!id.ok()) return id.status();
    if (*id < -1 || *id >= static_cast<int64_t>(n)) {
      return absl::InvalidArgumentError(
          absl::StrCat(file.name(), ": ", keys[i], " = ", *id, " is not a token id"));
    }
    ids[i] = *id;
  }
  // SentencePiece needs the unknown token's piece to be of type UNKNOWN (2); llama.cpp's
  // gemma3 files mark <unk> CONTROL (3) and name it only by tokenizer.ggml.unknown_token_id.
  if (ids[0] >= 0 && std::find(types.begin(), types.end(), 2) == types.end()) {
    types[static_cast<size_t>(ids[0])] = 2;
  }
  bool add_space_prefix = true;
  if (file.Has("tokenizer.ggml.add_space_prefix")) {
    absl::StatusOr<bool> read = file.GetBool("tokenizer.ggml.add_space_prefix");
    if (!read.ok()) return read.status();
    add_space_prefix = *read;
  }
  absl::StatusOr<std::unique_ptr<SentencePieceTokenizer>> tokenizer =
      SentencePieceTokenizer::FromModelProto(
          SentencePieceModelProto(*tokens, scores, types, ids[0], ids[1], ids[2], add_space_prefix),
          config.vocab_size, file.name());
  if (!tokenizer.ok()) return tokenizer.status();
  return std::unique_ptr<Tokenizer>(std::move(*tokenizer));
}

}  // namespace

absl::StatusOr<std::unique_ptr<Tokenizer>> LoadGgufTokenizer(const GgufFile& file,
                                                             const TokenizerConfig& config) {
  absl::StatusOr<std::string> model = file.GetString("tokenizer.ggml.model");
  if (!model.ok()) return model.status();
  if (*model == "llama") return LoadGgufSentencePiece(file, config);
  if (*model != "gpt2") {
    return absl::UnimplementedError(
        absl::StrCat(file.name(), ": tokenizer.ggml.model \"", *model, "\" is not implemented"));
  }
  BpeVocab vocab;
  vocab.source = file.name();
  absl::StatusOr<std::vector<std::string>> tokens = file.GetStringArray("tokenizer.ggml.tokens");
  if (!tokens.ok()) return tokens.status();
  vocab.tokens = std::move(*tokens);
  if (file.Has("tokenizer.ggml.merges")) {
    absl::StatusOr<std::vector<std::string>> merges = file.GetStringArray("tokenizer.ggml.merges");
    if (!merges.ok()) return merges.status();
    vocab.merges = std::move(*merges);
  }
  if (file.Has("tokenizer.ggml.token_type")) {
    absl::StatusOr<std::vector<int64_t>> types = file.GetIntArray("tokenizer.ggml.token_type");
    if (!types.ok()) return types.status();
    if (types->size() != vocab.tokens.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat(file.name(), ": tokenizer.ggml.token_type has ", types->size(),
                       " entries for ", vocab.tokens.size(), " tokens"));
    }
    for (size_t id = 0; id < types->size(); ++id) {
      const int64_t type = (*types)[id];
      if (type != 3 && type != 4) continue;
      BpeAddedToken token;
      token.content = vocab.tokens[id];
      token.id = static_cast<int32_t>(id);
      token.special = type == 3;
      vocab.added_tokens.push_back(std::move(token));
    }
  }
  vocab.pre = "default";
  if (file.Has("tokenizer.ggml.pre")) {
    absl::StatusOr<std::string> pre = file.GetString("tokenizer.ggml.pre");
    if (!pre.ok()) return pre.status();
    vocab.pre = std::move(*pre);
  }
  const int64_t fallback_eos = config.eos_token_ids.empty() ? -1 : config.eos_token_ids[0];
  for (const auto& [key, fallback, out] :
       {std::tuple<const char*, int64_t, int32_t*>{"tokenizer.ggml.bos_token_id",
                                                   config.bos_token_id, &vocab.bos_id},
        {"tokenizer.ggml.eos_token_id", fallback_eos, &vocab.eos_id}}) {
    absl::StatusOr<int64_t> id = OptionalInt(file, key, fallback);
    if (!id.ok()) return id.status();
    if (*id < -1 || *id >= static_cast<int64_t>(vocab.tokens.size())) {
      return absl::InvalidArgumentError(
          absl::StrCat(file.name(), ": ", key, " = ", *id, " is not a token id"));
    }
    *out = static_cast<int32_t>(*id);
  }
  if (file.Has("tokenizer.ggml.add_bos_token")) {
    absl::StatusOr<bool> add_bos = file.GetBool("tokenizer.ggml.add_bos_token");
    if (!add_bos.ok()) return add_bos.status();
    vocab.add_bos = *add_bos;
  }
  absl::StatusOr<std::unique_ptr<BpeTokenizer>> tokenizer =
      BpeTokenizer::FromVocab(std::move(vocab), config.vocab_size);
  if (!tokenizer.ok()) return tokenizer.status();
  return std::unique_ptr<Tokenizer>(std::move(*tokenizer));
}

}  // namespace kvcm
