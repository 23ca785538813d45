#pragma once

// The framing of HTTP/1.1 requests as their bytes arrive, read before libevent's parser
// reads them (docs/router.md, "Framing"). libevent 2.1 answers some requests itself, from
// its own callbacks and with its own HTML page, before any function of the router's runs:
// a body over the limit (413), a malformed chunked body and even a legal chunk extension
// (413 "Request Entity Too Large"), headers over the limit (400). And it reads some framing
// one way where RFC 9112 wants 400 (two Content-Lengths, "+48", a space before a colon).
// RequestFraming reads each request's head and body boundaries first: what it passes on,
// libevent reads exactly as it does (heads unchanged; chunked bodies with their chunk
// extensions and trailers left out); what it refuses, the router answers in the route's API's
// shape. RequestFraming is pure (no sockets, no libevent); FramedInput moves a connection's
// bytes through it inside libevent's read.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

struct evbuffer;

namespace kvcm::router {

struct FramingLimits {
  size_t max_head_bytes = 16384;    // a request line with its headers, up to the empty line
  size_t max_body_bytes = 1048576;  // a body, chunked or not (chunked: its data)
};

// A request refused by its framing: the status, the message, and the request's path when
// its request line was read ("" otherwise), which names the API whose error shape the reply
// has.
struct FramingRefusal {
  int status = 400;
  std::string message;
  std::string path;
};

// One step of RequestFraming::Next over the bytes at the front of the input.
struct FramingStep {
  enum class Kind {
    kNeedMore,  // nothing to do until more bytes arrive
    kPass,      // hand `length` bytes on unchanged
    kReplace,   // hand `replacement` on in place of `length` bytes
    kRefuse,    // refuse: `refusal`, then `replacement` ends what libevent was reading
  };
  Kind kind = Kind::kNeedMore;
  size_t length = 0;
  std::string replacement;
  FramingRefusal refusal;
};

class RequestFraming {
 public:
  explicit RequestFraming(FramingLimits limits) : limits_(limits) {}

  // How many bytes at the front of the input the next step wants to see (0: none, only how
  // many there are).
  size_t WindowWanted() const;
  // The next step over `window`, the first min(available, WindowWanted()) bytes of the
  // input, of which there are `available` in all. After a kRefuse, every step is kRefuse
  // with length 0 and nothing more is read.
  FramingStep Next(std::string_view window, size_t available);

  // Requests whose heads were passed on (the bodiless one a head refusal passes counted):
  // the 1-based index, on the connection, of the request libevent reads last.
  uint64_t heads() const { return heads_; }
  bool refused() const { return state_ == State::kRefused; }

  // The head libevent reads in place of a request refused at its head: its handler answers
  // the refusal (it is read after every request before it, so answered in order).
  static constexpr std::string_view kRefusedHead = "GET / HTTP/1.1\r\nHost: localhost\r\n\r\n";

 private:
  enum class State {
    kHead,       // before a request line, or in a head
    kBody,       // `left_` bytes of a Content-Length body
    kChunkLine,  // a chunk's size line
    kChunkData,  // `left_` bytes of a chunk's data
    kChunkEnd,   // the CRLF after a chunk's data
    kTrailers,   // the trailer lines after the last chunk
    kRefused,
  };

  FramingStep Head(std::string_view window);
  FramingStep ChunkLine(std::string_view window);
  FramingStep ChunkEnd(std::string_view window);
  FramingStep Trailer(std::string_view window);
  FramingStep Refuse(int status, std::string message);

  const FramingLimits limits_;
  State state_ = State::kHead;
  uint64_t left_ = 0;
  uint64_t body_bytes_ = 0;   // a chunked body's data so far
  size_t trailer_bytes_ = 0;  // its trailers so far
  size_t scanned_ = 0;        // bytes of a head searched for its end so far
  uint64_t heads_ = 0;
  std::string path_;  // the current request's
};

// One connection's framing inside libevent: Frame() is called from an evbuffer callback of
// the connection's input (a bufferevent that defers no callbacks) with the bytes just read,
// before libevent parses them. Those RequestFraming passes go back into the input; an
// unfinished head or chunk line waits here; after a refusal, libevent reads a request that
// ends what it was reading (FramingStep::replacement), whose handler answers the refusal
// (refused_request() says which), and nothing after it.
class FramedInput {
 public:
  explicit FramedInput(FramingLimits limits);
  ~FramedInput();
  FramedInput(const FramedInput&) = delete;
  FramedInput& operator=(const FramedInput&) = delete;

  // Frames the last `added` bytes of `input`.
  void Frame(evbuffer* input, size_t added);

  const std::optional<FramingRefusal>& refusal() const { return refusal_; }
  // The request (1-based, on the connection, in the order libevent dispatches them) that
  // answers refusal(); 0 while none.
  uint64_t refused_request() const { return refused_request_; }

 private:
  RequestFraming framing_;
  evbuffer* raw_;     // received, not yet framed
  evbuffer* framed_;  // framed, while Frame() runs
  std::optional<FramingRefusal> refusal_;
  uint64_t refused_request_ = 0;
};

}  // namespace kvcm::router
