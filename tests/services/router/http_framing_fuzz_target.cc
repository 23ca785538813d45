// The fuzz target of the framing of HTTP/1.1 requests (tests/support/fuzz_target.h):
// RequestFraming and FramedInput (services/router/http_framing.h), the bytes of a
// connection read before libevent's parser reads them. The input's first byte picks how the
// rest arrives (in one piece, or in pieces of 1 to 8 bytes); the rest is what a client sends.
//   - RequestFraming passes, refuses and counts the same whatever the pieces;
//   - through libevent: the bytes go over a real TCP connection on loopback to an evhttp
//     server whose connections are framed as the router's are, whose handler answers a
//     refused request with its refusal (JSON) and any other with 200; the client half-closes
//     and reads until the server closes. Every reply is an HTTP/1.1 response; none is
//     libevent's own error page (text/html): what the framing passes, libevent reads, and
//     what libevent would refuse, the framing refuses first; there are no more replies than
//     requests the framing passed, and a refusal is the last reply, with its status (unless
//     a reply before it closed the connection);
//   - nothing hangs: the server closes every connection once the client has half-closed.
// Seeds: tests/services/router/fuzz/http_framing/.

#include <arpa/inet.h>
#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/event.h>
#include <event2/http.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "services/router/http_framing.h"
#include "tests/services/router/framing_driver.h"
#include "tests/support/fuzz_target.h"

namespace kvcm::router {
namespace {

using fuzz::Check;
using fuzz::Fail;

constexpr FramingLimits kLimits{.max_head_bytes = 512, .max_body_bytes = 1024};

// The bytes through RequestFraming in pieces of `piece` bytes (0: one piece).
testing::Framed FramePure(std::string_view input, size_t piece) {
  std::vector<size_t> pieces;
  if (piece > 0) pieces.assign(input.size() / piece + 1, piece);
  testing::Framed framed = testing::FrameInPieces(input, kLimits, pieces);
  Check(framed.steps_in_bounds, "a step takes more bytes than there are");
  return framed;
}

// An evhttp server on loopback whose connections are framed as the router's.
struct Server {
  event_base* base = nullptr;
  evhttp* http = nullptr;
  int port = 0;
  struct Connection {
    FramedInput input{kLimits};
    uint64_t dispatched = 0;
  };
  std::map<const bufferevent*, std::unique_ptr<Connection>> connections;

  static void OnInput(evbuffer* input, const evbuffer_cb_info* info, void* arg) {
    auto* c = static_cast<Connection*>(arg);
    if (info->n_added == 0) return;
    // Frame()'s own moves call this again: they add nothing new to frame.
    static bool framing = false;
    if (framing) return;
    framing = true;
    c->input.Frame(input, info->n_added);
    framing = false;
  }
  static bufferevent* NewConnection(event_base* base, void* arg) {
    auto* self = static_cast<Server*>(arg);
    bufferevent* events = bufferevent_socket_new(base, -1, 0);
    auto connection = std::make_unique<Connection>();
    evbuffer_add_cb(bufferevent_get_input(events), &OnInput, connection.get());
    self->connections[events] = std::move(connection);
    return events;
  }
  static void OnRequest(evhttp_request* request, void* arg) {
    auto* self = static_cast<Server*>(arg);
    auto it = self->connections.find(
        evhttp_connection_get_bufferevent(evhttp_request_get_connection(request)));
    Check(it != self->connections.end(), "a request of no known connection");
    Connection& c = *it->second;
    evbuffer* out = evbuffer_new();
    if (++c.dispatched == c.input.refused_request()) {
      const FramingRefusal& refusal = *c.input.refusal();
      const std::string body = nlohmann::json{{"error", refusal.message}}.dump();
      evbuffer_add(out, body.data(), body.size());
      evhttp_add_header(evhttp_request_get_output_headers(request), "Content-Type",
                        "application/json");
      evhttp_add_header(evhttp_request_get_output_headers(request), "Connection", "close");
      evhttp_send_reply(request, refusal.status, "Refused", out);
    } else {
      evhttp_add_header(evhttp_request_get_output_headers(request), "Content-Type", "text/plain");
      evhttp_send_reply(request, 200, "OK", out);
    }
    evbuffer_free(out);
  }

  Server() {
    base = event_base_new();
    http = evhttp_new(base);
    // libevent's own limits above the framing's, as the router sets them.
    evhttp_set_max_headers_size(http, 2 * kLimits.max_head_bytes);
    evhttp_set_max_body_size(http, kLimits.max_body_bytes);
    evhttp_set_bevcb(http, &NewConnection, this);
    evhttp_set_allowed_methods(http, EVHTTP_REQ_GET | EVHTTP_REQ_POST | EVHTTP_REQ_HEAD |
                                         EVHTTP_REQ_PUT | EVHTTP_REQ_DELETE | EVHTTP_REQ_OPTIONS |
                                         EVHTTP_REQ_TRACE | EVHTTP_REQ_CONNECT | EVHTTP_REQ_PATCH);
    evhttp_set_gencb(http, &OnRequest, this);
    evhttp_bound_socket* bound = evhttp_bind_socket_with_handle(http, "127.0.0.1", 0);
    Check(bound != nullptr, "cannot listen on loopback");
    sockaddr_in address{};
    socklen_t length = sizeof(address);
    ::getsockname(evhttp_bound_socket_get_fd(bound), reinterpret_cast<sockaddr*>(&address),
                  &length);
    port = ntohs(address.sin_port);
  }
};

// The replies in `bytes`: their statuses and content types (1xx left out). False if they
// are not HTTP/1.1 responses.
struct Reply {
  int status = 0;
  std::string content_type;
};
bool ParseReplies(std::string_view bytes, std::vector<Reply>* replies) {
  while (!bytes.empty()) {
    const size_t end = bytes.find("\r\n\r\n");
    if (end == std::string_view::npos || !bytes.starts_with("HTTP/1.")) return false;
    const std::string head = absl::AsciiStrToLower(std::string(bytes.substr(0, end)));
    bytes.remove_prefix(end + 4);
    Reply reply;
    if (head.size() < 12 || !absl::SimpleAtoi(head.substr(9, 3), &reply.status)) return false;
    // A header's value in the (lowercased) head, or nullopt.
    const auto value_of = [&head](const std::string& name) -> std::optional<std::string> {
      const size_t at = head.find(absl::StrCat("\r\n", name, ":"));
      if (at == std::string::npos) return std::nullopt;
      const size_t from = at + name.size() + 3;
      return std::string(
          absl::StripAsciiWhitespace(head.substr(from, head.find("\r\n", from) - from)));
    };
    // Without a Content-Length: a HEAD's reply (no body, another reply may follow), or an
    // HTTP/1.0 reply whose body ends at the close.
    size_t length = bytes.starts_with("HTTP/1.") ? 0 : bytes.size();
    if (const std::optional<std::string> value = value_of("content-length")) {
      if (!absl::SimpleAtoi(*value, &length)) return false;
    }
    reply.content_type = value_of("content-type").value_or("");
    if (length > bytes.size()) return false;
    bytes.remove_prefix(length);
    if (reply.status >= 200) replies->push_back(reply);
  }
  return true;
}

// Sends `input` in pieces of `piece` bytes (0: one piece) to the server, half-closes, and
// returns all that comes back until the server closes.
std::string Exchange(Server& server, std::string_view input, size_t piece) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  Check(fd >= 0, "cannot make a socket");
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(server.port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  // Non-blocking, and waited for: libFuzzer's SIGALRM (its -timeout watchdog, no SA_RESTART)
  // made a blocking connect return EINTR now and then, which read as a broken contract.
  if (::connect(fd, reinterpret_cast<const sockaddr*>(&address), sizeof(address)) != 0) {
    Check(errno == EINPROGRESS || errno == EINTR,
          absl::StrCat("cannot connect: ", std::strerror(errno)));
    pollfd p{fd, POLLOUT, 0};
    while (::poll(&p, 1, -1) < 0) Check(errno == EINTR, "cannot wait for the connection");
    int error = 0;
    socklen_t length = sizeof(error);
    Check(::getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &length) == 0 && error == 0,
          absl::StrCat("cannot connect: ", std::strerror(error)));
  }
  std::string received;
  size_t sent = 0;
  bool shut = false;
  // Each round: the server's loop runs once, then the client sends a piece and reads.
  for (int round = 0; round < 100000; ++round) {
    event_base_loop(server.base, EVLOOP_NONBLOCK);
    if (sent < input.size()) {
      const size_t n = piece == 0 ? input.size() - sent : std::min(piece, input.size() - sent);
      const ssize_t wrote = ::send(fd, input.data() + sent, n, MSG_NOSIGNAL);
      if (wrote > 0) sent += static_cast<size_t>(wrote);
      if (wrote < 0 && errno != EAGAIN && errno != EWOULDBLOCK) sent = input.size();  // reset
    } else if (!shut) {
      ::shutdown(fd, SHUT_WR);
      shut = true;
    }
    char buffer[4096];
    const ssize_t n = ::recv(fd, buffer, sizeof(buffer), 0);
    if (n > 0) {
      received.append(buffer, static_cast<size_t>(n));
    } else if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK)) {
      ::close(fd);
      return received;
    } else if (shut) {
      pollfd p{fd, POLLIN, 0};
      // The server's loop may wait on its own sockets: give it a turn that may block briefly.
      event_base_loop(server.base, EVLOOP_ONCE | EVLOOP_NONBLOCK);
      ::poll(&p, 1, 1);
    }
  }
  Fail("the server did not close the connection after the client half-closed");
}

}  // namespace
}  // namespace kvcm::router

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvcm::router;  // NOLINT
  using kvcm::fuzz::Check;
  if (size == 0) return 0;
  const size_t piece = data[0] % 9;  // 0: one piece, else 1 to 8 bytes at a time
  const std::string_view input(reinterpret_cast<const char*>(data) + 1, size - 1);

  const testing::Framed whole = FramePure(input, 0);
  const testing::Framed split = FramePure(input, piece == 0 ? 1 : piece);
  Check(split.out == whole.out, "what passes depends on the pieces");
  Check(split.heads == whole.heads, "the heads counted depend on the pieces");
  Check(split.refusal.has_value() == whole.refusal.has_value() &&
            (!whole.refusal.has_value() || (split.refusal->status == whole.refusal->status &&
                                            split.refusal->message == whole.refusal->message)),
        "the refusal depends on the pieces");

  static Server* server = new Server();
  const std::string received = Exchange(*server, input, piece);
  // What broke, with the input and the replies (escaped), for the seed driver's log.
  const auto broken = [&](std::string_view what) {
    return absl::StrCat(std::string(what),
                        "\ninput: ", absl::CHexEscape(std::string(input.substr(0, 600))),
                        "\nreplies: ", absl::CHexEscape(received.substr(0, 600)));
  };
  std::vector<Reply> replies;
  Check(ParseReplies(received, &replies), broken("a reply that is no HTTP/1.1 response"));
  for (const Reply& reply : replies) {
    Check(reply.content_type.find("text/html") == std::string::npos,
          absl::StrCat("libevent answered itself: ", reply.status,
                       "\ninput: ", absl::CHexEscape(std::string(input.substr(0, 600)))));
  }
  Check(replies.size() <= whole.heads, broken("more replies than requests passed"));
  if (whole.refusal.has_value()) {
    // Answered last, unless a reply before it closed the connection (HTTP/1.0, or
    // "Connection: close"), when fewer replies came.
    Check(replies.size() <= whole.refused_request, broken("a reply after the refusal"));
    Check(replies.size() < whole.refused_request || replies.back().status == whole.refusal->status,
          broken("a refused request was not answered with its refusal"));
  } else if (!replies.empty()) {
    Check(replies.back().status == 200, broken("a request passed was not answered 200"));
  }
  if (!replies.empty()) kvcm::fuzz::NoteAccepted();
  return 0;
}
