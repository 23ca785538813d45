// The filters of the subset (docs/chat-templates.md, "Filters:"): `value | name(args)`, one
// small function each, in a table from name to function as Jinja's FILTERS.
#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/base/status_macros.h"
#include "common/chat/jinja_builtins.h"

namespace kvcm::jinja {
namespace internal {
namespace {

std::string HtmlEscape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&#34;";
        break;
      case '\'':
        out += "&#39;";
        break;
      default:
        out.push_back(c);
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
    const std::string part =
        attribute.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
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

// ---- Filters: `value | name(args)`.

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

}  // namespace

FilterFn FindFilter(std::string_view name) { return FindIn(kFilterTable, name); }

}  // namespace internal

bool IsKnownFilter(std::string_view name) { return internal::FindFilter(name) != nullptr; }
std::vector<std::string_view> SupportedFilters() {
  return internal::KeysOf(internal::kFilterTable);
}

}  // namespace kvcm::jinja
