#pragma once
// The cache-manager protocol's Step (schemas/kvcm_protocol.fbs: Step, StepOp, StepReply) as
// plain values, and the one codec between them and the wire. The client encodes ops and
// decodes outcomes; the cache manager decodes ops, then validates and applies them on the
// plain values, and encodes outcomes; the benchmark and the tests use the same functions.
//
//   std::vector<BlockOp> ops = {BlockOp::Allocate(1, 40, hashes), BlockOp::Append(7, 1)};
//   EncodeStep(builder, request_id, session_id, epoch, ops);          // router side
//   KVCM_RETURN_IF_ERROR(DecodeStep(*envelope.payload_as_Step(), limits, &ops));  // server
//
// Thread safety: stateless functions.

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/block/block_hash.h"
#include "common/block/block_ledger.h"
#include "flatbuffers/flatbuffers.h"
#include "schemas/kvcm_protocol_generated.h"

namespace kvcm {

// One op of a Step. Only the fields of its kind are meaningful; the others stay zero.
// Laid out without padding holes (72 bytes): the cache manager decodes a Step's ops into
// a vector of them, which a request after a context switch finds cold.
struct BlockOp {
  SeqId seq = 0;           // Allocate, Append, Commit, Free; Fork: the parent
  SeqId child = 0;         // Fork
  int32_t num_tokens = 0;  // Allocate, CanAllocate: prompt tokens; Append: more
                           // tokens; Commit: tokens whose KV is written
  wire::StepOp kind = wire::StepOp::NONE;
  bool drain = false;             // Free
  std::vector<BlockHash> hashes;  // Allocate, CanAllocate: leading full blocks; Commit: new
                                  // full blocks
  // Commit, when the cache manager wants them (HelloReply.wants_commit_tokens): the token
  // ids of the last full blocks committed (those the commit completes), block_size each,
  // block after block, the last ending at num_tokens' last full block; otherwise empty.
  std::vector<int32_t> tokens;

  static BlockOp Allocate(SeqId seq, int32_t num_tokens, std::span<const BlockHash> hashes = {});
  static BlockOp Append(SeqId seq, int32_t num_tokens);
  static BlockOp Fork(SeqId parent, SeqId child);
  static BlockOp Commit(SeqId seq, int32_t num_committed_tokens,
                        std::span<const BlockHash> new_hashes = {},
                        std::span<const int32_t> new_block_tokens = {});
  static BlockOp Free(SeqId seq, bool drain = false);
  static BlockOp CanAllocate(int32_t num_tokens, std::span<const BlockHash> hashes = {});
  friend bool operator==(const BlockOp&, const BlockOp&) = default;
};

// The outcome of one op (OpResult), in op order.
struct OpOutcome {
  // OK, or the op's own failure while running, typically RESOURCE_EXHAUSTED (not enough
  // free or evictable blocks now). A failed op changed nothing.
  absl::Status status;
  // Allocate: the whole block table; Append: the new blocks only; otherwise empty.
  std::vector<BlockId> blocks;
  // Allocate: leading tokens whose KV was already cached (a multiple of the block size);
  // CanAllocate: those that would be.
  int32_t num_cached_tokens = 0;
  // CanAllocate: new blocks the allocation would take.
  int32_t blocks_needed = 0;
  // Allocate with tiers: prefix tokens the host and disk tiers hold beyond the pool (being
  // loaded, when the status is UNAVAILABLE), or that were loaded from them (OK).
  int32_t host_tokens = 0;
  int32_t disk_tokens = 0;
  // Append: copy each order's src into its dst before the step that writes dst.
  std::vector<CopyOrder> copies;
  // With KV cache groups (SessionInfo::group_windows), Allocate and Append: groups 1..'s
  // blocks, each as many as `blocks` (group 0's), one after another.
  std::vector<BlockId> group_blocks;
};

// "allocate", "append", ... for messages; "unknown" outside the union.
const char* BlockOpName(wire::StepOp kind);

// Builds a finished Step envelope. INVALID_ARGUMENT for an op without a kind (the builder
// is then unusable for this message).
absl::Status EncodeStep(flatbuffers::FlatBufferBuilder& builder, uint64_t request_id,
                        uint64_t session_id, uint64_t epoch, std::span<const BlockOp> ops);

// What DecodeStep refuses before copying more.
struct StepLimits {
  int32_t max_ops = 0;     // 0: unbounded
  int64_t max_hashes = 0;  // in all ops together; 0: unbounded
  int32_t block_size = 1;  // tokens per block, to count a Commit's token ids as blocks
};

// Replaces `ops` with the verified Step's ops (reusing their storage). DATA_LOSS for a
// malformed step (op types and ops of different lengths, an empty op, a type outside the
// union); RESOURCE_EXHAUSTED for more ops or hashes than `limits` allow (a Commit's token ids
// count as hashes, one per block_size tokens, rounded up, with `limits.block_size`). Values are not
// judged here: whether a sequence is live or a count fits the pool is the service's call.
absl::Status DecodeStep(const wire::Step& step, const StepLimits& limits,
                        std::vector<BlockOp>* ops);

// Appends one OpResult for `outcome` to `builder` (before the reply's root is started).
flatbuffers::Offset<wire::OpResult> EncodeOpOutcome(flatbuffers::FlatBufferBuilder& builder,
                                                    const OpOutcome& outcome);

// The OpResults of one StepReply, as EncodeOpOutcome writes them, except that every result
// that is OK and carries nothing (most of a decode step: a Commit, an Append that fits its
// last block) is one table shared by all of them: a vector of tables may hold an offset more
// than once, and a reader sees equal results. Building a table was most of the cost of a
// reply (docs/PERFORMANCE.md, "The router's step shape").
class OpResultWriter {
 public:
  // For one reply in `builder`; a new reply needs a new writer.
  explicit OpResultWriter(flatbuffers::FlatBufferBuilder& builder) : builder_(builder) {}
  flatbuffers::Offset<wire::OpResult> Add(const OpOutcome& outcome);

 private:
  flatbuffers::FlatBufferBuilder& builder_;
  flatbuffers::Offset<wire::OpResult> empty_ok_;  // 0 until the first such result
};

// The outcomes of a verified StepReply; INTERNAL ("protocol error") when it holds another
// number of results than `expected_ops`.
absl::StatusOr<std::vector<OpOutcome>> DecodeStepReply(const wire::StepReply& reply,
                                                       size_t expected_ops);

}  // namespace kvcm
