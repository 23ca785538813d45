#include "common/wire/hello_codec.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/wire/convert.h"

namespace kvcm {

flatbuffers::Offset<wire::Hello> EncodeHello(flatbuffers::FlatBufferBuilder& builder,
                                             const HelloRequest& hello) {
  const auto name = builder.CreateString(hello.name);
  const auto secret = hello.secret.empty() ? flatbuffers::Offset<flatbuffers::String>()
                                           : builder.CreateString(hello.secret);
  return wire::CreateHello(builder, hello.role, hello.pid, name, secret);
}

HelloRequest DecodeHello(const wire::Hello& hello) {
  HelloRequest out;
  out.role = hello.role();
  out.pid = hello.pid();
  if (hello.name() != nullptr) out.name = hello.name()->str();
  if (hello.secret() != nullptr) out.secret = hello.secret()->str();
  return out;
}

flatbuffers::Offset<wire::HelloReply> EncodeHelloReply(flatbuffers::FlatBufferBuilder& builder,
                                                       const SessionInfo& info) {
  return wire::CreateHelloReply(
      builder, info.session_id, info.epoch,
      static_cast<uint32_t>(absl::ToInt64Milliseconds(info.heartbeat_interval)),
      static_cast<uint32_t>(absl::ToInt64Milliseconds(info.heartbeat_timeout)), info.num_blocks,
      info.block_size, ToWire(info.hash_algorithm), info.max_ops_per_step, info.max_message_bytes,
      info.wants_commit_tokens, info.tiers, info.sliding_window_tokens,
      info.group_windows.empty() ? 0 : builder.CreateVector(info.group_windows));
}

absl::StatusOr<SessionInfo> DecodeHelloReply(const wire::HelloReply& reply) {
  if (reply.session_id() == 0 || reply.epoch() == 0) {
    return absl::InternalError("HelloReply without a session id or epoch");
  }
  SessionInfo info;
  info.session_id = reply.session_id();
  info.epoch = reply.epoch();
  info.heartbeat_interval = absl::Milliseconds(reply.heartbeat_interval_ms());
  info.heartbeat_timeout = absl::Milliseconds(reply.heartbeat_timeout_ms());
  info.num_blocks = reply.num_blocks();
  info.block_size = reply.block_size();
  absl::StatusOr<HashAlgorithm> algorithm = FromWire(reply.hash_algorithm());
  if (!algorithm.ok()) return absl::InternalError(algorithm.status().message());
  info.hash_algorithm = *algorithm;
  info.max_ops_per_step = reply.max_ops_per_step();
  info.max_message_bytes = reply.max_message_bytes();
  info.wants_commit_tokens = reply.wants_commit_tokens();
  info.tiers = reply.tiers();
  if (reply.sliding_window_tokens() < 0) {
    return absl::InternalError(
        absl::StrCat("HelloReply with sliding_window_tokens ", reply.sliding_window_tokens()));
  }
  info.sliding_window_tokens = reply.sliding_window_tokens();
  if (const auto* windows = reply.group_windows(); windows != nullptr) {
    for (int32_t window : *windows) {
      if (window < 0) {
        return absl::InternalError(absl::StrCat("HelloReply with a group window of ", window));
      }
      info.group_windows.push_back(window);
    }
  }
  return info;
}

}  // namespace kvcm
