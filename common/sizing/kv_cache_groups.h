#pragma once

// KV cache groups: a model's layers grouped by attention type, so that each group keeps its
// own block table per sequence and a sliding-window group gives back the blocks every
// future query has passed (docs/architecture.md, "The hybrid KV cache").
//
// The grouping is vLLM's for hybrid models (equal pages across groups):
//   - layers of the same type (full attention; each window size) form a type;
//   - group_size = the fewest layers of any type, or the most when the most is below
//     1.25 x the fewest (little padding then);
//   - a type of n layers splits into ceil(n / group_size) groups, layers strided over them
//     (group i of k takes the type's layers i, i + k, i + 2k, ...);
//   - every group has group_size slots; a group with fewer layers leaves slots unused
//     (padding).
// A block (a page) then holds group_size layers' K and V for block_size tokens, whatever
// group it serves, so one free list serves every group: a pool laid out as a KvCacheSpec of
// group_size layers (slots) addresses each (group, slot) page alike. Layer l of the model
// reads and writes slot SlotOf(l) of the blocks in its group's table.
//
// Types are ordered full attention first, then by ascending window; groups follow their
// type's order. A model whose layers are all of one type has one group of all its layers
// (group_size = num_layers, no padding): the layout of a model without groups.
//
// Thread safety: plain values and pure functions.

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/sizing/kv_cache_spec.h"

namespace kvcm {

struct KvCacheGroup {
  int32_t window = 0;           // tokens each layer attends within; 0 = the whole context
  std::vector<int32_t> layers;  // model layer ids, ascending; at most group_size of them
  friend bool operator==(const KvCacheGroup&, const KvCacheGroup&) = default;
};

struct KvCacheGroups {
  int32_t num_layers = 0;  // of the model
  int32_t group_size = 0;  // slots per page: layers whose K and V one block holds
  std::vector<KvCacheGroup> groups;
  // Per model layer: its group and its slot (its position in the group's `layers`).
  std::vector<int32_t> group_of;
  std::vector<int32_t> slot_of;

  int32_t num_groups() const { return static_cast<int32_t>(groups.size()); }
  // Slots no layer uses: num_groups x group_size - num_layers.
  int32_t padding_slots() const { return num_groups() * group_size - num_layers; }
  // One line for logs, e.g. for Gemma 3 1B "7 groups of 4 slots: full attention (layers 5,
  // 11, 17, 23), window 512 (layers 0, 7, 14, 21), window 512 (layers 1, 8, 15, 22), ...,
  // window 512 (layers 6, 13, 20), 2 padding slots" (every group, none elided).
  std::string ToString() const;
};

// The groups of a model whose layer l attends within layer_windows[l] tokens (0 = the whole
// context; LayerWindows in common/model/model_config.h). INVALID_ARGUMENT for no layers or
// a negative window.
absl::StatusOr<KvCacheGroups> GroupLayers(std::span<const int32_t> layer_windows);

// The spec of one page: `model`'s with num_layers = groups.group_size (the pool's slots).
// REQUIRES: model.num_layers == groups.num_layers.
KvCacheSpec PageSpec(const KvCacheSpec& model, const KvCacheGroups& groups);

// Blocks one sequence of `seq_len` tokens holds in every group together while it decodes:
// per group BlocksHeldUnderWindow(seq_len, window, block_size) (common/sizing/
// model_config.h), summed. Bytes: that x PageSpec(...).BytesPerBlock().
int64_t BlocksHeldByGroups(const KvCacheGroups& groups, int64_t seq_len, int32_t block_size);

}  // namespace kvcm
