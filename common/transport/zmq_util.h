#pragma once

// Small ZeroMQ helpers shared by clients and tools: send one message, wait for the next
// one with a deadline, and tell whether an ipc:// endpoint has a listener at all.
//
// Generic: frames are bytes; no kvcm message type appears here (common/wire is the codec).
// ZeroMQ errors (zmq::error_t) never escape: they come back as absl::Status. EINTR is
// retried.
//
// Thread safety: the functions are thread-safe, but a zmq::socket_t is not: call them for a
// given socket only from the one thread that owns it.

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "zmq.hpp"

namespace kvcm {

// Sends `frames` as one multipart message (a single frame when there is one). While the
// socket's send queue is full (its high-water mark reached, e.g. a peer that stopped
// reading) it blocks for the socket's ZMQ_SNDTIMEO (default: forever), then returns
// RESOURCE_EXHAUSTED "zmq send queue full". INTERNAL with ZeroMQ's text when the send fails.
absl::Status SendMessage(zmq::socket_t& socket, std::span<const std::span<const uint8_t>> frames);
absl::Status SendFrame(zmq::socket_t& socket, std::span<const uint8_t> frame);

// Waits until `socket` has a message to read or `deadline` passes. Returns true when one is
// ready, false at the deadline (absl::InfinitePast() polls once without waiting).
// INTERNAL when zmq_poll fails.
absl::StatusOr<bool> WaitReadable(zmq::socket_t& socket, absl::Time deadline);

// Receives every frame of the next message without blocking. An empty vector means no
// message was pending. INTERNAL when the receive fails.
absl::StatusOr<std::vector<zmq::message_t>> ReceiveMessage(zmq::socket_t& socket);

// Waits for the next message until `deadline` (WaitReadable + ReceiveMessage). An empty
// vector means the deadline passed first.
absl::StatusOr<std::vector<zmq::message_t>> ReceiveMessageUntil(zmq::socket_t& socket,
                                                                absl::Time deadline);

// Connects `socket` to `endpoint` and waits until the ZeroMQ handshake with the peer has
// completed (a socket monitor's ZMQ_EVENT_HANDSHAKE_SUCCEEDED), so that, for example, a SUB
// socket's subscription is on its way before the caller asks the publisher for a snapshot.
// `context` must be the socket's. DEADLINE_EXCEEDED when no handshake completed by
// `deadline` (the socket stays connected and keeps retrying); INVALID_ARGUMENT for an
// endpoint ZeroMQ refuses; INTERNAL when the monitor cannot be set up.
absl::Status ConnectAndAwaitHandshake(zmq::context_t& context, zmq::socket_t& socket,
                                      const std::string& endpoint, absl::Time deadline);

// Sets ZMQ_MAXMSGSIZE on `socket` (before it binds or connects) for a protocol whose
// messages are at most `max_message_bytes`: libzmq then drops a connection that sends a
// larger message before it is buffered, so no peer can make this process hold gigabytes.
// The socket's limit is twice the protocol's, so that a message a little too large still
// arrives and is answered with a clear Oversized error. Throws zmq::error_t like set().
void LimitInboundMessages(zmq::socket_t& socket, size_t max_message_bytes);

// The filesystem path of an "ipc://PATH" endpoint; nullopt for any other transport.
std::optional<std::string> IpcPath(std::string_view endpoint);

// For an ipc:// endpoint, checks that something listens on its socket file: UNAVAILABLE
// "no socket file at PATH" or "nothing listens on PATH (stale socket file)" at once instead
// of waiting for a call to time out (a ZeroMQ connect never fails for a missing peer). The
// check connects and closes a plain Unix socket, which a ZeroMQ listener drops. Other
// transports (tcp://, inproc://) are OK without a check.
absl::Status ProbeIpcListener(std::string_view endpoint);

// For an ipc:// endpoint, checks that the directory holding its socket file belongs to this
// user (or root) and that nobody else can write there: otherwise another user could have
// put a socket of their own there, and a client would hand its requests to it (and map
// memory it sends). PERMISSION_DENIED naming the directory, its owner and mode; NOT_FOUND
// for a missing directory. Other transports are OK without a check.
absl::Status CheckIpcDirectory(std::string_view endpoint);

// A bytes view of a message frame.
inline std::span<const uint8_t> FrameBytes(const zmq::message_t& frame) {
  return {static_cast<const uint8_t*>(frame.data()), frame.size()};
}

// FlatBuffers reads a buffer's scalars in place, so a message must start on an 8-byte
// boundary (a misaligned load is undefined behaviour in C++ even where x86 allows it, and
// UBSan stops on it). libzmq may hand out a frame whose data starts anywhere in its receive
// buffer: such a frame is replaced by a copy in its own allocation (malloc's, or the
// message's inline storage for small ones, both aligned). Frame metadata (Peer-Address) is
// not copied: read it first. ReceiveMessage and ReceiveMessageUntil do this for every frame.
inline void AlignFrame(zmq::message_t& frame) {
  if (reinterpret_cast<uintptr_t>(frame.data()) % 8 == 0) return;
  zmq::message_t copy(frame.data(), frame.size());
  frame.swap(copy);
}

}  // namespace kvcm
