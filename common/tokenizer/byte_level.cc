#include "common/tokenizer/byte_level.h"

#include <array>
#include <cstdint>

namespace kvcm::internal {
namespace {

struct Tables {
  std::array<uint16_t, 256> code_point{};  // byte -> code point
  std::array<int16_t, 512> byte{};         // code point -> byte, -1 outside the alphabet
  Tables() {
    byte.fill(-1);
    int next = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      code_point[static_cast<size_t>(b)] = static_cast<uint16_t>(printable ? b : 256 + next++);
      byte[code_point[static_cast<size_t>(b)]] = static_cast<int16_t>(b);
    }
  }
};

const Tables& GetTables() {
  static const Tables tables;
  return tables;
}

}  // namespace

void ByteLevelEncode(std::string_view bytes, std::string* out) {
  const Tables& t = GetTables();
  for (const char ch : bytes) {
    const uint16_t cp = t.code_point[static_cast<unsigned char>(ch)];
    if (cp < 0x80) {
      out->push_back(static_cast<char>(cp));
    } else {
      out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    }
  }
}

bool ByteLevelDecode(std::string_view token, std::string* out) {
  const Tables& t = GetTables();
  std::string bytes;
  bytes.reserve(token.size());
  for (size_t i = 0; i < token.size();) {
    const auto c = static_cast<unsigned char>(token[i]);
    uint32_t cp;
    if (c < 0x80) {
      cp = c;
      i += 1;
    } else if (c >= 0xC2 && c <= 0xDF && i + 1 < token.size() &&
               (static_cast<unsigned char>(token[i + 1]) & 0xC0) == 0x80) {
      cp = ((c & 0x1Fu) << 6) | (static_cast<unsigned char>(token[i + 1]) & 0x3Fu);
      i += 2;
    } else {
      return false;  // longer sequences are all outside the alphabet (or invalid)
    }
    if (cp >= t.byte.size() || t.byte[cp] < 0) return false;
    bytes.push_back(static_cast<char>(t.byte[cp]));
  }
  out->append(bytes);
  return true;
}

}  // namespace kvcm::internal
