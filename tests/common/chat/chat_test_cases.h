#pragma once
// Shared by the common/chat tests: the templates under tests/common/chat/templates/, the
// conversations of tests/common/chat/conversations.json, seeded random conversations, and a
// live run of render_reference.py (transformers) over a batch of cases.

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/base/status_macros.h"
#include "common/chat/chat_template.h"
#include "nlohmann/json.hpp"
#include "tests/support/subprocess.h"

namespace kvcm::chat_test {

using Json = nlohmann::ordered_json;

inline std::string TestDir() { return KVCM_CHAT_TEST_DIR; }

inline std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

struct TemplateFile {
  std::string name;  // file name without .jinja
  std::string path;
  std::string source;
};

inline std::vector<TemplateFile> Templates() {
  std::vector<TemplateFile> out;
  for (const auto& entry : std::filesystem::directory_iterator(TestDir() + "/templates")) {
    if (entry.path().extension() != ".jinja") continue;
    out.push_back(
        {entry.path().stem().string(), entry.path().string(), ReadFile(entry.path().string())});
  }
  std::sort(out.begin(), out.end(),
            [](const TemplateFile& a, const TemplateFile& b) { return a.name < b.name; });
  return out;
}

struct Conversation {
  std::string name;
  std::vector<ChatMessage> messages;
  Json messages_json = Json::array();
  Json extra = Json::object();  // template variables
};

inline ChatMessage MessageFromJson(const Json& m) {
  ChatMessage message;
  message.role = m.value("role", "");
  message.content = m.value("content", "");
  Json extra = Json::object();
  for (const auto& [k, v] : m.items()) {
    if (k != "role" && k != "content") extra[k] = v;
  }
  if (!extra.empty()) message.extra_json = extra.dump();
  return message;
}

inline std::vector<Conversation> Conversations() {
  const Json file = Json::parse(ReadFile(TestDir() + "/conversations.json"));
  std::vector<Conversation> out;
  for (const auto& [name, value] : file["conversations"].items()) {
    Conversation c;
    c.name = name;
    const Json& messages = value.is_array() ? value : value["messages"];
    if (value.is_object()) {
      c.extra = value["extra"];
      for (auto& [k, v] : c.extra.items()) {
        if (v == "TOOLS") v = file["tools"];
      }
    }
    c.messages_json = messages;
    for (const Json& m : messages) c.messages.push_back(MessageFromJson(m));
    out.push_back(std::move(c));
  }
  return out;
}

// A random conversation: an optional system message, then user/assistant turns (now and
// then out of order), contents drawn from fragments with whitespace, unicode, quotes,
// braces and Jinja-looking text.
inline Conversation RandomConversation(std::mt19937_64& rng, int index) {
  static const std::vector<std::string> kFragments = {
      "Hello",      "world",  " ",     "  ",     "\n",     "\n\n",    "\t",       "é",
      "日本語",     "🙂",   "'",     "\"",     "\\",     "{{ x }}", "{% if %}", "{#",
      "<|im_end|>", "[INST]", "&amp;", "<b>",    "42",     "3.14",    "none",     "True",
      "a, b",       "!",      "?",     "\u00a0", "\u2028", "\r\n",    "Ünïcödé",  "tab\there"};
  auto pick = [&](size_t n) { return static_cast<size_t>(rng() % n); };
  auto text = [&]() {
    std::string s;
    const size_t n = pick(8);
    for (size_t i = 0; i < n; ++i) s += kFragments[pick(kFragments.size())];
    return s;
  };
  Conversation c;
  c.name = absl::StrCat("random_", index);
  if (pick(3) == 0) c.messages.push_back({"system", text(), ""});
  const size_t turns = 1 + pick(5);
  for (size_t i = 0; i < turns; ++i) {
    std::string role = i % 2 == 0 ? "user" : "assistant";
    if (pick(12) == 0) role = i % 2 == 0 ? "assistant" : "user";
    c.messages.push_back({role, text(), ""});
  }
  for (const ChatMessage& m : c.messages)
    c.messages_json.push_back({{"role", m.role}, {"content", m.content}});
  return c;
}

struct Case {
  const TemplateFile* tmpl;
  const Conversation* conversation;
  bool add_generation_prompt;
  std::string bos_token = "<s>";
  std::string eos_token = "</s>";

  std::string Label() const {
    return absl::StrCat(tmpl->name, " x ", conversation->name,
                        add_generation_prompt ? " (add_generation_prompt)" : "");
  }
  ChatTemplateOptions Options() const {
    ChatTemplateOptions options;
    options.add_generation_prompt = add_generation_prompt;
    options.bos_token = bos_token;
    options.eos_token = eos_token;
    if (!conversation->extra.empty()) options.extra_context_json = conversation->extra.dump();
    return options;
  }
};

// transformers' renderings of `cases`, in order: {"ok", "text"} or {"ok", "type", "error"}.
inline absl::StatusOr<std::vector<Json>> RunReference(const std::vector<Case>& cases) {
  KVCM_ASSIGN_OR_RETURN(testing::TempDir dir, testing::TempDir::Create("kvcm-chat"));
  Json input = {{"cases", Json::array()}};
  for (const Case& c : cases) {
    input["cases"].push_back({{"template", c.tmpl->path},
                              {"messages", c.conversation->messages_json},
                              {"add_generation_prompt", c.add_generation_prompt},
                              {"bos_token", c.bos_token},
                              {"eos_token", c.eos_token},
                              {"extra", c.conversation->extra}});
  }
  const std::string in_path = dir.path() + "/cases.json";
  const std::string out_path = dir.path() + "/results.json";
  {
    std::ofstream out(in_path, std::ios::binary);
    out << input.dump();
  }
  testing::Subprocess::Options options;
  options.argv = {KVCM_REFERENCE_PYTHON, TestDir() + "/render_reference.py", in_path, out_path};
  options.output_path = dir.path() + "/python.log";
  KVCM_ASSIGN_OR_RETURN(auto child, testing::Subprocess::Start(options));
  KVCM_ASSIGN_OR_RETURN(int code, child->Wait(absl::Seconds(240)));
  if (code != 0) {
    return absl::InternalError(
        absl::StrCat("render_reference.py exited with ", code, ": ", child->Output()));
  }
  const Json results = Json::parse(ReadFile(out_path))["results"];
  std::vector<Json> out(results.begin(), results.end());
  if (out.size() != cases.size()) return absl::InternalError("render_reference.py: wrong count");
  return out;
}

}  // namespace kvcm::chat_test
