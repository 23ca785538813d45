// The tests of the subset (docs/chat-templates.md, "Tests:"): `value is name(args)`, one
// small function each, in a table from name to function as Jinja's TESTS.
#include <cmath>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/base/status_macros.h"
#include "common/chat/jinja_builtins.h"

namespace kvcm::jinja {
namespace internal {
namespace {

// ---- Tests: `value is name(args)`.

// The one argument of a test that needs it.
absl::StatusOr<const Value*> TestArg(const std::string& name, const CallArgs& args) {
  const Value* arg = Arg(args, 0, "");
  if (arg == nullptr) return TypeError(absl::StrCat("the test '", name, "' needs an argument"));
  return arg;
}

// A test of the value alone: `Is<Pred>`.
template <bool (*kPred)(const Value&)>
absl::StatusOr<bool> Is(Interpreter&, const std::string&, const Value& v, CallArgs&) {
  return kPred(v);
}
bool IsDefined(const Value& v) { return !v.is_undefined(); }
bool IsUndefined(const Value& v) { return v.is_undefined(); }
bool IsNone(const Value& v) { return v.is_none(); }
bool IsBoolean(const Value& v) { return v.is_bool(); }
bool IsTrue(const Value& v) { return v.is_bool() && v.as_bool(); }
bool IsFalse(const Value& v) { return v.is_bool() && !v.as_bool(); }
bool IsInteger(const Value& v) { return v.is_int(); }
bool IsFloat(const Value& v) { return v.is_float(); }
bool IsNumber(const Value& v) { return v.is_number(); }
bool IsString(const Value& v) { return v.is_string(); }
bool IsMapping(const Value& v) { return v.is_dict(); }
bool IsIterable(const Value& v) {
  return v.is_string() || v.is_list() || v.is_dict() || v.is_undefined();
}
bool IsCallable(const Value& v) { return v.is_callable(); }
bool IsEscaped(const Value&) { return false; }

// lower / upper: no character of the other case, and at least one cased.
absl::StatusOr<bool> TestCase(Interpreter&, const std::string& name, const Value& v, CallArgs&) {
  const std::string s = ToStr(v);
  bool cased = false;
  for (char c : s) {
    if (name == "lower" && c >= 'A' && c <= 'Z') return false;
    if (name == "upper" && c >= 'a' && c <= 'z') return false;
    cased = cased || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
  }
  return cased;
}

// v % divisor with Python's semantics, for odd, even and divisibleby.
absl::StatusOr<double> TestModulo(const Value& v, const Value& divisor) {
  if (v.is_undefined()) return UndefinedError(v);
  if (!v.is_number() || !divisor.is_number()) {
    return TypeError(absl::StrCat("unsupported operand type(s) for %: '", v.TypeName(), "' and '",
                                  divisor.TypeName(), "'"));
  }
  if (!v.is_float() && !divisor.is_float()) {
    const int64_t x = v.is_int() ? v.as_int() : v.as_bool();
    const int64_t y = divisor.is_int() ? divisor.as_int() : divisor.as_bool();
    if (y == 0) return TypeError("integer modulo by zero");
    int64_t r = x % y;
    if (r != 0 && ((r < 0) != (y < 0))) r += y;
    return static_cast<double>(r);
  }
  if (divisor.as_double() == 0) return TypeError("float modulo");
  double m = std::fmod(v.as_double(), divisor.as_double());
  if (m != 0 && ((m < 0) != (divisor.as_double() < 0))) m += divisor.as_double();
  return m;
}

absl::StatusOr<bool> TestOdd(Interpreter&, const std::string&, const Value& v, CallArgs&) {
  KVCM_ASSIGN_OR_RETURN(double m, TestModulo(v, Value::Int(2)));
  return m == 1;
}

absl::StatusOr<bool> TestEven(Interpreter&, const std::string&, const Value& v, CallArgs&) {
  KVCM_ASSIGN_OR_RETURN(double m, TestModulo(v, Value::Int(2)));
  return m == 0;
}

absl::StatusOr<bool> TestDivisibleBy(Interpreter&, const std::string& name, const Value& v,
                                     CallArgs& args) {
  KVCM_ASSIGN_OR_RETURN(const Value* arg, TestArg(name, args));
  KVCM_ASSIGN_OR_RETURN(double m, TestModulo(v, *arg));
  return m == 0;
}

absl::StatusOr<bool> TestIn(Interpreter&, const std::string& name, const Value& v, CallArgs& args) {
  KVCM_ASSIGN_OR_RETURN(const Value* arg, TestArg(name, args));
  return Contains(*arg, v);
}

absl::StatusOr<bool> TestSameAs(Interpreter&, const std::string& name, const Value& v,
                                CallArgs& args) {
  KVCM_ASSIGN_OR_RETURN(const Value* arg, TestArg(name, args));
  if (v.is_none() || arg->is_none()) return v.is_none() && arg->is_none();
  if (v.is_bool() || arg->is_bool())
    return v.is_bool() && arg->is_bool() && v.as_bool() == arg->as_bool();
  if (v.is_string() && arg->is_string()) return &v.as_string() == &arg->as_string();
  if (v.is_list() && arg->is_list()) return &v.as_list() == &arg->as_list();
  if (v.is_dict() && arg->is_dict()) return &v.as_dict() == &arg->as_dict();
  return Equal(v, *arg) && v.TypeName() == arg->TypeName();
}

absl::StatusOr<bool> TestFilter(Interpreter&, const std::string& name, const Value&,
                                CallArgs& args) {
  KVCM_ASSIGN_OR_RETURN(const Value* arg, TestArg(name, args));
  return arg->is_string() && IsKnownFilter(arg->as_string());
}

absl::StatusOr<bool> TestTest(Interpreter&, const std::string& name, const Value&, CallArgs& args) {
  KVCM_ASSIGN_OR_RETURN(const Value* arg, TestArg(name, args));
  return arg->is_string() && IsKnownTest(arg->as_string());
}

absl::StatusOr<bool> TestEq(Interpreter&, const std::string& name, const Value& v, CallArgs& args) {
  KVCM_ASSIGN_OR_RETURN(const Value* arg, TestArg(name, args));
  return Equal(v, *arg);
}

absl::StatusOr<bool> TestNe(Interpreter&, const std::string& name, const Value& v, CallArgs& args) {
  KVCM_ASSIGN_OR_RETURN(const Value* arg, TestArg(name, args));
  return !Equal(v, *arg);
}

// lt gt le ge and their aliases: `TestOrder<swap, negate>` is (swap ? arg < v : v < arg), negated.
template <bool kSwap, bool kNegate>
absl::StatusOr<bool> TestOrder(Interpreter&, const std::string& name, const Value& v,
                               CallArgs& args) {
  KVCM_ASSIGN_OR_RETURN(const Value* arg, TestArg(name, args));
  if (v.is_undefined()) return UndefinedError(v);
  if (arg->is_undefined()) return UndefinedError(*arg);
  KVCM_ASSIGN_OR_RETURN(bool less, kSwap ? Less(*arg, v) : Less(v, *arg));
  return less != kNegate;
}
constexpr TestFn TestLt = TestOrder<false, false>;
constexpr TestFn TestGt = TestOrder<true, false>;
constexpr TestFn TestLe = TestOrder<true, true>;   // !(arg < v)
constexpr TestFn TestGe = TestOrder<false, true>;  // !(v < arg)

constexpr Entry<TestFn> kTestTable[] = {
    {"!=", TestNe},
    {"<", TestLt},
    {"<=", TestLe},
    {"==", TestEq},
    {">", TestGt},
    {">=", TestGe},
    {"boolean", Is<IsBoolean>},
    {"callable", Is<IsCallable>},
    {"defined", Is<IsDefined>},
    {"divisibleby", TestDivisibleBy},
    {"eq", TestEq},
    {"equalto", TestEq},
    {"escaped", Is<IsEscaped>},
    {"even", TestEven},
    {"false", Is<IsFalse>},
    {"filter", TestFilter},
    {"float", Is<IsFloat>},
    {"ge", TestGe},
    {"greaterthan", TestGt},
    {"gt", TestGt},
    {"in", TestIn},
    {"integer", Is<IsInteger>},
    {"iterable", Is<IsIterable>},
    {"le", TestLe},
    {"lessthan", TestLt},
    {"lower", TestCase},
    {"lt", TestLt},
    {"mapping", Is<IsMapping>},
    {"ne", TestNe},
    {"none", Is<IsNone>},
    {"number", Is<IsNumber>},
    {"odd", TestOdd},
    {"sameas", TestSameAs},
    {"sequence", Is<IsIterable>},
    {"string", Is<IsString>},
    {"test", TestTest},
    {"true", Is<IsTrue>},
    {"undefined", Is<IsUndefined>},
    {"upper", TestCase},
};
static_assert(SortedByName(kTestTable));

}  // namespace

TestFn FindTest(std::string_view name) { return FindIn(kTestTable, name); }

}  // namespace internal

bool IsKnownTest(std::string_view name) { return internal::FindTest(name) != nullptr; }
std::vector<std::string_view> SupportedTests() { return internal::KeysOf(internal::kTestTable); }

}  // namespace kvcm::jinja
