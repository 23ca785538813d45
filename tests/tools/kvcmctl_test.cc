// Runs the built kvcmctl binary (KVCMCTL_PATH) as a child process and checks what it prints
// and how it exits.

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

#ifndef KVCMCTL_PATH
#error "KVCMCTL_PATH must name the kvcmctl binary"
#endif

namespace kvcm {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

struct Result {
  int exit_code = -1;
  std::string out;
  std::string err;
};

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

class KvcmctlTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = ::testing::TempDir() + "/kvcmctl_test.XXXXXX";
    ASSERT_NE(mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
  }

  void TearDown() override {
    for (const std::string& path : files_) std::remove(path.c_str());
    std::remove((dir_ + "/stdout").c_str());
    std::remove((dir_ + "/stderr").c_str());
    rmdir(dir_.c_str());
  }

  std::string WriteFile(const std::string& name, const std::string& text) {
    const std::string path = dir_ + "/" + name;
    std::ofstream(path) << text;
    files_.push_back(path);
    return path;
  }

  // Runs `kvcmctl args...` with stdout and stderr going to files (no pipe to fill up).
  Result Run(const std::vector<std::string>& args) {
    const std::string out_path = dir_ + "/stdout";
    const std::string err_path = dir_ + "/stderr";
    std::vector<std::string> argv_storage = {KVCMCTL_PATH};
    argv_storage.insert(argv_storage.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (std::string& arg : argv_storage) argv.push_back(arg.data());
    argv.push_back(nullptr);

    const pid_t pid = fork();
    if (pid == 0) {
      const int out_fd = open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
      const int err_fd = open(err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
      if (out_fd < 0 || err_fd < 0 || dup2(out_fd, 1) < 0 || dup2(err_fd, 2) < 0) _exit(126);
      execv(argv[0], argv.data());
      _exit(127);
    }
    Result result;
    if (pid < 0) {
      ADD_FAILURE() << "fork failed";
      return result;
    }
    int status = 0;
    if (waitpid(pid, &status, 0) != pid) {
      ADD_FAILURE() << "waitpid failed";
      return result;
    }
    result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    result.out = ReadFile(out_path);
    result.err = ReadFile(err_path);
    return result;
  }

  std::string dir_;
  std::vector<std::string> files_;
};

// `plan` with Llama-3-8B's shape: 32 layers, 8 KV heads, head dim 128, bf16, blocks of 16.
std::vector<std::string> Llama3_8B() {
  return {"plan", "--layers", "32",   "--kv-heads",   "8", "--head-dim",
          "128",  "--dtype",  "bf16", "--block-size", "16"};
}

std::vector<std::string> With(std::vector<std::string> base, const std::vector<std::string>& more) {
  base.insert(base.end(), more.begin(), more.end());
  return base;
}

TEST_F(KvcmctlTest, PlanJsonLlama3_8B) {
  const Result r = Run(With(Llama3_8B(), {"--pool-bytes", "64GiB", "--json"}));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.err, "");
  const nlohmann::json j = nlohmann::json::parse(r.out);
  // 2 x 32 x 8 x 128 x 2 = 131072 B/token; x 16 = 2 MiB/block; 64 GiB / 2 MiB = 32768.
  EXPECT_EQ(j["bytes_per_token"], 131072);
  EXPECT_EQ(j["bytes_per_block"], 2097152);
  EXPECT_EQ(j["usable_bytes"], 68719476736);
  EXPECT_EQ(j["num_blocks"], 32768);
  EXPECT_EQ(j["pool_bytes"], 68719476736);
  EXPECT_EQ(j["unused_bytes"], 0);
  EXPECT_EQ(j["max_total_tokens"], 524288);
  EXPECT_EQ(j["dtype"], "bf16");
  EXPECT_EQ(j["budget"]["kind"], "pool-bytes");
  // Default --seq-len 4096 is among the standard lengths: 1024, 4096, 32768.
  ASSERT_EQ(j["sequences"].size(), 3u);
  EXPECT_EQ(j["sequences"][1]["seq_len"], 4096);
  EXPECT_EQ(j["sequences"][1]["num_sequences"], 128);  // 32768 / 256
}

TEST_F(KvcmctlTest, PlanHumanOutputHasTheKeyLines) {
  const Result r = Run(With(Llama3_8B(), {"--pool-bytes", "64GiB", "--seq-len", "1000"}));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("bytes per token  = 2 (K and V) x 32 layers x 8 KV heads x 128 "
                               "head dim x 2 bytes (bf16) = 131072 B (128.00 KiB)"));
  EXPECT_THAT(r.out, HasSubstr("bytes per block  = 131072 B per token x 16 tokens per block = "
                               "2097152 B (2.00 MiB)"));
  EXPECT_THAT(r.out, HasSubstr("num_blocks       = floor(68719476736 / 2097152) = 32768"));
  EXPECT_THAT(r.out, HasSubstr("unused bytes     = 68719476736 - 68719476736 = 0 B"));
  EXPECT_THAT(r.out, HasSubstr("max total tokens = 32768 blocks x 16 tokens = 524288 (TGI's "
                               "max_batch_total_tokens)"));
  // 1000 tokens: 63 blocks, 520 sequences, 8 empty slots = 1 MiB each.
  EXPECT_THAT(r.out, HasSubstr("1000           63          520  8 tokens (1.00 MiB)"));
  EXPECT_THAT(r.out, HasSubstr("32768         2048           16  0 tokens (0 B)"));
}

TEST_F(KvcmctlTest, PlanMemoryFractionAndNumBlocks) {
  // 80 GiB x 0.9 x (1 - 0.1) = 69578470195 B -> 33177 blocks of 2 MiB.
  Result r =
      Run(With(Llama3_8B(), {"--memory-fraction", "0.9", "--free-memory", "80GiB", "--json"}));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["usable_bytes"], 69578470195);
  EXPECT_EQ(j["num_blocks"], 33177);
  EXPECT_EQ(j["unused_bytes"], 1258291);
  EXPECT_EQ(j["budget"]["margin"], 0.1);

  // Explicit margin: 80 GiB x 0.5 x (1 - 0.25) = 30 GiB -> 15360 blocks.
  r = Run(With(Llama3_8B(),
               {"--memory-fraction=0.5", "--free-memory=80GiB", "--margin=0.25", "--json"}));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(nlohmann::json::parse(r.out)["num_blocks"], 15360);

  r = Run(With(Llama3_8B(), {"--num-blocks", "4096", "--json"}));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["pool_bytes"], 8589934592);  // 4096 x 2 MiB = 8 GiB
  EXPECT_EQ(j["max_total_tokens"], 65536);
}

TEST_F(KvcmctlTest, PlanShowsWhatTheTiersHold) {
  // Blocks of 2 MiB: a host tier of 256 GiB holds 131072 of them. A disk slot is 4096 B of
  // header + 2 MiB = 2101248 B; 1 TiB / 2101248 = 523265 slots, split among 4 files: 523264.
  Result r = Run(With(Llama3_8B(), {"--pool-bytes", "64GiB", "--host-tier-bytes", "256GiB",
                                    "--disk-tier-bytes", "1TiB", "--json"}));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  nlohmann::json j = nlohmann::json::parse(r.out);
  ASSERT_EQ(j["tiers"].size(), 2u);
  EXPECT_EQ(j["tiers"][0]["tier"], "host");
  EXPECT_EQ(j["tiers"][0]["slot_bytes"], 2097152);
  EXPECT_EQ(j["tiers"][0]["blocks"], 131072);
  EXPECT_EQ(j["tiers"][0]["tokens"], 2097152);
  EXPECT_EQ(j["tiers"][1]["tier"], "disk");
  EXPECT_EQ(j["tiers"][1]["bytes"], 1099511627776);
  EXPECT_EQ(j["tiers"][1]["slot_bytes"], 2101248);
  EXPECT_EQ(j["tiers"][1]["blocks"], 523264);
  EXPECT_EQ(j["tiers"][1]["tokens"], 8372224);

  r = Run(With(Llama3_8B(), {"--pool-bytes", "64GiB", "--host-tier-bytes", "256GiB",
                             "--disk-tier-bytes", "1TiB"}));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("host tier blocks = floor(274877906944 / 2097152) = 131072\n"));
  EXPECT_THAT(r.out, HasSubstr("host tier tokens = 131072 blocks x 16 tokens = 2097152"));
  EXPECT_THAT(r.out, HasSubstr("disk tier slot   = 4096 B header + 2097152 B block rounded up "
                               "to 4096 = 2101248 B"));
  EXPECT_THAT(r.out, HasSubstr("disk tier blocks = floor(1099511627776 / 2101248) = 523265, "
                               "in 4 equal files = 523264"));

  // A block that is not a whole number of pages: 2 x 32 x 8 x 1 x 2 x 3 = 3072 B, padded to
  // 4096, after a 4096-byte header: slots of 8192 B. 80 KiB makes 10 slots, 2 per file.
  r = Run({"plan", "--layers", "32", "--kv-heads", "8", "--head-dim", "1", "--block-size", "3",
           "--num-blocks", "10", "--disk-tier-bytes", "80KiB", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  j = nlohmann::json::parse(r.out);
  ASSERT_EQ(j["tiers"].size(), 1u);
  EXPECT_EQ(j["tiers"][0]["slot_bytes"], 8192);
  EXPECT_EQ(j["tiers"][0]["blocks"], 8);  // 10 slots, 4 files of 2
  EXPECT_EQ(j["tiers"][0]["tokens"], 24);

  // No tier flags: no tiers key. A host tier smaller than a block is refused.
  r = Run(With(Llama3_8B(), {"--pool-bytes", "64GiB", "--json"}));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_FALSE(nlohmann::json::parse(r.out).contains("tiers"));
  r = Run(With(Llama3_8B(), {"--pool-bytes", "64GiB", "--host-tier-bytes", "1MiB"}));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.err, HasSubstr("--host-tier-bytes"));
}

TEST_F(KvcmctlTest, PlanFromModelConfigFile) {
  // Llama-2-7B: MHA (no num_key_value_heads), 32 layers, head dim 4096 / 32 = 128, fp16.
  const std::string config = WriteFile("config.json", R"({
    "hidden_size": 4096, "num_attention_heads": 32, "num_hidden_layers": 32,
    "torch_dtype": "float16"})");
  Result r = Run({"plan", "--model-config", config, "--pool-bytes", "64GiB", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["model_config"], config);
  EXPECT_EQ(j["num_kv_heads"], 32);
  EXPECT_EQ(j["dtype"], "fp16");
  EXPECT_EQ(j["bytes_per_token"], 524288);  // 2 x 32 x 32 x 128 x 2
  EXPECT_EQ(j["bytes_per_block"], 8388608);
  EXPECT_EQ(j["num_blocks"], 8192);

  // --dtype overrides torch_dtype: fp8 halves the block, doubles the blocks.
  r = Run({"plan", "--model-config", config, "--dtype", "fp8", "--pool-bytes", "64GiB", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["dtype"], "fp8_e4m3");
  EXPECT_EQ(j["num_blocks"], 16384);

  r = Run({"plan", "--model-config", config, "--pool-bytes", "64GiB"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("Model shape from " + config));
}

TEST_F(KvcmctlTest, TwoSizingFlagsAreAUsageError) {
  const Result r = Run(With(Llama3_8B(), {"--pool-bytes", "64GiB", "--num-blocks", "10"}));
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(r.out, "");
  EXPECT_THAT(r.err, HasSubstr("conflicting pool sizes --pool-bytes and --num-blocks"));
}

TEST_F(KvcmctlTest, NoSizingFlagIsAUsageError) {
  const Result r = Run(Llama3_8B());
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("no pool size given"));
  EXPECT_THAT(r.err, HasSubstr("--pool-bytes"));
}

TEST_F(KvcmctlTest, UnknownDTypeIsAUsageError) {
  const Result r = Run({"plan", "--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--dtype",
                        "int3", "--pool-bytes", "64GiB"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("--dtype: unknown dtype \"int3\""));
}

TEST_F(KvcmctlTest, BadByteSizeNamesTheFlag) {
  const Result r = Run(With(Llama3_8B(), {"--pool-bytes", "64 gigs"}));
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("--pool-bytes: invalid byte size \"64 gigs\""));
}

TEST_F(KvcmctlTest, MissingDimensionIsAUsageError) {
  const Result r = Run({"plan", "--layers", "32", "--head-dim", "128", "--pool-bytes", "1GiB"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("missing --kv-heads"));
}

TEST_F(KvcmctlTest, TooSmallBudgetFailsWithExitOne) {
  const Result r = Run(With(Llama3_8B(), {"--pool-bytes", "1MiB"}));
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("not one KV-cache block fits"));
}

TEST_F(KvcmctlTest, MissingModelConfigFailsNamingThePath) {
  const std::string path = dir_ + "/absent/config.json";
  const Result r = Run({"plan", "--model-config", path, "--pool-bytes", "1GiB"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr(path));
}

TEST_F(KvcmctlTest, BrokenModelConfigFailsNamingTheKey) {
  const std::string config =
      WriteFile("config.json", R"({"hidden_size": 4096, "num_attention_heads": 32})");
  const Result r = Run({"plan", "--model-config", config, "--pool-bytes", "1GiB"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("\"num_hidden_layers\""));
}

TEST_F(KvcmctlTest, UnknownCommandPrintsUsage) {
  const Result r = Run({"frobnicate"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("unknown command \"frobnicate\""));
  EXPECT_THAT(r.err, HasSubstr("Usage: kvcmctl <command>"));
  EXPECT_THAT(r.err, HasSubstr("plan"));
}

TEST_F(KvcmctlTest, NoCommandPrintsUsage) {
  const Result r = Run({});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("Usage: kvcmctl <command>"));
}

TEST_F(KvcmctlTest, HelpGoesToStdout) {
  Result r = Run({"--help"});
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_THAT(r.out, HasSubstr("plan"));
  r = Run({"plan", "--help"});
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_THAT(r.out, HasSubstr("--memory-fraction"));
  EXPECT_THAT(r.out, Not(HasSubstr("unknown")));
}

}  // namespace
}  // namespace kvcm
