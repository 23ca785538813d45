#include "common/tokenizer/text_matching_internal.h"

#include <algorithm>
#include <cstring>
#include <functional>

#include "absl/strings/str_cat.h"
#include "common/tokenizer/normalizer.h"

namespace kvcm::internal {
namespace {

// Per-thread PCRE2 state: match data (only the whole match is read) and a JIT stack large
// enough for long runs of whitespace.
struct ThreadMatchState {
  pcre2_match_data* data = nullptr;
  pcre2_match_context* context = nullptr;
  pcre2_jit_stack* stack = nullptr;
  ThreadMatchState() {
    data = pcre2_match_data_create(1, nullptr);
    context = pcre2_match_context_create(nullptr);
    stack = pcre2_jit_stack_create(32 * 1024, 16 * 1024 * 1024, nullptr);
    if (context != nullptr && stack != nullptr) pcre2_jit_stack_assign(context, nullptr, stack);
  }
  ~ThreadMatchState() {
    pcre2_match_data_free(data);
    pcre2_match_context_free(context);
    pcre2_jit_stack_free(stack);
  }
  ThreadMatchState(const ThreadMatchState&) = delete;
  ThreadMatchState& operator=(const ThreadMatchState&) = delete;
};

ThreadMatchState& MatchState() {
  thread_local ThreadMatchState state;
  return state;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Regex>> Regex::Compile(std::string_view pattern,
                                                      std::string_view source) {
  const std::string rewritten = OnigurumaWhitespace(pattern);
  int error = 0;
  PCRE2_SIZE offset = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(rewritten.data()), rewritten.size(),
                                   PCRE2_UTF | PCRE2_UCP, &error, &offset, nullptr);
  if (code == nullptr) {
    std::array<PCRE2_UCHAR, 256> message{};
    pcre2_get_error_message(error, message.data(), message.size());
    return absl::InvalidArgumentError(absl::StrCat(std::string(source), ": pre-tokenizer regex \"",
                                                   std::string(pattern),
                                                   "\" does not compile at offset ", offset, ": ",
                                                   reinterpret_cast<const char*>(message.data())));
  }
  const bool jit = pcre2_jit_compile(code, PCRE2_JIT_COMPLETE) == 0;
  return std::unique_ptr<Regex>(new Regex(code, jit));
}

int Regex::Find(std::string_view subject, size_t start, size_t* begin, size_t* end) const {
  ThreadMatchState& state = MatchState();
  const auto* data = reinterpret_cast<PCRE2_SPTR>(subject.data());
  const int rc =
      jit_ ? pcre2_jit_match(code_, data, subject.size(), start, 0, state.data, state.context)
           : pcre2_match(code_, data, subject.size(), start, PCRE2_NO_UTF_CHECK, state.data,
                         state.context);
  if (rc == PCRE2_ERROR_NOMATCH) return 0;
  if (rc < 0) return rc;
  const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(state.data);
  *begin = ovector[0];
  *end = ovector[1];
  return 1;
}

absl::Status RegexError(int rc) {
  std::array<PCRE2_UCHAR, 256> message{};
  pcre2_get_error_message(rc, message.data(), message.size());
  return absl::InternalError(absl::StrCat("BPE pre-tokenizer: regex match failed: ",
                                          reinterpret_cast<const char*>(message.data())));
}

void AddedTokenMatcher::Finish() {
  for (const auto& [index, content] : contents_) {
    if (!index_of_.try_emplace(content, index).second) continue;
    std::vector<size_t>& lengths = lengths_by_first_byte_[static_cast<unsigned char>(content[0])];
    if (std::find(lengths.begin(), lengths.end(), content.size()) == lengths.end()) {
      lengths.push_back(content.size());
    }
  }
  for (std::vector<size_t>& lengths : lengths_by_first_byte_) {
    std::sort(lengths.begin(), lengths.end(), std::greater<>());
  }
}

bool AddedTokenMatcher::Find(std::string_view text, size_t from, size_t* begin, size_t* end,
                             int* index) const {
  for (size_t i = from; i < text.size(); ++i) {
    for (const size_t length : lengths_by_first_byte_[static_cast<unsigned char>(text[i])]) {
      if (text.size() - i < length) continue;
      const auto found = index_of_.find(text.substr(i, length));
      if (found == index_of_.end()) continue;
      *begin = i;
      *end = i + length;
      *index = found->second;
      return true;
    }
  }
  return false;
}

}  // namespace kvcm::internal
