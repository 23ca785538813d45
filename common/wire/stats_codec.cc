#include "common/wire/stats_codec.h"

#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/wire/convert.h"

namespace kvcm {

wire::PoolBackend PoolBackendToWire(PoolBackend backend) {
  return backend == PoolBackend::kCuda ? wire::PoolBackend::Cuda : wire::PoolBackend::Shm;
}

PoolBackend PoolBackendFromWire(wire::PoolBackend backend) {
  return backend == wire::PoolBackend::Cuda ? PoolBackend::kCuda : PoolBackend::kShm;
}

flatbuffers::Offset<wire::StatsReply> EncodeStatsReply(flatbuffers::FlatBufferBuilder& builder,
                                                       const StatsSnapshot& s) {
  const auto spec = ToWire(builder, s.spec);
  const auto events_endpoint = builder.CreateString(s.events_endpoint);
  const auto metrics_url = builder.CreateString(s.metrics_url);
  std::vector<flatbuffers::Offset<wire::SessionSummary>> summaries;
  summaries.reserve(s.session_list.size());
  for (const SessionListing& listing : s.session_list) {
    summaries.push_back(
        wire::CreateSessionSummary(builder, listing.session_id, listing.role, listing.pid,
                                   listing.pid_verified, builder.CreateString(listing.name),
                                   listing.quarantined, listing.sequences, listing.pending_fences));
  }
  const auto session_list = builder.CreateVector(summaries);
  flatbuffers::Offset<flatbuffers::Vector<flatbuffers::Offset<wire::TierStats>>> tiers;
  if (!s.tiers.empty()) {
    std::vector<flatbuffers::Offset<wire::TierStats>> tier_stats;
    tier_stats.reserve(s.tiers.size());
    for (const TierListing& tier : s.tiers) {
      tier_stats.push_back(wire::CreateTierStats(
          builder, builder.CreateString(tier.name), tier.capacity_blocks, tier.ready_blocks,
          tier.writing_blocks, tier.stored_total, tier.loaded_total, tier.evicted_total));
    }
    tiers = builder.CreateVector(tier_stats);
  }
  wire::StatsReplyBuilder out(builder);
  out.add_session_list(session_list);
  if (!tiers.IsNull()) out.add_tiers(tiers);
  out.add_tier_held_blocks(s.tier_held_blocks);
  out.add_tier_loading_blocks(s.tier_loading_blocks);
  out.add_tier_refusals_total(s.tier_refusals_total);
  out.add_tier_recovered_blocks(s.tier_recovered_blocks);
  out.add_num_blocks(s.num_blocks);
  out.add_block_size(s.block_size);
  out.add_free_blocks(s.free_blocks);
  out.add_in_use_blocks(s.in_use_blocks);
  out.add_cached_blocks(s.cached_blocks);
  out.add_pinned_blocks(s.pinned_blocks);
  out.add_quarantined_blocks(s.quarantined_blocks);
  out.add_draining_blocks(s.draining_blocks);
  out.add_open_fences(s.open_fences);
  out.add_live_sequences(s.live_sequences);
  out.add_usage_ratio(s.usage_ratio);
  out.add_occupancy_ratio(s.occupancy_ratio);
  out.add_prefix_query_tokens(s.prefix_query_tokens);
  out.add_prefix_hit_tokens(s.prefix_hit_tokens);
  out.add_blocks_allocated(s.blocks_allocated);
  out.add_blocks_released(s.blocks_released);
  out.add_evictions(s.evictions);
  out.add_allocation_failures(s.allocation_failures);
  out.add_cow_copies(s.cow_copies);
  out.add_epoch(s.epoch);
  out.add_sessions(s.sessions);
  out.add_events_published(s.events_published);
  out.add_backend(PoolBackendToWire(s.backend));
  out.add_pool_bytes(s.pool_bytes);
  out.add_block_bytes(s.block_bytes);
  out.add_spec(spec);
  out.add_uptime_seconds(s.uptime_seconds);
  out.add_rejected_messages(s.rejected_messages);
  out.add_events_endpoint(events_endpoint);
  out.add_metrics_url(metrics_url);
  return out.Finish();
}

absl::StatusOr<StatsSnapshot> DecodeStatsReply(const wire::StatsReply& r) {
  StatsSnapshot s;
  s.num_blocks = r.num_blocks();
  s.block_size = r.block_size();
  s.free_blocks = r.free_blocks();
  s.in_use_blocks = r.in_use_blocks();
  s.cached_blocks = r.cached_blocks();
  s.pinned_blocks = r.pinned_blocks();
  s.quarantined_blocks = r.quarantined_blocks();
  s.draining_blocks = r.draining_blocks();
  s.open_fences = r.open_fences();
  s.live_sequences = r.live_sequences();
  s.usage_ratio = r.usage_ratio();
  s.occupancy_ratio = r.occupancy_ratio();
  s.prefix_query_tokens = r.prefix_query_tokens();
  s.prefix_hit_tokens = r.prefix_hit_tokens();
  s.blocks_allocated = r.blocks_allocated();
  s.blocks_released = r.blocks_released();
  s.evictions = r.evictions();
  s.allocation_failures = r.allocation_failures();
  s.cow_copies = r.cow_copies();
  s.epoch = r.epoch();
  s.sessions = r.sessions();
  s.events_published = r.events_published();
  s.backend = PoolBackendFromWire(r.backend());
  s.pool_bytes = r.pool_bytes();
  s.block_bytes = r.block_bytes();
  if (r.spec() != nullptr) {
    absl::StatusOr<KvCacheSpec> spec = FromWire(r.spec());
    if (!spec.ok()) {
      return absl::InternalError(absl::StrCat("StatsReply: ", spec.status().message()));
    }
    s.spec = *std::move(spec);
  }
  s.uptime_seconds = r.uptime_seconds();
  s.rejected_messages = r.rejected_messages();
  if (r.events_endpoint() != nullptr) s.events_endpoint = r.events_endpoint()->str();
  if (r.metrics_url() != nullptr) s.metrics_url = r.metrics_url()->str();
  if (const auto* list = r.session_list(); list != nullptr) {
    s.session_list.reserve(list->size());
    for (const wire::SessionSummary* summary : *list) {
      SessionListing listing;
      listing.session_id = summary->session_id();
      listing.role = summary->role();
      listing.pid = summary->pid();
      listing.pid_verified = summary->pid_verified();
      if (summary->name() != nullptr) listing.name = summary->name()->str();
      listing.quarantined = summary->quarantined();
      listing.sequences = summary->sequences();
      listing.pending_fences = summary->pending_fences();
      s.session_list.push_back(std::move(listing));
    }
  }
  if (const auto* tiers = r.tiers(); tiers != nullptr) {
    s.tiers.reserve(tiers->size());
    for (const wire::TierStats* tier : *tiers) {
      TierListing listing;
      if (tier->name() != nullptr) listing.name = tier->name()->str();
      listing.capacity_blocks = tier->capacity_blocks();
      listing.ready_blocks = tier->ready_blocks();
      listing.writing_blocks = tier->writing_blocks();
      listing.stored_total = tier->stored_total();
      listing.loaded_total = tier->loaded_total();
      listing.evicted_total = tier->evicted_total();
      s.tiers.push_back(std::move(listing));
    }
  }
  s.tier_held_blocks = r.tier_held_blocks();
  s.tier_loading_blocks = r.tier_loading_blocks();
  s.tier_refusals_total = r.tier_refusals_total();
  s.tier_recovered_blocks = r.tier_recovered_blocks();
  return s;
}

}  // namespace kvcm
