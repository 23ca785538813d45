// No Abseil header may be included here: see sentencepiece_backend.h.
#include "common/tokenizer/sentencepiece_backend.h"

#include <sentencepiece_processor.h>

#include <utility>

namespace kvcm::internal {

struct SentencePieceBackend::Impl {
  sentencepiece::SentencePieceProcessor processor;
};

SentencePieceBackend::SentencePieceBackend(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
SentencePieceBackend::~SentencePieceBackend() = default;

std::unique_ptr<SentencePieceBackend> SentencePieceBackend::Load(const std::string& path,
                                                                 std::string* error) {
  auto impl = std::make_unique<Impl>();
  const sentencepiece::util::Status status = impl->processor.Load(path);
  if (!status.ok()) {
    *error = status.ToString();
    return nullptr;
  }
  return std::unique_ptr<SentencePieceBackend>(new SentencePieceBackend(std::move(impl)));
}

std::unique_ptr<SentencePieceBackend> SentencePieceBackend::LoadSerialized(
    std::string_view model_proto, std::string* error) {
  auto impl = std::make_unique<Impl>();
  const sentencepiece::util::Status status = impl->processor.LoadFromSerializedProto(model_proto);
  if (!status.ok()) {
    *error = status.ToString();
    return nullptr;
  }
  return std::unique_ptr<SentencePieceBackend>(new SentencePieceBackend(std::move(impl)));
}

bool SentencePieceBackend::Encode(std::string_view text, std::vector<int32_t>* ids,
                                  std::string* error) const {
  std::vector<int> out;
  const sentencepiece::util::Status status = impl_->processor.Encode(text, &out);
  if (!status.ok()) {
    *error = status.ToString();
    return false;
  }
  ids->assign(out.begin(), out.end());
  return true;
}

bool SentencePieceBackend::Decode(const std::vector<int32_t>& ids, std::string* text,
                                  std::string* error) const {
  const std::vector<int> in(ids.begin(), ids.end());
  const sentencepiece::util::Status status = impl_->processor.Decode(in, text);
  if (!status.ok()) {
    *error = status.ToString();
    return false;
  }
  return true;
}

int32_t SentencePieceBackend::piece_size() const { return impl_->processor.GetPieceSize(); }

std::string SentencePieceBackend::IdToPiece(int32_t id) const {
  if (id < 0 || id >= piece_size()) return "";
  return impl_->processor.IdToPiece(id);
}

int32_t SentencePieceBackend::PieceToId(std::string_view piece) const {
  const int id = impl_->processor.PieceToId(piece);
  // Unknown pieces come back as the <unk> id.
  if (id < 0 || impl_->processor.IdToPiece(id) != piece) return -1;
  return id;
}

bool SentencePieceBackend::IsControlOrUnknown(int32_t id) const {
  if (id < 0 || id >= impl_->processor.GetPieceSize()) return false;
  return impl_->processor.IsControl(id) || impl_->processor.IsUnknown(id);
}
int32_t SentencePieceBackend::bos_id() const { return impl_->processor.bos_id(); }
int32_t SentencePieceBackend::eos_id() const { return impl_->processor.eos_id(); }

}  // namespace kvcm::internal
