#include "common/chat/chat_template.h"

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/common/chat/chat_test_cases.h"
#include "tests/support/real_model.h"
#include "tests/support/status_matchers.h"

namespace kvcm {
namespace {

using chat_test::Case;
using chat_test::Json;
using ::testing::AllOf;
using ::testing::HasSubstr;

// Renders every case with kvcm and compares with transformers: the same text, or both
// failing (raise_exception with the same message).
void CompareWithReference(const std::vector<Case>& cases) {
  absl::StatusOr<std::vector<Json>> reference = chat_test::RunReference(cases);
  ASSERT_THAT(reference, IsOk());
  int rendered = 0, raised = 0, failed_both = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    const Json& want = (*reference)[i];
    absl::StatusOr<ChatTemplate> tmpl = ChatTemplate::Parse(c.tmpl->source);
    ASSERT_THAT(tmpl, IsOk()) << c.tmpl->name << ": " << tmpl.status();
    absl::StatusOr<std::string> got = tmpl->Render(c.conversation->messages, c.Options());
    if (want["ok"].get<bool>()) {
      if (!got.ok()) {
        ADD_FAILURE() << c.Label() << ": kvcm failed: " << got.status() << "\ntransformers:\n"
                      << want["text"].get<std::string>();
        continue;
      }
      EXPECT_EQ(*got, want["text"].get<std::string>()) << c.Label();
      ++rendered;
      continue;
    }
    const std::string type = want["type"].get<std::string>();
    const std::string error = want["error"].get<std::string>();
    if (got.ok()) {
      ADD_FAILURE() << c.Label() << ": transformers failed (" << type << ": " << error
                    << ") but kvcm rendered:\n"
                    << *got;
      continue;
    }
    EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument) << c.Label();
    if (type == "TemplateError") {  // raise_exception
      EXPECT_EQ(got.status().message(), error) << c.Label();
      ++raised;
    } else {
      EXPECT_THAT(std::string(got.status().message()), HasSubstr("chat template ")) << c.Label();
      ++failed_both;
    }
  }
  std::cout << cases.size() << " cases: " << rendered << " rendered equal, " << raised
            << " raise_exception with the same message, " << failed_both
            << " failing on both sides\n";
}

TEST(ChatTemplateReferenceTest, EveryTemplateAndConversationMatchesTransformers) {
  const std::vector<chat_test::TemplateFile> templates = chat_test::Templates();
  const std::vector<chat_test::Conversation> conversations = chat_test::Conversations();
  ASSERT_GE(templates.size(), 12u);
  std::vector<Case> cases;
  for (const auto& t : templates) {
    for (const auto& c : conversations) {
      for (bool agp : {true, false}) cases.push_back(Case{&t, &c, agp});
    }
  }
  CompareWithReference(cases);
}

TEST(ChatTemplateReferenceTest, SeededRandomConversationsMatchTransformers) {
  uint64_t seed = 20240601;
  if (const char* s = std::getenv("KVCM_TEST_SEED"); s != nullptr)
    seed = std::strtoull(s, nullptr, 10);
  std::cout << "seed " << seed << " (KVCM_TEST_SEED overrides)\n";
  std::mt19937_64 rng(seed);
  const std::vector<chat_test::TemplateFile> templates = chat_test::Templates();
  std::vector<chat_test::Conversation> conversations;
  for (int i = 0; i < 40; ++i) conversations.push_back(chat_test::RandomConversation(rng, i));
  std::vector<Case> cases;
  for (const auto& t : templates) {
    for (const auto& c : conversations) cases.push_back(Case{&t, &c, rng() % 2 == 0});
  }
  CompareWithReference(cases);
}

TEST(ChatTemplateReferenceTest, SmolLM2TemplateIsTheBundledGgufs) {
  const std::string gguf = testing::SmolLM2GgufPath();
  ASSERT_TRUE(std::filesystem::exists(gguf)) << testing::SmolLM2Missing(gguf);
  absl::StatusOr<testing::TempDir> dir = testing::TempDir::Create("kvcm-chat");
  ASSERT_THAT(dir, IsOk());
  const std::string out = dir->path() + "/template";
  testing::Subprocess::Options options;
  options.argv = {KVCM_REFERENCE_PYTHON, chat_test::TestDir() + "/render_reference.py",
                  "--gguf-template", gguf, out};
  options.output_path = dir->path() + "/python.log";
  auto child = testing::Subprocess::Start(options);
  ASSERT_THAT(child, IsOk());
  absl::StatusOr<int> code = (*child)->Wait(absl::Seconds(120));
  ASSERT_TRUE(code.ok() && *code == 0) << (*child)->Output();
  EXPECT_EQ(chat_test::ReadFile(out),
            chat_test::ReadFile(chat_test::TestDir() + "/templates/smollm2-135m-instruct.jinja"));
}

absl::Status ParseError(const std::string& source) {
  absl::StatusOr<ChatTemplate> t = ChatTemplate::Parse(source);
  if (t.ok()) return absl::OkStatus();
  return t.status();
}

absl::StatusOr<std::string> RenderOne(const std::string& source,
                                      const ChatTemplateOptions& options = {}) {
  absl::StatusOr<ChatTemplate> t = ChatTemplate::Parse(source);
  if (!t.ok()) return t.status();
  const std::vector<ChatMessage> messages = {{"user", "hi", ""}};
  return t->Render(messages, options);
}

TEST(ChatTemplateErrorTest, MalformedTemplatesNameLineAndColumn) {
  struct Bad {
    std::string source;
    std::string where;
    std::string what;
  };
  const std::vector<Bad> bad = {
      {"{% for m in messages %}{{ m }}", "1:1:", "unclosed 'for' block"},
      {"a\n  {% if x %}b{% else %}", "2:3:", "unclosed 'if' block"},
      {"x\n{{ 1 + }}", "2:8:", "expected an expression"},
      {"{{ messages | nosuchfilter }}", "1:15:", "the filter 'nosuchfilter'"},
      {"{{ 1 is nosuchtest }}", "1:9:", "the test 'nosuchtest'"},
      {"{% include 'other.jinja' %}", "1:4:", "the tag 'include'"},
      {"{% frobnicate %}", "1:4:", "unknown tag 'frobnicate'"},
      {"{{ 'unterminated }}", "1:4:", "unterminated string"},
      {"{% endfor %}", "1:4:", "unexpected 'endfor'"},
      {"{{ (1 }}", "1:7:", "unexpected '}'"},
      {"{# never closed", "1:1:", "missing end of comment"},
      {"{{ x", "1:1:", "unclosed tag"},
      {"{% set %}", "1:8:", "expected a name"},
      {"{% break %}", "1:4:", "outside of a loop"},
      {"{{ a ? b }}", "1:6:", "unexpected character '?'"},
  };
  for (const Bad& b : bad) {
    const absl::Status s = ParseError(b.source);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << b.source;
    EXPECT_THAT(std::string(s.message()),
                AllOf(HasSubstr("chat template " + b.where), HasSubstr(b.what)))
        << b.source;
  }
  // Constructs outside the subset name the way out.
  EXPECT_THAT(std::string(ParseError("{{ x | dictsort }}").message()),
              HasSubstr("--chat-template FILE"));
  EXPECT_THAT(
      std::string(RenderOne("{{ 'a'.zfill(3) }}").status().message()),
      AllOf(HasSubstr("chat template 1:"), HasSubstr("zfill"), HasSubstr("--chat-template FILE")));
}

TEST(ChatTemplateErrorTest, RuntimeErrorsAndRaiseException) {
  absl::StatusOr<std::string> r = RenderOne("{{ raise_exception('Roles must alternate!') }}");
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(r.status().message(), "Roles must alternate!");
  r = RenderOne("line\n  {{ nothing.attr }}");
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r.status().message()),
              AllOf(HasSubstr("chat template 2:"), HasSubstr("'nothing' is undefined")));
  r = RenderOne("{{ 'a' + 1 }}");
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("can only concatenate str"));
  // Jinja's lexer accepts a raw or comment tag that ends the source.
  EXPECT_EQ(RenderOne("a{% raw %}").value(), "a");
  EXPECT_EQ(RenderOne("a{#").value(), "a");
  // Undefined prints as nothing; a missing key is undefined.
  EXPECT_EQ(RenderOne("[{{ nothing }}{{ messages[0].nokey }}{{ messages[5] }}]").value(), "[]");
  ChatTemplateOptions options;
  options.extra_context_json = "[1]";
  EXPECT_THAT(std::string(RenderOne("x", options).status().message()),
              HasSubstr("extra_context_json"));
}

TEST(ChatTemplateLimitsTest, RunawayTemplatesHitTheLimits) {
  ChatTemplateOptions options;
  options.max_steps = 1'000'000;
  options.max_output_bytes = 1 << 20;
  const std::vector<std::string> runaway = {
      "{% for i in range(1000000000) %}{% endfor %}",
      "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}",
      "{% for i in range(10000000) %}{{ 'xxxxxxxxxx' }}{% endfor %}",
      "{{ 'x' * 1000000000000 }}",
      "{% set ns = namespace(s='ab') %}{% for i in range(100) %}{% set ns.s = ns.s + ns.s %}{% "
      "endfor %}",
      "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
      "{% set big = 'y' * 900000 %}{% for i in range(100000) %}{% set z = big ~ 'a' %}{% endfor %}",
  };
  for (const std::string& source : runaway) {
    absl::StatusOr<std::string> r = RenderOne(source, options);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted)
        << source << ": " << r.status();
  }
  // Nesting too deep for the parser is an error, not a stack overflow.
  for (const char* open : {"(", "[", "not ", "-"}) {
    std::string deep = "{{ ";
    for (int i = 0; i < 100000; ++i) deep += open;
    deep += "1 }}";
    EXPECT_EQ(ParseError(deep).code(), absl::StatusCode::kInvalidArgument) << open;
  }
  std::string nested;
  for (int i = 0; i < 5000; ++i) nested += "{% if true %}";
  EXPECT_EQ(ParseError(nested).code(), absl::StatusCode::kInvalidArgument);
}

TEST(ChatTemplateTest, RenderIsThreadSafe) {
  const std::vector<chat_test::TemplateFile> templates = chat_test::Templates();
  const std::vector<chat_test::Conversation> conversations = chat_test::Conversations();
  for (const auto& t : templates) {
    absl::StatusOr<ChatTemplate> tmpl = ChatTemplate::Parse(t.source);
    ASSERT_THAT(tmpl, IsOk());
    std::vector<std::string> want;
    for (const auto& c : conversations) {
      Case k{&t, &c, true};
      absl::StatusOr<std::string> r = tmpl->Render(c.messages, k.Options());
      want.push_back(r.ok() ? *r : r.status().ToString());
    }
    std::vector<std::thread> threads;
    std::vector<int> mismatches(8, 0);
    for (int n = 0; n < 8; ++n) {
      threads.emplace_back([&, n] {
        for (int round = 0; round < 20; ++round) {
          for (size_t i = 0; i < conversations.size(); ++i) {
            Case k{&t, &conversations[i], true};
            absl::StatusOr<std::string> r = tmpl->Render(conversations[i].messages, k.Options());
            if ((r.ok() ? *r : r.status().ToString()) != want[i])
              ++mismatches[static_cast<size_t>(n)];
          }
        }
      });
    }
    for (auto& th : threads) th.join();
    for (int m : mismatches) EXPECT_EQ(m, 0) << t.name;
  }
}

}  // namespace
}  // namespace kvcm
