// The official Python clients, unchanged, against the whole stack: Hugging Face's
// `text-generation` and `openai`, from PyPI (scripts/python-env.sh puts them into
// BUILD_DIR/venv). tests/clients/official_clients.py makes the calls through each client's
// own response models and prints what came back; this test checks it against the model run
// alone in this process.

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/services/router/router_stack.h"
#include "tests/support/status_matchers.h"
#include "tests/support/subprocess.h"

namespace kvcm {
namespace {

using ::testing::HasSubstr;
using namespace ::kvcm::testing;  // NOLINT: the stack's helpers

using OfficialClientsTest = RouterStackTest;

// The greedy tokens up to and including the first EOS.
std::vector<int32_t> UpToEos(std::vector<int32_t> tokens, const std::vector<int32_t>& eos) {
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (std::find(eos.begin(), eos.end(), tokens[i]) != eos.end()) {
      tokens.resize(i + 1);
      break;
    }
  }
  return tokens;
}

TEST_F(OfficialClientsTest, TextGenerationAndOpenAiClientsWorkUnchanged) {
  const std::string python = KVCM_CLIENTS_PYTHON;
  ASSERT_TRUE(std::filesystem::exists(python))
      << python << " is missing: scripts/python-env.sh makes it (scripts/test.sh runs it)";
  // The tiny model has no chat template: the router is given ChatML's.
  const std::string template_path = dir_->path() + "/chatml.jinja";
  {
    std::ofstream out(template_path);
    out << "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + "
           "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}"
           "{{ '<|im_start|>assistant\n' }}{% endif %}";
  }
  ASSERT_NO_FATAL_FAILURE(
      StartStack(/*num_blocks=*/128, /*executors=*/1,
                 {"--max-input-tokens", "64", "--chat-template", template_path}));
  const std::string chat = "Hi, kvcm";
  const std::string rendered = "<|im_start|>user\n" + chat + "<|im_end|>\n<|im_start|>assistant\n";
  const std::string prompt = "Clients from PyPI talk to kvcm";  // BOS + 30 bytes
  const int32_t n = 8;
  absl::StatusOr<RunResult> run = RunProgram(
      {python, KVCM_CLIENTS_SCRIPT, "--url", url_, "--prompt", prompt, "--max-new-tokens",
       std::to_string(n), "--too-long", std::string(100, 'x'), "--chat", chat},
      "", absl::Seconds(120));
  ASSERT_THAT(run, IsOk());
  ASSERT_EQ(run->exit_code, 0) << run->output << "\n" << router_->Output();
  const std::vector<std::string> lines = absl::StrSplit(run->output, '\n', absl::SkipEmpty());
  ASSERT_FALSE(lines.empty());
  const json report = json::parse(lines.back(), nullptr, false);
  ASSERT_FALSE(report.is_discarded()) << run->output;
  std::printf("clients: %s\n", report["versions"].dump().c_str());

  const ReferenceScores want = Score(*model_, PromptIds(prompt), n);
  const std::vector<int32_t> tokens = UpToEos(want.tokens, model_->config().eos_token_ids);
  const json& tgi = report["tgi"];
  // Client.generate with details, decoder_input_details and top_n_tokens.
  EXPECT_EQ(tgi["generate"]["ids"].get<std::vector<int32_t>>(), tokens);
  EXPECT_EQ(tgi["generate"]["generated_text"].get<std::string>(), AsJsonText(BytesOf(tokens)));
  EXPECT_EQ(tgi["generate"]["finish_reason"], tokens.size() < n ? "eos_token" : "length");
  ASSERT_EQ(tgi["generate"]["logprobs"].size(), tokens.size());
  for (size_t i = 0; i < tokens.size(); ++i) {
    EXPECT_NEAR(tgi["generate"]["logprobs"][i].get<double>(), want.logprobs[i], 1e-3);
    EXPECT_EQ(tgi["generate"]["top_tokens"][i].size(), 2u);
  }
  EXPECT_EQ(tgi["generate"]["prefill_ids"].get<std::vector<int32_t>>(), PromptIds(prompt));
  EXPECT_TRUE(tgi["generate"]["prefill_logprobs"][0].is_null());
  EXPECT_NEAR(tgi["generate"]["prefill_logprobs"][5].get<double>(), want.prompt[4], 1e-3);
  // generate_stream: the same tokens, the text on the last event only.
  EXPECT_EQ(tgi["generate_stream"]["ids"].get<std::vector<int32_t>>(), tokens);
  EXPECT_EQ(tgi["generate_stream"]["generated_text"].get<std::string>(),
            AsJsonText(BytesOf(tokens)));
  EXPECT_TRUE(tgi["generate_stream"]["intermediate_texts_null"].get<bool>());
  // Sampling with a seed: the same tokens twice, the seed reported.
  EXPECT_EQ(tgi["sampled"]["ids"][0], tgi["sampled"]["ids"][1]);
  EXPECT_EQ(tgi["sampled"]["seeds"][0], 42);
  // best_of = 2: the client parses best_of_sequences; the two seeds are consecutive.
  ASSERT_EQ(tgi["best_of"]["others"].size(), 1u) << tgi["best_of"].dump();
  EXPECT_EQ(std::abs(tgi["best_of"]["seed"].get<int64_t>() -
                     tgi["best_of"]["others"][0]["seed"].get<int64_t>()),
            1);
  // A prompt over --max-input-tokens: the client raises its ValidationError (our 422).
  EXPECT_EQ(tgi["too_long"]["raised"], "ValidationError");
  EXPECT_THAT(tgi["too_long"]["message"].get<std::string>(), HasSubstr("less than 64 tokens"));

  const json& oa = report["openai"];
  EXPECT_EQ(oa["model"], "tiny");
  ASSERT_EQ(oa["completions"].size(), 2u);
  for (const json& c : oa["completions"]) {
    EXPECT_EQ(c["text"].get<std::string>(), AsJsonText(BytesOf(tokens)));
    EXPECT_EQ(c["prompt_tokens"], 31);
    EXPECT_EQ(c["completion_tokens"], tokens.size());
    ASSERT_EQ(c["token_logprobs"].size(), tokens.size());
    EXPECT_NEAR(c["token_logprobs"][0].get<double>(), want.logprobs[0], 1e-3);
    EXPECT_EQ(c["top_logprobs"][0], 2);
  }
  // The TGI calls before left the prompt's 7 full blocks of 4 in the prefix cache.
  EXPECT_EQ(oa["completions"][0]["cached_tokens"], 28);
  EXPECT_EQ(oa["completions"][1]["cached_tokens"], 28);
  EXPECT_EQ(oa["completions_stream"]["text"].get<std::string>(), AsJsonText(BytesOf(tokens)));
  EXPECT_EQ(oa["completions_stream"]["completion_tokens"], tokens.size());
  EXPECT_EQ(oa["completions_stream"]["cached_tokens"], 28);
  // n = 2: two choices, indexed.
  EXPECT_EQ(oa["n"]["indices"], json::array({0, 1}));
  EXPECT_EQ(oa["n"]["texts"].size(), 2u);
  // chat.completions.create, streamed and not: the rendered template's bytes (no BOS: the
  // template writes what the model wants), then the model's greedy answer.
  std::vector<int32_t> chat_ids;
  for (unsigned char c : rendered) chat_ids.push_back(3 + c);
  const std::vector<int32_t> chat_tokens =
      UpToEos(Score(*model_, chat_ids, n).tokens, model_->config().eos_token_ids);
  std::vector<int32_t> chat_text_tokens = chat_tokens;
  if (!chat_text_tokens.empty() && chat_text_tokens.back() == 2) chat_text_tokens.pop_back();
  EXPECT_EQ(oa["chat"]["content"].get<std::string>(), AsJsonText(BytesOf(chat_text_tokens)));
  EXPECT_EQ(oa["chat"]["role"], "assistant");
  EXPECT_EQ(oa["chat"]["prompt_tokens"], chat_ids.size());
  EXPECT_EQ(oa["chat"]["completion_tokens"], chat_tokens.size());
  EXPECT_EQ(oa["chat_stream"]["content"], oa["chat"]["content"]);
  // Every delta names the role, as TGI's (its TextMessage requires role and content).
  EXPECT_FALSE(oa["chat_stream"]["roles"].empty());
  for (const json& role : oa["chat_stream"]["roles"]) EXPECT_EQ(role, "assistant");
  EXPECT_EQ(oa["chat_stream"]["completion_tokens"], chat_tokens.size());
  // n = 99 is refused in OpenAI's error shape, which the client turns into BadRequestError.
  EXPECT_EQ(oa["bad_request"]["raised"], "BadRequestError");
  EXPECT_EQ(oa["bad_request"]["status"], 400);
  EXPECT_EQ(oa["bad_request"]["param"], "n");

  EXPECT_TRUE(AwaitNoBlockInUse());
  ExpectWhole(Stats());
}

}  // namespace
}  // namespace kvcm
