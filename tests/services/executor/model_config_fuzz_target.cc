// The fuzz target of config.json loading (tests/support/fuzz_target.h): the one reader,
// common/model/model_config.h, under the cache manager's and kvcmctl's SpecFromHfConfig
// (common/sizing/model_config.h) and the executor's ParseLlamaConfig
// (services/executor/model/llama_config.h). Any text is accepted or
// refused with the codes their headers list, never a crash or an exception; an accepted
// config gives a spec that validates, and a Llama config whose heads divide as its header
// promises. Seeds: tests/services/executor/fuzz/model_config/ (real models' config.json).

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/sizing/model_config.h"
#include "services/executor/model/llama_config.h"
#include "tests/support/fuzz_target.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using kvcm::fuzz::Check;
  const std::string text(reinterpret_cast<const char*>(data), size);

  bool sized = true;
  for (const std::optional<kvcm::DType> dtype :
       {std::optional<kvcm::DType>(), std::optional<kvcm::DType>(kvcm::DType::kFloat8E4M3)}) {
    std::vector<std::string> notes;
    absl::StatusOr<kvcm::KvCacheSpec> spec = kvcm::SpecFromHfConfig(text, 16, dtype, &notes);
    if (spec.ok()) {
      Check(spec->Validate().ok(), "an accepted config.json gives a valid spec");
      Check(!dtype.has_value() || spec->dtype == *dtype, "the dtype override is taken");
      (void)spec->BytesPerBlock();
    } else {
      Check(spec.status().code() == absl::StatusCode::kInvalidArgument,
            "SpecFromHfConfig refuses with INVALID_ARGUMENT");
      sized = false;
    }
  }

  absl::StatusOr<kvcm::executor::LlamaConfig> config = kvcm::executor::ParseLlamaConfig(text);
  if (!config.ok()) {
    Check(config.status().code() == absl::StatusCode::kInvalidArgument ||
              config.status().code() == absl::StatusCode::kUnimplemented,
          "ParseLlamaConfig refuses with INVALID_ARGUMENT or UNIMPLEMENTED");
    return 0;
  }
  const kvcm::executor::LlamaConfig& c = *config;
  Check(c.vocab_size > 0 && c.hidden_size > 0 && c.intermediate_size > 0 &&
            c.num_hidden_layers > 0 && c.num_attention_heads > 0 && c.num_key_value_heads > 0 &&
            c.head_dim > 0,
        "an accepted Llama config has positive sizes");
  Check(c.num_attention_heads % c.num_key_value_heads == 0,
        "num_key_value_heads divides num_attention_heads");
  (void)c.ToString();
  absl::StatusOr<kvcm::KvCacheSpec> spec = c.KvSpec(kvcm::DType::kBFloat16, 16);
  if (spec.ok()) Check(spec->Validate().ok(), "LlamaConfig::KvSpec validates");
  if (sized && spec.ok()) kvcm::fuzz::NoteAccepted();
  return 0;
}
