#pragma once
// VllmConverter: the cache manager's ledger events and its tiers' events turned into
// vLLM-format KV events (docs/protocol.md, "vLLM-format KV events"; the values and their
// encoding are vllm_events.h's, the sockets VllmEventPublisher's).
//
// In: the ledger's BlockEvents, one batch at a time (as CacheManagerService::TakeEventBatch
// takes them), and before each batch the token ids the batch's commits carried
// (AddCommitTokens); after it, the host and disk tiers' TierEvents (AddTierEvents), which
// carry their blocks' tokens. Out: VllmEvents in that order (Take), each naming its medium:
// the pool's (GPU for a cuda pool, CPU for a shm pool), CPU for the host tier, DISK for the
// disk tier. A block is announced stored in a medium when the first place of that medium
// gains it and removed when the last one loses it: beside a shm pool, pool and host tier are
// both CPU, and a block evicted from the pool that the host tier keeps stays announced.
// - A stored block gives BlockStored with its id, its parent's id (none for a sequence's
//   first block) and its block_size token ids. Consecutive stored blocks of one chain share
//   an event, with ids unique within it (its parent's included).
// - A stored block without its token ids (its commit carried none: a router that does not
//   send them; a block loaded from a tier takes those the tier announced it with) is left
//   out and counted (blocks_without_tokens), and so is one whose id
//   equals that of a block published and not removed yet (a consumer could not tell them
//   apart). A removal gives BlockRemoved only for a block published and not removed yet
//   (in that medium), so each published block is removed once; consecutive removals of one
//   medium share an event.
// - `cleared` (the first batch of an epoch) puts an AllBlocksCleared before the batch's
//   events, and a kAllCleared event of the ledger gives one in its place; either forgets
//   which blocks were published, so that nothing published before is removed after it.
// Token ids are kept until the end of the next batch: those of blocks that stored nothing
// (indexed already) are then forgotten.
//
// KV cache groups (docs/architecture.md, "The hybrid KV cache"; docs/protocol.md,
// "vLLM-format KV events"): constructed with the groups' windows, every event names its
// group (VllmEvent::group), as vLLM's do for a hybrid model. The ledger indexes group g > 0
// under GroupBlockHash(h, g), which no consumer can compute; vLLM publishes the plain hash h
// with the group's index. So AddGroupedCommitTokens learns, beside a position's tokens, its
// plain hash h (and its parent's), and expects group g's block there under the ledger's
// hash GroupBlockHash(h, g); that block is published as (VllmBlockId(h), g), remembered
// under the ledger's hash so that its removal names the same id and group. A stored block
// whose plain hash was not learned (no tokens) is left out as one without tokens.
//
// Ids are VllmBlockId(hash, algorithm). Plain values in and out; no I/O.
// Thread safety: none; one thread (the service's) owns it.

#include <cstdint>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/functional/function_ref.h"
#include "common/block/block_hash.h"
#include "common/block/block_ledger.h"
#include "services/cache_manager/tiers/kv_tiers.h"
#include "services/cache_manager/vllm_events.h"

namespace kvcm::cache_manager {

class VllmConverter {
 public:
  // REQUIRES: block_size > 0. `pool_medium`: the pool's (kGpu for a cuda pool, kCpu for shm).
  // `group_windows`: with KV cache groups, each group's window (0 = full attention); empty
  // without groups (no event names a group).
  explicit VllmConverter(int32_t block_size, HashAlgorithm algorithm = kDefaultHashAlgorithm,
                         VllmMedium pool_medium = VllmMedium::kGpu,
                         std::vector<int32_t> group_windows = {});

  // A commit that succeeded carried `tokens`: the token ids of the last full blocks it
  // committed, block after block, ending at the last full block of
  // `num_committed_tokens`; `block_table` is the sequence's block table after it. Whole
  // blocks only (a remainder is ignored); tokens for more blocks than the commit covers,
  // or than the table holds, are ignored altogether (the service refuses such a step).
  void AddCommitTokens(std::span<const BlockId> block_table, int32_t num_committed_tokens,
                       std::span<const int32_t> tokens);

  // With groups, in place of AddCommitTokens: `table` is group 0's table after the commit
  // and `plain_hash_of(b)` the hash group 0's block b is indexed under (nullopt if none):
  // the plain hash of its position, which every group's block there is published with.
  // Each group g's block of a position is known by its ledger hash, GroupBlockHash(plain, g),
  // so that a block its window released in the same commit is published too. A position
  // whose plain hash (or its parent's) is unknown (group 0 released it: a model without
  // full attention) gives nothing.
  void AddGroupedCommitTokens(std::span<const BlockId> table, int32_t num_committed_tokens,
                              std::span<const int32_t> tokens,
                              absl::FunctionRef<std::optional<BlockHash>(BlockId)> plain_hash_of);

  // Converts one batch of ledger events (see above); `cleared`: announce AllBlocksCleared
  // first. An empty batch without `cleared` adds nothing but forgets the tokens.
  void AddBatch(std::span<const BlockEvent> events, bool cleared);

  // Converts the tiers' events (tiers::KvTiers::TakeEvents), in order. A stored block
  // without block_size token ids is counted in blocks_without_tokens and left out.
  void AddTierEvents(std::span<const tiers::TierEvent> events);

  // The token ids the last commits brought for pool block `block` (AddCommitTokens), until
  // the end of the next batch; null when none did.
  const std::vector<int32_t>* CommitTokens(BlockId block) const;

  // The events converted since the last call, in order; empty when there were none.
  std::vector<VllmEvent> Take();

  // Stored blocks left out for want of their token ids (or for a clashing id), in all.
  uint64_t blocks_without_tokens() const { return blocks_without_tokens_; }

 private:
  // The places a block can be, one bit each in Published::places.
  enum Place : uint8_t { kPool = 1, kHostTier = 2, kDiskTier = 4 };
  struct Published {
    BlockHash hash;      // the hash the id was published for
    uint8_t places = 0;  // where it is now
    // Its token ids: a block a tier loads back into the pool is committed by the cache
    // manager, with no tokens of a router's, and announced with these.
    std::vector<int32_t> tokens;
  };

  // A stored block's published identity: its id, the id of its parent (none for a first
  // block) and its group (-1 without groups).
  struct Origin {
    int32_t group = -1;
    uint64_t id = 0;
    std::optional<uint64_t> parent_id;
  };
  // What published_ is keyed by: the id and the group (-1 without groups).
  using Key = std::pair<uint64_t, int32_t>;

  void Clear();
  // The key `hash` (a ledger's or tier's hash) was published under, or would be without
  // groups.
  Key KeyOf(const BlockHash& hash) const;
  // The ledger's kStored: with groups, under the origin its commit taught.
  void StorePoolBlock(const BlockEvent& event);
  VllmMedium MediumOf(Place place) const;
  // The places of `places` whose medium is `medium`.
  uint8_t PlacesOf(uint8_t places, VllmMedium medium) const;
  // `hash` gained `place`: a BlockStored of the place's medium unless another place of that
  // medium holds it already. False (nothing changed) when `tokens` are not one block's or
  // the id is published for another hash.
  bool Store(Place place, const BlockHash& hash, const BlockHash* parent,
             std::span<const int32_t> tokens);
  // The same for a block published as `origin` says.
  bool StoreAs(Place place, const BlockHash& hash, const Origin& origin,
               std::span<const int32_t> tokens);
  // `hash` lost `place`: a BlockRemoved when no place of the medium holds it any more.
  void Remove(Place place, const BlockHash& hash);

  const size_t block_size_;
  const HashAlgorithm algorithm_;
  const VllmMedium pool_medium_;
  const std::vector<int32_t> group_windows_;  // empty without groups
  // The token ids commits brought, by block, until the end of the next batch.
  absl::flat_hash_map<BlockId, std::vector<int32_t>> commit_tokens_;
  // With groups: what the last commits taught of each block they brought tokens for, by its
  // ledger hash, until the end of the next batch.
  struct GroupedCommit {
    Origin origin;
    std::vector<int32_t> tokens;
  };
  absl::flat_hash_map<BlockHash, GroupedCommit, BlockHashHasher> commit_origins_;
  // By id and group, while some place holds it.
  absl::flat_hash_map<Key, Published> published_;
  // With groups: the key each published block's ledger hash is published under.
  absl::flat_hash_map<BlockHash, Key, BlockHashHasher> keys_;
  std::vector<VllmEvent> pending_;  // converted, not taken yet
  uint64_t blocks_without_tokens_ = 0;
};

}  // namespace kvcm::cache_manager
