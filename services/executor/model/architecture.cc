#include "services/executor/model/architecture.h"

namespace kvcm::executor {
namespace {

constexpr Architecture kArchitectures[] = {
    {.hf_name = "LlamaForCausalLM",
     .model_type = "llama",
     .gguf_name = "llama",
     .default_context = 2048,  // transformers' LlamaConfig
     .windowed = false,
     .gguf_windows = false,
     .gguf_interleaved_rope = true,
     .set_features = SetLlamaFeatures},
    // Mistral is Llama's forward with a window; llama.cpp writes its files as llama.
    {.hf_name = "MistralForCausalLM",
     .model_type = "mistral",
     .gguf_name = "",
     .default_context = 2048,
     .windowed = true,
     .gguf_windows = false,
     .gguf_interleaved_rope = true,
     .set_features = SetLlamaFeatures},
    {.hf_name = "Qwen2ForCausalLM",
     .model_type = "qwen2",
     .gguf_name = "qwen2",
     .default_context = 2048,
     .windowed = true,
     .gguf_windows = false,
     .gguf_interleaved_rope = false,
     .set_features = SetQwen2Features},
    {.hf_name = "Qwen3ForCausalLM",
     .model_type = "qwen3",
     .gguf_name = "qwen3",
     .default_context = 2048,
     .windowed = true,
     .gguf_windows = false,
     .gguf_interleaved_rope = false,
     .set_features = SetQwen3Features},
    {.hf_name = "Gemma3ForCausalLM",
     .model_type = "gemma3_text",
     .gguf_name = "gemma3",
     .default_context = 131072,  // Gemma3TextConfig's
     .windowed = true,
     .gguf_windows = true,
     .gguf_interleaved_rope = false,
     .set_features = SetGemma3Features},
};

template <typename Key>
const Architecture* Find(absl::string_view value, Key key) {
  if (value.empty()) return nullptr;
  for (const Architecture& a : kArchitectures) {
    if (a.*key == value) return &a;
  }
  return nullptr;
}

}  // namespace

std::span<const Architecture> Architectures() { return kArchitectures; }

const Architecture* FindArchitecture(absl::string_view hf_name) {
  return Find(hf_name, &Architecture::hf_name);
}
const Architecture* FindModelType(absl::string_view model_type) {
  return Find(model_type, &Architecture::model_type);
}
const Architecture* FindGgufArchitecture(absl::string_view gguf_name) {
  return Find(gguf_name, &Architecture::gguf_name);
}

}  // namespace kvcm::executor
