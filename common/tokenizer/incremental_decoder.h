#pragma once
// IncrementalDecoder: the text of a growing list of token ids, a piece per new token, at a
// cost that does not grow with the list (the router streams every generated token; decoding
// the whole generation again for each token made a long stream quadratic).
//
// As Hugging Face's text-generation-inference and vLLM do, it decodes a short window: the
// ids since `prefix` (a point where text was last complete) twice, without and with the
// ids since `read`, and the new text is the difference. Tokenizers whose decoding depends on
// the start (SentencePiece drops the first piece's leading space) decode both windows the
// same way, so the difference is what the whole decoding adds. Should the shorter window's
// text not be a prefix of the longer one's, the piece comes from decoding every id (the old
// way, correct for any tokenizer).
//
// A decoder that strips the first space of its text (Llama 2's tokenizer.json: Strip(" ", 1,
// 0)) strips it from both windows alike, so the difference keeps every space but the first of
// the whole text, as a whole Decode does.
//
// Text that ends inside a UTF-8 sequence (a character split across byte tokens) is held back
// as `pending` until a later token completes it, so every `ready` piece of valid UTF-8 text
// is whole characters (bytes that are no UTF-8 at all pass through as Decode gives them),
// and the `ready` pieces in order, then the last `pending`, are exactly Decode(ids). Text
// that ends in U+FFFD is held back too: SentencePiece-style decoders (byte_fallback) make
// "<0xE4><0xBD>" U+FFFD U+FFFD until "<0xA0>" makes it "你". When the ids hold bytes that no
// later id can make UTF-8 ("<0x41><0xFF>" decodes to two U+FFFD, though "<0x41>" alone was
// "A"), what was returned cannot change: the stream goes on from the whole decoding at the
// next character, and may differ from Decode(ids).
//
// Thread safety: none; one per sequence.

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "common/tokenizer/tokenizer.h"

namespace kvcm {

// The length of the longest prefix of `text` that does not end inside a UTF-8 sequence.
size_t CompleteUtf8Prefix(std::string_view text);

class IncrementalDecoder {
 public:
  struct Piece {
    std::string ready;    // new text that ends on a character boundary: stream it
    std::string pending;  // text after it, not yet a whole character (or its end)
  };

  // `ids`: every id so far, those of the previous call first. INVALID_ARGUMENT for an id
  // outside the vocabulary (as Decode).
  absl::StatusOr<Piece> Next(const Tokenizer& tokenizer, std::span<const int32_t> ids);

  // Bytes of `ready` text returned so far.
  size_t emitted() const { return emitted_; }

 private:
  size_t prefix_ = 0;  // ids before it were turned into text that was whole
  size_t read_ = 0;    // ids before it are covered by the text returned
  size_t emitted_ = 0;
};

}  // namespace kvcm
