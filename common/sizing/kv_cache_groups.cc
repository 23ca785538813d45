#include "common/sizing/kv_cache_groups.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <map>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/base/check.h"
#include "common/sizing/kv_cache_spec.h"
#include "common/sizing/model_config.h"

namespace kvcm {
namespace {

// The model's layers of each type, keyed by window: 0 (full attention) sorts first, then
// the windows ascending, which is the order the groups take.
using LayersByWindow = std::map<int32_t, std::vector<int32_t>>;

// The fewest layers of any type, or the most when the most is below 1.25 x the fewest: a
// type slightly larger than the smallest then fills one group with little padding instead
// of two with much (12 + 13 layers: 2 groups of 13, 1 slot unused, rather than 3 of 12).
int32_t GroupSize(const LayersByWindow& types) {
  int64_t fewest = std::numeric_limits<int64_t>::max();
  int64_t most = 0;
  for (const auto& [window, layers] : types) {
    fewest = std::min<int64_t>(fewest, static_cast<int64_t>(layers.size()));
    most = std::max<int64_t>(most, static_cast<int64_t>(layers.size()));
  }
  // most < 1.25 x fewest, in integers.
  return static_cast<int32_t>(4 * most < 5 * fewest ? most : fewest);
}

}  // namespace

std::string KvCacheGroups::ToString() const {
  std::vector<std::string> parts;
  parts.reserve(groups.size());
  for (const KvCacheGroup& group : groups) {
    parts.push_back(
        absl::StrCat(group.window == 0 ? "full attention" : absl::StrCat("window ", group.window),
                     " (layers ", absl::StrJoin(group.layers, ", "), ")"));
  }
  const int32_t padding = padding_slots();
  return absl::StrCat(num_groups(), num_groups() == 1 ? " group" : " groups", " of ", group_size,
                      group_size == 1 ? " slot: " : " slots: ", absl::StrJoin(parts, ", "), ", ",
                      padding, padding == 1 ? " padding slot" : " padding slots");
}

absl::StatusOr<KvCacheGroups> GroupLayers(std::span<const int32_t> layer_windows) {
  if (layer_windows.empty()) {
    return absl::InvalidArgumentError("KV cache groups: the model has no layers");
  }
  if (layer_windows.size() > static_cast<size_t>(std::numeric_limits<int32_t>::max())) {
    return absl::InvalidArgumentError(
        absl::StrCat("KV cache groups: ", layer_windows.size(), " layers, more than 2^31 - 1"));
  }
  LayersByWindow types;
  for (size_t layer = 0; layer < layer_windows.size(); ++layer) {
    if (layer_windows[layer] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("KV cache groups: layer ", layer, " has window ", layer_windows[layer],
                       "; a window is a token count, or 0 for full attention"));
    }
    types[layer_windows[layer]].push_back(static_cast<int32_t>(layer));
  }

  KvCacheGroups result;
  result.num_layers = static_cast<int32_t>(layer_windows.size());
  result.group_size = GroupSize(types);
  result.group_of.assign(layer_windows.size(), 0);
  result.slot_of.assign(layer_windows.size(), 0);
  for (const auto& [window, layers] : types) {
    const size_t size = static_cast<size_t>(result.group_size);
    const size_t count = (layers.size() + size - 1) / size;
    // Strided rather than consecutive (group i takes the type's layers i, i + count, ...):
    // a run of consecutive layers, such as a pipeline stage's, then spreads over all of
    // the type's groups instead of filling some and leaving others empty.
    for (size_t i = 0; i < count; ++i) {
      KvCacheGroup group;
      group.window = window;
      for (size_t k = i; k < layers.size(); k += count) {
        result.group_of[layers[k]] = result.num_groups();
        result.slot_of[layers[k]] = static_cast<int32_t>(group.layers.size());
        group.layers.push_back(layers[k]);
      }
      result.groups.push_back(std::move(group));
    }
  }
  return result;
}

KvCacheSpec PageSpec(const KvCacheSpec& model, const KvCacheGroups& groups) {
  KVCM_CHECK(model.num_layers == groups.num_layers)
      << "a spec of " << model.num_layers << " layers for groups of " << groups.num_layers;
  KvCacheSpec page = model;
  page.num_layers = groups.group_size;
  return page;
}

int64_t BlocksHeldByGroups(const KvCacheGroups& groups, int64_t seq_len, int32_t block_size) {
  int64_t blocks = 0;
  for (const KvCacheGroup& group : groups.groups) {
    blocks += BlocksHeldUnderWindow(seq_len, group.window, block_size);
  }
  return blocks;
}

}  // namespace kvcm
