#include "common/model/model_metadata.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/base/status_macros.h"
#include "common/gguf/gguf_file.h"
#include "common/model/model_config.h"
#include "common/tokenizer/gguf_tokenizer.h"
#include "nlohmann/json.hpp"

namespace kvcm {
namespace {

using Json = nlohmann::json;

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

absl::StatusOr<Json> ReadJsonObject(const std::string& path) {
  KVCM_ASSIGN_OR_RETURN(const std::string text, ReadFile(path));
  Json root = Json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded() || !root.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(path, " is not a JSON object"));
  }
  return root;
}

void AddId(int32_t id, std::vector<int32_t>* ids) {
  if (std::find(ids->begin(), ids->end(), id) == ids->end()) ids->push_back(id);
}

// A special token of tokenizer_config.json: a string, or {"content": "..."} (AddedToken).
std::string TokenText(const Json& root, const char* key) {
  const auto it = root.find(key);
  if (it == root.end()) return "";
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object() && it->contains("content") && (*it)["content"].is_string()) {
    return (*it)["content"].get<std::string>();
  }
  return "";
}

absl::Status ReadFolder(ModelMetadata* m) {
  const std::string folder(absl::StripSuffix(m->path, "/"));
  m->name = std::filesystem::path(folder).filename().string();

  // vocab_size, bos_token_id and eos_token_id as the one reader of config.json reads them.
  const std::string config_path = folder + "/config.json";
  KVCM_ASSIGN_OR_RETURN(const ModelConfig config, ReadHfModelConfigFile(config_path));
  if (!config.vocab_size.has_value()) {
    return absl::InvalidArgumentError(
        absl::StrCat(config.Where(), "missing required key \"vocab_size\""));
  }
  m->tokenizer.vocab_size = *config.vocab_size;
  m->tokenizer.bos_token_id = config.bos_token_id.value_or(-1);
  m->tokenizer.eos_token_ids = config.eos_token_ids;
  // config.json's and generation_config.json's: the rule the executors' min_tokens uses too.
  KVCM_ASSIGN_OR_RETURN(m->eos_token_ids, ReadEndTokenIds(folder));

  const std::string tokenizer_config_path = folder + "/tokenizer_config.json";
  Json tokenizer_config = Json::object();
  if (std::filesystem::exists(tokenizer_config_path)) {
    KVCM_ASSIGN_OR_RETURN(tokenizer_config, ReadJsonObject(tokenizer_config_path));
    m->bos_token = TokenText(tokenizer_config, "bos_token");
    m->eos_token = TokenText(tokenizer_config, "eos_token");
  }
  const std::string jinja_path = folder + "/chat_template.jinja";
  if (std::filesystem::exists(jinja_path)) {
    KVCM_ASSIGN_OR_RETURN(m->chat_template, ReadFile(jinja_path));
    m->chat_template_source = jinja_path;
  } else if (const auto t = tokenizer_config.find("chat_template");
             t != tokenizer_config.end() && !t->is_null()) {
    m->chat_template_source = absl::StrCat(tokenizer_config_path, " (chat_template)");
    if (t->is_string()) {
      m->chat_template = t->get<std::string>();
    } else if (t->is_array()) {
      // Several named templates: the "default" one serves chat completions.
      for (const Json& named : *t) {
        if (named.is_object() && named.value("name", "") == "default" &&
            named.contains("template") && named["template"].is_string()) {
          m->chat_template = named["template"].get<std::string>();
        }
      }
      if (m->chat_template.empty()) {
        return absl::InvalidArgumentError(absl::StrCat(
            tokenizer_config_path, ": chat_template is a list without a \"default\" template"));
      }
    } else {
      return absl::InvalidArgumentError(absl::StrCat(
          tokenizer_config_path, ": chat_template must be a string or a list of templates"));
    }
  }
  return absl::OkStatus();
}

absl::Status ReadGguf(ModelMetadata* m) {
  m->gguf = true;
  std::string name = std::filesystem::path(m->path).filename().string();
  if (absl::EndsWith(name, ".gguf")) name.resize(name.size() - 5);
  m->name = name;
  KVCM_ASSIGN_OR_RETURN(const std::unique_ptr<GgufFile> file, GgufFile::Open(m->path));
  // The vocabulary size and the ids as the one reader of GGUF metadata reads them.
  KVCM_ASSIGN_OR_RETURN(const ModelConfig config, ModelConfigFromGguf(*file));
  if (!config.vocab_size.has_value()) {
    return absl::InvalidArgumentError(absl::StrCat(m->path, ": no vocabulary size (",
                                                   config.model_type,
                                                   ".vocab_size, or tokenizer.ggml.tokens)"));
  }
  std::vector<std::string> tokens;
  if (file->Has("tokenizer.ggml.tokens")) {
    KVCM_ASSIGN_OR_RETURN(tokens, file->GetStringArray("tokenizer.ggml.tokens"));
  }
  auto text_of = [&](int32_t id) {
    return id >= 0 && id < static_cast<int32_t>(tokens.size()) ? tokens[static_cast<size_t>(id)]
                                                               : std::string();
  };
  m->tokenizer.vocab_size = *config.vocab_size;
  m->tokenizer.bos_token_id = config.bos_token_id.value_or(-1);
  m->tokenizer.eos_token_ids = config.eos_token_ids;
  const int32_t eos = config.eos_token_ids.empty() ? -1 : config.eos_token_ids.front();
  m->eos_token_ids = m->tokenizer.eos_token_ids;
  if (config.eot_token_id.has_value()) AddId(*config.eot_token_id, &m->eos_token_ids);
  m->bos_token = text_of(m->tokenizer.bos_token_id);
  m->eos_token = text_of(eos);
  if (file->Has("tokenizer.chat_template")) {
    KVCM_ASSIGN_OR_RETURN(m->chat_template, file->GetString("tokenizer.chat_template"));
    m->chat_template_source = absl::StrCat(m->path, " (tokenizer.chat_template)");
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ModelMetadata> ReadModelMetadata(const std::string& path) {
  ModelMetadata m;
  m.path = path;
  std::error_code error;
  if (std::filesystem::is_regular_file(path, error)) {
    KVCM_RETURN_IF_ERROR(ReadGguf(&m));
  } else {
    KVCM_RETURN_IF_ERROR(ReadFolder(&m));
  }
  return m;
}

absl::StatusOr<std::unique_ptr<Tokenizer>> LoadModelTokenizer(const ModelMetadata& metadata) {
  if (!metadata.gguf) return LoadTokenizer(metadata.path, metadata.tokenizer);
  KVCM_ASSIGN_OR_RETURN(const std::unique_ptr<GgufFile> file, GgufFile::Open(metadata.path));
  return LoadGgufTokenizer(*file, metadata.tokenizer);
}

}  // namespace kvcm
