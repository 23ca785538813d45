#pragma once
// VllmEventPublisher: the cache manager's second KV event stream, in vLLM's wire format
// (docs/protocol.md, "vLLM-format KV events"; docs/cluster.md), for cluster routers that
// consume vLLM engines' events (NVIDIA Dynamo's KV router, llm-d's indexer).
//
// - A bound PUB (--kv-events-endpoint): each batch is three frames, [topic (utf-8),
//   seq (8 bytes big-endian, 0 for the first batch, +1 per batch), payload (msgpack,
//   vllm_events.h)]. The first batch of every start is a lone AllBlocksCleared.
// - A bound ROUTER (--kv-events-replay-endpoint): a request [identity, "", start_seq
//   (8 bytes big-endian)] is answered with one [identity, "", topic, seq, payload] per
//   buffered batch whose seq >= start_seq, oldest first, then [identity, "", "",
//   int64 -1 (8 bytes big-endian), ""]. Anything else (another frame count, a non-empty
//   delimiter, a seq not 8 bytes) is logged, counted as malformed and left unanswered.
// - The buffer holds the last `buffer_steps` batches, except that seq 0 (the start's
//   AllBlocksCleared) is kept for good once the buffer wraps: a replay from 0 always
//   starts from a cleared state. A subscriber whose start is older than the oldest other
//   batch kept then gets seq 0 and the batches kept; the gap between them tells it that
//   it missed some (docs/protocol.md says what to do then).
//
// Thread safety: none; the cache manager's socket thread owns it.

#include <cstdint>
#include <deque>
#include <memory>
#include <span>
#include <string>

#include "absl/status/statusor.h"
#include "services/cache_manager/cache_manager_metrics.h"
#include "services/cache_manager/vllm_events.h"
#include "zmq.hpp"

namespace kvcm {

class VllmEventPublisher {
 public:
  struct Options {
    std::string endpoint;         // PUB, e.g. tcp://127.0.0.1:5557 (port 0: any free one)
    std::string replay_endpoint;  // ROUTER; empty: no replay
    std::string topic;            // first frame of every batch
    int32_t buffer_steps = 10000;  // batches kept for replay, >= 1
    VllmStreamInfo info;
  };

  // Binds both sockets in `context`. INVALID_ARGUMENT for options that make no sense,
  // UNAVAILABLE when a socket cannot be bound. `metrics` may be null and must outlive it.
  static absl::StatusOr<std::unique_ptr<VllmEventPublisher>> Create(
      zmq::context_t& context, const Options& options, CacheManagerMetrics* metrics);

  ~VllmEventPublisher();

  // Publishes `events` as the next batch (nothing when empty), stamped `timestamp`
  // (seconds since 1970), and keeps it for replay.
  void Publish(std::span<const VllmEvent> events, double timestamp);

  // Answers every replay request queued; the caller watches replay_socket() for input.
  void ServeReplay();

  // Null without a replay endpoint.
  zmq::socket_t* replay_socket() { return replay_ ? &replay_ : nullptr; }
  // The endpoints bound, with the port chosen for port 0.
  const std::string& endpoint() const { return endpoint_; }
  const std::string& replay_endpoint() const { return replay_endpoint_; }
  uint64_t next_seq() const { return next_seq_; }
  size_t buffered() const { return buffer_.size() + (first_.has_value() ? 1 : 0); }

 private:
  struct Batch {
    uint64_t seq = 0;
    std::string payload;
  };

  VllmEventPublisher(const Options& options, CacheManagerMetrics* metrics)
      : options_(options), metrics_(metrics) {}

  // Sends one [identity, "", topic, seq, payload] (or the end marker when `batch` is null);
  // false when the peer's queue is full or it is gone.
  bool SendReplayFrame(const zmq::message_t& identity, const Batch* batch);
  void RefuseReplay(std::string_view why);

  const Options options_;
  CacheManagerMetrics* const metrics_;
  zmq::socket_t pub_;
  zmq::socket_t replay_;
  std::string endpoint_;
  std::string replay_endpoint_;
  uint64_t next_seq_ = 0;
  std::optional<Batch> first_;  // seq 0, once it left the ring below
  std::deque<Batch> buffer_;    // the latest batches, oldest first
  uint64_t malformed_ = 0;
};

}  // namespace kvcm
