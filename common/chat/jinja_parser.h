#pragma once
// The lexer and parser of the Jinja subset ChatTemplate interprets (common/chat/chat_template.h):
// template source -> a tree of statements and expressions, with the whitespace rules
// transformers renders with (trim_blocks, lstrip_blocks, `{%-`/`-%}`, the one trailing newline
// Jinja drops, newlines normalised to "\n"). The lexer is jinja_lexer.cc (internal,
// jinja_lexer.h); the parser, jinja_parser.cc.
//
// Errors: INVALID_ARGUMENT "chat template LINE:COLUMN: ..." (columns count bytes from 1) for a
// syntax error, and for a construct outside the subset (an unknown tag, filter or test, ...)
// with the way out (docs/chat-templates.md). Nesting deeper than kMaxNesting is an error, so
// a hostile template cannot exhaust the stack.
//
// Thread safety: the tree is immutable once parsed.

#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/chat/jinja_value.h"

namespace kvcm::jinja {

inline constexpr int kMaxNesting = 200;

struct Position {
  int line = 1;
  int column = 1;
};

// "chat template L:C: what"
absl::Status SyntaxError(Position pos, std::string_view what);
// "chat template L:C: what is not supported ...; pass --chat-template FILE ..."
absl::Status Unsupported(Position pos, std::string_view what);

struct Expr;
using ExprPtr = std::unique_ptr<const Expr>;

struct Keyword {
  std::string name;
  ExprPtr value;
};

struct Expr {
  enum class Kind {
    kLiteral,    // value
    kName,       // name
    kGetAttr,    // a.name
    kGetItem,    // a[b]
    kSlice,      // a[b:c:d] (null parts are absent)
    kCall,       // a(args, keywords)
    kFilter,     // a | name(args, keywords)
    kTest,       // a is [not] name(args)
    kUnary,      // op a: "-", "+", "not"
    kBinary,     // a op b: + - * / // % ** ~ and or
    kCompare,    // a op b op c ...: == != < <= > >= in notin
    kCondition,  // a if b else c (c may be null)
    kList,       // [args]
    kTuple,      // (args)
    kDict,       // {args[0]: args[1], ...}
  };
  Expr(Kind k, Position p) : kind(k), pos(p) {}
  Kind kind;
  Position pos;
  Value value;
  std::string name;  // name, attribute, filter/test name, operator
  ExprPtr a, b, c, d;
  std::vector<ExprPtr> args;
  std::vector<Keyword> keywords;
  std::vector<std::string> ops;  // kCompare: the operators between args
  bool negated = false;          // kTest
};

struct Stmt;
using StmtPtr = std::unique_ptr<const Stmt>;
using Body = std::vector<StmtPtr>;

struct MacroParam {
  std::string name;
  ExprPtr default_value;  // may be null
};

struct Stmt {
  enum class Kind {
    kText,      // text
    kOutput,    // {{ expr }}
    kIf,        // if expr: body, else_body (elif is a nested kIf in else_body)
    kFor,       // for targets in expr [if filter]: body, else_body
    kSet,       // set targets = expr, or set ns.attr = expr
    kSetBlock,  // set name %}body{% endset
    kMacro,     // macro name(params): body
    kBreak,
    kContinue,
    kGeneration,   // generation %}body{% endgeneration (transformers' tag; renders body)
    kFilterBlock,  // filter name(args) %}body{% endfilter
  };
  Stmt(Kind k, Position p) : kind(k), pos(p) {}
  Kind kind;
  Position pos;
  std::string text;
  ExprPtr expr;
  ExprPtr filter;                    // kFor's if
  std::vector<std::string> targets;  // kFor, kSet names; kSet ns: {ns, attr} with attr_set
  bool attr_set = false;
  std::vector<MacroParam> params;
  Body body;
  Body else_body;
};

// Parses `source`; the root body.
absl::StatusOr<Body> ParseTemplate(std::string_view source);

// Whether `name` is a filter / test the interpreter implements (the parser rejects others,
// as Jinja does at compile time).
bool IsKnownFilter(std::string_view name);
bool IsKnownTest(std::string_view name);

}  // namespace kvcm::jinja
