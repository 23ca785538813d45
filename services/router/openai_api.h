#pragma once
// The OpenAI-compatible API's replies (docs/router.md, "HTTP API (OpenAI-compatible)"),
// formatted from plain values: no sockets, no libevent, so each can be tested and fuzzed on
// its own. The front end (http_frontend.h) sends what these return. Request bodies are
// parsed by RequestParser (http_requests.h), whose OpenAI members (ParseCompletions,
// ParseChatCompletions) are defined in openai_api.cc.
//
//   POST /v1/completions, /v1/chat/completions  a completion (OpenAiReply); streamed,
//        chunks after kOpenAiEventField: chat's first one per choice naming the role
//        (OpenAiRoleChunk), one per token (OpenAiTokenChunk), the usage chunk with
//        stream_options.include_usage (OpenAiUsageChunk), then kOpenAiDone
//   GET  /v1/models, /v1/models/{model}         the model served (OpenAiModelList,
//        OpenAiModel)
//
// Errors: {"error": {"message", "type", "param", "code"}} (OpenAiErrorBody), with 400 where
// TGI answers 422 (OpenAiErrorStatus).
//
// Thread safety: pure functions; `tokenizer` is only read.

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "common/tokenizer/tokenizer.h"
#include "nlohmann/json_fwd.hpp"
#include "services/router/generation.h"

namespace kvcm::router {

// How OpenAI writes a server-sent event's field: "data: ", a space after the colon; and its
// stream's last event.
inline constexpr std::string_view kOpenAiEventField = "data: ";
inline constexpr std::string_view kOpenAiDone = "[DONE]";

// OpenAI's system_fingerprint (TGI's "{version}-{label}"): the router and its version,
// "kvcm-router-0.1.0", the same for every response of one build.
const std::string& SystemFingerprint();

// OpenAI's error shape, and the status it is answered with: 400 for TGI's 422 (invalid
// requests), any other as it is.
nlohmann::json OpenAiErrorBody(const HttpError& error);
int OpenAiErrorStatus(int status);

// A token's text as OpenAI's completions logprobs show it: the text; for a piece that is not
// UTF-8 on its own (part of a character), "bytes:\xNN..." as OpenAI writes those; for one
// that decodes to nothing (a special token), "token_id:N" as vLLM writes token ids. So no two
// tokens share a key of top_logprobs.
std::string OpenAiTokenText(int32_t id, const std::string& piece);

// "cmpl-N" or "chatcmpl-N".
std::string OpenAiCompletionId(bool chat, uint64_t n);

// The unstreamed reply once every choice is done: the shown choices (Shown), each with its
// text (stopping before a stop sequence; the prompt first with echo) and logprobs if asked,
// and usage.
std::string OpenAiReply(const Generation& g, const Tokenizer& tokenizer,
                        const std::string& model_id);
// A chat stream's first chunk of choice `index`: the role, no content.
std::string OpenAiRoleChunk(const Generation& g, size_t index, const std::string& model_id);
// The chunk of choice `index`'s newest token (already in its `generated`; its text `piece`
// already added to its `text`); `finished`: with the finish reason.
std::string OpenAiTokenChunk(const Generation& g, size_t index, bool finished,
                             const std::string& piece, const Tokenizer& tokenizer,
                             const std::string& model_id);
// The stream's usage chunk (stream_options.include_usage): no choices.
std::string OpenAiUsageChunk(const Generation& g, const std::string& model_id);

// GET /v1/models (a list of the one model served) and the entry of /v1/models/{model}.
std::string OpenAiModelList(const std::string& model_id);
std::string OpenAiModel(const std::string& model_id);

}  // namespace kvcm::router
