#pragma once
// The byte-level alphabet of GPT-2's BPE (Hugging Face's bytes_char): every byte is one
// printable code point, so a token is a string of them. Bytes '!'..'~', 0xA1..0xAC and
// 0xAE..0xFF stand for themselves; the other 68 bytes, in order, for U+0100 onwards
// (space is 'Ġ' U+0120, newline 'Ċ' U+010A).
//
// Thread safety: pure functions.

#include <string>
#include <string_view>

namespace kvcm::internal {

// The byte-level spelling of `bytes` (any bytes), appended to *out.
void ByteLevelEncode(std::string_view bytes, std::string* out);

// The bytes behind a byte-level spelling, appended to *out. False (with *out unchanged) when
// `token` is not valid UTF-8 or holds a code point outside the alphabet.
bool ByteLevelDecode(std::string_view token, std::string* out);

}  // namespace kvcm::internal
