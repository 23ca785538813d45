#include "services/executor/kv_groups.h"

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/sizing/kv_cache_groups.h"

namespace kvcm::executor {
namespace {

std::string Describe(const KvCacheGroup& group) {
  return absl::StrCat(group.window == 0 ? "full attention" : absl::StrCat("window ", group.window),
                      " (layers ", absl::StrJoin(group.layers, ", "), ")");
}

absl::Status Mismatch(const std::string& what, const KvCacheGroups& model) {
  return absl::FailedPreconditionError(
      absl::StrCat(what, "; the model's KV cache groups are ", model.ToString(),
                   ": start the cache manager with the model's config.json (--model-config)"));
}

}  // namespace

absl::Status CheckPoolGroups(const PoolView& pool, std::span<const int32_t> layer_windows) {
  if (pool.kv_groups.empty()) return absl::OkStatus();
  if (pool.sliding_window_tokens != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the pool has KV cache groups and also releases blocks behind a pool-wide sliding "
        "window of ",
        pool.sliding_window_tokens, " tokens; with groups each group's window decides"));
  }
  absl::StatusOr<KvCacheGroups> model = GroupLayers(layer_windows);
  if (!model.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("the pool has KV cache groups but the model's layers make none: ",
                     model.status().message()));
  }
  if (pool.kv_groups.size() != model->groups.size()) {
    return Mismatch(
        absl::StrCat("the pool has ", pool.kv_groups.size(),
                     " KV cache groups but the model's layers make ", model->num_groups()),
        *model);
  }
  for (size_t g = 0; g < model->groups.size(); ++g) {
    if (pool.kv_groups[g] != model->groups[g]) {
      return Mismatch(
          absl::StrCat("KV cache group ", g, " of the pool is ", Describe(pool.kv_groups[g]),
                       " but the model's is ", Describe(model->groups[g])),
          *model);
    }
  }
  if (pool.spec.num_layers != model->group_size) {
    return Mismatch(
        absl::StrCat("the pool's pages hold ", pool.spec.num_layers,
                     " layer slots but the model's KV cache groups have ", model->group_size),
        *model);
  }
  return absl::OkStatus();
}

std::vector<LayerPlace> PlaceLayers(const PoolView& pool, int32_t num_layers) {
  std::vector<LayerPlace> places(static_cast<size_t>(num_layers));
  if (pool.kv_groups.empty()) {
    for (int32_t l = 0; l < num_layers; ++l) places[static_cast<size_t>(l)].pool_layer = l;
    return places;
  }
  for (size_t g = 0; g < pool.kv_groups.size(); ++g) {
    const std::vector<int32_t>& layers = pool.kv_groups[g].layers;
    for (size_t slot = 0; slot < layers.size(); ++slot) {
      places[static_cast<size_t>(layers[slot])] = {static_cast<int32_t>(g),
                                                   static_cast<int32_t>(slot)};
    }
  }
  return places;
}

std::vector<int64_t> WriteSlots(std::span<const int32_t> query_lens,
                                std::span<const int32_t> context_lens, const int32_t* tables,
                                int32_t max_blocks, int32_t block_size) {
  std::vector<int64_t> slots;
  for (size_t i = 0; i < query_lens.size(); ++i) {
    const int32_t* table = tables + static_cast<int64_t>(i) * max_blocks;
    for (int32_t p = context_lens[i] - query_lens[i]; p < context_lens[i]; ++p) {
      slots.push_back(int64_t{table[p / block_size]} * block_size + p % block_size);
    }
  }
  return slots;
}

}  // namespace kvcm::executor
