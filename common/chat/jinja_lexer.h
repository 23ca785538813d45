#pragma once
// Internal to common/chat, not part of kvcm_chat's interface: the lexer of the Jinja subset
// (jinja_lexer.cc), which turns template source into the tokens the parser
// (jinja_parser.cc) reads, applying the whitespace rules jinja_parser.h describes (newlines
// normalised, the trailing newline dropped, trim_blocks, lstrip_blocks, `{%-`/`-%}`) and
// keeping `{% raw %}` text as data.

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "common/chat/jinja_parser.h"

namespace kvcm::jinja::internal {

enum class Tok {
  kData,
  kVarBegin,
  kVarEnd,
  kBlockBegin,
  kBlockEnd,
  kName,
  kString,
  kInt,
  kFloat,
  kOp,
  kEof
};

struct Token {
  Token(Tok t, std::string s, Position p) : type(t), text(std::move(s)), pos(p) {}
  Tok type;
  std::string text;  // data, name, string value, operator, number spelling
  Position pos;
  int64_t int_value = 0;
  double float_value = 0;
};

// The tokens of `source`, ending with kEof; INVALID_ARGUMENT as jinja_parser.h describes.
absl::StatusOr<std::vector<Token>> Lex(std::string_view source);

}  // namespace kvcm::jinja::internal
