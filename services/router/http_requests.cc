#include "services/router/http_requests.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/chat/chat_template.h"
#include "nlohmann/json.hpp"

namespace kvcm::router {
namespace {

using json = nlohmann::json;

// JSON text; bytes that are not UTF-8 become U+FFFD (as in http_frontend.cc).
std::string Dump(const json& value) {
  return value.dump(-1, ' ', false, json::error_handler_t::replace);
}

// "parameter `key` is not supported by this server (value)", both shortened.
std::string Unsupported(absl::string_view key, const json& value) {
  return absl::StrCat("parameter `", Shortened(key), "` is not supported by this server (",
                      Shortened(Dump(value)), ")");
}

std::string TooDeep() {
  return absl::StrCat("the body nests arrays and objects deeper than ", kMaxJsonDepth,
                      " levels");
}

// A prompt of no tokens cannot be run (a sequence computes at least its last prompt token;
// the planner checks it): an empty text, or one the tokenizer drops whole, for a model that
// adds no BOS.
std::string NoPromptTokens(absl::string_view field) {
  return absl::StrCat("`", field, "` cannot be empty: it gives no tokens, and this model adds "
                      "no BOS token to a prompt");
}

}  // namespace

std::string Shortened(absl::string_view text, size_t max_bytes) {
  if (text.size() <= max_bytes) return std::string(text);
  size_t cut = max_bytes;
  while (cut > 0 && (static_cast<unsigned char>(text[cut]) & 0xC0) == 0x80) --cut;
  return absl::StrCat(text.substr(0, cut), "...");
}

bool NestedDeeperThan(const json& value, int max_depth) {
  if (!value.is_structured()) return false;
  // Depth first with a stack of our own: a body of 500,000 levels must not recurse here
  // either.
  std::vector<std::pair<const json*, int>> pending = {{&value, 1}};
  while (!pending.empty()) {
    const auto [node, depth] = pending.back();
    pending.pop_back();
    if (depth > max_depth) return true;
    for (const json& child : *node) {
      if (child.is_structured()) pending.emplace_back(&child, depth + 1);
    }
  }
  return false;
}

std::optional<HttpError> RequestParser::ParseParams(const json& root, Params* params) {
  params->max_new_tokens = options_.default_max_new_tokens;
  if (!root.contains("parameters") || root["parameters"].is_null()) return std::nullopt;
  const json& p = root["parameters"];
  if (!p.is_object()) return HttpError{422, "`parameters` must be an object"};
  for (const auto& item : p.items()) {
    // Named, not a structured binding: the lambdas below capture them, which Clang 14
    // does not allow for bindings.
    const std::string& key = item.key();
    const json& value = item.value();
    if (value.is_null()) continue;
    auto want_int = [&](int64_t lo, int64_t hi) -> std::optional<HttpError> {
      if (!value.is_number_integer() || value.get<int64_t>() < lo || value.get<int64_t>() > hi) {
        return HttpError{422,
                         absl::StrCat("`", key, "` must be an integer in [", lo, ", ", hi, "]")};
      }
      return std::nullopt;
    };
    auto want_float = [&](double lo, double hi, bool open_lo) -> std::optional<HttpError> {
      if (!value.is_number() || value.get<double>() > hi ||
          // An open bound is checked on the float the executors get: 1e-50 > 0 is 0.0f.
          (open_lo ? value.get<float>() <= lo : value.get<double>() < lo)) {
        return HttpError{422, absl::StrCat("`", key, "` must be a number in ", open_lo ? "(" : "[",
                                           lo, ", ", hi, "]")};
      }
      return std::nullopt;
    };
    std::optional<HttpError> bad;
    if (key == "max_new_tokens") {
      if (!(bad = want_int(1, options_.max_total_tokens))) {
        params->max_new_tokens = value.get<int32_t>();
      }
    } else if (key == "do_sample") {
      if (!value.is_boolean())
        bad = HttpError{422, "`do_sample` must be a boolean"};
      else
        params->do_sample = value.get<bool>();
    } else if (key == "temperature") {
      if (!(bad = want_float(0, 100, true))) params->sampling.temperature = value.get<float>();
    } else if (key == "top_p") {
      if (!(bad = want_float(0, 1, true))) params->sampling.top_p = value.get<float>();
    } else if (key == "top_k") {
      if (!(bad = want_int(1, 1 << 20))) params->sampling.top_k = value.get<int32_t>();
    } else if (key == "seed") {
      if (!value.is_number_unsigned())
        bad = HttpError{422, "`seed` must be an unsigned integer"};
      else
        params->seed = value.get<uint64_t>();
    } else if (key == "details") {
      if (!value.is_boolean())
        bad = HttpError{422, "`details` must be a boolean"};
      else
        params->details = value.get<bool>();
    } else if (key == "return_full_text") {
      if (!value.is_boolean())
        bad = HttpError{422, "`return_full_text` must be a boolean"};
      else
        params->return_full_text = value.get<bool>();
    } else if (key == "repetition_penalty") {
      if (!(bad = want_float(0, 100, true))) {
        params->sampling.repetition_penalty = value.get<float>();
      }
    } else if (key == "frequency_penalty") {
      if (!(bad = want_float(-2, 2, false))) {
        params->sampling.frequency_penalty = value.get<float>();
      }
    } else if (key == "top_n_tokens") {
      if (!(bad = want_int(0, options_.max_top_n_tokens))) {
        params->outputs.top_n = value.get<int32_t>();
      }
    } else if (key == "decoder_input_details") {
      if (!value.is_boolean())
        bad = HttpError{422, "`decoder_input_details` must be a boolean"};
      else
        params->outputs.prompt_logprobs = value.get<bool>();
    } else if (key == "truncate") {
      if (!(bad = want_int(1, options_.max_input_tokens))) params->truncate = value.get<int32_t>();
    } else if (key == "best_of") {
      if (!(bad = want_int(1, options_.max_best_of))) params->best_of = value.get<int32_t>();
    } else if (key == "watermark" && value.is_boolean() && !value.get<bool>()) {
    } else if (key == "stop") {
      if (!value.is_array() || value.size() > 4) {
        bad = HttpError{422, "`stop` must be a list of at most 4 strings"};
      } else {
        for (const json& sequence : value) {
          if (!sequence.is_string() || sequence.get<std::string>().empty()) {
            bad = HttpError{422, "`stop` must be a list of non-empty strings"};
            break;
          }
          params->stop.push_back(sequence.get<std::string>());
        }
      }
    } else {
      // Never ignored silently: kvcm does not do this yet (or not with this value).
      bad = HttpError{422, Unsupported(key, value)};
    }
    if (bad) return bad;
  }
  if (params->best_of > 1 && !params->do_sample) {
    return HttpError{422,
                     "`best_of` > 1 needs sampling: set `do_sample` (greedy answers "
                     "would all be the same)"};
  }
  if (params->best_of > 1 && p.contains("seed") && !p["seed"].is_null()) {
    return HttpError{422,
                     "`seed` must not be set when `best_of` > 1 (each sequence gets its "
                     "own, reported in details)"};
  }
  // A temperature too small to divide by samples as greedy (kGreedyBelowTemperature).
  if (params->do_sample && params->sampling.temperature != 0.0f &&
      params->sampling.temperature < kGreedyBelowTemperature) {
    params->do_sample = false;
  }
  if (params->do_sample) {
    if (params->sampling.temperature == 0.0f) params->sampling.temperature = 1.0f;
    params->sampling.seed = p.contains("seed") && !p["seed"].is_null() ? params->seed : next_seed_;
    // The request's sequences sample with seed, seed + 1, ...
    next_seed_ += static_cast<uint64_t>(params->best_of);
    params->seed = params->sampling.seed;
  } else {
    params->sampling = Greedy(params->sampling);
  }
  return std::nullopt;
}

// Greedy sampling that keeps `sampling`'s penalties and min_tokens (they apply to greedy
// choices too).
SeqSampling RequestParser::Greedy(const SeqSampling& sampling) {
  SeqSampling greedy;
  greedy.repetition_penalty = sampling.repetition_penalty;
  greedy.frequency_penalty = sampling.frequency_penalty;
  greedy.presence_penalty = sampling.presence_penalty;
  greedy.min_tokens = sampling.min_tokens;
  return greedy;
}

std::optional<HttpError> RequestParser::ParseGenerate(std::string_view body,
                                                      std::optional<bool> stream_path,
                                                      GenerationRequest* out) {
  const json root = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded() || !root.is_object()) {
    return HttpError{400, "the body is not a JSON object", "validation"};
  }
  if (NestedDeeperThan(root, kMaxJsonDepth)) return HttpError{422, TooDeep()};
  if (!root.contains("inputs") || !root["inputs"].is_string()) {
    return HttpError{422, "`inputs` must be a string"};
  }
  bool stream = stream_path.value_or(false);
  if (!stream_path.has_value() && root.contains("stream")) {
    if (!root["stream"].is_boolean()) return HttpError{422, "`stream` must be a boolean"};
    stream = root["stream"].get<bool>();
  }
  Params params;
  if (auto bad = ParseParams(root, &params)) return bad;
  if (stream && params.outputs.prompt_logprobs) {
    return HttpError{422,
                     "`decoder_input_details` == true is not supported when "
                     "streaming tokens"};
  }
  if (stream && params.best_of > 1) {
    return HttpError{422, "`best_of` > 1 is not supported when streaming tokens"};
  }
  // TGI reports every token's log-probability in details and in each streamed token;
  // best_of ranks its sequences by them.
  params.outputs.logprobs = params.details || stream || params.best_of > 1;
  params.outputs.sequences = params.best_of;
  const std::string text = root["inputs"].get<std::string>();
  absl::StatusOr<std::vector<int32_t>> prompt = PromptOf(text);
  if (!prompt.ok()) return HttpError{422, std::string(prompt.status().message())};
  if (prompt->empty()) return HttpError{422, NoPromptTokens("inputs")};
  if (params.truncate > 0 && prompt->size() > static_cast<size_t>(params.truncate)) {
    prompt->erase(prompt->begin(), prompt->end() - params.truncate);  // keeps the last ones
  }
  *out = GenerationRequest();
  out->stream = stream;
  out->as_list = !stream_path.has_value() && !stream;
  out->params = params;
  out->prompt_text = text;
  out->prompt = *std::move(prompt);
  return std::nullopt;
}

std::optional<HttpError> RequestParser::ParseTokenize(std::string_view body,
                                                      std::vector<int32_t>* ids) const {
  const json root = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded() || !root.is_object()) return HttpError{422, "`inputs` must be a string"};
  if (NestedDeeperThan(root, kMaxJsonDepth)) return HttpError{422, TooDeep()};
  if (!root.contains("inputs") || !root["inputs"].is_string()) {
    return HttpError{422, "`inputs` must be a string"};
  }
  absl::StatusOr<std::vector<int32_t>> prompt = PromptOf(root["inputs"].get<std::string>());
  if (!prompt.ok()) return HttpError{422, std::string(prompt.status().message())};
  // The bound /generate puts on a prompt (HttpFrontend's Start), in its words: the reply is
  // some 20 bytes of JSON per id.
  if (prompt->size() > static_cast<size_t>(options_.max_input_tokens)) {
    return HttpError{422, absl::StrCat("the prompt must have less than ", options_.max_input_tokens,
                                       " tokens. Given: ", prompt->size())};
  }
  *ids = *std::move(prompt);
  return std::nullopt;
}

// BOS (when the tokenizer's model wants one), then the tokenizer's ids.
absl::StatusOr<std::vector<int32_t>> RequestParser::PromptOf(const std::string& text) const {
  absl::StatusOr<std::vector<int32_t>> encoded = tokenizer_->Encode(text);
  if (!encoded.ok()) return encoded.status();
  std::vector<int32_t> prompt;
  if (tokenizer_->add_bos() && tokenizer_->bos_id() >= 0) prompt.push_back(tokenizer_->bos_id());
  prompt.insert(prompt.end(), encoded->begin(), encoded->end());
  return prompt;
}

// The sampling and length parameters the OpenAI completions and chat completions APIs
// share: nullopt when `key` is one and `value` is fine (applied to `a`, or to `seed`), an
// error to answer when it is one and its value is wrong, and an error of status 0 when
// `key` is not one of them.
std::optional<HttpError> RequestParser::OpenAiParam(const std::string& key, const json& value,
                                                    GenerationRequest* active_request,
                                                    OpenAiGiven* given) const {
  GenerationRequest& a = *active_request;
  const bool chat = a.chat;
  auto fail = [&](int status, std::string message, std::string param = "") {
    return std::optional<HttpError>(
        HttpError{status, std::move(message), "validation", std::move(param), Api::kOpenAi});
  };
  if (key == "max_tokens" || (chat && key == "max_completion_tokens")) {
    if (!value.is_number_integer() || value.get<int64_t>() < 1 ||
        value.get<int64_t>() > options_.max_total_tokens) {
      return fail(
          422,
          absl::StrCat("`", key, "` must be an integer in [1, ", options_.max_total_tokens, "]"),
          key);
    }
    // Both may be given; FinishOpenAiParams resolves them.
    (key == "max_tokens" ? given->max_tokens : given->max_completion_tokens) =
        value.get<int32_t>();
  } else if (key == "temperature") {
    if (!value.is_number() || value.get<double>() < 0 || value.get<double>() > 2) {
      return fail(422, "`temperature` must be a number in [0, 2]", key);
    }
    a.params.sampling.temperature = value.get<float>();
  } else if (key == "top_p") {
    if (!value.is_number() || value.get<float>() <= 0 || value.get<double>() > 1) {
      return fail(422, "`top_p` must be a number in (0, 1]", key);
    }
    a.params.sampling.top_p = value.get<float>();
  } else if (key == "seed") {
    if (!value.is_null()) {
      if (!value.is_number_unsigned()) {
        return fail(422, "`seed` must be an unsigned integer", key);
      }
      given->seed = value.get<uint64_t>();
    }
  } else if (key == "stream") {
    if (!value.is_boolean()) return fail(422, "`stream` must be a boolean", key);
    a.stream = value.get<bool>();
  } else if (key == "stream_options") {
    if (!value.is_null()) {
      if (!value.is_object()) return fail(422, "`stream_options` must be an object", key);
      for (const auto& [option, flag] : value.items()) {
        if (option != "include_usage" || !flag.is_boolean()) {
          return fail(422, absl::StrCat("stream_options_.", Shortened(option), " is not supported"),
                      key);
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
      return fail(422, "`stop` must be a string or a list of at most 4 strings", key);
    }
    // TGI's rule (ParseParams): an empty stop string would match every text, and ignoring
    // it silently is what kvcm does not do with a parameter.
    if (std::any_of(a.params.stop.begin(), a.params.stop.end(),
                    [](const std::string& x) { return x.empty(); })) {
      return fail(422, "`stop` must not hold an empty string", key);
    }
  } else if (key == "n" || key == "best_of") {
    if (!value.is_null()) {
      if (!value.is_number_integer() || value.get<int64_t>() < 1 ||
          value.get<int64_t>() > options_.max_best_of) {
        return fail(422,
                    absl::StrCat("`", key, "` must be an integer in [1, ", options_.max_best_of,
                                 "] (--max-best-of)"),
                    key);
      }
      (key == "n" ? a.params.n : a.params.best_of) = value.get<int32_t>();
      if (key == "best_of") given->best_of = true;
    }
  } else if (key == "frequency_penalty" || key == "presence_penalty") {
    if (!value.is_null()) {
      if (!value.is_number() || value.get<double>() < -2 || value.get<double>() > 2) {
        return fail(422, absl::StrCat("`", key, "` must be a number in [-2, 2]"), key);
      }
      (key == "frequency_penalty" ? a.params.sampling.frequency_penalty
                                  : a.params.sampling.presence_penalty) = value.get<float>();
    }
  } else if (key == "repetition_penalty") {  // vLLM's extension
    if (!value.is_null()) {
      if (!value.is_number() || value.get<float>() <= 0 || value.get<double>() > 100) {
        return fail(422, "`repetition_penalty` must be a number in (0, 100]", key);
      }
      a.params.sampling.repetition_penalty = value.get<float>();
    }
  } else if (key == "top_k") {  // vLLM's extension; -1 or 0: all tokens
    if (!value.is_null()) {
      if (!value.is_number_integer() || value.get<int64_t>() < -1 ||
          value.get<int64_t>() > (1 << 20)) {
        return fail(422, "`top_k` must be an integer >= -1 (-1: all tokens)", key);
      }
      a.params.sampling.top_k = std::max<int32_t>(0, value.get<int32_t>());
    }
  } else if (key == "ignore_eos") {
    // vLLM's extension: the EOS ids leave the request's stop set (RouterCore's
    // Submission::ignore_eos), nothing else does: stop strings still end it, and an EOS
    // generated is an ordinary token, which the tokenizer decodes to no text (vLLM's
    // skip_special_tokens default).
    if (!value.is_null()) {
      if (!value.is_boolean()) return fail(422, "`ignore_eos` must be a boolean", key);
      a.params.ignore_eos = value.get<bool>();
    }
  } else if (key == "min_tokens") {  // vLLM's extension; checked against max_tokens at the end
    if (!value.is_null()) {
      if (!value.is_number_integer() || value.get<int64_t>() < 0 ||
          value.get<int64_t>() > options_.max_total_tokens) {
        return fail(422,
                    absl::StrCat("`min_tokens` must be an integer in [0, ",
                                 options_.max_total_tokens, "]"),
                    key);
      }
      a.params.sampling.min_tokens = value.get<int32_t>();
    }
  } else if (key == "model" || key == "user") {
    if (!value.is_string() && !value.is_null()) return fail(422, "must be a string", key);
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
  auto refuse = [](int status, std::string message, std::string param = "") {
    return std::optional<HttpError>(
        HttpError{status, std::move(message), "validation", std::move(param), Api::kOpenAi});
  };
  const json root = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded() || !root.is_object()) {
    return refuse(400, "the body is not a JSON object");
  }
  if (NestedDeeperThan(root, kMaxJsonDepth)) return refuse(422, TooDeep());
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
        if (!ids.ok()) return refuse(422, std::string(ids.status().message()), "prompt");
        if (ids->empty()) return refuse(422, NoPromptTokens("prompt"), "prompt");
        prompt = *std::move(ids);
        a.prompt_text = one.get<std::string>();
      } else if (one.is_array() && !one.empty() &&
                 std::all_of(one.begin(), one.end(),
                             [](const json& t) { return t.is_number_integer(); })) {
        for (const json& t : one) {
          const int64_t id = t.get<int64_t>();
          if (id < 0 || id >= tokenizer_->vocab_size()) {
            return refuse(
                422,
                absl::StrCat("token id ", id, " is outside [0, ", tokenizer_->vocab_size(), ")"),
                "prompt");
          }
          prompt.push_back(static_cast<int32_t>(id));
        }
        absl::StatusOr<std::string> text = tokenizer_->Decode(prompt);
        a.prompt_text = text.ok() ? *text : "";
      } else {
        return refuse(422,
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
      if (!value.is_boolean()) return refuse(422, "`echo` must be a boolean", key);
      a.params.return_full_text = value.get<bool>();
    } else if (key == "logprobs") {
      if (!value.is_null()) {
        if (!value.is_number_integer() || value.get<int64_t>() < 0 ||
            value.get<int64_t>() > options_.max_top_n_tokens) {
          return refuse(
              422,
              absl::StrCat("`logprobs` must be an integer in [0, ", options_.max_top_n_tokens, "]"),
              key);
        }
        a.params.show_logprobs = true;
        a.params.outputs.top_n = value.get<int32_t>();
      }
    } else if ((key == "suffix" || key == "logit_bias") && value.is_null()) {
    } else {
      return refuse(422, Unsupported(key, value), Shortened(key));
    }
  }
  if (!have_prompt) return refuse(422, "`prompt` is required", "prompt");
  if (std::optional<HttpError> bad = FinishOpenAiParams(&a, given)) return bad;
  // With echo, the prompt's tokens come first in logprobs, scored.
  a.params.outputs.prompt_logprobs = a.params.show_logprobs && a.params.return_full_text;
  a.prompt = std::move(prompt);
  return std::nullopt;
}

// POST /v1/chat/completions (OpenAI): `messages` rendered with the model's chat template
// (add_generation_prompt), tokenized as transformers' apply_chat_template(tokenize=True)
// does (no BOS added: the template writes what the model wants).
std::optional<HttpError> RequestParser::ParseChatCompletions(std::string_view body,
                                                             GenerationRequest* out) {
  auto refuse = [](int status, std::string message, std::string param = "") {
    return std::optional<HttpError>(
        HttpError{status, std::move(message), "validation", std::move(param), Api::kOpenAi});
  };
  if (options_.chat_template == nullptr) {
    return refuse(501,
                  "this model has no usable chat template: start the router with "
                  "--chat-template FILE, or use /v1/completions");
  }
  const json root = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded() || !root.is_object()) {
    return refuse(400, "the body is not a JSON object");
  }
  if (NestedDeeperThan(root, kMaxJsonDepth)) return refuse(422, TooDeep());
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
      if (!value.is_array() || value.empty()) {
        return refuse(422, "`messages` must be a non-empty list of messages", key);
      }
      for (size_t i = 0; i < value.size(); ++i) {
        const json& m = value[i];
        const std::string where = absl::StrCat("messages[", i, "]");
        if (!m.is_object() || !m.contains("role") || !m["role"].is_string()) {
          return refuse(422, absl::StrCat(where, " must be an object with a string `role`"), key);
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
                return refuse(422,
                              absl::StrCat(where,
                                           ".content: only parts of type \"text\" "
                                           "are supported"),
                              key);
              }
              if (!message.content.empty()) message.content += "\n";
              message.content += part["text"].get<std::string>();
            }
          } else if (!content.is_null()) {
            return refuse(422,
                          absl::StrCat(where,
                                       ".content must be a string or a list of "
                                       "text parts"),
                          key);
          }
        }
        if (!extra.empty()) message.extra_json = extra.dump();
        messages.push_back(std::move(message));
      }
      have_messages = true;
    } else if (std::optional<HttpError> bad = OpenAiParam(key, value, &a, &given);
               !bad.has_value()) {
    } else if (bad->status != 0) {
      return bad;
    } else if (key == "logprobs") {
      if (!value.is_null()) {
        if (!value.is_boolean()) return refuse(422, "`logprobs` must be a boolean", key);
        a.params.show_logprobs = value.get<bool>();
      }
    } else if (key == "top_logprobs") {
      if (!value.is_null()) {
        if (!value.is_number_integer() || value.get<int64_t>() < 0 ||
            value.get<int64_t>() > options_.max_top_n_tokens) {
          return refuse(422,
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
      return refuse(422, Unsupported(key, value), Shortened(key));
    }
  }
  if (!have_messages) return refuse(422, "`messages` is required", "messages");
  if (a.params.outputs.top_n > 0 && !a.params.show_logprobs) {
    return refuse(422, "`top_logprobs` needs `logprobs`: true", "top_logprobs");
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
    return refuse(400,
                  absl::StrCat("the chat template refused the messages: ",
                               Shortened(text.status().message(), kMaxTemplateMessageBytes)),
                  "messages");
  }
  absl::StatusOr<std::vector<int32_t>> prompt = tokenizer_->Encode(*text);
  if (!prompt.ok()) return refuse(422, std::string(prompt.status().message()), "messages");
  if (prompt->empty()) return refuse(422, "the chat template rendered nothing", "messages");
  a.prompt_text = *std::move(text);
  a.prompt = *std::move(prompt);
  return std::nullopt;
}

}  // namespace kvcm::router
