// kvcm-make-tiny-model: writes a tiny random Llama model folder in the Hugging Face format
// (config.json + model.safetensors), loadable by the executor, for tests and the demo.
//
//   kvcm-make-tiny-model --output=DIR [--seed=N] [--dtype=fp32|bf16|fp16]
//                        [--architecture=llama|qwen2|qwen3] [--attention_bias]
//                        [--tie_word_embeddings] [--num_shards=N] [size flags]
//
// Flags are parsed here into TinyModelOptions (tools/make_tiny_model/tiny_model.h), which
// documents the weights. Exit status: 0 on success, 1 on a bad command line or a failed
// write, with the reason on stderr.

#include <cstdint>
#include <cstdio>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "common/sizing/kv_cache_spec.h"
#include "tools/make_tiny_model/tiny_model.h"

namespace {
const kvcm::TinyModelOptions kDefaults;
}  // namespace

ABSL_FLAG(std::string, output, "", "Model folder to create (required).");
ABSL_FLAG(uint64_t, seed, kDefaults.seed, "Seed of the random weights.");
ABSL_FLAG(std::string, dtype, "fp32", "Weight dtype in the file: fp32, bf16 or fp16.");
ABSL_FLAG(std::string, architecture, kDefaults.architecture,
          "llama, mistral, qwen2 (Qwen2ForCausalLM: a bias on q, k and v) or qwen3 "
          "(Qwen3ForCausalLM: a per-head RMSNorm of q and k).");
ABSL_FLAG(bool, attention_bias, kDefaults.attention_bias,
          "llama and qwen3: attention_bias, a bias on q, k, v and o.");
ABSL_FLAG(int32_t, sliding_window, kDefaults.sliding_window,
          "> 0: sliding-window attention of this many tokens (mistral: every layer; qwen2, "
          "qwen3: the layers from --max-window-layers on).");
ABSL_FLAG(int32_t, max_window_layers, kDefaults.max_window_layers,
          "qwen2, qwen3 with --sliding-window: the first layer that slides.");
ABSL_FLAG(bool, tie_word_embeddings, kDefaults.tie_word_embeddings,
          "Share the embedding matrix with the LM head (no lm_head.weight).");
ABSL_FLAG(int32_t, num_shards, kDefaults.num_shards,
          "Split the weights over this many safetensors files plus an index.");
ABSL_FLAG(int32_t, vocab_size, kDefaults.vocab_size, "Vocabulary size (>= 259 for bytes).");
ABSL_FLAG(int32_t, hidden_size, kDefaults.hidden_size, "Hidden size.");
ABSL_FLAG(int32_t, intermediate_size, kDefaults.intermediate_size, "MLP intermediate size.");
ABSL_FLAG(int32_t, num_layers, kDefaults.num_layers, "Transformer layers.");
ABSL_FLAG(int32_t, num_heads, kDefaults.num_heads, "Query heads.");
ABSL_FLAG(int32_t, num_kv_heads, kDefaults.num_kv_heads, "KV heads (GQA when < num_heads).");
ABSL_FLAG(int32_t, head_dim, kDefaults.head_dim, "Elements per head (even).");
ABSL_FLAG(double, rope_theta, kDefaults.rope_theta, "RoPE base.");
ABSL_FLAG(double, rms_norm_eps, kDefaults.rms_norm_eps, "RMSNorm epsilon.");
ABSL_FLAG(std::string, rope_scaling, "", "RoPE scaling: \"\" (none), linear or llama3.");
ABSL_FLAG(double, rope_factor, 8.0, "RoPE scaling factor (with --rope-scaling).");
ABSL_FLAG(double, rope_low_freq_factor, 1.0, "llama3 scaling: low_freq_factor.");
ABSL_FLAG(double, rope_high_freq_factor, 4.0, "llama3 scaling: high_freq_factor.");
ABSL_FLAG(int32_t, rope_original_max_position_embeddings, 1024,
          "llama3 scaling: original_max_position_embeddings.");
ABSL_FLAG(bool, rope_parameters, false,
          "Write transformers >= 5's \"rope_parameters\" instead of rope_theta/rope_scaling.");
ABSL_FLAG(int32_t, max_position_embeddings, kDefaults.max_position_embeddings,
          "Longest sequence the model accepts.");

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Writes a tiny random Llama model (config.json + model.safetensors).\n"
      "Usage: kvcm-make-tiny-model --output=DIR [--seed=N] [--dtype=fp32|bf16|fp16] ...");
  absl::ParseCommandLine(argc, argv);

  kvcm::TinyModelOptions options;
  const std::string output = absl::GetFlag(FLAGS_output);
  if (output.empty()) {
    std::fprintf(stderr, "kvcm-make-tiny-model: --output is required\n");
    return 1;
  }
  const absl::StatusOr<kvcm::DType> dtype = kvcm::ParseDType(absl::GetFlag(FLAGS_dtype));
  if (!dtype.ok()) {
    std::fprintf(stderr, "kvcm-make-tiny-model: --dtype: %s\n",
                 std::string(dtype.status().message()).c_str());
    return 1;
  }
  options.dtype = *dtype;
  options.seed = absl::GetFlag(FLAGS_seed);
  options.architecture = absl::GetFlag(FLAGS_architecture);
  options.attention_bias = absl::GetFlag(FLAGS_attention_bias);
  options.sliding_window = absl::GetFlag(FLAGS_sliding_window);
  options.max_window_layers = absl::GetFlag(FLAGS_max_window_layers);
  options.tie_word_embeddings = absl::GetFlag(FLAGS_tie_word_embeddings);
  options.num_shards = absl::GetFlag(FLAGS_num_shards);
  options.vocab_size = absl::GetFlag(FLAGS_vocab_size);
  options.hidden_size = absl::GetFlag(FLAGS_hidden_size);
  options.intermediate_size = absl::GetFlag(FLAGS_intermediate_size);
  options.num_layers = absl::GetFlag(FLAGS_num_layers);
  options.num_heads = absl::GetFlag(FLAGS_num_heads);
  options.num_kv_heads = absl::GetFlag(FLAGS_num_kv_heads);
  options.head_dim = absl::GetFlag(FLAGS_head_dim);
  options.rope_theta = absl::GetFlag(FLAGS_rope_theta);
  options.rms_norm_eps = absl::GetFlag(FLAGS_rms_norm_eps);
  options.rope_scaling = absl::GetFlag(FLAGS_rope_scaling);
  options.rope_factor = absl::GetFlag(FLAGS_rope_factor);
  options.rope_low_freq_factor = absl::GetFlag(FLAGS_rope_low_freq_factor);
  options.rope_high_freq_factor = absl::GetFlag(FLAGS_rope_high_freq_factor);
  options.rope_original_max_position_embeddings =
      absl::GetFlag(FLAGS_rope_original_max_position_embeddings);
  options.rope_parameters = absl::GetFlag(FLAGS_rope_parameters);
  options.max_position_embeddings = absl::GetFlag(FLAGS_max_position_embeddings);

  if (const absl::Status s = kvcm::WriteTinyModel(output, options); !s.ok()) {
    std::fprintf(stderr, "kvcm-make-tiny-model: %s\n", s.ToString().c_str());
    return 1;
  }
  std::printf(
      "kvcm-make-tiny-model: wrote %s (seed %llu, %s weights, vocab %d, hidden %d, "
      "%d layers, %d heads / %d KV heads x %d, intermediate %d%s)\n",
      output.c_str(), static_cast<unsigned long long>(options.seed),
      std::string(kvcm::DTypeName(options.dtype)).c_str(), options.vocab_size, options.hidden_size,
      options.num_layers, options.num_heads, options.num_kv_heads, options.head_dim,
      options.intermediate_size, options.tie_word_embeddings ? ", tied embeddings" : "");
  return 0;
}
