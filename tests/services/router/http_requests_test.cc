// RequestParser (services/router/http_requests.h) on vLLM's `ignore_eos` and `min_tokens`:
// accepted on /v1/completions and /v1/chat/completions with their defaults, min_tokens carried
// in the sampling parameters the executors get, refused with the parameter named when out of
// range, and refused on TGI's /generate (TGI has neither). Over
// a byte-level tokenizer and SmolLM2's chat template, with the front end's default limits.

#include "services/router/http_requests.h"

#include <memory>
#include <optional>
#include <string>

#include "common/chat/chat_template.h"
#include "common/tokenizer/tokenizer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace kvcm::router {
namespace {

using json = nlohmann::json;
using ::testing::HasSubstr;

constexpr char kChatTemplate[] =
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}";

class RequestParserTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<ByteTokenizer>> tokenizer = ByteTokenizer::Create(320);
    ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
    tokenizer_ = *std::move(tokenizer);
    absl::StatusOr<ChatTemplate> tmpl = ChatTemplate::Parse(kChatTemplate);
    ASSERT_TRUE(tmpl.ok()) << tmpl.status();
    template_ = std::make_unique<ChatTemplate>(*std::move(tmpl));
    RequestLimits limits;  // the front end's defaults
    limits.chat_template = template_.get();
    parser_ = std::make_unique<RequestParser>(limits, tokenizer_.get());
  }

  // The body of `endpoint` ("completions" or "chat") with `extra` members added.
  static std::string Body(const std::string& endpoint, const json& extra) {
    json body = endpoint == "chat" ? json{{"messages", {{{"role", "user"}, {"content", "hi"}}}}}
                                   : json{{"prompt", "hi"}};
    for (const auto& [key, value] : extra.items()) body[key] = value;
    return body.dump();
  }

  std::optional<HttpError> Parse(const std::string& endpoint, const json& extra,
                                 GenerationRequest* out) {
    return endpoint == "chat" ? parser_->ParseChatCompletions(Body(endpoint, extra), out)
                              : parser_->ParseCompletions(Body(endpoint, extra), out);
  }

  std::unique_ptr<ByteTokenizer> tokenizer_;
  std::unique_ptr<ChatTemplate> template_;
  std::unique_ptr<RequestParser> parser_;
};

TEST_F(RequestParserTest, IgnoreEosAndMinTokensDefaultToOffAndZeroOnBothOpenAiEndpoints) {
  for (const std::string endpoint : {"completions", "chat"}) {
    SCOPED_TRACE(endpoint);
    GenerationRequest r;
    ASSERT_EQ(Parse(endpoint, json::object(), &r), std::nullopt);
    EXPECT_FALSE(r.params.ignore_eos);
    EXPECT_EQ(r.params.sampling.min_tokens, 0);
    // null is the default too, as for OpenAI's other optional parameters.
    ASSERT_EQ(Parse(endpoint, {{"ignore_eos", nullptr}, {"min_tokens", nullptr}}, &r),
              std::nullopt);
    EXPECT_FALSE(r.params.ignore_eos);
    EXPECT_EQ(r.params.sampling.min_tokens, 0);
  }
}

TEST_F(RequestParserTest, MinTokensIsAcceptedAndCarriedInTheSamplingParameters) {
  for (const std::string endpoint : {"completions", "chat"}) {
    SCOPED_TRACE(endpoint);
    GenerationRequest r;
    // Greedy (temperature 0): min_tokens survives the greedy parameters.
    ASSERT_EQ(Parse(endpoint, {{"min_tokens", 5}, {"max_tokens", 9}, {"temperature", 0}}, &r),
              std::nullopt);
    EXPECT_EQ(r.params.sampling.min_tokens, 5);
    EXPECT_EQ(r.params.sampling.temperature, 0.0f);
    EXPECT_EQ(r.params.max_new_tokens, 9);
    // Sampled, with ignore_eos, and equal to max_tokens (vLLM's bound is inclusive).
    ASSERT_EQ(
        Parse(endpoint,
              {{"min_tokens", 4}, {"max_tokens", 4}, {"temperature", 0.8}, {"ignore_eos", true}},
              &r),
        std::nullopt);
    EXPECT_EQ(r.params.sampling.min_tokens, 4);
    EXPECT_EQ(r.params.sampling.temperature, 0.8f);
    EXPECT_TRUE(r.params.ignore_eos);
  }
  // Chat's max_completion_tokens bounds it when given.
  GenerationRequest r;
  ASSERT_EQ(Parse("chat", {{"min_tokens", 6}, {"max_tokens", 2}, {"max_completion_tokens", 6}}, &r),
            std::nullopt);
  EXPECT_EQ(r.params.sampling.min_tokens, 6);
}

TEST_F(RequestParserTest, IgnoreEosIsAcceptedOnBothOpenAiEndpoints) {
  for (const std::string endpoint : {"completions", "chat"}) {
    SCOPED_TRACE(endpoint);
    GenerationRequest r;
    ASSERT_EQ(Parse(endpoint, {{"ignore_eos", true}, {"max_tokens", 7}, {"min_tokens", 0}}, &r),
              std::nullopt);
    EXPECT_TRUE(r.params.ignore_eos);
    EXPECT_EQ(r.params.max_new_tokens, 7);
    ASSERT_EQ(Parse(endpoint, {{"ignore_eos", false}}, &r), std::nullopt);
    EXPECT_FALSE(r.params.ignore_eos);
  }
}

TEST_F(RequestParserTest, BadIgnoreEosAndMinTokensValuesAreRefusedNamingTheParameter) {
  struct Case {
    std::string endpoint;
    json extra;
    std::string says;
  };
  const Case cases[] = {
      {"completions", {{"ignore_eos", "yes"}}, "`ignore_eos` must be a boolean"},
      {"chat", {{"ignore_eos", 1}}, "`ignore_eos` must be a boolean"},
      {"completions", {{"min_tokens", -1}}, "`min_tokens` must be an integer in [0, "},
      {"chat", {{"min_tokens", 1.5}}, "`min_tokens` must be an integer in [0, "},
      {"completions", {{"min_tokens", "3"}}, "`min_tokens` must be an integer in [0, "},
      // vLLM's rule: at most max_tokens, whichever name gave it (OpenAI's default is 16).
      {"completions",
       {{"min_tokens", 17}},
       "`min_tokens` must be at most `max_tokens` (16), got 17"},
      {"completions",
       {{"min_tokens", 5}, {"max_tokens", 4}},
       "`min_tokens` must be at most `max_tokens` (4), got 5"},
      {"chat",
       {{"min_tokens", 5}, {"max_tokens", 9}, {"max_completion_tokens", 4}},
       "`min_tokens` must be at most `max_completion_tokens` (4), got 5"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.endpoint + " " + c.extra.dump());
    GenerationRequest r;
    std::optional<HttpError> bad = Parse(c.endpoint, c.extra, &r);
    ASSERT_TRUE(bad.has_value());
    EXPECT_EQ(bad->status, 422);  // answered 400 on the OpenAI API (HttpFrontend)
    EXPECT_EQ(bad->api, Api::kOpenAi);
    EXPECT_THAT(bad->message, HasSubstr(c.says));
    // The refused parameter is named in the error's `param`.
    EXPECT_EQ(bad->param, c.says.substr(1, c.says.find('`', 1) - 1));
  }
}

TEST_F(RequestParserTest, TgiGenerateStillRefusesIgnoreEosAndMinTokens) {
  // TGI has neither: they stay unsupported parameters there, named in the refusal.
  for (const std::string key : {"ignore_eos", "min_tokens"}) {
    GenerationRequest r;
    const json value = key == "ignore_eos" ? json(true) : json(2);
    std::optional<HttpError> bad = parser_->ParseGenerate(
        json{{"inputs", "hi"}, {"parameters", {{key, value}}}}.dump(), false, &r);
    ASSERT_TRUE(bad.has_value()) << key;
    EXPECT_EQ(bad->status, 422);
    EXPECT_THAT(bad->message, HasSubstr("parameter `" + key + "` is not supported"));
  }
}

}  // namespace
}  // namespace kvcm::router
