#pragma once
// SentencePieceBackend: the only code that includes <sentencepiece_processor.h>.
//
// Debian's libsentencepiece-dev (0.1.97) declares `namespace absl { using std::string_view; }`
// in its public header, which collides with Abseil 20220623's own absl::string_view class.
// So the library is reached only through this header, which includes neither, and its .cc,
// which includes no Abseil header. Errors come back as a message string; tokenizer.cc turns
// them into absl::Status.
//
// Thread safety: Encode and Decode are const and may run concurrently after Load.

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace kvcm::internal {

class SentencePieceBackend {
 public:
  // Loads a serialized SentencePiece model (`tokenizer.model`). On failure returns nullptr
  // and sets *error to the library's message.
  static std::unique_ptr<SentencePieceBackend> Load(const std::string& path, std::string* error);
  // The same from the bytes of a serialized ModelProto.
  static std::unique_ptr<SentencePieceBackend> LoadSerialized(std::string_view model_proto,
                                                              std::string* error);

  ~SentencePieceBackend();
  SentencePieceBackend(const SentencePieceBackend&) = delete;
  SentencePieceBackend& operator=(const SentencePieceBackend&) = delete;

  // False with *error set on failure.
  bool Encode(std::string_view text, std::vector<int32_t>* ids, std::string* error) const;
  bool Decode(const std::vector<int32_t>& ids, std::string* text, std::string* error) const;

  int32_t piece_size() const;
  // The id of `piece`, -1 when the model has no such piece.
  int32_t PieceToId(std::string_view piece) const;
  // The piece of `id` ("" outside [0, piece_size())).
  std::string IdToPiece(int32_t id) const;
  // Control or unknown piece (false outside [0, piece_size())).
  bool IsControlOrUnknown(int32_t id) const;
  int32_t bos_id() const;  // -1 when the model has none
  int32_t eos_id() const;  // -1 when the model has none

 private:
  struct Impl;
  explicit SentencePieceBackend(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvcm::internal
