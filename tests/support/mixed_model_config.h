#pragma once
// A model config of two attention types for tests of KV cache groups (docs/architecture.md,
// "The hybrid KV cache"): Qwen2-shaped, layer 0 full attention and layer 1 a sliding window
// (max_window_layers 1), each 2 KV heads of head dim 16 in fp16. Header only.

#include <cstdint>
#include <fstream>
#include <string>

namespace kvcm::testing {

// Writes the config with a window of `window` tokens to `dir`/config.json; returns its path.
inline std::string WriteMixedModelConfig(const std::string& dir, int32_t window) {
  const std::string path = dir + "/config.json";
  std::ofstream out(path);
  out << R"({"model_type": "qwen2", "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "hidden_size": 64, "torch_dtype": "float16",
            "use_sliding_window": true, "sliding_window": )"
      << window << R"(, "max_window_layers": 1})";
  return path;
}

}  // namespace kvcm::testing
