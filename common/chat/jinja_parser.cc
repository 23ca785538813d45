#include "common/chat/jinja_parser.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/base/status_macros.h"

namespace kvcm::jinja {

absl::Status SyntaxError(Position pos, std::string_view what) {
  return absl::InvalidArgumentError(
      absl::StrCat("chat template ", pos.line, ":", pos.column, ": ", std::string(what)));
}

absl::Status Unsupported(Position pos, std::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(
      "chat template ", pos.line, ":", pos.column, ": ", std::string(what),
      " is not supported by kvcm's chat template interpreter (docs/chat-templates.md); "
      "pass --chat-template FILE with a template that does without it"));
}

namespace {

// ---------------------------------------------------------------------------------------
// Lexer

enum class Tok { kData, kVarBegin, kVarEnd, kBlockBegin, kBlockEnd, kName, kString, kInt, kFloat,
                 kOp, kEof };

struct Token {
  Token(Tok t, std::string s, Position p) : type(t), text(std::move(s)), pos(p) {}
  Tok type;
  std::string text;  // data, name, string value, operator, number spelling
  Position pos;
  int64_t int_value = 0;
  double float_value = 0;
};

bool IsDigit(char c) { return c >= '0' && c <= '9'; }
bool IsNameStart(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
}
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
      const size_t len = lead < 0x80 ? 1 : (lead & 0xE0) == 0xC0 ? 2 : (lead & 0xF0) == 0xE0 ? 3 : 4;
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
        if (end == std::string::npos) return SyntaxError(PosAt(open), "missing end of comment tag '#}'");
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
        return SyntaxError(PosAt(open), block ? "unclosed tag: expected '%}'" : "unclosed tag: expected '}}'");
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
            if (balance.empty()) return SyntaxError(PosAt(i), absl::StrCat("unexpected '", std::string(op), "'"));
            if (balance.back() != op[0]) {
              return SyntaxError(PosAt(i), absl::StrCat("unexpected '", std::string(op), "', expected '",
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
        return SyntaxError(PosAt(i), absl::StrCat("unexpected character '", std::string(1, c), "'"));
      }
    }
  }

  absl::StatusOr<size_t> LexNumber(size_t i) {
    const size_t start = i;
    auto digits = [&](size_t j) {
      while (j < src_.size() && (IsDigit(src_[j]) || (src_[j] == '_' && j + 1 < src_.size() && IsDigit(src_[j + 1])))) ++j;
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
      if (i + 1 >= src_.size()) return SyntaxError(PosAt(start), "unterminated string");
      const char e = src_[i + 1];
      i += 2;
      auto hex = [&](int n) -> absl::StatusOr<char32_t> {
        char32_t cp = 0;
        for (int k = 0; k < n; ++k) {
          if (i >= src_.size()) return SyntaxError(PosAt(start), "truncated escape in string");
          const char h = src_[i++];
          int d = 0;
          if (h >= '0' && h <= '9') d = h - '0';
          else if (h >= 'a' && h <= 'f') d = h - 'a' + 10;
          else if (h >= 'A' && h <= 'F') d = h - 'A' + 10;
          else return SyntaxError(PosAt(start), "truncated escape in string");
          cp = cp * 16 + static_cast<char32_t>(d);
        }
        return cp;
      };
      switch (e) {
        case '\n': break;
        case '\\': value.push_back('\\'); break;
        case '\'': value.push_back('\''); break;
        case '"': value.push_back('"'); break;
        case 'a': value.push_back('\a'); break;
        case 'b': value.push_back('\b'); break;
        case 'f': value.push_back('\f'); break;
        case 'n': value.push_back('\n'); break;
        case 'r': value.push_back('\r'); break;
        case 't': value.push_back('\t'); break;
        case 'v': value.push_back('\v'); break;
        case 'x':
        case 'u':
        case 'U': {
          KVCM_ASSIGN_OR_RETURN(char32_t cp, hex(e == 'x' ? 2 : e == 'u' ? 4 : 8));
          if (cp > 0x10FFFF) return SyntaxError(PosAt(start), "illegal Unicode character in string");
          value += EncodeUtf8(std::u32string(1, cp));
          break;
        }
        case 'N': return Unsupported(PosAt(start), "a \\N{...} escape");
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
    }
    Emit(Tok::kString, std::move(value), start);
    return i;
  }

  std::string src_;
  std::vector<size_t> line_starts_;
  std::vector<Token> tokens_;
};

// ---------------------------------------------------------------------------------------
// Parser

class Parser {
 public:
  explicit Parser(std::vector<Token> tokens) : tokens_(std::move(tokens)) {}

  absl::StatusOr<Body> ParseRoot() {
    Body body;
    std::string end;
    KVCM_RETURN_IF_ERROR(ParseBody(body, {}, "", Position{}, end));
    return body;
  }

 private:
  const Token& Cur() const { return tokens_[pos_]; }
  const Token& Peek(size_t ahead = 1) const {
    return tokens_[std::min(pos_ + ahead, tokens_.size() - 1)];
  }
  void Next() {
    if (pos_ + 1 < tokens_.size()) ++pos_;
  }
  bool IsOp(std::string_view op) const { return Cur().type == Tok::kOp && Cur().text == op; }
  bool IsName(std::string_view name) const {
    return Cur().type == Tok::kName && Cur().text == name;
  }
  std::string Describe(const Token& t) const {
    switch (t.type) {
      case Tok::kEof: return "end of template";
      case Tok::kBlockEnd: return "end of statement block";
      case Tok::kVarEnd: return "end of print statement";
      case Tok::kString: return "string";
      case Tok::kInt:
      case Tok::kFloat: return absl::StrCat("number ", t.text);
      default: return absl::StrCat("'", t.text, "'");
    }
  }
  absl::Status Unexpected(std::string_view expected) const {
    return SyntaxError(Cur().pos, absl::StrCat("expected ", std::string(expected), ", got ",
                                               Describe(Cur())));
  }
  absl::Status ExpectOp(std::string_view op) {
    if (!IsOp(op)) return Unexpected(absl::StrCat("'", std::string(op), "'"));
    Next();
    return absl::OkStatus();
  }
  absl::Status ExpectBlockEnd() {
    if (Cur().type != Tok::kBlockEnd) return Unexpected("end of statement block '%}'");
    Next();
    return absl::OkStatus();
  }
  absl::StatusOr<std::string> ExpectName() {
    if (Cur().type != Tok::kName) return Unexpected("a name");
    std::string name = Cur().text;
    Next();
    return name;
  }

  struct DepthGuard {
    explicit DepthGuard(int& d) : depth(d) { ++depth; }
    ~DepthGuard() { --depth; }
    int& depth;
  };
  absl::Status CheckDepth() const {
    if (depth_ > kMaxNesting) return SyntaxError(Cur().pos, "nesting too deep");
    return absl::OkStatus();
  }

  // Statements until a block tag named in `ends` (consumed up to and including the name;
  // its name in `end`). Empty `ends`: until the end of the template.
  absl::Status ParseBody(Body& body, std::initializer_list<std::string_view> ends,
                         std::string_view opener, Position opened, std::string& end) {
    DepthGuard guard(depth_);
    KVCM_RETURN_IF_ERROR(CheckDepth());
    while (true) {
      const Token& t = Cur();
      switch (t.type) {
        case Tok::kEof: {
          if (ends.size() == 0) return absl::OkStatus();
          std::string names;
          for (std::string_view e : ends) {
            absl::StrAppend(&names, names.empty() ? "" : " or ", "'", std::string(e), "'");
          }
          return SyntaxError(opened, absl::StrCat("unclosed '", std::string(opener),
                                                  "' block: expected ", names,
                                                  " before the end of the template"));
        }
        case Tok::kData: {
          auto stmt = std::make_unique<Stmt>(Stmt::Kind::kText, t.pos);
          stmt->text = t.text;
          body.push_back(std::move(stmt));
          Next();
          break;
        }
        case Tok::kVarBegin: {
          const Position pos = t.pos;
          Next();
          KVCM_ASSIGN_OR_RETURN(ExprPtr expr, ParseTupleExpr(true));
          if (Cur().type != Tok::kVarEnd) return Unexpected("end of print statement '}}'");
          Next();
          auto stmt = std::make_unique<Stmt>(Stmt::Kind::kOutput, pos);
          stmt->expr = std::move(expr);
          body.push_back(std::move(stmt));
          break;
        }
        case Tok::kBlockBegin: {
          const Position pos = t.pos;
          Next();
          if (Cur().type != Tok::kName) return Unexpected("a tag name");
          const std::string name = Cur().text;
          for (std::string_view e : ends) {
            if (name == e) {
              Next();
              end = name;
              return absl::OkStatus();
            }
          }
          KVCM_ASSIGN_OR_RETURN(StmtPtr stmt, ParseStatement(pos));
          body.push_back(std::move(stmt));
          break;
        }
        default:
          return Unexpected("template data or a tag");
      }
    }
  }

  absl::StatusOr<StmtPtr> ParseStatement(Position pos) {
    const std::string name = Cur().text;
    const Position name_pos = Cur().pos;
    Next();
    if (name == "if") return ParseIf(pos);
    if (name == "for") return ParseFor(pos);
    if (name == "set") return ParseSet(pos);
    if (name == "macro") return ParseMacro(pos);
    if (name == "generation") {
      auto stmt = std::make_unique<Stmt>(Stmt::Kind::kGeneration, pos);
      KVCM_RETURN_IF_ERROR(ExpectBlockEnd());
      std::string end;
      KVCM_RETURN_IF_ERROR(ParseBody(stmt->body, {"endgeneration"}, "generation", pos, end));
      KVCM_RETURN_IF_ERROR(ExpectBlockEnd());
      return StmtPtr(std::move(stmt));
    }
    if (name == "filter") {
      auto stmt = std::make_unique<Stmt>(Stmt::Kind::kFilterBlock, pos);
      KVCM_ASSIGN_OR_RETURN(ExprPtr filter, ParseFilter(nullptr));
      stmt->expr = std::move(filter);
      KVCM_RETURN_IF_ERROR(ExpectBlockEnd());
      std::string end;
      KVCM_RETURN_IF_ERROR(ParseBody(stmt->body, {"endfilter"}, "filter", pos, end));
      KVCM_RETURN_IF_ERROR(ExpectBlockEnd());
      return StmtPtr(std::move(stmt));
    }
    if (name == "break" || name == "continue") {
      if (loop_depth_ == 0) {
        return SyntaxError(name_pos, absl::StrCat("'", name, "' outside of a loop"));
      }
      auto stmt = std::make_unique<Stmt>(name == "break" ? Stmt::Kind::kBreak : Stmt::Kind::kContinue, pos);
      KVCM_RETURN_IF_ERROR(ExpectBlockEnd());
      return StmtPtr(std::move(stmt));
    }
    static constexpr std::string_view kJinjaTags[] = {
        "call", "include", "import", "from", "extends", "block", "with", "autoescape", "do", "trans"};
    for (std::string_view tag : kJinjaTags) {
      if (name == tag) return Unsupported(name_pos, absl::StrCat("the tag '", name, "'"));
    }
    static constexpr std::string_view kEnds[] = {"endif", "endfor", "endset", "endmacro", "else",
                                                 "elif", "endgeneration", "endfilter", "endraw"};
    for (std::string_view tag : kEnds) {
      if (name == tag) {
        return SyntaxError(name_pos, absl::StrCat("unexpected '", name, "' (no block to close)"));
      }
    }
    return Unsupported(name_pos, absl::StrCat("the unknown tag '", name, "'"));
  }

  absl::StatusOr<StmtPtr> ParseIf(Position pos) {
    auto stmt = std::make_unique<Stmt>(Stmt::Kind::kIf, pos);
    KVCM_ASSIGN_OR_RETURN(stmt->expr, ParseTupleExpr(true));
    KVCM_RETURN_IF_ERROR(ExpectBlockEnd());
    std::string end;
    KVCM_RETURN_IF_ERROR(ParseBody(stmt->body, {"elif", "else", "endif"}, "if", pos, end));
    if (end == "elif") {
      const Position elif_pos = tokens_[pos_ - 1].pos;
      KVCM_ASSIGN_OR_RETURN(StmtPtr nested, ParseIf(elif_pos));
      stmt->else_body.push_back(std::move(nested));
      return StmtPtr(std::move(stmt));
    }
    if (end == "else") {
      KVCM_RETURN_IF_ERROR(ExpectBlockEnd());
      KVCM_RETURN_IF_ERROR(ParseBody(stmt->else_body, {"endif"}, "if", pos, end));
    }
    KVCM_RETURN_IF_ERROR(ExpectBlockEnd());
    return StmtPtr(std::move(stmt));
  }

  absl::Status ParseTargets(std::vector<std::string>& targets) {
    const bool paren = IsOp("(");
    if (paren) Next();
    while (true) {
      KVCM_ASSIGN_OR_RETURN(std::string name, ExpectName());
      targets.push_back(std::move(name));
      if (!IsOp(",")) break;
      Next();
      if (paren && IsOp(")")) break;
    }
    if (paren) KVCM_RETURN_IF_ERROR(ExpectOp(")"));
    return absl::OkStatus();
  }

  absl::StatusOr<StmtPtr> ParseFor(Position pos) {
    auto stmt = std::make_unique<Stmt>(Stmt::Kind::kFor, pos);
    KVCM_RETURN_IF_ERROR(ParseTargets(stmt->targets));
    if (!IsName("in")) return Unexpected("'in'");
    Next();
    KVCM_ASSIGN_OR_RETURN(stmt->expr, ParseTupleExpr(false));
    if (IsName("if")) {
      Next();
      KVCM_ASSIGN_OR_RETURN(stmt->filter, ParseExpression(true));
    }
    if (IsName("recursive")) return Unsupported(Cur().pos, "a recursive loop");
    KVCM_RETURN_IF_ERROR(ExpectBlockEnd());
    std::string end;
    ++loop_depth_;
    absl::Status s = ParseBody(stmt->body, {"else", "endfor"}, "for", pos, end);
    --loop_depth_;
    KVCM_RETURN_IF_ERROR(s);
    if (end == "else") {
      KVCM_RETURN_IF_ERROR(ExpectBlockEnd());
      KVCM_RETURN_IF_ERROR(ParseBody(stmt->else_body, {"endfor"}, "for", pos, end));
    }
    KVCM_RETURN_IF_ERROR(ExpectBlockEnd());
    return StmtPtr(std::move(stmt));
  }

  absl::StatusOr<StmtPtr> ParseSet(Position pos) {
    auto stmt = std::make_unique<Stmt>(Stmt::Kind::kSet, pos);
    KVCM_ASSIGN_OR_RETURN(std::string first, ExpectName());
    stmt->targets.push_back(first);
    if (IsOp(".")) {
      Next();
      KVCM_ASSIGN_OR_RETURN(std::string attr, ExpectName());
      stmt->targets.push_back(std::move(attr));
      stmt->attr_set = true;
    } else {
      while (IsOp(",")) {
        Next();
        KVCM_ASSIGN_OR_RETURN(std::string name, ExpectName());
        stmt->targets.push_back(std::move(name));
      }
    }
    if (IsOp("=")) {
      Next();
      KVCM_ASSIGN_OR_RETURN(stmt->expr, ParseTupleExpr(true));
      KVCM_RETURN_IF_ERROR(ExpectBlockEnd());
      return StmtPtr(std::move(stmt));
    }
    if (stmt->attr_set || stmt->targets.size() != 1) return Unexpected("'='");
    if (IsOp("|")) return Unsupported(Cur().pos, "a filter on a block set");
    KVCM_RETURN_IF_ERROR(ExpectBlockEnd());
    stmt->kind = Stmt::Kind::kSetBlock;
    std::string end;
    KVCM_RETURN_IF_ERROR(ParseBody(stmt->body, {"endset"}, "set", pos, end));
    KVCM_RETURN_IF_ERROR(ExpectBlockEnd());
    return StmtPtr(std::move(stmt));
  }

  absl::StatusOr<StmtPtr> ParseMacro(Position pos) {
    auto stmt = std::make_unique<Stmt>(Stmt::Kind::kMacro, pos);
    KVCM_ASSIGN_OR_RETURN(std::string name, ExpectName());
    stmt->text = name;
    KVCM_RETURN_IF_ERROR(ExpectOp("("));
    while (!IsOp(")")) {
      if (!stmt->params.empty()) KVCM_RETURN_IF_ERROR(ExpectOp(","));
      if (IsOp(")")) break;
      MacroParam param;
      KVCM_ASSIGN_OR_RETURN(param.name, ExpectName());
      if (IsOp("=")) {
        Next();
        KVCM_ASSIGN_OR_RETURN(param.default_value, ParseExpression(true));
      } else {
        for (const MacroParam& p : stmt->params) {
          if (p.default_value != nullptr) {
            return SyntaxError(Cur().pos, "non-default argument follows default argument");
          }
        }
      }
      stmt->params.push_back(std::move(param));
    }
    Next();
    KVCM_RETURN_IF_ERROR(ExpectBlockEnd());
    std::string end;
    const int saved_loops = loop_depth_;
    loop_depth_ = 0;
    absl::Status s = ParseBody(stmt->body, {"endmacro"}, "macro", pos, end);
    loop_depth_ = saved_loops;
    KVCM_RETURN_IF_ERROR(s);
    if (Cur().type == Tok::kName) Next();  // {% endmacro name %}
    KVCM_RETURN_IF_ERROR(ExpectBlockEnd());
    return StmtPtr(std::move(stmt));
  }

  // ----- expressions

  static ExprPtr Make(Expr::Kind kind, Position pos) {
    return std::make_unique<Expr>(kind, pos);
  }
  static std::unique_ptr<Expr> MakeMutable(Expr::Kind kind, Position pos) {
    return std::make_unique<Expr>(kind, pos);
  }

  // An expression, or several separated by commas as a tuple (`{{ a, b }}`, `for x in a, b`).
  absl::StatusOr<ExprPtr> ParseTupleExpr(bool with_condexpr) {
    const Position pos = Cur().pos;
    KVCM_ASSIGN_OR_RETURN(ExprPtr first, ParseExpression(with_condexpr));
    if (!IsOp(",")) return first;
    auto tuple = MakeMutable(Expr::Kind::kTuple, pos);
    tuple->args.push_back(std::move(first));
    while (IsOp(",")) {
      Next();
      if (Cur().type == Tok::kBlockEnd || Cur().type == Tok::kVarEnd || IsOp(")")) break;
      KVCM_ASSIGN_OR_RETURN(ExprPtr next, ParseExpression(with_condexpr));
      tuple->args.push_back(std::move(next));
    }
    return ExprPtr(std::move(tuple));
  }

  absl::StatusOr<ExprPtr> ParseExpression(bool with_condexpr) {
    DepthGuard guard(depth_);
    KVCM_RETURN_IF_ERROR(CheckDepth());
    if (!with_condexpr) return ParseOr();
    KVCM_ASSIGN_OR_RETURN(ExprPtr expr, ParseOr());
    while (IsName("if")) {
      const Position pos = Cur().pos;
      Next();
      KVCM_ASSIGN_OR_RETURN(ExprPtr test, ParseOr());
      ExprPtr otherwise;
      if (IsName("else")) {
        Next();
        KVCM_ASSIGN_OR_RETURN(otherwise, ParseExpression(true));
      }
      auto cond = MakeMutable(Expr::Kind::kCondition, pos);
      cond->a = std::move(expr);
      cond->b = std::move(test);
      cond->c = std::move(otherwise);
      expr = std::move(cond);
    }
    return expr;
  }

  absl::StatusOr<ExprPtr> Binary(std::string op, Position pos, ExprPtr a, ExprPtr b) {
    auto e = MakeMutable(Expr::Kind::kBinary, pos);
    e->name = std::move(op);
    e->a = std::move(a);
    e->b = std::move(b);
    return ExprPtr(std::move(e));
  }

  absl::StatusOr<ExprPtr> ParseOr() {
    KVCM_ASSIGN_OR_RETURN(ExprPtr left, ParseAnd());
    while (IsName("or")) {
      const Position pos = Cur().pos;
      Next();
      KVCM_ASSIGN_OR_RETURN(ExprPtr right, ParseAnd());
      KVCM_ASSIGN_OR_RETURN(left, Binary("or", pos, std::move(left), std::move(right)));
    }
    return left;
  }

  absl::StatusOr<ExprPtr> ParseAnd() {
    KVCM_ASSIGN_OR_RETURN(ExprPtr left, ParseNot());
    while (IsName("and")) {
      const Position pos = Cur().pos;
      Next();
      KVCM_ASSIGN_OR_RETURN(ExprPtr right, ParseNot());
      KVCM_ASSIGN_OR_RETURN(left, Binary("and", pos, std::move(left), std::move(right)));
    }
    return left;
  }

  absl::StatusOr<ExprPtr> ParseNot() {
    if (IsName("not")) {
      const Position pos = Cur().pos;
      Next();
      DepthGuard guard(depth_);
      KVCM_RETURN_IF_ERROR(CheckDepth());
      KVCM_ASSIGN_OR_RETURN(ExprPtr operand, ParseNot());
      auto e = MakeMutable(Expr::Kind::kUnary, pos);
      e->name = "not";
      e->a = std::move(operand);
      return ExprPtr(std::move(e));
    }
    return ParseCompare();
  }

  absl::StatusOr<ExprPtr> ParseCompare() {
    const Position pos = Cur().pos;
    KVCM_ASSIGN_OR_RETURN(ExprPtr first, ParseMath1());
    std::unique_ptr<Expr> cmp;
    while (true) {
      std::string op;
      if (Cur().type == Tok::kOp &&
          (Cur().text == "==" || Cur().text == "!=" || Cur().text == "<" || Cur().text == "<=" ||
           Cur().text == ">" || Cur().text == ">=")) {
        op = Cur().text;
        Next();
      } else if (IsName("in")) {
        op = "in";
        Next();
      } else if (IsName("not") && Peek().type == Tok::kName && Peek().text == "in") {
        op = "notin";
        Next();
        Next();
      } else {
        break;
      }
      if (cmp == nullptr) {
        cmp = MakeMutable(Expr::Kind::kCompare, pos);
        cmp->args.push_back(std::move(first));
      }
      KVCM_ASSIGN_OR_RETURN(ExprPtr next, ParseMath1());
      cmp->ops.push_back(std::move(op));
      cmp->args.push_back(std::move(next));
    }
    if (cmp == nullptr) return first;
    return ExprPtr(std::move(cmp));
  }

  absl::StatusOr<ExprPtr> ParseMath1() {
    KVCM_ASSIGN_OR_RETURN(ExprPtr left, ParseConcat());
    while (IsOp("+") || IsOp("-")) {
      const std::string op = Cur().text;
      const Position pos = Cur().pos;
      Next();
      KVCM_ASSIGN_OR_RETURN(ExprPtr right, ParseConcat());
      KVCM_ASSIGN_OR_RETURN(left, Binary(op, pos, std::move(left), std::move(right)));
    }
    return left;
  }

  absl::StatusOr<ExprPtr> ParseConcat() {
    KVCM_ASSIGN_OR_RETURN(ExprPtr left, ParseMath2());
    while (IsOp("~")) {
      const Position pos = Cur().pos;
      Next();
      KVCM_ASSIGN_OR_RETURN(ExprPtr right, ParseMath2());
      KVCM_ASSIGN_OR_RETURN(left, Binary("~", pos, std::move(left), std::move(right)));
    }
    return left;
  }

  absl::StatusOr<ExprPtr> ParseMath2() {
    KVCM_ASSIGN_OR_RETURN(ExprPtr left, ParsePow());
    while (IsOp("*") || IsOp("/") || IsOp("//") || IsOp("%")) {
      const std::string op = Cur().text;
      const Position pos = Cur().pos;
      Next();
      KVCM_ASSIGN_OR_RETURN(ExprPtr right, ParsePow());
      KVCM_ASSIGN_OR_RETURN(left, Binary(op, pos, std::move(left), std::move(right)));
    }
    return left;
  }

  absl::StatusOr<ExprPtr> ParsePow() {
    KVCM_ASSIGN_OR_RETURN(ExprPtr left, ParseUnary(true));
    while (IsOp("**")) {
      const Position pos = Cur().pos;
      Next();
      KVCM_ASSIGN_OR_RETURN(ExprPtr right, ParseUnary(true));
      KVCM_ASSIGN_OR_RETURN(left, Binary("**", pos, std::move(left), std::move(right)));
    }
    return left;
  }

  absl::StatusOr<ExprPtr> ParseUnary(bool with_filter) {
    DepthGuard guard(depth_);
    KVCM_RETURN_IF_ERROR(CheckDepth());
    ExprPtr node;
    if (IsOp("-") || IsOp("+")) {
      const std::string op = Cur().text;
      const Position pos = Cur().pos;
      Next();
      KVCM_ASSIGN_OR_RETURN(ExprPtr operand, ParseUnary(false));
      auto e = MakeMutable(Expr::Kind::kUnary, pos);
      e->name = op;
      e->a = std::move(operand);
      node = std::move(e);
    } else {
      KVCM_ASSIGN_OR_RETURN(node, ParsePrimary());
    }
    KVCM_ASSIGN_OR_RETURN(node, ParsePostfix(std::move(node)));
    if (with_filter) {
      KVCM_ASSIGN_OR_RETURN(node, ParseFilterExpr(std::move(node)));
    }
    return node;
  }

  absl::StatusOr<ExprPtr> ParsePrimary() {
    const Token& t = Cur();
    const Position pos = t.pos;
    switch (t.type) {
      case Tok::kName: {
        auto e = MakeMutable(Expr::Kind::kLiteral, pos);
        if (t.text == "true" || t.text == "True") {
          e->value = Value::Bool(true);
        } else if (t.text == "false" || t.text == "False") {
          e->value = Value::Bool(false);
        } else if (t.text == "none" || t.text == "None") {
          e->value = Value::None();
        } else {
          e->kind = Expr::Kind::kName;
          e->name = t.text;
        }
        Next();
        return ExprPtr(std::move(e));
      }
      case Tok::kString: {
        std::string s = t.text;
        Next();
        while (Cur().type == Tok::kString) {
          s += Cur().text;
          Next();
        }
        auto e = MakeMutable(Expr::Kind::kLiteral, pos);
        e->value = Value::String(std::move(s));
        return ExprPtr(std::move(e));
      }
      case Tok::kInt:
      case Tok::kFloat: {
        auto e = MakeMutable(Expr::Kind::kLiteral, pos);
        e->value = t.type == Tok::kInt ? Value::Int(t.int_value) : Value::Float(t.float_value);
        Next();
        return ExprPtr(std::move(e));
      }
      case Tok::kOp: {
        if (t.text == "(") {
          Next();
          if (IsOp(")")) {
            Next();
            return ExprPtr(MakeMutable(Expr::Kind::kTuple, pos));
          }
          KVCM_ASSIGN_OR_RETURN(ExprPtr first, ParseExpression(true));
          if (IsOp(")")) {
            Next();
            return first;
          }
          auto tuple = MakeMutable(Expr::Kind::kTuple, pos);
          tuple->args.push_back(std::move(first));
          while (IsOp(",")) {
            Next();
            if (IsOp(")")) break;
            KVCM_ASSIGN_OR_RETURN(ExprPtr next, ParseExpression(true));
            tuple->args.push_back(std::move(next));
          }
          KVCM_RETURN_IF_ERROR(ExpectOp(")"));
          return ExprPtr(std::move(tuple));
        }
        if (t.text == "[") {
          Next();
          auto list = MakeMutable(Expr::Kind::kList, pos);
          while (!IsOp("]")) {
            if (!list->args.empty()) KVCM_RETURN_IF_ERROR(ExpectOp(","));
            if (IsOp("]")) break;
            KVCM_ASSIGN_OR_RETURN(ExprPtr item, ParseExpression(true));
            list->args.push_back(std::move(item));
          }
          Next();
          return ExprPtr(std::move(list));
        }
        if (t.text == "{") {
          Next();
          auto dict = MakeMutable(Expr::Kind::kDict, pos);
          while (!IsOp("}")) {
            if (!dict->args.empty()) KVCM_RETURN_IF_ERROR(ExpectOp(","));
            if (IsOp("}")) break;
            KVCM_ASSIGN_OR_RETURN(ExprPtr key, ParseExpression(true));
            KVCM_RETURN_IF_ERROR(ExpectOp(":"));
            KVCM_ASSIGN_OR_RETURN(ExprPtr value, ParseExpression(true));
            dict->args.push_back(std::move(key));
            dict->args.push_back(std::move(value));
          }
          Next();
          return ExprPtr(std::move(dict));
        }
        break;
      }
      default:
        break;
    }
    return Unexpected("an expression");
  }

  absl::StatusOr<ExprPtr> ParsePostfix(ExprPtr node) {
    while (true) {
      if (IsOp(".")) {
        const Position pos = Cur().pos;
        Next();
        if (Cur().type == Tok::kName) {
          auto e = MakeMutable(Expr::Kind::kGetAttr, pos);
          e->name = Cur().text;
          e->a = std::move(node);
          Next();
          node = std::move(e);
        } else if (Cur().type == Tok::kInt) {
          auto e = MakeMutable(Expr::Kind::kGetItem, pos);
          auto index = MakeMutable(Expr::Kind::kLiteral, Cur().pos);
          index->value = Value::Int(Cur().int_value);
          e->a = std::move(node);
          e->b = std::move(index);
          Next();
          node = std::move(e);
        } else {
          return Unexpected("an attribute name");
        }
      } else if (IsOp("[")) {
        const Position pos = Cur().pos;
        Next();
        ExprPtr parts[3];
        int part = 0;
        bool is_slice = false;
        while (!IsOp("]")) {
          if (IsOp(":")) {
            is_slice = true;
            if (++part > 2) return Unexpected("']'");
            Next();
            continue;
          }
          if (parts[part] != nullptr) return Unexpected("':' or ']'");
          KVCM_ASSIGN_OR_RETURN(parts[part], ParseExpression(true));
          if (IsOp(",")) return Unsupported(Cur().pos, "a tuple subscript");
        }
        Next();
        if (!is_slice && parts[0] == nullptr) return SyntaxError(pos, "empty subscript");
        auto e = MakeMutable(is_slice ? Expr::Kind::kSlice : Expr::Kind::kGetItem, pos);
        e->a = std::move(node);
        e->b = std::move(parts[0]);
        e->c = std::move(parts[1]);
        e->d = std::move(parts[2]);
        node = std::move(e);
      } else if (IsOp("(")) {
        KVCM_ASSIGN_OR_RETURN(node, ParseCall(std::move(node)));
      } else {
        return node;
      }
    }
  }

  absl::Status ParseCallArgs(std::vector<ExprPtr>& args, std::vector<Keyword>& keywords) {
    KVCM_RETURN_IF_ERROR(ExpectOp("("));
    bool first = true;
    while (!IsOp(")")) {
      if (!first) KVCM_RETURN_IF_ERROR(ExpectOp(","));
      first = false;
      if (IsOp(")")) break;
      if (IsOp("*") || IsOp("**")) return Unsupported(Cur().pos, "*args or **kwargs in a call");
      if (Cur().type == Tok::kName && Peek().type == Tok::kOp && Peek().text == "=") {
        Keyword kw;
        kw.name = Cur().text;
        Next();
        Next();
        KVCM_ASSIGN_OR_RETURN(kw.value, ParseExpression(true));
        keywords.push_back(std::move(kw));
      } else {
        if (!keywords.empty()) {
          return SyntaxError(Cur().pos, "positional argument follows keyword argument");
        }
        KVCM_ASSIGN_OR_RETURN(ExprPtr arg, ParseExpression(true));
        args.push_back(std::move(arg));
      }
    }
    Next();
    return absl::OkStatus();
  }

  absl::StatusOr<ExprPtr> ParseCall(ExprPtr callee) {
    auto e = MakeMutable(Expr::Kind::kCall, Cur().pos);
    e->a = std::move(callee);
    KVCM_RETURN_IF_ERROR(ParseCallArgs(e->args, e->keywords));
    return ExprPtr(std::move(e));
  }

  // `name` or `name(args)` after a '|' (node may be null: a filter block).
  absl::StatusOr<ExprPtr> ParseFilter(ExprPtr node) {
    const Position pos = Cur().pos;
    KVCM_ASSIGN_OR_RETURN(std::string name, ExpectName());
    if (!IsKnownFilter(name)) return Unsupported(pos, absl::StrCat("the filter '", name, "'"));
    auto e = MakeMutable(Expr::Kind::kFilter, pos);
    e->name = std::move(name);
    e->a = std::move(node);
    if (IsOp("(")) KVCM_RETURN_IF_ERROR(ParseCallArgs(e->args, e->keywords));
    return ExprPtr(std::move(e));
  }

  absl::StatusOr<ExprPtr> ParseFilterExpr(ExprPtr node) {
    while (true) {
      if (IsOp("|")) {
        Next();
        KVCM_ASSIGN_OR_RETURN(node, ParseFilter(std::move(node)));
      } else if (IsName("is")) {
        Next();
        auto e = MakeMutable(Expr::Kind::kTest, Cur().pos);
        if (IsName("not")) {
          e->negated = true;
          Next();
        }
        const Position pos = Cur().pos;
        std::string name;
        if (Cur().type == Tok::kName) {
          name = Cur().text;
          Next();
        } else if (IsOp("==") || IsOp("!=") || IsOp("<") || IsOp("<=") || IsOp(">") || IsOp(">=")) {
          name = Cur().text;
          Next();
        } else {
          return Unexpected("a test name");
        }
        if (name == "none" || name == "true" || name == "false" || name == "None" ||
            name == "True" || name == "False") {
          name[0] = static_cast<char>(std::tolower(static_cast<unsigned char>(name[0])));
        }
        if (!IsKnownTest(name)) return Unsupported(pos, absl::StrCat("the test '", name, "'"));
        e->name = std::move(name);
        e->a = std::move(node);
        if (IsOp("(")) {
          KVCM_RETURN_IF_ERROR(ParseCallArgs(e->args, e->keywords));
        } else if ((Cur().type == Tok::kName || Cur().type == Tok::kString ||
                    Cur().type == Tok::kInt || Cur().type == Tok::kFloat || IsOp("[") ||
                    IsOp("{")) &&
                   !IsName("else") && !IsName("or") && !IsName("and") && !IsName("if") &&
                   !IsName("not") && !IsName("in") && !IsName("is")) {
          KVCM_ASSIGN_OR_RETURN(ExprPtr arg, ParsePrimary());
          KVCM_ASSIGN_OR_RETURN(arg, ParsePostfix(std::move(arg)));
          e->args.push_back(std::move(arg));
        }
        node = std::move(e);
      } else if (IsOp("(")) {
        KVCM_ASSIGN_OR_RETURN(node, ParseCall(std::move(node)));
      } else {
        return node;
      }
    }
  }

  std::vector<Token> tokens_;
  size_t pos_ = 0;
  int depth_ = 0;
  int loop_depth_ = 0;
};

}  // namespace

absl::StatusOr<Body> ParseTemplate(std::string_view source) {
  Lexer lexer(source);
  KVCM_ASSIGN_OR_RETURN(std::vector<Token> tokens, lexer.Run());
  Parser parser(std::move(tokens));
  return parser.ParseRoot();
}

}  // namespace kvcm::jinja
