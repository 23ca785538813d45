#pragma once
// Helpers shared by common/gguf/gguf_file.cc and common/gguf/gguf_writer.cc; not part of
// the library's interface.

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "common/base/utf8.h"  // IsValidUtf8, for both files
#include "common/gguf/gguf_file.h"

namespace kvcm::gguf_internal {

// Whether `type` is a GgufValueType.
bool IsValueType(uint32_t type);
// The fewest bytes a value of `type` takes in a file (a string's length, an array's type
// and count).
size_t MinEncodedSize(GgufValueType type);
// `s` in single quotes for a message, non-printable bytes escaped, cut after 200 bytes.
std::string Quoted(std::string_view s);

}  // namespace kvcm::gguf_internal
