#pragma once

// CacheManagerClient: a router's, executor's or tool's connection to kvcm-cache-manager
// (docs/architecture.md).
//
//   CacheManagerClient::Options options;
//   options.endpoint = "ipc://RUN_DIR/cache-manager.sock";
//   options.role = wire::Role::Router;
//   options.name = "router-0";
//   KVCM_ASSIGN_OR_RETURN(auto client, CacheManagerClient::Connect(options));
//   BlockOps step;
//   step.Allocate(/*seq=*/1, /*num_tokens=*/40, hashes).Append(/*seq=*/7, 1);
//   KVCM_ASSIGN_OR_RETURN(std::vector<OpOutcome> outcomes, client->Step(step));
//
// Each call is one request and one reply over a DEALER socket: the request is one frame, a
// finished Envelope carrying a fresh request id, this client's session id and epoch; the
// reply must pass VerifyEnvelope and echo the request id. Replies with another request id
// (answers to calls that timed out earlier) are dropped. Every call waits at most
// Options::call_timeout.
//
// Errors common to every call:
//   DEADLINE_EXCEEDED  "cache manager at <endpoint> did not answer <Type> within <timeout>"
//                      (not running, stopped, or overloaded; the next call may succeed).
//                      Also when the send queue stays full for the timeout.
//   ABORTED            the session is gone: "cache manager ended session 7 of epoch 3
//                      (StaleEpoch: ...); its sequences are gone. Quiesce what writes for
//                      it, then call Reregister()". Every later call fails the same way,
//                      without sending, until the caller calls Reregister() (see
//                      "Restarts"): the client never registers again behind its caller's
//                      back.
//   FAILED_PRECONDITION after Goodbye() until EnsureSession() registers again; also what the
//                      cache manager answers for a request in the wrong state.
//   INTERNAL           the reply was malformed or of the wrong type (a protocol bug), or a
//                      ZeroMQ call failed.
//   Any code the cache manager puts in an ErrorReply, mapped with FromWire() (e.g.
//   INVALID_ARGUMENT for a message that contradicts the pool's limits, UNAVAILABLE while it
//   shuts down).
// Step: the cache manager checks every op's meaning first (sequence known, not live twice,
// owned by this session, counts in range) and refuses the whole step, changing nothing, if
// one fails: the call returns NOT_FOUND, ALREADY_EXISTS, PERMISSION_DENIED or
// INVALID_ARGUMENT naming the op. Failures found while running the ops (RESOURCE_EXHAUSTED
// when the pool is full) are per op, in OpOutcome::status; the other ops still run.
//
// Restarts. The cache manager's epoch changes whenever it starts; its pool, sequences and
// sessions die with the old process. When a reply says NotRegistered, StaleSession or
// StaleEpoch (or the heartbeat thread saw that), the call fails with ABORTED and the session
// counts as lost. The caller first stops everything that may still write for the old
// session (a router quiesces its executors; an executor finishes or abandons its step and
// drops its AttachedPool), then calls Reregister(), then rebuilds: a router re-admits its
// in-flight requests, an executor calls Attach() again. epoch() and session_id() return the
// new values afterwards. EnsureSession() checks without a request. (Registering again at
// once would let a new session start while the old one's writers still run: the fencing
// of docs/architecture.md depends on the caller choosing the moment.)
//
// Fences (executors). Every HeartbeatReply lists the fences still waiting for this session
// (schemas/kvcm_protocol.fbs, Fence): PendingFences() returns the latest list and
// fence_generation() changes whenever it does, so a step loop can check it cheaply. Once
// no step of a fenced router session runs (and later ones are refused), the executor calls
// AcknowledgeFences().
//
// Heartbeats. With Options::heartbeats, Connect() starts one thread that owns its own
// DEALER socket (no socket is ever shared between threads) and sends a Heartbeat with the
// current session and epoch every heartbeat interval the cache manager asked for (with
// Options::require_progress, only while the caller showed progress). If a
// heartbeat reply says the session is gone, the thread records that; the next call (or
// EnsureSession()) registers again and returns ABORTED without sending its request. The
// thread is stopped through an inproc:// PAIR socket and joined by the destructor.
//
// Ownership and threading: the client owns its ZeroMQ context and sockets. It is NOT
// thread-safe: one thread at a time calls its methods (the heartbeat thread is internal and
// shares only atomics and a mutex-guarded session with it). Destroying the client does not
// say Goodbye (no blocking round trip in a destructor): call Goodbye() first to end the
// session at once; otherwise the cache manager ends it when this process exits or its
// heartbeats stop.

#include <atomic>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/base/mutex.h"
#include "common/block/block_hash.h"
#include "common/block/block_map.h"
#include "common/memory/pool_layout.h"
#include "common/memory/pool_memory.h"
#include "common/memory/pool_view.h"
#include "common/sizing/kv_cache_spec.h"
#include "common/wire/attach_codec.h"
#include "common/wire/describe_session_codec.h"
#include "common/wire/event_codec.h"
#include "common/wire/heartbeat_codec.h"
#include "common/wire/hello_codec.h"
#include "common/wire/stats_codec.h"
#include "common/wire/step_codec.h"
#include "flatbuffers/flatbuffers.h"
#include "schemas/kvcm_protocol_generated.h"
#include "zmq.hpp"

namespace kvcm {

// ---- Step ---------------------------------------------------------------------------------

// A builder of the block operations of one step, for callers that write them by hand (tools,
// tests, benchmarks; the router's planner makes its ops itself): CacheManagerClient::Step
// takes it as the span of its ops. Ops run in the order added; each gets its own outcome.
// A plain value: build it, send it, Clear() it and reuse it.
class BlockOps {
 public:
  // A new sequence `seq` of `num_tokens` tokens; `block_hashes` are the chained hashes of
  // its leading full blocks, for prefix matching. Outcome: the whole block table and how
  // many leading tokens were already cached.
  BlockOps& Allocate(SeqId seq, int32_t num_tokens, std::span<const BlockHash> block_hashes = {}) {
    return Add(BlockOp::Allocate(seq, num_tokens, block_hashes));
  }
  // Room for `num_tokens` more tokens of `seq`. Outcome: the new blocks only, and copy
  // orders for a shared partly filled block (copy-on-write).
  BlockOps& Append(SeqId seq, int32_t num_tokens) { return Add(BlockOp::Append(seq, num_tokens)); }
  // `child` shares every block of `parent`.
  BlockOps& Fork(SeqId parent, SeqId child) { return Add(BlockOp::Fork(parent, child)); }
  // The KV of the first `num_committed_tokens` tokens of `seq` is written;
  // `new_block_hashes` continue the hashes of its full blocks. Only tokens the sequence had
  // before this batch can be committed (the executors write after the Step's reply): the
  // cache manager refuses the whole step otherwise. `new_block_tokens`: when the session
  // asks for them (SessionInfo::wants_commit_tokens), the token ids of the full blocks the
  // commit completes, block after block, up to the last full block committed; else empty.
  BlockOps& Commit(SeqId seq, int32_t num_committed_tokens,
                   std::span<const BlockHash> new_block_hashes = {},
                   std::span<const int32_t> new_block_tokens = {}) {
    return Add(BlockOp::Commit(seq, num_committed_tokens, new_block_hashes, new_block_tokens));
  }
  // Ends `seq`; its committed full blocks stay cached. A `seq` that is not live (already
  // freed) fails alone with NOT_FOUND. With `drain`, its blocks are reused only once every
  // executor acknowledged that it no longer writes the sequence: for one an executor that
  // hung may still be writing (the request moved elsewhere).
  BlockOps& Free(SeqId seq, bool drain = false) { return Add(BlockOp::Free(seq, drain)); }
  // Dry run of Allocate for admission: would a new sequence of `num_tokens` tokens with
  // these hashes fit now, after the batch's earlier ops? Outcome: OK or RESOURCE_EXHAUSTED,
  // num_cached_tokens and blocks_needed; nothing changes.
  BlockOps& CanAllocate(int32_t num_tokens, std::span<const BlockHash> block_hashes = {}) {
    return Add(BlockOp::CanAllocate(num_tokens, block_hashes));
  }
  BlockOps& Add(BlockOp op) {
    ops_.push_back(std::move(op));
    return *this;
  }

  const std::vector<BlockOp>& ops() const { return ops_; }
  operator std::span<const BlockOp>() const { return ops_; }  // NOLINT: what Step() takes
  size_t size() const { return ops_.size(); }
  bool empty() const { return ops_.empty(); }
  void Clear() { ops_.clear(); }

 private:
  std::vector<BlockOp> ops_;
};

// ---- Replies as plain values ----------------------------------------------------------------
// The replies' plain forms live with their codecs in common/wire/, shared with the cache
// manager: SessionInfo (hello_codec.h), FenceNotice (heartbeat_codec.h), SessionSnapshot
// (describe_session_codec.h), StatsSnapshot (stats_codec.h), KvEventRecord and
// EventSnapshot (event_codec.h), PoolDescriptorInfo (attach_codec.h).

// The pool as an executor sees it after Attach(): the descriptor's values, checked, with
// view.base the mapping's. Destroy it (or reset `mapping`) to unmap; do so before attaching
// to a new epoch.
struct AttachedPool {
  PoolView view;
  std::unique_ptr<PoolMapping> mapping;
};

// Checks a decoded PoolDescriptor's values (not its memory; DecodeAttachReply checked the
// spec): num_blocks is positive and matches `expected_num_blocks` when that is positive, the
// backend is known, and every stride is what PoolLayout::For gives. Returns the values with
// `base` null. INTERNAL naming the first field that disagrees (the cache manager sent an
// inconsistent descriptor).
absl::StatusOr<PoolView> CheckPoolDescriptor(const PoolDescriptorInfo& descriptor,
                                             int32_t expected_num_blocks);

// The secret in `path` (a file of mode 0600, as the cache manager writes RUN_DIR/tcp-secret),
// surrounding whitespace dropped. NOT_FOUND when it cannot be opened, PERMISSION_DENIED when
// others may read it.
absl::StatusOr<std::string> ReadSecretFile(const std::string& path);

// ---- The client -----------------------------------------------------------------------------

class CacheManagerClient {
 public:
  struct Options {
    // The cache manager's request socket: "ipc://RUN_DIR/cache-manager.sock" (what its
    // ready line prints), or "tcp://127.0.0.1:PORT".
    std::string endpoint;
    // What this client is; the cache manager treats a dead router's sequences differently
    // from a dead executor's mapping (docs/architecture.md).
    wire::Role role = wire::Role::Unknown;
    // Shown in the cache manager's logs and `kvcmctl info`; at most 128 bytes.
    std::string name;
    // The longest any one call (including Connect's Hello) waits for its reply. Too short
    // fails calls of a busy cache manager; too long stalls a caller whose cache manager hung.
    absl::Duration call_timeout = absl::Seconds(5);
    // Start the heartbeat thread. Needed by long-lived routers and executors, whose session
    // otherwise expires after the heartbeat timeout; a one-shot tool may turn it off.
    bool heartbeats = true;
    // Heartbeats vouch for the calling thread, not only for the process: the thread sends
    // one only while the caller showed progress (any call, or NoteProgress()) within the
    // session's heartbeat timeout. A caller whose loop deadlocked then stops renewing its
    // lease and is quarantined like a hung process. Its loop must call NoteProgress()
    // while idle. Off: heartbeats go out as long as the process runs.
    bool require_progress = false;
    // Over tcp://, a Router or Executor must prove it may use the pool: the contents of the
    // cache manager's RUN_DIR/tcp-secret (mode 0600), given as `secret` or read from
    // `secret_file` at Connect. Without it the cache manager grants only a read-only
    // control session. Not needed over ipc:// (the kernel vouches for the peer).
    std::string secret;
    std::string secret_file;
  };

  // Connects a DEALER to options.endpoint and registers (Hello with this process's pid).
  // For an ipc:// endpoint it first checks that something listens on the socket file.
  // UNAVAILABLE "no socket file at ..." / "nothing listens on ..." when nothing runs there;
  // PERMISSION_DENIED when the ipc:// socket's directory belongs to another user or others
  // can write it (CheckIpcDirectory);
  // DEADLINE_EXCEEDED when Hello is not answered in time; INVALID_ARGUMENT for an empty
  // endpoint or a name over 128 bytes; the cache manager's error for a refused Hello.
  static absl::StatusOr<std::unique_ptr<CacheManagerClient>> Connect(Options options);

  CacheManagerClient(const CacheManagerClient&) = delete;
  CacheManagerClient& operator=(const CacheManagerClient&) = delete;
  // Stops and joins the heartbeat thread; closes the sockets without lingering.
  ~CacheManagerClient();

  // All `ops` in one round trip (a StepPlan's ops as they are, or a BlockOps); outcomes in op
  // order. No ops return an empty vector without a round trip. INVALID_ARGUMENT (nothing
  // sent) when there are more ops than the session's max_ops_per_step; INTERNAL when the
  // reply's count differs.
  absl::StatusOr<std::vector<OpOutcome>> Step(std::span<const BlockOp> ops);

  // After Step() returned DEADLINE_EXCEEDED, its ops may or may not have run. This sends the
  // same request again (same request id, same bytes): the cache manager runs it if it never
  // did, and otherwise answers with the first reply without running it twice. Call it
  // before any other Step. FAILED_PRECONDITION when there is no step to retry (none sent,
  // or the last one was answered), and from the cache manager for a step no longer in its
  // replay cache (it keeps a session's last four, whatever their size), which it does not
  // run again; DescribeSession() then tells what the session holds.
  absl::StatusOr<std::vector<OpOutcome>> RetryLastStep();
  // What the last answered Step's reply said could be taken right after it (free, or cached
  // and evictable blocks); -1 before any, or from a cache manager that does not say.
  int32_t available_blocks_after_last_step() const { return last_available_blocks_; }

  // Every live sequence of this session and the request id of the last Step applied: how
  // a router resynchronises after losing track.
  absl::StatusOr<SessionSnapshot> DescribeSession();

  // Ends another session (an operator's tool, role Control over ipc://): see
  // schemas/kvcm_protocol.fbs, EndSession. Returns the blocks released at once (a router's
  // blocks may drain behind a fence first). NOT_FOUND for an unknown session,
  // PERMISSION_DENIED for another role or over tcp://.
  absl::StatusOr<int32_t> EndSession(uint64_t session_id);

  // How many leading blocks of the chain `block_hashes` an Allocate of a prompt of
  // `num_tokens` tokens would reuse now (never the block of its last token, whose logits
  // must be computed). num_tokens 0: the hashes cover the prompt exactly.
  absl::StatusOr<int32_t> Lookup(std::span<const BlockHash> block_hashes, int32_t num_tokens = 0);

  // Keeps the cached blocks of `block_hashes` cached under `name` until Unpin(name).
  // NOT_FOUND when a block is not cached, ALREADY_EXISTS for a name in use (as answered).
  absl::Status Pin(std::string_view name, std::span<const BlockHash> block_hashes);
  // NOT_FOUND for an unknown name.
  absl::Status Unpin(std::string_view name);

  absl::StatusOr<StatsSnapshot> Stats();

  // The pool as a map of at most `max_cells` cells (0: 4096), each block's state or a run's
  // dominant one, with the blocks in each state (common/block/block_map.h). Any role may
  // ask; the cache manager spends one pass over its ledger on it, O(blocks): for a view
  // polled by people, not for a step loop. INTERNAL for a reply that contradicts itself
  // (DecodeBlockMapReply).
  absl::StatusOr<BlockMap> GetBlockMap(uint32_t max_cells = 0);

  // The prefix index now, for a KV event subscriber (kv_event_subscriber.h).
  absl::StatusOr<EventSnapshot> Snapshot();

  // Attaches to the pool: asks for the descriptor, checks it (CheckPoolDescriptor), and maps
  // the pool. shm: receives the memfd over the descriptor's fd channel (the 8-byte
  // little-endian epoch that travels with it must match) and maps it; cuda: opens the IPC
  // handle on the descriptor's device. Besides the common errors: INTERNAL for a descriptor
  // that contradicts itself or an fd-channel header of another epoch; the errors of
  // ReceiveFdFromChannel (UNAVAILABLE, DEADLINE_EXCEEDED, DATA_LOSS), MapShmPool
  // (FAILED_PRECONDITION for a size or seal mismatch) and OpenCudaPool (UNAVAILABLE without
  // CUDA). After ABORTED (a new epoch) drop any old AttachedPool, then attach again.
  absl::StatusOr<AttachedPool> Attach();
  // The pool's descriptor as Attach() asks for it (its spec, layout, window and KV cache
  // groups), checked (CheckPoolDescriptor, and of this session's epoch), without mapping
  // the pool: what a router shows of the pool (/info). Errors: Attach()'s before mapping.
  absl::StatusOr<PoolDescriptorInfo> DescribePool();

  // One heartbeat now (the heartbeat thread sends its own).
  absl::Status Heartbeat();

  // The caller's thread is making progress (Options::require_progress). Thread-safe and
  // lock-free: cheap enough for every loop turn or layer.
  void NoteProgress();

  // A heartbeat carrying acknowledgements of `fence_ids`: this executor runs no step of
  // their router sessions and refuses every later one. The fences are dropped from
  // PendingFences(). Unknown ids are ignored by the cache manager.
  absl::Status AcknowledgeFences(std::span<const uint64_t> fence_ids);
  // The fences of the latest HeartbeatReply, less those acknowledged since. Thread-safe.
  std::vector<FenceNotice> PendingFences() const;
  // Changes whenever PendingFences() does. Thread-safe and lock-free.
  uint64_t fence_generation() const { return fence_generation_.load(); }

  // Ends the session: a router's sequences are freed (committed full blocks stay cached).
  // Returns how many blocks were released. Later calls return FAILED_PRECONDITION until
  // EnsureSession() registers again.
  absl::StatusOr<int32_t> Goodbye();

  // OK when the session is believed alive. ABORTED (without a request) when it is known
  // gone; after Goodbye(), registers again and returns OK or Hello's error.
  absl::Status EnsureSession();

  // Registers again (Hello) after the session was lost (ABORTED), adopting the new session
  // id and epoch. Call it only once nothing writes for the old session any more. Errors of
  // Hello (UNAVAILABLE, DEADLINE_EXCEEDED, the cache manager's refusal).
  absl::Status Reregister();

  uint64_t session_id() const;
  uint64_t epoch() const;
  // The last HelloReply's values.
  SessionInfo session() const;
  const Options& options() const { return options_; }
  // True when a reply or the heartbeat thread saw the current session refused (calls fail
  // with ABORTED until Reregister()).
  bool session_lost() const;
  // Heartbeats the thread sent and the replies it got (for tests and logs).
  uint64_t heartbeats_sent() const { return heartbeats_sent_.load(); }
  uint64_t heartbeats_answered() const { return heartbeats_answered_.load(); }
  // Heartbeats the thread did not send because the caller showed no progress.
  uint64_t heartbeats_withheld() const { return heartbeats_withheld_.load(); }

 private:
  // A verified reply: the frame keeps the bytes `envelope` points into alive.
  struct Reply {
    zmq::message_t frame;
    const wire::Envelope* envelope = nullptr;
  };

  // The pool's descriptor and the values CheckPoolDescriptor took from it, checked once.
  struct CheckedPool {
    PoolDescriptorInfo descriptor;
    PoolView view;
  };

  explicit CacheManagerClient(Options options);

  absl::Status Register();
  // DescribePool() with the checked view, which Attach() maps.
  absl::StatusOr<CheckedPool> DescribeCheckedPool();
  absl::Status StartHeartbeats();
  // Stops and joins the thread; with `finish_pending`, it first waits (at most a call
  // timeout) for the reply to a heartbeat in flight.
  void StopHeartbeats(bool finish_pending = false);
  void HeartbeatLoop(zmq::socket_t stop);

  // Fails fast with ABORTED if the session is known gone; FAILED_PRECONDITION after Goodbye.
  absl::Status CheckSession();
  // Sends the envelope `builder` holds (finished by the caller with `request_id`) and waits
  // for the reply with the same id. Maps ErrorReply to a status (re-registering on
  // NotRegistered/StaleSession/StaleEpoch) and checks the payload type.
  absl::StatusOr<Reply> Exchange(flatbuffers::FlatBufferBuilder& builder, uint64_t request_id,
                                 wire::Message request_type, wire::Message reply_type);
  // An ErrorReply as a status (ABORTED, the session marked lost, for a session gone);
  // other replies and errors pass through.
  absl::StatusOr<Reply> MapErrorReply(absl::StatusOr<Reply> reply);
  // Decodes a StepReply of `expected` results.
  absl::StatusOr<std::vector<OpOutcome>> OutcomesOf(const Reply& reply, size_t expected);
  // Finishes `builder` around `payload` with a new request id and this session, then
  // Exchange().
  absl::StatusOr<Reply> Call(flatbuffers::FlatBufferBuilder& builder, wire::Message type,
                             flatbuffers::Offset<void> payload, wire::Message reply_type);
  // Marks the current session lost and returns the ABORTED status naming `why`.
  absl::Status SessionGone(std::string_view why);
  void TakeFencesLocked(const wire::HeartbeatReply& reply) ABSL_EXCLUSIVE_LOCKS_REQUIRED(fence_mu_);
  // The session and its generation, read together.
  std::pair<SessionInfo, uint64_t> SessionAndGeneration() const ABSL_LOCKS_EXCLUDED(session_mu_);

  const Options options_;
  zmq::context_t context_;
  zmq::socket_t socket_;                // DEALER, used by the caller's thread only
  int32_t last_available_blocks_ = -1;  // of the last StepReply
  // The last Step sent and not answered yet (for RetryLastStep); empty when answered.
  uint64_t heartbeat_starts_ = 0;
  std::vector<uint8_t> unanswered_step_;
  uint64_t unanswered_step_id_ = 0;
  size_t unanswered_step_ops_ = 0;
  uint64_t next_request_id_ = 1;
  bool said_goodbye_ = false;

  // Shared with the heartbeat thread.
  mutable Mutex session_mu_;
  SessionInfo session_ ABSL_GUARDED_BY(session_mu_);
  // Counts registrations: names a session unambiguously (a restarted cache manager
  // hands out the same session ids again).
  uint64_t generation_ ABSL_GUARDED_BY(session_mu_) = 0;
  // Why the heartbeat thread saw the session refused ("StaleEpoch: message for epoch ...").
  std::string lost_reason_ ABSL_GUARDED_BY(session_mu_);
  // The generation whose session the heartbeat thread saw refused (0: none).
  std::atomic<uint64_t> lost_generation_{0};
  std::atomic<uint64_t> heartbeats_sent_{0};
  std::atomic<uint64_t> heartbeats_answered_{0};
  std::atomic<uint64_t> heartbeats_withheld_{0};
  // MonotonicNow() of the caller's last sign of progress, in nanoseconds.
  std::atomic<int64_t> last_progress_ns_{0};

  // Fences, shared with the heartbeat thread.
  mutable Mutex fence_mu_;
  std::vector<FenceNotice> fences_ ABSL_GUARDED_BY(fence_mu_);
  absl::flat_hash_set<uint64_t> acked_fences_ ABSL_GUARDED_BY(fence_mu_);  // this epoch's
  std::atomic<uint64_t> fence_generation_{0};

  zmq::socket_t stop_;  // PAIR; the heartbeat thread holds the other end
  std::thread heartbeat_thread_;
};

}  // namespace kvcm
