// Seeded random mutations of the templates under tests/common/chat/templates/ fed to Parse
// and Render: never a crash, only OK, INVALID_ARGUMENT or RESOURCE_EXHAUSTED; and a mutant
// that both kvcm and transformers render gives the same text.

#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/chat/chat_template.h"
#include "gtest/gtest.h"
#include "tests/common/chat/chat_test_cases.h"
#include "tests/support/status_matchers.h"

namespace kvcm {
namespace {

using chat_test::Case;
using chat_test::Json;

uint64_t Seed() {
  uint64_t seed = 7355608;
  if (const char* s = std::getenv("KVCM_TEST_SEED"); s != nullptr)
    seed = std::strtoull(s, nullptr, 10);
  std::cout << "seed " << seed << " (KVCM_TEST_SEED overrides)\n";
  return seed;
}

std::string Mutate(std::string s, std::mt19937_64& rng) {
  static const std::vector<std::string> kPieces = {
      "{%",       "%}",       "{{",      "}}",       "{#",
      "#}",       "-",        "+",       "(",        ")",
      "[",        "]",        "{",       "}",        "|",
      ",",        ":",        "'",       "\"",       "\\",
      "\n",       " ",        "loop",    "for",      "endfor",
      "if",       "endif",    "else",    "elif",     "set",
      "in",       "not",      "is",      "and",      "or",
      "none",     "messages", "message", "ns",       "range(9)",
      "0",        "-1",       "1.5",     "~",        "*",
      "**",       "//",       "%",       "==",       "trim",
      "length",   "tojson",   "default", "defined",  "raise_exception('x')",
      "é",        "\xff",     "[::-1]",  ".strip()", "|join(',')",
      "{% raw %}"};
  auto pick = [&](size_t n) { return n == 0 ? size_t{0} : static_cast<size_t>(rng() % n); };
  const int edits = 1 + static_cast<int>(pick(4));
  for (int e = 0; e < edits; ++e) {
    const size_t at = pick(s.size() + 1);
    switch (pick(5)) {
      case 0:
        s.erase(at, 1 + pick(8));
        break;  // delete
      case 1:
        s.insert(at, kPieces[pick(kPieces.size())]);
        break;  // insert
      case 2:
        s.insert(at, s.substr(pick(s.size() + 1), 1 + pick(16)));
        break;  // duplicate
      case 3:
        if (at < s.size()) s[at] = static_cast<char>(rng() & 0xFF);
        break;    // byte
      default: {  // swap
        const size_t b = pick(s.size() + 1);
        if (at < s.size() && b < s.size()) std::swap(s[at], s[b]);
      }
    }
  }
  return s;
}

TEST(ChatTemplateFuzzTest, MutatedTemplatesNeverCrash) {
  std::mt19937_64 rng(Seed());
  const std::vector<chat_test::TemplateFile> templates = chat_test::Templates();
  const std::vector<chat_test::Conversation> conversations = chat_test::Conversations();
  int parsed = 0, rendered = 0, total = 0;
  for (int round = 0; round < 300; ++round) {
    for (const auto& t : templates) {
      const std::string source = Mutate(t.source, rng);
      ++total;
      absl::StatusOr<ChatTemplate> tmpl = ChatTemplate::Parse(source);
      if (!tmpl.ok()) {
        EXPECT_EQ(tmpl.status().code(), absl::StatusCode::kInvalidArgument) << tmpl.status();
        continue;
      }
      ++parsed;
      const auto& c = conversations[rng() % conversations.size()];
      Case k{&t, &c, rng() % 2 == 0};
      ChatTemplateOptions options = k.Options();
      options.max_steps = 200'000;
      options.max_output_bytes = 1 << 20;
      absl::StatusOr<std::string> r = tmpl->Render(c.messages, options);
      if (r.ok()) {
        ++rendered;
      } else {
        EXPECT_TRUE(r.status().code() == absl::StatusCode::kInvalidArgument ||
                    r.status().code() == absl::StatusCode::kResourceExhausted)
            << r.status();
      }
    }
  }
  std::cout << total << " mutants: " << parsed << " parsed, " << rendered << " rendered\n";
}

// Mutants both sides render must render the same; kvcm may refuse what it does not
// support, but must not fail where transformers renders for any other reason.
TEST(ChatTemplateFuzzTest, MutantsRenderLikeTransformers) {
  std::mt19937_64 rng(Seed() + 1);
  const std::vector<chat_test::TemplateFile> templates = chat_test::Templates();
  const std::vector<chat_test::Conversation> conversations = chat_test::Conversations();
  std::vector<chat_test::TemplateFile> mutants;
  absl::StatusOr<testing::TempDir> dir = testing::TempDir::Create("kvcm-chat-fuzz");
  ASSERT_THAT(dir, IsOk());
  for (int round = 0; round < 25; ++round) {
    for (const auto& t : templates) {
      chat_test::TemplateFile m;
      m.name = t.name + "~" + std::to_string(round);
      m.path = dir->path() + "/" + m.name + ".jinja";
      m.source = Mutate(t.source, rng);
      std::ofstream(m.path, std::ios::binary) << m.source;
      mutants.push_back(std::move(m));
    }
  }
  std::vector<Case> cases;
  for (const auto& m : mutants) {
    cases.push_back(Case{&m, &conversations[rng() % conversations.size()], rng() % 2 == 0});
  }
  absl::StatusOr<std::vector<Json>> reference = chat_test::RunReference(cases);
  ASSERT_THAT(reference, IsOk());
  int same = 0, both_fail = 0, unsupported = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    const Json& want = (*reference)[i];
    absl::StatusOr<ChatTemplate> tmpl = ChatTemplate::Parse(cases[i].tmpl->source);
    absl::StatusOr<std::string> got =
        tmpl.ok() ? tmpl->Render(cases[i].conversation->messages, cases[i].Options())
                  : absl::StatusOr<std::string>(tmpl.status());
    const bool ok = want["ok"].get<bool>();
    if (!ok && want["type"] == "UnicodeDecodeError") continue;  // no reference for bad UTF-8
    if (ok && got.ok()) {
      EXPECT_EQ(*got, want["text"].get<std::string>()) << "mutant:\n" << cases[i].tmpl->source;
      ++same;
    } else if (ok) {
      const std::string message(got.status().message());
      if (message.find("--chat-template") != std::string::npos) {
        ++unsupported;
      } else {
        ADD_FAILURE() << "transformers renders, kvcm fails: " << got.status() << "\nmutant:\n"
                      << cases[i].tmpl->source;
      }
    } else if (got.ok()) {
      ADD_FAILURE() << "transformers fails (" << want["type"].get<std::string>() << ": "
                    << want["error"].get<std::string>() << "), kvcm renders\nmutant:\n"
                    << cases[i].tmpl->source;
    } else {
      ++both_fail;
    }
  }
  std::cout << cases.size() << " mutants: " << same << " same text, " << both_fail
            << " failing on both sides, " << unsupported << " outside kvcm's subset\n";
}

}  // namespace
}  // namespace kvcm
