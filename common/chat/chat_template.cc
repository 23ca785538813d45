#include "common/chat/chat_template.h"

#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/base/status_macros.h"
#include "common/chat/jinja_interpreter.h"
#include "common/chat/jinja_parser.h"
#include "common/chat/jinja_value.h"

namespace kvcm {

struct ChatTemplate::Parsed {
  std::string source;
  jinja::Body body;
};

namespace {

// A JSON object's members; INVALID_ARGUMENT naming `what` otherwise.
absl::StatusOr<jinja::Dict> JsonObject(const std::string& json, const std::string& what) {
  if (json.empty()) return jinja::Dict{};
  absl::StatusOr<jinja::Value> v = jinja::FromJson(json);
  if (!v.ok() || !v->is_dict()) {
    return absl::InvalidArgumentError(absl::StrCat(what, " is not a JSON object"));
  }
  return v->as_dict();
}

// What transformers' _alias_reasoning_fields does: a message with reasoning_content,
// thinking or reasoning gets the first of them as both `thinking` (first) and
// `reasoning_content` (last).
jinja::Dict AliasReasoning(jinja::Dict message) {
  const jinja::Value* reasoning = nullptr;
  for (const char* key : {"reasoning_content", "thinking", "reasoning"}) {
    const jinja::Value* v = message.Find(std::string_view(key));
    if (v != nullptr && !v->is_none()) {
      reasoning = v;
      break;
    }
  }
  if (reasoning == nullptr) return message;
  const jinja::Value r = *reasoning;
  jinja::Dict out;
  out.Set(jinja::Value::String("thinking"), r);
  for (auto& [k, v] : message.items) out.Set(k, v);
  out.Set(jinja::Value::String("reasoning_content"), r);
  return out;
}

}  // namespace

absl::StatusOr<ChatTemplate> ChatTemplate::Parse(std::string_view source) {
  auto parsed = std::make_shared<Parsed>();
  parsed->source = std::string(source);
  KVCM_ASSIGN_OR_RETURN(parsed->body, jinja::ParseTemplate(source));
  return ChatTemplate(std::move(parsed));
}

const std::string& ChatTemplate::source() const { return parsed_->source; }

absl::StatusOr<std::string> ChatTemplate::Render(std::span<const ChatMessage> messages,
                                                 const ChatTemplateOptions& options) const {
  std::vector<jinja::Value> list;
  list.reserve(messages.size());
  for (size_t i = 0; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    jinja::Dict message;
    message.Set(jinja::Value::String("role"), jinja::Value::String(m.role));
    message.Set(jinja::Value::String("content"), jinja::Value::String(m.content));
    KVCM_ASSIGN_OR_RETURN(jinja::Dict extra,
                          JsonObject(m.extra_json, absl::StrCat("messages[", i, "].extra_json")));
    for (auto& [k, v] : extra.items) {
      if (!v.is_none()) message.Set(k, v);
    }
    list.push_back(jinja::Value::MakeDict(AliasReasoning(std::move(message))));
  }
  jinja::Dict context;
  context.Set(jinja::Value::String("messages"), jinja::Value::MakeList(std::move(list)));
  context.Set(jinja::Value::String("tools"), jinja::Value::None());
  context.Set(jinja::Value::String("documents"), jinja::Value::None());
  context.Set(jinja::Value::String("add_generation_prompt"),
              jinja::Value::Bool(options.add_generation_prompt));
  context.Set(jinja::Value::String("bos_token"), jinja::Value::String(options.bos_token));
  context.Set(jinja::Value::String("eos_token"), jinja::Value::String(options.eos_token));
  KVCM_ASSIGN_OR_RETURN(jinja::Dict extra,
                        JsonObject(options.extra_context_json, "extra_context_json"));
  for (auto& [k, v] : extra.items) context.Set(k, v);

  jinja::RenderLimits limits;
  limits.max_output_bytes = options.max_output_bytes;
  limits.max_steps = options.max_steps;
  limits.max_call_depth = options.max_call_depth;
  jinja::Interpreter interpreter(limits, std::move(context));
  return interpreter.Render(parsed_->body);
}

}  // namespace kvcm
