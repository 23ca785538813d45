// The fuzz target of the chat-template interpreter (tests/support/fuzz_target.h): the input
// is a template's source. ChatTemplate::Parse accepts it or refuses it with
// INVALID_ARGUMENT; a parsed template renders two conversations (a system prompt, turns
// with a tool call; a lone user message) within small step and output limits, giving text
// or INVALID_ARGUMENT / RESOURCE_EXHAUSTED, never a crash, a hang or an exception. Seeds:
// the real templates of tests/common/chat/templates/.

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "common/chat/chat_template.h"
#include "tests/support/fuzz_target.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using kvcm::fuzz::Check;
  const std::string_view source(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<kvcm::ChatTemplate> tmpl = kvcm::ChatTemplate::Parse(source);
  if (!tmpl.ok()) {
    Check(tmpl.status().code() == absl::StatusCode::kInvalidArgument,
          "a refused template is INVALID_ARGUMENT");
    return 0;
  }
  static const std::vector<kvcm::ChatMessage> kTurns = {
      {"system", "Be brief.", ""},
      {"user", "Hi! Ünïcödé 🙂", ""},
      {"assistant", "",
       R"({"tool_calls": [{"type": "function", "function": {"name": "f",)"
       R"( "arguments": {"x": 1}}}]})"},
      {"tool", "42", R"({"tool_call_id": "c1", "name": "f"})"},
      {"user", "And then?", ""}};
  static const std::vector<kvcm::ChatMessage> kOne = {{"user", "Hello", ""}};
  kvcm::ChatTemplateOptions options;
  options.bos_token = "<s>";
  options.eos_token = "</s>";
  options.max_steps = 200'000;
  options.max_output_bytes = 1 << 20;
  bool rendered = false;
  for (const auto* messages : {&kTurns, &kOne}) {
    options.add_generation_prompt = messages == &kTurns;
    absl::StatusOr<std::string> text = tmpl->Render(*messages, options);
    if (text.ok()) {
      Check(static_cast<int64_t>(text->size()) <= options.max_output_bytes,
            "the output stays within max_output_bytes");
      rendered = true;
    } else {
      Check(text.status().code() == absl::StatusCode::kInvalidArgument ||
                text.status().code() == absl::StatusCode::kResourceExhausted,
            "a refused render is INVALID_ARGUMENT or RESOURCE_EXHAUSTED");
    }
  }
  if (rendered) kvcm::fuzz::NoteAccepted();
  return 0;
}
