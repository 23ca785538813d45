#pragma once
// VllmEventPublisher: the cache manager's second KV event stream, in vLLM's wire format
// (docs/protocol.md, "vLLM-format KV events"; docs/cluster.md), for cluster routers that
// consume vLLM engines' events (NVIDIA Dynamo's KV router, llm-d's indexer).
//
// - A bound PUB (--kv-events-endpoint): each batch is three frames, [topic (utf-8),
//   seq (8 bytes big-endian, +1 per batch), payload (msgpack, vllm_events.h)]. The first
//   batch of every start is a lone AllBlocksCleared.
// - Sequence numbers start at 0 on a node's first start and go on increasing across its
//   restarts: a consumer that saw higher numbers from the same endpoint drops lower ones
//   (Dynamo 1.6.1 does, silently), and so would miss the restart's AllBlocksCleared. The
//   numbers are reserved in `seq_file` (the run directory's vllm-events.seq) a chunk at a
//   time, written and fsynced before any of them is sent, so a crash at any point leaves
//   a file from which the next start continues above every number sent; a restart skips
//   the rest of the chunk, which a consumer sees as a gap and answers with a replay.
// - The PUB is an XPUB that hears every subscription (xpub_verbose): a consumer subscribes
//   when it connects and again when it reconnects, and is answered with the latest batch
//   once more. ZeroMQ drops what a PUB sends before a subscriber's connection is up, so a
//   consumer that joins late, or reconnects after a restart of the cache manager (whose
//   AllBlocksCleared went out before it was back), would otherwise learn of the gap only
//   at the next batch, which may be long in coming. Seeing the latest number at once, it
//   replays what it missed at once. Subscribers that already had that batch get it twice
//   under the same number: a consumer that checks numbers (Dynamo) drops it, one that
//   does not applies the same events again, which changes nothing, since no later batch
//   exists.
// - A bound ROUTER (--kv-events-replay-endpoint): a request [identity, "", start_seq
//   (8 bytes big-endian)] is answered with one [identity, "", topic, seq, payload] per
//   buffered batch whose seq >= start_seq, oldest first, then [identity, "", "",
//   int64 -1 (8 bytes big-endian), ""]. Anything else (another frame count, a non-empty
//   delimiter, a seq not 8 bytes) is logged, counted as malformed and left unanswered.
// - The buffer holds the last `buffer_steps` batches, except that the start's first batch
//   (its AllBlocksCleared) is kept for good once the buffer wraps: a replay from 0 always
//   starts from a cleared state. A subscriber whose start is older than the oldest other
//   batch kept then gets the start's batch and the batches kept; the gap between them
//   tells it that it missed some (docs/protocol.md says what to do then).
//
// Thread safety: none; the cache manager's socket thread owns it.

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <span>
#include <string>

#include "absl/status/statusor.h"
#include "services/cache_manager/cache_manager_metrics.h"
#include "services/cache_manager/vllm_events.h"
#include "zmq.hpp"

namespace kvcm::cache_manager {

class VllmEventPublisher {
 public:
  struct Options {
    std::string endpoint;          // PUB, e.g. tcp://127.0.0.1:5557 (port 0: any free one)
    std::string replay_endpoint;   // ROUTER; empty: no replay
    std::string topic;             // first frame of every batch
    int32_t buffer_steps = 10000;  // batches kept for replay, >= 1
    // Where sequence numbers are reserved across restarts (above); empty: every start
    // begins at 0 (tests of the publisher alone).
    std::string seq_file;
    VllmStreamInfo info;
  };

  // Sequence numbers reserved in seq_file at a time: one small write and fsync per this
  // many batches, and at most this many numbers skipped by a restart.
  static constexpr uint64_t kSeqReservation = uint64_t{1} << 16;
  // Sequence numbers stay below 2^63: consumers may read them as signed 64-bit integers,
  // and -1 ends a replay.
  static constexpr uint64_t kMaxVllmSeq = (uint64_t{1} << 62);

  // Binds both sockets in `context`. INVALID_ARGUMENT for options that make no sense or a
  // seq_file that is not one this publisher wrote (delete it to start again from 0, and
  // register the node with its cluster router again), INTERNAL when seq_file cannot be
  // read or written, UNAVAILABLE when a socket cannot be bound. `metrics` may be null and must
  // outlive it.
  static absl::StatusOr<std::unique_ptr<VllmEventPublisher>> Create(zmq::context_t& context,
                                                                    const Options& options,
                                                                    CacheManagerMetrics* metrics);

  ~VllmEventPublisher();

  // Publishes `events` as the next batch (nothing when empty), stamped `timestamp`
  // (seconds since 1970), and keeps it for replay.
  void Publish(std::span<const VllmEvent> events, double timestamp);

  // Answers every replay request queued; the caller watches replay_socket() for input.
  void ServeReplay();
  // Reads the subscriptions queued on the PUB and answers them with the latest batch; the
  // caller watches pub_socket() for input.
  void ServeSubscriptions();

  zmq::socket_t& pub_socket() { return pub_; }

  // Null without a replay endpoint.
  zmq::socket_t* replay_socket() { return replay_ ? &replay_ : nullptr; }
  // The endpoints bound, with the port chosen for port 0.
  const std::string& endpoint() const { return endpoint_; }
  const std::string& replay_endpoint() const { return replay_endpoint_; }
  uint64_t next_seq() const { return next_seq_; }
  // The first batch's number in this start: 0, or where seq_file said to go on.
  uint64_t first_seq() const { return first_seq_; }
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
  // Sends `batch` on the PUB; false when ZeroMQ refused it (logged).
  bool SendOnPub(const Batch& batch);
  // Writes `limit` (the first number not yet reserved) into seq_file, durably.
  absl::Status ReserveSeqsUpTo(uint64_t limit);
  void RefuseReplay(std::string_view why);

  const Options options_;
  CacheManagerMetrics* const metrics_;
  zmq::socket_t pub_;
  zmq::socket_t replay_;
  std::string endpoint_;
  std::string replay_endpoint_;
  uint64_t first_seq_ = 0;
  uint64_t next_seq_ = 0;
  uint64_t reserved_until_ = ~uint64_t{0};  // without seq_file: no limit
  std::optional<Batch> first_;              // seq first_seq_, once it left the ring below
  std::deque<Batch> buffer_;                // the latest batches, oldest first
  uint64_t malformed_ = 0;
};

}  // namespace kvcm::cache_manager
