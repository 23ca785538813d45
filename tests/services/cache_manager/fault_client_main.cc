// A router-like client process for the cache manager's fault tests: it registers, takes
// --blocks blocks in committed sequences, prints them, then keeps the session busy with a
// Stats call every 50 ms until it is killed.
//
// Output (stdout), one line each:
//   held <n> <block id> <block id> ...
//   ready session=<id>
//   refused: <status>            a call failed (e.g. after SIGSTOP past the timeout)
//   registered anew session=<id> the next call succeeded on a new session
//
//   fault_client --endpoint ipc://RUN_DIR/cache-manager.sock --blocks 1000

#include <unistd.h>

#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/block/block_hash.h"
#include "common/client/cache_manager_client.h"

namespace kvcm::cache_manager {
namespace {

int Run(const std::string& endpoint, int32_t blocks) {
  CacheManagerClient::Options options;
  options.endpoint = endpoint;
  options.role = wire::Role::Router;
  options.name = "fault-client";
  auto client = CacheManagerClient::Connect(options);
  if (!client.ok()) {
    std::printf("connect failed: %s\n", client.status().ToString().c_str());
    return 1;
  }
  const int32_t block_size = (*client)->session().block_size;
  constexpr int32_t kBlocksPerSeq = 10;
  std::vector<int32_t> held;
  const BlockHash root = RootHash(HashAlgorithm::kSha256, absl::StrCat("fault-", ::getpid()));
  for (uint64_t seq = 1; static_cast<int32_t>(held.size()) < blocks; ++seq) {
    const int32_t n = std::min(kBlocksPerSeq, blocks - static_cast<int32_t>(held.size()));
    std::vector<int32_t> tokens(static_cast<size_t>(n * block_size));
    for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>(seq * 1000 + i);
    std::vector<BlockHash> hashes;
    HashFullBlocks(HashAlgorithm::kSha256, root, tokens, block_size, &hashes);
    BlockOps step;
    // Seq ids in this process's own range, so that two fault clients never collide.
    const uint64_t id = (static_cast<uint64_t>(::getpid()) << 32) | seq;
    step.Allocate(id, n * block_size, hashes);
    auto outcome = (*client)->Step(step);
    if (!outcome.ok() || !(*outcome)[0].status.ok()) {
      std::printf("allocate failed: %s\n",
                  (!outcome.ok() ? outcome.status() : (*outcome)[0].status).ToString().c_str());
      return 1;
    }
    held.insert(held.end(), (*outcome)[0].blocks.begin(), (*outcome)[0].blocks.end());
    // As a router does once its executors wrote the KV: the commit comes in a later step.
    step.Clear();
    step.Commit(id, n * block_size);
    auto committed = (*client)->Step(step);
    if (!committed.ok() || !(*committed)[0].status.ok()) {
      std::printf(
          "commit failed: %s\n",
          (!committed.ok() ? committed.status() : (*committed)[0].status).ToString().c_str());
      return 1;
    }
  }
  std::string line = absl::StrCat("held ", held.size());
  for (int32_t b : held) absl::StrAppend(&line, " ", b);
  std::printf("%s\nready session=%llu\n", line.c_str(),
              static_cast<unsigned long long>((*client)->session_id()));
  std::fflush(stdout);

  bool refused = false;
  while (true) {
    absl::SleepFor(absl::Milliseconds(50));
    auto stats = (*client)->Stats();
    if (!stats.ok()) {
      std::printf("refused: %s\n", stats.status().ToString().c_str());
      refused = true;
      // It writes nothing, so it may register again at once (the client never does so by
      // itself).
      if (absl::IsAborted(stats.status())) (void)(*client)->Reregister();
    } else if (refused) {
      std::printf("registered anew session=%llu\n",
                  static_cast<unsigned long long>((*client)->session_id()));
      refused = false;
    }
    std::fflush(stdout);
  }
}

}  // namespace
}  // namespace kvcm::cache_manager

int main(int argc, char** argv) {
  std::string endpoint;
  int32_t blocks = 0;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--endpoint") endpoint = argv[i + 1];
    if (flag == "--blocks" && !absl::SimpleAtoi(argv[i + 1], &blocks)) blocks = -1;
  }
  if (endpoint.empty() || blocks <= 0) {
    std::fprintf(stderr, "usage: fault_client --endpoint ENDPOINT --blocks N\n");
    return 2;
  }
  return kvcm::cache_manager::Run(endpoint, blocks);
}
