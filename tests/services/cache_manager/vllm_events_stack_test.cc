// The vLLM-format KV event stream of a whole node (docs/protocol.md, "vLLM-format KV
// events"): the real cache manager, router and executor of a tiny model, requests over
// HTTP, and a consumer reading the stream over loopback TCP. The token ids of every stored
// block are the prompt's, as the router's /tokenize gives them, block by block and chained
// by parent; eviction removes ids that were stored.

#include <cstdio>
#include <map>
#include <random>
#include <utility>

#include "common/base/monotonic_clock.h"
#include "tests/services/router/router_stack.h"
#include "tests/support/status_matchers.h"
#include "tests/support/vllm_event_reader.h"
#include "tests/support/wait_for.h"

namespace kvcm::testing {
namespace {

class VllmEventsStackTest : public RouterStackTest {
 protected:
  void StartNode(int32_t num_blocks) {
    CacheManagerOptions options = ManagerOptions(num_blocks, "");
    options.extra_args = {"--kv-events-endpoint", "tcp://127.0.0.1:0",
                          "--kv-events-replay-endpoint", "tcp://127.0.0.1:0"};
    absl::StatusOr<std::unique_ptr<CacheManagerProcess>> cm = CacheManagerProcess::Start(options);
    ASSERT_THAT(cm, IsOk());
    cm_ = std::move(*cm);
    auto line =
        cm_->process().WaitForLine("vLLM-format KV events on (\\S+) topic=(\\S+) replay=(\\S+)",
                                   absl::Now() + absl::Seconds(60));
    ASSERT_THAT(line, IsOk());
    replay_ = (*line)[3];
    ASSERT_NO_FATAL_FAILURE(StartRouterAndExecutors(1, {}, {}));
  }

  std::vector<int32_t> Tokenize(const std::string& text) {
    absl::StatusOr<HttpResponse> reply =
        HttpPost(url_ + "/tokenize", json{{"inputs", text}}.dump(), absl::Seconds(10));
    EXPECT_TRUE(reply.ok() && reply->status == 200) << (reply.ok() ? reply->body : "");
    std::vector<int32_t> ids;
    if (!reply.ok()) return ids;
    for (const json& token : json::parse(reply->body)) ids.push_back(token["id"].get<int32_t>());
    return ids;
  }

  void Generate(const std::string& text) {
    absl::StatusOr<HttpResponse> reply =
        HttpPost(url_ + "/generate", GenerateBody(text, 3), absl::Seconds(60));
    ASSERT_THAT(reply, IsOk());
    ASSERT_EQ(reply->status, 200) << reply->body;
  }

  // The stream once the node is idle: a reply to /generate can come before the router's
  // next step commits and frees the sequence (and the events of that), so the test waits
  // for no block in use rather than read the stream at a moment that only usually follows
  // them (docs/RELIABILITY.md, "Timing in tests").
  std::vector<ReadVllmBatch> Replay() {
    // One control session for every poll: a session each would pile up against the
    // cache manager's limit of sessions per process.
    CacheManagerClient::Options options;
    options.endpoint = cm_->endpoint();
    options.role = wire::Role::Control;
    options.name = "test";
    auto control = CacheManagerClient::Connect(options);
    EXPECT_THAT(control, IsOk());
    if (control.ok()) {
      const absl::Status idle = WaitFor(
          [&] {
            absl::StatusOr<StatsSnapshot> stats = (*control)->Stats();
            return !stats.ok() || stats->in_use_blocks == 0;
          },
          absl::Seconds(60), "no block in use");
      EXPECT_THAT(idle, IsOk());
    }
    auto batches = ReplayVllmEvents(replay_, 0, MonotonicNow() + absl::Seconds(60));
    EXPECT_THAT(batches, IsOk());
    return batches.ok() ? *std::move(batches) : std::vector<ReadVllmBatch>{};
  }

  std::string replay_;
};

// A consumer's view of the stream: each stored block by id, its parent and tokens.
struct Block {
  std::optional<uint64_t> parent;
  std::vector<uint32_t> tokens;
};
struct View {
  std::map<uint64_t, Block> live;
  std::map<uint64_t, Block> ever;
  std::vector<uint64_t> removed;
};

View Apply(const std::vector<ReadVllmBatch>& batches) {
  View view;
  for (size_t b = 0; b < batches.size(); ++b) {
    EXPECT_EQ(batches[b].seq, b);
    for (const ReadVllmEvent& event : batches[b].events) {
      if (event.type == "AllBlocksCleared") {
        EXPECT_EQ(b, 0u);
        view.live.clear();
      } else if (event.type == "BlockStored") {
        EXPECT_EQ(event.block_size, kBlockSize);
        std::optional<uint64_t> parent = event.parent_block_hash;
        if (parent) {
          EXPECT_TRUE(view.live.contains(*parent)) << "unknown parent " << *parent;
        }
        for (size_t i = 0; i < event.block_hashes.size(); ++i) {
          Block block;
          block.parent = parent;
          block.tokens.assign(
              event.token_ids.begin() + static_cast<ptrdiff_t>(i * kBlockSize),
              event.token_ids.begin() + static_cast<ptrdiff_t>((i + 1) * kBlockSize));
          const uint64_t id = event.block_hashes[i];
          EXPECT_FALSE(view.live.contains(id)) << "stored twice: " << id;
          view.live[id] = block;
          view.ever[id] = block;
          parent = id;
        }
      } else {
        for (uint64_t id : event.block_hashes) {
          EXPECT_TRUE(view.live.erase(id)) << "removed " << id << ", not stored";
          view.removed.push_back(id);
        }
      }
    }
  }
  return view;
}

// The ids of `prompt`'s full blocks in `blocks`, following the chain from the root; fewer
// when a block is missing.
std::vector<uint64_t> Chain(const std::map<uint64_t, Block>& blocks,
                            const std::vector<int32_t>& prompt) {
  std::vector<uint64_t> ids;
  std::optional<uint64_t> parent;
  for (size_t i = 0; i + kBlockSize <= prompt.size(); i += kBlockSize) {
    const std::vector<uint32_t> want(prompt.begin() + static_cast<ptrdiff_t>(i),
                                     prompt.begin() + static_cast<ptrdiff_t>(i + kBlockSize));
    bool found = false;
    for (const auto& [id, block] : blocks) {
      if (block.parent == parent && block.tokens == want) {
        ids.push_back(id);
        parent = id;
        found = true;
        break;
      }
    }
    if (!found) break;
  }
  return ids;
}

TEST_F(VllmEventsStackTest, StoredTokensAreThePromptsBlockByBlockAndEvictionRemovesThem) {
  ASSERT_NO_FATAL_FAILURE(StartNode(/*num_blocks=*/40));
  const std::string system = "You are a terse assistant who answers in one word. ";
  const std::string a = system + "Name a colour.";
  const std::string b = system + "Name a fruit, please.";
  ASSERT_NO_FATAL_FAILURE(Generate(a));
  ASSERT_NO_FATAL_FAILURE(Generate(b));
  // The prompt's ids: /tokenize's, the BOS first (the tiny model's: 1), then one id per byte.
  const std::vector<int32_t> tokens_a = Tokenize(a);
  const std::vector<int32_t> tokens_b = Tokenize(b);
  ASSERT_FALSE(tokens_a.empty());
  EXPECT_EQ(tokens_a[0], 1);
  EXPECT_EQ(tokens_a, PromptIds(a));
  EXPECT_EQ(tokens_b, PromptIds(b));
  ASSERT_GT(tokens_a.size(), 10u * kBlockSize);

  const std::vector<ReadVllmBatch> first_batches = Replay();
  View view = Apply(first_batches);
  const std::vector<uint64_t> chain_a = Chain(view.live, tokens_a);
  const std::vector<uint64_t> chain_b = Chain(view.live, tokens_b);
  EXPECT_EQ(chain_a.size(), tokens_a.size() / kBlockSize);
  EXPECT_EQ(chain_b.size(), tokens_b.size() / kBlockSize);
  // The shared system prompt's full blocks are the same ids in both chains.
  size_t shared = 0;
  while (shared < std::min(tokens_a.size(), tokens_b.size()) &&
         tokens_a[shared] == tokens_b[shared]) {
    ++shared;
  }
  const size_t shared_blocks = shared / kBlockSize;
  ASSERT_GT(shared_blocks, 5u);
  for (size_t i = 0; i < shared_blocks && i < chain_a.size() && i < chain_b.size(); ++i) {
    EXPECT_EQ(chain_a[i], chain_b[i]) << "block " << i;
  }
  if (shared_blocks < chain_a.size() && shared_blocks < chain_b.size()) {
    EXPECT_NE(chain_a[shared_blocks], chain_b[shared_blocks]);
  }

  // Distinct prompts through a pool of 40 blocks: the first prompts' blocks are evicted,
  // and each removal names an id stored before.
  const uint32_t seed = 20261202;
  std::printf("seed %u\n", seed);
  std::mt19937 rng(seed);
  for (int i = 0; i < 6; ++i) {
    std::string text;
    for (int c = 0; c < 60; ++c) text.push_back(static_cast<char>('a' + rng() % 26));
    ASSERT_NO_FATAL_FAILURE(Generate(text));
  }
  const std::vector<ReadVllmBatch> batches = Replay();
  view = Apply(batches);
  ASSERT_FALSE(view.removed.empty());
  for (uint64_t id : view.removed) EXPECT_TRUE(view.ever.contains(id)) << id;
  size_t evicted = 0;
  for (uint64_t id : chain_a) {
    evicted += std::find(view.removed.begin(), view.removed.end(), id) != view.removed.end();
  }
  EXPECT_GT(evicted, 0u) << "none of the first prompt's blocks was evicted";
  // The ledger agrees with the consumer's view: as many indexed blocks as live ids.
  const StatsSnapshot stats = Stats();
  EXPECT_EQ(static_cast<int64_t>(view.live.size()),
            static_cast<int64_t>(stats.cached_blocks + stats.pinned_blocks + stats.in_use_blocks))
      << "cached " << stats.cached_blocks << " in use " << stats.in_use_blocks;
}

}  // namespace
}  // namespace kvcm::testing
