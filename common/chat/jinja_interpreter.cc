// The interpreter proper (common/chat/jinja_interpreter.h): statements, expressions,
// operators, calls and the lookups in the tables of builtins, which jinja_filters.cc,
// jinja_tests.cc and jinja_methods.cc hold (shared helpers: jinja_builtins.h).
#include "common/chat/jinja_interpreter.h"

#include <algorithm>
#include <cmath>
#include <ctime>
#include <optional>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/base/status_macros.h"
#include "common/chat/jinja_builtins.h"

namespace kvcm::jinja {

using internal::Arg;
using internal::Chars;
using internal::CheckArgs;
using internal::Contains;
using internal::Entry;
using internal::FilterFn;
using internal::FindIn;
using internal::Iterate;
using internal::Less;
using internal::MethodFn;
using internal::NotSupported;
using internal::PythonAttr;
using internal::SortedByName;
using internal::TestFn;
using internal::ToIndex;
using internal::TypeError;
using internal::UndefinedError;

namespace {

template <typename T>
std::vector<T> SliceOf(const std::vector<T>& items, const Value* start_v, const Value* stop_v,
                       int64_t step) {
  const int64_t n = static_cast<int64_t>(items.size());
  auto clamp = [&](const Value* v, int64_t dflt, bool is_start) -> int64_t {
    if (v == nullptr || v->is_none()) return dflt;
    int64_t i = v->is_int() ? v->as_int() : (v->is_bool() ? v->as_bool() : 0);
    if (i < 0) i += n;
    if (step > 0) return std::clamp<int64_t>(i, 0, n);
    (void)is_start;
    return std::clamp<int64_t>(i, -1, n - 1);
  };
  std::vector<T> out;
  if (step > 0) {
    const int64_t start = clamp(start_v, 0, true);
    const int64_t stop = clamp(stop_v, n, false);
    for (int64_t i = start; i < stop; i += step) out.push_back(items[static_cast<size_t>(i)]);
  } else {
    const int64_t start = clamp(start_v, n - 1, true);
    const int64_t stop = clamp(stop_v, -1, false);
    for (int64_t i = start; i > stop; i += step) out.push_back(items[static_cast<size_t>(i)]);
  }
  return out;
}

// Python's obj[key]; nullopt on a lookup failure (KeyError, IndexError, TypeError).
std::optional<Value> PythonItem(const Value& obj, const Value& key) {
  if (obj.is_dict()) {
    if (const Value* v = obj.as_dict().Find(key)) return *v;
    return std::nullopt;
  }
  if ((obj.is_list() || obj.is_string()) && (key.is_int() || key.is_bool())) {
    int64_t i = key.is_int() ? key.as_int() : key.as_bool();
    if (obj.is_list()) {
      const auto& items = obj.as_list().items;
      const int64_t n = static_cast<int64_t>(items.size());
      if (i < 0) i += n;
      if (i < 0 || i >= n) return std::nullopt;
      return items[static_cast<size_t>(i)];
    }
    std::u32string cps = Chars(obj);
    const int64_t n = static_cast<int64_t>(cps.size());
    if (i < 0) i += n;
    if (i < 0 || i >= n) return std::nullopt;
    return Value::String(EncodeUtf8(std::u32string(1, cps[static_cast<size_t>(i)])));
  }
  return std::nullopt;
}

// obj[start:stop:step], the parts evaluated (None where left out; ints checked).
absl::StatusOr<Value> SliceValue(const Value& obj, const Value (&parts)[3]) {
  const int64_t step = parts[2].is_none() ? 1 : *ToIndex(parts[2]);
  if (step == 0) return TypeError("slice step cannot be zero");
  if (obj.is_undefined()) return UndefinedError(obj);
  if (obj.is_list()) {
    return Value::MakeList(SliceOf(obj.as_list().items, &parts[0], &parts[1], step),
                           obj.as_list().is_tuple);
  }
  if (obj.is_string()) {
    std::u32string cps = Chars(obj);
    std::vector<char32_t> v(cps.begin(), cps.end());
    std::vector<char32_t> sliced = SliceOf(v, &parts[0], &parts[1], step);
    return Value::String(EncodeUtf8(std::u32string(sliced.begin(), sliced.end())));
  }
  return Value::MakeUndefined("slice");
}

// not v, +v, -v.
absl::StatusOr<Value> UnaryOp(const std::string& op, const Value& v) {
  if (op == "not") return Value::Bool(!v.Truthy());
  if (v.is_undefined()) return UndefinedError(v);
  if (op == "+") {
    if (!v.is_number())
      return TypeError(absl::StrCat("bad operand type for unary +: '", v.TypeName(), "'"));
    return v.is_bool() ? Value::Int(v.as_bool()) : v;
  }
  if (v.is_float()) return Value::Float(-v.as_float());
  if (v.is_int() || v.is_bool()) {
    const int64_t i = v.is_int() ? v.as_int() : v.as_bool();
    if (i == INT64_MIN) return NotSupported("an integer beyond 64 bits");
    return Value::Int(-i);
  }
  return TypeError(absl::StrCat("bad operand type for unary -: '", v.TypeName(), "'"));
}

// ---- Binary operators (and/or short-circuit in EvalBinary): `a op b`, one function each.

using BinaryFn = absl::StatusOr<Value> (*)(Interpreter& in, const std::string& op, const Value& a,
                                           const Value& b);

absl::Status Defined(const Value& a, const Value& b) {
  if (a.is_undefined()) return UndefinedError(a);
  if (b.is_undefined()) return UndefinedError(b);
  return absl::OkStatus();
}

absl::Status UnsupportedOperands(const std::string& op, const Value& a, const Value& b) {
  return TypeError(absl::StrCat("unsupported operand type(s) for ", op, ": '", a.TypeName(),
                                "' and '", b.TypeName(), "'"));
}

int64_t AsInt(const Value& v) { return v.is_int() ? v.as_int() : v.as_bool(); }

absl::StatusOr<Value> CheckedInt(bool overflow, int64_t r) {
  if (overflow) return NotSupported("an integer beyond 64 bits");
  return Value::Int(r);
}

// Arithmetic on two numbers: int_op on two ints (bools count as ints), float_op otherwise.
template <typename IntOp, typename FloatOp>
absl::StatusOr<Value> Numeric(const std::string& op, const Value& a, const Value& b, IntOp int_op,
                              FloatOp float_op) {
  if (!a.is_number() || !b.is_number()) return UnsupportedOperands(op, a, b);
  if (!a.is_float() && !b.is_float()) return int_op(AsInt(a), AsInt(b));
  return float_op(a.as_double(), b.as_double());
}

// Python's floored x // y and x % y on ints.
absl::StatusOr<std::pair<int64_t, int64_t>> IntDivMod(int64_t x, int64_t y,
                                                      const char* zero_error) {
  if (y == 0) return TypeError(zero_error);
  if (x == INT64_MIN && y == -1) return NotSupported("an integer beyond 64 bits");
  int64_t q = x / y;
  int64_t m = x % y;
  if (m != 0 && ((m < 0) != (y < 0))) {
    --q;
    m += y;
  }
  return std::make_pair(q, m);
}

// Python's x % y on floats (y != 0).
double FloatMod(double x, double y) {
  double m = std::fmod(x, y);
  if (m != 0 && ((m < 0) != (y < 0))) m += y;
  return m;
}

absl::StatusOr<Value> OpConcat(Interpreter& in, const std::string&, const Value& a,
                               const Value& b) {
  std::string s = ToStr(a) + ToStr(b);
  KVCM_RETURN_IF_ERROR(in.CheckSize(s.size()));
  return Value::String(std::move(s));
}

absl::StatusOr<Value> OpAdd(Interpreter& in, const std::string& op, const Value& a,
                            const Value& b) {
  KVCM_RETURN_IF_ERROR(Defined(a, b));
  if (a.is_string() && b.is_string()) {
    std::string s = a.as_string() + b.as_string();
    KVCM_RETURN_IF_ERROR(in.CheckSize(s.size()));
    return Value::String(std::move(s));
  }
  if (a.is_list() && b.is_list() && a.as_list().is_tuple == b.as_list().is_tuple) {
    std::vector<Value> items = a.as_list().items;
    items.insert(items.end(), b.as_list().items.begin(), b.as_list().items.end());
    KVCM_RETURN_IF_ERROR(in.CheckSize(items.size() * sizeof(Value)));
    return Value::MakeList(std::move(items), a.as_list().is_tuple);
  }
  if (a.is_string()) {
    return TypeError(absl::StrCat("can only concatenate str (not \"", b.TypeName(), "\") to str"));
  }
  return Numeric(
      op, a, b,
      [](int64_t x, int64_t y) -> absl::StatusOr<Value> {
        int64_t r = 0;
        const bool overflow = __builtin_add_overflow(x, y, &r);
        return CheckedInt(overflow, r);
      },
      [](double x, double y) -> absl::StatusOr<Value> { return Value::Float(x + y); });
}

absl::StatusOr<Value> OpSub(Interpreter&, const std::string& op, const Value& a, const Value& b) {
  KVCM_RETURN_IF_ERROR(Defined(a, b));
  return Numeric(
      op, a, b,
      [](int64_t x, int64_t y) -> absl::StatusOr<Value> {
        int64_t r = 0;
        const bool overflow = __builtin_sub_overflow(x, y, &r);
        return CheckedInt(overflow, r);
      },
      [](double x, double y) -> absl::StatusOr<Value> { return Value::Float(x - y); });
}

// seq * n (or n * seq) for a str, list or tuple.
absl::StatusOr<Value> Repeat(Interpreter& in, const Value& seq, const Value& times) {
  if (!times.is_int() && !times.is_bool()) {
    return TypeError(
        absl::StrCat("can't multiply sequence by non-int of type '", times.TypeName(), "'"));
  }
  const int64_t n = std::max<int64_t>(0, AsInt(times));
  const size_t bounded_n =
      static_cast<size_t>(std::min<int64_t>(n, in.limits().max_output_bytes + 1));
  if (seq.is_string()) {
    if (n > 0 && seq.as_string().size() > 0) {
      KVCM_RETURN_IF_ERROR(in.CheckSize(bounded_n * seq.as_string().size()));
    }
    std::string s;
    for (int64_t i = 0; i < n && !seq.as_string().empty(); ++i) s += seq.as_string();
    return Value::String(std::move(s));
  }
  if (n > 0 && !seq.as_list().items.empty()) {
    KVCM_RETURN_IF_ERROR(in.CheckSize(bounded_n * seq.as_list().items.size() * sizeof(Value)));
  }
  std::vector<Value> items;
  for (int64_t i = 0; i < n; ++i) {
    items.insert(items.end(), seq.as_list().items.begin(), seq.as_list().items.end());
  }
  return Value::MakeList(std::move(items), seq.as_list().is_tuple);
}

absl::StatusOr<Value> OpMul(Interpreter& in, const std::string& op, const Value& a,
                            const Value& b) {
  KVCM_RETURN_IF_ERROR(Defined(a, b));
  const bool a_seq = a.is_string() || a.is_list();
  const bool b_seq = b.is_string() || b.is_list();
  if (a_seq != b_seq) return a_seq ? Repeat(in, a, b) : Repeat(in, b, a);
  return Numeric(
      op, a, b,
      [](int64_t x, int64_t y) -> absl::StatusOr<Value> {
        int64_t r = 0;
        const bool overflow = __builtin_mul_overflow(x, y, &r);
        return CheckedInt(overflow, r);
      },
      [](double x, double y) -> absl::StatusOr<Value> { return Value::Float(x * y); });
}

absl::StatusOr<Value> OpDiv(Interpreter&, const std::string& op, const Value& a, const Value& b) {
  KVCM_RETURN_IF_ERROR(Defined(a, b));
  return Numeric(
      op, a, b,
      [](int64_t x, int64_t y) -> absl::StatusOr<Value> {
        if (y == 0) return TypeError("division by zero");
        return Value::Float(static_cast<double>(x) / static_cast<double>(y));
      },
      [](double x, double y) -> absl::StatusOr<Value> {
        if (y == 0) return TypeError("float division by zero");
        return Value::Float(x / y);
      });
}

absl::StatusOr<Value> OpFloorDiv(Interpreter&, const std::string& op, const Value& a,
                                 const Value& b) {
  KVCM_RETURN_IF_ERROR(Defined(a, b));
  return Numeric(
      op, a, b,
      [](int64_t x, int64_t y) -> absl::StatusOr<Value> {
        KVCM_ASSIGN_OR_RETURN(auto qm, IntDivMod(x, y, "integer division or modulo by zero"));
        return Value::Int(qm.first);
      },
      [](double x, double y) -> absl::StatusOr<Value> {
        if (y == 0) return TypeError("float floor division by zero");
        const double div = (x - FloatMod(x, y)) / y;
        double floordiv = std::floor(div);
        if (div - floordiv > 0.5) floordiv += 1.0;
        return Value::Float(floordiv);
      });
}

absl::StatusOr<Value> OpMod(Interpreter&, const std::string& op, const Value& a, const Value& b) {
  KVCM_RETURN_IF_ERROR(Defined(a, b));
  if (a.is_string()) return NotSupported("printf-style string formatting with '%'");
  return Numeric(
      op, a, b,
      [](int64_t x, int64_t y) -> absl::StatusOr<Value> {
        KVCM_ASSIGN_OR_RETURN(auto qm, IntDivMod(x, y, "integer modulo by zero"));
        return Value::Int(qm.second);
      },
      [](double x, double y) -> absl::StatusOr<Value> {
        if (y == 0) return TypeError("float modulo");
        return Value::Float(FloatMod(x, y));
      });
}

absl::StatusOr<Value> OpPow(Interpreter& in, const std::string& op, const Value& a,
                            const Value& b) {
  KVCM_RETURN_IF_ERROR(Defined(a, b));
  return Numeric(
      op, a, b,
      [&in](int64_t x, int64_t y) -> absl::StatusOr<Value> {
        if (y < 0) return Value::Float(std::pow(static_cast<double>(x), static_cast<double>(y)));
        int64_t result = 1;
        for (int64_t i = 0; i < y; ++i) {
          if (__builtin_mul_overflow(result, x, &result))
            return NotSupported("an integer beyond 64 bits");
          if (result == 0 || result == 1) break;
          KVCM_RETURN_IF_ERROR(in.Charge(1));
        }
        if (result == 1 && x == -1 && y % 2 == 1) result = -1;
        return Value::Int(result);
      },
      [](double x, double y) -> absl::StatusOr<Value> { return Value::Float(std::pow(x, y)); });
}

constexpr Entry<BinaryFn> kBinaryOps[] = {
    {"%", OpMod}, {"*", OpMul}, {"**", OpPow},      {"+", OpAdd},
    {"-", OpSub}, {"/", OpDiv}, {"//", OpFloorDiv}, {"~", OpConcat},
};
static_assert(SortedByName(kBinaryOps));

}  // namespace

absl::StatusOr<Value> GetAttr(const Value& obj, const std::string& name) {
  if (obj.is_undefined()) return UndefinedError(obj);
  if (std::optional<Value> v = PythonAttr(obj, name)) return *v;
  if (std::optional<Value> v = PythonItem(obj, Value::String(name))) return *v;
  return Value::MakeUndefined(name);
}

absl::StatusOr<Value> GetItem(const Value& obj, const Value& key) {
  if (obj.is_undefined()) return UndefinedError(obj);
  if (std::optional<Value> v = PythonItem(obj, key)) return *v;
  if (key.is_string()) {
    if (std::optional<Value> v = PythonAttr(obj, key.as_string())) return *v;
  }
  return Value::MakeUndefined(key.is_string() ? key.as_string() : Repr(key));
}

Interpreter::Interpreter(const RenderLimits& limits, Dict context)
    : limits_(limits), context_(std::move(context)) {
  builtins_["raise_exception"] = Value::MakeCallable(
      "raise_exception", [](Interpreter& in, CallArgs& args) -> absl::StatusOr<Value> {
        const Value* msg = Arg(args, 0, "message");
        return in.Raise(msg == nullptr ? std::string() : ToStr(*msg));
      });
  builtins_["strftime_now"] = Value::MakeCallable(
      "strftime_now", [](Interpreter&, CallArgs& args) -> absl::StatusOr<Value> {
        const Value* fmt = Arg(args, 0, "format");
        if (fmt == nullptr || !fmt->is_string())
          return TypeError("strftime_now() needs a format string");
        const std::time_t now = std::time(nullptr);
        std::tm tm{};
        localtime_r(&now, &tm);
        char buf[512];
        const size_t n = std::strftime(buf, sizeof(buf), fmt->as_string().c_str(), &tm);
        return Value::String(std::string(buf, n));
      });
  builtins_["range"] =
      Value::MakeCallable("range", [](Interpreter& in, CallArgs& args) -> absl::StatusOr<Value> {
        KVCM_RETURN_IF_ERROR(CheckArgs(args, 3, {}, "range"));
        std::vector<int64_t> n;
        for (const Value& v : args.positional) {
          if (!v.is_int() && !v.is_bool()) {
            return TypeError(
                absl::StrCat("'", v.TypeName(), "' object cannot be interpreted as an integer"));
          }
          n.push_back(v.is_int() ? v.as_int() : v.as_bool());
        }
        if (n.empty()) return TypeError("range expected at least 1 argument, got 0");
        const int64_t start = n.size() == 1 ? 0 : n[0];
        const int64_t stop = n.size() == 1 ? n[0] : n[1];
        const int64_t step = n.size() == 3 ? n[2] : 1;
        if (step == 0) return TypeError("range() arg 3 must not be zero");
        std::vector<Value> items;
        for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
          KVCM_RETURN_IF_ERROR(in.Charge(1));
          items.push_back(Value::Int(i));
        }
        return Value::MakeList(std::move(items));
      });
  builtins_["dict"] =
      Value::MakeCallable("dict", [](Interpreter&, CallArgs& args) -> absl::StatusOr<Value> {
        Dict dict;
        if (args.positional.size() > 1) return TypeError("dict expected at most 1 argument");
        if (!args.positional.empty()) {
          const Value& src = args.positional[0];
          if (src.is_dict()) {
            dict = src.as_dict();
          } else {
            KVCM_ASSIGN_OR_RETURN(std::vector<Value> pairs, Iterate(src));
            for (const Value& p : pairs) {
              if (!p.is_list() || p.as_list().items.size() != 2) {
                return TypeError("dictionary update sequence element has the wrong length");
              }
              dict.Set(p.as_list().items[0], p.as_list().items[1]);
            }
          }
        }
        for (auto& [k, v] : args.keyword) dict.Set(Value::String(k), v);
        return Value::MakeDict(std::move(dict));
      });
  builtins_["namespace"] =
      Value::MakeCallable("namespace", [](Interpreter&, CallArgs& args) -> absl::StatusOr<Value> {
        Dict attrs;
        if (args.positional.size() > 1) return TypeError("namespace expected at most 1 argument");
        if (!args.positional.empty()) {
          if (!args.positional[0].is_dict()) return TypeError("namespace() takes a mapping");
          attrs = args.positional[0].as_dict();
        }
        for (auto& [k, v] : args.keyword) attrs.Set(Value::String(k), v);
        for (const auto& [k, v] : attrs.items) {
          if (k.is_string() && absl::StartsWith(k.as_string(), "_")) {
            return TypeError(
                absl::StrCat("Chat templates cannot store underscore-prefixed attributes on a "
                             "namespace, but got ",
                             StringRepr(k.as_string()), ". Please rename the attribute."));
          }
        }
        return Value::MakeNamespace(std::move(attrs));
      });
  for (const char* name : {"lipsum", "cycler", "joiner"}) {
    const std::string what = absl::StrCat("the function '", name, "'");
    builtins_[name] = Value::MakeCallable(
        name,
        [what](Interpreter&, CallArgs&) -> absl::StatusOr<Value> { return NotSupported(what); });
  }
}

absl::Status Interpreter::Charge(int64_t steps) {
  steps_ += steps;
  if (steps_ > limits_.max_steps) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "chat template: rendering took more than ", limits_.max_steps,
        " steps (a loop that does not end, or a template too costly for this conversation)"));
  }
  return absl::OkStatus();
}

absl::Status Interpreter::CheckSize(size_t bytes) {
  if (static_cast<int64_t>(bytes) > limits_.max_output_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "chat template: a rendered text or string grew past ", limits_.max_output_bytes, " bytes"));
  }
  return Charge(static_cast<int64_t>(bytes / 256));
}

absl::Status Interpreter::Raise(std::string message) {
  raised_ = true;
  return absl::InvalidArgumentError(std::move(message));
}

absl::Status Interpreter::At(const Expr& expr, absl::Status status) const {
  if (status.ok() || raised_ || status.code() == absl::StatusCode::kResourceExhausted ||
      absl::StartsWith(status.message(), "chat template ")) {
    return status;
  }
  return absl::Status(status.code(),
                      absl::StrCat("chat template ", expr.pos.line, ":", expr.pos.column, ": ",
                                   std::string(status.message())));
}

absl::StatusOr<std::string> Interpreter::Render(const Body& body) {
  frames_.clear();
  frames_.emplace_back();
  std::string out;
  absl::StatusOr<Flow> flow = ExecBody(body, out);
  if (!flow.ok()) return flow.status();
  return out;
}

Value Interpreter::Lookup(const std::string& name) const {
  for (auto it = frames_.rbegin(); it != frames_.rend(); ++it) {
    auto found = it->find(name);
    if (found != it->end()) return found->second;
  }
  if (const Value* v = context_.Find(name)) return *v;
  auto found = builtins_.find(name);
  if (found != builtins_.end()) return found->second;
  return Value::MakeUndefined(name);
}

absl::StatusOr<Interpreter::Flow> Interpreter::ExecBody(const Body& body, std::string& out) {
  for (const StmtPtr& stmt : body) {
    KVCM_ASSIGN_OR_RETURN(Flow flow, Exec(*stmt, out));
    if (flow != Flow::kNormal) return flow;
  }
  return Flow::kNormal;
}

absl::StatusOr<Interpreter::Flow> Interpreter::Exec(const Stmt& stmt, std::string& out) {
  KVCM_RETURN_IF_ERROR(Charge(1));
  switch (stmt.kind) {
    case Stmt::Kind::kText:
      out += stmt.text;
      KVCM_RETURN_IF_ERROR(CheckSize(out.size()));
      return Flow::kNormal;
    case Stmt::Kind::kOutput: {
      KVCM_ASSIGN_OR_RETURN(Value v, Eval(*stmt.expr));
      out += ToStr(v);
      KVCM_RETURN_IF_ERROR(CheckSize(out.size()));
      return Flow::kNormal;
    }
    case Stmt::Kind::kIf: {
      KVCM_ASSIGN_OR_RETURN(Value v, Eval(*stmt.expr));
      return ExecBody(v.Truthy() ? stmt.body : stmt.else_body, out);
    }
    case Stmt::Kind::kFor:
      return ExecFor(stmt, out);
    case Stmt::Kind::kSet: {
      KVCM_ASSIGN_OR_RETURN(Value v, Eval(*stmt.expr));
      KVCM_RETURN_IF_ERROR(Assign(stmt, std::move(v)));
      return Flow::kNormal;
    }
    case Stmt::Kind::kSetBlock: {
      std::string captured;
      KVCM_RETURN_IF_ERROR(ExecBody(stmt.body, captured).status());
      KVCM_RETURN_IF_ERROR(Assign(stmt, Value::String(std::move(captured))));
      return Flow::kNormal;
    }
    case Stmt::Kind::kMacro: {
      const Stmt* macro = &stmt;
      frames_.back()[stmt.text] = Value::MakeCallable(
          stmt.text,
          [macro](Interpreter& in, CallArgs& args) { return in.CallMacro(*macro, args); });
      return Flow::kNormal;
    }
    case Stmt::Kind::kBreak:
      return Flow::kBreak;
    case Stmt::Kind::kContinue:
      return Flow::kContinue;
    case Stmt::Kind::kGeneration:
      return ExecBody(stmt.body, out);
    case Stmt::Kind::kFilterBlock: {
      std::string captured;
      KVCM_RETURN_IF_ERROR(ExecBody(stmt.body, captured).status());
      KVCM_ASSIGN_OR_RETURN(CallArgs args, EvalArgs(*stmt.expr));
      absl::StatusOr<Value> v =
          ApplyFilter(stmt.expr->name, Value::String(std::move(captured)), args);
      if (!v.ok()) return At(*stmt.expr, v.status());
      out += ToStr(*v);
      KVCM_RETURN_IF_ERROR(CheckSize(out.size()));
      return Flow::kNormal;
    }
  }
  return Flow::kNormal;
}

absl::Status Interpreter::Assign(const Stmt& stmt, Value value) {
  const auto error_at = [&stmt](std::string msg) { return SyntaxError(stmt.pos, msg); };
  if (stmt.attr_set) {
    Value target = Lookup(stmt.targets[0]);
    if (!target.is_namespace()) {
      return error_at("cannot assign attribute on non-namespace object");
    }
    if (absl::StartsWith(stmt.targets[1], "_")) {
      return error_at(absl::StrCat(
          "Chat templates cannot store underscore-prefixed attributes on a namespace, but got ",
          StringRepr(stmt.targets[1]), ". Please rename the attribute."));
    }
    target.as_namespace().attrs.Set(Value::String(stmt.targets[1]), std::move(value));
    return absl::OkStatus();
  }
  if (stmt.targets.size() == 1) {
    frames_.back()[stmt.targets[0]] = std::move(value);
    return absl::OkStatus();
  }
  absl::StatusOr<std::vector<Value>> items = Iterate(value);
  if (!items.ok()) return error_at(std::string(items.status().message()));
  if (items->size() != stmt.targets.size()) {
    return error_at(absl::StrCat("cannot unpack ", items->size(), " values into ",
                                 stmt.targets.size(), " names"));
  }
  for (size_t i = 0; i < items->size(); ++i) frames_.back()[stmt.targets[i]] = (*items)[i];
  return absl::OkStatus();
}

absl::StatusOr<Interpreter::Flow> Interpreter::ExecFor(const Stmt& stmt, std::string& out) {
  KVCM_ASSIGN_OR_RETURN(Value iterable, Eval(*stmt.expr));
  absl::StatusOr<std::vector<Value>> all = Iterate(iterable);
  if (!all.ok()) return At(*stmt.expr, all.status());
  auto bind = [&](Frame& frame, const Value& item) -> absl::Status {
    if (stmt.targets.size() == 1) {
      frame[stmt.targets[0]] = item;
      return absl::OkStatus();
    }
    absl::StatusOr<std::vector<Value>> parts = Iterate(item);
    if (!parts.ok()) return SyntaxError(stmt.pos, std::string(parts.status().message()));
    if (parts->size() != stmt.targets.size()) {
      return SyntaxError(stmt.pos, absl::StrCat("cannot unpack ", parts->size(), " values into ",
                                                stmt.targets.size(), " loop variables"));
    }
    for (size_t i = 0; i < parts->size(); ++i) frame[stmt.targets[i]] = (*parts)[i];
    return absl::OkStatus();
  };
  std::vector<Value> items;
  if (stmt.filter != nullptr) {
    for (const Value& item : *all) {
      KVCM_RETURN_IF_ERROR(Charge(1));
      frames_.emplace_back();
      absl::Status s = bind(frames_.back(), item);
      absl::StatusOr<Value> keep = s.ok() ? Eval(*stmt.filter) : absl::StatusOr<Value>(s);
      frames_.pop_back();
      if (!keep.ok()) return keep.status();
      if (keep->Truthy()) items.push_back(item);
    }
  } else {
    items = std::move(*all);
  }
  if (items.empty()) return ExecBody(stmt.else_body, out);
  const int64_t n = static_cast<int64_t>(items.size());
  for (int64_t i = 0; i < n; ++i) {
    KVCM_RETURN_IF_ERROR(Charge(1));
    Frame frame;
    KVCM_RETURN_IF_ERROR(bind(frame, items[static_cast<size_t>(i)]));
    Dict loop;
    loop.Set(Value::String("index"), Value::Int(i + 1));
    loop.Set(Value::String("index0"), Value::Int(i));
    loop.Set(Value::String("revindex"), Value::Int(n - i));
    loop.Set(Value::String("revindex0"), Value::Int(n - i - 1));
    loop.Set(Value::String("first"), Value::Bool(i == 0));
    loop.Set(Value::String("last"), Value::Bool(i == n - 1));
    loop.Set(Value::String("length"), Value::Int(n));
    loop.Set(Value::String("depth"), Value::Int(1));
    loop.Set(Value::String("depth0"), Value::Int(0));
    if (i > 0) loop.Set(Value::String("previtem"), items[static_cast<size_t>(i - 1)]);
    if (i + 1 < n) loop.Set(Value::String("nextitem"), items[static_cast<size_t>(i + 1)]);
    loop.Set(
        Value::String("cycle"),
        Value::MakeCallable("cycle", [i](Interpreter&, CallArgs& args) -> absl::StatusOr<Value> {
          if (args.positional.empty()) return TypeError("no items for cycling given");
          return args.positional[static_cast<size_t>(i) % args.positional.size()];
        }));
    frame["loop"] = Value::MakeDict(std::move(loop));
    frames_.push_back(std::move(frame));
    absl::StatusOr<Flow> flow = ExecBody(stmt.body, out);
    frames_.pop_back();
    if (!flow.ok()) return flow.status();
    if (*flow == Flow::kBreak) break;
  }
  return Flow::kNormal;
}

absl::StatusOr<Value> Interpreter::CallMacro(const Stmt& macro, CallArgs& args) {
  if (call_depth_ >= limits_.max_call_depth) {
    return absl::ResourceExhaustedError(
        absl::StrCat("chat template ", macro.pos.line, ":", macro.pos.column,
                     ": macro calls nested deeper than ", limits_.max_call_depth));
  }
  if (args.positional.size() > macro.params.size()) {
    return TypeError(absl::StrCat("macro '", macro.text, "' takes not more than ",
                                  macro.params.size(), " argument(s)"));
  }
  Frame frame;
  for (size_t i = 0; i < macro.params.size(); ++i) {
    const MacroParam& p = macro.params[i];
    if (const Value* v = Arg(args, i, p.name)) {
      frame[p.name] = *v;
    } else if (p.default_value != nullptr) {
      KVCM_ASSIGN_OR_RETURN(frame[p.name], Eval(*p.default_value));
    } else {
      frame[p.name] = Value::MakeUndefined(p.name);
    }
  }
  for (const auto& [k, v] : args.keyword) {
    bool known = false;
    for (const MacroParam& p : macro.params) known = known || p.name == k;
    if (!known)
      return TypeError(
          absl::StrCat("macro '", macro.text, "' takes no keyword argument '", k, "'"));
  }
  // The macro sees the template's top level and its arguments.
  std::vector<Frame> saved(std::make_move_iterator(frames_.begin() + 1),
                           std::make_move_iterator(frames_.end()));
  frames_.resize(1);
  frames_.push_back(std::move(frame));
  ++call_depth_;
  std::string out;
  absl::StatusOr<Flow> flow = ExecBody(macro.body, out);
  --call_depth_;
  frames_.resize(1);
  for (Frame& f : saved) frames_.push_back(std::move(f));
  if (!flow.ok()) return flow.status();
  return Value::String(std::move(out));
}

absl::StatusOr<CallArgs> Interpreter::EvalArgs(const Expr& expr) {
  CallArgs args;
  for (const ExprPtr& a : expr.args) {
    KVCM_ASSIGN_OR_RETURN(Value v, Eval(*a));
    args.positional.push_back(std::move(v));
  }
  for (const Keyword& kw : expr.keywords) {
    KVCM_ASSIGN_OR_RETURN(Value v, Eval(*kw.value));
    args.keyword.emplace_back(kw.name, std::move(v));
  }
  return args;
}

absl::StatusOr<Value> Interpreter::CallValue(const Value& callee, CallArgs& args) {
  if (callee.is_undefined()) return UndefinedError(callee);
  if (!callee.is_callable())
    return TypeError(absl::StrCat("'", callee.TypeName(), "' object is not callable"));
  return callee.as_callable().fn(*this, args);
}

absl::StatusOr<Value> Interpreter::Eval(const Expr& expr) {
  KVCM_RETURN_IF_ERROR(Charge(1));
  absl::StatusOr<Value> v = EvalInner(expr);
  if (!v.ok()) return At(expr, v.status());
  return v;
}

absl::StatusOr<Value> Interpreter::EvalInner(const Expr& expr) {
  switch (expr.kind) {
    case Expr::Kind::kLiteral:
      return expr.value;
    case Expr::Kind::kName:
      return Lookup(expr.name);
    case Expr::Kind::kGetAttr: {
      KVCM_ASSIGN_OR_RETURN(Value obj, Eval(*expr.a));
      return GetAttr(obj, expr.name);
    }
    case Expr::Kind::kGetItem: {
      KVCM_ASSIGN_OR_RETURN(Value obj, Eval(*expr.a));
      KVCM_ASSIGN_OR_RETURN(Value key, Eval(*expr.b));
      return GetItem(obj, key);
    }
    case Expr::Kind::kSlice: {
      KVCM_ASSIGN_OR_RETURN(Value obj, Eval(*expr.a));
      Value parts[3];
      const Expr* exprs[3] = {expr.b.get(), expr.c.get(), expr.d.get()};
      for (int i = 0; i < 3; ++i) {
        if (exprs[i] != nullptr) {
          KVCM_ASSIGN_OR_RETURN(parts[i], Eval(*exprs[i]));
          if (!parts[i].is_none()) KVCM_RETURN_IF_ERROR(ToIndex(parts[i]).status());
        } else {
          parts[i] = Value::None();
        }
      }
      return SliceValue(obj, parts);
    }
    case Expr::Kind::kCall: {
      KVCM_ASSIGN_OR_RETURN(Value callee, Eval(*expr.a));
      KVCM_ASSIGN_OR_RETURN(CallArgs args, EvalArgs(expr));
      return CallValue(callee, args);
    }
    case Expr::Kind::kFilter: {
      KVCM_ASSIGN_OR_RETURN(Value input, Eval(*expr.a));
      KVCM_ASSIGN_OR_RETURN(CallArgs args, EvalArgs(expr));
      return ApplyFilter(expr.name, input, args);
    }
    case Expr::Kind::kTest: {
      KVCM_ASSIGN_OR_RETURN(Value input, Eval(*expr.a));
      KVCM_ASSIGN_OR_RETURN(CallArgs args, EvalArgs(expr));
      KVCM_ASSIGN_OR_RETURN(bool result, ApplyTest(expr.name, input, args));
      return Value::Bool(result != expr.negated);
    }
    case Expr::Kind::kUnary: {
      KVCM_ASSIGN_OR_RETURN(Value v, Eval(*expr.a));
      return UnaryOp(expr.name, v);
    }
    case Expr::Kind::kBinary:
      return EvalBinary(expr);
    case Expr::Kind::kCompare:
      return EvalCompare(expr);
    case Expr::Kind::kCondition: {
      KVCM_ASSIGN_OR_RETURN(Value test, Eval(*expr.b));
      if (test.Truthy()) return Eval(*expr.a);
      if (expr.c != nullptr) return Eval(*expr.c);
      return Value::MakeUndefined("the else branch of a conditional expression");
    }
    case Expr::Kind::kList:
    case Expr::Kind::kTuple: {
      std::vector<Value> items;
      for (const ExprPtr& a : expr.args) {
        KVCM_ASSIGN_OR_RETURN(Value v, Eval(*a));
        items.push_back(std::move(v));
      }
      return Value::MakeList(std::move(items), expr.kind == Expr::Kind::kTuple);
    }
    case Expr::Kind::kDict: {
      Dict dict;
      for (size_t i = 0; i + 1 < expr.args.size(); i += 2) {
        KVCM_ASSIGN_OR_RETURN(Value k, Eval(*expr.args[i]));
        KVCM_ASSIGN_OR_RETURN(Value v, Eval(*expr.args[i + 1]));
        if (k.is_list() && !k.as_list().is_tuple) return TypeError("unhashable type: 'list'");
        if (k.is_dict()) return TypeError("unhashable type: 'dict'");
        dict.Set(std::move(k), std::move(v));
      }
      return Value::MakeDict(std::move(dict));
    }
  }
  return TypeError("unknown expression");
}

absl::StatusOr<Value> Interpreter::EvalBinary(const Expr& expr) {
  const std::string& op = expr.name;
  KVCM_ASSIGN_OR_RETURN(Value a, Eval(*expr.a));
  if (op == "and") {
    if (!a.Truthy()) return a;
    return Eval(*expr.b);
  }
  if (op == "or") {
    if (a.Truthy()) return a;
    return Eval(*expr.b);
  }
  KVCM_ASSIGN_OR_RETURN(Value b, Eval(*expr.b));
  if (const BinaryFn fn = FindIn(kBinaryOps, op)) return fn(*this, op, a, b);
  KVCM_RETURN_IF_ERROR(Defined(a, b));
  return UnsupportedOperands(op, a, b);
}

absl::StatusOr<Value> Interpreter::EvalCompare(const Expr& expr) {
  KVCM_ASSIGN_OR_RETURN(Value left, Eval(*expr.args[0]));
  for (size_t i = 0; i < expr.ops.size(); ++i) {
    KVCM_ASSIGN_OR_RETURN(Value right, Eval(*expr.args[i + 1]));
    const std::string& op = expr.ops[i];
    bool result = false;
    if (op == "==") {
      result = Equal(left, right);
    } else if (op == "!=") {
      result = !Equal(left, right);
    } else if (op == "in" || op == "notin") {
      KVCM_ASSIGN_OR_RETURN(result, Contains(right, left));
      if (op == "notin") result = !result;
    } else {
      if (left.is_undefined()) return UndefinedError(left);
      if (right.is_undefined()) return UndefinedError(right);
      absl::StatusOr<bool> lt = op == "<" || op == ">=" ? Less(left, right) : Less(right, left);
      if (!lt.ok()) {
        return TypeError(absl::StrCat("'", op, "' not supported between instances of '",
                                      left.TypeName(), "' and '", right.TypeName(), "'"));
      }
      if (op == "<" || op == ">") {
        result = *lt;
      } else {
        result = !*lt;  // <=: !(right < left); >=: !(left < right)
      }
    }
    if (!result) return Value::Bool(false);
    left = std::move(right);
  }
  return Value::Bool(true);
}

absl::StatusOr<Value> Interpreter::CallMethod(const Value& self, const std::string& name,
                                              CallArgs& args) {
  MethodFn fn = nullptr;
  if (self.is_dict()) fn = internal::FindDictMethod(name);
  if (self.is_string()) fn = internal::FindStrMethod(name);
  if (fn == nullptr) {
    return NotSupported(absl::StrCat("the ", self.TypeName(), " method '", name, "'"));
  }
  return fn(*this, name, self, args);
}

absl::StatusOr<bool> Interpreter::ApplyTest(const std::string& name, const Value& v,
                                            CallArgs& args) {
  const TestFn fn = internal::FindTest(name);
  if (fn == nullptr) return NotSupported(absl::StrCat("the test '", name, "'"));
  return fn(*this, name, v, args);
}

absl::StatusOr<Value> Interpreter::ApplyFilter(const std::string& name, const Value& v,
                                               CallArgs& args) {
  const FilterFn fn = internal::FindFilter(name);
  if (fn == nullptr) return NotSupported(absl::StrCat("the filter '", name, "'"));
  return fn(*this, name, v, args);
}

}  // namespace kvcm::jinja
