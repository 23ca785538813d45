#pragma once
// VllmConverter: the cache manager's ledger events turned into vLLM-format KV events
// (docs/protocol.md, "vLLM-format KV events"; the values and their encoding are
// vllm_events.h's, the sockets VllmEventPublisher's).
//
// In: the ledger's BlockEvents, one batch at a time (as CacheManagerService::TakeEventBatch
// takes them), and before each batch the token ids the batch's commits carried
// (AddCommitTokens). Out: VllmEvents in the ledger's order (Take):
// - A stored block gives BlockStored with its id, its parent's id (none for a sequence's
//   first block) and its block_size token ids. Consecutive stored blocks of one chain share
//   an event, with ids unique within it (its parent's included).
// - A stored block without its token ids (its commit carried none: a router that does not
//   send them) is left out and counted (blocks_without_tokens), and so is one whose id
//   equals that of a block published and not removed yet (a consumer could not tell them
//   apart). A removal gives BlockRemoved only for a block published and not removed yet,
//   so each published block is removed once; consecutive removals share an event.
// - `cleared` (the first batch of an epoch) puts an AllBlocksCleared before the batch's
//   events, and a kAllCleared event of the ledger gives one in its place; either forgets
//   which blocks were published, so that nothing published before is removed after it.
// Token ids are kept until the end of the next batch: those of blocks that stored nothing
// (indexed already) are then forgotten.
//
// Ids are VllmBlockId(hash, algorithm). Plain values in and out; no I/O.
// Thread safety: none; one thread (the service's) owns it.

#include <cstdint>
#include <span>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "common/block/block_hash.h"
#include "common/block/block_ledger.h"
#include "services/cache_manager/vllm_events.h"

namespace kvcm {

class VllmConverter {
 public:
  // REQUIRES: block_size > 0.
  explicit VllmConverter(int32_t block_size,
                         HashAlgorithm algorithm = kDefaultHashAlgorithm);

  // A commit that succeeded carried `tokens`: the token ids of the last full blocks it
  // committed, block after block, ending at the last full block of
  // `num_committed_tokens`; `block_table` is the sequence's block table after it. Whole
  // blocks only (a remainder is ignored); tokens for more blocks than the commit covers,
  // or than the table holds, are ignored altogether (the service refuses such a step).
  void AddCommitTokens(std::span<const BlockId> block_table, int32_t num_committed_tokens,
                       std::span<const int32_t> tokens);

  // Converts one batch of ledger events (see above); `cleared`: announce AllBlocksCleared
  // first. An empty batch without `cleared` adds nothing but forgets the tokens.
  void AddBatch(std::span<const BlockEvent> events, bool cleared);

  // The events converted since the last call, in order; empty when there were none.
  std::vector<VllmEvent> Take();

  // Stored blocks left out for want of their token ids (or for a clashing id), in all.
  uint64_t blocks_without_tokens() const { return blocks_without_tokens_; }

 private:
  void Clear();

  const size_t block_size_;
  const HashAlgorithm algorithm_;
  // The token ids commits brought, by block, until the end of the next batch.
  absl::flat_hash_map<BlockId, std::vector<int32_t>> commit_tokens_;
  absl::flat_hash_set<uint64_t> stored_;  // ids published and not removed yet
  std::vector<VllmEvent> pending_;        // converted, not taken yet
  uint64_t blocks_without_tokens_ = 0;
};

}  // namespace kvcm
