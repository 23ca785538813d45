// The helpers common/chat/jinja_builtins.h declares: Python's errors and argument binding, and
// the Python semantics the interpreter and its builtins share (docs/chat-templates.md).
#include "common/chat/jinja_builtins.h"

#include <locale.h>

#include <cwctype>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/base/status_macros.h"

namespace kvcm::jinja::internal {

absl::Status TypeError(std::string message) {
  return absl::InvalidArgumentError(std::move(message));
}

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
      return TypeError(
          absl::StrCat(std::string(fn), "() got an unexpected keyword argument '", k, "'"));
    }
  }
  return absl::OkStatus();
}

std::u32string Chars(const Value& v) { return DecodeUtf8(v.as_string()); }

// Case mapping: the C.UTF-8 locale's simple mappings (what Python's str.upper/lower do for
// all but a few characters such as U+00DF, which Python maps to two); ASCII only where
// that locale is missing.
locale_t Utf8Locale() {
  static const locale_t locale =
      newlocale(LC_CTYPE_MASK, "C.UTF-8", static_cast<locale_t>(nullptr));
  return locale;
}
char32_t Upper(char32_t c) {
  if (c < 0x80 || Utf8Locale() == static_cast<locale_t>(nullptr))
    return (c >= 'a' && c <= 'z') ? c - 'a' + 'A' : c;
  return static_cast<char32_t>(towupper_l(static_cast<wint_t>(c), Utf8Locale()));
}
char32_t Lower(char32_t c) {
  if (c < 0x80 || Utf8Locale() == static_cast<locale_t>(nullptr))
    return (c >= 'A' && c <= 'Z') ? c - 'A' + 'a' : c;
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
    if (!chars->is_string())
      return TypeError(absl::StrCat(std::string(fn), " arg must be None or str"));
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
  return TypeError(absl::StrCat("'<' not supported between instances of '", a.TypeName(), "' and '",
                                b.TypeName(), "'"));
}

absl::StatusOr<bool> Contains(const Value& container, const Value& item) {
  if (container.is_string()) {
    if (!item.is_string()) {
      return TypeError(
          absl::StrCat("'in <string>' requires string as left operand, not ", item.TypeName()));
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

}  // namespace kvcm::jinja::internal
