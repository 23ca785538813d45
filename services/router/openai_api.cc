#include "services/router/openai_api.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/base/utf8.h"
#include "common/chat/chat_template.h"
#include "nlohmann/json.hpp"
#include "services/router/api.h"
#include "services/router/http_requests.h"

namespace kvcm::router {
namespace {

using json = nlohmann::json;

// OpenAI's error type for a status.
const char* OpenAiErrorType(int status) {
  switch (status) {
    case 429:
      return "rate_limit_error";
    case 503:
      return "service_unavailable";
    case 500:
      return "server_error";
    default:
      return "invalid_request_error";
  }
}

std::string OpenAiFinishReason(const std::string& tgi) {
  return tgi == "length" ? "length" : "stop";
}

json OpenAiUsage(const Generation& g) {
  size_t completion = 0;
  for (const Choice& c : g.choices) completion += c.generated.size();
  return {{"prompt_tokens", g.prompt_tokens},
          {"completion_tokens", completion},
          {"total_tokens", g.prompt_tokens + completion},
          {"prompt_tokens_details", {{"cached_tokens", g.cached_prompt_tokens}}}};
}

json OpenAiChunk(const Generation& g, json choices, const std::string& model_id) {
  return {{"id", g.completion_id},
          {"object", !g.chat    ? "text_completion"
                     : g.stream ? "chat.completion.chunk"
                                : "chat.completion"},
          {"created", g.created},
          {"model", model_id},
          {"system_fingerprint", SystemFingerprint()},
          {"choices", std::move(choices)}};
}

// A choice: completions' {"text"}; chat's {"message"} in a reply and {"delta"} in a stream,
// both {"role", "content"} (TGI's TextMessage requires both, in every delta).
json OpenAiChoice(const Generation& g, size_t index, const std::string& text,
                  const json& finish_reason) {
  json choice = {{"index", index}, {"logprobs", nullptr}, {"finish_reason", finish_reason}};
  if (!g.chat) {
    choice["text"] = text;
  } else if (g.stream) {
    choice["delta"] = {{"role", "assistant"}, {"content", text}};
  } else {
    choice["message"] = {{"role", "assistant"}, {"content", text}};
  }
  return choice;
}

// Chat's logprobs of generated tokens [from, to): {"content": [{token, logprob, bytes,
// top_logprobs: [{token, logprob, bytes}]}]}.
json ChatLogprobs(const Tokenizer& tokenizer, const Choice& c, size_t from, size_t to) {
  auto entry = [&](int32_t id, float logprob) {
    const std::string text = TokenText(tokenizer, id);
    json bytes = json::array();
    for (unsigned char b : text) bytes.push_back(b);
    return json({{"token", OpenAiTokenText(id, text)},
                 {"logprob", NumberLogprob(logprob)},
                 {"bytes", bytes}});
  };
  json content = json::array();
  for (size_t i = from; i < to && i < c.generated.size(); ++i) {
    json e = entry(c.generated[i], i < c.logprobs.size() ? c.logprobs[i] : 0.0f);
    json top = json::array();
    if (i < c.top.size()) {
      for (const auto& [id, logprob] : c.top[i]) top.push_back(entry(id, logprob));
    }
    e["top_logprobs"] = std::move(top);
    content.push_back(std::move(e));
  }
  return {{"content", content}};
}

// OpenAI's completion logprobs, built a token at a time: tokens, token_logprobs,
// top_logprobs, text_offset.
struct CompletionLogprobs {
  const Tokenizer& tokenizer;
  size_t offset;
  json tokens = json::array(), token_logprobs = json::array(), top = json::array(),
       offsets = json::array();

  void Add(int32_t id, float logprob, const json& alternatives) {
    const std::string text = TokenText(tokenizer, id);
    tokens.push_back(OpenAiTokenText(id, text));
    token_logprobs.push_back(Logprob(logprob));
    top.push_back(alternatives);
    offsets.push_back(offset);
    offset += text.size();
  }
  // The echoed prompt's tokens (its first unscored). What follows starts after the prompt's
  // text as echoed, whatever its tokens decode to (a normalizer may have changed it), as the
  // stream's later chunks count it.
  void AddPrompt(const Generation& g) {
    const size_t start = offset;
    for (size_t i = 0; i < g.prompt.size(); ++i) {
      const float logprob = i < g.prompt_logprobs.size() ? g.prompt_logprobs[i]
                                                         : std::numeric_limits<float>::quiet_NaN();
      Add(g.prompt[i], logprob,
          std::isnan(logprob)
              ? json(nullptr)
              : json({{OpenAiTokenText(g.prompt[i], TokenText(tokenizer, g.prompt[i])),
                       NumberLogprob(logprob)}}));
    }
    offset = start + g.prompt_text.size();
  }
  // Generated tokens [from, to).
  void AddGenerated(const Choice& c, size_t from, size_t to) {
    for (size_t i = from; i < to && i < c.generated.size(); ++i) {
      json alternatives = json::object();
      if (i < c.top.size()) {
        for (const auto& [id, logprob] : c.top[i]) {
          alternatives[OpenAiTokenText(id, TokenText(tokenizer, id))] = NumberLogprob(logprob);
        }
      }
      Add(c.generated[i], i < c.logprobs.size() ? c.logprobs[i] : 0.0f, alternatives);
    }
  }
  json Json() const {
    return {{"tokens", tokens},
            {"token_logprobs", token_logprobs},
            {"top_logprobs", top},
            {"text_offset", offsets}};
  }
};

// The echoed prompt's first (its first token unscored), then generated tokens [from, to).
json OpenAiLogprobs(const Generation& g, const Choice& c, const Tokenizer& tokenizer,
                    bool with_prompt, size_t from, size_t to, size_t offset) {
  CompletionLogprobs logprobs{tokenizer, offset};
  if (with_prompt) logprobs.AddPrompt(g);
  logprobs.AddGenerated(c, from, to);
  return logprobs.Json();
}

// One shown choice of the unstreamed reply, `k`th.
json ReplyChoice(const Generation& g, size_t k, const Choice& c, const Tokenizer& tokenizer) {
  std::string text = TextOf(tokenizer, c);
  // OpenAI's text stops before the stop sequence (TGI's keeps it).
  if (c.finish_reason == "stop_sequence") text.resize(std::min(c.stop_at, text.size()));
  json choice = OpenAiChoice(g, k, g.params.return_full_text ? g.prompt_text + text : text,
                             OpenAiFinishReason(c.finish_reason));
  if (g.params.show_logprobs) {
    choice["logprobs"] = g.chat ? ChatLogprobs(tokenizer, c, 0, c.generated.size())
                                : OpenAiLogprobs(g, c, tokenizer, g.params.return_full_text, 0,
                                                 c.generated.size(), 0);
  }
  return choice;
}

}  // namespace

const std::string& SystemFingerprint() {
  static const std::string* const fingerprint =
      new std::string(absl::StrCat(kRouterName, "-", kRouterVersion));
  return *fingerprint;
}

json OpenAiErrorBody(const HttpError& error) {
  return {{"error",
           {{"message", error.message},
            {"type", OpenAiErrorType(error.status)},
            {"param", error.param.empty() ? json(nullptr) : json(error.param)},
            {"code", nullptr}}}};
}

int OpenAiErrorStatus(int status) { return status == 422 ? 400 : status; }

std::string OpenAiTokenText(int32_t id, const std::string& piece) {
  if (piece.empty()) return absl::StrCat("token_id:", id);
  if (IsValidUtf8(piece)) return piece;
  std::string out = "bytes:";
  for (unsigned char c : piece) absl::StrAppend(&out, "\\x", absl::Hex(c, absl::kZeroPad2));
  return out;
}

std::string OpenAiCompletionId(bool chat, uint64_t n) {
  return absl::StrCat(chat ? "chatcmpl-" : "cmpl-", n);
}

std::string OpenAiReply(const Generation& g, const Tokenizer& tokenizer,
                        const std::string& model_id) {
  json choices = json::array();
  const std::vector<size_t> shown = Shown(g);
  for (size_t k = 0; k < shown.size(); ++k) {
    choices.push_back(ReplyChoice(g, k, g.choices[shown[k]], tokenizer));
  }
  json body = OpenAiChunk(g, std::move(choices), model_id);
  body["usage"] = OpenAiUsage(g);
  return Dump(body);
}

std::string OpenAiRoleChunk(const Generation& g, size_t index, const std::string& model_id) {
  json choice = OpenAiChoice(g, index, "", nullptr);
  return Dump(OpenAiChunk(g, json::array({std::move(choice)}), model_id));
}

std::string OpenAiTokenChunk(const Generation& g, size_t index, bool finished,
                             const std::string& piece, const Tokenizer& tokenizer,
                             const std::string& model_id) {
  const Choice& c = g.choices[index];
  const bool first_chunk = c.generated.size() == 1;
  const std::string first = first_chunk && g.params.return_full_text ? g.prompt_text : "";
  json choice = OpenAiChoice(g, index, first + piece,
                             finished ? json(OpenAiFinishReason(c.finish_reason)) : json(nullptr));
  if (g.params.show_logprobs && g.chat) {
    choice["logprobs"] = ChatLogprobs(tokenizer, c, c.generated.size() - 1, c.generated.size());
  } else if (g.params.show_logprobs) {
    const size_t last = c.generated.size() - 1;
    const size_t offset = first_chunk ? 0
                                      : (g.params.return_full_text ? g.prompt_text.size() : 0) +
                                            c.text.size() - piece.size();
    choice["logprobs"] = OpenAiLogprobs(g, c, tokenizer, first_chunk && g.params.return_full_text,
                                        last, last + 1, offset);
  }
  return Dump(OpenAiChunk(g, json::array({std::move(choice)}), model_id));
}

std::string OpenAiUsageChunk(const Generation& g, const std::string& model_id) {
  json usage = OpenAiChunk(g, json::array(), model_id);
  usage["usage"] = OpenAiUsage(g);
  return Dump(usage);
}

namespace {
// The model served, as OpenAI's model object.
json ModelEntry(const std::string& model_id) {
  return {{"id", model_id}, {"object", "model"}, {"created", 0}, {"owned_by", "kvcm"}};
}
}  // namespace

std::string OpenAiModelList(const std::string& model_id) {
  return Dump({{"object", "list"}, {"data", json::array({ModelEntry(model_id)})}});
}

std::string OpenAiModel(const std::string& model_id) { return Dump(ModelEntry(model_id)); }

// ---- Request parsing (RequestParser's OpenAI members, http_requests.h) ------------------

namespace {

// A refusal of an OpenAI request, in OpenAI's shape, naming the offending parameter if one.
std::optional<HttpError> OpenAiRefusal(int status, std::string message, std::string param = "") {
  return HttpError{status, std::move(message), "validation", std::move(param), Api::kOpenAi};
}

// `body` as a JSON object into `root`, or the refusal of a body that is none or nests deeper
// than kMaxJsonDepth.
std::optional<HttpError> ParseOpenAiBody(std::string_view body, json* root) {
  *root = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (root->is_discarded() || !root->is_object()) {
    return OpenAiRefusal(400, "the body is not a JSON object");
  }
  if (NestedDeeperThan(*root, kMaxJsonDepth)) return OpenAiRefusal(422, TooDeepMessage());
  return std::nullopt;
}

}  // namespace

// The sampling and length parameters the OpenAI completions and chat completions APIs
// share: nullopt when `key` is one and `value` is fine (applied to `a`, or to `seed`), an
// error to answer when it is one and its value is wrong, and an error of status 0 when
// `key` is not one of them.
std::optional<HttpError> RequestParser::OpenAiParam(const std::string& key, const json& value,
                                                    GenerationRequest* active_request,
                                                    OpenAiGiven* given) const {
  GenerationRequest& a = *active_request;
  const bool chat = a.chat;
  if (key == "max_tokens" || (chat && key == "max_completion_tokens")) {
    if (!value.is_number_integer() || value.get<int64_t>() < 1 ||
        value.get<int64_t>() > options_.max_total_tokens) {
      return OpenAiRefusal(
          422,
          absl::StrCat("`", key, "` must be an integer in [1, ", options_.max_total_tokens, "]"),
          key);
    }
    // Both may be given; FinishOpenAiParams resolves them.
    (key == "max_tokens" ? given->max_tokens : given->max_completion_tokens) = value.get<int32_t>();
  } else if (key == "temperature") {
    if (!value.is_number() || value.get<double>() < 0 || value.get<double>() > 2) {
      return OpenAiRefusal(422, "`temperature` must be a number in [0, 2]", key);
    }
    a.params.sampling.temperature = value.get<float>();
  } else if (key == "top_p") {
    if (!value.is_number() || value.get<float>() <= 0 || value.get<double>() > 1) {
      return OpenAiRefusal(422, "`top_p` must be a number in (0, 1]", key);
    }
    a.params.sampling.top_p = value.get<float>();
  } else if (key == "seed") {
    if (!value.is_null()) {
      if (!value.is_number_unsigned()) {
        return OpenAiRefusal(422, "`seed` must be an unsigned integer", key);
      }
      given->seed = value.get<uint64_t>();
    }
  } else if (key == "stream") {
    if (!value.is_boolean()) return OpenAiRefusal(422, "`stream` must be a boolean", key);
    a.stream = value.get<bool>();
  } else if (key == "stream_options") {
    if (!value.is_null()) {
      if (!value.is_object()) return OpenAiRefusal(422, "`stream_options` must be an object", key);
      for (const auto& [option, flag] : value.items()) {
        if (option != "include_usage" || !flag.is_boolean()) {
          return OpenAiRefusal(
              422, absl::StrCat("stream_options_.", Shortened(option), " is not supported"), key);
        }
        a.include_usage = flag.get<bool>();
      }
    }
  } else if (key == "stop") {
    if (value.is_string()) {
      a.params.stop = {value.get<std::string>()};
    } else if (value.is_array() && value.size() <= 4 &&
               std::all_of(value.begin(), value.end(),
                           [](const json& x) { return x.is_string(); })) {
      for (const json& x : value) a.params.stop.push_back(x.get<std::string>());
    } else if (!value.is_null()) {
      return OpenAiRefusal(422, "`stop` must be a string or a list of at most 4 strings", key);
    }
    // TGI's rule (ParseParams): an empty stop string would match every text, and ignoring
    // it silently is what kvcm does not do with a parameter.
    if (std::any_of(a.params.stop.begin(), a.params.stop.end(),
                    [](const std::string& x) { return x.empty(); })) {
      return OpenAiRefusal(422, "`stop` must not hold an empty string", key);
    }
  } else if (key == "n" || key == "best_of") {
    if (!value.is_null()) {
      if (!value.is_number_integer() || value.get<int64_t>() < 1 ||
          value.get<int64_t>() > options_.max_best_of) {
        return OpenAiRefusal(422,
                             absl::StrCat("`", key, "` must be an integer in [1, ",
                                          options_.max_best_of, "] (--max-best-of)"),
                             key);
      }
      (key == "n" ? a.params.n : a.params.best_of) = value.get<int32_t>();
      if (key == "best_of") given->best_of = true;
    }
  } else if (key == "frequency_penalty" || key == "presence_penalty") {
    if (!value.is_null()) {
      if (!value.is_number() || value.get<double>() < -2 || value.get<double>() > 2) {
        return OpenAiRefusal(422, absl::StrCat("`", key, "` must be a number in [-2, 2]"), key);
      }
      (key == "frequency_penalty" ? a.params.sampling.frequency_penalty
                                  : a.params.sampling.presence_penalty) = value.get<float>();
    }
  } else {
    return OpenAiExtensionParam(key, value, active_request);
  }
  return std::nullopt;
}

// vLLM's extensions of OpenAI's parameters (repetition_penalty, top_k, ignore_eos,
// min_tokens) and those read but unused (model, user), as OpenAiParam answers: an error of
// status 0 when `key` is none of them.
std::optional<HttpError> RequestParser::OpenAiExtensionParam(
    const std::string& key, const json& value, GenerationRequest* active_request) const {
  GenerationRequest& a = *active_request;
  if (key == "repetition_penalty") {
    if (!value.is_null()) {
      if (!value.is_number() || value.get<float>() <= 0 || value.get<double>() > 100) {
        return OpenAiRefusal(422, "`repetition_penalty` must be a number in (0, 100]", key);
      }
      a.params.sampling.repetition_penalty = value.get<float>();
    }
  } else if (key == "top_k") {  // vLLM's extension; -1 or 0: all tokens
    if (!value.is_null()) {
      if (!value.is_number_integer() || value.get<int64_t>() < -1 ||
          value.get<int64_t>() > (1 << 20)) {
        return OpenAiRefusal(422, "`top_k` must be an integer >= -1 (-1: all tokens)", key);
      }
      a.params.sampling.top_k = std::max<int32_t>(0, value.get<int32_t>());
    }
  } else if (key == "ignore_eos") {
    // vLLM's extension: the EOS ids leave the request's stop set (RouterCore's
    // Submission::ignore_eos), nothing else does: stop strings still end it, and an EOS
    // generated is an ordinary token, which the tokenizer decodes to no text (vLLM's
    // skip_special_tokens default).
    if (!value.is_null()) {
      if (!value.is_boolean()) return OpenAiRefusal(422, "`ignore_eos` must be a boolean", key);
      a.params.ignore_eos = value.get<bool>();
    }
  } else if (key == "min_tokens") {  // vLLM's extension; checked against max_tokens at the end
    if (!value.is_null()) {
      if (!value.is_number_integer() || value.get<int64_t>() < 0 ||
          value.get<int64_t>() > options_.max_total_tokens) {
        return OpenAiRefusal(
            422,
            absl::StrCat("`min_tokens` must be an integer in [0, ", options_.max_total_tokens, "]"),
            key);
      }
      a.params.sampling.min_tokens = value.get<int32_t>();
    }
  } else if (key == "model" || key == "user") {
    if (!value.is_string() && !value.is_null()) return OpenAiRefusal(422, "must be a string", key);
  } else {
    return HttpError{0, "", "", "", Api::kOpenAi};
  }
  return std::nullopt;
}

// The length, sampling as OpenAI's parameters chose it (temperature 0, or below
// kGreedyBelowTemperature: greedy), n and best_of.
std::optional<HttpError> RequestParser::FinishOpenAiParams(GenerationRequest* active_request,
                                                           const OpenAiGiven& given) {
  GenerationRequest& a = *active_request;
  // Chat's max_completion_tokens replaced max_tokens, and wins over it (as OpenAI's and
  // vLLM's servers take it).
  if (given.max_completion_tokens.has_value()) {
    a.params.max_new_tokens = *given.max_completion_tokens;
  } else if (given.max_tokens.has_value()) {
    a.params.max_new_tokens = *given.max_tokens;
  }
  // vLLM's rule: min_tokens at most max_tokens (whichever of the two names gave it). The
  // executors hold EOS back (its logit -inf) until min_tokens tokens are out, as vLLM does.
  const int32_t min_tokens = a.params.sampling.min_tokens;
  if (min_tokens > a.params.max_new_tokens) {
    return HttpError{422,
                     absl::StrCat("`min_tokens` must be at most `",
                                  given.max_completion_tokens.has_value() ? "max_completion_tokens"
                                                                          : "max_tokens",
                                  "` (", a.params.max_new_tokens, "), got ", min_tokens),
                     "validation", "min_tokens", Api::kOpenAi};
  }
  if (a.params.sampling.temperature >= kGreedyBelowTemperature) {
    a.params.do_sample = true;
    a.params.seed = given.seed.value_or(next_seed_++);
    a.params.sampling.seed = a.params.seed;
  } else {
    a.params.sampling = Greedy(a.params.sampling);
  }
  // best_of given is at least n (1 included: n = 2 with best_of = 1 is no request).
  if (given.best_of && a.params.best_of < a.params.n) {
    return HttpError{422, "`best_of` must be at least `n`", "validation", "best_of", Api::kOpenAi};
  }
  const int32_t sequences = std::max(a.params.n, a.params.best_of);
  if (sequences > a.params.n && a.stream) {
    return HttpError{422, "`best_of` > `n` is not supported when streaming", "validation",
                     "best_of", Api::kOpenAi};
  }
  a.params.outputs.sequences = sequences;
  a.shown = a.params.n;
  // best_of ranks its sequences by their log-probabilities.
  a.params.outputs.logprobs = a.params.show_logprobs || sequences > a.params.n;
  return std::nullopt;
}

// POST /v1/completions (OpenAI): one prompt (a string, or token ids), one choice.
std::optional<HttpError> RequestParser::ParseCompletions(std::string_view body,
                                                         GenerationRequest* out) {
  json root;
  if (std::optional<HttpError> bad = ParseOpenAiBody(body, &root)) return bad;
  *out = GenerationRequest();
  GenerationRequest& a = *out;
  a.api = Api::kOpenAi;
  a.params.max_new_tokens = 16;  // OpenAI's default
  a.params.sampling.temperature = 1.0f;
  std::vector<int32_t> prompt;
  bool have_prompt = false;
  OpenAiGiven given;
  for (const auto& [key, value] : root.items()) {
    if (key == "prompt") {
      json one = value;
      if (value.is_array() && value.size() == 1 && (value[0].is_string() || value[0].is_array())) {
        one = value[0];
      }
      if (one.is_string()) {
        absl::StatusOr<std::vector<int32_t>> ids = PromptOf(one.get<std::string>());
        if (!ids.ok()) return OpenAiRefusal(422, std::string(ids.status().message()), "prompt");
        if (ids->empty()) return OpenAiRefusal(422, NoPromptTokensMessage("prompt"), "prompt");
        prompt = *std::move(ids);
        a.prompt_text = one.get<std::string>();
      } else if (one.is_array() && !one.empty() &&
                 std::all_of(one.begin(), one.end(),
                             [](const json& t) { return t.is_number_integer(); })) {
        for (const json& t : one) {
          const int64_t id = t.get<int64_t>();
          if (id < 0 || id >= tokenizer_->vocab_size()) {
            return OpenAiRefusal(
                422,
                absl::StrCat("token id ", id, " is outside [0, ", tokenizer_->vocab_size(), ")"),
                "prompt");
          }
          prompt.push_back(static_cast<int32_t>(id));
        }
        absl::StatusOr<std::string> text = tokenizer_->Decode(prompt);
        a.prompt_text = text.ok() ? *text : "";
      } else {
        return OpenAiRefusal(422,
                             "`prompt` must be a string, a list of token ids, or a list of one "
                             "of those (several prompts in one request are not supported)",
                             "prompt");
      }
      have_prompt = true;
    } else if (std::optional<HttpError> bad = OpenAiParam(key, value, &a, &given);
               !bad.has_value()) {
    } else if (bad->status != 0) {
      return bad;
    } else if (key == "echo") {
      if (!value.is_boolean()) return OpenAiRefusal(422, "`echo` must be a boolean", key);
      a.params.return_full_text = value.get<bool>();
    } else if (key == "logprobs") {
      if (!value.is_null()) {
        if (!value.is_number_integer() || value.get<int64_t>() < 0 ||
            value.get<int64_t>() > options_.max_top_n_tokens) {
          return OpenAiRefusal(
              422,
              absl::StrCat("`logprobs` must be an integer in [0, ", options_.max_top_n_tokens, "]"),
              key);
        }
        a.params.show_logprobs = true;
        a.params.outputs.top_n = value.get<int32_t>();
      }
    } else if ((key == "suffix" || key == "logit_bias") && value.is_null()) {
    } else {
      return OpenAiRefusal(422, UnsupportedParameterMessage(key, value), Shortened(key));
    }
  }
  if (!have_prompt) return OpenAiRefusal(422, "`prompt` is required", "prompt");
  if (std::optional<HttpError> bad = FinishOpenAiParams(&a, given)) return bad;
  // With echo, the prompt's tokens come first in logprobs, scored.
  a.params.outputs.prompt_logprobs = a.params.show_logprobs && a.params.return_full_text;
  a.prompt = std::move(prompt);
  return std::nullopt;
}

namespace {

// OpenAI's chat `messages` as the chat template takes them: each an object with a string
// `role`; its `content` a string or a list of text parts (joined as vLLM joins them), or
// null; its other members kept for the template (tool calls, names).
std::optional<HttpError> ParseChatMessages(const json& value, std::vector<ChatMessage>* out) {
  const std::string key = "messages";
  std::vector<ChatMessage>& messages = *out;
  if (!value.is_array() || value.empty()) {
    return OpenAiRefusal(422, "`messages` must be a non-empty list of messages", key);
  }
  for (size_t i = 0; i < value.size(); ++i) {
    const json& m = value[i];
    const std::string where = absl::StrCat("messages[", i, "]");
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string()) {
      return OpenAiRefusal(422, absl::StrCat(where, " must be an object with a string `role`"),
                           key);
    }
    ChatMessage message;
    message.role = m["role"].get<std::string>();
    json extra = json::object();
    for (const auto& [field, content] : m.items()) {
      if (field == "role") continue;
      if (field != "content") {
        if (!content.is_null()) extra[field] = content;
        continue;
      }
      if (content.is_string()) {
        message.content = content.get<std::string>();
      } else if (content.is_array()) {
        // Content parts: only text ones, joined as vLLM joins them.
        for (const json& part : content) {
          // Not part.value("type", ""): it throws when "type" is there and no string.
          if (!part.is_object() || !part.contains("type") || part["type"] != "text" ||
              !part.contains("text") || !part["text"].is_string()) {
            return OpenAiRefusal(422,
                                 absl::StrCat(where,
                                              ".content: only parts of type \"text\" "
                                              "are supported"),
                                 key);
          }
          if (!message.content.empty()) message.content += "\n";
          message.content += part["text"].get<std::string>();
        }
      } else if (!content.is_null()) {
        return OpenAiRefusal(422,
                             absl::StrCat(where,
                                          ".content must be a string or a list of "
                                          "text parts"),
                             key);
      }
    }
    if (!extra.empty()) message.extra_json = extra.dump();
    messages.push_back(std::move(message));
  }
  return std::nullopt;
}

}  // namespace

// POST /v1/chat/completions (OpenAI): `messages` rendered with the model's chat template
// (add_generation_prompt), tokenized as transformers' apply_chat_template(tokenize=True)
// does (no BOS added: the template writes what the model wants).
std::optional<HttpError> RequestParser::ParseChatCompletions(std::string_view body,
                                                             GenerationRequest* out) {
  if (options_.chat_template == nullptr) {
    return OpenAiRefusal(501,
                         "this model has no usable chat template: start the router with "
                         "--chat-template FILE, or use /v1/completions");
  }
  json root;
  if (std::optional<HttpError> bad = ParseOpenAiBody(body, &root)) return bad;
  *out = GenerationRequest();
  GenerationRequest& a = *out;
  a.api = Api::kOpenAi;
  a.chat = true;
  a.params.max_new_tokens = options_.default_max_new_tokens;
  a.params.sampling.temperature = 1.0f;
  std::vector<ChatMessage> messages;
  bool have_messages = false;
  OpenAiGiven given;
  for (const auto& [key, value] : root.items()) {
    if (key == "messages") {
      if (std::optional<HttpError> bad = ParseChatMessages(value, &messages)) return bad;
      have_messages = true;
    } else if (std::optional<HttpError> bad = OpenAiParam(key, value, &a, &given);
               !bad.has_value()) {
    } else if (bad->status != 0) {
      return bad;
    } else if (key == "logprobs") {
      if (!value.is_null()) {
        if (!value.is_boolean()) return OpenAiRefusal(422, "`logprobs` must be a boolean", key);
        a.params.show_logprobs = value.get<bool>();
      }
    } else if (key == "top_logprobs") {
      if (!value.is_null()) {
        if (!value.is_number_integer() || value.get<int64_t>() < 0 ||
            value.get<int64_t>() > options_.max_top_n_tokens) {
          return OpenAiRefusal(422,
                               absl::StrCat("`top_logprobs` must be an integer in [0, ",
                                            options_.max_top_n_tokens, "]"),
                               key);
        }
        a.params.outputs.top_n = value.get<int32_t>();
      }
    } else if ((key == "logit_bias" || key == "tools" || key == "tool_choice" ||
                key == "response_format" || key == "parallel_tool_calls") &&
               value.is_null()) {
    } else {
      return OpenAiRefusal(422, UnsupportedParameterMessage(key, value), Shortened(key));
    }
  }
  if (!have_messages) return OpenAiRefusal(422, "`messages` is required", "messages");
  if (a.params.outputs.top_n > 0 && !a.params.show_logprobs) {
    return OpenAiRefusal(422, "`top_logprobs` needs `logprobs`: true", "top_logprobs");
  }
  if (!a.params.show_logprobs) a.params.outputs.top_n = 0;
  if (std::optional<HttpError> bad = FinishOpenAiParams(&a, given)) return bad;
  ChatTemplateOptions render;
  render.add_generation_prompt = true;
  render.bos_token = options_.bos_token;
  render.eos_token = options_.eos_token;
  absl::StatusOr<std::string> text = options_.chat_template->Render(messages, render);
  if (!text.ok()) {
    // The template's own raise_exception (roles out of order, ...) is the client's error.
    // Its message is the template author's, but may quote a message's content: shortened.
    return OpenAiRefusal(400,
                         absl::StrCat("the chat template refused the messages: ",
                                      Shortened(text.status().message(), kMaxTemplateMessageBytes)),
                         "messages");
  }
  absl::StatusOr<std::vector<int32_t>> prompt = tokenizer_->Encode(*text);
  if (!prompt.ok()) return OpenAiRefusal(422, std::string(prompt.status().message()), "messages");
  if (prompt->empty()) return OpenAiRefusal(422, "the chat template rendered nothing", "messages");
  a.prompt_text = *std::move(text);
  a.prompt = *std::move(prompt);
  return std::nullopt;
}

}  // namespace kvcm::router
