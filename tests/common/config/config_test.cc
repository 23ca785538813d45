// common/config/config.h: precedence (flag > environment > file > default), unknown keys
// and variables, wrong types, the variables' names, and setting real Abseil flags.

#include "common/config/config.h"

#include <stdlib.h>
#include <unistd.h>

#include <fstream>
#include <string>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/base/command_line.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "prometheus/registry.h"
#include "prometheus/text_serializer.h"
#include "tests/support/status_matchers.h"

ABSL_FLAG(int32_t, widgets, 8, "Test flag.");
ABSL_FLAG(std::string, label, "plain", "Test flag.");
ABSL_FLAG(bool, verbose_widgets, false, "Test flag.");
ABSL_FLAG(double, ratio, 0.5, "Test flag.");
ABSL_FLAG(int64_t, big, 0, "Test flag.");
ABSL_DECLARE_FLAG(std::string, config);

namespace kvcm::config {
namespace {

using ::testing::HasSubstr;

Option Int(std::string name, std::string value) { return {name, Type::kInt32, value, value}; }
Option Str(std::string name, std::string value) { return {name, Type::kString, value, value}; }

// Three options, each one source higher than the last: a default, a file value, an
// environment value over a file value, a flag over both.
Inputs Layered() {
  Inputs in;
  in.section = "cache_manager";
  in.options = {Int("block_size", "16"), Int("num_blocks", "0"), Str("backend", "auto"),
                Int("max_ops_per_step", "4096")};
  in.options[3].current_value = "7";  // given on the command line as 7
  in.given = {"max_ops_per_step"};
  in.file_path = "kvcm.yaml";
  in.file = {{"num_blocks", "64"}, {"backend", "shm"}, {"max_ops_per_step", "100"}};
  in.environment = {"PATH=/bin", "KVCM_CACHE_MANAGER_BACKEND=cuda",
                    "KVCM_CACHE_MANAGER_MAX_OPS_PER_STEP=200"};
  return in;
}

const Setting& Find(const std::vector<Setting>& settings, const std::string& name) {
  for (const Setting& s : settings) {
    if (s.name == name) return s;
  }
  ADD_FAILURE() << "no setting " << name;
  return settings.front();
}

TEST(EnvironmentVariableTest, IsKvcmSectionOptionUpperCased) {
  EXPECT_EQ(EnvironmentVariable("cache_manager", "num_blocks"), "KVCM_CACHE_MANAGER_NUM_BLOCKS");
  EXPECT_EQ(EnvironmentVariable("router", "port"), "KVCM_ROUTER_PORT");
  EXPECT_EQ(EnvironmentVariable("launch", "executors"), "KVCM_LAUNCH_EXECUTORS");
}

TEST(ResolveTest, FlagBeatsEnvironmentBeatsFileBeatsDefault) {
  absl::StatusOr<std::vector<Setting>> settings = Resolve(Layered());
  ASSERT_THAT(settings, IsOk());
  ASSERT_EQ(settings->size(), 4u);
  const Setting& block_size = Find(*settings, "block_size");
  EXPECT_EQ(block_size.value, "16");
  EXPECT_EQ(block_size.source, Source::kDefault);
  const Setting& num_blocks = Find(*settings, "num_blocks");
  EXPECT_EQ(num_blocks.value, "64");
  EXPECT_EQ(num_blocks.source, Source::kFile);
  EXPECT_EQ(num_blocks.origin, "kvcm.yaml");
  const Setting& backend = Find(*settings, "backend");
  EXPECT_EQ(backend.value, "cuda");
  EXPECT_EQ(backend.source, Source::kEnvironment);
  EXPECT_EQ(backend.origin, "KVCM_CACHE_MANAGER_BACKEND");
  const Setting& ops = Find(*settings, "max_ops_per_step");
  EXPECT_EQ(ops.value, "7");
  EXPECT_EQ(ops.source, Source::kCommandLine);
}

TEST(ResolveTest, SettingsKeepTheOptionsOrder) {
  absl::StatusOr<std::vector<Setting>> settings = Resolve(Layered());
  ASSERT_THAT(settings, IsOk());
  std::vector<std::string> names;
  for (const Setting& s : *settings) names.push_back(s.name);
  EXPECT_THAT(names,
              ::testing::ElementsAre("block_size", "num_blocks", "backend", "max_ops_per_step"));
}

TEST(ResolveTest, UnknownFileKeyIsAnErrorNamingTheKeyAndTheFile) {
  Inputs in = Layered();
  in.file["num_blokcs"] = "64";
  absl::StatusOr<std::vector<Setting>> settings = Resolve(in);
  ASSERT_FALSE(settings.ok());
  EXPECT_EQ(settings.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(settings.status().message(), HasSubstr("unknown key \"num_blokcs\""));
  EXPECT_THAT(settings.status().message(), HasSubstr("kvcm.yaml"));
}

TEST(ResolveTest, UnknownVariableWithTheSectionsPrefixIsAnError) {
  Inputs in = Layered();
  in.environment.push_back("KVCM_CACHE_MANAGER_NUM_BLOKCS=3");
  absl::StatusOr<std::vector<Setting>> settings = Resolve(in);
  ASSERT_FALSE(settings.ok());
  EXPECT_THAT(settings.status().message(), HasSubstr("KVCM_CACHE_MANAGER_NUM_BLOKCS"));
}

TEST(ResolveTest, VariablesOfOtherSectionsAndLowerCaseSpellingsAreNotTaken) {
  Inputs in = Layered();
  in.environment.push_back("KVCM_ROUTER_PORT=1");  // the router's, not ours
  in.environment.push_back("KVCM_TEST_SEED=5");
  absl::StatusOr<std::vector<Setting>> settings = Resolve(in);
  ASSERT_THAT(settings, IsOk());
  in.environment.push_back("KVCM_CACHE_MANAGER_block_size=3");
  settings = Resolve(in);
  ASSERT_FALSE(settings.ok());
  EXPECT_THAT(settings.status().message(), HasSubstr("KVCM_CACHE_MANAGER_block_size"));
}

TEST(ResolveTest, WrongTypeInTheFileNamesKeyAndExpectedType) {
  Inputs in = Layered();
  in.file["num_blocks"] = "many";
  absl::StatusOr<std::vector<Setting>> settings = Resolve(in);
  ASSERT_FALSE(settings.ok());
  EXPECT_THAT(settings.status().message(),
              HasSubstr("num_blocks in section cache_manager of kvcm.yaml: expected int32, "
                        "got \"many\""));
}

TEST(ResolveTest, WrongTypeIsAnErrorEvenWhereAFlagOverridesIt) {
  Inputs in = Layered();
  in.file["max_ops_per_step"] = "1.5";  // the command line's 7 wins, but 1.5 is no int32
  EXPECT_FALSE(Resolve(in).ok());
  in = Layered();
  in.environment.push_back("KVCM_CACHE_MANAGER_BLOCK_SIZE=sixteen");
  absl::StatusOr<std::vector<Setting>> settings = Resolve(in);
  ASSERT_FALSE(settings.ok());
  EXPECT_THAT(settings.status().message(),
              HasSubstr("KVCM_CACHE_MANAGER_BLOCK_SIZE: expected int32, got \"sixteen\""));
}

TEST(IsValidTest, AcceptsWhatAbseilFlagsAcceptAndNothingElse) {
  EXPECT_TRUE(IsValid(Type::kInt32, "-12"));
  EXPECT_FALSE(IsValid(Type::kInt32, "3000000000"));
  EXPECT_TRUE(IsValid(Type::kInt64, "3000000000"));
  EXPECT_FALSE(IsValid(Type::kInt64, "12abc"));
  EXPECT_TRUE(IsValid(Type::kDouble, "0.9"));
  EXPECT_FALSE(IsValid(Type::kDouble, "most"));
  for (const char* yes : {"true", "True", "yes", "1", "false", "no", "0"}) {
    EXPECT_TRUE(IsValid(Type::kBool, yes)) << yes;
  }
  EXPECT_FALSE(IsValid(Type::kBool, "maybe"));
  EXPECT_TRUE(IsValid(Type::kString, ""));
}

TEST(ParseSectionTest, ReadsOnlyTheGivenSection) {
  absl::StatusOr<SectionValues> values =
      ParseSection("cache_manager:\n  num_blocks: 64\n  dtype: \"\"\nrouter:\n  port: 8080\n",
                   "f.yaml", "cache_manager");
  ASSERT_THAT(values, IsOk());
  EXPECT_EQ(*values, (SectionValues{{"num_blocks", "64"}, {"dtype", ""}}));
  values = ParseSection("router:\n", "f.yaml", "router");
  ASSERT_THAT(values, IsOk());
  EXPECT_TRUE(values->empty());
  values = ParseSection("", "f.yaml", "router");
  ASSERT_THAT(values, IsOk());
  EXPECT_TRUE(values->empty());
}

TEST(ParseSectionTest, UnknownSectionIsAnErrorNamingItAndTheFile) {
  absl::StatusOr<SectionValues> values =
      ParseSection("cache-manager:\n  num_blocks: 64\n", "f.yaml", "cache_manager");
  ASSERT_FALSE(values.ok());
  EXPECT_THAT(values.status().message(), HasSubstr("unknown section \"cache-manager\" in f.yaml"));
}

TEST(ParseSectionTest, NonScalarValuesAndBadYamlAreErrors) {
  for (const char* text : {"router:\n  port: [1, 2]\n", "router:\n  port:\n",
                           "router:\n  port: {a: 1}\n", "router: [port]\n", "- router\n",
                           "router:\n  port: 1\n  port: 2\n", "router: {port: 1\n"}) {
    absl::StatusOr<SectionValues> values = ParseSection(text, "f.yaml", "router");
    EXPECT_FALSE(values.ok()) << text;
    EXPECT_EQ(values.status().code(), absl::StatusCode::kInvalidArgument) << text;
    EXPECT_THAT(values.status().message(), HasSubstr("f.yaml")) << text;
  }
}

TEST(ParseSectionTest, PrintableConfigReadsBackToTheSameValues) {
  const std::vector<Setting> settings = {
      {"label", Type::kString, "two words \"quoted\" \\ too", Source::kDefault, ""},
      {"empty", Type::kString, "", Source::kDefault, ""},
      {"widgets", Type::kInt32, "8", Source::kDefault, ""},
      {"ratio", Type::kDouble, "0.5", Source::kDefault, ""},
      {"verbose", Type::kBool, "false", Source::kDefault, ""}};
  const std::string text = PrintableConfig("executor", settings);
  absl::StatusOr<SectionValues> values = ParseSection(text, "printed", "executor");
  ASSERT_THAT(values, IsOk()) << "\n" << text;
  ASSERT_EQ(values->size(), settings.size());
  for (const Setting& s : settings) EXPECT_EQ(values->at(s.name), s.value) << text;
}

TEST(SecretTest, SecretValuesAreRedactedAndPathsToSecretsAreNot) {
  EXPECT_TRUE(IsSecret("tcp_secret"));
  EXPECT_FALSE(IsSecret("cache_manager_secret_file"));
  EXPECT_FALSE(IsSecret("secret_path"));
  EXPECT_FALSE(IsSecret("num_blocks"));
  const std::vector<Setting> settings = {
      {"tcp_secret", Type::kString, "hunter2", Source::kEnvironment, "KVCM_X_TCP_SECRET"},
      {"cache_manager_secret_file", Type::kString, "/run/s", Source::kDefault, ""}};
  const std::string line = Describe(settings, "");
  EXPECT_THAT(line, Not(HasSubstr("hunter2")));
  EXPECT_THAT(line, HasSubstr("tcp_secret=<redacted>"));
  EXPECT_THAT(line, HasSubstr("cache_manager_secret_file=/run/s"));
  EXPECT_THAT(PrintableConfig("router", settings), Not(HasSubstr("hunter2")));
  prometheus::Registry registry;
  ExportInfoMetric(registry, "kvcm_test_config_info", settings, "");
  const std::string text = prometheus::TextSerializer().Serialize(registry.Collect());
  EXPECT_THAT(text, Not(HasSubstr("hunter2")));
  EXPECT_THAT(text, HasSubstr("tcp_secret=\"<redacted>\""));
}

TEST(DescribeTest, OneLineWithEachNonDefaultsSource) {
  absl::StatusOr<std::vector<Setting>> settings = Resolve(Layered());
  ASSERT_THAT(settings, IsOk());
  EXPECT_EQ(Describe(*settings, "kvcm.yaml"),
            "configuration: block_size=16 num_blocks=64 (file) backend=cuda (env "
            "KVCM_CACHE_MANAGER_BACKEND) max_ops_per_step=7 (flag) from kvcm.yaml");
}

TEST(InfoMetricTest, IsOneGaugeAtOneLabelledWithEveryOptionAndTheFile) {
  absl::StatusOr<std::vector<Setting>> settings = Resolve(Layered());
  ASSERT_THAT(settings, IsOk());
  prometheus::Registry registry;
  ExportInfoMetric(registry, "kvcm_cache_manager_config_info", *settings, "kvcm.yaml");
  const std::string text = prometheus::TextSerializer().Serialize(registry.Collect());
  EXPECT_THAT(text, HasSubstr("# TYPE kvcm_cache_manager_config_info gauge"));
  EXPECT_THAT(text, HasSubstr("kvcm_cache_manager_config_info{backend=\"cuda\",block_size="
                              "\"16\",config_file=\"kvcm.yaml\",max_ops_per_step=\"7\","
                              "num_blocks=\"64\"} 1"));
}

// The Abseil side: the flags defined in this file, set from a file and the environment.
TEST(ApplyToFlagsTest, SetsTheFlagsOfThisFileFromTheFileAndTheEnvironment) {
  const std::vector<Option> options = FlagOptions(__FILE__);
  std::vector<std::string> names;
  for (const Option& o : options) names.push_back(o.name);
  // Only this file's flags (not --config, not Abseil's own), sorted.
  EXPECT_THAT(names, ::testing::ElementsAre("big", "label", "ratio", "verbose_widgets", "widgets"));
  const std::string path = absl::StrCat(::testing::TempDir(), "/config_test_", ::getpid(), ".yaml");
  {
    std::ofstream out(path);
    out << "executor:\n  widgets: 12\n  label: from the file\n  big: 5000000000\n";
  }
  absl::SetFlag(&FLAGS_config, path);
  ASSERT_EQ(::setenv("KVCM_EXECUTOR_LABEL", "from the environment", 1), 0);
  ASSERT_EQ(::setenv("KVCM_EXECUTOR_VERBOSE_WIDGETS", "yes", 1), 0);
  GivenFlagNames().insert("ratio");  // as if --ratio was on the command line
  absl::SetFlag(&FLAGS_ratio, 0.25);
  absl::StatusOr<std::vector<Setting>> settings = ApplyToFlags("executor", __FILE__);
  ::unsetenv("KVCM_EXECUTOR_LABEL");
  ::unsetenv("KVCM_EXECUTOR_VERBOSE_WIDGETS");
  ASSERT_THAT(settings, IsOk());
  EXPECT_EQ(absl::GetFlag(FLAGS_widgets), 12);
  EXPECT_EQ(absl::GetFlag(FLAGS_big), 5000000000);
  EXPECT_EQ(absl::GetFlag(FLAGS_label), "from the environment");
  EXPECT_TRUE(absl::GetFlag(FLAGS_verbose_widgets));
  EXPECT_EQ(absl::GetFlag(FLAGS_ratio), 0.25);
  EXPECT_EQ(Find(*settings, "ratio").source, Source::kCommandLine);
  EXPECT_EQ(Find(*settings, "widgets").source, Source::kFile);

  {
    std::ofstream out(path);
    out << "executor:\n  widgets: lots\n";
  }
  settings = ApplyToFlags("executor", __FILE__);
  ASSERT_FALSE(settings.ok());
  EXPECT_THAT(settings.status().message(), HasSubstr("widgets"));
  EXPECT_THAT(settings.status().message(), HasSubstr("expected int32"));
  absl::SetFlag(&FLAGS_config, ::testing::TempDir() + "/no-such-file.yaml");
  EXPECT_EQ(ApplyToFlags("executor", __FILE__).status().code(), absl::StatusCode::kNotFound);
  absl::SetFlag(&FLAGS_config, "");
}

}  // namespace
}  // namespace kvcm::config
