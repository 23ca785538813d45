// The names docs/chat-templates.md lists as supported (its "Tests:", "Filters:" and
// "Methods:" items) are exactly the keys of the interpreter's tables, in both directions; and
// the parser and evaluator accept exactly those names.
#include <algorithm>
#include <fstream>
#include <iterator>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/str_split.h"
#include "common/chat/jinja_interpreter.h"
#include "common/chat/jinja_parser.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvcm::jinja {
namespace {

using ::testing::HasSubstr;
using Names = std::set<std::string>;

std::string ReadDoc() {
  std::ifstream in(KVCM_CHAT_TEMPLATES_DOC);
  EXPECT_TRUE(in.good()) << KVCM_CHAT_TEMPLATES_DOC;
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The first sentence of the bullet "- <label>: ...", its lines joined: up to the first "`."
// (each list ends with a code span and a full stop; prose may follow).
std::string BulletSentence(const std::string& doc, const std::string& label) {
  const std::string start = "\n- " + label + ": ";
  const size_t begin = doc.find(start);
  if (begin == std::string::npos) {
    ADD_FAILURE() << "docs/chat-templates.md has no bullet '- " << label << ":'";
    return "";
  }
  const size_t end = doc.find("`.", begin);
  std::string text = doc.substr(begin + start.size(), end - begin - start.size() + 1);
  std::replace(text.begin(), text.end(), '\n', ' ');
  return text;
}

// The whitespace-separated words of the code spans of `text`, less (parenthesised remarks).
Names CodeWords(const std::string& text) {
  Names names;
  std::vector<std::string> parts = absl::StrSplit(text, '`');
  for (size_t i = 1; i < parts.size(); i += 2) {
    std::string span;
    int depth = 0;
    for (char c : parts[i]) {
      if (c == '(') ++depth;
      if (depth == 0) span.push_back(c);
      if (c == ')') --depth;
    }
    std::vector<std::string> words = absl::StrSplit(span, ' ', absl::SkipWhitespace());
    names.insert(words.begin(), words.end());
  }
  return names;
}

Names ToSet(const std::vector<std::string_view>& keys) { return Names(keys.begin(), keys.end()); }

// The names of `a` that `b` lacks.
std::vector<std::string> Minus(const Names& a, const Names& b) {
  std::vector<std::string> out;
  std::set_difference(a.begin(), a.end(), b.begin(), b.end(), std::back_inserter(out));
  return out;
}

// Both directions, naming the names that differ.
void ExpectSame(const Names& documented, const Names& table, const std::string& what) {
  EXPECT_THAT(Minus(documented, table), ::testing::IsEmpty())
      << what << " docs/chat-templates.md lists but the interpreter's table lacks";
  EXPECT_THAT(Minus(table, documented), ::testing::IsEmpty())
      << what << " in the interpreter's table that docs/chat-templates.md does not list";
}

TEST(JinjaTablesTest, DocumentedTestsAreTheTestTable) {
  const Names documented = CodeWords(BulletSentence(ReadDoc(), "Tests"));
  EXPECT_EQ(documented.size(), 39u);
  ExpectSame(documented, ToSet(SupportedTests()), "tests");
}

TEST(JinjaTablesTest, DocumentedFiltersAreTheFilterTable) {
  const Names documented = CodeWords(BulletSentence(ReadDoc(), "Filters"));
  EXPECT_EQ(documented.size(), 32u);
  ExpectSame(documented, ToSet(SupportedFilters()), "filters");
}

TEST(JinjaTablesTest, DocumentedMethodsAreTheMethodTables) {
  // "on strings `...`; on dicts `...`."
  const std::map<std::string, std::string> types = {{"strings", "str"}, {"dicts", "dict"}};
  std::map<std::string, Names> documented;
  std::vector<std::string> parts = absl::StrSplit(BulletSentence(ReadDoc(), "Methods"), ';');
  for (const std::string& text : parts) {
    const size_t on = text.find("on ");
    ASSERT_NE(on, std::string::npos) << text;
    const std::string receiver = text.substr(on + 3, text.find(' ', on + 3) - on - 3);
    ASSERT_TRUE(types.count(receiver)) << "unknown receiver '" << receiver << "' in: " << text;
    documented[types.at(receiver)] = CodeWords(text);
  }
  ASSERT_EQ(documented.size(), types.size());
  EXPECT_EQ(documented["str"].size(), 24u);
  EXPECT_EQ(documented["dict"].size(), 4u);
  for (const auto& [type, names] : documented) {
    ExpectSame(names, ToSet(SupportedMethods(type)), type + " methods");
  }
  EXPECT_TRUE(SupportedMethods("list").empty());
}

TEST(JinjaTablesTest, TablesAreSortedAndUnique) {
  for (const auto& keys :
       {SupportedFilters(), SupportedTests(), SupportedMethods("str"), SupportedMethods("dict")}) {
    EXPECT_TRUE(std::is_sorted(keys.begin(), keys.end()));
    EXPECT_EQ(std::adjacent_find(keys.begin(), keys.end()), keys.end());
  }
}

// The parser's names (IsKnownFilter, IsKnownTest) are the tables' keys.
TEST(JinjaTablesTest, ParserKnowsExactlyTheTableKeys) {
  for (std::string_view f : SupportedFilters()) EXPECT_TRUE(IsKnownFilter(f)) << f;
  for (std::string_view t : SupportedTests()) EXPECT_TRUE(IsKnownTest(t)) << t;
  for (std::string_view other : {"dictsort", "wordcount", "batch", "xmlattr", ""}) {
    EXPECT_FALSE(IsKnownFilter(other)) << other;
  }
  for (std::string_view other : {"divisible", "sameas2", "ascii", ""}) {
    EXPECT_FALSE(IsKnownTest(other)) << other;
  }
}

// A name outside a table keeps the interpreter's one error text.
TEST(JinjaTablesTest, UnknownNamesGiveTheUnsupportedError) {
  Interpreter in(RenderLimits{}, Dict{});
  CallArgs args;
  absl::StatusOr<Value> filter = in.ApplyFilter("dictsort", Value::String("x"), args);
  EXPECT_THAT(
      filter.status().message(),
      HasSubstr("the filter 'dictsort' is not supported by kvcm's chat template interpreter"));
  absl::StatusOr<bool> test = in.ApplyTest("ascii", Value::String("x"), args);
  EXPECT_THAT(test.status().message(),
              HasSubstr("the test 'ascii' is not supported by kvcm's chat template interpreter"));
  absl::StatusOr<Value> method = in.CallMethod(Value::String("x"), "zfill", args);
  EXPECT_THAT(
      method.status().message(),
      HasSubstr("the str method 'zfill' is not supported by kvcm's chat template interpreter"));
}

}  // namespace
}  // namespace kvcm::jinja
