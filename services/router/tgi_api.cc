#include "services/router/tgi_api.h"

#include <limits>
#include <optional>
#include <span>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/tokenizer/incremental_decoder.h"
#include "nlohmann/json.hpp"
#include "services/router/api.h"
#include "services/router/http_requests.h"
#include "services/router/stream_events.h"

namespace kvcm::router {
namespace {

using json = nlohmann::json;

// /info's validation_workers: every request is parsed, checked and tokenized on the HTTP
// thread, the one thread the front end runs on (http_frontend.h).
constexpr int kValidationWorkers = 1;
// /info's max_client_batch_size: the inputs one request may carry. /generate's `inputs` is
// one string and /v1/completions' `prompt` one prompt or a list of one (RequestParser).
constexpr int kMaxClientBatchSize = 1;

// TGI's token object; `logprob` null when it was not asked for.
json TgiToken(const Tokenizer& tokenizer, int32_t id, float logprob, const std::string& text) {
  return {{"id", id},
          {"text", text},
          {"logprob", Logprob(logprob)},
          {"special", tokenizer.IsSpecial(id)}};
}

json TgiTopTokens(const Tokenizer& tokenizer, const std::vector<std::pair<int32_t, float>>& top) {
  json out = json::array();
  for (const auto& [id, logprob] : top) {
    out.push_back(TgiToken(tokenizer, id, logprob, TokenText(tokenizer, id)));
  }
  return out;
}

// The prompt's tokens with their log-probabilities (details.prefill).
json Prefill(const Generation& g, const Tokenizer& tokenizer) {
  constexpr float kNone = std::numeric_limits<float>::quiet_NaN();
  json prefill = json::array();
  for (size_t i = 0; i < g.prompt.size(); ++i) {
    const float logprob = i < g.prompt_logprobs.size() ? g.prompt_logprobs[i] : kNone;
    prefill.push_back({{"id", g.prompt[i]},
                       {"text", TokenText(tokenizer, g.prompt[i])},
                       {"logprob", Logprob(logprob)}});
  }
  return prefill;
}

json Details(const Generation& g, const Choice& c, const Tokenizer& tokenizer,
             bool with_prefill = true) {
  constexpr float kNone = std::numeric_limits<float>::quiet_NaN();
  json tokens = json::array();
  for (size_t i = 0; i < c.generated.size(); ++i) {
    const int32_t id = c.generated[i];
    tokens.push_back(TgiToken(tokenizer, id, i < c.logprobs.size() ? c.logprobs[i] : kNone,
                              TokenText(tokenizer, id)));
  }
  const json prefill =
      with_prefill && g.params.outputs.prompt_logprobs ? Prefill(g, tokenizer) : json::array();
  const size_t index = static_cast<size_t>(&c - g.choices.data());
  json details = {{"finish_reason", c.finish_reason},
                  {"generated_tokens", c.generated.size()},
                  {"seed", g.params.do_sample ? json(g.params.seed + index) : json(nullptr)},
                  {"prefill", prefill},
                  {"tokens", tokens}};
  if (g.params.outputs.top_n > 0) {
    json top = json::array();
    for (const auto& alternatives : c.top) top.push_back(TgiTopTokens(tokenizer, alternatives));
    details["top_tokens"] = top;
  }
  return details;
}

// What the reply shows of a choice's text: the prompt first with return_full_text.
std::string ShownText(const Generation& g, const std::string& text) {
  return g.params.return_full_text ? g.prompt_text + text : text;
}

// The bytes of /tokenize's `inputs` an id stands for.
struct TokenSpan {
  size_t start = 0;
  size_t stop = 0;
};

// Whether the ids silent[j...] (which decode to nothing) spell input[from, to) one after
// the other, each a text Tokenizer::TokenId names it by (of at most kMaxSpelling bytes),
// but the BOS RequestParser puts first, which spells nothing; if so, sets their spans.
constexpr size_t kMaxSpelling = 256;
bool SpellSilent(const Tokenizer& tokenizer, std::string_view input, std::span<const int32_t> ids,
                 const std::vector<size_t>& silent, size_t j, size_t from, size_t to,
                 std::vector<TokenSpan>* spans) {
  if (j == silent.size()) return from == to;
  const size_t k = silent[j];
  if (k == 0 && tokenizer.add_bos() && ids[0] == tokenizer.bos_id() &&
      SpellSilent(tokenizer, input, ids, silent, j + 1, from, to, spans)) {
    (*spans)[k] = {from, from};
    return true;
  }
  for (size_t after = from + 1; after <= to && after - from <= kMaxSpelling; ++after) {
    if (tokenizer.TokenId(input.substr(from, after - from)) == ids[k] &&
        SpellSilent(tokenizer, input, ids, silent, j + 1, after, to, spans)) {
      (*spans)[k] = {from, after};
      return true;
    }
  }
  return false;
}

// Each id's span of `input`, from the text the ids decode to, id by id: an id that holds
// part of a character (byte-level BPE splits some) spans the whole character, as Hugging
// Face's offsets do; the ids that decode to nothing span the text of `input` between
// their neighbours' that spells them, one after the other (added tokens such as
// <|im_start|>: Tokenizer::TokenId of that text is the id), the BOS that RequestParser
// puts first nothing. nullopt when the ids' text does not spell `input` (a normalizer
// changed it: lowercase, NFKC): offsets into `input` are then unknown, and /tokenize
// leaves start and stop out rather than guess.
class SpanFinder {
 public:
  SpanFinder(const Tokenizer& tokenizer, std::string_view input, std::span<const int32_t> ids)
      : tokenizer_(tokenizer), input_(input), ids_(ids), spans_(ids.size()) {}

  std::optional<std::vector<TokenSpan>> Find() {
    for (size_t i = 0; i < ids_.size(); ++i) {
      if (!Next(i)) return std::nullopt;
    }
    if (at_ < input_.size() && held_ == 0 &&
        SpellSilent(tokenizer_, input_, ids_, silent_, 0, at_, input_.size(), &spans_)) {
      at_ = input_.size();
    }
    if (at_ + held_ != input_.size()) return std::nullopt;
    return std::move(spans_);
  }

 private:
  // The character boundary at or before / at or after `at` (`input` is a JSON string's
  // bytes, so UTF-8).
  size_t CharStart(size_t at) const {
    while (at > 0 && at < input_.size() &&
           (static_cast<unsigned char>(input_[at]) & 0xC0) == 0x80) {
      --at;
    }
    return at;
  }
  size_t CharEnd(size_t at) const {
    while (at < input_.size() && (static_cast<unsigned char>(input_[at]) & 0xC0) == 0x80) ++at;
    return at;
  }

  // Id i's span; false when the ids do not spell `input`.
  bool Next(size_t i) {
    absl::StatusOr<IncrementalDecoder::Piece> piece = decoder_.Next(tokenizer_, ids_.first(i + 1));
    if (!piece.ok()) return false;
    // What the ids spell from `at_` on: what was held, then this id's text.
    const std::string text = piece->ready + piece->pending;
    const size_t begin = at_ + held_;
    if (begin == at_ + text.size()) {  // nothing: spelled by text to come, or none
      spans_[i] = {begin, begin};
      if (held_ == 0) silent_.push_back(i);
      return true;
    }
    if (input_.substr(at_, text.size()) != text && !SkipSilent(text)) return false;
    silent_.clear();
    spans_[i] = {CharStart(at_ + held_), CharEnd(at_ + text.size())};
    at_ += piece->ready.size();
    held_ = piece->pending.size();
    return true;
  }

  // Text no id decodes to comes before `text`: the ids just before that decoded to nothing
  // spell it. Moves `at_` to where `text` starts.
  bool SkipSilent(const std::string& text) {
    if (silent_.empty() || held_ > 0) return false;
    size_t found = input_.find(text, at_ + 1);
    while (found != std::string_view::npos && found - at_ <= kMaxSpelling * silent_.size() &&
           !SpellSilent(tokenizer_, input_, ids_, silent_, 0, at_, found, &spans_)) {
      found = input_.find(text, found + 1);
    }
    if (found == std::string_view::npos || found - at_ > kMaxSpelling * silent_.size()) {
      return false;
    }
    at_ = found;
    return true;
  }

  const Tokenizer& tokenizer_;
  const std::string_view input_;
  const std::span<const int32_t> ids_;
  std::vector<TokenSpan> spans_;
  IncrementalDecoder decoder_;
  size_t at_ = 0;               // bytes of `input` the decoder's whole text so far spells
  size_t held_ = 0;             // bytes after `at_` the ids so far spell, not yet a whole character
  std::vector<size_t> silent_;  // the ids since the last text, each decoded to nothing
};

}  // namespace

json TgiErrorBody(const HttpError& error) {
  return {{"error", error.message}, {"error_type", error.type}};
}

std::string TgiReply(const Generation& g, const Tokenizer& tokenizer) {
  const std::vector<size_t> order = BestFirst(g);
  const Choice& best = g.choices[order.front()];
  json body = {{"generated_text", ShownText(g, TextOf(tokenizer, best))}};
  if (g.params.details) {
    body["details"] = Details(g, best, tokenizer);
    if (g.choices.size() > 1) {  // TGI's best_of: the others, best first
      json others = json::array();
      for (size_t k = 1; k < order.size(); ++k) {
        const Choice& c = g.choices[order[k]];
        json other = Details(g, c, tokenizer, /*with_prefill=*/false);
        other["generated_text"] = ShownText(g, TextOf(tokenizer, c));
        others.push_back(std::move(other));
      }
      body["details"]["best_of_sequences"] = std::move(others);
    }
  }
  return Dump(g.as_list ? json::array({body}) : body);
}

void AppendTgiTokenEvent(const Generation& g, size_t index, int32_t token, float logprob,
                         bool finished, const std::string& piece, const Tokenizer& tokenizer,
                         std::string* out) {
  const Choice& c = g.choices[index];
  // The bytes TgiToken and TgiTopTokens give, as Dump writes them (stream_events.h).
  TgiStreamEvent event;
  event.index = c.generated.size() - 1;
  event.token = {token, logprob, piece, tokenizer.IsSpecial(token)};
  std::vector<std::string> top_texts;
  std::vector<TgiStreamToken> top;
  if (g.params.outputs.top_n > 0) {
    event.with_top_tokens = true;
    for (const auto& alternative : c.top.back()) {
      top_texts.push_back(TokenText(tokenizer, alternative.first));
    }
    for (size_t i = 0; i < top_texts.size(); ++i) {
      const auto& [id, alternative_logprob] = c.top.back()[i];
      top.push_back({id, alternative_logprob, top_texts[i], tokenizer.IsSpecial(id)});
    }
    event.top_tokens = top;
  }
  TgiStreamEnd end;
  std::string all;
  if (finished) {
    all = ShownText(g, TextOf(tokenizer, c));
    end.generated_text = all;
    end.finish_reason = c.finish_reason;
    end.generated_tokens = c.generated.size();
    end.input_length = g.prompt_tokens;
    if (g.params.do_sample) end.seed = g.params.seed;
    event.end = &end;
  }
  AppendTgiStreamEvent(event, out);
}

std::string TgiTokenizeReply(std::string_view body, const std::vector<int32_t>& ids,
                             const Tokenizer& tokenizer) {
  // ParseTokenize read `inputs` from this body: a JSON object with a string there.
  const json root = json::parse(body, nullptr, /*allow_exceptions=*/false);
  const std::string inputs =
      root.is_object() && root.contains("inputs") && root["inputs"].is_string()
          ? root["inputs"].get<std::string>()
          : std::string();
  const std::optional<std::vector<TokenSpan>> spans = SpanFinder(tokenizer, inputs, ids).Find();
  json out = json::array();
  for (size_t i = 0; i < ids.size(); ++i) {
    json token = {{"id", ids[i]}, {"text", TokenText(tokenizer, ids[i])}};
    if (spans.has_value()) {
      token["start"] = (*spans)[i].start;
      token["stop"] = (*spans)[i].stop;
    }
    out.push_back(std::move(token));
  }
  return Dump(out);
}

std::vector<TgiKvCacheGroup> TgiKvCacheGroups(const KvCacheSpec& spec,
                                              std::span<const KvCacheGroup> groups,
                                              int32_t sliding_window_tokens,
                                              int32_t max_total_tokens) {
  // Without groups the pool is one group of every layer, each block all of them.
  KvCacheGroup all{.window = sliding_window_tokens, .layers = {}};
  for (int32_t layer = 0; layer < spec.num_layers; ++layer) all.layers.push_back(layer);
  const std::span<const KvCacheGroup> shown = groups.empty() ? std::span(&all, 1) : groups;
  std::vector<TgiKvCacheGroup> out;
  for (const KvCacheGroup& group : shown) {
    // A group alone, so that BlocksHeldByGroups gives its blocks only.
    KvCacheGroups alone;
    alone.groups = {group};
    out.push_back(
        {.window_tokens = group.window,
         .layers = group.layers,
         .bytes_per_token = spec.BytesPerToken(),
         .max_blocks_per_sequence = BlocksHeldByGroups(alone, max_total_tokens, spec.block_size)});
  }
  return out;
}

std::string TgiInfoReply(const TgiInfo& info) {
  json groups = json::array();
  for (size_t g = 0; g < info.kv_cache_groups.size(); ++g) {
    const TgiKvCacheGroup& group = info.kv_cache_groups[g];
    groups.push_back({{"group", g},
                      {"window_tokens", group.window_tokens},
                      {"layers", group.layers},
                      {"bytes_per_token", group.bytes_per_token},
                      {"max_blocks_per_sequence", group.max_blocks_per_sequence}});
  }
  const json body = {{"model_id", info.model_id},
                     {"model_dtype", nullptr},
                     {"block_size", info.block_size},
                     {"num_blocks", info.num_blocks},
                     {"max_total_tokens_in_pool", int64_t{info.block_size} * info.num_blocks},
                     {"max_batch_total_tokens", info.max_batch_total_tokens},
                     {"max_batch_prefill_tokens", info.max_batch_prefill_tokens},
                     {"max_input_tokens", info.max_input_tokens},
                     {"max_total_tokens", info.max_total_tokens},
                     {"max_concurrent_requests", info.max_concurrent_requests},
                     {"max_stop_sequences", 4},
                     {"max_top_n_tokens", info.max_top_n_tokens},
                     {"max_best_of", info.max_best_of},
                     {"validation_workers", kValidationWorkers},
                     {"max_client_batch_size", kMaxClientBatchSize},
                     {"executors", info.executors},
                     {"router", kRouterName},
                     {"version", kRouterVersion},
                     {"kv_cache_groups", std::move(groups)}};
  return Dump(body);
}

// ---- Request parsing (RequestParser's TGI members, http_requests.h) ---------------------

// One member of TGI's `parameters` (not null), applied to `params`; the error to answer
// when its value is wrong or it is not supported.
std::optional<HttpError> RequestParser::TgiParam(const std::string& key, const json& value,
                                                 Params* params) const {
  auto want_int = [&](int64_t lo, int64_t hi) -> std::optional<HttpError> {
    if (!value.is_number_integer() || value.get<int64_t>() < lo || value.get<int64_t>() > hi) {
      return HttpError{422, absl::StrCat("`", key, "` must be an integer in [", lo, ", ", hi, "]")};
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
    bad = HttpError{422, UnsupportedParameterMessage(key, value)};
  }
  return bad;
}

std::optional<HttpError> RequestParser::ParseParams(const json& root, Params* params) {
  params->max_new_tokens = options_.default_max_new_tokens;
  if (!root.contains("parameters") || root["parameters"].is_null()) return std::nullopt;
  const json& p = root["parameters"];
  if (!p.is_object()) return HttpError{422, "`parameters` must be an object"};
  for (const auto& [key, value] : p.items()) {
    if (value.is_null()) continue;
    if (std::optional<HttpError> bad = TgiParam(key, value, params)) return bad;
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

std::optional<HttpError> RequestParser::ParseGenerate(std::string_view body,
                                                      std::optional<bool> stream_path,
                                                      GenerationRequest* out) {
  const json root = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded() || !root.is_object()) {
    return HttpError{400, "the body is not a JSON object", "validation"};
  }
  if (NestedDeeperThan(root, kMaxJsonDepth)) return HttpError{422, TooDeepMessage()};
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
  if (prompt->empty()) return HttpError{422, NoPromptTokensMessage("inputs")};
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
  if (NestedDeeperThan(root, kMaxJsonDepth)) return HttpError{422, TooDeepMessage()};
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

}  // namespace kvcm::router
