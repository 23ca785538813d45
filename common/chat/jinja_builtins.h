#pragma once
// Internal to common/chat, not part of kvcm_chat's interface: what the interpreter
// (jinja_interpreter.cc) shares with its builtins, the str/dict methods (jinja_methods.cc),
// the tests (jinja_tests.cc) and the filters (jinja_filters.cc): Python's errors and argument
// binding, the Python semantics they have in common (iteration, len, <, in, case mapping,
// strip, replace; defined in jinja_builtins.cc), and the tables from name to the one small
// function that implements it (docs/chat-templates.md).

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <iterator>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/chat/jinja_interpreter.h"
#include "common/chat/jinja_value.h"

namespace kvcm::jinja::internal {

// ---- Errors (INVALID_ARGUMENT, as Jinja raises them).

absl::Status TypeError(std::string message);
// "'name' is undefined".
absl::Status UndefinedError(const Value& v);
// "WHAT is not supported by kvcm's chat template interpreter ...", with the way out.
absl::Status NotSupported(std::string what);

// ---- Arguments.

// The argument given by keyword `name`, else the positional one at `index`; null if neither.
const Value* Arg(const CallArgs& args, size_t index, std::string_view name);
// Python's TypeError for more than `max_positional` positional arguments or a keyword not in
// `names`; `fn` names the callee in the message.
absl::Status CheckArgs(const CallArgs& args, size_t max_positional,
                       std::initializer_list<std::string_view> names, std::string_view fn);

// ---- Strings.

// A str's code points.
std::u32string Chars(const Value& v);
// Python's simple case mappings of one character (see jinja_builtins.cc).
char32_t Upper(char32_t c);
char32_t Lower(char32_t c);
bool IsCased(char32_t c);
bool IsAsciiLetter(char32_t c);
// Python's str.lower() / str.upper().
std::string CaseLower(const std::string& s);
std::string CaseUpper(const std::string& s);
// Python's str.strip family: chars == nullptr strips whitespace.
std::string Strip(const std::string& s, const std::u32string* chars, bool left, bool right);
// self.strip(chars) and its lstrip/rstrip variants, arguments checked; `fn` names it.
absl::StatusOr<std::string> StripMethod(const Value& self, CallArgs& args, bool left, bool right,
                                        std::string_view fn);
// Python's s.replace(old_s, new_s, count); count < 0 replaces all.
std::string Replace(const std::string& s, const std::string& old_s, const std::string& new_s,
                    int64_t count);
// Python's str.splitlines().
std::vector<std::string> SplitLines(const std::string& s);

// ---- Sequences and comparisons.

// A Python sequence's items (str: its characters, dict: its keys); undefined is empty.
absl::StatusOr<std::vector<Value>> Iterate(const Value& v);
// Python's len(); undefined is 0.
absl::StatusOr<int64_t> Length(const Value& v);
// Python's <; INVALID_ARGUMENT between unordered types.
absl::StatusOr<bool> Less(const Value& a, const Value& b);
// Python's `item in container`; undefined contains nothing.
absl::StatusOr<bool> Contains(const Value& container, const Value& item);
// A slice index (int or bool); TypeError otherwise.
absl::StatusOr<int64_t> ToIndex(const Value& v);

// ---- Tables.

// A table from name to the one small function that implements it, sorted by name (Jinja's
// FILTERS/TESTS dicts, and Python's methods per type). The supported names are the keys.
template <typename Fn>
struct Entry {
  std::string_view name;
  Fn fn;
};

template <typename Fn, size_t N>
constexpr bool SortedByName(const Entry<Fn> (&table)[N]) {
  for (size_t i = 1; i < N; ++i) {
    if (!(table[i - 1].name < table[i].name)) return false;
  }
  return true;
}

template <typename Fn, size_t N>
Fn FindIn(const Entry<Fn> (&table)[N], std::string_view name) {
  const auto* it =
      std::lower_bound(std::begin(table), std::end(table), name,
                       [](const Entry<Fn>& e, std::string_view n) { return e.name < n; });
  return it != std::end(table) && it->name == name ? it->fn : nullptr;
}

template <typename Fn, size_t N>
std::vector<std::string_view> KeysOf(const Entry<Fn> (&table)[N]) {
  std::vector<std::string_view> keys;
  for (const Entry<Fn>& e : table) keys.push_back(e.name);
  return keys;
}

// self.name(args), per receiver type (jinja_methods.cc).
using MethodFn = absl::StatusOr<Value> (*)(Interpreter& in, const std::string& name,
                                           const Value& self, CallArgs& args);
// `value is name(args)` (jinja_tests.cc).
using TestFn = absl::StatusOr<bool> (*)(Interpreter& in, const std::string& name, const Value& v,
                                        CallArgs& args);
// `value | name(args)` (jinja_filters.cc).
using FilterFn = absl::StatusOr<Value> (*)(Interpreter& in, const std::string& name, const Value& v,
                                           CallArgs& args);

// The function a table has for `name`; null when the name is not supported.
MethodFn FindStrMethod(std::string_view name);
MethodFn FindDictMethod(std::string_view name);
TestFn FindTest(std::string_view name);
FilterFn FindFilter(std::string_view name);

// Python's attribute lookup on obj (jinja_methods.cc): a supported method bound to obj, a
// callable that refuses one of Python's other methods, or a namespace's attribute; nullopt
// when there is no such attribute.
std::optional<Value> PythonAttr(const Value& obj, const std::string& name);

}  // namespace kvcm::jinja::internal
