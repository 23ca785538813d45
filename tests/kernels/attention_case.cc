#include "tests/kernels/attention_case.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>

#include "common/base/check.h"
#include "kernels/write_kv.h"

namespace kvcm::kernels::testing_util {

std::vector<AttentionCase> StandardAttentionCases() {
  std::vector<AttentionCase> cases;
  uint64_t seed = 20240601;
  auto add = [&](AttentionCase c) {
    c.seed = seed++;
    cases.push_back(std::move(c));
  };
  // Decode (query_len 1), contexts that are not multiples of the block sizes.
  const std::vector<SeqShape> decode = {{1, 1}, {7, 1}, {33, 1}, {100, 1}, {257, 1}, {1000, 1}};
  for (int32_t bs : {1, 3, 16, 32}) {
    add({.name = "decode_bs" + std::to_string(bs), .block_size = bs, .seqs = decode});
  }
  for (int32_t g : {1, 2, 4, 8}) {
    add({.name = "decode_gqa" + std::to_string(g),
         .group_size = g,
         .head_dim = 128,
         .seqs = decode});
  }
  add({.name = "decode_mqa", .num_kv_heads = 1, .group_size = 8, .seqs = decode});
  add({.name = "decode_dim20_group3_bs5",
       .block_size = 5,
       .num_kv_heads = 3,
       .group_size = 3,
       .head_dim = 20,
       .seqs = decode});
  add({.name = "decode_dim8", .block_size = 4, .group_size = 2, .head_dim = 8, .seqs = decode});
  add({.name = "decode_ascending", .seqs = decode, .shuffled = false});
  // Head dims that change the CUDA kernel's lane mapping (80: partly filled lanes; 256 and
  // 512: 32 lanes per token, 16 elements per lane for 512).
  add({.name = "decode_dim80", .head_dim = 80, .seqs = decode});
  add({.name = "decode_dim256_gqa2",
       .block_size = 8,
       .group_size = 2,
       .head_dim = 256,
       .seqs = decode});
  add({.name = "prefill_dim512",
       .num_kv_heads = 1,
       .group_size = 2,
       .head_dim = 512,
       .seqs = {{40, 40}, {300, 1}}});
  // Long contexts: split across threads (CPU) and partitions (CUDA).
  add({.name = "decode_long",
       .group_size = 4,
       .head_dim = 128,
       .seqs = {{4000, 1}, {2500, 1}, {1, 1}}});
  add({.name = "decode_long_bs1_range3",
       .block_size = 1,
       .seqs = {{3000, 1}},
       .value_range = 3.0f});
  // Prefill over a cached prefix (and with none), causal; mixed with decode.
  const std::vector<SeqShape> prefill = {{40, 40}, {100, 13}, {301, 37}, {1, 1}, {77, 1}};
  for (int32_t bs : {1, 16}) {
    add({.name = "prefill_bs" + std::to_string(bs), .block_size = bs, .seqs = prefill});
  }
  for (int32_t g : {1, 2, 8}) {
    add({.name = "prefill_gqa" + std::to_string(g),
         .block_size = 32,
         .group_size = g,
         .head_dim = 128,
         .seqs = prefill});
  }
  add({.name = "prefill_mqa_bs3",
       .block_size = 3,
       .num_kv_heads = 1,
       .group_size = 4,
       .seqs = prefill});
  add({.name = "prefill_dim20_group3",
       .block_size = 5,
       .num_kv_heads = 3,
       .group_size = 3,
       .head_dim = 20,
       .seqs = prefill});
  add({.name = "prefill_long_range2", .seqs = {{1200, 300}}, .value_range = 2.0f});
  // Sliding windows: shorter and longer than a block, not a multiple of it, decode and
  // prefill longer than the window, long contexts split across threads or partitions.
  for (const bool released : {false, true}) {
    const std::string suffix = released ? "_released" : "";
    add({.name = "window16_decode_bs16" + suffix,
         .seqs = decode,
         .sliding_window = 16,
         .release_behind_window = released});
    add({.name = "window5_decode_bs3_gqa2" + suffix,
         .block_size = 3,
         .group_size = 2,
         .seqs = decode,
         .sliding_window = 5,
         .release_behind_window = released});
    add({.name = "window24_prefill_bs16" + suffix,
         .seqs = prefill,
         .sliding_window = 24,
         .release_behind_window = released});
    add({.name = "window1_prefill_bs1" + suffix,
         .block_size = 1,
         .seqs = prefill,
         .sliding_window = 1,
         .release_behind_window = released});
    add({.name = "window1000_decode_long" + suffix,
         .group_size = 4,
         .head_dim = 128,
         .seqs = {{4000, 1}, {2500, 1}, {999, 1}, {1, 1}},
         .sliding_window = 1000,
         .release_behind_window = released});
    add({.name = "window300_prefill_long" + suffix,
         .seqs = {{1200, 300}, {700, 1}},
         .sliding_window = 300,
         .release_behind_window = released});
  }
  return cases;
}

double DecodeHalfIndependent(uint16_t h) {
  const int sign = (h >> 15) & 1;
  const int exponent = (h >> 10) & 0x1f;
  const int mantissa = h & 0x3ff;
  double value;
  if (exponent == 0) {
    value = std::ldexp(mantissa, -24);
  } else if (exponent == 31) {
    value = mantissa == 0 ? std::numeric_limits<double>::infinity()
                          : std::numeric_limits<double>::quiet_NaN();
  } else {
    value = std::ldexp(1024 + mantissa, exponent - 25);
  }
  return sign ? -value : value;
}

double DecodeBFloat16Independent(uint16_t b) {
  const int sign = (b >> 15) & 1;
  const int exponent = (b >> 7) & 0xff;
  const int mantissa = b & 0x7f;
  double value;
  if (exponent == 0) {
    value = std::ldexp(mantissa, -133);
  } else if (exponent == 255) {
    value = mantissa == 0 ? std::numeric_limits<double>::infinity()
                          : std::numeric_limits<double>::quiet_NaN();
  } else {
    value = std::ldexp(128 + mantissa, exponent - 134);
  }
  return sign ? -value : value;
}

std::unique_ptr<AttentionInputs> MakeAttentionInputs(const AttentionCase& c, DType dtype) {
  auto in = std::make_unique<AttentionInputs>();
  std::mt19937_64 rng(c.seed);
  std::uniform_real_distribution<float> uniform(-c.value_range, c.value_range);

  const int32_t num_seqs = static_cast<int32_t>(c.seqs.size());
  int32_t blocks_used = 0;
  for (const SeqShape& s : c.seqs) {
    const int32_t blocks = (s.context_len + c.block_size - 1) / c.block_size;
    blocks_used += blocks;
    in->max_blocks_per_seq = std::max(in->max_blocks_per_seq, blocks);
    in->max_query_len = std::max(in->max_query_len, s.query_len);
    in->total_query_tokens += s.query_len;
  }
  in->max_blocks_per_seq += 1;                 // a spare, unused column
  const int32_t num_blocks = blocks_used + 5;  // and unused blocks

  in->spec.num_layers = 2;
  in->spec.num_kv_heads = c.num_kv_heads;
  in->spec.head_dim = c.head_dim;
  in->spec.dtype = dtype;
  in->spec.block_size = c.block_size;
  absl::StatusOr<PoolLayout> layout = PoolLayout::For(in->spec, num_blocks);
  KVCM_CHECK(layout.ok()) << layout.status().ToString();
  in->layout = *layout;
  in->pool.assign(static_cast<size_t>(in->layout.total_bytes), 0xFF);
  absl::StatusOr<PagedKvView> view = LayerView(in->pool.data(), in->layout, in->spec, 1);
  KVCM_CHECK(view.ok()) << view.status().ToString();
  in->view = *view;

  std::vector<int32_t> ids(static_cast<size_t>(num_blocks));
  std::iota(ids.begin(), ids.end(), 0);
  if (c.shuffled) std::shuffle(ids.begin(), ids.end(), rng);
  in->block_tables.assign(static_cast<size_t>(num_seqs) * in->max_blocks_per_seq, -1);
  size_t next_id = 0;
  const int64_t token_elems = int64_t{c.num_kv_heads} * c.head_dim;
  for (int32_t s = 0; s < num_seqs; ++s) {
    const SeqShape& shape = c.seqs[static_cast<size_t>(s)];
    in->query_lens.push_back(shape.query_len);
    in->context_lens.push_back(shape.context_len);
    int32_t* table = in->block_tables.data() + int64_t{s} * in->max_blocks_per_seq;
    const int32_t blocks = (shape.context_len + c.block_size - 1) / c.block_size;
    for (int32_t j = 0; j < blocks; ++j) table[j] = ids[next_id++];
    std::vector<float> key(static_cast<size_t>(shape.context_len * token_elems));
    std::vector<float> value(key.size());
    for (float& x : key) x = uniform(rng);
    for (float& x : value) x = uniform(rng);
    std::vector<int64_t> slots;
    for (int32_t pos = 0; pos < shape.context_len; ++pos) {
      slots.push_back(int64_t{table[pos / c.block_size]} * c.block_size + pos % c.block_size);
    }
    cpu::WriteKv(in->view, key.data(), value.data(), slots.data(), shape.context_len);
    if (c.sliding_window > 0 && c.release_behind_window) {
      const int32_t first_visible =
          std::max(0, shape.context_len - shape.query_len - c.sliding_window + 1);
      for (int32_t j = 0; j < first_visible / c.block_size; ++j) table[j] = -1;
    }
  }

  const int32_t num_q_heads = c.num_kv_heads * c.group_size;
  in->query.resize(static_cast<size_t>(in->total_query_tokens * num_q_heads * c.head_dim));
  for (float& x : in->query) x = uniform(rng);

  in->batch.num_seqs = num_seqs;
  in->batch.num_q_heads = num_q_heads;
  in->batch.query_lens = in->query_lens.data();
  in->batch.context_lens = in->context_lens.data();
  in->batch.block_tables = in->block_tables.data();
  in->batch.max_blocks_per_seq = in->max_blocks_per_seq;
  in->batch.scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  in->batch.max_query_len = in->max_query_len;
  in->batch.sliding_window = c.sliding_window;
  return in;
}

double ReadPoolElement(const AttentionInputs& in, int32_t kv, int32_t block, int32_t token,
                       int32_t head, int32_t d) {
  const uint8_t* p = in.pool.data() + in.layout.Offset(1, kv, block, token, head) +
                     int64_t{d} * in.layout.elem_bytes;
  switch (in.spec.dtype) {
    case DType::kFloat32: {
      float f;
      std::memcpy(&f, p, sizeof(f));
      return f;
    }
    case DType::kFloat16: {
      uint16_t h;
      std::memcpy(&h, p, sizeof(h));
      return DecodeHalfIndependent(h);
    }
    case DType::kBFloat16: {
      uint16_t b;
      std::memcpy(&b, p, sizeof(b));
      return DecodeBFloat16Independent(b);
    }
    default:
      KVCM_CHECK(false);
      return 0.0;
  }
}

std::vector<double> ReferenceAttention(const AttentionInputs& in) {
  const int32_t num_kv_heads = in.spec.num_kv_heads;
  const int32_t head_dim = in.spec.head_dim;
  const int32_t bs = in.spec.block_size;
  const int32_t num_q_heads = in.batch.num_q_heads;
  const int32_t group = num_q_heads / num_kv_heads;
  std::vector<double> out(static_cast<size_t>(in.OutputSize()));
  int64_t token = 0;
  for (size_t s = 0; s < in.query_lens.size(); ++s) {
    const int32_t ctx = in.context_lens[s];
    const int32_t qlen = in.query_lens[s];
    const int32_t* table = in.block_tables.data() + static_cast<int64_t>(s) * in.max_blocks_per_seq;
    // Contiguous copies: k[pos][h][d], v[pos][h][d].
    const size_t row = static_cast<size_t>(num_kv_heads) * head_dim;
    std::vector<double> k(static_cast<size_t>(ctx) * row);
    std::vector<double> v(k.size());
    const int32_t window = in.batch.sliding_window;
    // The first position any query of the sequence sees (blocks before it may be released).
    const int32_t first_read = window > 0 ? std::max(0, ctx - qlen - window + 1) : 0;
    for (int32_t pos = first_read / bs * bs; pos < ctx; ++pos) {
      for (int32_t h = 0; h < num_kv_heads; ++h) {
        for (int32_t d = 0; d < head_dim; ++d) {
          const size_t i = static_cast<size_t>(pos) * row + static_cast<size_t>(h) * head_dim +
                           static_cast<size_t>(d);
          k[i] = ReadPoolElement(in, 0, table[pos / bs], pos % bs, h, d);
          v[i] = ReadPoolElement(in, 1, table[pos / bs], pos % bs, h, d);
        }
      }
    }
    std::vector<double> scores(static_cast<size_t>(ctx));
    for (int32_t q = 0; q < qlen; ++q, ++token) {
      const int32_t last = ctx - qlen + q;
      const int32_t first = window > 0 ? std::max(0, last - window + 1) : 0;
      for (int32_t hq = 0; hq < num_q_heads; ++hq) {
        const int32_t h = hq / group;
        const float* qv = in.query.data() + (token * num_q_heads + hq) * head_dim;
        double max = -std::numeric_limits<double>::infinity();
        for (int32_t pos = first; pos <= last; ++pos) {
          double dot = 0.0;
          const double* kr =
              k.data() + static_cast<size_t>(pos) * row + static_cast<size_t>(h) * head_dim;
          for (int32_t d = 0; d < head_dim; ++d) dot += double{qv[d]} * kr[d];
          scores[static_cast<size_t>(pos)] = dot * double{in.batch.scale};
          max = std::max(max, scores[static_cast<size_t>(pos)]);
        }
        double sum = 0.0;
        for (int32_t pos = first; pos <= last; ++pos) {
          scores[static_cast<size_t>(pos)] = std::exp(scores[static_cast<size_t>(pos)] - max);
          sum += scores[static_cast<size_t>(pos)];
        }
        double* o = out.data() + (token * num_q_heads + hq) * head_dim;
        for (int32_t pos = first; pos <= last; ++pos) {
          const double p = scores[static_cast<size_t>(pos)] / sum;
          const double* vr =
              v.data() + static_cast<size_t>(pos) * row + static_cast<size_t>(h) * head_dim;
          for (int32_t d = 0; d < head_dim; ++d) o[d] += p * vr[d];
        }
      }
    }
  }
  return out;
}

namespace {

template <typename T>
double RelativeErrorImpl(const std::vector<float>& got, const std::vector<T>& want) {
  KVCM_CHECK(got.size() == want.size()) << got.size() << " vs " << want.size();
  double max_diff = 0.0;
  double max_ref = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double diff = std::abs(double{got[i]} - double{want[i]});
    if (std::isnan(diff)) return std::numeric_limits<double>::infinity();
    max_diff = std::max(max_diff, diff);
    max_ref = std::max(max_ref, std::abs(double{want[i]}));
  }
  return max_ref > 0.0 ? max_diff / max_ref : max_diff;
}

}  // namespace

double RelativeError(const std::vector<float>& got, const std::vector<double>& want) {
  return RelativeErrorImpl(got, want);
}

double RelativeError(const std::vector<float>& got, const std::vector<float>& want) {
  return RelativeErrorImpl(got, want);
}

}  // namespace kvcm::kernels::testing_util
