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
#include "flatbuffers/flatbuffers.h"
#include "schemas/kvcm_protocol_generated.h"

namespace kvcm {

inline constexpr uint16_t kProtocolVersion = 1;
// Envelope file identifier, as in schemas/kvcm_protocol.fbs.
inline constexpr char kEnvelopeIdentifier[] = "KVCP";
// Default cap on one message; a Step of 4096 allocations with hashes stays far below it.
inline constexpr size_t kDefaultMaxMessageBytes = 16u << 20;
// Verifier limits: tables nested deeper or more numerous than this are refused.
inline constexpr size_t kVerifierMaxDepth = 16;
inline constexpr size_t kVerifierMaxTables = 1u << 20;

// Why an inbound buffer was refused before its payload was read.
enum class EnvelopeFault : uint8_t { kNone, kOversized, kMalformed, kUnsupportedVersion };

struct VerifiedEnvelope {
  const wire::Envelope* envelope = nullptr;  // non-null iff fault == kNone
  EnvelopeFault fault = EnvelopeFault::kNone;
  std::string reason;  // set when fault != kNone
};

// Checks `bytes` (which must outlive the returned pointer) and returns the envelope. The
// payload union has been verified too, so its fields may be read (a missing optional field
// still reads as null).
VerifiedEnvelope VerifyEnvelope(std::span<const uint8_t> bytes,
                                size_t max_bytes = kDefaultMaxMessageBytes);

// Wraps `payload` (of union type `type`) in an envelope and finishes the buffer with the
// file identifier. The caller then reads builder.GetBufferSpan().
void FinishEnvelope(flatbuffers::FlatBufferBuilder& builder, uint64_t request_id,
                    uint64_t session_id, uint64_t epoch, wire::Message type,
                    flatbuffers::Offset<void> payload);

// A finished envelope holding an ErrorReply.
void FinishErrorReply(flatbuffers::FlatBufferBuilder& builder, uint64_t request_id,
                      uint64_t epoch, wire::ErrorCode code, std::string_view reason);

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
