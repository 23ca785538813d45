#include "common/wire/envelope.h"

#include "absl/strings/str_cat.h"

namespace kvcm {

void FinishEnvelope(flatbuffers::FlatBufferBuilder& builder, uint64_t request_id,
                    uint64_t session_id, uint64_t epoch, wire::Message type,
                    flatbuffers::Offset<void> payload) {
  wire::EnvelopeBuilder envelope(builder);
  envelope.add_version(kProtocolVersion);
  envelope.add_request_id(request_id);
  envelope.add_session_id(session_id);
  envelope.add_epoch(epoch);
  envelope.add_payload_type(type);
  envelope.add_payload(payload);
  builder.Finish(envelope.Finish(), kEnvelopeIdentifier);
}

void FinishErrorReply(flatbuffers::FlatBufferBuilder& builder, uint64_t request_id, uint64_t epoch,
                      wire::ErrorCode code, std::string_view reason) {
  auto text = builder.CreateString(reason.data(), reason.size());
  auto error = wire::CreateErrorReply(builder, code, text);
  FinishEnvelope(builder, request_id, 0, epoch, wire::Message::ErrorReply, error.Union());
}

wire::ErrorCode ToWireCode(absl::StatusCode code) {
  using C = absl::StatusCode;
  switch (code) {
    case C::kOk:
      return wire::ErrorCode::Ok;
    case C::kInvalidArgument:
      return wire::ErrorCode::InvalidArgument;
    case C::kNotFound:
      return wire::ErrorCode::NotFound;
    case C::kAlreadyExists:
      return wire::ErrorCode::AlreadyExists;
    case C::kPermissionDenied:
      return wire::ErrorCode::PermissionDenied;
    case C::kResourceExhausted:
      return wire::ErrorCode::ResourceExhausted;
    case C::kUnavailable:
      return wire::ErrorCode::Unavailable;
    case C::kOutOfRange:
      return wire::ErrorCode::InvalidArgument;
    default:
      return wire::ErrorCode::FailedPrecondition;
  }
}

absl::Status FromWire(wire::ErrorCode code, std::string_view reason) {
  using E = wire::ErrorCode;
  const std::string text(reason);
  switch (code) {
    case E::Ok:
      return absl::OkStatus();
    case E::InvalidArgument:
      return absl::InvalidArgumentError(text);
    case E::NotFound:
      return absl::NotFoundError(text);
    case E::AlreadyExists:
      return absl::AlreadyExistsError(text);
    case E::PermissionDenied:
      return absl::PermissionDeniedError(text);
    case E::ResourceExhausted:
      return absl::ResourceExhaustedError(text);
    case E::FailedPrecondition:
      return absl::FailedPreconditionError(text);
    case E::Unavailable:
      return absl::UnavailableError(text);
    case E::Malformed:
      return absl::InvalidArgumentError(text);
    case E::UnsupportedVersion:
      return absl::FailedPreconditionError(text);
    case E::NotRegistered:
    case E::StaleSession:
    case E::StaleEpoch:
      return absl::AbortedError(text);
  }
  return absl::UnknownError(
      absl::StrCat("unknown wire error code ", static_cast<int>(code), ": ", text));
}

std::string_view WireCodeName(wire::ErrorCode code) {
  const char* name = wire::EnumNameErrorCode(code);
  return name != nullptr && *name != '\0' ? std::string_view(name) : "Unknown";
}

}  // namespace kvcm
