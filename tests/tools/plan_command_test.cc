#include "tools/kvcmctl/plan_command.h"

#include <fstream>
#include <sstream>
#include <string>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "common/sizing/kv_cache_groups.h"
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

  config["model_type"] = "gemma2";  // every other layer slides: no single window
  config["architectures"] = {"Gemma2ForCausalLM"};
  std::ofstream(path) << config.dump();
  report = BuildPlanReport(*Parse({"--model-config", path, "--pool-bytes", "16GiB"}));
  ASSERT_THAT(report, IsOk());
  EXPECT_EQ(report->sliding_window, 0);
  EXPECT_FALSE(nlohmann::json::parse(FormatPlanJson(*report)).contains("sliding_window_tokens"));
  EXPECT_THAT(FormatPlanText(*report), ::testing::Not(HasSubstr("With the model's sliding")));
}

// Gemma 3 1B's KV-relevant keys: 26 layers, every 6th (5, 11, 17, 23) attending to the
// whole context and the others within 512 tokens; 1 KV head of 256, bf16.
nlohmann::json Gemma3_1BConfig() {
  return {{"architectures", {"Gemma3ForCausalLM"}},
          {"model_type", "gemma3_text"},
          {"num_hidden_layers", 26},
          {"num_attention_heads", 4},
          {"num_key_value_heads", 1},
          {"head_dim", 256},
          {"hidden_size", 1152},
          {"sliding_window", 512},
          {"sliding_window_pattern", 6},
          {"torch_dtype", "bfloat16"}};
}

// A model of several layer types gets a "KV cache groups" section: 1 full group and 6
// window groups of 4 slots. Each figure by hand, for an 8 GiB pool:
//   full block 2 x 26 x 1 x 256 x 2 x 16 = 425984 B; page (4 slots) 65536 B
//   pool pages 8589934592 / 65536 = 131072 (not 8589934592 / 425984 = 20164 blocks)
//   a window group holds 512 / 16 + 2 = 34 pages of a long sequence, the full group all
//   1024: 64 + 6 x 34 = 268 pages = 17563648 B against 64 x 425984 = 27262976 B
//   4096: 256 + 204 = 460 pages = 30146560 B against 109051904 B
//   32768: 2048 + 204 = 2252 pages = 147587072 B against 872415232 B, 131072 / 2252 = 58
TEST(BuildPlanReportTest, KvCacheGroupsForAModelOfSeveralLayerTypes) {
  const std::string path = ::testing::TempDir() + "/gemma3_config.json";
  std::ofstream(path) << Gemma3_1BConfig().dump();
  const absl::StatusOr<PlanReport> report =
      BuildPlanReport(*Parse({"--model-config", path, "--pool-bytes", "8GiB"}));
  ASSERT_THAT(report, IsOk());
  EXPECT_EQ(report->plan.num_blocks, 20164);
  ASSERT_TRUE(report->grouped.has_value());
  EXPECT_EQ(report->grouped->groups.group_size, 4);
  EXPECT_EQ(report->grouped->bytes_per_page, 65536);
  EXPECT_EQ(report->grouped->num_pages, 131072);

  const nlohmann::json j = nlohmann::json::parse(FormatPlanJson(*report));
  ASSERT_TRUE(j.contains("kv_cache_groups"));
  const nlohmann::json& groups = j["kv_cache_groups"];
  EXPECT_EQ(groups["group_size"], 4);
  EXPECT_EQ(groups["num_groups"], 7);
  EXPECT_EQ(groups["padding_slots"], 2);
  EXPECT_EQ(groups["groups"][0]["window"], 0);
  EXPECT_EQ(groups["groups"][0]["layers"], nlohmann::json({5, 11, 17, 23}));
  EXPECT_EQ(groups["groups"][1]["window"], 512);
  EXPECT_EQ(groups["groups"][1]["layers"], nlohmann::json({0, 7, 14, 21}));
  EXPECT_EQ(groups["groups"][6]["layers"], nlohmann::json({6, 13, 20}));
  EXPECT_EQ(groups["bytes_per_page"], 65536);
  EXPECT_EQ(groups["num_pages"], 131072);
  ASSERT_EQ(groups["sequences"].size(), 3u);
  const nlohmann::json& short_seq = groups["sequences"][0];
  EXPECT_EQ(short_seq["seq_len"], 1024);
  EXPECT_EQ(short_seq["pages_per_sequence"], 268);
  EXPECT_EQ(short_seq["bytes_per_sequence"], 17563648);
  EXPECT_EQ(short_seq["full_bytes_per_sequence"], 27262976);
  EXPECT_EQ(groups["sequences"][1]["bytes_per_sequence"], 30146560);
  EXPECT_EQ(groups["sequences"][1]["full_bytes_per_sequence"], 109051904);
  EXPECT_EQ(groups["sequences"][1]["num_sequences"], 284);  // 131072 / 460
  const nlohmann::json& longest = groups["sequences"][2];
  EXPECT_EQ(longest["seq_len"], 32768);
  EXPECT_EQ(longest["pages_per_sequence"], 2252);
  EXPECT_EQ(longest["bytes_per_sequence"], 147587072);
  EXPECT_EQ(longest["full_bytes_per_sequence"], 872415232);
  EXPECT_NEAR(longest["ratio"].get<double>(), 147587072.0 / 872415232.0, 1e-12);
  EXPECT_EQ(longest["num_sequences"], 58);
  EXPECT_EQ(j["sequences"][2]["num_sequences"], 9);  // 20164 full blocks / 2048

  const std::string text = FormatPlanText(*report);
  EXPECT_THAT(text, HasSubstr("\nKV cache groups: 7 groups of 4 slots, one block table each"));
  EXPECT_THAT(text, HasSubstr("  group 0: full attention, layers 5, 11, 17, 23\n"
                              "  group 1: window 512, layers 0, 7, 14, 21\n"));
  EXPECT_THAT(text, HasSubstr("  group 6: window 512, layers 6, 13, 20\n"));
  EXPECT_THAT(text, HasSubstr("  padding slots    = 7 groups x 4 slots - 26 layers = 2\n"));
  EXPECT_THAT(text, HasSubstr("  bytes per page   = 2 (K and V) x 4 slots x 1 KV heads x 256 "
                              "head dim x 2 bytes (bf16) x 16 tokens = 65536 B (64.00 KiB)\n"));
  EXPECT_THAT(text, HasSubstr("  pool pages       = floor(8589934592 / 65536) = 131072\n"));
  EXPECT_THAT(text, HasSubstr("its blocks number usable bytes / bytes per page, not usable "
                              "bytes / bytes per block"));
  EXPECT_THAT(text, HasSubstr("        4096          460    28.75 MiB   104.00 MiB   0.276   "
                              "       284\n"));
  EXPECT_THAT(text, HasSubstr("       32768         2252   140.75 MiB   832.00 MiB   0.169   "
                              "        58\n"));
}

// "layer_types" gives the same groups as the pattern; one type (Llama, Mistral's window on
// every layer) gets no groups section.
TEST(BuildPlanReportTest, KvCacheGroupsFromLayerTypesAndNoneForOneType) {
  const std::string path = ::testing::TempDir() + "/gemma3_types_config.json";
  nlohmann::json config = Gemma3_1BConfig();
  config.erase("sliding_window_pattern");
  std::vector<std::string> types(26, "sliding_attention");
  for (int layer : {5, 11, 17, 23}) types[layer] = "full_attention";
  config["layer_types"] = types;
  std::ofstream(path) << config.dump();
  absl::StatusOr<PlanReport> report =
      BuildPlanReport(*Parse({"--model-config", path, "--num-blocks", "100"}));
  ASSERT_THAT(report, IsOk());
  ASSERT_TRUE(report->grouped.has_value());
  EXPECT_EQ(report->grouped->groups.ToString(),
            GroupLayers(std::vector<int32_t>{512, 512, 512, 512, 512, 0,   512, 512, 512,
                                             512, 512, 0,   512, 512, 512, 512, 512, 0,
                                             512, 512, 512, 512, 512, 0,   512, 512})
                ->ToString());
  // 100 full blocks of 425984 B make 42598400 B: 650 pages of 65536 B.
  EXPECT_EQ(report->grouped->num_pages, 650);

  config["model_type"] = "mistral";
  config["architectures"] = {"MistralForCausalLM"};
  std::ofstream(path) << config.dump();
  report = BuildPlanReport(*Parse({"--model-config", path, "--num-blocks", "100"}));
  ASSERT_THAT(report, IsOk());
  EXPECT_FALSE(report->grouped.has_value());
  EXPECT_FALSE(nlohmann::json::parse(FormatPlanJson(*report)).contains("kv_cache_groups"));
  EXPECT_THAT(FormatPlanText(*report), ::testing::Not(HasSubstr("KV cache groups")));
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
