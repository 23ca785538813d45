#pragma once
// A byte-level BPE tokenizer.json for the tiny models, whose prompts get no BOS, as
// SmolLM2's (its GGUF says add_bos_token false): the ids are the byte tokenizer's (<unk>,
// <s>, </s>, then byte b as 3 + b), so executors, which read no tokenizer, run the same
// model. An empty text is then a prompt of no tokens, which the router must refuse. Test
// support only (header only; its user links kvcm_tokenizer).

#include <fstream>
#include <string>

#include "common/tokenizer/byte_level.h"
#include "nlohmann/json.hpp"

namespace kvcm::testing {

// Writes tokenizer.json and tokenizer_config.json (add_bos_token false) into `dir`.
inline void WriteByteTokenizerWithoutBos(const std::string& dir) {
  nlohmann::json vocab = nlohmann::json::object();
  nlohmann::json added = nlohmann::json::array();
  const char* const specials[] = {"<unk>", "<s>", "</s>"};
  for (int id = 0; id < 3; ++id) {
    vocab[specials[id]] = id;
    added.push_back({{"id", id},
                     {"content", specials[id]},
                     {"special", true},
                     {"lstrip", false},
                     {"rstrip", false},
                     {"single_word", false},
                     {"normalized", false}});
  }
  for (int b = 0; b < 256; ++b) {
    std::string spelled;
    internal::ByteLevelEncode(std::string(1, static_cast<char>(b)), &spelled);
    vocab[spelled] = 3 + b;
  }
  const nlohmann::json tokenizer = {
      {"version", "1.0"},
      {"added_tokens", added},
      {"normalizer", nullptr},
      {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
      {"post_processor", {{"type", "ByteLevel"}}},
      {"decoder", {{"type", "ByteLevel"}}},
      {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", nlohmann::json::array()}}}};
  std::ofstream(dir + "/tokenizer.json") << tokenizer.dump();
  std::ofstream(dir + "/tokenizer_config.json") << nlohmann::json{
      {"add_bos_token", false},
      {"bos_token", "<s>"},
      {"eos_token", "</s>"}}.dump();
}

}  // namespace kvcm::testing
