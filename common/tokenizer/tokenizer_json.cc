// Hugging Face tokenizer.json (and tokenizer_config.json) -> BpeVocab / BpeTokenizer.
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/tokenizer/bpe_tokenizer.h"

namespace kvcm {
namespace {

using Json = nlohmann::json;

class Parser {
 public:
  explicit Parser(std::string_view file_name) : file_(file_name) {}

  absl::Status Invalid(std::string_view key, std::string_view what) const {
    return absl::InvalidArgumentError(
        absl::StrCat(file_, ": key \"", std::string(key), "\" ", std::string(what)));
  }
  absl::Status Unimplemented(std::string_view key, std::string_view what) const {
    return absl::UnimplementedError(absl::StrCat(file_, ": key \"", std::string(key), "\" ",
                                                 std::string(what), " is not implemented"));
  }

  // The member `name` of object `j` (nullptr when absent or null).
  static const Json* Member(const Json& j, const char* name) {
    auto it = j.find(name);
    if (it == j.end() || it->is_null()) return nullptr;
    return &*it;
  }

  absl::Status GetBool(const Json& j, const char* name, const std::string& key, bool* out) const {
    const Json* m = Member(j, name);
    if (m == nullptr) return absl::OkStatus();
    if (!m->is_boolean()) return Invalid(key + "." + name, "must be a boolean");
    *out = m->get<bool>();
    return absl::OkStatus();
  }
  absl::Status GetString(const Json& j, const char* name, const std::string& key,
                         std::string* out) const {
    const Json* m = Member(j, name);
    if (m == nullptr) return absl::OkStatus();
    if (!m->is_string()) return Invalid(key + "." + name, "must be a string");
    *out = m->get<std::string>();
    return absl::OkStatus();
  }
  absl::Status GetId(const Json& j, const std::string& key, int32_t* out) const {
    if (!j.is_number_integer()) return Invalid(key, "must be an integer id");
    const int64_t v = j.get<int64_t>();
    if (v < 0 || v > INT32_MAX) return Invalid(key, absl::StrCat("is ", v, ", outside [0, 2^31)"));
    *out = static_cast<int32_t>(v);
    return absl::OkStatus();
  }

  absl::Status Model(const Json& root, BpeVocab* vocab) {
    const Json* model = Member(root, "model");
    if (model == nullptr) return Invalid("model", "is missing");
    if (!model->is_object()) return Invalid("model", "must be an object");
    std::string type;
    if (absl::Status s = GetString(*model, "type", "model", &type); !s.ok()) return s;
    if (type.empty() && !model->contains("merges")) {
      return Invalid("model.type", "is missing (and there are no merges)");
    }
    if (type == "WordPiece" || type == "WordLevel" || type == "Unigram") {
      return Unimplemented("model.type", absl::StrCat("\"", type, "\""));
    }
    if (!type.empty() && type != "BPE") {
      return Invalid("model.type", absl::StrCat("is \"", type, "\", not a known model type"));
    }
    if (absl::Status s = ModelOptions(*model, vocab); !s.ok()) return s;
    if (absl::Status s = ModelVocab(*model, vocab); !s.ok()) return s;
    return ModelMerges(*model, vocab);
  }

  // model's options: fuse_unk and ignore_merges; the others must keep the values that change
  // nothing (each refused by name otherwise).
  absl::Status ModelOptions(const Json& model_json, BpeVocab* vocab) {
    const Json* model = &model_json;
    if (const Json* d = Member(*model, "dropout"); d != nullptr) {
      if (!d->is_number()) return Invalid("model.dropout", "must be a number or null");
      if (d->get<double>() != 0.0) return Unimplemented("model.dropout", "(BPE dropout)");
    }
    for (const char* name : {"continuing_subword_prefix", "end_of_word_suffix"}) {
      std::string value;
      if (absl::Status s = GetString(*model, name, "model", &value); !s.ok()) return s;
      if (!value.empty()) return Unimplemented(absl::StrCat("model.", name), "(not empty)");
    }
    // byte_fallback: refused with the ByteLevel pre-tokenizer (Parse, once that is known).
    if (absl::Status s = GetBool(*model, "byte_fallback", "model", &vocab->byte_fallback);
        !s.ok()) {
      return s;
    }
    if (absl::Status s = GetBool(*model, "fuse_unk", "model", &vocab->fuse_unk); !s.ok()) return s;
    if (absl::Status s = GetBool(*model, "ignore_merges", "model", &vocab->ignore_merges);
        !s.ok()) {
      return s;
    }
    return absl::OkStatus();
  }

  // model.vocab (token: id) and model.unk_token.
  absl::Status ModelVocab(const Json& model_json, BpeVocab* vocab) {
    const Json* model = &model_json;
    const Json* v = Member(*model, "vocab");
    if (v == nullptr) return Invalid("model.vocab", "is missing");
    if (!v->is_object()) return Invalid("model.vocab", "must be an object of token: id");
    std::vector<std::pair<int32_t, std::string>> entries;
    entries.reserve(v->size());
    int32_t max_id = -1;
    for (auto it = v->begin(); it != v->end(); ++it) {
      int32_t id = 0;
      if (absl::Status s = GetId(it.value(), absl::StrCat("model.vocab[\"", it.key(), "\"]"), &id);
          !s.ok()) {
        return s;
      }
      if (it.key().empty()) return Invalid("model.vocab", "has an empty token");
      entries.push_back({id, it.key()});
      max_id = std::max(max_id, id);
    }
    max_id_ = std::max(max_id_, max_id);
    count_ += entries.size();
    // Refused before the table is sized: an id of 2^31 - 1 would ask for 64 GiB.
    if (!SparseOk()) return Sparse("model.vocab");
    vocab->tokens.assign(static_cast<size_t>(max_id + 1), std::string());
    for (auto& [id, token] : entries) {
      if (!vocab->tokens[static_cast<size_t>(id)].empty()) {
        return Invalid("model.vocab", absl::StrCat("gives id ", id, " to both \"",
                                                   vocab->tokens[static_cast<size_t>(id)],
                                                   "\" and \"", token, "\""));
      }
      vocab->tokens[static_cast<size_t>(id)] = std::move(token);
    }

    if (const Json* unk = Member(*model, "unk_token"); unk != nullptr) {
      if (!unk->is_string()) return Invalid("model.unk_token", "must be a string or null");
      auto it = v->find(unk->get<std::string>());
      if (it == v->end()) {
        return Invalid("model.unk_token", absl::StrCat("names \"", unk->get<std::string>(),
                                                       "\", which is not in model.vocab"));
      }
      vocab->unk_id = it.value().get<int32_t>();
    }

    return absl::OkStatus();
  }

  // model.merges: "a b" or ["a", "b"], each part and their join in model.vocab.
  absl::Status ModelMerges(const Json& model_json, BpeVocab* vocab) {
    const Json* model = &model_json;
    const Json* v = Member(*model, "vocab");
    if (const Json* merges = Member(*model, "merges"); merges != nullptr) {
      if (!merges->is_array()) return Invalid("model.merges", "must be an array");
      vocab->merges.reserve(merges->size());
      for (size_t i = 0; i < merges->size(); ++i) {
        const Json& m = (*merges)[i];
        const std::string key = absl::StrCat("model.merges[", i, "]");
        std::string a;
        std::string b;
        if (m.is_string()) {
          const std::string& line = m.get_ref<const std::string&>();
          const size_t space = line.find(' ');
          if (space == std::string::npos || line.find(' ', space + 1) != std::string::npos) {
            return Invalid(key,
                           absl::StrCat("\"", line, "\" is not two tokens separated by a space"));
          }
          a = line.substr(0, space);
          b = line.substr(space + 1);
        } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
          a = m[0].get<std::string>();
          b = m[1].get<std::string>();
          if (a.find(' ') != std::string::npos || b.find(' ') != std::string::npos) {
            return Unimplemented(key, "(a merged token holding a space)");
          }
        } else {
          return Invalid(key, "must be \"a b\" or [\"a\", \"b\"]");
        }
        for (const std::string* part : {&a, &b}) {
          if (!v->contains(*part)) {
            return Invalid(key, absl::StrCat("names \"", *part, "\", which is not in model.vocab"));
          }
        }
        if (!v->contains(a + b)) {
          return Invalid(key, absl::StrCat("makes \"", a + b, "\", which is not in model.vocab"));
        }
        vocab->merges.push_back(absl::StrCat(a, " ", b));
      }
    }
    return absl::OkStatus();
  }

  absl::Status AddedTokens(const Json& root, BpeVocab* vocab) {
    const Json* added = Member(root, "added_tokens");
    if (added == nullptr) return absl::OkStatus();
    if (!added->is_array()) return Invalid("added_tokens", "must be an array");
    absl::flat_hash_set<int32_t> seen;
    for (size_t i = 0; i < added->size(); ++i) {
      const Json& t = (*added)[i];
      const std::string key = absl::StrCat("added_tokens[", i, "]");
      if (!t.is_object()) return Invalid(key, "must be an object");
      BpeAddedToken token;
      const Json* id = Member(t, "id");
      if (id == nullptr) return Invalid(key + ".id", "is missing");
      if (absl::Status s = GetId(*id, key + ".id", &token.id); !s.ok()) return s;
      const Json* content = Member(t, "content");
      if (content == nullptr || !content->is_string() ||
          content->get_ref<const std::string&>().empty()) {
        return Invalid(key + ".content", "must be a non-empty string");
      }
      token.content = content->get<std::string>();
      token.normalized = true;  // Hugging Face's default for a token that is not special
      for (auto [name, field] : {std::pair<const char*, bool*>{"special", &token.special},
                                 {"lstrip", &token.lstrip},
                                 {"rstrip", &token.rstrip},
                                 {"single_word", &token.single_word}}) {
        if (absl::Status s = GetBool(t, name, key, field); !s.ok()) return s;
      }
      if (token.special) token.normalized = false;
      if (absl::Status s = GetBool(t, "normalized", key, &token.normalized); !s.ok()) return s;
      if (!seen.insert(token.id).second) {
        return Invalid(key + ".id", absl::StrCat("repeats id ", token.id));
      }
      max_id_ = std::max(max_id_, token.id);
      ++count_;
      if (!SparseOk()) return Sparse(key + ".id");
      vocab->added_tokens.push_back(std::move(token));
    }
    return absl::OkStatus();
  }

  // null, or one of normalizer.h's (a Sequence flattened into its steps).
  absl::Status Normalizer(const Json& root, BpeVocab* vocab) const {
    const Json* n = Member(root, "normalizer");
    if (n == nullptr) return absl::OkStatus();
    return NormalizerSteps(*n, "normalizer", &vocab->normalizers);
  }

  absl::Status NormalizerSteps(const Json& n, const std::string& key,
                               std::vector<NormalizerStep>* steps) const {
    if (!n.is_object()) return Invalid(key, "must be an object or null");
    std::string type;
    if (absl::Status s = GetString(n, "type", key, &type); !s.ok()) return s;
    using Kind = NormalizerStep::Kind;
    if (type == "Sequence") {
      const Json* list = Member(n, "normalizers");
      if (list == nullptr || !list->is_array()) {
        return Invalid(key + ".normalizers", "must be an array");
      }
      for (size_t i = 0; i < list->size(); ++i) {
        if (absl::Status s =
                NormalizerSteps((*list)[i], absl::StrCat(key, ".normalizers[", i, "]"), steps);
            !s.ok()) {
          return s;
        }
      }
      return absl::OkStatus();
    }
    static const std::pair<const char*, Kind> kPlain[] = {{"NFC", Kind::kNfc},
                                                          {"NFD", Kind::kNfd},
                                                          {"NFKC", Kind::kNfkc},
                                                          {"NFKD", Kind::kNfkd},
                                                          {"Lowercase", Kind::kLowercase},
                                                          {"StripAccents", Kind::kStripAccents}};
    NormalizerStep step;
    bool plain = false;
    for (const auto& [name, kind] : kPlain) {
      if (type == name) {
        step.kind = kind;
        plain = true;
      }
    }
    if (plain) {
      // nothing more to read
    } else if (type == "Strip") {
      step.kind = Kind::kStrip;
      if (absl::Status s = GetBool(n, "strip_left", key, &step.strip_left); !s.ok()) return s;
      if (absl::Status s = GetBool(n, "strip_right", key, &step.strip_right); !s.ok()) return s;
    } else if (type == "Prepend") {
      step.kind = Kind::kPrepend;
      const Json* prepend = Member(n, "prepend");
      if (prepend == nullptr || !prepend->is_string()) {
        return Invalid(key + ".prepend", "must be a string");
      }
      step.content = prepend->get<std::string>();
    } else if (type == "Replace") {
      step.kind = Kind::kReplace;
      if (absl::Status s = Replace(n, key, &step.pattern, &step.pattern_is_regex, &step.content);
          !s.ok()) {
        return s;
      }
    } else if (type == "BertNormalizer") {
      step.kind = Kind::kBert;
      for (const auto& [name, field] :
           {std::pair<const char*, bool*>{"clean_text", &step.clean_text},
            {"handle_chinese_chars", &step.handle_chinese_chars},
            {"lowercase", &step.lowercase}}) {
        if (absl::Status s = GetBool(n, name, key, field); !s.ok()) return s;
      }
      bool strip_accents = false;
      if (Member(n, "strip_accents") != nullptr) {
        if (absl::Status s = GetBool(n, "strip_accents", key, &strip_accents); !s.ok()) return s;
        step.strip_accents = strip_accents ? 1 : 0;
      }
    } else {
      return Unimplemented(key, absl::StrCat("normalizer \"", type,
                                             "\" (NFC, NFD, NFKC, NFKD, Lowercase, Strip, "
                                             "StripAccents, Prepend, Replace, BertNormalizer and "
                                             "Sequence are)"));
    }
    steps->push_back(std::move(step));
    return absl::OkStatus();
  }

  // A Replace normalizer's or decoder's pattern ({"String": ...} or {"Regex": ...}) and
  // content.
  absl::Status Replace(const Json& n, const std::string& key, std::string* pattern_out,
                       bool* is_regex, std::string* content_out) const {
    const Json* pattern = Member(n, "pattern");
    const Json* regex =
        pattern != nullptr && pattern->is_object() ? Member(*pattern, "Regex") : nullptr;
    const Json* literal =
        pattern != nullptr && pattern->is_object() ? Member(*pattern, "String") : nullptr;
    if (regex != nullptr && regex->is_string()) {
      *pattern_out = regex->get<std::string>();
      *is_regex = true;
    } else if (literal != nullptr && literal->is_string()) {
      *pattern_out = literal->get<std::string>();
    } else {
      return Invalid(key + ".pattern", "must be {\"Regex\": ...} or {\"String\": ...}");
    }
    if (pattern_out->empty()) return Invalid(key + ".pattern", "is empty");
    const Json* content = Member(n, "content");
    if (content == nullptr || !content->is_string()) {
      return Invalid(key + ".content", "must be a string");
    }
    *content_out = content->get<std::string>();
    return absl::OkStatus();
  }

  // `name` of `j`, a string of exactly one character (tokenizers reads it as a Rust char).
  absl::Status GetCharacter(const Json& j, const char* name, const std::string& key,
                            std::string* out) const {
    const Json* m = Member(j, name);
    if (m == nullptr || !m->is_string()) return Invalid(key + "." + name, "must be a string");
    const std::string& text = m->get_ref<const std::string&>();
    const auto lead = text.empty() ? 0 : static_cast<unsigned char>(text[0]);
    const size_t len = lead < 0x80 ? 1 : lead >= 0xF0 ? 4 : lead >= 0xE0 ? 3 : 2;
    if (text.empty() || len != text.size()) {
      return Invalid(key + "." + name, absl::StrCat("is \"", text, "\", not one character"));
    }
    *out = text;
    return absl::OkStatus();
  }

  // Metaspace's options, pre-tokenizer and decoder alike, as tokenizers 0.23 reads them:
  // replacement (one character), prepend_scheme ("always" when absent), split (true when
  // absent or null) and the legacy add_prefix_space (false must come with prepend_scheme
  // "never"; true leaves prepend_scheme as it is).
  absl::Status Metaspace(const Json& p, const std::string& key, BpePreTokenizerStep* step) const {
    using Scheme = BpePreTokenizerStep::PrependScheme;
    step->kind = BpePreTokenizerStep::Kind::kMetaspace;
    if (absl::Status s = GetCharacter(p, "replacement", key, &step->replacement); !s.ok()) {
      return s;
    }
    step->prepend_scheme = Scheme::kAlways;
    if (auto it = p.find("prepend_scheme"); it != p.end()) {
      static const std::pair<const char*, Scheme> kSchemes[] = {
          {"always", Scheme::kAlways}, {"first", Scheme::kFirst}, {"never", Scheme::kNever}};
      const auto* found = std::find_if(std::begin(kSchemes), std::end(kSchemes), [&](auto& s) {
        return it->is_string() && it->get_ref<const std::string&>() == s.first;
      });
      if (found == std::end(kSchemes)) {
        return Invalid(key + ".prepend_scheme", "must be \"always\", \"first\" or \"never\"");
      }
      step->prepend_scheme = found->second;
    }
    bool add_prefix_space = true;
    if (absl::Status s = GetBool(p, "add_prefix_space", key, &add_prefix_space); !s.ok()) return s;
    if (!add_prefix_space && step->prepend_scheme != Scheme::kNever) {
      return Invalid(key + ".add_prefix_space",
                     "is false, which does not match prepend_scheme (tokenizers refuses it too)");
    }
    step->split = true;
    return GetBool(p, "split", key, &step->split);
  }

  absl::Status PreTokenizer(const Json& p, const std::string& key,
                            std::vector<BpePreTokenizerStep>* steps) const {
    if (!p.is_object()) return Invalid(key, "must be an object");
    std::string type;
    if (absl::Status s = GetString(p, "type", key, &type); !s.ok()) return s;
    using Step = BpePreTokenizerStep;
    if (type == "Sequence") {
      const Json* list = Member(p, "pretokenizers");
      if (list == nullptr || !list->is_array()) {
        return Invalid(key + ".pretokenizers", "must be an array");
      }
      for (size_t i = 0; i < list->size(); ++i) {
        if (absl::Status s =
                PreTokenizer((*list)[i], absl::StrCat(key, ".pretokenizers[", i, "]"), steps);
            !s.ok()) {
          return s;
        }
      }
      return absl::OkStatus();
    }
    Step step;
    if (type == "ByteLevel") {
      step.kind = Step::Kind::kByteLevel;
      if (absl::Status s = GetBool(p, "add_prefix_space", key, &step.add_prefix_space); !s.ok()) {
        return s;
      }
      if (absl::Status s = GetBool(p, "use_regex", key, &step.use_regex); !s.ok()) return s;
    } else if (type == "Digits") {
      bool individual = false;
      if (absl::Status s = GetBool(p, "individual_digits", key, &individual); !s.ok()) return s;
      step.regex = "\\p{N}";
      step.behavior = individual ? Step::Behavior::kIsolated : Step::Behavior::kContiguous;
    } else if (type == "Split") {
      const Json* pattern = Member(p, "pattern");
      if (pattern == nullptr || !pattern->is_object()) {
        return Invalid(key + ".pattern", "must be {\"Regex\": ...} or {\"String\": ...}");
      }
      if (const Json* r = Member(*pattern, "Regex"); r != nullptr && r->is_string()) {
        step.regex = r->get<std::string>();
      } else if (const Json* str = Member(*pattern, "String"); str != nullptr && str->is_string()) {
        // A literal: every ASCII punctuation character escaped.
        for (const char ch : str->get_ref<const std::string&>()) {
          const auto u = static_cast<unsigned char>(ch);
          if (u < 0x80 && !std::isalnum(u)) step.regex.push_back('\\');
          step.regex.push_back(ch);
        }
        if (step.regex.empty()) return Invalid(key + ".pattern.String", "is empty");
      } else {
        return Invalid(key + ".pattern", "must be {\"Regex\": ...} or {\"String\": ...}");
      }
      std::string behavior;
      if (absl::Status s = GetString(p, "behavior", key, &behavior); !s.ok()) return s;
      static const std::pair<const char*, Step::Behavior> kBehaviors[] = {
          {"Removed", Step::Behavior::kRemoved},
          {"Isolated", Step::Behavior::kIsolated},
          {"MergedWithPrevious", Step::Behavior::kMergedWithPrevious},
          {"MergedWithNext", Step::Behavior::kMergedWithNext},
          {"Contiguous", Step::Behavior::kContiguous}};
      bool found = false;
      for (const auto& [name, value] : kBehaviors) {
        if (behavior == name) {
          step.behavior = value;
          found = true;
        }
      }
      if (!found) {
        return Invalid(key + ".behavior", absl::StrCat("is \"", behavior, "\", not a known one"));
      }
      if (absl::Status s = GetBool(p, "invert", key, &step.invert); !s.ok()) return s;
    } else if (type == "Metaspace") {
      if (absl::Status s = Metaspace(p, key, &step); !s.ok()) return s;
    } else {
      return Unimplemented(key, absl::StrCat("pre-tokenizer \"", type, "\""));
    }
    steps->push_back(std::move(step));
    return absl::OkStatus();
  }

  absl::Status Decoder(const Json& root, BpeVocab* vocab) const {
    const Json* d = Member(root, "decoder");
    if (d == nullptr) return Unimplemented("decoder", "null (tokens joined with spaces)");
    if (!d->is_object()) return Invalid("decoder", "must be an object");
    if (!vocab->byte_level) return DecoderSteps(*d, "decoder", &vocab->decoder);
    std::string type;
    if (absl::Status s = GetString(*d, "type", "decoder", &type); !s.ok()) return s;
    if (type == "ByteLevel") return absl::OkStatus();
    if (type == "Sequence") {
      const Json* list = Member(*d, "decoders");
      if (list != nullptr && list->is_array() && list->size() == 1 && (*list)[0].is_object() &&
          (*list)[0].value("type", Json()) == "ByteLevel") {
        return absl::OkStatus();
      }
    }
    return Unimplemented("decoder", absl::StrCat("\"", type,
                                                 "\" with the ByteLevel pre-tokenizer (only "
                                                 "ByteLevel is)"));
  }

  // A SentencePiece-style decoder (token_decoder.h; a Sequence flattened into its steps).
  absl::Status DecoderSteps(const Json& d, const std::string& key,
                            std::vector<TokenDecoderStep>* steps) const {
    if (!d.is_object()) return Invalid(key, "must be an object");
    std::string type;
    if (absl::Status s = GetString(d, "type", key, &type); !s.ok()) return s;
    using Kind = TokenDecoderStep::Kind;
    TokenDecoderStep step;
    if (type == "Sequence") {
      const Json* list = Member(d, "decoders");
      if (list == nullptr || !list->is_array())
        return Invalid(key + ".decoders", "must be an array");
      for (size_t i = 0; i < list->size(); ++i) {
        if (absl::Status s =
                DecoderSteps((*list)[i], absl::StrCat(key, ".decoders[", i, "]"), steps);
            !s.ok()) {
          return s;
        }
      }
      return absl::OkStatus();
    } else if (type == "Replace") {
      step.kind = Kind::kReplace;
      if (absl::Status s = Replace(d, key, &step.pattern, &step.pattern_is_regex, &step.content);
          !s.ok()) {
        return s;
      }
    } else if (type == "ByteFallback" || type == "Fuse") {
      step.kind = type == "Fuse" ? Kind::kFuse : Kind::kByteFallback;
    } else if (type == "Strip") {
      step.kind = Kind::kStrip;
      if (absl::Status s = GetCharacter(d, "content", key, &step.content); !s.ok()) return s;
      for (const auto& [name, field] :
           {std::pair<const char*, size_t*>{"start", &step.start}, {"stop", &step.stop}}) {
        const Json* m = Member(d, name);
        if (m == nullptr || !m->is_number_unsigned()) {
          return Invalid(absl::StrCat(key, ".", name), "must be a non-negative integer");
        }
        *field = m->get<size_t>();
      }
    } else if (type == "Metaspace") {
      BpePreTokenizerStep metaspace;
      if (absl::Status s = Metaspace(d, key, &metaspace); !s.ok()) return s;
      step.kind = Kind::kMetaspace;
      step.content = metaspace.replacement;
      step.prepend = metaspace.prepend_scheme != BpePreTokenizerStep::PrependScheme::kNever;
    } else if (type == "ByteLevel") {
      return Unimplemented(key, "decoder \"ByteLevel\" without the ByteLevel pre-tokenizer");
    } else {
      return Unimplemented(key, absl::StrCat("decoder \"", type,
                                             "\" (Replace, ByteFallback, Fuse, Strip, "
                                             "Metaspace and Sequence are)"));
    }
    steps->push_back(std::move(step));
    return absl::OkStatus();
  }

  // TemplateProcessing: a special token first in `single` is BOS.
  absl::Status PostProcessor(const Json& p, const std::string& key, BpeVocab* vocab) const {
    if (!p.is_object()) return Invalid(key, "must be an object");
    std::string type;
    if (absl::Status s = GetString(p, "type", key, &type); !s.ok()) return s;
    if (type == "ByteLevel") return absl::OkStatus();
    if (type == "Sequence") {
      const Json* list = Member(p, "processors");
      if (list == nullptr || !list->is_array())
        return Invalid(key + ".processors", "must be an array");
      for (size_t i = 0; i < list->size(); ++i) {
        if (absl::Status s =
                PostProcessor((*list)[i], absl::StrCat(key, ".processors[", i, "]"), vocab);
            !s.ok()) {
          return s;
        }
      }
      return absl::OkStatus();
    }
    if (type != "TemplateProcessing") {
      return Unimplemented(key, absl::StrCat("post-processor \"", type, "\""));
    }
    const Json* single = Member(p, "single");
    if (single == nullptr || !single->is_array())
      return Invalid(key + ".single", "must be an array");
    if (single->empty() || !(*single)[0].is_object()) return absl::OkStatus();
    const Json* special = Member((*single)[0], "SpecialToken");
    if (special == nullptr) return absl::OkStatus();
    if (!special->is_object() || !special->contains("id") || !(*special)["id"].is_string()) {
      return Invalid(key + ".single[0].SpecialToken.id", "must be a string");
    }
    const std::string name = (*special)["id"].get<std::string>();
    int32_t id = -1;
    if (const Json* tokens = Member(p, "special_tokens");
        tokens != nullptr && tokens->is_object()) {
      if (const Json* entry = Member(*tokens, name.c_str());
          entry != nullptr && entry->is_object()) {
        if (const Json* ids = Member(*entry, "ids");
            ids != nullptr && ids->is_array() && ids->size() == 1) {
          if (absl::Status s = GetId(
                  (*ids)[0], absl::StrCat(key, ".special_tokens[\"", name, "\"].ids[0]"), &id);
              !s.ok()) {
            return s;
          }
        }
      }
    }
    if (id < 0) {
      return Invalid(key + ".special_tokens", absl::StrCat("has no single id for \"", name, "\""));
    }
    vocab->bos_id = id;
    vocab->add_bos = true;
    return absl::OkStatus();
  }

 private:
  bool SparseOk() const { return max_id_ < 0 || static_cast<size_t>(max_id_) < 2 * count_ + 1024; }
  absl::Status Sparse(std::string_view key) const {
    return Invalid(
        key, absl::StrCat("has id ", max_id_, " for only ", count_, " tokens (ids must be dense)"));
  }

  std::string file_;
  int32_t max_id_ = -1;
  size_t count_ = 0;
};

absl::StatusOr<BpeVocab> Parse(std::string_view json_text, std::string_view file_name) {
  Parser parser(file_name);
  Json root;
  try {
    root = Json::parse(json_text.begin(), json_text.end());
  } catch (const Json::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat(std::string(file_name), ": not valid JSON: ", e.what()));
  }
  if (!root.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(std::string(file_name), ": the top level must be an object"));
  }
  BpeVocab vocab;
  vocab.source = std::string(file_name);
  if (absl::Status s = parser.Model(root, &vocab); !s.ok()) return s;
  if (absl::Status s = parser.AddedTokens(root, &vocab); !s.ok()) return s;
  if (absl::Status s = parser.Normalizer(root, &vocab); !s.ok()) return s;
  // No ByteLevel pre-tokenizer (null included): SentencePiece-style BPE.
  if (const Json* pre = Parser::Member(root, "pre_tokenizer"); pre != nullptr) {
    if (absl::Status s = parser.PreTokenizer(*pre, "pre_tokenizer", &vocab.pre_tokenizer);
        !s.ok()) {
      return s;
    }
  }
  auto has = [&](BpePreTokenizerStep::Kind kind) {
    return std::any_of(vocab.pre_tokenizer.begin(), vocab.pre_tokenizer.end(),
                       [&](const BpePreTokenizerStep& step) { return step.kind == kind; });
  };
  vocab.byte_level = has(BpePreTokenizerStep::Kind::kByteLevel);
  if (vocab.byte_level && has(BpePreTokenizerStep::Kind::kMetaspace)) {
    return parser.Unimplemented("pre_tokenizer", "Metaspace together with ByteLevel");
  }
  if (vocab.byte_level && vocab.byte_fallback) {
    return parser.Unimplemented("model.byte_fallback", "(true) with the ByteLevel pre-tokenizer");
  }
  if (absl::Status s = parser.Decoder(root, &vocab); !s.ok()) return s;
  if (const Json* post = Parser::Member(root, "post_processor"); post != nullptr) {
    if (absl::Status s = parser.PostProcessor(*post, "post_processor", &vocab); !s.ok()) return s;
  }
  return vocab;
}

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("\"", path, "\" cannot be opened"));
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// tokenizer_config.json's bos_token/eos_token: a string, an AddedToken object or null.
absl::StatusOr<std::optional<std::string>> TokenName(const Json& config, const char* key,
                                                     const std::string& path) {
  auto it = config.find(key);
  if (it == config.end() || it->is_null()) return std::nullopt;
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object()) {
    auto content = it->find("content");
    if (content != it->end() && content->is_string()) return content->get<std::string>();
  }
  return absl::InvalidArgumentError(absl::StrCat(
      path, ": key \"", key, "\" must be a string, an object with \"content\", or null"));
}

}  // namespace

absl::StatusOr<BpeVocab> ParseTokenizerJson(std::string_view json_text,
                                            std::string_view file_name) {
  try {
    return Parse(json_text, file_name);
  } catch (const std::exception& e) {  // a type mismatch the checks above missed
    return absl::InvalidArgumentError(absl::StrCat(std::string(file_name), ": ", e.what()));
  }
}

absl::StatusOr<std::unique_ptr<BpeTokenizer>> BpeTokenizer::FromTokenizerJson(
    const std::string& path, const TokenizerConfig& config) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) {
    return absl::NotFoundError(absl::StrCat("tokenizer.json \"", path, "\" not found"));
  }
  absl::StatusOr<std::string> text = ReadFile(path);
  if (!text.ok()) return text.status();
  absl::StatusOr<BpeVocab> vocab = ParseTokenizerJson(*text, path);
  if (!vocab.ok()) return vocab.status();

  // Finds a token by name: added tokens first, then the vocab.
  auto find = [&](const std::string& name) -> std::optional<int32_t> {
    for (const BpeAddedToken& t : vocab->added_tokens) {
      if (t.content == name) return t.id;
    }
    for (size_t id = 0; id < vocab->tokens.size(); ++id) {
      if (vocab->tokens[id] == name) return static_cast<int32_t>(id);
    }
    return std::nullopt;
  };

  bool eos_set = false;
  const std::string config_path =
      (std::filesystem::path(path).parent_path() / "tokenizer_config.json").string();
  if (std::filesystem::is_regular_file(config_path, ec)) {
    absl::StatusOr<std::string> config_text = ReadFile(config_path);
    if (!config_text.ok()) return config_text.status();
    Json tc;
    try {
      tc = Json::parse(*config_text);
    } catch (const Json::exception& e) {
      return absl::InvalidArgumentError(absl::StrCat(config_path, ": not valid JSON: ", e.what()));
    }
    if (!tc.is_object()) {
      return absl::InvalidArgumentError(
          absl::StrCat(config_path, ": the top level must be an object"));
    }
    if (auto it = tc.find("add_bos_token"); it != tc.end() && !it->is_null()) {
      if (!it->is_boolean()) {
        return absl::InvalidArgumentError(
            absl::StrCat(config_path, ": key \"add_bos_token\" must be a boolean"));
      }
      vocab->add_bos = it->get<bool>();
    }
    for (const auto& [key, id, set] :
         {std::tuple<const char*, int32_t*, bool*>{"bos_token", &vocab->bos_id, nullptr},
          {"eos_token", &vocab->eos_id, &eos_set}}) {
      absl::StatusOr<std::optional<std::string>> name = TokenName(tc, key, config_path);
      if (!name.ok()) return name.status();
      if (!name->has_value()) continue;
      const std::optional<int32_t> found = find(**name);
      if (!found.has_value()) {
        return absl::InvalidArgumentError(absl::StrCat(config_path, ": key \"", key, "\" names \"",
                                                       **name, "\", which is not a token of ",
                                                       path));
      }
      *id = *found;
      if (set != nullptr) *set = true;
    }
  }
  if (vocab->bos_id < 0 && config.bos_token_id >= 0) vocab->bos_id = config.bos_token_id;
  if (!eos_set && !config.eos_token_ids.empty()) vocab->eos_id = config.eos_token_ids[0];
  return FromVocab(std::move(*vocab), config.vocab_size);
}

}  // namespace kvcm
