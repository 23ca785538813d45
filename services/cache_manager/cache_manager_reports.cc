// CacheManagerService's reports (docs/architecture.md, "Cache manager"): Attach, Stats,
// BlockMap and the event snapshot and batches, with what they count (the blocks held apart
// from the ledger's own states). The requests that change state are in
// cache_manager_service.cc.

#include <algorithm>
#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/base/check.h"
#include "common/wire/attach_codec.h"
#include "common/wire/block_map_codec.h"
#include "common/wire/convert.h"
#include "common/wire/envelope.h"
#include "common/wire/event_codec.h"
#include "common/wire/stats_codec.h"
#include "flatbuffers/flatbuffers.h"
#include "schemas/kvcm_protocol_generated.h"
#include "services/cache_manager/cache_manager_service.h"
#include "services/cache_manager/session_roles.h"

namespace kvcm::cache_manager {

CacheManagerService::HeldBlocks CacheManagerService::BlocksHeldApart() const {
  HeldBlocks held;
  for (const auto& [block, state] : HeldApartList()) {
    ++(state == MapState::kQuarantined ? held.quarantined : held.draining);
  }
  return held;
}

std::vector<std::pair<BlockId, MapState>> CacheManagerService::HeldApartList() const {
  struct Refs {
    int32_t quarantined = 0;
    int32_t draining = 0;
  };
  absl::flat_hash_map<BlockId, Refs> refs;
  auto count = [&](SeqId seq, int32_t Refs::*field) {
    // Every KV cache group's blocks: the sequence holds them all.
    auto tables = ledger_.BlockTables(seq);
    KVCM_CHECK(tables.ok()) << tables.status().ToString();
    for (const std::vector<BlockId>& table : tables->groups) {
      for (BlockId block : table) {
        if (block != kNoBlock) ++(refs[block].*field);
      }
    }
  };
  absl::flat_hash_set<uint64_t> quarantined;
  for (const auto& [id, session] : sessions_.sessions()) {
    if (session.quarantined && session.num_seqs > 0) quarantined.insert(id);
  }
  if (!quarantined.empty()) {
    ledger_.ForEachSequence([&](SeqId seq, uint64_t owner) {
      if (owner != 0 && quarantined.contains(owner)) count(seq, &Refs::quarantined);
    });
  }
  for (const auto& [id, fence] : fences_.fences()) {
    for (SeqId seq : fence.seqs) count(seq, &Refs::draining);
  }
  std::vector<std::pair<BlockId, MapState>> held;
  for (const auto& [block, r] : refs) {
    if (r.quarantined + r.draining != ledger_.RefCount(block)) continue;
    held.emplace_back(block, r.quarantined > 0 ? MapState::kQuarantined : MapState::kDraining);
  }
  std::sort(held.begin(), held.end());
  return held;
}

void CacheManagerService::HandleBlockMap(const wire::Envelope& envelope,
                                         flatbuffers::FlatBufferBuilder* reply) {
  const wire::BlockMap* request = envelope.payload_as_BlockMap();
  const int32_t max_cells = BlockMapCellsFor(request == nullptr ? 0 : request->max_cells());
  ledger_.FillBlockMap(max_cells, HeldApartList(), &block_map_);
  const auto payload = EncodeBlockMapReply(*reply, block_map_);
  FinishEnvelope(*reply, envelope.request_id(), envelope.session_id(), options_.epoch,
                 wire::Message::BlockMapReply, payload.Union());
}

void CacheManagerService::HandleAttach(const wire::Envelope& envelope,
                                       flatbuffers::FlatBufferBuilder* reply) {
  const PoolExport& pool = options_.pool;
  PoolDescriptorInfo descriptor;
  descriptor.spec = options_.spec;
  descriptor.num_blocks = ledger_.num_blocks();
  descriptor.layout = pool.layout;
  descriptor.backend = pool.backend;
  descriptor.epoch = options_.epoch;
  descriptor.fd_channel_path = pool.fd_channel_path;
  descriptor.cuda_device = pool.cuda_device;
  descriptor.cuda_ipc_handle = pool.cuda_ipc_handle;
  descriptor.sliding_window_tokens = options_.ledger.sliding_window_tokens;
  descriptor.kv_groups = options_.kv_groups.groups;
  auto payload = EncodeAttachReply(*reply, descriptor);
  FinishEnvelope(*reply, envelope.request_id(), envelope.session_id(), options_.epoch,
                 wire::Message::AttachReply, payload.Union());
}

void CacheManagerService::HandleStats(const wire::Envelope& envelope, absl::Time now,
                                      flatbuffers::FlatBufferBuilder* reply) {
  const LedgerStats stats = ledger_.Stats();
  std::vector<uint64_t> ids;
  ids.reserve(static_cast<size_t>(sessions_.size()));
  for (const auto& [id, session] : sessions_.sessions()) ids.push_back(id);
  std::sort(ids.begin(), ids.end());
  // A session id is all that binds a tcp:// session: a peer that has not proven who it is
  // (no kernel credentials, no secret) gets the list with every id 0, so that it cannot
  // act as another session.
  const Session* asker = sessions_.Find(envelope.session_id());
  const bool show_ids = asker != nullptr && asker->authenticated;
  StatsSnapshot out;
  out.session_list.reserve(ids.size());
  for (uint64_t id : ids) {
    const Session& session = *sessions_.Find(id);
    out.session_list.push_back({show_ids ? id : 0, WireRoleOf(session.role), session.pid,
                                session.pid_verified, session.name, session.quarantined,
                                session.num_seqs,
                                static_cast<int32_t>(session.pending_fences.size())});
  }
  out.num_blocks = stats.num_blocks;
  out.block_size = stats.block_size;
  out.free_blocks = stats.free_blocks;
  out.in_use_blocks = stats.in_use_blocks;
  out.cached_blocks = stats.cached_blocks;
  out.pinned_blocks = stats.pinned_blocks;
  const HeldBlocks held = BlocksHeldApart();
  out.quarantined_blocks = held.quarantined;
  out.draining_blocks = held.draining;
  out.open_fences = static_cast<uint32_t>(fences_.size());
  out.live_sequences = stats.live_sequences;
  out.usage_ratio = stats.usage_ratio;
  out.occupancy_ratio = stats.occupancy_ratio;
  out.prefix_query_tokens = stats.prefix_query_tokens;
  out.prefix_hit_tokens = stats.prefix_hit_tokens;
  out.blocks_allocated = stats.blocks_allocated;
  out.blocks_released = stats.blocks_released;
  out.evictions = stats.evictions;
  out.allocation_failures = stats.allocation_failures;
  out.cow_copies = stats.cow_copies;
  out.epoch = options_.epoch;
  out.sessions = static_cast<uint32_t>(sessions_.size());
  out.events_published = events_published_;
  out.backend = PoolBackendFromWire(options_.pool.backend);
  out.pool_bytes = options_.pool.layout.total_bytes;
  out.block_bytes = static_cast<uint64_t>(options_.spec.BytesPerBlock());
  out.spec = options_.spec;
  out.uptime_seconds = absl::ToDoubleSeconds(now - start_time_);
  out.rejected_messages = rejected_messages_;
  out.events_endpoint = options_.events_endpoint;
  out.metrics_url = options_.metrics_url;
  if (const TierCoordinator* coordinator = tier_coordinator(); coordinator != nullptr) {
    const tiers::TierSnapshot t = coordinator->tiers().Snapshot();
    for (int i = 0; i < tiers::kNumTiers; ++i) {
      if (t.slots[i] == 0) continue;  // a tier that is off
      out.tiers.push_back({std::string(tiers::TierName(static_cast<tiers::Tier>(i))), t.slots[i],
                           t.ready[i], t.writing[i], t.counters.stored[i], t.counters.loaded[i],
                           t.counters.evicted[i]});
    }
    out.tier_held_blocks = coordinator->held_blocks();
    out.tier_loading_blocks = coordinator->loading_blocks();
    for (const uint64_t refused : t.counters.refused) out.tier_refusals_total += refused;
    out.tier_recovered_blocks = t.counters.recovered;
  }
  auto payload = EncodeStatsReply(*reply, out);
  FinishEnvelope(*reply, envelope.request_id(), envelope.session_id(), options_.epoch,
                 wire::Message::StatsReply, payload.Union());
}

CacheManagerSnapshot CacheManagerService::Snapshot() const {
  CacheManagerSnapshot snapshot;
  snapshot.ledger = ledger_.Stats();
  // O(groups): counters the ledger keeps, no table read (a snapshot follows every change).
  const std::vector<uint64_t> released = ledger_.WindowReleasedByGroup();
  const std::vector<int64_t> held_by_group = ledger_.HeldBlocksByGroup();
  for (size_t g = 0; g < released.size(); ++g) {
    const int32_t window = ledger_.num_groups() == 1 ? options_.ledger.sliding_window_tokens
                                                     : ledger_.group_windows()[g];
    snapshot.groups.push_back({window, released[g], held_by_group[g]});
  }
  const HeldBlocks held = BlocksHeldApart();
  snapshot.quarantined_blocks = held.quarantined;
  snapshot.draining_blocks = held.draining;
  snapshot.open_fences = fences_.size();
  for (const auto& [id, session] : sessions_.sessions()) {
    ++snapshot.sessions_by_role[static_cast<size_t>(session.role)];
  }
  snapshot.epoch = options_.epoch;
  snapshot.events_published = events_published_;
  if (const TierCoordinator* tiers = tier_coordinator(); tiers != nullptr) {
    snapshot.tiers = tiers->tiers().Snapshot();
    snapshot.tier_held_blocks = tiers->held_blocks();
    snapshot.tier_loading_blocks = tiers->loading_blocks();
  }
  return snapshot;
}

std::vector<std::pair<tiers::Tier, double>> CacheManagerService::TakeTierLoadSeconds() {
  if (tiers_ == nullptr) return {};
  return tiers_->tiers().TakeLoadSeconds();
}

uint64_t CacheManagerService::TakeEventBatch(flatbuffers::FlatBufferBuilder* out) {
  std::vector<BlockEvent> events = ledger_.TakeEvents();
  if (!pending_events_.empty()) {
    events.insert(events.begin(), pending_events_.begin(), pending_events_.end());
    pending_events_.clear();
  }
  // Even an empty batch: the commits' token ids are not kept past it.
  if (options_.vllm_events) {
    vllm_.AddBatch(events, announce_cleared_);
    if (tiers_ != nullptr) vllm_.AddTierEvents(tiers_->tiers().TakeEvents());
  }
  if (events.empty() && !announce_cleared_) return 0;
  out->Clear();
  KvEventBatch batch;
  batch.events.reserve(events.size() + 1);
  if (announce_cleared_) {
    batch.events.push_back({.kind = KvEventKind::kAllBlocksCleared});
    announce_cleared_ = false;
  }
  for (const BlockEvent& event : events) {
    switch (event.kind) {
      case BlockEvent::Kind::kStored:
        batch.events.push_back({.kind = KvEventKind::kBlockStored,
                                .hash = event.hash,
                                .parent_hash = event.has_parent ? event.parent_hash : BlockHash(),
                                .block = event.block,
                                .has_parent = event.has_parent});
        break;
      case BlockEvent::Kind::kRemoved:
        batch.events.push_back(
            {.kind = KvEventKind::kBlockRemoved, .hash = event.hash, .block = event.block});
        break;
      case BlockEvent::Kind::kAllCleared:
        batch.events.push_back({.kind = KvEventKind::kAllBlocksCleared});
        break;
    }
  }
  batch.seq = ++event_seq_;
  batch.epoch = options_.epoch;
  out->Finish(EncodeEventBatch(*out, batch));
  events_published_ += batch.events.size();
  return batch.seq;
}

void CacheManagerService::HandleEventSnapshot(const wire::Envelope& envelope,
                                              flatbuffers::FlatBufferBuilder* reply) {
  EventSnapshot snapshot;
  snapshot.seq = event_seq_;
  snapshot.epoch = options_.epoch;
  // The epoch's first batch cleared the subscribers' mirrors before any could connect: a
  // late subscriber learns it here.
  snapshot.events.push_back({.kind = KvEventKind::kAllBlocksCleared});
  for (const auto& [block, hash] : ledger_.IndexedBlocks()) {
    snapshot.events.push_back({.kind = KvEventKind::kBlockStored, .hash = hash, .block = block});
  }
  auto payload = EncodeEventSnapshotReply(*reply, snapshot);
  FinishEnvelope(*reply, envelope.request_id(), envelope.session_id(), options_.epoch,
                 wire::Message::EventSnapshotReply, payload.Union());
}

}  // namespace kvcm::cache_manager
