#include "common/tokenizer/token_decoder.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/base/utf8.h"
#include "common/tokenizer/normalizer.h"

namespace kvcm {
namespace internal {

int ByteFallbackValue(std::string_view token) {
  if (token.size() != 6 || token.substr(0, 3) != "<0x" || token[5] != '>') return -1;
  auto hex = [](char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  const int low = hex(token[4]);
  if (low < 0) return -1;
  if (token[3] == '+') return low;  // Rust's u8::from_str_radix takes a leading '+'
  const int high = hex(token[3]);
  return high < 0 ? -1 : high * 16 + low;
}

}  // namespace internal

namespace {

using Kind = TokenDecoderStep::Kind;

// The length of the UTF-8 character at text[i] (REQUIRES: valid UTF-8).
size_t CharLength(std::string_view text, size_t i) {
  const auto c = static_cast<unsigned char>(text[i]);
  return c < 0x80 ? 1 : c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : 2;
}

bool IsOneCharacter(std::string_view text) {
  return !text.empty() && InvalidUtf8Offset(text) == std::string_view::npos &&
         CharLength(text, 0) == text.size();
}

// Hugging Face's ByteFallback::decode_chain.
void ByteFallback(std::vector<std::string>* tokens) {
  std::vector<std::string> out;
  out.reserve(tokens->size());
  std::string bytes;
  size_t count = 0;  // byte tokens in `bytes`
  auto flush = [&] {
    if (count == 0) return;
    if (InvalidUtf8Offset(bytes) == std::string_view::npos) {
      out.push_back(std::move(bytes));
    } else {
      for (size_t i = 0; i < count; ++i) out.emplace_back("\xEF\xBF\xBD");  // U+FFFD
    }
    bytes.clear();
    count = 0;
  };
  for (std::string& token : *tokens) {
    const int byte = internal::ByteFallbackValue(token);
    if (byte >= 0) {
      bytes.push_back(static_cast<char>(byte));
      ++count;
      continue;
    }
    flush();
    out.push_back(std::move(token));
  }
  flush();
  *tokens = std::move(out);
}

// Hugging Face's Strip::decode_chain on one token: up to `start` leading and `stop` trailing
// `content` characters removed (where tokenizers 0.23.3 panics, both ends overlapping, nothing
// is left).
void Strip(const TokenDecoderStep& step, std::string* token) {
  const std::string_view text = *token;
  const std::string_view c = step.content;
  size_t begin = 0;
  for (size_t n = 0; n < step.start && text.substr(begin, c.size()) == c; ++n) begin += c.size();
  size_t end = text.size();
  for (size_t n = 0;
       n < step.stop && end >= begin + c.size() && text.substr(end - c.size(), c.size()) == c;
       ++n) {
    end -= c.size();
  }
  *token = std::string(text.substr(begin, end - begin));
}

// Hugging Face's Metaspace::decode_chain.
void Metaspace(const TokenDecoderStep& step, std::vector<std::string>* tokens) {
  const std::string_view r = step.content;
  for (size_t i = 0; i < tokens->size(); ++i) {
    std::string& token = (*tokens)[i];
    if (token.find(r) == std::string::npos) continue;
    std::string out;
    out.reserve(token.size());
    for (size_t at = 0; at < token.size();) {
      if (std::string_view(token).substr(at, r.size()) == r) {
        if (i != 0 || !step.prepend) out.push_back(' ');
        at += r.size();
      } else {
        out.push_back(token[at++]);
      }
    }
    token = std::move(out);
  }
}

}  // namespace

struct TokenDecoder::Impl {
  struct Step {
    TokenDecoderStep spec;
    Normalizer replace;  // kReplace
  };
  std::vector<Step> steps;
};

TokenDecoder::TokenDecoder() : impl_(std::make_unique<Impl>()) {}
TokenDecoder::TokenDecoder(TokenDecoder&&) noexcept = default;
TokenDecoder& TokenDecoder::operator=(TokenDecoder&&) noexcept = default;
TokenDecoder::~TokenDecoder() = default;

absl::StatusOr<TokenDecoder> TokenDecoder::Create(std::vector<TokenDecoderStep> steps,
                                                  std::string_view source) {
  TokenDecoder decoder;
  for (TokenDecoderStep& spec : steps) {
    Impl::Step step;
    if (spec.kind == Kind::kReplace) {
      NormalizerStep replace;
      replace.kind = NormalizerStep::Kind::kReplace;
      replace.pattern = spec.pattern;
      replace.pattern_is_regex = spec.pattern_is_regex;
      replace.content = spec.content;
      absl::StatusOr<Normalizer> created =
          Normalizer::Create({std::move(replace)}, absl::StrCat(std::string(source), ": decoder"));
      if (!created.ok()) return created.status();
      step.replace = std::move(*created);
    } else if ((spec.kind == Kind::kStrip || spec.kind == Kind::kMetaspace) &&
               !IsOneCharacter(spec.content)) {
      return absl::InvalidArgumentError(
          absl::StrCat(std::string(source), ": decoder ",
                       spec.kind == Kind::kStrip ? "Strip content" : "Metaspace replacement", " \"",
                       spec.content, "\" is not one character"));
    }
    step.spec = std::move(spec);
    decoder.impl_->steps.push_back(std::move(step));
  }
  return decoder;
}

absl::Status TokenDecoder::Decode(std::vector<std::string> tokens, std::string* out) const {
  for (const Impl::Step& step : impl_->steps) {
    switch (step.spec.kind) {
      case Kind::kReplace:
        for (std::string& token : tokens) {
          if (!step.spec.pattern_is_regex && token.find(step.spec.pattern) == std::string::npos) {
            continue;
          }
          std::string replaced;
          if (absl::Status s = step.replace.Apply(token, &replaced); !s.ok()) return s;
          token = std::move(replaced);
        }
        break;
      case Kind::kByteFallback:
        ByteFallback(&tokens);
        break;
      case Kind::kFuse: {
        std::string fused;
        for (const std::string& token : tokens) fused += token;
        tokens.assign(1, std::move(fused));
        break;
      }
      case Kind::kStrip:
        for (std::string& token : tokens) Strip(step.spec, &token);
        break;
      case Kind::kMetaspace:
        Metaspace(step.spec, &tokens);
        break;
    }
  }
  out->clear();
  for (const std::string& token : tokens) *out += token;
  return absl::OkStatus();
}

}  // namespace kvcm
