#pragma once

// KvEventSubscriber: a local mirror of the cache manager's prefix index (block hash ->
// block id), kept up to date from its KV event stream (docs/architecture.md). A KV-aware
// router uses it to guess which executor already holds a prefix without asking.
//
// The stream: the cache manager's PUB socket sends three-frame messages
//   [topic "kvcm.events", seq (u64 big-endian), EventBatch FlatBuffer (no file identifier)]
// with consecutive sequence numbers per epoch starting at 1, so a lost batch shows as a gap.
// Each batch is verified (FlatBuffers Verifier; frame seq == batch seq) before it is read;
// a message that fails is counted in rejected_batches() and skipped.
//
// Joining late (the ZeroMQ "slow joiner"): a SUB socket receives only what is published
// after its subscription reached the publisher, and nothing says when that was. So:
//   1. Connect(): connect, subscribe, and wait for the ZeroMQ handshake;
//   2. Resync(client): ask the cache manager for an EventSnapshot (the whole index and `seq`,
//      the last batch published before it);
//   3. apply the snapshot, then only batches with seq > snapshot seq; batches that arrived
//      while waiting for the snapshot are buffered and replayed in order.
// If a batch is lost anyway, the next one reveals the gap: needs_snapshot() turns true,
// gaps() counts it, later batches are buffered (up to Options::max_buffered_batches, oldest
// dropped first) and the caller calls Resync() again. A mirror that has seen batch 1 of an
// epoch from the start is complete without a snapshot.
//
// Restarts: a batch of a new epoch empties the mirror (the old pool is gone). If it is batch
// 1, the mirror follows the new epoch at once; otherwise it needs a snapshot.
//
// Ownership and threading: the subscriber owns its ZeroMQ context and SUB socket. Not
// thread-safe: one thread calls everything, including Resync() with a client that the same
// thread uses.

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/block/block_hash.h"
#include "common/client/cache_manager_client.h"
#include "zmq.hpp"

namespace kvcm {

// The topic frame of every KV event message.
inline constexpr char kKvEventTopic[] = "kvcm.events";

class KvEventSubscriber {
 public:
  struct Options {
    // The cache manager's PUB socket: "ipc://RUN_DIR/events.sock" (its ready line prints it).
    std::string endpoint;
    // How long Connect() waits for the ZeroMQ handshake with the publisher.
    absl::Duration connect_timeout = absl::Seconds(5);
    // Batches kept while the mirror waits for a snapshot. More rides out a longer snapshot
    // round trip under heavy churn; each batch holds its decoded events.
    size_t max_buffered_batches = 4096;
    // Called for every batch applied to the mirror, in order, after it is applied (not for
    // snapshots). Runs on the thread calling Poll/ApplySnapshot/Resync; empty: none.
    std::function<void(uint64_t seq, uint64_t epoch, const std::vector<KvEventRecord>& events)>
        on_batch_applied;
  };

  // Connects and subscribes, waiting for the handshake (step 1 above). UNAVAILABLE when
  // nothing listens on an ipc:// endpoint; DEADLINE_EXCEEDED when no handshake completes
  // within connect_timeout; INVALID_ARGUMENT for an empty or unusable endpoint.
  static absl::StatusOr<std::unique_ptr<KvEventSubscriber>> Connect(Options options);

  KvEventSubscriber(const KvEventSubscriber&) = delete;
  KvEventSubscriber& operator=(const KvEventSubscriber&) = delete;
  ~KvEventSubscriber();

  // Waits up to `timeout` for a message, then also takes every message already queued, and
  // applies (or buffers) them. Returns how many batches were applied to the mirror.
  // INTERNAL only when ZeroMQ fails; bad messages are counted and skipped.
  absl::StatusOr<int> Poll(absl::Duration timeout);

  // Replaces the mirror with `snapshot`, then replays buffered batches after snapshot.seq.
  // INVALID_ARGUMENT (mirror unchanged) when the snapshot holds an event other than
  // BlockStored after its leading AllBlocksCleared.
  absl::Status ApplySnapshot(const EventSnapshot& snapshot);

  // Takes the messages already queued (without waiting), asks `client` for a snapshot and
  // applies it. Errors of CacheManagerClient::Snapshot (an ABORTED there means the cache
  // manager restarted: call Resync again) and of ApplySnapshot.
  absl::Status Resync(CacheManagerClient& client);

  // The mirror: block hash -> block id, for every block in the prefix index.
  const absl::flat_hash_map<BlockHash, int32_t, BlockHashHasher>& blocks() const { return blocks_; }
  // True until the mirror is complete (a snapshot applied, or batch 1 seen), and again after
  // a gap or a restart mid-stream. While true, batches are buffered, not applied.
  bool needs_snapshot() const { return !synced_; }
  // The last batch applied (or the snapshot's seq); 0 before any.
  uint64_t last_seq() const { return last_seq_; }
  // The epoch of the mirror; 0 before any batch or snapshot.
  uint64_t epoch() const { return epoch_; }
  // Gaps seen in a complete mirror's stream (lost batches, or a new epoch seen mid-stream).
  uint64_t gaps() const { return gaps_; }
  // Messages taken off the socket (applied, buffered, ignored, dropped or refused).
  uint64_t messages_received() const { return messages_received_; }
  uint64_t batches_applied() const { return batches_applied_; }
  uint64_t rejected_batches() const { return rejected_batches_; }
  size_t buffered_batches() const { return buffered_.size(); }

  // The next valid batch received is discarded as if the network lost it (to test gap
  // detection).
  void DropNextBatchForTest() { drop_next_ = true; }

 private:
  struct Batch {
    uint64_t seq = 0;
    uint64_t epoch = 0;
    std::vector<KvEventRecord> events;
  };

  KvEventSubscriber(Options options);

  // Decodes one message; false when rejected.
  bool Decode(const std::vector<zmq::message_t>& frames, Batch* batch);
  // Applies or buffers `batch` by the rules in the header comment. Returns true if applied.
  bool Accept(Batch batch);
  void Apply(const Batch& batch);
  void Buffer(Batch batch);
  int Replay();

  const Options options_;
  zmq::context_t context_;
  zmq::socket_t socket_;  // SUB

  absl::flat_hash_map<BlockHash, int32_t, BlockHashHasher> blocks_;
  bool synced_ = false;
  uint64_t last_seq_ = 0;
  uint64_t epoch_ = 0;
  uint64_t gaps_ = 0;
  uint64_t messages_received_ = 0;
  uint64_t batches_applied_ = 0;
  uint64_t rejected_batches_ = 0;
  bool drop_next_ = false;
  std::deque<Batch> buffered_;  // ascending seq within an epoch, as received
};

}  // namespace kvcm
