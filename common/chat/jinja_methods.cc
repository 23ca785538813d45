// The str and dict methods of the subset (docs/chat-templates.md, "Methods:"), one small
// function each, in a table per receiver type; and Python's attribute lookup, which binds
// them (obj.name) or refuses the Python methods outside the subset by name.
#include <algorithm>
#include <optional>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/base/status_macros.h"
#include "common/chat/jinja_builtins.h"

namespace kvcm::jinja {
namespace internal {
namespace {

Value BoundMethod(const Value& self, const std::string& name) {
  return Value::MakeCallable(name, [self, name](Interpreter& in, CallArgs& args) {
    return in.CallMethod(self, name, args);
  });
}

// ---- Methods: self.name(args), per receiver type.

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
      "casefold",   "center",    "encode",       "expandtabs", "format_map",  "index",
      "isascii",    "isdecimal", "isidentifier", "isnumeric",  "isprintable", "istitle",
      "ljust",      "maketrans", "partition",    "rfind",      "rindex",      "rjust",
      "rpartition", "rsplit",    "swapcase",     "translate",  "zfill"};
  return std::find(std::begin(kMethods), std::end(kMethods), name) != std::end(kMethods);
}
bool IsOtherPythonDictMethod(std::string_view name) {
  static constexpr std::string_view kMethods[] = {"clear",   "copy",       "fromkeys", "pop",
                                                  "popitem", "setdefault", "update"};
  return std::find(std::begin(kMethods), std::end(kMethods), name) != std::end(kMethods);
}
bool IsPythonListMethod(std::string_view name) {
  static constexpr std::string_view kMethods[] = {"append", "clear",   "copy",   "count",
                                                  "extend", "index",   "insert", "pop",
                                                  "remove", "reverse", "sort"};
  return std::find(std::begin(kMethods), std::end(kMethods), name) != std::end(kMethods);
}

Value UnsupportedMethod(const Value& self, const std::string& name) {
  const std::string what = absl::StrCat("the ", self.TypeName(), " method '", name, "'");
  return Value::MakeCallable(name, [what](Interpreter&, CallArgs&) -> absl::StatusOr<Value> {
    return NotSupported(what);
  });
}

}  // namespace

MethodFn FindStrMethod(std::string_view name) { return FindIn(kStrMethods, name); }
MethodFn FindDictMethod(std::string_view name) { return FindIn(kDictMethods, name); }

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

}  // namespace internal

std::vector<std::string_view> SupportedMethods(std::string_view type) {
  if (type == "str") return internal::KeysOf(internal::kStrMethods);
  if (type == "dict") return internal::KeysOf(internal::kDictMethods);
  return {};
}

}  // namespace kvcm::jinja
