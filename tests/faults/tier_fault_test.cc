// Faults on the host and disk tiers (docs/architecture.md, "Tiers"), seen from outside: the
// real stack of kvcm-launch (cache manager, router, executor of a tiny model) with its
// tiers on, while a process dies or the disk tier's directory cannot be used.
//
//   - the cache manager SIGKILLed while its movers write and requests run: no torn or
//     unwritten slot is recovered or served, every reply is the model's own;
//   - a working set four times the pool: the second round is served from the host and disk
//     tiers, with the model's tokens;
//   - the router, or an executor, SIGKILLed while a request's blocks load: nothing leaks;
//   - a disk tier directory that cannot be created, or bigger than the file size allowed:
//     the start fails, naming the directory or the bytes;
//   - a second cache manager on a directory the stack's holds: it fails naming the holder.
//
// Every test ends with the ledger whole (no block in use, quarantined, draining, held for a
// store or loading) and a clean shutdown. Seeds are printed; KVCM_TIER_FAULT_SEED fixes one.

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <random>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/base/mutex.h"
#include "tests/faults/tier_stack.h"
#include "tests/support/wait_for.h"

namespace kvcm::faults {
namespace {

// The tiny model's KV block of 4 tokens (KvCacheSpec::BytesPerBlock).
constexpr int64_t kBlockBytes = 4096;

// The sum of every series of `family` (all label values) in one scrape; -1 when none.
double SumOfFamily(const std::string& url, const std::string& family) {
  absl::StatusOr<testing::HttpResponse> reply = testing::HttpGet(url, absl::Seconds(2));
  if (!reply.ok() || reply->status != 200) return -1;
  double sum = -1;
  for (absl::string_view line : absl::StrSplit(reply->body, '\n')) {
    if (absl::StartsWith(line, family + "{") || absl::StartsWith(line, family + " ")) {
      const size_t space = line.rfind(' ');
      sum = std::max(sum, 0.0) + std::stod(std::string(line.substr(space + 1)));
    }
  }
  return sum;
}

uint64_t SeedFor(const std::string& test) {
  const uint64_t seed = static_cast<uint64_t>(EnvOr("KVCM_TIER_FAULT_SEED", 20261207));
  std::cout << test << ": seed " << seed << " (KVCM_TIER_FAULT_SEED=" << seed << " repeats it)\n";
  return seed;
}

class TierFaultTest : public TierStackTest {
 protected:
  TierFaultTest() : TierStackTest("kvcm-tier-fault") {}

  std::string TierDir() const { return dir_->path() + "/tier"; }
  std::vector<std::string> TierFlags(const std::string& host_bytes = "8MiB",
                                     const std::string& disk_bytes = "64MiB") const {
    return {"--cache-manager-arg=--disk-tier-dir=" + TierDir(),
            "--cache-manager-arg=--disk-tier-bytes=" + disk_bytes,
            "--cache-manager-arg=--host-tier-bytes=" + host_bytes};
  }

  // Starts kvcm-launch as Launch() does, with `extra` flags, expecting the start to fail:
  // its exit code (-1 when it did not exit within the hang guard) and its output.
  std::pair<int, std::string> LaunchExpectingFailure(const std::vector<std::string>& extra) {
    testing::Subprocess::Options options;
    options.argv = {testing::KvcmBinaryPath("kvcm-launch"),
                    "--model",
                    model_dir_,
                    "--port",
                    std::to_string(FreePort()),
                    "--run-dir",
                    dir_->path() + "/run",
                    "--executors",
                    "1",
                    "--num-blocks",
                    "64",
                    "--threads",
                    "1",
                    "--block-size",
                    "4",
                    "--restart-backoff-ms",
                    "100"};
    options.argv.insert(options.argv.end(), extra.begin(), extra.end());
    options.argv.insert(options.argv.begin(), launch_wrapper_.begin(), launch_wrapper_.end());
    options.output_path = dir_->path() + "/failed-launch.log";
    options.env = {"TMPDIR=" + dir_->path()};
    absl::StatusOr<std::unique_ptr<testing::Subprocess>> started =
        testing::Subprocess::Start(options);
    EXPECT_THAT(started, IsOk());
    if (!started.ok()) return {-1, ""};
    absl::StatusOr<int> code = (*started)->Wait(absl::Seconds(90));
    const std::string output = (*started)->Output();
    if (!code.ok()) {
      (*started)->Stop(absl::Seconds(10));
      return {-1, output};
    }
    return {*code, output};
  }

  // Until kvcm-launch has started `process` again after `old_pid` died and a request
  // completes with the model's tokens (a hang guard of 90 s).
  void AwaitRestarted(const std::string& process, pid_t old_pid) {
    ASSERT_THAT(testing::WaitFor([&] { return CurrentPid(process) != old_pid; }, absl::Seconds(90),
                                 process + " to be started again"),
                IsOk())
        << testing::Tail(launch_->Output(), 6000);
    ASSERT_THAT(testing::WaitFor(
                    [&] {
                      return Request("probe after a restart", 2, absl::Seconds(10)).kind ==
                             "completed";
                    },
                    absl::Seconds(90), "a request to complete after the restart"),
                IsOk())
        << testing::Tail(launch_->Output(), 6000);
  }

  // The OpenAI completion of `text`, greedy, `n` tokens with their texts (logprobs): the
  // usage's cached prompt tokens, and whether the tokens are the model's reference.
  std::pair<int, bool> CompletionFromTiers(const std::string& text, int n) {
    const json body = {{"model", "tiny"},
                       {"prompt", text},
                       {"max_tokens", n},
                       {"temperature", 0},
                       {"logprobs", 1}};
    absl::StatusOr<testing::HttpResponse> reply =
        testing::HttpPost(url_ + "/v1/completions", body.dump(), absl::Seconds(60));
    EXPECT_THAT(reply, IsOk());
    if (!reply.ok()) return {-1, false};
    EXPECT_EQ(reply->status, 200) << reply->body;
    const json parsed = json::parse(reply->body, nullptr, /*allow_exceptions=*/false);
    if (!parsed.is_object() || !parsed.contains("usage") || !parsed.contains("choices")) {
      ADD_FAILURE() << reply->body;
      return {-1, false};
    }
    const int cached = parsed["usage"]["prompt_tokens_details"]["cached_tokens"].get<int>();
    // A byte token's text as the router writes it (http_frontend.cc, OpenAiTokenText): the
    // byte when ASCII, else "bytes:\xNN"; a token with no text (a special one, or one
    // past the byte tokens) "token_id:N".
    std::vector<std::string> want;
    for (int32_t id : KnownReference(text, n)) {
      if (id < 3 || id >= 3 + 256) {
        want.push_back(absl::StrCat("token_id:", id));
      } else if (id - 3 < 0x80) {
        want.push_back(std::string(1, static_cast<char>(id - 3)));
      } else {
        want.push_back(absl::StrFormat("bytes:\\x%02x", id - 3));
      }
    }
    std::vector<std::string> got;
    const json& logprobs = parsed["choices"][0]["logprobs"];
    if (logprobs.is_object() && logprobs.contains("tokens")) {
      for (const json& t : logprobs["tokens"]) got.push_back(t.get<std::string>());
    }
    const bool same = got == want;
    EXPECT_TRUE(same) << "'" << text << "': " << reply->body;
    return {cached, same};
  }

  // The cache manager killed (its pid), kvcm-launch restarts it (see KillWhileLoading).
  void KillWhileLoading(const std::string& process);
};

// 1. The cache manager SIGKILLed while its movers write blocks and requests run.
TEST_F(TierFaultTest, CacheManagerKilledMidWriteRecoversOnlyWhatItStoredAndServesNothingTorn) {
  std::mt19937_64 rng(SeedFor("CacheManagerKilledMidWrite"));
  std::vector<std::string> prompts;
  // Prompts of 100 to 225 blocks: each prefill commits them at once, so the movers have a
  // backlog of writes after it.
  for (int p = 0; p < 12; ++p) prompts.push_back(TieredPrompt(p, 400 + rng() % 500));
  for (const std::string& text : prompts) references_[{text, 6}] = Reference(text, 6);
  references_[{"probe after a restart", 2}] = Reference("probe after a restart", 2);
  ASSERT_NO_FATAL_FAILURE(Launch(/*executors=*/1, /*num_blocks=*/1024, TierFlags()));

  // Two clients, each its own seeded order of the prompts, until told to stop.
  std::atomic<bool> stop{false};
  Mutex mutex;
  std::map<std::string, int> outcomes;
  std::vector<std::string> bad;
  std::vector<std::thread> clients;
  for (int c = 0; c < 2; ++c) {
    clients.emplace_back([&, c, client_seed = rng()] {
      std::mt19937_64 order(client_seed);
      while (!stop.load()) {
        const std::string& text = prompts[order() % prompts.size()];
        const Outcome outcome = Request(text, 6, absl::Seconds(60));
        MutexLock lock(&mutex);
        ++outcomes[outcome.kind];
        if (!outcome.acceptable) bad.push_back(outcome.kind + ": " + outcome.detail);
      }
      (void)c;
    });
  }
  const auto stop_clients = [&] {
    stop = true;
    for (std::thread& t : clients) t.join();
    clients.clear();
  };
  // On any early return (a failed ASSERT) too.
  struct Finally {
    std::function<void()> run;
    ~Finally() { run(); }
  } join_clients{stop_clients};

  // Until the movers have written a seeded number of blocks and have a backlog of writes
  // (slots being written: a store's slots count as writing from when it is queued).
  const int until = 20 + static_cast<int>(rng() % 200);
  const std::string url = CacheManagerMetricsUrl();
  const std::vector<std::string> series = {
      "kvcm_cache_manager_tier_stored_blocks_total{tier=\"disk\"}",
      "kvcm_cache_manager_tier_blocks{tier=\"disk\",state=\"writing\"}"};
  ASSERT_THAT(testing::WaitFor(
                  [&] {
                    const std::vector<double> now = ScrapeSeries(url, series);
                    return now[0] >= until && now[1] >= 20;
                  },
                  absl::Seconds(90), "a backlog of disk writes"),
              IsOk());

  // The router stopped, so that no Step commits a block (queues a store) after the counts
  // are read: the bound below is then exact. The stores already queued go on, and the kill
  // finds those not yet done mid-write (or queued).
  const pid_t router = CurrentPid("router");
  const pid_t cache_manager = CurrentPid("cache-manager");
  ASSERT_EQ(::kill(router, SIGSTOP), 0);
  // A Step the router sent before it stopped may still commit: until stored + writing (which
  // a finished write leaves unchanged; only a new store raises it) holds for 20 ms.
  double sum = -2;
  const absl::Status settled = testing::WaitFor(
      [&] {
        const std::vector<double> now = ScrapeSeries(url, series);
        const double previous = sum;
        sum = now[0] + now[1];
        // Kept: a quiet window is the check (nothing marks the last Step in flight). A Step
        // later than it only breaks the bound if its store is queued and written whole between
        // the scrape below and the SIGKILL right after it.
        absl::SleepFor(absl::Milliseconds(20));
        return now[0] >= 0 && now[1] >= 0 && sum == previous;
      },
      absl::Seconds(30), "no store queued while the router is stopped");
  const std::vector<double> at_kill = ScrapeSeries(url, series);
  ASSERT_EQ(::kill(cache_manager, SIGKILL), 0);
  ::kill(router, SIGCONT);
  ASSERT_THAT(settled, IsOk());
  ASSERT_GE(at_kill[0], 0);
  ASSERT_GE(at_kill[1], 0);
  const double bound = at_kill[0] + at_kill[1];
  std::cout << "killed the cache manager (pid " << cache_manager << ") with " << at_kill[0]
            << " blocks stored on disk and " << at_kill[1] << " being written\n";

  ASSERT_NO_FATAL_FAILURE(AwaitRestarted("cache-manager", cache_manager));
  stop_clients();
  const double recovered = Metric("kvcm_cache_manager_tier_recovered_blocks_total");
  std::cout << "recovered " << recovered << " blocks (at most " << bound << ")\n";
  EXPECT_GT(recovered, 0) << testing::Tail(launch_->Output(), 6000);
  EXPECT_LE(recovered, bound) << "a slot recovered that no write completed";
  {
    MutexLock lock(&mutex);
    std::string tally;
    for (const auto& [kind, count] : outcomes) absl::StrAppend(&tally, " ", kind, "=", count);
    std::cout << "requests:" << tally << "\n";
    EXPECT_TRUE(bad.empty()) << absl::StrJoin(bad, "\n");
    EXPECT_GT(outcomes["completed"], 0);
  }

  // The same prompts again: from the recovered slots or computed, the model's tokens. A torn
  // slot would be refused (counted by reason) and computed.
  for (const std::string& text : prompts) {
    const Outcome outcome = Request(text, 6, absl::Seconds(60));
    EXPECT_EQ(outcome.kind, "completed") << outcome.detail;
  }
  std::cout << "refusals after the restart: "
            << SumOfFamily(CacheManagerMetricsUrl(), "kvcm_cache_manager_tier_refusals_total")
            << ", disk loads: "
            << Metric("kvcm_cache_manager_tier_loaded_blocks_total{tier=\"disk\"}") << "\n";
  ExpectLedgerWhole();
  ExpectCleanShutdown({});
}

// 2. A working set four times the pool, served twice.
TEST_F(TierFaultTest, AWorkingSetFourTimesThePoolComesBackFromTheHostAndDiskTiers) {
  constexpr int kPoolBlocks = 64;
  constexpr int kPrompts = 8;
  constexpr int kChars = 127;  // with BOS 128 tokens: 32 full blocks; 8 prompts: 4x the pool
  std::vector<std::string> prompts;
  for (int p = 0; p < kPrompts; ++p) {
    std::string text = TieredPrompt(p, kChars);
    text.resize(kChars);
    prompts.push_back(text);
    references_[{text, 6}] = Reference(text, 6);
  }
  ASSERT_NO_FATAL_FAILURE(Launch(/*executors=*/1, kPoolBlocks,
                                 TierFlags(absl::StrCat(kPoolBlocks * kBlockBytes), "16MiB")));

  // Round one: each prompt computed, and on disk before the next (a store still queued when
  // the pool needs its block is dropped, by design).
  int full_blocks = 0;
  for (const std::string& text : prompts) {
    const Outcome outcome = Request(text, 6, absl::Seconds(60));
    EXPECT_EQ(outcome.kind, "completed") << outcome.detail;
    full_blocks += (kChars + 1) / 4;
    ASSERT_NO_FATAL_FAILURE(AwaitStoredOnDisk(full_blocks));
  }
  ExpectLedgerWhole();

  // Round two: the pool holds the last prompts' blocks at most; the rest come from the
  // host tier (the last ones written) and the disk tier (all).
  int cached = 0;
  for (const std::string& text : prompts) {
    const auto [prompt_cached, same] = CompletionFromTiers(text, 6);
    std::cout << "'" << text.substr(0, 12) << "...': " << prompt_cached << " cached of "
              << kChars + 1 << "\n";
    cached += std::max(prompt_cached, 0);
  }
  EXPECT_GE(cached, 0.8 * full_blocks * 4) << cached << " of " << full_blocks * 4;
  const double router_host =
      RouterMetric("kvcm_router_prompt_tokens_from_tier_total{tier=\"host\"}");
  const double router_disk =
      RouterMetric("kvcm_router_prompt_tokens_from_tier_total{tier=\"disk\"}");
  const double loaded_host = Metric("kvcm_cache_manager_tier_loaded_blocks_total{tier=\"host\"}");
  const double loaded_disk = Metric("kvcm_cache_manager_tier_loaded_blocks_total{tier=\"disk\"}");
  std::cout << "router: from host " << router_host << ", from disk " << router_disk
            << " tokens; cache manager: loaded " << loaded_host << " from host, " << loaded_disk
            << " from disk\n";
  EXPECT_GT(router_host, 0);
  EXPECT_GT(router_disk, 0);
  EXPECT_GT(loaded_host, 0);
  EXPECT_GT(loaded_disk, 0);
  // And through /generate, the model's tokens once more.
  ServeAll(prompts);
  ExpectLedgerWhole();
  ExpectCleanShutdown({});
}

// 3. The router or an executor SIGKILLed while a request's blocks load from the disk tier.
void TierFaultTest::KillWhileLoading(const std::string& process) {
  std::mt19937_64 rng(SeedFor("KillWhileLoading " + process));
  // Long prompts (about 230 blocks each; the router takes fewer than 1024 tokens), so that
  // their loads take a while.
  std::vector<std::string> prompts;
  for (int p = 0; p < 2; ++p) prompts.push_back(TieredPrompt(p, 850 + rng() % 100));
  for (const std::string& text : prompts) references_[{text, 6}] = Reference(text, 6);
  references_[{"probe after a restart", 2}] = Reference("probe after a restart", 2);
  ASSERT_NO_FATAL_FAILURE(Launch(/*executors=*/1, /*num_blocks=*/1024, TierFlags()));
  ServeAll(prompts);
  // Every block the requests committed is on disk before the kill: each computed its
  // prompt (BOS and a token per byte) and 5 of its 6 new tokens, and committed their full
  // blocks. (Waiting for 90% of them let a missing block in the middle of a prompt cut its
  // prefix below the 90% checked at the end, depending on the mover's pace.)
  int committed_blocks = 0;
  for (const std::string& text : prompts) {
    committed_blocks += static_cast<int>(text.size() + 1 + 5) / 4;
  }
  ASSERT_NO_FATAL_FAILURE(AwaitStoredOnDisk(committed_blocks));
  ASSERT_NO_FATAL_FAILURE(KillEverything());

  // The whole stack again on the directory: the prompts are on disk only.
  ASSERT_NO_FATAL_FAILURE(Launch(/*executors=*/1, /*num_blocks=*/1024, TierFlags()));
  ASSERT_GT(Metric("kvcm_cache_manager_tier_recovered_blocks_total"), 0);
  const std::string& text = prompts[rng() % prompts.size()];
  const pid_t victim = CurrentPid(process);
  ASSERT_GT(victim, 0);
  Outcome outcome;
  std::atomic<bool> done{false};
  std::thread client([&] {
    outcome = Request(text, 6, absl::Seconds(90));
    done = true;
  });
  // Until the cache manager loads the prompt's blocks (or the request is over), as fast as
  // it can be scraped; then the kill.
  const std::string url = CacheManagerMetricsUrl();
  double loading = 0;
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (!done.load() && absl::Now() < deadline) {
    loading = MetricAt(url, "kvcm_cache_manager_tier_loading_blocks");
    if (loading > 0) break;
  }
  ::kill(victim, SIGKILL);
  std::cout << "SIGKILL " << process << " (pid " << victim << ") with " << loading
            << " blocks loading" << (done.load() ? " (the request was already over)" : "") << "\n";
  client.join();
  std::cout << "the request: " << outcome.kind << "\n";
  EXPECT_TRUE(outcome.acceptable) << outcome.kind << ": " << outcome.detail;
  ASSERT_NO_FATAL_FAILURE(AwaitRestarted(process, victim));

  // Nothing leaked: no block in use, held or loading.
  ExpectLedgerWhole();
  // The prompt afterwards: its blocks cached (loaded then, or now), the model's tokens.
  const auto [cached, total] = CachedTokens(text);
  EXPECT_GE(cached, 0.9 * total) << cached << " of " << total;
  const Outcome again = Request(text, 6, absl::Seconds(60));
  EXPECT_EQ(again.kind, "completed") << again.detail;
  ExpectLedgerWhole();
  ExpectCleanShutdown({});
}

TEST_F(TierFaultTest, RouterKilledWhileItsRequestsBlocksLoadLeaksNothing) {
  KillWhileLoading("router");
}

TEST_F(TierFaultTest, ExecutorKilledWhileItsRequestsBlocksLoadLeaksNothing) {
  KillWhileLoading("executor-0");
}

// 4. A disk tier directory that cannot be created: the start fails, naming it.
TEST_F(TierFaultTest, ADiskTierDirectoryUnderARegularFileFailsTheStartNamingIt) {
  std::ofstream(dir_->path() + "/file") << "not a directory\n";
  const std::string tier = dir_->path() + "/file/tier";
  const auto [code, output] =
      LaunchExpectingFailure({"--cache-manager-arg=--disk-tier-dir=" + tier,
                              "--cache-manager-arg=--disk-tier-bytes=16MiB"});
  EXPECT_NE(code, 0) << testing::Tail(output, 6000);
  EXPECT_NE(code, -1) << "kvcm-launch did not exit\n" << testing::Tail(output, 6000);
  EXPECT_TRUE(absl::StrContains(output, tier)) << testing::Tail(output, 6000);
}

// A disk tier bigger than the file system allows. The slot files are preallocated at start
// (fallocate), so a disk too small shows there, as a failed start naming the bytes, and
// never while serving. RLIMIT_FSIZE stands in for a small file system: fallocate past it
// fails with EFBIG (and raises SIGXFSZ).
TEST_F(TierFaultTest, ADiskTierBiggerThanTheFileSystemAllowsFailsTheStartNamingTheBytes) {
  constexpr int64_t kFileSizeLimit = 8 << 20;  // room for the logs, not for the slots
  launch_wrapper_ = {"prlimit", absl::StrCat("--fsize=", kFileSizeLimit), "--"};
  const auto [code, output] =
      LaunchExpectingFailure({"--cache-manager-arg=--disk-tier-dir=" + TierDir(),
                              "--cache-manager-arg=--disk-tier-bytes=64MiB"});
  EXPECT_NE(code, 0) << testing::Tail(output, 6000);
  EXPECT_NE(code, -1) << "kvcm-launch did not exit\n" << testing::Tail(output, 6000);
  EXPECT_TRUE(std::regex_search(output, std::regex("cannot preallocate [0-9]+ bytes")))
      << testing::Tail(output, 6000);
  EXPECT_TRUE(absl::StrContains(output, TierDir())) << testing::Tail(output, 6000);
}

// 5. A second cache manager on the directory the stack's cache manager holds.
TEST_F(TierFaultTest, ASecondCacheManagerOnTheDirectoryFailsNamingTheHolder) {
  references_[{"probe after a restart", 2}] = Reference("probe after a restart", 2);
  ASSERT_NO_FATAL_FAILURE(Launch(/*executors=*/1, /*num_blocks=*/64, TierFlags()));
  const pid_t holder = CurrentPid("cache-manager");
  ASSERT_GT(holder, 0);
  testing::Subprocess::Options options;
  options.argv = {testing::KvcmBinaryPath("kvcm-cache-manager"),
                  "--run-dir=" + dir_->path() + "/second-run",
                  "--disk-tier-dir=" + TierDir(),
                  "--disk-tier-bytes=64MiB",
                  "--model-config=" + model_dir_,
                  "--num-blocks=16",
                  "--block-size=4",
                  "--metrics-address=127.0.0.1:0"};
  options.output_path = dir_->path() + "/second.log";
  absl::StatusOr<std::unique_ptr<testing::Subprocess>> second = testing::Subprocess::Start(options);
  ASSERT_THAT(second, IsOk());
  absl::StatusOr<int> code = (*second)->Wait(absl::Seconds(60));
  if (!code.ok()) (*second)->Stop(absl::Seconds(10));
  const std::string output = (*second)->Output();
  ASSERT_THAT(code, IsOk()) << "the second cache manager did not exit\n" << output;
  EXPECT_NE(*code, 0) << output;
  EXPECT_TRUE(absl::StrContains(output, absl::StrCat("in use by pid ", holder))) << output;
  // The stack's own cache manager still serves, and still holds the directory.
  EXPECT_EQ(CurrentPid("cache-manager"), holder);
  EXPECT_EQ(Request("probe after a restart", 2, absl::Seconds(60)).kind, "completed");
  ExpectLedgerWhole();
  ExpectCleanShutdown({});
}

}  // namespace
}  // namespace kvcm::faults
