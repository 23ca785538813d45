#include "common/wire/step_codec.h"

#include <algorithm>
#include <string_view>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/wire/convert.h"
#include "common/wire/envelope.h"

namespace kvcm {

BlockOp BlockOp::Allocate(SeqId seq, int32_t num_tokens, std::span<const BlockHash> hashes) {
  BlockOp op;
  op.kind = wire::StepOp::AllocateOp;
  op.seq = seq;
  op.num_tokens = num_tokens;
  op.hashes.assign(hashes.begin(), hashes.end());
  return op;
}

BlockOp BlockOp::Append(SeqId seq, int32_t num_tokens) {
  BlockOp op;
  op.kind = wire::StepOp::AppendOp;
  op.seq = seq;
  op.num_tokens = num_tokens;
  return op;
}

BlockOp BlockOp::Fork(SeqId parent, SeqId child) {
  BlockOp op;
  op.kind = wire::StepOp::ForkOp;
  op.seq = parent;
  op.child = child;
  return op;
}

BlockOp BlockOp::Commit(SeqId seq, int32_t num_committed_tokens,
                        std::span<const BlockHash> new_hashes,
                        std::span<const int32_t> new_block_tokens) {
  BlockOp op;
  op.kind = wire::StepOp::CommitOp;
  op.seq = seq;
  op.num_tokens = num_committed_tokens;
  op.hashes.assign(new_hashes.begin(), new_hashes.end());
  op.tokens.assign(new_block_tokens.begin(), new_block_tokens.end());
  return op;
}

BlockOp BlockOp::Free(SeqId seq, bool drain) {
  BlockOp op;
  op.kind = wire::StepOp::FreeOp;
  op.seq = seq;
  op.drain = drain;
  return op;
}

BlockOp BlockOp::CanAllocate(int32_t num_tokens, std::span<const BlockHash> hashes) {
  BlockOp op;
  op.kind = wire::StepOp::CanAllocateOp;
  op.num_tokens = num_tokens;
  op.hashes.assign(hashes.begin(), hashes.end());
  return op;
}

const char* BlockOpName(wire::StepOp kind) {
  switch (kind) {
    case wire::StepOp::AllocateOp:
      return "allocate";
    case wire::StepOp::AppendOp:
      return "append";
    case wire::StepOp::ForkOp:
      return "fork";
    case wire::StepOp::CommitOp:
      return "commit";
    case wire::StepOp::FreeOp:
      return "free";
    case wire::StepOp::CanAllocateOp:
      return "can_allocate";
    default:
      return "unknown";
  }
}

absl::Status EncodeStep(flatbuffers::FlatBufferBuilder& builder, uint64_t request_id,
                        uint64_t session_id, uint64_t epoch, std::span<const BlockOp> ops) {
  std::vector<wire::StepOp> types;
  std::vector<flatbuffers::Offset<void>> offsets;
  types.reserve(ops.size());
  offsets.reserve(ops.size());
  for (const BlockOp& op : ops) {
    flatbuffers::Offset<void> offset;
    switch (op.kind) {
      case wire::StepOp::AllocateOp:
        offset = wire::CreateAllocateOp(builder, op.seq, op.num_tokens, ToWire(builder, op.hashes))
                     .Union();
        break;
      case wire::StepOp::AppendOp:
        offset = wire::CreateAppendOp(builder, op.seq, op.num_tokens).Union();
        break;
      case wire::StepOp::ForkOp:
        offset = wire::CreateForkOp(builder, op.seq, op.child).Union();
        break;
      case wire::StepOp::CommitOp: {
        const auto hashes = ToWire(builder, op.hashes);
        flatbuffers::Offset<flatbuffers::Vector<int32_t>> tokens;
        if (!op.tokens.empty()) tokens = builder.CreateVector(op.tokens);
        offset = wire::CreateCommitOp(builder, op.seq, op.num_tokens, hashes, tokens).Union();
        break;
      }
      case wire::StepOp::FreeOp:
        offset = wire::CreateFreeOp(builder, op.seq, op.drain).Union();
        break;
      case wire::StepOp::CanAllocateOp:
        offset =
            wire::CreateCanAllocateOp(builder, op.num_tokens, ToWire(builder, op.hashes)).Union();
        break;
      default:
        return absl::InvalidArgumentError(absl::StrCat("step op ", types.size(), " has no kind"));
    }
    types.push_back(op.kind);
    offsets.push_back(offset);
  }
  const auto step =
      wire::CreateStep(builder, builder.CreateVector(types), builder.CreateVector(offsets));
  FinishEnvelope(builder, request_id, session_id, epoch, wire::Message::Step, step.Union());
  return absl::OkStatus();
}

absl::Status DecodeStep(const wire::Step& step, const StepLimits& limits,
                        std::vector<BlockOp>* ops) {
  const auto* wire_ops = step.ops();
  const auto* types = step.ops_type();
  const size_t n = wire_ops == nullptr ? 0 : wire_ops->size();
  if ((types == nullptr ? 0 : types->size()) != n) {
    return absl::DataLossError("step op types and ops differ in length");
  }
  if (limits.max_ops > 0 && n > static_cast<size_t>(limits.max_ops)) {
    return absl::ResourceExhaustedError(
        absl::StrCat("step of ", n, " ops exceeds the limit of ", limits.max_ops));
  }
  ops->resize(n);
  int64_t hashes = 0;
  for (size_t i = 0; i < n; ++i) {
    const auto index = static_cast<flatbuffers::uoffset_t>(i);
    const auto kind = static_cast<wire::StepOp>(types->Get(index));
    const void* raw = wire_ops->Get(index);
    if (raw == nullptr) return absl::DataLossError(absl::StrCat("op ", i, " is empty"));
    BlockOp& op = (*ops)[i];
    op.kind = kind;
    op.seq = 0;
    op.child = 0;
    op.num_tokens = 0;
    op.drain = false;
    op.tokens.clear();
    const WireHashVector* wire_hashes = nullptr;
    const flatbuffers::Vector<int32_t>* wire_tokens = nullptr;
    switch (kind) {
      case wire::StepOp::AllocateOp: {
        const auto* a = static_cast<const wire::AllocateOp*>(raw);
        op.seq = a->seq();
        op.num_tokens = a->num_tokens();
        wire_hashes = a->block_hashes();
        break;
      }
      case wire::StepOp::AppendOp: {
        const auto* a = static_cast<const wire::AppendOp*>(raw);
        op.seq = a->seq();
        op.num_tokens = a->num_tokens();
        break;
      }
      case wire::StepOp::ForkOp: {
        const auto* f = static_cast<const wire::ForkOp*>(raw);
        op.seq = f->parent();
        op.child = f->child();
        break;
      }
      case wire::StepOp::CommitOp: {
        const auto* c = static_cast<const wire::CommitOp*>(raw);
        op.seq = c->seq();
        op.num_tokens = c->num_committed_tokens();
        wire_hashes = c->new_block_hashes();
        wire_tokens = c->new_block_tokens();
        break;
      }
      case wire::StepOp::FreeOp: {
        const auto* f = static_cast<const wire::FreeOp*>(raw);
        op.seq = f->seq();
        op.drain = f->drain();
        break;
      }
      case wire::StepOp::CanAllocateOp: {
        const auto* c = static_cast<const wire::CanAllocateOp*>(raw);
        op.num_tokens = c->num_tokens();
        wire_hashes = c->block_hashes();
        break;
      }
      default:
        return absl::DataLossError(
            absl::StrCat("op ", i, " has unknown type ", static_cast<int>(kind)));
    }
    hashes += static_cast<int64_t>(HashCount(wire_hashes));
    if (wire_tokens != nullptr) {
      const int64_t block_size = std::max(limits.block_size, 1);
      hashes += (static_cast<int64_t>(wire_tokens->size()) + block_size - 1) / block_size;
    }
    if (limits.max_hashes > 0 && hashes > limits.max_hashes) {
      return absl::ResourceExhaustedError(
          absl::StrCat("step carries more than ", limits.max_hashes, " block hashes"));
    }
    FromWire(wire_hashes, &op.hashes);
    if (wire_tokens != nullptr) op.tokens.assign(wire_tokens->begin(), wire_tokens->end());
  }
  return absl::OkStatus();
}

flatbuffers::Offset<wire::OpResult> EncodeOpOutcome(flatbuffers::FlatBufferBuilder& builder,
                                                    const OpOutcome& outcome) {
  flatbuffers::Offset<flatbuffers::String> reason;
  if (!outcome.status.ok()) {
    const absl::string_view message = outcome.status.message();
    reason = builder.CreateString(message.data(), message.size());
  }
  flatbuffers::Offset<flatbuffers::Vector<int32_t>> blocks;
  if (!outcome.blocks.empty()) blocks = builder.CreateVector(outcome.blocks);
  flatbuffers::Offset<flatbuffers::Vector<int32_t>> group_blocks;
  if (!outcome.group_blocks.empty()) group_blocks = builder.CreateVector(outcome.group_blocks);
  flatbuffers::Offset<flatbuffers::Vector<const wire::CopyOrder*>> copies;
  if (!outcome.copies.empty()) {
    wire::CopyOrder* out = nullptr;
    copies = builder.CreateUninitializedVectorOfStructs(outcome.copies.size(), &out);
    for (const CopyOrder& copy : outcome.copies) *out++ = wire::CopyOrder(copy.src, copy.dst);
  }
  wire::OpResultBuilder result(builder);
  result.add_code(ToWireCode(outcome.status.code()));
  if (!outcome.status.ok()) result.add_reason(reason);
  if (!outcome.blocks.empty()) result.add_blocks(blocks);
  if (outcome.num_cached_tokens != 0) result.add_num_cached_tokens(outcome.num_cached_tokens);
  if (outcome.blocks_needed != 0) result.add_blocks_needed(outcome.blocks_needed);
  if (outcome.host_tokens != 0) result.add_host_tokens(outcome.host_tokens);
  if (outcome.disk_tokens != 0) result.add_disk_tokens(outcome.disk_tokens);
  if (!outcome.copies.empty()) result.add_copies(copies);
  if (!outcome.group_blocks.empty()) result.add_group_blocks(group_blocks);
  return result.Finish();
}

flatbuffers::Offset<wire::OpResult> OpResultWriter::Add(const OpOutcome& outcome) {
  const bool empty_ok = outcome.status.ok() && outcome.blocks.empty() && outcome.copies.empty() &&
                        outcome.group_blocks.empty() && outcome.num_cached_tokens == 0 &&
                        outcome.blocks_needed == 0 && outcome.host_tokens == 0 &&
                        outcome.disk_tokens == 0;
  if (!empty_ok) return EncodeOpOutcome(builder_, outcome);
  if (empty_ok_.IsNull()) empty_ok_ = EncodeOpOutcome(builder_, outcome);
  return empty_ok_;
}

absl::StatusOr<std::vector<OpOutcome>> DecodeStepReply(const wire::StepReply& reply,
                                                       size_t expected_ops) {
  const auto* results = reply.results();
  const size_t count = results == nullptr ? 0 : results->size();
  if (count != expected_ops) {
    return absl::InternalError(absl::StrCat("cache manager protocol error: StepReply has ", count,
                                            " results for ", expected_ops, " ops"));
  }
  std::vector<OpOutcome> outcomes(count);
  for (size_t i = 0; i < count; ++i) {
    const wire::OpResult* result = results->Get(static_cast<flatbuffers::uoffset_t>(i));
    OpOutcome& outcome = outcomes[i];
    outcome.status =
        FromWire(result->code(), result->reason() == nullptr ? std::string_view()
                                                             : result->reason()->string_view());
    if (const auto* blocks = result->blocks(); blocks != nullptr) {
      outcome.blocks.assign(blocks->begin(), blocks->end());
    }
    outcome.num_cached_tokens = result->num_cached_tokens();
    outcome.blocks_needed = result->blocks_needed();
    outcome.host_tokens = result->host_tokens();
    outcome.disk_tokens = result->disk_tokens();
    if (const auto* group_blocks = result->group_blocks(); group_blocks != nullptr) {
      outcome.group_blocks.assign(group_blocks->begin(), group_blocks->end());
    }
    if (const auto* copies = result->copies(); copies != nullptr) {
      outcome.copies.reserve(copies->size());
      for (const wire::CopyOrder* copy : *copies) {
        outcome.copies.push_back(CopyOrder{copy->src(), copy->dst()});
      }
    }
  }
  return outcomes;
}

}  // namespace kvcm
