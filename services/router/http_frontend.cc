#include "services/router/http_frontend.h"
#include "services/router/http_framing.h"
#include "services/router/http_requests.h"
#include "services/router/stream_events.h"

#include <arpa/inet.h>
#include <dirent.h>
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
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <limits>
#include <memory>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <optional>
#include <span>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "common/base/log.h"
#include "common/tokenizer/incremental_decoder.h"
#include "common/base/mutex.h"
#include "common/base/utf8.h"
#include "common/base/monotonic_clock.h"
#include "common/base/unique_fd.h"
#include "common/transport/descriptor_limit.h"
#include "nlohmann/json.hpp"
#include "prometheus/registry.h"
#include "prometheus/text_serializer.h"

// services/router/openapi.json, embedded at build time (cmake/KvcmEmbed.cmake).
extern "C" {
extern const unsigned char kvcm_openapi_json[];
extern const size_t kvcm_openapi_json_size;
}

namespace kvcm::router {
namespace {

using json = nlohmann::json;

constexpr char kComponent[] = "kvcm-router";
void Log(std::string_view text) { LogLine(kComponent, text); }

constexpr char kVersion[] = "0.1.0";
// OpenAI's system_fingerprint (TGI's "{version}-{label}"): the router and its version,
// "kvcm-router-0.1.0", the same for every response of one build (docs/router.md, "HTTP API
// (OpenAI-compatible)").
const std::string& SystemFingerprint() {
  static const std::string* const fingerprint =
      new std::string(absl::StrCat(kComponent, "-", kVersion));
  return *fingerprint;
}
// /info's validation_workers: every request is parsed, checked and tokenized on the HTTP
// thread, the one thread the front end runs on (http_frontend.h).
constexpr int kValidationWorkers = 1;
// /info's max_client_batch_size: the inputs one request may carry. /generate's `inputs` is
// one string and /v1/completions' `prompt` one prompt or a list of one (RequestParser).
constexpr int kMaxClientBatchSize = 1;

// A token's text as OpenAI's completions logprobs show it: the text; for a piece that is not
// UTF-8 on its own (part of a character), "bytes:\xNN..." as OpenAI writes those; for one
// that decodes to nothing (a special token), "token_id:N" as vLLM writes token ids. So no two
// tokens share a key of top_logprobs.
std::string OpenAiTokenText(int32_t id, const std::string& piece) {
  if (piece.empty()) return absl::StrCat("token_id:", id);
  if (IsValidUtf8(piece)) return piece;
  std::string out = "bytes:";
  for (unsigned char c : piece) absl::StrAppend(&out, "\\x", absl::Hex(c, absl::kZeroPad2));
  return out;
}


// JSON text; bytes that are not UTF-8 (a model may generate any byte) become U+FFFD, as
// Hugging Face's decode(errors="replace") does.
std::string Dump(const json& value) {
  return value.dump(-1, ' ', false, json::error_handler_t::replace);
}


// Tokens delivered in one turn of the HTTP thread's loop: the loop writes their events to
// their sockets before it formats the next slice (Impl::DeliverSlice).
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

// OpenAI's error type for a status.
const char* OpenAiErrorType(int status) {
  switch (status) {
    case 429: return "rate_limit_error";
    case 503: return "service_unavailable";
    case 500: return "server_error";
    default: return "invalid_request_error";
  }
}

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
  if (host.empty()) return std::nullopt;
  if (!rest.empty()) {  // ":" and a port, maybe empty (RFC 3986)
    if (rest.front() != ':') return std::nullopt;
    for (char c : rest.substr(1)) {
      if (c < '0' || c > '9') return std::nullopt;
    }
  }
  return std::string(host);
}

}  // namespace

absl::StatusOr<std::vector<std::string>> HttpFrontend::ParseAllowedHosts(std::string_view text) {
  std::vector<std::string> hosts;
  for (absl::string_view entry : absl::StrSplit(absl::string_view(text.data(), text.size()), ',',
                                                absl::SkipWhitespace())) {
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

struct HttpFrontend::Impl {
  Options options;
  const Tokenizer* tokenizer = nullptr;
  RouterCore* core = nullptr;
  RouterMetrics* metrics = nullptr;
  event_base* base = nullptr;
  evhttp* http = nullptr;
  event* mail = nullptr;
  event* deliver_more = nullptr;  // a zero timeout: the next slice, after the loop's writes
  event* stop = nullptr;

  Mutex mailbox_mutex;
  std::vector<Progress> mailbox ABSL_GUARDED_BY(mailbox_mutex);
  // Tokens taken from the mailbox, delivered kDeliverySlice at a time; `delivered` of them
  // so far.
  std::vector<Progress> delivering;
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
      Log(absl::StrCat(count.has_value() ? absl::StrCat(count->open, " of ", count->limit,
                                                        " descriptors open: ")
                                         : "",
                       "accepting HTTP connections again (", self->shed_while_stopped,
                       " closed meanwhile)"));
      return;
    }
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
      ++self->shed_while_stopped;
      if (self->metrics != nullptr) self->metrics->CountHttpConnectionShed();
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
  // own read of an EOF fails it, and OnClose cancels the request (docs/router.md, "Errors").
  // Bytes that arrive instead (a pipelined request) end the watch: libevent reads them after
  // the reply.
  struct PeerWatch {
    Impl* self = nullptr;
    uint64_t id = 0;
    event* readable = nullptr;
    PeerWatch() = default;
    PeerWatch(const PeerWatch&) = delete;
    PeerWatch& operator=(const PeerWatch&) = delete;
    ~PeerWatch() {
      if (readable != nullptr) event_free(readable);
    }
  };
  std::unique_ptr<PeerWatch> WatchPeer(uint64_t id, evhttp_connection* connection) {
    bufferevent* events = evhttp_connection_get_bufferevent(connection);
    const evutil_socket_t fd = events == nullptr ? -1 : bufferevent_getfd(events);
    if (fd < 0) return nullptr;
    auto watch = std::make_unique<PeerWatch>();
    watch->self = this;
    watch->id = id;
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
    Impl* self = watch->self;
    auto it = self->active.find(watch->id);
    if (it == self->active.end() || it->second.request == nullptr) return;
    bufferevent* events = evhttp_connection_get_bufferevent(it->second.connection);
    if (events == nullptr) return;
    bufferevent_trigger_event(events, BEV_EVENT_READING | BEV_EVENT_EOF,
                              BEV_TRIG_DEFER_CALLBACKS);
  }

  // What one generated sequence produced.
  struct Choice {
    std::vector<int32_t> generated;
    std::vector<float> logprobs;  // with params.outputs.logprobs, per generated token
    std::vector<std::vector<std::pair<int32_t, float>>> top;  // with top_n
    // Its text a token at a time (streams and stop sequences), and that text so far: what
    // a stream has sent.
    IncrementalDecoder decoder;
    std::string text;
    bool done = false;
    std::string finish_reason;
    double sum_logprob = 0;  // for best_of
    // With finish_reason "stop_sequence": where in `text` the stop sequence that ended it
    // starts (OpenAI's text stops there).
    size_t stop_at = std::string::npos;
  };

  struct Active {
    evhttp_request* request = nullptr;  // null once the client is gone
    evhttp_connection* connection = nullptr;
    std::unique_ptr<PeerWatch> watch;  // while it runs (null if the socket cannot be watched)
    bool stream = false;
    bool as_list = false;  // POST / without streaming answers [reply], as TGI does
    Params params;
    std::string prompt_text;
    std::vector<int32_t> prompt;  // its tokens, as submitted
    std::vector<float> prompt_logprobs;  // with params.outputs.prompt_logprobs
    // One per sequence generated (params.outputs.sequences: OpenAI's n or best_of, TGI's
    // best_of); `shown` of them are returned (OpenAI's n; 1 for TGI).
    std::vector<Choice> choices;
    int32_t shown = 1;
    int32_t open = 0;  // choices not finished yet
    absl::Time arrived;
    absl::Time last_token;
    Api api = Api::kTgi;
    // OpenAI:
    bool chat = false;  // /v1/chat/completions (messages, deltas) rather than /v1/completions
    std::string completion_id;
    int64_t created = 0;
    bool include_usage = false;
    size_t prompt_tokens = 0;
    int32_t cached_prompt_tokens = 0;
  };

  void Count(Api api, RequestOutcome outcome) {
    if (metrics == nullptr) return;
    metrics->CountRequest(api == Api::kOpenAi ? RequestApi::kOpenAi : RequestApi::kTgi, outcome);
  }
  absl::flat_hash_map<uint64_t, Active> active;
  absl::flat_hash_map<evhttp_connection*, uint64_t> by_connection;
  uint64_t next_id = 1;
  std::unique_ptr<RequestParser> parser;  // with `options`' limits and `tokenizer`
  std::string openapi;  // GET /openapi.json: OpenApiDocument(options)

  // What a request's Host may name (HostRefusal; docs/router.md, "Browsers"): any host
  // ("*" in allowed_hosts), any IP literal (listening on a wildcard address), these names
  // (HostKey) and these addresses (AddressBytes).
  bool any_host = false;
  bool any_ip_literal = false;
  std::vector<std::string> host_names;
  std::vector<std::string> host_addresses;

  // A stream event's bytes are written here, then handed to libevent from `event_out`: one
  // buffer of each, reused, so an event costs no allocation of its own.
  std::string event_text;
  evbuffer* event_out = nullptr;

  ~Impl() {
    for (auto& [id, a] : active) a.watch.reset();  // their events, before the base goes
    if (event_out != nullptr) evbuffer_free(event_out);
    if (mail != nullptr) event_free(mail);
    if (deliver_more != nullptr) event_free(deliver_more);
    if (stop != nullptr) event_free(stop);
    if (shed != nullptr) event_free(shed);
    if (http != nullptr) evhttp_free(http);
    if (base != nullptr) event_base_free(base);
  }

  static void Reply(evhttp_request* request, int status, const std::string& body,
                    const char* content_type = "application/json") {
    evkeyvalq* headers = evhttp_request_get_output_headers(request);
    if (content_type != nullptr) evhttp_add_header(headers, "Content-Type", content_type);
    evbuffer* out = evbuffer_new();
    evbuffer_add(out, body.data(), body.size());
    const char* reason = status == 200   ? "OK"
                         : status == 400 ? "Bad Request"
                         : status == 403 ? "Forbidden"
                         : status == 404 ? "Not Found"
                         : status == 405 ? "Method Not Allowed"
                         : status == 413 ? "Payload Too Large"
                         : status == 417 ? "Expectation Failed"
                         : status == 415 ? "Unsupported Media Type"
                         : status == 422 ? "Unprocessable Entity"
                         : status == 429 ? "Too Many Requests"
                         : status == 431 ? "Request Header Fields Too Large"
                         : status == 501 ? "Not Implemented"
                         : status == 500 ? "Internal Server Error"
                         : status == 503 ? "Service Unavailable"
                         : status == 505 ? "HTTP Version Not Supported"
                                         : "Error";
    evhttp_send_reply(request, status, reason, out);
    evbuffer_free(out);
  }
  // A refusal of a generation request, counted.
  void Refuse(evhttp_request* request, const HttpError& error) {
    Count(error.api, error.status == 429   ? RequestOutcome::kOverloaded
                     : error.status == 503 ? RequestOutcome::kUnavailable
                                           : RequestOutcome::kInvalid);
    ReplyError(request, error);
  }
  static json ErrorBody(const HttpError& error) {
    if (error.api == Api::kOpenAi) {
      return {{"error",
               {{"message", error.message},
                {"type", OpenAiErrorType(error.status)},
                {"param", error.param.empty() ? json(nullptr) : json(error.param)},
                {"code", nullptr}}}};
    }
    return {{"error", error.message}, {"error_type", error.type}};
  }
  static void ReplyError(evhttp_request* request, const HttpError& error) {
    // OpenAI answers invalid requests with 400 (TGI with 422).
    const int status = error.api == Api::kOpenAi && error.status == 422 ? 400 : error.status;
    Reply(request, status, Dump(ErrorBody(error)));
  }

  std::string Body(evhttp_request* request) {
    evbuffer* in = evhttp_request_get_input_buffer(request);
    std::string body(evbuffer_get_length(in), '\0');
    evbuffer_copyout(in, body.data(), body.size());
    return body;
  }

  // A parsed request as the front end keeps it while it runs.
  static Active ActiveOf(GenerationRequest parsed) {
    Active a;
    a.api = parsed.api;
    a.chat = parsed.chat;
    a.stream = parsed.stream;
    a.as_list = parsed.as_list;
    a.include_usage = parsed.include_usage;
    a.shown = parsed.shown;
    a.params = std::move(parsed.params);
    a.prompt_text = std::move(parsed.prompt_text);
    return a;
  }

  // POST /generate, /generate_stream and / (TGI): the body parsed by RequestParser.
  void HandleGenerate(evhttp_request* request, std::optional<bool> stream_path) {
    GenerationRequest parsed;
    if (std::optional<HttpError> bad = parser->ParseGenerate(Body(request), stream_path, &parsed)) {
      return Refuse(request, *bad);
    }
    std::vector<int32_t> prompt = std::move(parsed.prompt);
    Start(request, ActiveOf(std::move(parsed)), std::move(prompt));
  }

  // 422 when the prompt and every token it may generate need more blocks than the pool has
  // in all, or more tokens than max_batch_total_tokens: the planner's rule for a request it
  // rejects (StepPlanner::Plan), with the core's message (RouterCore's rejected requests).
  std::optional<HttpError> NeverFits(size_t prompt_tokens, int64_t max_new_tokens) const {
    const int64_t whole = static_cast<int64_t>(prompt_tokens) + max_new_tokens;
    const bool over_pool =
        options.num_blocks > 0 && options.block_size > 0 &&
        (whole + options.block_size - 1) / options.block_size > options.num_blocks;
    const bool over_batch =
        options.max_batch_total_tokens > 0 && whole > options.max_batch_total_tokens;
    if (!over_pool && !over_batch) return std::nullopt;
    return HttpError{422, "the prompt and max_new_tokens need more KV cache than the pool holds",
                     "validation"};
  }

  // The checks every API shares; then the request is registered and handed to the core.
  void Start(evhttp_request* request, Active a, std::vector<int32_t> prompt) {
    const Api api = a.api;
    auto refuse = [&](HttpError error) {
      error.api = api;
      Refuse(request, error);
    };
    if (prompt.empty()) {  // the parsers refuse it first: the planner cannot run it
      return refuse({422, "the prompt has no tokens"});
    }
    if (static_cast<int32_t>(prompt.size()) > options.max_input_tokens) {
      return refuse({422, absl::StrCat("the prompt must have less than ", options.max_input_tokens,
                                       " tokens. Given: ", prompt.size())});
    }
    if (static_cast<int64_t>(prompt.size()) + a.params.max_new_tokens > options.max_total_tokens) {
      return refuse({422, absl::StrCat("prompt tokens + new tokens must be <= ",
                                       options.max_total_tokens, ". Given: ", prompt.size(),
                                       " prompt tokens and ", a.params.max_new_tokens,
                                       " new tokens")});
    }
    // What the pool can never hold the planner rejects once queued (StepPlanner::Plan): known
    // now, so refused now, with the status and body of any refusal, a stream's included
    // (it was a 200 stream of one error event; docs/router.md, "Errors").
    if (std::optional<HttpError> never = NeverFits(prompt.size(), a.params.max_new_tokens)) {
      return refuse(*never);
    }
    if (static_cast<int32_t>(active.size()) >= options.max_concurrent_requests) {
      return refuse({429, "Model is overloaded", "overloaded"});
    }
    if (core->draining()) return refuse({503, "the router is shutting down", "unavailable"});
    if (core->live_executors() == 0) {
      return refuse({503, "no executor is registered with the router yet", "unavailable"});
    }
    const uint64_t id = next_id++;
    a.request = request;
    a.connection = evhttp_request_get_connection(request);
    a.arrived = MonotonicNow();
    a.prompt_tokens = prompt.size();
    a.prompt = prompt;
    a.choices.assign(static_cast<size_t>(a.params.outputs.sequences), Choice{});
    a.open = a.params.outputs.sequences;
    by_connection[a.connection] = id;
    evhttp_connection_set_closecb(a.connection, &Impl::OnClose, this);
    a.watch = WatchPeer(id, a.connection);
    if (a.stream) {
      evkeyvalq* headers = evhttp_request_get_output_headers(request);
      evhttp_add_header(headers, "Content-Type", "text/event-stream");
      evhttp_add_header(headers, "Cache-Control", "no-cache");
      evhttp_send_reply_start(request, 200, "OK");
      if (a.chat) {  // OpenAI's first chunk of each choice names the role
        for (int32_t k = 0; k < a.shown; ++k) {
          json choice = OpenAiChoice(a, static_cast<size_t>(k), "", nullptr);
          SendEvent(request, Dump(OpenAiChunk(a, json::array({std::move(choice)}))), Api::kOpenAi);
        }
      }
    }
    Submission submission;
    submission.id = id;
    submission.prompt = std::move(prompt);
    submission.max_new_tokens = a.params.max_new_tokens;
    submission.sampling = a.params.sampling;
    submission.outputs = a.params.outputs;
    submission.api = a.api == Api::kOpenAi ? RequestApi::kOpenAi : RequestApi::kTgi;
    submission.ignore_eos = a.params.ignore_eos;
    active.emplace(id, std::move(a));
    core->Submit(std::move(submission));
  }

  // POST /v1/completions and /v1/chat/completions (OpenAI): the body parsed by
  // RequestParser.
  void HandleOpenAi(evhttp_request* request, bool chat) {
    GenerationRequest parsed;
    const std::string body = Body(request);
    if (std::optional<HttpError> bad = chat ? parser->ParseChatCompletions(body, &parsed)
                                            : parser->ParseCompletions(body, &parsed)) {
      return Refuse(request, *bad);
    }
    std::vector<int32_t> prompt = std::move(parsed.prompt);
    Active a = ActiveOf(std::move(parsed));
    a.completion_id = absl::StrCat(chat ? "chatcmpl-" : "cmpl-", next_id);
    a.created = absl::ToUnixSeconds(absl::Now());
    Start(request, std::move(a), std::move(prompt));
  }

  // The model served, as OpenAI's model object.
  json ModelEntry() const {
    return {{"id", options.model_id}, {"object", "model"}, {"created", 0}, {"owned_by", "kvcm"}};
  }
  void HandleModels(evhttp_request* request) {
    Reply(request, 200, Dump({{"object", "list"}, {"data", json::array({ModelEntry()})}}));
  }
  // GET /v1/models/{model} (the official client's models.retrieve): the entry /v1/models
  // lists when {model} (percent-decoded, and it may hold a '/') is the model served, else
  // 404 in OpenAI's shape.
  void HandleModel(evhttp_request* request) {
    std::string id = PathOf(request).substr(std::strlen(kModelPrefix));
    size_t decoded_size = 0;
    if (char* decoded = evhttp_uridecode(id.c_str(), /*decode_plus=*/0, &decoded_size)) {
      id.assign(decoded, decoded_size);
      std::free(decoded);
    }
    if (id == options.model_id) return Reply(request, 200, Dump(ModelEntry()));
    ReplyError(request, {404,
                         absl::StrCat("the model `", Shortened(id), "` does not exist (this "
                                      "server serves `", options.model_id, "`)"),
                         "validation", "model", Api::kOpenAi});
  }

  static std::string OpenAiFinishReason(const std::string& tgi) {
    return tgi == "length" ? "length" : "stop";
  }

  json OpenAiUsage(const Active& a) const {
    size_t completion = 0;
    for (const Choice& c : a.choices) completion += c.generated.size();
    return {{"prompt_tokens", a.prompt_tokens},
            {"completion_tokens", completion},
            {"total_tokens", a.prompt_tokens + completion},
            {"prompt_tokens_details", {{"cached_tokens", a.cached_prompt_tokens}}}};
  }

  json OpenAiChunk(const Active& a, json choices) const {
    return {{"id", a.completion_id},
            {"object", !a.chat ? "text_completion"
                       : a.stream ? "chat.completion.chunk"
                                  : "chat.completion"},
            {"created", a.created},
            {"model", options.model_id},
            {"system_fingerprint", SystemFingerprint()},
            {"choices", std::move(choices)}};
  }
  // A choice: completions' {"text"}; chat's {"message"} in a reply and {"delta"} in a stream,
  // both {"role", "content"} (TGI's TextMessage requires both, in every delta).
  static json OpenAiChoice(const Active& a, size_t index, const std::string& text,
                           const json& finish_reason) {
    json choice = {{"index", index}, {"logprobs", nullptr}, {"finish_reason", finish_reason}};
    if (!a.chat) {
      choice["text"] = text;
    } else if (a.stream) {
      choice["delta"] = {{"role", "assistant"}, {"content", text}};
    } else {
      choice["message"] = {{"role", "assistant"}, {"content", text}};
    }
    return choice;
  }

  // Chat's logprobs of generated tokens [from, to): {"content": [{token, logprob, bytes,
  // top_logprobs: [{token, logprob, bytes}]}]}.
  json ChatLogprobs(const Choice& c, size_t from, size_t to) const {
    auto entry = [&](int32_t id, float logprob) {
      const std::string text = TokenText(id);
      json bytes = json::array();
      for (unsigned char b : text) bytes.push_back(b);
      return json({{"token", OpenAiTokenText(id, text)},
                   {"logprob", NumberLogprob(logprob)},
                   {"bytes", bytes}});
    };
    json content = json::array();
    for (size_t i = from; i < to && i < c.generated.size(); ++i) {
      json e = entry(c.generated[i], i < c.logprobs.size() ? c.logprobs[i] : 0.0f);
      json top = json::array();
      if (i < c.top.size()) {
        for (const auto& [id, logprob] : c.top[i]) top.push_back(entry(id, logprob));
      }
      e["top_logprobs"] = std::move(top);
      content.push_back(std::move(e));
    }
    return {{"content", content}};
  }

  static void OnClose(evhttp_connection* connection, void* arg) {
    auto* self = static_cast<Impl*>(arg);
    auto it = self->by_connection.find(connection);
    if (it == self->by_connection.end()) return;
    const uint64_t id = it->second;
    self->by_connection.erase(it);
    if (auto a = self->active.find(id); a != self->active.end()) {
      const Api api = a->second.api;
      // A request the client left before its reply was done is detached from its
      // connection (no connection any more) and is ours to free; any other is freed by
      // libevent with the connection.
      evhttp_request* request = a->second.request;
      if (request != nullptr && evhttp_request_get_connection(request) == nullptr) {
        evhttp_request_free(request);
      }
      self->active.erase(a);
      self->core->Cancel(id);
      self->Count(api, RequestOutcome::kCancelled);
      Log(absl::StrCat("request ", id, ": the client went away; cancelled"));
    }
  }

  std::string TokenText(int32_t id) const {
    const int32_t one[] = {id};
    absl::StatusOr<std::string> piece = tokenizer->Decode(one);
    return piece.ok() ? *piece : "";
  }
  bool Special(int32_t id) const { return tokenizer->IsSpecial(id); }
  // A log-probability as JSON: null when not computed (NaN), else finite (ShownLogprob:
  // -inf reads as kMinLogprob, the number the OpenAPI document promises).
  static json Logprob(float value) {
    return std::isnan(value) ? json(nullptr) : json(ShownLogprob(value));
  }
  // One where the OpenAPI document types a number, never null: chat's logprob and
  // top_logprobs, completions' top_logprobs maps. A NaN (an executor that sent one; kvcm's
  // sampler reads a NaN logit as -inf) is written as -inf is, kMinLogprob.
  static json NumberLogprob(float value) {
    return ShownLogprob(std::isnan(value) ? -std::numeric_limits<float>::infinity() : value);
  }

  // TGI's token object; `logprob` null when it was not asked for.
  json TgiToken(int32_t id, float logprob, const std::string& text) const {
    return {{"id", id}, {"text", text}, {"logprob", Logprob(logprob)}, {"special", Special(id)}};
  }
  json TgiTopTokens(const std::vector<std::pair<int32_t, float>>& top) const {
    json out = json::array();
    for (const auto& [id, logprob] : top) out.push_back(TgiToken(id, logprob, TokenText(id)));
    return out;
  }

  json Details(const Active& a, const Choice& c, bool with_prefill = true) const {
    constexpr float kNone = std::numeric_limits<float>::quiet_NaN();
    json tokens = json::array();
    for (size_t i = 0; i < c.generated.size(); ++i) {
      const int32_t id = c.generated[i];
      tokens.push_back(TgiToken(id, i < c.logprobs.size() ? c.logprobs[i] : kNone, TokenText(id)));
    }
    json prefill = json::array();
    if (with_prefill && a.params.outputs.prompt_logprobs) {
      for (size_t i = 0; i < a.prompt.size(); ++i) {
        const float logprob = i < a.prompt_logprobs.size() ? a.prompt_logprobs[i] : kNone;
        prefill.push_back({{"id", a.prompt[i]},
                           {"text", TokenText(a.prompt[i])},
                           {"logprob", Logprob(logprob)}});
      }
    }
    const size_t index = static_cast<size_t>(&c - a.choices.data());
    json details = {{"finish_reason", c.finish_reason},
                    {"generated_tokens", c.generated.size()},
                    {"seed", a.params.do_sample ? json(a.params.seed + index) : json(nullptr)},
                    {"prefill", prefill},
                    {"tokens", tokens}};
    if (a.params.outputs.top_n > 0) {
      json top = json::array();
      for (const auto& alternatives : c.top) top.push_back(TgiTopTokens(alternatives));
      details["top_tokens"] = top;
    }
    return details;
  }

  // OpenAI's completion logprobs: tokens, token_logprobs, top_logprobs, text_offset; the
  // echoed prompt's first (its first token unscored), then generated tokens [from, to).
  json OpenAiLogprobs(const Active& a, const Choice& c, bool with_prompt, size_t from,
                      size_t to, size_t offset) const {
    json tokens = json::array(), token_logprobs = json::array(), top = json::array(),
         offsets = json::array();
    auto add = [&](int32_t id, float logprob, const json& alternatives) {
      const std::string text = TokenText(id);
      tokens.push_back(OpenAiTokenText(id, text));
      token_logprobs.push_back(Logprob(logprob));
      top.push_back(alternatives);
      offsets.push_back(offset);
      offset += text.size();
    };
    if (with_prompt) {
      for (size_t i = 0; i < a.prompt.size(); ++i) {
        const float logprob = i < a.prompt_logprobs.size() ? a.prompt_logprobs[i]
                                                           : std::numeric_limits<float>::quiet_NaN();
        add(a.prompt[i], logprob,
            std::isnan(logprob)
                ? json(nullptr)
                : json({{OpenAiTokenText(a.prompt[i], TokenText(a.prompt[i])),
                         NumberLogprob(logprob)}}));
      }
    }
    for (size_t i = from; i < to && i < c.generated.size(); ++i) {
      json alternatives = json::object();
      if (i < c.top.size()) {
        for (const auto& [id, logprob] : c.top[i]) {
          alternatives[OpenAiTokenText(id, TokenText(id))] = NumberLogprob(logprob);
        }
      }
      add(c.generated[i], i < c.logprobs.size() ? c.logprobs[i] : 0.0f, alternatives);
    }
    return {{"tokens", tokens},
            {"token_logprobs", token_logprobs},
            {"top_logprobs", top},
            {"text_offset", offsets}};
  }

  std::string TextOf(const Choice& c) const {
    absl::StatusOr<std::string> decoded = tokenizer->Decode(c.generated);
    return decoded.ok() ? *decoded : "";
  }

  // The choices to return, in order: all of them, or with best_of the `shown` whose
  // generated tokens have the highest log-probability in all (TGI's and OpenAI's rule).
  static std::vector<size_t> Shown(const Active& a) {
    std::vector<size_t> order = InOrder(a);
    if (static_cast<int32_t>(order.size()) > a.shown) {
      order = BestFirst(a);
      order.resize(static_cast<size_t>(a.shown));
    }
    return order;
  }
  static std::vector<size_t> InOrder(const Active& a) {
    std::vector<size_t> order(a.choices.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    return order;
  }
  // Every choice, the highest total log-probability first (ties in choice order).
  static std::vector<size_t> BestFirst(const Active& a) {
    std::vector<size_t> order = InOrder(a);
    std::stable_sort(order.begin(), order.end(), [&](size_t x, size_t y) {
      return a.choices[x].sum_logprob > a.choices[y].sum_logprob;
    });
    return order;
  }

  // The request's reply once every choice is done (or it failed with `error`).
  void Finish(uint64_t id, Active& a, const absl::Status& error) {
    a.watch.reset();  // before the reply, which may close the socket
    if (a.request != nullptr) {
      by_connection.erase(a.connection);
      evhttp_connection_set_closecb(a.connection, nullptr, nullptr);
      if (!error.ok()) {
        const int status = absl::IsResourceExhausted(error) ? 422 : 503;
        const HttpError failure{status, std::string(error.message()),
                                status == 422 ? "validation" : "unavailable", "", a.api};
        if (a.stream) {
          SendEvent(a.request, Dump(ErrorBody(failure)), a.api);
          evhttp_send_reply_end(a.request);
        } else {
          ReplyError(a.request, failure);  // OpenAI's 400 for TGI's 422, as every refusal
        }
      } else if (a.stream) {
        if (a.api == Api::kOpenAi) {
          if (a.include_usage) {
            json usage = OpenAiChunk(a, json::array());
            usage["usage"] = OpenAiUsage(a);
            SendEvent(a.request, Dump(usage), Api::kOpenAi);
          }
          SendEvent(a.request, "[DONE]", Api::kOpenAi);
        }
        evhttp_send_reply_end(a.request);
      } else if (a.api == Api::kOpenAi) {
        json choices = json::array();
        const std::vector<size_t> shown = Shown(a);
        for (size_t k = 0; k < shown.size(); ++k) {
          const Choice& c = a.choices[shown[k]];
          std::string text = TextOf(c);
          // OpenAI's text stops before the stop sequence (TGI's keeps it).
          if (c.finish_reason == "stop_sequence") text.resize(std::min(c.stop_at, text.size()));
          json choice = OpenAiChoice(a, k,
                                     a.params.return_full_text ? a.prompt_text + text : text,
                                     OpenAiFinishReason(c.finish_reason));
          if (a.params.show_logprobs) {
            choice["logprobs"] =
                a.chat ? ChatLogprobs(c, 0, c.generated.size())
                       : OpenAiLogprobs(a, c, a.params.return_full_text, 0, c.generated.size(), 0);
          }
          choices.push_back(std::move(choice));
        }
        json body = OpenAiChunk(a, std::move(choices));
        body["usage"] = OpenAiUsage(a);
        Reply(a.request, 200, Dump(body));
      } else {
        const std::vector<size_t> order = BestFirst(a);
        const Choice& best = a.choices[order.front()];
        const std::string text = TextOf(best);
        json body = {{"generated_text", a.params.return_full_text ? a.prompt_text + text : text}};
        if (a.params.details) {
          body["details"] = Details(a, best);
          if (a.choices.size() > 1) {  // TGI's best_of: the others, best first
            json others = json::array();
            for (size_t k = 1; k < order.size(); ++k) {
              const Choice& c = a.choices[order[k]];
              json other = Details(a, c, /*with_prefill=*/false);
              const std::string other_text = TextOf(c);
              other["generated_text"] =
                  a.params.return_full_text ? a.prompt_text + other_text : other_text;
              others.push_back(std::move(other));
            }
            body["details"]["best_of_sequences"] = std::move(others);
          }
        }
        Reply(a.request, 200, Dump(a.as_list ? json::array({body}) : body));
      }
    }
    active.erase(id);
  }

  // Where a stop sequence ending in the text `piece` adds to what `c` said before starts,
  // counted in that text (c.text, then the piece); nullopt if none does. Only a match that
  // ends in the new text counts: every earlier token was looked at already. As vLLM does,
  // nothing is looked for while the request's first min_tokens tokens come out, and a
  // sequence those tokens spelled never counts later (docs/router.md, "ignore_eos and
  // min_tokens").
  static std::optional<size_t> StopSequenceSeen(const Active& a, const Choice& c,
                                                const IncrementalDecoder::Piece& piece) {
    if (a.params.stop.empty()) return std::nullopt;
    if (static_cast<int64_t>(c.generated.size()) <= a.params.sampling.min_tokens) {
      return std::nullopt;
    }
    size_t longest = 0;
    for (const std::string& sequence : a.params.stop) longest = std::max(longest, sequence.size());
    const size_t keep = std::min(c.text.size(), longest > 0 ? longest - 1 : 0);
    const std::string tail = c.text.substr(c.text.size() - keep) + piece.ready + piece.pending;
    std::optional<size_t> first;
    for (const std::string& sequence : a.params.stop) {
      // A match starting at `from` or later ends past `keep`, in the new text.
      const size_t from = keep - std::min(keep, sequence.size() - 1);
      const size_t at = tail.find(sequence, from);
      if (at != std::string::npos && (!first.has_value() || at < *first)) first = at;
    }
    if (!first.has_value()) return std::nullopt;
    return c.text.size() - keep + *first;
  }

  // One server-sent event: "data:" as TGI writes it, "data: " as OpenAI does.
  void SendEvent(evhttp_request* request, std::string_view data, Api api = Api::kTgi) {
    event_text.assign(api == Api::kOpenAi ? "data: " : "data:");
    event_text.append(data);
    event_text.append("\n\n");
    WriteEvent(request);
  }
  // A TGI token event, its JSON written straight into event_text (no DOM).
  void SendTgiEvent(evhttp_request* request, const TgiStreamEvent& event) {
    event_text.assign("data:");
    AppendTgiStreamEvent(event, &event_text);
    event_text.append("\n\n");
    WriteEvent(request);
  }
  // Sends event_text as one chunk of `request`'s reply.
  void WriteEvent(evhttp_request* request) {
    evbuffer_add(event_out, event_text.data(), event_text.size());
    evhttp_send_reply_chunk(request, event_out);  // moves the bytes to the connection
    // Whatever libevent did not take (no connection any more) must not go with the next.
    evbuffer_drain(event_out, evbuffer_get_length(event_out));
  }

  // Streams choice `index`'s newest token; `finished` with its finish reason.
  // `piece`: the text the token adds (never a broken UTF-8 sequence until the end: what is
  // incomplete waits for the next token).
  void Stream(Active& a, size_t index, const Progress& p, bool finished,
              const std::string& piece) {
    Choice& c = a.choices[index];
    if (a.api == Api::kOpenAi) {
      const bool first_chunk = c.generated.size() == 1;
      const std::string first = first_chunk && a.params.return_full_text ? a.prompt_text : "";
      json choice = OpenAiChoice(a, index, first + piece,
                                 finished ? json(OpenAiFinishReason(c.finish_reason))
                                          : json(nullptr));
      if (a.params.show_logprobs && a.chat) {
        choice["logprobs"] = ChatLogprobs(c, c.generated.size() - 1, c.generated.size());
      } else if (a.params.show_logprobs) {
        const size_t last = c.generated.size() - 1;
        const size_t offset = first_chunk ? 0
                                          : (a.params.return_full_text ? a.prompt_text.size() : 0) +
                                                c.text.size() - piece.size();
        choice["logprobs"] = OpenAiLogprobs(a, c, first_chunk && a.params.return_full_text,
                                            last, last + 1, offset);
      }
      SendEvent(a.request, Dump(OpenAiChunk(a, json::array({std::move(choice)}))), Api::kOpenAi);
      return;
    }
    // The bytes TgiToken and TgiTopTokens give, as Dump writes them (stream_events.h).
    TgiStreamEvent event;
    event.index = c.generated.size() - 1;
    event.token = {p.token, p.logprob, piece, Special(p.token)};
    std::vector<std::string> top_texts;
    std::vector<TgiStreamToken> top;
    if (a.params.outputs.top_n > 0) {
      event.with_top_tokens = true;
      for (const auto& alternative : c.top.back()) top_texts.push_back(TokenText(alternative.first));
      for (size_t i = 0; i < top_texts.size(); ++i) {
        const auto& [id, logprob] = c.top.back()[i];
        top.push_back({id, logprob, top_texts[i], Special(id)});
      }
      event.top_tokens = top;
    }
    TgiStreamEnd end;
    std::string all;
    if (finished) {
      all = TextOf(c);
      if (a.params.return_full_text) all = a.prompt_text + all;
      end.generated_text = all;
      end.finish_reason = c.finish_reason;
      end.generated_tokens = c.generated.size();
      end.input_length = a.prompt_tokens;
      if (a.params.do_sample) end.seed = a.params.seed;
      event.end = &end;
    }
    SendTgiEvent(a.request, event);
  }

  static void OnMail(evutil_socket_t, short, void* arg) {
    try {
      static_cast<Impl*>(arg)->DeliverMail();
    } catch (const std::exception& error) {
      Log(absl::StrCat("delivering tokens: ", error.what()));
    }
  }

  // Latencies of the tokens of one DeliverMail, observed after all its events are queued to
  // their connections rather than between them.
  std::vector<double> first_token_seconds;
  std::vector<double> token_gap_seconds;

  // Delivers the next slice of the tokens taken from the mailbox (taking them when the last
  // ones are done), and comes back for the rest after the loop's next poll. libevent writes
  // a connection's queued events only when its loop polls again: a step's 1,000 tokens
  // delivered in one callback reached no socket before the last was formatted, and each
  // token waited for the formatting of all. Sliced, the loop writes the first streams'
  // events while the later ones wait their turn. Returns whether tokens are left.
  bool DeliverSlice() {
    if (delivered == delivering.size()) {
      delivering.clear();
      delivered = 0;
      MutexLock lock(&mailbox_mutex);
      delivering.swap(mailbox);
    }
    const size_t end = std::min(delivering.size(), delivered + kDeliverySlice);
    DeliverProgress(std::span<const Progress>(delivering).subspan(delivered, end - delivered));
    delivered = end;
    if (metrics != nullptr) {
      for (double seconds : first_token_seconds) metrics->ObserveTimeToFirstToken(seconds);
      for (double seconds : token_gap_seconds) metrics->ObserveTimePerOutputToken(seconds);
    }
    first_token_seconds.clear();
    token_gap_seconds.clear();
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

  void DeliverProgress(std::span<const Progress> batch) {
    for (const Progress& p : batch) {
      auto it = active.find(p.id);
      if (it == active.end()) continue;
      Active& a = it->second;
      if (!p.error.ok()) {  // the whole request failed
        Done(p.id, a, p.error);
        continue;
      }
      if (p.choice < 0 || static_cast<size_t>(p.choice) >= a.choices.size()) continue;
      const auto index = static_cast<size_t>(p.choice);
      Choice& c = a.choices[index];
      if (c.done) continue;  // a token still in flight after a stop sequence
      bool finished = p.finished;
      if (p.token >= 0) {
        const absl::Time now = MonotonicNow();
        if (metrics != nullptr && index == 0) {
          (c.generated.empty() ? first_token_seconds : token_gap_seconds)
              .push_back(absl::ToDoubleSeconds(now - (c.generated.empty() ? a.arrived
                                                                           : a.last_token)));
        }
        if (index == 0) a.last_token = now;
        a.cached_prompt_tokens = p.cached_prompt_tokens;
        c.generated.push_back(p.token);
        c.sum_logprob += p.logprob;
        if (a.params.outputs.logprobs) c.logprobs.push_back(p.logprob);
        if (a.params.outputs.top_n > 0) {
          std::vector<std::pair<int32_t, float>>& top = c.top.emplace_back();
          for (size_t i = 0; i < p.top_ids.size() && i < p.top_logprobs.size(); ++i) {
            top.emplace_back(p.top_ids[i], p.top_logprobs[i]);
          }
        }
        if (!p.prompt_logprobs.empty()) a.prompt_logprobs = p.prompt_logprobs;
        c.finish_reason = p.finish_reason;
        IncrementalDecoder::Piece piece;
        if (a.stream || !a.params.stop.empty()) {
          absl::StatusOr<IncrementalDecoder::Piece> next = c.decoder.Next(*tokenizer, c.generated);
          if (next.ok()) piece = *std::move(next);
        }
        const std::optional<size_t> at =
            finished ? std::nullopt : StopSequenceSeen(a, c, piece);
        if (at.has_value()) {
          // Ends here: the text up to and including the stop sequence; the core frees the
          // sequence at its next step and any token it still reports is dropped.
          finished = true;
          c.stop_at = *at;
          c.finish_reason = "stop_sequence";
          core->Cancel(p.id, p.choice);
        }
        // At the end, what is still incomplete goes too.
        std::string added = finished ? piece.ready + piece.pending : piece.ready;
        c.text += added;
        if (a.stream && a.request != nullptr) Stream(a, index, p, finished, added);
      } else if (finished) {
        c.finish_reason = p.finish_reason;
      }
      if (!finished) continue;
      c.done = true;
      if (--a.open == 0) Done(p.id, a, absl::OkStatus());
    }
  }

  // The request is over: counted, timed, answered.
  void Done(uint64_t id, Active& a, const absl::Status& error) {
    if (metrics != nullptr) {
      metrics->ObserveRequestDuration(absl::ToDoubleSeconds(MonotonicNow() - a.arrived));
    }
    Count(a.api, error.ok() ? RequestOutcome::kOk : RequestOutcome::kUnavailable);
    Finish(id, a, error);
  }

  void HandleInfo(evhttp_request* request) {
    const json info = {{"model_id", options.model_id},
                       {"model_dtype", nullptr},
                       {"block_size", options.block_size},
                       {"num_blocks", options.num_blocks},
                       {"max_total_tokens_in_pool",
                        int64_t{options.block_size} * options.num_blocks},
                       {"max_batch_total_tokens", options.max_batch_total_tokens},
                       {"max_batch_prefill_tokens", options.max_batch_prefill_tokens},
                       {"max_input_tokens", options.max_input_tokens},
                       {"max_total_tokens", options.max_total_tokens},
                       {"max_concurrent_requests", options.max_concurrent_requests},
                       {"max_stop_sequences", 4},
                       {"max_top_n_tokens", options.max_top_n_tokens},
                       {"max_best_of", options.max_best_of},
                       {"validation_workers", kValidationWorkers},
                       {"max_client_batch_size", kMaxClientBatchSize},
                       {"executors", core->live_executors()},
                       {"router", "kvcm-router"},
                       {"version", kVersion}};
    Reply(request, 200, Dump(info));
  }

  void HandleTokenize(evhttp_request* request) {
    // The ids a prompt of this text is run with, BOS included: what the cache holds and the
    // KV events carry (a cluster router's query needs exactly those).
    std::vector<int32_t> ids;
    const std::string body = Body(request);
    if (std::optional<HttpError> bad = parser->ParseTokenize(body, &ids)) {
      return ReplyError(request, *bad);
    }
    // ParseTokenize read `inputs` from this body: a JSON object with a string there.
    const json root = json::parse(body, nullptr, /*allow_exceptions=*/false);
    const std::string inputs = root.is_object() && root.contains("inputs") &&
                                       root["inputs"].is_string()
                                   ? root["inputs"].get<std::string>()
                                   : std::string();
    const std::optional<std::vector<TokenSpan>> spans = TokenSpans(inputs, ids);
    json out = json::array();
    for (size_t i = 0; i < ids.size(); ++i) {
      const int32_t one[] = {ids[i]};
      absl::StatusOr<std::string> text = tokenizer->Decode(one);
      json token = {{"id", ids[i]}, {"text", text.ok() ? *text : ""}};
      if (spans.has_value()) {
        token["start"] = (*spans)[i].start;
        token["stop"] = (*spans)[i].stop;
      }
      out.push_back(std::move(token));
    }
    Reply(request, 200, Dump(out));
  }

  // The bytes of /tokenize's `inputs` an id stands for: TGI's SimpleToken start and stop
  // (docs/router.md, "HTTP API (TGI-compatible)").
  struct TokenSpan {
    size_t start = 0;
    size_t stop = 0;
  };
  // Each id's span of `input`, from the text the ids decode to, id by id: an id that holds
  // part of a character (byte-level BPE splits some) spans the whole character, as Hugging
  // Face's offsets do; the ids that decode to nothing span the text of `input` between
  // their neighbours' that spells them, one after the other (added tokens such as
  // <|im_start|>: Tokenizer::TokenId of that text is the id), the BOS that RequestParser
  // puts first nothing. nullopt when the ids' text does not spell `input` (a normalizer
  // changed it: lowercase, NFKC): offsets into `input` are then unknown, and /tokenize
  // leaves start and stop out rather than guess.
  std::optional<std::vector<TokenSpan>> TokenSpans(std::string_view input,
                                                   std::span<const int32_t> ids) const {
    std::vector<TokenSpan> spans(ids.size());
    // The character boundary at or before / at or after `at` (`input` is a JSON string's
    // bytes, so UTF-8).
    auto char_start = [&](size_t at) {
      while (at > 0 && at < input.size() &&
             (static_cast<unsigned char>(input[at]) & 0xC0) == 0x80) {
        --at;
      }
      return at;
    };
    auto char_end = [&](size_t at) {
      while (at < input.size() && (static_cast<unsigned char>(input[at]) & 0xC0) == 0x80) ++at;
      return at;
    };
    IncrementalDecoder decoder;
    size_t at = 0;    // bytes of `input` the decoder's whole text so far spells
    size_t held = 0;  // bytes after `at` the ids so far spell, not yet a whole character
    std::vector<size_t> silent;  // the ids since the last text, each decoded to nothing
    for (size_t i = 0; i < ids.size(); ++i) {
      absl::StatusOr<IncrementalDecoder::Piece> piece = decoder.Next(*tokenizer, ids.first(i + 1));
      if (!piece.ok()) return std::nullopt;
      // What the ids spell from `at` on: what was held, then this id's text.
      const std::string text = piece->ready + piece->pending;
      const size_t begin = at + held;
      if (begin == at + text.size()) {  // nothing: spelled by text to come, or none
        spans[i] = {begin, begin};
        if (held == 0) silent.push_back(i);
        continue;
      }
      if (input.substr(at, text.size()) != text) {
        // Text no id decodes to: the ids just before that decoded to nothing spell it.
        if (silent.empty() || held > 0) return std::nullopt;
        size_t found = input.find(text, at + 1);
        while (found != std::string_view::npos && found - at <= kMaxSpelling * silent.size() &&
               !SpellSilent(input, ids, silent, 0, at, found, &spans)) {
          found = input.find(text, found + 1);
        }
        if (found == std::string_view::npos || found - at > kMaxSpelling * silent.size()) {
          return std::nullopt;
        }
        at = found;
      }
      silent.clear();
      spans[i] = {char_start(at + held), char_end(at + text.size())};
      at += piece->ready.size();
      held = piece->pending.size();
    }
    if (at < input.size() && held == 0 &&
        SpellSilent(input, ids, silent, 0, at, input.size(), &spans)) {
      at = input.size();
    }
    if (at + held != input.size()) return std::nullopt;
    return spans;
  }
  // Whether the ids silent[j...] (which decode to nothing) spell input[from, to) one after
  // the other, each a text Tokenizer::TokenId names it by (of at most kMaxSpelling bytes),
  // but the BOS RequestParser puts first, which spells nothing; if so, sets their spans.
  static constexpr size_t kMaxSpelling = 256;
  bool SpellSilent(std::string_view input, std::span<const int32_t> ids,
                   const std::vector<size_t>& silent, size_t j, size_t from, size_t to,
                   std::vector<TokenSpan>* spans) const {
    if (j == silent.size()) return from == to;
    const size_t k = silent[j];
    if (k == 0 && tokenizer->add_bos() && ids[0] == tokenizer->bos_id() &&
        SpellSilent(input, ids, silent, j + 1, from, to, spans)) {
      (*spans)[k] = {from, from};
      return true;
    }
    for (size_t after = from + 1; after <= to && after - from <= kMaxSpelling; ++after) {
      if (tokenizer->TokenId(input.substr(from, after - from)) == ids[k] &&
          SpellSilent(input, ids, silent, j + 1, after, to, spans)) {
        (*spans)[k] = {from, after};
        return true;
      }
    }
    return false;
  }

  // The path of a request, without its query.
  static std::string PathOf(evhttp_request* request) {
    const char* uri = evhttp_request_get_uri(request);
    std::string path = uri == nullptr ? "/" : uri;
    if (const size_t q = path.find('?'); q != std::string::npos) path.resize(q);
    return path;
  }
  // The API whose error shape a path's errors have: OpenAI's under /v1/.
  static Api ApiOfPath(std::string_view path) {
    return path == "/v1" || path.starts_with("/v1/") ? Api::kOpenAi : Api::kTgi;
  }

  // Why a request's Host is refused, or nullopt (docs/router.md, "Browsers"): a page the
  // local user opens whose DNS name its owner rebinds to 127.0.0.1 reaches this port as its
  // own origin, and reads every reply, with its own name as the Host. 400 for an HTTP/1.1
  // request without Host, with several, or with one that is no host[:port] (RFC 9112); 403
  // for a host this server does not answer to. An absolute URI's host is checked as well.
  std::optional<HttpError> HostRefusal(evhttp_request* request) const {
    const evkeyvalq* headers = evhttp_request_get_input_headers(request);
    std::vector<std::string> values;
    for (const evkeyval* h = headers->tqh_first; h != nullptr; h = h->next.tqe_next) {
      if (evutil_ascii_strcasecmp(h->key, "Host") == 0) values.emplace_back(h->value);
    }
    if (values.size() > 1) return HttpError{400, "the request has more than one Host header"};
    if (values.empty() && (request->major > 1 || (request->major == 1 && request->minor >= 1))) {
      return HttpError{400, "an HTTP/1.1 request must have a Host header"};
    }
    if (const evhttp_uri* uri = evhttp_request_get_evhttp_uri(request); uri != nullptr) {
      if (const char* host = evhttp_uri_get_host(uri); host != nullptr && *host != '\0') {
        const std::string_view text = host;
        values.push_back(text.find(':') != std::string_view::npos && text.front() != '['
                             ? "[" + std::string(text) + "]"
                             : std::string(text));
      }
    }
    for (const std::string& value : values) {
      const std::optional<std::string> host = HostOfField(value);
      if (!host.has_value()) {
        return HttpError{400, absl::StrCat("the Host `", Shortened(value),
                                           "` is not a host name or IP literal, with or "
                                           "without a port")};
      }
      if (!HostAllowed(*host)) {
        return HttpError{403,
                         absl::StrCat("this server does not answer to the Host `",
                                      Shortened(*host),
                                      "` (a web page may name any); name it in --allowed-hosts "
                                      "to serve it"),
                         "forbidden"};
      }
    }
    return std::nullopt;
  }
  bool HostAllowed(const std::string& host) const {
    if (any_host) return true;
    const std::string address = AddressBytes(host);
    if (!address.empty()) {
      return any_ip_literal || std::find(host_addresses.begin(), host_addresses.end(),
                                         address) != host_addresses.end();
    }
    return std::find(host_names.begin(), host_names.end(), HostKey(host)) != host_names.end();
  }
  // The Host rules of `options` (host, allowed_hosts).
  void SetHostRules() {
    host_names = {"localhost"};
    host_addresses = {AddressBytes("127.0.0.1"), AddressBytes("::1")};
    const std::string listen = HostKey(options.host.starts_with('[') && options.host.ends_with(']')
                                           ? options.host.substr(1, options.host.size() - 2)
                                           : options.host);
    const std::string listen_address = AddressBytes(listen);
    // 0.0.0.0 or ::, every address of the machine: any of them may be the Host.
    any_ip_literal = !listen_address.empty() &&
                     listen_address.find_first_not_of('\0') == std::string::npos;
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

  // Why a POST's body is refused for its Content-Type, or nullopt: each Content-Type must be
  // application/json, parameters (charset) allowed, the type in any case. A page of any
  // origin may POST text/plain, a form or multipart to this port without asking first (a
  // CORS "simple request"); application/json needs the browser's preflight, which this
  // server never grants (docs/router.md, "Browsers").
  static std::optional<HttpError> ContentTypeRefusal(evhttp_request* request) {
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
      return HttpError{415, "the body must be sent as Content-Type: application/json (the "
                            "request names no Content-Type)"};
    }
    return std::nullopt;
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
        return ReplyError(request, {refusal.status, refusal.message, "validation", "",
                                    ApiOfPath(refusal.path)});
      }
    }
    try {
      Route(request, static_cast<Impl*>(arg));
    } catch (const std::exception& error) {  // a bug here must not take the server down
      Log(absl::StrCat("handling ", evhttp_request_get_uri(request), ": ", error.what()));
      ReplyError(request, {500, "internal error", "internal"});
    }
  }

  // A route: its path, the one method it answers, the API whose error shape its errors have
  // and whether its refusals are counted as requests (the generation routes').
  struct RouteEntry {
    const char* path;
    const char* method;  // "GET" or "POST"
    Api api;
    bool generation;
    void (*handle)(Impl* self, evhttp_request* request);
  };
  // Every route the server answers, matched on the path without its query: the table
  // HttpFrontend::Routes() lists and GET /openapi.json documents (docs/router.md, "OpenAPI
  // document"). A known path asked with another method gets 405 and an Allow header; an
  // unknown one 404.
  static const RouteEntry kRoutes[];

  static const char* MethodName(evhttp_cmd_type command) {
    switch (command) {
      case EVHTTP_REQ_GET: return "GET";
      case EVHTTP_REQ_POST: return "POST";
      case EVHTTP_REQ_HEAD: return "HEAD";
      case EVHTTP_REQ_PUT: return "PUT";
      case EVHTTP_REQ_DELETE: return "DELETE";
      case EVHTTP_REQ_OPTIONS: return "OPTIONS";
      case EVHTTP_REQ_TRACE: return "TRACE";
      case EVHTTP_REQ_CONNECT: return "CONNECT";
      case EVHTTP_REQ_PATCH: return "PATCH";
    }
    return "";
  }

  static void Route(evhttp_request* request, Impl* self);
  static bool Matches(std::string_view route, std::string_view path);
  static constexpr char kModelPrefix[] = "/v1/models/";

  void HandleMetrics(evhttp_request* request) {
    if (metrics == nullptr) return ReplyError(request, {404, "no metrics", "validation"});
    const std::string text = prometheus::TextSerializer().Serialize(metrics->registry()->Collect());
    Reply(request, 200, text, "text/plain; version=0.0.4");
  }

  // /dashboard (the page) and /dashboard/state (the JSON it polls).
  void HandleDashboard(evhttp_request* request, bool state) {
    if (options.dashboard == nullptr) {
      return ReplyError(request, {404, "no dashboard", "validation"});
    }
    evkeyvalq* headers = evhttp_request_get_output_headers(request);
    evhttp_add_header(headers, "Cache-Control", "no-store");
    evhttp_add_header(headers, "X-Content-Type-Options", "nosniff");
    if (state) return Reply(request, 200, options.dashboard->StateJson());
    // The page fetches nothing but its state, from this server: the browser enforces it.
    evhttp_add_header(headers, "Content-Security-Policy",
                      "default-src 'none'; script-src 'unsafe-inline'; "
                      "style-src 'unsafe-inline'; connect-src 'self'; img-src data:");
    Reply(request, 200, std::string(Dashboard::Page()), "text/html; charset=utf-8");
  }

  void HandleHealth(evhttp_request* request) {
    // No body, and so no Content-Type (an empty body is no JSON).
    if (core->live_executors() > 0) return Reply(request, 200, "", nullptr);
    ReplyError(request, {503, "no executor is registered", "unavailable"});
  }

  void HandleOpenApi(evhttp_request* request) { Reply(request, 200, openapi); }

  static void OnStop(evutil_socket_t, short, void* arg) {
    auto* impl = static_cast<Impl*>(arg);
    try {
      while (impl->DeliverSlice()) {  // every token handed over before Stop
      }
    } catch (const std::exception& error) {
      Log(absl::StrCat("delivering tokens: ", error.what()));
    }
    event_base_loopexit(impl->base, nullptr);
  }
};

const HttpFrontend::Impl::RouteEntry HttpFrontend::Impl::kRoutes[] = {
    {"/generate", "POST", Api::kTgi, true,
     [](Impl* self, evhttp_request* r) { self->HandleGenerate(r, false); }},
    {"/generate_stream", "POST", Api::kTgi, true,
     [](Impl* self, evhttp_request* r) { self->HandleGenerate(r, true); }},
    {"/", "POST", Api::kTgi, true,
     [](Impl* self, evhttp_request* r) { self->HandleGenerate(r, std::nullopt); }},
    {"/tokenize", "POST", Api::kTgi, false,
     [](Impl* self, evhttp_request* r) { self->HandleTokenize(r); }},
    {"/v1/completions", "POST", Api::kOpenAi, true,
     [](Impl* self, evhttp_request* r) { self->HandleOpenAi(r, false); }},
    {"/v1/chat/completions", "POST", Api::kOpenAi, true,
     [](Impl* self, evhttp_request* r) { self->HandleOpenAi(r, true); }},
    {"/v1/models", "GET", Api::kOpenAi, false,
     [](Impl* self, evhttp_request* r) { self->HandleModels(r); }},
    {"/v1/models/{model}", "GET", Api::kOpenAi, false,
     [](Impl* self, evhttp_request* r) { self->HandleModel(r); }},
    {"/info", "GET", Api::kTgi, false, [](Impl* self, evhttp_request* r) { self->HandleInfo(r); }},
    {"/metrics", "GET", Api::kTgi, false,
     [](Impl* self, evhttp_request* r) { self->HandleMetrics(r); }},
    {"/dashboard", "GET", Api::kTgi, false,
     [](Impl* self, evhttp_request* r) { self->HandleDashboard(r, false); }},
    {"/dashboard/state", "GET", Api::kTgi, false,
     [](Impl* self, evhttp_request* r) { self->HandleDashboard(r, true); }},
    {"/health", "GET", Api::kTgi, false,
     [](Impl* self, evhttp_request* r) { self->HandleHealth(r); }},
    {"/openapi.json", "GET", Api::kTgi, false,
     [](Impl* self, evhttp_request* r) { self->HandleOpenApi(r); }},
};

// Whether `path` is `route`'s: the same, or for a route ending in a parameter ("{model}"),
// the same up to it and then at least one byte (a parameter may hold '/': a model id may).
bool HttpFrontend::Impl::Matches(std::string_view route, std::string_view path) {
  const size_t parameter = route.find('{');
  if (parameter == std::string_view::npos) return path == route;
  return path.size() > parameter && path.substr(0, parameter) == route.substr(0, parameter);
}

void HttpFrontend::Impl::Route(evhttp_request* request, Impl* self) {
  const std::string path = PathOf(request);
  // Every route, /health and /metrics included: a rebound page must read none of them.
  if (std::optional<HttpError> refused = self->HostRefusal(request)) {
    refused->api = ApiOfPath(path);
    return ReplyError(request, *refused);
  }
  for (const RouteEntry& route : kRoutes) {
    if (!Matches(route.path, path)) continue;
    if (std::strcmp(MethodName(evhttp_request_get_command(request)), route.method) != 0) {
      evhttp_add_header(evhttp_request_get_output_headers(request), "Allow", route.method);
      const HttpError error{405, absl::StrCat("use ", route.method), "validation", "",
                            route.api};
      return route.generation ? self->Refuse(request, error) : ReplyError(request, error);
    }
    if (std::strcmp(route.method, "POST") == 0) {
      if (std::optional<HttpError> refused = ContentTypeRefusal(request)) {
        refused->api = route.api;
        return route.generation ? self->Refuse(request, *refused)
                                : ReplyError(request, *refused);
      }
    }
    return route.handle(self, request);
  }
  // Under /v1/ in OpenAI's shape (its clients read error.message); the path shortened.
  ReplyError(request, {404, absl::StrCat("no route ", Shortened(path)), "validation", "",
                       ApiOfPath(path)});
}

std::vector<HttpRoute> HttpFrontend::Routes() {
  std::vector<HttpRoute> routes;
  for (const Impl::RouteEntry& route : Impl::kRoutes) routes.push_back({route.path, route.method});
  return routes;
}

std::string HttpFrontend::OpenApiDocument(const Options& options) {
  json document = json::parse(
      std::string_view(reinterpret_cast<const char*>(kvcm_openapi_json), kvcm_openapi_json_size));
  document["info"]["version"] = kVersion;
  // A bound that is a flag of the router's is named by "x-kvcm-maximum" where it applies.
  const std::pair<std::string_view, int64_t> limits[] = {
      {"max_total_tokens", options.max_total_tokens},
      {"max_input_tokens", options.max_input_tokens},
      {"max_top_n_tokens", options.max_top_n_tokens},
      {"max_best_of", options.max_best_of},
  };
  std::vector<json*> pending = {&document};
  while (!pending.empty()) {
    json* node = pending.back();
    pending.pop_back();
    if (node->is_object() && node->contains("x-kvcm-maximum")) {
      const json& name = (*node)["x-kvcm-maximum"];
      for (const auto& [flag, value] : limits) {
        if (name.is_string() && name.get<std::string>() == flag) (*node)["maximum"] = value;
      }
    }
    if (node->is_structured()) {
      for (json& child : *node) pending.push_back(&child);
    }
  }
  return document.dump(1);
}

absl::StatusOr<std::unique_ptr<HttpFrontend>> HttpFrontend::Start(const Options& options,
                                                                  const Tokenizer* tokenizer,
                                                                  RouterCore* core,
                                                                  RouterMetrics* metrics) {
  static std::once_flag threads;
  std::call_once(threads, [] { evthread_use_pthreads(); });
  std::unique_ptr<HttpFrontend> frontend(new HttpFrontend());
  frontend->impl_ = std::make_unique<Impl>();
  Impl& impl = *frontend->impl_;
  impl.options = options;
  impl.tokenizer = tokenizer;
  RequestLimits limits;
  limits.max_input_tokens = options.max_input_tokens;
  limits.max_total_tokens = options.max_total_tokens;
  limits.default_max_new_tokens = options.default_max_new_tokens;
  limits.max_top_n_tokens = options.max_top_n_tokens;
  limits.max_best_of = options.max_best_of;
  limits.chat_template = options.chat_template;
  limits.bos_token = options.bos_token;
  limits.eos_token = options.eos_token;
  impl.parser = std::make_unique<RequestParser>(std::move(limits), tokenizer);
  impl.openapi = OpenApiDocument(options);
  impl.SetHostRules();
  impl.core = core;
  impl.metrics = metrics;
  impl.base = event_base_new();
  if (impl.base == nullptr) return absl::InternalError("event_base_new failed");
  impl.http = evhttp_new(impl.base);
  evhttp_set_max_body_size(impl.http, static_cast<ev_ssize_t>(options.max_body_bytes));
  // The framing (Connection::Frame) refuses heads and bodies over the limits first, in the
  // route's shape; libevent's own limits stay as a backstop (its head count differs: 2x).
  evhttp_set_max_headers_size(impl.http, static_cast<ev_ssize_t>(2 * options.max_header_bytes));
  evhttp_set_timeout(impl.http, options.timeout_seconds);
  evhttp_set_bevcb(impl.http, &Impl::NewConnection, &impl);
  // Every method reaches Route(), which answers one a route does not take with 405.
  evhttp_set_allowed_methods(impl.http, EVHTTP_REQ_GET | EVHTTP_REQ_POST | EVHTTP_REQ_HEAD |
                                            EVHTTP_REQ_PUT | EVHTTP_REQ_DELETE |
                                            EVHTTP_REQ_OPTIONS | EVHTTP_REQ_TRACE |
                                            EVHTTP_REQ_CONNECT | EVHTTP_REQ_PATCH);
  evhttp_set_gencb(impl.http, &Impl::OnRequest, &impl);
  // Every reply with a body names its type; libevent's default ("text/html;
  // charset=ISO-8859-1") went on /health's empty 200, which has none.
  evhttp_set_default_content_type(impl.http, nullptr);
  evhttp_bound_socket* bound = evhttp_bind_socket_with_handle(
      impl.http, options.host.c_str(), static_cast<ev_uint16_t>(options.port));
  if (bound == nullptr) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", options.host, ":",
                                               options.port, ": ", std::strerror(errno)));
  }
  sockaddr_storage address{};
  socklen_t length = sizeof(address);
  ::getsockname(evhttp_bound_socket_get_fd(bound), reinterpret_cast<sockaddr*>(&address),
                &length);
  frontend->port_ = address.ss_family == AF_INET6
                        ? ntohs(reinterpret_cast<sockaddr_in6*>(&address)->sin6_port)
                        : ntohs(reinterpret_cast<sockaddr_in*>(&address)->sin_port);
  impl.listener = evhttp_bound_socket_get_listener(bound);
  impl.shed = event_new(impl.base, evhttp_bound_socket_get_fd(bound), EV_READ | EV_PERSIST,
                        &Impl::OnShed, &impl);
  impl.fd_dir.reset(::open("/proc/self/fd", O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  impl.mail = event_new(impl.base, -1, 0, &Impl::OnMail, &impl);
  impl.deliver_more = evtimer_new(impl.base, &Impl::OnMail, &impl);
  impl.event_out = evbuffer_new();
  impl.event_text.reserve(4096);
  impl.stop = event_new(impl.base, -1, 0, &Impl::OnStop, &impl);
  frontend->thread_ = std::thread([base = impl.base] { event_base_dispatch(base); });
  return frontend;
}

void HttpFrontend::Deliver(std::vector<Progress> progress) {
  {
    MutexLock lock(&impl_->mailbox_mutex);
    if (impl_->mailbox.empty()) {
      impl_->mailbox.swap(progress);  // a step's tokens, handed over whole
    } else {
      impl_->mailbox.insert(impl_->mailbox.end(), std::make_move_iterator(progress.begin()),
                            std::make_move_iterator(progress.end()));
    }
  }
  event_active(impl_->mail, 0, 0);
}

void HttpFrontend::Stop() {
  if (!thread_.joinable()) return;
  event_active(impl_->stop, 0, 0);
  thread_.join();
}

HttpFrontend::~HttpFrontend() { Stop(); }

}  // namespace kvcm::router
