#include "services/router/http_server.h"

#include <arpa/inet.h>
#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/event.h>
#include <event2/http.h>
#include <event2/http_struct.h>  // evhttp_request's major and minor: 2.1 has no accessor
#include <event2/keyvalq_struct.h>
#include <event2/listener.h>
#include <event2/thread.h>
#include <event2/util.h>
#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <optional>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/base/log.h"
#include "common/base/monotonic_clock.h"
#include "common/base/mutex.h"
#include "common/base/unique_fd.h"
#include "common/transport/descriptor_limit.h"
#include "services/router/http_framing.h"
#include "services/router/http_requests.h"

namespace kvcm::router {
namespace {

void Log(std::string_view text) { LogLine(kRouterName, text); }

// Reports delivered in one turn of the server's loop: the loop writes their events to their
// sockets before the next slice is handed over (Impl::DeliverSlice).
constexpr size_t kDeliverySlice = 64;

// The HTTP port at the descriptor limit (docs/router.md, "Connections at the descriptor
// limit"): when fewer than this many descriptors, or 1/16 of RLIMIT_NOFILE if that is more,
// are left, the port stops taking connections (each new one is closed at once) until twice
// as many are free again. What is left is for the ZeroMQ connections of executors that
// register meanwhile, their pidfds and the dashboard's session; as the cache manager keeps
// its own (services/cache_manager/cache_manager_server.cc).
constexpr int kMinFreeDescriptors = 32;
// Connections closed per wakeup while not accepting, so that a flood does not hold the loop.
constexpr int kMaxShedPerWakeup = 64;

// An IP literal's address bytes (4 for dotted IPv4, 16 for IPv6 without brackets); "" for
// anything else (a name).
std::string AddressBytes(const std::string& text) {
  in_addr v4{};
  if (::inet_pton(AF_INET, text.c_str(), &v4) == 1) {
    return std::string(reinterpret_cast<const char*>(&v4), sizeof(v4));
  }
  in6_addr v6{};
  if (::inet_pton(AF_INET6, text.c_str(), &v6) == 1) {
    return std::string(reinterpret_cast<const char*>(&v6), sizeof(v6));
  }
  return "";
}

// A host as Host rules compare it: a name lower-cased without one trailing dot, an IP
// literal as written (brackets off).
std::string HostKey(std::string_view host) {
  std::string key(host);
  absl::AsciiStrToLower(&key);
  if (key.size() > 1 && key.back() == '.') key.pop_back();
  return key;
}

// Whether `port` is ":" and a port, maybe empty (RFC 3986), or nothing.
bool IsPortSuffix(std::string_view rest) {
  if (rest.empty()) return true;
  if (rest.front() != ':') return false;
  for (char c : rest.substr(1)) {
    if (c < '0' || c > '9') return false;
  }
  return true;
}

// The host of a Host field's value (RFC 9110's uri-host [ ":" port ]): a name, an IPv4
// literal, or an IPv6 literal in brackets (returned without them); nullopt when the value
// is none of these.
std::optional<std::string> HostOfField(std::string_view value) {
  std::string_view host, rest;
  if (!value.empty() && value.front() == '[') {
    const size_t close = value.find(']');
    if (close == std::string_view::npos) return std::nullopt;
    host = value.substr(1, close - 1);
    rest = value.substr(close + 1);
    if (AddressBytes(std::string(host)).size() != 16) return std::nullopt;
  } else {
    const size_t colon = value.find(':');
    host = value.substr(0, colon);
    rest = colon == std::string_view::npos ? "" : value.substr(colon);
    for (char c : host) {  // RFC 3986's reg-name (and so an IPv4 literal)
      if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) &&
          std::strchr("-._~%!$&'()*+,;=", c) == nullptr) {
        return std::nullopt;
      }
    }
  }
  if (host.empty() || !IsPortSuffix(rest)) return std::nullopt;
  return std::string(host);
}

const char* MethodName(evhttp_cmd_type command) {
  switch (command) {
    case EVHTTP_REQ_GET:
      return "GET";
    case EVHTTP_REQ_POST:
      return "POST";
    case EVHTTP_REQ_HEAD:
      return "HEAD";
    case EVHTTP_REQ_PUT:
      return "PUT";
    case EVHTTP_REQ_DELETE:
      return "DELETE";
    case EVHTTP_REQ_OPTIONS:
      return "OPTIONS";
    case EVHTTP_REQ_TRACE:
      return "TRACE";
    case EVHTTP_REQ_CONNECT:
      return "CONNECT";
    case EVHTTP_REQ_PATCH:
      return "PATCH";
  }
  return "";
}

// Whether `path` is `route`'s: the same, or for a route ending in a parameter ("{model}"),
// the same up to it and then at least one byte (a parameter may hold '/': a model id may).
bool Matches(std::string_view route, std::string_view path) {
  const size_t parameter = route.find('{');
  if (parameter == std::string_view::npos) return path == route;
  return path.size() > parameter && path.substr(0, parameter) == route.substr(0, parameter);
}

const char* ReasonPhrase(int status) {
  switch (status) {
    case 200:
      return "OK";
    case 400:
      return "Bad Request";
    case 403:
      return "Forbidden";
    case 404:
      return "Not Found";
    case 405:
      return "Method Not Allowed";
    case 413:
      return "Payload Too Large";
    case 415:
      return "Unsupported Media Type";
    case 417:
      return "Expectation Failed";
    case 422:
      return "Unprocessable Entity";
    case 429:
      return "Too Many Requests";
    case 431:
      return "Request Header Fields Too Large";
    case 500:
      return "Internal Server Error";
    case 501:
      return "Not Implemented";
    case 503:
      return "Service Unavailable";
    case 505:
      return "HTTP Version Not Supported";
    default:
      return "Error";
  }
}

// Why a POST's body is refused for its Content-Type, or nullopt: each Content-Type must be
// application/json, parameters (charset) allowed, the type in any case. A page of any
// origin may POST text/plain, a form or multipart to this port without asking first (a
// CORS "simple request"); application/json needs the browser's preflight, which this
// server never grants (docs/router.md, "Browsers").
std::optional<HttpError> ContentTypeRefusal(evhttp_request* request) {
  const evkeyvalq* headers = evhttp_request_get_input_headers(request);
  const char* declared = nullptr;
  for (const evkeyval* h = headers->tqh_first; h != nullptr; h = h->next.tqe_next) {
    if (evutil_ascii_strcasecmp(h->key, "Content-Type") != 0) continue;
    declared = h->value;
    absl::string_view media = h->value;
    media = absl::StripAsciiWhitespace(media.substr(0, media.find(';')));
    if (!absl::EqualsIgnoreCase(media, "application/json")) {
      return HttpError{415, absl::StrCat("the body must be sent as Content-Type: "
                                         "application/json, not `",
                                         Shortened(h->value), "`")};
    }
  }
  if (declared == nullptr) {
    return HttpError{415,
                     "the body must be sent as Content-Type: application/json (the "
                     "request names no Content-Type)"};
  }
  return std::nullopt;
}

}  // namespace

absl::StatusOr<std::vector<std::string>> HttpServer::ParseAllowedHosts(std::string_view text) {
  std::vector<std::string> hosts;
  for (absl::string_view entry :
       absl::StrSplit(absl::string_view(text.data(), text.size()), ',', absl::SkipWhitespace())) {
    entry = absl::StripAsciiWhitespace(entry);
    if (entry == "*") {
      hosts.emplace_back("*");
      continue;
    }
    // An IPv6 literal may come without its brackets; anything else as a Host names it, but
    // with no port: the whole entry is the host.
    std::string field(entry);
    if (field.front() != '[' && AddressBytes(field).size() == 16) field = "[" + field + "]";
    const std::optional<std::string> host = HostOfField(field);
    if (!host.has_value() || field != (field.front() == '[' ? "[" + *host + "]" : *host)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--allowed-hosts: `", entry, "` is not a host name or IP literal (no port, no scheme)"));
    }
    hosts.push_back(HostKey(*host));
  }
  return hosts;
}

// What a request's Host may name (HostRefusal; docs/router.md, "Browsers"): any host ("*"
// in allowed_hosts), any IP literal (listening on a wildcard address), these names
// (HostKey) and these addresses (AddressBytes).
struct HostRules {
  bool any_host = false;
  bool any_ip_literal = false;
  std::vector<std::string> host_names;
  std::vector<std::string> host_addresses;

  // The rules of `options` (host, allowed_hosts).
  explicit HostRules(const HttpServer::Options& options) {
    host_names = {"localhost"};
    host_addresses = {AddressBytes("127.0.0.1"), AddressBytes("::1")};
    const std::string listen = HostKey(options.host.starts_with('[') && options.host.ends_with(']')
                                           ? options.host.substr(1, options.host.size() - 2)
                                           : options.host);
    const std::string listen_address = AddressBytes(listen);
    // 0.0.0.0 or ::, every address of the machine: any of them may be the Host.
    any_ip_literal =
        !listen_address.empty() && listen_address.find_first_not_of('\0') == std::string::npos;
    std::vector<std::string> hosts = options.allowed_hosts;
    hosts.push_back(listen);
    for (const std::string& host : hosts) {
      const std::string address = AddressBytes(host);
      if (host == "*") {
        any_host = true;
      } else if (address.empty()) {
        host_names.push_back(HostKey(host));
      } else {
        host_addresses.push_back(address);
      }
    }
  }

  bool Allowed(const std::string& host) const {
    if (any_host) return true;
    const std::string address = AddressBytes(host);
    if (!address.empty()) {
      return any_ip_literal || std::find(host_addresses.begin(), host_addresses.end(), address) !=
                                   host_addresses.end();
    }
    return std::find(host_names.begin(), host_names.end(), HostKey(host)) != host_names.end();
  }

  // Why a request's Host is refused, or nullopt (docs/router.md, "Browsers"): a page the
  // local user opens whose DNS name its owner rebinds to 127.0.0.1 reaches this port as its
  // own origin, and reads every reply, with its own name as the Host. 400 for an HTTP/1.1
  // request without Host, with several, or with one that is no host[:port] (RFC 9112); 403
  // for a host this server does not answer to. An absolute URI's host is checked as well.
  std::optional<HttpError> Refusal(evhttp_request* request) const {
    std::vector<std::string> values;
    if (std::optional<HttpError> bad = HostValues(request, &values)) return bad;
    for (const std::string& value : values) {
      const std::optional<std::string> host = HostOfField(value);
      if (!host.has_value()) {
        return HttpError{400, absl::StrCat("the Host `", Shortened(value),
                                           "` is not a host name or IP literal, with or "
                                           "without a port")};
      }
      if (!Allowed(*host)) {
        return HttpError{403,
                         absl::StrCat("this server does not answer to the Host `", Shortened(*host),
                                      "` (a web page may name any); name it in --allowed-hosts "
                                      "to serve it"),
                         "forbidden"};
      }
    }
    return std::nullopt;
  }

  // The Host field's value and an absolute URI's host, or the error of a missing or
  // repeated Host.
  static std::optional<HttpError> HostValues(evhttp_request* request,
                                             std::vector<std::string>* values) {
    const evkeyvalq* headers = evhttp_request_get_input_headers(request);
    for (const evkeyval* h = headers->tqh_first; h != nullptr; h = h->next.tqe_next) {
      if (evutil_ascii_strcasecmp(h->key, "Host") == 0) values->emplace_back(h->value);
    }
    if (values->size() > 1) return HttpError{400, "the request has more than one Host header"};
    if (values->empty() && (request->major > 1 || (request->major == 1 && request->minor >= 1))) {
      return HttpError{400, "an HTTP/1.1 request must have a Host header"};
    }
    if (const evhttp_uri* uri = evhttp_request_get_evhttp_uri(request); uri != nullptr) {
      if (const char* host = evhttp_uri_get_host(uri); host != nullptr && *host != '\0') {
        const std::string_view text = host;
        values->push_back(text.find(':') != std::string_view::npos && text.front() != '['
                              ? "[" + std::string(text) + "]"
                              : std::string(text));
      }
    }
    return std::nullopt;
  }
};

struct HttpServer::Impl {
  Options options;
  std::vector<Route> routes;
  Hooks hooks;
  RouterMetrics* metrics = nullptr;
  HostRules host_rules;
  event_base* base = nullptr;
  evhttp* http = nullptr;
  event* mail = nullptr;
  event* deliver_more = nullptr;  // a zero timeout: the next slice, after the loop's writes
  event* stop = nullptr;

  Impl(const Options& server_options, std::vector<Route> route_table, Hooks server_hooks,
       RouterMetrics* router_metrics)
      : options(server_options),
        routes(std::move(route_table)),
        hooks(std::move(server_hooks)),
        metrics(router_metrics),
        host_rules(server_options) {}

  Mutex mailbox_mutex;
  std::vector<TokenEvent> mailbox ABSL_GUARDED_BY(mailbox_mutex);
  // Reports taken from the mailbox, handed over kDeliverySlice at a time; `delivered` of
  // them so far.
  std::vector<TokenEvent> delivering;
  size_t delivered = 0;

  // A connection of evhttp's, by its bufferevent, from NewConnection on. libevent 2.1 tells
  // nothing when a connection goes, so an entry outlives its connection until a new
  // connection's bufferevent takes its address (NewConnection replaces it); only bufferevents
  // made there carry OnInput, so a stale entry is never read. The map stays about as large as
  // the most connections open at once, each entry holding at most an unfinished head.
  struct Connection {
    Impl* self = nullptr;
    bufferevent* events = nullptr;
    FramedInput input;
    bool framing_now = false;
    // When the request arriving must be whole (Options::request_timeout: from its first
    // byte). InfinitePast: waiting for a request's first byte; InfiniteFuture: a request is
    // being answered (or the connection was dropped).
    absl::Time deadline = absl::InfinitePast();
    uint64_t dispatched = 0;  // requests handed to OnRequest so far

    Connection(Impl* impl, bufferevent* bev, FramingLimits limits)
        : self(impl), events(bev), input(limits) {}
  };
  absl::flat_hash_map<const bufferevent*, std::unique_ptr<Connection>> connections;

  // Connections at the descriptor limit (kMinFreeDescriptors). libevent 2.1 has no
  // evhttp_set_max_connections and says nothing when a connection closes, so the
  // descriptors are counted (/proc/self/fd) as connections arrive; below the reserve, evhttp's
  // listener is disabled and `shed` reads the listening socket instead, closing each new
  // connection at once. Without this, accept() failing with EMFILE left the socket readable
  // and libevent retried it at 100% CPU, logging each failure.
  evconnlistener* listener = nullptr;  // evhttp's, of the bound socket
  event* shed = nullptr;               // on the bound socket, while not accepting
  UniqueFd fd_dir;                     // /proc/self/fd
  bool accepting = true;
  // Connections accepted before the descriptors are counted again: half of those that
  // would reach the reserve at the last count, so that a flood is counted O(log) times.
  int accepts_until_count = 0;
  uint64_t shed_while_stopped = 0;

  struct Descriptors {
    int limit = 0;
    int open = 0;
    int reserve = 0;  // stop accepting with fewer free than this
    int left() const { return limit - open; }
  };
  std::optional<Descriptors> CountDescriptors() const {
    const int limit = DescriptorLimit();
    const int open = OpenDescriptors(fd_dir.get());
    if (limit < 0 || open < 0) return std::nullopt;
    return Descriptors{limit, open, std::max(kMinFreeDescriptors, limit / 16)};
  }
  // A connection was accepted: stop accepting more when too few descriptors are left.
  void GuardDescriptors() {
    if (!accepting || --accepts_until_count > 0) return;
    const std::optional<Descriptors> count = CountDescriptors();
    if (!count.has_value()) {  // no /proc: the accept guard (main.cc) is all there is
      accepts_until_count = std::numeric_limits<int>::max();
      return;
    }
    if (count->left() >= count->reserve) {
      accepts_until_count = std::max(1, (count->left() - count->reserve) / 2);
      return;
    }
    evconnlistener_disable(listener);  // its accept loop ends after this connection
    event_add(shed, nullptr);
    accepting = false;
    shed_while_stopped = 0;
    Log(absl::StrCat(count->open, " of ", count->limit,
                     " descriptors open: not accepting HTTP connections (each new one is "
                     "closed at once) until ",
                     2 * count->reserve, " are free again"));
  }
  // The listening socket is readable while not accepting: accepting again if enough
  // descriptors were freed (the waiting connection is then evhttp's), else closing what
  // waits.
  static void OnShed(evutil_socket_t listening, short, void* arg) {
    auto* self = static_cast<Impl*>(arg);
    const std::optional<Descriptors> count = self->CountDescriptors();
    if (!count.has_value() || count->left() >= 2 * count->reserve) {
      event_del(self->shed);
      evconnlistener_enable(self->listener);
      self->accepting = true;
      self->accepts_until_count = 0;
      Log(absl::StrCat(
          count.has_value() ? absl::StrCat(count->open, " of ", count->limit, " descriptors open: ")
                            : "",
          "accepting HTTP connections again (", self->shed_while_stopped, " closed meanwhile)"));
      return;
    }
    self->ShedWaiting(listening);
  }
  // Closes the connections waiting on the listening socket (kMaxShedPerWakeup at most).
  void ShedWaiting(evutil_socket_t listening) {
    for (int i = 0; i < kMaxShedPerWakeup; ++i) {
      const int fd = ::accept4(listening, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (fd < 0) {
        // ECONNABORTED: the accept guard closed it for want of a descriptor.
        if (errno == ECONNABORTED || errno == EINTR) continue;
        break;  // EAGAIN: none waits
      }
      // A reset: the client learns at once, and nothing lingers here.
      const linger reset{1, 0};
      ::setsockopt(fd, SOL_SOCKET, SO_LINGER, &reset, sizeof(reset));
      ::close(fd);
      ++shed_while_stopped;
      if (metrics != nullptr) metrics->CountHttpConnectionShed();
    }
  }

  // evhttp_set_bevcb: the bufferevent of a new connection, as libevent makes it itself,
  // with OnInput reading what arrives before libevent does.
  static bufferevent* NewConnection(event_base* base, void* arg) {
    auto* self = static_cast<Impl*>(arg);
    self->GuardDescriptors();
    bufferevent* events = bufferevent_socket_new(base, -1, 0);
    if (events == nullptr) return nullptr;
    auto connection = std::make_unique<Connection>(
        self, events, FramingLimits{self->options.max_header_bytes, self->options.max_body_bytes});
    evbuffer_add_cb(bufferevent_get_input(events), &Impl::OnInput, connection.get());
    self->connections[events] = std::move(connection);
    return events;
  }
  // Called as bytes are added to a connection's input, inside the bufferevent's read and
  // before libevent parses them (the bufferevent defers no callbacks). The bytes just read
  // (the last info->n_added) are framed (docs/router.md, "Framing"): what RequestFraming
  // passes goes back into the input for libevent, an unfinished head waits in `raw`, and a
  // refused request leaves the head or the end of a body that makes libevent dispatch the
  // request whose handler answers the refusal (OnRequest); nothing after it is read. And a
  // request past its deadline has its connection dropped as libevent's own read timeout
  // drops it (no reply), deferred.
  static void OnInput(evbuffer* input, const evbuffer_cb_info* info, void* arg) {
    auto* c = static_cast<Connection*>(arg);
    if (info->n_added == 0 || c->framing_now) return;  // a drain, or the framing's own moves
    c->framing_now = true;
    c->input.Frame(input, info->n_added);
    c->framing_now = false;
    Impl* self = c->self;
    if (self->options.request_timeout <= absl::ZeroDuration()) return;
    const absl::Time now = MonotonicNow();
    if (c->deadline == absl::InfinitePast()) {  // a request's first bytes
      c->deadline = now + self->options.request_timeout;
      return;
    }
    if (now <= c->deadline) return;
    c->deadline = absl::InfiniteFuture();  // dropped once
    if (self->metrics != nullptr) self->metrics->CountSlowRequestDropped();
    bufferevent_trigger_event(c->events, BEV_EVENT_READING | BEV_EVENT_TIMEOUT,
                              BEV_TRIG_DEFER_CALLBACKS);
  }
  Connection* ConnectionOf(evhttp_request* request) {
    evhttp_connection* connection = evhttp_request_get_connection(request);
    if (connection == nullptr) return nullptr;
    auto it = connections.find(evhttp_connection_get_bufferevent(connection));
    return it == connections.end() ? nullptr : it->second.get();
  }
  // A request arrived whole: no deadline while it is answered; the next one on the
  // connection has its own from its first byte.
  void NoteArrived(evhttp_request* request) {
    if (options.request_timeout <= absl::ZeroDuration()) return;
    if (Connection* c = ConnectionOf(request); c != nullptr) c->deadline = absl::InfiniteFuture();
    evhttp_request_set_on_complete_cb(request, &Impl::OnReplied, this);
  }
  static void OnReplied(evhttp_request* request, void* arg) {
    auto* self = static_cast<Impl*>(arg);
    if (Connection* c = self->ConnectionOf(request); c != nullptr) {
      c->deadline = absl::InfinitePast();
    }
  }

  // A running request's socket, watched for the client leaving. libevent reads nothing from
  // a connection once its request arrived whole until the reply is sent, so an unstreamed
  // request (which writes nothing until its last token) never learnt that its client closed:
  // it ran to its last token, holding its place in the batch and its blocks. A stream
  // learns it at its next write, but not while it waits in the queue. The watch peeks
  // (reads nothing): at the end of the stream or a reset the connection fails as libevent's
  // own read of an EOF fails it, and OnClose reports the request (docs/router.md, "Errors").
  // Bytes that arrive instead (a pipelined request) end the watch: libevent reads them after
  // the reply.
  struct PeerWatch {
    evhttp_connection* connection = nullptr;
    event* readable = nullptr;
    PeerWatch() = default;
    PeerWatch(const PeerWatch&) = delete;
    PeerWatch& operator=(const PeerWatch&) = delete;
    ~PeerWatch() {
      if (readable != nullptr) event_free(readable);
    }
  };
  std::unique_ptr<PeerWatch> WatchPeer(evhttp_connection* connection) {
    bufferevent* events = evhttp_connection_get_bufferevent(connection);
    const evutil_socket_t fd = events == nullptr ? -1 : bufferevent_getfd(events);
    if (fd < 0) return nullptr;
    auto watch = std::make_unique<PeerWatch>();
    watch->connection = connection;
    watch->readable = event_new(base, fd, EV_READ, &Impl::OnPeerReadable, watch.get());
    if (watch->readable == nullptr || event_add(watch->readable, nullptr) != 0) return nullptr;
    return watch;
  }
  static void OnPeerReadable(evutil_socket_t fd, short, void* arg) {
    auto* watch = static_cast<PeerWatch*>(arg);
    char byte;
    const ssize_t n = ::recv(fd, &byte, 1, MSG_PEEK | MSG_DONTWAIT);
    if (n > 0) return;  // the client sent more: no longer watched
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
      event_add(watch->readable, nullptr);
      return;
    }
    // The client closed (or reset) its connection. Deferred: libevent's own handling of the
    // EOF frees the connection, and OnClose with it this watch.
    bufferevent* events = evhttp_connection_get_bufferevent(watch->connection);
    if (events == nullptr) return;
    bufferevent_trigger_event(events, BEV_EVENT_READING | BEV_EVENT_EOF, BEV_TRIG_DEFER_CALLBACKS);
  }

  // The requests Track()ed, until Untrack or their connection closes.
  struct Tracked {
    evhttp_request* request = nullptr;
    evhttp_connection* connection = nullptr;
    std::unique_ptr<PeerWatch> watch;  // null if the socket cannot be watched
  };
  absl::flat_hash_map<uint64_t, Tracked> tracked;
  absl::flat_hash_map<evhttp_connection*, uint64_t> by_connection;

  static void OnClose(evhttp_connection* connection, void* arg) {
    auto* self = static_cast<Impl*>(arg);
    auto it = self->by_connection.find(connection);
    if (it == self->by_connection.end()) return;
    const uint64_t id = it->second;
    self->by_connection.erase(it);
    auto t = self->tracked.find(id);
    if (t == self->tracked.end()) return;
    // A request the client left before its reply was done is detached from its connection
    // (no connection any more) and is ours to free; any other is freed by libevent with the
    // connection.
    evhttp_request* request = t->second.request;
    if (request != nullptr && evhttp_request_get_connection(request) == nullptr) {
      evhttp_request_free(request);
    }
    self->tracked.erase(t);
    self->hooks.closed(id);
  }

  // A stream event's bytes are written here, then handed to libevent from `event_out`: one
  // buffer of each, reused, so an event costs no allocation of its own.
  std::string event_text;
  evbuffer* event_out = nullptr;

  ~Impl() {
    // The watches' events, before the base goes; evhttp_free then closes the tracked
    // requests' connections, and OnClose reports each.
    for (auto& [id, t] : tracked) t.watch.reset();
    if (event_out != nullptr) evbuffer_free(event_out);
    if (mail != nullptr) event_free(mail);
    if (deliver_more != nullptr) event_free(deliver_more);
    if (stop != nullptr) event_free(stop);
    if (shed != nullptr) event_free(shed);
    if (http != nullptr) evhttp_free(http);
    if (base != nullptr) event_base_free(base);
  }

  static void OnMail(evutil_socket_t, short, void* arg) {
    try {
      static_cast<Impl*>(arg)->DeliverMail();
    } catch (const std::exception& error) {
      Log(absl::StrCat("delivering tokens: ", error.what()));
    }
  }

  // Hands over the next slice of the reports taken from the mailbox (taking them when the
  // last ones are done), and comes back for the rest after the loop's next poll. libevent
  // writes a connection's queued events only when its loop polls again: a step's 1,000
  // tokens delivered in one callback reached no socket before the last was formatted, and
  // each token waited for the formatting of all. Sliced, the loop writes the first streams'
  // events while the later ones wait their turn. Returns whether reports are left.
  bool DeliverSlice() {
    if (delivered == delivering.size()) {
      delivering.clear();
      delivered = 0;
      MutexLock lock(&mailbox_mutex);
      delivering.swap(mailbox);
    }
    const size_t end = std::min(delivering.size(), delivered + kDeliverySlice);
    hooks.deliver(std::span<const TokenEvent>(delivering).subspan(delivered, end - delivered));
    delivered = end;
    if (delivered < delivering.size()) return true;
    MutexLock lock(&mailbox_mutex);
    return !mailbox.empty();
  }

  void DeliverMail() {
    if (DeliverSlice()) {
      // A zero timeout runs after the loop's next poll: the sockets it finds writable (the
      // slice's streams) are written first.
      static constexpr timeval kNow = {0, 0};
      evtimer_add(deliver_more, &kNow);
    }
  }

  static void OnStop(evutil_socket_t, short, void* arg) {
    auto* impl = static_cast<Impl*>(arg);
    try {
      while (impl->DeliverSlice()) {  // every report handed over before Stop
      }
    } catch (const std::exception& error) {
      Log(absl::StrCat("delivering tokens: ", error.what()));
    }
    event_base_loopexit(impl->base, nullptr);
  }

  static void OnRequest(evhttp_request* request, void* arg) {
    auto* self = static_cast<Impl*>(arg);
    self->NoteArrived(request);
    // A request refused by its framing (Connection::Frame): answered in its path's API's
    // shape, before any handler, uncounted, and the connection closed after the reply.
    if (Connection* c = self->ConnectionOf(request); c != nullptr) {
      if (++c->dispatched == c->input.refused_request()) {
        const FramingRefusal& refusal = *c->input.refusal();
        evhttp_add_header(evhttp_request_get_output_headers(request), "Connection", "close");
        return self->hooks.reply_error(request, {refusal.status, refusal.message, "validation", "",
                                                 self->hooks.api_of_path(refusal.path)});
      }
    }
    try {
      self->Dispatch(request);
    } catch (const std::exception& error) {  // a bug here must not take the server down
      Log(absl::StrCat("handling ", evhttp_request_get_uri(request), ": ", error.what()));
      self->hooks.reply_error(request, {500, "internal error", "internal"});
    }
  }

  // Every route, matched on the path without its query. A known path asked with another
  // method gets 405 and an Allow header; an unknown one 404.
  void Dispatch(evhttp_request* request) {
    const std::string path = PathOf(request);
    // Every route, /health and /metrics included: a rebound page must read none of them.
    if (std::optional<HttpError> refused = host_rules.Refusal(request)) {
      refused->api = hooks.api_of_path(path);
      return hooks.reply_error(request, *refused);
    }
    for (const HttpServer::Route& route : routes) {
      if (!Matches(route.path, path)) continue;
      if (std::optional<HttpError> refused = MethodRefusal(request, route)) {
        refused->api = route.api;
        return route.generation ? hooks.refuse(request, *refused)
                                : hooks.reply_error(request, *refused);
      }
      return route.handle(request);
    }
    // Under /v1/ in OpenAI's shape (its clients read error.message); the path shortened.
    hooks.reply_error(request, {404, absl::StrCat("no route ", Shortened(path)), "validation", "",
                                hooks.api_of_path(path)});
  }

  // 405 (with Allow) for another method than the route's, 415 for a POST that is not JSON.
  static std::optional<HttpError> MethodRefusal(evhttp_request* request,
                                                const HttpServer::Route& route) {
    if (MethodName(evhttp_request_get_command(request)) != route.method) {
      const std::string method(route.method);
      evhttp_add_header(evhttp_request_get_output_headers(request), "Allow", method.c_str());
      return HttpError{405, absl::StrCat("use ", method), "validation"};
    }
    if (route.method == "POST") return ContentTypeRefusal(request);
    return std::nullopt;
  }

  absl::Status Listen(int* port);
};

// The event base, evhttp and its limits, the bound socket (its port in `port`) and the
// server's own events.
absl::Status HttpServer::Impl::Listen(int* port) {
  base = event_base_new();
  if (base == nullptr) return absl::InternalError("event_base_new failed");
  http = evhttp_new(base);
  evhttp_set_max_body_size(http, static_cast<ev_ssize_t>(options.max_body_bytes));
  // The framing (Connection::Frame) refuses heads and bodies over the limits first, in the
  // route's shape; libevent's own limits stay as a backstop (its head count differs: 2x).
  evhttp_set_max_headers_size(http, static_cast<ev_ssize_t>(2 * options.max_header_bytes));
  evhttp_set_timeout(http, options.timeout_seconds);
  evhttp_set_bevcb(http, &Impl::NewConnection, this);
  // Every method reaches Dispatch(), which answers one a route does not take with 405.
  evhttp_set_allowed_methods(http, EVHTTP_REQ_GET | EVHTTP_REQ_POST | EVHTTP_REQ_HEAD |
                                       EVHTTP_REQ_PUT | EVHTTP_REQ_DELETE | EVHTTP_REQ_OPTIONS |
                                       EVHTTP_REQ_TRACE | EVHTTP_REQ_CONNECT | EVHTTP_REQ_PATCH);
  evhttp_set_gencb(http, &Impl::OnRequest, this);
  // Every reply with a body names its type; libevent's default ("text/html;
  // charset=ISO-8859-1") went on /health's empty 200, which has none.
  evhttp_set_default_content_type(http, nullptr);
  evhttp_bound_socket* bound = evhttp_bind_socket_with_handle(
      http, options.host.c_str(), static_cast<ev_uint16_t>(options.port));
  if (bound == nullptr) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", options.host, ":", options.port,
                                               ": ", std::strerror(errno)));
  }
  sockaddr_storage address{};
  socklen_t length = sizeof(address);
  ::getsockname(evhttp_bound_socket_get_fd(bound), reinterpret_cast<sockaddr*>(&address), &length);
  *port = address.ss_family == AF_INET6
              ? ntohs(reinterpret_cast<sockaddr_in6*>(&address)->sin6_port)
              : ntohs(reinterpret_cast<sockaddr_in*>(&address)->sin_port);
  listener = evhttp_bound_socket_get_listener(bound);
  shed =
      event_new(base, evhttp_bound_socket_get_fd(bound), EV_READ | EV_PERSIST, &Impl::OnShed, this);
  fd_dir.reset(::open("/proc/self/fd", O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  mail = event_new(base, -1, 0, &Impl::OnMail, this);
  deliver_more = evtimer_new(base, &Impl::OnMail, this);
  event_out = evbuffer_new();
  event_text.reserve(4096);
  stop = event_new(base, -1, 0, &Impl::OnStop, this);
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<HttpServer>> HttpServer::Create(const Options& options,
                                                               std::vector<Route> routes,
                                                               Hooks hooks,
                                                               RouterMetrics* metrics) {
  static std::once_flag threads;
  std::call_once(threads, [] { evthread_use_pthreads(); });
  std::unique_ptr<HttpServer> server(new HttpServer());
  server->impl_ = std::make_unique<Impl>(options, std::move(routes), std::move(hooks), metrics);
  if (absl::Status listening = server->impl_->Listen(&server->port_); !listening.ok()) {
    return listening;
  }
  return server;
}

void HttpServer::Run() {
  thread_ = std::thread([base = impl_->base] { event_base_dispatch(base); });
}

void HttpServer::Deliver(std::vector<TokenEvent> events) {
  {
    MutexLock lock(&impl_->mailbox_mutex);
    if (impl_->mailbox.empty()) {
      impl_->mailbox.swap(events);  // a step's tokens, handed over whole
    } else {
      impl_->mailbox.insert(impl_->mailbox.end(), std::make_move_iterator(events.begin()),
                            std::make_move_iterator(events.end()));
    }
  }
  event_active(impl_->mail, 0, 0);
}

void HttpServer::Stop() {
  if (!thread_.joinable()) return;
  event_active(impl_->stop, 0, 0);
  thread_.join();
}

HttpServer::~HttpServer() { Stop(); }

void HttpServer::Reply(evhttp_request* request, int status, const std::string& body,
                       const char* content_type) {
  evkeyvalq* headers = evhttp_request_get_output_headers(request);
  if (content_type != nullptr) evhttp_add_header(headers, "Content-Type", content_type);
  evbuffer* out = evbuffer_new();
  evbuffer_add(out, body.data(), body.size());
  evhttp_send_reply(request, status, ReasonPhrase(status), out);
  evbuffer_free(out);
}

void HttpServer::AddHeader(evhttp_request* request, const char* name, const char* value) {
  evhttp_add_header(evhttp_request_get_output_headers(request), name, value);
}

std::string HttpServer::Body(evhttp_request* request) {
  evbuffer* in = evhttp_request_get_input_buffer(request);
  std::string body(evbuffer_get_length(in), '\0');
  evbuffer_copyout(in, body.data(), body.size());
  return body;
}

std::string HttpServer::PathOf(evhttp_request* request) {
  const char* uri = evhttp_request_get_uri(request);
  std::string path = uri == nullptr ? "/" : uri;
  if (const size_t q = path.find('?'); q != std::string::npos) path.resize(q);
  return path;
}

std::string HttpServer::PercentDecoded(const std::string& text) {
  size_t decoded_size = 0;
  char* decoded = evhttp_uridecode(text.c_str(), /*decode_plus=*/0, &decoded_size);
  if (decoded == nullptr) return text;
  std::string out(decoded, decoded_size);
  std::free(decoded);
  return out;
}

void HttpServer::StartStream(evhttp_request* request) {
  evkeyvalq* headers = evhttp_request_get_output_headers(request);
  evhttp_add_header(headers, "Content-Type", "text/event-stream");
  evhttp_add_header(headers, "Cache-Control", "no-cache");
  evhttp_send_reply_start(request, 200, "OK");
}

void HttpServer::EndStream(evhttp_request* request) { evhttp_send_reply_end(request); }

void HttpServer::SendEvent(evhttp_request* request, std::string_view field, std::string_view data) {
  StartEvent(field)->append(data);
  SendStartedEvent(request);
}

std::string* HttpServer::StartEvent(std::string_view field) {
  impl_->event_text.assign(field);
  return &impl_->event_text;
}

void HttpServer::SendStartedEvent(evhttp_request* request) {
  impl_->event_text.append("\n\n");
  evbuffer_add(impl_->event_out, impl_->event_text.data(), impl_->event_text.size());
  evhttp_send_reply_chunk(request, impl_->event_out);  // moves the bytes to the connection
  // Whatever libevent did not take (no connection any more) must not go with the next.
  evbuffer_drain(impl_->event_out, evbuffer_get_length(impl_->event_out));
}

void HttpServer::Track(uint64_t id, evhttp_request* request) {
  Impl::Tracked& t = impl_->tracked[id];
  t.request = request;
  t.connection = evhttp_request_get_connection(request);
  impl_->by_connection[t.connection] = id;
  evhttp_connection_set_closecb(t.connection, &Impl::OnClose, impl_.get());
  t.watch = impl_->WatchPeer(t.connection);
}

void HttpServer::Untrack(uint64_t id) {
  auto it = impl_->tracked.find(id);
  if (it == impl_->tracked.end()) return;
  it->second.watch.reset();  // before the reply, which may close the socket
  impl_->by_connection.erase(it->second.connection);
  evhttp_connection_set_closecb(it->second.connection, nullptr, nullptr);
  impl_->tracked.erase(it);
}

}  // namespace kvcm::router
