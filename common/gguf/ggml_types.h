#pragma once
// ggml's tensor types (the element encodings of GGUF tensors) and their conversion to and
// from float32.
//
//   GgmlType      ggml's numbering (ggml.h's enum ggml_type, gguf's GGMLQuantizationType);
//                 the values are what a GGUF tensor info stores.
//   GgmlTypeName  "F32", "Q4_K", ...; GgmlTypeTraits: elements per block, bytes per block.
//   Dequantize    a row of blocks to float32, exactly ggml's reference dequantize_row_*
//                 (the same float32 operations in the same order, fp16 scales converted
//                 exactly), so the floats are bitwise those of ggml and of the `gguf`
//                 Python package's gguf.quants.dequantize.
//   Quantize      float32 to blocks, exactly ggml's quantize_row_*_ref (the same bytes as
//                 gguf.quants.quantize) for the inputs those accept: finite floats.
//
// A quantized type packs `block_size` consecutive elements into `type_size` bytes (a
// 32-element Q4_0 block is an fp16 scale and 16 bytes of 4-bit values); float types have
// blocks of one element. A row of a tensor (ne[0] elements) is a whole number of blocks.
//
// Errors: INVALID_ARGUMENT when dst (src for Quantize) is not a multiple of the block size
// or the byte side is not exactly its size in blocks; UNIMPLEMENTED naming the type for a
// type without a conversion here; INVALID_ARGUMENT for a number that is not a ggml type.
//
// Thread safety: all functions are pure and may run concurrently.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace kvcm {

enum class GgmlType : uint32_t {
  kF32 = 0,
  kF16 = 1,
  kQ4_0 = 2,
  kQ4_1 = 3,
  // 4 and 5 were Q4_2 and Q4_3, removed from ggml.
  kQ5_0 = 6,
  kQ5_1 = 7,
  kQ8_0 = 8,
  kQ8_1 = 9,
  kQ2_K = 10,
  kQ3_K = 11,
  kQ4_K = 12,
  kQ5_K = 13,
  kQ6_K = 14,
  kQ8_K = 15,
  kIQ2_XXS = 16,
  kIQ2_XS = 17,
  kIQ3_XXS = 18,
  kIQ1_S = 19,
  kIQ4_NL = 20,
  kIQ3_S = 21,
  kIQ2_S = 22,
  kIQ4_XS = 23,
  kI8 = 24,
  kI16 = 25,
  kI32 = 26,
  kI64 = 27,
  kF64 = 28,
  kIQ1_M = 29,
  kBF16 = 30,
  // 31..33 were Q4_0_4_4, Q4_0_4_8, Q4_0_8_8, removed from ggml.
  kTQ1_0 = 34,
  kTQ2_0 = 35,
  // 36..38 were IQ4_NL_4_4, IQ4_NL_4_8, IQ4_NL_8_8, removed from ggml.
  kMXFP4 = 39,
  kNVFP4 = 40,
  kQ1_0 = 41,
};

struct GgmlTypeTraits {
  const char* name;    // ggml's name: "F32", "Q4_K", ...
  int64_t block_size;  // elements per block
  int64_t type_size;   // bytes per block
};

// The traits of `type`; nullopt when it is not a ggml type (a number read from a file).
std::optional<GgmlTypeTraits> GetGgmlTypeTraits(GgmlType type);
// ggml's name of `type`, or "type N" when it is not a ggml type.
std::string GgmlTypeName(GgmlType type);

// Whether Dequantize / Quantize implement `type`.
bool CanDequantize(GgmlType type);
bool CanQuantize(GgmlType type);

// Decodes blocks of `type` in `src` into `dst` (dst.size() elements, a multiple of the
// block size; src exactly dst.size() / block_size * type_size bytes). Implemented for F32,
// F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K.
absl::Status Dequantize(GgmlType type, std::span<const std::byte> src, std::span<float> dst);

// Encodes `src` (a multiple of the block size) as blocks of `type` into `dst` (exactly its
// size in bytes). Implemented for F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1.
absl::Status Quantize(GgmlType type, std::span<const float> src, std::span<std::byte> dst);

// The bytes `element_count` elements of `type` take; INVALID_ARGUMENT when the count is
// negative or not a multiple of the block size, or the type is not a ggml type.
absl::StatusOr<int64_t> TypeBytes(GgmlType type, int64_t element_count);

// F16 and BF16 elements convert with common/base/float16.h: FloatFromHalf,
// FloatFromBFloat16 (exact), HalfFromFloatKeepingNanPayload (round to nearest even, overflow
// to infinity, NaN payload kept, as F16C's vcvtps2ph and numpy's astype(float16) do) and
// BFloat16FromFloat (ggml's ggml_compute_fp32_to_bf16: round to nearest even, NaN made quiet).

}  // namespace kvcm
