#pragma once
// LlamaModel: a Llama-family decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU; and
// Gemma 3's variants, which LlamaConfig describes: GELU, norms around each sublayer, a RoPE
// per layer type) on the CPU, computing in fp32 over weights kept as their file stores them, whose
// attention reads and writes the shared paged KV pool through the kernels of kernels/
// (docs/architecture.md).
//
// Two forward paths share every step but attention:
//
//   Forward            a batch of sequences, each adding query_lens[i] new tokens after
//                      context_lens[i] - query_lens[i] tokens already in the pool: projects,
//                      applies RoPE, writes the new K/V into their pool slots
//                      (kernels::cpu::WriteKv) and attends over the pool
//                      (kernels::cpu::PagedAttention). Prefill, decode and prefill over a
//                      cached prefix are all this one call.
//   ForwardContiguous  the reference: one sequence from position 0 with a private,
//                      contiguous fp32 KV cache and plain attention; no pool, no kernels.
//
// Matrix products are kernels::MatMulInt8 (or kernels::MatMul with LlamaModelOptions::matmul
// = kFp32; kernels/matmul_cpu.h) on the kernels' process-wide thread pool, split over output
// features; each row of activations is quantized on its own and each output is one chain of
// operations in a fixed order, so results are bitwise the same for any number of threads and
// for any batching of the same tokens (attention aside, which is the kernel's). Products
// sharing an input (q, k, v; gate, up) are one call: one quantization, one parallel loop.
//
// Ownership: the model owns its weights (loaded once; a GGUF file's quantized tensors are
// repacked and stay quantized, fp32 otherwise). The pool memory belongs to the
// caller; Forward writes only the slots of the batch's new tokens.
// Thread safety: const methods may be called concurrently; the parallel loops of concurrent
// calls take turns on the shared thread pool. Two concurrent Forward calls must not
// write the same slots (the ledger guarantees this).

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/memory/pool_layout.h"
#include "common/memory/pool_view.h"
#include "common/sizing/kv_cache_spec.h"
#include "kernels/matmul_cpu.h"
#include "services/executor/model/llama_config.h"

namespace kvcm::executor {

// One step of a batch of sequences. Sequence i (i < query_lens.size()):
//   - adds query_lens[i] >= 1 new tokens, stored back to back with the other sequences'
//     in token_ids, in batch order;
//   - has context_lens[i] tokens after this step (cached ones plus the new ones), so its
//     new tokens sit at positions context_lens[i] - query_lens[i] .. context_lens[i] - 1;
//   - keeps its KV in blocks block_tables[i * max_blocks_per_seq + j] for
//     j < ceil(context_lens[i] / block_size); the token at position p lives in slot
//     block_tables[i * max_blocks_per_seq + p / block_size] * block_size + p % block_size.
// Entries of block_tables past a sequence's last block are ignored. Blocks holding a cached
// prefix may be shared by several sequences (only read); no slot may be written twice.
// On a pool with KV cache groups (PoolView::kv_groups), block_tables is group 0's and
// group_block_tables holds groups 1..'s, each [num_seqs][max_blocks_per_seq], one after
// another; a layer reads and writes its group's table (kv_groups.h). Empty without groups.
struct ForwardBatch {
  std::vector<int32_t> token_ids;
  std::vector<int32_t> query_lens;
  std::vector<int32_t> context_lens;
  std::vector<int32_t> block_tables;
  std::vector<int32_t> group_block_tables;
  int32_t max_blocks_per_seq = 0;
  // Per sequence (or empty: none): 1 returns logits for every new token of the sequence, not
  // only its last, whatever the LogitsScope (a prompt's scores).
  std::vector<uint8_t> all_logits;
};

// Which tokens Forward returns logits for.
enum class LogitsScope {
  kLastTokenPerSeq,  // [num_seqs][vocab]: the last new token of each sequence (sampling)
  kAllTokens,        // [token_ids.size()][vocab]: every new token (tests, scoring)
};

struct LlamaModelOptions {
  // Threads for the matrix products and attention, the caller included. 0 (default): the
  // hardware concurrency; more is clamped to it. Results do not depend on it.
  int32_t num_threads = 0;
  // How the quantized matrices multiply (kernels/matmul_cpu.h): kInt8 (default) quantizes
  // the activations to 8 bits per group and uses integer dot products, as llama.cpp does;
  // kFp32 dequantizes the weights and multiplies in fp32 (the reference, closer to
  // transformers' logits). fp32 matrices (F16, BF16, F32 tensors) take fp32 either way.
  // Results do not depend on the batch or the threads on either path.
  kernels::MatMulPath matmul = kernels::MatMulPath::kInt8;
};

// The model's parameters with Hugging Face's shapes (see LlamaModel::Load): H = hidden_size,
// I = intermediate_size, Q = num_attention_heads x head_dim, K = num_key_value_heads x
// head_dim, V = vocab_size. The matrices are kernels::WeightMatrix (kernels/matmul_cpu.h):
// a GGUF file's quantized tensors stay quantized (repacked, not dequantized), everything
// else is fp32; norms and biases are fp32 vectors.
struct LlamaWeights {
  struct Layer {
    std::vector<float> input_norm;    // [H]
    kernels::WeightMatrix q_proj;     // [Q, H]
    kernels::WeightMatrix k_proj;     // [K, H]
    kernels::WeightMatrix v_proj;     // [K, H]
    kernels::WeightMatrix o_proj;     // [H, Q]
    std::vector<float> post_norm;     // [H]: the MLP's input norm (Gemma: pre_feedforward)
    kernels::WeightMatrix gate_proj;  // [I, H]
    kernels::WeightMatrix up_proj;    // [I, H]
    kernels::WeightMatrix down_proj;  // [H, I]
    // Attention biases (empty when the model has none): q, k, v with qkv_bias (Qwen2, and
    // Llama's attention_bias), o with o_bias (Llama's attention_bias).
    std::vector<float> q_bias;  // [Q]
    std::vector<float> k_bias;  // [K]
    std::vector<float> v_bias;  // [K]
    std::vector<float> o_bias;  // [H]
    // Per-head RMSNorm weights of q and of k (qk_norm, Qwen3 and Gemma 3; empty otherwise).
    std::vector<float> q_norm;  // [head_dim]
    std::vector<float> k_norm;  // [head_dim]
    // sandwich_norms (Gemma 3): the norms of the attention output and of the MLP output, each
    // before its residual add (empty otherwise).
    std::vector<float> attn_output_norm;  // [H]
    std::vector<float> mlp_output_norm;   // [H]
  };
  kernels::WeightMatrix embed_tokens;  // [V, H]; rows dequantized at lookup
  std::vector<Layer> layers;
  std::vector<float> final_norm;  // [H]
  kernels::WeightMatrix lm_head;  // [V, H]; empty when tied: embed_tokens is the head

  const kernels::WeightMatrix& head() const { return lm_head.empty() ? embed_tokens : lm_head; }
  // The bytes the matrices take (what the model holds in memory, norms and biases aside).
  int64_t matrix_bytes() const;
};

// Where each new token of a ForwardBatch goes, as both forward paths (CPU and CUDA) need it:
// token t (in token_ids order) sits at positions[t] and is written to slots[t]; the rows
// whose logits Forward returns are logit_rows, in order. REQUIRES: CheckBatch passed.
struct TokenPlan {
  std::vector<int32_t> positions;
  std::vector<int64_t> slots;
  std::vector<int64_t> logit_rows;
};
TokenPlan PlanTokens(const ForwardBatch& batch, int32_t block_size, LogitsScope scope);

namespace internal {
class WeightSource;
}  // namespace internal

// Whether `path` is a GGUF file (a regular file starting with the magic "GGUF").
bool IsGgufFile(const std::string& path);

class LlamaModel {
 public:
  // Loads `folder`/config.json and the folder's safetensors shards (see safetensors.h).
  // Tensors, as Hugging Face names them (L = num_hidden_layers, H = hidden_size,
  // I = intermediate_size, Q = num_attention_heads x head_dim, K = num_key_value_heads x
  // head_dim, V = vocab_size):
  //   model.embed_tokens.weight                         [V, H]
  //   model.layers.{l}.input_layernorm.weight           [H]
  //   model.layers.{l}.self_attn.q_proj.weight          [Q, H]
  //   model.layers.{l}.self_attn.k_proj.weight          [K, H]
  //   model.layers.{l}.self_attn.v_proj.weight          [K, H]
  //   model.layers.{l}.self_attn.o_proj.weight          [H, Q]
  //   model.layers.{l}.post_attention_layernorm.weight  [H]
  //   model.layers.{l}.mlp.gate_proj.weight             [I, H]
  //   model.layers.{l}.mlp.up_proj.weight               [I, H]
  //   model.layers.{l}.mlp.down_proj.weight             [H, I]
  //   model.norm.weight                                 [H]
  //   lm_head.weight                                    [V, H]  (not read when tied)
  //   model.layers.{l}.self_attn.{q,k,v}_proj.bias      [Q], [K], [K]  (with qkv_bias)
  //   model.layers.{l}.self_attn.o_proj.bias            [H]  (with o_bias)
  //   model.layers.{l}.self_attn.{q,k}_norm.weight      [head_dim]  (with qk_norm: Qwen3)
  // With sandwich_norms (Gemma 3), post_attention_layernorm is the attention output's norm
  // and the MLP reads pre_feedforward_layernorm; post_feedforward_layernorm normalizes its
  // output:
  //   model.layers.{l}.pre_feedforward_layernorm.weight   [H]
  //   model.layers.{l}.post_feedforward_layernorm.weight  [H]
  // Every norm weight gets config().norm_weight_offset added at load (Gemma's 1 + w).
  // Other tensors are ignored. Errors: those of LoadLlamaConfig and SafetensorsFolder::Open;
  // NOT_FOUND naming a missing tensor; INVALID_ARGUMENT naming a tensor whose shape differs,
  // with the expected and actual shapes; UNIMPLEMENTED for a dtype other than F32/F16/BF16.
  //
  // `path` may also be a GGUF file (IsGgufFile): the config comes from its metadata
  // (LlamaConfigFromGguf) and the same tensors under llama.cpp's names (token_embd,
  // blk.{l}.attn_norm, attn_q, attn_k, attn_v, attn_output, ffn_norm, ffn_gate, ffn_up,
  // ffn_down, output_norm, output; attn_{q,k,v}.bias for qwen2; attn_q_norm, attn_k_norm
  // for qwen3), of any type Dequantize
  // implements: matrices of Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K stay quantized
  // (kernels::WeightMatrix::FromGgml), other types and the norms are dequantized to fp32 at
  // load; a llama file's q and k rows are put back from
  // GGUF's RoPE order (see llama_model.cc; qwen2 and qwen3 files keep Hugging Face's order).
  // Errors:
  // GgufFile::Open's and LlamaConfigFromGguf's, and the tensor errors above naming the file.
  static absl::StatusOr<std::unique_ptr<LlamaModel>> Load(
      const std::string& path, const LlamaModelOptions& options = LlamaModelOptions());

  LlamaModel(const LlamaModel&) = delete;
  LlamaModel& operator=(const LlamaModel&) = delete;
  ~LlamaModel();

  const LlamaConfig& config() const { return config_; }
  const LlamaWeights& weights() const { return weights_; }
  // Threads of the kernels' pool its parallel loops use, the caller included.
  int32_t num_threads() const { return num_threads_; }
  // RoPE inverse frequencies, [head_dim / 2], rope_scaling applied: the full-attention
  // layers' (every layer's unless config().local_rope).
  const std::vector<double>& inv_freq() const { return inv_freq_; }

  // OK when the model can run on `pool`: base not null, layout.Validate(spec) OK, and the
  // spec's layers, KV heads and head dim equal the model's (else FAILED_PRECONDITION naming
  // the field and both values); a pool whose blocks are released behind a sliding window
  // only when every layer attends within it (else FAILED_PRECONDITION naming the layer);
  // UNIMPLEMENTED for a cache dtype without a kernel (fp8). A pool with KV cache groups
  // must have the model's groups, its layers being their slots (CheckPoolGroups).
  absl::Status CheckPool(const PoolView& pool) const;

  // OK when `batch` is well formed for `pool` (see ForwardBatch); otherwise
  // INVALID_ARGUMENT naming the field and sequence: sizes that disagree, query_lens[i] < 1,
  // context_lens[i] < query_lens[i] or > max_position_embeddings, too few block-table
  // entries, a token id outside [0, vocab_size), a block id outside [0, num_blocks) (-1 is
  // allowed for a block wholly behind every layer's window: released, never read), or a
  // slot written twice. With KV cache groups: group_block_tables of (groups - 1) tables, each
  // checked as block_tables with its group's window deciding where -1 may be, and no slot
  // written twice by any group's layers.
  absl::Status CheckBatch(const ForwardBatch& batch, const PoolView& pool) const;

  // Runs one step: writes the new tokens' K/V into the pool and sets *logits to
  // [num_seqs][vocab] (kLastTokenPerSeq) or [num_new_tokens][vocab] (kAllTokens), row-major.
  // Errors: those of CheckPool and CheckBatch, before anything is written; FAILED_PRECONDITION
  // for a pool in CUDA memory (pool.cuda_device >= 0: LlamaCudaModel runs on those).
  // `after_layer`, when given, is called on the calling thread after each layer wrote its
  // K/V; when it returns false the pass stops there and returns CANCELLED, writing nothing
  // more (the executor abandons a step this way once its router was fenced).
  // REQUIRES: logits != nullptr.
  absl::Status Forward(const ForwardBatch& batch, const PoolView& pool, std::vector<float>* logits,
                       LogitsScope scope = LogitsScope::kLastTokenPerSeq,
                       const std::function<bool(int32_t layer)>* after_layer = nullptr) const;

  // The reference forward of one sequence from position 0: [tokens.size()][vocab] logits,
  // row-major. INVALID_ARGUMENT for an empty sequence, a token id outside [0, vocab_size) or
  // a sequence longer than max_position_embeddings.
  absl::StatusOr<std::vector<float>> ForwardContiguous(std::span<const int32_t> tokens) const;

 private:
  // The first position any layer reads for queries from `first_query` on: 0 unless every
  // layer has a window.
  int32_t ReadableFrom(int32_t first_query) const;
  LlamaModel(LlamaConfig config, int32_t num_threads, kernels::MatMulPath matmul);
  static absl::StatusOr<std::unique_ptr<LlamaModel>> LoadWeights(
      LlamaConfig config, const internal::WeightSource& source, const LlamaModelOptions& options);

  // Calls fn(begin, end) for disjoint chunks covering [0, n), each at least `min_chunk` long
  // (except a shorter n), on up to num_threads_ threads of the kernels' pool. The chunk
  // bounds depend only on n, min_chunk and num_threads_.
  void ParallelChunks(int64_t n, int64_t min_chunk,
                      absl::FunctionRef<void(int64_t, int64_t)> fn) const;

  // y[rows][out] = x[rows][in] . w[out][in]^T (kernels::MatMulInt8 or kernels::MatMul, as
  // matmul_ says, on num_threads_ threads). REQUIRES: w is [out, in].
  void MatMul(const float* x, int64_t rows, int64_t in, const kernels::WeightMatrix& w, int64_t out,
              float* y) const;
  // Several products of the same x[rows][in] (each output's w is [rows of y, in]): one call
  // of kernels::MatMulInt8 on the int8 path, MatMul each on the fp32 path.
  void MatMuls(const float* x, int64_t rows, int64_t in,
               std::initializer_list<kernels::MatMulOutput> outputs) const;
  // out[rows][H] = RMSNorm(x[rows][H]) * weight.
  void RmsNorm(const float* x, int64_t rows, const std::vector<float>& weight, float* out) const;
  // Qwen3's q_norm / k_norm: RMSNorm of each of the `heads` heads of each row, in place, with
  // the head_dim weights `weight`; nothing for an empty weight.
  void HeadNorm(float* x, int64_t rows, int32_t heads, const std::vector<float>& weight) const;
  // Rotates `heads` heads of each row in place by its position (HF rotate_half convention)
  // with the inverse frequencies `inv_freq`.
  void ApplyRope(float* x, int64_t rows, int32_t heads, std::span<const int32_t> positions,
                 const std::vector<double>& inv_freq) const;
  // The inverse frequencies layer `l` rotates by (local_inv_freq_ for a sliding layer with
  // local_rope, else inv_freq_).
  const std::vector<double>& LayerInvFreq(int32_t l) const;
  // out[rows][H] = down(act(gate(x)) * up(x)) of layer `l`, act SiLU or GELU (tanh).
  void Mlp(int32_t l, const float* x, int64_t rows, float* out) const;
  // x[rows][H] = embeddings of `tokens`.
  void Embed(std::span<const int32_t> tokens, float* x) const;
  // Layer `l` up to attention: q [rows][Q], k and v [rows][K], biases, q/k norms and RoPE
  // applied.
  void AttentionInputs(int32_t l, const float* x, int64_t rows, std::span<const int32_t> positions,
                       float* q, float* k, float* v) const;
  // Layer `l` after attention: x += o_proj(attn); x += MLP(post_norm(x)) (with
  // sandwich_norms, each addend normalized first by attn_output_norm, mlp_output_norm).
  void AttentionOutputAndMlp(int32_t l, const float* attn, int64_t rows, float* x) const;
  // Final norm of the chosen rows of x, then the LM head: [rows.size()][vocab].
  void Logits(const float* x, std::span<const int64_t> rows, std::vector<float>* logits) const;

  LlamaConfig config_;
  std::vector<double> inv_freq_;        // [head_dim / 2], rope_scaling applied
  std::vector<double> local_inv_freq_;  // local_rope: the sliding layers'; empty otherwise
  LlamaWeights weights_;
  int32_t num_threads_ = 1;  // threads of the kernels' pool a parallel loop uses
  kernels::MatMulPath matmul_ = kernels::MatMulPath::kInt8;
};

}  // namespace kvcm::executor
