// THE test of the executor's model: a forward over the paged pool (WriteKv + PagedAttention)
// gives the logits of the plain contiguous forward, for prefill, decode, chunked prefill,
// prefill over a shared cached prefix, mixed batches, any block size and placement, and
// fp32 / fp16 / bf16 caches; for a Llama, for a Qwen3 (its per-head q/k norm, and a
// head_dim other than hidden / heads), for a Mistral with a sliding window of 6 tokens on
// every layer (the table entries of blocks behind every window sent as -1, as the cache
// manager's release leaves them) and for a Qwen2 whose last two of four layers slide over 5
// tokens. Sequences run several windows long. That Qwen2 also runs on a pool of KV cache
// groups, a table per group and each layer in its slot of its group's blocks
// (docs/architecture.md, "The hybrid KV cache"), with malformed group tables refused.
//
// Tolerances, as max |paged - reference| / max(1, max |reference|) over a logits row:
//   fp32 cache  1e-5  (only the order of the attention sums differs; about 7e-7 seen)
//   fp16 cache  2e-3  (K/V rounded to 11 significant bits; about 6e-4 seen)
//   bf16 cache  1.5e-2 (K/V rounded to 8 significant bits; about 4e-3 seen)
// The worst error seen is printed for each case.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/base/check.h"
#include "common/memory/pool_layout.h"
#include "common/memory/pool_memory.h"
#include "common/sizing/kv_cache_groups.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/paged_kv.h"
#include "services/executor/kv_groups.h"
#include "services/executor/model/llama_model.h"
#include "services/executor/model/llama_model_cuda.h"
#include "services/executor/model/sampler.h"
#include "tests/support/status_matchers.h"
#include "tests/support/subprocess.h"
#include "tools/make_tiny_model/tiny_model.h"

namespace kvcm::executor {
namespace {

using ::testing::HasSubstr;

double Tolerance(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return 1e-5;
    case DType::kFloat16:
      return 2e-3;
    default:
      return 1.5e-2;
  }
}

// The tiny model of `architecture` ("llama" or "qwen3"), one for the whole suite (loading
// is cheap but not free).
TinyModelOptions TinyOptions(const std::string& architecture) {
  TinyModelOptions options;
  options.architecture = architecture;
  if (architecture == "qwen3") options.head_dim = 24;  // not hidden 64 / 4 heads
  if (architecture == "mistral-window") {
    options.architecture = "mistral";
    options.sliding_window = 6;
  }
  if (architecture == "qwen2-window") {
    options.architecture = "qwen2";
    options.sliding_window = 5;
    options.max_window_layers = 2;
  }
  return options;
}

class ModelHolder {
 public:
  static const LlamaModel& Get(const std::string& architecture = "llama") {
    static auto* holders = new std::map<std::string, ModelHolder*>();
    ModelHolder*& holder = (*holders)[architecture];
    if (holder == nullptr) holder = new ModelHolder(architecture);
    return *holder->model_;
  }

 private:
  explicit ModelHolder(const std::string& architecture) {
    absl::StatusOr<testing::TempDir> dir = testing::TempDir::Create("kvcm-paged");
    KVCM_CHECK(dir.ok()) << dir.status();
    const TinyModelOptions options = TinyOptions(architecture);
    std::printf("tiny model seed %llu\n", static_cast<unsigned long long>(options.seed));
    KVCM_CHECK(WriteTinyModel(dir->path(), options).ok());
    LlamaModelOptions model_options;
    model_options.num_threads = 2;
    auto model = LlamaModel::Load(dir->path(), model_options);
    KVCM_CHECK(model.ok()) << model.status();
    model_ = std::move(*model);
  }
  std::unique_ptr<LlamaModel> model_;
};

// A pool in plain memory, with blocks handed out in a shuffled order.
class TestPool {
 public:
  TestPool(const LlamaConfig& config, DType dtype, int32_t block_size, int32_t num_blocks,
           uint64_t seed) {
    pool_.spec = config.KvSpec(dtype, block_size).value();
    pool_.layout = PoolLayout::For(pool_.spec, num_blocks).value();
    // Garbage, not zeros, so a read of an unwritten slot cannot pass by luck.
    memory_.assign(static_cast<size_t>(pool_.layout.total_bytes), 0x5a);
    pool_.base = memory_.data();
    for (int32_t b = 0; b < num_blocks; ++b) free_.push_back(b);
    std::mt19937_64 rng(seed);
    std::shuffle(free_.begin(), free_.end(), rng);
  }
  int32_t TakeBlock() {
    KVCM_CHECK(!free_.empty());
    const int32_t b = free_.back();
    free_.pop_back();
    return b;
  }
  const PoolView& pool() const { return pool_; }
  int32_t block_size() const { return pool_.spec.block_size; }
  const std::vector<uint8_t>& memory() const { return memory_; }
  std::vector<uint8_t>& mutable_memory() { return memory_; }

 private:
  std::vector<uint8_t> memory_;
  PoolView pool_;
  std::vector<int32_t> free_;
};

struct Sequence {
  std::vector<int32_t> tokens;  // all tokens so far, including ones not yet run
  int32_t cached = 0;           // tokens whose K/V are in the pool
  std::vector<int32_t> blocks;  // block table
};

// Runs one step: for each (sequence, number of new tokens) pair, the next `n` tokens of the
// sequence (already appended to its tokens) are run. Returns all-token logits.
std::vector<float> Step(const LlamaModel& model, TestPool& pool,
                        const std::vector<std::pair<Sequence*, int32_t>>& work) {
  ForwardBatch batch;
  int32_t max_blocks = 1;
  for (const auto& [seq, n] : work) {
    const int32_t ctx = seq->cached + n;
    while (static_cast<int32_t>(seq->blocks.size()) * pool.block_size() < ctx) {
      seq->blocks.push_back(pool.TakeBlock());
    }
    max_blocks = std::max(max_blocks, static_cast<int32_t>(seq->blocks.size()));
  }
  batch.max_blocks_per_seq = max_blocks + 1;  // one spare entry: must be ignored
  // With a window on every layer, the blocks wholly behind the window of every new token
  // go as -1, as the cache manager's release leaves them: a read of one would fail.
  const std::vector<int32_t>& windows = model.config().layer_windows;
  const int32_t window = *std::min_element(windows.begin(), windows.end());
  for (const auto& [seq, n] : work) {
    batch.query_lens.push_back(n);
    batch.context_lens.push_back(seq->cached + n);
    for (int32_t i = seq->cached; i < seq->cached + n; ++i)
      batch.token_ids.push_back(seq->tokens[i]);
    const int32_t released =
        window > 0 ? std::max(0, seq->cached - window + 1) / pool.block_size() : 0;
    for (int32_t j = 0; j < batch.max_blocks_per_seq; ++j) {
      batch.block_tables.push_back(
          j >= released && j < static_cast<int32_t>(seq->blocks.size()) ? seq->blocks[j] : -1);
    }
  }
  std::vector<float> logits;
  const absl::Status s = model.Forward(batch, pool.pool(), &logits, LogitsScope::kAllTokens);
  EXPECT_THAT(s, IsOk());
  for (const auto& [seq, n] : work) seq->cached += n;
  return logits;
}

// max |a - ref| / max(1, max |ref|) over one row.
double RowError(const float* a, const float* ref, int32_t vocab) {
  double diff = 0;
  double scale = 1;
  for (int32_t i = 0; i < vocab; ++i) {
    diff = std::max(diff, static_cast<double>(std::abs(a[i] - ref[i])));
    scale = std::max(scale, static_cast<double>(std::abs(ref[i])));
  }
  return diff / scale;
}

// Tracks the logits a sequence got from the paged path, position by position, and compares
// them with ForwardContiguous over its final tokens.
class Checker {
 public:
  explicit Checker(const LlamaModel& model) : model_(model), vocab_(model.config().vocab_size) {}

  // Records the rows of `logits` (all-token, in `work` order) against their positions.
  void Record(const std::vector<float>& logits,
              const std::vector<std::pair<Sequence*, int32_t>>& work) {
    size_t row = 0;
    for (const auto& [seq, n] : work) {
      auto& rows = rows_[seq];
      for (int32_t q = 0; q < n; ++q, ++row) {
        const int32_t position = seq->cached - n + q;
        rows.emplace_back(position, std::vector<float>(logits.begin() + row * vocab_,
                                                       logits.begin() + (row + 1) * vocab_));
      }
    }
    ASSERT_EQ(row * vocab_, logits.size());
  }

  // The worst relative error of any recorded row.
  double WorstError() const {
    double worst = 0;
    for (const auto& [seq, rows] : rows_) {
      absl::StatusOr<std::vector<float>> ref = model_.ForwardContiguous(seq->tokens);
      EXPECT_THAT(ref, IsOk());
      if (!ref.ok()) return INFINITY;
      for (const auto& [position, row] : rows) {
        worst =
            std::max(worst, RowError(row.data(), ref->data() + int64_t{position} * vocab_, vocab_));
      }
    }
    return worst;
  }

 private:
  const LlamaModel& model_;
  int32_t vocab_;
  std::map<const Sequence*, std::vector<std::pair<int32_t, std::vector<float>>>> rows_;
};

std::vector<int32_t> RandomTokens(std::mt19937_64& rng, int32_t n, int32_t vocab) {
  std::vector<int32_t> tokens;
  for (int32_t i = 0; i < n; ++i) tokens.push_back(static_cast<int32_t>(rng() % vocab));
  return tokens;
}

using Param = std::tuple<int32_t /*block_size*/, DType, const char* /*architecture*/>;

class PagedForwardTest : public ::testing::TestWithParam<Param> {
 protected:
  int32_t block_size() const { return std::get<0>(GetParam()); }
  DType dtype() const { return std::get<1>(GetParam()); }
  const LlamaModel& model() const { return ModelHolder::Get(std::get<2>(GetParam())); }
  uint64_t Seed() const {
    const uint64_t seed =
        1000 + static_cast<uint64_t>(block_size()) * 10 + static_cast<uint64_t>(dtype());
    std::printf("seed %llu (block size %d, %s cache)\n", static_cast<unsigned long long>(seed),
                block_size(), std::string(DTypeName(dtype())).c_str());
    return seed;
  }
  void ExpectWithinTolerance(double error, const char* what) {
    std::printf("%s: worst relative error %.3g (tolerance %.1g)\n", what, error,
                Tolerance(dtype()));
    EXPECT_LE(error, Tolerance(dtype())) << what;
  }
};

// Three sequences of different lengths prefilled in one batch, then decoded token by token
// in one batch (each next token greedy on the reference logits), sequences dropping out at
// different steps.
TEST_P(PagedForwardTest, BatchedPrefillThenDecodeMatchesContiguous) {
  const LlamaModel& model = this->model();
  const int32_t vocab = model.config().vocab_size;
  const uint64_t seed = Seed();
  std::mt19937_64 rng(seed);
  TestPool pool(model.config(), dtype(), block_size(), 200, seed);
  Checker checker(model);

  std::vector<Sequence> seqs(3);
  const int32_t prompt_lens[] = {1, 7, 20};
  std::vector<std::pair<Sequence*, int32_t>> work;
  for (size_t i = 0; i < seqs.size(); ++i) {
    seqs[i].tokens = RandomTokens(rng, prompt_lens[i], vocab);
    work.emplace_back(&seqs[i], prompt_lens[i]);
  }
  checker.Record(Step(model, pool, work), work);

  for (int32_t step = 0; step < 12; ++step) {
    std::vector<std::pair<Sequence*, int32_t>> decode;
    for (size_t i = 0; i < seqs.size(); ++i) {
      if (step < 12 - 3 * static_cast<int32_t>(i)) decode.emplace_back(&seqs[i], 1);
    }
    // The next token of each: greedy from the last logits the sequence got.
    for (auto& [seq, n] : decode) {
      absl::StatusOr<std::vector<float>> ref = model.ForwardContiguous(seq->tokens);
      ASSERT_THAT(ref, IsOk());
      seq->tokens.push_back(
          Greedy(std::span<const float>(*ref).subspan((seq->tokens.size() - 1) * vocab, vocab)));
    }
    checker.Record(Step(model, pool, decode), decode);
  }
  ExpectWithinTolerance(checker.WorstError(), "prefill + decode");
}

// One prompt prefilled in chunks of 5, 6, 1 and 9 tokens: each chunk is a prefill over the
// sequence's own cached prefix.
TEST_P(PagedForwardTest, ChunkedPrefillMatchesContiguous) {
  const LlamaModel& model = this->model();
  const uint64_t seed = Seed();
  std::mt19937_64 rng(seed);
  TestPool pool(model.config(), dtype(), block_size(), 100, seed);
  Checker checker(model);
  Sequence seq;
  seq.tokens = RandomTokens(rng, 21, model.config().vocab_size);
  for (const int32_t chunk : {5, 6, 1, 9}) {
    const std::vector<std::pair<Sequence*, int32_t>> work = {{&seq, chunk}};
    checker.Record(Step(model, pool, work), work);
  }
  ExpectWithinTolerance(checker.WorstError(), "chunked prefill");
}

// Sequence A is prefilled; B starts with the same k full blocks of tokens and, as the
// ledger does on a prefix hit, reuses A's blocks for them and prefills only its own suffix.
// Then A and B decode together, reading the shared blocks.
TEST_P(PagedForwardTest, PrefillOverSharedCachedPrefixMatchesContiguous) {
  const LlamaModel& model = this->model();
  const int32_t vocab = model.config().vocab_size;
  const uint64_t seed = Seed();
  std::mt19937_64 rng(seed);
  TestPool pool(model.config(), dtype(), block_size(), 200, seed);
  Checker checker(model);

  Sequence a;
  a.tokens = RandomTokens(rng, 20, vocab);
  checker.Record(Step(model, pool, {{&a, 20}}), {{&a, 20}});

  const int32_t full_blocks = 20 / block_size();
  const int32_t shared_blocks = std::max(1, full_blocks - 1);
  ASSERT_GE(full_blocks, 1);
  const int32_t shared_tokens = shared_blocks * block_size();
  Sequence b;
  b.tokens.assign(a.tokens.begin(), a.tokens.begin() + shared_tokens);
  const std::vector<int32_t> suffix = RandomTokens(rng, 9, vocab);
  b.tokens.insert(b.tokens.end(), suffix.begin(), suffix.end());
  b.blocks.assign(a.blocks.begin(), a.blocks.begin() + shared_blocks);
  b.cached = shared_tokens;
  std::printf("B shares %d blocks (%d tokens) of A and prefills %zu more\n", shared_blocks,
              shared_tokens, suffix.size());
  const std::vector<std::pair<Sequence*, int32_t>> prefill = {{&b, 9}};
  checker.Record(Step(model, pool, prefill), prefill);

  for (int32_t step = 0; step < 5; ++step) {
    a.tokens.push_back(static_cast<int32_t>(rng() % vocab));
    b.tokens.push_back(static_cast<int32_t>(rng() % vocab));
    const std::vector<std::pair<Sequence*, int32_t>> decode = {{&a, 1}, {&b, 1}};
    checker.Record(Step(model, pool, decode), decode);
  }
  ExpectWithinTolerance(checker.WorstError(), "shared prefix");
}

// Decode of one sequence, prefill of another and a chunk of a third in the same batch.
TEST_P(PagedForwardTest, MixedPrefillAndDecodeBatchMatchesContiguous) {
  const LlamaModel& model = this->model();
  const int32_t vocab = model.config().vocab_size;
  const uint64_t seed = Seed();
  std::mt19937_64 rng(seed);
  TestPool pool(model.config(), dtype(), block_size(), 200, seed);
  Checker checker(model);
  Sequence a, b, c;
  a.tokens = RandomTokens(rng, 12, vocab);
  c.tokens = RandomTokens(rng, 30, vocab);
  const std::vector<std::pair<Sequence*, int32_t>> first = {{&a, 12}, {&c, 10}};
  checker.Record(Step(model, pool, first), first);
  a.tokens.push_back(static_cast<int32_t>(rng() % vocab));
  b.tokens = RandomTokens(rng, 17, vocab);
  const std::vector<std::pair<Sequence*, int32_t>> mixed = {{&b, 17}, {&a, 1}, {&c, 20}};
  checker.Record(Step(model, pool, mixed), mixed);
  ExpectWithinTolerance(checker.WorstError(), "mixed batch");
}

// Test names: "Qwen3_BlockSize3_fp16"; the Llama's without a prefix.
std::string ParamName(const ::testing::TestParamInfo<Param>& param_info) {
  const std::map<std::string, std::string> prefixes = {{"llama", ""},
                                                       {"qwen3", "Qwen3_"},
                                                       {"mistral-window", "MistralWindow_"},
                                                       {"qwen2-window", "Qwen2Window_"}};
  return absl::StrCat(prefixes.at(std::get<2>(param_info.param)), "BlockSize",
                      std::get<0>(param_info.param), "_",
                      std::string(DTypeName(std::get<1>(param_info.param))));
}

INSTANTIATE_TEST_SUITE_P(
    BlockSizesAndCacheDTypes, PagedForwardTest,
    ::testing::Combine(::testing::Values(1, 3, 16),
                       ::testing::Values(DType::kFloat32, DType::kFloat16, DType::kBFloat16),
                       ::testing::Values("llama", "qwen3", "mistral-window", "qwen2-window")),
    ParamName);

// The last-token logits are the matching rows of the all-token logits, and a repeated
// forward gives the same bits.
TEST(PagedForwardMiscTest, LastTokenLogitsAreRowsOfAllTokenLogits) {
  const LlamaModel& model = ModelHolder::Get();
  const int32_t vocab = model.config().vocab_size;
  std::mt19937_64 rng(77);
  ForwardBatch batch;
  batch.token_ids = RandomTokens(rng, 11, vocab);
  batch.query_lens = {4, 7};
  batch.context_lens = {4, 7};
  batch.max_blocks_per_seq = 2;
  batch.block_tables = {5, 0, 2, 9};

  auto run = [&](LogitsScope scope) {
    TestPool pool(model.config(), DType::kFloat32, 4, 12, 1);
    std::vector<float> logits;
    EXPECT_THAT(model.Forward(batch, pool.pool(), &logits, scope), IsOk());
    return logits;
  };
  const std::vector<float> all = run(LogitsScope::kAllTokens);
  const std::vector<float> last = run(LogitsScope::kLastTokenPerSeq);
  ASSERT_EQ(all.size(), 11u * vocab);
  ASSERT_EQ(last.size(), 2u * vocab);
  EXPECT_TRUE(std::equal(last.begin(), last.begin() + vocab, all.begin() + 3 * vocab));
  EXPECT_TRUE(std::equal(last.begin() + vocab, last.end(), all.begin() + 10 * vocab));
  EXPECT_EQ(run(LogitsScope::kLastTokenPerSeq), last);
}

// The same paged steps on models with 1 and 4 threads give bitwise equal logits (a Llama and
// a Qwen3).
TEST(PagedForwardMiscTest, ResultsDoNotDependOnThreadCount) {
  for (const char* architecture : {"llama", "qwen3"}) {
    SCOPED_TRACE(architecture);
    absl::StatusOr<testing::TempDir> dir = testing::TempDir::Create("kvcm-paged-threads");
    ASSERT_THAT(dir, IsOk());
    ASSERT_THAT(WriteTinyModel(dir->path(), TinyOptions(architecture)), IsOk());
    std::vector<std::vector<float>> results;
    for (const int32_t threads : {1, 4}) {
      LlamaModelOptions options;
      options.num_threads = threads;
      auto model = LlamaModel::Load(dir->path(), options);
      ASSERT_THAT(model, IsOk());
      std::mt19937_64 rng(5);
      TestPool pool((*model)->config(), DType::kBFloat16, 3, 64, 5);
      Sequence a, b;
      a.tokens = RandomTokens(rng, 25, 320);
      b.tokens = RandomTokens(rng, 9, 320);
      std::vector<float> all = Step(**model, pool, {{&a, 25}, {&b, 9}});
      for (int32_t step = 0; step < 4; ++step) {
        a.tokens.push_back(3 + step);
        b.tokens.push_back(4 + step);
        const std::vector<float> next = Step(**model, pool, {{&a, 1}, {&b, 1}});
        all.insert(all.end(), next.begin(), next.end());
      }
      results.push_back(std::move(all));
    }
    EXPECT_EQ(results[0], results[1]);
  }
}

class PagedForwardErrorTest : public ::testing::Test {
 protected:
  PagedForwardErrorTest() : pool_(ModelHolder::Get().config(), DType::kFloat32, 4, 8, 1) {
    batch_.token_ids = {3, 4, 5, 6, 7};
    batch_.query_lens = {3, 2};
    batch_.context_lens = {3, 6};
    batch_.max_blocks_per_seq = 2;
    batch_.block_tables = {0, -1, 1, 2};
  }
  absl::Status Run(const ForwardBatch& batch) {
    const std::vector<uint8_t> before = pool_.memory();
    std::vector<float> logits;
    const absl::Status s = ModelHolder::Get().Forward(batch, pool_.pool(), &logits);
    if (!s.ok()) {
      EXPECT_EQ(pool_.memory(), before) << "a rejected batch wrote the pool";
    }
    return s;
  }
  ForwardBatch batch_;
  TestPool pool_;
};

TEST_F(PagedForwardErrorTest, ValidBatchRuns) { EXPECT_THAT(Run(batch_), IsOk()); }

TEST_F(PagedForwardErrorTest, MalformedBatchesAreInvalidNamingTheField) {
  struct Case {
    const char* name;
    std::function<void(ForwardBatch&)> edit;
    const char* expect;
  };
  const std::vector<Case> cases = {
      {"no sequences", [](ForwardBatch& b) { b.query_lens.clear(); }, "no sequences"},
      {"context_lens size", [](ForwardBatch& b) { b.context_lens.pop_back(); }, "context_lens"},
      {"zero query", [](ForwardBatch& b) { b.query_lens[0] = 0; }, "query_lens[0]"},
      {"context < query", [](ForwardBatch& b) { b.context_lens[1] = 1; }, "context_lens[1]"},
      {"token count", [](ForwardBatch& b) { b.token_ids.pop_back(); }, "token_ids"},
      {"token id", [](ForwardBatch& b) { b.token_ids[4] = 320; }, "token_ids[4] = 320"},
      {"negative token", [](ForwardBatch& b) { b.token_ids[0] = -1; }, "token_ids[0] = -1"},
      {"block id", [](ForwardBatch& b) { b.block_tables[3] = 8; }, "block_tables[1][1] = 8"},
      {"negative block", [](ForwardBatch& b) { b.block_tables[0] = -1; }, "block_tables[0][0]"},
      {"table size", [](ForwardBatch& b) { b.block_tables.pop_back(); }, "block_tables has"},
      {"max blocks", [](ForwardBatch& b) { b.max_blocks_per_seq = 0; }, "max_blocks_per_seq"},
      {"too few blocks",
       [](ForwardBatch& b) {
         b.context_lens[1] = 9;
         b.query_lens[1] = 2;
       },
       "needs 3 blocks"},
      {"slot written twice",
       [](ForwardBatch& b) {
         b.block_tables = {0, -1, 0, 2};
         b.context_lens[1] = 3;
         b.query_lens = {3, 2};
       },
       "written by both"},
      {"past max positions",
       [](ForwardBatch& b) {
         b.context_lens[1] = 4097;
         b.max_blocks_per_seq = 2000;
         b.block_tables.assign(4000, 0);
       },
       "max_position_embeddings"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    ForwardBatch batch = batch_;
    c.edit(batch);
    const absl::Status s = Run(batch);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(s.message(), HasSubstr(c.expect));
  }
}

TEST_F(PagedForwardErrorTest, PoolThatDoesNotFitTheModelIsFailedPrecondition) {
  const LlamaConfig& config = ModelHolder::Get().config();
  LlamaConfig other = config;
  other.num_key_value_heads = 4;
  TestPool wrong_heads(other, DType::kFloat32, 4, 8, 1);
  std::vector<float> logits;
  absl::Status s = ModelHolder::Get().Forward(batch_, wrong_heads.pool(), &logits);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("num_kv_heads is 4 in the pool but 2 in the model"));

  PoolView bad_layout = pool_.pool();
  bad_layout.layout.block_stride += 4;
  s = ModelHolder::Get().Forward(batch_, bad_layout, &logits);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);

  PoolView null_base = pool_.pool();
  null_base.base = nullptr;
  EXPECT_EQ(ModelHolder::Get().Forward(batch_, null_base, &logits).code(),
            absl::StatusCode::kInvalidArgument);

  TestPool fp8(config, DType::kFloat8E4M3, 4, 8, 1);
  s = ModelHolder::Get().Forward(batch_, fp8.pool(), &logits);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(s.message(), HasSubstr("fp8"));
}

// A pool in device memory would be dereferenced as a host pointer: refused before any
// access (the base here is host memory, so a read would not even crash).
TEST_F(PagedForwardErrorTest, DevicePoolIsRefusedByTheHostForward) {
  PoolView device = pool_.pool();
  device.cuda_device = 0;
  const std::vector<uint8_t> before = pool_.memory();
  std::vector<float> logits;
  const absl::Status s = ModelHolder::Get().Forward(batch_, device, &logits);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(s.message(), HasSubstr("CUDA device 0"));
  EXPECT_EQ(pool_.memory(), before);
}

// KV cache groups (docs/architecture.md, "The hybrid KV cache"): the Qwen2 whose last two of
// four layers slide over 5 tokens groups into full attention (layers 0, 1) and window 5
// (layers 2, 3), pages of 2 slots. Each sequence has a table per group, its blocks drawn
// from one shuffled free list; the window group's entries wholly behind the window of
// every new token go as -1.
class GroupedPagedTest : public ::testing::Test {
 protected:
  static constexpr int32_t kBlockSize = 3;

  struct GroupedSeq {
    std::vector<int32_t> tokens;
    int32_t cached = 0;
    std::vector<std::vector<int32_t>> tables;  // per group
  };

  GroupedPagedTest()
      : model_(ModelHolder::Get("qwen2-window")),
        groups_(GroupLayers(model_.config().layer_windows).value()),
        pool_(model_.config(), DType::kFloat32, kBlockSize, 120, 9) {
    view_ = pool_.pool();
    view_.spec = PageSpec(view_.spec, groups_);
    view_.layout = PoolLayout::For(view_.spec, 120).value();  // fewer bytes than pool_'s
    view_.kv_groups = groups_.groups;
  }

  // The batch of `work` (each sequence's next n tokens); tables grown as needed.
  ForwardBatch Batch(const std::vector<std::pair<GroupedSeq*, int32_t>>& work) {
    ForwardBatch batch;
    batch.max_blocks_per_seq = 1;
    for (const auto& [seq, n] : work) {
      seq->tables.resize(static_cast<size_t>(groups_.num_groups()));
      for (std::vector<int32_t>& table : seq->tables) {
        while (static_cast<int32_t>(table.size()) * kBlockSize < seq->cached + n) {
          table.push_back(pool_.TakeBlock());
        }
        batch.max_blocks_per_seq =
            std::max(batch.max_blocks_per_seq, static_cast<int32_t>(table.size()));
      }
    }
    for (int32_t g = 0; g < groups_.num_groups(); ++g) {
      std::vector<int32_t>& out = g == 0 ? batch.block_tables : batch.group_block_tables;
      for (const auto& [seq, n] : work) {
        const int64_t released =
            ReleasedBlocks(groups_.groups[static_cast<size_t>(g)].window, seq->cached, kBlockSize);
        const std::vector<int32_t>& table = seq->tables[static_cast<size_t>(g)];
        for (int32_t j = 0; j < batch.max_blocks_per_seq; ++j) {
          const bool kept = j >= released && j < static_cast<int32_t>(table.size());
          out.push_back(kept ? table[static_cast<size_t>(j)] : -1);
          released_ += j < released ? 1 : 0;
        }
      }
    }
    for (const auto& [seq, n] : work) {
      batch.query_lens.push_back(n);
      batch.context_lens.push_back(seq->cached + n);
      batch.token_ids.insert(batch.token_ids.end(), seq->tokens.begin() + seq->cached,
                             seq->tokens.begin() + seq->cached + n);
    }
    return batch;
  }

  std::vector<float> Run(const std::vector<std::pair<GroupedSeq*, int32_t>>& work) {
    const ForwardBatch batch = Batch(work);
    std::vector<float> logits;
    EXPECT_THAT(model_.Forward(batch, view_, &logits, LogitsScope::kAllTokens), IsOk());
    for (const auto& [seq, n] : work) seq->cached += n;
    return logits;
  }

  // The worst relative error of the rows of `logits` (all-token, for `work` just run)
  // against the contiguous forward.
  double Error(const std::vector<float>& logits,
               const std::vector<std::pair<GroupedSeq*, int32_t>>& work) {
    const int32_t vocab = model_.config().vocab_size;
    double worst = 0;
    size_t row = 0;
    for (const auto& [seq, n] : work) {
      const std::vector<int32_t> prefix(seq->tokens.begin(), seq->tokens.begin() + seq->cached);
      absl::StatusOr<std::vector<float>> ref = model_.ForwardContiguous(prefix);
      EXPECT_THAT(ref, IsOk());
      if (!ref.ok()) return INFINITY;
      for (int32_t q = 0; q < n; ++q, ++row) {
        const int64_t position = seq->cached - n + q;
        worst = std::max(
            worst, RowError(logits.data() + row * vocab, ref->data() + position * vocab, vocab));
      }
    }
    return worst;
  }

  const LlamaModel& model_;
  KvCacheGroups groups_;
  TestPool pool_;  // the memory and the free list; view_ is its grouped view
  PoolView view_;
  int32_t released_ = 0;
};

// Two sequences prefilled together, then decoded together several windows long: the
// contiguous forward's logits. Each layer's keys are where its group's table and its slot
// say: layer 3's (window group, slot 1) in slot 1 of the window group's blocks.
TEST_F(GroupedPagedTest, GroupedPoolMatchesContiguousAndLayersLiveInTheirSlots) {
  ASSERT_EQ(groups_.ToString(),
            "2 groups of 2 slots: full attention (layers 0, 1), window 5 (layers 2, 3), 0 "
            "padding slots");
  std::mt19937_64 rng(31);
  const int32_t vocab = model_.config().vocab_size;
  GroupedSeq a, b;
  a.tokens = RandomTokens(rng, 26, vocab);
  b.tokens = RandomTokens(rng, 23, vocab);
  double worst = 0;
  std::vector<std::pair<GroupedSeq*, int32_t>> work = {{&a, 14}, {&b, 9}};
  worst = std::max(worst, Error(Run(work), work));
  for (int32_t step = 0; step < 12; ++step) {
    work = {{&a, 1}};
    if (step < 10) work.emplace_back(&b, step == 0 ? 4 : 1);
    worst = std::max(worst, Error(Run(work), work));
  }
  std::printf("grouped pool: worst relative error %.3g, %d entries released\n", worst, released_);
  EXPECT_LE(worst, Tolerance(DType::kFloat32));
  EXPECT_GT(released_, 0);

  // Layer 3's key of a's last token, recomputed by a fresh ungrouped pass over a's tokens,
  // against the grouped pool's slot 1 of the window group's block.
  TestPool plain(model_.config(), DType::kFloat32, kBlockSize, 120, 9);
  Sequence whole;
  whole.tokens = a.tokens;
  Step(model_, plain, {{&whole, static_cast<int32_t>(a.tokens.size())}});
  const int32_t p = a.cached - 1;
  const int32_t kv_bytes = view_.spec.num_kv_heads * view_.spec.head_dim * 4;
  for (int32_t layer = 0; layer < 4; ++layer) {
    SCOPED_TRACE(absl::StrCat("layer ", layer));
    const int32_t g = groups_.group_of[static_cast<size_t>(layer)];
    const int32_t slot = groups_.slot_of[static_cast<size_t>(layer)];
    const int32_t block = a.tables[static_cast<size_t>(g)][static_cast<size_t>(p / kBlockSize)];
    const auto* grouped = reinterpret_cast<const float*>(
        pool_.memory().data() + view_.layout.Offset(slot, 0, block, p % kBlockSize, 0));
    const PoolView& flat = plain.pool();
    const int32_t flat_block = whole.blocks[static_cast<size_t>(p / kBlockSize)];
    const auto* want = reinterpret_cast<const float*>(
        plain.memory().data() + flat.layout.Offset(layer, 0, flat_block, p % kBlockSize, 0));
    for (int32_t i = 0; i < kv_bytes / 4; ++i) EXPECT_NEAR(grouped[i], want[i], 1e-4) << i;
  }
}

// Negative control: the pool's two slots exchanged after the prefill (each layer then
// reads its slot-mate's keys and values) moves the next logits far beyond the tolerance.
TEST_F(GroupedPagedTest, ExchangedSlotsMoveTheLogits) {
  std::mt19937_64 rng(32);
  GroupedSeq a;
  a.tokens = RandomTokens(rng, 15, model_.config().vocab_size);
  std::vector<std::pair<GroupedSeq*, int32_t>> work = {{&a, 14}};
  EXPECT_LE(Error(Run(work), work), Tolerance(DType::kFloat32));
  std::vector<uint8_t>& memory = pool_.mutable_memory();
  const auto stride = static_cast<std::ptrdiff_t>(view_.layout.layer_stride);
  std::swap_ranges(memory.begin(), memory.begin() + stride, memory.begin() + stride);
  work = {{&a, 1}};
  const double moved = Error(Run(work), work);
  std::printf("grouped pool with slots 0 and 1 exchanged: relative error %.3g\n", moved);
  EXPECT_GT(moved, 100 * Tolerance(DType::kFloat32));
}

// The batch's tables per group, checked as block_tables: their count, -1 only behind the
// group's window (nowhere in the full group), no slot written through two groups' tables.
TEST_F(GroupedPagedTest, MalformedGroupTablesAreInvalidNamingTheTable) {
  std::mt19937_64 rng(33);
  GroupedSeq a;
  a.tokens = RandomTokens(rng, 13, model_.config().vocab_size);
  Run({{&a, 12}});
  const ForwardBatch good = Batch({{&a, 1}});  // 12 cached: window 5 releases blocks 0 and 1
  ASSERT_EQ(good.group_block_tables[0], -1);
  struct Case {
    const char* name;
    std::function<void(ForwardBatch&)> edit;
    const char* expect;
  };
  const std::vector<Case> cases = {
      {"no group tables", [](ForwardBatch& b) { b.group_block_tables.clear(); },
       "group_block_tables has 0 entries, expected (KV cache groups (2) - 1)"},
      {"released in the full group", [](ForwardBatch& b) { b.block_tables[0] = -1; },
       "block_tables[0][0] = -1"},
      {"released inside the window", [](ForwardBatch& b) { b.group_block_tables[3] = -1; },
       "group_block_tables (KV cache group 1)[0][3] = -1"},
      {"block outside the pool", [](ForwardBatch& b) { b.group_block_tables[4] = 120; },
       "group_block_tables (KV cache group 1)[0][4] = 120"},
      {"one block in both groups",
       [](ForwardBatch& b) { b.group_block_tables[4] = b.block_tables[4]; }, "written by both"},
  };
  const std::vector<uint8_t> before = pool_.memory();
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    ForwardBatch batch = good;
    c.edit(batch);
    std::vector<float> logits;
    const absl::Status s = model_.Forward(batch, view_, &logits);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(s.message(), HasSubstr(c.expect));
  }
  EXPECT_EQ(pool_.memory(), before) << "a rejected batch wrote the pool";
  std::vector<float> logits;
  EXPECT_THAT(model_.Forward(good, view_, &logits), IsOk());
}

// Without a device (or without CUDA in the build) the device model says why instead of
// failing later. Runs where no device is present; the gpu tests cover the other case.
TEST(LlamaCudaModelCreateTest, WithoutADeviceSaysWhy) {
  absl::StatusOr<std::unique_ptr<LlamaCudaModel>> made =
      LlamaCudaModel::Create(ModelHolder::Get(), 0);
  if (kernels::CudaKernelsCompiled()) {
    if (CudaDeviceCount().ok()) GTEST_SKIP() << "a CUDA device is present";
    EXPECT_EQ(made.status().code(), absl::StatusCode::kUnavailable) << made.status();
    EXPECT_THAT(made.status().message(), HasSubstr("no CUDA device"));
  } else {
    EXPECT_EQ(made.status().code(), absl::StatusCode::kUnimplemented) << made.status();
    EXPECT_THAT(made.status().message(), HasSubstr("built without CUDA"));
  }
}

// Qwen3's per-head q/k norm has no CUDA kernel: the device model refuses it up front, with
// or without a device and in builds without CUDA, rather than compute other logits.
TEST(LlamaCudaModelCreateTest, Qwen3QkNormIsRefused) {
  const LlamaModel& qwen3 = ModelHolder::Get("qwen3");
  ASSERT_TRUE(qwen3.config().qk_norm);
  absl::StatusOr<std::unique_ptr<LlamaCudaModel>> made = LlamaCudaModel::Create(qwen3, 0);
  EXPECT_EQ(made.status().code(), absl::StatusCode::kUnimplemented) << made.status();
  EXPECT_THAT(made.status().message(), HasSubstr("q/k norm"));
  EXPECT_THAT(made.status().message(), HasSubstr("not implemented on CUDA devices yet"));
  EXPECT_THAT(CheckCudaSupport(ModelHolder::Get().config()), IsOk());
}

}  // namespace
}  // namespace kvcm::executor
