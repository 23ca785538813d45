// ExecutorService without sockets or a cache manager: a tiny model written to a temp folder,
// a local pool buffer behind a fake PoolSource. Steps against the contiguous reference,
// sampling independent of batching, refused steps that leave the pool untouched, epochs,
// the protocol state (Hello, replies, malformed frames), and a pool of KV cache groups (its
// steps, their refusals, the attach check).

#include "services/executor/executor_service.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/memory/pool_layout.h"
#include "common/sizing/kv_cache_groups.h"
#include "common/wire/envelope.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "services/executor/kv_groups.h"
#include "services/executor/model/sampler.h"
#include "tests/support/status_matchers.h"
#include "tests/support/subprocess.h"
#include "tools/make_tiny_model/tiny_model.h"

namespace kvcm::executor {
namespace {

using ::kvcm::testing::TempDir;
using ::testing::Contains;
using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr int32_t kNumBlocks = 64;
constexpr uint64_t kEpoch = 1000;

// A PoolSource over a local buffer: the fake of the cache-manager attachment.
class LocalPool : public PoolSource {
 public:
  LocalPool(const KvCacheSpec& spec, int32_t num_blocks, uint64_t epoch) {
    absl::StatusOr<PoolLayout> layout = PoolLayout::For(spec, num_blocks);
    EXPECT_THAT(layout, IsOk());
    memory_.assign(static_cast<size_t>(layout->total_bytes), 0);
    view_.base = memory_.data();
    view_.layout = *layout;
    view_.spec = spec;
    view_.num_blocks = num_blocks;
    view_.epoch = epoch;
  }

  const PoolView* pool() const override { return attached_ ? &view_ : nullptr; }
  absl::Status Refresh() override { return absl::OkStatus(); }
  absl::Status Reattach() override {
    ++reattaches_;
    if (!reattach_result_.ok()) {
      attached_ = false;
      return reattach_result_;
    }
    // A new epoch's pool: fresh memory, as after a cache-manager restart.
    std::fill(memory_.begin(), memory_.end(), 0);
    view_.epoch = epoch_after_reattach_;
    attached_ = true;
    return absl::OkStatus();
  }
  void Goodbye() override {}
  absl::StatusOr<bool> AttachedEpochIsCurrent() override {
    ++epoch_checks_;
    if (!attached_) return false;
    return epoch_current_;
  }

  // Fences: `fence` appears once fence_generation() has been asked `after_queries` more
  // times (0: at once), as when the cache-manager heartbeat thread learns of it mid-step.
  std::vector<FenceNotice> PendingFences() const override { return fences_; }
  uint64_t fence_generation() const override {
    if (scheduled_ && --queries_left_ < 0) {
      fences_.push_back(*scheduled_);
      scheduled_.reset();
      ++generation_;
    }
    return generation_;
  }
  absl::Status AcknowledgeFences(std::span<const uint64_t> ids) override {
    acked_.insert(acked_.end(), ids.begin(), ids.end());
    std::erase_if(fences_, [&](const FenceNotice& f) {
      return std::find(ids.begin(), ids.end(), f.id) != ids.end();
    });
    ++generation_;
    return absl::OkStatus();
  }
  void ScheduleFence(FenceNotice fence, int after_queries) {
    scheduled_ = fence;
    queries_left_ = after_queries;
  }
  const std::vector<uint64_t>& acked() const { return acked_; }

  std::vector<uint8_t>& memory() { return memory_; }
  const PoolView& view() const { return view_; }
  void set_kv_groups(std::vector<KvCacheGroup> groups) { view_.kv_groups = std::move(groups); }
  void set_attached(bool attached) { attached_ = attached; }
  void set_epoch_after_reattach(uint64_t epoch) { epoch_after_reattach_ = epoch; }
  void set_reattach_result(absl::Status status) { reattach_result_ = std::move(status); }
  int reattaches() const { return reattaches_; }
  // What the cache manager answers when asked whether the attached epoch is current.
  void set_epoch_current(absl::StatusOr<bool> current) { epoch_current_ = std::move(current); }
  int epoch_checks() const { return epoch_checks_; }

 private:
  std::vector<uint8_t> memory_;
  PoolView view_;
  bool attached_ = true;
  uint64_t epoch_after_reattach_ = kEpoch;
  absl::Status reattach_result_;
  int reattaches_ = 0;
  absl::StatusOr<bool> epoch_current_ = true;
  int epoch_checks_ = 0;
  mutable std::vector<FenceNotice> fences_;
  mutable std::optional<FenceNotice> scheduled_;
  mutable int queries_left_ = 0;
  mutable uint64_t generation_ = 0;
  std::vector<uint64_t> acked_;
};

class ExecutorServiceTest : public ::testing::TestWithParam<std::pair<DType, int32_t>> {
 protected:
  static void SetUpTestSuite() {
    absl::StatusOr<TempDir> dir = TempDir::Create("kvcm-exec-unit");
    ASSERT_THAT(dir, IsOk());
    dir_ = new TempDir(std::move(*dir));
    TinyModelOptions options;
    options.seed = 20240611;
    ASSERT_THAT(WriteTinyModel(dir_->path() + "/tiny", options), IsOk());
    LlamaModelOptions model_options;
    model_options.num_threads = 2;
    absl::StatusOr<std::unique_ptr<LlamaModel>> model =
        LlamaModel::Load(dir_->path() + "/tiny", model_options);
    ASSERT_THAT(model, IsOk());
    model_ = model->release();
  }
  static void TearDownTestSuite() {
    delete model_;
    delete dir_;
  }

  void SetUp() override {
    const auto [dtype, block_size] = GetParam();
    absl::StatusOr<KvCacheSpec> spec = model_->config().KvSpec(dtype, block_size);
    ASSERT_THAT(spec, IsOk());
    pool_ = std::make_unique<LocalPool>(*spec, kNumBlocks, kEpoch);
    ExecutorService::Options options;
    options.name = "unit";
    options.model_name = "tiny";
    executor_model_ = std::make_unique<ExecutorModel>(model_);
    service_ =
        std::make_unique<ExecutorService>(options, executor_model_.get(), pool_.get(), nullptr);
  }

  int32_t block_size() const { return GetParam().second; }

  // Blocks [first, first + n).
  static std::vector<int32_t> Blocks(int32_t first, int32_t n) {
    std::vector<int32_t> blocks(static_cast<size_t>(n));
    for (int32_t i = 0; i < n; ++i) blocks[static_cast<size_t>(i)] = first + i;
    return blocks;
  }

  // Greedy reference: ForwardContiguous over the whole sequence for each new token.
  static std::vector<int32_t> ReferenceGreedy(std::vector<int32_t> tokens, int32_t n) {
    std::vector<int32_t> out;
    const size_t vocab = static_cast<size_t>(model_->config().vocab_size);
    for (int32_t i = 0; i < n; ++i) {
      absl::StatusOr<std::vector<float>> logits = model_->ForwardContiguous(tokens);
      EXPECT_THAT(logits, IsOk());
      const std::span<const float> last(logits->data() + logits->size() - vocab, vocab);
      out.push_back(Greedy(last));
      tokens.push_back(out.back());
    }
    return out;
  }

  // Generates `n` tokens for each prompt through RunStep, batched (prefill, then decode),
  // sequence i in blocks starting at first_block[i].
  std::vector<std::vector<int32_t>> Generate(const std::vector<std::vector<int32_t>>& prompts,
                                             const std::vector<int32_t>& first_block, int32_t n,
                                             const SamplingParams& sampling = {}) {
    std::vector<std::vector<int32_t>> tokens = prompts;
    std::vector<std::vector<int32_t>> generated(prompts.size());
    const int32_t max_len = 64;
    for (int32_t step_index = 0; step_index < n; ++step_index) {
      StepBatch step;
      step.step_id = static_cast<uint64_t>(step_index);
      step.epoch = kEpoch;
      for (size_t i = 0; i < prompts.size(); ++i) {
        SeqWork s;
        s.seq = i + 1;
        const int32_t len = static_cast<int32_t>(tokens[i].size());
        if (step_index == 0) {
          s.tokens = tokens[i];
        } else {
          s.tokens = {tokens[i].back()};
        }
        s.context_len = len;
        s.block_table = Blocks(first_block[i], (max_len + block_size() - 1) / block_size());
        s.sampling = sampling;
        s.sample = true;
        s.sample_index = step_index;
        step.seqs.push_back(std::move(s));
      }
      absl::StatusOr<StepResult> report = service_->RunStep(step);
      EXPECT_THAT(report, IsOk());
      if (!report.ok()) return generated;
      for (size_t i = 0; i < prompts.size(); ++i) {
        EXPECT_THAT(report->results[i].status, IsOk());
        generated[i].push_back(report->results[i].token);
        tokens[i].push_back(report->results[i].token);
      }
    }
    return generated;
  }

  static TempDir* dir_;
  static LlamaModel* model_;
  std::unique_ptr<LocalPool> pool_;
  std::unique_ptr<ExecutorModel> executor_model_;
  std::unique_ptr<ExecutorService> service_;
};

TempDir* ExecutorServiceTest::dir_ = nullptr;
LlamaModel* ExecutorServiceTest::model_ = nullptr;

const std::vector<std::vector<int32_t>> kPrompts = {
    {1, 72, 101, 108, 108},
    {1, 84, 104, 101, 32, 113, 117, 105, 99, 107, 32},
    {1, 40, 32, 97, 109, 32, 97, 32, 115, 109, 97, 108, 108, 32, 116, 101, 115},
};

TEST_P(ExecutorServiceTest, GreedyStepsMatchTheContiguousReference) {
  const int32_t n = 10;
  const std::vector<std::vector<int32_t>> got = Generate(kPrompts, {0, 20, 40}, n);
  for (size_t i = 0; i < kPrompts.size(); ++i) {
    SCOPED_TRACE(absl::StrCat("prompt ", i));
    EXPECT_THAT(got[i], ElementsAreArray(ReferenceGreedy(kPrompts[i], n)));
  }
  EXPECT_EQ(service_->steps(), static_cast<uint64_t>(n));
}

TEST_P(ExecutorServiceTest, SampledTokensDependOnSeedAndIndexNotOnBatching) {
  SamplingParams sampling;
  sampling.temperature = 1.0f;
  sampling.top_p = 0.95f;
  sampling.seed = 77;
  const auto alone = Generate({kPrompts[1]}, {0}, 8, sampling);
  const auto batched = Generate({kPrompts[0], kPrompts[2], kPrompts[1]}, {20, 40, 0}, 8, sampling);
  EXPECT_EQ(alone[0], batched[2]);
}

// vLLM's min_tokens through RunStep: the tokens that end generation (here the greedy
// answer's 4th token, an end token as generation_config.json names one, and the model's own
// EOS ids) cannot be chosen before token number min_tokens; from there on the model chooses
// as before.
TEST_P(ExecutorServiceTest, MinTokensHoldsTheEndTokensBackUntilItsCount) {
  const std::vector<int32_t>& prompt = kPrompts[0];
  const std::vector<int32_t> plain = ReferenceGreedy(prompt, 8);
  const int32_t stop = plain[3];
  ASSERT_EQ(std::count(plain.begin(), plain.begin() + 3, stop), 0) << "pick another prompt";
  ExecutorService::Options options;
  options.name = "unit";
  options.model_name = "tiny";
  options.end_token_ids = {stop};
  service_ =
      std::make_unique<ExecutorService>(options, executor_model_.get(), pool_.get(), nullptr);
  // The reference: the contiguous pass, the end ids at -infinity for the first min_tokens.
  constexpr int32_t kMinTokens = 6;
  std::vector<int32_t> end_ids = model_->config().eos_token_ids;
  end_ids.push_back(stop);
  std::vector<int32_t> want;
  std::vector<int32_t> context = prompt;
  const size_t vocab = static_cast<size_t>(model_->config().vocab_size);
  for (int32_t i = 0; i < 8; ++i) {
    absl::StatusOr<std::vector<float>> logits = model_->ForwardContiguous(context);
    ASSERT_THAT(logits, IsOk());
    std::vector<float> last(logits->end() - static_cast<std::ptrdiff_t>(vocab), logits->end());
    if (i < kMinTokens) {
      for (const int32_t id : end_ids) {
        last[static_cast<size_t>(id)] = -std::numeric_limits<float>::infinity();
      }
    }
    want.push_back(Greedy(last));
    context.push_back(want.back());
  }
  SamplingParams sampling;
  sampling.min_tokens = kMinTokens;
  const std::vector<int32_t> held = Generate({prompt}, {0}, 8, sampling)[0];
  EXPECT_THAT(held, ElementsAreArray(want));
  EXPECT_THAT(std::vector<int32_t>(held.begin(), held.begin() + 3),
              ElementsAre(plain[0], plain[1], plain[2]));
  for (int32_t i = 0; i < kMinTokens; ++i) {
    EXPECT_THAT(end_ids, Not(Contains(held[static_cast<size_t>(i)]))) << "token " << i;
  }
  // Without min_tokens the end token comes 4th, as the model chooses it.
  EXPECT_THAT(Generate({prompt}, {20}, 8)[0], ElementsAreArray(plain));
  // Sampled too: whatever the seed, no end id before min_tokens.
  sampling.temperature = 1.5f;
  for (uint64_t seed = 1; seed <= 4; ++seed) {
    sampling.seed = seed;
    const std::vector<int32_t> drawn = Generate({prompt}, {40}, kMinTokens, sampling)[0];
    for (const int32_t token : drawn) EXPECT_THAT(end_ids, Not(Contains(token))) << seed;
  }
}

TEST_P(ExecutorServiceTest, InputLogprobsScoreThePromptChunkByChunkAsTheContiguousPass) {
  // Reference: log softmax of the contiguous pass's logits at position j - 1, at token j.
  const std::vector<int32_t>& prompt = kPrompts[2];
  absl::StatusOr<std::vector<float>> all = model_->ForwardContiguous(prompt);
  ASSERT_THAT(all, IsOk());
  const size_t vocab = static_cast<size_t>(model_->config().vocab_size);
  std::vector<float> expected;
  for (size_t j = 1; j < prompt.size(); ++j) {
    const std::span<const float> row(all->data() + (j - 1) * vocab, vocab);
    expected.push_back(LogprobOf(row, prompt[j]));
  }
  // Three chunks; another sequence decodes beside the middle one (its rows must not shift).
  const std::vector<std::pair<size_t, size_t>> chunks = {{0, 5}, {5, 11}, {11, prompt.size()}};
  std::vector<float> got;
  int32_t sampled = -1;
  for (size_t c = 0; c < chunks.size(); ++c) {
    const auto [begin, end] = chunks[c];
    StepBatch step;
    step.step_id = c;
    step.epoch = kEpoch;
    step.router_session = 1;
    if (c == 1) {
      SeqWork other;
      other.seq = 9;
      other.tokens = kPrompts[0];
      other.context_len = static_cast<int32_t>(kPrompts[0].size());
      other.block_table = Blocks(40, 8);
      other.sample = true;
      step.seqs.push_back(std::move(other));
    }
    SeqWork s;
    s.seq = 1;
    s.tokens.assign(prompt.begin() + static_cast<std::ptrdiff_t>(begin),
                    prompt.begin() + static_cast<std::ptrdiff_t>(end));
    s.context_len = static_cast<int32_t>(end);
    s.block_table = Blocks(0, (64 + block_size() - 1) / block_size());
    s.input_logprobs = true;
    s.sample = end == prompt.size();
    s.logprobs = s.sample;
    if (!s.sample) s.score_next = prompt[end];
    step.seqs.push_back(std::move(s));
    absl::StatusOr<StepResult> report = service_->RunStep(step);
    ASSERT_THAT(report, IsOk());
    const SeqResult& outcome = report->results.back();
    ASSERT_THAT(outcome.status, IsOk());
    EXPECT_EQ(outcome.input_logprobs.size(), end - begin - (s.sample ? 1 : 0));
    got.insert(got.end(), outcome.input_logprobs.begin(), outcome.input_logprobs.end());
    if (s.sample) sampled = outcome.token;
    if (c == 1) {
      EXPECT_TRUE(report->results[0].input_logprobs.empty());
    }
  }
  ASSERT_EQ(got.size(), expected.size());
  // The reference keeps its K/V in fp32; a bf16 pool rounds it to 8 bits of mantissa.
  const double tolerance = GetParam().first == DType::kBFloat16 ? 2e-2 : 2e-3;
  for (size_t j = 0; j < got.size(); ++j) {
    EXPECT_NEAR(got[j], expected[j], tolerance) << "token " << j + 1;
  }
  EXPECT_EQ(sampled, ReferenceGreedy(prompt, 1)[0]);
}

TEST_P(ExecutorServiceTest, RefusedStepsLeaveThePoolUntouched) {
  // Give the pool content, so that a stray copy or write would show.
  for (size_t i = 0; i < pool_->memory().size(); ++i) {
    pool_->memory()[i] = static_cast<uint8_t>(i * 7);
  }
  const std::vector<uint8_t> before = pool_->memory();
  const int32_t needed = (11 + block_size() - 1) / block_size();
  auto valid = [&] {
    StepBatch step;
    step.epoch = kEpoch;
    step.copies = {{1, 2}};
    SeqWork s;
    s.seq = 5;
    s.tokens = kPrompts[1];
    s.context_len = 11;
    s.block_table = Blocks(10, needed);
    s.sample = true;
    step.seqs.push_back(s);
    return step;
  };
  struct Case {
    const char* what;
    void (*mutate)(StepBatch&);
    const char* message;
  };
  const Case cases[] = {
      {"block out of range", [](StepBatch& s) { s.seqs[0].block_table.back() = kNumBlocks; },
       "the pool has 64 blocks"},
      {"short table", [](StepBatch& s) { s.seqs[0].block_table.pop_back(); }, "needs"},
      // -1 is only for a block the pool's window released; this pool releases none.
      {"no block where the window still reads", [](StepBatch& s) { s.seqs[0].block_table[0] = -1; },
       "which its window still reads"},
      {"table longer than the pool",
       [](StepBatch& s) { s.seqs[0].block_table.resize(kNumBlocks + 1, 0); },
       "the pool holds 64 blocks"},
      {"context longer than the pool", [](StepBatch& s) { s.seqs[0].context_len = 1 << 30; },
       "the pool holds 64 blocks"},
      {"copy out of range",
       [](StepBatch& s) {
         s.copies.push_back({kNumBlocks + 1, 3});
       },
       "outside"},
      {"copy destination twice",
       [](StepBatch& s) {
         s.copies.push_back({4, 2});
       },
       "repeats a destination"},
      {"copy source overwritten",
       [](StepBatch& s) {
         s.copies.push_back({2, 9});
       },
       "overwrites"},
      {"token outside the vocabulary", [](StepBatch& s) { s.seqs[0].tokens[3] = 100000; }, ""},
      {"slot written twice",
       [](StepBatch& s) {
         SeqWork other = s.seqs[0];
         other.seq = 6;
         s.seqs.push_back(other);
       },
       ""},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    StepBatch step = valid();
    c.mutate(step);
    absl::StatusOr<StepResult> report = service_->RunStep(step);
    ASSERT_FALSE(report.ok());
    EXPECT_TRUE(absl::IsInvalidArgument(report.status())) << report.status();
    EXPECT_THAT(std::string(report.status().message()), HasSubstr(c.message));
    EXPECT_TRUE(pool_->memory() == before) << "the pool changed";
  }
  // The valid step itself runs (and does change the pool).
  absl::StatusOr<StepResult> report = service_->RunStep(valid());
  ASSERT_THAT(report, IsOk());
  EXPECT_FALSE(pool_->memory() == before);
}

TEST_P(ExecutorServiceTest, AStepWhoseBlockTablesWouldBeTooLargeIsRefusedBeforeAnyWork) {
  ExecutorService::Options options;
  options.name = "bounded";
  options.model_name = "tiny";
  options.max_block_table_entries = 8;
  ExecutorService bounded(options, executor_model_.get(), pool_.get(), nullptr);
  const std::vector<uint8_t> before = pool_->memory();
  // Sequences of 11 tokens, each needing ceil(11 / block size) blocks.
  const int32_t needed = (11 + block_size() - 1) / block_size();
  auto step_of = [&](int n) {
    StepBatch step;
    step.epoch = kEpoch;
    step.router_session = 1;
    for (int i = 0; i < n; ++i) {
      SeqWork s;
      s.seq = static_cast<uint64_t>(i + 1);
      s.tokens = kPrompts[1];
      s.context_len = 11;
      s.block_table = Blocks(needed * i, needed);
      step.seqs.push_back(s);
    }
    return step;
  };
  const int fits = 8 / needed;
  absl::StatusOr<StepResult> over = bounded.RunStep(step_of(fits + 1));
  EXPECT_TRUE(absl::IsInvalidArgument(over.status())) << over.status();
  EXPECT_THAT(std::string(over.status().message()), HasSubstr("entries one step may use"));
  EXPECT_TRUE(pool_->memory() == before) << "a refused step wrote into the pool";
  if (fits > 0) {
    EXPECT_THAT(bounded.RunStep(step_of(fits)), IsOk());
  }
}

TEST_P(ExecutorServiceTest, CopiesRunBeforeTheForwardPass) {
  const PoolView& view = pool_->view();
  // Block 3 of every layer, K and V: a pattern. Copy it to block 8 in a step that also runs a
  // sequence in blocks 20...
  for (int32_t layer = 0; layer < view.spec.num_layers; ++layer) {
    for (int32_t kv = 0; kv < 2; ++kv) {
      uint8_t* block = pool_->memory().data() + view.layout.Offset(layer, kv, 3, 0, 0);
      for (int64_t b = 0; b < view.layout.block_stride; ++b) {
        block[b] = static_cast<uint8_t>(layer * 31 + kv * 7 + b);
      }
    }
  }
  StepBatch step;
  step.epoch = kEpoch;
  step.copies = {{3, 8}};
  SeqWork s;
  s.seq = 1;
  s.tokens = kPrompts[0];
  s.context_len = 5;
  s.block_table = Blocks(20, 4);
  step.seqs.push_back(s);
  absl::StatusOr<StepResult> report = service_->RunStep(step);
  ASSERT_THAT(report, IsOk());
  EXPECT_EQ(report->results[0].token, -1);  // not asked to sample
  EXPECT_EQ(report->prefill_tokens, 5);
  for (int32_t layer = 0; layer < view.spec.num_layers; ++layer) {
    for (int32_t kv = 0; kv < 2; ++kv) {
      const uint8_t* src = pool_->memory().data() + view.layout.Offset(layer, kv, 3, 0, 0);
      const uint8_t* dst = pool_->memory().data() + view.layout.Offset(layer, kv, 8, 0, 0);
      EXPECT_EQ(std::memcmp(src, dst, static_cast<size_t>(view.layout.block_stride)), 0)
          << "layer " << layer << " kv " << kv;
    }
  }
}

TEST_P(ExecutorServiceTest, AnotherEpochIsRefusedAndReattachesOnlyWhenTheCacheManagerConfirmsIt) {
  StepBatch step;
  SeqWork s;
  s.seq = 1;
  s.tokens = {1, 2};
  s.context_len = 2;
  s.block_table = {0};
  s.sample = true;
  step.seqs.push_back(s);
  step.router_session = 1;

  // The attached epoch, no question asked.
  step.epoch = kEpoch;
  ASSERT_THAT(service_->RunStep(step), IsOk());
  EXPECT_EQ(pool_->epoch_checks(), 0);

  // Older or newer makes no difference: while the cache manager confirms the attached
  // epoch, a step of another (a stale router, a corrupt message) is refused and the mapping
  // stays.
  for (uint64_t other : {kEpoch - 1, kEpoch + 1}) {
    step.epoch = other;
    absl::StatusOr<StepResult> stale = service_->RunStep(step);
    EXPECT_TRUE(absl::IsAborted(stale.status())) << stale.status();
    EXPECT_THAT(std::string(stale.status().message()), HasSubstr("stale epoch"));
    EXPECT_EQ(pool_->reattaches(), 0);
    ASSERT_NE(pool_->pool(), nullptr);
  }
  // The cache manager cannot answer: refused, the mapping stays.
  pool_->set_epoch_current(absl::DeadlineExceededError("no answer"));
  absl::StatusOr<StepResult> unknown = service_->RunStep(step);
  EXPECT_TRUE(absl::IsAborted(unknown.status())) << unknown.status();
  EXPECT_THAT(std::string(unknown.status().message()), HasSubstr("cannot say which"));
  EXPECT_EQ(pool_->reattaches(), 0);

  // The cache manager says the attached epoch is gone: re-attach (no weights reloaded), but
  // refuse the step: it was sent before this executor had a session in its epoch, so no
  // fence of its router session waits for this executor (docs/architecture.md, "Fencing").
  // The next step of that epoch runs.
  pool_->set_epoch_current(false);
  pool_->set_epoch_after_reattach(kEpoch + 1);
  absl::StatusOr<StepResult> newer = service_->RunStep(step);
  EXPECT_TRUE(absl::IsAborted(newer.status())) << newer.status();
  EXPECT_THAT(std::string(newer.status().message()), HasSubstr("stale epoch, re-attached"));
  EXPECT_EQ(pool_->reattaches(), 1);
  EXPECT_TRUE(service_->WantsHello(absl::Now()));  // announces the new epoch
  absl::StatusOr<StepResult> next = service_->RunStep(step);
  ASSERT_THAT(next, IsOk());
  EXPECT_EQ(pool_->reattaches(), 1);

  // Gone again, but attaching fails: stale epoch, re-attaching.
  step.epoch = kEpoch + 5;
  pool_->set_reattach_result(absl::UnavailableError("nothing listens"));
  absl::StatusOr<StepResult> failed = service_->RunStep(step);
  EXPECT_TRUE(absl::IsAborted(failed.status())) << failed.status();
  EXPECT_THAT(std::string(failed.status().message()), HasSubstr("stale epoch, re-attaching"));
  EXPECT_EQ(pool_->reattaches(), 2);
}

TEST_P(ExecutorServiceTest, HandleAnswersEveryRequestAndNoReply) {
  flatbuffers::FlatBufferBuilder reply;
  const absl::Time now = absl::Now();

  // Garbage: ErrorReply Malformed with request id 0.
  const std::vector<uint8_t> garbage(40, 0xab);
  ExecutorService::Handled handled = service_->Handle(garbage, now, &reply);
  ASSERT_TRUE(handled.reply);
  VerifiedExecutorEnvelope verified = VerifyExecutorEnvelope(BufferSpan(reply));
  ASSERT_NE(verified.envelope, nullptr) << verified.reason;
  ASSERT_EQ(verified.envelope->payload_type(), wire::ExecutorMessage::ErrorReply);
  EXPECT_EQ(verified.envelope->payload_as_ErrorReply()->code(), wire::ErrorCode::Malformed);
  EXPECT_EQ(verified.envelope->request_id(), 0u);

  // A heartbeat probe: HeartbeatReply with its request id.
  flatbuffers::FlatBufferBuilder request;
  FinishExecutorEnvelope(request, 31, 1, kEpoch, wire::ExecutorMessage::Heartbeat,
                         wire::CreateHeartbeat(request).Union());
  handled = service_->Handle(BufferSpan(request), now, &reply);
  ASSERT_TRUE(handled.reply);
  verified = VerifyExecutorEnvelope(BufferSpan(reply));
  ASSERT_NE(verified.envelope, nullptr);
  EXPECT_EQ(verified.envelope->payload_type(), wire::ExecutorMessage::HeartbeatReply);
  EXPECT_EQ(verified.envelope->request_id(), 31u);

  // Something only a router receives: InvalidArgument.
  request.Clear();
  EncodeStepResult(request, 32, 1, kEpoch, StepResult{});
  handled = service_->Handle(BufferSpan(request), now, &reply);
  ASSERT_TRUE(handled.reply);
  verified = VerifyExecutorEnvelope(BufferSpan(reply));
  ASSERT_NE(verified.envelope, nullptr);
  EXPECT_EQ(verified.envelope->payload_as_ErrorReply()->code(), wire::ErrorCode::InvalidArgument);

  // A StepBatch with a block outside the pool: an ErrorReply naming it, with its request id.
  StepBatch step;
  step.epoch = kEpoch;
  step.router_session = 7;
  SeqWork s;
  s.seq = 3;
  s.tokens = {1};
  s.context_len = 1;
  s.block_table = {kNumBlocks + 100};
  step.seqs.push_back(s);
  request.Clear();
  EncodeStepBatch(request, 33, 1, step);
  handled = service_->Handle(BufferSpan(request), now, &reply);
  ASSERT_TRUE(handled.reply);
  verified = VerifyExecutorEnvelope(BufferSpan(reply));
  ASSERT_NE(verified.envelope, nullptr);
  EXPECT_EQ(verified.envelope->request_id(), 33u);
  const wire::ErrorReply* error = verified.envelope->payload_as_ErrorReply();
  ASSERT_NE(error, nullptr);
  EXPECT_EQ(error->code(), wire::ErrorCode::InvalidArgument);
  EXPECT_THAT(error->reason()->str(), HasSubstr("names block 164"));

  // The same step with a valid block: a StepResult.
  step.seqs[0].block_table = {2};
  step.seqs[0].sample = true;
  request.Clear();
  EncodeStepBatch(request, 34, 1, step);
  handled = service_->Handle(BufferSpan(request), now, &reply);
  ASSERT_TRUE(handled.reply);
  verified = VerifyExecutorEnvelope(BufferSpan(reply));
  ASSERT_NE(verified.envelope, nullptr);
  const wire::StepResult* result = verified.envelope->payload_as_StepResult();
  ASSERT_NE(result, nullptr);
  ASSERT_EQ(result->results()->size(), 1u);
  EXPECT_GE(result->results()->Get(0)->token(), 0);
  EXPECT_EQ(result->prefill_tokens(), 1);
}

TEST_P(ExecutorServiceTest, RegistersWithTheRouterAndAgainWhenForgotten) {
  const absl::Time now = absl::Now();
  EXPECT_TRUE(service_->WantsHello(now));
  flatbuffers::FlatBufferBuilder hello;
  service_->BuildHello(now, &hello);
  VerifiedExecutorEnvelope verified = VerifyExecutorEnvelope(BufferSpan(hello));
  ASSERT_NE(verified.envelope, nullptr);
  EXPECT_EQ(verified.envelope->epoch(), kEpoch);
  absl::StatusOr<ExecutorHello> info =
      DecodeExecutorHello(*verified.envelope->payload_as_ExecutorHello());
  ASSERT_THAT(info, IsOk());
  EXPECT_EQ(info->kv_spec, pool_->view().spec);
  EXPECT_EQ(info->model.num_layers, model_->config().num_hidden_layers);
  EXPECT_FALSE(service_->WantsHello(now));                    // waiting for the reply
  EXPECT_TRUE(service_->WantsHello(now + absl::Seconds(2)));  // unanswered: again

  flatbuffers::FlatBufferBuilder reply;
  flatbuffers::FlatBufferBuilder answer;
  FinishExecutorEnvelope(answer, verified.envelope->request_id(), 9, kEpoch,
                         wire::ExecutorMessage::ExecutorHelloReply,
                         wire::CreateExecutorHelloReply(answer, 9, 100).Union());
  EXPECT_FALSE(service_->Handle(BufferSpan(answer), now, &reply).reply);  // never answered
  EXPECT_TRUE(service_->registered());
  EXPECT_EQ(service_->executor_id(), 9u);
  EXPECT_FALSE(service_->WantsHello(now + absl::Seconds(2)));
  EXPECT_TRUE(service_->WantsHeartbeat(now + absl::Milliseconds(150)));

  // The router forgot us (restarted): Hello again.
  answer.Clear();
  FinishExecutorError(answer, 5, 0, kEpoch, wire::ErrorCode::NotRegistered, "who?");
  EXPECT_FALSE(service_->Handle(BufferSpan(answer), now, &reply).reply);
  EXPECT_FALSE(service_->registered());
  EXPECT_TRUE(service_->WantsHello(now));

  // A Hello that could not be sent is retried at once.
  service_->BuildHello(now, &hello);
  EXPECT_FALSE(service_->WantsHello(now));
  service_->HelloNotSent();
  EXPECT_TRUE(service_->WantsHello(now));
  service_->BuildHello(now, &hello);
  verified = VerifyExecutorEnvelope(BufferSpan(hello));
  ASSERT_NE(verified.envelope, nullptr);
  answer.Clear();
  FinishExecutorEnvelope(answer, verified.envelope->request_id(), 9, kEpoch,
                         wire::ExecutorMessage::ExecutorHelloReply,
                         wire::CreateExecutorHelloReply(answer, 9, 100).Union());
  EXPECT_FALSE(service_->Handle(BufferSpan(answer), now, &reply).reply);
  EXPECT_TRUE(service_->registered());

  // The router says goodbye: answered, and Hello again later.
  answer.Clear();
  FinishExecutorEnvelope(answer, 6, 9, kEpoch, wire::ExecutorMessage::Goodbye,
                         wire::CreateGoodbye(answer).Union());
  ASSERT_TRUE(service_->Handle(BufferSpan(answer), now, &reply).reply);
  verified = VerifyExecutorEnvelope(BufferSpan(reply));
  ASSERT_NE(verified.envelope, nullptr);
  EXPECT_EQ(verified.envelope->payload_type(), wire::ExecutorMessage::GoodbyeReply);
  EXPECT_FALSE(service_->registered());
  EXPECT_TRUE(service_->WantsHello(now));

  // No pool: no Hello (nothing to serve with).
  pool_->set_attached(false);
  EXPECT_FALSE(service_->WantsHello(now));
}

// A step of router session 7 over sequence 5, blocks from 10.
StepBatch FenceTestStep(int32_t block_size) {
  StepBatch step;
  step.epoch = kEpoch;
  step.router_session = 7;
  SeqWork s;
  s.seq = 5;
  s.tokens = kPrompts[1];
  s.context_len = static_cast<int32_t>(kPrompts[1].size());
  const int32_t needed = (s.context_len + block_size - 1) / block_size;
  for (int32_t i = 0; i < needed; ++i) s.block_table.push_back(10 + i);
  s.sample = true;
  step.seqs.push_back(s);
  return step;
}

TEST_P(ExecutorServiceTest, FencedRouterSessionsStepsAreRefusedAfterTheAcknowledgement) {
  EXPECT_EQ(service_->ApplyFences(), 0);  // none pending: nothing acknowledged
  EXPECT_TRUE(pool_->acked().empty());
  pool_->ScheduleFence({/*id=*/3, /*router_session=*/7, {}}, 0);
  (void)pool_->fence_generation();
  const std::vector<uint8_t> before = pool_->memory();
  EXPECT_EQ(service_->ApplyFences(), 1);
  EXPECT_THAT(pool_->acked(), ElementsAreArray({uint64_t{3}}));
  EXPECT_TRUE(service_->fenced_sessions().contains(7));

  absl::StatusOr<StepResult> refused = service_->RunStep(FenceTestStep(block_size()));
  EXPECT_TRUE(absl::IsCancelled(refused.status())) << refused.status();
  EXPECT_THAT(refused.status().message(), HasSubstr("router session 7 was fenced"));
  EXPECT_EQ(pool_->memory(), before);  // nothing written
  // Over the wire: StaleSession.
  flatbuffers::FlatBufferBuilder request, reply;
  EncodeStepBatch(request, 41, 1, FenceTestStep(block_size()));
  ASSERT_TRUE(service_->Handle(BufferSpan(request), absl::Now(), &reply).reply);
  const VerifiedExecutorEnvelope verified = VerifyExecutorEnvelope(BufferSpan(reply));
  ASSERT_NE(verified.envelope, nullptr);
  ASSERT_NE(verified.envelope->payload_as_ErrorReply(), nullptr);
  EXPECT_EQ(verified.envelope->payload_as_ErrorReply()->code(), wire::ErrorCode::StaleSession);
  EXPECT_EQ(pool_->memory(), before);

  // Another router's steps still run.
  StepBatch other = FenceTestStep(block_size());
  other.router_session = 8;
  EXPECT_THAT(service_->RunStep(other), IsOk());
}

TEST_P(ExecutorServiceTest, AFenceArrivingMidStepStopsItAtTheNextLayer) {
  const StepBatch step = FenceTestStep(block_size());
  // Query 1 is the look before writing, query 2 comes after layer 0.
  pool_->ScheduleFence({/*id=*/4, /*router_session=*/7, {}}, 1);
  absl::StatusOr<StepResult> abandoned = service_->RunStep(step);
  EXPECT_TRUE(absl::IsCancelled(abandoned.status())) << abandoned.status();
  EXPECT_THAT(abandoned.status().message(), HasSubstr("stopped after layer 0"));
  EXPECT_EQ(service_->abandoned_steps(), 1u);
  // Layer 0's K/V went in; no later layer was written.
  const PoolLayout& layout = pool_->view().layout;
  const auto layer_written = [&](int32_t layer) {
    const auto begin = pool_->memory().begin() + layer * layout.layer_stride;
    return std::any_of(begin, begin + layout.layer_stride, [](uint8_t b) { return b != 0; });
  };
  EXPECT_TRUE(layer_written(0));
  for (int32_t layer = 1; layer < pool_->view().spec.num_layers; ++layer) {
    EXPECT_FALSE(layer_written(layer)) << "layer " << layer;
  }
  // Not acknowledged while running; the next call between steps does, and refuses it after.
  EXPECT_TRUE(pool_->acked().empty());
  EXPECT_EQ(service_->ApplyFences(), 1);
  EXPECT_THAT(pool_->acked(), ElementsAreArray({uint64_t{4}}));
  EXPECT_TRUE(absl::IsCancelled(service_->RunStep(step).status()));
}

TEST_P(ExecutorServiceTest, AFenceOfAnotherRouterDoesNotStopTheStep) {
  pool_->ScheduleFence({/*id=*/5, /*router_session=*/99, {}}, 1);
  absl::StatusOr<StepResult> report = service_->RunStep(FenceTestStep(block_size()));
  ASSERT_THAT(report, IsOk());
  EXPECT_EQ(service_->abandoned_steps(), 0u);
  EXPECT_GE(report->results[0].token, 0);
}

TEST_P(ExecutorServiceTest, ASequenceFenceStopsOnlyStepsNamingItsSequences) {
  const StepBatch step = FenceTestStep(block_size());
  const uint64_t seq = step.seqs[0].seq;
  // Another sequence of the same router, fenced mid-step: the step runs on.
  pool_->ScheduleFence({/*id=*/6, /*router_session=*/7, {seq + 100}}, 1);
  absl::StatusOr<StepResult> unaffected = service_->RunStep(step);
  ASSERT_THAT(unaffected, IsOk());
  EXPECT_EQ(service_->abandoned_steps(), 0u);
  EXPECT_EQ(service_->ApplyFences(), 1);
  // Its own sequence, fenced mid-step (the router freed it with drain after moving it
  // elsewhere): stopped at the next layer, acknowledged between steps, refused after.
  pool_->ScheduleFence({/*id=*/7, /*router_session=*/7, {seq}}, 1);
  absl::StatusOr<StepResult> stopped = service_->RunStep(step);
  EXPECT_TRUE(absl::IsCancelled(stopped.status())) << stopped.status();
  EXPECT_EQ(service_->abandoned_steps(), 1u);
  EXPECT_EQ(service_->ApplyFences(), 1);
  EXPECT_THAT(pool_->acked(), ElementsAreArray({uint64_t{6}, uint64_t{7}}));
  absl::StatusOr<StepResult> refused = service_->RunStep(step);
  EXPECT_TRUE(absl::IsCancelled(refused.status())) << refused.status();
  EXPECT_THAT(refused.status().message(), HasSubstr(absl::StrCat("sequence ", seq)));
  // The router itself is not fenced: its other sequences run.
  EXPECT_FALSE(service_->fenced_sessions().contains(7));
  StepBatch other = step;
  other.seqs[0].seq = seq + 1;
  EXPECT_THAT(service_->RunStep(other), IsOk());
}

TEST_P(ExecutorServiceTest, NoPoolIsUnavailable) {
  pool_->set_attached(false);
  pool_->set_reattach_result(absl::UnavailableError("nothing listens"));
  StepBatch step;
  step.epoch = 0;
  absl::StatusOr<StepResult> report = service_->RunStep(step);
  EXPECT_TRUE(absl::IsUnavailable(report.status())) << report.status();
}

INSTANTIATE_TEST_SUITE_P(DTypesAndBlockSizes, ExecutorServiceTest,
                         ::testing::Values(std::make_pair(DType::kFloat32, 4),
                                           std::make_pair(DType::kFloat16, 16),
                                           std::make_pair(DType::kBFloat16, 5)),
                         [](const auto& test_param) {
                           return absl::StrCat(std::string(DTypeName(test_param.param.first)),
                                               "_block", test_param.param.second);
                         });

// KV cache groups (docs/architecture.md, "The hybrid KV cache") through RunStep: a tiny
// Qwen2 whose last two of four layers slide over 5 tokens, on a pool of its two groups
// (full attention: layers 0 and 1; window 5: layers 2 and 3) in pages of 2 slots.
class ExecutorServiceGroupsTest : public ::testing::Test {
 protected:
  static constexpr int32_t kBlockSize = 4;
  static constexpr int32_t kTableLen = 8;

  static void SetUpTestSuite() {
    absl::StatusOr<TempDir> dir = TempDir::Create("kvcm-exec-groups");
    ASSERT_THAT(dir, IsOk());
    dir_ = new TempDir(std::move(*dir));
    TinyModelOptions options;
    options.architecture = "qwen2";
    options.sliding_window = 5;
    options.max_window_layers = 2;
    ASSERT_THAT(WriteTinyModel(dir_->path() + "/tiny", options), IsOk());
    LlamaModelOptions model_options;
    model_options.num_threads = 2;
    absl::StatusOr<std::unique_ptr<LlamaModel>> model =
        LlamaModel::Load(dir_->path() + "/tiny", model_options);
    ASSERT_THAT(model, IsOk());
    model_ = model->release();
  }
  static void TearDownTestSuite() {
    delete model_;
    delete dir_;
  }

  void SetUp() override {
    groups_ = GroupLayers(model_->config().layer_windows).value();
    ASSERT_EQ(groups_.num_groups(), 2) << groups_.ToString();
    ASSERT_EQ(groups_.group_size, 2) << groups_.ToString();
    const KvCacheSpec spec =
        PageSpec(model_->config().KvSpec(DType::kFloat32, kBlockSize).value(), groups_);
    pool_ = std::make_unique<LocalPool>(spec, kNumBlocks, kEpoch);
    pool_->set_kv_groups(groups_.groups);
    ExecutorService::Options options;
    options.name = "unit";
    options.model_name = "tiny";
    executor_model_ = std::make_unique<ExecutorModel>(model_);
    service_ =
        std::make_unique<ExecutorService>(options, executor_model_.get(), pool_.get(), nullptr);
  }

  // Tokens [done, done + n) of `tokens` as one step of sequence 1, sampled greedily: group
  // 0 in blocks 3, 4, ..., group 1 in blocks 40, 38, ... (other ids, another order), its
  // entries wholly behind the window of the first new token -1, as the cache manager
  // releases them.
  StepBatch Step(const std::vector<int32_t>& tokens, int32_t done, int32_t n) {
    StepBatch step;
    step.step_id = next_step_++;
    step.epoch = kEpoch;
    SeqWork s;
    s.seq = 1;
    s.tokens.assign(tokens.begin() + done, tokens.begin() + done + n);
    s.context_len = done + n;
    s.sample = true;
    const int64_t released = ReleasedBlocks(groups_.groups[1].window, done, kBlockSize);
    for (int32_t j = 0; j < kTableLen; ++j) {
      s.block_table.push_back(3 + j);
      s.group_tables.push_back(j < released ? -1 : 40 - 2 * j);
      released_ += j < released ? 1 : 0;
    }
    step.seqs.push_back(std::move(s));
    return step;
  }

  static TempDir* dir_;
  static LlamaModel* model_;
  KvCacheGroups groups_;
  std::unique_ptr<LocalPool> pool_;
  std::unique_ptr<ExecutorModel> executor_model_;
  std::unique_ptr<ExecutorService> service_;
  uint64_t next_step_ = 1;
  int32_t released_ = 0;
};

TempDir* ExecutorServiceGroupsTest::dir_ = nullptr;
LlamaModel* ExecutorServiceGroupsTest::model_ = nullptr;

TEST_F(ExecutorServiceGroupsTest, GreedyStepsOnAGroupedPoolMatchTheContiguousReference) {
  std::vector<int32_t> tokens = kPrompts[1];
  const int32_t prompt_len = static_cast<int32_t>(tokens.size());
  const size_t vocab = static_cast<size_t>(model_->config().vocab_size);
  std::vector<int32_t> got;
  std::vector<int32_t> want;
  for (int32_t i = 0; i < 12; ++i) {
    const int32_t done = i == 0 ? 0 : static_cast<int32_t>(tokens.size()) - 1;
    const int32_t n = i == 0 ? prompt_len : 1;
    absl::StatusOr<StepResult> report = service_->RunStep(Step(tokens, done, n));
    ASSERT_THAT(report, IsOk());
    ASSERT_THAT(report->results[0].status, IsOk());
    absl::StatusOr<std::vector<float>> logits = model_->ForwardContiguous(tokens);
    ASSERT_THAT(logits, IsOk());
    want.push_back(Greedy(std::span<const float>(*logits).last(vocab)));
    got.push_back(report->results[0].token);
    tokens.push_back(got.back());
  }
  EXPECT_THAT(got, ElementsAreArray(want));
  EXPECT_GT(released_, 0) << "no table entry was released";
}

// Copy-on-write orders copy whole pages, every slot: a sequence that decodes through copies
// of each group's last, partly filled block (as a forked one does) gets the reference token
// and log-probability.
TEST_F(ExecutorServiceGroupsTest, CopyOnWriteCopiesEverySlotOfAPage) {
  std::vector<int32_t> tokens = kPrompts[1];  // 11 tokens: block 2 holds positions 8 .. 10
  absl::StatusOr<StepResult> prefill = service_->RunStep(Step(tokens, 0, 11));
  ASSERT_THAT(prefill, IsOk());
  tokens.push_back(prefill->results[0].token);
  StepBatch next = Step(tokens, 11, 1);
  SeqWork& s = next.seqs[0];
  next.copies = {{s.block_table[2], 60}, {s.group_tables[2], 61}};
  s.block_table[2] = 60;
  s.group_tables[2] = 61;
  s.logprobs = true;
  absl::StatusOr<StepResult> decoded = service_->RunStep(next);
  ASSERT_THAT(decoded, IsOk());
  absl::StatusOr<std::vector<float>> logits = model_->ForwardContiguous(tokens);
  ASSERT_THAT(logits, IsOk());
  const size_t vocab = static_cast<size_t>(model_->config().vocab_size);
  const std::span<const float> last = std::span<const float>(*logits).last(vocab);
  EXPECT_EQ(decoded->results[0].token, Greedy(last));
  EXPECT_NEAR(decoded->results[0].logprob, LogprobOf(last, Greedy(last)), 1e-4);
}

TEST_F(ExecutorServiceGroupsTest, StepWithoutTheRightGroupTablesIsRefusedNamingTheSequence) {
  const std::vector<int32_t>& tokens = kPrompts[1];
  StepBatch none = Step(tokens, 0, 5);
  none.seqs[0].group_tables.clear();
  absl::StatusOr<StepResult> refused = service_->RunStep(none);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  EXPECT_THAT(refused.status().message(), HasSubstr("seq[0] (id 1) has 0 group table entries"));
  EXPECT_THAT(refused.status().message(), HasSubstr("2 KV cache groups"));

  StepBatch two = Step(tokens, 0, 5);
  std::vector<int32_t>& tables = two.seqs[0].group_tables;
  tables.insert(tables.end(), tables.begin(), tables.end());  // a table for a third group
  refused = service_->RunStep(two);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  EXPECT_THAT(refused.status().message(), HasSubstr("has 16 group table entries"));
  EXPECT_EQ(service_->steps(), 0u);
}

TEST_F(ExecutorServiceGroupsTest, NoBlockWhereAGroupStillReadsIsRefused) {
  std::vector<int32_t> tokens = kPrompts[1];  // 11 tokens
  tokens.push_back(7);
  // Decoding position 11: the window group reads positions 7.. (block 1 on); the full
  // group reads everything.
  StepBatch inside = Step(tokens, 11, 1);
  ASSERT_EQ(inside.seqs[0].group_tables[0], -1);
  inside.seqs[0].group_tables[1] = -1;
  absl::StatusOr<StepResult> refused = service_->RunStep(inside);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  EXPECT_THAT(refused.status().message(),
              HasSubstr("seq[0] (id 1) has no block at group_tables (KV cache group 1)[1]"));

  StepBatch full = Step(tokens, 11, 1);
  full.seqs[0].block_table[0] = -1;
  refused = service_->RunStep(full);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  EXPECT_THAT(refused.status().message(), HasSubstr("has no block at block_table[0]"));
  EXPECT_EQ(service_->steps(), 0u);
}

TEST_F(ExecutorServiceGroupsTest, GroupTablesOnAPoolWithoutGroupsAreRefused) {
  LocalPool plain(model_->config().KvSpec(DType::kFloat32, kBlockSize).value(), kNumBlocks, kEpoch);
  ExecutorService service({}, executor_model_.get(), &plain, nullptr);
  absl::StatusOr<StepResult> refused = service.RunStep(Step(kPrompts[1], 0, 5));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  EXPECT_THAT(refused.status().message(), HasSubstr("seq[0] (id 1) has 8 group table entries"));
}

// The attach check: the pool's groups must be the model's, exactly.
TEST_F(ExecutorServiceGroupsTest, PoolWhoseGroupsDifferFromTheModelsIsRefusedAtAttach) {
  const LlamaConfig& c = model_->config();
  const ModelKvShape shape = {c.num_hidden_layers, c.num_key_value_heads, c.head_dim,
                              c.layer_windows};
  EXPECT_THAT(CheckPoolFitsModel(pool_->view(), shape), IsOk());
  EXPECT_THAT(model_->CheckPool(pool_->view()), IsOk());
  auto refusal = [&](const PoolView& pool) {
    const absl::Status fits = CheckPoolFitsModel(pool, shape);
    EXPECT_EQ(fits.code(), absl::StatusCode::kFailedPrecondition) << fits;
    const absl::Status checked = model_->CheckPool(pool);
    EXPECT_EQ(checked.code(), absl::StatusCode::kFailedPrecondition) << checked;
    EXPECT_EQ(fits.message(), checked.message());
    return std::string(fits.message());
  };
  PoolView pool = pool_->view();
  pool.kv_groups.pop_back();
  EXPECT_THAT(refusal(pool), HasSubstr("the pool has 1 KV cache groups but the model's layers "
                                       "make 2"));
  pool = pool_->view();
  pool.kv_groups[1].window = 6;
  EXPECT_THAT(refusal(pool), HasSubstr("KV cache group 1 of the pool is window 6 (layers 2, 3) "
                                       "but the model's is window 5 (layers 2, 3)"));
  pool = pool_->view();
  std::swap(pool.kv_groups[0].layers[0], pool.kv_groups[0].layers[1]);
  EXPECT_THAT(refusal(pool), HasSubstr("KV cache group 0 of the pool is full attention (layers "
                                       "1, 0) but the model's is full attention (layers 0, 1)"));
  pool = pool_->view();
  pool.sliding_window_tokens = 5;
  EXPECT_THAT(refusal(pool), HasSubstr("pool-wide sliding window of 5 tokens"));
  // Pages of 4 slots (the model's layer count) for groups of 2.
  LocalPool wide(model_->config().KvSpec(DType::kFloat32, kBlockSize).value(), kNumBlocks, kEpoch);
  wide.set_kv_groups(groups_.groups);
  EXPECT_THAT(refusal(wide.view()),
              HasSubstr("the pool's pages hold 4 layer slots but the model's KV cache groups "
                        "have 2"));
}

// The device model reads every layer through one table: a grouped pool in CUDA memory is
// refused before any weight is copied, with or without a device.
TEST_F(ExecutorServiceGroupsTest, CudaModelRefusesAGroupedPool) {
  PoolView pool = pool_->view();
  pool.backend = PoolBackend::kCuda;
  pool.cuda_device = 0;
  ExecutorModel model(model_);
  const absl::Status prepared = model.Prepare(pool);
  EXPECT_EQ(prepared.code(), absl::StatusCode::kUnimplemented) << prepared;
  EXPECT_THAT(prepared.message(), HasSubstr("KV cache groups are served by the CPU model only"));
  EXPECT_EQ(model.cuda(), nullptr);
}

TEST(ChooseTokenTest, GreedyTakesTheArgmaxAndNaNFails) {
  const std::vector<float> logits = {0.5f, 3.0f, -1.0f, 3.0f};
  absl::StatusOr<ChosenToken> token = ChooseToken(logits, SeqWork{}, 0);
  ASSERT_THAT(token, IsOk());
  EXPECT_EQ(token->token, 1);  // lowest id among ties
  std::vector<float> broken = logits;
  broken[2] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(absl::IsFailedPrecondition(ChooseToken(broken, SeqWork{}, 0).status()));
  SeqWork hot;
  hot.sampling.temperature = 2.0f;
  hot.sampling.seed = 5;
  // Pure function of (logits, params, index).
  EXPECT_EQ(ChooseToken(logits, hot, 7)->token, ChooseToken(logits, hot, 7)->token);
}

TEST(ChooseTokenTest, ForkSeedsDrawWhatThoseSeedsWouldDrawAtIndexZero) {
  std::vector<float> logits(64);
  for (size_t i = 0; i < logits.size(); ++i) logits[i] = std::sin(static_cast<float>(i) * 1.7f);
  SeqWork seq;
  seq.sampling.temperature = 1.5f;
  seq.sampling.seed = 100;
  seq.logprobs = true;
  seq.fork_seeds = {101, 102, 103, 104, 105, 106};
  absl::StatusOr<ChosenToken> chosen = ChooseToken(logits, seq, 0);
  ASSERT_THAT(chosen, IsOk());
  ASSERT_EQ(chosen->fork_tokens.size(), seq.fork_seeds.size());
  ASSERT_EQ(chosen->fork_logprobs.size(), seq.fork_seeds.size());
  std::set<int32_t> distinct = {chosen->token};
  for (size_t i = 0; i < seq.fork_seeds.size(); ++i) {
    SeqWork alone;
    alone.sampling = seq.sampling;
    alone.sampling.seed = seq.fork_seeds[i];
    alone.logprobs = true;
    const ChosenToken own = *ChooseToken(logits, alone, 0);
    EXPECT_EQ(chosen->fork_tokens[i], own.token) << "fork " << i;
    EXPECT_EQ(chosen->fork_logprobs[i], own.logprob);
    distinct.insert(own.token);
  }
  EXPECT_GT(distinct.size(), 1u) << "seven draws at temperature 1.5 all alike";
}

// vLLM's min_tokens: the end ids are held back while the index is below it, for greedy and
// sampled choices, the log-probabilities are of the masked row, and fork seeds (index 0) are
// held back as index 0 is.
TEST(ChooseTokenTest, MinTokensHoldsTheEndIdsBackBeforeItsIndex) {
  const std::vector<float> logits = {0.0f, 5.0f, 1.0f, 4.0f, 0.5f};
  const std::vector<int32_t> end_ids = {1, 3};
  SeqWork seq;
  seq.sampling.min_tokens = 3;
  seq.logprobs = true;
  seq.top_n = 5;
  for (int64_t index = 0; index < 3; ++index) {
    absl::StatusOr<ChosenToken> chosen = ChooseToken(logits, seq, index, end_ids);
    ASSERT_THAT(chosen, IsOk());
    EXPECT_EQ(chosen->token, 2) << index;  // the best that is no end id
    double z = 0;
    for (float l : {0.0f, 1.0f, 0.5f}) z += std::exp(static_cast<double>(l));
    EXPECT_NEAR(chosen->logprob, 1.0 - std::log(z), 1e-6);
    ASSERT_EQ(chosen->top.size(), 5u);
    EXPECT_EQ(chosen->top[3].logprob, -std::numeric_limits<float>::infinity());
    EXPECT_EQ(chosen->top[4].logprob, -std::numeric_limits<float>::infinity());
  }
  // From index min_tokens on, the row is the model's.
  EXPECT_EQ(ChooseToken(logits, seq, 3, end_ids)->token, 1);
  // No end ids known, or min_tokens 0: nothing held back.
  EXPECT_EQ(ChooseToken(logits, seq, 0)->token, 1);
  seq.sampling.min_tokens = 0;
  EXPECT_EQ(ChooseToken(logits, seq, 0, end_ids)->token, 1);
  // Sampled: many seeds, never an end id before min_tokens, but one after it.
  seq.sampling.min_tokens = 2;
  seq.sampling.temperature = 3.0f;
  bool ended_after = false;
  for (uint64_t seed = 0; seed < 200; ++seed) {
    seq.sampling.seed = seed;
    for (int64_t index = 0; index < 2; ++index) {
      EXPECT_THAT(end_ids, Not(Contains(ChooseToken(logits, seq, index, end_ids)->token)));
    }
    const int32_t later = ChooseToken(logits, seq, 2, end_ids)->token;
    ended_after = ended_after || later == 1 || later == 3;
  }
  EXPECT_TRUE(ended_after);
  // Fork seeds draw as index 0: held back even when the main draw is past min_tokens.
  seq.sampling.temperature = 0.0f;
  seq.fork_seeds = {7, 8};
  absl::StatusOr<ChosenToken> forked = ChooseToken(logits, seq, 5, end_ids);
  ASSERT_THAT(forked, IsOk());
  EXPECT_EQ(forked->token, 1);
  EXPECT_THAT(forked->fork_tokens, ElementsAre(2, 2));
}

TEST(ChooseTokenTest, PenaltiesSteerGreedyAwayFromWhatWasSeen) {
  const std::vector<float> logits = {2.0f, 1.9f, -0.5f, 1.0f};
  SeqWork seq;
  seq.penalty_tokens = {0, 2};  // the prompt holds tokens 0 and 2
  seq.penalty_prompt_len = 2;
  seq.sampling.repetition_penalty = 1.2f;  // 2.0 -> 1.667 < 1.9
  EXPECT_EQ(ChooseToken(logits, seq, 0)->token, 1);
  // Frequency and presence count the output only: the prompt's token 0 keeps its logit.
  seq.sampling.repetition_penalty = 1.0f;
  seq.sampling.frequency_penalty = 2.0f;
  EXPECT_EQ(ChooseToken(logits, seq, 0)->token, 0);
  seq.penalty_tokens = {3, 0, 1, 1};  // prompt {3}, output {0, 1, 1}
  seq.penalty_prompt_len = 1;
  seq.sampling.frequency_penalty = 0.5f;  // 0: 1.5, 1: 0.9, 3: 1.0
  EXPECT_EQ(ChooseToken(logits, seq, 0)->token, 0);
  seq.sampling.presence_penalty = 0.6f;  // 0: 0.9, 1: 0.3, 3: 1.0
  EXPECT_EQ(ChooseToken(logits, seq, 0)->token, 3);
}

TEST(ChooseTokenTest, LogprobsAreThoseOfThePenalizedTemperedDistribution) {
  const std::vector<float> logits = {1.0f, 3.0f, 3.0f, -2.0f, 0.0f};
  SeqWork seq;
  seq.logprobs = true;
  seq.top_n = 3;
  absl::StatusOr<ChosenToken> chosen = ChooseToken(logits, seq, 0);
  ASSERT_THAT(chosen, IsOk());
  double total = 0;
  for (float l : logits) total += std::exp(static_cast<double>(l));
  EXPECT_NEAR(chosen->logprob, 3.0 - std::log(total), 1e-6);
  ASSERT_EQ(chosen->top.size(), 3u);
  EXPECT_EQ(chosen->top[0].token, 1);  // ties: the lower id first
  EXPECT_EQ(chosen->top[1].token, 2);
  EXPECT_EQ(chosen->top[2].token, 0);
  EXPECT_NEAR(chosen->top[2].logprob, 1.0 - std::log(total), 1e-6);

  // With a temperature the distribution is softmax(l / t); with a penalty, of the penalized
  // logits.
  seq.sampling.temperature = 0.5f;
  seq.sampling.seed = 11;
  seq.sampling.repetition_penalty = 2.0f;
  seq.penalty_tokens = {1};
  seq.penalty_prompt_len = 1;
  chosen = ChooseToken(logits, seq, 3);
  ASSERT_THAT(chosen, IsOk());
  const std::vector<double> adjusted = {1.0 / 0.5, 1.5 / 0.5, 3.0 / 0.5, -2.0 / 0.5, 0.0};
  double z = 0;
  for (double a : adjusted) z += std::exp(a);
  EXPECT_NEAR(chosen->logprob, adjusted[static_cast<size_t>(chosen->token)] - std::log(z), 1e-5);
  EXPECT_EQ(chosen->top[0].token, 2);
  EXPECT_NEAR(chosen->top[0].logprob, 6.0 - std::log(z), 1e-5);
  // Not asked for: nothing computed.
  seq.logprobs = false;
  seq.top_n = 0;
  EXPECT_TRUE(ChooseToken(logits, seq, 3)->top.empty());
}

}  // namespace
}  // namespace kvcm::executor
