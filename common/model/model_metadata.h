#pragma once
// ModelMetadata: what the processes around a model need to know of it without loading its
// weights: its name, its tokenizer's ids, the tokens that end generation and its chat
// template. The router reads it at start; the launcher and the cache manager read the KV
// shape elsewhere (common/sizing).
//
// `--model PATH` is either
//   a Hugging Face folder  config.json (vocab_size, bos_token_id, eos_token_id, as
//                          common/model/model_config.h reads them),
//                          generation_config.json (more eos_token_id: instruction-tuned
//                          models name their end-of-turn token there; generation stops at
//                          any of them, as vLLM does), the chat template from
//                          chat_template.jinja or else tokenizer_config.json's
//                          "chat_template" (a string, or a list of {name, template} whose
//                          "default" is taken), and tokenizer_config.json's bos_token and
//                          eos_token (strings or {"content": ...}) for the template;
//   a GGUF file            general.architecture's vocab_size (else the number of tokens),
//                          tokenizer.ggml.bos_token_id, eos_token_id and eot_token_id (as
//                          common/model/model_config.h reads them),
//                          tokenizer.chat_template, and the bos/eos tokens' text.
//
// Errors name the file and the key: NOT_FOUND for a missing config.json or GGUF file;
// INVALID_ARGUMENT for malformed JSON or metadata, or token ids outside the vocabulary.
//
// Thread safety: a plain value.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/tokenizer/tokenizer.h"

namespace kvcm {

struct ModelMetadata {
  std::string path;   // as given
  bool gguf = false;  // `path` is a GGUF file
  // The folder's name, or the GGUF file's without ".gguf": /v1/models' id.
  std::string name;
  TokenizerConfig tokenizer;
  // Generation ends at any of these (never empty when the model names an EOS).
  std::vector<int32_t> eos_token_ids;
  std::string chat_template;         // "" when the model has none
  std::string chat_template_source;  // the file (and key) it came from, for logs and errors
  std::string bos_token;             // the template's bos_token and eos_token ("" when none)
  std::string eos_token;
};

absl::StatusOr<ModelMetadata> ReadModelMetadata(const std::string& path);

// The model's tokenizer: LoadTokenizer for a folder, LoadGgufTokenizer for a GGUF file.
absl::StatusOr<std::unique_ptr<Tokenizer>> LoadModelTokenizer(const ModelMetadata& metadata);

}  // namespace kvcm
