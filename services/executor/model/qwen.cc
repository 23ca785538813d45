// Qwen2's and Qwen3's (dense) differences from Llama: Qwen2's biases on q, k and v; Qwen3's
// per-head RMSNorm of q and k before RoPE (q_norm, k_norm of head_dim, epsilon rms_norm_eps),
// its head_dim apart from hidden_size / heads (read as every family's). Both attend within a
// window from max_window_layers on when use_sliding_window (architecture.cc).

#include "absl/status/status.h"
#include "common/base/status_macros.h"
#include "services/executor/model/architecture.h"

namespace kvcm::executor {

absl::Status SetQwen2Features(const ModelConfig& m, LlamaConfig* c) {
  KVCM_RETURN_IF_ERROR(RequireSilu(m));
  // Qwen2's q, k and v projections always have a bias, its o projection none.
  c->qkv_bias = true;
  return SetRope(m, c);
}

absl::Status SetQwen3Features(const ModelConfig& m, LlamaConfig* c) {
  KVCM_RETURN_IF_ERROR(RequireSilu(m));
  // Qwen3's attention_bias is Llama's: q, k, v and o.
  c->qkv_bias = m.attention_bias.value_or(false);
  c->o_bias = c->qkv_bias;
  c->qk_norm = true;
  return SetRope(m, c);
}

}  // namespace kvcm::executor
