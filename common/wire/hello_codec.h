#pragma once
// The cache-manager protocol's Hello and HelloReply (schemas/kvcm_protocol.fbs) as plain
// values, and the one codec between them and the wire. A client registers with a Hello;
// the cache manager answers with the session and the limits it announces.
//
//   const auto hello = EncodeHello(builder, {.role = wire::Role::Router, .pid = getpid()});
//   KVCM_ASSIGN_OR_RETURN(SessionInfo info, DecodeHelloReply(*reply));       // client
//
// Thread safety: stateless functions.

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/block/block_hash.h"
#include "flatbuffers/flatbuffers.h"
#include "schemas/kvcm_protocol_generated.h"

namespace kvcm {

// A Hello. Whether its values are acceptable (a role, a pid, a name of at most 128 bytes,
// the secret over tcp://) is the cache manager's call.
struct HelloRequest {
  wire::Role role = wire::Role::Unknown;
  int32_t pid = 0;
  std::string name;    // sent even when empty
  std::string secret;  // left out when empty (an absent and an empty secret mean the same)
  friend bool operator==(const HelloRequest&, const HelloRequest&) = default;
};

// The session that Hello established, with the limits the cache manager announced.
struct SessionInfo {
  uint64_t session_id = 0;
  uint64_t epoch = 0;
  absl::Duration heartbeat_interval;  // send a Heartbeat at least this often
  absl::Duration heartbeat_timeout;   // silent longer than this: the session expires
  int32_t num_blocks = 0;
  int32_t block_size = 0;
  HashAlgorithm hash_algorithm = kDefaultHashAlgorithm;
  int32_t max_ops_per_step = 0;    // Step() refuses larger batches locally
  uint32_t max_message_bytes = 0;  // also the client's limit on replies
  // A router's Commits should carry the token ids of their new blocks
  // (HelloReply.wants_commit_tokens: the cache manager publishes vLLM-format KV events).
  bool wants_commit_tokens = false;
  // The cache manager has a host or disk tier (HelloReply.tiers): an Allocate may be
  // answered UNAVAILABLE while its prefix loads, and is sent again.
  bool tiers = false;
  // > 0: blocks wholly behind a sequence's window of this many tokens are released
  // (HelloReply.sliding_window_tokens); a router sends -1 for their table entries.
  int32_t sliding_window_tokens = 0;
  // The pool's KV cache groups, by window (HelloReply.group_windows; 0 = full attention);
  // empty: none. With groups a sequence has a block table per group (OpOutcome.group_blocks).
  std::vector<int32_t> group_windows;
  friend bool operator==(const SessionInfo&, const SessionInfo&) = default;
};

flatbuffers::Offset<wire::Hello> EncodeHello(flatbuffers::FlatBufferBuilder& builder,
                                             const HelloRequest& hello);
// The values of a verified Hello; absent strings read as empty.
HelloRequest DecodeHello(const wire::Hello& hello);

// A HelloReply of `info`; the heartbeat durations travel as whole milliseconds.
flatbuffers::Offset<wire::HelloReply> EncodeHelloReply(flatbuffers::FlatBufferBuilder& builder,
                                                       const SessionInfo& info);
// The values of a verified HelloReply. INTERNAL "HelloReply without a session id or epoch"
// when either is 0, and FromWire's error for a hash algorithm outside the enum (the client
// adds "cache manager protocol error: ").
absl::StatusOr<SessionInfo> DecodeHelloReply(const wire::HelloReply& reply);

}  // namespace kvcm
