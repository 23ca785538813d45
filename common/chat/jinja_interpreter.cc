#include "common/chat/jinja_interpreter.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <cmath>
#include <ctime>
#include <cwctype>
#include <locale.h>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/base/status_macros.h"

namespace kvcm::jinja {
namespace {

absl::Status TypeError(std::string message) { return absl::InvalidArgumentError(std::move(message)); }

absl::Status UndefinedError(const Value& v) {
  return absl::InvalidArgumentError(absl::StrCat("'", v.as_undefined().name, "' is undefined"));
}

absl::Status NotSupported(std::string what) {
  return absl::InvalidArgumentError(
      absl::StrCat(what,
                   " is not supported by kvcm's chat template interpreter "
                   "(docs/chat-templates.md); pass --chat-template FILE with a template that "
                   "does without it"));
}

const Value* Arg(const CallArgs& args, size_t index, std::string_view name) {
  for (const auto& [k, v] : args.keyword) {
    if (k == name) return &v;
  }
  if (index < args.positional.size()) return &args.positional[index];
  return nullptr;
}

absl::Status CheckArgs(const CallArgs& args, size_t max_positional,
                       std::initializer_list<std::string_view> names, std::string_view fn) {
  if (args.positional.size() > max_positional) {
    return TypeError(absl::StrCat(std::string(fn), "() takes at most ", max_positional,
                                  " positional arguments (", args.positional.size(), " given)"));
  }
  for (const auto& [k, v] : args.keyword) {
    bool known = false;
    for (std::string_view n : names) known = known || n == k;
    if (!known) {
      return TypeError(absl::StrCat(std::string(fn), "() got an unexpected keyword argument '", k, "'"));
    }
  }
  return absl::OkStatus();
}

std::u32string Chars(const Value& v) { return DecodeUtf8(v.as_string()); }

// Case mapping: the C.UTF-8 locale's simple mappings (what Python's str.upper/lower do for
// all but a few characters such as U+00DF, which Python maps to two); ASCII only where
// that locale is missing.
locale_t Utf8Locale() {
  static const locale_t locale = newlocale(LC_CTYPE_MASK, "C.UTF-8", static_cast<locale_t>(nullptr));
  return locale;
}
char32_t Upper(char32_t c) {
  if (c < 0x80 || Utf8Locale() == static_cast<locale_t>(nullptr)) return (c >= 'a' && c <= 'z') ? c - 'a' + 'A' : c;
  return static_cast<char32_t>(towupper_l(static_cast<wint_t>(c), Utf8Locale()));
}
char32_t Lower(char32_t c) {
  if (c < 0x80 || Utf8Locale() == static_cast<locale_t>(nullptr)) return (c >= 'A' && c <= 'Z') ? c - 'A' + 'a' : c;
  return static_cast<char32_t>(towlower_l(static_cast<wint_t>(c), Utf8Locale()));
}
bool IsCased(char32_t c) { return Upper(c) != c || Lower(c) != c; }
bool IsAsciiLetter(char32_t c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }
std::string CaseLower(const std::string& s) {
  std::u32string cps = DecodeUtf8(s);
  for (char32_t& c : cps) c = Lower(c);
  return EncodeUtf8(cps);
}
std::string CaseUpper(const std::string& s) {
  std::u32string cps = DecodeUtf8(s);
  for (char32_t& c : cps) c = Upper(c);
  return EncodeUtf8(cps);
}

// Python's str.strip family: chars == nullptr strips whitespace.
std::string Strip(const std::string& s, const std::u32string* chars, bool left, bool right) {
  std::u32string cps = DecodeUtf8(s);
  auto strip_it = [&](char32_t c) {
    return chars == nullptr ? IsPythonSpace(c) : chars->find(c) != std::u32string::npos;
  };
  size_t b = 0, e = cps.size();
  if (left) {
    while (b < e && strip_it(cps[b])) ++b;
  }
  if (right) {
    while (e > b && strip_it(cps[e - 1])) --e;
  }
  if (b == 0 && e == cps.size()) return s;
  return EncodeUtf8(std::u32string_view(cps).substr(b, e - b));
}

absl::StatusOr<std::string> StripMethod(const Value& self, CallArgs& args, bool left, bool right,
                                        std::string_view fn) {
  KVCM_RETURN_IF_ERROR(CheckArgs(args, 1, {}, fn));
  const Value* chars = Arg(args, 0, "");
  if (chars != nullptr && !chars->is_none()) {
    if (!chars->is_string()) return TypeError(absl::StrCat(std::string(fn), " arg must be None or str"));
    std::u32string set = Chars(*chars);
    return Strip(self.as_string(), &set, left, right);
  }
  return Strip(self.as_string(), nullptr, left, right);
}

std::string Replace(const std::string& s, const std::string& old_s, const std::string& new_s,
                    int64_t count) {
  std::string out;
  if (old_s.empty()) {
    std::u32string cps = DecodeUtf8(s);
    int64_t done = 0;
    for (size_t i = 0; i <= cps.size(); ++i) {
      if (count < 0 || done < count) {
        out += new_s;
        ++done;
      }
      if (i < cps.size()) out += EncodeUtf8(std::u32string(1, cps[i]));
    }
    return out;
  }
  size_t pos = 0;
  int64_t done = 0;
  while (count < 0 || done < count) {
    const size_t hit = s.find(old_s, pos);
    if (hit == std::string::npos) break;
    out.append(s, pos, hit - pos);
    out += new_s;
    pos = hit + old_s.size();
    ++done;
  }
  out.append(s, pos, std::string::npos);
  return out;
}

std::vector<std::string> SplitLines(const std::string& s) {
  std::vector<std::string> lines;
  std::u32string cps = DecodeUtf8(s);
  std::u32string cur;
  for (size_t i = 0; i < cps.size(); ++i) {
    const char32_t c = cps[i];
    if (c == '\n' || c == '\r' || c == 0x0B || c == 0x0C || c == 0x1C || c == 0x1D || c == 0x1E ||
        c == 0x85 || c == 0x2028 || c == 0x2029) {
      lines.push_back(EncodeUtf8(cur));
      cur.clear();
      if (c == '\r' && i + 1 < cps.size() && cps[i + 1] == '\n') ++i;
    } else {
      cur.push_back(c);
    }
  }
  if (!cur.empty()) lines.push_back(EncodeUtf8(cur));
  return lines;
}

// A Python sequence's items (str: its characters, dict: its keys); undefined is empty.
absl::StatusOr<std::vector<Value>> Iterate(const Value& v) {
  if (v.is_list()) return v.as_list().items;
  if (v.is_undefined()) return std::vector<Value>{};
  if (v.is_dict()) {
    std::vector<Value> keys;
    for (const auto& [k, item] : v.as_dict().items) keys.push_back(k);
    return keys;
  }
  if (v.is_string()) {
    std::vector<Value> chars;
    for (char32_t c : Chars(v)) chars.push_back(Value::String(EncodeUtf8(std::u32string(1, c))));
    return chars;
  }
  return TypeError(absl::StrCat("'", v.TypeName(), "' object is not iterable"));
}

absl::StatusOr<int64_t> Length(const Value& v) {
  if (v.is_string()) return static_cast<int64_t>(Chars(v).size());
  if (v.is_list()) return static_cast<int64_t>(v.as_list().items.size());
  if (v.is_dict()) return static_cast<int64_t>(v.as_dict().items.size());
  if (v.is_undefined()) return 0;
  return TypeError(absl::StrCat("object of type '", v.TypeName(), "' has no len()"));
}

// Python's <; INVALID_ARGUMENT between unordered types.
absl::StatusOr<bool> Less(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if ((a.is_int() || a.is_bool()) && (b.is_int() || b.is_bool())) {
      const int64_t x = a.is_int() ? a.as_int() : a.as_bool();
      const int64_t y = b.is_int() ? b.as_int() : b.as_bool();
      return x < y;
    }
    return a.as_double() < b.as_double();
  }
  if (a.is_string() && b.is_string()) return a.as_string() < b.as_string();
  if (a.is_list() && b.is_list()) {
    const auto& x = a.as_list().items;
    const auto& y = b.as_list().items;
    for (size_t i = 0; i < x.size() && i < y.size(); ++i) {
      if (Equal(x[i], y[i])) continue;
      return Less(x[i], y[i]);
    }
    return x.size() < y.size();
  }
  return TypeError(absl::StrCat("'<' not supported between instances of '", a.TypeName(),
                                "' and '", b.TypeName(), "'"));
}

absl::StatusOr<bool> Contains(const Value& container, const Value& item) {
  if (container.is_string()) {
    if (!item.is_string()) {
      return TypeError(absl::StrCat("'in <string>' requires string as left operand, not ",
                                    item.TypeName()));
    }
    return absl::StrContains(container.as_string(), item.as_string());
  }
  if (container.is_list()) {
    for (const Value& v : container.as_list().items) {
      if (Equal(v, item)) return true;
    }
    return false;
  }
  if (container.is_dict()) return container.as_dict().Find(item) != nullptr;
  if (container.is_undefined()) return false;
  return TypeError(absl::StrCat("argument of type '", container.TypeName(), "' is not iterable"));
}

absl::StatusOr<int64_t> ToIndex(const Value& v) {
  if (v.is_int()) return v.as_int();
  if (v.is_bool()) return v.as_bool() ? 1 : 0;
  if (v.is_none()) return TypeError("slice indices must be integers or None");
  return TypeError("slice indices must be integers or None or have an __index__ method");
}

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

Value BoundMethod(const Value& self, const std::string& name) {
  return Value::MakeCallable(name, [self, name](Interpreter& in, CallArgs& args) {
    return in.CallMethod(self, name, args);
  });
}

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

// ---- Methods: self.name(args), per receiver type.

using MethodFn = absl::StatusOr<Value> (*)(Interpreter& in, const std::string& name,
                                           const Value& self, CallArgs& args);

absl::StatusOr<Value> DictGet(Interpreter&, const std::string&, const Value& self, CallArgs& args) {
  KVCM_RETURN_IF_ERROR(CheckArgs(args, 2, {}, "get"));
  if (args.positional.empty()) return TypeError("get expected at least 1 argument, got 0");
  if (const Value* v = self.as_dict().Find(args.positional[0])) return *v;
  return args.positional.size() > 1 ? args.positional[1] : Value::None();
}

absl::StatusOr<Value> DictItems(Interpreter&, const std::string& name, const Value& self,
                                CallArgs& args) {
  KVCM_RETURN_IF_ERROR(CheckArgs(args, 0, {}, name));
  std::vector<Value> out;
  for (const auto& [k, v] : self.as_dict().items)
    out.push_back(Value::MakeList({k, v}, /*is_tuple=*/true));
  return Value::MakeList(std::move(out));
}

absl::StatusOr<Value> DictKeys(Interpreter&, const std::string& name, const Value& self,
                               CallArgs& args) {
  KVCM_RETURN_IF_ERROR(CheckArgs(args, 0, {}, name));
  std::vector<Value> out;
  for (const auto& [k, v] : self.as_dict().items) out.push_back(k);
  return Value::MakeList(std::move(out));
}

absl::StatusOr<Value> DictValues(Interpreter&, const std::string& name, const Value& self,
                                 CallArgs& args) {
  KVCM_RETURN_IF_ERROR(CheckArgs(args, 0, {}, name));
  std::vector<Value> out;
  for (const auto& [k, v] : self.as_dict().items) out.push_back(v);
  return Value::MakeList(std::move(out));
}

constexpr Entry<MethodFn> kDictMethods[] = {
    {"get", DictGet}, {"items", DictItems}, {"keys", DictKeys}, {"values", DictValues}};
static_assert(SortedByName(kDictMethods));

template <bool kLeft, bool kRight>
absl::StatusOr<Value> StrStrip(Interpreter&, const std::string& name, const Value& self,
                               CallArgs& args) {
  KVCM_ASSIGN_OR_RETURN(std::string out, StripMethod(self, args, kLeft, kRight, name));
  return Value::String(std::move(out));
}

absl::StatusOr<Value> StrUpper(Interpreter&, const std::string& name, const Value& self,
                               CallArgs& args) {
  KVCM_RETURN_IF_ERROR(CheckArgs(args, 0, {}, name));
  return Value::String(CaseUpper(self.as_string()));
}

absl::StatusOr<Value> StrLower(Interpreter&, const std::string& name, const Value& self,
                               CallArgs& args) {
  KVCM_RETURN_IF_ERROR(CheckArgs(args, 0, {}, name));
  return Value::String(CaseLower(self.as_string()));
}

absl::StatusOr<Value> StrTitle(Interpreter&, const std::string& name, const Value& self,
                               CallArgs& args) {
  KVCM_RETURN_IF_ERROR(CheckArgs(args, 0, {}, name));
  std::u32string cps = DecodeUtf8(self.as_string());
  bool prev_cased = false;
  for (char32_t& c : cps) {
    const bool cased = IsCased(c);
    c = prev_cased ? Lower(c) : Upper(c);
    prev_cased = cased;
  }
  return Value::String(EncodeUtf8(cps));
}

absl::StatusOr<Value> StrCapitalize(Interpreter&, const std::string& name, const Value& self,
                                    CallArgs& args) {
  KVCM_RETURN_IF_ERROR(CheckArgs(args, 0, {}, name));
  std::u32string cps = DecodeUtf8(self.as_string());
  for (size_t i = 0; i < cps.size(); ++i) cps[i] = i == 0 ? Upper(cps[i]) : Lower(cps[i]);
  return Value::String(EncodeUtf8(cps));
}

// startswith / endswith.
absl::StatusOr<Value> StrAffix(Interpreter&, const std::string& name, const Value& self,
                               CallArgs& args) {
  KVCM_RETURN_IF_ERROR(CheckArgs(args, 1, {}, name));
  if (args.positional.empty())
    return TypeError(absl::StrCat(name, "() takes at least 1 argument (0 given)"));
  std::vector<Value> options;
  if (args.positional[0].is_list() && args.positional[0].as_list().is_tuple) {
    options = args.positional[0].as_list().items;
  } else {
    options.push_back(args.positional[0]);
  }
  const std::string& s = self.as_string();
  for (const Value& o : options) {
    if (!o.is_string()) {
      return TypeError(
          absl::StrCat(name, " first arg must be str or a tuple of str, not ", o.TypeName()));
    }
    if (name == "startswith" ? absl::StartsWith(s, o.as_string())
                             : absl::EndsWith(s, o.as_string())) {
      return Value::Bool(true);
    }
  }
  return Value::Bool(false);
}

// removeprefix / removesuffix.
absl::StatusOr<Value> StrRemoveAffix(Interpreter&, const std::string& name, const Value& self,
                                     CallArgs& args) {
  KVCM_RETURN_IF_ERROR(CheckArgs(args, 1, {}, name));
  if (args.positional.size() != 1 || !args.positional[0].is_string()) {
    return TypeError(absl::StrCat(name, "() argument must be str"));
  }
  const std::string& s = self.as_string();
  const std::string& fix = args.positional[0].as_string();
  if (name == "removeprefix" && absl::StartsWith(s, fix))
    return Value::String(s.substr(fix.size()));
  if (name == "removesuffix" && absl::EndsWith(s, fix) && !fix.empty()) {
    return Value::String(s.substr(0, s.size() - fix.size()));
  }
  return self;
}

absl::StatusOr<Value> StrReplace(Interpreter& in, const std::string& name, const Value& self,
                                 CallArgs& args) {
  KVCM_RETURN_IF_ERROR(CheckArgs(args, 3, {}, name));
  if (args.positional.size() < 2 || !args.positional[0].is_string() ||
      !args.positional[1].is_string()) {
    return TypeError("replace() takes two str arguments");
  }
  int64_t count = -1;
  if (args.positional.size() == 3) {
    if (!args.positional[2].is_int()) return TypeError("replace() count must be an int");
    count = args.positional[2].as_int();
  }
  std::string out = Replace(self.as_string(), args.positional[0].as_string(),
                            args.positional[1].as_string(), count);
  KVCM_RETURN_IF_ERROR(in.CheckSize(out.size()));
  return Value::String(std::move(out));
}

// str.split() with no separator: runs of whitespace.
std::vector<Value> SplitWhitespace(const std::string& s, int64_t maxsplit) {
  std::vector<Value> parts;
  std::u32string cps = DecodeUtf8(s);
  size_t i = 0;
  while (true) {
    while (i < cps.size() && IsPythonSpace(cps[i])) ++i;
    if (i >= cps.size()) break;
    if (maxsplit >= 0 && static_cast<int64_t>(parts.size()) == maxsplit) {
      size_t e = cps.size();
      while (e > i && IsPythonSpace(cps[e - 1])) --e;
      parts.push_back(Value::String(EncodeUtf8(std::u32string_view(cps).substr(i, e - i))));
      break;
    }
    size_t j = i;
    while (j < cps.size() && !IsPythonSpace(cps[j])) ++j;
    parts.push_back(Value::String(EncodeUtf8(std::u32string_view(cps).substr(i, j - i))));
    i = j;
  }
  return parts;
}

std::vector<Value> SplitOn(const std::string& s, const std::string& d, int64_t maxsplit) {
  std::vector<Value> parts;
  size_t pos = 0;
  while (true) {
    const size_t hit = s.find(d, pos);
    if (hit == std::string::npos ||
        (maxsplit >= 0 && static_cast<int64_t>(parts.size()) == maxsplit)) {
      parts.push_back(Value::String(s.substr(pos)));
      break;
    }
    parts.push_back(Value::String(s.substr(pos, hit - pos)));
    pos = hit + d.size();
  }
  return parts;
}

absl::StatusOr<Value> StrSplit(Interpreter& in, const std::string& name, const Value& self,
                               CallArgs& args) {
  KVCM_RETURN_IF_ERROR(CheckArgs(args, 2, {"sep", "maxsplit"}, name));
  const Value* sep = Arg(args, 0, "sep");
  const Value* maxsplit_v = Arg(args, 1, "maxsplit");
  int64_t maxsplit = -1;
  if (maxsplit_v != nullptr) {
    if (!maxsplit_v->is_int()) return TypeError("split() maxsplit must be an int");
    maxsplit = maxsplit_v->as_int();
  }
  std::vector<Value> parts;
  if (sep == nullptr || sep->is_none()) {
    parts = SplitWhitespace(self.as_string(), maxsplit);
  } else {
    if (!sep->is_string())
      return TypeError(absl::StrCat("must be str or None, not ", sep->TypeName()));
    if (sep->as_string().empty()) return TypeError("empty separator");
    parts = SplitOn(self.as_string(), sep->as_string(), maxsplit);
  }
  KVCM_RETURN_IF_ERROR(in.Charge(static_cast<int64_t>(parts.size())));
  return Value::MakeList(std::move(parts));
}

absl::StatusOr<Value> StrSplitlines(Interpreter&, const std::string& name, const Value& self,
                                    CallArgs& args) {
  KVCM_RETURN_IF_ERROR(CheckArgs(args, 0, {}, name));
  std::vector<Value> parts;
  for (std::string& line : SplitLines(self.as_string()))
    parts.push_back(Value::String(std::move(line)));
  return Value::MakeList(std::move(parts));
}

// The one str argument of find and count.
absl::StatusOr<std::string> SubstringArg(const std::string& name, CallArgs& args) {
  KVCM_RETURN_IF_ERROR(CheckArgs(args, 1, {}, name));
  if (args.positional.size() != 1 || !args.positional[0].is_string()) {
    return TypeError(absl::StrCat(name, "() argument must be str"));
  }
  return args.positional[0].as_string();
}

absl::StatusOr<Value> StrFind(Interpreter&, const std::string& name, const Value& self,
                              CallArgs& args) {
  KVCM_ASSIGN_OR_RETURN(const std::string sub, SubstringArg(name, args));
  const std::string& s = self.as_string();
  const size_t hit = s.find(sub);
  if (hit == std::string::npos) return Value::Int(-1);
  return Value::Int(static_cast<int64_t>(DecodeUtf8(std::string_view(s).substr(0, hit)).size()));
}

absl::StatusOr<Value> StrCount(Interpreter&, const std::string& name, const Value& self,
                               CallArgs& args) {
  KVCM_ASSIGN_OR_RETURN(const std::string sub, SubstringArg(name, args));
  const std::string& s = self.as_string();
  if (sub.empty()) return Value::Int(static_cast<int64_t>(DecodeUtf8(s).size()) + 1);
  int64_t n = 0;
  for (size_t pos = s.find(sub); pos != std::string::npos; pos = s.find(sub, pos + sub.size())) ++n;
  return Value::Int(n);
}

absl::StatusOr<Value> StrJoin(Interpreter& in, const std::string& name, const Value& self,
                              CallArgs& args) {
  KVCM_RETURN_IF_ERROR(CheckArgs(args, 1, {}, name));
  if (args.positional.size() != 1) return TypeError("join() takes exactly one argument");
  KVCM_ASSIGN_OR_RETURN(std::vector<Value> items, Iterate(args.positional[0]));
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) {
    if (!items[i].is_string()) {
      return TypeError(absl::StrCat("sequence item ", i, ": expected str instance, ",
                                    items[i].TypeName(), " found"));
    }
    if (i > 0) out += self.as_string();
    out += items[i].as_string();
    KVCM_RETURN_IF_ERROR(in.CheckSize(out.size()));
  }
  return Value::String(std::move(out));
}

// The argument a str.format field `{field}` names; null when there is none.
const Value* FormatArg(const std::string& field, const CallArgs& args, size_t& auto_index) {
  if (field.empty()) {
    const Value* v = auto_index < args.positional.size() ? &args.positional[auto_index] : nullptr;
    ++auto_index;
    return v;
  }
  if (std::all_of(field.begin(), field.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    const size_t index = std::stoul(field);
    return index < args.positional.size() ? &args.positional[index] : nullptr;
  }
  return Arg(args, SIZE_MAX, field);
}

absl::StatusOr<Value> StrFormat(Interpreter& in, const std::string&, const Value& self,
                                CallArgs& args) {
  const std::string& s = self.as_string();
  std::string out;
  size_t auto_index = 0;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '{' && i + 1 < s.size() && s[i + 1] == '{') {
      out.push_back('{');
      ++i;
    } else if (s[i] == '}' && i + 1 < s.size() && s[i + 1] == '}') {
      out.push_back('}');
      ++i;
    } else if (s[i] == '{') {
      const size_t close = s.find('}', i);
      if (close == std::string::npos) return TypeError("Single '{' encountered in format string");
      const std::string field = s.substr(i + 1, close - i - 1);
      if (field.find_first_of(":!.[") != std::string::npos) {
        return NotSupported("a str.format field with a conversion or format spec");
      }
      const Value* v = FormatArg(field, args, auto_index);
      if (v == nullptr) return TypeError(absl::StrCat("format: no argument for {", field, "}"));
      out += ToStr(*v);
      i = close;
    } else if (s[i] == '}') {
      return TypeError("Single '}' encountered in format string");
    } else {
      out.push_back(s[i]);
    }
  }
  KVCM_RETURN_IF_ERROR(in.CheckSize(out.size()));
  return Value::String(std::move(out));
}

// isdigit isalpha isalnum isspace isupper islower, on ASCII text (isspace on any).
absl::StatusOr<Value> StrIsClass(Interpreter&, const std::string& name, const Value& self,
                                 CallArgs& args) {
  KVCM_RETURN_IF_ERROR(CheckArgs(args, 0, {}, name));
  std::u32string cps = DecodeUtf8(self.as_string());
  if (cps.empty()) return Value::Bool(false);
  bool cased = false;
  for (char32_t c : cps) {
    if (c >= 0x80 && name != "isspace")
      return NotSupported(absl::StrCat("str.", name, "() on non-ASCII text"));
    const bool digit = c >= '0' && c <= '9';
    const bool letter = IsAsciiLetter(c);
    if (name == "isdigit" && !digit) return Value::Bool(false);
    if (name == "isalpha" && !letter) return Value::Bool(false);
    if (name == "isalnum" && !letter && !digit) return Value::Bool(false);
    if (name == "isspace" && !IsPythonSpace(c)) return Value::Bool(false);
    if (name == "isupper" && c >= 'a' && c <= 'z') return Value::Bool(false);
    if (name == "islower" && c >= 'A' && c <= 'Z') return Value::Bool(false);
    cased = cased || letter;
  }
  if (name == "isupper" || name == "islower") return Value::Bool(cased);
  return Value::Bool(true);
}

constexpr Entry<MethodFn> kStrMethods[] = {
    {"capitalize", StrCapitalize},
    {"count", StrCount},
    {"endswith", StrAffix},
    {"find", StrFind},
    {"format", StrFormat},
    {"isalnum", StrIsClass},
    {"isalpha", StrIsClass},
    {"isdigit", StrIsClass},
    {"islower", StrIsClass},
    {"isspace", StrIsClass},
    {"isupper", StrIsClass},
    {"join", StrJoin},
    {"lower", StrLower},
    {"lstrip", StrStrip<true, false>},
    {"removeprefix", StrRemoveAffix},
    {"removesuffix", StrRemoveAffix},
    {"replace", StrReplace},
    {"rstrip", StrStrip<false, true>},
    {"split", StrSplit},
    {"splitlines", StrSplitlines},
    {"startswith", StrAffix},
    {"strip", StrStrip<true, true>},
    {"title", StrTitle},
    {"upper", StrUpper},
};
static_assert(SortedByName(kStrMethods));

bool IsStringMethod(std::string_view name) { return FindIn(kStrMethods, name) != nullptr; }
bool IsDictMethod(std::string_view name) { return FindIn(kDictMethods, name) != nullptr; }

// Python's other methods: the subset refuses them by name.
bool IsOtherPythonStringMethod(std::string_view name) {
  static constexpr std::string_view kMethods[] = {
      "casefold", "center", "encode", "expandtabs", "format_map", "index", "isascii",
      "isdecimal", "isidentifier", "isnumeric", "isprintable", "istitle", "ljust", "maketrans",
      "partition", "rfind", "rindex", "rjust", "rpartition", "rsplit", "swapcase", "translate",
      "zfill"};
  return std::find(std::begin(kMethods), std::end(kMethods), name) != std::end(kMethods);
}
bool IsOtherPythonDictMethod(std::string_view name) {
  static constexpr std::string_view kMethods[] = {"clear", "copy", "fromkeys", "pop", "popitem",
                                                  "setdefault", "update"};
  return std::find(std::begin(kMethods), std::end(kMethods), name) != std::end(kMethods);
}
bool IsPythonListMethod(std::string_view name) {
  static constexpr std::string_view kMethods[] = {"append", "clear", "copy", "count", "extend",
                                                  "index", "insert", "pop", "remove", "reverse",
                                                  "sort"};
  return std::find(std::begin(kMethods), std::end(kMethods), name) != std::end(kMethods);
}

Value UnsupportedMethod(const Value& self, const std::string& name) {
  const std::string what = absl::StrCat("the ", self.TypeName(), " method '", name, "'");
  return Value::MakeCallable(name, [what](Interpreter&, CallArgs&) -> absl::StatusOr<Value> {
    return NotSupported(what);
  });
}

// Python's attribute lookup on obj; nullopt when there is no such attribute.
std::optional<Value> PythonAttr(const Value& obj, const std::string& name) {
  if (obj.is_string()) {
    if (IsStringMethod(name)) return BoundMethod(obj, name);
    if (IsOtherPythonStringMethod(name)) return UnsupportedMethod(obj, name);
  } else if (obj.is_dict()) {
    if (IsDictMethod(name)) return BoundMethod(obj, name);
    if (IsOtherPythonDictMethod(name)) return UnsupportedMethod(obj, name);
  } else if (obj.is_list()) {
    if (IsPythonListMethod(name)) return UnsupportedMethod(obj, name);
  } else if (obj.is_namespace()) {
    if (const Value* v = obj.as_namespace().attrs.Find(name)) return *v;
  }
  return std::nullopt;
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

std::string HtmlEscape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&#34;"; break;
      case '\'': out += "&#39;"; break;
      default: out.push_back(c);
    }
  }
  return out;
}

std::string EnsureAscii(const std::string& json) {
  std::string out;
  for (char32_t c : DecodeUtf8(json)) {
    if (c < 0x80) {
      out.push_back(static_cast<char>(c));
      continue;
    }
    char buf[16];
    if (c < 0x10000) {
      std::snprintf(buf, sizeof(buf), "\\u%04x", static_cast<unsigned>(c));
      out += buf;
    } else {
      const char32_t v = c - 0x10000;
      std::snprintf(buf, sizeof(buf), "\\u%04x\\u%04x", static_cast<unsigned>(0xD800 + (v >> 10)),
                    static_cast<unsigned>(0xDC00 + (v & 0x3FF)));
      out += buf;
    }
  }
  return out;
}

// Jinja's attribute getter for filters: "a.b.0", item access first.
absl::StatusOr<Value> AttributeOf(const Value& item, const std::string& attribute) {
  Value cur = item;
  size_t start = 0;
  while (true) {
    const size_t dot = attribute.find('.', start);
    const std::string part = attribute.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    bool is_int = !part.empty();
    for (char c : part) is_int = is_int && c >= '0' && c <= '9';
    if (is_int) {
      KVCM_ASSIGN_OR_RETURN(cur, GetItem(cur, Value::Int(std::stoll(part))));
    } else {
      KVCM_ASSIGN_OR_RETURN(cur, GetItem(cur, Value::String(part)));
    }
    if (dot == std::string::npos) break;
    start = dot + 1;
  }
  return cur;
}

// ---- Tests: `value is name(args)`.

using TestFn = absl::StatusOr<bool> (*)(Interpreter& in, const std::string& name, const Value& v,
                                        CallArgs& args);

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

// ---- Filters: `value | name(args)`.

using FilterFn = absl::StatusOr<Value> (*)(Interpreter& in, const std::string& name, const Value& v,
                                           CallArgs& args);

absl::StatusOr<Value> FilterSafe(Interpreter&, const std::string&, const Value& v, CallArgs&) {
  return v;
}

absl::StatusOr<Value> FilterDefault(Interpreter&, const std::string& name, const Value& v,
                                    CallArgs& args) {
  KVCM_RETURN_IF_ERROR(CheckArgs(args, 2, {"default_value", "boolean"}, name));
  const Value* dflt = Arg(args, 0, "default_value");
  const Value* boolean = Arg(args, 1, "boolean");
  if (v.is_undefined() || (boolean != nullptr && boolean->Truthy() && !v.Truthy())) {
    return dflt != nullptr ? *dflt : Value::String("");
  }
  return v;
}

absl::StatusOr<Value> FilterLength(Interpreter&, const std::string&, const Value& v, CallArgs&) {
  KVCM_ASSIGN_OR_RETURN(int64_t n, Length(v));
  return Value::Int(n);
}

absl::StatusOr<Value> FilterString(Interpreter&, const std::string&, const Value& v, CallArgs&) {
  return Value::String(ToStr(v));
}

absl::StatusOr<Value> FilterTrim(Interpreter&, const std::string& name, const Value& v,
                                 CallArgs& args) {
  KVCM_RETURN_IF_ERROR(CheckArgs(args, 1, {"chars"}, name));
  const Value* chars = Arg(args, 0, "chars");
  Value s = Value::String(ToStr(v));
  CallArgs strip_args;
  if (chars != nullptr) strip_args.positional.push_back(*chars);
  KVCM_ASSIGN_OR_RETURN(std::string out, StripMethod(s, strip_args, true, true, "strip"));
  return Value::String(std::move(out));
}

absl::StatusOr<Value> FilterUpper(Interpreter&, const std::string&, const Value& v, CallArgs&) {
  return Value::String(CaseUpper(ToStr(v)));
}

absl::StatusOr<Value> FilterLower(Interpreter&, const std::string&, const Value& v, CallArgs&) {
  return Value::String(CaseLower(ToStr(v)));
}

absl::StatusOr<Value> FilterCapitalize(Interpreter& in, const std::string&, const Value& v,
                                       CallArgs&) {
  CallArgs none;
  return in.CallMethod(Value::String(ToStr(v)), "capitalize", none);
}

absl::StatusOr<Value> FilterTitle(Interpreter&, const std::string&, const Value& v, CallArgs&) {
  std::u32string cps = DecodeUtf8(ToStr(v));
  bool word_start = true;
  for (char32_t& c : cps) {
    const bool separator =
        c == '-' || c == '(' || c == '{' || c == '[' || c == '<' || IsPythonSpace(c);
    if (separator) {
      word_start = true;
    } else {
      c = word_start ? Upper(c) : Lower(c);
      word_start = false;
    }
  }
  return Value::String(EncodeUtf8(cps));
}

absl::StatusOr<Value> FilterEscape(Interpreter&, const std::string&, const Value& v, CallArgs&) {
  return Value::String(HtmlEscape(ToStr(v)));
}

absl::StatusOr<Value> FilterReplace(Interpreter& in, const std::string& name, const Value& v,
                                    CallArgs& args) {
  KVCM_RETURN_IF_ERROR(CheckArgs(args, 3, {"old", "new", "count"}, name));
  const Value* old_v = Arg(args, 0, "old");
  const Value* new_v = Arg(args, 1, "new");
  const Value* count_v = Arg(args, 2, "count");
  if (old_v == nullptr || new_v == nullptr) return TypeError("replace() needs old and new");
  int64_t count = -1;
  if (count_v != nullptr && !count_v->is_none()) {
    if (!count_v->is_int()) return TypeError("replace() count must be an int");
    count = count_v->as_int();
  }
  std::string out = Replace(ToStr(v), ToStr(*old_v), ToStr(*new_v), count);
  KVCM_RETURN_IF_ERROR(in.CheckSize(out.size()));
  return Value::String(std::move(out));
}

absl::StatusOr<Value> FilterIndent(Interpreter& in, const std::string& name, const Value& v,
                                   CallArgs& args) {
  KVCM_RETURN_IF_ERROR(CheckArgs(args, 3, {"width", "first", "blank"}, name));
  const Value* width = Arg(args, 0, "width");
  const Value* first = Arg(args, 1, "first");
  const Value* blank = Arg(args, 2, "blank");
  std::string indention(4, ' ');
  if (width != nullptr) {
    if (width->is_string()) {
      indention = width->as_string();
    } else if (width->is_int()) {
      indention =
          std::string(static_cast<size_t>(std::clamp<int64_t>(width->as_int(), 0, 4096)), ' ');
    } else {
      return TypeError("indent() width must be an int or a str");
    }
  }
  std::vector<std::string> lines = SplitLines(ToStr(v) + "\n");
  std::string rv;
  if (blank != nullptr && blank->Truthy()) {
    for (size_t i = 0; i < lines.size(); ++i) {
      if (i > 0) rv += "\n" + indention;
      rv += lines[i];
    }
  } else {
    rv = lines.empty() ? "" : lines[0];
    for (size_t i = 1; i < lines.size(); ++i) {
      rv += "\n";
      if (!lines[i].empty()) rv += indention + lines[i];
    }
  }
  if (first != nullptr && first->Truthy()) rv = indention + rv;
  KVCM_RETURN_IF_ERROR(in.CheckSize(rv.size()));
  return Value::String(std::move(rv));
}

absl::StatusOr<Value> FilterTojson(Interpreter& in, const std::string& name, const Value& v,
                                   CallArgs& args) {
  KVCM_RETURN_IF_ERROR(
      CheckArgs(args, 4, {"ensure_ascii", "indent", "separators", "sort_keys"}, name));
  const Value* ensure_ascii = Arg(args, 0, "ensure_ascii");
  const Value* indent_v = Arg(args, 1, "indent");
  const Value* separators = Arg(args, 2, "separators");
  const Value* sort_keys = Arg(args, 3, "sort_keys");
  int indent = -1;
  std::string indent_string;
  if (indent_v != nullptr && !indent_v->is_none()) {
    if (indent_v->is_int()) {
      indent = static_cast<int>(std::clamp<int64_t>(indent_v->as_int(), 0, 4096));
    } else if (indent_v->is_string()) {
      indent = 0;
      indent_string = indent_v->as_string();
    } else {
      return TypeError("tojson indent must be an int or a str");
    }
  }
  std::string item_sep = indent >= 0 ? "," : ", ";
  std::string key_sep = ": ";
  if (separators != nullptr && !separators->is_none()) {
    if (!separators->is_list() || separators->as_list().items.size() != 2 ||
        !separators->as_list().items[0].is_string() ||
        !separators->as_list().items[1].is_string()) {
      return TypeError("tojson separators must be a pair of strings");
    }
    item_sep = separators->as_list().items[0].as_string();
    key_sep = separators->as_list().items[1].as_string();
  }
  KVCM_ASSIGN_OR_RETURN(std::string json, ToJson(v, indent, indent_string, item_sep, key_sep,
                                                 sort_keys != nullptr && sort_keys->Truthy()));
  if (ensure_ascii != nullptr && ensure_ascii->Truthy()) json = EnsureAscii(json);
  KVCM_RETURN_IF_ERROR(in.CheckSize(json.size()));
  return Value::String(std::move(json));
}

absl::StatusOr<Value> FilterInt(Interpreter&, const std::string& name, const Value& v,
                                CallArgs& args) {
  KVCM_RETURN_IF_ERROR(CheckArgs(args, 2, {"default", "base"}, name));
  const Value* dflt = Arg(args, 0, "default");
  const Value fallback = dflt != nullptr ? *dflt : Value::Int(0);
  if (v.is_int()) return v;
  if (v.is_bool()) return Value::Int(v.as_bool());
  if (v.is_float()) {
    if (!std::isfinite(v.as_float()) || std::fabs(v.as_float()) > 9e18) return fallback;
    return Value::Int(static_cast<int64_t>(v.as_float()));
  }
  if (v.is_string()) {
    const std::string t = Strip(v.as_string(), nullptr, true, true);
    char* end = nullptr;
    errno = 0;
    const long long i = std::strtoll(t.c_str(), &end, 10);
    if (!t.empty() && end == t.c_str() + t.size() && errno == 0) return Value::Int(i);
    const double d = std::strtod(t.c_str(), &end);
    if (!t.empty() && end == t.c_str() + t.size() && std::isfinite(d) && std::fabs(d) < 9e18) {
      return Value::Int(static_cast<int64_t>(d));
    }
  }
  return fallback;
}

absl::StatusOr<Value> FilterFloat(Interpreter&, const std::string& name, const Value& v,
                                  CallArgs& args) {
  KVCM_RETURN_IF_ERROR(CheckArgs(args, 1, {"default"}, name));
  const Value* dflt = Arg(args, 0, "default");
  const Value fallback = dflt != nullptr ? *dflt : Value::Float(0.0);
  if (v.is_number()) return Value::Float(v.as_double());
  if (v.is_string()) {
    const std::string t = Strip(v.as_string(), nullptr, true, true);
    char* end = nullptr;
    const double d = std::strtod(t.c_str(), &end);
    if (!t.empty() && end == t.c_str() + t.size()) return Value::Float(d);
  }
  return fallback;
}

absl::StatusOr<Value> FilterAbs(Interpreter&, const std::string&, const Value& v, CallArgs&) {
  if (v.is_float()) return Value::Float(std::fabs(v.as_float()));
  if (v.is_int()) {
    if (v.as_int() == INT64_MIN) return NotSupported("an integer beyond 64 bits");
    return Value::Int(v.as_int() < 0 ? -v.as_int() : v.as_int());
  }
  if (v.is_bool()) return Value::Int(v.as_bool());
  return TypeError(absl::StrCat("bad operand type for abs(): '", v.TypeName(), "'"));
}

absl::StatusOr<Value> FilterItems(Interpreter& in, const std::string&, const Value& v, CallArgs&) {
  if (v.is_undefined()) return Value::MakeList({});
  if (!v.is_dict()) return TypeError("Can only get item pairs from a mapping.");
  CallArgs none;
  return in.CallMethod(v, "items", none);
}

absl::StatusOr<Value> FilterList(Interpreter&, const std::string&, const Value& v, CallArgs&) {
  KVCM_ASSIGN_OR_RETURN(std::vector<Value> items, Iterate(v));
  return Value::MakeList(std::move(items));
}

// first / last.
absl::StatusOr<Value> FilterEnd(Interpreter&, const std::string& name, const Value& v, CallArgs&) {
  KVCM_ASSIGN_OR_RETURN(std::vector<Value> items, Iterate(v));
  if (items.empty())
    return Value::MakeUndefined(absl::StrCat("the ", name, " item of an empty sequence"));
  return name == "first" ? items.front() : items.back();
}

absl::StatusOr<Value> FilterReverse(Interpreter&, const std::string&, const Value& v, CallArgs&) {
  if (v.is_string()) {
    std::u32string cps = Chars(v);
    std::reverse(cps.begin(), cps.end());
    return Value::String(EncodeUtf8(cps));
  }
  KVCM_ASSIGN_OR_RETURN(std::vector<Value> items, Iterate(v));
  std::reverse(items.begin(), items.end());
  return Value::MakeList(std::move(items));
}

absl::StatusOr<Value> FilterJoin(Interpreter& in, const std::string& name, const Value& v,
                                 CallArgs& args) {
  KVCM_RETURN_IF_ERROR(CheckArgs(args, 2, {"d", "attribute"}, name));
  const Value* sep = Arg(args, 0, "d");
  const Value* attribute = Arg(args, 1, "attribute");
  KVCM_ASSIGN_OR_RETURN(std::vector<Value> items, Iterate(v));
  const std::string d = sep != nullptr ? ToStr(*sep) : "";
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) {
    if (i > 0) out += d;
    if (attribute != nullptr && !attribute->is_none()) {
      KVCM_ASSIGN_OR_RETURN(Value item, AttributeOf(items[i], ToStr(*attribute)));
      out += ToStr(item);
    } else {
      out += ToStr(items[i]);
    }
    KVCM_RETURN_IF_ERROR(in.CheckSize(out.size()));
  }
  return Value::String(std::move(out));
}

// map(attribute=..., default=...).
absl::StatusOr<Value> MapAttribute(const std::vector<Value>& items, const Value& attribute,
                                   const Value* dflt) {
  std::vector<Value> out;
  for (const Value& item : items) {
    KVCM_ASSIGN_OR_RETURN(Value x, AttributeOf(item, ToStr(attribute)));
    if (x.is_undefined() && dflt != nullptr) x = *dflt;
    out.push_back(std::move(x));
  }
  return Value::MakeList(std::move(out));
}

absl::StatusOr<Value> FilterMap(Interpreter& in, const std::string&, const Value& v,
                                CallArgs& args) {
  KVCM_ASSIGN_OR_RETURN(std::vector<Value> items, Iterate(v));
  const Value* attribute = nullptr;
  const Value* dflt = nullptr;
  for (const auto& [k, kv] : args.keyword) {
    if (k == "attribute")
      attribute = &kv;
    else if (k == "default")
      dflt = &kv;
  }
  if (attribute != nullptr) return MapAttribute(items, *attribute, dflt);
  if (args.positional.empty() || !args.positional[0].is_string()) {
    return TypeError("map() needs a filter name or attribute=");
  }
  const std::string filter = args.positional[0].as_string();
  if (!IsKnownFilter(filter)) return NotSupported(absl::StrCat("the filter '", filter, "'"));
  CallArgs rest;
  rest.positional.assign(args.positional.begin() + 1, args.positional.end());
  rest.keyword = args.keyword;
  std::vector<Value> out;
  for (const Value& item : items) {
    KVCM_RETURN_IF_ERROR(in.Charge(1));
    CallArgs copy = rest;
    KVCM_ASSIGN_OR_RETURN(Value x, in.ApplyFilter(filter, item, copy));
    out.push_back(std::move(x));
  }
  return Value::MakeList(std::move(out));
}

// select reject selectattr rejectattr.
absl::StatusOr<Value> FilterSelect(Interpreter& in, const std::string& name, const Value& v,
                                   CallArgs& args) {
  const bool by_attr = name == "selectattr" || name == "rejectattr";
  const bool keep_if = name == "select" || name == "selectattr";
  KVCM_ASSIGN_OR_RETURN(std::vector<Value> items, Iterate(v));
  size_t next = 0;
  std::string attribute;
  if (by_attr) {
    if (args.positional.empty()) return TypeError(absl::StrCat(name, "() needs an attribute"));
    attribute = ToStr(args.positional[next++]);
  }
  std::string test;
  if (next < args.positional.size()) test = ToStr(args.positional[next++]);
  if (!test.empty() && !IsKnownTest(test))
    return NotSupported(absl::StrCat("the test '", test, "'"));
  CallArgs test_args;
  test_args.positional.assign(args.positional.begin() + static_cast<std::ptrdiff_t>(next),
                              args.positional.end());
  std::vector<Value> out;
  for (const Value& item : items) {
    KVCM_RETURN_IF_ERROR(in.Charge(1));
    Value x = item;
    if (by_attr) {
      KVCM_ASSIGN_OR_RETURN(x, AttributeOf(item, attribute));
    }
    bool pass;
    if (test.empty()) {
      pass = x.Truthy();
    } else {
      CallArgs copy = test_args;
      KVCM_ASSIGN_OR_RETURN(pass, in.ApplyTest(test, x, copy));
    }
    if (pass == keep_if) out.push_back(item);
  }
  return Value::MakeList(std::move(out));
}

// The keys unique and sort compare: the item or its attribute, lowered unless case-sensitive.
absl::StatusOr<std::vector<Value>> SortKeys(const std::vector<Value>& items,
                                            const Value* case_sensitive, const Value* attribute) {
  const bool cs = case_sensitive != nullptr && case_sensitive->Truthy();
  std::vector<Value> keys;
  for (const Value& item : items) {
    Value key = item;
    if (attribute != nullptr && !attribute->is_none()) {
      KVCM_ASSIGN_OR_RETURN(key, AttributeOf(item, ToStr(*attribute)));
    }
    if (!cs && key.is_string()) key = Value::String(CaseLower(key.as_string()));
    keys.push_back(std::move(key));
  }
  return keys;
}

absl::StatusOr<Value> FilterUnique(Interpreter& in, const std::string& name, const Value& v,
                                   CallArgs& args) {
  KVCM_RETURN_IF_ERROR(CheckArgs(args, 2, {"reverse", "case_sensitive", "attribute"}, name));
  const Value* case_sensitive = Arg(args, 0, "case_sensitive");
  const Value* attribute = Arg(args, 1, "attribute");
  KVCM_ASSIGN_OR_RETURN(std::vector<Value> items, Iterate(v));
  KVCM_ASSIGN_OR_RETURN(std::vector<Value> keys, SortKeys(items, case_sensitive, attribute));
  std::vector<Value> out, seen;
  for (size_t i = 0; i < items.size(); ++i) {
    KVCM_RETURN_IF_ERROR(in.Charge(static_cast<int64_t>(seen.size())));
    bool dup = false;
    for (const Value& s : seen) dup = dup || Equal(s, keys[i]);
    if (!dup) {
      seen.push_back(keys[i]);
      out.push_back(items[i]);
    }
  }
  return Value::MakeList(std::move(out));
}

absl::StatusOr<Value> FilterSort(Interpreter&, const std::string& name, const Value& v,
                                 CallArgs& args) {
  KVCM_RETURN_IF_ERROR(CheckArgs(args, 3, {"reverse", "case_sensitive", "attribute"}, name));
  const Value* reverse = Arg(args, 0, "reverse");
  const Value* case_sensitive = Arg(args, 1, "case_sensitive");
  const Value* attribute = Arg(args, 2, "attribute");
  KVCM_ASSIGN_OR_RETURN(std::vector<Value> items, Iterate(v));
  KVCM_ASSIGN_OR_RETURN(std::vector<Value> keys, SortKeys(items, case_sensitive, attribute));
  std::vector<size_t> order(items.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  absl::Status error;
  const bool rev = reverse != nullptr && reverse->Truthy();
  std::stable_sort(order.begin(), order.end(), [&](size_t x, size_t y) {
    absl::StatusOr<bool> lt = rev ? Less(keys[y], keys[x]) : Less(keys[x], keys[y]);
    if (!lt.ok()) {
      error = lt.status();
      return false;
    }
    return *lt;
  });
  KVCM_RETURN_IF_ERROR(error);
  std::vector<Value> out;
  for (size_t i : order) out.push_back(items[i]);
  return Value::MakeList(std::move(out));
}

constexpr Entry<FilterFn> kFilterTable[] = {
    {"abs", FilterAbs},           {"capitalize", FilterCapitalize},
    {"count", FilterLength},      {"d", FilterDefault},
    {"default", FilterDefault},   {"e", FilterEscape},
    {"escape", FilterEscape},     {"first", FilterEnd},
    {"float", FilterFloat},       {"indent", FilterIndent},
    {"int", FilterInt},           {"items", FilterItems},
    {"join", FilterJoin},         {"last", FilterEnd},
    {"length", FilterLength},     {"list", FilterList},
    {"lower", FilterLower},       {"map", FilterMap},
    {"reject", FilterSelect},     {"rejectattr", FilterSelect},
    {"replace", FilterReplace},   {"reverse", FilterReverse},
    {"safe", FilterSafe},         {"select", FilterSelect},
    {"selectattr", FilterSelect}, {"sort", FilterSort},
    {"string", FilterString},     {"title", FilterTitle},
    {"tojson", FilterTojson},     {"trim", FilterTrim},
    {"unique", FilterUnique},     {"upper", FilterUpper},
};
static_assert(SortedByName(kFilterTable));

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

bool IsKnownFilter(std::string_view name) { return FindIn(kFilterTable, name) != nullptr; }
bool IsKnownTest(std::string_view name) { return FindIn(kTestTable, name) != nullptr; }

std::vector<std::string_view> SupportedFilters() { return KeysOf(kFilterTable); }
std::vector<std::string_view> SupportedTests() { return KeysOf(kTestTable); }
std::vector<std::string_view> SupportedMethods(std::string_view type) {
  if (type == "str") return KeysOf(kStrMethods);
  if (type == "dict") return KeysOf(kDictMethods);
  return {};
}

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
  builtins_["raise_exception"] =
      Value::MakeCallable("raise_exception", [](Interpreter& in, CallArgs& args) -> absl::StatusOr<Value> {
        const Value* msg = Arg(args, 0, "message");
        return in.Raise(msg == nullptr ? std::string() : ToStr(*msg));
      });
  builtins_["strftime_now"] =
      Value::MakeCallable("strftime_now", [](Interpreter&, CallArgs& args) -> absl::StatusOr<Value> {
        const Value* fmt = Arg(args, 0, "format");
        if (fmt == nullptr || !fmt->is_string()) return TypeError("strftime_now() needs a format string");
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
            return TypeError(absl::StrCat("'", v.TypeName(), "' object cannot be interpreted as an integer"));
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
            return TypeError(absl::StrCat(
                "Chat templates cannot store underscore-prefixed attributes on a namespace, but got ",
                StringRepr(k.as_string()), ". Please rename the attribute."));
          }
        }
        return Value::MakeNamespace(std::move(attrs));
      });
  for (const char* name : {"lipsum", "cycler", "joiner"}) {
    const std::string what = absl::StrCat("the function '", name, "'");
    builtins_[name] = Value::MakeCallable(name, [what](Interpreter&, CallArgs&) -> absl::StatusOr<Value> {
      return NotSupported(what);
    });
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
  return absl::Status(status.code(), absl::StrCat("chat template ", expr.pos.line, ":",
                                                  expr.pos.column, ": ", std::string(status.message())));
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
          stmt.text, [macro](Interpreter& in, CallArgs& args) { return in.CallMacro(*macro, args); });
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
      absl::StatusOr<Value> v = ApplyFilter(stmt.expr->name, Value::String(std::move(captured)), args);
      if (!v.ok()) return At(*stmt.expr, v.status());
      out += ToStr(*v);
      KVCM_RETURN_IF_ERROR(CheckSize(out.size()));
      return Flow::kNormal;
    }
  }
  return Flow::kNormal;
}

absl::Status Interpreter::Assign(const Stmt& stmt, Value value) {
  const auto error_at = [&stmt](std::string msg) {
    return SyntaxError(stmt.pos, msg);
  };
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
    loop.Set(Value::String("cycle"),
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
    return absl::ResourceExhaustedError(absl::StrCat(
        "chat template ", macro.pos.line, ":", macro.pos.column, ": macro calls nested deeper than ",
        limits_.max_call_depth));
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
    if (!known) return TypeError(absl::StrCat("macro '", macro.text, "' takes no keyword argument '", k, "'"));
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
  if (!callee.is_callable()) return TypeError(absl::StrCat("'", callee.TypeName(), "' object is not callable"));
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
  if (self.is_dict()) fn = FindIn(kDictMethods, name);
  if (self.is_string()) fn = FindIn(kStrMethods, name);
  if (fn == nullptr) {
    return NotSupported(absl::StrCat("the ", self.TypeName(), " method '", name, "'"));
  }
  return fn(*this, name, self, args);
}

absl::StatusOr<bool> Interpreter::ApplyTest(const std::string& name, const Value& v, CallArgs& args) {
  const TestFn fn = FindIn(kTestTable, name);
  if (fn == nullptr) return NotSupported(absl::StrCat("the test '", name, "'"));
  return fn(*this, name, v, args);
}

absl::StatusOr<Value> Interpreter::ApplyFilter(const std::string& name, const Value& v, CallArgs& args) {
  const FilterFn fn = FindIn(kFilterTable, name);
  if (fn == nullptr) return NotSupported(absl::StrCat("the filter '", name, "'"));
  return fn(*this, name, v, args);
}

}  // namespace kvcm::jinja
