#pragma once
// ChatTemplate: a model's Jinja chat template (GGUF `tokenizer.chat_template`, or
// tokenizer_config.json's `chat_template`) rendered over a conversation exactly as Hugging
// Face transformers' apply_chat_template(messages, add_generation_prompt=...,
// tokenize=False) renders it. An interpreter of the Jinja subset chat templates use (lexer,
// parser, evaluator in common/chat/jinja_*.h), not a recogniser of template families;
// docs/chat-templates.md lists what is supported.
//
//   KVCM_ASSIGN_OR_RETURN(ChatTemplate tmpl, ChatTemplate::Parse(source));
//   std::vector<ChatMessage> messages = {{"system", "Be brief."}, {"user", "Hi"}};
//   KVCM_ASSIGN_OR_RETURN(std::string prompt, tmpl.Render(messages, options));
//
// The template sees what transformers gives it: `messages` (a list of dicts with role,
// content and the members of ChatMessage::extra_json), `add_generation_prompt`, `bos_token`,
// `eos_token`, `tools` and `documents` (none unless extra_context_json sets them), the
// members of extra_context_json, and the globals raise_exception, strftime_now (local time),
// namespace, dict and range.
//
// Errors (never a crash, whatever the template or the messages):
//   Parse   INVALID_ARGUMENT "chat template LINE:COLUMN: ..." for a syntax error, and for a
//           construct outside the subset (an unknown filter, test or tag) with the way out:
//           pass `--chat-template FILE` (a template file the router uses instead).
//   Render  INVALID_ARGUMENT carrying exactly the message of the template's
//           raise_exception(msg) (the router answers 400 with it); INVALID_ARGUMENT
//           "chat template LINE:COLUMN: ..." for what Jinja would raise (an attribute of an
//           undefined value, a type error) or an unsupported method; INVALID_ARGUMENT naming
//           the message when an extra_json is not a JSON object; RESOURCE_EXHAUSTED when a
//           limit of ChatTemplateOptions is reached (a runaway loop, a huge output).
//
// Thread safety: a parsed ChatTemplate is immutable; Render is const and may be called
// concurrently from any number of threads. Copies share the parsed tree.

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace kvcm {

struct ChatMessage {
  std::string role;
  std::string content;
  // Further members of the message as a JSON object (tool_calls, tool_call_id, name,
  // reasoning_content, ...); "" for none. Members whose value is null are dropped, as
  // apply_chat_template drops them.
  std::string extra_json;
};

struct ChatTemplateOptions {
  bool add_generation_prompt = true;
  std::string bos_token;
  std::string eos_token;
  // Further template variables as a JSON object ({"tools": [...], "date_string": "..."});
  // "" for none.
  std::string extra_context_json;
  // Limits, so a hostile template cannot hang the caller or exhaust its memory.
  int64_t max_output_bytes = 16 << 20;  // the output and any string the template builds
  int64_t max_steps = 20'000'000;       // statements, expressions and loop iterations
  int max_call_depth = 64;              // nested macro calls
};

class ChatTemplate {
 public:
  // Errors: INVALID_ARGUMENT as above.
  static absl::StatusOr<ChatTemplate> Parse(std::string_view source);

  absl::StatusOr<std::string> Render(std::span<const ChatMessage> messages,
                                     const ChatTemplateOptions& options) const;

  const std::string& source() const;

  struct Parsed;  // the tree (common/chat/jinja_parser.h)

 private:
  explicit ChatTemplate(std::shared_ptr<const Parsed> parsed) : parsed_(std::move(parsed)) {}
  std::shared_ptr<const Parsed> parsed_;
};

}  // namespace kvcm
