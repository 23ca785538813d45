// The real kvcm-cache-manager's vLLM-format KV event stream (docs/protocol.md, "vLLM-format
// KV events"), read over loopback TCP by a consumer written against the format
// (tests/support/vllm_event_reader.h): sequence numbers from 0, AllBlocksCleared first and
// after a restart, which goes on above the numbers sent before, stored blocks with their token ids
// and parents, removals of stored ids on eviction, replay to a late subscriber ending with the -1
// frame, a buffer that wrapped, and bad input on the replay socket and in Commits.

#include <csignal>
#include <cstdio>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/base/atomic_file.h"
#include "common/base/monotonic_clock.h"
#include "common/block/block_hash.h"
#include "common/client/cache_manager_client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "services/cache_manager/vllm_event_publisher.h"
#include "services/cache_manager/vllm_events.h"
#include "tests/support/cache_manager_process.h"
#include "tests/support/http_client.h"
#include "tests/support/metrics_text.h"
#include "tests/support/mixed_model_config.h"
#include "tests/support/status_matchers.h"
#include "tests/support/vllm_event_reader.h"
#include "tests/support/wait_for.h"

namespace kvcm::cache_manager {
namespace {

using testing::CacheManagerOptions;
using testing::CacheManagerProcess;
using testing::ReadVllmBatch;
using testing::ReadVllmEvent;

constexpr int32_t kBlockSize = 4;

struct Node {
  std::unique_ptr<CacheManagerProcess> process;
  std::string events;  // tcp://127.0.0.1:P
  std::string replay;
  std::string topic;
};

// A cache manager of `num_blocks` with the vLLM-format stream on ports picked free.
Node StartNode(int32_t num_blocks, const std::string& run_dir = "", int32_t buffer_steps = 10000) {
  CacheManagerOptions options;
  options.run_dir = run_dir;
  options.num_blocks = num_blocks;
  options.block_size = kBlockSize;
  options.extra_args = {"--kv-events-endpoint",        "tcp://127.0.0.1:0",
                        "--kv-events-replay-endpoint", "tcp://127.0.0.1:0",
                        "--kv-events-buffer-steps",    absl::StrCat(buffer_steps)};
  Node node;
  auto started = CacheManagerProcess::Start(options);
  EXPECT_THAT(started, IsOk());
  if (!started.ok()) return node;
  node.process = *std::move(started);
  auto line = node.process->process().WaitForLine(
      "vLLM-format KV events on (\\S+) topic=(\\S+) replay=(\\S+)",
      absl::Now() + absl::Seconds(10));
  EXPECT_THAT(line, IsOk());
  if (!line.ok()) return node;
  node.events = (*line)[1];
  node.topic = (*line)[2];
  node.replay = (*line)[3];
  return node;
}

std::unique_ptr<CacheManagerClient> ConnectRouter(const CacheManagerProcess& process) {
  CacheManagerClient::Options options;
  options.endpoint = process.endpoint();
  options.role = wire::Role::Router;
  options.name = "vllm-events-test";
  auto client = CacheManagerClient::Connect(options);
  EXPECT_THAT(client, IsOk());
  return client.ok() ? *std::move(client) : nullptr;
}

// The chained hashes of the full blocks of `tokens`, as a router computes them.
std::vector<BlockHash> Hashes(const std::vector<int32_t>& tokens) {
  std::vector<BlockHash> hashes;
  HashFullBlocks(kDefaultHashAlgorithm, RootHash(kDefaultHashAlgorithm, ""), tokens, kBlockSize,
                 &hashes);
  return hashes;
}

std::vector<uint64_t> Ids(const std::vector<BlockHash>& hashes) {
  std::vector<uint64_t> ids;
  for (const BlockHash& h : hashes) ids.push_back(VllmBlockId(h));
  return ids;
}

// Allocates, commits (with token ids) and frees one sequence of `tokens`.
void RunSequence(CacheManagerClient& client, SeqId seq, const std::vector<int32_t>& tokens) {
  const std::vector<BlockHash> hashes = Hashes(tokens);
  BlockOps allocate;
  allocate.Allocate(seq, static_cast<int32_t>(tokens.size()));
  auto allocated = client.Step(allocate);
  ASSERT_THAT(allocated, IsOk());
  ASSERT_THAT((*allocated)[0].status, IsOk());
  std::vector<int32_t> full(tokens.begin(),
                            tokens.begin() + static_cast<ptrdiff_t>(hashes.size() * kBlockSize));
  BlockOps commit;
  commit.Commit(seq, static_cast<int32_t>(tokens.size()), hashes, full).Free(seq);
  auto committed = client.Step(commit);
  ASSERT_THAT(committed, IsOk());
  ASSERT_THAT((*committed)[0].status, IsOk());
  ASSERT_THAT((*committed)[1].status, IsOk());
}

std::vector<int32_t> RandomTokens(std::mt19937& rng, int n) {
  std::vector<int32_t> tokens(static_cast<size_t>(n));
  for (int32_t& t : tokens) t = static_cast<int32_t>(rng() % 50000);
  return tokens;
}

// Runs a prompt of 3 full blocks and 2 tokens more (sequence 1, `first`), one sharing its
// first 2 blocks (sequence 2, `second`), then `evicting` prompts of `evicting_tokens` each,
// enough to evict everything.
void RunSharedThenEvicting(CacheManagerClient& client, std::mt19937& rng, SeqId evicting,
                           int evicting_tokens, std::vector<int32_t>* first,
                           std::vector<int32_t>* second) {
  *first = RandomTokens(rng, 14);
  second->assign(first->begin(), first->begin() + 8);
  for (int32_t t : RandomTokens(rng, 8)) second->push_back(t);
  ASSERT_NO_FATAL_FAILURE(RunSequence(client, 1, *first));
  ASSERT_NO_FATAL_FAILURE(RunSequence(client, 2, *second));
  for (SeqId seq = 3; seq < 3 + evicting; ++seq) {
    ASSERT_NO_FATAL_FAILURE(RunSequence(client, seq, RandomTokens(rng, evicting_tokens)));
  }
}

std::vector<ReadVllmBatch> Replay(const Node& node, uint64_t from) {
  auto batches = testing::ReplayVllmEvents(node.replay, from, MonotonicNow() + absl::Seconds(10));
  EXPECT_THAT(batches, IsOk());
  return batches.ok() ? *std::move(batches) : std::vector<ReadVllmBatch>{};
}

void ExpectSameEvents(const ReadVllmBatch& a, const ReadVllmBatch& b) {
  EXPECT_EQ(a.seq, b.seq);
  EXPECT_EQ(a.topic, b.topic);
  ASSERT_EQ(a.events.size(), b.events.size()) << "seq " << a.seq;
  for (size_t i = 0; i < a.events.size(); ++i) {
    EXPECT_EQ(a.events[i].type, b.events[i].type);
    EXPECT_EQ(a.events[i].block_hashes, b.events[i].block_hashes);
    EXPECT_EQ(a.events[i].parent_block_hash, b.events[i].parent_block_hash);
    EXPECT_EQ(a.events[i].token_ids, b.events[i].token_ids);
  }
}

double Metric(const CacheManagerProcess& process, const std::string& name,
              const testing::MetricLabels& labels = {}) {
  auto scraped = testing::HttpGet(process.metrics_url());
  EXPECT_THAT(scraped, IsOk());
  if (!scraped.ok()) return -1;
  auto parsed = testing::ParseMetricsText(scraped->body);
  EXPECT_THAT(parsed, IsOk());
  if (!parsed.ok()) return -1;
  auto value = parsed->Value(name, labels);
  EXPECT_THAT(value, IsOk());
  return value.ok() ? *value : -1;
}

TEST(VllmEventsProcessTest, StoredBlocksCarryTokensAndEvictionRemovesTheirIds) {
  const uint32_t seed = 20261202;
  std::printf("seed %u\n", seed);
  std::mt19937 rng(seed);
  Node node = StartNode(/*num_blocks=*/8);
  ASSERT_NE(node.process, nullptr);
  EXPECT_THAT(node.topic, ::testing::StartsWith("kv@"));
  auto subscriber =
      testing::VllmEventSubscriber::Connect(node.events, MonotonicNow() + absl::Seconds(10));
  ASSERT_THAT(subscriber, IsOk());
  auto client = ConnectRouter(*node.process);
  ASSERT_NE(client, nullptr);
  EXPECT_TRUE(client->session().wants_commit_tokens);

  std::vector<int32_t> first, second;
  ASSERT_NO_FATAL_FAILURE(RunSharedThenEvicting(*client, rng, 4, 32, &first, &second));

  const std::vector<ReadVllmBatch> batches = Replay(node, 0);
  ASSERT_FALSE(batches.empty());
  // Numbered from 0, contiguous, AllBlocksCleared alone first.
  for (size_t i = 0; i < batches.size(); ++i) {
    EXPECT_EQ(batches[i].seq, i);
    EXPECT_EQ(batches[i].topic, node.topic);
    EXPECT_EQ(batches[i].data_parallel_rank, 0);
    EXPECT_GT(batches[i].timestamp, 1.7e9);
  }
  ASSERT_EQ(batches[0].events.size(), 1u);
  EXPECT_EQ(batches[0].events[0].type, "AllBlocksCleared");

  // Replay the stream into a consumer's view: every id stored once, with a known parent,
  // and removed only after it was stored.
  absl::flat_hash_set<uint64_t> live;
  std::vector<ReadVllmEvent> stored;
  absl::flat_hash_set<uint64_t> removed;
  for (size_t b = 1; b < batches.size(); ++b) {
    const ReadVllmBatch& batch = batches[b];
    for (const ReadVllmEvent& event : batch.events) {
      if (event.type == "BlockStored") {
        EXPECT_EQ(event.block_size, kBlockSize);
        EXPECT_EQ(event.medium, "CPU");  // a shm pool
        if (event.parent_block_hash) {
          EXPECT_TRUE(live.contains(*event.parent_block_hash));
        }
        for (uint64_t id : event.block_hashes) EXPECT_TRUE(live.insert(id).second) << id;
        stored.push_back(event);
      } else if (event.type == "BlockRemoved") {
        for (uint64_t id : event.block_hashes) {
          EXPECT_TRUE(live.erase(id)) << "removed " << id << ", never stored";
          removed.insert(id);
        }
      } else {
        ADD_FAILURE() << "a second AllBlocksCleared at seq " << batch.seq;
      }
    }
  }
  // The first prompt: its 3 full blocks in one chained event, their tokens block by block.
  ASSERT_GE(stored.size(), 2u);
  const std::vector<uint64_t> first_ids = Ids(Hashes(first));
  EXPECT_EQ(stored[0].block_hashes, first_ids);
  EXPECT_EQ(stored[0].parent_block_hash, std::nullopt);
  EXPECT_EQ(stored[0].token_ids, std::vector<uint32_t>(first.begin(), first.begin() + 12));
  // The second shares 2 of its 4 blocks: its last 2 are new, their parent the shared second.
  const std::vector<uint64_t> second_ids = Ids(Hashes(second));
  ASSERT_EQ(second_ids.size(), 4u);
  EXPECT_EQ(stored[1].block_hashes, (std::vector<uint64_t>{second_ids[2], second_ids[3]}));
  EXPECT_EQ(stored[1].parent_block_hash, second_ids[1]);
  EXPECT_EQ(stored[1].token_ids, std::vector<uint32_t>(second.begin() + 8, second.end()));
  // A pool of 8 blocks filled by 8-block prompts: the first prompts' blocks were evicted.
  for (uint64_t id : first_ids) EXPECT_TRUE(removed.contains(id)) << id;
  EXPECT_TRUE(removed.contains(second_ids[2]));

  // The live subscriber saw the same batches (it may have joined after the first ones; its
  // subscription was answered with the latest batch then, which it may see twice).
  uint64_t expected = 0;
  bool first_live = true;
  while (expected < batches.back().seq) {
    auto batch = (*subscriber)->Next(MonotonicNow() + absl::Seconds(10));
    ASSERT_THAT(batch, IsOk());
    if (!first_live) {
      EXPECT_TRUE(batch->seq == expected + 1 || batch->seq == expected) << batch->seq;
    }
    first_live = false;
    expected = batch->seq;
    ASSERT_LT(batch->seq, batches.size());
    ExpectSameEvents(*batch, batches[batch->seq]);
  }

  // A late subscriber asking from seq k gets k.. and the end marker.
  const std::vector<ReadVllmBatch> tail = Replay(node, 3);
  ASSERT_EQ(tail.size(), batches.size() - 3);
  for (size_t i = 0; i < tail.size(); ++i) ExpectSameEvents(tail[i], batches[i + 3]);
  EXPECT_TRUE(Replay(node, batches.size()).empty());

  // Metrics count what went out.
  int64_t stored_events = 0, removed_events = 0;
  for (const ReadVllmBatch& batch : batches) {
    for (const ReadVllmEvent& event : batch.events) {
      stored_events += event.type == "BlockStored";
      removed_events += event.type == "BlockRemoved";
    }
  }
  EXPECT_EQ(Metric(*node.process, "kvcm_cache_manager_vllm_batches_published_total"),
            static_cast<double>(batches.size()));
  EXPECT_EQ(Metric(*node.process, "kvcm_cache_manager_vllm_events_published_total",
                   {{"type", "block_stored"}}),
            static_cast<double>(stored_events));
  EXPECT_EQ(Metric(*node.process, "kvcm_cache_manager_vllm_events_published_total",
                   {{"type", "block_removed"}}),
            static_cast<double>(removed_events));
  EXPECT_EQ(Metric(*node.process, "kvcm_cache_manager_vllm_events_published_total",
                   {{"type", "all_blocks_cleared"}}),
            1);
  EXPECT_EQ(Metric(*node.process, "kvcm_cache_manager_vllm_buffer_batches"),
            static_cast<double>(batches.size()));
  EXPECT_EQ(Metric(*node.process, "kvcm_cache_manager_vllm_replay_requests_total",
                   {{"result", "served"}}),
            3);
  EXPECT_EQ(Metric(*node.process, "kvcm_cache_manager_vllm_batches_replayed_total"),
            static_cast<double>(batches.size() + tail.size()));
  EXPECT_EQ(Metric(*node.process, "kvcm_cache_manager_vllm_blocks_without_tokens_total"), 0);
  EXPECT_EQ(Metric(*node.process, "kvcm_cache_manager_vllm_subscriptions_total"), 1);
}

// A subscriber that connects is answered at once with the latest batch, so that it sees
// where the stream stands (and replays what it missed) without waiting for the next batch:
// ZeroMQ drops what a PUB sent before the subscriber's connection was up.
TEST(VllmEventsProcessTest, ASubscriptionIsAnsweredWithTheLatestBatch) {
  Node node = StartNode(16);
  ASSERT_NE(node.process, nullptr);
  {
    auto client = ConnectRouter(*node.process);
    ASSERT_NE(client, nullptr);
    std::mt19937 rng(28);
    ASSERT_NO_FATAL_FAILURE(RunSequence(*client, 1, RandomTokens(rng, 8)));
    ASSERT_NO_FATAL_FAILURE(RunSequence(*client, 2, RandomTokens(rng, 8)));
  }
  const std::vector<ReadVllmBatch> batches = Replay(node, 0);
  ASSERT_EQ(batches.size(), 3u);
  for (int subscribers = 1; subscribers <= 2; ++subscribers) {
    auto subscriber =
        testing::VllmEventSubscriber::Connect(node.events, MonotonicNow() + absl::Seconds(10));
    ASSERT_THAT(subscriber, IsOk());
    // Nothing else is published: what comes is the answer to the subscription.
    auto batch = (*subscriber)->Next(MonotonicNow() + absl::Seconds(10));
    ASSERT_THAT(batch, IsOk());
    ExpectSameEvents(*batch, batches.back());
    EXPECT_EQ(Metric(*node.process, "kvcm_cache_manager_vllm_subscriptions_total"), subscribers);
  }
  // Published and buffered counts are those of the stream alone.
  EXPECT_EQ(Metric(*node.process, "kvcm_cache_manager_vllm_batches_published_total"), 3);
  EXPECT_EQ(Metric(*node.process, "kvcm_cache_manager_vllm_buffer_batches"), 3);
}

// A restart goes on above every sequence number the earlier start sent, whether it was
// stopped or killed: a consumer still subscribed (Dynamo drops numbers lower than those it
// saw) then applies the restart's AllBlocksCleared, and one asking for what it missed gets
// it from the replay socket.
TEST(VllmEventsProcessTest, ARestartGoesOnAboveEverySeqSentWithAllBlocksCleared) {
  // The run directory outlives each process: the next starts on it.
  auto dir = testing::TempDir::Create("kvcm-vllm-restart");
  ASSERT_THAT(dir, IsOk());
  constexpr uint64_t kChunk = VllmEventPublisher::kSeqReservation;
  Node first = StartNode(16, dir->path());
  ASSERT_NE(first.process, nullptr);
  {
    auto client = ConnectRouter(*first.process);
    ASSERT_NE(client, nullptr);
    std::mt19937 rng(8);
    ASSERT_NO_FATAL_FAILURE(RunSequence(*client, 1, RandomTokens(rng, 8)));
  }
  const std::vector<ReadVllmBatch> before = Replay(first, 0);
  ASSERT_EQ(before.size(), 2u);
  EXPECT_EQ(before[0].seq, 0u);  // a node's first start begins at 0
  EXPECT_EQ(before[1].seq, 1u);
  auto stopped = first.process->Terminate();
  ASSERT_THAT(stopped, IsOk());
  EXPECT_EQ(*stopped, 0);
  first.process.reset();

  // Stopped cleanly: the next start begins at the next reserved chunk.
  Node again = StartNode(16, dir->path());
  ASSERT_NE(again.process, nullptr);
  std::vector<ReadVllmBatch> batches = Replay(again, 0);
  ASSERT_EQ(batches.size(), 1u);
  EXPECT_EQ(batches[0].seq, kChunk);
  ASSERT_EQ(batches[0].events.size(), 1u);
  EXPECT_EQ(batches[0].events[0].type, "AllBlocksCleared");
  // A consumer that saw batch 1 sees the gap and asks from 2: the clear comes first.
  batches = Replay(again, before.back().seq + 1);
  ASSERT_EQ(batches.size(), 1u);
  EXPECT_EQ(batches[0].events[0].type, "AllBlocksCleared");
  {
    auto client = ConnectRouter(*again.process);
    ASSERT_NE(client, nullptr);
    std::mt19937 rng(18);
    ASSERT_NO_FATAL_FAILURE(RunSequence(*client, 1, RandomTokens(rng, 8)));
  }
  ASSERT_EQ(Replay(again, 0).size(), 2u);

  // Killed: nothing written at exit, and still above everything sent.
  ASSERT_THAT(again.process->process().Signal(SIGKILL), IsOk());
  ASSERT_THAT(again.process->process().Wait(absl::Seconds(10)), IsOk());
  again.process.reset();
  Node third = StartNode(16, dir->path());
  ASSERT_NE(third.process, nullptr);
  batches = Replay(third, 0);
  ASSERT_EQ(batches.size(), 1u);
  EXPECT_EQ(batches[0].seq, 2 * kChunk);
  EXPECT_EQ(batches[0].events[0].type, "AllBlocksCleared");
  EXPECT_THAT(third.process->process().Output(),
              ::testing::HasSubstr(absl::StrCat("first_seq=", 2 * kChunk)));
}

// A seq file the cache manager did not write stops the start with the file's name and what
// to do, rather than guess a number consumers may have seen already.
TEST(VllmEventsProcessTest, AnUnreadableSeqFileStopsTheStartNamingIt) {
  auto dir = testing::TempDir::Create("kvcm-vllm-seq-file");
  ASSERT_THAT(dir, IsOk());
  const std::string seq_file = dir->path() + "/vllm-events.seq";
  for (const char* content : {"not a number\n", "12\n13\n", "-5\n", "99999999999999999999\n"}) {
    ASSERT_THAT(WriteFileAtomically(seq_file, content), IsOk());
    CacheManagerOptions options;
    options.run_dir = dir->path();
    options.num_blocks = 16;
    options.block_size = kBlockSize;
    options.extra_args = {"--kv-events-endpoint", "tcp://127.0.0.1:0"};
    auto started = CacheManagerProcess::Start(options);
    ASSERT_FALSE(started.ok()) << content;
    EXPECT_THAT(std::string(started.status().message()), ::testing::HasSubstr(seq_file)) << content;
    EXPECT_THAT(std::string(started.status().message()), ::testing::HasSubstr("delete it"))
        << content;
  }
  // Without the stream the file is not read: the cache manager starts.
  CacheManagerOptions options;
  options.run_dir = dir->path();
  options.num_blocks = 16;
  options.block_size = kBlockSize;
  auto started = CacheManagerProcess::Start(options);
  ASSERT_THAT(started, IsOk());
}

TEST(VllmEventsProcessTest, AWrappedBufferKeepsTheStartsClearedBatch) {
  Node node = StartNode(64, "", /*buffer_steps=*/3);
  ASSERT_NE(node.process, nullptr);
  auto client = ConnectRouter(*node.process);
  ASSERT_NE(client, nullptr);
  std::mt19937 rng(9);
  for (SeqId seq = 1; seq <= 5; ++seq) {
    ASSERT_NO_FATAL_FAILURE(RunSequence(*client, seq, RandomTokens(rng, 8)));
  }
  // Batches 0..5 were published; 0 and the last two are kept.
  const std::vector<ReadVllmBatch> batches = Replay(node, 0);
  ASSERT_EQ(batches.size(), 3u);
  EXPECT_EQ(batches[0].seq, 0u);
  EXPECT_EQ(batches[0].events[0].type, "AllBlocksCleared");
  EXPECT_EQ(batches[1].seq, 4u);
  EXPECT_EQ(batches[2].seq, 5u);
  EXPECT_EQ(Metric(*node.process, "kvcm_cache_manager_vllm_buffer_batches"), 3);
  EXPECT_EQ(Replay(node, 5).size(), 1u);
}

TEST(VllmEventsProcessTest, MalformedReplayRequestsAreCountedAndChangeNothing) {
  Node node = StartNode(16);
  ASSERT_NE(node.process, nullptr);
  auto client = ConnectRouter(*node.process);
  ASSERT_NE(client, nullptr);
  std::mt19937 rng(10);
  ASSERT_NO_FATAL_FAILURE(RunSequence(*client, 1, RandomTokens(rng, 8)));
  auto before = client->Stats();
  ASSERT_THAT(before, IsOk());
  const std::vector<std::vector<std::string>> bad = {
      {std::string(8, '\0')},              // no delimiter
      {"", "1234"},                        // short seq
      {"x", std::string(8, '\0')},         // a delimiter that is not empty
      {"", std::string(8, '\0'), "more"},  // a frame too many
      {"", std::string(9, '\x7f')},        // a long seq
      {"", "", ""},                        // garbage
  };
  for (size_t i = 0; i < bad.size(); ++i) {
    // 300 ms for a reply that must not come: a slow machine can only make this miss one,
    // not report one.
    auto replies = testing::SendRawReplayRequest(node.replay, bad[i], absl::Milliseconds(300));
    ASSERT_THAT(replies, IsOk());
    EXPECT_EQ(*replies, 0);
    // Each connection is a peer of its own, with no order between them: each request is
    // counted before the next is sent, so that the log below names them in order.
    const absl::Status counted = testing::WaitFor(
        [&] {
          return Metric(*node.process, "kvcm_cache_manager_vllm_replay_requests_total",
                        {{"result", "malformed"}}) == static_cast<double>(i + 1);
        },
        absl::Seconds(60), absl::StrCat("bad request ", i, " to be counted"));
    ASSERT_THAT(counted, IsOk());
  }
  EXPECT_THAT(node.process->Output(),
              ::testing::HasSubstr("vLLM-format replay request refused (1 so far): 1 frame(s) "
                                   "instead of 2"));
  EXPECT_THAT(node.process->Output(),
              ::testing::HasSubstr("the sequence number has 4 bytes instead of 8"));
  // Still serving, the ledger as it was, the stream whole.
  auto after = client->Stats();
  ASSERT_THAT(after, IsOk());
  EXPECT_EQ(after->cached_blocks, before->cached_blocks);
  EXPECT_EQ(after->free_blocks, before->free_blocks);
  EXPECT_EQ(Replay(node, 0).size(), 2u);
  EXPECT_EQ(Metric(*node.process, "kvcm_cache_manager_vllm_replay_requests_total",
                   {{"result", "served"}}),
            1);
}

TEST(VllmEventsProcessTest, ACommitWithTheWrongNumberOfTokensIsRefusedWhole) {
  Node node = StartNode(16);
  ASSERT_NE(node.process, nullptr);
  auto client = ConnectRouter(*node.process);
  ASSERT_NE(client, nullptr);
  std::mt19937 rng(11);
  const std::vector<int32_t> tokens = RandomTokens(rng, 8);
  BlockOps allocate;
  allocate.Allocate(1, 8);
  ASSERT_THAT(client->Step(allocate), IsOk());
  auto before = client->Stats();
  ASSERT_THAT(before, IsOk());
  const std::vector<BlockHash> hashes = Hashes(tokens);
  BlockOps commit;
  commit.Commit(1, 8, hashes, std::span<const int32_t>(tokens).first(7));
  auto refused = client->Step(commit);
  ASSERT_FALSE(refused.ok());
  EXPECT_THAT(refused.status().message(),
              ::testing::HasSubstr("carries 7 token ids for a commit of 8 tokens"));
  // More blocks than the commit covers.
  std::vector<int32_t> three_blocks = tokens;
  three_blocks.insert(three_blocks.end(), {1, 2, 3, 4});
  BlockOps too_many;
  too_many.Commit(1, 8, hashes, three_blocks);
  auto refused_too = client->Step(too_many);
  ASSERT_FALSE(refused_too.ok());
  EXPECT_THAT(refused_too.status().message(),
              ::testing::HasSubstr("carries 12 token ids for a commit of 8 tokens"));
  auto after = client->Stats();
  ASSERT_THAT(after, IsOk());
  EXPECT_EQ(after->cached_blocks, before->cached_blocks);
  EXPECT_EQ(after->in_use_blocks, before->in_use_blocks);
  // Nothing was stored; the right commit then is.
  EXPECT_EQ(Replay(node, 0).size(), 1u);
  BlockOps right;
  right.Commit(1, 8, hashes, tokens);
  auto committed = client->Step(right);
  ASSERT_THAT(committed, IsOk());
  ASSERT_THAT((*committed)[0].status, IsOk());
  const std::vector<ReadVllmBatch> batches = Replay(node, 0);
  ASSERT_EQ(batches.size(), 2u);
  ASSERT_EQ(batches[1].events.size(), 1u);
  EXPECT_EQ(batches[1].events[0].block_hashes, Ids(hashes));
}

// A block of a group, as a consumer keys it: (group_idx, id).
using GroupId = std::pair<int64_t, uint64_t>;

// Replays a grouped stream (after its first batch, the AllBlocksCleared) into a consumer's
// view by (group, id), checking every event names group 0 (full attention) or 1 (a window
// of `window` tokens), each (group, id) is stored once while live with its parent live in its
// group, and removed only once stored. The stored events and the removed (group, id)s out.
void ReadGroupedStream(const std::vector<ReadVllmBatch>& batches, int32_t window,
                       std::vector<ReadVllmEvent>* stored, std::set<GroupId>* removed) {
  absl::flat_hash_set<GroupId> live;
  for (size_t b = 1; b < batches.size(); ++b) {
    for (const ReadVllmEvent& event : batches[b].events) {
      ASSERT_TRUE(event.group_idx.has_value()) << event.type << " without group_idx";
      const int64_t group = *event.group_idx;
      ASSERT_TRUE(group == 0 || group == 1) << group;
      if (event.type == "BlockStored") {
        EXPECT_EQ(event.medium, "CPU");
        EXPECT_EQ(event.kv_cache_spec_kind, group == 0 ? "full_attention" : "sliding_window");
        EXPECT_EQ(event.sliding_window, group == 0 ? std::nullopt : std::optional<int64_t>(window));
        if (event.parent_block_hash) {
          EXPECT_TRUE(live.contains(GroupId{group, *event.parent_block_hash}));
        }
        for (uint64_t id : event.block_hashes) {
          EXPECT_TRUE(live.insert({group, id}).second) << group << "/" << id;
        }
        stored->push_back(event);
      } else if (event.type == "BlockRemoved") {
        for (uint64_t id : event.block_hashes) {
          EXPECT_TRUE(live.erase(GroupId{group, id})) << "removed " << group << "/" << id;
          removed->insert({group, id});
        }
      } else {
        ADD_FAILURE() << "a second AllBlocksCleared at seq " << batches[b].seq;
      }
    }
  }
}

// With KV cache groups (docs/protocol.md, "vLLM-format KV events"): the real cache manager
// started on a mixed model publishes every group's blocks under the plain hash of their
// position with the group's index, kind and window, with the same token ids in every
// group, and removes each (id, group) it stored once.
TEST(VllmEventsProcessTest, AGroupedPoolPublishesEveryGroupsBlocksUnderThePlainHash) {
  constexpr int32_t kWindow = 2 * kBlockSize;
  const uint32_t seed = 20261207;
  std::printf("seed %u\n", seed);
  std::mt19937 rng(seed);
  auto dir = testing::TempDir::Create("kvcm-vllm-groups");
  ASSERT_THAT(dir, IsOk());
  CacheManagerOptions options;
  options.num_blocks = 20;
  options.block_size = kBlockSize;
  options.layers = 0;  // the shape comes from the config
  options.kv_heads = 0;
  options.head_dim = 0;
  options.dtype = "";
  options.extra_args = {"--model-config",
                        testing::WriteMixedModelConfig(dir->path(), kWindow),
                        "--kv-events-endpoint",
                        "tcp://127.0.0.1:0",
                        "--kv-events-replay-endpoint",
                        "tcp://127.0.0.1:0"};
  auto process = CacheManagerProcess::Start(options);
  ASSERT_THAT(process, IsOk());
  auto line = (*process)->process().WaitForLine(
      "vLLM-format KV events on (\\S+) topic=(\\S+) replay=(\\S+)",
      absl::Now() + absl::Seconds(10));
  ASSERT_THAT(line, IsOk());
  Node node{*std::move(process), (*line)[1], (*line)[3], (*line)[2]};
  auto subscriber =
      testing::VllmEventSubscriber::Connect(node.events, MonotonicNow() + absl::Seconds(10));
  ASSERT_THAT(subscriber, IsOk());
  auto client = ConnectRouter(*node.process);
  ASSERT_NE(client, nullptr);
  EXPECT_TRUE(client->session().wants_commit_tokens);
  ASSERT_EQ(client->session().group_windows, (std::vector<int32_t>{0, kWindow}));

  // The window group releases the first prompt's first block at its commit.
  std::vector<int32_t> first, second;
  ASSERT_NO_FATAL_FAILURE(RunSharedThenEvicting(*client, rng, 5, 16, &first, &second));

  const std::vector<ReadVllmBatch> batches = Replay(node, 0);
  ASSERT_FALSE(batches.empty());
  ASSERT_EQ(batches[0].events.size(), 1u);
  EXPECT_EQ(batches[0].events[0].type, "AllBlocksCleared");
  std::vector<ReadVllmEvent> stored;
  std::set<GroupId> removed;
  ASSERT_NO_FATAL_FAILURE(ReadGroupedStream(batches, kWindow, &stored, &removed));
  // The first prompt's 3 blocks in each group: the plain hashes, the same tokens; then the
  // second prompt's last 2 blocks in each group, children of the shared second block.
  ASSERT_GE(stored.size(), 4u);
  const std::vector<uint64_t> first_ids = Ids(Hashes(first));
  const std::vector<uint64_t> second_ids = Ids(Hashes(second));
  for (int64_t g = 0; g < 2; ++g) {
    SCOPED_TRACE(absl::StrCat("group ", g));
    const ReadVllmEvent& one = stored[static_cast<size_t>(g)];
    EXPECT_EQ(one.group_idx, g);
    EXPECT_EQ(one.block_hashes, first_ids);
    EXPECT_EQ(one.parent_block_hash, std::nullopt);
    EXPECT_EQ(one.token_ids, std::vector<uint32_t>(first.begin(), first.begin() + 12));
    const ReadVllmEvent& two = stored[static_cast<size_t>(2 + g)];
    EXPECT_EQ(two.group_idx, g);
    EXPECT_EQ(two.block_hashes, (std::vector<uint64_t>{second_ids[2], second_ids[3]}));
    EXPECT_EQ(two.parent_block_hash, second_ids[1]);
    EXPECT_EQ(two.token_ids, std::vector<uint32_t>(second.begin() + 8, second.end()));
    for (uint64_t id : first_ids) EXPECT_TRUE(removed.contains({g, id})) << id;
  }
  EXPECT_EQ(Metric(*node.process, "kvcm_cache_manager_vllm_blocks_without_tokens_total"), 0);
  // The live subscriber decodes the same stream.
  auto batch = (*subscriber)->Next(MonotonicNow() + absl::Seconds(10));
  ASSERT_THAT(batch, IsOk());
  ASSERT_LT(batch->seq, batches.size());
  ExpectSameEvents(*batch, batches[batch->seq]);
}

TEST(VllmEventsProcessTest, OffByDefaultAndRoutersAreNotAskedForTokens) {
  CacheManagerOptions options;
  options.num_blocks = 16;
  options.block_size = kBlockSize;
  auto process = CacheManagerProcess::Start(options);
  ASSERT_THAT(process, IsOk());
  auto client = ConnectRouter(**process);
  ASSERT_NE(client, nullptr);
  EXPECT_FALSE(client->session().wants_commit_tokens);
  EXPECT_THAT((*process)->Output(), ::testing::Not(::testing::HasSubstr("vLLM-format")));
}

}  // namespace
}  // namespace kvcm::cache_manager
