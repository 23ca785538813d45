// The fuzz target of GgufFile::FromBuffer (tests/support/fuzz_target.h): any bytes parse or
// are refused with INVALID_ARGUMENT, never a crash or a read out of bounds; every getter on
// every key of a file that parses returns a value or a status; every tensor's bytes lie
// inside the buffer with the size its dims and type say, and dequantize when the type is
// implemented. Seeds: tests/common/gguf/fuzz/gguf/ (make_seeds.py).

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "common/gguf/ggml_types.h"
#include "common/gguf/gguf_file.h"
#include "tests/support/fuzz_target.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using kvcm::fuzz::Check;
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  absl::StatusOr<std::unique_ptr<kvcm::GgufFile>> file = kvcm::GgufFile::FromBuffer("fuzz", bytes);
  if (!file.ok()) {
    Check(file.status().code() == absl::StatusCode::kInvalidArgument,
          "a refused file is INVALID_ARGUMENT");
    return 0;
  }
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
    Check(t.data.data() >= bytes.data() && t.data.data() + t.data.size() <= bytes.data() + size,
          "a tensor's bytes lie inside the buffer");
    Check(static_cast<int64_t>(t.data.size()) == t.byte_size, "a tensor's byte size is its own");
    Check((*file)->FindTensor(t.name).value_or(nullptr) == &t, "FindTensor finds each tensor");
    if (!kvcm::CanDequantize(t.type)) continue;
    std::vector<float> out(static_cast<size_t>(t.element_count));
    Check(kvcm::Dequantize(t.type, t.data, out).ok(), "a parsed tensor dequantizes");
  }
  kvcm::fuzz::NoteAccepted();
  return 0;
}
