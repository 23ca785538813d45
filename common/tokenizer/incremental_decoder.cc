#include "common/tokenizer/incremental_decoder.h"

#include <algorithm>
#include <string_view>

namespace kvcm {

size_t CompleteUtf8Prefix(std::string_view text) {
  size_t end = text.size();
  // Look back at most 3 bytes for the lead byte of a sequence still missing bytes.
  for (size_t back = 1; back <= 3 && back <= text.size(); ++back) {
    const auto c = static_cast<unsigned char>(text[text.size() - back]);
    if ((c & 0xC0) == 0x80) continue;  // a continuation byte: keep looking
    const size_t need = (c & 0xE0) == 0xC0   ? 2
                        : (c & 0xF0) == 0xE0 ? 3
                        : (c & 0xF8) == 0xF0 ? 4
                                             : 1;
    if (need > back) end = text.size() - back;
    break;
  }
  return end;
}

namespace {

constexpr std::string_view kReplacementCharacter = "\xEF\xBF\xBD";  // U+FFFD

}  // namespace

absl::StatusOr<IncrementalDecoder::Piece> IncrementalDecoder::Next(const Tokenizer& tokenizer,
                                                                   std::span<const int32_t> ids) {
  absl::StatusOr<std::string> before = tokenizer.Decode(ids.subspan(prefix_, read_ - prefix_));
  if (!before.ok()) return before.status();
  absl::StatusOr<std::string> after = tokenizer.Decode(ids.subspan(prefix_));
  if (!after.ok()) return after.status();
  std::string_view added;
  if (std::string_view(*after).substr(0, before->size()) == *before) {
    added = std::string_view(*after).substr(before->size());
  } else {
    // The window's decoding is not a prefix of itself grown: decode every id.
    absl::StatusOr<std::string> all = tokenizer.Decode(ids);
    if (!all.ok()) return all.status();
    *after = *std::move(all);
    added =
        emitted_ < after->size() ? std::string_view(*after).substr(emitted_) : std::string_view();
    // Never from inside a character (the text returned may not be a prefix of this one).
    while (!added.empty() && (static_cast<unsigned char>(added[0]) & 0xC0) == 0x80) {
      added.remove_prefix(1);
    }
  }
  Piece piece;
  // A trailing U+FFFD may be the byte-fallback tokens of a character that later ids complete
  // (Hugging Face's ByteFallback decodes "<0xE4><0xBD>" so): held back, as Hugging Face's
  // DecodeStream, TGI and vLLM do.
  const bool replaced =
      added.size() >= kReplacementCharacter.size() &&
      added.substr(added.size() - kReplacementCharacter.size()) == kReplacementCharacter;
  if (!added.empty() && !replaced && CompleteUtf8Prefix(added) == added.size()) {
    piece.ready = std::string(added);
    emitted_ += piece.ready.size();
    // The text is whole here: the next window starts at the ids this one read before
    // (the last of them gives a tokenizer its context), or one id back at most.
    prefix_ = std::min(read_, ids.size() - 1);
    read_ = ids.size();
  } else {
    piece.pending = std::string(added);
  }
  return piece;
}

}  // namespace kvcm
