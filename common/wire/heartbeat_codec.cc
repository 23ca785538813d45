#include "common/wire/heartbeat_codec.h"

#include "common/wire/convert.h"

namespace kvcm {

flatbuffers::Offset<wire::Heartbeat> EncodeHeartbeat(flatbuffers::FlatBufferBuilder& builder,
                                                     std::span<const uint64_t> fence_acks) {
  const auto acks = fence_acks.empty() ? flatbuffers::Offset<flatbuffers::Vector<uint64_t>>()
                                       : builder.CreateVector(fence_acks.data(), fence_acks.size());
  return wire::CreateHeartbeat(builder, acks);
}

std::vector<uint64_t> DecodeHeartbeat(const wire::Heartbeat& heartbeat) {
  return CopyScalars(heartbeat.fence_acks());
}

flatbuffers::Offset<wire::HeartbeatReply> EncodeHeartbeatReply(
    flatbuffers::FlatBufferBuilder& builder, std::span<const FenceNotice> fences) {
  std::vector<wire::Fence> whole;
  std::vector<flatbuffers::Offset<wire::SequenceFence>> scoped;
  for (const FenceNotice& fence : fences) {
    if (fence.seqs.empty()) {
      whole.emplace_back(fence.id, fence.router_session);
    } else {
      scoped.push_back(wire::CreateSequenceFence(builder, fence.id, fence.router_session,
                                                 builder.CreateVector(fence.seqs)));
    }
  }
  const auto whole_vector = builder.CreateVectorOfStructs(whole);
  const auto scoped_vector =
      scoped.empty()
          ? flatbuffers::Offset<flatbuffers::Vector<flatbuffers::Offset<wire::SequenceFence>>>()
          : builder.CreateVector(scoped);
  return wire::CreateHeartbeatReply(builder, whole_vector, scoped_vector);
}

std::vector<FenceNotice> DecodeHeartbeatReply(const wire::HeartbeatReply& reply) {
  std::vector<FenceNotice> fences;
  if (reply.fences() != nullptr) {
    for (const wire::Fence* fence : *reply.fences()) {
      fences.push_back({fence->id(), fence->router_session(), {}});
    }
  }
  if (reply.sequence_fences() != nullptr) {
    for (const wire::SequenceFence* fence : *reply.sequence_fences()) {
      fences.push_back({fence->id(), fence->router_session(), CopyScalars(fence->seqs())});
    }
  }
  return fences;
}

}  // namespace kvcm
