#pragma once
// Reading the cache manager's vLLM-format KV event stream (docs/protocol.md, "vLLM-format
// KV events") the way a consumer does, for tests: a strict msgpack decoder of one batch's
// payload, written against the format (not against kvcm's encoder), and a subscriber of the
// PUB plus a client of the replay ROUTER, over real sockets.
//
// The decoder refuses what consumers refuse: a payload that is not an array of 3, an event
// that is not a map with a "type", hashes that are not unsigned integers (bin breaks a
// whole batch in Dynamo), a BlockStored whose token count is not blocks x block_size or
// whose ids repeat (parent included). vLLM's group fields are read when present, all of
// them (BlockStored: extra_keys nil or an array, group_idx, kv_cache_spec_kind and its window, the
// window an integer exactly for "sliding_window"; BlockRemoved: group_idx) or none.
//
// Deadlines are on the monotonic clock (common/base/monotonic_clock.h), as
// common/transport/zmq_util.h takes them.
//
// Thread safety: none; one owner.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "zmq.hpp"

namespace kvcm::testing {

struct ReadVllmEvent {
  std::string type;  // BlockStored, BlockRemoved, AllBlocksCleared
  std::vector<uint64_t> block_hashes;
  std::optional<uint64_t> parent_block_hash;
  std::vector<uint32_t> token_ids;
  int64_t block_size = 0;
  std::string medium;
  // vLLM's KV cache group fields (docs/protocol.md, "vLLM-format KV events"): present in
  // every event of a pool with groups, in none without. kv_cache_spec_kind is
  // "full_attention" or "sliding_window"; sliding_window nullopt for full attention.
  std::optional<int64_t> group_idx;
  std::string kv_cache_spec_kind;
  std::optional<int64_t> sliding_window;
};

struct ReadVllmBatch {
  std::string topic;
  uint64_t seq = 0;
  double timestamp = 0;
  int64_t data_parallel_rank = -1;
  std::vector<ReadVllmEvent> events;
};

// Decodes one payload. INVALID_ARGUMENT naming what is wrong.
absl::StatusOr<ReadVllmBatch> DecodeVllmPayload(std::string_view payload);

// A SUB connected to a PUB endpoint, subscribed to everything.
class VllmEventSubscriber {
 public:
  // Connects and waits for the handshake (until `deadline`).
  static absl::StatusOr<std::unique_ptr<VllmEventSubscriber>> Connect(const std::string& endpoint,
                                                                      absl::Time deadline);
  // The next batch, decoded; DEADLINE_EXCEEDED when none came by `deadline`.
  absl::StatusOr<ReadVllmBatch> Next(absl::Time deadline);

 private:
  VllmEventSubscriber() : context_(1) {}
  zmq::context_t context_;
  zmq::socket_t socket_;
};

// Asks the replay ROUTER at `endpoint` for the batches from `start_seq` (a DEALER sending
// ["", start_seq as 8 bytes big-endian]) and reads them up to the end marker
// ["", "", -1, ""]. DEADLINE_EXCEEDED when the marker did not come by `deadline`.
absl::StatusOr<std::vector<ReadVllmBatch>> ReplayVllmEvents(const std::string& endpoint,
                                                            uint64_t start_seq,
                                                            absl::Time deadline);

// Sends `frames` raw to the replay ROUTER from a DEALER (connected first, and flushed before
// it closes), then waits until `wait` passes for any reply; returns how many messages came
// back. DEADLINE_EXCEEDED when no connection was made within 60 s.
absl::StatusOr<int> SendRawReplayRequest(const std::string& endpoint,
                                         const std::vector<std::string>& frames,
                                         absl::Duration wait);

}  // namespace kvcm::testing
