#include "common/tokenizer/bpe_tokenizer.h"

#include <algorithm>
#include <array>
#include <climits>
#include <cstring>
#include <deque>
#include <queue>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/base/mutex.h"
#include "common/base/utf8.h"
#include "common/tokenizer/byte_level.h"
#include "common/tokenizer/text_matching_internal.h"

namespace kvcm {
namespace {

using internal::AddedTokenMatcher;
using internal::DecodeAt;
using internal::IsWhiteSpace;
using internal::PreviousStart;
using internal::Regex;
using internal::RegexError;

// Llama 3's and Qwen2's published pre-tokenizer regexes (their tokenizer.json files).
constexpr std::string_view kLlama3Regex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr std::string_view kQwen2Regex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

// Words longer than this are not cached (Hugging Face does the same above 256 chars).
constexpr size_t kMaxCachedWordBytes = 256;
constexpr size_t kMaxCacheEntries = 1 << 17;
// Words with more symbols than this merge through a heap instead of rescans.
constexpr size_t kHeapMergeThreshold = 48;

// Abseil's string_view is its own type here; heterogeneous lookups need it.
absl::string_view AbslView(std::string_view s) { return absl::string_view(s.data(), s.size()); }

uint64_t PairKey(int32_t a, int32_t b) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
}

struct MergeResult {
  int32_t rank;
  int32_t id;
};

}  // namespace

absl::StatusOr<std::vector<BpePreTokenizerStep>> BpePreTokenizerForName(std::string_view pre) {
  BpePreTokenizerStep byte_level;
  byte_level.kind = BpePreTokenizerStep::Kind::kByteLevel;
  byte_level.use_regex = true;
  auto split_then_bytes = [&](std::string_view regex) {
    BpePreTokenizerStep split;
    split.regex = std::string(regex);
    BpePreTokenizerStep bytes = byte_level;
    bytes.use_regex = false;
    return std::vector<BpePreTokenizerStep>{split, bytes};
  };
  auto is = [&](std::initializer_list<std::string_view> names) {
    return std::find(names.begin(), names.end(), pre) != names.end();
  };
  if (is({"gpt2", "default", "mpt", "olmo", "jais"})) {
    return std::vector<BpePreTokenizerStep>{byte_level};
  }
  if (is({"llama-bpe", "llama3", "llama-v3", "smaug-bpe", "dbrx"})) {
    return split_then_bytes(kLlama3Regex);
  }
  if (is({"qwen2", "deepseek-r1-qwen", "megrez"})) return split_then_bytes(kQwen2Regex);
  if (is({"smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva"})) {
    BpePreTokenizerStep digits;
    digits.regex = "\\p{N}";
    digits.behavior = BpePreTokenizerStep::Behavior::kIsolated;
    return std::vector<BpePreTokenizerStep>{digits, byte_level};
  }
  return absl::UnimplementedError(
      absl::StrCat("BPE pre-tokenizer \"", std::string(pre), "\" is not implemented"));
}

struct BpeTokenizer::Impl {
  struct Step {
    BpePreTokenizerStep spec;
    std::unique_ptr<Regex> regex;  // kSplit; kByteLevel with use_regex
  };

  int32_t vocab_size = 0;
  int32_t bos_id = -1;
  int32_t eos_id = -1;
  bool add_bos = false;
  bool ignore_merges = false;
  Normalizer normalizer;  // empty: none
  int32_t unk_id = -1;
  bool fuse_unk = false;
  // SentencePiece-style BPE: words merged from characters, text made by token_decoder.
  bool byte_level = true;
  bool byte_fallback = false;
  std::array<int32_t, 256> fallback_id{};  // the token "<0xNN>" of each byte, -1 when none
  TokenDecoder token_decoder;

  std::vector<Step> steps;
  std::vector<BpeAddedToken> added;
  AddedTokenMatcher raw_matcher;         // normalized = false
  AddedTokenMatcher normalized_matcher;  // normalized = true
  std::unique_ptr<Regex> word_char;      // for single_word: [\p{Alphabetic}\p{N}_]

  std::array<int32_t, 256> byte_id{};  // the token of each single byte, -1 when none
  absl::flat_hash_map<uint64_t, MergeResult> merges;
  absl::flat_hash_map<std::string, int32_t> raw_to_id;    // raw bytes (text) -> vocab token
  absl::flat_hash_map<std::string, int32_t> piece_to_id;  // spelling -> id
  absl::flat_hash_map<std::string, int32_t> added_to_id;  // added content -> id
  // id -> raw bytes (byte-level), the spelling token_decoder takes (SentencePiece-style)
  std::vector<std::string> decoded;
  std::vector<uint8_t> special;  // id -> Decode skips it

  mutable Mutex cache_mu;
  mutable absl::flat_hash_map<std::string, std::vector<int32_t>> cache ABSL_GUARDED_BY(cache_mu);

  bool IsWordCharBefore(std::string_view text, size_t end) const {
    if (end == 0) return false;
    const size_t start = PreviousStart(text, end);
    size_t b = 0;
    size_t e = 0;
    return word_char->Find(text.substr(start, end - start), 0, &b, &e) == 1;
  }
  bool IsWordCharAt(std::string_view text, size_t start) const {
    if (start >= text.size()) return false;
    size_t len = 0;
    DecodeAt(text, start, &len);
    size_t b = 0;
    size_t e = 0;
    return word_char->Find(text.substr(start, len), 0, &b, &e) == 1;
  }

  // Hugging Face's AddedVocabulary::find_matches over `text`: appends (added index or -1,
  // range) to *out.
  void SplitAdded(const AddedTokenMatcher& matcher, std::string_view text, size_t base,
                  std::vector<std::pair<int, std::pair<size_t, size_t>>>* out) const {
    if (matcher.empty()) {
      out->push_back({-1, {base, base + text.size()}});
      return;
    }
    size_t start_offset = 0;
    size_t search = 0;
    size_t begin = 0;
    size_t end = 0;
    int index = -1;
    while (search < text.size() && matcher.Find(text, search, &begin, &end, &index)) {
      search = end;
      const BpeAddedToken& token = added[static_cast<size_t>(index)];
      size_t start = begin;
      size_t stop = end;
      if (token.single_word && (IsWordCharBefore(text, start) || IsWordCharAt(text, stop))) {
        continue;
      }
      if (token.lstrip) {
        size_t s = start;
        while (s > 0) {
          const size_t prev = PreviousStart(text, s);
          size_t len = 0;
          if (!IsWhiteSpace(DecodeAt(text, prev, &len))) break;
          s = prev;
        }
        start = std::max(s, start_offset);
      }
      if (token.rstrip) {
        while (stop < text.size()) {
          size_t len = 0;
          if (!IsWhiteSpace(DecodeAt(text, stop, &len))) break;
          stop += len;
        }
      }
      if (start_offset < start) out->push_back({-1, {base + start_offset, base + start}});
      out->push_back({index, {base + start, base + stop}});
      start_offset = stop;
    }
    if (start_offset < text.size()) {
      out->push_back({-1, {base + start_offset, base + text.size()}});
    }
  }

  // Splits every piece of *pieces by `regex` with `behavior` (Hugging Face's
  // NormalizedString::split), into *out.
  absl::Status Split(const Step& step, const std::vector<std::string_view>& pieces,
                     std::vector<std::string_view>* out) const {
    out->clear();
    std::vector<std::pair<std::string_view, bool>> parts;
    for (const std::string_view piece : pieces) {
      parts.clear();
      size_t prev = 0;
      size_t search = 0;
      while (search <= piece.size()) {
        size_t b = 0;
        size_t e = 0;
        const int rc = step.regex->Find(piece, search, &b, &e);
        if (rc < 0) return RegexError(rc);
        if (rc == 0) break;
        if (b == e) {  // an empty match splits nothing; step over one character
          if (b >= piece.size()) break;
          size_t len = 0;
          DecodeAt(piece, b, &len);
          search = b + len;
          continue;
        }
        if (prev != b) parts.push_back({piece.substr(prev, b - prev), false});
        parts.push_back({piece.substr(b, e - b), true});
        prev = e;
        search = e;
      }
      if (prev != piece.size()) parts.push_back({piece.substr(prev), false});
      if (step.spec.invert) {
        for (auto& part : parts) part.second = !part.second;
      }
      using Behavior = BpePreTokenizerStep::Behavior;
      const size_t first = out->size();
      auto extend_last = [&](std::string_view part) {
        std::string_view& last = (*out)[out->size() - 1];
        last = std::string_view(last.data(),
                                static_cast<size_t>(part.data() + part.size() - last.data()));
      };
      switch (step.spec.behavior) {
        case Behavior::kRemoved:
          for (const auto& [part, is_match] : parts) {
            if (!is_match) out->push_back(part);
          }
          break;
        case Behavior::kIsolated:
          for (const auto& part : parts) out->push_back(part.first);
          break;
        case Behavior::kMergedWithPrevious: {
          bool previous_match = false;
          for (const auto& [part, is_match] : parts) {
            if (is_match && !previous_match && out->size() > first) {
              extend_last(part);
            } else {
              out->push_back(part);
            }
            previous_match = is_match;
          }
          break;
        }
        case Behavior::kMergedWithNext: {
          bool previous_match = false;
          std::vector<std::string_view> reversed;
          for (size_t i = parts.size(); i-- > 0;) {
            const auto& [part, is_match] = parts[i];
            if (is_match && !previous_match && !reversed.empty()) {
              std::string_view& last = reversed.back();
              last = std::string_view(part.data(),
                                      static_cast<size_t>(last.data() + last.size() - part.data()));
            } else {
              reversed.push_back(part);
            }
            previous_match = is_match;
          }
          out->insert(out->end(), reversed.rbegin(), reversed.rend());
          break;
        }
        case Behavior::kContiguous: {
          bool previous_match = false;
          for (const auto& [part, is_match] : parts) {
            if (is_match == previous_match && out->size() > first) {
              extend_last(part);
            } else {
              out->push_back(part);
            }
            previous_match = is_match;
          }
          break;
        }
      }
    }
    return absl::OkStatus();
  }

  // Merges the bytes of `word` (SentencePiece-style: its characters) by rank, appending its
  // ids to *ids.
  void MergeWord(std::string_view word, std::vector<int32_t>* ids) const {
    std::vector<int32_t> symbols;
    symbols.reserve(word.size());
    if (byte_level) {
      bool previous_unk = false;
      for (const char ch : word) {
        const int32_t id = byte_id[static_cast<unsigned char>(ch)];
        if (id >= 0) {
          symbols.push_back(id);
          previous_unk = false;
        } else if (unk_id >= 0) {
          if (!(fuse_unk && previous_unk)) symbols.push_back(unk_id);
          previous_unk = true;
        }
      }
    } else {
      CharacterSymbols(word, &symbols);
    }
    if (symbols.size() >= 2) {
      if (symbols.size() <= kHeapMergeThreshold) {
        MergeByRescan(&symbols);
      } else {
        MergeByHeap(&symbols);
      }
    }
    ids->insert(ids->end(), symbols.begin(), symbols.end());
  }

  // The first symbols of a SentencePiece-style word, as Hugging Face's BPE::merge_word: each
  // character's token; else, with byte_fallback, its bytes' "<0xNN>" tokens; else unk, which
  // waits for the next character with a token of its own (fused with the unks before it when
  // fuse_unk), so that byte-fallback tokens in between come first.
  void CharacterSymbols(std::string_view word, std::vector<int32_t>* symbols) const {
    bool pending_unk = false;
    for (size_t i = 0; i < word.size();) {
      size_t len = 0;
      DecodeAt(word, i, &len);
      const std::string_view ch = word.substr(i, len);
      i += len;
      if (auto it = raw_to_id.find(AbslView(ch)); it != raw_to_id.end()) {
        if (pending_unk) symbols->push_back(unk_id);
        pending_unk = false;
        symbols->push_back(it->second);
        continue;
      }
      if (byte_fallback && std::all_of(ch.begin(), ch.end(), [&](char b) {
            return fallback_id[static_cast<unsigned char>(b)] >= 0;
          })) {
        for (const char b : ch) symbols->push_back(fallback_id[static_cast<unsigned char>(b)]);
        continue;
      }
      if (unk_id < 0) continue;
      if (pending_unk && !fuse_unk) symbols->push_back(unk_id);
      pending_unk = true;
    }
    if (pending_unk) symbols->push_back(unk_id);
  }

  MergeResult Lookup(int32_t a, int32_t b) const {
    auto it = merges.find(PairKey(a, b));
    return it == merges.end() ? MergeResult{INT_MAX, -1} : it->second;
  }

  void MergeByRescan(std::vector<int32_t>* symbols) const {
    std::vector<int32_t>& s = *symbols;
    std::array<MergeResult, kHeapMergeThreshold> pair{};
    size_t n = s.size();
    for (size_t i = 0; i + 1 < n; ++i) pair[i] = Lookup(s[i], s[i + 1]);
    while (n >= 2) {
      size_t best = 0;
      for (size_t i = 1; i + 1 < n; ++i) {
        if (pair[i].rank < pair[best].rank) best = i;
      }
      if (pair[best].id < 0) break;
      s[best] = pair[best].id;
      for (size_t i = best + 1; i + 1 < n; ++i) s[i] = s[i + 1];
      for (size_t i = best + 1; i + 2 < n; ++i) pair[i] = pair[i + 1];
      --n;
      if (best > 0) pair[best - 1] = Lookup(s[best - 1], s[best]);
      if (best + 1 < n) pair[best] = Lookup(s[best], s[best + 1]);
    }
    s.resize(n);
  }

  // Hugging Face's Word::merge_all: a heap of candidate merges ordered by (rank, position).
  void MergeByHeap(std::vector<int32_t>* symbols) const {
    struct Symbol {
      int32_t id;
      int32_t prev;
      int32_t next;
      bool alive;
    };
    struct Candidate {
      int32_t rank;
      int32_t pos;
      int32_t id;
      bool operator>(const Candidate& o) const {
        return rank != o.rank ? rank > o.rank : pos > o.pos;
      }
    };
    const auto n = static_cast<int32_t>(symbols->size());
    std::vector<Symbol> sym(static_cast<size_t>(n));
    for (int32_t i = 0; i < n; ++i) {
      sym[static_cast<size_t>(i)] = {(*symbols)[static_cast<size_t>(i)], i - 1,
                                     i + 1 < n ? i + 1 : -1, true};
    }
    std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> heap;
    auto push = [&](int32_t pos) {
      const int32_t next = sym[static_cast<size_t>(pos)].next;
      if (next < 0) return;
      const MergeResult m =
          Lookup(sym[static_cast<size_t>(pos)].id, sym[static_cast<size_t>(next)].id);
      if (m.id >= 0) heap.push({m.rank, pos, m.id});
    };
    for (int32_t i = 0; i + 1 < n; ++i) push(i);
    while (!heap.empty()) {
      const Candidate top = heap.top();
      heap.pop();
      Symbol& left = sym[static_cast<size_t>(top.pos)];
      if (!left.alive || left.next < 0) continue;
      Symbol& right = sym[static_cast<size_t>(left.next)];
      if (Lookup(left.id, right.id).id != top.id) continue;
      left.id = top.id;
      right.alive = false;
      left.next = right.next;
      if (right.next >= 0) sym[static_cast<size_t>(right.next)].prev = top.pos;
      if (left.prev >= 0) push(left.prev);
      push(top.pos);
    }
    symbols->clear();
    for (int32_t i = 0; i >= 0; i = sym[static_cast<size_t>(i)].next) {
      symbols->push_back(sym[static_cast<size_t>(i)].id);
    }
  }

  void EncodeWord(std::string_view word, bool use_cache, std::vector<int32_t>* ids) const {
    if (ignore_merges) {
      if (auto it = raw_to_id.find(AbslView(word)); it != raw_to_id.end()) {
        ids->push_back(it->second);
        return;
      }
    }
    if (word.size() == 1) {
      MergeWord(word, ids);
      return;
    }
    const bool cacheable = use_cache && word.size() <= kMaxCachedWordBytes;
    if (cacheable) {
      ReaderMutexLock lock(&cache_mu);
      if (auto it = cache.find(AbslView(word)); it != cache.end()) {
        ids->insert(ids->end(), it->second.begin(), it->second.end());
        return;
      }
    }
    const size_t first = ids->size();
    MergeWord(word, ids);
    if (cacheable) {
      MutexLock lock(&cache_mu);
      if (cache.size() < kMaxCacheEntries) {
        cache.try_emplace(std::string(word), ids->begin() + static_cast<std::ptrdiff_t>(first),
                          ids->end());
      }
    }
  }

  // Hugging Face's Metaspace pre-tokenizer on every piece of `pieces` (kept in *owned), into
  // *out. *origin: where the piece at the start of the text begins (nullptr: none is).
  static void Metaspace(const BpePreTokenizerStep& spec,
                        const std::vector<std::string_view>& pieces, const char** origin,
                        std::vector<std::string_view>* out, std::deque<std::string>* owned) {
    using Scheme = BpePreTokenizerStep::PrependScheme;
    const std::string_view r = spec.replacement;
    out->clear();
    for (const std::string_view p : pieces) {
      if (p.empty()) continue;
      const bool first = p.data() == *origin;
      std::string text;
      text.reserve(p.size() + r.size() + 8);
      if (spec.prepend_scheme == Scheme::kAlways ||
          (spec.prepend_scheme == Scheme::kFirst && first)) {
        // Not when the piece starts with the replacement once its spaces are replaced.
        if (p[0] != ' ' && p.substr(0, r.size()) != r) text += r;
      }
      for (const char ch : p) {
        if (ch == ' ') {
          text += r;
        } else {
          text.push_back(ch);
        }
      }
      owned->push_back(std::move(text));
      const std::string_view t = owned->back();
      if (first) *origin = t.data();
      if (!spec.split) {
        out->push_back(t);
        continue;
      }
      size_t start = 0;
      for (size_t at = t.find(r); at != std::string_view::npos; at = t.find(r, at + r.size())) {
        if (at > start) out->push_back(t.substr(start, at - start));
        start = at;
      }
      if (start < t.size()) out->push_back(t.substr(start));
    }
  }

  // One piece of text between added tokens: the pre-tokenizer, then BPE. `at_start`: the
  // piece begins the text (Metaspace's prepend_scheme "first").
  absl::Status EncodePiece(std::string_view piece, bool at_start, bool use_cache,
                           std::vector<int32_t>* ids) const {
    std::vector<std::string_view> pieces = {piece};
    std::vector<std::string_view> next;
    std::deque<std::string> owned;  // pieces given a prefix space, Metaspace's pieces
    const char* origin = at_start ? piece.data() : nullptr;
    for (const Step& step : steps) {
      if (step.spec.kind == BpePreTokenizerStep::Kind::kMetaspace) {
        Metaspace(step.spec, pieces, &origin, &next, &owned);
        pieces.swap(next);
        continue;
      }
      if (step.spec.kind == BpePreTokenizerStep::Kind::kByteLevel) {
        if (step.spec.add_prefix_space) {
          for (std::string_view& p : pieces) {
            if (!p.empty() && p[0] != ' ') {
              owned.push_back(absl::StrCat(" ", std::string(p)));
              p = owned.back();
            }
          }
        }
        if (!step.spec.use_regex) continue;
      }
      if (absl::Status s = Split(step, pieces, &next); !s.ok()) return s;
      pieces.swap(next);
    }
    for (const std::string_view word : pieces) {
      if (!word.empty()) EncodeWord(word, use_cache, ids);
    }
    return absl::OkStatus();
  }

  absl::StatusOr<std::vector<int32_t>> Encode(std::string_view text, bool use_cache) const {
    if (const size_t bad = InvalidUtf8Offset(text); bad != std::string_view::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("BPE Encode: the text is not valid UTF-8 at byte ", bad));
    }
    std::vector<int32_t> ids;
    ids.reserve(text.size() / 3 + 4);
    std::vector<std::pair<int, std::pair<size_t, size_t>>> first;
    SplitAdded(raw_matcher, text, 0, &first);
    std::vector<std::pair<int, std::pair<size_t, size_t>>> second;
    for (const auto& [index, range] : first) {
      if (index >= 0) {
        ids.push_back(added[static_cast<size_t>(index)].id);
        continue;
      }
      std::string_view piece = text.substr(range.first, range.second - range.first);
      // The normalizer sees what the raw added tokens left; the normalized ones and the
      // pre-tokenizer see its output, as in Hugging Face's tokenizers.
      std::string normalized;
      if (!normalizer.empty()) {
        if (absl::Status s = normalizer.Apply(piece, &normalized); !s.ok()) return s;
        piece = normalized;
      }
      second.clear();
      SplitAdded(normalized_matcher, piece, 0, &second);
      for (const auto& [index2, range2] : second) {
        if (index2 >= 0) {
          ids.push_back(added[static_cast<size_t>(index2)].id);
          continue;
        }
        const bool at_start = range.first == 0 && range2.first == 0;
        if (absl::Status s = EncodePiece(piece.substr(range2.first, range2.second - range2.first),
                                         at_start, use_cache, &ids);
            !s.ok()) {
          return s;
        }
      }
    }
    return ids;
  }
  // FromVocab's passes, in order.
  absl::Status SetIds(BpeVocab& vocab, int32_t model_vocab_size);
  absl::Status SetTokens(const std::vector<std::string>& tokens, const std::string& source);
  absl::Status SetMerges(const std::vector<std::string>& merge_list, const std::string& source);
  absl::Status SetAddedTokens(std::vector<BpeAddedToken> tokens, const std::string& source);
  absl::Status SetPreTokenizer(std::vector<BpePreTokenizerStep> spec, const std::string& pre_name,
                               const std::string& source);
  absl::Status SetCharacterPreTokenizer(std::vector<BpePreTokenizerStep> spec,
                                        const std::string& source);
  absl::StatusOr<std::string> Decode(std::span<const int32_t> ids) const;
};

BpeTokenizer::BpeTokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
BpeTokenizer::~BpeTokenizer() = default;

// Sizes and ids: the vocab's size, bos/eos/unk, the normalizer.
absl::Status BpeTokenizer::Impl::SetIds(BpeVocab& vocab, int32_t model_vocab_size) {
  const std::string& source = vocab.source;
  int64_t size = static_cast<int64_t>(vocab.tokens.size());
  for (const BpeAddedToken& token : vocab.added_tokens) {
    if (token.id < 0) {
      return absl::InvalidArgumentError(absl::StrCat(source, ": added token \"", token.content,
                                                     "\" has a negative id ", token.id));
    }
    size = std::max<int64_t>(size, int64_t{token.id} + 1);
  }
  if (model_vocab_size > 0 && size > model_vocab_size) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": the tokenizer has ids up to ",
                                                   size - 1, ", outside the model's vocab_size ",
                                                   model_vocab_size));
  }
  if (size > INT32_MAX / 2) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": too many ids (", size, ")"));
  }
  vocab_size = model_vocab_size > 0 ? model_vocab_size : static_cast<int32_t>(size);
  for (const auto& [name, id] : {std::pair<const char*, int32_t>{"bos", vocab.bos_id},
                                 {"eos", vocab.eos_id},
                                 {"unk", vocab.unk_id}}) {
    if (id < -1 || id >= vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          source, ": ", name, " id ", id, " is outside [0, vocab_size=", vocab_size, ")"));
    }
  }
  bos_id = vocab.bos_id;
  eos_id = vocab.eos_id;
  add_bos = vocab.add_bos && vocab.bos_id >= 0;
  ignore_merges = vocab.ignore_merges;
  absl::StatusOr<Normalizer> created = Normalizer::Create(std::move(vocab.normalizers), source);
  if (!created.ok()) return created.status();
  normalizer = std::move(*created);
  unk_id = vocab.unk_id;
  fuse_unk = vocab.fuse_unk;
  byte_level = vocab.byte_level;
  byte_fallback = vocab.byte_fallback;
  if (byte_level && byte_fallback) {
    return absl::UnimplementedError(absl::StrCat(
        source, ": byte_fallback with the ByteLevel pre-tokenizer is not implemented"));
  }
  if (byte_level && !vocab.decoder.empty()) {
    return absl::UnimplementedError(
        absl::StrCat(source,
                     ": a decoder other than ByteLevel with the ByteLevel pre-tokenizer is not "
                     "implemented"));
  }
  absl::StatusOr<TokenDecoder> decoder = TokenDecoder::Create(std::move(vocab.decoder), source);
  if (!decoder.ok()) return decoder.status();
  token_decoder = std::move(*decoder);
  return absl::OkStatus();
}

// Tokens: the byte-level spelling and the raw bytes behind it (SentencePiece-style: the
// text, and the "<0xNN>" tokens of byte_fallback).
absl::Status BpeTokenizer::Impl::SetTokens(const std::vector<std::string>& tokens,
                                           const std::string& source) {
  decoded.assign(static_cast<size_t>(vocab_size), std::string());
  special.assign(static_cast<size_t>(vocab_size), 1);
  byte_id.fill(-1);
  fallback_id.fill(-1);
  piece_to_id.reserve(tokens.size());
  raw_to_id.reserve(tokens.size());
  for (size_t id = 0; id < tokens.size(); ++id) {
    const std::string& token = tokens[id];
    if (token.empty()) continue;
    special[id] = 0;
    piece_to_id.try_emplace(token, static_cast<int32_t>(id));
    if (!byte_level) {
      if (InvalidUtf8Offset(token) != std::string_view::npos) {
        return absl::InvalidArgumentError(
            absl::StrCat(source, ": token ", id, " is not valid UTF-8"));
      }
      raw_to_id.try_emplace(token, static_cast<int32_t>(id));
      decoded[id] = token;
      continue;
    }
    std::string raw;
    if (internal::ByteLevelDecode(token, &raw)) {
      raw_to_id.try_emplace(raw, static_cast<int32_t>(id));
      if (raw.size() == 1 && byte_id[static_cast<unsigned char>(raw[0])] < 0) {
        byte_id[static_cast<unsigned char>(raw[0])] = static_cast<int32_t>(id);
      }
      decoded[id] = std::move(raw);
    } else {
      decoded[id] = token;  // as Hugging Face's ByteLevel decoder: the token as it is
    }
  }
  if (!byte_level) {
    for (int b = 0; b < 256; ++b) {
      // Hugging Face looks up format!("<{b:#04X}>"): "<0x0A>".
      constexpr char kHex[] = "0123456789ABCDEF";
      const std::string spelled = {'<', '0', 'x', kHex[b >> 4], kHex[b & 15], '>'};
      if (auto it = piece_to_id.find(spelled); it != piece_to_id.end()) {
        fallback_id[static_cast<size_t>(b)] = it->second;
      }
    }
  }
  return absl::OkStatus();
}

// Merges: (left id, right id) -> (rank, merged id); a later duplicate wins, as in Hugging
// Face's map.
absl::Status BpeTokenizer::Impl::SetMerges(const std::vector<std::string>& merge_list,
                                           const std::string& source) {
  merges.reserve(merge_list.size());
  for (size_t rank = 0; rank < merge_list.size(); ++rank) {
    const std::string& merge = merge_list[rank];
    const size_t space = merge.find(' ');
    if (space == std::string::npos || space == 0 || space + 1 == merge.size() ||
        merge.find(' ', space + 1) != std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat(source, ": merges[", rank, "] \"", merge,
                                                     "\" is not two tokens separated by a space"));
    }
    const std::string left = merge.substr(0, space);
    const std::string right = merge.substr(space + 1);
    const std::string joined = left + right;
    int32_t ids[3];
    const std::string* parts[3] = {&left, &right, &joined};
    for (int k = 0; k < 3; ++k) {
      auto it = piece_to_id.find(*parts[k]);
      if (it == piece_to_id.end()) {
        return absl::InvalidArgumentError(absl::StrCat(source, ": merges[", rank, "] \"", merge,
                                                       "\" names \"", *parts[k],
                                                       "\", which is not in the vocab"));
      }
      ids[k] = it->second;
    }
    merges[PairKey(ids[0], ids[1])] = {static_cast<int32_t>(rank), ids[2]};
  }
  return absl::OkStatus();
}

// Added tokens: their matchers (raw or normalized) and how they decode.
absl::Status BpeTokenizer::Impl::SetAddedTokens(std::vector<BpeAddedToken> tokens,
                                                const std::string& source) {
  added = std::move(tokens);
  bool single_word = false;
  for (size_t i = 0; i < added.size(); ++i) {
    const BpeAddedToken& token = added[i];
    const auto id = static_cast<size_t>(token.id);
    if (InvalidUtf8Offset(token.content) != std::string_view::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat(source, ": added token ", token.id, " is not valid UTF-8"));
    }
    added_to_id.try_emplace(token.content, token.id);
    special[id] = token.special ? 1 : 0;
    // A token matched in normalized text is matched, and decodes, as its own normalized
    // form (Hugging Face's AddedVocabulary normalizes such tokens' contents): "kvcm" is
    // "▁kvcm" after a Prepend("▁").
    std::string content = token.content;
    if (token.normalized) {
      if (absl::Status s = normalizer.Apply(token.content, &content); !s.ok()) return s;
    }
    if (token.special) {
      decoded[id].clear();
    } else if (!byte_level) {
      decoded[id] = content;  // the decoder's steps see it as any token
    } else {
      std::string raw;
      decoded[id] = internal::ByteLevelDecode(content, &raw) ? raw : content;
    }
    (token.normalized ? normalized_matcher : raw_matcher).Add(static_cast<int>(i), content);
    single_word |= token.single_word;
  }
  raw_matcher.Finish();
  normalized_matcher.Finish();
  if (single_word) {
    absl::StatusOr<std::unique_ptr<Regex>> word =
        Regex::Compile(R"([\p{Alphabetic}\p{N}_])", source);
    if (!word.ok()) return word.status();
    word_char = std::move(*word);
  }
  return absl::OkStatus();
}

// The pre-tokenizer: the vocab's steps, or the ones its name stands for.
absl::Status BpeTokenizer::Impl::SetPreTokenizer(std::vector<BpePreTokenizerStep> spec,
                                                 const std::string& pre_name,
                                                 const std::string& source) {
  if (!byte_level) return SetCharacterPreTokenizer(std::move(spec), source);
  std::vector<BpePreTokenizerStep> specs = std::move(spec);
  if (specs.empty()) {
    absl::StatusOr<std::vector<BpePreTokenizerStep>> named = BpePreTokenizerForName(pre_name);
    if (!named.ok()) {
      return absl::Status(named.status().code(),
                          absl::StrCat(source, ": ", named.status().message()));
    }
    specs = std::move(*named);
  }
  for (size_t i = 0; i < specs.size(); ++i) {
    if (specs[i].kind == BpePreTokenizerStep::Kind::kMetaspace) {
      return absl::UnimplementedError(
          absl::StrCat(source, ": the Metaspace pre-tokenizer with ByteLevel is not implemented"));
    }
    const bool is_byte_level = specs[i].kind == BpePreTokenizerStep::Kind::kByteLevel;
    if (is_byte_level != (i + 1 == specs.size())) {
      return absl::UnimplementedError(absl::StrCat(
          source, ": the pre-tokenizer must end with ByteLevel, and have it only there"));
    }
    Impl::Step step;
    step.spec = std::move(specs[i]);
    if (!is_byte_level || step.spec.use_regex) {
      const std::string_view pattern =
          is_byte_level ? kGpt2PreTokenizerRegex : std::string_view(step.spec.regex);
      absl::StatusOr<std::unique_ptr<Regex>> regex = Regex::Compile(pattern, source);
      if (!regex.ok()) return regex.status();
      step.regex = std::move(*regex);
      if (is_byte_level) step.spec.behavior = BpePreTokenizerStep::Behavior::kIsolated;
    }
    steps.push_back(std::move(step));
  }
  if (steps.empty()) {
    return absl::UnimplementedError(
        absl::StrCat(source, ": the pre-tokenizer must end with ByteLevel"));
  }
  return absl::OkStatus();
}

// SentencePiece-style pre-tokenizer: Split and Metaspace steps in any order, or none.
absl::Status BpeTokenizer::Impl::SetCharacterPreTokenizer(std::vector<BpePreTokenizerStep> specs,
                                                          const std::string& source) {
  for (BpePreTokenizerStep& spec : specs) {
    Impl::Step step;
    if (spec.kind == BpePreTokenizerStep::Kind::kByteLevel) {
      return absl::UnimplementedError(absl::StrCat(
          source, ": the ByteLevel pre-tokenizer in SentencePiece-style BPE is not implemented"));
    }
    if (spec.kind == BpePreTokenizerStep::Kind::kMetaspace) {
      size_t len = 0;
      if (!spec.replacement.empty()) DecodeAt(spec.replacement, 0, &len);
      if (spec.replacement.empty() || len != spec.replacement.size() ||
          InvalidUtf8Offset(spec.replacement) != std::string_view::npos) {
        return absl::InvalidArgumentError(absl::StrCat(
            source, ": Metaspace replacement \"", spec.replacement, "\" is not one character"));
      }
    } else {
      absl::StatusOr<std::unique_ptr<Regex>> regex = Regex::Compile(spec.regex, source);
      if (!regex.ok()) return regex.status();
      step.regex = std::move(*regex);
    }
    step.spec = std::move(spec);
    steps.push_back(std::move(step));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<BpeTokenizer>> BpeTokenizer::FromVocab(BpeVocab vocab,
                                                                      int32_t vocab_size) {
  auto impl = std::make_unique<Impl>();
  const std::string source = vocab.source;
  if (absl::Status s = impl->SetIds(vocab, vocab_size); !s.ok()) return s;
  if (absl::Status s = impl->SetTokens(vocab.tokens, source); !s.ok()) return s;
  if (absl::Status s = impl->SetMerges(vocab.merges, source); !s.ok()) return s;
  if (absl::Status s = impl->SetAddedTokens(std::move(vocab.added_tokens), source); !s.ok()) {
    return s;
  }
  if (absl::Status s = impl->SetPreTokenizer(std::move(vocab.pre_tokenizer), vocab.pre, source);
      !s.ok()) {
    return s;
  }
  return std::unique_ptr<BpeTokenizer>(new BpeTokenizer(std::move(impl)));
}

absl::StatusOr<std::vector<int32_t>> BpeTokenizer::Encode(std::string_view text) const {
  return impl_->Encode(text, /*use_cache=*/true);
}

absl::StatusOr<std::vector<int32_t>> BpeTokenizer::EncodeUncached(std::string_view text) const {
  return impl_->Encode(text, /*use_cache=*/false);
}

absl::StatusOr<std::string> BpeTokenizer::Decode(std::span<const int32_t> ids) const {
  return impl_->Decode(ids);
}

absl::StatusOr<std::string> BpeTokenizer::Impl::Decode(std::span<const int32_t> ids) const {
  std::string text;
  std::vector<std::string> tokens;  // SentencePiece-style: the decoder's input
  if (!byte_level) tokens.reserve(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    const int32_t id = ids[i];
    if (id < 0 || id >= vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "Decode: ids[", i, "] = ", id, " is outside [0, vocab_size=", vocab_size, ")"));
    }
    if (special[static_cast<size_t>(id)] != 0) continue;
    if (byte_level) {
      text += decoded[static_cast<size_t>(id)];
    } else {
      tokens.push_back(decoded[static_cast<size_t>(id)]);
    }
  }
  if (!byte_level) {
    if (absl::Status s = token_decoder.Decode(std::move(tokens), &text); !s.ok()) return s;
  }
  return text;
}

int32_t BpeTokenizer::bos_id() const { return impl_->bos_id; }
int32_t BpeTokenizer::eos_id() const { return impl_->eos_id; }
int32_t BpeTokenizer::vocab_size() const { return impl_->vocab_size; }
bool BpeTokenizer::add_bos() const { return impl_->add_bos; }

bool BpeTokenizer::IsSpecial(int32_t id) const {
  return id >= 0 && id < impl_->vocab_size && impl_->special[static_cast<size_t>(id)] != 0;
}

std::optional<int32_t> BpeTokenizer::TokenId(std::string_view piece) const {
  if (auto it = impl_->added_to_id.find(AbslView(piece)); it != impl_->added_to_id.end())
    return it->second;
  if (auto it = impl_->piece_to_id.find(AbslView(piece)); it != impl_->piece_to_id.end())
    return it->second;
  return std::nullopt;
}

}  // namespace kvcm
