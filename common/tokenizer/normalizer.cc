#include "common/tokenizer/normalizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <unicode/locid.h>
#include <unicode/normalizer2.h>
#include <unicode/uchar.h>
#include <unicode/unistr.h>
#include <unicode/utf8.h>
#include <unicode/utypes.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/base/utf8.h"

namespace kvcm {
namespace internal {

std::string OnigurumaWhitespace(std::string_view pattern) {
  std::string out;
  out.reserve(pattern.size() + 32);
  bool quoted = false;
  for (size_t i = 0; i < pattern.size(); ++i) {
    const char ch = pattern[i];
    if (ch != '\\' || i + 1 == pattern.size()) {
      out.push_back(ch);
      continue;
    }
    const char next = pattern[i + 1];
    ++i;
    if (quoted) {
      if (next == 'E') quoted = false;
      out.push_back('\\');
      out.push_back(next);
    } else if (next == 'Q') {
      quoted = true;
      out += "\\Q";
    } else if (next == 's') {
      out += "\\p{White_Space}";
    } else if (next == 'S') {
      out += "\\P{White_Space}";
    } else {
      out.push_back('\\');
      out.push_back(next);
    }
  }
  return out;
}

}  // namespace internal

namespace {

using Kind = NormalizerStep::Kind;

bool IsAscii(std::string_view text) {
  return std::all_of(text.begin(), text.end(),
                     [](char c) { return static_cast<unsigned char>(c) < 0x80; });
}

// The code point at text[*i], advancing *i. REQUIRES: valid UTF-8.
UChar32 Next(std::string_view text, size_t* i) {
  UChar32 c;
  int32_t at = static_cast<int32_t>(*i);
  U8_NEXT_UNSAFE(reinterpret_cast<const uint8_t*>(text.data()), at, c);
  *i = static_cast<size_t>(at);
  return c;
}

void Append(UChar32 c, std::string* out) {
  std::array<uint8_t, U8_MAX_LENGTH> bytes{};
  int32_t n = 0;
  U8_APPEND_UNSAFE(bytes.data(), n, c);
  out->append(reinterpret_cast<const char*>(bytes.data()), static_cast<size_t>(n));
}

absl::Status IcuError(std::string_view what, UErrorCode error) {
  return absl::InternalError(absl::StrCat("ICU ", std::string(what), ": ", u_errorName(error)));
}

// Unicode normalization form `kind` of `text`; ASCII is its own form in all four.
absl::Status Normalize(Kind kind, std::string_view text, std::string* out) {
  if (IsAscii(text)) {
    out->assign(text);
    return absl::OkStatus();
  }
  UErrorCode error = U_ZERO_ERROR;
  const icu::Normalizer2* n = kind == Kind::kNfc    ? icu::Normalizer2::getNFCInstance(error)
                              : kind == Kind::kNfd  ? icu::Normalizer2::getNFDInstance(error)
                              : kind == Kind::kNfkc ? icu::Normalizer2::getNFKCInstance(error)
                                                    : icu::Normalizer2::getNFKDInstance(error);
  if (U_FAILURE(error)) return IcuError("normalizer", error);
  const icu::UnicodeString source = icu::UnicodeString::fromUTF8(
      icu::StringPiece(text.data(), static_cast<int32_t>(text.size())));
  const icu::UnicodeString result = n->normalize(source, error);
  if (U_FAILURE(error)) return IcuError("normalize", error);
  out->clear();
  result.toUTF8String(*out);
  return absl::OkStatus();
}

// Each character's full lowercase mapping on its own (no context: Rust's char::to_lowercase,
// which Hugging Face's NormalizedString::lowercase applies character by character).
void Lowercase(std::string_view text, std::string* out) {
  out->clear();
  out->reserve(text.size());
  for (size_t i = 0; i < text.size();) {
    const auto b = static_cast<unsigned char>(text[i]);
    if (b < 0x80) {
      out->push_back(static_cast<char>(b >= 'A' && b <= 'Z' ? b + ('a' - 'A') : b));
      ++i;
      continue;
    }
    const UChar32 c = Next(text, &i);
    if (u_tolower(c) == c && u_hasBinaryProperty(c, UCHAR_CHANGES_WHEN_LOWERCASED) == 0) {
      Append(c, out);
      continue;
    }
    icu::UnicodeString one(c);
    one.toLower(icu::Locale::getRoot());
    one.toUTF8String(*out);
  }
}

void Strip(std::string_view text, bool left, bool right, std::string* out) {
  size_t begin = 0;
  size_t end = text.size();
  if (left) {
    while (begin < end) {
      size_t i = begin;
      if (!u_isUWhiteSpace(Next(text, &i))) break;
      begin = i;
    }
  }
  if (right) {
    while (end > begin) {
      size_t start = end - 1;
      while (start > begin && (static_cast<unsigned char>(text[start]) & 0xC0) == 0x80) --start;
      size_t i = start;
      if (!u_isUWhiteSpace(Next(text, &i))) break;
      end = start;
    }
  }
  out->assign(text.substr(begin, end - begin));
}

// Removes the nonspacing marks (Mn), or with `all_marks` every mark (Mn, Mc, Me: Hugging
// Face's is_combining_mark, General_Category=Mark).
void StripMarks(std::string_view text, bool all_marks, std::string* out) {
  out->clear();
  out->reserve(text.size());
  for (size_t i = 0; i < text.size();) {
    const size_t start = i;
    const UChar32 c = Next(text, &i);
    const int8_t type = u_charType(c);
    const bool mark = type == U_NON_SPACING_MARK ||
                      (all_marks && (type == U_COMBINING_SPACING_MARK || type == U_ENCLOSING_MARK));
    if (!mark) out->append(text.substr(start, i - start));
  }
}

// Hugging Face's is_chinese_char (bert.rs): the CJK Unified Ideographs blocks.
bool IsChineseChar(UChar32 c) {
  return (c >= 0x4E00 && c <= 0x9FFF) || (c >= 0x3400 && c <= 0x4DBF) ||
         (c >= 0x20000 && c <= 0x2A6DF) || (c >= 0x2A700 && c <= 0x2B73F) ||
         (c >= 0x2B740 && c <= 0x2B81F) || (c >= 0x2B920 && c <= 0x2CEAF) ||
         (c >= 0xF900 && c <= 0xFAFF) || (c >= 0x2F800 && c <= 0x2FA1F);
}

// bert.rs's is_control (unicode_categories' is_other): Cc, Cf, Cs and Co but \t, \n, \r;
// unassigned code points (Cn) are kept.
bool IsBertControl(UChar32 c) {
  if (c == '\t' || c == '\n' || c == '\r') return false;
  switch (u_charType(c)) {
    case U_CONTROL_CHAR:
    case U_FORMAT_CHAR:
    case U_SURROGATE:
    case U_PRIVATE_USE_CHAR:
      return true;
    default:
      return false;
  }
}

void BertCleanAndPad(std::string_view text, bool clean, bool chinese, std::string* out) {
  out->clear();
  out->reserve(text.size());
  for (size_t i = 0; i < text.size();) {
    const size_t start = i;
    const UChar32 c = Next(text, &i);
    if (clean) {
      if (c == 0 || c == 0xFFFD || IsBertControl(c)) continue;
      if (c == '\t' || c == '\n' || c == '\r' || u_isUWhiteSpace(c)) {
        out->push_back(' ');
        continue;
      }
    }
    if (chinese && IsChineseChar(c)) {
      out->push_back(' ');
      out->append(text.substr(start, i - start));
      out->push_back(' ');
      continue;
    }
    out->append(text.substr(start, i - start));
  }
}

struct PcreDeleter {
  void operator()(pcre2_code* code) const { pcre2_code_free(code); }
};

}  // namespace

struct Normalizer::Impl {
  struct Step {
    NormalizerStep spec;
    std::unique_ptr<pcre2_code, PcreDeleter> regex;  // kReplace with a Regex pattern
  };
  std::vector<Step> steps;

  absl::Status Replace(const Step& step, std::string_view text, std::string* out) const {
    out->clear();
    if (text.empty()) return absl::OkStatus();  // nothing to match, not even an empty match
    const std::string& content = step.spec.content;
    if (step.regex == nullptr) {
      const std::string& literal = step.spec.pattern;
      size_t at = 0;
      for (size_t found; (found = text.find(literal, at)) != std::string_view::npos;) {
        out->append(text.substr(at, found - at));
        out->append(content);
        at = found + literal.size();
      }
      out->append(text.substr(at));
      return absl::OkStatus();
    }
    std::unique_ptr<pcre2_match_data, decltype(&pcre2_match_data_free)> data(
        pcre2_match_data_create_from_pattern(step.regex.get(), nullptr), &pcre2_match_data_free);
    if (data == nullptr) return absl::InternalError("PCRE2: cannot allocate match data");
    const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
    size_t copied = 0;  // text[0, copied) is in *out
    size_t search = 0;
    bool matched = false;
    size_t last_end = 0;  // where the previous match ended
    while (search <= text.size()) {
      const int rc = pcre2_match(step.regex.get(), subject, text.size(), search, PCRE2_NO_UTF_CHECK,
                                 data.get(), nullptr);
      if (rc == PCRE2_ERROR_NOMATCH) break;
      if (rc < 0) {
        std::array<PCRE2_UCHAR, 256> message{};
        pcre2_get_error_message(rc, message.data(), message.size());
        return absl::InternalError(
            absl::StrCat("PCRE2: ", reinterpret_cast<const char*>(message.data())));
      }
      const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(data.get());
      const size_t begin = ovector[0];
      const size_t end = ovector[1];
      // An empty match where the previous one ended is not one (Oniguruma's find_iter).
      const bool skip = begin == end && matched && begin == last_end;
      if (!skip) {
        out->append(text.substr(copied, begin - copied));
        out->append(content);
        copied = end;
        matched = true;
        last_end = end;
      }
      if (begin == end) {  // step over one character
        if (end >= text.size()) break;
        size_t next = end;
        Next(text, &next);
        search = next;
      } else {
        search = end;
      }
    }
    out->append(text.substr(copied));
    return absl::OkStatus();
  }

  absl::Status ApplyStep(const Step& step, std::string_view text, std::string* out) const {
    const NormalizerStep& s = step.spec;
    switch (s.kind) {
      case Kind::kNfc:
      case Kind::kNfd:
      case Kind::kNfkc:
      case Kind::kNfkd:
        return Normalize(s.kind, text, out);
      case Kind::kLowercase:
        Lowercase(text, out);
        return absl::OkStatus();
      case Kind::kStrip:
        Strip(text, s.strip_left, s.strip_right, out);
        return absl::OkStatus();
      case Kind::kStripAccents:
        StripMarks(text, /*all_marks=*/true, out);
        return absl::OkStatus();
      case Kind::kPrepend:
        out->clear();
        if (!text.empty()) {
          out->append(s.content);
          out->append(text);
        }
        return absl::OkStatus();
      case Kind::kReplace:
        return Replace(step, text, out);
      case Kind::kBert: {
        std::string current;
        BertCleanAndPad(text, s.clean_text, s.handle_chinese_chars, &current);
        const bool strip_accents = s.strip_accents < 0 ? s.lowercase : s.strip_accents == 1;
        if (strip_accents) {
          std::string decomposed;
          if (absl::Status st = Normalize(Kind::kNfd, current, &decomposed); !st.ok()) return st;
          StripMarks(decomposed, /*all_marks=*/false, &current);
        }
        if (s.lowercase) {
          Lowercase(current, out);
        } else {
          *out = std::move(current);
        }
        return absl::OkStatus();
      }
    }
    return absl::InternalError("unknown normalizer step");
  }
};

Normalizer::Normalizer() : impl_(std::make_unique<Impl>()) {}
Normalizer::Normalizer(Normalizer&&) noexcept = default;
Normalizer& Normalizer::operator=(Normalizer&&) noexcept = default;
Normalizer::~Normalizer() = default;

absl::StatusOr<Normalizer> Normalizer::Create(std::vector<NormalizerStep> steps,
                                              std::string_view source) {
  Normalizer n;
  for (NormalizerStep& spec : steps) {
    if (InvalidUtf8Offset(spec.content) != std::string_view::npos ||
        InvalidUtf8Offset(spec.pattern) != std::string_view::npos) {
      return absl::InvalidArgumentError(absl::StrCat(
          std::string(source), ": a normalizer's content or pattern is not valid UTF-8"));
    }
    Impl::Step step;
    if (spec.kind == Kind::kReplace) {
      if (spec.pattern.empty()) {
        return absl::InvalidArgumentError(
            absl::StrCat(std::string(source), ": a Replace normalizer has an empty pattern"));
      }
      if (spec.pattern_is_regex) {
        const std::string rewritten = internal::OnigurumaWhitespace(spec.pattern);
        int error = 0;
        PCRE2_SIZE offset = 0;
        pcre2_code* code =
            pcre2_compile(reinterpret_cast<PCRE2_SPTR>(rewritten.data()), rewritten.size(),
                          PCRE2_UTF | PCRE2_UCP, &error, &offset, nullptr);
        if (code == nullptr) {
          std::array<PCRE2_UCHAR, 256> message{};
          pcre2_get_error_message(error, message.data(), message.size());
          return absl::InvalidArgumentError(
              absl::StrCat(std::string(source), ": Replace normalizer regex \"", spec.pattern,
                           "\" does not compile at offset ", offset, ": ",
                           reinterpret_cast<const char*>(message.data())));
        }
        step.regex.reset(code);
      }
    }
    step.spec = std::move(spec);
    n.impl_->steps.push_back(std::move(step));
  }
  return n;
}

bool Normalizer::empty() const { return impl_->steps.empty(); }

absl::Status Normalizer::Apply(std::string_view text, std::string* out) const {
  out->assign(text);
  std::string next;
  for (const Impl::Step& step : impl_->steps) {
    if (absl::Status s = impl_->ApplyStep(step, *out, &next); !s.ok()) return s;
    out->swap(next);
  }
  return absl::OkStatus();
}

}  // namespace kvcm
