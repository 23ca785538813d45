// The fuzz target of the executor's inbound path (tests/support/fuzz_target.h): whole
// frames from the router through ExecutorService::Handle, the envelope check,
// DecodeStepBatch, the checks against the pool and the model (CheckAndBuild, CheckBatch)
// and, for a step they pass, the copies, the forward pass of a tiny model and sampling.
//
// The tiny model (1 layer, tools/make_tiny_model) is written and loaded once; each input
// gets a new service over a zeroed local pool of 16 blocks of 4 tokens (epoch 1000), and
// its records (tests/support/fuzz_records.h) are the frames, in order; the flags are
// unused. Checked after every frame (the contract of executor_service.h):
//   - a frame other than a reply to the executor's own requests (ExecutorHelloReply,
//     HeartbeatReply, GoodbyeReply, ErrorReply) gets exactly one reply, an envelope that
//     verifies, and those replies get none;
//   - a StepBatch refused with an ErrorReply wrote nothing to the pool;
//   - a StepResult has one result per sequence of the step, in its order, each token in
//     the vocabulary.
// An input is accepted when one of its steps got a StepResult.
// Seeds: tests/services/executor/fuzz/executor/ (tests/services/fuzz_seeds.cc).

#include <stdlib.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/memory/pool_layout.h"
#include "common/wire/executor_codec.h"
#include "flatbuffers/flatbuffers.h"
#include "services/executor/executor_model.h"
#include "services/executor/executor_service.h"
#include "services/executor/model/llama_model.h"
#include "tests/support/fuzz_records.h"
#include "tests/support/fuzz_target.h"
#include "tools/make_tiny_model/tiny_model.h"

namespace kvcm::executor {
namespace {

using fuzz::Check;

constexpr int32_t kNumBlocks = 16;
constexpr int32_t kBlockSize = 4;
constexpr uint64_t kEpoch = 1000;

// The tiny model, written to a temporary folder, loaded, and the folder removed.
const LlamaModel& Model() {
  static const LlamaModel* model = [] {
    char dir[] = "/tmp/kvcm-executor-fuzz.XXXXXX";
    Check(::mkdtemp(dir) != nullptr, "mkdtemp");
    TinyModelOptions tiny;
    tiny.num_layers = 1;
    tiny.hidden_size = 32;
    tiny.intermediate_size = 64;
    tiny.num_heads = 2;
    tiny.num_kv_heads = 1;
    tiny.head_dim = 16;
    tiny.max_position_embeddings = 256;
    Check(WriteTinyModel(dir, tiny).ok(), "the tiny model is written");
    LlamaModelOptions options;
    options.num_threads = 1;
    absl::StatusOr<std::unique_ptr<LlamaModel>> loaded = LlamaModel::Load(dir, options);
    Check(loaded.ok(), "the tiny model loads");
    std::filesystem::remove_all(dir);
    return loaded->release();
  }();
  return *model;
}

// A PoolSource over a local buffer, attached at kEpoch for good.
class LocalPool : public PoolSource {
 public:
  explicit LocalPool(const KvCacheSpec& spec) {
    absl::StatusOr<PoolLayout> layout = PoolLayout::For(spec, kNumBlocks);
    Check(layout.ok(), "the pool's layout");
    memory_.assign(static_cast<size_t>(layout->total_bytes), 0);
    view_.base = memory_.data();
    view_.layout = *layout;
    view_.spec = spec;
    view_.num_blocks = kNumBlocks;
    view_.epoch = kEpoch;
  }
  const PoolView* pool() const override { return &view_; }
  absl::Status Refresh() override { return absl::OkStatus(); }
  absl::Status Reattach() override { return absl::OkStatus(); }
  void Goodbye() override {}
  const std::vector<uint8_t>& memory() const { return memory_; }

 private:
  std::vector<uint8_t> memory_;
  PoolView view_;
};

}  // namespace
}  // namespace kvcm::executor

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvcm;            // NOLINT: one function
  using namespace kvcm::executor;  // NOLINT
  const LlamaModel& model = Model();
  static const KvCacheSpec spec = model.config().KvSpec(DType::kFloat32, kBlockSize).value();
  LocalPool pool(spec);
  ExecutorModel executor_model(&model);
  ExecutorService::Options options;
  options.name = "fuzz";
  options.model_name = "tiny";
  ExecutorService service(options, &executor_model, &pool, nullptr);

  const absl::Time now = absl::FromUnixSeconds(1'000'000);
  flatbuffers::FlatBufferBuilder reply;
  bool accepted = false;
  for (const fuzz::Record& record : fuzz::SplitRecords({data, size})) {
    const std::vector<uint8_t> frame(record.bytes.begin(), record.bytes.end());
    const VerifiedExecutorEnvelope request = VerifyExecutorEnvelope(frame);
    const bool is_step = request.envelope != nullptr &&
                         request.envelope->payload_type() == wire::ExecutorMessage::StepBatch;
    // Replies to the executor's own requests are taken in silently; the rest is answered.
    const bool is_request =
        request.envelope == nullptr ||
        (request.envelope->payload_type() != wire::ExecutorMessage::ExecutorHelloReply &&
         request.envelope->payload_type() != wire::ExecutorMessage::GoodbyeReply &&
         request.envelope->payload_type() != wire::ExecutorMessage::HeartbeatReply &&
         request.envelope->payload_type() != wire::ExecutorMessage::ErrorReply);
    const std::vector<uint8_t> before = is_step ? pool.memory() : std::vector<uint8_t>();

    const ExecutorService::Handled handled = service.Handle(frame, now, &reply);
    fuzz::Check(handled.reply == is_request, "a request, and only a request, is answered");
    if (!handled.reply) continue;
    const VerifiedExecutorEnvelope answer = VerifyExecutorEnvelope(BufferSpan(reply));
    fuzz::Check(answer.envelope != nullptr, "the reply is an envelope that verifies");
    if (!is_step) continue;
    if (answer.envelope->payload_type() == wire::ExecutorMessage::ErrorReply) {
      fuzz::Check(pool.memory() == before, "a refused step writes nothing to the pool");
      continue;
    }
    fuzz::Check(answer.envelope->payload_type() == wire::ExecutorMessage::StepResult,
                "a step is answered with a StepResult or an ErrorReply");
    const StepBatch step = DecodeStepBatch(*request.envelope->payload_as_StepBatch()).value();
    const StepResult report = DecodeStepResult(*answer.envelope->payload_as_StepResult());
    fuzz::Check(report.results.size() == step.seqs.size(), "one result per sequence");
    for (size_t i = 0; i < step.seqs.size(); ++i) {
      fuzz::Check(report.results[i].seq == step.seqs[i].seq, "results in the step's order");
      if (!report.results[i].status.ok()) continue;
      fuzz::Check(report.results[i].token < model.config().vocab_size,
                  "a sampled token is in the vocabulary");
      fuzz::Check(!step.seqs[i].sample || report.results[i].token >= 0,
                  "a sequence that asked for a token got one");
    }
    accepted = true;
  }
  if (accepted) fuzz::NoteAccepted();
  return 0;
}
