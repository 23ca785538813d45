#include "common/chat/jinja_parser.h"

#include <algorithm>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/base/status_macros.h"
#include "common/chat/jinja_lexer.h"

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

using internal::Tok;
using internal::Token;

namespace {

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
      case Tok::kEof:
        return "end of template";
      case Tok::kBlockEnd:
        return "end of statement block";
      case Tok::kVarEnd:
        return "end of print statement";
      case Tok::kString:
        return "string";
      case Tok::kInt:
      case Tok::kFloat:
        return absl::StrCat("number ", t.text);
      default:
        return absl::StrCat("'", t.text, "'");
    }
  }
  absl::Status Unexpected(std::string_view expected) const {
    return SyntaxError(Cur().pos,
                       absl::StrCat("expected ", std::string(expected), ", got ", Describe(Cur())));
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
          return SyntaxError(
              opened, absl::StrCat("unclosed '", std::string(opener), "' block: expected ", names,
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
      auto stmt =
          std::make_unique<Stmt>(name == "break" ? Stmt::Kind::kBreak : Stmt::Kind::kContinue, pos);
      KVCM_RETURN_IF_ERROR(ExpectBlockEnd());
      return StmtPtr(std::move(stmt));
    }
    static constexpr std::string_view kJinjaTags[] = {"call",    "include", "import", "from",
                                                      "extends", "block",   "with",   "autoescape",
                                                      "do",      "trans"};
    for (std::string_view tag : kJinjaTags) {
      if (name == tag) return Unsupported(name_pos, absl::StrCat("the tag '", name, "'"));
    }
    static constexpr std::string_view kEnds[] = {"endif",         "endfor",    "endset",
                                                 "endmacro",      "else",      "elif",
                                                 "endgeneration", "endfilter", "endraw"};
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

  static ExprPtr Make(Expr::Kind kind, Position pos) { return std::make_unique<Expr>(kind, pos); }
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
  KVCM_ASSIGN_OR_RETURN(std::vector<Token> tokens, internal::Lex(source));
  Parser parser(std::move(tokens));
  return parser.ParseRoot();
}

}  // namespace kvcm::jinja
