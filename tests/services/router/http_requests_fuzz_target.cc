// The fuzz target of the HTTP API's request bodies (tests/support/fuzz_target.h): the
// router's RequestParser (services/router/http_requests.h), which turns the body of a TGI or
// OpenAI generation request into what the router submits. The input's first byte picks the
// endpoint (0 /generate, 1 /generate_stream, 2 POST /, 3 /v1/completions,
// 4 /v1/chat/completions; modulo 5), the rest is the body. Over a byte-level tokenizer
// (vocab 320) and SmolLM2's chat template, with the front end's default limits:
//   - nothing throws (the front end would answer 500 internal error);
//   - a refusal is 400, 422 or 501, in the endpoint's API, with a message; an unsupported
//     parameter's name and value are echoed shortened, and no message is long whatever the
//     body (kMaxEchoedValueBytes, kMaxTemplateMessageBytes);
//   - an accepted request is one the executors take: max_new_tokens in [1,
//     max_total_tokens], prompt tokens inside the vocabulary, top_n in [0,
//     max_top_n_tokens], between 1 and max_best_of sequences of which at least the shown
//     ones, and sampling parameters DecodeStepBatch accepts (common/wire/executor_codec.h),
//     a sampled one at a temperature of at least kGreedyBelowTemperature;
//   - on the response side, the input's last four bytes as a float (any bit pattern: NaN,
//     infinities, denormals) are a log-probability as the router writes it (ShownLogprob,
//     services/router/stream_events.h): JSON that reads back as a number no lower than
//     kMinLogprob, in the stream events' writer and in nlohmann's alike.
// Seeds: tests/services/router/fuzz/http_requests/.

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "absl/strings/str_cat.h"
#include "common/chat/chat_template.h"
#include "common/tokenizer/tokenizer.h"
#include "nlohmann/json.hpp"
#include "services/router/http_requests.h"
#include "services/router/stream_events.h"
#include "tests/support/fuzz_target.h"

namespace kvcm::router {
namespace {

using fuzz::Check;

constexpr char kChatTemplate[] =
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}";

struct Fixture {
  std::unique_ptr<Tokenizer> tokenizer;
  std::unique_ptr<ChatTemplate> chat_template;
  std::unique_ptr<RequestParser> parser;
};

Fixture& TheFixture() {
  static Fixture* fixture = [] {
    auto* f = new Fixture;
    absl::StatusOr<std::unique_ptr<ByteTokenizer>> tokenizer = ByteTokenizer::Create(320);
    Check(tokenizer.ok(), "the byte-level tokenizer");
    f->tokenizer = *std::move(tokenizer);
    absl::StatusOr<ChatTemplate> tmpl = ChatTemplate::Parse(kChatTemplate);
    Check(tmpl.ok(), "the chat template parses");
    f->chat_template = std::make_unique<ChatTemplate>(*std::move(tmpl));
    RequestLimits limits;  // the front end's defaults (HttpFrontend::Options)
    limits.chat_template = f->chat_template.get();
    limits.bos_token = "<|im_start|>";
    limits.eos_token = "<|im_end|>";
    f->parser = std::make_unique<RequestParser>(limits, f->tokenizer.get());
    return f;
  }();
  return *fixture;
}

void CheckAccepted(const GenerationRequest& r, Api api) {
  const RequestLimits limits;
  Check(r.api == api, "the request is of the endpoint's API");
  const Params& p = r.params;
  Check(p.max_new_tokens >= 1 && p.max_new_tokens <= limits.max_total_tokens,
        "max_new_tokens in [1, max_total_tokens]");
  // The planner cannot run a prompt of no tokens (StepPlanner::Enqueue checks it).
  Check(!r.prompt.empty(), "a prompt has at least one token");
  for (const int32_t id : r.prompt) Check(id >= 0 && id < 320, "prompt tokens in the vocabulary");
  Check(p.outputs.top_n >= 0 && p.outputs.top_n <= limits.max_top_n_tokens,
        "top_n in [0, max_top_n_tokens]");
  Check(p.outputs.sequences >= 1 && p.outputs.sequences <= limits.max_best_of,
        "between 1 and max_best_of sequences");
  Check(r.shown >= 1 && r.shown <= p.outputs.sequences, "the shown sequences are generated");
  // vLLM's min_tokens at most max_tokens (DecodeStepBatch refuses a negative one); TGI has
  // neither it nor ignore_eos.
  Check(p.sampling.min_tokens >= 0 && p.sampling.min_tokens <= p.max_new_tokens,
        "min_tokens in [0, max_tokens]");
  Check(api == Api::kOpenAi || (!p.ignore_eos && p.sampling.min_tokens == 0),
        "TGI has no ignore_eos or min_tokens");
  const SamplingParams& s = p.sampling;
  // What DecodeStepBatch refuses (common/wire/executor_codec.h).
  Check(std::isfinite(s.temperature) && s.temperature >= 0, "temperature >= 0");
  Check(std::isfinite(s.top_p) && s.top_p > 0 && s.top_p <= 1, "top_p in (0, 1]");
  Check(s.top_k >= 0, "top_k >= 0");
  Check(std::isfinite(s.repetition_penalty) && s.repetition_penalty > 0, "repetition_penalty > 0");
  Check(std::isfinite(s.frequency_penalty) && std::abs(s.frequency_penalty) <= 2,
        "frequency_penalty in [-2, 2]");
  Check(std::isfinite(s.presence_penalty) && std::abs(s.presence_penalty) <= 2,
        "presence_penalty in [-2, 2]");
  Check(!p.do_sample || s.temperature >= kGreedyBelowTemperature,
        "a sampled request has a temperature it can divide by");
}

// A log-probability of any bit pattern, written as the router writes one: a number (JSON
// has no -inf; the OpenAPI document types it as a number), never below kMinLogprob.
void CheckLogprobFormatting(const uint8_t* bytes) {
  float value;
  std::memcpy(&value, bytes, sizeof(value));
  if (std::isnan(value)) return;  // not computed: written null where the APIs say so
  std::string written;
  AppendJsonNumber(ShownLogprob(value), &written);
  const nlohmann::json streamed = nlohmann::json::parse(written, nullptr, false);
  Check(streamed.is_number() && streamed.get<double>() >= kMinLogprob,
        "a streamed log-probability is a number no lower than kMinLogprob");
  const nlohmann::json dumped =
      nlohmann::json::parse(nlohmann::json(ShownLogprob(value)).dump(), nullptr, false);
  Check(dumped.is_number() && dumped.get<double>() >= kMinLogprob,
        "a log-probability in a reply is a number no lower than kMinLogprob");
}

}  // namespace
}  // namespace kvcm::router

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvcm::router;  // NOLINT: one function
  if (size == 0) return 0;
  if (size >= 5) CheckLogprobFormatting(data + size - 4);
  Fixture& f = TheFixture();
  const int endpoint = data[0] % 5;
  const std::string_view body(reinterpret_cast<const char*>(data + 1), size - 1);
  GenerationRequest parsed;
  std::optional<HttpError> error;
  try {
    switch (endpoint) {
      case 0:
        error = f.parser->ParseGenerate(body, false, &parsed);
        break;
      case 1:
        error = f.parser->ParseGenerate(body, true, &parsed);
        break;
      case 2:
        error = f.parser->ParseGenerate(body, std::nullopt, &parsed);
        break;
      case 3:
        error = f.parser->ParseCompletions(body, &parsed);
        break;
      default:
        error = f.parser->ParseChatCompletions(body, &parsed);
        break;
    }
  } catch (const std::exception& e) {
    kvcm::fuzz::Fail(absl::StrCat("the parser threw (the front end answers 500): ", e.what()));
  }
  const Api api = endpoint <= 2 ? Api::kTgi : Api::kOpenAi;
  if (error.has_value()) {
    Check(error->status == 400 || error->status == 422 || error->status == 501,
          "a refusal is 400, 422 or 501");
    Check(error->api == api || api == Api::kTgi, "an OpenAI refusal has OpenAI's shape");
    Check(!error->message.empty(), "a refusal says why");
    // "parameter `KEY` is not supported by this server (VALUE)": both shortened.
    Check(error->param.size() <= 2 * kMaxEchoedValueBytes &&
              (error->message.rfind("parameter `", 0) != 0 ||
               error->message.size() <= 4 * kMaxEchoedValueBytes),
          "a refusal echoes no more than a short prefix of what it refuses");
    Check(error->message.size() <= kMaxTemplateMessageBytes + 4 * kMaxEchoedValueBytes,
          "a refusal's message is short, however long the body");
    return 0;
  }
  CheckAccepted(parsed, api);
  kvcm::fuzz::NoteAccepted();
  return 0;
}
