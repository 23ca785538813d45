#include "common/tokenizer/tokenizer.h"

#include <filesystem>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/tokenizer/bpe_tokenizer.h"
#include "common/tokenizer/sentencepiece_backend.h"
#include "common/tokenizer/text_matching_internal.h"

namespace kvcm {
namespace {

absl::Status CheckIds(std::span<const int32_t> ids, int32_t vocab_size) {
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "Decode: ids[", i, "] = ", ids[i], " is outside [0, vocab_size=", vocab_size, ")"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<ByteTokenizer>> ByteTokenizer::Create(int32_t vocab_size) {
  if (vocab_size < kMinVocabSize) {
    return absl::InvalidArgumentError(absl::StrCat(
        "byte-level tokenizer: the model's vocab_size is ", vocab_size, ", but ", kMinVocabSize,
        " ids are needed (3 special + 256 bytes); add a tokenizer.model to the model folder"));
  }
  return std::unique_ptr<ByteTokenizer>(new ByteTokenizer(vocab_size));
}

absl::StatusOr<std::vector<int32_t>> ByteTokenizer::Encode(std::string_view text) const {
  std::vector<int32_t> ids;
  ids.reserve(text.size());
  for (const char ch : text) ids.push_back(static_cast<unsigned char>(ch) + kByteOffset);
  return ids;
}

absl::StatusOr<std::string> ByteTokenizer::Decode(std::span<const int32_t> ids) const {
  if (absl::Status s = CheckIds(ids, vocab_size_); !s.ok()) return s;
  std::string text;
  for (const int32_t id : ids) {
    if (id >= kByteOffset && id < kByteOffset + 256) {
      text.push_back(static_cast<char>(static_cast<unsigned char>(id - kByteOffset)));
    }
  }
  return text;
}

bool ByteTokenizer::IsSpecial(int32_t id) const {
  return id >= 0 && id < vocab_size_ && (id < kByteOffset || id >= kByteOffset + 256);
}

std::optional<int32_t> ByteTokenizer::TokenId(std::string_view piece) const {
  if (piece == "<unk>") return kUnkId;
  if (piece == "<s>") return kBosId;
  if (piece == "</s>") return kEosId;
  if (piece.size() == 6 && piece.substr(0, 3) == "<0x" && piece[5] == '>') {
    int value = 0;
    for (const char ch : piece.substr(3, 2)) {
      if (ch >= '0' && ch <= '9') {
        value = value * 16 + (ch - '0');
      } else if (ch >= 'A' && ch <= 'F') {
        value = value * 16 + (ch - 'A' + 10);
      } else {
        return std::nullopt;
      }
    }
    return kByteOffset + value;
  }
  return std::nullopt;
}

SentencePieceTokenizer::SentencePieceTokenizer(
    std::unique_ptr<internal::SentencePieceBackend> backend, int32_t vocab_size)
    : backend_(std::move(backend)),
      specials_(std::make_unique<internal::AddedTokenMatcher>()),
      vocab_size_(vocab_size) {
  for (int32_t id = 0; id < backend_->piece_size(); ++id) {
    if (backend_->IsControlOrUnknown(id)) specials_->Add(id, backend_->IdToPiece(id));
  }
  specials_->Finish();
}

SentencePieceTokenizer::~SentencePieceTokenizer() = default;

absl::StatusOr<std::unique_ptr<SentencePieceTokenizer>> SentencePieceTokenizer::Load(
    const std::string& path, int32_t vocab_size) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) {
    return absl::NotFoundError(absl::StrCat("SentencePiece model \"", path, "\" not found"));
  }
  std::string error;
  std::unique_ptr<internal::SentencePieceBackend> backend =
      internal::SentencePieceBackend::Load(path, &error);
  if (backend == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot load SentencePiece model \"", path, "\": ", error));
  }
  if (backend->piece_size() > vocab_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("SentencePiece model \"", path, "\" has ", backend->piece_size(),
                     " pieces, more than the model's vocab_size ", vocab_size));
  }
  return std::unique_ptr<SentencePieceTokenizer>(
      new SentencePieceTokenizer(std::move(backend), vocab_size));
}

absl::StatusOr<std::unique_ptr<SentencePieceTokenizer>> SentencePieceTokenizer::FromModelProto(
    std::string_view model_proto, int32_t vocab_size, const std::string& source) {
  std::string error;
  std::unique_ptr<internal::SentencePieceBackend> backend =
      internal::SentencePieceBackend::LoadSerialized(model_proto, &error);
  if (backend == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": SentencePiece rejects the model: ", error));
  }
  if (backend->piece_size() > vocab_size) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": ", backend->piece_size(),
                     " SentencePiece pieces, more than the model's vocab_size ", vocab_size));
  }
  return std::unique_ptr<SentencePieceTokenizer>(
      new SentencePieceTokenizer(std::move(backend), vocab_size));
}

absl::StatusOr<std::vector<int32_t>> SentencePieceTokenizer::Encode(std::string_view text) const {
  // The text between special pieces goes through SentencePiece one part at a time (each gets
  // the dummy prefix when the model adds one, as llama.cpp's add_space_prefix does after a
  // special token).
  std::vector<int32_t> ids;
  std::vector<int32_t> part;
  std::string error;
  auto encode = [&](std::string_view segment) {
    if (segment.empty()) return true;
    if (!backend_->Encode(segment, &part, &error)) return false;
    ids.insert(ids.end(), part.begin(), part.end());
    return true;
  };
  size_t from = 0;
  size_t begin = 0;
  size_t end = 0;
  int special = 0;
  while (specials_->Find(text, from, &begin, &end, &special)) {
    if (!encode(text.substr(from, begin - from))) break;
    ids.push_back(special);
    from = end;
  }
  if (error.empty()) encode(text.substr(from));
  if (!error.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("SentencePiece Encode: ", error));
  }
  return ids;
}

absl::StatusOr<std::string> SentencePieceTokenizer::Decode(std::span<const int32_t> ids) const {
  if (absl::Status s = CheckIds(ids, vocab_size_); !s.ok()) return s;
  // Ids past the model's pieces (a padded vocab) have no text.
  std::vector<int32_t> known;
  known.reserve(ids.size());
  for (const int32_t id : ids) {
    if (id < backend_->piece_size()) known.push_back(id);
  }
  std::string text;
  std::string error;
  if (!backend_->Decode(known, &text, &error)) {
    return absl::InvalidArgumentError(absl::StrCat("SentencePiece Decode: ", error));
  }
  return text;
}

int32_t SentencePieceTokenizer::bos_id() const { return backend_->bos_id(); }
int32_t SentencePieceTokenizer::eos_id() const { return backend_->eos_id(); }

bool SentencePieceTokenizer::IsSpecial(int32_t id) const {
  if (id < 0 || id >= vocab_size_) return false;
  return id >= backend_->piece_size() || backend_->IsControlOrUnknown(id);
}

std::optional<int32_t> SentencePieceTokenizer::TokenId(std::string_view piece) const {
  const int32_t id = backend_->PieceToId(piece);
  if (id < 0) return std::nullopt;
  return id;
}

absl::StatusOr<std::unique_ptr<Tokenizer>> LoadTokenizer(const std::string& folder,
                                                         const TokenizerConfig& config) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path json_path = fs::path(folder) / "tokenizer.json";
  if (fs::exists(json_path, ec)) {
    absl::StatusOr<std::unique_ptr<BpeTokenizer>> bpe =
        BpeTokenizer::FromTokenizerJson(json_path.string(), config);
    if (!bpe.ok()) return bpe.status();
    return std::unique_ptr<Tokenizer>(std::move(*bpe));
  }
  const fs::path sp_path = fs::path(folder) / "tokenizer.model";
  if (fs::exists(sp_path, ec)) {
    absl::StatusOr<std::unique_ptr<SentencePieceTokenizer>> sp =
        SentencePieceTokenizer::Load(sp_path.string(), config.vocab_size);
    if (!sp.ok()) return sp.status();
    return std::unique_ptr<Tokenizer>(std::move(*sp));
  }
  if (config.bos_token_id != -1 && config.bos_token_id != ByteTokenizer::kBosId) {
    return absl::InvalidArgumentError(
        absl::StrCat("model folder \"", folder,
                     "\" has no tokenizer.model, so the byte-level tokenizer "
                     "(BOS 1, EOS 2) is used, but config.json sets bos_token_id ",
                     config.bos_token_id));
  }
  if (!config.eos_token_ids.empty() &&
      config.eos_token_ids != std::vector<int32_t>{ByteTokenizer::kEosId}) {
    return absl::InvalidArgumentError(
        absl::StrCat("model folder \"", folder,
                     "\" has no tokenizer.model, so the byte-level tokenizer "
                     "(BOS 1, EOS 2) is used, but config.json sets eos_token_id [",
                     absl::StrJoin(config.eos_token_ids, ", "), "]"));
  }
  absl::StatusOr<std::unique_ptr<ByteTokenizer>> bytes = ByteTokenizer::Create(config.vocab_size);
  if (!bytes.ok()) return bytes.status();
  return std::unique_ptr<Tokenizer>(std::move(*bytes));
}

}  // namespace kvcm
