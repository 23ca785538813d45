// The replies of both HTTP APIs, formatted without a socket (services/router/tgi_api.h,
// services/router/openai_api.h) from a Generation (services/router/generation.h) over a
// byte-level tokenizer: TGI's /generate (details, best_of, POST /'s list), its stream's last
// event, /tokenize's spans and its error shape; OpenAI's completion (a stop sequence cut,
// usage), a chat stream's role chunk, its errors (400 for 422) and token texts; and the
// per-choice bookkeeping both share (Shown, StopSequenceSeen); TGI's /info with the pool's
// KV cache groups.

#include <memory>
#include <string>
#include <vector>

#include "common/sizing/kv_cache_groups.h"
#include "common/sizing/kv_cache_spec.h"
#include "common/tokenizer/tokenizer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "services/router/generation.h"
#include "services/router/openai_api.h"
#include "services/router/tgi_api.h"

namespace kvcm::router {
namespace {

using json = nlohmann::json;

// ByteTokenizer's id of byte `c`.
int32_t Id(char c) { return static_cast<unsigned char>(c) + ByteTokenizer::kByteOffset; }

class ApiRepliesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<ByteTokenizer>> tokenizer = ByteTokenizer::Create(320);
    ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
    tokenizer_ = *std::move(tokenizer);
  }

  // A request for "hi" that generated `texts`, one choice each, with these log-probabilities
  // per token.
  static Generation Generated(Api api, const std::vector<std::string>& texts,
                              const std::vector<float>& logprob_per_choice) {
    Generation g;
    g.api = api;
    g.prompt_text = "hi";
    g.prompt = {ByteTokenizer::kBosId, Id('h'), Id('i')};
    g.prompt_tokens = g.prompt.size();
    for (size_t k = 0; k < texts.size(); ++k) {
      Choice& c = g.choices.emplace_back();
      for (char ch : texts[k]) {
        c.generated.push_back(Id(ch));
        c.logprobs.push_back(logprob_per_choice[k]);
        c.sum_logprob += logprob_per_choice[k];
      }
      c.text = texts[k];
      c.finish_reason = "length";
      c.done = true;
    }
    return g;
  }

  std::unique_ptr<ByteTokenizer> tokenizer_;
};

TEST_F(ApiRepliesTest, TgiReplyShowsTheBestChoiceAndTheOthersBestFirst) {
  Generation g = Generated(Api::kTgi, {"ab", "cd", "ef"}, {-2.0f, -0.5f, -1.0f});
  g.params.details = true;
  g.params.outputs.logprobs = true;
  const json reply = json::parse(TgiReply(g, *tokenizer_));
  EXPECT_EQ(reply["generated_text"], "cd");
  EXPECT_EQ(reply["details"]["finish_reason"], "length");
  EXPECT_EQ(reply["details"]["generated_tokens"], 2);
  EXPECT_TRUE(reply["details"]["seed"].is_null());
  EXPECT_EQ(reply["details"]["prefill"], json::array());
  ASSERT_EQ(reply["details"]["tokens"].size(), 2u);
  EXPECT_EQ(reply["details"]["tokens"][0],
            json({{"id", Id('c')}, {"text", "c"}, {"logprob", -0.5}, {"special", false}}));
  ASSERT_EQ(reply["details"]["best_of_sequences"].size(), 2u);
  EXPECT_EQ(reply["details"]["best_of_sequences"][0]["generated_text"], "ef");
  EXPECT_EQ(reply["details"]["best_of_sequences"][1]["generated_text"], "ab");
}

TEST_F(ApiRepliesTest, TgiReplyOfPostSlashIsAListOfOneWithTheFullText) {
  Generation g = Generated(Api::kTgi, {"!"}, {-1.0f});
  g.as_list = true;
  g.params.return_full_text = true;
  EXPECT_EQ(TgiReply(g, *tokenizer_), R"([{"generated_text":"hi!"}])");
}

TEST_F(ApiRepliesTest, TgiLastStreamEventCarriesTheTextAndTheSeed) {
  Generation g = Generated(Api::kTgi, {"ok"}, {-0.25f});
  g.params.do_sample = true;
  g.params.seed = 7;
  std::string event;
  AppendTgiTokenEvent(g, 0, Id('k'), -0.25f, /*finished=*/true, "k", *tokenizer_, &event);
  const json parsed = json::parse(event);
  EXPECT_EQ(parsed["index"], 1);
  EXPECT_EQ(parsed["token"]["text"], "k");
  EXPECT_EQ(parsed["generated_text"], "ok");
  EXPECT_EQ(parsed["details"]["seed"], 7);
  EXPECT_EQ(parsed["details"]["input_length"], 3);
}

TEST_F(ApiRepliesTest, TgiTokenizeSpansTheBytesOfTheInputsAndBosNothing) {
  const std::vector<int32_t> ids = {ByteTokenizer::kBosId, Id('h'), Id('i')};
  const json reply = json::parse(TgiTokenizeReply(R"({"inputs":"hi"})", ids, *tokenizer_));
  ASSERT_EQ(reply.size(), 3u);
  EXPECT_EQ(reply[0], json({{"id", 1}, {"text", ""}, {"start", 0}, {"stop", 0}}));
  EXPECT_EQ(reply[1], json({{"id", Id('h')}, {"text", "h"}, {"start", 0}, {"stop", 1}}));
  EXPECT_EQ(reply[2], json({{"id", Id('i')}, {"text", "i"}, {"start", 1}, {"stop", 2}}));
}

TEST_F(ApiRepliesTest, ErrorsHaveTheirApisShapes) {
  const HttpError error{422, "bad `x`", "validation", "x", Api::kOpenAi};
  EXPECT_EQ(Dump(TgiErrorBody(error)), R"({"error":"bad `x`","error_type":"validation"})");
  EXPECT_EQ(Dump(OpenAiErrorBody(error)),
            R"({"error":{"code":null,"message":"bad `x`","param":"x",)"
            R"("type":"invalid_request_error"}})");
  EXPECT_EQ(OpenAiErrorStatus(422), 400);
  EXPECT_EQ(OpenAiErrorStatus(429), 429);
  EXPECT_EQ(OpenAiErrorBody({503, "down", "unavailable"})["error"]["type"], "service_unavailable");
}

TEST_F(ApiRepliesTest, OpenAiCompletionStopsBeforeItsStopSequenceAndCountsUsage) {
  Generation g = Generated(Api::kOpenAi, {"yes.no"}, {-1.0f});
  g.choices[0].finish_reason = "stop_sequence";
  g.choices[0].stop_at = 3;
  g.completion_id = OpenAiCompletionId(/*chat=*/false, 5);
  g.created = 123;
  g.cached_prompt_tokens = 2;
  const json reply = json::parse(OpenAiReply(g, *tokenizer_, "tiny"));
  EXPECT_EQ(reply["id"], "cmpl-5");
  EXPECT_EQ(reply["object"], "text_completion");
  EXPECT_EQ(reply["model"], "tiny");
  EXPECT_EQ(reply["system_fingerprint"], "kvcm-router-0.1.0");
  ASSERT_EQ(reply["choices"].size(), 1u);
  EXPECT_EQ(reply["choices"][0]["text"], "yes");
  EXPECT_EQ(reply["choices"][0]["finish_reason"], "stop");
  EXPECT_TRUE(reply["choices"][0]["logprobs"].is_null());
  EXPECT_EQ(reply["usage"], json({{"prompt_tokens", 3},
                                  {"completion_tokens", 6},
                                  {"total_tokens", 9},
                                  {"prompt_tokens_details", {{"cached_tokens", 2}}}}));
}

TEST_F(ApiRepliesTest, OpenAiShowsTheBestNOfBestOf) {
  Generation g = Generated(Api::kOpenAi, {"a", "b", "c"}, {-3.0f, -1.0f, -2.0f});
  g.shown = 2;
  const json reply = json::parse(OpenAiReply(g, *tokenizer_, "tiny"));
  ASSERT_EQ(reply["choices"].size(), 2u);
  EXPECT_EQ(reply["choices"][0]["text"], "b");
  EXPECT_EQ(reply["choices"][0]["index"], 0);
  EXPECT_EQ(reply["choices"][1]["text"], "c");
  EXPECT_EQ(Shown(g), (std::vector<size_t>{1, 2}));
}

TEST_F(ApiRepliesTest, OpenAiChatStreamStartsWithTheRoleAndLogprobsShowTokens) {
  Generation g = Generated(Api::kOpenAi, {"x"}, {-1.0f});
  g.chat = true;
  g.stream = true;
  g.completion_id = OpenAiCompletionId(/*chat=*/true, 9);
  const json role = json::parse(OpenAiRoleChunk(g, 0, "tiny"));
  EXPECT_EQ(role["object"], "chat.completion.chunk");
  EXPECT_EQ(role["id"], "chatcmpl-9");
  EXPECT_EQ(role["choices"][0]["delta"], json({{"role", "assistant"}, {"content", ""}}));
  EXPECT_TRUE(role["choices"][0]["finish_reason"].is_null());
  g.params.show_logprobs = true;
  const json token =
      json::parse(OpenAiTokenChunk(g, 0, /*finished=*/true, "x", *tokenizer_, "tiny"));
  EXPECT_EQ(token["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(token["choices"][0]["logprobs"]["content"][0]["token"], "x");
  EXPECT_EQ(token["choices"][0]["logprobs"]["content"][0]["bytes"], json({'x'}));
  EXPECT_EQ(OpenAiTokenText(5, "\xC3"), "bytes:\\xc3");
  EXPECT_EQ(OpenAiTokenText(5, ""), "token_id:5");
}

TEST_F(ApiRepliesTest, AStopSequenceIsFoundWhereItEndsInTheNewText) {
  Generation g = Generated(Api::kTgi, {"abc"}, {-1.0f});
  g.params.stop = {"cd"};
  IncrementalDecoder::Piece piece;
  piece.ready = "de";
  EXPECT_EQ(StopSequenceSeen(g, g.choices[0], piece), 2u);
  piece.ready = "xy";
  EXPECT_EQ(StopSequenceSeen(g, g.choices[0], piece), std::nullopt);
  g.params.sampling.min_tokens = 3;  // nothing is looked for while they come out
  piece.ready = "de";
  EXPECT_EQ(StopSequenceSeen(g, g.choices[0], piece), std::nullopt);
}

// With echo, a generated token's text_offset counts the prompt's text as echoed, in the
// unstreamed reply and in the stream alike, even where the prompt's tokens decode to other
// text (as after a normalizer): "hi there" is echoed, its tokens spell "hi".
TEST_F(ApiRepliesTest, EchoedCompletionOffsetsCountThePromptTextAsEchoed) {
  Generation g = Generated(Api::kOpenAi, {"ab"}, {-1.0f});
  g.prompt_text = "hi there";
  g.params.return_full_text = true;
  g.params.show_logprobs = true;
  const json reply = json::parse(OpenAiReply(g, *tokenizer_, "m"));
  const json& offsets = reply["choices"][0]["logprobs"]["text_offset"];
  ASSERT_EQ(offsets.size(), 5u);  // BOS, h, i, then a, b
  EXPECT_EQ(offsets[3], 8);
  EXPECT_EQ(offsets[4], 9);

  // The same choice streamed: its first chunk echoes the prompt, the second does not.
  Choice& c = g.choices[0];
  c.generated = {Id('a')};
  c.text = "a";
  c.done = false;
  const json first = json::parse(OpenAiTokenChunk(g, 0, false, "a", *tokenizer_, "m"));
  const json& first_offsets = first["choices"][0]["logprobs"]["text_offset"];
  ASSERT_EQ(first_offsets.size(), 4u);
  EXPECT_EQ(first_offsets[3], 8);
  c.generated.push_back(Id('b'));
  c.text = "ab";
  const json second = json::parse(OpenAiTokenChunk(g, 0, true, "b", *tokenizer_, "m"));
  EXPECT_EQ(second["choices"][0]["logprobs"]["text_offset"], json::array({9}));
}

// /info's kv_cache_groups of a Gemma-3-1B-shaped pool (docs/kv-cache-sizing.md, "KV cache
// groups"): 26 layers, every sixth full, the others a window of 512; pages of 4 slots of one
// KV head of 256 in bf16, blocks of 16.
TEST(TgiInfoTest, KvCacheGroupsShowEachGroupsWindowLayersBytesAndBlocks) {
  std::vector<int32_t> windows(26, 512);
  for (int32_t layer : {5, 11, 17, 23}) windows[static_cast<size_t>(layer)] = 0;
  absl::StatusOr<KvCacheGroups> groups = GroupLayers(windows);
  ASSERT_TRUE(groups.ok()) << groups.status();
  const KvCacheSpec page{.num_layers = 4,
                         .num_kv_heads = 1,
                         .head_dim = 256,
                         .dtype = DType::kBFloat16,
                         .block_size = 16};
  const std::vector<TgiKvCacheGroup> shown =
      TgiKvCacheGroups(page, groups->groups, /*sliding_window_tokens=*/0, 32768);
  ASSERT_EQ(shown.size(), 7u);
  // 2 (K and V) x 4 slots x 1 head x 256 x 2 bytes, whatever the group's layers.
  EXPECT_EQ(shown[0], (TgiKvCacheGroup{0, {5, 11, 17, 23}, 4096, 2048}));
  EXPECT_EQ(shown[1], (TgiKvCacheGroup{512, {0, 7, 14, 21}, 4096, 34}));  // 512 / 16 + 2
  EXPECT_EQ(shown[6], (TgiKvCacheGroup{512, {6, 13, 20}, 4096, 34}));
  // A sequence shorter than the window holds all of its blocks in every group.
  EXPECT_EQ(TgiKvCacheGroups(page, groups->groups, 0, 100)[3].max_blocks_per_sequence, 7);
}

TEST(TgiInfoTest, WithoutGroupsThePoolIsOneGroupOfEveryLayer) {
  const KvCacheSpec llama{.num_layers = 32,
                          .num_kv_heads = 8,
                          .head_dim = 128,
                          .dtype = DType::kBFloat16,
                          .block_size = 16};
  std::vector<int32_t> all(32);
  for (int32_t layer = 0; layer < 32; ++layer) all[static_cast<size_t>(layer)] = layer;
  EXPECT_THAT(TgiKvCacheGroups(llama, {}, 0, 4096),
              ::testing::ElementsAre(TgiKvCacheGroup{0, all, 131072, 256}));
  // A pool window of 4,096 tokens (Mistral 7B v0.1): 258 blocks of a 32K-token sequence.
  EXPECT_THAT(TgiKvCacheGroups(llama, {}, 4096, 32768),
              ::testing::ElementsAre(TgiKvCacheGroup{4096, all, 131072, 258}));
}

TEST(TgiInfoTest, ReplyKeepsTgisFieldsAndAddsTheGroups) {
  TgiInfo info;
  info.model_id = "tiny";
  info.block_size = 4;
  info.num_blocks = 512;
  info.max_batch_total_tokens = 2048;
  info.max_batch_prefill_tokens = 4096;
  info.max_input_tokens = 1024;
  info.max_total_tokens = 2048;
  info.max_concurrent_requests = 128;
  info.max_top_n_tokens = 5;
  info.max_best_of = 4;
  info.executors = 1;
  info.kv_cache_groups = {{0, {0}, 512, 512}, {6, {1}, 512, 4}};
  const json body = json::parse(TgiInfoReply(info));
  // TGI's own fields, as its clients parse them.
  EXPECT_EQ(body.at("model_id"), "tiny");
  EXPECT_TRUE(body.at("model_dtype").is_null());
  EXPECT_EQ(body.at("max_total_tokens"), 2048);
  EXPECT_EQ(body.at("max_input_tokens"), 1024);
  EXPECT_EQ(body.at("max_batch_total_tokens"), 2048);
  EXPECT_EQ(body.at("max_concurrent_requests"), 128);
  EXPECT_EQ(body.at("max_best_of"), 4);
  EXPECT_EQ(body.at("max_stop_sequences"), 4);
  EXPECT_EQ(body.at("max_total_tokens_in_pool"), 2048);
  EXPECT_EQ(body.at("router"), "kvcm-router");
  EXPECT_EQ(body.at("kv_cache_groups"), json::parse(R"([
    {"group": 0, "window_tokens": 0, "layers": [0], "bytes_per_token": 512,
     "max_blocks_per_sequence": 512},
    {"group": 1, "window_tokens": 6, "layers": [1], "bytes_per_token": 512,
     "max_blocks_per_sequence": 4}])"));
}

}  // namespace
}  // namespace kvcm::router
