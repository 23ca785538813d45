#pragma once
// Values of the Jinja interpreter behind ChatTemplate (common/chat/chat_template.h): what a
// chat template computes with, with Python's semantics as Jinja has them (str() and repr()
// of lists and dicts, truthiness, == between ints and floats, insertion-ordered dicts).
//
//   undefined  a name or key that is not there (Jinja's default Undefined: prints as "",
//              is false, iterates as empty; attribute or item access on it is an error)
//   none, bool, int (int64; overflow is an error), float (double), string (UTF-8),
//   list (also tuples, which differ only in repr), dict, namespace (the one mutable
//   value: `{% set ns.x = ... %}`), callable (builtins, bound methods, macros).
//
// Strings, lists and dicts are immutable and shared (copying a Value is cheap); a
// namespace is shared and mutable. Values belong to one render: they are not shared
// between threads.

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "absl/status/statusor.h"

namespace kvcm::jinja {

class Value;
class Interpreter;

struct Undefined {
  std::string name;  // what was looked up, for error messages
};
struct NoneType {};

struct List {
  std::vector<Value> items;
  bool is_tuple = false;
};

struct Dict {
  std::vector<std::pair<Value, Value>> items;  // insertion order, unique keys
  const Value* Find(const Value& key) const;
  const Value* Find(std::string_view key) const;
  void Set(Value key, Value value);
};

// Arguments of a call: positional, then keyword.
struct CallArgs {
  std::vector<Value> positional;
  std::vector<std::pair<std::string, Value>> keyword;
};

struct Callable {
  std::string name;
  std::function<absl::StatusOr<Value>(Interpreter&, CallArgs&)> fn;
};

struct Namespace {
  Dict attrs;
};

class Value {
 public:
  using Storage =
      std::variant<Undefined, NoneType, bool, int64_t, double, std::shared_ptr<const std::string>,
                   std::shared_ptr<const List>, std::shared_ptr<const Dict>,
                   std::shared_ptr<Namespace>, std::shared_ptr<const Callable>>;

  Value() : storage_(Undefined{}) {}
  static Value MakeUndefined(std::string name) { return Value(Undefined{std::move(name)}); }
  static Value None() { return Value(NoneType{}); }
  static Value Bool(bool b) { return Value(b); }
  static Value Int(int64_t i) { return Value(i); }
  static Value Float(double d) { return Value(d); }
  static Value String(std::string s) {
    return Value(std::make_shared<const std::string>(std::move(s)));
  }
  static Value MakeList(std::vector<Value> items, bool is_tuple = false) {
    return Value(std::make_shared<const List>(List{std::move(items), is_tuple}));
  }
  static Value MakeDict(Dict dict) { return Value(std::make_shared<const Dict>(std::move(dict))); }
  static Value MakeNamespace(Dict attrs) {
    return Value(std::make_shared<Namespace>(Namespace{std::move(attrs)}));
  }
  static Value MakeCallable(std::string name,
                            std::function<absl::StatusOr<Value>(Interpreter&, CallArgs&)> fn) {
    return Value(std::make_shared<const Callable>(Callable{std::move(name), std::move(fn)}));
  }

  bool is_undefined() const { return std::holds_alternative<Undefined>(storage_); }
  bool is_none() const { return std::holds_alternative<NoneType>(storage_); }
  bool is_bool() const { return std::holds_alternative<bool>(storage_); }
  bool is_int() const { return std::holds_alternative<int64_t>(storage_); }
  bool is_float() const { return std::holds_alternative<double>(storage_); }
  bool is_number() const { return is_bool() || is_int() || is_float(); }  // Python's Number
  bool is_string() const {
    return std::holds_alternative<std::shared_ptr<const std::string>>(storage_);
  }
  bool is_list() const { return std::holds_alternative<std::shared_ptr<const List>>(storage_); }
  bool is_dict() const { return std::holds_alternative<std::shared_ptr<const Dict>>(storage_); }
  bool is_namespace() const { return std::holds_alternative<std::shared_ptr<Namespace>>(storage_); }
  bool is_callable() const {
    return std::holds_alternative<std::shared_ptr<const Callable>>(storage_);
  }

  bool as_bool() const { return std::get<bool>(storage_); }
  int64_t as_int() const { return std::get<int64_t>(storage_); }
  double as_float() const { return std::get<double>(storage_); }
  // int, float or bool as a double.
  double as_double() const;
  const std::string& as_string() const {
    return *std::get<std::shared_ptr<const std::string>>(storage_);
  }
  const List& as_list() const { return *std::get<std::shared_ptr<const List>>(storage_); }
  const Dict& as_dict() const { return *std::get<std::shared_ptr<const Dict>>(storage_); }
  Namespace& as_namespace() const { return *std::get<std::shared_ptr<Namespace>>(storage_); }
  const Callable& as_callable() const {
    return *std::get<std::shared_ptr<const Callable>>(storage_);
  }
  const Undefined& as_undefined() const { return std::get<Undefined>(storage_); }

  // Python's bool().
  bool Truthy() const;
  // Python's type name ("str", "int", "list", "dict", "NoneType", ...), for errors.
  std::string TypeName() const;

 private:
  template <typename T>
  explicit Value(T v) : storage_(std::move(v)) {}
  Storage storage_;
};

// Python's str() (undefined is ""), as Jinja prints a value.
std::string ToStr(const Value& v);
// Python's repr().
std::string Repr(const Value& v);
// Python's repr() of a float (shortest round trip; 1.0, 1e+16, 1e-05, inf, nan).
std::string FloatRepr(double d);
// Python's repr() of a str.
std::string StringRepr(std::string_view s);
// Python's ==.
bool Equal(const Value& a, const Value& b);
// json.dumps(v, ensure_ascii=False, indent=indent, separators=..., sort_keys=...), as
// transformers' tojson filter. indent < 0: none; indent_string replaces spaces when set.
// INVALID_ARGUMENT for values JSON cannot hold (undefined, callables, namespaces).
absl::StatusOr<std::string> ToJson(const Value& v, int indent, const std::string& indent_string,
                                   const std::string& item_separator,
                                   const std::string& key_separator, bool sort_keys);
// A JSON text as a Value (objects keep their key order). INVALID_ARGUMENT when it is not
// JSON.
absl::StatusOr<Value> FromJson(std::string_view json);

// UTF-8 helpers: code points of s (invalid bytes decode as U+FFFD) and back.
std::u32string DecodeUtf8(std::string_view s);
std::string EncodeUtf8(std::u32string_view s);
// Python's str.isspace() for one code point.
bool IsPythonSpace(char32_t c);

}  // namespace kvcm::jinja
