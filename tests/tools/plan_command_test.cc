#include "tools/kvcmctl/plan_command.h"

#include <fstream>
#include <sstream>
#include <string>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "common/sizing/kv_cache_spec.h"
#include "common/sizing/pool_plan.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/support/status_matchers.h"
#include "tools/kvcmctl/command.h"
#include "tools/kvcmctl/flag_parser.h"

namespace kvcm::kvcmctl {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kGiB = int64_t{1} << 30;

absl::StatusOr<PlanOptions> Parse(std::vector<std::string> args) { return ParsePlanOptions(args); }

// The message of a parse that must fail with INVALID_ARGUMENT.
std::string ParseError(std::vector<std::string> args) {
  const absl::StatusOr<PlanOptions> options = ParsePlanOptions(args);
  EXPECT_EQ(options.status().code(), absl::StatusCode::kInvalidArgument);
  return std::string(options.status().message());
}

// Llama-3-8B's shape by dimension flags, followed by `more`.
std::vector<std::string> Shape(std::vector<std::string> more) {
  std::vector<std::string> args = {"--layers", "32", "--kv-heads", "8", "--head-dim", "128"};
  args.insert(args.end(), more.begin(), more.end());
  return args;
}

TEST(ParseFlagsTest, FormsAndErrors) {
  constexpr FlagSpec kSpecs[] = {{"n", "N", ""}, {"on", "", ""}};
  const std::vector<std::string> args = {"--n=3", "--on", "pos", "--", "--n"};
  const absl::StatusOr<ParsedFlags> flags = ParseFlags(kSpecs, args);
  ASSERT_THAT(flags, IsOk());
  EXPECT_EQ(flags->Get("n"), "3");
  EXPECT_TRUE(flags->Has("on"));
  EXPECT_EQ(flags->positional(), (std::vector<std::string>{"pos", "--n"}));

  auto error = [&](std::vector<std::string> bad) {
    return std::string(ParseFlags(kSpecs, bad).status().message());
  };
  EXPECT_EQ(error({"--x"}), "unknown flag --x");
  EXPECT_EQ(error({"--n", "1", "--n", "2"}), "flag --n given more than once");
  EXPECT_EQ(error({"--n"}), "flag --n needs a value (--n N)");
  EXPECT_EQ(error({"--n", "--on"}), "flag --n needs a value (--n N)");
  EXPECT_EQ(error({"--on=yes"}), "flag --on takes no value, got \"yes\"");
  EXPECT_THAT(error({"-n", "3"}), HasSubstr("unknown flag \"-n\""));
}

TEST(ParsePlanOptionsTest, DimensionsAndDefaults) {
  const absl::StatusOr<PlanOptions> options = Parse(Shape({"--pool-bytes", "64GiB"}));
  ASSERT_THAT(options, IsOk());
  EXPECT_EQ(options->num_layers, 32);
  EXPECT_EQ(options->num_kv_heads, 8);
  EXPECT_EQ(options->head_dim, 128);
  EXPECT_FALSE(options->dtype.has_value());
  EXPECT_EQ(options->block_size, 16);
  EXPECT_EQ(options->seq_len, 4096);
  EXPECT_FALSE(options->json);
  EXPECT_EQ(std::get<PoolBytesBudget>(options->budget.kind).bytes, 64 * kGiB);
}

TEST(ParsePlanOptionsTest, AllFlags) {
  const absl::StatusOr<PlanOptions> options =
      Parse(Shape({"--dtype", "fp8", "--block-size", "32", "--memory-fraction", "0.8",
                   "--free-memory", "70GB", "--margin", "0.05", "--seq-len", "8192", "--json"}));
  ASSERT_THAT(options, IsOk());
  EXPECT_EQ(options->dtype, DType::kFloat8E4M3);
  EXPECT_EQ(options->block_size, 32);
  EXPECT_EQ(options->seq_len, 8192);
  EXPECT_TRUE(options->json);
  const auto& budget = std::get<MemoryFractionBudget>(options->budget.kind);
  EXPECT_EQ(budget.free_bytes, 70'000'000'000);
  EXPECT_EQ(budget.fraction, 0.8);
  EXPECT_EQ(budget.margin, 0.05);
}

TEST(ParsePlanOptionsTest, MemoryFractionDefaultMargin) {
  const absl::StatusOr<PlanOptions> options =
      Parse(Shape({"--memory-fraction", "0.9", "--free-memory", "80GiB"}));
  ASSERT_THAT(options, IsOk());
  EXPECT_EQ(std::get<MemoryFractionBudget>(options->budget.kind).margin, kDefaultMemoryMargin);
}

TEST(ParsePlanOptionsTest, ModelConfig) {
  const absl::StatusOr<PlanOptions> options =
      Parse({"--model-config", "x/config.json", "--num-blocks", "100"});
  ASSERT_THAT(options, IsOk());
  EXPECT_EQ(options->model_config, "x/config.json");
  EXPECT_EQ(std::get<BlockCountBudget>(options->budget.kind).num_blocks, 100);
}

TEST(ParsePlanOptionsTest, Help) {
  EXPECT_TRUE(Parse({"--help"})->help);
  EXPECT_TRUE(Parse({"-h"})->help);
  EXPECT_THAT(PlanUsage(), HasSubstr("--model-config PATH"));
}

TEST(ParsePlanOptionsTest, SizingFlagErrors) {
  EXPECT_THAT(ParseError(Shape({})), HasSubstr("no pool size given"));
  EXPECT_THAT(ParseError(Shape(
                  {"--pool-bytes", "1GiB", "--memory-fraction", "0.5", "--free-memory", "2GiB"})),
              HasSubstr("conflicting pool sizes --pool-bytes and --memory-fraction"));
  EXPECT_THAT(ParseError(Shape({"--memory-fraction", "0.9"})), HasSubstr("needs --free-memory"));
  EXPECT_THAT(ParseError(Shape({"--pool-bytes", "1GiB", "--margin", "0.1"})),
              HasSubstr("--margin: only applies with --memory-fraction"));
  EXPECT_THAT(ParseError(Shape({"--num-blocks", "8", "--free-memory", "1GiB"})),
              HasSubstr("--free-memory: only applies with --memory-fraction"));
  EXPECT_THAT(ParseError(Shape({"--memory-fraction", "1.5", "--free-memory", "1GiB"})),
              HasSubstr("--memory-fraction: must be in (0, 1]"));
  EXPECT_THAT(ParseError(Shape({"--memory-fraction", "nan", "--free-memory", "1GiB"})),
              HasSubstr("--memory-fraction: must be in (0, 1]"));
  EXPECT_THAT(
      ParseError(Shape({"--memory-fraction", "0.9", "--free-memory", "1GiB", "--margin", "1"})),
      HasSubstr("--margin: must be in [0, 1)"));
  EXPECT_THAT(ParseError(Shape({"--pool-bytes", "0"})), HasSubstr("--pool-bytes: must be"));
  EXPECT_THAT(ParseError(Shape({"--pool-bytes", "-5GiB"})), HasSubstr("negative"));
  EXPECT_THAT(ParseError(Shape({"--num-blocks", "0"})), HasSubstr("--num-blocks: must be in"));
  EXPECT_THAT(ParseError(Shape({"--num-blocks", "3000000000"})),
              HasSubstr("--num-blocks: must be in [1, 2147483647]"));
}

TEST(ParsePlanOptionsTest, ShapeErrors) {
  EXPECT_THAT(ParseError({"--pool-bytes", "1GiB"}), HasSubstr("missing --layers"));
  EXPECT_THAT(ParseError({"--model-config", "c.json", "--layers", "2", "--pool-bytes", "1GiB"}),
              HasSubstr("--model-config and --layers cannot be combined"));
  EXPECT_THAT(ParseError(Shape({"--pool-bytes", "1GiB", "--layers", "3"})),
              HasSubstr("given more than once"));
  EXPECT_THAT(
      ParseError({"--layers", "x", "--kv-heads", "8", "--head-dim", "128", "--pool-bytes", "1GiB"}),
      HasSubstr("--layers: expected a positive integer, got \"x\""));
  EXPECT_THAT(ParseError({"--layers", "-3", "--kv-heads", "8", "--head-dim", "128", "--pool-bytes",
                          "1GiB"}),
              HasSubstr("--layers: must be in [1, "));
  EXPECT_THAT(ParseError(Shape({"--pool-bytes", "1GiB", "--block-size", "4096"})),
              HasSubstr("--block-size: must be in [1, 1024]"));
  EXPECT_THAT(ParseError(Shape({"--pool-bytes", "1GiB", "--dtype", "int4"})),
              HasSubstr("--dtype: unknown dtype \"int4\""));
  EXPECT_THAT(ParseError(Shape({"--pool-bytes", "1GiB", "--seq-len", "0"})),
              HasSubstr("--seq-len: must be in"));
  EXPECT_THAT(ParseError(Shape({"--pool-bytes", "1GiB", "extra"})),
              HasSubstr("unexpected argument \"extra\""));
}

TEST(BuildPlanReportTest, FiguresAndSequenceLengths) {
  const PlanOptions options = *Parse(Shape({"--pool-bytes", "64GiB", "--seq-len", "1000"}));
  const absl::StatusOr<PlanReport> report = BuildPlanReport(options);
  ASSERT_THAT(report, IsOk());
  // bf16 by default with dimension flags: 131072 B/token, 2 MiB/block, 32768 blocks.
  EXPECT_EQ(report->plan.spec.dtype, DType::kBFloat16);
  EXPECT_EQ(report->plan.num_blocks, 32768);
  ASSERT_EQ(report->fits.size(), 4u);  // 1000, 1024, 4096, 32768
  EXPECT_EQ(report->fits[0].seq_len, 1000);
  EXPECT_EQ(report->fits[0].num_sequences, 520);
  EXPECT_EQ(report->fits[3].seq_len, 32768);
}

TEST(BuildPlanReportTest, JsonCarriesTheFigures) {
  const PlanReport report = *BuildPlanReport(*Parse(Shape({"--num-blocks", "4096"})));
  const nlohmann::json j = nlohmann::json::parse(FormatPlanJson(report));
  EXPECT_EQ(j["num_blocks"], 4096);
  EXPECT_EQ(j["pool_bytes"], 8 * kGiB);
  EXPECT_EQ(j["max_total_tokens"], 65536);
  EXPECT_EQ(j["budget"]["kind"], "num-blocks");
  EXPECT_EQ(j["budget"]["num_blocks"], 4096);
  EXPECT_EQ(j["sequences"].size(), 3u);
  EXPECT_FALSE(j.contains("model_config"));
}

// Mistral 7B v0.1's KV-relevant keys: a 4,096-token window on every layer. The plan shows
// what a decoding sequence holds with the blocks behind the window released; a model that
// mixes windowed and full layers (Gemma 2) shows none.
TEST(BuildPlanReportTest, AModelWindowShowsWhatADecodingSequenceHolds) {
  const std::string path = ::testing::TempDir() + "/mistral_config.json";
  nlohmann::json config = {{"architectures", {"MistralForCausalLM"}},
                           {"model_type", "mistral"},
                           {"num_hidden_layers", 32},
                           {"num_attention_heads", 32},
                           {"num_key_value_heads", 8},
                           {"head_dim", 128},
                           {"hidden_size", 4096},
                           {"sliding_window", 4096},
                           {"torch_dtype", "bfloat16"}};
  std::ofstream(path) << config.dump();
  absl::StatusOr<PlanReport> report =
      BuildPlanReport(*Parse({"--model-config", path, "--pool-bytes", "16GiB"}));
  ASSERT_THAT(report, IsOk());
  EXPECT_EQ(report->sliding_window, 4096);
  // 128 KiB per token, 2 MiB per block: 8192 blocks; a 32K-token sequence has 2048 of them,
  // and holds 4096 / 16 + 2 = 258 while it decodes.
  EXPECT_EQ(report->plan.num_blocks, 8192);
  const nlohmann::json j = nlohmann::json::parse(FormatPlanJson(*report));
  EXPECT_EQ(j["sliding_window_tokens"], 4096);
  const nlohmann::json& longest = j["sequences"].back();
  EXPECT_EQ(longest["seq_len"], 32768);
  EXPECT_EQ(longest["num_sequences"], 4);
  EXPECT_EQ(longest["window_blocks_per_sequence"], 258);
  EXPECT_EQ(longest["window_sequences"], 31);
  EXPECT_EQ(j["sequences"][0]["window_blocks_per_sequence"], 64);  // 1,024 tokens: all
  EXPECT_THAT(FormatPlanText(*report), HasSubstr("With the model's sliding window of 4096"));

  config["model_type"] = "gemma2";  // every other layer slides: every block is kept
  config["architectures"] = {"Gemma2ForCausalLM"};
  std::ofstream(path) << config.dump();
  report = BuildPlanReport(*Parse({"--model-config", path, "--pool-bytes", "16GiB"}));
  ASSERT_THAT(report, IsOk());
  EXPECT_EQ(report->sliding_window, 0);
  EXPECT_FALSE(nlohmann::json::parse(FormatPlanJson(*report)).contains("sliding_window_tokens"));
  EXPECT_THAT(FormatPlanText(*report), ::testing::Not(HasSubstr("With the model's sliding")));
}

TEST(RunPlanCommandTest, ExitCodes) {
  std::ostringstream out;
  std::ostringstream err;
  EXPECT_EQ(RunPlanCommand(Shape({"--pool-bytes", "1GiB"}), out, err), kExitOk);
  EXPECT_THAT(out.str(), HasSubstr("num_blocks       = floor(1073741824 / 2097152) = 512"));
  EXPECT_EQ(err.str(), "");

  out.str("");
  EXPECT_EQ(RunPlanCommand(Shape({}), out, err), kExitUsage);
  EXPECT_THAT(err.str(), HasSubstr("kvcmctl plan: no pool size given"));
  EXPECT_EQ(out.str(), "");

  err.str("");
  EXPECT_EQ(RunPlanCommand(Shape({"--pool-bytes", "1KiB"}), out, err), kExitFailure);
  EXPECT_THAT(err.str(), HasSubstr("not one KV-cache block fits"));
}

}  // namespace
}  // namespace kvcm::kvcmctl
