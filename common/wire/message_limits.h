#pragma once
// The cache-manager protocol's limit on one message, without the generated code that
// envelope.h needs: headers that only name the limit (the cache manager service's options)
// include this one.

#include <cstddef>

namespace kvcm {

// Default cap on one message; a Step of 4096 allocations with hashes stays far below it.
inline constexpr size_t kDefaultMaxMessageBytes = 16u << 20;

}  // namespace kvcm
