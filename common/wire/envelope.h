#pragma once
// The protocol envelope (schemas/kvcm_protocol.fbs): verifying inbound buffers and finishing
// outbound ones. Shared by the cache manager, its clients and the benchmarks.
//
// Every inbound buffer goes through VerifyEnvelope before a single field is read: size
// limit, FlatBuffers Verifier, file identifier, protocol version. Meaning (ids in range,
// sessions, ownership) is checked by whoever handles the payload.
//
// Thread safety: stateless functions.

#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/wire/message_limits.h"
#include "flatbuffers/flatbuffers.h"
#include "schemas/kvcm_protocol_generated.h"

namespace kvcm {

inline constexpr uint16_t kProtocolVersion = 1;
// Envelope file identifier, as in schemas/kvcm_protocol.fbs.
inline constexpr char kEnvelopeIdentifier[] = "KVCP";
// Verifier limits: tables nested deeper or more numerous than this are refused.
inline constexpr size_t kVerifierMaxDepth = 16;
inline constexpr size_t kVerifierMaxTables = 1u << 20;

// Why an inbound buffer was refused before its payload was read.
enum class EnvelopeFault : uint8_t { kNone, kOversized, kMalformed, kUnsupportedVersion };

// An inbound envelope-shaped root (a table with version(), payload_type() and payload()),
// checked. Shared by every kvcm protocol: Envelope here, ExecutorEnvelope in
// common/wire/executor_codec.h.
template <typename Root>
struct VerifiedRoot {
  const Root* envelope = nullptr;  // non-null iff fault == kNone
  EnvelopeFault fault = EnvelopeFault::kNone;
  std::string reason;  // set when fault != kNone
  // The request id, also when the envelope was refused, as long as the root table and that
  // one field verify: an error reply can then name the request its sender waits for. 0 when
  // not even that holds (the sender cannot be told which request failed).
  uint64_t request_id = 0;
};

// The request id of a buffer that may fail full verification: the file identifier, the
// root offset, the root table's vtable and its request_id field are verified, nothing else.
// 0 when any of them fails.
template <typename Root>
uint64_t PeekRequestId(std::span<const uint8_t> bytes, const char* identifier) {
  if (bytes.size() < 8 || reinterpret_cast<uintptr_t>(bytes.data()) % 8 != 0 ||
      !flatbuffers::BufferHasIdentifier(bytes.data(), identifier)) {
    return 0;
  }
  flatbuffers::Verifier verifier(bytes.data(), bytes.size(), kVerifierMaxDepth, kVerifierMaxTables);
  if (verifier.VerifyOffset(0) == 0) return 0;
  const auto* table = flatbuffers::GetRoot<flatbuffers::Table>(bytes.data());
  if (!table->VerifyTableStart(verifier) ||
      !table->VerifyField<uint64_t>(verifier, Root::VT_REQUEST_ID, 8)) {
    return 0;
  }
  return table->GetField<uint64_t>(Root::VT_REQUEST_ID, 0);
}

// Size limit, file `identifier`, FlatBuffers Verifier (payload union included), protocol
// version, payload present. `bytes` must outlive the returned pointer.
template <typename Root>
VerifiedRoot<Root> VerifyEnvelopeOf(std::span<const uint8_t> bytes, size_t max_bytes,
                                    const char* identifier) {
  VerifiedRoot<Root> out;
  out.request_id = PeekRequestId<Root>(bytes, identifier);
  if (bytes.size() > max_bytes) {
    out.fault = EnvelopeFault::kOversized;
    out.reason = absl::StrCat("message of ", bytes.size(), " bytes exceeds the limit of ",
                              max_bytes, " bytes");
    return out;
  }
  if (bytes.size() < 8 || !flatbuffers::BufferHasIdentifier(bytes.data(), identifier)) {
    out.fault = EnvelopeFault::kMalformed;
    out.reason = absl::StrCat("not a kvcm message (", bytes.size(), " bytes without the ",
                              identifier, " file identifier)");
    return out;
  }
  flatbuffers::Verifier verifier(bytes.data(), bytes.size(), kVerifierMaxDepth, kVerifierMaxTables);
  if (!verifier.VerifyBuffer<Root>(identifier)) {
    out.fault = EnvelopeFault::kMalformed;
    out.reason =
        absl::StrCat("message of ", bytes.size(), " bytes failed FlatBuffers verification");
    return out;
  }
  const Root* root = flatbuffers::GetRoot<Root>(bytes.data());
  if (root->version() != kProtocolVersion) {
    out.fault = EnvelopeFault::kUnsupportedVersion;
    out.reason = absl::StrCat("protocol version ", root->version(),
                              " is not supported (this side speaks ", kProtocolVersion, ")");
    return out;
  }
  if (static_cast<int>(root->payload_type()) == 0 || root->payload() == nullptr) {
    out.fault = EnvelopeFault::kMalformed;
    out.reason = "message has no payload";
    return out;
  }
  out.envelope = root;
  return out;
}

using VerifiedEnvelope = VerifiedRoot<wire::Envelope>;

// VerifyEnvelopeOf for the cache-manager protocol.
inline VerifiedEnvelope VerifyEnvelope(std::span<const uint8_t> bytes,
                                       size_t max_bytes = kDefaultMaxMessageBytes) {
  return VerifyEnvelopeOf<wire::Envelope>(bytes, max_bytes, kEnvelopeIdentifier);
}

// Wraps `payload` (of union type `type`) in an envelope and finishes the buffer with the
// file identifier. The caller then reads builder.GetBufferSpan().
void FinishEnvelope(flatbuffers::FlatBufferBuilder& builder, uint64_t request_id,
                    uint64_t session_id, uint64_t epoch, wire::Message type,
                    flatbuffers::Offset<void> payload);

// A finished envelope holding an ErrorReply.
void FinishErrorReply(flatbuffers::FlatBufferBuilder& builder, uint64_t request_id, uint64_t epoch,
                      wire::ErrorCode code, std::string_view reason);

// absl::Status <-> wire error codes. Codes without a wire equivalent become kInternal-like
// FailedPrecondition on the wire; protocol-only codes map back to the nearest absl code
// (Malformed -> INVALID_ARGUMENT, UnsupportedVersion -> FAILED_PRECONDITION,
// NotRegistered/StaleSession/StaleEpoch -> ABORTED: the client must register again).
wire::ErrorCode ToWireCode(absl::StatusCode code);
absl::Status FromWire(wire::ErrorCode code, std::string_view reason);

// "Ok", "ResourceExhausted", ... (the schema's names).
std::string_view WireCodeName(wire::ErrorCode code);

// Bytes of a finished builder, as a span.
inline std::span<const uint8_t> BufferSpan(const flatbuffers::FlatBufferBuilder& builder) {
  return {builder.GetBufferPointer(), builder.GetSize()};
}

}  // namespace kvcm
