#pragma once
// The model families the executor runs, one entry each (docs/executor.md, "Supported
// architectures"): how a config names the family and what the family changes of the Llama
// forward, through LlamaConfig's feature fields (qkv_bias, qk_norm, sandwich_norms, ...).
// Each family's differences live in a file of their own in this folder (llama.cc, qwen.cc,
// gemma3.cc), as llama.cpp keeps one file per architecture in src/models/: a new family is
// one entry in Architectures() and one such file, and the forward (llama_model.cc) reads
// only the feature fields.
//
//   const Architecture* family = FindArchitecture("Qwen3ForCausalLM");
//   KVCM_RETURN_IF_ERROR(family->set_features(model_config, &llama_config));
//
// Thread safety: constant data.

#include <cstdint>
#include <span>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "common/model/model_config.h"
#include "services/executor/model/llama_config.h"

namespace kvcm::executor {

struct Architecture {
  absl::string_view hf_name;     // config.json's "architectures" entry, e.g. "Qwen3ForCausalLM"
  absl::string_view model_type;  // config.json's "model_type" when "architectures" is absent
  absl::string_view gguf_name;   // a GGUF file's general.architecture; empty: none is read
  int32_t default_context;       // max_position_embeddings when the config has none
  // Whether the family attends within a sliding window where its config gives one (Mistral,
  // Qwen2, Qwen3, Gemma 3: as transformers runs them); Llama's transformers ignores the key.
  bool windowed;
  // Whether a GGUF file of the family may give windows (llama.cpp applies gemma3's only).
  bool gguf_windows;
  // Whether a GGUF file of the family holds q and k rows in ggml's interleaved RoPE order
  // (llama: convert_hf_to_gguf permutes them; the loader undoes it).
  bool gguf_interleaved_rope;
  // The family's differences from Llama, set on `c` (whose shape and context are read), and
  // the features it has that the forward does not, refused naming the key (UNIMPLEMENTED).
  absl::Status (*set_features)(const ModelConfig& m, LlamaConfig* c);
};

// Every supported family, in the order the refusals list them.
std::span<const Architecture> Architectures();
// The family of a config.json "architectures" entry, a "model_type" or a GGUF
// general.architecture; nullptr for none.
const Architecture* FindArchitecture(absl::string_view hf_name);
const Architecture* FindModelType(absl::string_view model_type);
const Architecture* FindGgufArchitecture(absl::string_view gguf_name);

// What the family files share (llama_config.cc): an error of `m` naming where it was read.
absl::Status Invalid(const ModelConfig& m, absl::string_view what);
absl::Status Unimplemented(const ModelConfig& m, absl::string_view what);
// The one RoPE of a family with the same set for every layer (rope_theta and its scaling);
// a per-layer-type set is refused.
absl::Status SetRope(const ModelConfig& m, LlamaConfig* c);
// The RoPE scaling of the set `rope` of `m`: the types and keys the forward implements.
absl::StatusOr<RopeScaling> Scaling(const ModelConfig& m, const RopeConfig& rope);
// A SiLU-gated MLP (hidden_act "silu" or absent), as every family but Gemma has.
absl::Status RequireSilu(const ModelConfig& m);

// The families (one file each).
absl::Status SetLlamaFeatures(const ModelConfig& m, LlamaConfig* c);   // llama.cc
absl::Status SetQwen2Features(const ModelConfig& m, LlamaConfig* c);   // qwen.cc
absl::Status SetQwen3Features(const ModelConfig& m, LlamaConfig* c);   // qwen.cc
absl::Status SetGemma3Features(const ModelConfig& m, LlamaConfig* c);  // gemma3.cc
// The multimodal Gemma 3, named by `what`: refused by name (gemma3.cc).
absl::Status RefuseMultimodalGemma3(const ModelConfig& m, absl::string_view what);

}  // namespace kvcm::executor
