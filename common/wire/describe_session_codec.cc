#include "common/wire/describe_session_codec.h"

#include <utility>

namespace kvcm {

flatbuffers::Offset<wire::DescribeSessionReply> EncodeDescribeSessionReply(
    flatbuffers::FlatBufferBuilder& builder, const SessionSnapshot& snapshot) {
  std::vector<flatbuffers::Offset<wire::SequenceState>> states;
  states.reserve(snapshot.sequences.size());
  for (const SequenceSnapshot& seq : snapshot.sequences) {
    const auto blocks = builder.CreateVector(seq.blocks);
    flatbuffers::Offset<flatbuffers::Vector<int32_t>> group_blocks;
    if (!seq.group_blocks.empty()) group_blocks = builder.CreateVector(seq.group_blocks);
    states.push_back(wire::CreateSequenceState(builder, seq.seq, seq.num_tokens,
                                               seq.num_committed_tokens, blocks, group_blocks));
  }
  const auto vector = builder.CreateVector(states);
  return wire::CreateDescribeSessionReply(builder, vector, snapshot.last_step_request_id);
}

SessionSnapshot DecodeDescribeSessionReply(const wire::DescribeSessionReply& reply) {
  SessionSnapshot out;
  out.last_step_request_id = reply.last_step_request_id();
  if (const auto* sequences = reply.sequences(); sequences != nullptr) {
    out.sequences.reserve(sequences->size());
    for (const wire::SequenceState* state : *sequences) {
      SequenceSnapshot seq;
      seq.seq = state->seq();
      seq.num_tokens = state->num_tokens();
      seq.num_committed_tokens = state->num_committed_tokens();
      if (state->blocks() != nullptr) {
        seq.blocks.assign(state->blocks()->begin(), state->blocks()->end());
      }
      if (state->group_blocks() != nullptr) {
        seq.group_blocks.assign(state->group_blocks()->begin(), state->group_blocks()->end());
      }
      out.sequences.push_back(std::move(seq));
    }
  }
  return out;
}

}  // namespace kvcm
