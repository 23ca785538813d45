// A fuzz target for GgufFile::FromBuffer: any bytes must parse or be refused with a status,
// never crash or read out of bounds; every tensor of a file that parses must dequantize
// (when its type is implemented) from the bytes it names.
//
// Built into gguf_fuzz_test (seeded mutations, tests/common/gguf/gguf_fuzz_test.cc) and,
// with clang, into the libFuzzer binary gguf_libfuzzer (tests/common/gguf/CMakeLists.txt).

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>
#include <vector>

#include "common/gguf/ggml_types.h"
#include "common/gguf/gguf_file.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  absl::StatusOr<std::unique_ptr<kvcm::GgufFile>> file = kvcm::GgufFile::FromBuffer("fuzz", bytes);
  if (!file.ok()) return 0;
  // Every getter on every key: a type mismatch is a status, never a crash.
  for (const kvcm::GgufKeyValue& kv : (*file)->metadata()) {
    (void)(*file)->GetString(kv.key);
    (void)(*file)->GetInt(kv.key);
    (void)(*file)->GetFloat(kv.key);
    (void)(*file)->GetBool(kv.key);
    (void)(*file)->GetStringArray(kv.key);
    (void)(*file)->GetIntArray(kv.key);
    (void)(*file)->GetFloatArray(kv.key);
  }
  for (const kvcm::GgufTensorInfo& t : (*file)->tensors()) {
    // The tensor's bytes lie inside the buffer and have the size its dims and type say.
    if (t.data.data() < bytes.data() || t.data.data() + t.data.size() > bytes.data() + size ||
        static_cast<int64_t>(t.data.size()) != t.byte_size) {
      std::abort();
    }
    if ((*file)->FindTensor(t.name).value_or(nullptr) != &t) std::abort();
    if (!kvcm::CanDequantize(t.type)) continue;
    std::vector<float> out(static_cast<size_t>(t.element_count));
    if (!kvcm::Dequantize(t.type, t.data, out).ok()) std::abort();
  }
  return 0;
}
