// Llama's differences from itself: none. The family is the forward every other family file
// changes (llama_model.cc); Llama 2 and 3, SmolLM and Mistral (the same forward with a
// window, architecture.cc) run it as it is.

#include "absl/status/status.h"
#include "common/base/status_macros.h"
#include "services/executor/model/architecture.h"

namespace kvcm::executor {

// Llama's attention_bias: a bias on q, k, v and o (GGUF files have no such key).
absl::Status SetLlamaFeatures(const ModelConfig& m, LlamaConfig* c) {
  KVCM_RETURN_IF_ERROR(RequireSilu(m));
  c->qkv_bias = m.attention_bias.value_or(false);
  c->o_bias = c->qkv_bias;
  return SetRope(m, c);
}

}  // namespace kvcm::executor
