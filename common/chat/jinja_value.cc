#include "common/chat/jinja_value.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <string>
#include <system_error>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace kvcm::jinja {

const Value* Dict::Find(const Value& key) const {
  for (const auto& [k, v] : items) {
    if (Equal(k, key)) return &v;
  }
  return nullptr;
}

const Value* Dict::Find(std::string_view key) const {
  for (const auto& [k, v] : items) {
    if (k.is_string() && k.as_string() == key) return &v;
  }
  return nullptr;
}

void Dict::Set(Value key, Value value) {
  for (auto& [k, v] : items) {
    if (Equal(k, key)) {
      v = std::move(value);
      return;
    }
  }
  items.emplace_back(std::move(key), std::move(value));
}

double Value::as_double() const {
  if (is_float()) return as_float();
  if (is_int()) return static_cast<double>(as_int());
  return as_bool() ? 1.0 : 0.0;
}

bool Value::Truthy() const {
  if (is_undefined() || is_none()) return false;
  if (is_bool()) return as_bool();
  if (is_int()) return as_int() != 0;
  if (is_float()) return as_float() != 0.0;
  if (is_string()) return !as_string().empty();
  if (is_list()) return !as_list().items.empty();
  if (is_dict()) return !as_dict().items.empty();
  return true;
}

std::string Value::TypeName() const {
  if (is_undefined()) return "Undefined";
  if (is_none()) return "NoneType";
  if (is_bool()) return "bool";
  if (is_int()) return "int";
  if (is_float()) return "float";
  if (is_string()) return "str";
  if (is_list()) return as_list().is_tuple ? "tuple" : "list";
  if (is_dict()) return "dict";
  if (is_namespace()) return "Namespace";
  return "function";
}

std::u32string DecodeUtf8(std::string_view s) {
  std::u32string out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    int len = 0;
    char32_t cp = 0;
    if (c < 0x80) {
      out.push_back(c);
      ++i;
      continue;
    } else if ((c & 0xE0) == 0xC0) {
      len = 2;
      cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      len = 3;
      cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      len = 4;
      cp = c & 0x07;
    } else {
      out.push_back(0xFFFD);
      ++i;
      continue;
    }
    if (i + static_cast<size_t>(len) > s.size()) {
      out.push_back(0xFFFD);
      ++i;
      continue;
    }
    bool ok = true;
    for (int k = 1; k < len; ++k) {
      const unsigned char cc = static_cast<unsigned char>(s[i + static_cast<size_t>(k)]);
      if ((cc & 0xC0) != 0x80) {
        ok = false;
        break;
      }
      cp = (cp << 6) | (cc & 0x3F);
    }
    if (!ok) {
      out.push_back(0xFFFD);
      ++i;
      continue;
    }
    out.push_back(cp);
    i += static_cast<size_t>(len);
  }
  return out;
}

std::string EncodeUtf8(std::u32string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char32_t cp : s) {
    if (cp < 0x80) {
      out.push_back(static_cast<char>(cp));
    } else if (cp < 0x800) {
      out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
      out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else if (cp < 0x10000) {
      out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
      out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
      out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else {
      out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
      out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
      out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
      out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    }
  }
  return out;
}

bool IsPythonSpace(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 ||
         c == 0x1680 || (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F ||
         c == 0x205F || c == 0x3000;
}

namespace {

bool IsPrintable(char32_t c) {
  if (c < 0x20 || c == 0x7F) return false;
  if (c >= 0x80 && c <= 0xA0) return false;
  if (c == 0xAD || c == 0x1680 || c == 0x3000 || c == 0xFEFF) return false;
  if (c >= 0x2000 && c <= 0x200F) return false;
  if (c >= 0x2028 && c <= 0x202F) return false;
  if (c >= 0x205F && c <= 0x2064) return false;
  if (c >= 0xD800 && c <= 0xDFFF) return false;
  return true;
}

std::string Hex(char32_t c, int digits) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out(static_cast<size_t>(digits), '0');
  for (int i = digits - 1; i >= 0; --i) {
    out[static_cast<size_t>(i)] = kDigits[c & 0xF];
    c >>= 4;
  }
  return out;
}

}  // namespace

std::string StringRepr(std::string_view s) {
  const bool has_single = s.find('\'') != std::string_view::npos;
  const bool has_double = s.find('"') != std::string_view::npos;
  const char quote = (has_single && !has_double) ? '"' : '\'';
  std::string out(1, quote);
  for (char32_t c : DecodeUtf8(s)) {
    if (c == static_cast<char32_t>(quote) || c == '\\') {
      out.push_back('\\');
      out.push_back(static_cast<char>(c));
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (IsPrintable(c)) {
      out += EncodeUtf8(std::u32string(1, c));
    } else if (c < 0x100) {
      out += "\\x" + Hex(c, 2);
    } else if (c < 0x10000) {
      out += "\\u" + Hex(c, 4);
    } else {
      out += "\\U" + Hex(c, 8);
    }
  }
  out.push_back(quote);
  return out;
}

std::string FloatRepr(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof(buf), d, std::chars_format::scientific);
  std::string sci(buf, res.ptr);
  // sci: [-]D[.DDD]e[+-]XX
  bool negative = false;
  if (!sci.empty() && sci[0] == '-') {
    negative = true;
    sci.erase(0, 1);
  }
  const size_t e_pos = sci.find('e');
  std::string mantissa = sci.substr(0, e_pos);
  const int exponent = std::stoi(sci.substr(e_pos + 1));
  std::string digits;
  for (char c : mantissa) {
    if (c != '.') digits.push_back(c);
  }
  while (digits.size() > 1 && digits.back() == '0') digits.pop_back();
  std::string out = negative ? "-" : "";
  if (exponent < -4 || exponent >= 16) {
    out += digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    char ebuf[16];
    std::snprintf(ebuf, sizeof(ebuf), "e%c%02d", exponent < 0 ? '-' : '+', std::abs(exponent));
    out += ebuf;
    return out;
  }
  const int point = exponent + 1;  // digits before the decimal point
  if (point <= 0) {
    out += "0." + std::string(static_cast<size_t>(-point), '0') + digits;
  } else if (static_cast<size_t>(point) >= digits.size()) {
    out += digits + std::string(static_cast<size_t>(point) - digits.size(), '0') + ".0";
  } else {
    out += digits.substr(0, static_cast<size_t>(point)) + "." +
           digits.substr(static_cast<size_t>(point));
  }
  return out;
}

std::string Repr(const Value& v) {
  if (v.is_string()) return StringRepr(v.as_string());
  if (v.is_list()) {
    const List& list = v.as_list();
    std::string out = list.is_tuple ? "(" : "[";
    for (size_t i = 0; i < list.items.size(); ++i) {
      if (i > 0) out += ", ";
      out += Repr(list.items[i]);
    }
    if (list.is_tuple && list.items.size() == 1) out += ",";
    out += list.is_tuple ? ")" : "]";
    return out;
  }
  if (v.is_dict()) {
    std::string out = "{";
    bool first = true;
    for (const auto& [k, item] : v.as_dict().items) {
      if (!first) out += ", ";
      first = false;
      out += Repr(k) + ": " + Repr(item);
    }
    return out + "}";
  }
  if (v.is_namespace()) {
    std::string out = "<Namespace {";
    bool first = true;
    for (const auto& [k, item] : v.as_namespace().attrs.items) {
      if (!first) out += ", ";
      first = false;
      out += Repr(k) + ": " + Repr(item);
    }
    return out + "}>";
  }
  if (v.is_undefined()) return "Undefined";
  return ToStr(v);
}

std::string ToStr(const Value& v) {
  if (v.is_undefined()) return "";
  if (v.is_none()) return "None";
  if (v.is_bool()) return v.as_bool() ? "True" : "False";
  if (v.is_int()) return std::to_string(v.as_int());
  if (v.is_float()) return FloatRepr(v.as_float());
  if (v.is_string()) return v.as_string();
  if (v.is_callable()) return "<function " + v.as_callable().name + ">";
  return Repr(v);
}

bool Equal(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if ((a.is_int() || a.is_bool()) && (b.is_int() || b.is_bool())) {
      const int64_t x = a.is_int() ? a.as_int() : (a.as_bool() ? 1 : 0);
      const int64_t y = b.is_int() ? b.as_int() : (b.as_bool() ? 1 : 0);
      return x == y;
    }
    return a.as_double() == b.as_double();
  }
  if (a.is_string() && b.is_string()) return a.as_string() == b.as_string();
  if (a.is_none() && b.is_none()) return true;
  if (a.is_undefined() && b.is_undefined()) return true;
  if (a.is_list() && b.is_list()) {
    const List& x = a.as_list();
    const List& y = b.as_list();
    if (x.is_tuple != y.is_tuple || x.items.size() != y.items.size()) return false;
    for (size_t i = 0; i < x.items.size(); ++i) {
      if (!Equal(x.items[i], y.items[i])) return false;
    }
    return true;
  }
  if (a.is_dict() && b.is_dict()) {
    const Dict& x = a.as_dict();
    const Dict& y = b.as_dict();
    if (x.items.size() != y.items.size()) return false;
    for (const auto& [k, item] : x.items) {
      const Value* other = y.Find(k);
      if (other == nullptr || !Equal(item, *other)) return false;
    }
    return true;
  }
  if (a.is_namespace() && b.is_namespace()) return &a.as_namespace() == &b.as_namespace();
  if (a.is_callable() && b.is_callable()) return &a.as_callable() == &b.as_callable();
  return false;
}

namespace {

std::string JsonString(std::string_view s) {
  std::string out = "\"";
  for (char c : s) {
    const unsigned char u = static_cast<unsigned char>(c);
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      default:
        if (u < 0x20) {
          out += "\\u" + Hex(u, 4);
        } else {
          out.push_back(c);
        }
    }
  }
  return out + "\"";
}

struct JsonWriter {
  int indent;
  std::string indent_string;
  std::string item_separator;
  std::string key_separator;
  bool sort_keys;
  int depth = 0;

  bool Indented() const { return indent >= 0 || !indent_string.empty(); }
  std::string Newline(int level) const {
    std::string out = "\n";
    const std::string unit =
        indent_string.empty() ? std::string(static_cast<size_t>(indent), ' ') : indent_string;
    for (int i = 0; i < level; ++i) out += unit;
    return out;
  }

  absl::StatusOr<std::string> Key(const Value& k) {
    if (k.is_string()) return JsonString(k.as_string());
    if (k.is_none()) return std::string("\"null\"");
    if (k.is_bool()) return std::string(k.as_bool() ? "\"true\"" : "\"false\"");
    if (k.is_int()) return "\"" + std::to_string(k.as_int()) + "\"";
    if (k.is_float()) return "\"" + FloatRepr(k.as_float()) + "\"";
    return absl::InvalidArgumentError(
        absl::StrCat("keys must be str, int, float, bool or None, not ", k.TypeName()));
  }

  absl::StatusOr<std::string> Write(const Value& v) {
    if (++depth > 512) return absl::InvalidArgumentError("tojson: nesting too deep");
    absl::StatusOr<std::string> out = WriteInner(v);
    --depth;
    return out;
  }

  absl::StatusOr<std::string> WriteInner(const Value& v) {
    if (v.is_none()) return std::string("null");
    if (v.is_bool()) return std::string(v.as_bool() ? "true" : "false");
    if (v.is_int()) return std::to_string(v.as_int());
    if (v.is_float()) {
      const double d = v.as_float();
      if (std::isnan(d)) return std::string("NaN");
      if (std::isinf(d)) return std::string(d > 0 ? "Infinity" : "-Infinity");
      return FloatRepr(d);
    }
    if (v.is_string()) return JsonString(v.as_string());
    if (v.is_list()) {
      const List& list = v.as_list();
      if (list.items.empty()) return std::string("[]");
      std::string out = "[";
      for (size_t i = 0; i < list.items.size(); ++i) {
        if (i > 0) out += item_separator;
        if (Indented()) out += Newline(depth);
        absl::StatusOr<std::string> item = Write(list.items[i]);
        if (!item.ok()) return item.status();
        out += *item;
      }
      if (Indented()) out += Newline(depth - 1);
      return out + "]";
    }
    if (v.is_dict()) {
      std::vector<const std::pair<Value, Value>*> items;
      for (const auto& item : v.as_dict().items) items.push_back(&item);
      if (items.empty()) return std::string("{}");
      if (sort_keys) {
        for (const auto* item : items) {
          if (!item->first.is_string()) {
            return absl::InvalidArgumentError("tojson: sort_keys needs string keys");
          }
        }
        std::stable_sort(items.begin(), items.end(), [](const auto* a, const auto* b) {
          return a->first.as_string() < b->first.as_string();
        });
      }
      std::string out = "{";
      for (size_t i = 0; i < items.size(); ++i) {
        if (i > 0) out += item_separator;
        if (Indented()) out += Newline(depth);
        absl::StatusOr<std::string> key = Key(items[i]->first);
        if (!key.ok()) return key.status();
        absl::StatusOr<std::string> item = Write(items[i]->second);
        if (!item.ok()) return item.status();
        out += *key + key_separator + *item;
      }
      if (Indented()) out += Newline(depth - 1);
      return out + "}";
    }
    return absl::InvalidArgumentError(
        absl::StrCat("Object of type ", v.TypeName(), " is not JSON serializable"));
  }
};

Value FromNlohmann(const nlohmann::ordered_json& j) {
  switch (j.type()) {
    case nlohmann::ordered_json::value_t::null:
      return Value::None();
    case nlohmann::ordered_json::value_t::boolean:
      return Value::Bool(j.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer:
      return Value::Int(j.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_unsigned:
      return Value::Int(static_cast<int64_t>(j.get<uint64_t>()));
    case nlohmann::ordered_json::value_t::number_float:
      return Value::Float(j.get<double>());
    case nlohmann::ordered_json::value_t::string:
      return Value::String(j.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      std::vector<Value> items;
      for (const auto& item : j) items.push_back(FromNlohmann(item));
      return Value::MakeList(std::move(items));
    }
    case nlohmann::ordered_json::value_t::object: {
      Dict dict;
      for (const auto& [k, item] : j.items()) dict.Set(Value::String(k), FromNlohmann(item));
      return Value::MakeDict(std::move(dict));
    }
    default:
      return Value::None();
  }
}

}  // namespace

absl::StatusOr<std::string> ToJson(const Value& v, int indent, const std::string& indent_string,
                                   const std::string& item_separator,
                                   const std::string& key_separator, bool sort_keys) {
  JsonWriter writer{indent, indent_string, item_separator, key_separator, sort_keys};
  return writer.Write(v);
}

absl::StatusOr<Value> FromJson(std::string_view json) {
  nlohmann::ordered_json j =
      nlohmann::ordered_json::parse(json, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return absl::InvalidArgumentError("not valid JSON");
  return FromNlohmann(j);
}

}  // namespace kvcm::jinja
