#include "common/tokenizer/gguf_tokenizer.h"

#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/gguf/gguf_file.h"
#include "common/tokenizer/bpe_tokenizer.h"

namespace kvcm {
namespace {

// An optional integer key: `fallback` when absent.
absl::StatusOr<int64_t> OptionalInt(const GgufFile& file, const char* key, int64_t fallback) {
  if (!file.Has(key)) return fallback;
  return file.GetInt(key);
}

}  // namespace

absl::StatusOr<std::unique_ptr<Tokenizer>> LoadGgufTokenizer(const GgufFile& file,
                                                              const TokenizerConfig& config) {
  absl::StatusOr<std::string> model = file.GetString("tokenizer.ggml.model");
  if (!model.ok()) return model.status();
  if (*model == "llama") {
    return absl::UnimplementedError(absl::StrCat(
        file.name(), ": tokenizer.ggml.model \"llama\" (SentencePiece from GGUF arrays) is not "
                     "implemented; use the model's tokenizer.model or tokenizer.json"));
  }
  if (*model != "gpt2") {
    return absl::UnimplementedError(absl::StrCat(file.name(), ": tokenizer.ggml.model \"", *model,
                                                 "\" is not implemented"));
  }
  BpeVocab vocab;
  vocab.source = file.name();
  absl::StatusOr<std::vector<std::string>> tokens = file.GetStringArray("tokenizer.ggml.tokens");
  if (!tokens.ok()) return tokens.status();
  vocab.tokens = std::move(*tokens);
  if (file.Has("tokenizer.ggml.merges")) {
    absl::StatusOr<std::vector<std::string>> merges = file.GetStringArray("tokenizer.ggml.merges");
    if (!merges.ok()) return merges.status();
    vocab.merges = std::move(*merges);
  }
  if (file.Has("tokenizer.ggml.token_type")) {
    absl::StatusOr<std::vector<int64_t>> types = file.GetIntArray("tokenizer.ggml.token_type");
    if (!types.ok()) return types.status();
    if (types->size() != vocab.tokens.size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          file.name(), ": tokenizer.ggml.token_type has ", types->size(), " entries for ",
          vocab.tokens.size(), " tokens"));
    }
    for (size_t id = 0; id < types->size(); ++id) {
      const int64_t type = (*types)[id];
      if (type != 3 && type != 4) continue;
      BpeAddedToken token;
      token.content = vocab.tokens[id];
      token.id = static_cast<int32_t>(id);
      token.special = type == 3;
      vocab.added_tokens.push_back(std::move(token));
    }
  }
  vocab.pre = "default";
  if (file.Has("tokenizer.ggml.pre")) {
    absl::StatusOr<std::string> pre = file.GetString("tokenizer.ggml.pre");
    if (!pre.ok()) return pre.status();
    vocab.pre = std::move(*pre);
  }
  const int64_t fallback_eos = config.eos_token_ids.empty() ? -1 : config.eos_token_ids[0];
  for (const auto& [key, fallback, out] :
       {std::tuple<const char*, int64_t, int32_t*>{"tokenizer.ggml.bos_token_id",
                                                   config.bos_token_id, &vocab.bos_id},
        {"tokenizer.ggml.eos_token_id", fallback_eos, &vocab.eos_id}}) {
    absl::StatusOr<int64_t> id = OptionalInt(file, key, fallback);
    if (!id.ok()) return id.status();
    if (*id < -1 || *id >= static_cast<int64_t>(vocab.tokens.size())) {
      return absl::InvalidArgumentError(absl::StrCat(file.name(), ": ", key, " = ", *id,
                                                     " is not a token id"));
    }
    *out = static_cast<int32_t>(*id);
  }
  if (file.Has("tokenizer.ggml.add_bos_token")) {
    absl::StatusOr<bool> add_bos = file.GetBool("tokenizer.ggml.add_bos_token");
    if (!add_bos.ok()) return add_bos.status();
    vocab.add_bos = *add_bos;
  }
  absl::StatusOr<std::unique_ptr<BpeTokenizer>> tokenizer =
      BpeTokenizer::FromVocab(std::move(vocab), config.vocab_size);
  if (!tokenizer.ok()) return tokenizer.status();
  return std::unique_ptr<Tokenizer>(std::move(*tokenizer));
}

}  // namespace kvcm
