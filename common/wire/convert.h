#pragma once
// Conversions between the library types (common/block, common/sizing) and their wire
// forms in schemas/. Inbound conversions validate: a peer's buffer has passed the
// Verifier, but its values are still untrusted.
//
// Thread safety: stateless functions.

#include <cstring>
#include <span>
#include <type_traits>
#include <vector>

#include "absl/status/statusor.h"
#include "common/block/block_hash.h"
#include "common/sizing/kv_cache_spec.h"
#include "flatbuffers/flatbuffers.h"
#include "schemas/kvcm_protocol_generated.h"

namespace kvcm {

using WireHashVector = flatbuffers::Vector<const wire::BlockHash*>;

wire::DType ToWire(DType dtype);
// INVALID_ARGUMENT for a value outside the enum.
absl::StatusOr<DType> FromWire(wire::DType dtype);

wire::HashAlgorithm ToWire(HashAlgorithm algorithm);
absl::StatusOr<HashAlgorithm> FromWire(wire::HashAlgorithm algorithm);

flatbuffers::Offset<wire::KvCacheSpec> ToWire(flatbuffers::FlatBufferBuilder& builder,
                                              const KvCacheSpec& spec);
// INVALID_ARGUMENT when absent or when KvCacheSpec::Validate() fails.
absl::StatusOr<KvCacheSpec> FromWire(const wire::KvCacheSpec* spec);

flatbuffers::Offset<WireHashVector> ToWire(flatbuffers::FlatBufferBuilder& builder,
                                           std::span<const BlockHash> hashes);
BlockHash FromWire(const wire::BlockHash& hash);

// Replaces `out` with the hashes in `hashes` (null reads as empty).
void FromWire(const WireHashVector* hashes, std::vector<BlockHash>* out);
inline size_t HashCount(const WireHashVector* hashes) {
  return hashes == nullptr ? 0 : hashes->size();
}

// The elements of a verified vector of scalars (null reads as empty), copied byte by byte.
// The FlatBuffers Verifier checks a vector's length prefix (4-byte aligned) but not that
// 8-byte elements are 8-byte aligned, so a peer's [uint64] may be misaligned, and reading
// it through the vector is a misaligned load (undefined behaviour). Found by the executor
// fuzz target (docs/RELIABILITY.md, "Fuzzing").
template <typename T>
std::vector<T> CopyScalars(const flatbuffers::Vector<T>* values) {
  static_assert(std::is_arithmetic_v<T>);
  static_assert(FLATBUFFERS_LITTLEENDIAN, "the wire is little-endian: copying needs no swap");
  std::vector<T> out(values == nullptr ? 0 : values->size());
  if (!out.empty()) std::memcpy(out.data(), values->Data(), out.size() * sizeof(T));
  return out;
}

}  // namespace kvcm
