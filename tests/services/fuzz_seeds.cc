// Writes the seed corpora of the cache_manager and executor fuzz targets
// (tests/services/cache_manager/cache_manager_fuzz_target.cc,
// tests/services/executor/executor_fuzz_target.cc) with the real encoders, as records of
// tests/support/fuzz_records.h:
//
//   build/tests/kvcm_fuzz_seeds cache_manager tests/services/cache_manager/fuzz/cache_manager
//   build/tests/kvcm_fuzz_seeds executor tests/services/executor/fuzz/executor
//
// Run it again when a schema changes; the targets' seed tests fail when a seed is no longer
// accepted.

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "common/block/block_hash.h"
#include "common/wire/convert.h"
#include "common/wire/envelope.h"
#include "common/wire/executor_codec.h"
#include "common/wire/step_codec.h"
#include "flatbuffers/flatbuffers.h"
#include "schemas/kvcm_executor_generated.h"
#include "schemas/kvcm_protocol_generated.h"
#include "tests/support/fuzz_records.h"

namespace kvcm {
namespace {

// Senders and flags of the cache_manager target (its header comment).
constexpr uint8_t kRouterA = 0, kRouterB = 1, kExecutor = 2, kControl = 3;
constexpr uint8_t kExpireFirst = 8, kExitAfter = 16, kEventsAfter = 32;

BlockHash HashOf(int i) {
  BlockHash h;
  h.bytes[0] = static_cast<uint8_t>(i);
  h.bytes[1] = static_cast<uint8_t>(i >> 8);
  h.bytes[31] = 0x5a;
  return h;
}

std::vector<BlockHash> Hashes(int first, int n) {
  std::vector<BlockHash> out;
  for (int i = 0; i < n; ++i) out.push_back(HashOf(first + i));
  return out;
}

// A cache-manager input under construction. Envelopes carry session 1 and epoch 1 so that
// both fields are present for the target to overwrite with the sender's.
class CacheManagerInput {
 public:
  void Step(uint8_t flags, const std::vector<BlockOp>& ops) {
    flatbuffers::FlatBufferBuilder b;
    if (!EncodeStep(b, ++request_id_, 1, 1, ops).ok()) std::abort();
    fuzz::AppendRecord(flags, BufferSpan(b), &out_);
  }
  void Message(
      uint8_t flags, wire::Message type,
      const std::function<flatbuffers::Offset<void>(flatbuffers::FlatBufferBuilder&)>& build) {
    flatbuffers::FlatBufferBuilder b;
    const flatbuffers::Offset<void> payload = build(b);
    FinishEnvelope(b, ++request_id_, 1, 1, type, payload);
    fuzz::AppendRecord(flags, BufferSpan(b), &out_);
  }
  const std::string& bytes() const { return out_; }

 private:
  std::string out_;
  uint64_t request_id_ = 10;
};

std::vector<std::pair<std::string, std::string>> CacheManagerSeeds() {
  std::vector<std::pair<std::string, std::string>> seeds;
  {  // A router's sequences through every op, then Goodbye.
    CacheManagerInput in;
    in.Step(kRouterA, {BlockOp::Allocate(1, 10, Hashes(0, 2)), BlockOp::Allocate(2, 3)});
    in.Step(kRouterA, {BlockOp::Append(1, 4), BlockOp::Commit(1, 10, {}),
                       BlockOp::CanAllocate(9, Hashes(0, 2))});
    in.Step(kRouterA, {BlockOp::Fork(1, 3), BlockOp::Append(3, 2)});
    in.Message(kRouterA, wire::Message::Heartbeat,
               [](auto& b) { return wire::CreateHeartbeat(b).Union(); });
    in.Message(kRouterA, wire::Message::DescribeSession,
               [](auto& b) { return wire::CreateDescribeSession(b).Union(); });
    in.Step(kRouterA, {BlockOp::Free(2), BlockOp::Free(3, /*drain=*/true)});
    in.Step(kRouterA | kEventsAfter, {BlockOp::Free(1)});
    in.Message(kRouterA, wire::Message::Goodbye,
               [](auto& b) { return wire::CreateGoodbye(b).Union(); });
    seeds.emplace_back("step_lifecycle", in.bytes());
  }
  {  // The prefix cache: a prompt committed and freed, found, pinned, hit by another router.
    CacheManagerInput in;
    in.Step(kRouterA, {BlockOp::Allocate(7, 13, Hashes(100, 3))});
    in.Step(kRouterA, {BlockOp::Commit(7, 12, {}), BlockOp::Free(7)});
    in.Message(kRouterB, wire::Message::Lookup, [](auto& b) {
      return wire::CreateLookup(b, ToWire(b, Hashes(100, 3)), 13).Union();
    });
    in.Message(kRouterB, wire::Message::Pin, [](auto& b) {
      return wire::CreatePin(b, b.CreateString("system"), ToWire(b, Hashes(100, 2))).Union();
    });
    in.Step(kRouterB, {BlockOp::Allocate(7, 14, Hashes(100, 3)), BlockOp::CanAllocate(64)});
    in.Message(kRouterB, wire::Message::Unpin,
               [](auto& b) { return wire::CreateUnpin(b, b.CreateString("system")).Union(); });
    in.Message(kControl | kEventsAfter, wire::Message::Stats,
               [](auto& b) { return wire::CreateStats(b).Union(); });
    seeds.emplace_back("prefix_cache", in.bytes());
  }
  {  // A router dies holding sequences: they wait behind a fence for the executor.
    CacheManagerInput in;
    in.Message(kExecutor, wire::Message::Attach,
               [](auto& b) { return wire::CreateAttach(b).Union(); });
    in.Step(kRouterA, {BlockOp::Allocate(1, 8), BlockOp::Allocate(2, 5)});
    in.Step(kRouterA | kExitAfter, {BlockOp::Append(1, 1)});
    in.Message(kExecutor, wire::Message::Heartbeat,
               [](auto& b) { return wire::CreateHeartbeat(b).Union(); });
    in.Message(kExecutor | kEventsAfter, wire::Message::Heartbeat, [](auto& b) {
      return wire::CreateHeartbeat(b, b.CreateVector(std::vector<uint64_t>{1})).Union();
    });
    in.Step(kRouterA, {BlockOp::Allocate(1, 4)});
    seeds.emplace_back("router_dies_behind_a_fence", in.bytes());
  }
  {  // Leases: a silent router is quarantined, then its process exits; control inspects.
    CacheManagerInput in;
    in.Step(kRouterB, {BlockOp::Allocate(5, 20, Hashes(200, 5))});
    in.Message(kControl, wire::Message::EventSnapshot,
               [](auto& b) { return wire::CreateEventSnapshot(b).Union(); });
    in.Step(kRouterB | kExpireFirst, {BlockOp::Append(5, 1)});
    in.Message(kRouterA, wire::Message::Heartbeat,
               [](auto& b) { return wire::CreateHeartbeat(b).Union(); });
    in.Message(kControl | kExitAfter, wire::Message::Stats,
               [](auto& b) { return wire::CreateStats(b).Union(); });
    seeds.emplace_back("lease_expiry", in.bytes());
  }
  return seeds;
}

// ---- Executor -------------------------------------------------------------------------------

constexpr uint64_t kEpoch = 1000;  // the executor target's pool

SeqWork Seq(SeqId id, std::vector<int32_t> tokens, int32_t context_len,
            std::vector<BlockId> blocks) {
  SeqWork s;
  s.seq = id;
  s.tokens = std::move(tokens);
  s.context_len = context_len;
  s.block_table = std::move(blocks);
  s.sample = true;
  return s;
}

StepBatch NewStep(uint64_t step_id, uint64_t router_session) {
  StepBatch step;
  step.step_id = step_id;
  step.epoch = kEpoch;
  step.router_session = router_session;
  return step;
}

class ExecutorInput {
 public:
  void Step(const StepBatch& step) {
    flatbuffers::FlatBufferBuilder b;
    EncodeStepBatch(b, ++request_id_, 7, step);
    fuzz::AppendRecord(0, BufferSpan(b), &out_);
  }
  void Message(
      wire::ExecutorMessage type,
      const std::function<flatbuffers::Offset<void>(flatbuffers::FlatBufferBuilder&)>& build) {
    flatbuffers::FlatBufferBuilder b;
    const flatbuffers::Offset<void> payload = build(b);
    FinishExecutorEnvelope(b, ++request_id_, 7, kEpoch, type, payload);
    fuzz::AppendRecord(0, BufferSpan(b), &out_);
  }
  const std::string& bytes() const { return out_; }

 private:
  std::string out_;
  uint64_t request_id_ = 0;
};

std::vector<std::pair<std::string, std::string>> ExecutorSeeds() {
  std::vector<std::pair<std::string, std::string>> seeds;
  {  // Prefill then decode of one greedy sequence with log-probabilities.
    ExecutorInput in;
    StepBatch step = NewStep(1, 42);
    SeqWork s = Seq(1, {1, 72, 101, 108, 108, 111}, 6, {0, 1});
    s.logprobs = true;
    s.top_n = 3;
    s.input_logprobs = true;
    step.seqs.push_back(s);
    in.Step(step);
    step.step_id = 2;
    step.seqs[0].tokens = {44};
    step.seqs[0].context_len = 7;
    step.seqs[0].input_logprobs = false;
    step.seqs[0].score_next = 32;
    in.Step(step);
    seeds.emplace_back("prefill_then_decode", in.bytes());
  }
  {  // Two sampled sequences with penalties and fork seeds, then a copy-on-write step.
    ExecutorInput in;
    StepBatch step = NewStep(1, 42);
    SeqWork a = Seq(1, {1, 2, 3, 4, 5}, 5, {2, 3});
    a.sampling = {.temperature = 0.8f,
                  .top_p = 0.9f,
                  .top_k = 40,
                  .seed = 7,
                  .repetition_penalty = 1.1f,
                  .frequency_penalty = 0.5f,
                  .presence_penalty = -0.5f};
    a.sample_index = 0;
    a.penalty_tokens = {1, 2, 3, 4, 5};
    a.penalty_prompt_len = 5;
    a.fork_seeds = {8, 9};
    SeqWork b = Seq(2, {6, 7, 8}, 3, {4});
    b.sample = false;
    step.seqs = {a, b};
    in.Step(step);
    StepBatch cow = NewStep(2, 42);
    cow.seqs.push_back(Seq(3, {9}, 6, {2, 5}));
    cow.copies = {{3, 5}};
    in.Step(cow);
    seeds.emplace_back("sampling_forks_and_copies", in.bytes());
  }
  {  // The protocol around steps: the router's replies and requests.
    ExecutorInput in;
    in.Message(wire::ExecutorMessage::ExecutorHelloReply,
               [](auto& b) { return wire::CreateExecutorHelloReply(b, 7, 500).Union(); });
    in.Message(wire::ExecutorMessage::Heartbeat,
               [](auto& b) { return wire::CreateHeartbeat(b).Union(); });
    StepBatch step = NewStep(1, 43);
    step.seqs.push_back(Seq(1, {1, 10}, 2, {0}));
    in.Step(step);
    in.Message(wire::ExecutorMessage::ErrorReply, [](auto& b) {
      return wire::CreateErrorReply(b, wire::ErrorCode::NotRegistered, b.CreateString("who?"))
          .Union();
    });
    in.Message(wire::ExecutorMessage::Goodbye,
               [](auto& b) { return wire::CreateGoodbye(b).Union(); });
    seeds.emplace_back("protocol", in.bytes());
  }
  return seeds;
}

}  // namespace
}  // namespace kvcm

int main(int argc, char** argv) {
  const std::string which = argc == 3 ? argv[1] : "";
  if (which != "cache_manager" && which != "executor") {
    std::fprintf(stderr, "usage: %s cache_manager|executor DIR\n", argv[0]);
    return 2;
  }
  const auto seeds = which == "cache_manager" ? kvcm::CacheManagerSeeds() : kvcm::ExecutorSeeds();
  for (const auto& [name, bytes] : seeds) {
    const std::string path = std::string(argv[2]) + "/" + name;
    std::ofstream(path, std::ios::binary) << bytes;
    std::printf("%s: %zu bytes\n", path.c_str(), bytes.size());
  }
  return 0;
}
