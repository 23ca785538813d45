// A second check of kvcm's loaders, independent of its own writer: tiny random Llama and
// Qwen2 models written by Hugging Face transformers' save_pretrained (transformers 5's config
// spelling: dtype, rope_parameters, layer_types), with transformers' logits
// (tests/reference/transformers_models.py writes both; it needs torch, so they are
// committed). kvcm loads each folder and must give the same logits at every position of a
// fixed token sequence, and the same greedy continuation:
//   llama       grouped-query attention, llama3 RoPE scaling
//   llama-bias  attention_bias (q, k, v and o), tied embeddings
//   qwen2       Qwen2ForCausalLM: bias on q, k and v, tied embeddings
//   qwen3       Qwen3ForCausalLM: per-head q/k RMSNorm, head_dim 16 != hidden 32 / 4 heads,
//               grouped-query attention
//   qwen3-mha   Qwen3ForCausalLM: 2 heads of 8 with hidden 48, no GQA, tied embeddings
//   qwen3-bias  Qwen3ForCausalLM with attention_bias (q, k, v and o), 4 query heads per KV head
//   mistral-window  MistralForCausalLM, a sliding window of 5 tokens on every layer
//   qwen2-window    Qwen2ForCausalLM, layer 0 full and layer 1 a window of 4 (layer_types)
//   qwen3-window    Qwen3ForCausalLM, a window of 3 on both layers
//   gemma3      Gemma3ForCausalLM: layers sliding (window 4), full, sliding; head_dim 16 !=
//               hidden 32 / 4 heads, 2 KV heads, query_pre_attn_scalar 24, RoPE theta 10000
//               with linear scaling x2 on the full layer and 100 on the sliding ones, tied
//   gemma3-mha  Gemma3ForCausalLM: 2 heads on 2 KV heads, sliding_window_pattern 2 (window
//               3), query_pre_attn_scalar 10, untied embeddings
// (the prompt and its greedy continuation, 18 tokens, are several windows long).
// The qwen3 model is also converted to a GGUF file (llama.cpp's qwen3 keys and tensor names,
// attn_q_norm / attn_k_norm) that must give the same logits.
// Negative controls show the comparison can fail: the qwen3 model with its q_norm / k_norm
// weights changed, or read as a Llama (the same tensors, the q/k norm skipped), must move
// the logits well beyond the tolerance; so must each window model read without its window,
// and the gemma3 model computed without each of Gemma's differences from Llama: norms
// x_normed * w instead of x_normed * (1 + w), embeddings unscaled, attention scaled by
// head_dim ** -0.5, one RoPE for every layer. Its paged forward (chunked prefill, then
// decode) gives its contiguous forward's logits. On a pool of KV cache groups (one block
// table per group of layers, docs/architecture.md, "The hybrid KV cache") the qwen2-window
// and gemma3 models give transformers' logits and greedy tokens; with two groups' tables
// swapped mid-prompt they do not.

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "common/gguf/gguf_file.h"
#include "common/gguf/gguf_writer.h"
#include "common/memory/pool_layout.h"
#include "common/memory/pool_view.h"
#include "common/safetensors/safetensors.h"
#include "common/sizing/kv_cache_groups.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "services/executor/kv_groups.h"
#include "services/executor/model/llama_model.h"
#include "services/executor/model/llama_model_cuda.h"
#include "tests/support/status_matchers.h"
#include "tests/support/subprocess.h"

namespace kvcm::executor {
namespace {

using json = nlohmann::json;
using testing::ReadFileOrEmpty;
using testing::TempDir;

// Both sides compute in fp32 from the same weights; only the order of sums differs.
constexpr double kTolerance = 1e-4;

json Reference() {
  std::ifstream in(std::string(KVCM_REFERENCE_DIR) + "/transformers_reference.json");
  std::stringstream text;
  text << in.rdbuf();
  return json::parse(text.str());
}

std::string ModelFolder(const std::string& name) {
  return std::string(KVCM_REFERENCE_DIR) + "/transformers/" + name;
}

// The largest |kvcm - transformers| over every logit of `tokens` (the reference prompt).
double WorstLogitError(const LlamaModel& model, const std::vector<int32_t>& tokens,
                       const json& want) {
  absl::StatusOr<std::vector<float>> logits = model.ForwardContiguous(tokens);
  EXPECT_THAT(logits, IsOk());
  if (!logits.ok()) return INFINITY;
  const size_t vocab = static_cast<size_t>(model.config().vocab_size);
  EXPECT_EQ(logits->size(), tokens.size() * vocab);
  if (logits->size() != tokens.size() * vocab) return INFINITY;
  double worst = 0;
  for (size_t t = 0; t < tokens.size(); ++t) {
    for (size_t v = 0; v < vocab; ++v) {
      worst =
          std::max(worst, std::abs((*logits)[t * vocab + v] - want["logits"][t][v].get<double>()));
    }
  }
  return worst;
}

class TransformersModelsTest : public ::testing::TestWithParam<const char*> {};

TEST_P(TransformersModelsTest, LogitsAndGreedyTokensEqualTransformers) {
  const std::string name = GetParam();
  const json reference = Reference();
  const json& want = reference["models"][name];
  LlamaModelOptions options;
  options.num_threads = 1;
  absl::StatusOr<std::unique_ptr<LlamaModel>> model = LlamaModel::Load(ModelFolder(name), options);
  ASSERT_THAT(model, IsOk());
  std::printf("%s: %s\n", name.c_str(), (*model)->config().ToString().c_str());

  std::vector<int32_t> tokens = reference["prompt"].get<std::vector<int32_t>>();
  const size_t vocab = static_cast<size_t>((*model)->config().vocab_size);
  const double worst = WorstLogitError(**model, tokens, want);
  std::printf("%s: worst logit error %.2e over %zu positions (reference margin %.3f)\n",
              name.c_str(), worst, tokens.size(), want["smallest_margin"].get<double>());
  EXPECT_LE(worst, kTolerance);

  std::vector<int32_t> greedy;
  for (size_t i = 0; i < want["greedy"].size(); ++i) {
    absl::StatusOr<std::vector<float>> step = (*model)->ForwardContiguous(tokens);
    ASSERT_THAT(step, IsOk());
    const float* last = step->data() + (tokens.size() - 1) * vocab;
    const auto next = static_cast<int32_t>(std::max_element(last, last + vocab) - last);
    greedy.push_back(next);
    tokens.push_back(next);
  }
  EXPECT_EQ(greedy, want["greedy"].get<std::vector<int32_t>>());
}

INSTANTIATE_TEST_SUITE_P(Models, TransformersModelsTest,
                         ::testing::Values("llama", "llama-bias", "qwen2", "qwen3", "qwen3-mha",
                                           "qwen3-bias", "mistral-window", "qwen2-window",
                                           "qwen3-window", "gemma3", "gemma3-mha"),
                         [](const ::testing::TestParamInfo<const char*>& param) {
                           std::string n = param.param;
                           std::replace(n.begin(), n.end(), '-', '_');
                           return n;
                         });

void NoConfigEdit(json&) {}
void NoTensorEdit(const std::string&, std::vector<float>&) {}

// The folder of model `name` copied to `dir` by kvcm's writer: its config.json passed through
// `edit_config`, each tensor's values through `edit_tensor`, then `extra` tensors added.
void CopyModel(
    const std::string& name, const std::string& dir, const std::function<void(json&)>& edit_config,
    const std::function<void(const std::string& name, std::vector<float>& values)>& edit_tensor,
    std::vector<SafetensorsTensorToWrite> extra = {}) {
  const std::string from = ModelFolder(name);
  json config = json::parse(ReadFileOrEmpty(from + "/config.json"));
  edit_config(config);
  {
    std::ofstream out(dir + "/config.json");
    out << config.dump(2);
    ASSERT_TRUE(out.good());
  }
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file =
      SafetensorsFile::Open(from + "/model.safetensors");
  ASSERT_THAT(file, IsOk());
  std::vector<SafetensorsTensorToWrite> tensors;
  for (const SafetensorsTensorInfo& info : (*file)->tensors()) {
    absl::StatusOr<std::vector<float>> values = (*file)->LoadFloat32(info.name);
    ASSERT_THAT(values, IsOk());
    edit_tensor(info.name, *values);
    absl::StatusOr<std::vector<std::byte>> bytes = EncodeFloat32As(*values, "F32");
    ASSERT_THAT(bytes, IsOk());
    tensors.push_back({info.name, "F32", info.shape, *std::move(bytes)});
  }
  for (SafetensorsTensorToWrite& tensor : extra) tensors.push_back(std::move(tensor));
  ASSERT_THAT(WriteSafetensors(dir + "/model.safetensors", tensors), IsOk());
}

// The qwen3 folder copied to `dir`, its config.json's text passed through `edit_config` and
// each q_norm / k_norm weight through `edit_norm`.
void CopyQwen3(const std::string& dir, const std::function<std::string(std::string)>& edit_config,
               const std::function<float(float)>& edit_norm) {
  int norms = 0;
  CopyModel(
      "qwen3", dir, [&](json& config) { config = json::parse(edit_config(config.dump(2))); },
      [&](const std::string& name, std::vector<float>& values) {
        if (!name.ends_with("q_norm.weight") && !name.ends_with("k_norm.weight")) return;
        for (float& v : values) v = edit_norm(v);
        ++norms;
      });
  EXPECT_EQ(norms, 4);  // two layers, q and k
}

// The worst logit error of the copy of model `name` in `dir` against transformers' logits of
// `name`; the copy must load as `want_architecture`.
double CopyError(const std::string& dir, const std::string& name,
                 const std::string& want_architecture) {
  const json reference = Reference();
  LlamaModelOptions options;
  options.num_threads = 1;
  absl::StatusOr<std::unique_ptr<LlamaModel>> model = LlamaModel::Load(dir, options);
  EXPECT_THAT(model, IsOk());
  if (!model.ok()) return 0;
  EXPECT_EQ((*model)->config().architecture, want_architecture);
  return WorstLogitError(**model, reference["prompt"].get<std::vector<int32_t>>(),
                         reference["models"][name]);
}

// The qwen3 folder as llama.cpp's convert_hf_to_gguf writes it (architecture "qwen3": the
// q and k rows keep Hugging Face's order), the matrices in `type`, the vectors in F32; the
// GGUF tensor `skip` left out; `arch` names the architecture and its keys.
void WriteQwen3Gguf(const std::string& path, GgmlType type, const std::string& skip = "",
                    const std::string& arch = "qwen3") {
  const json config = json::parse(ReadFileOrEmpty(ModelFolder("qwen3") + "/config.json"));
  GgufWriter writer;
  const std::pair<std::string, GgufValue> keys[] = {
      {"general.architecture", GgufValue::String(arch)},
      {arch + ".block_count", GgufValue::Uint32(config["num_hidden_layers"].get<uint32_t>())},
      {arch + ".context_length",
       GgufValue::Uint32(config["max_position_embeddings"].get<uint32_t>())},
      {arch + ".embedding_length", GgufValue::Uint32(config["hidden_size"].get<uint32_t>())},
      {arch + ".feed_forward_length",
       GgufValue::Uint32(config["intermediate_size"].get<uint32_t>())},
      {arch + ".attention.head_count",
       GgufValue::Uint32(config["num_attention_heads"].get<uint32_t>())},
      {arch + ".attention.head_count_kv",
       GgufValue::Uint32(config["num_key_value_heads"].get<uint32_t>())},
      {arch + ".attention.key_length", GgufValue::Uint32(config["head_dim"].get<uint32_t>())},
      {arch + ".attention.value_length", GgufValue::Uint32(config["head_dim"].get<uint32_t>())},
      {arch + ".rope.freq_base",
       GgufValue::Float32(config["rope_parameters"]["rope_theta"].get<float>())},
      {arch + ".attention.layer_norm_rms_epsilon",
       GgufValue::Float32(config["rms_norm_eps"].get<float>())},
      {arch + ".vocab_size", GgufValue::Uint32(config["vocab_size"].get<uint32_t>())},
      {"tokenizer.ggml.bos_token_id", GgufValue::Uint32(1)},
      {"tokenizer.ggml.eos_token_id", GgufValue::Uint32(2)},
  };
  for (const auto& [key, value] : keys) ASSERT_THAT(writer.Add(key, value), IsOk()) << key;
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file =
      SafetensorsFile::Open(ModelFolder("qwen3") + "/model.safetensors");
  ASSERT_THAT(file, IsOk());
  auto gguf_name = [](const std::string& hf) -> std::string {
    static const std::pair<const char*, const char*> kWhole[] = {
        {"model.embed_tokens.weight", "token_embd.weight"},
        {"model.norm.weight", "output_norm.weight"},
        {"lm_head.weight", "output.weight"}};
    for (const auto& [from, to] : kWhole) {
      if (hf == from) return to;
    }
    static const std::pair<const char*, const char*> kLayer[] = {
        {"input_layernorm.weight", "attn_norm.weight"},
        {"self_attn.q_proj.weight", "attn_q.weight"},
        {"self_attn.k_proj.weight", "attn_k.weight"},
        {"self_attn.v_proj.weight", "attn_v.weight"},
        {"self_attn.o_proj.weight", "attn_output.weight"},
        {"self_attn.q_norm.weight", "attn_q_norm.weight"},
        {"self_attn.k_norm.weight", "attn_k_norm.weight"},
        {"post_attention_layernorm.weight", "ffn_norm.weight"},
        {"mlp.gate_proj.weight", "ffn_gate.weight"},
        {"mlp.up_proj.weight", "ffn_up.weight"},
        {"mlp.down_proj.weight", "ffn_down.weight"}};
    const std::string layers = "model.layers.";
    const size_t dot = hf.find('.', layers.size());
    const std::string tail = hf.substr(dot + 1);
    for (const auto& [from, to] : kLayer) {
      if (tail == from) return "blk." + hf.substr(layers.size(), dot - layers.size()) + "." + to;
    }
    ADD_FAILURE() << "no GGUF name for " << hf;
    return hf;
  };
  for (const SafetensorsTensorInfo& info : (*file)->tensors()) {
    absl::StatusOr<std::vector<float>> values = (*file)->LoadFloat32(info.name);
    ASSERT_THAT(values, IsOk());
    const std::vector<int64_t> dims(info.shape.rbegin(), info.shape.rend());  // ne[0] first
    if (gguf_name(info.name) == skip) continue;
    ASSERT_THAT(writer.AddTensor(gguf_name(info.name), dims,
                                 info.shape.size() == 2 ? type : GgmlType::kF32, *values),
                IsOk())
        << info.name;
  }
  ASSERT_THAT(writer.WriteFile(path), IsOk());
}

TEST(TransformersModelsGgufTest, Qwen3GgufGivesTransformersLogits) {
  absl::StatusOr<TempDir> dir = TempDir::Create("kvcm-qwen3");
  ASSERT_THAT(dir, IsOk());
  const std::string path = dir->path() + "/qwen3.gguf";
  WriteQwen3Gguf(path, GgmlType::kF32);

  absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::Open(path);
  ASSERT_THAT(file, IsOk());
  absl::StatusOr<LlamaConfig> config = LlamaConfigFromGguf(**file);
  ASSERT_THAT(config, IsOk());
  EXPECT_EQ(config->architecture, "Qwen3ForCausalLM (GGUF qwen3)");
  EXPECT_TRUE(config->qk_norm);
  EXPECT_FALSE(config->qkv_bias);
  EXPECT_FALSE(config->o_bias);
  EXPECT_EQ(config->hidden_size, 32);
  EXPECT_EQ(config->num_attention_heads, 4);
  EXPECT_EQ(config->num_key_value_heads, 2);
  EXPECT_EQ(config->head_dim, 16);  // key_length, not embedding_length / head_count
  EXPECT_EQ(config->rope_theta, 1e6);
  EXPECT_FALSE(config->tie_word_embeddings);

  const json reference = Reference();
  LlamaModelOptions options;
  options.num_threads = 1;
  absl::StatusOr<std::unique_ptr<LlamaModel>> model = LlamaModel::Load(path, options);
  ASSERT_THAT(model, IsOk());
  const double worst = WorstLogitError(**model, reference["prompt"].get<std::vector<int32_t>>(),
                                       reference["models"]["qwen3"]);
  std::printf("qwen3 GGUF: worst logit error %.2e\n", worst);
  EXPECT_LE(worst, kTolerance);
}

// A gemma3 GGUF file is read as Gemma 3 (tests/services/executor/model/real_model_test.cc runs a
// real one), never as another architecture: the Qwen3 tensors written as gemma3 lack Gemma's
// sandwich norms, and the load names the first one missing (llama.cpp's name for
// post_attention_layernorm with sandwich norms, not Llama's ffn_norm).
TEST(TransformersModelsGgufTest, Gemma3GgufIsReadAsGemma3) {
  absl::StatusOr<TempDir> dir = TempDir::Create("kvcm-gemma3");
  ASSERT_THAT(dir, IsOk());
  const std::string path = dir->path() + "/gemma3.gguf";
  WriteQwen3Gguf(path, GgmlType::kF32, "", "gemma3");
  EXPECT_THAT(LlamaModel::Load(path).status(),
              StatusIs(absl::StatusCode::kNotFound,
                       ::testing::HasSubstr("blk.0.post_attention_norm.weight")));
}

TEST(TransformersModelsGgufTest, Qwen3GgufWithoutQkNormIsRefusedNamingTheTensor) {
  absl::StatusOr<TempDir> dir = TempDir::Create("kvcm-qwen3");
  ASSERT_THAT(dir, IsOk());
  // As qwen3, every layer needs both norms.
  const std::string path = dir->path() + "/qwen3.gguf";
  WriteQwen3Gguf(path, GgmlType::kF32, "blk.1.attn_k_norm.weight");
  EXPECT_THAT(LlamaModel::Load(path).status(),
              StatusIs(absl::StatusCode::kNotFound, ::testing::HasSubstr("blk.1.attn_k_norm")));
}

TEST(TransformersModelsNegativeTest, UnchangedCopyStillMatches) {
  // The copy itself (rewritten by kvcm's writer) changes nothing.
  absl::StatusOr<TempDir> dir = TempDir::Create("kvcm-qwen3");
  ASSERT_THAT(dir, IsOk());
  CopyQwen3(
      dir->path(), [](std::string text) { return text; }, [](float v) { return v; });
  const double worst = CopyError(dir->path(), "qwen3", "Qwen3ForCausalLM");
  std::printf("qwen3 copy: worst logit error %.2e\n", worst);
  EXPECT_LE(worst, kTolerance);
}

TEST(TransformersModelsNegativeTest, ChangedQkNormWeightsMoveTheLogits) {
  // q_norm and k_norm reset to 1 (transformers' initial value; the reference's are 1 + N(0,
  // 0.1)): a loader or forward that ignored them would look like this.
  absl::StatusOr<TempDir> dir = TempDir::Create("kvcm-qwen3");
  ASSERT_THAT(dir, IsOk());
  CopyQwen3(
      dir->path(), [](std::string text) { return text; }, [](float) { return 1.0f; });
  const double worst = CopyError(dir->path(), "qwen3", "Qwen3ForCausalLM");
  std::printf("qwen3 with q/k norm weights 1: worst logit error %.2e\n", worst);
  EXPECT_GT(worst, 100 * kTolerance);
}

TEST(TransformersModelsNegativeTest, SkippedQkNormMovesTheLogits) {
  // The same tensors read as a Llama: q_norm and k_norm are ignored, the norm is skipped.
  absl::StatusOr<TempDir> dir = TempDir::Create("kvcm-qwen3");
  ASSERT_THAT(dir, IsOk());
  CopyQwen3(
      dir->path(),
      [](std::string text) {
        for (const auto& [from, to] :
             {std::pair<std::string, std::string>{"Qwen3ForCausalLM", "LlamaForCausalLM"},
              {"\"qwen3\"", "\"llama\""}}) {
          const size_t at = text.find(from);
          EXPECT_NE(at, std::string::npos) << from;
          if (at != std::string::npos) text.replace(at, from.size(), to);
        }
        return text;
      },
      [](float v) { return v; });
  const double worst = CopyError(dir->path(), "qwen3", "LlamaForCausalLM");
  std::printf("qwen3 read as llama (no q/k norm): worst logit error %.2e\n", worst);
  EXPECT_GT(worst, 100 * kTolerance);
}

// Each window model with its window taken out of config.json (so every layer attends to
// the whole context) moves the logits beyond the tolerance: the window is what matches.
TEST(TransformersModelsNegativeTest, WindowModelsWithoutTheirWindowMoveTheLogits) {
  const json reference = Reference();
  const std::vector<int32_t> tokens = reference["prompt"].get<std::vector<int32_t>>();
  for (const char* name : {"mistral-window", "qwen2-window", "qwen3-window", "gemma3"}) {
    absl::StatusOr<TempDir> dir = TempDir::Create("kvcm-window");
    ASSERT_THAT(dir, IsOk());
    CopyModel(
        name, dir->path(),
        [&](json& config) {
          ASSERT_TRUE(config.contains("sliding_window")) << name;
          if (config.contains("query_pre_attn_scalar")) {
            // Gemma 3: its sliding layers keep their type (and so their RoPE); only the
            // window grows past the prompt.
            config["sliding_window"] = 4096;
          } else {
            config["sliding_window"] = nullptr;
            config["use_sliding_window"] = false;
            config.erase("layer_types");
          }
        },
        NoTensorEdit);
    LlamaModelOptions options;
    options.num_threads = 1;
    absl::StatusOr<std::unique_ptr<LlamaModel>> model = LlamaModel::Load(dir->path(), options);
    ASSERT_THAT(model, IsOk());
    const double worst = WorstLogitError(**model, tokens, reference["models"][name]);
    std::printf("%s without its window: worst logit error %.2e\n", name, worst);
    EXPECT_GT(worst, 100 * kTolerance) << name;
  }
}

TEST(TransformersModelsNegativeTest, MissingQkNormIsRefusedNamingTheTensor) {
  absl::StatusOr<TempDir> dir = TempDir::Create("kvcm-qwen3");
  ASSERT_THAT(dir, IsOk());
  CopyQwen3(
      dir->path(), [](std::string text) { return text; }, [](float v) { return v; });
  // Rewrite the shard without layer 1's k_norm.
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file =
      SafetensorsFile::Open(ModelFolder("qwen3") + "/model.safetensors");
  ASSERT_THAT(file, IsOk());
  std::vector<SafetensorsTensorToWrite> tensors;
  for (const SafetensorsTensorInfo& info : (*file)->tensors()) {
    if (info.name == "model.layers.1.self_attn.k_norm.weight") continue;
    absl::StatusOr<std::vector<float>> values = (*file)->LoadFloat32(info.name);
    ASSERT_THAT(values, IsOk());
    absl::StatusOr<std::vector<std::byte>> bytes = EncodeFloat32As(*values, "F32");
    ASSERT_THAT(bytes, IsOk());
    tensors.push_back({info.name, "F32", info.shape, *std::move(bytes)});
  }
  ASSERT_THAT(WriteSafetensors(dir->path() + "/model.safetensors", tensors), IsOk());
  absl::StatusOr<std::unique_ptr<LlamaModel>> model = LlamaModel::Load(dir->path());
  EXPECT_THAT(model, StatusIs(absl::StatusCode::kNotFound,
                              ::testing::HasSubstr("model.layers.1.self_attn.k_norm.weight")));
}

TEST(TransformersModelsGemma3Test, UnchangedCopyStillMatches) {
  absl::StatusOr<TempDir> dir = TempDir::Create("kvcm-gemma3");
  ASSERT_THAT(dir, IsOk());
  CopyModel("gemma3", dir->path(), NoConfigEdit, NoTensorEdit);
  const double worst = CopyError(dir->path(), "gemma3", "Gemma3ForCausalLM");
  std::printf("gemma3 copy: worst logit error %.2e\n", worst);
  EXPECT_LE(worst, kTolerance);
}

TEST(TransformersModelsGemma3Test, NormsWithoutTheOneMoveTheLogits) {
  // Every norm weight shifted by -1: kvcm's x_normed * (1 + w - 1) is what a forward that
  // computed x_normed * w (Llama's norm) on the original weights would give.
  absl::StatusOr<TempDir> dir = TempDir::Create("kvcm-gemma3");
  ASSERT_THAT(dir, IsOk());
  int norms = 0;
  CopyModel("gemma3", dir->path(), NoConfigEdit,
            [&](const std::string& name, std::vector<float>& values) {
              if (name.find("norm") == std::string::npos) return;
              for (float& v : values) v -= 1.0f;
              ++norms;
            });
  EXPECT_EQ(norms, 3 * 6 + 1);  // per layer: 4 layer norms, q_norm, k_norm; the final norm
  const double worst = CopyError(dir->path(), "gemma3", "Gemma3ForCausalLM");
  std::printf("gemma3 with norms x * w: worst logit error %.2e\n", worst);
  EXPECT_GT(worst, 100 * kTolerance);
}

TEST(TransformersModelsGemma3Test, UnscaledEmbeddingsMoveTheLogits) {
  // The input embeddings divided by sqrt(hidden_size) (the head keeps the original matrix,
  // untied): kvcm's scaled lookup then gives the unscaled embeddings.
  absl::StatusOr<TempDir> dir = TempDir::Create("kvcm-gemma3");
  ASSERT_THAT(dir, IsOk());
  // The head: lm_head.weight, the original embeddings.
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> original =
      SafetensorsFile::Open(ModelFolder("gemma3") + "/model.safetensors");
  ASSERT_THAT(original, IsOk());
  absl::StatusOr<std::vector<float>> head = (*original)->LoadFloat32("model.embed_tokens.weight");
  ASSERT_THAT(head, IsOk());
  absl::StatusOr<std::vector<std::byte>> head_bytes = EncodeFloat32As(*head, "F32");
  ASSERT_THAT(head_bytes, IsOk());
  int scaled = 0;
  CopyModel(
      "gemma3", dir->path(), [](json& config) { config["tie_word_embeddings"] = false; },
      [&](const std::string& name, std::vector<float>& values) {
        if (name != "model.embed_tokens.weight") return;
        for (float& v : values) v /= std::sqrt(32.0f);
        ++scaled;
      },
      {{"lm_head.weight", "F32", {260, 32}, *std::move(head_bytes)}});
  ASSERT_EQ(scaled, 1);
  const double worst = CopyError(dir->path(), "gemma3", "Gemma3ForCausalLM");
  std::printf("gemma3 without the embedding scale: worst logit error %.2e\n", worst);
  EXPECT_GT(worst, 100 * kTolerance);
}

TEST(TransformersModelsGemma3Test, HeadDimAttentionScaleMovesTheLogits) {
  // query_pre_attn_scalar set to head_dim: attention scaled by head_dim ** -0.5 as Llama's.
  absl::StatusOr<TempDir> dir = TempDir::Create("kvcm-gemma3");
  ASSERT_THAT(dir, IsOk());
  CopyModel(
      "gemma3", dir->path(),
      [](json& config) { config["query_pre_attn_scalar"] = config["head_dim"]; }, NoTensorEdit);
  const double worst = CopyError(dir->path(), "gemma3", "Gemma3ForCausalLM");
  std::printf("gemma3 with head_dim ** -0.5: worst logit error %.2e\n", worst);
  EXPECT_GT(worst, 100 * kTolerance);
}

TEST(TransformersModelsGemma3Test, OneRopeForEveryLayerMovesTheLogits) {
  // The sliding layers given the full-attention layers' RoPE.
  absl::StatusOr<TempDir> dir = TempDir::Create("kvcm-gemma3");
  ASSERT_THAT(dir, IsOk());
  CopyModel(
      "gemma3", dir->path(),
      [](json& config) {
        json& rope = config["rope_parameters"];
        rope["sliding_attention"] = rope["full_attention"];
      },
      NoTensorEdit);
  const double worst = CopyError(dir->path(), "gemma3", "Gemma3ForCausalLM");
  std::printf("gemma3 with one RoPE for all layers: worst logit error %.2e\n", worst);
  EXPECT_GT(worst, 100 * kTolerance);
}

// The paged forward over a host pool (fp32, blocks of 4 in a scattered order): the prompt
// in two chunks, then one token at a time, against the contiguous forward of every token.
TEST(TransformersModelsGemma3Test, PagedForwardMatchesContiguous) {
  const json reference = Reference();
  LlamaModelOptions options;
  options.num_threads = 1;
  absl::StatusOr<std::unique_ptr<LlamaModel>> model =
      LlamaModel::Load(ModelFolder("gemma3"), options);
  ASSERT_THAT(model, IsOk());
  const LlamaConfig& c = (*model)->config();
  std::vector<int32_t> tokens = reference["prompt"].get<std::vector<int32_t>>();
  for (int32_t t : reference["models"]["gemma3"]["greedy"].get<std::vector<int32_t>>()) {
    tokens.push_back(t);
  }
  absl::StatusOr<std::vector<float>> want = (*model)->ForwardContiguous(tokens);
  ASSERT_THAT(want, IsOk());

  constexpr int32_t kBlockSize = 4;
  constexpr int32_t kNumBlocks = 16;
  PoolView pool;
  pool.spec = c.KvSpec(DType::kFloat32, kBlockSize).value();
  pool.num_blocks = kNumBlocks;
  pool.layout = PoolLayout::For(pool.spec, kNumBlocks).value();
  std::vector<uint8_t> memory(static_cast<size_t>(pool.layout.total_bytes), 0x5a);
  pool.base = memory.data();
  std::vector<int32_t> table;
  for (int32_t b = 0; b < kNumBlocks; ++b) table.push_back((b * 7 + 3) % kNumBlocks);

  const size_t vocab = static_cast<size_t>(c.vocab_size);
  const std::vector<int32_t> steps = {5, 7, 1, 1, 1, 1, 1, 1};
  int32_t done = 0;
  double worst = 0;
  for (int32_t n : steps) {
    ForwardBatch batch;
    batch.token_ids.assign(tokens.begin() + done, tokens.begin() + done + n);
    batch.query_lens = {n};
    batch.context_lens = {done + n};
    batch.block_tables = table;
    batch.max_blocks_per_seq = kNumBlocks;
    std::vector<float> logits;
    ASSERT_THAT((*model)->Forward(batch, pool, &logits, LogitsScope::kAllTokens), IsOk());
    ASSERT_EQ(logits.size(), static_cast<size_t>(n) * vocab);
    for (size_t i = 0; i < logits.size(); ++i) {
      worst = std::max<double>(worst, std::abs(logits[i] - (*want)[done * vocab + i]));
    }
    done += n;
  }
  ASSERT_EQ(done, static_cast<int32_t>(tokens.size()));
  std::printf("gemma3 paged vs contiguous: worst logit difference %.2e\n", worst);
  EXPECT_LE(worst, kTolerance);
}

// KV cache groups (docs/architecture.md, "The hybrid KV cache"): the model's layers grouped
// by window (GroupLayers), a pool of pages of group_size slots (PageSpec), one block table
// per group whose blocks lie scattered over the pool, different in every group, and the
// window group's entries -1 once its window has passed them, as the cache manager releases
// them. Runs `tokens` in `chunks` of new tokens, all-token logits; `swap_from`: from that
// chunk on, groups 0 and 1 read and write each other's tables (a negative control; nothing
// is released then, so that the swapped full group's table has no -1).
struct GroupedRun {
  std::vector<float> logits;  // [tokens][vocab]
  KvCacheGroups groups;
  int32_t released = 0;  // table entries sent as -1
};
GroupedRun RunGrouped(const LlamaModel& model, const std::vector<int32_t>& tokens,
                      const std::vector<int32_t>& chunks, size_t swap_from = SIZE_MAX) {
  constexpr int32_t kBlockSize = 2;
  constexpr int32_t kNumBlocks = 64;
  const LlamaConfig& c = model.config();
  GroupedRun run;
  run.groups = GroupLayers(c.layer_windows).value();
  const int32_t num_groups = run.groups.num_groups();
  PoolView pool;
  pool.spec = PageSpec(c.KvSpec(DType::kFloat32, kBlockSize).value(), run.groups);
  pool.num_blocks = kNumBlocks;
  pool.layout = PoolLayout::For(pool.spec, kNumBlocks).value();
  pool.kv_groups = run.groups.groups;
  // Garbage, not zeros: a read of a slot nobody wrote cannot pass by luck.
  std::vector<uint8_t> memory(static_cast<size_t>(pool.layout.total_bytes), 0x5a);
  pool.base = memory.data();
  const int32_t max_blocks = (static_cast<int32_t>(tokens.size()) + kBlockSize - 1) / kBlockSize;
  EXPECT_LE(max_blocks * num_groups, kNumBlocks);
  // Group g's block j: a permutation of the pool dealt out to the groups in turn.
  std::vector<std::vector<int32_t>> tables(static_cast<size_t>(num_groups));
  for (int32_t j = 0; j < max_blocks; ++j) {
    for (int32_t g = 0; g < num_groups; ++g) {
      tables[static_cast<size_t>(g)].push_back((37 * (j * num_groups + g) + 11) % kNumBlocks);
    }
  }
  int32_t done = 0;
  for (size_t chunk = 0; chunk < chunks.size(); ++chunk) {
    const int32_t n = chunks[chunk];
    const bool swap = chunk >= swap_from;
    ForwardBatch batch;
    batch.token_ids.assign(tokens.begin() + done, tokens.begin() + done + n);
    batch.query_lens = {n};
    batch.context_lens = {done + n};
    batch.max_blocks_per_seq = max_blocks;
    for (int32_t g = 0; g < num_groups; ++g) {
      const int32_t window = run.groups.groups[static_cast<size_t>(g)].window;
      const int64_t released = swap_from == SIZE_MAX ? ReleasedBlocks(window, done, kBlockSize) : 0;
      const int32_t from = swap && g < 2 ? 1 - g : g;
      std::vector<int32_t>& out = g == 0 ? batch.block_tables : batch.group_block_tables;
      for (int32_t j = 0; j < max_blocks; ++j) {
        out.push_back(j < released ? -1
                                   : tables[static_cast<size_t>(from)][static_cast<size_t>(j)]);
        run.released += j < released ? 1 : 0;
      }
    }
    std::vector<float> logits;
    EXPECT_THAT(model.Forward(batch, pool, &logits, LogitsScope::kAllTokens), IsOk());
    run.logits.insert(run.logits.end(), logits.begin(), logits.end());
    done += n;
  }
  EXPECT_EQ(done, static_cast<int32_t>(tokens.size()));
  return run;
}

// The largest |logits - the reference's| over the prompt's positions.
double WorstGroupedError(const std::vector<float>& logits, const json& want, size_t positions,
                         size_t vocab) {
  double worst = 0;
  for (size_t t = 0; t < positions; ++t) {
    for (size_t v = 0; v < vocab; ++v) {
      worst = std::max(worst, std::abs(logits[t * vocab + v] - want["logits"][t][v].get<double>()));
    }
  }
  return worst;
}

class TransformersModelsGroupedTest : public ::testing::TestWithParam<const char*> {};

// The prompt in chunks of 5, 4 and 3 tokens, then greedy decoding one token a step: the
// reference logits and greedy tokens, on a grouped pool.
TEST_P(TransformersModelsGroupedTest, GroupedPoolGivesTransformersLogitsAndGreedyTokens) {
  const std::string name = GetParam();
  const json reference = Reference();
  const json& want = reference["models"][name];
  LlamaModelOptions options;
  options.num_threads = 1;
  absl::StatusOr<std::unique_ptr<LlamaModel>> model = LlamaModel::Load(ModelFolder(name), options);
  ASSERT_THAT(model, IsOk());
  const size_t vocab = static_cast<size_t>((*model)->config().vocab_size);
  std::vector<int32_t> tokens = reference["prompt"].get<std::vector<int32_t>>();
  const size_t prompt_len = tokens.size();
  const std::vector<int32_t> greedy_want = want["greedy"].get<std::vector<int32_t>>();
  // The greedy tokens are fed back one a step; each step's last row chooses the next.
  std::vector<int32_t> chunks = {5, 4, static_cast<int32_t>(prompt_len) - 9};
  tokens.insert(tokens.end(), greedy_want.begin(), greedy_want.end() - 1);
  chunks.insert(chunks.end(), greedy_want.size() - 1, 1);
  const GroupedRun run = RunGrouped(**model, tokens, chunks);
  ASSERT_GE(run.groups.num_groups(), 2) << run.groups.ToString();
  EXPECT_GT(run.released, 0) << "no table entry was released";
  ASSERT_EQ(run.logits.size(), tokens.size() * vocab);

  const double worst = WorstGroupedError(run.logits, want, prompt_len, vocab);
  std::printf("%s on a grouped pool (%s): worst logit error %.2e, %d entries released\n",
              name.c_str(), run.groups.ToString().c_str(), worst, run.released);
  EXPECT_LE(worst, kTolerance);
  std::vector<int32_t> greedy;
  for (size_t t = prompt_len - 1; t < tokens.size(); ++t) {
    const float* row = run.logits.data() + t * vocab;
    greedy.push_back(static_cast<int32_t>(std::max_element(row, row + vocab) - row));
  }
  EXPECT_EQ(greedy, greedy_want);
}

// Negative control: the first chunk as it should be, then groups 0 and 1 reading and
// writing each other's tables: the prompt's later logits move well beyond the tolerance.
TEST_P(TransformersModelsGroupedTest, SwappedGroupTablesMoveTheLogits) {
  const std::string name = GetParam();
  const json reference = Reference();
  const json& want = reference["models"][name];
  LlamaModelOptions options;
  options.num_threads = 1;
  absl::StatusOr<std::unique_ptr<LlamaModel>> model = LlamaModel::Load(ModelFolder(name), options);
  ASSERT_THAT(model, IsOk());
  const size_t vocab = static_cast<size_t>((*model)->config().vocab_size);
  const std::vector<int32_t> tokens = reference["prompt"].get<std::vector<int32_t>>();
  const std::vector<int32_t> chunks = {5, static_cast<int32_t>(tokens.size()) - 5};
  const GroupedRun same = RunGrouped(**model, tokens, chunks, /*swap_from=*/chunks.size());
  EXPECT_LE(WorstGroupedError(same.logits, want, tokens.size(), vocab), kTolerance);
  const GroupedRun swapped = RunGrouped(**model, tokens, chunks, /*swap_from=*/1);
  const double worst = WorstGroupedError(swapped.logits, want, tokens.size(), vocab);
  std::printf("%s with groups 0 and 1 swapped after the first chunk: worst logit error %.2e\n",
              name.c_str(), worst);
  EXPECT_GT(worst, 100 * kTolerance);
}

INSTANTIATE_TEST_SUITE_P(Models, TransformersModelsGroupedTest,
                         ::testing::Values("qwen2-window", "gemma3"),
                         [](const ::testing::TestParamInfo<const char*>& param) {
                           std::string n = param.param;
                           std::replace(n.begin(), n.end(), '-', '_');
                           return n;
                         });

// Gemma 3 has no CUDA kernels: the device model refuses it up front, naming it, with or
// without a device and in builds without CUDA, rather than compute other logits.
TEST(TransformersModelsGemma3Test, CudaModelRefusesGemma3) {
  absl::StatusOr<std::unique_ptr<LlamaModel>> model = LlamaModel::Load(ModelFolder("gemma3"));
  ASSERT_THAT(model, IsOk());
  const absl::Status support = CheckCudaSupport((*model)->config());
  EXPECT_EQ(support.code(), absl::StatusCode::kUnimplemented) << support;
  EXPECT_THAT(support.message(), ::testing::HasSubstr("Gemma 3"));
  absl::StatusOr<std::unique_ptr<LlamaCudaModel>> made = LlamaCudaModel::Create(**model, 0);
  EXPECT_EQ(made.status().code(), absl::StatusCode::kUnimplemented) << made.status();
  EXPECT_THAT(made.status().message(), ::testing::HasSubstr("Gemma 3"));
}

}  // namespace
}  // namespace kvcm::executor
