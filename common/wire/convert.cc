#include "common/wire/convert.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/base/check.h"

namespace kvcm {

static_assert(sizeof(wire::BlockHash) == sizeof(BlockHash));

wire::DType ToWire(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return wire::DType::Float32;
    case DType::kFloat16:
      return wire::DType::Float16;
    case DType::kBFloat16:
      return wire::DType::BFloat16;
    case DType::kFloat8E4M3:
      return wire::DType::Float8E4M3;
    case DType::kFloat8E5M2:
      return wire::DType::Float8E5M2;
  }
  return wire::DType::Float32;
}

absl::StatusOr<DType> FromWire(wire::DType dtype) {
  switch (dtype) {
    case wire::DType::Float32:
      return DType::kFloat32;
    case wire::DType::Float16:
      return DType::kFloat16;
    case wire::DType::BFloat16:
      return DType::kBFloat16;
    case wire::DType::Float8E4M3:
      return DType::kFloat8E4M3;
    case wire::DType::Float8E5M2:
      return DType::kFloat8E5M2;
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown dtype value ", static_cast<int>(dtype)));
}

wire::HashAlgorithm ToWire(HashAlgorithm algorithm) {
  switch (algorithm) {
    case HashAlgorithm::kSha256:
      return wire::HashAlgorithm::Sha256;
    case HashAlgorithm::kFast128:
      return wire::HashAlgorithm::Fast128;
    case HashAlgorithm::kXxh3:
      return wire::HashAlgorithm::Xxh3;
    case HashAlgorithm::kVllmSha256Cbor:
      return wire::HashAlgorithm::VllmSha256Cbor;
    case HashAlgorithm::kXxh3V2:
      return wire::HashAlgorithm::Xxh3V2;
  }
  KVCM_CHECK(false) << "unknown hash algorithm " << static_cast<int>(algorithm);
  return wire::HashAlgorithm::Sha256;
}

absl::StatusOr<HashAlgorithm> FromWire(wire::HashAlgorithm algorithm) {
  switch (algorithm) {
    case wire::HashAlgorithm::Sha256:
      return HashAlgorithm::kSha256;
    case wire::HashAlgorithm::Fast128:
      return HashAlgorithm::kFast128;
    case wire::HashAlgorithm::Xxh3:
      return HashAlgorithm::kXxh3;
    case wire::HashAlgorithm::VllmSha256Cbor:
      return HashAlgorithm::kVllmSha256Cbor;
    case wire::HashAlgorithm::Xxh3V2:
      return HashAlgorithm::kXxh3V2;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown hash algorithm value ", static_cast<int>(algorithm)));
}

flatbuffers::Offset<wire::KvCacheSpec> ToWire(flatbuffers::FlatBufferBuilder& builder,
                                              const KvCacheSpec& spec) {
  return wire::CreateKvCacheSpec(builder, static_cast<uint32_t>(spec.num_layers),
                                 static_cast<uint32_t>(spec.num_kv_heads),
                                 static_cast<uint32_t>(spec.head_dim), ToWire(spec.dtype),
                                 static_cast<uint32_t>(spec.block_size));
}

absl::StatusOr<KvCacheSpec> FromWire(const wire::KvCacheSpec* spec) {
  if (spec == nullptr) return absl::InvalidArgumentError("KV cache spec is missing");
  constexpr uint32_t kMax = 1u << 30;
  if (spec->num_layers() > kMax || spec->num_kv_heads() > kMax || spec->head_dim() > kMax ||
      spec->block_size() > kMax) {
    return absl::InvalidArgumentError("KV cache spec has a dimension above 2^30");
  }
  KvCacheSpec out;
  out.num_layers = static_cast<int32_t>(spec->num_layers());
  out.num_kv_heads = static_cast<int32_t>(spec->num_kv_heads());
  out.head_dim = static_cast<int32_t>(spec->head_dim());
  out.block_size = static_cast<int32_t>(spec->block_size());
  auto dtype = FromWire(spec->dtype());
  if (!dtype.ok()) return dtype.status();
  out.dtype = *dtype;
  if (absl::Status valid = out.Validate(); !valid.ok()) return valid;
  return out;
}

flatbuffers::Offset<WireHashVector> ToWire(flatbuffers::FlatBufferBuilder& builder,
                                           std::span<const BlockHash> hashes) {
  wire::BlockHash* data = nullptr;
  auto vector = builder.CreateUninitializedVectorOfStructs(hashes.size(), &data);
  if (!hashes.empty()) {
    std::memcpy(static_cast<void*>(data), hashes.data(), hashes.size_bytes());
  }
  return vector;
}

BlockHash FromWire(const wire::BlockHash& hash) {
  BlockHash out;
  std::memcpy(out.bytes.data(), hash.bytes()->Data(), out.bytes.size());
  return out;
}

void FromWire(const WireHashVector* hashes, std::vector<BlockHash>* out) {
  out->clear();
  if (hashes == nullptr || hashes->size() == 0) return;
  out->resize(hashes->size());
  std::memcpy(out->data(), hashes->Data(), hashes->size() * sizeof(BlockHash));
}

}  // namespace kvcm
