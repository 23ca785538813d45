#pragma once
// UTF-8 validation, strict: no overlong forms, surrogates or code points past U+10FFFF.
// Shared by the GGUF reader and writer (common/gguf), the tokenizers (common/tokenizer) and
// the router's token texts.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>

namespace kvcm {

// The byte offset of the first byte of `text` that is not part of valid UTF-8, or npos.
inline size_t InvalidUtf8Offset(std::string_view text) {
  const auto* s = reinterpret_cast<const unsigned char*>(text.data());
  const size_t n = text.size();
  size_t i = 0;
  while (i < n) {
    // Eight ASCII bytes at a time.
    if (i + 8 <= n) {
      uint64_t word;
      std::memcpy(&word, s + i, 8);
      if ((word & 0x8080808080808080ULL) == 0) {
        i += 8;
        continue;
      }
    }
    const unsigned char c = s[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    size_t len;
    uint32_t cp;
    if (c >= 0xC2 && c <= 0xDF) {
      len = 2;
      cp = c & 0x1Fu;
    } else if (c >= 0xE0 && c <= 0xEF) {
      len = 3;
      cp = c & 0x0Fu;
    } else if (c >= 0xF0 && c <= 0xF4) {
      len = 4;
      cp = c & 0x07u;
    } else {
      return i;  // a continuation byte, an overlong lead (C0, C1) or past U+10FFFF
    }
    if (i + len > n) return i;
    for (size_t k = 1; k < len; ++k) {
      if ((s[i + k] & 0xC0) != 0x80) return i;
      cp = (cp << 6) | (s[i + k] & 0x3Fu);
    }
    if ((len == 3 && (cp < 0x800 || (cp >= 0xD800 && cp <= 0xDFFF))) ||
        (len == 4 && (cp < 0x10000 || cp > 0x10FFFF))) {
      return i;  // overlong, a surrogate, or out of range
    }
    i += len;
  }
  return std::string_view::npos;
}

inline bool IsValidUtf8(std::string_view text) {
  return InvalidUtf8Offset(text) == std::string_view::npos;
}

}  // namespace kvcm
