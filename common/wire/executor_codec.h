#pragma once
// The executor protocol's codec (schemas/kvcm_executor.fbs): verifying inbound envelopes,
// finishing outbound ones, and converting StepBatch, StepResult and ExecutorHello to and
// from their plain values (common/wire/executor_protocol.h). Shared by kvcm-executor, the router
// and the tests' step driver. No sockets here, and no model: only bytes and values.
//
// Every inbound buffer goes through VerifyExecutorEnvelope before a field is read: size
// limit, file identifier "KVCX", the FlatBuffers Verifier, protocol version, payload
// present. The Decode* functions then check what the schema cannot say (counts, signs);
// whether block ids fit a pool is the service's business.
//
// Thread safety: stateless functions.

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/block/block_ledger.h"
#include "common/memory/pool_memory.h"
#include "common/sizing/kv_cache_spec.h"
#include "common/wire/envelope.h"
#include "common/wire/executor_protocol.h"
#include "flatbuffers/flatbuffers.h"
#include "schemas/kvcm_executor_generated.h"

namespace kvcm {

// File identifier of ExecutorEnvelope, as in schemas/kvcm_executor.fbs.
inline constexpr char kExecutorEnvelopeIdentifier[] = "KVCX";

// An inbound executor-protocol message, checked (common/wire/envelope.h).
using VerifiedExecutorEnvelope = VerifiedRoot<wire::ExecutorEnvelope>;

// Checks `bytes` (which must outlive the returned pointer). On success the payload union has
// been verified and may be read.
inline VerifiedExecutorEnvelope VerifyExecutorEnvelope(std::span<const uint8_t> bytes,
                                                       size_t max_bytes = kDefaultMaxMessageBytes) {
  return VerifyEnvelopeOf<wire::ExecutorEnvelope>(bytes, max_bytes, kExecutorEnvelopeIdentifier);
}

// Wraps `payload` (of union type `type`) in an envelope and finishes the buffer with the file
// identifier; the caller then sends BufferSpan(builder).
void FinishExecutorEnvelope(flatbuffers::FlatBufferBuilder& builder, uint64_t request_id,
                            uint64_t executor_id, uint64_t epoch, wire::ExecutorMessage type,
                            flatbuffers::Offset<void> payload);

// A finished envelope holding an ErrorReply { code, reason }.
void FinishExecutorError(flatbuffers::FlatBufferBuilder& builder, uint64_t request_id,
                         uint64_t executor_id, uint64_t epoch, wire::ErrorCode code,
                         std::string_view reason);

// "StepBatch", "ErrorReply", ... (the schema's names); "NONE" for none.
std::string_view ExecutorMessageName(wire::ExecutorMessage type);

// ---- Steps ----------------------------------------------------------------------------------

// Builds a finished StepBatch envelope (router side).
void EncodeStepBatch(flatbuffers::FlatBufferBuilder& builder, uint64_t request_id,
                     uint64_t executor_id, const StepBatch& step);

// Reads a verified StepBatch. INVALID_ARGUMENT naming the sequence (by index and id) for a
// sequence without new tokens, a context_len smaller than its new tokens, a negative block
// id, a duplicate sequence id, a negative copy id, or non-finite / out-of-range sampling
// parameters (temperature < 0, top_p outside (0, 1], top_k < 0, repetition_penalty <= 0,
// frequency or presence penalty outside [-2, 2]), top_n outside [0, kMaxTopN],
// penalty_prompt_len outside [0, len(penalty_tokens)], a negative penalty token, or more
// than kMaxForkSeeds fork seeds (or any without `sample`).
absl::StatusOr<StepBatch> DecodeStepBatch(const wire::StepBatch& step);

// Builds a finished StepResult envelope (executor side).
void EncodeStepResult(flatbuffers::FlatBufferBuilder& builder, uint64_t request_id,
                      uint64_t executor_id, uint64_t epoch, const StepResult& report);

// Reads a verified StepResult (router side). Codes map back with FromWire.
StepResult DecodeStepResult(const wire::StepResult& result);

// ---- Registration ---------------------------------------------------------------------------

void EncodeExecutorHello(flatbuffers::FlatBufferBuilder& builder, uint64_t request_id,
                         uint64_t executor_id, uint64_t epoch, const ExecutorHello& hello);
// INVALID_ARGUMENT when the model summary or the KV spec is missing or invalid.
absl::StatusOr<ExecutorHello> DecodeExecutorHello(const wire::ExecutorHello& hello);

}  // namespace kvcm
