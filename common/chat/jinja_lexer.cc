// The lexer of the Jinja subset (common/chat/jinja_lexer.h): the text between tags, and
// the names, literals and operators inside `{{ ... }}` and `{% ... %}`.
#include "common/chat/jinja_lexer.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/base/status_macros.h"

namespace kvcm::jinja::internal {
namespace {

bool IsDigit(char c) { return c >= '0' && c <= '9'; }
bool IsNameStart(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
bool IsNameChar(char c) { return IsNameStart(c) || IsDigit(c); }

// Python's str.rstrip().
std::string RStripPython(std::string_view text) {
  std::u32string cps = DecodeUtf8(text);
  size_t n = cps.size();
  while (n > 0 && IsPythonSpace(cps[n - 1])) --n;
  // Re-encode only the kept prefix; keep the original bytes when nothing changed.
  if (n == cps.size()) return std::string(text);
  return EncodeUtf8(std::u32string_view(cps).substr(0, n));
}

bool AllPythonSpace(std::string_view text) {
  if (text.empty()) return false;
  for (char32_t c : DecodeUtf8(text)) {
    if (!IsPythonSpace(c)) return false;
  }
  return true;
}

class Lexer {
 public:
  explicit Lexer(std::string_view source) {
    // Newlines to "\n"; one trailing newline dropped (keep_trailing_newline=False).
    src_.reserve(source.size());
    for (size_t i = 0; i < source.size(); ++i) {
      if (source[i] == '\r') {
        src_.push_back('\n');
        if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
      } else {
        src_.push_back(source[i]);
      }
    }
    if (!src_.empty() && src_.back() == '\n') src_.pop_back();
    line_starts_.push_back(0);
    for (size_t i = 0; i < src_.size(); ++i) {
      if (src_[i] == '\n') line_starts_.push_back(i + 1);
    }
  }

  // The offset after the Python whitespace (str.isspace(), what `\s` matches) at `i`.
  size_t SkipSpace(size_t i) const {
    while (i < src_.size()) {
      const unsigned char lead = static_cast<unsigned char>(src_[i]);
      const size_t len = lead < 0x80             ? 1
                         : (lead & 0xE0) == 0xC0 ? 2
                         : (lead & 0xF0) == 0xE0 ? 3
                                                 : 4;
      const std::u32string cp = DecodeUtf8(std::string_view(src_).substr(i, len));
      if (cp.size() != 1 || !IsPythonSpace(cp[0])) break;
      i += len;
    }
    return i;
  }

  Position PosAt(size_t offset) const {
    auto it = std::upper_bound(line_starts_.begin(), line_starts_.end(), offset);
    const size_t line = static_cast<size_t>(it - line_starts_.begin());
    return Position{static_cast<int>(line), static_cast<int>(offset - line_starts_[line - 1] + 1)};
  }

  absl::StatusOr<std::vector<Token>> Run() {
    size_t pos = 0;
    bool line_starting = true;
    while (pos < src_.size()) {
      size_t open = pos;
      char kind = 0;
      while (true) {
        open = src_.find('{', open);
        if (open == std::string::npos || open + 1 >= src_.size()) {
          open = std::string::npos;
          break;
        }
        const char next = src_[open + 1];
        if (next == '{' || next == '%' || next == '#') {
          kind = next;
          break;
        }
        ++open;
      }
      if (open == std::string::npos) {
        Emit(Tok::kData, src_.substr(pos), pos);
        break;
      }
      std::string text = src_.substr(pos, open - pos);
      size_t cursor = open + 2;
      char sign = 0;
      if (cursor < src_.size() && (src_[cursor] == '-' || src_[cursor] == '+')) {
        sign = src_[cursor];
        ++cursor;
      }
      // {% raw %}
      size_t raw_body = 0;
      if (kind == '%') raw_body = MatchRawBegin(cursor);
      ApplyLStrip(text, sign, kind == '{', line_starting);
      if (!text.empty()) Emit(Tok::kData, text, pos);

      if (raw_body != 0) {
        KVCM_ASSIGN_OR_RETURN(pos, LexRaw(open, raw_body, line_starting));
        continue;
      }
      if (kind == '#') {
        if (cursor >= src_.size()) break;  // as in Jinja, "{#" that ends the source is no error
        size_t end = src_.find("#}", cursor);
        if (end == std::string::npos)
          return SyntaxError(PosAt(open), "missing end of comment tag '#}'");
        size_t after = end + 2;
        if (end > cursor && src_[end - 1] == '-') {
          after = SkipSpace(after);
        } else if (end > cursor && src_[end - 1] == '+') {
          // keep
        } else if (after < src_.size() && src_[after] == '\n') {
          ++after;
        }
        line_starting = src_[after - 1] == '\n';
        pos = after;
        continue;
      }
      Emit(kind == '{' ? Tok::kVarBegin : Tok::kBlockBegin, "", open);
      KVCM_ASSIGN_OR_RETURN(pos, LexTag(open, cursor, kind == '%'));
      line_starting = src_[pos - 1] == '\n';
    }
    Emit(Tok::kEof, "", src_.size());
    return std::move(tokens_);
  }

 private:
  void Emit(Tok type, std::string text, size_t offset) {
    tokens_.emplace_back(type, std::move(text), PosAt(offset));
  }

  // lstrip_blocks and `{%-`: what Jinja's OptionalLStrip does to the text before a tag.
  static void ApplyLStrip(std::string& text, char sign, bool is_variable, bool line_starting) {
    if (sign == '-') {
      text = RStripPython(text);
    } else if (sign != '+' && !is_variable) {
      const size_t newline = text.rfind('\n');
      const size_t l_pos = newline == std::string::npos ? 0 : newline + 1;
      if ((l_pos > 0 || line_starting) && AllPythonSpace(std::string_view(text).substr(l_pos))) {
        text.resize(l_pos);
      }
    }
  }

  // After "{%" and its sign at `cursor`: the offset after `\s*raw\s*(-%}\s*|%})`, or 0.
  size_t MatchRawBegin(size_t cursor) const {
    size_t i = cursor;
    i = SkipSpace(i);
    if (src_.compare(i, 3, "raw") != 0) return 0;
    i += 3;
    i = SkipSpace(i);
    if (src_.compare(i, 3, "-%}") == 0) {
      i += 3;
      i = SkipSpace(i);
      return i;
    }
    if (src_.compare(i, 2, "%}") == 0) return i + 2;
    return 0;
  }

  absl::StatusOr<size_t> LexRaw(size_t open, size_t body, bool& line_starting) {
    if (body >= src_.size()) return src_.size();  // Jinja accepts a raw tag that ends the source
    line_starting = src_[body - 1] == '\n';
    size_t search = body;
    while (true) {
      const size_t tag = src_.find("{%", search);
      if (tag == std::string::npos) return SyntaxError(PosAt(open), "missing end of raw directive");
      size_t i = tag + 2;
      char sign = 0;
      if (i < src_.size() && (src_[i] == '-' || src_[i] == '+')) sign = src_[i++];
      i = SkipSpace(i);
      if (src_.compare(i, 6, "endraw") != 0) {
        search = tag + 2;
        continue;
      }
      i += 6;
      i = SkipSpace(i);
      size_t after = 0;
      if (src_.compare(i, 3, "+%}") == 0) {
        after = i + 3;
      } else if (src_.compare(i, 3, "-%}") == 0) {
        after = i + 3;
        after = SkipSpace(after);
      } else if (src_.compare(i, 2, "%}") == 0) {
        after = i + 2;
        if (after < src_.size() && src_[after] == '\n') ++after;
      } else {
        search = tag + 2;
        continue;
      }
      std::string text = src_.substr(body, tag - body);
      ApplyLStrip(text, sign, false, line_starting);
      if (!text.empty()) Emit(Tok::kData, text, body);
      line_starting = src_[after - 1] == '\n';
      return after;
    }
  }

  // Tokens of one `{{ ... }}` or `{% ... %}`; returns the offset after its end.
  absl::StatusOr<size_t> LexTag(size_t open, size_t i, bool block) {
    std::vector<char> balance;
    while (true) {
      i = SkipSpace(i);
      if (i >= src_.size()) {
        return SyntaxError(PosAt(open),
                           block ? "unclosed tag: expected '%}'" : "unclosed tag: expected '}}'");
      }
      if (balance.empty()) {
        if (block) {
          if (src_.compare(i, 3, "+%}") == 0) {
            Emit(Tok::kBlockEnd, "", i);
            return i + 3;
          }
          if (src_.compare(i, 3, "-%}") == 0) {
            Emit(Tok::kBlockEnd, "", i);
            i += 3;
            i = SkipSpace(i);
            return i;
          }
          if (src_.compare(i, 2, "%}") == 0) {
            Emit(Tok::kBlockEnd, "", i);
            i += 2;
            if (i < src_.size() && src_[i] == '\n') ++i;  // trim_blocks
            return i;
          }
        } else {
          if (src_.compare(i, 3, "-}}") == 0) {
            Emit(Tok::kVarEnd, "", i);
            i += 3;
            i = SkipSpace(i);
            return i;
          }
          if (src_.compare(i, 2, "}}") == 0) {
            Emit(Tok::kVarEnd, "", i);
            return i + 2;
          }
        }
      }
      const char c = src_[i];
      const size_t start = i;
      if (IsDigit(c)) {
        KVCM_ASSIGN_OR_RETURN(i, LexNumber(i));
        continue;
      }
      if (IsNameStart(c)) {
        while (i < src_.size() && IsNameChar(src_[i])) ++i;
        Emit(Tok::kName, src_.substr(start, i - start), start);
        continue;
      }
      if (c == '\'' || c == '"') {
        KVCM_ASSIGN_OR_RETURN(i, LexString(i));
        continue;
      }
      static constexpr std::string_view kOps[] = {"**", "//", "==", "!=", ">=", "<=", "+", "-", "/",
                                                  "*",  "%",  "~",  "[",  "]",  "(",  ")", "{", "}",
                                                  ">",  "<",  "=",  ".",  ":",  "|",  ",", ";"};
      bool matched = false;
      for (std::string_view op : kOps) {
        if (src_.compare(i, op.size(), op) == 0) {
          if (op == "(" || op == "[" || op == "{") {
            balance.push_back(op == "(" ? ')' : op == "[" ? ']' : '}');
          } else if (op == ")" || op == "]" || op == "}") {
            if (balance.empty())
              return SyntaxError(PosAt(i), absl::StrCat("unexpected '", std::string(op), "'"));
            if (balance.back() != op[0]) {
              return SyntaxError(PosAt(i),
                                 absl::StrCat("unexpected '", std::string(op), "', expected '",
                                              std::string(1, balance.back()), "'"));
            }
            balance.pop_back();
          }
          Emit(Tok::kOp, std::string(op), i);
          i += op.size();
          matched = true;
          break;
        }
      }
      if (!matched && static_cast<unsigned char>(c) >= 0x80) {
        return Unsupported(PosAt(i), "a non-ASCII character in a tag (a Unicode name?)");
      }
      if (!matched) {
        return SyntaxError(PosAt(i),
                           absl::StrCat("unexpected character '", std::string(1, c), "'"));
      }
    }
  }

  absl::StatusOr<size_t> LexNumber(size_t i) {
    const size_t start = i;
    auto digits = [&](size_t j) {
      while (j < src_.size() &&
             (IsDigit(src_[j]) || (src_[j] == '_' && j + 1 < src_.size() && IsDigit(src_[j + 1]))))
        ++j;
      return j;
    };
    i = digits(i);
    bool is_float = false;
    const bool after_dot = start > 0 && src_[start - 1] == '.';
    if (!after_dot) {
      if (i + 1 < src_.size() && src_[i] == '.' && IsDigit(src_[i + 1])) {
        i = digits(i + 1);
        is_float = true;
      }
      if (i < src_.size() && (src_[i] == 'e' || src_[i] == 'E')) {
        size_t j = i + 1;
        if (j < src_.size() && (src_[j] == '+' || src_[j] == '-')) ++j;
        if (j < src_.size() && IsDigit(src_[j])) {
          i = digits(j);
          is_float = true;
        }
      }
    }
    std::string spelling;
    for (size_t k = start; k < i; ++k) {
      if (src_[k] != '_') spelling.push_back(src_[k]);
    }
    Token token(is_float ? Tok::kFloat : Tok::kInt, spelling, PosAt(start));
    if (is_float) {
      token.float_value = std::strtod(spelling.c_str(), nullptr);
    } else {
      int64_t v = 0;
      for (char d : spelling) {
        if (v > (INT64_MAX - (d - '0')) / 10) {
          return Unsupported(PosAt(start), "an integer literal beyond 64 bits");
        }
        v = v * 10 + (d - '0');
      }
      token.int_value = v;
    }
    tokens_.push_back(std::move(token));
    return i;
  }

  // A quoted string with Python's escapes (what Jinja's unicode-escape decoding accepts).
  absl::StatusOr<size_t> LexString(size_t i) {
    const size_t start = i;
    const char quote = src_[i++];
    std::string value;
    while (true) {
      if (i >= src_.size()) return SyntaxError(PosAt(start), "unterminated string");
      const char c = src_[i];
      if (c == quote) {
        ++i;
        break;
      }
      if (c != '\\') {
        value.push_back(c);
        ++i;
        continue;
      }
      KVCM_ASSIGN_OR_RETURN(i, LexEscape(start, i, value));
    }
    Emit(Tok::kString, std::move(value), start);
    return i;
  }

  // The escape at `i` (its backslash) in the string that starts at `start`, appended to
  // `value`; returns the offset after it.
  absl::StatusOr<size_t> LexEscape(size_t start, size_t i, std::string& value) {
    if (i + 1 >= src_.size()) return SyntaxError(PosAt(start), "unterminated string");
    const char e = src_[i + 1];
    i += 2;
    auto hex = [&](int n) -> absl::StatusOr<char32_t> {
      char32_t cp = 0;
      for (int k = 0; k < n; ++k) {
        if (i >= src_.size()) return SyntaxError(PosAt(start), "truncated escape in string");
        const char h = src_[i++];
        int d = 0;
        if (h >= '0' && h <= '9')
          d = h - '0';
        else if (h >= 'a' && h <= 'f')
          d = h - 'a' + 10;
        else if (h >= 'A' && h <= 'F')
          d = h - 'A' + 10;
        else
          return SyntaxError(PosAt(start), "truncated escape in string");
        cp = cp * 16 + static_cast<char32_t>(d);
      }
      return cp;
    };
    switch (e) {
      case '\n':
        break;
      case '\\':
        value.push_back('\\');
        break;
      case '\'':
        value.push_back('\'');
        break;
      case '"':
        value.push_back('"');
        break;
      case 'a':
        value.push_back('\a');
        break;
      case 'b':
        value.push_back('\b');
        break;
      case 'f':
        value.push_back('\f');
        break;
      case 'n':
        value.push_back('\n');
        break;
      case 'r':
        value.push_back('\r');
        break;
      case 't':
        value.push_back('\t');
        break;
      case 'v':
        value.push_back('\v');
        break;
      case 'x':
      case 'u':
      case 'U': {
        KVCM_ASSIGN_OR_RETURN(char32_t cp, hex(e == 'x' ? 2 : e == 'u' ? 4 : 8));
        if (cp > 0x10FFFF) return SyntaxError(PosAt(start), "illegal Unicode character in string");
        value += EncodeUtf8(std::u32string(1, cp));
        break;
      }
      case 'N':
        return Unsupported(PosAt(start), "a \\N{...} escape");
      default:
        if (e >= '0' && e <= '7') {
          char32_t cp = static_cast<char32_t>(e - '0');
          for (int k = 0; k < 2 && i < src_.size() && src_[i] >= '0' && src_[i] <= '7'; ++k) {
            cp = cp * 8 + static_cast<char32_t>(src_[i++] - '0');
          }
          value += EncodeUtf8(std::u32string(1, cp));
        } else {
          value.push_back('\\');
          value.push_back(e);
        }
    }
    return i;
  }

  std::string src_;
  std::vector<size_t> line_starts_;
  std::vector<Token> tokens_;
};

}  // namespace

absl::StatusOr<std::vector<Token>> Lex(std::string_view source) {
  Lexer lexer(source);
  return lexer.Run();
}

}  // namespace kvcm::jinja::internal
